"""Which scaled-dot-product-attention kernel the pretended GPU runs, and the patch that makes it run it.

SDPA picks its backend in C++ from real device properties, so under fake CUDA it would always take the math path
(which materialises B*H*Tq*Tk scores). This module re-states upstream's choice as a pure function of the call, the
compute capability and the runtime (torch release, cuDNN, the program's switches), and patches
`F.scaled_dot_product_attention` to call the chosen fused op, whose fake kernel allocates what the GPU kernel
returns and autograd saves. Read from pytorch `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp` and
`sdp_utils_cpp.h` (checked against the 2.14.1 wheel's headers and the warning strings in its libtorch_cuda.so,
and the 2.13 headers); names in the comments are upstream's functions. Import only in the tracing child.

The choice (`select_sdp_backend`): walk the priority order and take the first backend whose `can_use_*` gates pass;
math only when enabled. The order is `Context.h`'s default (flash, efficient, math, cudnn) unless the program set
one (`sdpa_kernel(..., set_priority=True)`), and `check_prefer_cudnn_attention` puts cuDNN first on sm9x/sm10x
with cuDNN > 9.15.0 (CUDA < 13 wheels: minor 0 or 3 only), unless $TORCH_CUDNN_SDPA_DEPRIORITIZED.
Grouped-query attention (`enable_gqa`, `check_grouped_query_attention`) runs on all three fused kernels on CUDA;
multi-query (k/v with one head, no `enable_gqa`) on them from torch 2.14 (`supports_mqa`); the efficient kernel
takes either only from 2.14 (2.13's meta backward returns dk/dv with q's head count). cuDNN's layout check
(`check_cudnn_layout`) is not among its gates in these releases (its warnings are absent from the 2.14.1 binary).
Autocast casts SDPA's inputs before the choice (a lower_precision_fp op), so the choice sees the cast dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from xmem.trace.errors import as_on_a_gpu

FLASH, EFFICIENT, MATH, CUDNN = "flash", "efficient", "math", "cudnn"
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)  # Context.h sdp_priority_order
CUDNN_FIRST = (CUDNN, FLASH, EFFICIENT, MATH)  # priority_order() when check_prefer_cudnn_attention()
_ENUM_NAMES = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}  # at::SDPBackend values; 4 (overrideable) is not CUDA's

# A CPU build of torch stands for the CUDA wheel of its release, whose libraries it cannot show. The only wheel
# read is 2.14.1+cu130 (CUDA 13.0, cuDNN 9.24.0 = 92400, notes/fake-cuda-cuda-build.md): its figures stand in.
WHEEL_CUDA_MAJOR, WHEEL_CUDNN_VERSION = 13, 92400
# Capabilities whose answers can differ (one per rule boundary): Volta, Turing, A100, A10/RTX30, L40S/RTX40,
# H100, B200, B300, RTX50. An answer that differs across them makes the trace arch-sensitive.
GENERATIONS = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0))
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Runtime:
    """What the choice reads besides the call and the GPU: the torch release, its CUDA and cuDNN, the switches."""

    torch_version: tuple[int, int] = (2, 14)
    cuda_major: int = WHEEL_CUDA_MAJOR  # CUDA the wheel was built with
    cudnn_version: int = WHEEL_CUDNN_VERSION  # runtime cuDNN, as versionRuntimeCuDNN() (9.24.0 -> 92400)
    enabled: frozenset[str] = frozenset(DEFAULT_ORDER)  # torch.backends.cuda.enable_*_sdp / sdpa_kernel
    order: tuple[str, ...] = DEFAULT_ORDER  # the order the program left in the global context
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) without warn_only
    cudnn_deprioritized: bool = False  # $TORCH_CUDNN_SDPA_DEPRIORITIZED

    @property
    def supports_mqa(self) -> bool:
        return self.torch_version >= (2, 14)  # check_batch_size_and_num_heads_dense<..., supports_mqa> from 2.14

    @property
    def batches_unbatched_input(self) -> bool:
        return self.torch_version >= (2, 14)  # normalize_unbatched_input: 3-D q/k/v get a batch of 1


def current_runtime() -> Runtime:
    """The Runtime of this process, read now (the program may have changed the switches since the last call)."""
    flags = {FLASH: torch.backends.cuda.flash_sdp_enabled(), EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
             MATH: torch.backends.cuda.math_sdp_enabled(), CUDNN: torch.backends.cuda.cudnn_sdp_enabled()}
    order = tuple(_ENUM_NAMES[i] for i in torch._C._get_sdp_priority_order() if i in _ENUM_NAMES)
    torch_version, cuda_major, cudnn_version = _libraries()
    return Runtime(torch_version=torch_version, cuda_major=cuda_major, cudnn_version=cudnn_version,
                   enabled=frozenset(name for name, on in flags.items() if on), order=order,
                   deterministic=(torch.are_deterministic_algorithms_enabled()
                                  and not torch.is_deterministic_algorithms_warn_only_enabled()),
                   cudnn_deprioritized=_env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED"))


@functools.cache
def _libraries() -> tuple[tuple[int, int], int, int]:
    """(torch release, CUDA major, cuDNN version) of this torch. The cuDNN version is read from the library, not
    through torch.backends.cudnn.version(), which asks the device's capability (an arch question) to vet it."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    cuda = torch.version.cuda
    cudnn = torch._C._cudnn.getVersionInt() if hasattr(torch._C, "_cudnn") else WHEEL_CUDNN_VERSION
    return (major, minor), int(cuda.split(".")[0]) if cuda else WHEEL_CUDA_MAJOR, cudnn


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE", "Y")  # c10::utils::check_env


