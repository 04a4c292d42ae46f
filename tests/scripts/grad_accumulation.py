"""Gradient accumulation: 2 micro-batches per optimizer step (a valid GPU script)."""
import torch
import torch.nn as nn

model = nn.Linear(64, 64).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
accumulate = 2
for micro_step in range(20):
    x = torch.randn(16, 64).cuda()
    loss = model(x).square().mean() / accumulate
    loss.backward()
    if (micro_step + 1) % accumulate == 0:
        optimizer.step()
        optimizer.zero_grad()
