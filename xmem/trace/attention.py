"""Which scaled-dot-product-attention kernel the pretended GPU runs, and the patch that makes it run it.

SDPA picks its backend in C++ from real device properties, so under fake CUDA it would always take the math path
(which materialises B*H*T*T scores). This module re-states the choice (upstream: sdp_utils.cpp select_sdp_backend,
simplified) as a pure function of the call and the compute capability, and patches
`F.scaled_dot_product_attention` to call the chosen fused op. Import only in the tracing child.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def install(fake: Any) -> None:
    """Route F.scaled_dot_product_attention on cuda to the backend `fake` (a FakeCuda) would run.

    A function patch, not a TorchFunctionMode: those stay on the thread that entered them, and activation-checkpoint
    recomputation runs on the autograd thread (it must pick the same kernel as the forward did)."""
    math_attention = F.scaled_dot_product_attention
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = dict(zip(names, args)) | kwargs
        q, k, v = call["query"], call["key"], call["value"]
        mask = call.get("attn_mask")
        backend, depends_on_arch = choose_attention_backend(q, k, v, mask, call.get("enable_gqa", False),
                                                            fake.capability, _enabled_attention_backends())
        if depends_on_arch:
            fake.on_arch_question()
        dropout, causal, scale = call.get("dropout_p", 0.0), call.get("is_causal", False), call.get("scale")
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False,
                                                                      scale=scale)[0]
        if backend == "efficient":
            if mask is not None and mask.dtype == torch.bool:
                # upstream convert_boolean_attn_mask: a float bias with -inf where the mask is False
                mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
            needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, needs_grad, dropout,
                                                                          causal, scale=scale)[0]
        return math_attention(*args, **kwargs)

    F.scaled_dot_product_attention = scaled_dot_product_attention


def _enabled_attention_backends() -> frozenset[str]:
    """The backends the program allows (torch.nn.attention.sdpa_kernel / torch.backends.cuda.enable_*_sdp)."""
    flags = {"flash": torch.backends.cuda.flash_sdp_enabled(),
             "efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}
    return frozenset(name for name, enabled in flags.items() if enabled)


def choose_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool,
                             capability: tuple[int, int],
                             enabled: frozenset[str] = frozenset({"flash", "efficient"})) -> tuple[str, bool]:
    """(backend, whether another GPU generation would choose differently) for one SDPA call on cuda.

    flash: sm>=80, fp16/bf16, no explicit mask, head_dim <= 256 and a multiple of 8, same head count in q/k/v;
    efficient: sm>=50, any float dtype (bf16 needs sm>=80), masks allowed, head_dim alignment 8 (fp32: 4);
    otherwise math. Backends the program disabled are skipped.
    """
    if q.device.type != "cuda" or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math", False
    head_dim, dtype = q.shape[-1], q.dtype
    same_heads = q.shape[1] == k.shape[1] == v.shape[1]
    flash_shape_ok = mask is None and head_dim <= 256 and head_dim % 8 == 0 and same_heads and not gqa
    half = dtype in (torch.float16, torch.bfloat16)
    efficient_ok_anywhere = same_heads and not gqa and head_dim % (4 if dtype == torch.float32 else 8) == 0
    choice = {}
    for cap in ((7, 0), (8, 0), capability):
        if "flash" in enabled and half and flash_shape_ok and cap >= (8, 0):
            choice[cap] = "flash"
        elif "efficient" in enabled and efficient_ok_anywhere and (
                dtype in (torch.float32, torch.float16) or dtype == torch.bfloat16 and cap >= (8, 0)):
            choice[cap] = "efficient"
        else:
            choice[cap] = "math"
    return choice[capability], len(set(choice.values())) > 1
