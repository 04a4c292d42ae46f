"""Whose fault a failure is (xmem.trace.child.attribution): each kind of exception that comes from the fake GPU is "not
modelled" with a one-line message naming what is missing and the program's line; what a real GPU would raise too is
the user's. The exceptions are real ones, raised by torch's fake tensor mode, torch's C++, ctypes and xmem's code in
this process; the end-to-end tests trace small programs that fail each way."""

import ctypes
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.torch_builds import SCRIPTS
from xmem.trace import TraceError, run_trace
from xmem.trace.child import triton_launch
from xmem.trace.child.attribution import attribute
from xmem.trace.errors import NotModelled

HERE = "test_attribution.py"


def raised(action) -> BaseException:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the exception under test
        return error
    raise AssertionError("nothing raised")


def under_fake_mode(action):
    def run():
        with FakeTensorMode():
            action()
    return run


def test_what_a_gpu_refuses_too_is_the_users():
    found = attribute(raised(under_fake_mode(lambda: torch.empty(3, 4) @ torch.empty(5, 6))))
    assert found.kind == "user_error" and found.message.startswith("RuntimeError: ")
    assert f"(at {HERE}:" in found.message


def test_the_fake_modes_own_device_check_is_the_users():
    # FakeTensorDeviceMismatchError restates the check every real op makes: two devices in one op.
    error = raised(under_fake_mode(lambda: torch.ones(3, device="cuda") + torch.ones(3)))
    assert type(error).__name__ == "FakeTensorDeviceMismatchError"
    assert attribute(error).kind == "user_error"


@pytest.mark.parametrize("action", [lambda: torch.ones(2).sum().item(), lambda: torch.nonzero(torch.ones(3))],
                         ids=["data-dependent", "dynamic-shape"])
def test_a_limit_of_the_fake_tensor_mode_is_not_modelled(action):
    error = raised(under_fake_mode(action))
    found = attribute(error)
    assert found.kind == "not_modelled"
    assert found.message.startswith(f"not modelled: {type(error).__name__}: aten.") and f"(at {HERE}:" in found.message


@pytest.mark.parametrize("action", [
    under_fake_mode(lambda: torch.ones(3).untyped_storage().tolist()),  # the storage a fake tensor does not have
    lambda: torch.empty(0).set_(torch.empty(4, device="meta").untyped_storage()),  # a meta storage set on the host
], ids=["storage", "set-meta-storage"])
def test_the_fake_representation_seen_through_is_not_modelled(action):
    found = attribute(raised(action))
    assert found.kind == "not_modelled"
    assert found.message.startswith("not modelled: a GPU tensor's data or storage, which the fake GPU does not hold")


class Tagged(torch.Tensor):  # a plain-data subclass, as torchvision's tv_tensors.Image is
    pass


def test_a_tensor_subclass_the_fake_mode_declines_is_not_modelled_and_named():
    # FakeTensorMode declines an op on a subclass it does not know (moving a tv_tensors.Image batch to the GPU):
    # torch says no handler took it, which a GPU would never say
    batch = torch.ones(3).as_subclass(Tagged)  # a real host tensor, as a data loader hands it over
    error = raised(under_fake_mode(lambda: batch.to("cuda")))
    assert isinstance(error, TypeError)
    found = attribute(error)
    assert found.kind == "not_modelled"
    assert found.message.startswith(f"not modelled: a tensor subclass the fake GPU cannot hold ({__name__}.Tagged)")
    assert f"(at {HERE}:" in found.message


def test_an_op_error_met_while_the_fake_caches_control_flow_was_handled_is_the_users():
    from torch._subclasses.fake_tensor import _BypassDispatchCache

    def dispatched_in_the_handler():  # its __context__ is the cache's bypass, which says nothing of the program
        try:
            raise _BypassDispatchCache("unsupported")
        except _BypassDispatchCache:
            torch.empty(3, 4) @ torch.empty(5, 6)
    assert attribute(raised(under_fake_mode(dispatched_in_the_handler))).kind == "user_error"


def test_the_programs_own_raise_keeps_its_words_whatever_they_say():
    def own():
        raise RuntimeError("the meta file of shard 3 is missing")
    assert attribute(raised(own)).kind == "user_error"


