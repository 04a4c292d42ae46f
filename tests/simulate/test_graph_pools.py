"""CUDA graphs' private memory pools in the allocator model, derived by hand from upstream's rules
(CUDACachingAllocator.cpp: beginAllocateToPool / endAllocateToPool / releasePool, get_pool, release_cached_blocks):
a capture's allocations come from its own pool, whose segments no other allocation takes and which stay reserved
until every graph sharing the pool is gone and the cache is emptied; while a capture records, the OOM retry does not
free the device's cache."""

import pytest

from xmem.simulate import (ALLOC, BEGIN_POOL, EMPTY_CACHE, END_POOL, FREE, RELEASE_POOL, AllocatorConfig, simulate,
                           simulate_limits)
from xmem.simulate.allocator import DeviceCachingAllocator
from xmem.simulate.allocator_settings import MiB

EMPTY = (EMPTY_CACHE, 0, 0, 0)
CAPTURE_STREAM = 7


def alloc(block, nbytes, stream=0):
    return (ALLOC, block, nbytes, stream)


def free(block):
    return (FREE, block, 0, 0)


def begin(pool, stream=CAPTURE_STREAM):
    return (BEGIN_POOL, pool, 0, stream)


def end(pool):
    return (END_POOL, pool, 0, 0)


def release(pool):
    return (RELEASE_POOL, pool, 0, 0)


def reserved_after(ops):
    """Reserved bytes after each op."""
    result = simulate(ops, timeline_points=len(ops) + 3)
    return [reserved for _, _, reserved in result.timeline]


# a 4 MiB request is a large one under kMinLargeAlloc (10 MiB): it takes a 20 MiB segment (kLargeBuffer)
GRAPH_LIFE = [
    alloc(1, 4 * MiB), free(1),  # the device's cache: one 20 MiB segment, free
    begin(1),
    alloc(2, 4 * MiB, CAPTURE_STREAM),  # the graph's pool has nothing cached: a segment of its own
    free(2),  # back to the graph's pool
    alloc(3, 2 * MiB, CAPTURE_STREAM),  # reuses the graph's segment
    end(1),
    alloc(4, 4 * MiB),  # outside the capture: the device's cached segment, never the graph's
    free(4),
    EMPTY,  # frees the device's segment; the graph's stays (its pool is in use)
    release(1),  # the graph is gone; block 3 (a static output) is still alive, so its segment is split
    EMPTY,  # nothing of the graph's pool can go yet
    free(3),  # back to the graph's pool, merged whole
    EMPTY,  # now its segment goes, and the pool with it
]


def test_a_capture_takes_segments_of_its_own_which_stay_until_the_graph_is_gone_and_the_cache_emptied():
    assert reserved_after(GRAPH_LIFE) == [
        20 * MiB, 20 * MiB,
        20 * MiB,
        40 * MiB, 40 * MiB, 40 * MiB,
        40 * MiB,
        40 * MiB, 40 * MiB,
        20 * MiB,
        20 * MiB, 20 * MiB, 20 * MiB,
        0,
    ]


def test_the_pool_is_forgotten_once_released_and_emptied():
    allocator = DeviceCachingAllocator(AllocatorConfig())
    allocator.begin_allocate_to_pool(1, 0)
    block = allocator.malloc(4 * MiB, 0)
    allocator.end_allocate_to_pool(1)
    assert allocator.graph_pools[1].cudaMalloc_count == 1
    allocator.free(block)
    allocator.release_pool(1)
    allocator.empty_cache()
    assert allocator.graph_pools == {} and allocator.total_allocated_memory == 0


def test_a_capture_on_another_stream_leaves_the_default_streams_allocations_in_the_device_pool():
    ops = [begin(1), alloc(1, 4 * MiB, 0), free(1), alloc(2, 4 * MiB, CAPTURE_STREAM), end(1),
           alloc(3, 4 * MiB, 0)]
    # block 1 is the device's (stream 0 is not capturing); block 3 reuses its cached segment
    assert reserved_after(ops) == [0, 20 * MiB, 20 * MiB, 40 * MiB, 40 * MiB, 40 * MiB]


def test_a_pool_shared_by_two_graphs_stays_until_both_are_released():
    ops = [begin(1), alloc(1, 4 * MiB, CAPTURE_STREAM), free(1), end(1),
           begin(1), alloc(2, 4 * MiB, CAPTURE_STREAM), free(2), end(1),  # shares the cached segment
           release(1), EMPTY, release(1), EMPTY]
    assert reserved_after(ops) == [0, 20 * MiB, 20 * MiB, 20 * MiB,
                                   20 * MiB, 20 * MiB, 20 * MiB, 20 * MiB,
                                   20 * MiB, 20 * MiB, 20 * MiB, 0]


def test_while_a_capture_records_an_out_of_memory_retry_keeps_the_devices_cache():
    # 30 MiB of device: the cached 20 MiB segment would have to go for the graph's 20 MiB; upstream frees the cache
    # only when no capture is underway
    during = simulate([alloc(1, 4 * MiB), free(1), begin(1), alloc(2, 4 * MiB, CAPTURE_STREAM)], capacity=30 * MiB)
    assert during.oom is not None and during.oom.index == 3
    eager = simulate([alloc(1, 4 * MiB), free(1), alloc(2, 4 * MiB, CAPTURE_STREAM)], capacity=30 * MiB)
    assert eager.oom is None and eager.num_alloc_retries == 1


def test_pool_ops_out_of_order_name_the_op():
    with pytest.raises(ValueError, match="op 1: pool 1: not recording to it"):
        simulate([begin(2), end(1)])
    with pytest.raises(ValueError, match="op 0: pool 3: released more often than used"):
        simulate([release(3)])
    with pytest.raises(ValueError, match="op 1: pool 1: already recording to it"):
        simulate([begin(1), begin(1)])


def test_limited_replays_with_a_graph_pool_are_the_replays_under_their_limits():
    limits = {(capacity * MiB, 80 * MiB) for capacity in (0, 19, 20, 30, 39, 40, 60)}
    whole, limited = simulate_limits(GRAPH_LIFE, AllocatorConfig(), limits)
    assert whole == simulate(GRAPH_LIFE)
    for capacity, device_total in limits:
        assert limited[capacity, device_total] == simulate(GRAPH_LIFE, capacity=capacity, device_total=device_total)


def test_expandable_segments_map_the_graphs_pages_in_a_segment_of_its_own():
    # expandable: pages of 20 MiB (large_segment_size); the capture's 4 MiB maps one page of a new segment
    ops = [alloc(1, 4 * MiB), free(1), begin(1), alloc(2, 4 * MiB, CAPTURE_STREAM), end(1)]
    result = simulate(ops, AllocatorConfig.parse("expandable_segments:True"))
    assert result.peak_reserved == 40 * MiB and result.num_segments_at_peak == 2