@dataclass(frozen=True, slots=True)
class Mask:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bool
    requires_grad: bool = False
    last_stride: int = 1


@dataclass(frozen=True, slots=True)
class Call:
    """What the gates read of one SDPA call (sdp_params), as plain data so the choice can be tested by hand."""

    q: tuple[int, ...]  # shapes
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype = torch.float16
    same_dtypes: bool = True  # q, k and v share the dtype
    mask: Mask | None = None
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    needs_grad: bool = False  # input_requires_grad: an input requires grad and grad mode is on
    on_cuda: bool = True
    last_strides: tuple[int, int, int] = (1, 1, 1)
    storage_offsets: tuple[int, int, int] = (0, 0, 0)  # in elements

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
           is_causal: bool, enable_gqa: bool) -> "Call":
        tensors = (q, k, v)
        return cls(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dtype=q.dtype,
                   same_dtypes=q.dtype == k.dtype == v.dtype,
                   mask=None if mask is None else Mask(tuple(mask.shape), mask.dtype, mask.requires_grad,
                                                       mask.stride(-1) if mask.dim() else 1),
                   dropout=dropout, is_causal=is_causal, enable_gqa=enable_gqa,
                   needs_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
                   on_cuda=all(t.device.type == "cuda" for t in tensors),
                   last_strides=tuple(t.stride(-1) if t.dim() else 1 for t in tensors),
                   storage_offsets=tuple(t.storage_offset() for t in tensors))

    def batched(self) -> "Call":
        """normalize_unbatched_input: 3-D q, k, v as a batch of one (a mask grows to 4-D)."""
        if not (len(self.q) == len(self.k) == len(self.v) == 3):
            return self
        mask = self.mask
        if mask is not None and len(mask.shape) < 4:
            mask = Mask((1,) * (4 - len(mask.shape)) + mask.shape, mask.dtype, mask.requires_grad, mask.last_stride)
        return dataclasses.replace(self, q=(1, *self.q), k=(1, *self.k), v=(1, *self.v), mask=mask)


# ---- the gates, per backend (sdp_utils.cpp / sdp_utils_cpp.h) --------------------------------------------------
def _in_range(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int] = (12, 1)) -> bool:
    return low <= capability <= high  # check_sm_version


def _dense_ok(call: Call, ignore_singleton_dim: bool) -> bool:
    """check_tensor_shapes, check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense."""
    if not (len(call.q) == len(call.k) == len(call.v) == 4) or call.q[-2] == 0 or call.k[-2] == 0:
        return False
    strides_ok = all(s == 1 for s in call.last_strides) or ignore_singleton_dim and call.q[-1] == 1
    return strides_ok and (call.mask is None or call.mask.last_stride == 1)


