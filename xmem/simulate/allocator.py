"""A replay model of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`, torch 2.13/2.14).

Owns: the allocator's records (`Block`, `BlockPool`, `AllocParams`, `ExpandableSegment`, and `Segment` for
snapshots) and its decisions, one function per upstream rule and under upstream's name: `round_size`, `get_pool`,
`get_allocation_size`, `get_free_block`, `should_split`, `alloc_found_block`, `free_block`, `try_merge_blocks`,
`alloc_block`, `release_block`, `release_available_cached_blocks`, `release_cached_blocks`,
`garbage_collect_cached_blocks`, `malloc`, `free`, `empty_cache`, and for expandable segments
`find_expandable_block`, `try_allocate_expandable_block`, `map_block`, `unmap_block`; for CUDA graphs' private pools
(`PrivatePool`) `begin_allocate_to_pool`, `end_allocate_to_pool`, `release_pool`, `create_or_incref_pool`; `snapshot`
lists the segments.
The rules are re-stated from reading upstream's `c10/cuda/CUDACachingAllocator.cpp`, each function beside the
upstream function of its name (`Block::splice`, `DeviceCachingAllocator::alloc_found_block` ...), not copied.

What is not modelled, on purpose:
- `record_stream` / cross-stream uses: a freed block goes back to its pool at once (no deferred `free_block`, no
  CUDA events); `trigger_free_memory_callbacks` has nothing registered in a replay.
- MemPools with an allocator of their own, `use_on_oom` and `no_split` pools, IPC, `release_lock_on_cudamalloc`,
  `cudaMallocAsync`. A CUDA graph's private pool is modelled; its capture filter is "the capturing stream".
- Several devices: one `DeviceCachingAllocator` is one device.

Model choices where upstream depends on the real device:
- Addresses: every cudaMalloc (and every expandable segment's address reservation) gets a fresh, increasing
  virtual address, so segments never touch, as with the driver.
- `capacity` stands for what cudaMalloc / cuMemCreate can still obtain: an allocation fails when reserved + new
  bytes would exceed it. `device_total` is the device's memory; when it is not given, `capacity` stands in.
  A memory fraction is taken of it, as upstream, and is inactive when neither is known; garbage collection,
  which needs the fraction, is then inactive too.
- An expandable segment reserves 1.125 x device_total of address space, as upstream.
- Streams are kept in the order the replay first meets them (upstream orders them by handle value; the order
  matters only to `release_available_cached_blocks` when it backs up across streams).

Must not: do I/O or import torch; it is pure and deterministic.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from xmem.simulate.allocator_settings import (
    AllocatorConfig,
    kLargeBuffer,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
)

_SIZE_MAX = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size when unset
_ADDRESS_SPACE_UNLIMITED = 1 << 48  # expandable address reservation when the device size is unknown
_FIRST_ADDRESS = 1 << 32


def _key(stream: int, size: int, ptr: int) -> int:
    """BlockComparatorSize as one integer: order by stream, then size, then address."""
    return (stream << 128) | (size << 64) | ptr


class Block:
    """A piece of a segment, allocated or free; `prev`/`next` link the pieces of one segment in address order."""

    __slots__ = ("stream", "size", "ptr", "pool", "prev", "next", "allocated", "mapped", "segment",
                 "gc_count_base")

    def __init__(self, stream: int, size: int, ptr: int, pool: BlockPool,
                 segment: ExpandableSegment | None = None, mapped: bool = True) -> None:
        self.stream = stream
        self.size = size
        self.ptr = ptr
        self.pool = pool
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = mapped
        self.segment = segment  # the expandable segment this block lives in (Block::expandable_segment_)
        self.gc_count_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """Block::splice: link this block between `before` and `after`, which must be neighbours (upstream asserts
        it: a block list that lost a link would merge blocks that are not adjacent)."""
        if before is not None:
            assert before.next is after
            before.next = self
        self.prev = before
        if after is not None:
            assert after.prev is before
            after.prev = self
        self.next = after


class BlockPool:
    """The free blocks of one pool (small or large), all streams, best-fit ordered by (stream, size, ptr); `owner` is
    the CUDA graph pool it belongs to (upstream owner_PrivatePool), None for the device's own two pools."""

    __slots__ = ("is_small", "keys", "blocks", "unmapped", "get_free_blocks_call_count", "owner")

    def __init__(self, is_small: bool, owner: PrivatePool | None = None) -> None:
        self.is_small = is_small
        self.owner = owner
        self.keys: list[int] = []  # sorted _key()s of the free mapped blocks (the upstream std::set)
        self.blocks: dict[int, Block] = {}
        self.unmapped: set[Block] = set()  # unmapped ranges of expandable segments
        self.get_free_blocks_call_count = 0  # the clock of garbage collection ages

    def insert_into_blocks(self, block: Block) -> None:
        """BlockPool::insert_into_blocks: a block enters the pool and its gc age restarts."""
        block.gc_count_base = self.get_free_blocks_call_count
        key = (block.stream << 128) | (block.size << 64) | block.ptr  # _key(), inlined: the hottest path
        insort(self.keys, key)
        self.blocks[key] = block

    def erase(self, block: Block) -> None:
        key = (block.stream << 128) | (block.size << 64) | block.ptr  # _key(), inlined
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]


