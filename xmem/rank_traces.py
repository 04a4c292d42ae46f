"""The ranks of a job that can differ, traced one each, and the answer that is the fullest of them.

A trace runs one rank (rank 0: `xmem.launchers`). Data-parallel replicas (DDP, FSDP, ZeRO over even shards) hold
alike and are traced once. Pipeline stages do not: the first holds the embedding and, under 1F1B, the most
microbatches in flight; the last the head and the loss. Where rank 0's trace reports that a pipeline schedule ran
(`Trace.pipeline`, `xmem.trace.child.pipelining`), the rank holding each other stage of its pipeline group is traced
too (other pipeline groups are data-parallel replicas of this one), in stage order, each handed the activation
shapes its input stages' ranks sent (`launchers.PIPELINE_INPUTS_ENV`). A rank whose stage's input shapes were not
known yet when it ran (an interleaved schedule's rank 0 holds stage P, fed by the last rank) assumed them; where the
producing rank then sent others, that rank is traced again with the real ones.

Ranks part too where the program tests the rank it reads (`Trace.rank_tests`, `xmem.trace.child.rank_reads`):
`if rank == 0:` evaluation, checkpoint gathering or logging (`barrier()` after it holds the others back, not their
memory), the remainder of a split handed to the last rank. Then the last rank is traced besides rank 0 (and any
stage's rank): rank 0 is the one such tests single out most, the last the other end of every split by rank; the
ranks between run as one of the two unless the program singles them out by number, which a few traced iterations
cannot tell apart. A program that reads its rank and never tests it (a device index, a sampler's argument) costs
no second trace, nor do uneven shards: upstream's cuts give rank 0 the largest part (the child module says why).

The answer, per GPU type, is the estimate of the rank that needs the most there (`fullest`), and it names that rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

from xmem.estimate_record import Estimate, GpuEstimate, shown_gpu
from xmem.launchers import PIPELINE_INPUTS_ENV, TRACED_RANK_ENV
from xmem.trace.events import ActivationMeta, PipelineRun, Trace
from xmem.trace.wire import Note, NoteKind

Traces = dict[str, Trace]  # by capability class, as xmem.estimate traces a rank
TraceRank = Callable[[Mapping[str, str]], Traces]  # the job's traces with these variables added to its environment


def pipeline_of(traces: Traces) -> PipelineRun | None:
    """The pipeline a rank's traces report (its first trace's: the classes run the same schedule)."""
    return next(iter(traces.values())).pipeline


def trace_stages(first: Traces, trace_rank: TraceRank,
                 on_progress: Callable[[str], None] | None = None) -> dict[int, Traces]:
    """Every rank that holds a stage of rank 0's pipeline, traced (rank 0's are `first`), by global rank; `first`
    alone where no pipeline ran. `on_progress` hears which rank is traced next."""
    pipeline = pipeline_of(first)
    traced: dict[int, Traces] = {0: first}
    if pipeline is None:
        return traced
    say = on_progress or (lambda line: None)
    for rank in _ranks_in_stage_order(pipeline):
        if rank not in traced:
            held = [stage for stage, holder in enumerate(pipeline.stage_ranks) if holder == rank]
            say(f"tracing rank {rank} (pipeline {_stages_text(held)} of {len(pipeline.stage_ranks)})")
            traced[rank] = trace_rank(_rank_env(rank, traced))
    for rank in _assumed_wrongly(traced):
        say(f"tracing rank {rank} again, with the shapes its input stages sent")
        traced[rank] = trace_rank(_rank_env(rank, traced))
    return traced


def trace_differing(first: Traces, trace_rank: TraceRank,
                    on_progress: Callable[[str], None] | None = None) -> dict[int, Traces]:
    """Every rank that can need more than rank 0 (whose traces are `first`), traced, by global rank: each pipeline
    stage's (`trace_stages`) and, where the program tests its rank, the last rank."""
    traced = trace_stages(first, trace_rank, on_progress)
    last = _last_rank_if_tested(first)
    if last is not None and last not in traced:
        if on_progress:
            on_progress(f"tracing rank {last} too: the program tests its rank ({_tests_text(first)})")
        traced[last] = trace_rank(_rank_env(last, traced))
    return traced


def _last_rank_if_tested(first: Traces) -> int | None:
    trace = next(iter(first.values()))
    return trace.world_size - 1 if trace.world_size > 1 and trace.rank_tests else None


def _tests_text(first: Traces, shown: int = 2) -> str:
    """'train.py:41, train.py:58 and 3 more': where the program tested its rank, by file name and line."""
    tests = next(iter(first.values())).rank_tests
    named = [f"{os.path.basename(test.rsplit(':', 1)[0])}:{test.rsplit(':', 1)[1]}" for test in tests[:shown]]
    return ", ".join(named) + (f" and {len(tests) - shown} more" if len(tests) > shown else "")


