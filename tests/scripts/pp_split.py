"""Pipeline parallelism by torch.distributed.pipelining's tracing frontend, launched by torchrun with 2 processes:
`pipeline()` splits a two-block model (each block Linear 128->512, GELU, Linear 512->128) at the second block's
start (SplitPoint.BEGINNING), each rank builds its stage (`Pipe.build_stage`: upstream's _PipelineStage, whose
shapes come from the traced graph) and trains it under ScheduleGPipe with 4 microbatches, AdamW."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = block(), block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    batch = torch.randn(8, 64, 128)
    pipe = pipeline(TwoBlocks(), mb_args=(batch.chunk(4)[0],), split_spec={"second": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: (out - target).square().mean())
    optimizer = torch.optim.AdamW(stage.submod.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(batch.to(device))
        else:
            schedule.step(target=torch.zeros(8, 64, 128, device=device))
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