def _heads_ok(call: Call, runtime: Runtime, same_kv_heads_required: bool, supports_gqa: bool = True) -> bool:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads, supports_mqa> (CUDA)."""
    (bq, hq), (bk, hk), (bv, hv) = call.q[:2], call.k[:2], call.v[:2]
    if not bq == bk == bv:
        return False
    if call.enable_gqa and supports_gqa:  # check_grouped_query_attention
        if same_kv_heads_required and hk != hv:
            return False
        return hq % hk == 0 and (same_kv_heads_required or hq % hv == 0)
    if hq == hk == hv:
        return True
    return supports_gqa and runtime.supports_mqa and hq > 0 and hk == hv == 1


def can_use_flash(call: Call, capability: tuple[int, int], runtime: Runtime) -> bool:
    d = call.q[-1]
    if FLASH not in runtime.enabled or not call.on_cuda or len(call.q) != 4 or call.mask is not None:
        return False  # check_runtime_disabled_flash, check_all_tensors_on_device, check_for_attn_mask
    if not (d == call.k[-1] == call.v[-1] and d <= 256):  # check_head_dim_size_flash
        return False
    if not _in_range(capability, (8, 0)):  # check_flash_attention_hardware_support: sm80..sm121
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: their backward kernels stop at 192
    if call.needs_grad and (_in_range(capability, (8, 6), (8, 9)) or _in_range(capability, (12, 0))):
        if not (d <= 192 or call.dropout == 0 and d > 224):
            return False
    if call.is_causal and call.q[-2] != call.k[-2]:  # check_flash_causal_non_square_seqlens
        return False
    if not (call.same_dtypes and call.dtype in HALF):  # check_dtypes_flash_attention (FA3's fp8 not modelled)
        return False
    return _heads_ok(call, runtime, same_kv_heads_required=True) and _dense_ok(call, ignore_singleton_dim=True)


def minimum_gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """minimum_gemm_alignment: elements the efficient kernel's head dim (and storage offsets) must be a multiple of."""
    half = dtype in HALF
    tensor_cores = capability[0] >= 8 or capability[0] >= 7 and half
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def can_use_efficient(call: Call, capability: tuple[int, int], runtime: Runtime) -> bool:
    if EFFICIENT not in runtime.enabled or not call.on_cuda or not _in_range(capability, (5, 0)):
        return False  # check_runtime_disabled_mem_efficient, ..._on_device, check_mem_efficient_hardware_support
    if len(call.q) != 4 or len(call.k) != 4 or len(call.v) != 4:
        return False
    align = minimum_gemm_alignment(call.dtype, capability)
    dq, dk, dv = call.q[-1], call.k[-1], call.v[-1]
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False  # check_head_dim_size_mem_efficient
    if capability[0] >= 8 and any(offset % align for offset in call.storage_offsets):
        return False  # check_data_ptr_alignment_mem_efficient (the allocator's bases are 512-byte aligned)
    # before 2.14 the efficient kernel took no grouped heads (2.13's fake backward gives dk/dv q's head count)
    heads_ok = _heads_ok(call, runtime, same_kv_heads_required=True, supports_gqa=runtime.torch_version >= (2, 14))
    if not (_dense_ok(call, ignore_singleton_dim=False) and heads_ok):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability[0] >= 8 else (torch.float16, torch.float32)
    return call.same_dtypes and call.dtype in dtypes


def _cudnn_supports_d256(capability: tuple[int, int], cudnn: int) -> bool:
    """sm90/sm10x with cuDNN > 9.22 take head dims up to 256 (the 2.14 wheel's cudnn-frontend is assumed >= 1.24)."""
    unsupported_sm107 = capability == (10, 7) and cudnn <= 92500
    return _sm90_or_sm10x(capability) and not unsupported_sm107 and cudnn > 92200


def _sm90_or_sm10x(capability: tuple[int, int]) -> bool:
    return capability == (9, 0) or capability[0] == 10


