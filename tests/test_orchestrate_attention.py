"""Orchestrate: the scratch of a fused attention backward (AttentionWorkspaceModel), placed after the op's last
output (dq, dk, dv) and freed before the next op, sized from dq (fp32 accumulator of a 16-bit dq; flash with
grouped k/v heads also holds per-query-head dk and dv)."""

import pytest

from xmem.gpus import load_catalog
from xmem.orchestrate import AttentionWorkspaceModel, orchestrate
from xmem.simulate import ALLOC, FREE
from xmem.trace.events import MemEvent, Trace

MIB = 1 << 20
CUDNN_BACKWARD, FLASH_BACKWARD = "_scaled_dot_product_cudnn_attention_backward", \
    "_scaled_dot_product_flash_attention_backward"


@pytest.fixture(scope="module")
def h100():
    return load_catalog(calibration_path=None)["H100-SXM5-80GB"]


def backward_call(op, dq, dk, first_block=1):
    """dq, dk, dv of one call (dv sized as dk), then the next op's output."""
    sizes = [dq, dk, dk, MIB]
    ops = [op] * 3 + ["add"]
    return [MemEvent("alloc", first_block + i, size, 0, 0, name, "", "backward", 0, "gradient")
            for i, (size, name) in enumerate(zip(sizes, ops))]


def test_cudnn_backward_gets_an_fp32_dq_accumulator_after_its_outputs(h100):
    ops = orchestrate(Trace(events=backward_call(CUDNN_BACKWARD, 64 * MIB, 8 * MIB), used_cuda=True), h100)
    assert ops.ops == [(ALLOC, 1, 64 * MIB, 0), (ALLOC, 2, 8 * MIB, 0), (ALLOC, 3, 8 * MIB, 0),
                       (ALLOC, 5, 128 * MIB, 0), (FREE, 5, 128 * MIB, 0), (ALLOC, 4, MIB, 0)]
    assert ops.attention_workspaces == 1 and ops.labels[3] == ("workspace", "backward", 0)


def test_flash_backward_with_grouped_heads_also_holds_expanded_dk_and_dv(h100):
    ops = orchestrate(Trace(events=backward_call(FLASH_BACKWARD, 64 * MIB, 8 * MIB), used_cuda=True), h100)
    scratch = [(action, nbytes) for action, block, nbytes, stream in ops.ops[3:9]]
    assert scratch == [(ALLOC, 128 * MIB), (ALLOC, 64 * MIB), (ALLOC, 64 * MIB),
                       (FREE, 128 * MIB), (FREE, 64 * MIB), (FREE, 64 * MIB)]
    same_heads = orchestrate(Trace(events=backward_call(FLASH_BACKWARD, 64 * MIB, 64 * MIB), used_cuda=True), h100)
    assert [nbytes for action, block, nbytes, stream in same_heads.ops if action == FREE] == [128 * MIB]


def test_each_call_gets_its_own_scratch_and_the_model_can_be_turned_off(h100):
    events = backward_call(CUDNN_BACKWARD, 4 * MIB, 4 * MIB) + backward_call(CUDNN_BACKWARD, 4 * MIB, 4 * MIB, 10)
    trace = Trace(events=events, used_cuda=True)
    assert orchestrate(trace, h100).attention_workspaces == 2
    off = orchestrate(trace, h100, attention_workspace=AttentionWorkspaceModel(dq_fraction=0))
    assert off.attention_workspaces == 0 and len(off.ops) == len(events)
