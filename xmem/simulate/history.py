"""The allocator's own history of a replay: what `torch.cuda.memory._record_memory_history` would have recorded.

Owns `HistoryAllocator`, the caching allocator model that also keeps one `TraceEntry` per action it takes (alloc,
free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom), tagged with the
replay op that caused it. It changes no decision: every rule is the parent's. A replay only uses it when a history
is asked for (`simulate(..., history=[])`), so the plain replay keeps its speed.
Must not: do I/O or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmem.simulate.allocator import AllocParams, Block, DeviceCachingAllocator
from xmem.simulate.allocator_settings import AllocatorConfig


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One action of the allocator, as upstream's `TraceEntry` (CUDACachingAllocator.h)."""

    action: str
    addr: int
    size: int  # bytes of the block or segment range (for "oom": the rounded request)
    stream: int
    op_index: int  # the replay op during which it happened
    requested: int = 0  # for alloc/free: the bytes the caller asked for (before rounding)
    device_free: int = 0  # for oom: what the device had left (capacity - reserved; 0 when unlimited)


class HistoryAllocator(DeviceCachingAllocator):
    """`DeviceCachingAllocator` recording each action into `history`; set `op_index` before each op."""

    def __init__(self, config: AllocatorConfig, capacity: int | None, device_total: int | None,
                 history: list[TraceEntry]) -> None:
        super().__init__(config, capacity, device_total)
        self.history = history
        self.op_index = 0
        self._requested: dict[int, int] = {}  # block ptr -> the size asked for, for its free entries

    def _record(self, action: str, addr: int, size: int, stream: int, requested: int = 0, free: int = 0) -> None:
        self.history.append(TraceEntry(action, addr, size, stream, self.op_index, requested, free))

    def malloc(self, orig_size: int, stream: int) -> Block | None:
        block = super().malloc(orig_size, stream)
        if block is None:
            limit = self.capacity if self.capacity is not None else self.device_total
            free = max(limit - self.total_allocated_memory, 0) if limit is not None else 0
            self._record("oom", 0, self.last_oom_alloc_size, stream, orig_size, free)
            return None
        self._requested[block.ptr] = orig_size
        self._record("alloc", block.ptr, block.size, block.stream, orig_size)
        return block

    def free(self, block: Block) -> None:
        # recorded before the parent merges the block with its free neighbours (which moves ptr and size)
        requested = self._requested.pop(block.ptr, block.size)
        self._record("free_requested", block.ptr, block.size, block.stream, requested)
        self._record("free_completed", block.ptr, block.size, block.stream, requested)
        super().free(block)

    def alloc_block(self, p: AllocParams, is_retry: bool) -> bool:
        found = super().alloc_block(p, is_retry)
        if found and p.block.segment is None:  # an expandable segment records its page maps instead
            self._record("segment_alloc", p.block.ptr, p.block.size, p.block.stream)
        return found

    def release_block(self, block: Block) -> None:
        self._record("segment_free", block.ptr, block.size, block.stream)
        super().release_block(block)

    def map_block(self, to_map: Block, size: int) -> bool:
        ptr, reserved = to_map.ptr, self.total_allocated_memory
        mapped = super().map_block(to_map, size)
        if mapped:
            self._record("segment_map", ptr, self.total_allocated_memory - reserved, to_map.stream)
        return mapped

    def unmap_block(self, block: Block) -> None:
        reserved = self.total_allocated_memory
        super().unmap_block(block)
        if self.total_allocated_memory < reserved:  # block.ptr/size now name the unmapped range
            self._record("segment_unmap", block.ptr, reserved - self.total_allocated_memory, block.stream)


__all__ = ["HistoryAllocator", "TraceEntry"]
