"""The fake-CUDA world a traced program runs in: torch believes a GPU of a given compute capability is present.

Owns every process-global patch of torch made for a trace (torch.cuda API answers, `nn.Module._apply`, GradScaler,
DataLoader, the optimizer foreach default, CPU data -> cuda tensor creation, torch.compile, TorchScript, as_subclass);
the SDPA backend choice (`xmem.trace.child.attention`) and distributed training (`xmem.trace.child.distributed`) are
installed from here too. Patches are plain attribute replacements, which hold on every thread (the autograd device
thread included). Import only in the tracing child, after `xmem.trace.shim.load_shim()`: the patches are never
undone. Must not record anything itself: it reports module tensors and capability questions through the `FakeCuda`
object's callbacks.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import struct
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import xmem.trace.child.attention as attention
import xmem.trace.child.cuda_driver as cuda_driver
import xmem.trace.child.cuda_graphs as cuda_graphs
import xmem.trace.child.deepspeed_ops as deepspeed_ops
import xmem.trace.child.distributed as distributed
import xmem.trace.child.managed_memory as managed_memory
import xmem.trace.child.meta_kernels as meta_kernels
import xmem.trace.child.transformer_engine_refusal as transformer_engine_refusal
import xmem.trace.child.triton_launch as triton_launch
from xmem.trace.errors import as_on_a_gpu
from xmem.trace.events import Category
from xmem.trace.wire import FakeGpu, Note, NoteKind
from xmem.trace.child.on_import import patch_on_import

@dataclass(frozen=True)
class FakeDeviceProperties:
    """Stand-in for torch.cuda's _CudaDeviceProperties (the fields training code reads)."""

    name: str
    memory_bytes: int
    major: int
    minor: int
    multi_processor_count: int
    L2_cache_size: int
    max_threads_per_multi_processor: int
    warp_size: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    gcnArchName: str = ""
    on_memory_read: Callable[[int], None] = field(default=lambda nbytes: None, repr=False, compare=False)

    @property
    def total_memory(self) -> int:
        self.on_memory_read(self.memory_bytes)  # the program may size itself by it: the estimate says so
        return self.memory_bytes


class FakeStream:
    """A CUDA stream that exists only as an id: allocations are tagged with the current stream's id."""

    _ids = itertools.count(1)

    def __init__(self, device: Any = None, priority: int = 0, stream_id: int | None = None, **_: Any) -> None:
        self.stream_id = next(self._ids) if stream_id is None else stream_id
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.cuda_stream = self.stream_id

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def record_event(self, event: Any = None) -> "FakeEvent":
        return event or FakeEvent()
    def query(self) -> bool:
        return True
    def synchronize(self) -> None: ...
    def is_capturing(self) -> bool:
        return False
    def __enter__(self) -> "FakeStream":  # `with stream:` makes it current, as torch.Stream does
        assert _installed is not None, "fake CUDA is not installed"
        self._previous, _installed.current_stream = _installed.current_stream, self
        return self
    def __exit__(self, *exc: Any) -> None:
        assert _installed is not None
        _installed.current_stream = self._previous
    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id
    def __hash__(self) -> int:
        return hash(self.stream_id)
    def __repr__(self) -> str:
        return f"<fake cuda stream {self.stream_id}>"


class FakeEvent:
    """A CUDA event that is always complete; elapsed_time is a nominal 1 ms (no timing exists here)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def query(self) -> bool:
        return True
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: "FakeEvent") -> float:
        return 1.0


class HostGenerator(torch.Generator):
    """torch.Generator whose "cuda" generators live on the host: a CUDA generator needs a driver, and under fake
    tensors random ops only need a generator to exist (their values are never made). One asked for on cuda is a
    CudaGenerator, whose state has the GPU's form."""

    def __new__(cls, device: Any = "cpu") -> "HostGenerator":
        if cls is HostGenerator and _is_cuda(device):
            return CudaGenerator(device)
        return super().__new__(cls, "cpu")

    def __init__(self, device: Any = "cpu") -> None:  # the C type's initialiser already ran in __new__
        pass


# upstream CUDAGeneratorImpl::get_state: the Philox seed (uint64) then the offset (int64), 16 bytes; set_state also
# takes the seed alone (8 bytes, the form of older versions) and refuses any other size
CUDA_STATE = struct.Struct("<Qq")


