"""The recorder's shortcuts (xmem.trace.child.shortcuts) give what FakeTensorMode gives, only faster: the same fake results
in-process, the same trace event for event end to end (XMEM_TRACE_SHORTCUTS=0 turns them off), and they decline
every call whose validity they cannot see at a glance, so that the real op's own checks still run."""

import sys
import warnings

import pytest
import torch
import torch._functorch.config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trace.child.test_scripts import trace
from xmem.trace.child import shortcuts

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


def canonical(events):
    """The events with each run of consecutive frees in block order: where several storages die at once their order
    is a hash map's (autocast's cast cache, cleared as the region ends, is keyed by address) and differs from run to
    run of the same program; what dies at each point does not."""
    result, frees = [], []
    for event in events:
        if event.action == "free":
            frees.append(event)
            continue
        result += sorted(frees, key=lambda e: e.block) + [event]
        frees = []
    return result + sorted(frees, key=lambda e: e.block)


@pytest.mark.parametrize("script, args", [
    ("optimizer_loop.py", ("--optimizer", "AdamW", "--dtype", "float32")),
    ("optimizer_loop.py", ("--optimizer", "SGD", "--dtype", "float32")),
    ("optimizer_loop.py", ("--optimizer", "NAdam", "--dtype", "bfloat16")),
    ("optimizer_loop.py", ("--optimizer", "RMSprop", "--dtype", "float32")),
    ("layer_caches.py", ()),  # empty GPU tensors made directly; bf16 autocast, SDPA, views, in-place ops
    ("cnn_bn_sgd.py", ()),  # convolutions, batch norm (never cached upstream), pooling
    # rollouts under no_grad before learning starts: `.item()` of each step's action (a data-dependent op), values
    # known from the weights, tiny storages made and freed every step
    ("rl_rollouts.py", ("--learning-starts", "70", "--steps", "90")),
], ids=["AdamW", "SGD", "NAdam-bf16", "RMSprop", "layer-caches", "cnn-bn", "rl-rollouts"])
def test_a_trace_is_the_same_event_for_event_without_the_shortcuts(script, args, monkeypatch):
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "1")
    fast = trace(sys.executable, script, *args, iterations=3)
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "0")
    slow = trace(sys.executable, script, *args, iterations=3)
    assert fast.iterations == slow.iterations == 3
    assert canonical(fast.events) == canonical(slow.events)
    # the same ops but where a shortcut answers: `.device` queries, and an empty GPU tensor made directly
    # (`empty`) instead of copied from the host (`_to_copy`)
    replaced = {"device", "_to_copy", "empty"}
    assert {op: n for op, n in slow.op_counts.items() if op not in replaced} == \
           {op: n for op, n in fast.op_counts.items() if op not in replaced}
    made_directly = fast.op_counts.get("empty", 0) - slow.op_counts.get("empty", 0)
    assert slow.op_counts.get("_to_copy", 0) - fast.op_counts.get("_to_copy", 0) == made_directly
    assert made_directly == (20 if script == "layer_caches.py" else 0)  # 2 per layer and step, 2 at the start


# ---- the quick key in front of FakeTensorMode's cache ---------------------------------------------------------------

def metadata(value):
    """What a fake result is, for comparing two: per tensor its shape, stride, offset, dtype, device, requires_grad,
    and which input (if any) it is or shares storage with."""
    if isinstance(value, (tuple, list)):
        return type(value), [metadata(v) for v in value]
    if not isinstance(value, torch.Tensor):
        return value
    return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device,
            value.requires_grad, value.is_inference(), python_state(value), data_pointer_guarded(value))


def python_state(fake):
    """A FakeTensor's Python attributes, its mode's by type (each mode is its own object)."""
    return sorted((name, type(v).__name__ if name == "fake_mode" else v) for name, v in vars(fake).items())


def data_pointer_guarded(fake):
    """Whether reading the data pointer raises (FakeTensor() arms it; the test's modes are made to raise, not warn
    once per process)."""
    try:
        fake.data_ptr()
    except RuntimeError:
        return True
    return False


def aliases(out, inputs):
    """Which inputs the result is, and which it shares storage with (a view's, an in-place op's)."""
    outs = [o for o in (out if isinstance(out, tuple) else [out]) if isinstance(o, torch.Tensor)]
    storage = {name: t.untyped_storage()._cdata for name, t in inputs.items()}
    return ([name for name, t in inputs.items() if out is t],
            [name for name in inputs for o in outs if o.untyped_storage()._cdata == storage[name]])


