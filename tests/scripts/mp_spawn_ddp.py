"""DDP started with torch.multiprocessing.spawn, one process per GPU (a valid multi-GPU script)."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = DDP(nn.Linear(64, 64).to(rank), device_ids=[rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        optimizer.zero_grad()
        model(torch.randn(8, 64, device=rank)).sum().backward()
        optimizer.step()
    assert dist.get_world_size() == world_size
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
