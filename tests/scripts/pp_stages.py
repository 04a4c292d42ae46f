"""Pipeline parallelism with torch.distributed.pipelining, launched by torchrun (one stage per rank): a small
language model (token embedding, `--layers` feed-forward blocks with a residual, a final LayerNorm and an output
head) built whole on the host, each rank keeping its stage's part as torchtitan splits a model: the first stage
holds the embedding, the last the norm and the head, the blocks are dealt out evenly. `--schedule` gpipe or 1f1b;
`--microbatches` per step; `--static 1` gives the stage its input and output shapes (PipelineStage's
`input_args`/`output_args`) instead of leaving them to shape inference. AdamW over the stage's parameters.
`--print-stage-bytes 1` prints each stage's parameter bytes as built on the host, one 'stage S BYTES' line each,
without tracing anything (what the tests compare the trace with)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--dim", type=int, default=128)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--static", type=int, default=0)
parser.add_argument("--print-stage-bytes", type=int, default=0)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(args.dim, args.hidden), nn.Linear(args.hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stage(nn.Module):
    """The part of the model one stage holds: the embedding on the first, the norm and head on the last."""

    def __init__(self, index: int, stages: int) -> None:
        super().__init__()
        per_stage = args.layers // stages
        self.tok = nn.Embedding(args.vocab, args.dim) if index == 0 else None
        self.blocks = nn.ModuleList(Block() for _ in range(per_stage))
        last = index == stages - 1
        self.norm = nn.LayerNorm(args.dim) if last else None
        self.head = nn.Linear(args.dim, args.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.print_stage_bytes:
        for index in range(world):
            print(f"stage {index} {stage_bytes(Stage(index, world))}")
        return
    dist.init_process_group("nccl")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    module = Stage(rank, world).to(device)
    micro = args.batch // args.microbatches
    first, last = rank == 0, rank == world - 1
    static = {}
    if args.static:
        # activations between stages require grad: their gradients travel back (upstream derives the gradients'
        # shapes from these)
        inputs = (torch.zeros(micro, args.seq, dtype=torch.long, device=device) if first
                  else torch.empty(micro, args.seq, args.dim, device=device, requires_grad=True))
        outputs = torch.empty(micro, args.seq, args.vocab if last else args.dim, device=device, requires_grad=True)
        static = {"input_args": inputs, "output_args": outputs}
    stage = PipelineStage(module, rank, world, device, **static)
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        optimizer.zero_grad()
        if first:
            schedule.step(tokens)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=tokens, losses=losses)
        else:
            schedule.step()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
