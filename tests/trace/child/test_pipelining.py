"""Pipeline parallelism (torch.distributed.pipelining) traced rank by rank, from tests/scripts/pp_stages.py under
torchrun (one stage per rank; the first holds the embedding, the last the norm and head). Upstream's rules pinned:
- schedules.py `_PipelineSchedule._warmup_p2p` refuses dynamic shape inference over a fake process group (exit 5
  before): the traced rank now answers, and says which stages the pipeline has and what it sent on;
- Schedule1F1B (`_step_microbatches`): stage i runs num_stages - i forwards before its first backward, so the first
  stage holds the most microbatches' activations, the last one; ScheduleGPipe runs every forward first, so every
  stage holds them all;
- the estimate traces each stage's rank, in stage order, handing it the shapes its input stage sent, and answers
  with the fullest, named."""

import json
import os
import subprocess
import sys

import pytest

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import by_category, walk
from xmem import rank_traces
from xmem.estimate import estimate
from xmem.trace import run_trace
from xmem.trace.errors import TraceError
from xmem.trace.events import ActivationMeta, Category

pytestmark = pytest.mark.usefixtures("warm_tracer")

SCRIPT = str(SCRIPTS / "pp_stages.py")
# 4 stages, 8 microbatches of 2: more microbatches than stages, so 1F1B's warm-up differs from GPipe's; a vocabulary
# as small as the model's width, so that the head's logits do not drown the blocks' activations
FOUR = ["--microbatches", "8", "--batch", "16", "--vocab", "128"]
MICRO, SEQ, DIM = 2, 64, 128  # the activation between stages: (batch / microbatches, seq, dim), fp32


def command(stages: int, schedule: str, *more: str) -> list[str]:
    return ["torchrun", f"--nproc_per_node={stages}", SCRIPT, "--schedule", schedule, *more]


def trace_every_stage(stages: int, schedule: str, *more: str) -> dict[int, rank_traces.Traces]:
    """Each stage's rank traced as the estimate traces them (rank_traces.trace_stages over run_trace)."""
    def trace_rank(more_env):
        return {"sm80+": run_trace(command(stages, schedule, *more), iterations=2, python=sys.executable,
                                   env={**os.environ, **more_env})}
    return rank_traces.trace_stages(trace_rank({}), trace_rank)


def stage_parameter_bytes(stages: int, *more: str) -> dict[int, int]:
    """Each stage's parameter bytes as pp_stages.py builds its part on the host (no tracing)."""
    printed = subprocess.run([sys.executable, SCRIPT, "--print-stage-bytes", "1", *more], check=True, text=True,
                             capture_output=True, env={**os.environ, "WORLD_SIZE": str(stages)}).stdout
    return {int(words[1]): int(words[2]) for words in map(str.split, printed.splitlines())}


def held_at_end(trace, category: str) -> int:
    live = {}
    for _, live in walk(trace):
        pass
    return sum(by_category(live).get(category, []))


def peak_of(trace, category: str) -> int:
    """The most bytes of `category` live at once during the training steps."""
    return max((sum(e.nbytes for e in live.values() if e.category == category)
                for event, live in walk(trace) if event.iteration >= 0), default=0)


def most_in_flight(trace) -> int:
    """The most microbatches whose forward a stage holds at once during the steps: each stage has one block
    (pp_stages.py --layers 4 over 4 stages), whose GELU output is saved for backward once per microbatch."""
    return max(sum(1 for e in live.values() if e.op == "gelu") for event, live in walk(trace) if event.iteration >= 0)


@pytest.fixture(scope="module")
def one_f_one_b():
    return trace_every_stage(4, "1f1b", *FOUR)


@pytest.fixture(scope="module")
def gpipe():
    return trace_every_stage(4, "gpipe", *FOUR)


def test_rank_zero_of_a_dynamic_pipeline_answers_and_notes_its_stages():
    trace = run_trace(command(2, "1f1b"), iterations=2, python=sys.executable)
    assert trace.iterations == 2
    pipeline = trace.pipeline
    assert pipeline.schedule == "Schedule1F1B"
    assert pipeline.stage_ranks == (0, 1) and pipeline.own_stages == (0,)
    # what stage 0 sent stage 1: one (microbatch, seq, dim) fp32 activation that requires grad (pp_stages' defaults:
    # batch 8 in 4 microbatches)
    assert pipeline.sent == {1: (ActivationMeta((2, 64, 128), (64 * 128, 128, 1), "float32", True),)}
    assert pipeline.assumed == {}


