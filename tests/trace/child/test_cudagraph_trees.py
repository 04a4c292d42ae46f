"""Inductor's CUDA graph trees (torch.compile(mode="reduce-overhead")) traced on fake CUDA
(xmem/trace/child/cudagraph_trees.py): one private pool per device that the forward and backward graphs share, each
graph warmed up in it, then recorded (its inputs that are not static copied in first, the cache emptied), then
replayed; the pool's size derived by hand.

tests/scripts/compiled_models.py --model swish (fp32, batch 16384): the forward graph allocates h = x @ W_up^T
(64 MiB), y = swish(h) (64 MiB, realized: the down projection's input, saved) and the output (16 MiB); the backward
graph W_down's gradient (1 MiB: a small block), dy (64 MiB), dh (64 MiB, fused) and W_up's gradient (1 MiB).
By hand, through the caching allocator's best fit:
- step 0 warms up: the forward takes three segments of the pool (64, 64, 16); the eager loss frees the output;
  backward's gradients take a 2 MiB small segment, dy the block y freed, and dh, with h still held, a fourth (64):
  3 x 64 + 16 + 2 = 210 MiB;
- step 1 records: the batch's copy takes the output's 16 MiB, the captured forward h and y two free 64 MiB blocks
  and its output splits the third (48 left); the backward's tangent copy (16 MiB) splits those 48 (32 left), dy
  takes y's block, and dh finds no free 64 MiB run (the third segment holds the tangent's copy): a fifth segment;
- replays find every block free again: the pool stays at 4 x 64 + 16 + 2 = 274 MiB.
"""

import sys
from pathlib import Path

import pytest

from xmem.simulate import ALLOC, BEGIN_POOL, EMPTY_CACHE, END_POOL, FREE, RELEASE_POOL, simulate
from xmem.trace.runner import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compiled_models.py"
MiB = 1 << 20
_OPS = {"alloc": ALLOC, "free": FREE, "empty_cache": EMPTY_CACHE, "begin_pool": BEGIN_POOL, "end_pool": END_POOL,
        "release_pool": RELEASE_POOL}


@pytest.fixture(scope="module")
def reduce_overhead():
    result = run_trace([sys.executable, str(SCRIPT), "--model", "swish", "--compile", "module", "--mode",
                        "reduce-overhead", "--steps", "5"], iterations=4)
    assert result.iterations == 4
    return result


def pool_windows(result) -> list[tuple[int, str]]:
    """(iteration, what) of each stretch the pool takes allocations: a warm-up or copy ('allocate', released after)
    or a capture ('capture', the cache emptied before it)."""
    windows, events = [], result.events
    for i, e in enumerate(events):
        if e.action == "begin_pool":
            end = next(j for j in range(i, len(events)) if events[j].action == "end_pool")
            released = end + 1 < len(events) and events[end + 1].action == "release_pool"
            windows.append((e.iteration, "allocate" if released else "capture"))
    return windows


def pool_only(events) -> list[tuple]:
    """The simulator's ops for the pool's own blocks (those allocated on the tree's stream) and its actions."""
    pooled = {e.block for e in events if e.action == "alloc" and e.stream != 0}
    return [(_OPS[e.action], e.block, e.nbytes, e.stream) for e in events
            if e.action in ("begin_pool", "end_pool", "release_pool", "empty_cache")
            or e.action in ("alloc", "free") and e.block in pooled]


def pool_reserved(events) -> int:
    ops = pool_only(events)
    return simulate(ops, timeline_points=len(ops) + 3).final_reserved


def test_forward_and_backward_share_one_pool_warmed_up_recorded_then_replayed(reduce_overhead):
    assert reduce_overhead.warnings == []  # the pool is modelled: no warning that it is not
    assert len({e.block for e in reduce_overhead.events if e.action == "begin_pool"}) == 1
    windows = pool_windows(reduce_overhead)
    keeper = [(0, "capture")]  # the tree's empty capture that keeps its pool alive
    warm_up = [(0, "allocate")] * 2  # forward, backward
    record = [(1, "allocate"), (1, "capture")] * 2  # each: its input copy, then its capture
    replays = [(step, "allocate") for step in (2, 3) for _ in range(2)]
    assert windows == keeper + warm_up + record + replays


def test_the_recording_copies_the_batch_and_the_tangent_into_the_pool_once(reduce_overhead):
    copies = [e for e in reduce_overhead.events if e.action == "alloc" and e.stream != 0 and e.iteration == 1
              and e.op == "empty_strided" and e.nbytes == 16 * MiB]
    assert len(copies) == 2
    held = {e.block for e in copies}
    assert not any(e.action == "free" and e.block in held for e in reduce_overhead.events)


