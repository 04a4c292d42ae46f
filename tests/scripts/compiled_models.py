"""Small models trained eagerly or compiled, for tests/trace/child/test_compiled.py.

--model swish: Linear(256 -> 1024) -> x * sigmoid(x) * 2 + 1 -> Linear(1024 -> 256), a batch of 16384 (fp32).
--model block: a pre-norm transformer block (RMSNorm, causal softmax attention written out, SwiGLU MLP), dim 256,
  4 heads, sequence 512, batch 8 (fp32).
--compile: none | module (torch.compile(model)) | method (model.compile()) | function (a compiled train step's
  forward and loss) | backend (torch.compile(model, backend=<a function of the program's>)).
--mode: torch.compile's mode for --compile module (reduce-overhead: CUDA graph trees).
--graph-break: the block's forward breaks the graph between attention and MLP (torch._dynamo.graph_break()).
--batches: the batch's first dimension at each step, comma-separated (instead of --steps steps of the default).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("swish", "block"), default="swish")
parser.add_argument("--compile", choices=("none", "module", "method", "function", "backend"), default="none")
parser.add_argument("--graph-break", action="store_true")
parser.add_argument("--mode", default=None, help="torch.compile's mode (reduce-overhead: Inductor's CUDA graph trees)")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batches", default=None)
args = parser.parse_args()


class Swish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 1024, bias=False)
        self.down = nn.Linear(1024, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * torch.sigmoid(h) * 2.0 + 1.0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Block(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, hidden: int = 768) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.Parameter(torch.ones(dim))
        self.norm2 = nn.Parameter(torch.ones(dim))
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (dim // self.heads) ** 0.5
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, seq, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(rms_norm(x, self.norm1))
        if args.graph_break:
            torch._dynamo.graph_break()
        h = rms_norm(x, self.norm2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def backend_of_the_program(graph: torch.fx.GraphModule, example_inputs: list) -> object:
    return graph.forward


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


model = (Swish() if args.model == "swish" else Block()).cuda()
run = model
loss_fn = loss_of
if args.compile == "module":
    run = torch.compile(model, mode=args.mode)
elif args.compile == "method":
    model.compile()
elif args.compile == "function":
    loss_fn = torch.compile(loss_of)
elif args.compile == "backend":
    run = torch.compile(model, backend=backend_of_the_program)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
shape = (16384, 256) if args.model == "swish" else (8, 512, 256)
shapes = [(int(rows), *shape[1:]) for rows in args.batches.split(",")] if args.batches else [shape] * args.steps
for shape in shapes:
    batch = torch.randn(*shape, device="cuda")
    loss_fn(run, batch).backward()
    optimizer.step()
    optimizer.zero_grad()
