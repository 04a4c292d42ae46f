"""CUDA graphs under fake CUDA: a capture runs its ops once, and what they allocate is kept in the graph's private
memory pool, as PyTorch's caching allocator keeps it; a replay runs nothing and allocates nothing. The replay of a
captured training step (an optimizer step in the capture) counts as the iterations its capture completed.

Owns the fake `torch.cuda.CUDAGraph` (`FakeCUDAGraph`), the `torch.cuda.graph` context (`graph`), the pool handles
(`graph_pool_handle`, `CUDAGraph.pool()`) and which streams are capturing. Upstream's `make_graphed_callables` runs
unchanged over them (its warm-up on a side stream, then one capture per forward and backward, sharing one pool).
What the caching allocator does with a pool (CUDACachingAllocator.cpp beginAllocateToPool / endAllocateToPool /
releasePool) is said to the recorder as pool events (`FakeCuda.on_graph_pool(action, pool, stream)`, the actions of
`xmem.trace.events.POOL_ACTIONS`), and the simulator keeps the pool (xmem.simulate.allocator.PrivatePool).

The rules, restated from upstream (aten/src/ATen/cuda/CUDAGraph.cpp, torch/cuda/graphs.py):
- capture_begin takes the pool it is given (a handle from graph_pool_handle() or another graph's pool()) or a new
  one, and from then on the capturing stream allocates from it; capture_end stops that.
- reset() or the graph's deletion releases the pool once a capture ended; the pool's memory goes back only when no
  graph uses it any more and the cache is emptied.
- torch.cuda.graph empties the cache before it captures, on a side stream of its own unless given one.

Inductor's CUDA graph trees allocate into their pool outside a capture too (warm-up runs, the recording's input
copies: torch._C's beginAllocateCurrentThreadToPool / endAllocateToPool / releasePool), said as the same pool events.

Not modelled, named (exit 11): user memory pools (`torch.cuda.MemPool`, `use_mem_pool`) and the allocator-state
checkpoints of Inductor's CUDA graph trees; a pool shared again after every graph that used it was released.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any, Callable

import torch

from xmem.trace.errors import NotModelled

USER_POOL_GAP = "a user memory pool (torch.cuda.MemPool / use_mem_pool): its allocations are not modelled"
POOL_STATE_GAP = ("the caching allocator's pool checkpoints (torch.compile's CUDA graph trees, mode='reduce-overhead')"
                  " are not modelled")
DEAD_POOL_GAP = "a CUDA graph pool shared again after every graph that used it was released is not modelled"


class GraphPools:
    """The pools the program's graphs use: a number each (the events' pool id) by upstream handle, how many graphs
    use each (upstream PrivatePool::use_count), and which stream each capture underway records."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake
        self._numbers: dict[tuple[int, int], int] = {}
        self._uses: dict[int, int] = {}
        self._user_ids = itertools.count(1)  # upstream MemPool::uid_: graph_pool_handle()'s
        self._graph_ids = itertools.count(1)  # upstream MemPool::uuid_: a pool made for a graph given none
        self.capturing: dict[int, int] = {}  # stream id -> pool number, for captures underway

    def new_handle(self, user_created: bool) -> tuple[int, int]:
        """A fresh MempoolId: (uid, 0) for a user's handle, (0, uuid) for a graph's own pool."""
        return (next(self._user_ids), 0) if user_created else (0, next(self._graph_ids))

    def begin(self, handle: tuple[int, int], stream: int, capture: bool = True) -> int:
        """Allocations on `stream` go to the pool of `handle` from now on; `capture`: a graph capture underway (else
        only the allocations, as upstream's beginAllocateCurrentThreadToPool, which Inductor's CUDA graph trees use)."""
        number = self._numbers.setdefault(handle, len(self._numbers) + 1)
        if self._uses.get(number) == 0:
            raise NotModelled(DEAD_POOL_GAP)
        self._uses[number] = self._uses.get(number, 0) + 1
        if capture:
            self.capturing[stream] = number
        self.fake.on_graph_pool("begin_pool", number, stream)
        return number

    def number_of(self, handle: tuple[int, int]) -> int:
        return self._numbers[handle]

    def end(self, number: int) -> None:
        for stream, capturing in list(self.capturing.items()):
            if capturing == number:
                del self.capturing[stream]
        self.fake.on_graph_pool("end_pool", number, self.fake.current_stream.stream_id)

    def release(self, number: int) -> None:
        self._uses[number] -= 1
        self.fake.on_graph_pool("release_pool", number, self.fake.current_stream.stream_id)

    def stream_is_capturing(self, stream_id: int) -> bool:
        return stream_id in self.capturing


