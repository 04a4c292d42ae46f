"""The tracer on a small MLP trained with Adam, on both torch builds: the recorded allocations are the ones the
script must make on a GPU (parameters, one gradient per parameter, Adam's two moments per parameter)."""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from xmem.trace import run_trace

SCRIPTS = Path(__file__).parent / "scripts"


def _cpu_build_python() -> pytest.param:
    python = os.environ.get("XMEM_TEST_CPU_PYTHON", "")
    reason = ("XMEM_TEST_CPU_PYTHON is unset" if not python else
              f"XMEM_TEST_CPU_PYTHON={python} is not an executable" if not os.access(python, os.X_OK) else "")
    return pytest.param(python, id="cpu-build", marks=pytest.mark.skipif(bool(reason), reason=reason))


PYTHONS = [pytest.param(sys.executable, id="this-build"), _cpu_build_python()]

# nn.Sequential(Linear(100, 300), ReLU(), Linear(300, 10)) in fp32
PARAM_BYTES = [100 * 300 * 4, 300 * 4, 300 * 10 * 4, 10 * 4]


@pytest.fixture(scope="module", params=PYTHONS)
def mlp_trace(request):
    return run_trace(["python", str(SCRIPTS / "mlp_adam.py"), "--steps", "10"], iterations=3, python=request.param)


def _allocs(trace, category):
    return [e.nbytes for e in trace.events if e.action == "alloc" and e.category == category]


def test_mlp_stops_after_the_requested_iterations(mlp_trace):
    assert mlp_trace.iterations == 3
    assert mlp_trace.used_cuda
    assert {e.iteration for e in mlp_trace.events} == {-1, 0, 1, 2}


def test_mlp_parameters_are_the_first_allocations(mlp_trace):
    first = mlp_trace.events[:4]
    assert [e.nbytes for e in first] == PARAM_BYTES
    assert all(e.category == "parameter" and e.iteration == -1 and e.op == "_to_copy" for e in first)


def test_mlp_one_gradient_per_parameter_each_iteration(mlp_trace):
    # zero_grad() sets grads to None, so each of the 3 iterations allocates them again
    assert sorted(_allocs(mlp_trace, "gradient")) == sorted(PARAM_BYTES * 3)


def test_mlp_adam_keeps_two_moments_per_parameter(mlp_trace):
    # exp_avg + exp_avg_sq, created once in the first step; `step` stays a CPU scalar (not fused/capturable)
    assert sorted(_allocs(mlp_trace, "optimizer_state")) == sorted(PARAM_BYTES * 2)
    assert {e.iteration for e in mlp_trace.events if e.category == "optimizer_state"} == {0}


def test_mlp_inputs_and_phases(mlp_trace):
    # x: 64x100 fp32, y: 64 int64, moved each iteration
    assert sorted(_allocs(mlp_trace, "input")) == sorted([64 * 100 * 4, 64 * 8] * 3)
    phases = Counter(e.phase for e in mlp_trace.events if e.action == "alloc")
    assert phases["forward"] and phases["backward"] and phases["optimizer"]


def test_mlp_every_free_matches_an_earlier_alloc(mlp_trace):
    live = {}
    for e in mlp_trace.events:
        if e.action == "alloc":
            assert e.block not in live
            live[e.block] = e.nbytes
        elif e.action == "free":
            assert live.pop(e.block) == e.nbytes


def test_mlp_uses_foreach_adam_and_cublas(mlp_trace):
    assert mlp_trace.op_counts.get("_foreach_sqrt", 0) >= 3  # GPU default: foreach, not the for-loop
    assert "cublas" in mlp_trace.libraries
    assert mlp_trace.threads == 2  # the forward thread and the autograd device thread


def test_mlp_item_gets_a_stand_in_and_one_warning(mlp_trace):
    assert [w for w in mlp_trace.warnings if "item()" in w] == [
        "tensor.item()/float()/bool() returned a stand-in value (no real data under fake CUDA)"]