class PrivatePool:
    """A CUDA graph's memory pool (upstream PrivatePool, keyed by MempoolId): its own small and large blocks, which only
    allocations made while a capture records into it take, and which stay reserved until every graph that shares it
    is gone (`use_count`) and the cache is emptied. `cudaMalloc_count` counts its segments still held."""

    __slots__ = ("id", "use_count", "cudaMalloc_count", "small_blocks", "large_blocks")

    def __init__(self, pool_id: int) -> None:
        self.id = pool_id
        self.use_count = 1
        self.cudaMalloc_count = 0
        self.small_blocks = BlockPool(is_small=True, owner=self)
        self.large_blocks = BlockPool(is_small=False, owner=self)


@dataclass(frozen=True)
class Segment:
    """One segment as `torch.cuda.memory_snapshot()` describes it (upstream SegmentInfo)."""

    address: int
    total_size: int  # cudaMalloc'd bytes, or the mapped bytes of an expandable segment
    stream: int
    is_large: bool
    is_expandable: bool
    allocated_size: int
    blocks: tuple[tuple[int, bool], ...]  # (size, allocated) of each mapped block, in address order


class AllocParams:
    """One malloc request in flight (upstream AllocParams): rounded size, stream, pool, segment size, result."""

    __slots__ = ("size", "stream", "pool", "alloc_size", "block")

    def __init__(self, size: int, stream: int, pool: BlockPool, alloc_size: int) -> None:
        self.size = size
        self.stream = stream
        self.pool = pool
        self.alloc_size = alloc_size
        self.block: Block | None = None


