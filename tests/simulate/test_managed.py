"""CUDA managed memory in the replay (stream MANAGED): outside the caching allocator, counted beside it, refused by
no limit."""

from xmem.simulate import ALLOC, FREE, MANAGED, AllocatorConfig, simulate, simulate_limits
from xmem.simulate.allocator_settings import MiB


def test_managed_bytes_count_unrounded_beside_the_allocators_and_take_no_segment():
    ops = [(ALLOC, 1, 4 * MiB, 0), (ALLOC, 2, 3_000_001, MANAGED), (FREE, 2, 0, 0), (FREE, 1, 0, 0)]
    result = simulate(ops, timeline_points=10)
    # the 4 MiB tensor takes a 20 MiB segment; the managed 3000001 bytes are added as they are
    assert [reserved for _, _, reserved in result.timeline] == [20 * MiB, 20 * MiB + 3_000_001, 20 * MiB, 20 * MiB]
    assert [allocated for _, allocated, _ in result.timeline] == [4 * MiB, 4 * MiB + 3_000_001, 4 * MiB, 0]
    assert result.num_segments_at_peak == 1


def test_a_limit_refuses_no_managed_memory_and_the_allocator_still_gets_its_own():
    ops = [(ALLOC, 1, 50 * MiB, MANAGED), (ALLOC, 2, 4 * MiB, 0)]
    result = simulate(ops, capacity=30 * MiB)
    assert result.oom is None and result.peak_reserved == 70 * MiB


def test_limited_replays_with_managed_memory_are_the_replays_under_their_limits():
    ops = [(ALLOC, 1, 50 * MiB, MANAGED), (ALLOC, 2, 4 * MiB, 0), (FREE, 2, 0, 0), (ALLOC, 3, 25 * MiB, 0),
           (FREE, 1, 0, 0), (ALLOC, 4, 30 * MiB, 0)]
    limits = {(capacity * MiB, 100 * MiB) for capacity in (10, 20, 40, 50, 60, 80)}
    whole, limited = simulate_limits(ops, AllocatorConfig(), limits)
    assert whole == simulate(ops)
    for capacity, total in limits:
        assert limited[capacity, total] == simulate(ops, capacity=capacity, device_total=total)
