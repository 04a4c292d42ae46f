"""Each step leaves a CUDA tensor in a reference cycle: only Python's cyclic collector frees it, as in a program
whose tensors are held by objects that point at each other (a model's hooks, a closure over itself)."""

import gc

import torch

assert gc.isenabled(), "the program runs with the cyclic collector on, as it would without a tracer"
model = torch.nn.Linear(256, 256).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    node = {"buffer": torch.empty(123_457, dtype=torch.uint8, device="cuda")}
    node["self"] = node  # garbage from the next line on, but not freed until a collection finds it
    del node
    for _ in range(50):  # enough new containers for the collector's first generation to run on its own
        loss = model(torch.randn(8, 256, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
