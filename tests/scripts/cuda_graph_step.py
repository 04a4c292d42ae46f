"""A whole training step captured into one CUDA graph and replayed, as torch's CUDA graphs notes show it: warm-up
steps on a side stream, capture of forward, backward and SGD step, then replays on fresh inputs copied into the
static input (a valid GPU script)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--replays", type=int, default=5)
args = parser.parse_args()

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
static_x = torch.randn(64, 256, device="cuda")

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        model(static_x).sum().backward()
        optimizer.step()
torch.cuda.current_stream().wait_stream(side)

graph = torch.cuda.CUDAGraph()
optimizer.zero_grad(set_to_none=True)
with torch.cuda.graph(graph):
    static_loss = model(static_x).sum()
    static_loss.backward()
    optimizer.step()

for _ in range(args.replays):
    static_x.copy_(torch.randn(64, 256, device="cuda"))
    graph.replay()
print("loss", static_loss.item())
