"""bitsandbytes' paged optimizers traced on fake CUDA (tests/scripts/adamw_8bit.py): the paged state is CUDA managed
memory (xmem.trace.child.managed_memory), counted beside the caching allocator, never in its segments.

The rule, from bitsandbytes' source (Optimizer8bit.get_state_buffer, Optimizer2State.init_state): a paged optimizer
takes a parameter's two state buffers from get_paged (cudaMallocManaged) when the parameter has 1e5 elements or more,
else from torch.zeros_like as the unpaged one does. PagedAdamW8bit's buffers are uint8 (1 byte per element each: 2
bytes per parameter element in managed memory) where the parameter has at least min_8bit_size (4096) elements, with
the fp32 block absmax (one per 256 elements) on the device as usual; PagedAdamW's are fp32 (8 bytes per element).
The MLP's first weight is 300 x 500 = 150000 elements: the only paged one; the others (300, 3000, 10) stay unpaged.
"""

import importlib.util
import sys

import pytest

from tests.trace.child.test_8bit import QMAPS, blocks
from tests.trace.child.test_scripts import allocs, sizes, trace
from xmem.audit import audit
from xmem.gpus import load_catalog
from xmem.orchestrate import orchestrate
from xmem.simulate import simulate
from xmem.trace.events import MANAGED_OP, MANAGED_STREAM, Trace

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed"),
              pytest.mark.usefixtures("warm_tracer")]

PAGED = 300 * 500


def managed(result):
    return [e for e in allocs(result) if e.stream == MANAGED_STREAM]


@pytest.fixture(scope="module")
def paged_8bit():
    return trace(sys.executable, "adamw_8bit.py", "--optimizer", "PagedAdamW8bit", iterations=2)


def test_paged_8bit_state_is_two_bytes_per_element_of_managed_memory(paged_8bit):
    paged = managed(paged_8bit)
    assert sizes(paged) == [PAGED, PAGED]
    assert {(e.op, e.category, e.phase, e.iteration) for e in paged} == {(MANAGED_OP, "optimizer_state", "optimizer",
                                                                          0)}
    # on the device as usual: the paged weight's absmax, the unpaged parameters' fp32 states, the quantisation maps
    device_state = [e for e in allocs(paged_8bit, "optimizer_state") if e.stream != MANAGED_STREAM]
    assert sizes(device_state) == sorted(QMAPS + [blocks(PAGED) * 4] * 2 + [n * 4 for n in (300, 3000, 10)
                                                                            for _ in range(2)])
    if paged_8bit.facts is not None:
        assert audit(paged_8bit) == ()


def test_paged_32bit_state_is_eight_bytes_per_element_of_managed_memory():
    result = trace(sys.executable, "adamw_8bit.py", "--optimizer", "PagedAdamW", iterations=2)
    assert sizes(managed(result)) == [PAGED * 4, PAGED * 4]


def test_the_replay_counts_managed_bytes_as_they_are_beside_the_allocators_segments(paged_8bit):
    gpu = load_catalog()["A100-SXM4-40GB"]
    with_state = simulate(orchestrate(paged_8bit, gpu).ops)
    without = Trace(events=[e for e in paged_8bit.events if e.stream != MANAGED_STREAM],
                    libraries=paged_8bit.libraries)
    without_state = simulate(orchestrate(without, gpu).ops)
    # the state lives from the first step to the end: the same allocator replay, plus its bytes unrounded
    assert with_state.final_reserved - without_state.final_reserved == 2 * PAGED
    assert with_state.peak_reserved - without_state.peak_reserved == 2 * PAGED