def test_the_pool_holds_the_hand_derived_segments_for_the_programs_life(reduce_overhead):
    events = reduce_overhead.events
    first_recording = next(i for i, e in enumerate(events) if e.iteration == 1)
    assert pool_reserved(events[:first_recording]) == (3 * 64 + 16 + 2) * MiB  # after the warm-up
    ops = pool_only(events)
    result = simulate(ops, timeline_points=len(ops) + 3)
    assert result.peak_reserved == result.final_reserved == (4 * 64 + 16 + 2) * MiB


# ---- a second batch size: compiled_models.py --model swish --batches ... ---------------------------------------------
# the swish model above with batches of 4096 and 8192 rows in the order below (dynamo's automatic dynamic). At 4096 rows
# the forward allocates h (16 MiB), y (16 MiB) and the output (4 MiB), the backward W_down's gradient (1 MiB: small),
# dy (16), dh (16) and W_up's gradient (1 MiB); at 8192 rows 32, 32, 8 and 1, 32, 32, 1. The recording copies the
# batch (4 or 8 MiB) and the backward's tangent (the same) into the pool and holds them.
SHAPES = [4096, 4096, 8192, 8192, 4096, 8192, 4096, 4096]


@pytest.fixture(scope="module")
def two_shapes():
    result = run_trace([sys.executable, str(SCRIPT), "--model", "swish", "--compile", "module", "--mode",
                        "reduce-overhead", "--batches", ",".join(map(str, SHAPES))], iterations=7)
    assert result.iterations == 7
    return result


def test_each_batch_size_is_its_own_function_of_the_tree_warmed_up_recorded_then_replayed(two_shapes):
    # dynamo compiles 4096 statically (graph S), recompiles at 8192 with a symbolic batch (graph D) and, D's guard
    # matching every size, runs 4096 through D too; D is one tree function per batch size (cudagraphify_impl's
    # fn_cache keyed by its int inputs): S warms up in step 0, records in 1; D at 8192 warms up in 2, records in 3,
    # replays in 5; D at 4096 warms up in 4 and records in 6 (before, 8192 was replayed into the 4096-row copy of
    # the batch and the trace ended on the program: a size mismatch, exit 5)
    assert two_shapes.warnings == []
    warm_up = [("allocate", "allocate")]  # forward, backward: each run in the pool
    record = [("allocate", "capture", "allocate", "capture")]  # each: its input copy, then its capture
    by_step: dict[int, list[str]] = {}
    for step, what in pool_windows(two_shapes)[1:]:  # after the keeper's empty capture
        by_step.setdefault(step, []).append(what)
    assert [tuple(by_step[step]) for step in range(7)] == (warm_up + record + warm_up + record + warm_up + warm_up
                                                           + record)


def test_the_pool_grows_for_the_second_size_once_and_holds_both_recordings(two_shapes):
    # through the caching allocator's best fit (large blocks of 10 MiB or more rounded to 2 MiB, smaller ones cut
    # from a 20 MiB segment, 1 MiB from a 2 MiB small one):
    # - step 0 (S warms up): h, y take a 16 MiB segment each, the output a 20 MiB one; backward's gradients a 2 MiB
    #   small segment, dy y's freed block, dh 16 of the 20 (the output freed): 16 + 16 + 20 + 2 = 54 MiB;
    # - step 1 (S records): the batch's copy cuts 4 from a 16 (12 left), the captured h and y take the other 16 and
    #   the 20's first 16, the output the 20's last 4; the tangent's copy that 4 again (the output freed), dy y's
    #   block, and dh finds no free 16 MiB run: a fifth segment, 70 MiB;
    # - step 2 (D warms up at 8192): h, y and dh (32 MiB each) find no free 32 MiB run in segments of 16 and 20:
    #   three new segments; the 8 MiB output and the gradients fit freed blocks: 70 + 3 x 32 = 166 MiB;
    # - the recordings of 8192 and 4096 and the warm-up of 4096 fit the pool as it is (the held copies of 8 MiB in
    #   freed 16 MiB blocks): it stays at 166 MiB for the program's life.
    events = two_shapes.events
    before = [next(i for i, e in enumerate(events) if e.iteration >= step) for step in (1, 2, 3)]
    assert [pool_reserved(events[:cut]) for cut in before] == [54 * MiB, 70 * MiB, 166 * MiB]
    ops = pool_only(events)
    result = simulate(ops, timeline_points=len(ops) + 3)
    assert result.peak_reserved == result.final_reserved == 166 * MiB
    held = [e.nbytes for e in events if e.action == "alloc" and e.stream != 0 and e.op == "empty_strided"
            and e.iteration in (1, 3, 6) and e.nbytes in (4 * MiB, 8 * MiB)]
    assert held == [4 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 4 * MiB, 4 * MiB]  # batch, tangent: one pair per recording
    freed = {e.block for e in events if e.action == "free"}
    assert not any(e.block in freed for e in events if e.action == "alloc" and e.stream != 0
                   and e.op == "empty_strided" and e.iteration in (1, 3, 6) and e.nbytes in (4 * MiB, 8 * MiB))
