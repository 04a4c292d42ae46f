"""The replay driver: op checking, peaks, timeline, and the allocator's bookkeeping under long random sequences."""

import random
from array import array

import pytest

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate
from xmem.simulate.allocator import DeviceCachingAllocator, kMinBlockSize
from xmem.simulate.allocator_settings import MiB

EMPTY = (EMPTY_CACHE, 0, 0, 0)


def alloc(block, nbytes, stream=0):
    return (ALLOC, block, nbytes, stream)


def free(block):
    return (FREE, block, 0, 0)


def test_free_of_an_unknown_block_names_the_op():
    with pytest.raises(ValueError, match=r"^op 1: FREE of block 7, which is not allocated"):
        simulate([alloc(1, 100), free(7)])


def test_double_free_is_an_unknown_block():
    with pytest.raises(ValueError, match=r"^op 2: FREE of block 1"):
        simulate([alloc(1, 100), free(1), free(1)])


def test_alloc_of_a_live_id_and_unknown_actions_are_rejected():
    with pytest.raises(ValueError, match=r"^op 1: ALLOC of block 1, which is already allocated"):
        simulate([alloc(1, 100), alloc(1, 100)])
    with pytest.raises(ValueError, match=r"^op 0: unknown action 9"):
        simulate([(9, 1, 100, 0)])
    with pytest.raises(ValueError, match=r"^op 0: ALLOC of block 1 with negative size"):
        simulate([alloc(1, -1)])


def test_empty_replay_reports_zeros():
    result = simulate([])
    assert (result.peak_allocated, result.peak_reserved, result.timeline, result.oom) == (0, 0, (), None)


def test_peaks_name_their_first_op_and_segments_are_counted_there():
    # op0: 4 MiB (20 MiB segment, 16 MiB rest split off); op1: 30 MiB own segment -> reserved 50 MiB in
    # 2 segments, allocated 34 MiB; op2: frees the 30 MiB block (cached)
    ops = [alloc(1, 4 * MiB), alloc(2, 30 * MiB), free(2), alloc(3, 12 * MiB), alloc(4, 25 * MiB)]
    result = simulate(ops)
    # op3: the smallest cached block >= 12 MiB is the 16 MiB rest; it takes 12 MiB of it (split: 4 MiB > 1 MiB
    # left): allocated 16 MiB, reserved 50 MiB.
    # op4 25 MiB takes the cached 30 MiB block (remainder 5 MiB > 1 MiB: split): allocated 41 MiB, reserved 50.
    assert (result.peak_reserved, result.peak_reserved_index) == (50 * MiB, 1)
    assert (result.peak_allocated, result.peak_allocated_index) == (41 * MiB, 4)
    assert result.num_segments_at_peak == 2
    assert result.fragmentation_at_peak == pytest.approx((50 - 34) / 50)
    assert (result.final_allocated, result.final_reserved) == (41 * MiB, 50 * MiB)
    # reserved stays at 50 MiB from op1 on; op4 holds the most allocated there (41 MiB against 34 at op1)
    assert result.fullest_peak_index == 4


def test_timeline_is_downsampled_but_keeps_both_peaks_and_the_last_op():
    rng = random.Random(1)
    ops, live = [], []
    for i in range(5000):
        if live and rng.random() < 0.5:
            ops.append(free(live.pop(rng.randrange(len(live)))))
        else:
            ops.append(alloc(i, rng.randrange(1, 40 * MiB)))
            live.append(i)
    ops.append(EMPTY)
    result = simulate(ops, timeline_points=50)
    indices = [i for i, _, _ in result.timeline]
    assert len(indices) <= 50 and indices == sorted(set(indices))
    assert {result.peak_allocated_index, result.peak_reserved_index, len(ops) - 1} <= set(indices)
    points = {i: (a, r) for i, a, r in result.timeline}
    assert points[result.peak_allocated_index][0] == result.peak_allocated
    assert points[result.peak_reserved_index][1] == result.peak_reserved
    assert points[len(ops) - 1] == (result.final_allocated, result.final_reserved)
    full = simulate(ops, timeline_points=len(ops))
    assert len(full.timeline) == len(ops)  # every op when asked for as many points
    assert all(point in full.timeline for point in result.timeline)


@pytest.mark.parametrize("n, points", [(5000, 50), (997, 40), (101, 100), (64, 7)])
def test_each_bucket_gives_its_first_highest_op(n, points):
    """The rule as numpy states it (buckets cut at linspace(0, n, b + 1), argmax in each), against the down-sampler."""
    import numpy as np
    from xmem.simulate.result import downsample_timeline

    rng = random.Random(n)
    allocated = array("q", (rng.randrange(0, 50) for _ in range(n)))  # small values: many ties within a bucket
    keep = (3, n - 1)
    buckets = points - len(keep)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64).tolist()
    expected = set(keep) | {start + int(np.asarray(allocated[start:stop]).argmax())
                            for start, stop in zip(edges[:-1], edges[1:]) if stop > start}
    timeline = downsample_timeline(allocated, allocated, points, keep)
    assert [i for i, _, _ in timeline] == sorted(expected)


