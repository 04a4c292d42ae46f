"""Expandable segments (shared/notes/torch-allocator.md A.7): page-wise growth, reuse, unmapping, splitting.

Pages are 2 MiB in the small pool and 20 MiB (large_segment_size) in the large pool; MiB = 1,048,576 B.
"""

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate
from xmem.simulate.allocator import DeviceCachingAllocator
from xmem.simulate.allocator_settings import MiB

KiB = 1024
EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")
EMPTY = (EMPTY_CACHE, 0, 0, 0)


def alloc(block, nbytes, stream=0):
    return (ALLOC, block, nbytes, stream)


def free(block):
    return (FREE, block, 0, 0)


def run(*ops, config=EXPANDABLE, capacity=None):
    return simulate(list(ops), config, capacity=capacity)


def test_large_pool_grows_in_20mib_pages_for_the_rounded_request():
    # 30 MiB maps ceil(30 / 20) = 2 pages = 40 MiB; the 10 MiB rest is split off (>= 512 B)
    assert (run(alloc(1, 30 * MiB)).final_allocated, run(alloc(1, 30 * MiB)).final_reserved) == (30 * MiB, 40 * MiB)
    # + 5 MiB fits the 10 MiB rest; + 20 MiB does not fit the 5 MiB left, so one more page (20 MiB) is mapped
    # right after it and the two merge into 25 MiB, of which 20 MiB is used: 60 MiB reserved, 55 MiB allocated
    result = run(alloc(1, 30 * MiB), alloc(2, 5 * MiB), alloc(3, 20 * MiB))
    assert [(a, r) for _, a, r in result.timeline] == [(30 * MiB, 40 * MiB), (35 * MiB, 40 * MiB),
                                                       (55 * MiB, 60 * MiB)]
    assert result.num_segments_at_peak == 1  # one segment per (stream, pool)


def test_small_pool_grows_in_2mib_pages():
    # 700 KiB = 716,800 B: two fit the first 2 MiB page (663,552 B left); the third takes that rest plus a
    # second page: 4 MiB reserved, as with 2 MiB segments, but in one segment
    result = run(alloc(1, 700 * KiB), alloc(2, 700 * KiB), alloc(3, 700 * KiB))
    assert (result.final_allocated, result.final_reserved) == (3 * 716_800, 4 * MiB)
    assert result.num_segments_at_peak == 1


def test_remainder_of_at_least_512_bytes_is_split_even_in_the_large_pool():
    # 12,000,000 -> 12,000,256 B rounded, one 20 MiB page; the rest 8,971,264 >= 512 is split off, so allocated
    # is the rounded size (without expandable segments it would be the whole 12,582,912 B segment)
    result = run(alloc(1, 12_000_000))
    assert (result.final_allocated, result.final_reserved) == (12_000_256, 20 * MiB)


def test_freed_memory_is_reused_before_new_pages_are_mapped():
    # a (30 MiB) maps 40 MiB; b (30 MiB) uses the 10 MiB rest + one new page exactly. a freed, 25 MiB reuses it.
    result = run(alloc(1, 30 * MiB), alloc(2, 30 * MiB), free(1), alloc(3, 25 * MiB))
    assert result.peak_reserved == result.final_reserved == 60 * MiB
    assert result.final_allocated == 55 * MiB


def test_empty_cache_unmaps_only_whole_free_pages():
    # pages: [0,20) [20,40) [40,60) MiB. a = [0,30), b = [30,60).
    ops = [alloc(1, 30 * MiB), alloc(2, 30 * MiB), free(1), EMPTY]
    # a freed: page [0,20) is wholly free and goes back; [20,40) still holds part of b: 40 MiB reserved
    result = run(*ops)
    assert (result.final_allocated, result.final_reserved) == (30 * MiB, 40 * MiB)
    # b freed too: its block merges with the free [20,30) piece; every page is free -> nothing reserved
    result = run(*ops, free(2), EMPTY)
    assert result.final_reserved == 0


def test_empty_cache_releases_a_fully_unmapped_segment():
    allocator = DeviceCachingAllocator(EXPANDABLE)
    block = allocator.malloc(30 * MiB, 0)
    allocator.free(block)
    allocator.empty_cache()
    assert allocator.total_allocated_memory == 0
    assert allocator.expandable_segments == []
    assert allocator.num_segments == 0


def test_each_stream_gets_its_own_segment():
    # stream 1 cannot use stream 0's free pages: its own segment, its own 20 MiB page
    result = run(alloc(1, 5 * MiB, stream=0), free(1), alloc(2, 5 * MiB, stream=1))
    assert result.final_reserved == 40 * MiB
    assert result.num_segments_at_peak == 2


def test_out_of_memory_path_unmaps_free_pages_and_retries():
    # capacity 60 MiB. Stream 0 keeps 40 MiB of free pages after a's free. 30 MiB on stream 1 needs two new
    # pages: 40 + 40 > 60 fails; release_cached_blocks unmaps stream 0's pages and the retry maps 40 MiB.
    result = run(alloc(1, 30 * MiB), free(1), alloc(2, 30 * MiB, stream=1), capacity=60 * MiB)
    assert result.oom is None
    assert result.num_alloc_retries == 1
    assert (result.final_allocated, result.final_reserved) == (30 * MiB, 40 * MiB)


def test_mapping_starts_at_the_lowest_address_that_fits():
    allocator = DeviceCachingAllocator(EXPANDABLE)
    # a, b, c: 20 MiB each, one page each: pages 0, 1, 2
    a, b, c = (allocator.malloc(20 * MiB, 0) for _ in range(3))
    base = a.ptr
    allocator.free(a)
    allocator.empty_cache()  # page 0 unmapped: a hole below b
    assert allocator.total_allocated_memory == 40 * MiB
    d = allocator.malloc(20 * MiB, 0)
    assert d.ptr == base  # mapped again in the hole, not after c
    assert allocator.total_allocated_memory == 60 * MiB


def test_snapshot_shows_only_the_mapped_part_of_an_expandable_segment():
    allocator = DeviceCachingAllocator(EXPANDABLE)
    allocator.malloc(30 * MiB, 0)  # two 20 MiB pages: 30 MiB used, 10 MiB free, the rest unmapped
    (segment,) = allocator.snapshot()
    assert (segment.is_expandable, segment.total_size, segment.allocated_size) == (True, 40 * MiB, 30 * MiB)
    assert segment.blocks == ((30 * MiB, True), (10 * MiB, False))
