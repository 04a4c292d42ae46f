"""torchrun DDP training of a small CNN: NCCL process group from the launcher's environment, DistributedSampler,
DDP with device_ids, SGD with momentum, loss all-reduced for logging on rank 0 (corpus program)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(32 * 16, 10))


def main():
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    data = TensorDataset(torch.randn(1024, 1, 28, 28), torch.randint(0, 10, (1024,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DistributedDataParallel(build_model().to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler.set_epoch(0)
    for step, (images, labels) in enumerate(loader):
        images, labels = images.to(device), labels.to(device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
        if rank == 0 and step % 2 == 0:
            print(f"step {step} world {world} loss {reduced.item():.4f}")
        if step == 6:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
