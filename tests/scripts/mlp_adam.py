"""A small MLP trained with Adam on random data (a valid GPU script)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--fused", action="store_true")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=args.fused or None)
loss_fn = nn.CrossEntropyLoss()

for step in range(args.steps):
    x = torch.randn(args.batch, 100).to(device)
    y = torch.randint(0, 10, (args.batch,)).to(device)
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")
