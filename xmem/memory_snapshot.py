"""The simulated run as a PyTorch memory snapshot: what `torch.cuda.memory._dump_snapshot` writes, so that
PyTorch's own viewers (`python -m torch.cuda._memory_viz trace_plot|segment_plot|stats`, pytorch.org/memory_viz)
open it.

Owns the mapping from a `GpuRun` (xmem.pictures) to the snapshot's dict: `segments` (the allocator's state at the
end of the run: each segment with its blocks, active or inactive) and `device_traces` (one list per device of the
allocator's actions: alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap,
oom). Allocations carry their category (parameter, activation...), which the viewer colours by; each action carries
frames as torch's do, innermost first: the traced op behind it (file = the module, function = the ATen op), then,
for an allocation, the program's line that made it (file, line, function: `Trace.sites`, the innermost frame
outside torch and xmem that the tracer saw), then one frame naming the category, phase and iteration. `time_us` is
the op's index in the replay.

One deliberate difference from torch: an alloc/free action's `size` is the block's (rounded) size, not the bytes
asked for (those are in `requested_size`), so that the viewers' active-memory total is `memory_allocated()`, the
figure the estimate reports.
Must not: import torch (the pickle holds plain dicts, lists, ints and strings).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from xmem.pictures import GpuRun
from xmem.simulate.allocator_settings import kSmallBuffer
from xmem.simulate.history import TraceEntry

SEGMENT_START = {"segment_alloc", "segment_map"}
SEGMENT_END = {"segment_free", "segment_unmap"}


def memory_snapshot(run: GpuRun) -> dict[str, Any]:
    """The snapshot dict of `run` (one device: the one replayed; the others' traces are empty)."""
    frames = _frames(run)
    device = run.ops.device
    traces: list[list[dict]] = [[] for _ in range(device + 1)]
    labels = run.ops.labels
    traces[device] = [_trace_entry(entry, frames(entry.op_index), labels[entry.op_index][0])
                      for entry in run.history]
    return {"segments": _segments(run.history, frames, device), "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": run.trace.alloc_conf}}


def write_snapshot(run: GpuRun, path: str | Path) -> None:
    Path(path).write_bytes(pickle.dumps(memory_snapshot(run)))


def _frames(run: GpuRun):
    cache: dict[int, list[dict]] = {}

    def frames(op_index: int) -> list[dict]:
        if op_index not in cache:
            event = run.event_of(op_index)
            category, phase, iteration = run.ops.labels[op_index]
            when = f"iteration {iteration}" if iteration >= 0 else "setup"
            own = [{"filename": event.module or "<no module>", "line": 0, "name": event.op or "<alloc>"}] \
                if event is not None else []
            cache[op_index] = own + _program_frame(run, event) + \
                [{"filename": "xmem", "line": 0, "name": f"{category} ({phase}, {when})"}]
        return cache[op_index]

    return frames


def _program_frame(run: GpuRun, event: Any) -> list[dict]:
    """The program's line behind an allocation, as a frame of torch's form; none for a free or an unknown line."""
    sites = run.trace.sites
    if event is None or not 0 <= event.site < len(sites):
        return []
    filename, line, name = sites[event.site]
    return [{"filename": filename, "line": line, "name": name}]


def _trace_entry(entry: TraceEntry, frames: list[dict], category: str) -> dict[str, Any]:
    out = {"action": entry.action, "addr": entry.addr, "size": entry.size, "stream": entry.stream,
           "time_us": entry.op_index, "frames": frames}
    if entry.action == "oom":
        del out["addr"]
        out["device_free"] = entry.device_free
    elif entry.action in ("alloc", "free_requested", "free_completed"):
        out["requested_size"] = entry.requested
        out["category"] = str(category)  # the viewer colours the active memory timeline by it (a plain str: the
        # pickle must load without xmem)
    return out


def _segments(history: Iterable[TraceEntry], frames, device: int) -> list[dict[str, Any]]:
    """The segments live at the end of `history`, with the blocks allocated in them at the end."""
    whole: dict[int, tuple[int, int]] = {}  # cudaMalloc'd segment addr -> (size, stream)
    mapped: list[list[int]] = []  # expandable segments' mapped ranges [start, end, stream], merged
    live: dict[int, TraceEntry] = {}  # block addr -> its alloc
    for entry in history:
        if entry.action == "segment_alloc":
            whole[entry.addr] = (entry.size, entry.stream)
        elif entry.action == "segment_free":
            whole.pop(entry.addr, None)
        elif entry.action == "segment_map":
            _add_range(mapped, entry.addr, entry.addr + entry.size, entry.stream)
        elif entry.action == "segment_unmap":
            _remove_range(mapped, entry.addr, entry.addr + entry.size)
        elif entry.action == "alloc":
            live[entry.addr] = entry
        elif entry.action == "free_completed":
            live.pop(entry.addr, None)
    ranges = [(addr, size, stream, False) for addr, (size, stream) in whole.items()]
    ranges += [(start, end - start, stream, True) for start, end, stream in mapped]
    blocks = sorted(live.values(), key=lambda e: e.addr)
    return [_segment(addr, size, stream, expandable, [b for b in blocks if addr <= b.addr < addr + size],
                     frames, device) for addr, size, stream, expandable in sorted(ranges)]


def _segment(addr: int, size: int, stream: int, expandable: bool, allocated: list[TraceEntry], frames,
             device: int) -> dict[str, Any]:
    blocks, cursor = [], addr
    for b in allocated:
        if b.addr > cursor:
            blocks.append(_free_block(cursor, b.addr - cursor))
        blocks.append({"address": b.addr, "size": b.size, "requested_size": b.requested, "state": "active_allocated",
                       "frames": frames(b.op_index)})
        cursor = b.addr + b.size
    if cursor < addr + size:
        blocks.append(_free_block(cursor, addr + size - cursor))
    in_use = sum(b.size for b in allocated)
    return {"device": device, "address": addr, "total_size": size, "stream": stream,
            "segment_type": "small" if size == kSmallBuffer and not expandable else "large",
            "segment_pool_id": (0, 0), "is_expandable": expandable, "allocated_size": in_use,
            "active_size": in_use, "requested_size": sum(b.requested for b in allocated), "frames": [],
            "blocks": blocks}


def _free_block(addr: int, size: int) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": 0, "state": "inactive", "frames": []}


def _add_range(ranges: list[list[int]], start: int, end: int, stream: int) -> None:
    ranges.append([start, end, stream])
    ranges.sort()
    merged = [ranges[0]]
    for r in ranges[1:]:
        if r[0] <= merged[-1][1] and r[2] == merged[-1][2]:
            merged[-1][1] = max(merged[-1][1], r[1])
        else:
            merged.append(r)
    ranges[:] = merged


def _remove_range(ranges: list[list[int]], start: int, end: int) -> None:
    kept = []
    for lo, hi, stream in ranges:
        kept += [[lo, min(hi, start), stream]] if lo < start else []
        kept += [[max(lo, end), hi, stream]] if hi > end else []
    ranges[:] = [r for r in kept if r[0] < r[1]]


__all__ = ["memory_snapshot", "write_snapshot"]
