"""An MLP trained with bitsandbytes' 8-bit AdamW, plain or paged, as a QLoRA-style fine-tuning script sets it up
(a valid GPU script)."""
import argparse

import bitsandbytes as bnb
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", choices=["AdamW8bit", "PagedAdamW8bit", "PagedAdamW"], default="AdamW8bit")
parser.add_argument("--features", type=int, default=500, help="inputs of the first layer (its weight: 300 x this)")
args = parser.parse_args()

model = nn.Sequential(nn.Linear(args.features, 300), nn.ReLU(), nn.Linear(300, 10)).cuda()
optimizer = getattr(bnb.optim, args.optimizer)(model.parameters(), lr=1e-3, weight_decay=0.01)
for step in range(3):
    x, y = torch.randn(64, args.features, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
