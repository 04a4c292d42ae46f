"""The caching-allocator rules (shared/notes/torch-allocator.md A.2-A.6, A.8), each pinned by a hand-built sequence.

Every expected figure is derived by hand in the comments; MiB = 1,048,576 B.
"""

import pytest

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate
from xmem.simulate.allocator import DeviceCachingAllocator, round_size
from xmem.simulate.allocator_settings import MiB

KiB = 1024


def alloc(block, nbytes, stream=0):
    return (ALLOC, block, nbytes, stream)


def free(block):
    return (FREE, block, 0, 0)


EMPTY = (EMPTY_CACHE, 0, 0, 0)


def run(*ops, config=AllocatorConfig(), capacity=None):
    return simulate(list(ops), config, capacity=capacity)


# ---- A.2 rounding -----------------------------------------------------------------------------------------------


def test_one_byte_rounds_to_512_in_a_2mib_small_segment():
    result = run(alloc(1, 1))
    assert result.peak_allocated == 512
    assert result.peak_reserved == 2 * MiB
    # (2,097,152 - 512) / 2,097,152 of the segment is cached but unallocated
    assert result.fragmentation_at_peak == pytest.approx((2 * MiB - 512) / (2 * MiB))


def test_sizes_round_up_to_multiples_of_512():
    assert round_size(512) == 512
    assert round_size(513) == 1024  # 2 x 512
    assert round_size(12_000_000) == 12_000_256  # ceil(12,000,000 / 512) = 23,438; x 512


def test_roundup_power2_divisions_apply_only_above_512_times_divisions():
    four = (4,) * 16
    # 1200 <= 512 x 4 = 2048, so plain 512-B rounding: ceil(1200 / 512) = 3 -> 1536 (not 1280)
    assert round_size(1200, four) == 1536
    # 1,100,000 > 2048: power-of-2 floor 1,048,576, step 1,048,576 / 4 = 262,144 -> next step 1,310,720
    assert round_size(1_100_000, four) == 1_310_720
    assert round_size(1_100_000) == 1_100_288  # without divisions: 2,149 x 512
    assert round_size(4 * MiB, four) == 4 * MiB  # a power of 2 stays


def test_roundup_power2_divisions_per_interval_list_reaches_the_segment_size():
    config = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    # 600 MiB + 1 B lies in [512 MiB, 1 GiB): 2 divisions, step 256 MiB -> 768 MiB; >= 10 MiB, so its own
    # segment of round_up(768 MiB, 2 MiB) = 768 MiB, taken whole
    result = run(alloc(1, 600 * MiB + 1), config=config)
    assert result.peak_allocated == result.peak_reserved == 768 * MiB
    # 300 MiB + 1 B lies in [256 MiB, 512 MiB): 1 division = plain 512-B rounding -> 300 MiB + 512; segment
    # round_up(., 2 MiB) = 302 MiB; remainder 2 MiB - 512 > 1 MiB, so it is split off
    result = run(alloc(1, 300 * MiB + 1), config=config)
    assert (result.peak_allocated, result.peak_reserved) == (300 * MiB + 512, 302 * MiB)


def test_zero_byte_alloc_makes_no_block_and_its_free_is_accepted():
    result = run(alloc(1, 0), alloc(2, 1000), free(1))
    assert result.peak_allocated == 1024  # only block 2: 2 x 512
    assert result.final_allocated == 1024
    assert result.peak_reserved == 2 * MiB


# ---- A.3 pools and segment sizes --------------------------------------------------------------------------------


def test_small_pool_packs_requests_into_2mib_segments():
    # 700 KiB = 716,800 B (a multiple of 512). One 2 MiB segment holds two: 2,097,152 - 2 x 716,800 = 663,552
    # is left, too small for a third, which opens a second 2 MiB segment.
    result = run(alloc(1, 700 * KiB), alloc(2, 700 * KiB), alloc(3, 700 * KiB))
    assert result.peak_allocated == 3 * 716_800
    assert result.peak_reserved == 4 * MiB
    assert result.num_segments_at_peak == 2


def test_cublas_workspace_takes_a_split_20mib_segment():
    # 8,519,680 B (> 1 MiB, < 10 MiB): large pool, 20 MiB segment; 12,451,840 B left over (> 1 MiB): split off,
    # and a second workspace fits into that remainder.
    result = run(alloc(1, 8_519_680), alloc(2, 8_519_680))
    assert result.peak_allocated == 2 * 8_519_680
    assert result.peak_reserved == 20 * MiB
    assert result.num_segments_at_peak == 1


