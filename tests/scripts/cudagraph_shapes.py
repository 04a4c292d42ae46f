"""A compiled MLP under Inductor's CUDA graph trees (torch.compile mode="reduce-overhead") whose batch size changes
during training: Linear(256 -> 1024), x * sigmoid(x), Linear(1024 -> 256), fp32, SGD; each step's batch size taken in
turn from --batches. --dynamic: torch.compile's `dynamic` (auto: dynamo recompiles the second size with symbolic
shapes; false: one static graph per size; true: symbolic from the start)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batches", default="4096,4096,8192,8192,4096,8192")
parser.add_argument("--dynamic", choices=("auto", "false", "true"), default="auto")
args = parser.parse_args()


class Swish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 1024, bias=False)
        self.down = nn.Linear(1024, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * torch.sigmoid(h))


model = Swish().cuda()
run = torch.compile(model, mode="reduce-overhead", dynamic={"auto": None, "false": False, "true": True}[args.dynamic])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for rows in (int(size) for size in args.batches.split(",")):
    batch = torch.randn(rows, 256, device="cuda")
    run(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
