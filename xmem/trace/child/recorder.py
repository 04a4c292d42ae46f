"""Recording a program's GPU storage allocations and frees under fake CUDA, with training context.

Owns `TrainingState` (phase and iteration, from autograd/optimizer/module hooks; the stop after N iterations) and
`AllocationRecorder` (a TorchDispatchMode above FakeTensorMode that sees every ATen op, notes each new CUDA storage
and, through `weakref.finalize`, the moment it dies, which is when the caching allocator would get `free()`).
Where fake tensors have no data (`.item()`, `nonzero`) it asks `xmem.trace.child.standins.StandIns` for a value.
Import only in the tracing child, after the shim and `xmem.trace.child.fakecuda`.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode

from xmem.alloc_conf import alloc_conf_setting
from xmem.trace.events import (ARCH_SENSITIVE_PROGRESS, CUBLAS_OPS, MANAGED_OP, MANAGED_STREAM, Category, MemEvent,
                               Phase, Trace)
import xmem.trace.child.distributed as distributed
import xmem.trace.child.fft as fft
import xmem.trace.child.float8 as float8
import xmem.trace.child.nf4 as nf4
import xmem.trace.child.shortcuts as shortcuts
from xmem.trace.child.attribution import DECLINED_BY_FAKE_MODE
from xmem.trace.child.facts import fsdp1_flat_parameter, fsdp2_sharded_parameters, inner_tensors
from xmem.trace.errors import NotModelled
from xmem.trace.child.fakecuda import FakeCuda
from xmem.trace.child.known_values import KnownValues
from xmem.trace.child.standins import OFFSET_OPS, StandIns, guess_truth, note_offset
from xmem.trace.child.value_bounds import ValueBounds

aten = torch.ops.aten


class StopTracing(BaseException):
    """Raised from the optimizer's post-step hook once enough iterations ran. BaseException so that the
    user's `except Exception` blocks let it through."""


# Which GPU library a real run of an op on cuda would load (upstream: the CUDA kernels behind each ATen op).
_LIBRARY_OPS = {
    # _grouped_mm: CUTLASS on sm90, a loop of cuBLAS mm elsewhere; counted as loading cuBLAS, given no workspace
    "cublas": CUBLAS_OPS | {"_grouped_mm"},
    "cudnn": {"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
              "cudnn_convolution_transpose", "cudnn_batch_norm", "cudnn_batch_norm_backward", "native_batch_norm",
              "native_batch_norm_backward", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
              "_cudnn_rnn", "_cudnn_rnn_backward", "_scaled_dot_product_cudnn_attention", "cudnn_grid_sampler"},
    "cufft": {"_fft_r2c", "_fft_c2r", "_fft_c2c"},
    "cusolver": {"linalg_cholesky_ex", "cholesky", "cholesky_solve", "cholesky_inverse", "linalg_qr", "geqrf",
                 "ormqr", "_linalg_svd", "_linalg_eigh", "linalg_eig", "linalg_lu_factor_ex", "linalg_lu",
                 "linalg_lu_solve", "linalg_solve_triangular", "triangular_solve", "_linalg_solve_ex",
                 "linalg_inv_ex", "linalg_ldl_factor_ex", "_linalg_det", "_linalg_slogdet",
                 "linalg_householder_product"},
}

# Ops that bring data onto the GPU (host copies, random batches): outside forward/backward/optimizer, the inputs.
_COPY_OPS = {"_to_copy", "copy_", "_copy_from"}
_RANDOM_INPUT_OPS = {"randn", "rand", "randint", "randperm", "normal"}

class NoStepInTime(BaseException):
    """Raised at the trace's own time limit when the program, which created an optimizer, has run forward passes
    but not stepped it yet (see TrainingState)."""


# A program without an optimizer that has run at least the iterations asked of forward passes on the GPU, and this
# many of them or for this long since the first, without any backward pass or step, is traced as forward-only once
# its peak held through the last half of its passes.
FORWARD_ONLY_PASSES = 1000
FORWARD_ONLY_SECONDS = 20.0
# A program whose iterations reach the target on a side stream (`with torch.cuda.stream(s)`) is warming up for a CUDA
# graph capture, as torch's CUDA graphs notes ask (warm-up on a side stream, then capture on one): its trace goes on
# until an iteration completes on the default stream (a replay of a captured step is one), for at most this many
# more iterations, so that the capture and its pool are in it.
SIDE_STREAM_GRACE = 10


