"""torch.compile'd regions traced as compiled: what the compiled program would allocate on a GPU, under fake CUDA.

Owns the tracer's `torch.compile` (`install`). Dynamo captures the program's graphs as on a GPU (graph breaks and the
frames it skips run eagerly there too); each graph goes to `traced_backend`, which does what Inductor's `compile_fx`
does up to code generation: AOTAutograd with Inductor's decompositions and Inductor's partitioner
(`torch._inductor.compile_fx.partition_fn`: its joint-graph passes, then `min_cut_rematerialization_partition`). So
the activations saved for backward are the ones the compiled program keeps, recomputation choices included (the
dominant memory effect of compiling). The forward and backward graphs then run node by node (`GraphRunner`) on the
program's fake tensors, each value dropped after its last use, as Inductor's generated code frees its buffers:

- ops Inductor runs as library kernels (matmuls, convolutions, attention, fallbacks: `ExternKernel`s) and mutations
  run as in eager mode, seen by the recorder (their outputs, cuBLAS/cuDNN use);
- ops Inductor lowers into its own kernels (pointwise, reductions, views, ...) are computed below the recorder (shape
  only), and only a value Inductor would write to memory (`Fusion.realized`) gets a buffer, made by `empty_strided`
  as Inductor's code makes it: a graph output (a saved activation, a gradient), an input of a library kernel, a
  reduction, a value read by several kernels that reads more than Inductor's `realize_reads_threshold` buffers,
  a value that accumulated more than `realize_acc_reads_threshold` reads.

Not modelled (said where it matters): Inductor's own post-grad passes and pattern rewrites, the op-count limits of
its inlining, its in-kernel buffer removal and buffer reuse (the caching allocator's reuse stands for it), layout
padding; user backends other than Inductor/aot_eager/eager. CUDA graphs (mode="reduce-overhead", "max-autotune",
the triton.cudagraphs option): Inductor's CUDA graph trees, their one private pool per device, warm-up and recording
(xmem.trace.child.cudagraph_trees).
A region that our backend cannot follow runs eagerly with a warning that names it (`FALLBACK_WARNING`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from xmem.trace.child import cudagraph_trees

# said once per region our backend could not compile: the region ran op by op as in eager mode
FALLBACK_WARNING = "torch.compile: a compiled region ({region}) was traced eagerly ({why}): compiled code often needs less"
# said when dynamo itself failed on a frame (torch's suppress_errors path): that frame ran eagerly
DYNAMO_FALLBACK_WARNING = "torch.compile: dynamo could not follow {region} ({why}): it was traced eagerly"
BACKEND_WARNING = ("torch.compile's backend {backend!r} was not followed: its regions were traced as dynamo captured "
                   "them, op by op (eager memory)")
CUDAGRAPH_WARNING = ("torch.compile(mode={mode!r}) runs CUDA graphs, whose private memory pool is not modelled: the "
                     "compiled regions were traced without it")
# Inductor's own realization limits (torch._inductor.config), restated in `Fusion`
REALIZE_READS = 4
REALIZE_ACCUMULATED_READS = 8
# reductions: Inductor makes each a buffer of its own (ir.Reduction is stored, not inlined into its readers)
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "argmax", "argmin", "var_mean", "var", "std", "max",
                        "min", "any", "all", "logsumexp", "cumsum", "cumprod", "sort", "topk"})

_fake_cuda: Any = None  # the FakeCuda whose on_warning hears this module's warnings (set by install)


def install(fake: Any) -> None:
    """torch.compile follows the compiled program (module docstring); nothing changes until a program compiles."""
    global _fake_cuda
    _fake_cuda = fake
    # the global hooks torch warns of are the tracer's own, set aside in compiled regions (_with_tracer_hooks_outside)
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    real_compile = torch.compile

    def compile_traced(model: Any = None, *, fullgraph: bool = False, dynamic: bool | None = None,
                       backend: Any = "inductor", mode: str | None = None, options: dict | None = None,
                       disable: bool = False) -> Any:
        if model is None:  # used as a decorator with arguments
            return lambda function: compile_traced(function, fullgraph=fullgraph, dynamic=dynamic, backend=backend,
                                                   mode=mode, options=options, disable=disable)
        if disable:
            return model
        compiled = real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=_backend_for(backend, mode,
                                                                                                   options))
        return _with_tracer_hooks_outside(compiled, model)

    functools.update_wrapper(compile_traced, real_compile)
    torch.compile = compile_traced


def _warn(message: str) -> None:
    if _fake_cuda is not None:
        _fake_cuda.on_warning(message)


def _backend_for(backend: Any, mode: str | None, options: dict | None) -> Any:
    """The backend that stands for the program's: Inductor's (and aot_eager's) AOTAutograd partition, run node by node,
    under Inductor's CUDA graph trees where its mode or options turn them on; dynamo's eager backend as it is; any
    other, eager with a warning."""
    cudagraphs = _cudagraphs_on(mode, options)
    if backend == "inductor" and cudagraphs:
        return functools.partial(traced_backend, cudagraphs=True)
    if cudagraphs:
        _warn(CUDAGRAPH_WARNING.format(mode=mode or "triton.cudagraphs"))
    if backend in ("inductor", "aot_eager_decomp_partition"):
        return traced_backend
    if backend == "aot_eager":
        return functools.partial(traced_backend, partitioner="default", decompose=False)
    if backend != "eager":
        _warn(BACKEND_WARNING.format(backend=getattr(backend, "__name__", backend)))
    return "eager"


def _cudagraphs_on(mode: str | None, options: dict | None) -> bool:
    """Inductor's CUDA graphs: its option, else its mode's (torch._inductor.list_mode_options), else its config's."""
    from torch._inductor import config, list_mode_options
    chosen = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    return bool(chosen.get("triton.cudagraphs", config.triton.cudagraphs))


# ---- dynamo under the fake GPU ---------------------------------------------------------------------------------------

@functools.cache
def _prepare_dynamo() -> None:
    """Once, at the first compile: what dynamo needs of the fake world. Eager programs never get here."""
    _distinct_fake_functions()
    # the DDP stand-in (xmem.trace.child.distributed) has no active-module registry for DDPOptimizer, whose bucket-
    # wise graph splitting is then not modelled: one graph per frame, as without DDP
    torch._dynamo.config.optimize_ddp = False
    # the tracer's SDPA (xmem.trace.child.attention: the kernel the GPU would pick) is one call of the graph, as
    # torch's is: dynamo would break the graph at its reads of the backend switches; AOTAutograd traces into it
    torch._dynamo.allow_in_graph(torch.nn.functional.scaled_dot_product_attention)
    logging.getLogger("torch._dynamo.convert_frame").addHandler(_DynamoFailures())
    torch._dynamo.config.suppress_errors = True  # a frame dynamo fails on runs eagerly: said by _DynamoFailures


def _distinct_fake_functions() -> None:
    """Dynamo keys its handlers of torch.cuda/torch.accelerator functions by identity and refuses one function under
    two names; the fake world answers several names with one function (current_stream, _exchange_device...). Each
    second name gets a wrapper of its own, which answers the same."""
    seen: set[int] = set()
    for namespace in (torch.cuda, torch.accelerator):
        for name, value in sorted(vars(namespace).items()):
            if not callable(value) or isinstance(value, type):
                continue
            if id(value) in seen:
                setattr(namespace, name, functools.wraps(value)(functools.partial(_same_answer, value)))
            seen.add(id(value))


def _same_answer(function: Callable, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


class _DynamoFailures(logging.Handler):
    """Dynamo's warning when it gave up on a frame (an error, suppressed: the frame runs eagerly), as a trace warning.
    Its soft failures (graph breaks it cannot resume, logged at info) run eagerly on a GPU too and are not ours."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        why = _first_line(error) if error is not None else record.getMessage().splitlines()[0]
        _warn(DYNAMO_FALLBACK_WARNING.format(region=_frame_name(record.getMessage()), why=why))


def _frame_name(message: str) -> str:
    for line in message.splitlines():
        if "File " in line or "function" in line:
            return line.strip()
    return "a frame"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs")


def _with_tracer_hooks_outside(compiled: Any, model: Any) -> Any:
    """The compiled callable, run with the global module hooks (the tracer's own: phases, module paths, facts) set
    aside: dynamo would trace into them (graph breaks at every module). The compiled module's own call still runs
    them: torch.compile(model) gives an OptimizedModule whose call runs them; model.compile() compiles the module's
    _call_impl, so they are run here around it."""
    if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
        compiled.forward = _hooks_set_aside(compiled.forward, None)
        return compiled
    owner = getattr(model, "__self__", None)
    module = owner if isinstance(owner, torch.nn.Module) and getattr(model, "__name__", "") == "_call_impl" else None
    return _hooks_set_aside(compiled, module)


def _hooks_set_aside(function: Callable, module: torch.nn.Module | None) -> Callable:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        _prepare_dynamo()  # at the first compiled call: a library that only decorates changes nothing
        if module is None:
            with _global_hooks_aside():
                return function(*args, **kwargs)
        return _called_with_global_hooks(module, function, args, kwargs)
    return run


def _called_with_global_hooks(module: torch.nn.Module, function: Callable, args: tuple, kwargs: dict) -> Any:
    """`function(*args, **kwargs)` between the global forward hooks of `module`, as its _call_impl runs them: a
    pre-hook's result replaces the arguments, a forward hook's the output; the always-called ones run if it raises."""
    from torch.nn.modules import module as modules
    for hook in list(modules._global_forward_pre_hooks.values()):
        result = hook(module, args)
        if result is not None:
            args = result if isinstance(result, tuple) else (result,)
    hooks = list(modules._global_forward_hooks.items())
    try:
        with _global_hooks_aside():
            output = function(*args, **kwargs)
    except BaseException:
        for hook_id, hook in hooks:
            if hook_id in modules._global_forward_hooks_always_called:
                hook(module, args, None)
        raise
    for hook_id, hook in hooks:
        with_kwargs = modules._global_forward_hooks_with_kwargs.get(hook_id, False)
        result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
        if result is not None:
            output = result
    return output


@contextlib.contextmanager
def _global_hooks_aside() -> Iterator[None]:
    from torch.nn.modules import module
    kept = {name: dict(getattr(module, name)) for name in _MODULE_HOOKS}
    for name in _MODULE_HOOKS:
        getattr(module, name).clear()
    try:
        yield
    finally:
        for name, hooks in kept.items():
            getattr(module, name).update(hooks)


# ---- the backend -----------------------------------------------------------------------------------------------------

def traced_backend(graph: fx.GraphModule, example_inputs: list, *, partitioner: str = "inductor",
                   decompose: bool = True, cudagraphs: bool = False) -> Callable:
    """Dynamo's backend: AOTAutograd as Inductor sets it up, each graph run by a GraphRunner (under Inductor's CUDA
    graph trees with `cudagraphs`: xmem.trace.child.cudagraph_trees). A failure here is ours: the region runs eagerly
    (dynamo's graph as captured) and a warning names it."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    try:
        decompositions = _inductor_decompositions() if decompose else {}
        partition = _inductor_partition if partitioner == "inductor" else default_partition
        compiler = functools.partial(_runner_for, fusion=decompose)
        if cudagraphs:
            forward, backward = cudagraph_trees.forward_compiler(compiler), cudagraph_trees.backward_compiler(compiler)
        else:
            forward = backward = compiler
        backend = aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=forward,
                               partition_fn=partition, decompositions=decompositions,
                               keep_inference_input_mutations=True)
        with _no_real_constants(), _inductor_fake_mode(example_inputs):
            return backend(graph, example_inputs)
    except Exception as error:  # noqa: BLE001 - any failure of ours: the region is traced eagerly, and said so
        _warn(FALLBACK_WARNING.format(region=_region_name(graph), why=_first_line(error)))
        return graph.forward


@contextlib.contextmanager
def _no_real_constants() -> Iterator[None]:
    """While AOTAutograd traces, proxy tracing computes one-element constants for real (torch.tensor(v) in the graph,
    then its ops, `.to("cuda")` included: a real CUDA tensor at compile time, with no driver here). With its limit at
    0 such values are traced as any other (one element each: no memory to speak of)."""
    from torch.fx.experimental import proxy_tensor
    limit, proxy_tensor.CONSTANT_NUMEL_LIMIT = proxy_tensor.CONSTANT_NUMEL_LIMIT, 0
    try:
        yield
    finally:
        proxy_tensor.CONSTANT_NUMEL_LIMIT = limit


def _inductor_fake_mode(example_inputs: list) -> Any:
    """Inductor's virtualized fake mode (V.fake_mode), which its joint-graph passes use (the random ops' seeds), set
    to dynamo's as compile_fx sets it."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V
    fake_mode = detect_fake_mode(example_inputs)
    return V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext()


def _region_name(graph: fx.GraphModule) -> str:
    calls = sum(1 for node in graph.graph.nodes if node.op in ("call_function", "call_method", "call_module"))
    sites = [node.meta.get("stack_trace", "") for node in graph.graph.nodes if node.meta.get("stack_trace")]
    where = sites[0].strip().splitlines()[-2].strip() if sites and len(sites[0].strip().splitlines()) > 1 else ""
    return f"{calls} ops{', from ' + where if where else ''}"


@functools.cache
def _inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


def _inductor_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple:
    """Inductor's partition_fn (its joint-graph passes, then the min-cut partitioner with compiler="inductor")."""
    from torch._inductor import config
    from torch._inductor.compile_fx import partition_fn
    # passes that run real kernels on the graph's device, which is not here: folding uniform constants (memory
    # neutral: a constant either way) and benchmarking matmul padding (not modelled: no padding)
    with config.patch(joint_graph_constant_folding=False, shape_padding=False):
        return partition_fn(joint, joint_inputs, **kwargs)


def _runner_for(graph: fx.GraphModule, example_inputs: Any, fusion: bool = True) -> Callable:
    return GraphRunner(graph, Fusion.of(graph.graph) if fusion else Fusion.none())


# ---- what Inductor would write to memory -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fusion:
    """Which graph values Inductor computes inside its own kernels (`fused`), which of those it writes to a buffer
    (`realized`), and the buffers a fused value's kernel code reads (`reads`: inputs, library kernels' outputs,
    realized values), which stay alive until that code has run; every other value comes from a library kernel or is
    an input."""

    fused: frozenset[fx.Node]
    realized: frozenset[fx.Node]
    reads: dict[fx.Node, frozenset[fx.Node]]

    @staticmethod
    def none() -> "Fusion":
        return Fusion(frozenset(), frozenset(), {})

    @staticmethod
    def of(graph: fx.Graph) -> "Fusion":
        """Realized: graph outputs, inputs of library kernels, reductions, and values read by several kernels that
        read more than REALIZE_READS buffers or accumulated more than REALIZE_ACCUMULATED_READS (Inductor's
        GraphLowering.run_node and StorageBox.should_realize_on_reuse)."""
        fused = {node for node in graph.nodes if _lowered_by_inductor(node)}
        outputs = {arg for node in graph.nodes if node.op == "output" for arg in node.all_input_nodes}
        realized: set[fx.Node] = set()
        reads: dict[fx.Node, frozenset[fx.Node]] = {}
        for node in graph.nodes:
            if node not in fused:
                continue
            reads[node] = _buffers_read(node.all_input_nodes, reads, realized)
            if node in outputs or _op_name(node) in REDUCTIONS or len(reads[node]) > REALIZE_ACCUMULATED_READS \
                    or any(user not in fused for user in node.users) \
                    or len(node.users) > 1 and len(reads[node]) > REALIZE_READS:
                buffer = _buffer_of(node, fused)
                if buffer is not None:
                    realized.add(buffer)
                    reads[node] = frozenset({node})
        return Fusion(frozenset(fused), frozenset(realized), reads)

    def buffers_read(self, node: fx.Node) -> frozenset[fx.Node]:
        """The values whose memory `node`'s kernel reads (through the fused values among its inputs)."""
        return _buffers_read(node.all_input_nodes, self.reads, self.realized)


def _buffers_read(inputs: list[fx.Node], reads: dict, realized: Any) -> frozenset[fx.Node]:
    return frozenset().union(*(reads[arg] if arg in reads and arg not in realized else frozenset({arg})
                               for arg in inputs))


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "_opname", "")


def _lowered_by_inductor(node: fx.Node) -> bool:
    """An op Inductor turns into its own (fusible) kernel code: it has a lowering that is neither a fallback to the
    ATen kernel nor one of its library-kernel lowerings (torch._inductor.kernel: matmuls, convolutions, flex
    attention, as templates or extern calls). Mutations and higher-order ops run as library kernels here."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    from torch._inductor.lowering import fallbacks, lowerings
    target = node.target
    lowering = lowerings.get(target) or lowerings.get(target.overloadpacket)
    return not target._schema.is_mutable and target not in fallbacks and lowering is not None and \
        not getattr(lowering, "__module__", "").startswith("torch._inductor.kernel")


def _buffer_of(node: fx.Node, fused: set[fx.Node]) -> fx.Node | None:
    """The fused value whose buffer would hold `node`'s data (a view's base, through views); None where the data is
    already in memory (a view of an input or of a library kernel's output)."""
    while node.target.is_view:
        base = node.all_input_nodes[0] if node.all_input_nodes else None
        if base not in fused:
            return None
        node = base
    return node


# ---- running a graph as the compiled program would -------------------------------------------------------------------

class GraphRunner:
    """A forward, backward or inference graph, run node by node in the boxed convention (the caller's list of inputs is
    emptied, so that an input dies at its last use as in Inductor's generated code). Library-kernel ops run as in
    eager mode; fused values are computed below the recorder and a realized one is then given its buffer."""

    def __init__(self, graph: fx.GraphModule, fusion: Fusion) -> None:
        self._boxed_call = True  # an instance attribute: the wrappers AOTAutograd puts around it copy __dict__
        self.module = graph
        self.nodes = list(graph.graph.nodes)
        self.fusion = fusion
        self.dropped_after = _last_uses(self.nodes, fusion)

    def __call__(self, inputs: list) -> Any:
        fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        values: dict[fx.Node, Any] = {}
        inputs = list(inputs) if not isinstance(inputs, list) else inputs
        arguments = iter(inputs)
        for index, node in enumerate(self.nodes):
            if node.op == "placeholder":
                values[node] = next(arguments)
                if index + 1 < len(self.nodes) and self.nodes[index + 1].op != "placeholder":
                    inputs.clear()  # the graph holds its inputs now, each until its last use
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], values.__getitem__)
            else:
                values[node] = self._run(node, values, fake_mode)
            for dead in self.dropped_after.get(node, ()):
                values.pop(dead, None)
        raise AssertionError("graph without output")

    def _run(self, node: fx.Node, values: dict, fake_mode: Any) -> Any:
        if node.op == "get_attr":
            return functools.reduce(getattr, node.target.split("."), self.module)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        if node not in self.fusion.fused or fake_mode is None:
            return node.target(*args, **kwargs)
        with _below_recorder(fake_mode):
            value = node.target(*args, **kwargs)
        if node in self.fusion.realized and isinstance(value, torch.Tensor):
            return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
        return value


@contextlib.contextmanager
def _below_recorder(fake_mode: Any) -> Iterator[None]:
    """Only the fake mode: a fused kernel's values are shapes, never GPU memory of their own."""
    with torch.utils._python_dispatch._disable_current_modes(), fake_mode:
        yield


def _last_uses(nodes: list[fx.Node], fusion: Fusion) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values whose last reader it is (the output node keeps what it returns). A fused value's
    kernel reads the buffers behind it: those live until the kernel that reads them has run."""
    last: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for used in (*node.all_input_nodes, *fusion.buffers_read(node)):
            last[used] = node
    dropped: dict[fx.Node, list[fx.Node]] = {}
    for value, reader in last.items():
        if reader.op != "output":
            dropped.setdefault(reader, []).append(value)
    for node in nodes:  # a value nobody reads dies at once
        if not node.users and node.op not in ("output", "placeholder"):
            dropped.setdefault(node, []).append(node)
    return dropped
