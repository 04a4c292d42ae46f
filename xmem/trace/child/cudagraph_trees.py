"""Inductor's CUDA graph trees (torch.compile's mode="reduce-overhead" or "max-autotune", the triton.cudagraphs
option) under fake CUDA: where a compiled program's graphs keep their memory.

Owns the compilers that stand for Inductor's cudagraphify of each compiled graph (`forward_compiler`,
`backward_compiler`: xmem.trace.child.compiled calls them around its own) and each device's tree (`_Tree`). Restated
from torch/_inductor/cudagraph_trees.py (CUDAGraphTreeManager, CUDAWarmupNode, CUDAGraphNode) for the path a training
loop takes, over the fake CUDA graphs and pool events of xmem.trace.child.cuda_graphs:

- one tree per device (upstream's per thread, in a thread-local state that autograd's device threads inherit: the
  backward graphs share the forward's tree), with a side stream of its own and one private memory pool
  (graph_pool_handle), kept alive by an empty capture made with the tree (the manager's __init__); every graph of the
  tree allocates from that pool, so that what one graph freed, the next graph of the step can take;
- a graph's first call (its step's warm-up, CUDAWarmupNode.run) runs it with its allocations in the pool
  (_use_cuda_memory_pool_manager: upstream's own, run here): its outputs live in the pool;
- its second call records it (CUDAGraphNode): the inputs that are not static are first copied into new tensors in
  the pool (_allocate_and_copy_recording_inputs), which the graph holds for its life; static are the parameters and
  buffers (AOTAutograd's static_input_indices) and, in backward, the saved tensors (count_tangents: the forward's
  outputs, already in the pool). Then torch.cuda.graph captures it into the pool (the cache emptied first);
- later calls replay: the new inputs are copied into the held ones and the graph runs again in the pool, where it
  finds the blocks its recording freed. On a GPU a replay reuses the recording's addresses and allocates nothing:
  the pool ends as large either way;
- a new input shape is a new function of the same tree, in the same pool: a static recompilation is a new compiled
  graph (a new `CudagraphedGraph`), and a graph with symbolic sizes (dynamo's automatic dynamic recompilation, or
  dynamic=True) is one function per distinct value of its int inputs (cudagraphify_impl's `fn_cache`), each warmed
  up at its first call, recorded at its second and replayed after, its recording's input copies held for its life.

Not modelled: the allocator checkpoints by which a tree branches (a second path from one node, as graphs called in
another order make: upstream's apply_checkpoint_execution_state_in_allocator restores the pool to its state after
the parent's recording before recording the child; here the child allocates from the pool as it is), the generations
(`cudagraph_mark_step_begin`, or a new torch.compile invocation with no backward pending, ends the current path and
frees its outputs: here they are freed when the program drops them), re-recording when a static input moves, a
program that keeps a graph's outputs alive into the next step (an error upstream), upstream's warm-up of every graph
that follows a warm-up in the same path (`in_warmup`: here a recorded graph replays after a new one's warm-up), and
the graphs upstream leaves uncaptured (CPU inputs, mutated inputs that are not static, more re-recordings than
cudagraph_unexpected_rerecord_limit): each of these is traced as if captured.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

Compiler = Callable[[fx.GraphModule, Any], Callable]


def forward_compiler(compile_graph: Compiler) -> Compiler:
    """A forward or inference graph's compiler under the trees: static are its parameters and buffers."""
    def compile_forward(graph: fx.GraphModule, example_inputs: Any) -> Callable:
        return CudagraphedGraph(compile_graph(graph, example_inputs), _static_forward_inputs())
    return compile_forward


def backward_compiler(compile_graph: Compiler) -> Compiler:
    """A backward graph's compiler under the trees: static are its saved tensors (all inputs but the tangents)."""
    def compile_backward(graph: fx.GraphModule, example_inputs: Any) -> Callable:
        from torch._inductor.utils import count_tangents
        return CudagraphedGraph(compile_graph(graph, example_inputs), frozenset(range(count_tangents(graph))))
    return compile_backward