def test_large_block_not_split_when_remainder_at_most_1mib():
    # 12,000,000 -> 12,000,256 rounded -> segment round_up(., 2 MiB) = 6 x 2 MiB = 12,582,912; the remainder
    # 582,656 <= 1 MiB stays with the block, so allocated counts it.
    result = run(alloc(1, 12_000_000))
    assert result.peak_allocated == result.peak_reserved == 12_582_912
    # 19 MiB in a 20 MiB segment leaves exactly 1 MiB: not more than kSmallSize, so not split either
    result = run(alloc(1, 19 * MiB))
    assert result.peak_allocated == result.peak_reserved == 20 * MiB


def test_requests_of_10mib_or_more_get_their_own_segment():
    # 10 MiB exactly: segment = round_up(10 MiB, 2 MiB) = 10 MiB, not a 20 MiB one
    assert run(alloc(1, 10 * MiB)).peak_reserved == 10 * MiB
    # 512 B less is below kMinLargeAlloc: a 20 MiB segment, split (10 MiB + 512 left > 1 MiB)
    result = run(alloc(1, 10 * MiB - 512))
    assert (result.peak_allocated, result.peak_reserved) == (10 * MiB - 512, 20 * MiB)


def test_large_segment_size_setting_changes_the_mid_size_segment():
    config = AllocatorConfig.parse("large_segment_size_mb:32")
    # 4 MiB: 1 MiB < size < 10 MiB -> one large_segment_size segment of 32 MiB
    assert run(alloc(1, 4 * MiB), config=config).peak_reserved == 32 * MiB


# ---- A.4 best fit and splitting ---------------------------------------------------------------------------------


def test_best_fit_picks_the_smallest_block_then_the_lowest_address():
    allocator = DeviceCachingAllocator(AllocatorConfig())
    big = allocator.malloc(30 * MiB, 0)  # own segments, sized exactly: 30, 24, 24 MiB
    first24 = allocator.malloc(24 * MiB, 0)
    second24 = allocator.malloc(24 * MiB, 0)
    address_of_first24 = first24.ptr
    for block in (second24, big, first24):
        allocator.free(block)
    block = allocator.malloc(22 * MiB, 0)
    # the 24 MiB blocks are the smallest that fit; of the two, the lower address (allocated first)
    assert block.ptr == address_of_first24
    assert block.size == 22 * MiB  # remainder 2 MiB > 1 MiB: split
    assert allocator.total_allocated_memory == 78 * MiB  # no new segment


def test_a_100mib_cached_block_is_split_for_a_2mib_request():
    # default max_split_size (SIZE_MAX): the cached 100 MiB block serves 2 MiB, split; the remaining 98 MiB then
    # serves 98 MiB exactly. No new segment at any point.
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 2 * MiB), alloc(3, 98 * MiB))
    assert result.peak_reserved == result.final_reserved == 100 * MiB
    assert result.final_allocated == 100 * MiB
    assert result.num_segments_at_peak == 1


def test_max_split_size_keeps_small_requests_off_oversize_blocks():
    config = AllocatorConfig.parse("max_split_size_mb:64")
    # 2 MiB < 64 MiB and the cached block (100 MiB) >= 64 MiB: rejected, a new 20 MiB segment: 100 + 20
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 2 * MiB), config=config)
    assert result.final_reserved == 120 * MiB
    assert result.final_allocated == 2 * MiB


def test_max_split_size_rejects_blocks_larger_than_request_plus_max_non_split_rounding():
    config = AllocatorConfig.parse("max_split_size_mb:64")
    # 70 MiB >= 64 MiB and 100 MiB >= 70 + 20 MiB: rejected, new 70 MiB segment -> 170 MiB reserved
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 70 * MiB), config=config)
    assert result.final_reserved == 170 * MiB
    # 85 MiB: 100 < 85 + 20, so the cached block is taken; 85 >= max_split, so it is not split: allocated 100 MiB
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 85 * MiB), config=config)
    assert (result.final_allocated, result.final_reserved) == (100 * MiB, 100 * MiB)
    # with max_non_split_rounding_mb:40, 100 < 70 + 40: the 70 MiB request takes the 100 MiB block whole
    wider = AllocatorConfig.parse("max_split_size_mb:64,max_non_split_rounding_mb:40")
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 70 * MiB), config=wider)
    assert (result.final_allocated, result.final_reserved) == (100 * MiB, 100 * MiB)


