"""Replay an alloc/free sequence through the allocator model and report peaks, fragmentation and a timeline.

Owns: the op format (`ALLOC`, `FREE`, `EMPTY_CACHE` tuples), checking it, and turning allocator state into a
`SimResult`. The allocator rules live in `allocator.py`.
Must not: do I/O; it is pure and deterministic.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from xmem.simulate.allocator import Block, DeviceCachingAllocator
from xmem.simulate.config import AllocatorConfig
from xmem.simulate.history import HistoryAllocator, TraceEntry
from xmem.simulate.result import OomInfo, SimResult, downsample_timeline, oom_message

ALLOC = 0
FREE = 1
EMPTY_CACHE = 2


def simulate(
    ops: Iterable[tuple[int, int, int, int]],
    config: AllocatorConfig = AllocatorConfig(),
    capacity: int | None = None,
    timeline_points: int = 2000,
    device_total: int | None = None,
    history: list[TraceEntry] | None = None,
) -> SimResult:
    """Replay `(action, block, nbytes, stream)` ops on one device; stop at the first out-of-memory.

    `block` is the caller's id of an allocation: a FREE names the id its ALLOC used (its nbytes and stream are
    ignored). An ALLOC of 0 bytes makes no block (torch returns a null pointer) but its FREE is accepted.
    `capacity` is what cudaMalloc can obtain on the device (None = unlimited; zero or less, as when overheads
    exceed the device, lets no allocation succeed). `device_total` is the device's whole memory, of which a
    memory fraction is taken (as `set_per_process_memory_fraction` does); `capacity` stands in when it is not
    given. `record_stream` is not modelled:
    a FREE returns the block to its pool at once.
    `history`, if given, receives the allocator's every action (`xmem.simulate.history`), for a memory snapshot.
    """
    if timeline_points < 3:
        raise ValueError(f"timeline_points must be at least 3 (both peaks and the last op), got {timeline_points}")
    allocator = (DeviceCachingAllocator(config, capacity, device_total) if history is None
                 else HistoryAllocator(config, capacity, device_total, history))
    recording = history is not None
    live: dict[int, Block | None] = {}
    stream_index: dict[int, int] = {}
    allocated_at = array("q")
    reserved_at = array("q")
    peak_allocated = peak_reserved = -1
    peak_allocated_index = peak_reserved_index = segments_at_peak = 0
    oom = None
    malloc, free = allocator.malloc, allocator.free
    record_allocated, record_reserved = allocated_at.append, reserved_at.append
    for index, (action, block_id, nbytes, stream) in enumerate(ops):
        if recording:
            allocator.op_index = index
        if action == ALLOC:
            if block_id in live:
                raise ValueError(f"op {index}: ALLOC of block {block_id}, which is already allocated")
            if nbytes > 0:
                s = stream_index.get(stream)
                if s is None:
                    s = stream_index[stream] = len(stream_index)
                block = malloc(nbytes, s)
                if block is None:
                    oom = _oom_info(allocator, index, nbytes)
                live[block_id] = block
            elif nbytes == 0:
                live[block_id] = None
            else:
                raise ValueError(f"op {index}: ALLOC of block {block_id} with negative size {nbytes}")
        elif action == FREE:
            if block_id not in live:
                raise ValueError(f"op {index}: FREE of block {block_id}, which is not allocated "
                                 f"(never allocated, or already freed)")
            block = live.pop(block_id)
            if block is not None:
                free(block)
        elif action == EMPTY_CACHE:
            allocator.empty_cache()
        else:
            raise ValueError(f"op {index}: unknown action {action!r}; expected ALLOC=0, FREE=1 or EMPTY_CACHE=2")
        allocated = allocator.allocated_bytes
        reserved = allocator.total_allocated_memory
        record_allocated(allocated)
        record_reserved(reserved)
        if allocated > peak_allocated:
            peak_allocated, peak_allocated_index = allocated, index
        if reserved > peak_reserved:
            peak_reserved, peak_reserved_index = reserved, index
            segments_at_peak = allocator.num_segments
        if oom is not None:
            break
    return _result(allocator, allocated_at, reserved_at, peak_allocated_index, peak_reserved_index,
                   segments_at_peak, timeline_points, oom)


def _oom_info(allocator: DeviceCachingAllocator, index: int, requested: int) -> OomInfo:
    # an OOM needs a limit: capacity, or a memory fraction of device_total
    capacity = allocator.capacity if allocator.capacity is not None else allocator.device_total
    allocated, reserved = allocator.allocated_bytes, allocator.total_allocated_memory
    message = oom_message(allocator.last_oom_alloc_size, allocator.device_total, capacity - reserved, allocated,
                          reserved, allocator.allowed_memory_maximum)
    return OomInfo(index=index, requested=requested, allocated=allocated, reserved=reserved, capacity=capacity,
                   message=message)


def _result(allocator: DeviceCachingAllocator, allocated_at: array, reserved_at: array, peak_allocated_index: int,
            peak_reserved_index: int, segments_at_peak: int, timeline_points: int, oom: OomInfo | None) -> SimResult:
    if not allocated_at:
        return SimResult(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, (), None)
    peak_allocated = allocated_at[peak_allocated_index]
    peak_reserved = reserved_at[peak_reserved_index]
    at_peak_allocated = allocated_at[peak_reserved_index]
    fragmentation = (peak_reserved - at_peak_allocated) / peak_reserved if peak_reserved else 0.0
    keep = (peak_allocated_index, peak_reserved_index, len(allocated_at) - 1)
    at_peak = [i for i in range(peak_reserved_index, len(reserved_at)) if reserved_at[i] == peak_reserved]
    return SimResult(
        peak_allocated=peak_allocated,
        peak_allocated_index=peak_allocated_index,
        peak_reserved=peak_reserved,
        peak_reserved_index=peak_reserved_index,
        fullest_peak_index=max(at_peak, key=allocated_at.__getitem__),
        fragmentation_at_peak=fragmentation,
        final_allocated=allocator.allocated_bytes,
        final_reserved=allocator.total_allocated_memory,
        num_segments_at_peak=segments_at_peak,
        num_alloc_retries=allocator.num_alloc_retries,
        num_ooms=allocator.num_ooms,
        timeline=downsample_timeline(allocated_at, reserved_at, timeline_points, keep),
        oom=oom,
    )