def _static_forward_inputs() -> frozenset[int]:
    """compile_fx.get_static_input_idxs: AOTAutograd's static inputs (parameters and buffers) while it compiles."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    return frozenset(metadata.static_input_indices) if metadata is not None else frozenset()


@dataclass(frozen=True)
class _Tree:
    """A device's CUDA graph tree: its stream, its pool, and the empty graph that keeps the pool alive."""

    device: int
    stream: Any
    pool: tuple[int, int]
    keeper: Any

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Allocations go to the tree's pool, on its stream (upstream's _use_cuda_memory_pool_manager)."""
        from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager
        with _use_cuda_memory_pool_manager(self.device, self.pool, self.stream):
            yield


_trees: dict[int, _Tree] = {}


def _tree_for(device: int) -> _Tree:
    """The tree of `device`, made at its first graph (upstream: get_container(device).tree_manager)."""
    key = device
    if key not in _trees:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            keeper = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(keeper, pool=pool, stream=stream):
                pass
        _trees[key] = _Tree(device, stream, pool, keeper)
    return _trees[key]


def _device_of(inputs: list) -> int:
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device.index or 0
    return torch.cuda.current_device()


class CudagraphedGraph:
    """One compiled graph under its device's tree, called in the boxed convention (the caller's input list is
    emptied). A graph with symbolic sizes is one function of the tree per distinct value of its int inputs, each
    warmed up, recorded and replayed on its own (upstream's cudagraphify_impl: `fn_cache` keyed by `get_ints`)."""

    def __init__(self, run: Callable, static: frozenset[int]) -> None:
        self._boxed_call = True  # an instance attribute: the wrappers AOTAutograd puts around it copy __dict__
        self.run = run
        self.static = static
        self.int_positions: tuple[int, ...] | None = None  # where the int inputs are, as its first call gives them
        self.functions: dict[tuple, TreeFunction] = {}

    def __call__(self, inputs: list) -> Any:
        if self.int_positions is None:
            self.int_positions = tuple(index for index, value in enumerate(inputs) if isinstance(value, int))
        key = tuple(inputs[index] for index in self.int_positions)
        if key not in self.functions:
            self.functions[key] = TreeFunction(self.run, self.static)
        return self.functions[key](_tree_for(_device_of(inputs)), inputs)


class TreeFunction:
    """One function of a tree (module docstring): warmed up, recorded, then replayed."""

    def __init__(self, run: Callable, static: frozenset[int]) -> None:
        self.run = run
        self.static = static
        self.calls = 0
        self.held_inputs: dict[int, torch.Tensor] = {}  # the recording's copies of the inputs that are not static
        self.graph: Any = None  # the captured graph: its use of the pool

    def __call__(self, tree: _Tree, inputs: list) -> Any:
        self.calls += 1
        if self.calls == 1:
            with tree.allocating():
                return self.run(inputs)
        if self.calls == 2:
            return self._record(tree, inputs)
        with tree.allocating():
            return self.run(self._copied_into_held(inputs))

    def _record(self, tree: _Tree, inputs: list) -> Any:
        from torch._inductor.compile_fx import static_input
        with tree.allocating():
            self.held_inputs = {index: static_input(value) for index, value in enumerate(inputs)
                                if isinstance(value, torch.Tensor) and index not in self.static}
            recording_inputs = self._copied_into_held(inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=tree.pool, stream=tree.stream):
            return self.run(recording_inputs)

    def _copied_into_held(self, inputs: list) -> list:
        """The graph's inputs with each one that is not static copied into its held copy; `inputs` emptied, so that
        the caller's tensors can die (upstream's _copy_inputs_and_remove_from_src)."""
        given = list(inputs)
        inputs.clear()
        for index, held in self.held_inputs.items():
            held.copy_(given[index])
            given[index] = held
        return given


__all__ = ["CudagraphedGraph", "backward_compiler", "forward_compiler"]
