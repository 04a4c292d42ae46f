"""Async tensor parallelism's first step (launched by torchrun, or alone as a world of one): symmetric memory enabled for the TP group and a
buffer allocated in it (torch.distributed._symmetric_memory.empty + rendezvous), as async TP's fused
all-gather-matmul does for its peer-to-peer buffers; then a tiny training step."""
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("tp",))
group = mesh.get_group()
symm_mem.enable_symm_mem_for_group(group.group_name)
buffer = symm_mem.empty(4096, device="cuda")
handle = symm_mem.rendezvous(buffer, group)
model = torch.nn.Linear(64, 64).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
