"""A data-parallel job whose ranks differ only where it tests its rank (tests/trace/child/test_rank_reads.py), run
under torchrun. A bias-free 4096 x 4096 fp32 linear layer (64 MiB) trained by AdamW on batches that
DistributedSampler deals out; then, by --mode:
- last-extra: the last rank (by torch.distributed.get_rank()) keeps the remainder of a split, 32 MiB, all along;
- rank0-ema: rank 0 (by the RANK variable) keeps an EMA copy of the weights, 64 MiB, and the others wait at a
  barrier while it makes it;
- device-only: the ranks read their rank only to pick their device and deal their batches: no test of it.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MIB = 2**20
WIDTH = 4096


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("last-extra", "rank0-ema", "device-only"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device_index = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    model = torch.nn.Linear(WIDTH, WIDTH, bias=False, device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    kept = hold_by_rank(args.mode, model)
    data = TensorDataset(torch.randn(10 * args.steps, WIDTH))
    sampler = DistributedSampler(data, rank=dist.get_rank(), shuffle=False)
    for (batch,) in DataLoader(data, batch_size=2, sampler=sampler):
        model(batch.to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    del kept


def hold_by_rank(mode: str, model: torch.nn.Module) -> object:
    if mode == "last-extra":
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == world - 1:
            # the rank as a device index: what the tracer hands the program's get_rank() must pass as one
            return torch.empty(32 * MIB, dtype=torch.uint8, device=rank % torch.cuda.device_count())
    if mode == "rank0-ema":
        rank = int(os.environ["RANK"])
        ema = [p.detach().clone() for p in model.parameters()] if rank == 0 else []
        dist.barrier()
        return ema
    return None


if __name__ == "__main__":
    main()