def calls(x, w, ints):
    """Calls a training step makes, with the cases a key must tell apart: a scalar's type (1 vs 1.0 on an integer
    tensor), kwargs, tuple results, views, in-place ops, factories that read the default dtype."""
    return [
        ("add", lambda: torch.add(x, x)), ("add scalar", lambda: torch.add(x, 2.0, alpha=0.5)),
        ("int + int", lambda: ints + 1), ("int + float", lambda: ints + 1.0),
        ("mm", lambda: x @ w), ("layer norm (3 results)", lambda: aten.native_layer_norm(x, [8], w[0], w[0], 1e-5)),
        ("softmax", lambda: torch.softmax(x, dim=-1)), ("sum dims", lambda: x.sum(dim=(0,), keepdim=True)),
        ("view", lambda: x.view(-1)), ("transpose", lambda: x.t()), ("expand", lambda: w[0].expand(4, 8)),
        ("slice", lambda: x[1:3]), ("in place", lambda: x.mul_(1.0)), ("full", lambda: torch.full((3,), 1.5)),
        ("zeros like", lambda: torch.zeros_like(x, dtype=torch.bfloat16)),
    ]


def test_the_quick_key_gives_what_the_fake_mode_gives():
    """Each call twice in each mode: the second is a cache hit, by the quick key or by upstream's own."""
    results = {}
    for name, make_mode in [("plain", FakeTensorMode), ("quick", shortcuts.fake_mode)]:
        with torch._functorch.config.patch(fake_tensor_allow_unsafe_data_ptr_access=False), make_mode() as mode:
            x, w, ints = torch.empty(4, 8), torch.empty(8, 8), torch.empty(5, dtype=torch.int64)
            inputs = {"x": x, "w": w, "ints": ints}
            for label, call in calls(x, w, ints):
                for attempt in range(2):
                    out = call()
                    results[(name, label, attempt)] = (metadata(out), aliases(out, inputs))
    assert type(mode) is FakeTensorMode  # by its type, higher-order ops find their fake rule
    assert mode._cached_dispatch_impl.__self__.hits >= len(calls(x, w, ints))  # every second call at least
    for (name, label, attempt), result in results.items():
        if name == "quick":
            assert result == results[("plain", label, attempt)], label
    assert results[("quick", "int + float", 1)][0][3] == torch.float32  # not the int result a key without types gives


def test_the_quick_key_keeps_upstreams_cache_and_its_counts():
    """A call first seen goes through upstream's cache steps restated (the key computed once): the same entries,
    negative ones included (batch norm in training is never cached), and the same hit, miss and bypass counts."""
    counts, entries = {}, {}
    for name, make_mode in [("plain", FakeTensorMode), ("quick", shortcuts.fake_mode)]:
        FakeTensorMode.cache_clear()
        with make_mode():
            x, w, ints = torch.empty(4, 8), torch.empty(8, 8), torch.empty(5, dtype=torch.int64)
            mean, var = torch.zeros(8), torch.ones(8)
            batch_norm = ("batch norm", lambda: aten.native_batch_norm(x, w[0], w[0], mean, var, True, 0.1, 1e-5))
            for _, call in [*calls(x, w, ints), batch_norm] * 2:
                call()
        info = FakeTensorMode.cache_info()
        counts[name] = (info.hits, info.misses, dict(info.bypasses), info.size)
        entries[name] = sorted(type(entry).__name__ for entry in FakeTensorMode.cache.values())
    FakeTensorMode.cache_clear()
    assert counts["quick"] == counts["plain"] and entries["quick"] == entries["plain"]
    assert counts["plain"][2], "no call was a bypass: the case is not covered"