def test_each_stage_holds_its_own_parameters(one_f_one_b):
    built = stage_parameter_bytes(4, *FOUR)
    held = {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in one_f_one_b.items()}
    assert held == built
    assert built[0] != built[1] != built[3]  # the embedding's and the head's stages differ from the middle ones


def test_every_stage_rank_is_traced_in_stage_order_with_the_shapes_it_receives(one_f_one_b):
    assert list(one_f_one_b) == [0, 1, 2, 3]
    for rank, traces in one_f_one_b.items():
        pipeline = traces["sm80+"].pipeline
        assert pipeline.own_stages == (rank,) and pipeline.assumed == {}
        sent = {rank + 1: (ActivationMeta((MICRO, SEQ, DIM), (SEQ * DIM, DIM, 1), "float32", True),)}
        assert pipeline.sent == (sent if rank < 3 else {})


def test_under_1f1b_the_first_stage_holds_more_microbatches_than_the_last(one_f_one_b, gpipe):
    """Schedule1F1B._step_microbatches: stage i runs min(microbatches, stages - i) forwards before its first backward,
    then one backward before each forward: at most 4, 3, 2, 1 microbatches in flight on stages 0..3. ScheduleGPipe
    runs all 8 forwards first on every stage."""
    assert {rank: most_in_flight(traces["sm80+"]) for rank, traces in one_f_one_b.items()} == {0: 4, 1: 3, 2: 2, 3: 1}
    assert {rank: most_in_flight(traces["sm80+"]) for rank, traces in gpipe.items()} == {0: 8, 1: 8, 2: 8, 3: 8}
    first, last = one_f_one_b[0]["sm80+"], one_f_one_b[3]["sm80+"]
    assert peak_of(first, Category.ACTIVATION) > peak_of(last, Category.ACTIVATION)


def test_the_estimate_is_the_fullest_stage_and_names_its_rank():
    """2 stages of pp_stages.py's defaults: the last holds the head (2048 x 128) and its logits, the fullest."""
    said: list[str] = []
    answer = estimate(command(2, "1f1b"), gpus=["H100"], iterations=2, python=sys.executable, on_progress=said.append)
    assert "tracing rank 1 (pipeline stage 1 of 2)" in said
    peaks = answer.rank_peaks
    assert sorted(peaks) == [0, 1]
    assert answer.fullest_rank == max(peaks, key=peaks.get) == 1
    assert answer.gpus[answer.breakdown_gpu].peak_bytes == peaks[answer.fullest_rank]
    assert answer.rank_stages == {0: (0,), 1: (1,)}
    assert f"the figures are rank {answer.fullest_rank}'s (stage {answer.fullest_rank})" in answer.warnings[0]
    as_json = json.loads(json.dumps(answer.to_json()))
    assert as_json["fullest_rank"] == answer.fullest_rank
    assert {int(rank): peak for rank, peak in as_json["rank_peaks"].items()} == peaks


def test_static_shapes_need_no_inference_and_hold_the_same_parameters():
    """PipelineStage given input_args and output_args (requiring grad, so that gradients travel back): upstream's
    static mode, no shapes exchanged; every stage's rank is still traced."""
    traced = trace_every_stage(2, "gpipe", "--static", "1")
    built = stage_parameter_bytes(2)
    assert {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in traced.items()} == built
    assert traced[0]["sm80+"].pipeline.sent == {}  # nothing sent: static mode exchanges no metadata


