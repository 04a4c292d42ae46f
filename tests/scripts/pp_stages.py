"""Pipeline parallelism with torch.distributed.pipelining, launched by torchrun (one stage per rank): a small
language model (token embedding, `--layers` feed-forward blocks with a residual, a final LayerNorm and an output
head) built whole on the host, each rank keeping its stage's part as torchtitan splits a model: the first stage
holds the embedding, the last the norm and the head, the blocks are dealt out evenly. `--schedule` gpipe, 1f1b, or
interleaved (ScheduleInterleaved1F1B over `--stages-per-rank` stages a rank, rank r holding stages r, r + P, ...),
or zbv (ScheduleZBVZeroBubble: two stages a rank in a V, rank r holding stages r and 2P - 1 - r);
`--microbatches` per step; `--grow N` widens the activation by N after each stage (a projection ends each stage
but the last); `--dp N`: a (pp, dp) device mesh as torchtitan lays it out, each stage fully_shard'ed over its
"dp" dimension (the world is stages x N; a rank's stage is its "pp" coordinate); `--static 1` gives the stage
its input and output shapes (PipelineStage's `input_args`/`output_args`) instead of leaving them to shape
inference. AdamW over the stage's parameters.
`--print-stage-bytes 1` prints each stage's parameter bytes as built on the host, one 'stage S BYTES' line each,
without tracing anything (what the tests compare the trace with)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, \
    ScheduleZBVZeroBubble

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "zbv"))
parser.add_argument("--stages-per-rank", type=int, default=1)
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--dim", type=int, default=128)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--static", type=int, default=0)
parser.add_argument("--grow", type=int, default=0)
parser.add_argument("--dp", type=int, default=1)
parser.add_argument("--print-stage-bytes", type=int, default=0)
args = parser.parse_args()


def width(index: int) -> int:
    """The width of the activation stage `index` takes."""
    return args.dim + args.grow * index


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, args.hidden), nn.Linear(args.hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stage(nn.Module):
    """The part of the model one stage holds: the embedding on the first, the norm and head on the last."""

    def __init__(self, index: int, stages: int) -> None:
        super().__init__()
        per_stage = args.layers // stages
        dim = width(index)
        self.tok = nn.Embedding(args.vocab, dim) if index == 0 else None
        self.blocks = nn.ModuleList(Block(dim) for _ in range(per_stage))
        last = index == stages - 1
        self.widen = nn.Linear(dim, width(index + 1)) if args.grow and not last else None
        self.norm = nn.LayerNorm(dim) if last else None
        self.head = nn.Linear(dim, args.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for block in self.blocks:
            h = block(h)
        if self.widen is not None:
            h = self.widen(h)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1")) // args.dp  # the pipeline's ranks
    stages = world * args.stages_per_rank
    if args.print_stage_bytes:
        for index in range(stages):
            print(f"stage {index} {stage_bytes(Stage(index, stages))}")
        return
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    group, rank = None, dist.get_rank()
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world, args.dp), mesh_dim_names=("pp", "dp"))
        group, rank = mesh["pp"].get_group(), mesh.get_local_rank("pp")
    own = ([rank, 2 * world - 1 - rank] if args.schedule == "zbv"
           else [rank + world * k for k in range(args.stages_per_rank)])
    modules = [Stage(index, stages).to(device) for index in own]
    if args.dp > 1:
        from torch.distributed.fsdp import fully_shard
        for module in modules:
            fully_shard(module, mesh=mesh["dp"])
    pipeline = [PipelineStage(module, index, stages, device, group=group, **static_shapes(index, stages, device))
                for module, index in zip(modules, own)]
    if args.schedule in ("interleaved", "zbv"):
        kind = ScheduleInterleaved1F1B if args.schedule == "interleaved" else ScheduleZBVZeroBubble
        schedule = kind(pipeline, n_microbatches=args.microbatches, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(pipeline[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for module in modules for p in module.parameters()], lr=1e-4)
    first, last = 0 in own, stages - 1 in own
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        optimizer.zero_grad()
        if first:
            schedule.step(tokens, **({"target": tokens, "losses": []} if last else {}))
        elif last:
            schedule.step(target=tokens, losses=[])
        else:
            schedule.step()
        optimizer.step()
    dist.destroy_process_group()


def static_shapes(index: int, stages: int, device: torch.device) -> dict[str, torch.Tensor]:
    """With --static 1, stage `index`'s input and output shapes (PipelineStage's input_args, output_args)."""
    if not args.static:
        return {}
    micro = args.batch // args.microbatches
    # activations between stages require grad: their gradients travel back (upstream derives the gradients'
    # shapes from these)
    inputs = (torch.zeros(micro, args.seq, dtype=torch.long, device=device) if index == 0
              else torch.empty(micro, args.seq, width(index), device=device, requires_grad=True))
    out = args.vocab if index == stages - 1 else width(index + 1)
    return {"input_args": inputs, "output_args": torch.empty(micro, args.seq, out, device=device, requires_grad=True)}


if __name__ == "__main__":
    main()
