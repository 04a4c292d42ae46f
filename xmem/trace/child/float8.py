"""torchao's float8 and MX training under fake CUDA.

Owns which ops the recorder leaves to those tensors' own `__torch_dispatch__` (`dispatches_itself`). torchao's
float8 training (`convert_to_float8_training`: Float8Linear) casts each matmul operand in the program's own ops
(amax, scale, scaled copy, clamp, cast to float8: plain ops the recorder sees) and wraps the float8 bits and their
scale in a `Float8TrainingTensor`; the matmul of two such tensors is that class's handler (torchao.float8.float8_ops:
`preprocess_addmm`, then `addmm_float8_unwrapped`), which runs plain ops on the inner tensors: the layout copies
`torch._scaled_mm` needs (an operand made row-major or column-major by `contiguous`), the reciprocal of each scale,
rowwise scales repeated to a column, the `_scaled_mm` itself and, for rowwise scaling without fast accumulation, its
output rescaled afterwards. When the recorder took the matmul itself, that handler ran below it and only the output
was recorded; left to the handler first (as DTensor's and NF4's ops are), its inner ops come back to the recorder one
by one and are recorded as the GPU allocates them. Under torch.compile, AOTAutograd takes the subclass apart and the
compiled graph holds the casts and `_scaled_mm` itself (xmem.trace.child.compiled).

torchao's MX training (torchao.prototype.moe_training: MXFP8TrainingOpConfig, its weights wrapped so that F.linear
runs its mx_mm) casts each operand by torchao's custom ops (their fake kernels run here) into an `MXTensor`, whose mm
handler (mx_tensor._addmm_mx_dispatch) swizzles both scales (`to_blocked`: copies) and calls `_scaled_mm`: the
same rule lets it dispatch first.

FSDP2's float8 all-gather (`enable_fsdp_float8_all_gather`: each weight a torchao `WeightWithDynamicFloat8CastTensor`)
needs nothing of its own here: its `fsdp_pre_all_gather` casts the fp32 shard by plain ops, FSDP2 allocates the flat
float8 all-gather output and the float8 unsharded weights itself, and the wrapper's own ops (FSDP's copies and views,
AdamW's moments) are the recorder's as any tensor's, recorded by their inner storages (tests/trace/child/
test_float8_fsdp.py). Its `__tensor_flatten__` reads the precomputed scale's value: see facts.inner_tensors.

Whether the GPU can run the float8 matmul is said as upstream's CUDA kernel says it (`refuse_where_the_gpu_cannot`:
aten's `_scaled_mm_out_cuda` checks the device's compute capability, which its meta kernel, run here, does not);
torchao's and the training libraries' own checks read the fake GPU's capability themselves (MX training's kernels
need sm100: below, torchao's casts raise its own "needs triton").
"""

from __future__ import annotations

import sys
from typing import Any

from xmem.trace.errors import as_on_a_gpu

# upstream's refusal (aten/src/ATen/native/cuda/Blas.cpp), word for word: a program that reaches it fails on such a GPU
SCALED_MM_REFUSAL = ("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or "
                     "ROCm MI300+")
SCALED_MM_CAPABILITY = (8, 9)
SCALED_MM_OPS = frozenset({"_scaled_mm"})

# (module, class) of each torchao tensor whose handler is run first: its module must be imported for it to be in use
_CLASSES = (
    ("torchao.float8.float8_training_tensor", "Float8TrainingTensor"),
    ("torchao.prototype.mx_formats.mx_tensor", "MXTensor"),
)


def dispatches_itself(types: Any) -> bool:
    """Whether an op on tensors of `types` (its __torch_dispatch__ argument) is a torchao float8 or MX tensor's to
    dispatch first."""
    classes = _classes_in_use()
    return bool(classes) and any(issubclass(kind, classes) for kind in types)


def refuse_where_the_gpu_cannot(op_name: str, fake: Any) -> None:
    """A float8 matmul on a GPU below compute capability 8.9 fails as it fails there (RuntimeError, upstream's words).
    Asking the capability marks the trace as depending on the GPU generation."""
    if op_name in SCALED_MM_OPS and fake.ask_capability() < SCALED_MM_CAPABILITY:
        raise as_on_a_gpu(RuntimeError(SCALED_MM_REFUSAL))  # the program's error: it fails there too


def _classes_in_use() -> tuple[type, ...]:
    found = []
    for module_name, class_name in _CLASSES:
        module = sys.modules.get(module_name)
        kind = getattr(module, class_name, None) if module is not None else None
        if isinstance(kind, type):
            found.append(kind)
    return tuple(found)


__all__ = ["SCALED_MM_REFUSAL", "dispatches_itself", "refuse_where_the_gpu_cannot"]
