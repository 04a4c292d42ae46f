"""An MLP trained under autocast (bf16, or fp16 with a GradScaler), calling its layers twice per step so that the
second call takes the weights from autocast's cast cache (a valid GPU script)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
args = parser.parse_args()
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
for step in range(5):
    x = torch.randn(32, 256, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        h = model(model(x))  # the second call: the same weights, already cast
        loss = h.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
