"""Replay an alloc/free sequence through the allocator model and report peaks, fragmentation and a timeline.

Owns: the op format (`ALLOC`, `FREE`, `EMPTY_CACHE`, and for CUDA graphs `BEGIN_POOL`, `END_POOL`, `RELEASE_POOL`
tuples), checking it, and turning allocator state into a
`SimResult`. The allocator rules live in `allocator.py`.
Must not: do I/O; it is pure and deterministic.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from xmem.simulate.allocator import Block, DeviceCachingAllocator
from xmem.simulate.allocator_settings import AllocatorConfig
from xmem.simulate.history import HistoryAllocator, TraceEntry
from xmem.simulate.result import OomInfo, SimResult, downsample_timeline, oom_message

ALLOC = 0
FREE = 1
EMPTY_CACHE = 2
# A CUDA graph's private pool (`block` is the pool's id): a capture starts recording the allocations on `stream`
# into it (CUDAGraph::capture_begin), stops (capture_end), and the graph is reset or deleted (its releasePool).
BEGIN_POOL = 3
END_POOL = 4
RELEASE_POOL = 5
# An ALLOC on this stream is CUDA managed memory (cudaMallocManaged: bitsandbytes' paged optimizer state), which the
# caching allocator never sees: its bytes count beside the allocator's reserved bytes as device memory the job
# holds, unrounded, and never take a segment; the device's limit does not refuse them (the driver pages managed
# memory out to the host under pressure rather than fail), so a job may need more than its GPU without an OOM.
MANAGED = -1


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
    ignored). BEGIN_POOL, END_POOL and RELEASE_POOL name a CUDA graph's pool by `block` (BEGIN_POOL: the capture
    records the ALLOCs on `stream`; their nbytes is 0). An ALLOC of 0 bytes makes no block (torch returns a null
    pointer) but its FREE is accepted.
    `capacity` is what cudaMalloc can obtain on the device (None = unlimited; zero or less, as when overheads
    exceed the device, lets no allocation succeed). `device_total` is the device's whole memory, of which a
    memory fraction is taken (as `set_per_process_memory_fraction` does); `capacity` stands in when it is not
    given. An ALLOC on stream MANAGED is managed memory: the allocated and reserved figures are the allocator's
    plus the managed bytes live. `record_stream` is not modelled:
    a FREE returns the block to its pool at once.
    `history`, if given, receives the allocator's every action (`xmem.simulate.history`), for a memory snapshot.
    """
    if timeline_points < 3:
        raise ValueError(f"timeline_points must be at least 3 (both peaks and the last op), got {timeline_points}")
    allocator = (DeviceCachingAllocator(config, capacity, device_total) if history is None
                 else HistoryAllocator(config, capacity, device_total, history))
    replay = _Replay(allocator, recording=history is not None)
    replay.run(ops if isinstance(ops, list) else list(ops))
    return replay.result(timeline_points)


def simulate_limits(ops: list[tuple[int, int, int, int]], config: AllocatorConfig,
                    limits: Iterable[tuple[int, int]], timeline_points: int = 2000
                    ) -> tuple[SimResult, dict[tuple[int, int], SimResult]]:
    """The replay of `ops` without a limit, and under each `(capacity, device_total)` of `limits` what
    `simulate(ops, config, capacity=..., device_total=...)` gives, with the work they share done once.

    Without a memory fraction and expandable segments a limit is read only at cudaMalloc (reserved + the new
    segment must fit the capacity), so a limited replay is op for op the unlimited one until the first op after
    which the unlimited replay reserves more than the capacity: each limited replay starts from a copy of the
    unlimited allocator's state just before that op (limits it never passes get the unlimited result).
    """
    if config.memory_fraction is not None or config.expandable_segments:
        raise ValueError("simulate_limits: only without a memory fraction and expandable segments")
    unlimited = _Replay(DeviceCachingAllocator(config))
    unlimited.run(ops)
    whole = unlimited.result(timeline_points)
    results = {}
    prefix = _Replay(DeviceCachingAllocator(config))
    for (capacity, device_total), index in _first_ops_above(unlimited.reserved_at, set(limits)):
        if index is None:
            results[capacity, device_total] = whole
            continue
        prefix.run(ops, stop=index)
        limited = prefix.fork(capacity, device_total)
        limited.run(ops, start=index)
        results[capacity, device_total] = limited.result(timeline_points)
    return whole, results


def _first_ops_above(reserved_at: array, limits: set[tuple[int, int]]) -> list[tuple[tuple[int, int], int | None]]:
    """Each limit with the index of the first op after which `reserved_at` exceeds its capacity (None: never),
    in the order of those indices."""
    found: list[tuple[tuple[int, int], int | None]] = []
    pending = sorted(limits)
    for index, reserved in enumerate(reserved_at):
        while pending and reserved > pending[0][0]:
            found.append((pending.pop(0), index))
        if not pending:
            break
    return found + [(limit, None) for limit in pending]


