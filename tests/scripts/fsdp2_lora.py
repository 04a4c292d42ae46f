"""FSDP2 (fully_shard) fine-tuning of LoRA-like adapters, launched by torchrun: two blocks, each a frozen base
Linear(256, 256) with a trainable rank-8 adapter beside it (down 256->8, up 8->256, no bias), each block its own
unit, the root unit holding a head Linear(256, 16). AdamW steps the trainable parameters only. Options (argv):
--mp none|bf16 (MixedPrecisionPolicy: bf16 params, fp32 reduce, or bf16 by --reduce bf16), --frozen base|base+head (base+head: only the
adapters train, as peft's get_peft_model leaves a model, so the root unit has no gradient), --hsdp 1 (HSDP: a 2-D
mesh, replicated across the nodes and sharded within each, as torchrun --nnodes gives them)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WIDTH, RANK, CLASSES = 256, 8, 16


class Adapted(nn.Module):
    """A frozen base layer and a low-rank update beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.up(self.down(x)))


parser = argparse.ArgumentParser()
parser.add_argument("--mp", default="none")
parser.add_argument("--frozen", default="base")
parser.add_argument("--hsdp", type=int, default=0)
parser.add_argument("--reduce", default="fp32")
args = parser.parse_args()

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.Sequential(Adapted(), Adapted(), nn.Linear(WIDTH, CLASSES).requires_grad_("head" not in args.frozen))
model.cuda()
reduce_dtype = torch.bfloat16 if args.reduce == "bf16" else torch.float32
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if args.mp == "bf16" \
    else MixedPrecisionPolicy()
mesh = None
if args.hsdp:
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cuda", (dist.get_world_size() // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))
for block in model[:2]:
    fully_shard(block, mp_policy=policy, mesh=mesh)
fully_shard(model, mp_policy=policy, mesh=mesh)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for step in range(3):
    model(torch.randn(8, WIDTH, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
