"""Trains a step only on the interpreter it is told to expect: a trace on another one ends in a user error."""

import sys

import torch

if sys.executable != sys.argv[1]:
    raise SystemExit(f"ran on {sys.executable}, not on {sys.argv[1]}")
model = torch.nn.Linear(4, 4).cuda()
model(torch.randn(2, 4, device="cuda")).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
