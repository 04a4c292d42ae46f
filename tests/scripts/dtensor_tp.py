"""Tensor parallelism over a DeviceMesh, launched by torchrun: an MLP Linear(256, 1024) -> ReLU -> Linear(1024, 256)
whose first layer is split by columns and second by rows (parallelize_module, ColwiseParallel/RowwiseParallel) over
all ranks of a 1-D mesh; AdamW steps the DTensor parameters."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(3):
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
