"""Residual MLP blocks behind an input projection, with torch.utils.checkpoint per block (reentrant or not) or
without it (a valid GPU script)."""
import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["none", "reentrant", "non-reentrant"], default="non-reentrant")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 256)  # not checkpointed: the blocks' inputs require grad (reentrant needs it)
        self.blocks = nn.ModuleList(Block(256) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if args.mode == "none" else checkpoint(block, x, use_reentrant=args.mode == "reentrant")
        return x


model = Model().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(32, 64, device="cuda")).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
