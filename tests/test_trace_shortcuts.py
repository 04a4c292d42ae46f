"""The recorder's shortcuts (xmem.trace.shortcuts) give what FakeTensorMode gives, only faster: the same fake results
in-process, the same trace event for event end to end (XMEM_TRACE_SHORTCUTS=0 turns them off), and they decline
every call whose validity they cannot see at a glance, so that the real op's own checks still run."""

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from test_trace_scripts import trace
from xmem.trace import shortcuts

aten = torch.ops.aten


class ForeachSpy(TorchDispatchMode):
    """Above the fake mode, as the recorder is: notes whether each foreach op would be taken by the shortcut."""

    def __init__(self):
        super().__init__()
        self.taken = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._opname.startswith("_foreach_"):
            self.taken.append((func._opname, shortcuts.foreach(func, func._opname, args, kwargs)
                               is not shortcuts.NOT_TAKEN))
        return func(*args, **kwargs)


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def tensors(*shapes, dtype=torch.float32):
    return [torch.empty(shape, dtype=dtype) for shape in shapes]


def test_in_place_foreach_is_taken_and_changes_nothing(fake):
    params, grads = tensors((4, 3), (5,)), tensors((4, 3), (5,))
    before = [(p.shape, p.stride(), p.dtype, p.untyped_storage()._cdata) for p in params]
    for func, args, kwargs in [
        (aten._foreach_add_.List, (params, grads), {"alpha": 0.5}),
        (aten._foreach_mul_.Scalar, (params, 0.9), {}),
        (aten._foreach_addcdiv_.ScalarList, (params, grads, grads, [0.1, 0.2]), {}),
        (aten._foreach_lerp_.Scalar, (params, grads, 0.1), {}),
        (aten._foreach_zero_.default, (params,), {}),
    ]:
        assert shortcuts.foreach(func, func._opname, args, kwargs) is None
    assert [(p.shape, p.stride(), p.dtype, p.untyped_storage()._cdata) for p in params] == before


def test_out_of_place_foreach_gives_what_the_fake_mode_gives(fake):
    inputs = tensors((4, 3), (7,), (2, 2, 2)) + [torch.empty(6, 4).t()]  # a transposed view keeps its layout
    for func, args in [(aten._foreach_sqrt.default, (inputs,)), (aten._foreach_add.Scalar, (inputs, 1e-8)),
                       (aten._foreach_mul.List, (inputs, [torch.empty_like(t) for t in inputs]))]:
        taken = shortcuts.foreach(func, func._opname, args, {})
        normal = func(*args)
        assert [(t.shape, t.stride(), t.dtype, t.device) for t in taken] == \
               [(t.shape, t.stride(), t.dtype, t.device) for t in normal]
        assert not {t.untyped_storage()._cdata for t in taken} & {t.untyped_storage()._cdata for t in inputs}


@pytest.mark.parametrize("case", ["shapes differ", "lengths differ", "integer tensors", "complex scalar",
                                  "one tensor operand", "dtypes differ", "a reduction", "an out= variant",
                                  "another fake mode"])
def test_declines_what_it_cannot_vouch_for(fake, case):
    a, b = tensors((4, 3), (5,)), tensors((4, 3), (5,))
    with FakeTensorMode():
        elsewhere = tensors((4, 3), (5,))
    func, args, kwargs = {
        "shapes differ": (aten._foreach_add_.List, (a, tensors((4, 3), (1,))), {}),
        "lengths differ": (aten._foreach_add_.List, (a, b[:1]), {}),
        "integer tensors": (aten._foreach_add_.Scalar, (tensors((3,), dtype=torch.int64), 1), {}),
        "complex scalar": (aten._foreach_mul_.Scalar, (a, 1j), {}),
        "one tensor operand": (aten._foreach_mul_.Tensor, (a, torch.empty(())), {}),
        "dtypes differ": (aten._foreach_add_.List, (a, tensors((4, 3), (5,), dtype=torch.float16)), {}),
        "a reduction": (aten._foreach_norm.Scalar, (a, 2), {}),
        "an out= variant": (aten._foreach_add.List_out, (a, b), {"out": tensors((4, 3), (5,))}),
        "another fake mode": (aten._foreach_mul_.Scalar, (elsewhere, 0.5), {}),
    }[case]
    assert shortcuts.foreach(func, func._opname, args, kwargs) is shortcuts.NOT_TAKEN


def test_an_adamw_step_on_fake_tensors_takes_every_foreach_op_but_the_step_counters(fake):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    spy = ForeachSpy()
    with spy:
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
    declined = [name for name, taken in spy.taken if not taken]
    assert len(spy.taken) == 18 and declined == ["_foreach_add_", "_foreach_add_"]  # steps: lifted constants


def test_device_query_is_the_fake_device_outside_a_kernel(fake):
    tensor = torch.empty(3)
    assert shortcuts.device_of(torch.ops.prim.device.default, (tensor,)) == torch.device("cpu")
    assert shortcuts.device_of(aten.add.Tensor, (tensor,)) is shortcuts.NOT_TAKEN
    fake.in_kernel_invocation = True
    try:
        assert shortcuts.device_of(torch.ops.prim.device.default, (tensor,)) is shortcuts.NOT_TAKEN
    finally:
        fake.in_kernel_invocation = False


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "NAdam", "RMSprop"])
def test_a_trace_is_the_same_event_for_event_without_the_shortcuts(optimizer, monkeypatch):
    args = ("--optimizer", optimizer, "--dtype", "bfloat16" if optimizer == "NAdam" else "float32")
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "1")
    fast = trace(sys.executable, "optimizer_loop.py", *args, iterations=3)
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "0")
    slow = trace(sys.executable, "optimizer_loop.py", *args, iterations=3)
    assert fast.iterations == slow.iterations == 3
    assert fast.events == slow.events
    assert {op: n for op, n in slow.op_counts.items() if op != "device"} == fast.op_counts
