"""Triton kernels under the fake GPU (xmem.trace.child.triton_launch): a launch is checked and skipped, since it writes
into tensors allocated before it, so a program with the user's own autotuned kernel in a custom autograd.Function
traces to exactly the allocations of the same program with torch ops (plus the autotuner's restore copies), a
program using Liger's kernels traces, and a launch a GPU refuses is still the user's error. Only the CUDA build
brings triton."""

import sys
from collections import Counter

import pytest

from tests.torch_builds import SCRIPTS
from xmem.trace import TraceError, run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what a program allocates: forked warm

pytest.importorskip("triton")
SCRIPT = str(SCRIPTS / "triton_kernels.py")
ROW_BYTES = 8 * 64 * 256 * 4  # the scaled activations: batch 8 x 64 tokens x width 256, fp32


def alloc_sizes(trace) -> Counter:
    return Counter(event.nbytes for event in trace.events if event.action == "alloc")


@pytest.fixture(scope="module")
def user_kernel():
    return run_trace([sys.executable, SCRIPT], iterations=3)


def test_a_user_kernel_allocates_what_torch_ops_would(user_kernel):
    reference = run_trace([sys.executable, SCRIPT, "--torch"], iterations=3)
    assert user_kernel.iterations == 3 and "triton" in user_kernel.libraries
    # The autotuner benchmarks its two configs once, each after copying the `restore_value` output (freed after).
    assert alloc_sizes(user_kernel) - alloc_sizes(reference) == Counter({ROW_BYTES: 2})
    assert alloc_sizes(reference) - alloc_sizes(user_kernel) == Counter()


def test_a_probe_for_the_driver_carries_on(user_kernel):
    # The script probes ctypes.CDLL("libcuda.so.1") under try/except OSError before training: refused, it goes on.
    assert user_kernel.used_cuda


def test_liger_kernels_trace_with_the_fake_gpus_properties():
    pytest.importorskip("liger_kernel")
    trace = run_trace([sys.executable, SCRIPT, "--liger"], iterations=2)
    assert trace.iterations == 2 and "triton" in trace.libraries
    # LigerRMSNorm's backward keeps one fp32 row of weight gradient per SM: 132 on the H100 that sm_90 stands for.
    partial_dw = [event for event in trace.events if event.action == "alloc" and event.nbytes == 132 * 256 * 4]
    assert {event.phase for event in partial_dw} == {"backward"} and len(partial_dw) == 2


def test_a_host_tensor_given_to_a_kernel_is_the_users_error():
    with pytest.raises(TraceError) as caught:
        run_trace([sys.executable, SCRIPT, "--mistake"], iterations=1)
    assert caught.value.kind == "user_error"
    assert caught.value.message.startswith("ValueError: Pointer argument out_ptr cannot be accessed from Triton")
    assert "(at triton_kernels.py:" in caught.value.message