def _stages_text(held: Sequence[int]) -> str:
    """'stage 1', 'stages 0, 2'."""
    return f"stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"


def _ranks_in_stage_order(pipeline: PipelineRun) -> list[int]:
    return list(dict.fromkeys(pipeline.stage_ranks))


def _sent(traced: Mapping[int, Traces]) -> dict[int, tuple[ActivationMeta, ...]]:
    """What every traced rank's stages sent on, by receiving stage."""
    sent: dict[int, tuple[ActivationMeta, ...]] = {}
    for traces in traced.values():
        pipeline = pipeline_of(traces)
        sent.update(pipeline.sent if pipeline else {})
    return sent


def _rank_env(rank: int, traced: Mapping[int, Traces]) -> dict[str, str]:
    inputs = {str(stage): [meta.to_json() for meta in metas] for stage, metas in _sent(traced).items()}
    return {TRACED_RANK_ENV: str(rank), PIPELINE_INPUTS_ENV: json.dumps(inputs)}


def _assumed_wrongly(traced: Mapping[int, Traces]) -> list[int]:
    """The ranks that assumed input shapes other than those their producing stages' ranks then sent."""
    sent = _sent(traced)
    wrong = []
    for rank, traces in traced.items():
        pipeline = pipeline_of(traces)
        if pipeline and any(stage in sent and sent[stage] != metas for stage, metas in pipeline.assumed.items()):
            wrong.append(rank)
    return wrong


def fullest(estimates: Mapping[int, Estimate], traced: Mapping[int, Traces]) -> Estimate:
    """One answer from the estimates of several ranks (by rank; `traced`: their traces): per GPU type the rank that
    runs out of memory first, else needs the most; the breakdown, warnings and audit of the rank shown. With one
    rank, its estimate as it is."""
    if len(estimates) == 1:
        return next(iter(estimates.values()))
    stages = stages_by_rank(traced)
    names = list(next(iter(estimates.values())).gpus)
    by_gpu = {name: max(estimates, key=lambda rank: _need(estimates[rank].gpus[name])) for name in names}
    gpus = {name: estimates[by_gpu[name]].gpus[name] for name in names}
    shown = shown_gpu(list(gpus.values()))
    rank = by_gpu[shown]
    chosen = estimates[rank]
    line = Note(NoteKind.RANKS_TRACED, f"{_why_ranks(traced, stages)}; the figures are rank {rank}'s"
                                       f"{_held_text(stages[rank])}, the fullest on {shown}", rank, shown)
    warnings = dict.fromkeys(w for estimate in estimates.values() for w in estimate.warnings)
    return dataclasses.replace(
        chosen, gpus=gpus, breakdown_gpu=shown, breakdown=estimates[rank].breakdowns.get(shown, chosen.breakdown),
        breakdowns={name: estimates[by_gpu[name]].breakdowns.get(name, {}) for name in names},
        warnings=(line, *warnings), iterations=min(e.iterations for e in estimates.values()),
        seconds=max(e.seconds for e in estimates.values()),
        suspect_reasons=tuple(dict.fromkeys(r for e in estimates.values() for r in e.suspect_reasons)),
        fullest_rank=rank, rank_peaks={r: e.gpus[shown].peak_bytes for r, e in estimates.items()},
        rank_stages={r: tuple(stages[r]) for r in estimates})


def _why_ranks(traced: Mapping[int, Traces], stages: Mapping[int, tuple[int, ...]]) -> str:
    """Why several ranks were traced: each pipeline stage's, the program's tests of its rank, or both."""
    first = traced[0]
    reasons = []
    if any(stages.values()):
        held = {rank: held for rank, held in stages.items() if held}
        reasons.append(f"pipeline parallel: one rank traced per stage ({_ranks_words(held)})")
    if _last_rank_if_tested(first) in traced:
        world = next(iter(first.values())).world_size
        reasons.append(f"ranks can differ: the program tests its rank ({_tests_text(first)}); ranks "
                       f"{', '.join(map(str, sorted(traced)))} of {world} traced")
    return "; ".join(reasons)


def _held_text(held: Sequence[int]) -> str:
    return f" ({_stages_text(held)})" if held else ""


def stages_by_rank(traced: Mapping[int, Traces]) -> dict[int, tuple[int, ...]]:
    """The pipeline stages each traced rank holds."""
    return {rank: pipeline.own_stages if (pipeline := pipeline_of(traces)) else () for rank, traces in traced.items()}


def _need(gpu: GpuEstimate) -> tuple[bool, int]:
    return not gpu.fits, gpu.unlimited_peak_bytes or gpu.peak_bytes


def _ranks_words(stages: Mapping[int, tuple[int, ...]]) -> str:
    return ", ".join(f"rank {rank}: {_stages_text(held)}" for rank, held in sorted(stages.items()))
