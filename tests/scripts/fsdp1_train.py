"""FSDP (FullyShardedDataParallel, use_orig_params) training of 4 Linear layers, launched by torchrun."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = FSDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda(), use_orig_params=True)
optimizer = torch.optim.AdamW(model.parameters())
for step in range(5):
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