class _Replay:
    """One replay in progress: the allocator, the live blocks by the caller's id, and the per-op figures."""

    def __init__(self, allocator: DeviceCachingAllocator, recording: bool = False) -> None:
        self.allocator = allocator
        self.recording = recording
        self.live: dict[int, Block | None] = {}
        self.stream_index: dict[int, int] = {}
        self.allocated_at = array("q")
        self.reserved_at = array("q")
        self.peak_allocated = self.peak_reserved = -1
        self.peak_allocated_index = self.peak_reserved_index = self.segments_at_peak = 0
        self.oom: OomInfo | None = None
        self.next_index = 0
        self.managed = 0  # bytes of managed memory live

    def fork(self, capacity: int | None, device_total: int | None) -> _Replay:
        """This replay's state so far, continued under another limit (see `DeviceCachingAllocator.clone`)."""
        allocator, copies = self.allocator.clone(capacity, device_total)
        twin = _Replay(allocator)
        twin.live = {block_id: copies[block] if isinstance(block, Block) else block
                     for block_id, block in self.live.items()}
        twin.stream_index = dict(self.stream_index)
        twin.allocated_at, twin.reserved_at = array("q", self.allocated_at), array("q", self.reserved_at)
        for name in ("peak_allocated", "peak_reserved", "peak_allocated_index", "peak_reserved_index",
                     "segments_at_peak", "next_index", "managed"):
            setattr(twin, name, getattr(self, name))
        return twin

    def run(self, ops: list[tuple[int, int, int, int]], start: int | None = None, stop: int | None = None) -> None:
        """Replay `ops[start:stop]` (from where the replay is by default); stop at the first out-of-memory."""
        allocator, live, stream_index = self.allocator, self.live, self.stream_index
        recording = self.recording
        malloc, free = allocator.malloc, allocator.free
        record_allocated, record_reserved = self.allocated_at.append, self.reserved_at.append
        peak_allocated, peak_reserved = self.peak_allocated, self.peak_reserved
        managed = self.managed
        start = self.next_index if start is None else start
        index = start - 1
        for index in range(start, len(ops) if stop is None else stop):
            action, block_id, nbytes, stream = ops[index]
            if recording:
                allocator.op_index = index
            if action == ALLOC:
                if block_id in live:
                    raise ValueError(f"op {index}: ALLOC of block {block_id}, which is already allocated")
                if stream == MANAGED and nbytes > 0:
                    managed += nbytes
                    live[block_id] = _Managed(nbytes)
                elif nbytes > 0:
                    s = stream_index.get(stream)
                    if s is None:
                        s = stream_index[stream] = len(stream_index)
                    block = malloc(nbytes, s)
                    if block is None:
                        self.oom = _oom_info(allocator, index, nbytes)
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
                if type(block) is _Managed:
                    managed -= block.nbytes
                elif block is not None:
                    free(block)
            elif action == EMPTY_CACHE:
                allocator.empty_cache()
            elif action in _POOL_ACTIONS:
                self._pool_op(index, action, block_id, stream)
            else:
                raise ValueError(f"op {index}: unknown action {action!r}; expected ALLOC=0, FREE=1, EMPTY_CACHE=2, "
                                 f"BEGIN_POOL=3, END_POOL=4 or RELEASE_POOL=5")
            allocated = allocator.allocated_bytes + managed
            reserved = allocator.total_allocated_memory + managed
            record_allocated(allocated)
            record_reserved(reserved)
            if allocated > peak_allocated:
                peak_allocated, self.peak_allocated_index = allocated, index
            if reserved > peak_reserved:
                peak_reserved, self.peak_reserved_index = reserved, index
                self.segments_at_peak = allocator.num_segments
            if self.oom is not None:
                break
        self.peak_allocated, self.peak_reserved = peak_allocated, peak_reserved
        self.managed = managed
        self.next_index = index + 1

    def _pool_op(self, index: int, action: int, pool_id: int, stream: int) -> None:
        """A CUDA graph's pool op; its stream is numbered as ALLOCs number theirs, so that the capture's filter
        meets the allocations on it."""
        try:
            if action == BEGIN_POOL:
                s = self.stream_index.setdefault(stream, len(self.stream_index))
                self.allocator.begin_allocate_to_pool(pool_id, s)
            elif action == END_POOL:
                self.allocator.end_allocate_to_pool(pool_id)
            else:
                self.allocator.release_pool(pool_id)
        except ValueError as error:
            raise ValueError(f"op {index}: {error}") from None

    def result(self, timeline_points: int) -> SimResult:
        return _result(self.allocator, self.allocated_at, self.reserved_at, self.peak_allocated_index,
                       self.peak_reserved_index, self.segments_at_peak, timeline_points, self.oom, self.managed)


_POOL_ACTIONS = (BEGIN_POOL, END_POOL, RELEASE_POOL)


class _Managed:
    """A live managed allocation (not a Block: the caching allocator never had it)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _oom_info(allocator: DeviceCachingAllocator, index: int, requested: int) -> OomInfo:
    # an OOM needs a limit: capacity, or a memory fraction of device_total
    capacity = allocator.capacity if allocator.capacity is not None else allocator.device_total
    allocated, reserved = allocator.allocated_bytes, allocator.total_allocated_memory
    message = oom_message(allocator.last_oom_alloc_size, allocator.device_total, capacity - reserved, allocated,
                          reserved, allocator.allowed_memory_maximum)
    return OomInfo(index=index, requested=requested, allocated=allocated, reserved=reserved, capacity=capacity,
                   message=message)


def _result(allocator: DeviceCachingAllocator, allocated_at: array, reserved_at: array, peak_allocated_index: int,
            peak_reserved_index: int, segments_at_peak: int, timeline_points: int, oom: OomInfo | None,
            managed: int = 0) -> SimResult:
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
        final_allocated=allocator.allocated_bytes + managed,
        final_reserved=allocator.total_allocated_memory + managed,
        num_segments_at_peak=segments_at_peak,
        num_alloc_retries=allocator.num_alloc_retries,
        num_ooms=allocator.num_ooms,
        timeline=downsample_timeline(allocated_at, reserved_at, timeline_points, keep),
        oom=oom,
    )