def _cudnn_shapes_ok(call: Call, capability: tuple[int, int], cudnn: int) -> bool:
    """check_cudnn_tensor_shapes (for cuDNN >= 9, which every wheel that reaches here has) and the decode gate."""
    (b, h, s_q, d_qk), s_k, d_v = call.q, call.k[2], call.v[3]
    if b > 65535 or h > 65535:
        return False
    limit = 128
    if _cudnn_supports_d256(capability, cudnn):
        limit = 256
    elif _sm90_or_sm10x(capability) and cudnn >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if s_k == 1 or call.dropout != 0.0 and s_q == 1:
        return False
    # 2.14: is_cudnn_attention_decode_disabled (query length 1 on SM 10.x/11.x with cuDNN 9.19 to 9.25.0 but 9.24.1)
    decode_disabled = capability[0] in (10, 11) and 91900 <= cudnn <= 92500 and cudnn != 92401
    return not (s_q == 1 and decode_disabled)


def _cudnn_backward_head_dims_ok(call: Call, capability: tuple[int, int], cudnn: int) -> bool:
    """check_cudnn_d256_bprop_head_dim: where head dims to 256 are taken, backward takes only some of them."""
    if not call.needs_grad or not _cudnn_supports_d256(capability, cudnn):
        return True
    d_qk, d_v = call.q[3], call.v[3]
    return d_qk <= 128 and d_v <= 128 or (d_qk, d_v) in ((192, 128), (256, 256))


def _cudnn_mask_ok(call: Call) -> bool:
    """check_attn_mask_shape: a 2-D or 4-D mask broadcastable over (batch, heads) and not requiring grad."""
    mask = call.mask
    if mask is None:
        return True
    if mask.requires_grad or len(mask.shape) not in (2, 4):
        return False
    (b, h, s_q), s_k = call.q[:3], call.k[2]
    wanted = (b, h, s_q, s_k)[-len(mask.shape):]
    return all(size in (want, 1) for size, want in zip(mask.shape, wanted))


def can_use_cudnn(call: Call, capability: tuple[int, int], runtime: Runtime) -> bool:
    cudnn = runtime.cudnn_version
    if cudnn < 90000 or call.dropout > 0.0 and 91100 < cudnn < 91400:
        return False  # cuDNN attention needs cuDNN 9; 9.11-9.13 cannot do dropout
    if CUDNN not in runtime.enabled or not call.on_cuda or len(call.q) != 4 or len(call.k) != 4:
        return False  # check_runtime_disabled_cudnn, check_all_tensors_on_device, check_tensor_shapes
    if len(call.v) != 4 or runtime.deterministic:  # check_cudnn_deterministic
        return False
    low_precision = HALF if capability[0] >= 8 else (torch.float16,)  # check_dtypes_low_precision
    if not (call.same_dtypes and call.dtype in low_precision and _cudnn_mask_ok(call)):
        return False
    if not _in_range(capability, (8, 0)) or call.dropout * 16.0 != math.floor(call.dropout * 16.0):
        return False  # check_cudnn_hardware_support, check_cudnn_dropout (multiples of 1/16)
    return (_dense_ok(call, ignore_singleton_dim=True) and _heads_ok(call, runtime, same_kv_heads_required=False)
            and _cudnn_shapes_ok(call, capability, cudnn) and _cudnn_backward_head_dims_ok(call, capability, cudnn))


CAN_USE = {FLASH: can_use_flash, EFFICIENT: can_use_efficient, CUDNN: can_use_cudnn,
           MATH: lambda call, capability, runtime: MATH in runtime.enabled}


def prefers_cudnn(capability: tuple[int, int], runtime: Runtime) -> bool:
    """check_prefer_cudnn_attention."""
    if runtime.cudnn_deprioritized or runtime.cudnn_version <= 91500 or capability[0] not in (9, 10):
        return False
    return runtime.cuda_major >= 13 or capability[1] in (0, 3)


def priority_order(capability: tuple[int, int], runtime: Runtime) -> tuple[str, ...]:
    """The order upstream walks. It puts cuDNN first once, at the process's first look at the order, unless the
    program had set its own (an order left equal to the default is taken as never set)."""
    if runtime.order == DEFAULT_ORDER and prefers_cudnn(capability, runtime):
        return CUDNN_FIRST
    return runtime.order


