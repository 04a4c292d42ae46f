"""The replay behind the pictures of one estimate: one GPU type's run, op by op, with its allocator history.

Owns `GpuRun` (the busiest device's ops on one GPU type, their replay, the allocator's history and the trace event
behind each op), the bytes live per category over the run, and what to say about the op that reached the peak.
The plot (`xmem.report_plots`) and the memory snapshot (`xmem.memory_snapshot`) are drawn from it. The replay is
the estimate's own (`xmem.estimate`: same ops, same allocator settings, same capacity), so its peaks are the
estimate's.
Must not: do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from xmem.estimate import allocator_config, busiest_replay, capability_class
from xmem.gpus import GpuType, overhead_bytes
from xmem.orchestrate import GpuOps, orchestrate, reaches_allocator
from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, SimResult, simulate
from xmem.simulate.history import TraceEntry
from xmem.trace.events import Category, MemEvent, Trace

TIMELINE_POINTS = 3000  # samples of the curves: plenty for a figure a few thousand pixels wide


@dataclass(frozen=True)
class GpuRun:
    """One GPU type's replay of the busiest traced device, kept whole for pictures."""

    gpu: GpuType
    trace: Trace
    ops: GpuOps
    sim: SimResult
    history: list[TraceEntry]
    sources: list[int]  # per op: index of the trace event it comes from (an added workspace: the op that added it)
    overhead: int  # CUDA context + libraries, outside the allocator

    @property
    def capacity(self) -> int:
        return self.gpu.total_bytes - self.overhead

    def event_of(self, op_index: int) -> MemEvent | None:
        source = self.sources[op_index] if 0 <= op_index < len(self.sources) else -1
        return self.trace.events[source] if source >= 0 else None


def gpu_run(traces: Mapping[str, Trace], gpu: GpuType, env: Mapping[str, str]) -> GpuRun:
    """Replay `gpu`'s trace (from `estimate(..., keep_traces=...)`) as the estimate did, with history.

    With several devices the one the estimate reports counts: the first to run out of memory, else the highest
    peak reserved.
    """
    trace = traces[capability_class(gpu.capability)]
    config = allocator_config(trace, env)
    overhead = overhead_bytes(gpu, trace.libraries)
    histories: dict[int, list[TraceEntry]] = {}

    def replay(device: int) -> tuple[GpuOps, SimResult]:
        ops = orchestrate(trace, gpu, env, device=device)
        history = histories.setdefault(device, [])
        return ops, simulate(ops.ops, config, capacity=gpu.total_bytes - overhead, timeline_points=TIMELINE_POINTS,
                             device_total=gpu.total_bytes, history=history)

    ops, sim, device = busiest_replay(trace, replay)
    return GpuRun(gpu, trace, ops, sim, histories[device], op_sources(trace, ops), overhead)


def op_sources(trace: Trace, ops: GpuOps) -> list[int]:
    """The trace event behind each op. Orchestration only inserts ops (workspaces, with block ids above every
    traced one) after the event that caused them, and drops 0-byte requests: the rest map one to one, in order."""
    first_added_block = max((e.block for e in trace.events), default=0) + 1
    replayed = iter([i for i, e in enumerate(trace.events) if reaches_allocator(e, ops.device)])
    sources, last = [], -1
    for action, block, _nbytes, _stream in ops.ops:
        if action == EMPTY_CACHE or block < first_added_block:
            last = next(replayed, -1)
        sources.append(last)
    return sources


def category_curves(run: GpuRun, at: list[int]) -> dict[str, np.ndarray]:
    """Bytes live per category (as requested, before rounding) just after each op index in `at`."""
    ops, labels = run.ops.ops, run.ops.labels
    categories = sorted({label[0] for label in labels})
    column = {name: i for i, name in enumerate(categories)}
    deltas = np.zeros((len(categories), len(ops)), dtype=np.int64)
    size_of: dict[int, tuple[int, int]] = {}  # live block -> (category row, bytes)
    for i, ((action, block, nbytes, _stream), (category, _phase, _iteration)) in enumerate(zip(ops, labels)):
        if action == ALLOC:
            size_of[block] = (column[category], nbytes)
            deltas[column[category], i] = nbytes
        elif action == FREE and block in size_of:
            row, freed = size_of.pop(block)
            deltas[row, i] = -freed
    live = np.cumsum(deltas, axis=1)
    picked = np.asarray(at, dtype=np.int64)
    return {name: live[column[name], picked] for name in categories}


def describe_op(run: GpuRun, op_index: int) -> str:
    """What happened at op `op_index`, for people: the ATen op, its module, phase and iteration."""
    event = run.event_of(op_index)
    category, phase, iteration = run.ops.labels[op_index]
    if event is None:
        return f"{category.replace('_', ' ')} ({phase})"
    what = f"{event.op or 'an allocation'}"
    if category == Category.WORKSPACE and event.category != Category.WORKSPACE:
        what = f"workspace of {what}"
    where = f" in {event.module}" if event.module else ""
    when = f", iteration {iteration}" if iteration >= 0 else ", setup"
    return f"{what}{where} ({phase}{when})"


__all__ = ["GpuRun", "category_curves", "describe_op", "gpu_run", "op_sources"]
