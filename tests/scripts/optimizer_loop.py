"""A small model trained by one of torch's optimizers in its default (foreach) form, with gradient clipping."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="AdamW")
parser.add_argument("--dtype", default="float32")
args = parser.parse_args()

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                            torch.nn.Linear(128, 10)).to("cuda", getattr(torch, args.dtype))
options = {"SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "RMSprop": {"momentum": 0.5, "centered": True},
           "AdamW": {"weight_decay": 0.1}}.get(args.optimizer, {})
optimizer = getattr(torch.optim, args.optimizer)(model.parameters(), **options)
for step in range(5):
    batch = torch.randn(16, 64, device="cuda", dtype=model[0].weight.dtype)
    loss = model(batch).float().square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=args.optimizer != "SGD")