def select_backend(call: Call, capability: tuple[int, int], runtime: Runtime = Runtime()) -> str | None:
    """select_sdp_backend: the backend the GPU of `capability` runs `call` with; None when none may (upstream
    raises "No available kernel")."""
    if runtime.batches_unbatched_input:
        call = call.batched()
    for backend in priority_order(capability, runtime):
        if CAN_USE[backend](call, capability, runtime):
            return backend
    return None


def choose_attention_backend(call: Call, capability: tuple[int, int], runtime: Runtime = Runtime(),
                             generations: Iterable[tuple[int, int]] = GENERATIONS) -> tuple[str | None, bool]:
    """(backend on `capability`, whether another GPU generation would choose differently)."""
    backend = select_backend(call, capability, runtime)
    return backend, any(select_backend(call, other, runtime) != backend for other in generations)


# ---- the patch ---------------------------------------------------------------------------------------------------
def install(fake: Any) -> None:
    """Route F.scaled_dot_product_attention on cuda to the backend `fake` (a FakeCuda) would run.

    A function patch, not a TorchFunctionMode: those stay on the thread that entered them, and activation-checkpoint
    recomputation runs on the autograd thread (it must pick the same kernel as the forward did)."""
    math_attention = F.scaled_dot_product_attention
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = dict(zip(names, args)) | kwargs
        q, k, v = call["query"], call["key"], call["value"]
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" and not t.is_nested for t in (q, k, v)):
            return math_attention(*args, **kwargs)
        mask, dropout, causal = call.get("attn_mask"), call.get("dropout_p", 0.0), call.get("is_causal", False)
        q, k, v, mask = _autocast(q, k, v, mask)
        runtime = current_runtime()
        backend, depends_on_arch = choose_attention_backend(
            Call.of(q, k, v, mask, dropout, causal, call.get("enable_gqa", False)), fake.capability, runtime)
        if depends_on_arch:
            fake.on_arch_question()
        if backend is None:
            raise as_on_a_gpu(RuntimeError("No available kernel. Aborting execution. (scaled_dot_product_attention: "
                                            "every backend the program left enabled refuses this call on this GPU)"))
        if backend == MATH:
            return math_attention(*args, **kwargs)
        unbatched = q.dim() == 3 and runtime.batches_unbatched_input
        if unbatched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        out = FUSED[backend](q, k, v, mask, dropout, causal, call.get("scale"))
        return out.squeeze(0) if unbatched else out

    F.scaled_dot_product_attention = scaled_dot_product_attention


def _autocast(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """What autocast does before SDPA's own dispatch picks a kernel (it is a lower_precision_fp op): floating
    inputs on cuda become the autocast dtype (a copy each, as on the GPU)."""
    if not torch.is_autocast_enabled("cuda"):
        return list(tensors)
    dtype = torch.get_autocast_dtype("cuda")
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.device.type == "cuda" else t
            for t in tensors]


def _logsumexp_needed(*tensors: torch.Tensor) -> bool:
    """should_compute_logsumexp: backward needs the softmax statistics."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask: a float bias with -inf where a boolean mask is False."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _flash(q, k, v, mask, dropout, causal, scale):
    # attention.cpp pads head dims to a multiple of 8 for flash, with the scale of the true head dim
    head_dim = q.shape[-1]
    if head_dim % 8:
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        q, k, v = (F.pad(t, (0, 8 - head_dim % 8)) for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
    return out[..., :head_dim] if head_dim % 8 else out


def _efficient(q, k, v, mask, dropout, causal, scale):
    mask = _additive_mask(mask, q.dtype)
    if mask is not None:
        # preprocess_mask: a bias whose rows are not 16-element aligned is copied into a padded one (pad_bias),
        # then read broadcast to (B, H, Tq, Tk)
        if any(stride % 16 for stride in mask.stride()[:-1]):
            tk = mask.shape[-1]
            mask = F.pad(mask, (0, 16 - tk % 16))[..., :tk]
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, _logsumexp_needed(q, k, v), dropout, causal, scale=scale)[0]


def _cudnn(q, k, v, mask, dropout, causal, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, _additive_mask(mask, q.dtype), _logsumexp_needed(q, k, v), dropout, causal, False,
        scale=scale)[0]


FUSED = {FLASH: _flash, EFFICIENT: _efficient, CUDNN: _cudnn}