def test_with_fsdp_the_stages_of_rank_zeros_pipeline_group_are_traced_once_each():
    """A (pp 2, dp 2) mesh over 4 ranks, each stage fully_shard'ed over "dp": rank 0's pipeline group is ranks 0 and
    2 (the mesh's "pp" column), ranks 1 and 3 are their data-parallel replicas, not traced. Each traced rank holds
    half its stage's parameters (fully_shard's dim-0 chunks; every dim 0 here is even)."""
    traced = trace_every_stage(4, "1f1b", "--dp", "2")
    assert list(traced) == [0, 2]
    assert traced[0]["sm80+"].pipeline.stage_ranks == (0, 2)
    assert traced[2]["sm80+"].pipeline.own_stages == (1,)
    built = stage_parameter_bytes(4, "--dp", "2")
    held = {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in traced.items()}
    assert held == {0: built[0] // 2, 2: built[1] // 2}


def test_an_interleaved_schedule_traces_each_rank_of_its_looped_stages():
    """ScheduleInterleaved1F1B, 2 ranks x 2 stages: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Rank 0,
    traced first, cannot have stage 1's output (rank 1's) for its stage 2: it assumes what its stage 0 sent, which
    is what rank 1's stage 1 then sends (one activation shape through the model): no second trace of rank 0."""
    traced = trace_every_stage(2, "interleaved", "--stages-per-rank", "2")
    assert list(traced) == [0, 1]
    zero, one = traced[0]["sm80+"].pipeline, traced[1]["sm80+"].pipeline
    assert zero.schedule == "ScheduleInterleaved1F1B" and zero.stage_ranks == (0, 1, 0, 1)
    assert zero.own_stages == (0, 2) and one.own_stages == (1, 3)
    assert zero.assumed == {2: one.sent[2]} and one.assumed == {}
    built = stage_parameter_bytes(2, "--stages-per-rank", "2")
    held = {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in traced.items()}
    assert held == {0: built[0] + built[2], 1: built[1] + built[3]}


def test_a_v_schedule_traces_each_rank_of_its_two_stages():
    """ScheduleZBVZeroBubble, 2 ranks: rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and
    2, which pass their activation within the rank (upstream's same-rank path, no shapes exchanged)."""
    traced = trace_every_stage(2, "zbv", "--stages-per-rank", "2")
    zero, one = traced[0]["sm80+"].pipeline, traced[1]["sm80+"].pipeline
    assert zero.schedule == "ScheduleZBVZeroBubble" and zero.stage_ranks == (0, 1, 1, 0)
    assert zero.own_stages == (0, 3) and one.own_stages == (1, 2)
    assert set(zero.sent) == {1} and set(one.sent) == {3}  # each rank sends across once, forward
    assert zero.assumed == {3: one.sent[3]}
    built = stage_parameter_bytes(2, "--stages-per-rank", "2")
    held = {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in traced.items()}
    assert held == {0: built[0] + built[3], 1: built[1] + built[2]}


def test_a_wrong_assumed_shape_is_not_modelled_not_the_users_error():
    """--grow widens the activation after every stage: rank 0's stage 2 takes what rank 1's stage 1 sends, wider
    than what rank 0's stage 0 sent, which it assumed: exit 11 naming the stage, never exit 5."""
    with pytest.raises(TraceError) as raised:
        run_trace(command(2, "interleaved", "--stages-per-rank", "2", "--grow", "32"), iterations=2,
                  python=sys.executable)
    assert raised.value.kind == "not_modelled"
    assert "the input shapes of pipeline stage 2" in raised.value.message


def test_the_tracing_frontend_stages_are_traced_each():
    """pipeline() + Pipe.build_stage (upstream's _PipelineStage: shapes from the traced graph, none exchanged): each
    rank holds one block's parameters (128 x 512 + 512 + 512 x 128 + 128 fp32 elements)."""
    def trace_rank(more_env):
        return {"sm80+": run_trace(["torchrun", "--nproc_per_node=2", str(SCRIPTS / "pp_split.py")], iterations=2,
                                   python=sys.executable, env={**os.environ, **more_env})}
    traced = rank_traces.trace_stages(trace_rank({}), trace_rank)
    assert list(traced) == [0, 1]
    assert traced[0]["sm80+"].pipeline.schedule == "ScheduleGPipe"
    block = (128 * 512 + 512 + 512 * 128 + 128) * 4
    assert {rank: held_at_end(traces["sm80+"], Category.PARAMETER) for rank, traces in traced.items()} == \
        {0: block, 1: block}


def test_the_traced_rank_has_its_own_launcher_variables():
    """torchrun --nnodes 2 --nproc_per_node 4, rank 5: the second process of the second node."""
    from xmem.launchers import TRACED_RANK_ENV, launcher_env, parse_launch
    target = parse_launch(["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "train.py"])
    env = launcher_env(target, {TRACED_RANK_ENV: "5"}, 4)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["ROLE_RANK"]) == ("5", "1", "1", "5")
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    assert launcher_env(target, {}, 4)["RANK"] == "0"
