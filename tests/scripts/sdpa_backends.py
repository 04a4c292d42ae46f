"""One attention layer trained for a step, its SDPA backend restricted by the program (torch.nn.attention.sdpa_kernel)
so that each backend's forward and backward allocations can be checked by hand. q/k/v are leaf parameters
(B, H, T, D) and (B, H_kv, T, D): the only other allocations are their gradients and the loss."""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["cudnn", "flash", "efficient", "math", "any"], default="any")
parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
parser.add_argument("--shape", type=int, nargs=5, default=[2, 8, 2, 64, 32], metavar=("B", "H", "H_KV", "T", "D"))
parser.add_argument("--mask", action="store_true", help="a boolean (B, 1, T, T) padding mask instead of is_causal")
args = parser.parse_args()

BACKENDS = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}
BACKENDS["any"] = [chosen for name, (chosen,) in BACKENDS.items()]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
b, h, h_kv, t, d = args.shape
q = torch.nn.Parameter(torch.randn(b, h, t, d, device="cuda", dtype=dtype))
k = torch.nn.Parameter(torch.randn(b, h_kv, t, d, device="cuda", dtype=dtype))
v = torch.nn.Parameter(torch.randn(b, h_kv, t, d, device="cuda", dtype=dtype))
optimizer = torch.optim.SGD([q, k, v], lr=0.1)
mask = torch.ones(b, 1, t, t, device="cuda", dtype=torch.bool) if args.mask else None
for step in range(2):
    with sdpa_kernel(BACKENDS[args.backend]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not args.mask, enable_gqa=h != h_kv)
    out.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
