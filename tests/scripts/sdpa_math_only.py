"""Attention restricted to the math backend by the program (torch.nn.attention.sdpa_kernel)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

proj = torch.nn.Linear(64, 64).cuda().half()
optimizer = torch.optim.SGD(proj.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(2, 4, 32, 64, device="cuda", dtype=torch.half)
    q = proj(x)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, x, x, is_causal=True)
    out.float().sum().backward()
    optimizer.step()