def test_a_host_tensor_copied_to_the_gpu_gives_what_the_fake_mode_gives():
    """`_to_copy` of a real host tensor (model.to, every batch): upstream caches none; the quick key keys the host
    tensor's metadata and takes upstream's first result as the recipe. A one-element tensor (a constant upstream
    may memoise) always goes upstream."""
    host = {"matrix": torch.empty(4, 3), "transposed weight": torch.nn.Parameter(torch.empty(6, 2).t()),
            "scalar": torch.tensor(2.0)}
    copies = [("to gpu", lambda t: t.to("cuda:0")), ("to gpu in bf16", lambda t: t.to("cuda:0", torch.bfloat16)),
              ("dtype only", lambda t: t.to(torch.float64)), ("cuda(0)", lambda t: t.cuda(0))]
    results = {}
    for name, make_mode in [("plain", FakeTensorMode), ("quick", shortcuts.fake_mode)]:
        with torch._functorch.config.patch(fake_tensor_allow_unsafe_data_ptr_access=False), \
                make_mode(allow_non_fake_inputs=True) as mode:
            for tensor_name, tensor in host.items():
                for label, copy in copies:
                    for attempt in range(2):
                        out = copy(tensor)
                        results[(name, tensor_name, label, attempt)] = \
                            (metadata(out), out.constant is None, out.untyped_storage().nbytes())
    quick = mode._cached_dispatch_impl.__self__
    host_keys = [key for key in quick.known if key[0] is aten._to_copy.default and key[5][0] == "host"]
    assert len(host_keys) >= len(copies) and all(type(quick.known[key]) is tuple for key in host_keys)
    assert all(key[5][2] != torch.Size([]) for key in host_keys)  # the one-element tensor was never keyed
    for (name, *call), result in results.items():
        if name == "quick":
            assert result == results[("plain", *call)], call


def test_the_quick_key_follows_the_global_state_the_upstream_key_reads():
    with shortcuts.fake_mode():
        x = torch.empty(3, 3)
        assert torch.full((2,), 1.5).dtype == torch.float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert torch.full((2,), 1.5).dtype == torch.float64
        finally:
            torch.set_default_dtype(previous)
        assert not (x + x).is_inference()
        with torch.inference_mode():
            assert (x + x).is_inference()


def test_the_quick_key_is_off_with_the_other_shortcuts(monkeypatch):
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "0")
    assert "_cached_dispatch_impl" not in vars(shortcuts.fake_mode())
    monkeypatch.setenv(shortcuts.SWITCH_ENV, "1")
    assert isinstance(vars(shortcuts.fake_mode())["_cached_dispatch_impl"].__self__, shortcuts.QuickKeyCache)


def test_calls_that_miss_the_quick_key_are_counted_by_reason():
    """As upstream counts its cache's bypasses by reason, each call that goes upstream's way is counted with why
    (the trace's `quick_key_misses`): an op upstream never caches, with upstream's reason (a composite op, which
    arrives whole under inference_mode); a one-element host tensor's copy to the GPU (a constant upstream may
    memoise)."""
    FakeTensorMode.cache_clear()
    scalar = torch.tensor(2.0)
    with shortcuts.fake_mode(allow_non_fake_inputs=True) as mode:
        x = torch.empty(4, 8)
        for _ in range(3):
            with torch.inference_mode():
                x.flatten()
            scalar.to("cuda:0")
    FakeTensorMode.cache_clear()
    misses = shortcuts.quick_key_misses(mode)
    assert misses["an op upstream does not cache: CompositeImplicitAutograd"] == 3
    assert misses[shortcuts._MISS_HOST_TENSOR] == 3
    assert shortcuts.quick_key_misses(FakeTensorMode()) == {}


def test_a_data_dependent_op_skips_upstreams_key_and_raises_as_the_fake_mode_does(monkeypatch):
    """`.item()` of a fake GPU tensor (`_local_scalar_dense`, once per environment step in a rollout) is never cached
    upstream: the quick key sends it straight to the fake mode's dispatch, which raises what a plain fake mode
    raises, without building upstream's key for it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(DataDependentOutputException):
            torch.empty(3).sum().item()
    with shortcuts.fake_mode(allow_non_fake_inputs=True) as mode:
        keyed = []
        cache_key = mode._cache_key
        monkeypatch.setattr(mode, "_cache_key", lambda state, func, *rest: keyed.append(func) or
                            cache_key(state, func, *rest))
        total = torch.empty(3).sum()
        for _ in range(3):
            with pytest.raises(DataDependentOutputException):
                total.item()
    assert aten._local_scalar_dense.default not in keyed
    assert shortcuts.quick_key_misses(mode)[shortcuts._MISS_DATA_DEPENDENT] == 3