class TrainingState:
    """Where the program is in its training loop: phase, iteration, and when to stop.

    Iteration rule: an iteration is complete when every optimizer the program created has stepped once since the
    previous one completed, so GAN-style loops (two optimizers) count one iteration per round, and gradient
    accumulation (k backwards per step) one per step. An optimizer that steps again before the others did shows
    that those others are not part of the loop: the iteration completes there and they are no longer awaited.
    Steps nested in another optimizer's step (wrappers such as ZeroRedundancyOptimizer) are part of that step.
    A program with no optimizer at all (parameters updated by hand) completes an iteration with each backward pass
    from a GPU tensor (`loss.backward()` / `torch.autograd.grad`). Events before the first forward or backward are
    setup: iteration -1.
    Forward passes: a top-level module forward that makes GPU storages before any backward or step (evaluation,
    inference; an nn.Module transform run on host data makes none and is no pass). A program holding an optimizer is
    heading for a step, however long it evaluates first: its passes never end the trace; if the trace's own time
    limit (`deadline`) comes first, NoStepInTime. A program without one ends as forward-only (StopTracing with
    `forward_only` set) once it ran `target` passes and `FORWARD_ONLY_PASSES` of them or for `FORWARD_ONLY_SECONDS`,
    and the GPU's peak has not risen in the last half of its passes (a generation loop's key/value cache grows
    with every pass: its peak is reached at its longest sequence), or when the deadline comes (`peak_rising` says
    if the peak still rose then). A long inference loop ends soon; an evaluation of a few hundred batches before
    the optimizer is made does not. The check runs as the next top-level forward starts, between two passes.
    """

    def __init__(self, iterations: int, on_progress: Callable[[str], None], optimizers: weakref.WeakSet,
                 deadline: float | None = None) -> None:
        self.target = iterations
        self.deadline = deadline  # time.monotonic() of the trace's own time limit
        self.forward_passes = 0  # top-level forwards on the GPU before training
        self.pass_starts: list[int] = []  # the recorder's event count as each of them started
        self.forward_only = False  # the trace ended on forward passes (see the class docstring)
        self.peak_rising = False  # ... at the deadline, with the GPU's peak still rising in its last half
        self._first_pass_at = 0.0
        self._events_before = 0
        self._peak = self._peak_rose_at = 0  # the GPU's peak after the last pass, the pass it last rose in
        self.gpu_events: Callable[[], int] = lambda: 0  # the recorder's count of alloc/free events so far
        self.gpu_peak: Callable[[], int] = lambda: 0  # the recorder's peak of live GPU bytes
        self.on_progress = on_progress
        self.phase = Phase.OTHER
        self.completed = 0
        self.started = False
        self.trained = False  # a backward pass or an optimizer step happened
        self._forward_depth = 0
        self.stopped = False
        self._optimizers = optimizers  # every optimizer the program created (kept by FakeCuda)
        self._not_awaited: set[int] = set()
        self._stepped: set[int] = set()
        self._step_depth = 0
        self.on_step_begin: Callable[[torch.optim.Optimizer], None] = lambda opt: None
        self.on_step_end: Callable[[torch.optim.Optimizer], None] = lambda opt: None
        self.on_module_forward: Callable[[torch.nn.Module], None] = lambda module: None
        self.on_backward_end: Callable[[], None] = lambda: None  # a backward pass that is the iteration (no optimizer)
        self.on_side_stream: Callable[[], bool] = lambda: False  # whether a side stream is current (SIDE_STREAM_GRACE)

    @property
    def iteration(self) -> int:
        return self.completed if self.started else -1

    def install(self) -> None:
        """Hook autograd, optimizers and module forwards (process-global, never removed)."""
        import torch.optim.optimizer as optimizer_module
        optimizer_module.register_optimizer_step_pre_hook(self._before_step)
        optimizer_module.register_optimizer_step_post_hook(self._after_step)
        torch.nn.modules.module.register_module_forward_pre_hook(self._before_module_forward)
        torch.nn.modules.module.register_module_forward_hook(self._after_module_forward, always_call=True)
        torch.autograd.backward = self._in_backward(torch.autograd.backward)
        torch.autograd.grad = self._in_backward(torch.autograd.grad)

    def _before_module_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.on_module_forward(module)
        if self._forward_depth == 0 and not self.trained:
            if self.forward_passes:
                self._end_if_forward_only()
            self._events_before = self.gpu_events()
        self._forward_depth += 1
        if self.phase == Phase.OTHER or self._forward_in_closure():
            self.phase = Phase.FORWARD
            if not self.started:
                self.started = True
                self.on_progress("training started")

    def _after_module_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        if self._forward_depth == 0 and not self.trained and self.gpu_events() > self._events_before:
            self.forward_passes += 1
            self.pass_starts.append(self._events_before)
            if self.forward_passes == 1:
                self._first_pass_at = time.monotonic()
            if self.gpu_peak() > self._peak:
                self._peak, self._peak_rose_at = self.gpu_peak(), self.forward_passes

    def _forward_in_closure(self) -> bool:
        """A forward pass inside an optimizer's step: the step's closure (`optimizer.step(closure)`, which torch's
        optimizers run under `enable_grad` while their own update runs without grad; Lightning's loop trains so).
        Its tensors are activations as in a plain loop, whoever runs the loop."""
        return self.phase == Phase.OPTIMIZER and self._forward_depth == 1 and torch.is_grad_enabled()

    def _after_forward(self) -> str:
        """The phase a backward pass of a forward returns to: the step whose closure ran both, else none."""
        return Phase.OPTIMIZER if self._step_depth else Phase.OTHER

    def _end_if_forward_only(self) -> None:
        now = time.monotonic()
        late = self.deadline is not None and now >= self.deadline
        if late and len(self._optimizers):
            raise NoStepInTime
        settled = self.forward_passes >= 2 * self._peak_rose_at
        enough = self.forward_passes >= self.target and (
            self.forward_passes >= FORWARD_ONLY_PASSES or now - self._first_pass_at >= FORWARD_ONLY_SECONDS)
        if late or (enough and settled and not len(self._optimizers)):
            self.forward_only = self.stopped = True
            self.peak_rising = not settled
            self.on_progress(f"forward passes only: {self.forward_passes}")
            raise StopTracing

    def _in_backward(self, run: Callable) -> Callable:
        def run_in_backward_phase(*args: Any, **kwargs: Any) -> Any:
            outer, self.phase, self.started, self.trained = self.phase, Phase.BACKWARD, True, True
            try:
                result = run(*args, **kwargs)
            finally:
                self.phase = self._after_forward() if outer == Phase.FORWARD else outer
            if outer != Phase.BACKWARD and not self._step_depth and not len(self._optimizers) and \
                    _on_gpu(args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))):
                self.on_backward_end()  # before the last iteration's StopTracing
                self._complete_iteration()  # no optimizer: the backward pass is the iteration
            return result
        return run_in_backward_phase

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_depth += 1
        self.trained = True
        if self._step_depth == 1:
            self.phase = Phase.OPTIMIZER
            self.on_step_begin(optimizer)
        else:
            self._not_awaited.add(id(optimizer))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_depth -= 1
        if self._step_depth > 0:
            return
        self.on_step_end(optimizer)
        self.phase = Phase.OTHER
        if id(optimizer) in self._stepped:  # stepped again: the optimizers not seen are not in the loop
            self._not_awaited |= {id(o) for o in self._optimizers} - self._stepped
            self._complete_iteration()
        self._stepped.add(id(optimizer))
        awaited = {id(o) for o in self._optimizers} - self._not_awaited
        if awaited <= self._stepped:
            self._complete_iteration()

    def _complete_iteration(self) -> None:
        self._stepped = set()
        self.completed += 1
        self.on_progress(f"iteration {self.completed}/{self.target}")
        if self.completed >= self.target and not self._warming_up_for_a_graph():
            self.stopped = True
            raise StopTracing

    def _warming_up_for_a_graph(self) -> bool:
        return self.on_side_stream() and self.completed < self.target + SIDE_STREAM_GRACE

    def replayed(self, iterations: int) -> None:
        """A CUDA graph whose capture completed `iterations` was replayed: so many training iterations ran again."""
        for _ in range(iterations):
            self._complete_iteration()


