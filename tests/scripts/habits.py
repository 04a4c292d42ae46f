"""Habits of real training scripts: an EMA copy, metrics through numpy, unique labels, one_hot, a LR schedule, a CUDA generator,
the old torch.cuda.amp API, a checkpoint saved every step (a valid GPU script). Argument: checkpoint path."""
import copy
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

checkpoint = sys.argv[1]
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)).cuda()
ema = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
scaler = torch.cuda.amp.GradScaler()
history = []
shuffle = torch.Generator(device="cuda")
shuffle.manual_seed(0)
for step in range(10):
    x = torch.randn(16, 20, device="cuda")[torch.randperm(16, device="cuda", generator=shuffle)]
    y = torch.randint(0, 5, (16,), device="cuda")
    classes = torch.unique(y)
    target = F.one_hot(y).float()
    with torch.cuda.amp.autocast():
        logits = model(x)
        loss = F.cross_entropy(logits, y) + 0.0 * target.sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    schedule.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
    accuracy = (logits.argmax(1) == y).float().mean().cpu().numpy()
    history.append(float(accuracy) + len(classes))
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "step": step}, checkpoint)
print(np.mean(history))