class _Capture:
    """One graph's capture state, apart from the graph so that the graph's finalizer can release its pool."""

    def __init__(self, pools: GraphPools) -> None:
        self.pools = pools
        self.handle: tuple[int, int] | None = None
        self.number = 0
        self.begun = self.ended = False
        self.iterations = 0  # training iterations the capture completed (an optimizer step captured), counted back

    def release(self) -> None:
        """CUDAGraph::reset's pool part: only a capture that ended holds its pool."""
        if self.ended:
            self.ended = False
            self.pools.release(self.number)


def _pool_handle(pool: Any) -> tuple[int, int] | None:
    """torch.cuda.graphs._get_pool_id: a MempoolId from a handle tuple; a MemPool is not modelled."""
    if pool is None:
        return None
    if isinstance(pool, tuple) and len(pool) == 2:
        return (int(pool[0]), int(pool[1]))
    raise NotModelled(USER_POOL_GAP)


def _given_pool(pool: Any) -> tuple[int, int]:
    handle = _pool_handle(pool)
    if handle is None:  # upstream's callers always name one
        raise NotModelled(POOL_STATE_GAP)
    return handle


def graph_class(pools: GraphPools) -> type:
    """The fake torch.cuda.CUDAGraph over `pools`."""

    class FakeCUDAGraph:
        """torch.cuda.CUDAGraph without a device: the captured ops run once, as they are captured; replay runs
        nothing (the GPU would re-run the same kernels on the same memory, allocating nothing)."""

        def __init__(self, keep_graph: bool = False) -> None:
            self._capture = _Capture(pools)
            weakref.finalize(self, self._capture.release).atexit = False

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                          check_input_liveness: bool = False) -> None:
            capture = self._capture
            if capture.begun:  # CUDAGraph::capture_begin's check
                raise RuntimeError("This CUDAGraph instance already owns a captured graph. To capture a new graph, "
                                   "create a new instance.")
            capture.handle = _pool_handle(pool) or pools.new_handle(user_created=False)
            capture.number = pools.begin(capture.handle, pools.fake.current_stream.stream_id)
            capture.begun = True
            capture.iterations = -pools.fake.iterations_done()

        def capture_end(self) -> None:
            capture = self._capture
            if not capture.begun or capture.ended:
                raise RuntimeError("CUDAGraph::capture_end: no capture underway on this graph")
            pools.end(capture.number)
            capture.ended = True
            capture.iterations += pools.fake.iterations_done()

        def capture_end_pre(self) -> None:
            self.capture_end()

        def capture_end_post(self) -> None: ...
        def instantiate(self) -> None: ...

        def replay(self) -> None:
            if not self._capture.ended:
                raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
            if self._capture.iterations:  # a captured training step: each replay is an iteration of the trace
                pools.fake.on_replayed_iterations(self._capture.iterations)

        def reset(self) -> None:
            self._capture.release()
            self._capture.begun = False

        def pool(self) -> tuple[int, int]:
            if self._capture.handle is None:
                raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
            return self._capture.handle

        def pools(self) -> list[tuple[int, int]]:
            return [self.pool()]

        def enable_debug_mode(self) -> None: ...
        def debug_dump(self, debug_path: str) -> None: ...

    return FakeCUDAGraph