class AllocationRecorder(TorchDispatchMode):
    """Records every CUDA storage allocation and free in program order, plus what ran (ops, libraries).

    Enter it inside (above) the FakeTensorMode. Storages are identified by their StorageImpl address while alive.
    Per-op work is kept small: a dict increment and a look at the outputs.
    """

    def __init__(self, fake: FakeCuda, state: TrainingState, module_path: Callable[[], str]) -> None:
        super().__init__()
        self.fake = fake
        self.state = state
        self.module_path = module_path
        self.rows: list[list] = []  # [action, block, nbytes, device, stream, op, module, phase, iteration]
        self.category: dict[int, str] = {}  # block -> category (refined after the fact)
        self.op_counts: dict[str, int] = {}
        self.libraries: set[str] = set()
        self.warnings: list[str] = []
        self.arch_sensitive = False
        self.alloc_conf: str | None = None  # the allocator setting, read at the first allocation as torch does
        self.live_bytes = 0
        self.peak_bytes = 0
        # modules that ran forward, by id (a module may define __eq__ and so be unhashable), for gradient labels
        self._forward_modules: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._live: dict[int, tuple[int, int, int, int]] = {}  # storage key -> (block, bytes, device, stream)
        self._emptied: dict[int, int] = {}  # storage key -> device, for watched storages of 0 bytes
        self._block_ids = itertools.count()
        self._cuda_ops: set[str] = set()
        # One lock for everything: the FakeTensorMode keeps per-mode state that two autograd device threads
        # (several fake GPUs) must not change at once; re-entrant because a storage can die, and its finalizer
        # record the free, while this thread holds it.
        self._lock = threading.RLock()
        self._shortcuts = shortcuts.enabled()  # read here, in the job's environment (a warm tracer imports earlier)
        self.stand_ins = StandIns(self.warn, lambda: (state.iteration, state.phase))
        self.known = KnownValues()  # values of GPU tensors copied from the host, which the stand-ins answer with
        self.stand_ins.known_value = self.known.value
        self.bounds = ValueBounds()  # the ranges of integer GPU values, which the stand-ins of sizes follow
        self.stand_ins.value_range = self.bounds.of
        self.sites = UserSites()
        self._connect()

    def _connect(self) -> None:
        fake, state = self.fake, self.state
        fake.on_arch_question = self._arch_question
        fake.on_module_tensor = lambda tensor, kind: self.label(tensor, kind)
        fake.on_empty_cache = self._empty_cache
        fake.on_graph_pool = self._graph_pool
        fake.on_managed = self._managed
        fake.on_warning = self.warn
        fake.on_library = self.libraries.add
        fake.live_bytes = lambda: self.live_bytes
        fake.peak_bytes = lambda: self.peak_bytes
        fake.reset_peak = self._reset_peak
        state.on_step_begin = self._label_parameters_and_gradients
        torch.load = self._recording_load(torch.load)
        self._watch_storage_resizes()
        state.on_step_end = self._label_optimizer_state
        state.on_module_forward = self._label_module_tensors
        state.on_backward_end = self._label_module_gradients
        state.gpu_events = lambda: len(self.rows)  # a top-level forward that adds none ran on the host
        state.gpu_peak = lambda: self.peak_bytes
        state.on_side_stream = lambda: fake.current_stream.stream_id != fake.default_stream.stream_id
        fake.iterations_done = lambda: state.completed
        fake.on_replayed_iterations = state.replayed

    # ---- the dispatch hook -------------------------------------------------------------------------------------
    records_allocations = True  # how distributed.py tells this mode from others on the stack
    supports_higher_order_operators = True  # flex_attention and the like reach __torch_dispatch__ (see below)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd regions (xmem.trace.child.compiled): off while dynamo and AOTAutograd trace them, on again
        # for the compiled graphs' ops as they run, which are what the GPU allocates (else dynamo runs them eagerly)
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._shortcuts:
            device = shortcuts.device_of(func, args)
            if device is not shortcuts.NOT_TAKEN:
                return device
        if distributed.dispatches_itself(types) or nf4.dispatches_itself(types) or float8.dispatches_itself(types):
            return NotImplemented  # DTensor, NF4, float8 dispatch first; their inner ops come back here (the modules)
        if _runs_on_host(args, kwargs):
            # Only what the GPU would hold is fake: host work runs for real, with real values, below the fake mode.
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if distributed.is_wait_tensor(func):
            return args[0]  # what the GPU's wait_tensor returns (see distributed.py)
        with self._lock:
            try:
                return self._dispatch(func, args, kwargs)
            except (NotImplementedError, RuntimeError) as error:
                if _holds_sparse((*args, *kwargs.values())):
                    raise NotModelled(SPARSE_GAP) from error
                raise

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        name = func._opname
        self.op_counts[name] = self.op_counts.get(name, 0) + 1
        if _composite_implicit(func):
            out = self._decomposed(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if not self.state.stopped:
            self._note_unseen_inputs(args, name)
            if name == "convolution" and args[0].dtype == torch.bfloat16:
                self._arch_question()  # cuDNN takes bf16 convolutions from sm80 only (slow path before)
            float8.refuse_where_the_gpu_cannot(name, self.fake)  # float8 matmuls: sm89 and above
        plan = None if self.state.stopped else self.known.plan(func, args, kwargs)
        try:
            out = shortcuts.foreach(func, name, args, kwargs) if self._shortcuts else shortcuts.NOT_TAKEN
            if out is shortcuts.NOT_TAKEN:
                out = _with_plain_data_subclasses_as_tensors(func, args, kwargs)
        except DataDependentOutputException:
            if func in (aten._local_scalar_dense.default, aten.item.default):  # item: under inference_mode
                return self.stand_ins.scalar(args[0])
            if func in (aten.equal.default, aten.allclose.default):
                return self.stand_ins.equal(func._opname, args)
            raise
        except DynamicOutputShapeException:
            out = self.known.made_on_host(plan, args[0].device)
            if out is None:
                out = self.stand_ins.dynamic_shape(func, args, kwargs)
            if out is None:
                raise
        if self.state.stopped:
            return out
        self.known.keep(plan, out)
        self.bounds.note(func, name, args, kwargs, out)
        self.stand_ins.note_host_results(args, kwargs, out)
        self._note_outputs(out, name, args)
        if name in fft.FFT_OPS and isinstance(out, torch.Tensor) and out.device.type == "cuda":
            self._fft_scratch(name, args, kwargs, out.device.index or 0)
        return out

    def _fft_scratch(self, op: str, args: tuple, kwargs: dict, device: int) -> None:
        """What cuFFT's path takes besides the output while the op runs (xmem.trace.child.fft): blocks made and
        freed right after the output, in upstream's order. bf16 takes another path from sm80: a capability question."""
        bf16_r2c = op == "_fft_r2c" and args[0].dtype == torch.bfloat16
        capability = self.fake.ask_capability() if bf16_r2c else self.fake.capability
        blocks: dict[int, tuple[int, int]] = {}
        stream, state = self.fake.current_stream.stream_id, self.state
        try:
            steps = fft.scratch(op, args, kwargs, capability)
        except (RuntimeError, ValueError, IndexError, TypeError) as error:  # a layout the rule did not foresee
            self.warn(f"cuFFT's work area and copies were left out of an FFT call ({op}: {error})")
            return
        for step in steps:
            if step[0] == fft.ALLOC:
                block, nbytes = next(self._block_ids), step[2]
                blocks[step[1]] = block, nbytes
                self.category[block] = step[3]
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            else:
                (block, nbytes), self.live_bytes = blocks[step[1]], self.live_bytes - blocks[step[1]][1]
            self.rows.append([step[0], block, nbytes, device, stream, op, self.module_path(), state.phase,
                              state.iteration])

    def _decomposed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op that autograd would have decomposed (a CompositeImplicitAutograd one) arrives whole where autograd
        is off (`torch.inference_mode`). A GPU then runs that same decomposition; so do we, with this mode back on,
        so that its ops come here one by one: each recorded, its temporaries included, and each given its stand-in
        (`nonzero(as_tuple=True)` is `nonzero`). Sent whole, the fake mode would decompose it out of our sight,
        raise on the `nonzero` inside, or constant-fold an `aten.to` of a real host tensor by a real copy to the
        device. NotImplemented where the op has no decomposition after all."""
        with self:
            return func.decompose(*args, **kwargs)

    def _note_outputs(self, out: Any, name: str, args: tuple) -> None:
        if isinstance(out, torch.Tensor):
            self._note_output(out, name, args)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._note_output(item, name, args)

    def _higher_order(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A higher-order op (flex_attention, checkpoint wrappers, ...): the fake mode's own rule for it runs, which
        gives the outputs a fused kernel would write (flex_attention: output and logsumexp); we record those."""
        name = getattr(func, "_name", str(func))
        self.op_counts[name] = self.op_counts.get(name, 0) + 1
        out = func(*args, **kwargs)
        if not self.state.stopped:
            from torch.utils._pytree import tree_leaves
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._note_output(leaf, name, args)
        return out

    def _note_unseen_inputs(self, args: tuple, op: str) -> None:
        """CUDA storages made outside the dispatcher (torch.load(map_location="cuda") builds storages directly)
        are recorded at their first use, late but not lost."""
        for arg in args:
            if isinstance(arg, torch.Tensor):
                self._note_unseen(arg, f"unseen before {op}")
            elif isinstance(arg, (list, tuple)):
                for item in arg:
                    if isinstance(item, torch.Tensor):
                        self._note_unseen(item, f"unseen before {op}")

    def _note_unseen(self, tensor: torch.Tensor, op: str) -> None:
        if type(tensor) is not FakeTensor and hasattr(tensor, "__tensor_flatten__"):
            for inner in inner_tensors(tensor):
                self._note_unseen(inner, op)
            return
        key = _storage_key(tensor)
        if key is not None and self._known(key):
            return  # nearly every input: known storages are CUDA ones, so the device (a Python property) can wait
        if tensor.device.type == "cuda":
            storage = tensor.untyped_storage()
            self._alloc(storage, storage._cdata, tensor.device.index or 0, op, from_host=True)

    def _note_output(self, tensor: torch.Tensor, op: str, args: tuple) -> None:
        if type(tensor) is not FakeTensor and hasattr(tensor, "__tensor_flatten__"):
            # a wrapper subclass (DTensor...): its own storage is a shell of the global size; the memory is in the
            # inner tensors, made while the subclass dispatched (with this mode off)
            for inner in inner_tensors(tensor):
                self._note_unseen(inner, op)
            return
        if tensor.dtype == torch.bool:
            guess_truth(tensor, op, args)
        elif op in OFFSET_OPS:
            note_offset(tensor, op, args)
        key = _storage_key(tensor)
        known = key is not None and self._known(key)  # a view, an in-place result: on CUDA, as all known storages
        if not known and tensor.device.type != "cuda":
            return
        if op not in self._cuda_ops:
            self._first_cuda_use(op)
        if known:
            return
        storage = tensor.untyped_storage()
        from_host = op in _COPY_OPS and isinstance(args[0], torch.Tensor) and args[0].device.type != "cuda"
        self._alloc(storage, storage._cdata, tensor.device.index or 0, op, from_host)

    def _alloc(self, storage: torch.UntypedStorage, key: int, device: int, op: str, from_host: bool,
               watch: bool = True) -> None:
        state = self.state
        nbytes = storage.nbytes()
        if self.alloc_conf is None:  # the caching allocator reads its setting once, when it first allocates
            setting = alloc_conf_setting(os.environ)
            self.alloc_conf = setting[1] if setting else ""
        if watch:
            finalizer = weakref.finalize(storage, self._free, key)
            finalizer.atexit = False
        if nbytes == 0:  # the caching allocator returns no block for 0 bytes; a later resize_ may give it some
            self._emptied[key] = device
            return
        with self._lock:
            block = next(self._block_ids)
            stream = self.fake.current_stream.stream_id
            self._live[key] = (block, nbytes, device, stream)
            self.rows.append(["alloc", block, nbytes, device, stream, op, self.module_path(), state.phase,
                              state.iteration, self.sites.current()])
            self.category[block] = _category_at_birth(state.phase, op, from_host)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        """The storage died, or was resized: its current block goes back to the allocator."""
        with self._lock:
            self._emptied.pop(key, None)
            live = self._live.pop(key, None)
            if live is None or self.state.stopped:
                return
            block, nbytes, device, stream = live
            self.live_bytes -= nbytes
            self.rows.append(["free", block, nbytes, device, stream, "", self.module_path(), self.state.phase,
                              self.state.iteration])

    def _known(self, key: int) -> bool:
        """Whether the storage is already recorded (alive, possibly with 0 bytes)."""
        return key in self._live or key in self._emptied

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """`storage.resize_(n)` (FSDP frees and re-allocates unsharded parameters so) happens outside the dispatcher:
        on the GPU it is a free of the old block and a new cudaMalloc-backed block of n bytes.
        In a training program only FSDP (1 and 2: `free_storage`/`alloc_storage`, `_free_storage`) resizes storages,
        to drop and regrow what it all-gathers, so both blocks are Category.UNSHARDED_PARAMETER: not the parameters the
        optimizer steps (the shards), though the module holds them as its parameters while it runs."""
        key = storage._cdata
        if self.state.stopped or (key not in self._live and key not in self._emptied):
            return
        device = self._live[key][2] if key in self._live else self._emptied[key]
        self._label_unsharded(key)
        self._free(key)
        self._alloc(storage, key, device, "resize_", from_host=False, watch=False)
        self._label_unsharded(key)

    def _label_unsharded(self, key: int) -> None:
        live = self._live.get(key)
        if live is not None:
            self.category[live[0]] = Category.UNSHARDED_PARAMETER

    def _first_cuda_use(self, op: str) -> None:
        self._cuda_ops.add(op)
        for library, ops in _LIBRARY_OPS.items():
            if op in ops:
                self.libraries.add(library)

    def _watch_storage_resizes(self) -> None:
        resize = torch.UntypedStorage.resize_

        def resize_and_record(storage: torch.UntypedStorage, size: int) -> Any:
            result = resize(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_and_record

    def _recording_load(self, load: Callable) -> Callable:
        """torch.load(map_location="cuda") makes GPU storages without dispatching an op: note them as it returns."""
        from torch.utils._pytree import tree_leaves

        def load_and_record(*args: Any, **kwargs: Any) -> Any:
            loaded = load(*args, **kwargs)
            if not self.state.stopped:
                for leaf in tree_leaves(loaded):
                    if isinstance(leaf, torch.Tensor):
                        self._note_unseen(leaf, "torch.load")
            return loaded
        return load_and_record

    # ---- listeners --------------------------------------------------------------------------------------------
    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def _arch_question(self) -> None:
        """The program took a choice that depends on the GPU generation: other classes need traces of their own."""
        if not self.arch_sensitive:
            self.arch_sensitive = True
            self.state.on_progress(ARCH_SENSITIVE_PROGRESS)

    def _empty_cache(self) -> None:
        if not self.state.stopped:
            self.rows.append(["empty_cache", -1, 0, self.fake.current_device, 0, "empty_cache", self.module_path(),
                              self.state.phase, self.state.iteration])

    def _graph_pool(self, action: str, pool: int, stream: int) -> None:
        """A CUDA graph's pool action (xmem.trace.child.cuda_graphs): `pool` in the block's place."""
        if not self.state.stopped:
            with self._lock:
                self.rows.append([action, pool, 0, self.fake.current_device, stream, action, self.module_path(),
                                  self.state.phase, self.state.iteration])

    def _managed(self, tensor: torch.Tensor) -> None:
        """A storage made as CUDA managed memory (xmem.trace.child.managed_memory): its alloc, and the free to come,
        move to MANAGED_STREAM, outside the caching allocator."""
        key = _storage_key(tensor)
        with self._lock:
            live = self._live.get(key)
            if live is None or self.state.stopped:
                return
            block, nbytes, device, _stream = live
            self._live[key] = (block, nbytes, device, MANAGED_STREAM)
            for row in reversed(self.rows):
                if row[0] == "alloc" and row[1] == block:
                    row[4], row[5] = MANAGED_STREAM, MANAGED_OP
                    return

    def _reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def label(self, tensor: torch.Tensor | None, category: str) -> None:
        """Set the category of the storage(s) behind `tensor` (the inner tensors' for a wrapper subclass)."""
        if tensor is None:
            return
        if type(tensor) is not FakeTensor and hasattr(tensor, "__tensor_flatten__"):
            for inner in inner_tensors(tensor):
                self.label(inner, category)
        elif tensor.device.type == "cuda":
            live = self._live.get(tensor.untyped_storage()._cdata)
            # an FSDP unit's gathered parameters are its module's parameters while it runs: they stay unsharded
            if live is not None and not (category == Category.PARAMETER and
                                     self.category.get(live[0]) == Category.UNSHARDED_PARAMETER):
                self.category[live[0]] = category

    def _label_module_tensors(self, module: torch.nn.Module) -> None:
        self._forward_modules[id(module)] = module
        # frozen weights (no optimizer) made directly on the GPU are known as parameters only by their module
        for param in module._parameters.values():
            self.label(param, Category.PARAMETER)
        for buffer in module._buffers.values():
            self.label(buffer, Category.BUFFER)

    def _label_module_gradients(self) -> None:
        # no optimizer names the parameters (updated by hand: p.data.add_(p.grad, alpha=-lr)), so the gradients
        # are those of the parameters of the modules that ran forward; unlabelled they were "temporary"
        for module in list(self._forward_modules.values()):
            for param in module._parameters.values():
                if param is not None:
                    self.label(param.grad, Category.GRADIENT)

    def _label_parameters_and_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.label(param, Category.PARAMETER)
                self.label(param.grad, Category.GRADIENT)
        for module in list(self._forward_modules.values()):  # sharded by now: FSDP resharded them after backward
            flat = fsdp1_flat_parameter(module)
            if flat is not None:
                self.label(flat, Category.PARAMETER)
                self.label(flat.grad, Category.GRADIENT)
            for param in fsdp2_sharded_parameters(module):  # frozen shards too, which no optimizer names
                self.label(param, Category.PARAMETER)

    def _label_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        # a step with a closure made its gradients after it began (the closure runs forward and backward)
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.label(param.grad, Category.GRADIENT)
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    self.label(value, Category.OPTIMIZER_STATE)

    # ---- the result -------------------------------------------------------------------------------------------
    def to_trace(self, capability: tuple[int, int], seconds: float) -> Trace:
        if not self.state.completed:
            self._number_forward_passes()
        events = [MemEvent(*row[:9], category=self._category_of(row), site=row[9] if len(row) > 9 else -1)
                  for row in self.rows]
        return Trace(events=events, iterations=self.state.completed, warnings=list(self.warnings),
                     libraries=sorted(self.libraries), op_counts=dict(self.op_counts), capability=capability,
                     arch_sensitive=self.arch_sensitive, used_cuda=bool(self.rows),
                     alloc_conf=self.alloc_conf or "", seconds=seconds, torch_version=torch.__version__,
                     sites=self.sites.table())

    def _category_of(self, row: list) -> str:
        """An alloc's or free's storage category; a pool action's block is a pool, not a storage."""
        return self.category.get(row[1], Category.OTHER) if row[0] in ("alloc", "free") else Category.OTHER


    def _number_forward_passes(self) -> None:
        """With no training iteration, each forward pass is one: the events from its start on carry its number."""
        starts, number = self.state.pass_starts, -1
        for index, row in enumerate(self.rows):
            while number + 1 < len(starts) and starts[number + 1] <= index:
                number += 1
            if number >= 0:
                row[8] = number


class UserSites:
    """The program's line behind each allocation, for the memory snapshot's frames (issue 32): the innermost Python
    frame outside torch, xmem and the standard library (the model's own forward, a library's modeling code, or
    the training script), taken with sys._getframe only when a storage is allocated. An allocation on an autograd
    device thread (backward on a fake GPU), whose stack is torch's alone, takes the main thread's line (its
    `loss.backward()`). Each (file, line, function) is stored once; an alloc row carries its index."""

    def __init__(self) -> None:
        self._index: dict[tuple[str, int, str], int] = {}
        # id(code) -> (code, whether its file is skipped), asked once each: by id, as hashing a code object hashes
        # its whole body; the code is held, so that its id is not reused
        self._library_code: dict[int, tuple[Any, bool]] = {}
        self._main = threading.main_thread().ident

    def current(self) -> int:
        """The index of the calling allocation's site; -1 when no frame of the program is on the stack."""
        frame = self._outside_libraries(sys._getframe(1))
        if frame is None and threading.get_ident() != self._main:
            frame = self._outside_libraries(sys._current_frames().get(self._main))
        if frame is None:
            return -1
        key = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        return self._index.setdefault(key, len(self._index))

    def table(self) -> list[tuple[str, int, str]]:
        return list(self._index)  # in index order: a dict keeps its insertion order

    def _outside_libraries(self, frame: Any) -> Any:
        known = self._library_code
        while frame is not None:
            code = frame.f_code
            entry = known.get(id(code))
            if entry is None:
                entry = known[id(code)] = (code, _skipped_file(code.co_filename))
            if not entry[1]:
                return frame
            frame = frame.f_back
        return None


# Frames that are never the program's line: torch's, ours, the standard library's (not its site-packages), and
# generated code (`<string>`, torch.fx's `<eval_with_key>`, `<frozen ...>`).
_SKIPPED_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch/
                 os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")) + os.sep)  # xmem/
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _skipped_file(filename: str) -> bool:
    return (filename.startswith(("<", *_SKIPPED_DIRS))
            or (filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename))


# Sparse layouts hold their memory in index and value tensors that the fake mode does not make for the GPU (its
# kernels for them reach the real runtime, and a sparse tensor has no storage of its own to record).
SPARSE_GAP = "sparse tensors on the GPU (torch.sparse layouts): their index and value memory is not modelled"


def _holds_sparse(values: tuple) -> bool:
    """Whether an op's arguments (and lists of them) hold a sparse tensor or ask for a sparse layout."""
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.layout != torch.strided or \
                    isinstance(item, torch.layout) and item != torch.strided:
                return True
    return False


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the StorageImpl behind `tensor`, which identifies a storage while it lives; None for a
    layout without one (sparse)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _category_at_birth(phase: str, op: str, from_host: bool) -> str:
    """First guess of a storage's category; parameters, gradients and optimizer state are labelled later."""
    if phase == Phase.FORWARD:
        return Category.ACTIVATION
    if phase in (Phase.BACKWARD, Phase.OPTIMIZER):
        return Category.TEMPORARY
    return Category.INPUT if from_host or op in _RANDOM_INPUT_OPS else Category.TEMPORARY


def _on_gpu(tensors: Any) -> bool:
    """Whether a backward starts from a GPU tensor (a CPU-only warm-up loop's backward is no training iteration)."""
    from torch.utils._pytree import tree_leaves
    return any(isinstance(t, FakeTensor) for t in tree_leaves(tensors))


_COMPOSITE: dict[Any, bool] = {}  # op overload -> whether it has a CompositeImplicitAutograd kernel


def _composite_implicit(func: Any) -> bool:
    """Whether autograd decomposes this op rather than dispatching it (its CompositeImplicitAutograd kernel, in C++
    or in Python); asked of the dispatcher once per op. TorchScript's own ops (`prim::device`) have no dispatcher
    entry at all."""
    known = _COMPOSITE.get(func)
    if known is None:
        key, name = torch._C.DispatchKey.CompositeImplicitAutograd, func.name()
        known = _COMPOSITE[func] = key in func.py_kernels or (
            torch._C._dispatch_has_kernel(name) and torch._C._dispatch_has_kernel_for_dispatch_key(name, key))
    return known


def _runs_on_host(args: tuple, kwargs: dict) -> bool:
    """Whether an op touches nothing the GPU would hold: no fake (or wrapper-subclass) tensor among its inputs and no
    cuda device asked for. Real tensors are host tensors: there is no real GPU in a trace. Meta tensors go to the
    fake mode as before (they hold no data either way, and torch.load under a fake mode rebuilds on meta)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if not _is_plain(value):
                return False
        elif isinstance(value, torch.device):
            if value.type in _FAKE_DEVICES:
                return False
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and not _is_plain(item):
                    return False
    return True


def _with_plain_data_subclasses_as_tensors(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` under the fake mode. FakeTensorMode declines a Python subclass of Tensor it does not know, even one
    that only adds behaviour above dispatch (torchvision's tv_tensors.Image: `batch.to("cuda")` ended anomalib's
    training); on a GPU such a subclass is its data. So when it declines, the op runs again on the same real data as
    plain tensors (a view: no copy). Only then: the common path pays nothing."""
    try:
        return func(*args, **kwargs)
    except TypeError as error:
        if DECLINED_BY_FAKE_MODE not in str(error):
            raise
        with unset_fake_temporarily():
            args, kwargs = pytree.tree_map_only(torch.Tensor, _as_plain_tensor, (args, kwargs))
        return func(*args, **kwargs)


def _as_plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    kind = type(tensor)
    if kind in (torch.Tensor, torch.nn.Parameter) or isinstance(tensor, FakeTensor) or \
            kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return tensor  # torch's own, fake, or a subclass that dispatches itself
    return tensor.as_subclass(torch.Tensor)


def _is_plain(tensor: torch.Tensor) -> bool:
    """A real tensor of torch's own types (or a plain Python subclass without its own dispatch)."""
    kind = type(tensor)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter and (
            isinstance(tensor, FakeTensor) or hasattr(kind, "__tensor_flatten__")):
        return False
    return not tensor.is_meta


_FAKE_DEVICES = ("cuda", "meta")