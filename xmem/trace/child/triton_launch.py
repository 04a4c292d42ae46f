"""Triton kernels under the fake GPU: launches are checked and skipped, and Triton's driver is a fake one.

A Triton launch (`kernel[grid](...)`, a library's autotuned kernel, `torch.library.wrap_triton`) writes into tensors
that PyTorch allocated before it; the kernel itself allocates nothing the caching allocator sees. So under fake CUDA
a launch is checked as the launcher would check it (the arguments bind to the kernel's signature, pointer arguments
are GPU tensors, the grid evaluates) and then skipped: no compilation, no driver, nothing recorded. Not modelled: the
global scratch a kernel using device-side TMA descriptors asks of `triton.set_allocator` (the kernel is never
compiled, so its size is unknown) and TRITON_INTERPRET's interpreter.

Triton's active driver is replaced by `FakeTritonDriver`, which answers what programs ask of it (the target, the
device's properties, the stream) from the fake GPU; whatever else reaches `driver.active.utils` (loading a binary, a
TMA descriptor) raises NotModelled naming it. Autotuning runs each config's hooks once, through the benchmarker the
autotuner asks for, and reports equal times: the first config is taken (which one runs changes no allocation; the
hooks' copies of `restore_value` arguments are real and recorded).

Installed from `xmem.trace.child.fakecuda.install` once triton is imported; must not record anything itself.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from xmem.trace.errors import NotModelled, as_on_a_gpu

# The most shared memory a block may opt in to (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), per
# compute capability, from the CUDA programming guide's table of technical specifications: kernels size their tiles
# by it (nothing the allocator sees).


def install(fake: Any) -> None:
    """Make `triton` (already imported) launch nothing and ask no driver."""
    try:
        from triton.backends.nvidia.driver import CudaDriver
        from triton.runtime import autotuner, driver, jit
    except ImportError:  # a triton without the NVIDIA backend, or of another layout: its launches stay its own
        return

    fake_driver = _fake_driver_class(CudaDriver)(fake)
    driver._default = driver._active = fake_driver  # `reset_active()` comes back to it too
    jit.JITFunction.run = _checked_and_skipped(fake)
    autotuner.Autotuner.do_bench = property(lambda self: _run_once)


def _fake_driver_class(cuda_driver: type) -> type:
    """CudaDriver without its native module (`CudaUtils` compiles and loads one that needs libcuda): what it says
    comes from the fake GPU through torch.cuda (patched), the rest of its behaviour is upstream's."""

    class FakeTritonDriver(cuda_driver):  # type: ignore[misc, valid-type]
        def __init__(self, fake: Any) -> None:  # not CudaDriver.__init__: no CudaUtils
            self.fake = fake
            self.utils = FakeDriverUtils(fake)
            self.launcher_cls = None
            self.get_device_capability = lambda device=None: fake.capability  # triton's own question: no arch hint
            self.get_current_device = torch.cuda.current_device
            self.set_current_device = torch.cuda.set_device
            self.get_current_stream = lambda device=None: fake.current_stream.cuda_stream

        @staticmethod
        def is_active() -> bool:
            return True

        def get_benchmarker(self) -> Callable:
            return _run_once

    return FakeTritonDriver


class FakeDriverUtils:
    """`triton.runtime.driver.active.utils`: the device's properties from the fake GPU; nothing else exists."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake

    def get_device_properties(self, device: int = 0) -> dict[str, int]:
        # The keys and meanings of triton's nvidia driver.c getDeviceProperties, from the requested GPU; the clocks
        # and bus width are a typical GPU's (they only feed performance models).
        gpu = self.fake.gpu
        return {"max_shared_mem": gpu.shared_memory_per_block_optin, "max_num_regs": gpu.registers_per_block,
                "multiprocessor_count": gpu.multi_processor_count, "warpSize": gpu.warp_size,
                "sm_clock_rate": 1755000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    def get_device_capability(self, device: int = 0) -> tuple[int, int]:
        return self.fake.capability

    def get_current_device(self) -> int:
        return torch.cuda.current_device()

    def set_current_device(self, device: int) -> None:
        torch.cuda.set_device(device)

    def __getattr__(self, name: str) -> Any:
        raise NotModelled(f"Triton's driver call {name} (it needs the CUDA driver; launches are skipped)")


def _checked_and_skipped(fake: Any) -> Callable:
    """JITFunction.run: what the real one checks before it launches (upstream `JITFunction.run`: pre-run hooks, the
    binder made by `create_function_from_signature`, the grid called with the bound arguments), then no launch."""

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> "SkippedKernel":
        for hook in self.pre_run_hooks:
            hook(*args, **kwargs)
        bound = _bind(self, args, kwargs)
        for name, value in bound.items():
            for tensor in _pointers(value):
                if tensor.device.type != "cuda":  # the launcher's pointer check (driver.c), on a GPU too
                    raise as_on_a_gpu(ValueError(f"Pointer argument {name} cannot be accessed from Triton "
                                                 f"(cpu tensor?)"))
        if not warmup:
            _grid(grid, bound)
            fake.on_library("triton")
        return SkippedKernel(self)

    return run


def _bind(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The kernel's arguments by name, defaults applied; the other keywords are compile options (num_warps...).
    A missing or extra positional argument raises TypeError, as upstream's binder does."""
    parameters = kernel.signature.parameters
    bound = kernel.signature.bind(*args, **{name: value for name, value in kwargs.items() if name in parameters})
    bound.apply_defaults()
    return dict(bound.arguments)


def _pointers(value: Any) -> Iterator[torch.Tensor]:
    """The tensors behind a kernel argument: itself, a TensorWrapper's or TensorDescriptor's base, a tuple's items."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _pointers(item)
    elif isinstance(getattr(value, "base", None), torch.Tensor):
        yield value.base


def _grid(grid: Any, bound: dict[str, Any]) -> None:
    """The grid as upstream reads it: called with the bound arguments when callable, then its first dimension."""
    grid = grid(bound) if callable(grid) else grid
    try:
        grid[0]  # noqa: B018 - fails where upstream's launch fails (an empty grid, a number instead of a tuple)
    except (TypeError, IndexError) as error:
        raise as_on_a_gpu(error) from None


def _run_once(kernel_call: Callable[[], Any], quantiles: Sequence[float] = (0.5,), **_: Any) -> list[float]:
    """The autotuner's benchmark: the config's hooks and launch once, equal times for all (the first config wins)."""
    kernel_call()
    return [1.0] * len(quantiles)


class SkippedKernel:
    """What a launch returns instead of the CompiledKernel: the kernel was never compiled."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getattr__(self, name: str) -> Any:
        raise NotModelled(f"the compiled form of Triton kernel {getattr(self.kernel, '__name__', '?')} "
                          f"(.{name}): launches are skipped, nothing is compiled")