class ExpandableSegment:
    """An address range reserved once (cuMemAddressReserve) and backed page by page (cuMemCreate + cuMemMap)."""

    __slots__ = ("ptr", "size", "page_size", "stream", "mapped_pages")

    def __init__(self, ptr: int, address_space: int, page_size: int, stream: int) -> None:
        self.ptr = ptr
        self.page_size = page_size
        self.size = -(-address_space // page_size) * page_size
        self.stream = stream
        self.mapped_pages: set[int] = set()

    def pages_to_map(self, ptr: int, size: int) -> range:
        """ExpandableSegment::map: every page the range touches."""
        begin = (ptr - self.ptr) // self.page_size
        end = -(-(ptr + size - self.ptr) // self.page_size)
        return range(begin, end)

    def pages_to_unmap(self, ptr: int, size: int) -> range:
        """ExpandableSegment::unmap: only the pages the range covers entirely."""
        begin = -(-(ptr - self.ptr) // self.page_size)
        end = (ptr + size - self.ptr) // self.page_size
        return range(begin, max(begin, end))


def roundup_power2_divisions(size: int, divisions: tuple[int, ...]) -> int:
    """AcceleratorAllocatorConfig::roundup_power2_divisions: the divisions of size's power-of-2 interval."""
    if not divisions:
        return 0
    index = max(size.bit_length() - 1 - 20, 0)  # intervals start at 1 MiB = 2**20
    return divisions[min(index, len(divisions) - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """CUDACachingAllocator.cpp roundup_power2_next_division: next of `divisions` steps between powers of 2."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(size: int, divisions: tuple[int, ...] = ()) -> int:
    """DeviceCachingAllocator::round_size: at least 512 B, then 512-B steps or power-of-2 divisions."""
    if size < kMinBlockSize:
        return kMinBlockSize
    division = roundup_power2_divisions(size, divisions)
    if division > 1 and size > kMinBlockSize * division:
        return roundup_power2_next_division(size, division)
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int, large_segment_size: int = kLargeBuffer) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment_size
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


class DeviceCachingAllocator:
    """One device's caching allocator; `allocated_bytes` / `total_allocated_memory` are allocated / reserved."""

    def __init__(self, config: AllocatorConfig, capacity: int | None = None, device_total: int | None = None) -> None:
        self.config = config
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        self.max_split_size = config.max_split_size if config.max_split_size is not None else _SIZE_MAX
        self.divisions = config.roundup_power2_divisions
        self.small_blocks = BlockPool(is_small=True)
        self.large_blocks = BlockPool(is_small=False)
        # setMemoryFraction: allowed_memory_maximum = fraction * total
        self.set_fraction = config.memory_fraction is not None and self.device_total is not None
        self.allowed_memory_maximum = int(config.memory_fraction * self.device_total) if self.set_fraction else None
        self.gc_enabled = self.set_fraction and config.garbage_collection_threshold > 0.0
        self.allocated_bytes = 0  # stats.allocated_bytes: sum of allocated block sizes
        self.total_allocated_memory = 0  # stats.reserved_bytes: cudaMalloc'd segments + mapped pages
        self.num_segments = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.last_oom_alloc_size = 0
        self.next_address = _FIRST_ADDRESS
        self.expandable_segments: list[ExpandableSegment] = []
        self.active_blocks: set[Block] = set()  # the allocated blocks (upstream active_blocks)
        # CUDA graphs: the private pools by id, those no graph uses any more, and the captures recording now as
        # (pool id, capturing stream), latest last (upstream captures_underway, whose filter is the stream here)
        self.graph_pools: dict[int, PrivatePool] = {}
        self.graph_pools_freeable: dict[int, PrivatePool] = {}
        self.captures_underway: list[tuple[int, int]] = []

    def clone(self, capacity: int | None, device_total: int | None) -> tuple[DeviceCachingAllocator, dict]:
        """A copy of this allocator's whole state (segments, blocks, pools, counters) under another limit, and the
        map from each of its blocks to the copy's. Only without a memory fraction and expandable segments: the limit
        is then read at cudaMalloc alone (`alloc_block`), so nothing else in the state depends on it."""
        if self.set_fraction or self.config.memory_fraction is not None or self.config.expandable_segments:
            raise ValueError("clone: only without a memory fraction and expandable segments")
        twin = DeviceCachingAllocator(self.config, capacity, device_total)
        for name in ("allocated_bytes", "total_allocated_memory", "num_segments", "num_alloc_retries", "num_ooms",
                     "last_oom_alloc_size", "next_address"):
            setattr(twin, name, getattr(self, name))
        pools = {id(self.small_blocks): twin.small_blocks, id(self.large_blocks): twin.large_blocks}
        for pool_id, private in self.graph_pools.items():
            copy = twin.graph_pools[pool_id] = PrivatePool(pool_id)
            copy.use_count, copy.cudaMalloc_count = private.use_count, private.cudaMalloc_count
            pools[id(private.small_blocks)], pools[id(private.large_blocks)] = copy.small_blocks, copy.large_blocks
        twin.graph_pools_freeable = {pool_id: twin.graph_pools[pool_id] for pool_id in self.graph_pools_freeable}
        twin.captures_underway = list(self.captures_underway)
        blocks = [block for pool in self._all_pools() for block in pool.blocks.values()] + list(self.active_blocks)
        copies: dict[Block, Block] = {}
        for block in blocks:
            copy = copies[block] = Block(block.stream, block.size, block.ptr, pools[id(block.pool)])
            copy.allocated, copy.gc_count_base = block.allocated, block.gc_count_base
        for block, copy in copies.items():  # every piece of a segment is free (in a pool) or allocated (active)
            copy.prev = copies[block.prev] if block.prev is not None else None
            copy.next = copies[block.next] if block.next is not None else None
        for pool in self._all_pools():
            into = pools[id(pool)]
            into.keys = list(pool.keys)
            into.blocks = {key: copies[block] for key, block in pool.blocks.items()}
            into.get_free_blocks_call_count = pool.get_free_blocks_call_count
        twin.active_blocks = {copies[block] for block in self.active_blocks}
        return twin, copies

    def _all_pools(self) -> list[BlockPool]:
        """The device's two pools and every private pool's two."""
        pools = [self.small_blocks, self.large_blocks]
        for private in self.graph_pools.values():
            pools += [private.small_blocks, private.large_blocks]
        return pools

    # ---- the request path ------------------------------------------------------------------------------------

    def malloc(self, orig_size: int, stream: int) -> Block | None:
        """DeviceCachingAllocator::malloc: a block for `orig_size` bytes on `stream`, or None on out-of-memory."""
        size = round_size(orig_size, self.divisions)
        pool = self.get_pool(size, stream)
        p = AllocParams(size, stream, pool, get_allocation_size(size, self.config.large_segment_size))
        if not self.get_free_block(p):
            if self.gc_enabled:
                self.garbage_collect_cached_blocks()
            found = (self.alloc_block(p, is_retry=False)
                     or (self.release_available_cached_blocks(p) and self.alloc_block(p, is_retry=False))
                     or (not self.captures_underway and self.release_cached_blocks()
                         and self.alloc_block(p, is_retry=True)))
            if not found:
                self.num_ooms += 1
                self.last_oom_alloc_size = p.alloc_size
                return None
        return self.alloc_found_block(p, self.should_split(p.block, size))

    def get_pool(self, size: int, stream: int) -> BlockPool:
        """DeviceCachingAllocator::get_pool: small pool for rounded sizes up to kSmallSize; while a capture records on
        `stream`, the latest such capture's private pool instead."""
        for pool_id, capturing in reversed(self.captures_underway):
            if capturing == stream:
                private = self.graph_pools[pool_id]
                return private.small_blocks if size <= kSmallSize else private.large_blocks
        return self.small_blocks if size <= kSmallSize else self.large_blocks

    def get_free_block(self, p: AllocParams) -> bool:
        """DeviceCachingAllocator::get_free_block: smallest cached block >= size on the stream, lowest address."""
        pool = p.pool
        if self.gc_enabled:
            pool.get_free_blocks_call_count += 1
        keys = pool.keys
        i = bisect_left(keys, _key(p.stream, p.size, 0))
        if i == len(keys) or keys[i] >> 128 != p.stream:
            return False
        block = pool.blocks[keys[i]]
        if block.segment is not None and self.config.expandable_segments:
            i, block = self.best_expandable_fit(pool, i, block)
        if p.size < self.max_split_size and block.size >= self.max_split_size:
            return False  # a small request never takes an oversize block
        if p.size >= self.max_split_size and block.size >= p.size + self.config.max_non_split_rounding:
            return False  # nor does a large request take one much larger than itself
        del pool.blocks[keys[i]]
        del keys[i]
        p.block = block
        return True

    @staticmethod
    def best_expandable_fit(pool: BlockPool, i: int, block: Block) -> tuple[int, Block]:
        """get_free_block's expandable branch: a block's size counts the unmapped space right after it."""
        def expandable_size(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        keys, stream = pool.keys, block.stream
        while block.segment is not None and i + 1 < len(keys) and keys[i + 1] >> 128 == stream:
            candidate = pool.blocks[keys[i + 1]]
            if expandable_size(candidate) >= expandable_size(block):
                break
            i, block = i + 1, candidate
        return i, block

    def should_split(self, block: Block, size: int) -> bool:
        """DeviceCachingAllocator::should_split: small pool / expandable >= 512 B left; large > 1 MiB left."""
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.max_split_size and remaining > kSmallSize

    def alloc_found_block(self, p: AllocParams, split_remainder: bool) -> Block:
        """DeviceCachingAllocator::alloc_found_block: keep the front for the request, the rest back to the pool."""
        block = p.block
        if split_remainder:
            remaining = block
            block = Block(remaining.stream, p.size, remaining.ptr, remaining.pool, remaining.segment)
            block.splice(remaining.prev, remaining)
            remaining.ptr += p.size
            remaining.size -= p.size
            remaining.pool.insert_into_blocks(remaining)
        block.allocated = True
        self.allocated_bytes += block.size
        self.active_blocks.add(block)
        return block

    # ---- the free path ---------------------------------------------------------------------------------------

    def free(self, block: Block) -> None:
        """DeviceCachingAllocator::free: no stream uses are recorded in a replay, so free_block runs at once."""
        block.allocated = False
        self.allocated_bytes -= block.size
        self.active_blocks.discard(block)
        self.free_block(block)

    def free_block(self, block: Block) -> None:
        """DeviceCachingAllocator::free_block: coalesce with free neighbours in the segment, back into the pool."""
        pool = block.pool
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.insert_into_blocks(block)

    @staticmethod
    def try_merge_blocks(dst: Block, src: Block | None, pool: BlockPool) -> int:
        """DeviceCachingAllocator::try_merge_blocks: absorb a free neighbour of the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        assert dst.is_split() and src.is_split()  # as upstream: neighbours are parts of one split segment
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.erase(src)
        else:
            pool.unmapped.discard(src)
        dst.size += src.size
        return src.size

    # ---- getting memory from the device ----------------------------------------------------------------------

    def alloc_block(self, p: AllocParams, is_retry: bool) -> bool:
        """DeviceCachingAllocator::alloc_block: a new segment (cudaMalloc) or new pages (expandable)."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.set_fraction and self.total_allocated_memory + p.alloc_size > self.allowed_memory_maximum:
            return False
        if self.config.expandable_segments:
            p.block = self.try_allocate_expandable_block(p.stream, p.pool, p.size)
            if p.block is not None and p.pool.owner is not None:
                p.pool.owner.cudaMalloc_count += 1  # as upstream, never taken back for expandable pages
            return p.block is not None
        if self.capacity is not None and self.total_allocated_memory + p.alloc_size > self.capacity:
            return False  # cudaMalloc: cudaErrorMemoryAllocation
        if p.pool.owner is not None:
            p.pool.owner.cudaMalloc_count += 1
        ptr = self.next_address
        self.next_address += p.alloc_size
        self.total_allocated_memory += p.alloc_size
        self.num_segments += 1
        p.block = Block(p.stream, p.alloc_size, ptr, p.pool)
        return True

    def release_block(self, block: Block) -> None:
        """DeviceCachingAllocator::release_block: cudaFree a whole cached segment."""
        assert block.segment is None and not block.is_split(), "only whole cudaMalloc segments are released"
        block.pool.erase(block)
        self.total_allocated_memory -= block.size
        self.num_segments -= 1
        if block.pool.owner is not None:
            block.pool.owner.cudaMalloc_count -= 1

    def release_available_cached_blocks(self, p: AllocParams) -> bool:
        """DeviceCachingAllocator::release_available_cached_blocks: free oversize cached blocks (max_split only)."""
        if self.max_split_size == _SIZE_MAX:
            return False
        pool, keys = p.pool, p.pool.keys
        key_size = max(p.size, self.max_split_size)
        i = bisect_left(keys, _key(p.stream, key_size, 0))
        if i < len(keys) and keys[i] >> 128 == p.stream and pool.blocks[keys[i]].segment is None:
            self.release_block(pool.blocks[keys[i]])
            return True
        # No single block is large enough: free oversize blocks, the largest of this stream first.
        if i == 0:
            return False
        released = 0
        for key in reversed(keys[:i]):
            block = pool.blocks[key]
            if released >= key_size or block.size < self.max_split_size or block.stream != p.stream:
                break
            if block.segment is None:
                released += block.size
                self.release_block(block)
        return released >= key_size

    def release_cached_blocks(self) -> bool:
        """DeviceCachingAllocator::release_cached_blocks (of the default pool): cudaFree every unsplit cached block
        and unmap free pages, the device's own only while no capture records; then those of every private pool no
        graph uses any more, and forget such a pool once it holds no segment."""
        if not self.captures_underway:
            self.release_blocks(self.large_blocks)
            self.release_blocks(self.small_blocks)
        for pool_id, private in list(self.graph_pools_freeable.items()):
            self.release_blocks(private.small_blocks)
            self.release_blocks(private.large_blocks)
            if private.cudaMalloc_count == 0:
                del self.graph_pools[pool_id], self.graph_pools_freeable[pool_id]
        return True

    def release_blocks(self, pool: BlockPool) -> None:
        """DeviceCachingAllocator::release_blocks: one pool's part of release_cached_blocks."""
        to_unmap = []
        for key in list(pool.keys):
            block = pool.blocks[key]
            if block.segment is not None:
                to_unmap.append(block)  # unmapping changes the pool: gather first
            elif not block.is_split():
                self.release_block(block)
        for block in to_unmap:
            self.unmap_block(block)
            if not block.mapped and not block.is_split():
                self.release_expandable_segment(block)

    def empty_cache(self) -> None:
        """DeviceCachingAllocator::emptyCache: what `torch.cuda.empty_cache()` does on one device."""
        self.release_cached_blocks()

    def garbage_collect_cached_blocks(self) -> None:
        """DeviceCachingAllocator::garbage_collect_cached_blocks: free old unsplit large blocks above the threshold."""
        gc_threshold = int(self.config.garbage_collection_threshold * self.allowed_memory_maximum)
        if self.total_allocated_memory <= gc_threshold:
            return
        target_size = self.total_allocated_memory - gc_threshold
        pool = self.large_blocks

        def freeable() -> list[Block]:
            return [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split()
                    and pool.blocks[k].segment is None]

        def gc_count(block: Block) -> int:
            return pool.get_free_blocks_call_count - block.gc_count_base

        candidates = freeable()
        total_age = sum(gc_count(b) for b in candidates)
        count = len(candidates)
        reclaimed = 0
        block_freed = True
        while reclaimed < target_size and block_freed and count > 0:
            age_threshold = total_age / count  # free blocks of above-average age first
            block_freed = False
            for block in freeable():  # all of them, past the target: GC should not run again soon
                if gc_count(block) >= age_threshold:
                    block_freed = True
                    reclaimed += block.size
                    total_age -= gc_count(block)
                    count -= 1
                    self.release_block(block)

    # ---- CUDA graphs' private pools --------------------------------------------------------------------------

    def create_or_incref_pool(self, pool_id: int) -> None:
        """DeviceCachingAllocator::create_or_incref_pool: a new pool used once, or one more use of a live one."""
        private = self.graph_pools.get(pool_id)
        if private is None:
            self.graph_pools[pool_id] = PrivatePool(pool_id)
        else:
            if private.use_count <= 0:
                raise ValueError(f"pool {pool_id} is no longer used by any graph: it cannot be shared again")
            private.use_count += 1

    def begin_allocate_to_pool(self, pool_id: int, stream: int) -> None:
        """DeviceCachingAllocator::beginAllocateToPool (CUDAGraph::capture_begin): from now on, allocations on
        `stream` come from pool `pool_id`, created or shared."""
        if any(recording == pool_id for recording, _ in self.captures_underway):
            raise ValueError(f"pool {pool_id}: already recording to it")
        self.create_or_incref_pool(pool_id)
        self.captures_underway.append((pool_id, stream))

    def end_allocate_to_pool(self, pool_id: int) -> None:
        """DeviceCachingAllocator::endAllocateToPool (CUDAGraph::capture_end): the capture into `pool_id` ended."""
        for index, (recording, _) in enumerate(self.captures_underway):
            if recording == pool_id:
                del self.captures_underway[index]
                return
        raise ValueError(f"pool {pool_id}: not recording to it")

    def release_pool(self, pool_id: int) -> None:
        """DeviceCachingAllocator::releasePool (a graph reset or deleted): one use fewer; with none left, the pool's
        unsplit free segments go back to the device at the next release_cached_blocks (empty_cache, OOM retry)."""
        private = self.graph_pools.get(pool_id)
        if private is None or private.use_count <= 0:
            raise ValueError(f"pool {pool_id}: released more often than used")
        private.use_count -= 1
        if private.use_count == 0:
            self.graph_pools_freeable[pool_id] = private

    # ---- expandable segments ---------------------------------------------------------------------------------

    def try_allocate_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block | None:
        """DeviceCachingAllocator::try_allocate_expandable_block: map pages until a free block holds `size`."""
        candidate = self.find_expandable_block(stream, pool, size)
        if not candidate.mapped and not self.map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free -> unmapped -> ...: map some of the next and merge
            new_candidate = candidate.next
            if not self.map_block(new_candidate, min(size - candidate.size, new_candidate.size)):
                return None
            candidate = new_candidate
        pool.erase(candidate)
        return candidate

    def find_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block:
        """DeviceCachingAllocator::find_expandable_block: the lowest-address room for `size`, else a new segment."""
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def has_available_address_space(b: Block | None) -> bool:
            room = 0
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            return room >= size

        for unmapped in sorted((b for b in pool.unmapped if b.stream == stream), key=lambda b: b.ptr):
            candidate = unmapped.prev if allocatable(unmapped.prev) else unmapped
            if has_available_address_space(candidate):
                return candidate
        page_size = kSmallBuffer if pool.is_small else self.config.large_segment_size
        total = self.device_total
        address_space = total + total // 8 if total is not None and total > 0 else _ADDRESS_SPACE_UNLIMITED
        segment = ExpandableSegment(self.next_address, address_space, page_size, stream)
        self.next_address += segment.size
        self.expandable_segments.append(segment)
        candidate = Block(stream, segment.size, segment.ptr, pool, segment, mapped=False)
        pool.unmapped.add(candidate)
        return candidate

    def map_block(self, to_map: Block, size: int) -> bool:
        """DeviceCachingAllocator::map_block: back the front of an unmapped block with pages, merge, pool it."""
        segment = to_map.segment
        pages = segment.pages_to_map(to_map.ptr, size)
        mapped_size = len(pages) * segment.page_size
        if self.capacity is not None and self.total_allocated_memory + mapped_size > self.capacity:
            return False  # cuMemCreate: out of memory
        if not segment.mapped_pages:
            self.num_segments += 1
        segment.mapped_pages.update(pages)
        pool = to_map.pool
        pool.unmapped.discard(to_map)
        to_map.mapped = True
        if mapped_size < to_map.size:
            remaining = Block(to_map.stream, to_map.size - mapped_size, to_map.ptr + mapped_size, pool, segment,
                              mapped=False)
            remaining.splice(to_map, to_map.next)
            pool.unmapped.add(remaining)
            to_map.size = mapped_size
        self.try_merge_blocks(to_map, to_map.prev, pool)
        self.try_merge_blocks(to_map, to_map.next, pool)
        pool.insert_into_blocks(to_map)
        self.total_allocated_memory += mapped_size
        return True

    def unmap_block(self, block: Block) -> None:
        """DeviceCachingAllocator::unmap_block: give back the whole pages inside a free block."""
        segment = block.segment
        pages = segment.pages_to_unmap(block.ptr, block.size)
        if not pages:
            return
        pool = block.pool
        pool.erase(block)
        unmapped_ptr = segment.ptr + pages.start * segment.page_size
        unmapped_size = len(pages) * segment.page_size
        before_size = unmapped_ptr - block.ptr
        if before_size > 0:
            before_free = Block(block.stream, before_size, block.ptr, pool, segment)
            before_free.splice(block.prev, block)
            pool.insert_into_blocks(before_free)
        after_size = block.size - (before_size + unmapped_size)
        if after_size > 0:
            after_free = Block(block.stream, after_size, unmapped_ptr + unmapped_size, pool, segment)
            after_free.splice(block, block.next)
            pool.insert_into_blocks(after_free)
        block.ptr = unmapped_ptr
        block.size = unmapped_size
        block.mapped = False
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.unmapped.add(block)
        segment.mapped_pages.difference_update(pages)
        if not segment.mapped_pages:
            self.num_segments -= 1
        self.total_allocated_memory -= unmapped_size

    def release_expandable_segment(self, block: Block) -> None:
        """DeviceCachingAllocator::release_expandable_segment: drop a segment with nothing mapped."""
        block.pool.unmapped.discard(block)
        self.expandable_segments.remove(block.segment)

    # ---- inspection ------------------------------------------------------------------------------------------

    def snapshot(self) -> tuple[Segment, ...]:
        """DeviceCachingAllocator::snapshot: every segment with memory behind it, in address order."""
        everything = set(self.active_blocks)
        for pool in self._all_pools():
            everything.update(pool.blocks.values())
            everything.update(pool.unmapped)
        segments = []
        for head in sorted((b for b in everything if b.prev is None), key=lambda b: b.ptr):
            chain = []
            block = head
            while block is not None:
                chain.append(block)
                block = block.next
            mapped = [b for b in chain if b.mapped]
            if mapped:
                segments.append(Segment(
                    address=head.ptr, total_size=sum(b.size for b in mapped), stream=head.stream,
                    is_large=not head.pool.is_small, is_expandable=head.segment is not None,
                    allocated_size=sum(b.size for b in mapped if b.allocated),
                    blocks=tuple((b.size, b.allocated) for b in mapped)))
        return tuple(segments)
