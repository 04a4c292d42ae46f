"""Orchestrate: trace events -> the simulator's op rows, with cuBLAS/cuDNN workspaces and parallel labels."""

import pytest

from xmem.gpus import load_catalog
from xmem.orchestrate import ConvWorkspaceModel, orchestrate, trace_devices
from xmem.simulate import ALLOC, EMPTY_CACHE, FREE
from xmem.trace.events import MemEvent, Trace

MIB = 1 << 20
A100_WORKSPACE = 8_519_680
HOPPER_WORKSPACE = 32 * MIB


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(calibration_path=None)


def alloc(block, nbytes, op="empty", phase="forward", iteration=0, category="activation", stream=0, device=0):
    return MemEvent("alloc", block, nbytes, device, stream, op, "", phase, iteration, category)


def free(block, nbytes, phase="forward", iteration=0, category="activation", stream=0, device=0):
    return MemEvent("free", block, nbytes, device, stream, "", "", phase, iteration, category)


def linear_step_trace() -> Trace:
    """Forward: two GEMMs on the Python thread; backward: two GEMMs on the autograd thread."""
    return Trace(events=[
        alloc(1, 4 * MIB, op="empty", phase="other", iteration=-1, category="parameter"),
        alloc(2, 1 * MIB, op="addmm", phase="forward"),
        alloc(3, 1 * MIB, op="mm", phase="forward"),
        alloc(4, 4 * MIB, op="mm", phase="backward", category="gradient"),
        alloc(5, 1 * MIB, op="mm", phase="backward", category="temporary"),
        free(5, 1 * MIB, phase="backward", category="temporary"),
        alloc(6, 4 * MIB, op="zeros_like", phase="optimizer", category="optimizer_state"),
    ], used_cuda=True, libraries=["cublas"])


def workspace_rows(ops):
    return [(i, row) for i, row in enumerate(ops.ops) if ops.labels[i][0] == "workspace"]


def test_one_cublas_workspace_per_host_thread_after_its_first_gemm(catalog):
    ops = orchestrate(linear_step_trace(), catalog["A100-SXM4-40GB"])
    rows = workspace_rows(ops)
    # Forward thread: right after block 2 (the first addmm); autograd thread: right after block 4.
    assert [i for i, _ in rows] == [2, 5]
    assert ops.ops[1][1] == 2 and ops.ops[4][1] == 4
    assert all(row[0] == ALLOC and row[2] == A100_WORKSPACE for _, row in rows)
    assert [ops.labels[i][1] for i, _ in rows] == ["forward", "backward"]
    assert ops.cublas_workspaces == 2 and ops.cublas_workspace_bytes == A100_WORKSPACE


def test_cublas_workspaces_are_kept_to_the_end(catalog):
    ops = orchestrate(linear_step_trace(), catalog["A100-SXM4-40GB"])
    workspace_blocks = {row[1] for _, row in workspace_rows(ops)}
    assert not [row for row in ops.ops if row[0] == FREE and row[1] in workspace_blocks]


def test_cublas_workspace_block_ids_do_not_collide_with_the_trace(catalog):
    ops = orchestrate(linear_step_trace(), catalog["A100-SXM4-40GB"])
    assert {row[1] for _, row in workspace_rows(ops)} == {7, 8}


def test_hopper_cublas_workspace_is_32_mib(catalog):
    ops = orchestrate(linear_step_trace(), catalog["H100-SXM5-80GB"])
    assert [row[2] for _, row in workspace_rows(ops)] == [HOPPER_WORKSPACE, HOPPER_WORKSPACE]