# ---- A.5 free, coalescing, streams ------------------------------------------------------------------------------


def test_freed_block_on_one_stream_is_not_reused_by_another():
    # 4 MiB on stream 1 opens a 20 MiB segment; after its free, 4 MiB on stream 0 cannot use it: a second
    # 20 MiB segment. Stream 1 then reuses its own cached block: still 40 MiB.
    result = run(alloc(1, 4 * MiB, stream=1), free(1), alloc(2, 4 * MiB, stream=0), alloc(3, 4 * MiB, stream=1))
    assert result.final_reserved == 40 * MiB
    assert result.final_allocated == 8 * MiB


def test_free_block_coalesces_with_both_neighbours():
    allocator = DeviceCachingAllocator(AllocatorConfig())
    # 512 KiB x 3 in one 2 MiB small segment: [a][b][c][free 512 KiB]
    a, b, c = (allocator.malloc(512 * KiB, 0) for _ in range(3))
    allocator.free(a)  # [free][b][c][free]
    allocator.free(c)  # c merges with the tail: [free 512 KiB][b][free 1 MiB]
    assert sorted(blk.size for blk in allocator.small_blocks.blocks.values()) == [512 * KiB, 1 * MiB]
    allocator.free(b)  # b merges with both: one free block covering the whole segment
    assert [blk.size for blk in allocator.small_blocks.blocks.values()] == [2 * MiB]
    assert not allocator.small_blocks.blocks[allocator.small_blocks.keys[0]].is_split()


def test_coalesced_segment_is_released_by_empty_cache():
    ops = [alloc(1, 512 * KiB), alloc(2, 512 * KiB), alloc(3, 512 * KiB), free(1), free(3), free(2), EMPTY]
    result = run(*ops)
    assert result.peak_reserved == 2 * MiB
    assert result.final_reserved == 0  # only possible if the three pieces merged back into one segment


def test_empty_cache_releases_only_fully_free_segments():
    # a and b share a 20 MiB segment (2 MiB each, large pool); c has its own 30 MiB segment.
    ops = [alloc(1, 2 * MiB), alloc(2, 2 * MiB), alloc(3, 30 * MiB), free(1), free(3), EMPTY]
    result = run(*ops)
    assert result.peak_reserved == 50 * MiB
    assert result.final_reserved == 20 * MiB  # c's segment went back; a's is split while b lives
    assert run(*ops, free(2), EMPTY).final_reserved == 0


# ---- A.6 when nothing cached fits -------------------------------------------------------------------------------


def test_release_cached_blocks_frees_unsplit_segments_so_the_retry_succeeds():
    # capacity 100 MiB: 60 MiB cached, a 70 MiB request does not fit it; 60 + 70 > 100, so cudaMalloc fails,
    # release_cached_blocks frees the cached 60 MiB, and the retry (counted) gets 70 MiB.
    result = run(alloc(1, 60 * MiB), free(1), alloc(2, 70 * MiB), capacity=100 * MiB)
    assert result.oom is None
    assert result.num_alloc_retries == 1
    assert result.final_reserved == result.peak_reserved == 70 * MiB


def test_release_available_cached_blocks_frees_one_oversize_block_without_a_retry():
    config = AllocatorConfig.parse("max_split_size_mb:64")
    # cached 100 MiB is oversize and rejected for 70 MiB (100 >= 70 + 20); 100 + 70 > 150 fails, so
    # release_available_cached_blocks frees that one block (>= max(70, 64) MiB) and alloc_block succeeds.
    result = run(alloc(1, 100 * MiB), free(1), alloc(2, 70 * MiB), config=config, capacity=150 * MiB)
    assert result.oom is None
    assert result.num_alloc_retries == 0
    assert result.final_reserved == 70 * MiB


