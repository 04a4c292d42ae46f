"""Tensor parallelism (and 2-D FSDP x TP) as torchtitan lays it out, launched by torchrun, at toy sizes: a token
embedding, one feed-forward block (LayerNorm, w1: Linear(D, H), GELU, w2: Linear(H, D), a residual add), a final
LayerNorm and an output head Linear(D, V, bias=False), trained with AdamW on cross-entropy.

--sp 0: tensor parallelism alone (Megatron style): embedding RowwiseParallel (input Replicate, output Replicate),
        w1 ColwiseParallel, w2 RowwiseParallel, head ColwiseParallel (output Replicate); no LayerNorm (a plain
        parameter beside DTensors would not step in one foreach group).
--sp 1: with sequence parallelism: embedding output Shard(1), the LayerNorms SequenceParallel, the block's input
        gathered by PrepareModuleInput (Shard(1) -> Replicate), w2's output Shard(1), the head's input Shard(1).
--loss-parallel 1: the head's output stays sharded on the vocabulary (Shard(-1), a DTensor) and the cross-entropy
        runs under loss_parallel(), as torchtitan's loss_parallel option does.
--dp N: a 2-D mesh ("dp", "tp") of N x world/N: TP on "tp", then fully_shard on "dp" for the block and the root.
--replicate R: with --dp, a 3-D mesh ("replicate", "dp", "tp") of R x N x world/(R N): fully_shard on the 2-D
        ("replicate", "dp") mesh (HSDP: replicated across R groups, sharded within each), TP on "tp".
--meta 1: built on the meta device and materialised after sharding (to_empty, then reset_parameters), as
        torchtitan initialises: no rank ever holds a whole parameter.
--dropout P: dropout on the sequence-parallel (DTensor) output of the block's norm (SequenceParallel only).
--fake-world N: run alone as rank 0 of a world of N over torch's fake process group (its collectives do nothing;
        every buffer is still allocated), started as `python tp_block.py`: rank 0's memory on one real GPU, for a
        GPU check of the traced figures (the data are meaningless, the allocations are rank 0's).
--checkpoint 1: the block under activation checkpointing (torch.utils.checkpoint, non-reentrant), recomputed in
        backward with its collectives, as torchtitan's full activation checkpointing wraps each block.
--batch, --seq: the token batch (B, S); D, H, V by --dim, --hidden, --vocab.
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

parser = argparse.ArgumentParser()
parser.add_argument("--sp", type=int, default=0)
parser.add_argument("--dp", type=int, default=1)
parser.add_argument("--loss-parallel", type=int, default=0)
parser.add_argument("--meta", type=int, default=0)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--fake-world", type=int, default=0)
parser.add_argument("--replicate", type=int, default=1)
parser.add_argument("--checkpoint", type=int, default=0)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--vocab", type=int, default=512)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.dropout = nn.Dropout(args.dropout)
        self.ffn = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.dropout(self.norm(x)))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, norm: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.block = Block(dim, hidden, norm)
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if args.checkpoint:
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            x = self.block(x)
        return self.head(self.norm(x))


if args.fake_world:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    torch.cuda.set_device(0)
else:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
world = dist.get_world_size()
mesh = init_device_mesh("cuda", (args.replicate, args.dp, world // args.dp // args.replicate),
                        mesh_dim_names=("replicate", "dp", "tp"))
tp = mesh["tp"]
with torch.device("meta" if args.meta else "cuda"):
    model = Model(args.vocab, args.dim, args.hidden, norm=bool(args.sp))
if args.sp:
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "block.norm": SequenceParallel(),
        "block.dropout": SequenceParallel(),
        "block.ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "block.ffn.w1": ColwiseParallel(),
        "block.ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if args.loss_parallel else Replicate(),
                                use_local_output=not args.loss_parallel),
    }
else:
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "block.ffn.w1": ColwiseParallel(),
        "block.ffn.w2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1) if args.loss_parallel else Replicate(),
                                use_local_output=not args.loss_parallel),
    }
parallelize_module(model, tp, plan)
if args.dp > 1:
    from torch.distributed.fsdp import fully_shard
    data_parallel = mesh["replicate", "dp"] if args.replicate > 1 else mesh["dp"]
    fully_shard(model.block, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)
if args.meta:
    model.to_empty(device="cuda")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    logits = model(tokens)
    with loss_parallel() if args.loss_parallel else contextlib.nullcontext():
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