class CudaGenerator(HostGenerator):
    """A GPU's generator on the host (`torch.cuda.default_generators[i]`, `torch.Generator("cuda")`): seeded as a
    CUDA one is, and its state in the CUDA form (CUDA_STATE), so that a program that saves a state, forks and
    restores it (Megatron's RNG tracker, torch.random.fork_rng, checkpointing) runs as on a GPU. No kernel draws
    here, so the offset moves only when a state is set."""

    def __new__(cls, device: Any = None) -> "CudaGenerator":
        return torch.Generator.__new__(cls, "cpu")

    def __init__(self, device: Any = None) -> None:
        self.index = _device_index(device)
        self.offset = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def get_state(self) -> torch.Tensor:
        with unset_fake_temporarily():  # a real host tensor, as upstream's
            raw = bytearray(CUDA_STATE.pack(self.initial_seed(), self.offset))
            return torch.frombuffer(raw, dtype=torch.uint8).clone()

    def set_state(self, state: torch.Tensor) -> "CudaGenerator":
        if state.dtype != torch.uint8 or state.numel() not in (CUDA_STATE.size, CUDA_STATE.size // 2):
            raise RuntimeError("RNG state is wrong size")
        if isinstance(state, FakeTensor):  # a state kept on the GPU: its bytes are not here
            return self
        with unset_fake_temporarily():
            raw = bytes(state.contiguous().numpy()).ljust(CUDA_STATE.size, b"\0")
        seed, self.offset = CUDA_STATE.unpack(raw)
        self.manual_seed(seed)
        return self


class FakeCuda:
    """The pretended GPU(s): answers torch.cuda questions and tells listeners what the program asked or did.

    Listeners (set by the recorder): `on_arch_question()` when a capability-dependent answer was given,
    `on_module_tensor(tensor, kind)` for each parameter/buffer a module moved, `on_empty_cache()`,
    `live_bytes()` / `peak_bytes()` / `reset_peak()` for the memory queries. A read of the memory size
    (`ask_total_memory`) is said once as a warning: what a program allocates after it may follow the size it saw,
    and a MIG slice or an MPS share shows another one than the traced GPU.
    """

    def __init__(self, gpu: FakeGpu, device_count: int = 1) -> None:
        self.gpu = gpu  # every fact it reports, as the request carried them (the catalog's type)
        self.capability = gpu.capability
        self.device_count = device_count
        self.current_device = 0
        self.default_stream = FakeStream(stream_id=0)
        self.current_stream = self.default_stream
        self.on_arch_question: Callable[[], None] = lambda: None
        self.on_module_tensor: Callable[[torch.Tensor, str], None] = lambda t, kind: None
        self.on_empty_cache: Callable[[], None] = lambda: None
        self.on_warning: Callable[[str], None] = lambda message: None
        self.on_library: Callable[[str], None] = lambda name: None
        self.on_graph_pool: Callable[[str, int, int], None] = lambda action, pool, stream: None  # cuda_graphs
        self.on_managed: Callable[[torch.Tensor], None] = lambda tensor: None  # managed_memory
        self.iterations_done: Callable[[], int] = lambda: 0  # training iterations completed (cuda_graphs' replays)
        self.on_replayed_iterations: Callable[[int], None] = lambda iterations: None
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # every optimizer the program created
        self.live_bytes: Callable[[], int] = lambda: 0
        self.peak_bytes: Callable[[], int] = lambda: 0
        self.reset_peak: Callable[[], None] = lambda: None
        self.memory_size_said = False  # the memory-size warning, once (`_memory_size_read`)

    @property
    def properties(self) -> FakeDeviceProperties:
        """The requested GPU's (scripts that size their batch from total_memory see the target GPU)."""
        gpu = self.gpu
        return FakeDeviceProperties(gpu.name, gpu.total_bytes, gpu.capability[0], gpu.capability[1],
                                    gpu.multi_processor_count, gpu.l2_cache_bytes, gpu.max_threads_per_multi_processor,
                                    gpu.warp_size, on_memory_read=self._memory_size_read)

    def ask_total_memory(self) -> int:
        """The device's memory size, as `total_memory`, `mem_get_info` and NVML give it to the program."""
        return self.properties.total_memory

    def _memory_size_read(self, nbytes: int) -> None:
        if not self.memory_size_said and not _read_for_a_cap_only():
            self.memory_size_said = True
            self.on_warning(memory_size_warning(nbytes))

    @property
    def bf16_supported(self) -> bool:
        return self.capability >= (8, 0)

    def ask_capability(self) -> tuple[int, int]:
        self.on_arch_question()
        return self.capability

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream | None):
        previous, self.current_stream = self.current_stream, stream or self.current_stream
        try:
            yield stream
        finally:
            self.current_stream = previous


_installed: FakeCuda | None = None  # the process's fake GPU(s), once install() ran


def install(fake: FakeCuda) -> None:
    """Apply every process-global patch. Call once, right after `import torch` in the tracing child."""
    global _installed
    _installed = fake
    _install_device_guard()
    meta_kernels.install()  # ops with only a CUDA kernel upstream (SyncBatchNorm's): sized, not run
    _patch_optimizer_defaults(fake)
    _patch_torch_cuda(fake)
    _ask_triton_again()
    _patch_tensor_and_data(fake)
    _data_assignment_takes_its_device()
    _patch_grad_scaler(fake)
    _patch_cuda_data_functions()
    attention.install(fake)
    _patch_compile(fake)
    _patch_torchscript(fake)
    _patch_as_subclass()
    patch_on_import("transformers.utils.import_utils", _fake_tensors_are_not_a_graph)
    distributed.install(fake)
    nn.Module._apply = _make_fake_aware_apply(nn.Module._apply, fake)
    _patch_module_registration(fake)
    _rebuild_fake_parameters_by_type()
    _swap_fake_tensors_too()
    _patch_recurrent_layers()
    _patch_nvml(fake)
    cuda_driver.install()  # a library's own load of libcuda: not modelled, named
    transformer_engine_refusal.install()  # NVIDIA's kernels in its own extension: not modelled, named
    managed_memory.install(fake)  # bitsandbytes' paged optimizer state: managed memory, beside the allocator's
    patch_on_import("triton", lambda triton: triton_launch.install(fake))  # launches checked and skipped
    patch_on_import("deepspeed.ops.op_builder.builder", deepspeed_ops.install)  # compiled ops: no compiling
    for module_name in deepspeed_ops.FINITE_GRADIENTS:  # ZeRO's overflow checks read stand-ins
        patch_on_import(module_name, deepspeed_ops.finite_gradients)
    patch_on_import("deepspeed.runtime.zero.utils", deepspeed_ops.rank_0_lists)  # ZeRO-3's order checks
    patch_on_import("accelerate.utils.deepspeed", deepspeed_ops.track_dummy_optimizers)


def _install_device_guard() -> None:
    # CUDA build: replace the real CUDA guard (0 devices) with torch's own no-op guard now, as FakeTensorMode
    # would do on entry, but only while torch.cuda.is_available() is False (it won't be, once patched).
    if hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        torch._C._ensureCUDADeviceGuardSet()
    # There is no device: FakeTensorMode must never try to initialise one, whatever is_available() says.
    FakeTensorMode.avoid_device_init = property(lambda self: True)
    # torch.tensor(data, device="cuda") builds on the host first in every thread, not only where the fake mode is
    # entered (the flag is process-global; FakeTensorMode sets it on entry and restores it on exit).
    torch._C._set_only_lift_cpu_tensors(True)