def test_release_available_cached_blocks_frees_several_oversize_blocks_largest_first():
    config = AllocatorConfig.parse("max_split_size_mb:64")
    ops = [alloc(1, 70 * MiB), alloc(2, 68 * MiB), alloc(3, 66 * MiB), free(1), free(2), free(3),
           alloc(4, 100 * MiB)]
    # no cached block >= 100 MiB; 204 + 100 > 220 fails; releasing 70 (< 100) then 68 (138 >= 100) suffices,
    # so the 66 MiB block stays cached: 66 + 100 = 166 MiB (smallest-first would have kept 70: 170 MiB)
    result = run(*ops, config=config, capacity=220 * MiB)
    assert (result.num_alloc_retries, result.final_reserved) == (0, 166 * MiB)
    # without max_split_size everything cached comes back through release_cached_blocks, with a retry
    result = run(*ops, capacity=220 * MiB)
    assert (result.num_alloc_retries, result.final_reserved) == (1, 100 * MiB)


def test_out_of_memory_reports_like_torch_and_stops_the_replay():
    # 60 + 30 MiB live in a 100 MiB device; 20 MiB more needs a 20 MiB segment: 110 > 100, nothing cached to
    # release, the retry fails too.
    ops = [alloc(1, 60 * MiB), alloc(2, 30 * MiB), alloc(3, 20 * MiB), free(1)]
    result = run(*ops, capacity=100 * MiB)
    oom = result.oom
    assert oom is not None
    assert (oom.index, oom.requested, oom.allocated, oom.reserved, oom.capacity) == (
        2, 20 * MiB, 90 * MiB, 90 * MiB, 100 * MiB)
    assert "Tried to allocate 20.00 MiB" in oom.message
    assert "total capacity of 100.00 MiB of which 10.00 MiB is free" in oom.message
    assert "90.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated" in oom.message
    assert (result.num_ooms, result.num_alloc_retries) == (1, 1)
    assert result.final_allocated == 90 * MiB  # the FREE after the OOM never ran
    assert result.timeline[-1][0] == 2


def test_out_of_memory_when_cached_memory_sits_in_split_segments():
    # a and b (2 MiB each) share a 20 MiB segment; a is freed but the segment stays split by b, so it cannot be
    # released. 25 MiB needs a 26 MiB segment (round_up to 2 MiB): 20 + 26 > 40 -> out of memory.
    ops = [alloc(1, 2 * MiB), alloc(2, 2 * MiB), free(1), alloc(3, 25 * MiB)]
    result = run(*ops, capacity=40 * MiB)
    assert result.oom is not None and result.oom.index == 3
    assert "Tried to allocate 26.00 MiB" in result.oom.message
    assert "18.00 MiB is reserved by PyTorch but unallocated" in result.oom.message  # 20 - 2


def test_memory_fraction_limits_cudamalloc_below_capacity():
    config = AllocatorConfig(memory_fraction=0.5)
    ops = [alloc(1, 60 * MiB), alloc(2, 50 * MiB)]
    # allowed = 0.5 x 200 MiB = 100 MiB; 60 + 50 > 100 -> out of memory, although the device has room
    result = run(*ops, config=config, capacity=200 * MiB)
    assert result.oom is not None and result.oom.index == 1
    assert "100.00 MiB allowed;" in result.oom.message
    assert run(*ops, capacity=200 * MiB).oom is None


def test_memory_fraction_is_taken_of_the_device_total_when_given():
    config = AllocatorConfig(memory_fraction=0.5)
    ops = [alloc(1, 60 * MiB), alloc(2, 50 * MiB)]
    # allowed = 0.5 x 200 MiB (device total) = 100 MiB, though only 150 MiB is obtainable: 60 + 50 > 100
    result = simulate(ops, config, capacity=150 * MiB, device_total=200 * MiB)
    assert result.oom is not None and result.oom.capacity == 150 * MiB
    # torch's wording: the device total, and what is free on it (150 - 60 MiB reserved)
    assert "total capacity of 200.00 MiB of which 90.00 MiB is free. 100.00 MiB allowed;" in result.oom.message
    # with no capacity limit the fraction of the device total still applies
    result = simulate(ops, config, device_total=200 * MiB)
    assert result.oom is not None and result.oom.capacity == 200 * MiB