def test_timeline_points_below_three_are_refused():
    with pytest.raises(ValueError, match="timeline_points"):
        simulate([alloc(1, 1)], timeline_points=2)


def test_a_negative_capacity_fails_the_first_allocation():
    # overheads beyond the device leave nothing for cudaMalloc: the first 2 MiB segment cannot be had
    result = simulate([alloc(1, 1), alloc(2, 1)], capacity=-300 * MiB)
    assert result.oom is not None and result.oom.index == 0
    assert "total capacity of 0 bytes of which 0 bytes is free" in result.oom.message


def test_ops_may_be_a_generator_and_stream_ids_any_integers():
    ops = (op for op in [alloc(1, 5 * MiB, stream=140_000_000_000), alloc(2, 5 * MiB, stream=-3)])
    assert simulate(ops).peak_reserved == 40 * MiB  # two streams: two 20 MiB segments


# ---- bookkeeping under long random sequences --------------------------------------------------------------------


def segment_chains(allocator, live_blocks):
    """Every segment's blocks in address order, found from the allocated, free and unmapped blocks."""
    everything = set(live_blocks)
    for pool in (allocator.small_blocks, allocator.large_blocks):
        everything.update(pool.blocks.values())
        everything.update(pool.unmapped)
    chains = []
    for head in (b for b in everything if b.prev is None):
        chain, block = [], head
        while block is not None:
            chain.append(block)
            block = block.next
        chains.append(chain)
    return everything, chains


def check_bookkeeping(allocator, live_blocks):
    everything, chains = segment_chains(allocator, live_blocks)
    assert sum(len(chain) for chain in chains) == len(everything)  # no block outside a chain
    reserved = 0
    for chain in chains:
        for left, right in zip(chain, chain[1:]):
            assert right.prev is left and right.ptr == left.ptr + left.size  # contiguous, linked both ways
            # neighbours that could merge have merged
            assert left.allocated or right.allocated or left.mapped != right.mapped
        if chain[0].segment is None:
            reserved += sum(b.size for b in chain)
        else:
            segment = chain[0].segment
            assert chain[0].ptr == segment.ptr and sum(b.size for b in chain) == segment.size
            reserved += len(segment.mapped_pages) * segment.page_size
            for block in chain:  # mapped blocks lie on mapped pages, unmapped ones on unmapped pages
                pages = segment.pages_to_map(block.ptr, block.size)
                if block.mapped:
                    assert set(pages) <= segment.mapped_pages
                else:  # unmapped ranges can be huge: test the few mapped pages against the range instead
                    assert not any(page in pages for page in segment.mapped_pages)
    for pool in (allocator.small_blocks, allocator.large_blocks):
        assert pool.keys == sorted(pool.blocks)
        assert all(not b.allocated and b.mapped and b.pool is pool for b in pool.blocks.values())
    assert all(b.allocated and b.size >= kMinBlockSize for b in live_blocks)
    assert allocator.allocated_bytes == sum(b.size for b in live_blocks)
    assert allocator.total_allocated_memory == reserved
    assert allocator.active_blocks == set(live_blocks)
    segments = allocator.snapshot()
    assert sum(s.total_size for s in segments) == reserved
    assert sum(s.allocated_size for s in segments) == allocator.allocated_bytes
    assert len(segments) == allocator.num_segments


CONFIGS = {
    "default": (AllocatorConfig(), None),
    "max_split": (AllocatorConfig.parse("max_split_size_mb:64"), 600 * MiB),
    "expandable": (AllocatorConfig.parse("expandable_segments:True"), 600 * MiB),
    "expandable_unlimited": (AllocatorConfig.parse("expandable_segments:True,roundup_power2_divisions:4"), None),
    "gc": (AllocatorConfig.parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.8,"
                                 "max_split_size_mb:100"), 600 * MiB),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bookkeeping_holds_through_random_alloc_free_and_empty_cache(name):
    config, capacity = CONFIGS[name]
    allocator = DeviceCachingAllocator(config, capacity)
    rng = random.Random(name)
    live = []
    ooms = 0
    for step in range(2500):
        roll = rng.random()
        if roll < 0.01:
            allocator.empty_cache()
        elif live and roll < 0.48:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, 1 * MiB), rng.randrange(1 * MiB, 10 * MiB),
                               rng.randrange(10 * MiB, 120 * MiB)])
            block = allocator.malloc(size, stream=rng.randrange(2))
            if block is None:
                ooms += 1
            else:
                live.append(block)
        check_bookkeeping(allocator, live)
    for block in live:
        allocator.free(block)
    allocator.empty_cache()
    assert (allocator.allocated_bytes, allocator.total_allocated_memory, allocator.num_segments) == (0, 0, 0)
    if capacity is not None:  # the limit was reached, so the release and OOM paths ran too
        assert ooms > 0 or allocator.num_alloc_retries > 0
