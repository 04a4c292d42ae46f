"""An MLP trained with AdamW in one of torch's implementations: fused, foreach or for-loop (a valid GPU script)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=["fused", "foreach", "for-loop"], default="foreach")
args = parser.parse_args()

model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10)).cuda()
choice = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[args.impl]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **choice)
for step in range(5):
    x, y = torch.randn(64, 100, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
