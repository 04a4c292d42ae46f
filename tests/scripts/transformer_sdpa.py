"""A small causal transformer using F.scaled_dot_product_attention, trained with AdamW (a valid GPU script).
--dtype fp16 runs the forward under autocast (fp16); fp32 otherwise."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


device = "cuda"
model = TinyGPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.dtype)
for step in range(10):
    idx = torch.randint(0, 256, (4, 33), device=device)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
