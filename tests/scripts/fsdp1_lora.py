"""FSDP1 (FullyShardedDataParallel) fine-tuning of LoRA-like adapters, launched by torchrun: two blocks, each a
frozen base Linear(256, 256) with a trainable rank-8 adapter beside it (down 256->8, up 8->256, no bias), each block
one FSDP unit (frozen and trainable mixed in it), the root unit holding a head Linear(256, 16). AdamW
steps the trainable parameters only. Options (argv): --orig 0|1 (use_orig_params), --strategy FULL_SHARD |
SHARD_GRAD_OP | NO_SHARD, --mp none|bf16 (MixedPrecision: bf16 params, fp32 or bf16 reduce by --reduce),
--frozen base|none|base+head: what is frozen (none: a full fine-tune, as use_orig_params=False refuses a unit that
mixes; base+head: all but the adapters, as peft's get_peft_model leaves it, so the root unit has no gradient),
--offload 1: CPUOffload(offload_params=True), the model left on the host as upstream requires then; --blocks N (2),
--forward-prefetch 0|1, --backward-prefetch PRE|POST|NONE (BACKWARD_PRE, FSDP's default), --limit 1|0
(limit_all_gathers, default on), --buffers 1: each block scales its output by an fp32 buffer of WIDTH elements (with
--mp bf16, MixedPrecision's buffer_dtype is bf16)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

WIDTH, RANK, CLASSES = 256, 8, 16


class Adapted(nn.Module):
    """A frozen base layer and a low-rank update beside it, registered base first (as peft's LoRA layers are)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, WIDTH, bias=False)
        self.base.requires_grad_("base" not in FROZEN)
        if BUFFERS:
            self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.base(x) + self.up(self.down(x)))
        return out * self.scale if BUFFERS else out


parser = argparse.ArgumentParser()
parser.add_argument("--orig", type=int, default=1)
parser.add_argument("--strategy", default="FULL_SHARD")
parser.add_argument("--mp", default="none")
parser.add_argument("--reduce", default="fp32")
parser.add_argument("--frozen", default="base")
parser.add_argument("--offload", type=int, default=0)
parser.add_argument("--blocks", type=int, default=2)
parser.add_argument("--forward-prefetch", type=int, default=0)
parser.add_argument("--backward-prefetch", default="PRE")
parser.add_argument("--limit", type=int, default=1)
parser.add_argument("--buffers", type=int, default=0)
args = parser.parse_args()
FROZEN, BUFFERS = args.frozen, bool(args.buffers)

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.Sequential(*(Adapted() for _ in range(args.blocks)),
                      nn.Linear(WIDTH, CLASSES).requires_grad_("head" not in FROZEN))
model = model if args.offload else model.cuda()
precision = None
if args.mp == "bf16":
    precision = MixedPrecision(param_dtype=torch.bfloat16,
                               reduce_dtype=torch.float32 if args.reduce == "fp32" else torch.bfloat16,
                               buffer_dtype=torch.bfloat16 if BUFFERS else None)
model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Adapted}), use_orig_params=bool(args.orig),
             sharding_strategy=ShardingStrategy[args.strategy], mixed_precision=precision,
             device_id=torch.cuda.current_device() if args.offload else None,
             cpu_offload=CPUOffload(offload_params=bool(args.offload)), forward_prefetch=bool(args.forward_prefetch),
             backward_prefetch=getattr(BackwardPrefetch, f"BACKWARD_{args.backward_prefetch}", None),
             limit_all_gathers=bool(args.limit))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for step in range(3):
    model(torch.randn(8, WIDTH, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