def test_a_cuda_library_that_cannot_load_is_not_modelled():
    found = attribute(raised(lambda: ctypes.CDLL("libcudart.so.999")))
    assert found.kind == "not_modelled"
    assert found.message.startswith("not modelled: the program loads a CUDA library that is not here (OSError: ")
    driver = attribute(raised(lambda: ctypes.CDLL("libcuda.so.999")))  # (a driver's load outside the fake world)
    assert driver.message.startswith("not modelled: the program calls the CUDA driver directly (OSError: ")


def test_a_failure_in_xmems_code_is_not_modelled_and_names_it():
    found = attribute(raised(lambda: triton_launch._bind(object(), (), {})))
    assert found.kind == "not_modelled"
    assert found.message.startswith("not modelled: the fake GPU's triton_launch._bind failed (AttributeError: ")


def test_a_missing_file_relayed_by_the_sandboxs_file_apis_is_the_users(tmp_path):
    # The fallback sandbox's copy-on-write open and mkdir are xmem frames, but what they relay is the path's answer.
    from xmem.trace.sandbox import CopyOnWrite
    files = CopyOnWrite(str(tmp_path / "cow"), passthrough=[])
    for action in (lambda: files.open(tmp_path / "missing.txt"), lambda: files.mkdir(tmp_path)):
        found = attribute(raised(action))
        assert found.kind == "user_error", found.message
        assert "sandbox" not in found.message


def test_what_xmem_raises_as_a_gpu_would_is_the_users():
    found = attribute(raised(lambda: triton_launch._grid(4, {})))  # a grid that is not a tuple
    assert found.kind == "user_error" and found.message.startswith("TypeError: ")


def test_not_modelled_wrapped_by_a_library_is_still_ours():
    def library_call():
        try:
            triton_launch.SkippedKernel(library_call).n_regs  # noqa: B018
        except NotModelled as error:
            raise RuntimeError("kernel set-up failed") from error
    found = attribute(raised(library_call))
    assert found.kind == "not_modelled"
    assert found.message.startswith("not modelled: the compiled form of Triton kernel library_call (.n_regs)")


def test_an_exit_while_handling_our_failure_is_ours_and_a_plain_exit_the_users():
    def cli():  # a command-line framework prints the error and exits with status 1
        try:
            triton_launch.SkippedKernel(cli).n_regs  # noqa: B018
        except NotModelled:
            sys.exit(1)
    assert attribute(raised_exit(cli)).kind == "not_modelled"
    found = attribute(raised_exit(lambda: sys.exit(3)))
    assert (found.kind, found.message) == ("user_error", "the program exited with status 3")


def raised_exit(action) -> SystemExit:
    try:
        action()
    except SystemExit as exit_:
        return exit_
    raise AssertionError("no exit")


# ---- end to end: the kind and message a traced program gets --------------------------------------------------------
@pytest.mark.parametrize("how, kind, message", [
    ("shape", "user_error", "RuntimeError: "),
    ("storage", "not_modelled", "not modelled: a GPU tensor's data or storage, which the fake GPU does not hold"),
    ("driver", "not_modelled", "not modelled: fails_on_fake.py calls the CUDA driver directly (loads libcuda.so.1)"),
    ("check", "not_modelled", "not modelled: a check failed on values of GPU tensors, which the fake GPU stands in "
                              "for (AssertionError: wrong shuffled batch)"),
])
def test_a_traced_program_is_told_whose_fault_it_is(how, kind, message):
    with pytest.raises(TraceError) as caught:
        run_trace([sys.executable, str(SCRIPTS / "fails_on_fake.py"), how], iterations=1, timeout=120)
    assert (caught.value.kind, caught.value.message[:len(message)]) == (kind, message)
    assert "(at fails_on_fake.py:" in caught.value.message and "\n" not in caught.value.message


def test_the_library_line_that_reached_the_real_runtime_is_named():
    from accelerate.utils import send_to_device  # a real library whose own line moves the tensor

    found = attribute(raised(lambda: send_to_device(torch.ones(2), "cuda")))  # no device in this process
    assert found.kind == "not_modelled" and "reached the real CUDA runtime" in found.message
    assert " (in accelerate at accelerate/utils/operations.py:" in found.message
    assert f", called at {HERE}:" in found.message