def test_garbage_collection_frees_cached_blocks_before_cudamalloc():
    gc = AllocatorConfig(memory_fraction=0.5, garbage_collection_threshold=0.6)
    ops = [alloc(1, 30 * MiB), alloc(2, 40 * MiB), free(1), alloc(3, 34 * MiB)]
    # allowed 100 MiB, GC threshold 60 MiB. 34 MiB does not fit the cached 30 MiB; reserved 70 > 60, so GC frees
    # the cached 30 MiB first and cudaMalloc (40 + 34 = 74 <= 100) succeeds with no retry.
    result = run(*ops, config=gc, capacity=200 * MiB)
    assert (result.num_alloc_retries, result.final_reserved) == (0, 74 * MiB)
    # without GC: 70 + 34 > 100 fails, release_cached_blocks frees the 30 MiB, the retry succeeds (counted)
    result = run(*ops, config=AllocatorConfig(memory_fraction=0.5), capacity=200 * MiB)
    assert (result.num_alloc_retries, result.final_reserved) == (1, 74 * MiB)


def test_garbage_collection_is_inactive_without_a_memory_fraction():
    config = AllocatorConfig(garbage_collection_threshold=0.6)
    ops = [alloc(1, 30 * MiB), alloc(2, 40 * MiB), free(1), alloc(3, 34 * MiB)]
    # capacity 100 MiB, no fraction: 70 + 34 > 100 goes through release_cached_blocks and a retry
    result = run(*ops, config=config, capacity=100 * MiB)
    assert result.num_alloc_retries == 1


def test_garbage_collection_frees_the_oldest_cached_blocks_first():
    config = AllocatorConfig(memory_fraction=0.5, garbage_collection_threshold=0.5)
    # allowed 100 MiB, GC at 50 MiB. x (20 MiB, stream 0) is cached first; s (12 MiB, stream 1) is reused five
    # times, each reuse a large-pool get_free_block call that ages x, and each free makes s young again.
    ops = [alloc(1, 20 * MiB), free(1)]
    for i in range(6):
        ops += [alloc(10 + i, 12 * MiB, stream=1), free(10 + i)]
    ops.append(alloc(2, 36 * MiB))  # reserved 20 + 12 + 36 = 68; GC saw 32 <= 50 before it, so nothing freed
    # 16 MiB on a new stream: GC target 68 - 50 = 18 MiB. Ages: x 8, s 2, mean 5 -> only x (>= 5) is freed,
    # 20 >= 18 ends GC. cudaMalloc: 48 + 16 = 64 MiB.
    ops.append(alloc(3, 16 * MiB, stream=2))
    result = run(*ops, config=config, capacity=200 * MiB)
    assert (result.final_reserved, result.num_alloc_retries) == (64 * MiB, 0)
    # s survived: stream 1 reuses it without growing the cache
    assert run(*ops, alloc(4, 12 * MiB, stream=1), config=config, capacity=200 * MiB).final_reserved == 64 * MiB


# ---- A.8 what the allocator holds ---------------------------------------------------------------------------------


def test_snapshot_lists_each_segment_with_its_blocks_in_address_order():
    allocator = DeviceCachingAllocator(AllocatorConfig())
    allocator.malloc(4 * MiB, 0)  # 20 MiB segment: 4 MiB used, 16 MiB split off
    allocator.malloc(1, 1)  # 2 MiB small segment on stream 1: 512 B used
    allocator.free(allocator.malloc(30 * MiB, 0))  # its own 30 MiB segment, cached whole
    segments = allocator.snapshot()
    assert [(s.total_size, s.is_large, s.stream, s.allocated_size, s.blocks) for s in segments] == [
        (20 * MiB, True, 0, 4 * MiB, ((4 * MiB, True), (16 * MiB, False))),
        (2 * MiB, False, 1, 512, ((512, True), (2 * MiB - 512, False))),
        (30 * MiB, True, 0, 0, ((30 * MiB, False),)),
    ]
    assert sum(s.total_size for s in segments) == allocator.total_allocated_memory
    assert not any(s.is_expandable for s in segments)


def test_a_block_is_spliced_only_between_neighbours():
    """Block::splice's own check, as upstream asserts it: linking a block between two blocks that are not
    neighbours would lose the blocks between them (and let try_merge_blocks join memory that is not adjacent)."""
    from xmem.simulate.allocator import Block, BlockPool

    pool = BlockPool(is_small=False)
    first, second, third = (Block(0, MiB, i * MiB, pool) for i in range(3))
    second.splice(first, None)
    third.splice(second, None)
    Block(0, MiB, 3 * MiB, pool).splice(second, third)  # neighbours: fine
    with pytest.raises(AssertionError):
        Block(0, MiB, 4 * MiB, pool).splice(first, third)  # `second` and the block after it lie between
