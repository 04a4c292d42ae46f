"""What cuFFT's path through torch takes from the caching allocator besides an FFT op's output.

The fake kernels of `_fft_c2c`, `_fft_r2c` and `_fft_c2r` (torch/_meta_registrations.py) make the output only:
the intermediates they make themselves (a clone, a second buffer) are fake tensors the recorder never sees, and the
work area is not there at all. On a GPU the CUDA kernels (aten/src/ATen/native/cuda/SpectralOps.cpp and
CuFFTPlanCache.h) take more while they run, and give all of it back before the op returns:

- Each cuFFT execution (`_exec_fft`) first makes the input it hands cuFFT: the batch dimensions, put first in stride
  order, are collapsed into one by `reshape`, a copy where no view can do it; then a contiguous clone where cuFFT
  cannot address the strides (`CuFFTConfig::should_clone_input`: `as_cufft_embed` finds a last stride <= 0, a batch
  stride of 0 over more than one batch, or a stride that is no multiple of the next one; or 16-bit data whose last
  stride is not 1). Then it allocates the plan's work area, `at::empty({workspace_size()}, kByte)`, and hands it to
  `cufftSetWorkArea`: plans are made with `cufftSetAutoAllocation(plan, 0)`, so cuFFT never allocates one itself.
  All three are freed when the execution returns. Plans live in a per-device LRU cache (`CuFFTParamsLRUCache`,
  4096 plans by default) and hold none of the caching allocator's memory.
- `_fft_c2r` clones its input (cuFFT's C2R overwrites it), or, over several dims off the optimised path
  (`use_optimized_cufft_path`: dims starting (0, 1), or more than 3 of them), runs a `_fft_c2c` over all but the
  last dim first, whose output stands where the clone would.
- `_fft_c2c` transforms at most 3 dims per execution (`cufft_max_ndim`); with more, it ping-pongs between its output
  and a second buffer of the same size. `_fft_r2c` off the optimised path does the same after its R2C pass.
- `_fft_r2c` of an input whose address is not aligned to a complex element (an odd storage offset) first clones it.
- bfloat16: `_fft_r2c` on sm80+, on the optimised path, with power-of-two sizes, writes a ComplexHalf proxy
  (4 bytes per onesided element) and converts it to complex64; the result is that conversion, or, two-sided, a copy
  of it into a full-size tensor. Otherwise the input is first converted to float32.

The work area's size is cuFFT's own answer (`cufftXtMakePlanMany`), not a documented formula. cuFFT's guide bounds
it by 8 x batch x the transform's elements (complex elements of the execution type) in the worst case, and says it
can be as low as one such buffer. A stated approximation, not a measurement: one buffer, batch x the complex
elements of the transform (the last dim n/2+1 for R2C/C2R), of the execution type (complex64: 8 bytes per element);
a dim with a prime factor above 7 (upstream's `has_large_prime_factor`: cuFFT then uses Bluestein's algorithm, which
pads to a length of at least 2n-1) counts as the power of two at or above 2n-1.

`scratch(op, args, kwargs, capability)` says it as a list of steps `(ALLOC, tag, nbytes, category)` and
`(FREE, tag)`, in upstream's order, for the recorder to append right after the op's output. Pure: sizes and
strides only, on meta tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from xmem.trace.events import Category

FFT_OPS = frozenset({"_fft_c2c", "_fft_r2c", "_fft_c2r"})
ALLOC, FREE = "alloc", "free"
CUFFT_MAX_NDIM = 3  # upstream's cufft_max_ndim: dims per cuFFT execution
_SMALL_RADICES = (2, 3, 5, 7)  # sizes of only these factors avoid Bluestein's algorithm

Step = tuple


def scratch(op: str, args: tuple, kwargs: dict, capability: tuple[int, int]) -> list[Step]:
    """The transient allocations of one `op` call on CUDA besides its output (see the module docstring), from the
    input's sizes, strides, dtype and storage offset alone (any device: the recorder asks for CUDA calls)."""
    self = args[0]
    if not isinstance(self, torch.Tensor) or self.numel() == 0:
        return []
    dims = [d % self.dim() for d in args[1]]  # as passed: the order decides the last dim and the optimised path
    plan = _Plan()
    if op == "_fft_c2c":
        plan.c2c(_meta(self), dims)
    elif op == "_fft_r2c":
        plan.r2c(_meta(self), dims, bool(args[3]), self.storage_offset(), capability)
    else:
        plan.c2r(_meta(self), dims, int(args[3]))
    if kwargs.get("out") is not None:  # `_fft_*_cufft_out`: the result is made, then normalised into `out`
        plan.hold(_nbytes(kwargs["out"]), Category.TEMPORARY)
    return plan.finish()