def _patch_optimizer_defaults(fake: FakeCuda) -> None:
    # On a GPU, optimizers default to foreach for plain tensors; FakeTensor params must count as such.
    import torch.optim.optimizer as optimizer_module
    if FakeTensor not in optimizer_module._foreach_supported_types:
        optimizer_module._foreach_supported_types.append(FakeTensor)
    original_init = torch.optim.Optimizer.__init__

    def init_and_register(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        fake.optimizers.add(self)

    torch.optim.Optimizer.__init__ = init_and_register


def _device_index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def _resolve_bare_cuda_to_current(fake: FakeCuda) -> None:
    """A "cuda" without an index in `Tensor.to` / `Tensor.cuda` (and so `Module.to` / `Module.cuda`) lands on the
    current device, as on a GPU. ATen resolves that index in C++ (TensorConversions' ensure_has_index asks the
    device guard, i.e. the runtime's current device), which never hears of the fake's `set_device`: after
    `torch.cuda.set_device(3)` a `.cuda()` landed on cuda:0 while `device="cuda"` factories (FakeTensor asks
    torch.cuda.current_device()) went to cuda:3, and a rank's trace failed on the mismatch. Installed on the first
    move away from device 0, so a program that never leaves it keeps torch's own methods."""
    if fake.current_device == 0 or getattr(torch.Tensor.to, "_xmem_current_device", False):
        return
    tensor_to, tensor_cuda = torch.Tensor.to, torch.Tensor.cuda

    def indexed(device: Any) -> Any:
        if isinstance(device, (str, torch.device)) and torch.device(device) == torch.device("cuda"):
            return torch.device("cuda", fake.current_device)
        return device

    @functools.wraps(tensor_to)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            args = (indexed(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = indexed(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    @functools.wraps(tensor_cuda)
    def cuda(self: torch.Tensor, device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor_cuda(self, fake.current_device if device is None else indexed(device), *args, **kwargs)

    to._xmem_current_device = True  # type: ignore[attr-defined]
    torch.Tensor.to, torch.Tensor.cuda = to, cuda


def _ask_triton_again() -> None:
    """torch.utils._triton.has_triton caches its answer for the process's life: one asked before the fake GPU was
    there (a warm server's imports: warm_server.triton_as_with_a_gpu) is asked again now, of this job's GPU."""
    triton_checks = sys.modules.get("torch.utils._triton")
    if triton_checks is not None:
        triton_checks.has_triton.cache_clear()


def _patch_torch_cuda(fake: FakeCuda) -> None:
    """torch.cuda answers as a GPU would, surface by surface (each answer's maker below says what it covers)."""
    answers = {**_device_answers(fake), **_stream_answers(fake), **_memory_answers(fake)}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    _patch_random_generators(fake)
    # Modules that imported these names before the patch keep the originals; the common ones are re-pointed.
    torch.cuda.memory.empty_cache = answers["empty_cache"]
    torch.cuda.memory.memory_allocated = answers["memory_allocated"]
    torch.cuda.memory.max_memory_allocated = answers["max_memory_allocated"]
    _patch_accelerator(fake, answers)
    cuda_graphs.install(fake)  # graphs, their pools, and which stream captures (the optimizers' health check asks)


def _device_answers(fake: FakeCuda) -> dict[str, Any]:
    """The devices: how many, which is current, what each is (name, capability, bf16), and the runtime's state."""

    def set_device(device: Any) -> None:
        fake.current_device = _device_index(device)
        _resolve_bare_cuda_to_current(fake)

    def exchange_device(device: int) -> int:
        previous, fake.current_device = fake.current_device, device if device >= 0 else fake.current_device
        _resolve_bare_cuda_to_current(fake)
        return previous

    def get_device_properties(device: Any = None) -> FakeDeviceProperties:
        fake.on_arch_question()
        return fake.properties

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        # upstream: native from sm80; older GPUs (CUDA >= 11) emulate it, which counts unless excluded
        fake.on_arch_question()
        return fake.bf16_supported or including_emulation

    return dict(
        is_available=lambda: True,
        device_count=lambda: fake.device_count,
        current_device=lambda: fake.current_device,
        set_device=set_device,
        _exchange_device=exchange_device,
        _maybe_exchange_device=exchange_device,
        get_device_properties=get_device_properties,
        get_device_capability=lambda device=None: fake.ask_capability(),
        get_device_name=lambda device=None: get_device_properties().name,
        get_arch_list=lambda: [f"sm_{fake.capability[0]}{fake.capability[1]}"],
        is_bf16_supported=is_bf16_supported,
        is_initialized=lambda: True,
        init=lambda: None,
        synchronize=lambda device=None: None,
        ipc_collect=lambda: None,
        # torch.cuda's deferred-initialisation queue: callbacks would reach the real runtime (is_initialized is
        # True here, so upstream runs them at once); none of them matters without a device
        _lazy_call=lambda callable, **kwargs: None,
    )


def _stream_answers(fake: FakeCuda) -> dict[str, Any]:
    """Streams and events: made and switched, never waited on."""
    return dict(
        Stream=FakeStream,
        Event=FakeEvent,
        current_stream=lambda device=None: fake.current_stream,
        default_stream=lambda device=None: fake.default_stream,
        stream=fake.use_stream,
        set_stream=lambda stream: setattr(fake, "current_stream", stream),
    )


def _memory_answers(fake: FakeCuda) -> dict[str, Any]:
    """The memory counters and the cache, from the recorder's live bytes (the program's own view of them)."""

    def empty_cache() -> None:
        fake.on_empty_cache()

    def memory_stats(device: Any = None) -> dict[str, int]:
        # upstream's byte counters of every kind, each with current, peak, allocated and freed (ludwig's trainer logs
        # allocated_bytes.all.allocated and .freed); the cumulative ones are not recorded: the least they can be,
        # the peak allocated and what was freed of it, so that allocated - freed == current as upstream keeps
        current, peak = fake.live_bytes(), fake.peak_bytes()
        counters = {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}
        return {f"{kind}.all.{counter}": value for kind in ("allocated_bytes", "reserved_bytes", "active_bytes",
                                                           "requested_bytes") for counter, value in counters.items()}

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        total = fake.ask_total_memory()
        return total - fake.live_bytes(), total

    return dict(
        memory_allocated=lambda device=None: fake.live_bytes(),
        max_memory_allocated=lambda device=None: fake.peak_bytes(),
        memory_reserved=lambda device=None: fake.live_bytes(),
        max_memory_reserved=lambda device=None: fake.peak_bytes(),
        reset_peak_memory_stats=lambda device=None: fake.reset_peak(),
        reset_max_memory_allocated=lambda device=None: fake.reset_peak(),
        reset_accumulated_memory_stats=lambda device=None: None,
        memory_stats=memory_stats,
        memory_summary=lambda device=None, abbreviated=False: _memory_summary(fake),
        mem_get_info=mem_get_info,
        empty_cache=empty_cache,
        set_per_process_memory_fraction=lambda fraction, device=None: None,
    )


def _patch_random_generators(fake: FakeCuda) -> None:
    """The GPU's random generators: upstream's torch.cuda.random runs as is, over one CudaGenerator per device in
    `torch.cuda.default_generators` (upstream fills that tuple at CUDA's initialisation, which never runs here, so
    every get/set/seed call indexed an empty tuple). torch.cuda.random bound torch.cuda's device questions by name
    when it was imported: those names get the fake answers too, and its deferred calls run at once, as upstream's
    `_lazy_call` does once CUDA is initialised. torch.cuda re-exports the module's functions: the same objects."""
    torch.cuda.default_generators = tuple(CudaGenerator(index) for index in range(fake.device_count))
    random = torch.cuda.random
    random.current_device, random.device_count = torch.cuda.current_device, torch.cuda.device_count
    random.is_initialized, random._lazy_init = (lambda: True), (lambda: None)
    random._lazy_call = lambda callable, **kwargs: callable()
    for name in random.__all__:
        setattr(torch.cuda, name, getattr(random, name))


def _patch_accelerator(fake: FakeCuda, cuda_answers: dict[str, Any]) -> None:
    """torch.accelerator (device-generic API, used by FSDP2 and DeviceMesh) answers as torch.cuda does."""
    cuda = torch.device("cuda")
    torch._C._get_accelerator = lambda *args, **kwargs: cuda
    same = ("is_available", "device_count", "synchronize", "current_stream", "set_stream", "empty_cache",
            "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
            "reset_peak_memory_stats", "memory_stats")
    answers = {name: cuda_answers[name] for name in same}
    answers.update(
        current_accelerator=lambda check_available=False: cuda,
        current_device_index=cuda_answers["current_device"],
        current_device_idx=cuda_answers["current_device"],
        set_device_index=cuda_answers["set_device"],
        set_device_idx=cuda_answers["set_device"],
        get_device_capability=lambda device=None: {"major": fake.ask_capability()[0], "minor": fake.capability[1]},
    )
    for name, answer in answers.items():
        if hasattr(torch.accelerator, name):
            setattr(torch.accelerator, name, answer)


def _patch_tensor_and_data(fake: FakeCuda) -> None:
    # Pinning needs a driver; under the trace pinned host memory is not GPU memory anyway.
    torch.Tensor.pin_memory = lambda self, device=None: self
    torch.Tensor.is_pinned = lambda self, device=None: False
    # Streams are ids here; the allocator's deferred free after record_stream is not modelled (a known gap).
    torch.Tensor.record_stream = lambda self, stream: None

    torch.Generator = HostGenerator
    # torch.save writes for real, into the sandbox: `xmem.trace.child.weights` saves fake tensors as metadata

    # Worker processes would receive fake tensors they cannot pickle back; load in the main process.
    loader_init = torch.utils.data.DataLoader.__init__

    def single_process_loader_init(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("num_workers", 0):
            kwargs.update(num_workers=0, persistent_workers=False, prefetch_factor=None)
        kwargs.pop("pin_memory_device", None)
        loader_init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = single_process_loader_init


def _data_assignment_takes_its_device() -> None:
    """`tensor.data = other` makes `tensor` `other`'s tensor, device included (TensorImpl::set_data shallow-copies
    the impl). A FakeTensor's device is a Python attribute (`fake_device`) that set_data leaves as it was, so a GPU
    fake given host data (`.data = t.cpu()`: FSDP's CPU offload moves its flat parameter, its views and their
    gradients so, back and forth) still said cuda, and every op on it made GPU memory. Here the fake takes the
    device of the fake it is given."""
    data = torch._C.TensorBase.data

    def set_data(self: FakeTensor, new: torch.Tensor) -> None:
        data.__set__(self, new)
        if isinstance(new, FakeTensor):
            self.fake_device = new.fake_device

    FakeTensor.data = property(lambda self: data.__get__(self, type(self)), set_data)


def _patch_grad_scaler(fake: FakeCuda) -> None:
    from torch.amp.grad_scaler import GradScaler

    def always_step(self: GradScaler, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        # upstream: steps only if no inf/NaN was found (found_inf.item()); fake gradients have no values.
        fake.on_warning(Note(NoteKind.GRAD_SCALER_STEPPED,
                             "GradScaler assumed finite gradients (no real data under fake CUDA)"))
        return optimizer.step(*args, **kwargs)

    GradScaler._maybe_opt_step = always_step


def _patch_compile(fake: FakeCuda) -> None:
    """torch.compile follows the compiled program: AOTAutograd's partition as Inductor makes it, run node by node
    (xmem.trace.child.compiled); a region it cannot follow is traced eagerly, with a warning naming it."""
    import xmem.trace.child.compiled as compiled
    compiled.install(fake)


def _patch_as_subclass() -> None:
    """A fake tensor stays one where the program gives it a Python subclass type (`t.as_subclass(Image)`:
    torchvision's tv_tensors re-wrap what `.to("cuda")`, `.clone()` and `.detach()` return). torch cannot give the
    object behind a FakeTensor another type ("already associated to a python object of type FakeTensor"), so it
    stays a plain fake tensor: the subclass's behaviour above dispatch is lost for GPU tensors, its data is not."""
    as_subclass = torch.Tensor.as_subclass

    def as_subclass_unless_fake(self: torch.Tensor, cls: type) -> torch.Tensor:
        if isinstance(self, FakeTensor) and not issubclass(cls, FakeTensor):
            return self
        return as_subclass(self, cls)

    torch.Tensor.as_subclass = as_subclass_unless_fake


# Said when the program scripts anything (a library may script at import what never runs on the GPU)
SCRIPTED_WARNING = Note(NoteKind.TORCHSCRIPT_UNFUSED, "the program uses TorchScript, whose GPU fuser was off: any "
                        "scripted code ran op by op (fused kernels often need less)")


def _patch_torchscript(fake: FakeCuda) -> None:
    """Scripted code runs op by op. On a GPU, TorchScript's profiling executor fuses a scripted function's
    element-wise chains into kernels it generates (the TensorExpr fuser, or the legacy one), compiled by NVRTC and
    loaded through the CUDA driver, which a trace does not have (programs that script their models, as MACE and
    e3nn do, ended on "libcuda.so.1: cannot open"). Unfused, each intermediate is allocated as in eager mode: the
    estimate errs on the safe side, and says so once the program scripts something (SCRIPTED_WARNING)."""
    torch._C._jit_override_can_fuse_on_gpu(False)
    torch._C._jit_set_texpr_fuser_enabled(False)
    script = torch.jit.script

    def script_unfused(obj: Any, *args: Any, **kwargs: Any) -> Any:
        fake.on_warning(SCRIPTED_WARNING)
        return script(obj, *args, **kwargs)

    torch.jit.script = script_unfused


def _fake_tensors_are_not_a_graph(import_utils: Any) -> None:
    # transformers' is_tracing(tensor) takes a FakeTensor for a graph being compiled or exported and then skips the
    # value checks a GPU run makes: find_packed_sequence_indices keeps a packed-sequence mask and
    # _ignore_causal_mask_sdpa never drops the causal mask, so every decoder's SDPA call got a materialised mask (no
    # GQA in the kernel but repeat_kv copies of k/v, no flash, a converted bias) where the GPU runs is_causal. In a
    # trace every FakeTensor of the program stands for GPU data: its checks get stand-in values like any other. A
    # region dynamo compiles is still told apart as on a GPU (is_tracing also asks is_torchdynamo_compiling).
    # Found by the model-zoo oracle (scripts/zoo_check.py, hf:llama).
    import_utils.is_fake_tensor = lambda tensor: False


def _active_fake_mode() -> FakeTensorMode | None:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _make_fake_aware_apply(original_apply: Callable, fake: FakeCuda) -> Callable:
    """nn.Module._apply that works on fake tensors and keeps tied weights tied.

    Stock `_apply` swaps tensors in place (`swap_tensors`), which FakeTensors refuse (the fake-tensor memo holds a
    weakref), and cannot `.data`-assign a FakeTensor to a real parameter. So a tensor that is or becomes fake (moved
    to cuda: the recorder routes that op to the fake mode) is *replaced*, memoised by identity so that a tensor
    shared by two modules stays shared; a host-to-host conversion (`model.double()` on CPU) keeps the stock rule.
    """

    def fake_aware_apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
        memo: dict[int, torch.Tensor] = {}
        replaced: dict[int, torch.Tensor] = {}  # old tensor's id -> the new object that stands for it

        def convert(tensor: torch.Tensor, kind: str) -> torch.Tensor:
            if id(tensor) in memo:
                return memo[id(tensor)]
            with torch.no_grad():
                converted = fn(tensor)
            # stock sets .data only where the types allow it (compute_should_use_set_data), and swaps a wrapper
            # subclass, whose data is its inner tensors (a DTensor moved off meta by FSDP2's to_empty, torchao's
            # NF4Tensor moved to the GPU): here those are replaced
            if not isinstance(converted, FakeTensor) and not isinstance(tensor, FakeTensor) and (
                    converted is tensor or torch._has_compatible_shallow_copy_type(tensor, converted) and
                    not is_traceable_wrapper_subclass(converted)):
                if converted is not tensor:  # stock: same object, new data
                    tensor.data = converted
                result = tensor
                if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
                    tensor.grad = convert(tensor.grad, Category.GRADIENT)
            else:
                result = converted
                if isinstance(tensor, nn.Parameter):
                    result = nn.Parameter(converted, requires_grad=tensor.requires_grad)
                    if tensor.grad is not None:
                        result.grad = convert(tensor.grad, Category.GRADIENT)
                if result is not tensor:
                    _keep_attributes(tensor, result)
                    replaced[id(tensor)] = result
                    fake.on_module_tensor(result, kind)
            memo[id(tensor)] = result
            return result

        for module, has_own_apply in _modules_to_apply(self) if recurse else [(self, False)]:
            if has_own_apply:  # stock _apply calls each child's _apply: an override must run (see below)
                module._apply(fn)
                continue
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = convert(param, Category.PARAMETER)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = convert(buffer, Category.BUFFER)
        _rebind_optimizers(fake.optimizers, {old: new for old, new in replaced.items()
                                             if isinstance(new, nn.Parameter)})
        # convert() calls itself, so its closure is a reference cycle that keeps memo alive until the next garbage
        # collection: a second move (`.cuda()` then `.to(memory_format=channels_last)`) would keep every replaced
        # GPU tensor of the first, where stock _apply frees it at once (timm's channels_last doubled the weights)
        memo.clear()
        replaced.clear()
        return self

    return fake_aware_apply


def _keep_attributes(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give a replacement the Python attributes libraries set on the tensor it replaces, as stock `_apply` keeps
    them by keeping the object: spmd_types' `_local_type` (torchtitan annotates its meta parameters, then moves
    them with to_empty: fully_shard turns the annotated ones into DTensors and refused the bare ones), sharding
    marks, `_no_weight_decay` flags. The replacement's own attributes (a FakeTensor's) stay."""
    for name, value in getattr(old, "__dict__", {}).items():
        new.__dict__.setdefault(name, value)


def _modules_to_apply(root: nn.Module) -> list[tuple[nn.Module, bool]]:
    """`root` and its descendants in `modules()` order, each with whether its class defines its own `_apply`: that
    one must run it, as under stock `_apply`, and its subtree is its own (torchmetrics' Metric moves its states and
    defaults there: skipped, `model.to("cuda")` left a LightningModule's metrics on the CPU; RNNs re-point their
    flat weights there). A tensor shared across that boundary would be converted twice."""
    order: list[tuple[nn.Module, bool]] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        has_own_apply = module is not root and type(module)._apply is not nn.Module._apply
        order.append((module, has_own_apply))
        if not has_own_apply:
            for child in module.children():
                visit(child)

    visit(root)
    return order


def _rebind_optimizers(optimizers: Iterable[torch.optim.Optimizer], replaced: dict[int, torch.Tensor]) -> None:
    """Point live optimizers at replaced parameters (keyed by the old parameter's id).

    Stock `_apply` keeps each Parameter object and swaps its data, so an optimizer built before `model.to("cuda")`
    (the usual Hugging Face order) still trains the moved model. Replacing parameters would leave it stepping the
    old CPU ones: no optimizer state, and gradients that zero_grad never frees.
    """
    if not replaced:
        return
    for optimizer in list(optimizers):
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        if optimizer.state:
            optimizer.state = collections.defaultdict(
                dict, {replaced.get(id(k), k): v for k, v in optimizer.state.items()})
    deepspeed_ops.rebind_dummy_optimizers(replaced)  # accelerate's stand-in for DeepSpeed's optimizer


def _patch_cuda_data_functions() -> None:
    """`torch.tensor(data, device="cuda")` and friends: FakeTensorMode lifts Python/CPU data only onto the CPU, so
    build there and move, as the GPU copy would."""
    import xmem.trace.child.shortcuts as shortcuts
    # torch's default-device context (`with torch.device("cuda")`) gives a device to the factories it knows by
    # identity, collected at its first use: collected now, before factories are wrapped here and in
    # _patch_module_registration, the set holds torch's own, which the wrappers call
    import torch.utils._device
    torch.utils._device._device_constructors()
    for name in ("tensor", "as_tensor", "asarray"):
        _replace_torch_function(name, _lift_then_move(getattr(torch, name), shortcuts.enabled()))
    new_tensor = torch.Tensor.new_tensor

    def new_tensor_of_read_values(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        (read,), kwargs = _gpu_values_read((data,), kwargs)  # reads a sequence's tensors as torch.tensor does
        if read is data:
            return new_tensor(self, data, *args, **kwargs)
        try:
            return new_tensor(self, read, *args, **kwargs)
        except (ValueError, TypeError) as error:
            raise as_on_a_gpu(error)

    torch.Tensor.new_tensor = new_tensor_of_read_values


def _replace_torch_function(name: str, wrapper: Callable) -> None:
    """Put `wrapper` in the place of `torch.<name>`, for TorchScript too. A scripted function's call of torch.zeros
    compiles to its aten op, found by the object's identity (torch.jit._builtins._find_builtin); our wrapper would
    be a Python function to compile, which TorchScript refuses (*args), and programs that script their models
    (MACE, e3nn) would end on our error. Registered as the same op, scripted code runs the op itself: under the
    fake mode all the same, without the wrapper's host-side shortcuts."""
    from torch.jit import _builtins
    op = _builtins._find_builtin(getattr(torch, name))
    setattr(torch, name, wrapper)
    if op is not None:
        _builtins._register_builtin(wrapper, op)


def _lift_then_move(create: Callable, empty_shortcut: bool) -> Callable:
    def create_from_gpu_values_read(*args: Any, **kwargs: Any) -> torch.Tensor:
        read_args, read_kwargs = _gpu_values_read(args, kwargs)
        if read_args is args and read_kwargs is kwargs:
            return create_on_host_then_move(*args, **kwargs)
        try:
            return create_on_host_then_move(*read_args, **read_kwargs)
        except (ValueError, TypeError) as error:  # upstream's checks of the elements: a GPU raises them too
            raise as_on_a_gpu(error)

    def create_on_host_then_move(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if not _is_cuda(device):
            return create(*args, **kwargs)
        if empty_shortcut and _no_data(args, kwargs):
            # `torch.tensor([], device="cuda")` (transformers' key/value cache starts so in every layer): no value to
            # carry, so the empty GPU tensor directly, without a host tensor turned fake and copied (1.4 ms a call)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            return torch.empty(0, dtype=dtype, device=device, requires_grad=kwargs.get("requires_grad", False))
        kwargs["device"] = "cpu"
        return create(*args, **kwargs).to(device)
    return create_from_gpu_values_read


def _gpu_values_read(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The data of `torch.tensor(data)` (as_tensor, asarray) with every GPU tensor inside a list or tuple replaced by a
    host tensor of its values. Upstream's internal_new_from_data reads the value of each tensor in a sequence (a
    device-to-host copy per element on a GPU: `torch.tensor([freq / 8 for freq in inv_freq], device=...)`, the
    Llama 3 RoPE rescaling) with the Python dispatch key excluded, so a fake tensor's read skips the fake mode and
    reaches the real CUDA runtime. Read here instead, above dispatch: known values where the trace has them, else the
    stand-ins (`.item()`, `.tolist()`); upstream's own rules (dtype inference from the elements, a many-element
    tensor refused) then apply to host tensors of the same dtype and shape."""
    if args:
        data = _sequence_values_read(args[0])
        return (args if data is args[0] else (data, *args[1:])), kwargs
    for name in ("data", "obj"):
        if name in kwargs:
            data = _sequence_values_read(kwargs[name])
            return args, (kwargs if data is kwargs[name] else {**kwargs, name: data})
    return args, kwargs


def _sequence_values_read(data: Any) -> Any:
    if type(data) is not list and not isinstance(data, tuple):
        return data  # a tensor or an array is lifted whole, through the fake mode
    read: list | None = None
    for index, item in enumerate(data):
        if isinstance(item, FakeTensor):
            value = item.item() if item.dim() == 0 else item.tolist()
            with unset_fake_temporarily():
                new = _ORIGINAL_TENSOR(value, dtype=item.dtype, device="cpu")
        elif type(item) is list or isinstance(item, tuple):
            new = _sequence_values_read(item)
        else:
            continue
        if new is not item:
            read = list(data) if read is None else read
            read[index] = new
    return data if read is None else (read if type(data) is list else tuple(read))


_ORIGINAL_TENSOR = torch.tensor


def _no_data(args: tuple, kwargs: dict) -> bool:
    """Data that is an empty Python list or tuple, with no argument but dtype, device and requires_grad."""
    return len(args) == 1 and type(args[0]) in (list, tuple) and not args[0] and \
        set(kwargs) <= {"dtype", "device", "requires_grad"}


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"



# Parameters and buffers a program builds on the host stay real (with real values, so CPU-side code that reads them
# works) up to this many bytes in all; past it they are born fake, so that a 7B model built on the CPU before
# `.cuda()` costs no host memory and no real initialisation.
HOST_MODEL_BYTES = 64 << 20


def _patch_module_registration(fake: FakeCuda) -> None:
    real_bytes = 0
    # What each host tensor became when first registered: registering it again (tied weights: transformers'
    # `_tie_or_clone_weights` assigns the input embedding's Parameter to the output layer) must give that same
    # object, kept real or made fake, so that the tie holds and its bytes count once. Kept by the tensor's view of
    # its storage, for as long as the storage lives: a weak reference to the tensor itself would make
    # torch.utils.swap_tensors refuse it (torchtune's QLoRA layers swap each weight for its torchao NF4Tensor).
    # A tensor kept real maps to None: a value holding the tensor would keep it alive for good.
    registered: dict[tuple, torch.Tensor | None] = {}

    def fake_past_budget(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or isinstance(tensor, FakeTensor) or tensor.device.type != "cpu" or \
                tensor.layout != torch.strided or \
                type(tensor) not in (torch.Tensor, nn.Parameter, getattr(nn, "Buffer", nn.Parameter)):
            return tensor
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
        if key not in registered:
            result = _real_or_fake(tensor)
            registered[key] = None if result is tensor else result
            weakref.finalize(storage, registered.pop, key, None).atexit = False
        became = registered[key]
        return tensor if became is None else became

    def _real_or_fake(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal real_bytes
        nbytes = tensor.numel() * tensor.element_size()
        if real_bytes + nbytes <= HOST_MODEL_BYTES:
            real_bytes += nbytes
            return tensor
        mode = _active_fake_mode()
        if mode is None:
            return tensor
        fake.on_warning(HOST_MODEL_WARNING)
        with unset_fake_temporarily():
            converted = mode.from_tensor(tensor.detach())
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(converted, requires_grad=tensor.requires_grad)
        return converted

    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_fake_parameter(self: nn.Module, name: str, param: Any) -> None:
        register_parameter(self, name, fake_past_budget(param))

    def register_fake_buffer(self: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        register_buffer(self, name, fake_past_budget(tensor), persistent)

    nn.Module.register_parameter = register_fake_parameter
    nn.Module.register_buffer = register_fake_buffer

    def born_fake_past_budget(create: Callable) -> Callable:
        """A host tensor made in a module's constructor that the budget left cannot hold is born fake (nn.Linear
        makes its weight with torch.empty before registering it: a 10 GB layer would be allocated first)."""
        def create_on_host_or_fake(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device") or torch.get_default_device()
            if device is None or torch.device(device).type != "cpu" or "out" in kwargs:
                return create(*args, **kwargs)
            try:
                with unset_fake_temporarily():  # its size and dtype, from the meta device (no memory)
                    shape = create(*args, **{**kwargs, "device": "meta"})
            except (RuntimeError, TypeError):
                return create(*args, **kwargs)
            mode = _active_fake_mode()
            if mode is None or real_bytes + shape.nbytes <= HOST_MODEL_BYTES or not _in_module_constructor():
                return create(*args, **kwargs)
            fake.on_warning(HOST_MODEL_WARNING)
            return FakeTensor(mode, shape, torch.device("cpu"))
        return create_on_host_or_fake

    for name in HOST_MODEL_FACTORIES:
        _replace_torch_function(name, born_fake_past_budget(getattr(torch, name)))


# What module constructors make their tensors with (nn.Linear, nn.Embedding, convolutions: torch.empty; norms and
# hand-written layers: the others)
HOST_MODEL_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn")
HOST_MODEL_WARNING = Note(NoteKind.HOST_MODEL_FAKE, f"model tensors built on the host past {HOST_MODEL_BYTES >> 20} "
                          "MiB are fake (no real values): host-side code that reads their values gets stand-ins")


def _in_module_constructor() -> bool:
    """Whether an nn.Module's `__init__` is running on this thread's stack (asked only of large host tensors)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return True
        frame = frame.f_back
    return False


def _rebuild_fake_parameters_by_type() -> None:
    """`type(param)(data, requires_grad=...)`, the idiom that rebuilds a parameter as its own class (accelerate's
    `set_module_tensor_to_device`, under every `init_empty_weights`, `device_map` and diffusers load): a parameter
    made on meta or born fake past the host budget is a FakeTensor marked as a parameter (nn.Parameter of a tensor
    subclass keeps the subclass), so the idiom names FakeTensor, whose constructor wants a fake mode and a meta
    tensor. Called so, with no fake mode, it makes the Parameter the idiom means, as it would on a GPU."""
    make = FakeTensor.__new__

    def new_fake_tensor_or_parameter(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is FakeTensor and _names_data_only(args, kwargs):
            return nn.Parameter(*args, **kwargs)
        return make(cls, *args, **kwargs)

    FakeTensor.__new__ = staticmethod(new_fake_tensor_or_parameter)  # type: ignore[method-assign]


def _names_data_only(args: tuple, kwargs: dict) -> bool:
    """Whether a constructor call reads as nn.Parameter's (data, requires_grad), which no FakeTensor call does."""
    return 1 <= len(args) <= 2 and isinstance(args[0], torch.Tensor) and set(kwargs) <= {"requires_grad"} and \
        all(isinstance(flag, bool) for flag in (*args[1:], *kwargs.values()))


def _swap_fake_tensors_too() -> None:
    """torch.utils.swap_tensors refuses a tensor that has a weak reference, and the fake mode's converter keeps one
    to each fake tensor it made (its memo, `tensor_memo`: a cache of conversions). torchtune's QLoRA layers, built on
    the GPU, swap each weight for its torchao NF4Tensor so: a fake's entries there are dropped first (a later
    conversion of the same source makes a new fake), then upstream swaps."""
    swap = torch.utils.swap_tensors

    def swap_fakes_too(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for tensor in (t1, t2):
            if isinstance(tensor, FakeTensor):
                memo = tensor.fake_mode.fake_tensor_converter.tensor_memo
                # a WeakValueDictionary's reference knows its key (the references themselves not kept: a live one
                # is what upstream refuses)
                for key in [getattr(ref, "key", None) for ref in weakref.getweakrefs(tensor)]:
                    if key is not None and memo.get(key) is tensor:
                        del memo[key]
        return swap(t1, t2)

    torch.utils.swap_tensors = swap_fakes_too


def _memory_summary(fake: FakeCuda) -> str:
    return (f"|  fake CUDA (xmem trace): allocated {fake.live_bytes() / 2**20:.1f} MiB now, "
            f"{fake.peak_bytes() / 2**20:.1f} MiB at the peak; the estimate replays the caching allocator  |")


# Library functions that read the memory size only to cap an allocation of theirs, so that the answer changes
# nothing for a job whose weights fit with room to spare: transformers' `caching_allocator_warmup` (from_pretrained
# with a device_map) makes one warm-up allocation of the weights' size, capped at the total memory less 1.2 GiB and
# skipped when the free memory is all but used.
_CAP_ONLY_READERS = {("transformers.modeling_utils", "caching_allocator_warmup")}


def _read_for_a_cap_only() -> bool:
    """Whether the code that asked for the memory size (the first frame outside this module) is a cap-only reader."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame is not None and (frame.f_globals.get("__name__"), frame.f_code.co_name) in _CAP_ONLY_READERS


def memory_size_warning(nbytes: int) -> Note:
    """Said once when the program reads the device's memory size (`FakeCuda.ask_total_memory`)."""
    shown = f"{nbytes / 2**30:.1f} GiB"
    return Note(NoteKind.MEMORY_SIZE_READ, f"the program read the GPU's memory size (traced with {shown}); where its "
                                           "GPU, MIG slice or MPS share shows another size, it may allocate otherwise "
                                           "than traced", shown)


# No longer said (CUDA graphs are modelled: xmem.trace.child.cuda_graphs); kept for the wording of traces made before.
GRAPH_WARNING = Note(NoteKind.CUDA_GRAPHS_EAGER,
                     "CUDA graphs were traced eagerly: the graph's private memory pool is not modelled")


def _patch_recurrent_layers() -> None:
    """nn.LSTM/GRU/RNN on cuda: upstream's cuDNN RNN kernel is called from C++ without the dispatcher, so under fake
    CUDA it would reach the real runtime. The layer runs its native CUDA path instead (cuDNN off for that call):
    `_thnn_fused_lstm_cell`/`_thnn_fused_gru_cell` per step, which keep per layer and step the gate activations and
    the new hidden (and cell) state for backward: the same bytes cuDNN's training reserve space holds for them,
    as many small blocks instead of one (documented approximation). The cuDNN weight flattening, a copy of the
    parameters into one buffer that then views it, is skipped: the parameter bytes are the same.
    """
    from torch.nn.modules import rnn

    def without_cudnn(forward: Callable) -> Callable:
        def forward_on_native_path(self: nn.Module, input: Any, *args: Any, **kwargs: Any) -> Any:
            data = input.data if isinstance(input, rnn.PackedSequence) else input
            if not isinstance(data, FakeTensor):
                return forward(self, input, *args, **kwargs)
            with torch.backends.cudnn.flags(enabled=False):
                return forward(self, input, *args, **kwargs)
        return forward_on_native_path

    for layer in (rnn.LSTM, rnn.GRU, rnn.RNN):
        layer.forward = without_cudnn(layer.forward)
    flatten = rnn.RNNBase.flatten_parameters

    def flatten_unless_fake(self: rnn.RNNBase) -> None:
        if not any(isinstance(w, FakeTensor) for w in self._flat_weights):
            flatten(self)

    rnn.RNNBase.flatten_parameters = flatten_unless_fake


def _patch_nvml(fake: FakeCuda) -> None:
    """pynvml (nvidia-ml-py) needs the driver's libnvidia-ml: where it is installed, the queries scripts make
    answer for the fake GPU (memory from the recorder), so a monitoring line cannot end the trace."""
    try:
        import pynvml  # torch.cuda has already imported it where it is installed
    except ImportError:
        pass
    else:
        _answer_nvml(pynvml, fake)
    for name in ("utilization", "temperature", "power_draw", "clock_rate"):
        setattr(torch.cuda, name, lambda device=None: 0)
    torch.cuda.memory_usage = lambda device=None: 0
    torch.cuda.device_memory_used = lambda device=None: fake.live_bytes()


def _answer_nvml(nvml: Any, fake: FakeCuda) -> None:
    class Memory:
        @property
        def total(self) -> int:
            return fake.ask_total_memory()

        @property
        def used(self) -> int:
            return fake.live_bytes()

        @property
        def free(self) -> int:
            return self.total - self.used

    class Rates:
        gpu = memory = 0

    answers = dict(
        nvmlInit=lambda *a: None, nvmlInitWithFlags=lambda *a: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: fake.device_count,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: fake.properties.name,
        nvmlDeviceGetMemoryInfo=lambda handle, *a: Memory(),
        nvmlDeviceGetUtilizationRates=lambda handle: Rates(),
        nvmlDeviceGetTemperature=lambda handle, sensor=0: 40,
        nvmlDeviceGetPowerUsage=lambda handle: 100_000,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [],
        nvmlSystemGetDriverVersion=lambda: "0.0 (xmem fake CUDA)",
        nvmlDeviceGetCudaComputeCapability=lambda handle: fake.capability,
    )
    for name, answer in answers.items():
        setattr(nvml, name, answer)
