"""A decoder in the style of transformers' models: each layer keeps a key/value cache that starts as an empty GPU
tensor (`torch.tensor([], dtype=..., device=...)`) and grows by concatenation; trained with AdamW in bf16 autocast.
Checks what the empty tensors are, so that a trace fails if the tracer makes them wrongly."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerCache:
    def __init__(self):
        self.keys = self.values = None

    def update(self, keys, values):
        if self.keys is None:
            self.keys = torch.tensor([], dtype=keys.dtype, device=keys.device)
            self.values = torch.tensor([], dtype=values.dtype, device=values.device)
            assert self.keys.shape == (0,) and self.keys.dtype == keys.dtype and self.keys.device == keys.device
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values


class Layer(nn.Module):
    def __init__(self, dim=128, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        k, v = cache.update(k, v)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


layers = nn.ModuleList(Layer() for _ in range(3)).cuda()
optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
assert torch.tensor([], device="cuda").dtype == torch.get_default_dtype()
assert torch.as_tensor((), dtype=torch.int64, device="cuda").shape == (0,)
for step in range(10):
    x = torch.randn(4, 64, 128, device="cuda")
    caches = [LayerCache() for _ in layers]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for layer, cache in zip(layers, caches):
            x = layer(x, cache)
        loss = x.float().square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
