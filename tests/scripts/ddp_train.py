"""DistributedDataParallel training, launched by torchrun (a valid multi-GPU script)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).cuda(local_rank)
model = DistributedDataParallel(model, device_ids=[local_rank])
model = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters())
for step in range(10):
    x = torch.randn(32, 128, device=f"cuda:{local_rank}")
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
