"""A frozen backbone built directly on the GPU with a small trainable head (LoRA-style fine-tuning shape)."""
import torch
import torch.nn as nn

with torch.device("cuda"):
    backbone = nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 128))
    head = nn.Linear(128, 2)
backbone.requires_grad_(False)
optimizer = torch.optim.AdamW(head.parameters())
for step in range(5):
    features = backbone(torch.randn(4, 128, device="cuda"))
    head(features).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