def graph_context(upstream: type) -> type:
    """torch.cuda.graph over the fake CUDAGraph: upstream's __init__ (side stream, pool), its own enter and exit."""

    class graph(upstream):  # type: ignore[misc, valid-type]  # noqa: N801 (upstream's name)
        """torch.cuda.graph: empty the cache, make the capture stream current, capture into the pool."""

        def __enter__(self) -> None:
            torch.cuda.synchronize()
            if torch.compiler.config.force_cudagraph_gc:
                gc.collect()
            torch.cuda.empty_cache()
            self.stream_ctx.__enter__()
            self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

        def __exit__(self, *args: object) -> None:
            self.cuda_graph.capture_end()
            self.stream_ctx.__exit__(*args)

    return graph


class UserMemPool:
    """torch.cuda.MemPool: a class still (libraries test isinstance against it), which cannot be made here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotModelled(USER_POOL_GAP)


def _not_modelled(gap: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotModelled(gap)
    return refuse


def install(fake: Any) -> GraphPools:
    """torch.cuda's graph surface over `fake`; returns the pools (which streams capture)."""
    import torch.cuda.graphs as graphs

    pools = GraphPools(fake)
    cuda_graph = graph_class(pools)
    context = graph_context(graphs.graph)

    def graph_pool_handle() -> tuple[int, int]:
        return pools.new_handle(user_created=True)

    def is_current_stream_capturing() -> bool:
        return pools.stream_is_capturing(fake.current_stream.stream_id)

    for module in (torch.cuda, graphs):
        module.CUDAGraph, module.graph, module.graph_pool_handle = cuda_graph, context, graph_pool_handle
        module.is_current_stream_capturing = is_current_stream_capturing
        module.make_graphed_callables = graphs.make_graphed_callables  # upstream's, over the names above
    type(fake.current_stream).is_capturing = lambda stream: pools.stream_is_capturing(stream.stream_id)
    torch.cuda.MemPool = torch.cuda.memory.MemPool = UserMemPool  # type: ignore[misc]
    refuse_pool = _not_modelled(USER_POOL_GAP)
    # torch._dynamo's skip list names the context manager's function when dynamo is first imported (a program that
    # imports it after start: variables/torch.py reads use_mem_pool.__wrapped__)
    refuse_pool.__wrapped__ = getattr(torch.cuda.use_mem_pool, "__wrapped__", torch.cuda.use_mem_pool)  # type: ignore
    torch.cuda.use_mem_pool = torch.cuda.memory.use_mem_pool = refuse_pool
    for name in ("_cuda_beginAllocateCurrentStreamToPool", "_cuda_beginAllocateToPool", "_cuda_setCheckpointPoolState",
                 "_cuda_getCheckpointState", "_cuda_checkPoolLiveAllocations"):
        if hasattr(torch._C, name):
            setattr(torch._C, name, _not_modelled(POOL_STATE_GAP))
    _install_thread_pool_allocation(pools)
    return pools


def _install_thread_pool_allocation(pools: GraphPools) -> None:
    """torch._C's allocate-to-pool calls of Inductor's CUDA graph trees (cudagraph_trees._use_cuda_memory_pool_manager:
    begin on the current thread, end, release). Upstream routes the thread's allocations, on any stream, to the pool;
    here those of the current stream, which that manager has just made its own side stream."""
    fake = pools.fake

    def begin_allocate_current_thread_to_pool(device: int, pool: Any) -> None:
        pools.begin(_given_pool(pool), fake.current_stream.stream_id, capture=False)

    def end_allocate_to_pool(device: int, pool: Any) -> None:
        pools.end(pools.number_of(_given_pool(pool)))

    def release_pool(device: int, pool: Any) -> None:
        pools.release(pools.number_of(_given_pool(pool)))

    torch._C._cuda_beginAllocateCurrentThreadToPool = begin_allocate_current_thread_to_pool
    torch._C._cuda_endAllocateToPool = end_allocate_to_pool
    torch._C._cuda_releasePool = release_pool


__all__ = ["DEAD_POOL_GAP", "POOL_STATE_GAP", "USER_POOL_GAP", "GraphPools", "UserMemPool", "graph_class",
           "graph_context", "install"]
