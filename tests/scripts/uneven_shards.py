"""FSDP2 over a layer whose dim 0 (1021 rows) does not divide by the world size (tests/trace/child/
test_rank_reads.py): fully_shard cuts it in torch.chunk's way, so under torchrun with 4 ranks ranks 0-2 hold 256 rows
and rank 3 the remaining 253. The program never tests its rank; the rank comes from the launcher only."""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

ROWS, WIDTH = 1021, 512

dist.init_process_group("nccl")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
model = torch.nn.Linear(WIDTH, ROWS, device=device)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
for step in range(4):
    model(torch.randn(8, WIDTH, device=device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
