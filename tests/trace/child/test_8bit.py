"""bitsandbytes' 8-bit AdamW traced on fake CUDA (tests/scripts/adamw_8bit.py), its state pinned by hand from
bitsandbytes' Optimizer2State.init_state: a parameter of at least min_8bit_size (4096) elements keeps two uint8
states of its size and two fp32 absmax vectors of one value per 256-element block; a smaller one keeps two fp32
states; the two 256-entry fp32 quantisation maps (signed, unsigned) are moved to the GPU once. Its update kernels
are custom ops with fake kernels: in place, they allocate nothing. Paged state (parameters of 1e5 elements or more)
is CUDA managed memory: tests/trace/child/test_paged.py."""

import importlib.util
import sys

import pytest

from tests.trace.child.test_scripts import allocs, sizes, trace
from xmem.audit import audit

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed"),
              pytest.mark.usefixtures("warm_tracer")]  # traces of what a program allocates: forked warm

QMAPS = [256 * 4, 256 * 4]


def blocks(numel, blocksize=256):
    return -(-numel // blocksize)


def state_of(numel):
    """One parameter's AdamW8bit state, in bytes per tensor."""
    if numel < 4096:
        return [numel * 4] * 2  # state1, state2 in fp32
    return [numel] * 2 + [blocks(numel) * 4] * 2  # uint8 state1, state2; fp32 absmax1, absmax2


def mlp_state(features):
    """nn.Sequential(Linear(features, 300), ReLU(), Linear(300, 10)): weight, bias, weight, bias."""
    return sorted(QMAPS + [b for numel in (300 * features, 300, 10 * 300, 10) for b in state_of(numel)])


def test_the_hand_rule_by_itself():
    # 150000 elements: 2 x 150000 uint8 + 2 x 586 blocks x 4; the 3000-element weight is under min_8bit_size
    assert mlp_state(500) == sorted([1024, 1024, 150000, 150000, 2344, 2344, 1200, 1200, 12000, 12000, 40, 40])


def test_adamw8bit_keeps_uint8_moments_with_blockwise_absmax_and_its_kernel_allocates_nothing():
    result = trace(sys.executable, "adamw_8bit.py", iterations=2)
    state = allocs(result, "optimizer_state")
    assert sizes(state) == mlp_state(500)
    assert {(e.iteration, e.phase) for e in state} == {(0, "optimizer")}
    # the update ran as bitsandbytes' ops (8-bit for the large weight, 32-bit for the rest), allocating nothing
    assert result.op_counts.get("optimizer_update_8bit_blockwise") == 2
    assert result.op_counts.get("optimizer_update_32bit") == 6
    assert [e for e in allocs(result, phase="optimizer") if e.category != "optimizer_state"] == []
    if result.facts is not None:
        assert audit(result) == ()


def test_paged_adamw8bit_below_the_paging_size_is_plain_device_memory():
    # 30000 elements < 1e5: bitsandbytes' get_state_buffer takes torch.zeros_like, as for AdamW8bit
    result = trace(sys.executable, "adamw_8bit.py", "--optimizer", "PagedAdamW8bit", "--features", "100",
                   iterations=2)
    assert sizes(allocs(result, "optimizer_state")) == mlp_state(100)