def test_cublas_workspace_config_from_the_job_env(catalog):
    ops = orchestrate(linear_step_trace(), catalog["H100-SXM5-80GB"], {"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert [row[2] for _, row in workspace_rows(ops)] == [16 * 1024 * 8] * 2


def test_a_second_stream_gets_its_own_cublas_workspace(catalog):
    trace = Trace(events=[alloc(1, MIB, op="mm"), alloc(2, MIB, op="mm", stream=7), alloc(3, MIB, op="mm")],
                  used_cuda=True)
    ops = orchestrate(trace, catalog["A100-SXM4-40GB"])
    assert [(row[3], row[2]) for _, row in workspace_rows(ops)] == [(0, A100_WORKSPACE), (7, A100_WORKSPACE)]


def test_no_gemm_means_no_cublas_workspace(catalog):
    trace = Trace(events=[alloc(1, MIB, op="relu"), free(1, MIB)], used_cuda=True)
    ops = orchestrate(trace, catalog["A100-SXM4-40GB"])
    assert ops.cublas_workspaces == 0 and len(ops.ops) == 2


def test_convolution_gets_a_transient_workspace_after_each_output(catalog):
    trace = Trace(events=[
        alloc(1, 3 * MIB, op="convolution"),
        alloc(2, 2 * MIB, op="convolution_backward", phase="backward", category="temporary"),
        alloc(3, 1 * MIB, op="convolution_backward", phase="backward", category="gradient"),
    ], used_cuda=True)
    ops = orchestrate(trace, catalog["A100-SXM4-40GB"])
    assert ops.ops == [
        (ALLOC, 1, 3 * MIB, 0), (ALLOC, 4, 3 * MIB, 0), (FREE, 4, 3 * MIB, 0),
        (ALLOC, 2, 2 * MIB, 0), (ALLOC, 5, 2 * MIB, 0), (FREE, 5, 2 * MIB, 0),
        (ALLOC, 3, 1 * MIB, 0), (ALLOC, 6, 1 * MIB, 0), (FREE, 6, 1 * MIB, 0),
    ]
    assert ops.conv_workspaces == 3
    assert ops.labels[1] == ("workspace", "forward", 0) and ops.labels[4] == ("workspace", "backward", 0)


def test_conv_workspace_is_capped_and_can_be_turned_off(catalog):
    trace = Trace(events=[alloc(1, 1024 * MIB, op="convolution")], used_cuda=True)
    gpu = catalog["A100-SXM4-40GB"]
    assert orchestrate(trace, gpu).ops[1][2] == 256 * MIB
    half = ConvWorkspaceModel(fraction=0.5, cap_bytes=10**12)
    assert orchestrate(trace, gpu, conv_workspace=half).ops[1][2] == 512 * MIB
    assert orchestrate(trace, gpu, conv_workspace=ConvWorkspaceModel(fraction=0)).ops == [(ALLOC, 1, 1024 * MIB, 0)]


def test_trace_order_and_labels_are_kept(catalog):
    trace = linear_step_trace()
    ops = orchestrate(trace, catalog["A100-SXM4-40GB"])
    assert len(ops.ops) == len(ops.labels)
    kept = [(row, label) for row, label in zip(ops.ops, ops.labels) if label[0] != "workspace"]
    assert [row for row, _ in kept] == [
        (ALLOC if e.action == "alloc" else FREE, e.block, e.nbytes, e.stream) for e in trace.events]
    assert [label for _, label in kept] == [(e.category, e.phase, e.iteration) for e in trace.events]


def test_only_the_requested_device_and_no_zero_byte_requests(catalog):
    trace = Trace(events=[alloc(1, MIB), alloc(2, 0), free(2, 0), alloc(3, 2 * MIB, device=1), alloc(4, MIB)],
                  used_cuda=True)
    gpu = catalog["A100-SXM4-40GB"]
    assert [row[1] for row in orchestrate(trace, gpu).ops] == [1, 4]
    assert [row[1] for row in orchestrate(trace, gpu, device=1).ops] == [3]
    assert trace_devices(trace) == [0, 1]
    assert trace_devices(Trace()) == [0]


def test_empty_cache_passes_through(catalog):
    trace = Trace(events=[alloc(1, MIB), free(1, MIB), MemEvent("empty_cache", 0, 0, phase="other")],
                  used_cuda=True)
    ops = orchestrate(trace, catalog["A100-SXM4-40GB"])
    assert ops.ops[-1] == (EMPTY_CACHE, 0, 0, 0)


def test_iteration_starts_mark_the_first_op_of_each_iteration(catalog):
    trace = Trace(events=[
        alloc(1, MIB, iteration=-1), alloc(2, MIB, iteration=0), alloc(3, MIB, iteration=0),
        alloc(4, MIB, iteration=1), free(4, MIB, iteration=1), alloc(5, MIB, iteration=2),
    ], used_cuda=True)
    assert orchestrate(trace, catalog["A100-SXM4-40GB"]).iteration_starts == {0: 1, 1: 3, 2: 5}
