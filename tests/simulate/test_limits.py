"""Limited replays that share the unlimited replay's work (`simulate_limits`) give exactly what a replay of their own
under that limit gives: the rule that lets the GPU types of one estimate share a replay."""

import random

import pytest

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate, simulate_limits
from xmem.simulate.allocator_settings import MiB


def training_like_ops(seed: int, steps: int = 1500) -> list[tuple[int, int, int, int]]:
    """Random allocations and frees, small and large, on two streams, with an empty_cache now and then: enough
    splitting, merging and caching that a limit changes the replay (retries that free the cache, OOMs)."""
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    for _ in range(steps):
        if live and rng.random() < 0.45:
            ops.append((FREE, live.pop(rng.randrange(len(live))), 0, 0))
        elif rng.random() < 0.01:
            ops.append((EMPTY_CACHE, 0, 0, 0))
        else:
            next_id += 1
            size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 40 * MiB), rng.randint(0, 512)])
            ops.append((ALLOC, next_id, size, rng.choice([0, 0, 0, 1])))
            live.append(next_id)
    return ops


@pytest.mark.parametrize("setting", ["", "max_split_size_mb:20", "roundup_power2_divisions:4",
                                     "garbage_collection_threshold:0.6"])
@pytest.mark.parametrize("seed", [1, 2])
def test_each_limited_replay_is_the_replay_under_that_limit(setting, seed):
    ops = training_like_ops(seed)
    config = AllocatorConfig.parse(setting)
    unlimited = simulate(ops, config)
    levels = sorted({0, -1, unlimited.peak_reserved, unlimited.peak_reserved - 1, unlimited.peak_reserved + 1,
                     *(int(unlimited.peak_reserved * f) for f in (0.2, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99))})
    limits = {(capacity, capacity + 300 * MiB) for capacity in levels}
    whole, limited = simulate_limits(ops, config, limits)
    assert whole == unlimited
    assert set(limited) == limits
    for capacity, total in limits:
        assert limited[capacity, total] == simulate(ops, config, capacity=capacity, device_total=total), capacity
    assert any(limited[limit].oom is not None for limit in limits)  # the limits bite: OOMs ...
    assert any(limited[limit].num_alloc_retries for limit in limits)  # ... and retries that freed the cache


def test_limits_need_a_replay_where_the_limit_is_read_at_cudamalloc_only():
    ops = training_like_ops(3, steps=50)
    for setting in ("expandable_segments:True", "per_process_memory_fraction:0.5"):
        with pytest.raises(ValueError, match="memory fraction and expandable segments"):
            simulate_limits(ops, AllocatorConfig.parse(setting), {(10 * MiB, 20 * MiB)})
