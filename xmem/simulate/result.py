"""What a replay reports: `SimResult` (peaks, fragmentation, timeline) and `OomInfo` (the first out-of-memory).

Owns: the two frozen records, torch's `format_size` and OOM message wording, and the timeline down-sampling.
Must not: run the allocator (that is `allocator.py`) or do any I/O.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class OomInfo:
    """The allocation that failed; the replay stops there, as the real job would crash."""

    index: int  # op index of the failing ALLOC
    requested: int  # bytes requested (unrounded)
    allocated: int
    reserved: int
    capacity: int
    message: str  # worded like torch's OutOfMemoryError


@dataclass(frozen=True)
class SimResult:
    """Allocator statistics over a replay: `memory_allocated()` / `memory_reserved()` as upstream counts them."""

    peak_allocated: int
    peak_allocated_index: int
    peak_reserved: int
    peak_reserved_index: int
    # among the ops at peak reserved, the one with the most allocated: reserved reaches its peak early (the first
    # time the cache grows that far) and stays there while cached blocks are reused; this op shows what it is for
    fullest_peak_index: int
    fragmentation_at_peak: float  # (reserved - allocated) / reserved at the peak-reserved op
    final_allocated: int
    final_reserved: int
    num_segments_at_peak: int  # cudaMalloc'd segments + expandable segments with pages mapped, at peak reserved
    num_alloc_retries: int
    num_ooms: int
    timeline: tuple[tuple[int, int, int], ...]  # (op index, allocated, reserved), down-sampled
    oom: OomInfo | None


def format_size(size: int) -> str:
    """Upstream `format_size` (CUDACachingAllocator.cpp): bytes, KiB, MiB or GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1024**2:
        return f"{size / 1024:.2f} KiB"
    if size <= 1024**3:
        return f"{size / 1024**2:.2f} MiB"
    return f"{size / 1024**3:.2f} GiB"


def oom_message(alloc_size: int, device_total: int, device_free: int, allocated: int, reserved: int,
                allowed: int | None) -> str:
    """The text of `DeviceCachingAllocator::malloc`'s OutOfMemoryError (device 0, no per-process lines)."""
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
        f"{format_size(max(device_total, 0))} of which {format_size(max(device_free, 0))} is free. {allowed_info}"
        f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
        f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but unallocated "
        f"memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def downsample_timeline(
    allocated: array, reserved: array, points: int, keep: tuple[int, ...]
) -> tuple[tuple[int, int, int], ...]:
    """At most `points` (index, allocated, reserved) samples; `keep` indices always included.

    The ops are cut into equal buckets and each bucket contributes its op of highest allocated memory, so the
    down-sampled curve is the upper envelope a memory plot needs rather than an aliased stride sample.
    """
    n = len(allocated)
    if n == 0:
        return ()
    keep_set = {i for i in keep if 0 <= i < n}
    if n <= points:
        chosen = range(n)
    else:
        buckets = max(points - len(keep_set), 1)
        edges = [int(k * (n / buckets)) for k in range(buckets)] + [n]  # numpy.linspace(0, n, buckets + 1), truncated
        chosen_set = set(keep_set)
        for start, stop in zip(edges[:-1], edges[1:]):
            if stop > start:
                bucket = allocated[start:stop]
                chosen_set.add(start + bucket.index(max(bucket)))  # the first highest, as argmax
        chosen = sorted(chosen_set)
    return tuple((i, allocated[i], reserved[i]) for i in chosen)