class _Plan:
    """The steps of one op call; `hold` keeps a block to the op's end, `transient` frees it at once."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._held: list[int] = []
        self._tags = 0

    def alloc(self, nbytes: int, category: str) -> int:
        self._tags += 1
        if nbytes > 0:
            self.steps.append((ALLOC, self._tags, nbytes, category))
        return self._tags

    def free(self, tag: int) -> None:
        if any(step[1] == tag for step in self.steps if step[0] == ALLOC):
            self.steps.append((FREE, tag))

    def hold(self, nbytes: int, category: str) -> None:
        self._held.append(self.alloc(nbytes, category))

    def finish(self) -> list[Step]:
        for tag in reversed(self._held):
            self.free(tag)
        return self.steps

    # ---- the ops, as SpectralOps.cpp runs them ---------------------------------------------------------------
    def c2c(self, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        """`_fft_c2c_cufft`: passes of up to 3 dims, the smallest-strided first; returns the output's layout."""
        if not dims:
            return x  # the op is a clone: its output is all
        out = x
        remaining = list(dims)
        first = True
        while remaining:
            remaining.sort(key=lambda d: out.stride(d), reverse=True)
            group, remaining = remaining[-CUFFT_MAX_NDIM:], remaining[:-CUFFT_MAX_NDIM]
            out = self.execute(out, group, x.shape, "c2c", x.dtype)
            if remaining and first:  # the first output becomes the input; a second buffer of its size is made
                self.hold(_numel(x.shape) * x.element_size(), Category.TEMPORARY)
            first = False
        return out

    def r2c(self, x: torch.Tensor, dims: list[int], onesided: bool, offset: int, capability: tuple[int, int]) -> None:
        """`_fft_r2c_cufft`."""
        last = dims[-1]
        half = list(x.shape)
        half[last] = x.shape[last] // 2 + 1
        optimised = _optimised(dims)
        if x.dtype == torch.bfloat16:
            if capability >= (8, 0) and optimised and all(_pow2(x.shape[d]) for d in dims):
                self.hold(_numel(half) * 4, Category.TEMPORARY)  # the ComplexHalf proxy cuFFT writes
                self.execute(x, dims, half, "r2c", x.dtype)
                if not onesided:  # the complex64 conversion, copied into the two-sided result
                    self.hold(_numel(half) * 8, Category.TEMPORARY)
                return
            self.hold(x.numel() * 4, Category.TEMPORARY)  # promoted to float32, then the float path
            x = torch.empty(x.shape, dtype=torch.float32, device="meta")
            offset = 0
        if offset % 2:  # cuFFT wants real input aligned as if it were complex: a clone, contiguous along `last`
            self.hold(x.numel() * x.element_size(), Category.TEMPORARY)
            x = x.movedim(last, -1).contiguous().movedim(-1, last)
        complex_size = 2 * x.element_size()
        full = list(x.shape)
        if optimised:
            self.execute(x, dims, full if not onesided else half, "r2c", x.dtype)
            return
        out = self.execute(x, [last], full if len(dims) == 1 and not onesided else half, "r2c", x.dtype)
        if len(dims) > 1:  # the working tensor of the C2C passes, as large as the result
            self.hold(_numel(full if not onesided else half) * complex_size, Category.TEMPORARY)
        remaining = dims[:-1]
        while remaining:
            remaining.sort(key=lambda d: out.stride(d), reverse=True)
            group, remaining = remaining[-CUFFT_MAX_NDIM:], remaining[:-CUFFT_MAX_NDIM]
            out = self.execute(out, group, half, "c2c", out.dtype)

    def c2r(self, x: torch.Tensor, dims: list[int], last_size: int) -> None:
        """`_fft_c2r_cufft`: a clone (or, over several dims off the optimised path, a C2C first), then C2R."""
        out_sizes = list(x.shape)
        out_sizes[dims[-1]] = last_size
        if _optimised(dims) or len(dims) == 1:
            self.hold(x.numel() * x.element_size(), Category.TEMPORARY)  # C2R overwrites its input (gh-34551)
            source = x.contiguous()
        else:
            self.hold(x.numel() * x.element_size(), Category.TEMPORARY)  # the C2C's output
            source = self.c2c(x, dims[:-1])
        self.execute(source, dims if _optimised(dims) else dims[-1:], out_sizes, "c2r", x.dtype)

    def execute(self, x: torch.Tensor, dims: list[int], out_sizes: Any, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """`_exec_fft`: the input copy or clone, the work area; returns the output's layout (batch dims first in the
        input's stride order, contiguous in that order, as upstream restrides it)."""
        batch = [d for d in range(x.dim()) if d not in dims]
        batch.sort(key=lambda d: x.stride(d), reverse=True)
        order = batch + list(dims)
        permuted = x.permute(order)
        signal = [x.shape[d] for d in dims]
        held: list[int] = []
        try:
            batched = permuted.view([-1, *signal])
        except RuntimeError:  # `reshape` copies
            held.append(self.alloc(x.numel() * x.element_size(), Category.TEMPORARY))
            batched = permuted.contiguous().view([-1, *signal])
        sixteen_bit = dtype in (torch.float16, torch.bfloat16, torch.complex32)
        if _must_clone(batched) or (sixteen_bit and batched.stride(-1) != 1):
            held.append(self.alloc(x.numel() * x.element_size(), Category.TEMPORARY))
        sizes = [max(x.shape[d], out_sizes[d]) for d in dims]
        held.append(self.alloc(workspace_bytes(batched.shape[0], sizes, kind, dtype), Category.WORKSPACE))
        for tag in reversed(held):
            self.free(tag)
        out_dtype = torch.complex64 if kind != "c2r" else torch.float32  # the layout is all that is used
        out_shape = [out_sizes[d] for d in order]
        inverse = [order.index(d) for d in range(x.dim())]
        return torch.empty(out_shape, dtype=out_dtype, device="meta").permute(inverse)


def workspace_bytes(batch: int, sizes: list[int], kind: str, dtype: torch.dtype) -> int:
    """The stated approximation of one execution's work area (module docstring): one complex buffer of the
    transform, Bluestein's padded length for a dim with a prime factor above 7."""
    lengths = [n if not _large_prime_factor(n) else 1 << (2 * n - 2).bit_length() for n in sizes]
    if kind != "c2c":  # a real transform runs as a half-length complex one
        lengths[-1] = lengths[-1] // 2 + 1
    real = dtype.to_real() if dtype.is_complex else dtype
    return batch * math.prod(lengths) * 2 * real.itemsize


def _must_clone(batched: torch.Tensor) -> bool:
    """`as_cufft_embed`'s must_clone for a batched input [batch, *signal]: strides cuFFT cannot address."""
    sizes, strides = batched.shape, batched.stride()
    last = strides[-1]
    if last <= 0 or (sizes[0] != 1 and strides[0] == 0):
        return True
    for i in range(len(sizes) - 2, 0, -1):
        if sizes[i] == 1:
            continue
        if strides[i] <= 0 or strides[i] % last:
            return True
        last = strides[i]
    return False


def _large_prime_factor(n: int) -> bool:
    """Upstream's `has_large_prime_factor`: sizes below 11 never count (as it returns early)."""
    for prime in _SMALL_RADICES:
        if n < 11:
            return False
        while n % prime == 0:
            n //= prime
    return n != 1


def _optimised(dims: list[int]) -> bool:
    """Upstream's `use_optimized_cufft_path`."""
    return not (len(dims) > CUFFT_MAX_NDIM or (len(dims) >= 2 and dims[0] == 0 and dims[1] == 1))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `tensor`'s sizes, strides and dtype: where upstream's choices are made."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
