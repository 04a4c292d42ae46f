"""A training step that fails in one of four ways (argv[1]): "shape" (the program's own mistake, which a GPU
refuses too, in code that also logged a GPU value), "storage" (it reads a GPU tensor's storage, which the fake GPU
does not hold), "driver" (it loads the CUDA driver itself, as a library with its own ctypes binding does), "check"
(it checks a shuffled batch's values on the GPU against the order it expects, which holds on a GPU)."""
import ctypes
import sys

import torch

model = torch.nn.Linear(16, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batch = torch.randn(8, 12 if sys.argv[1] == "shape" else 16, device="cuda")
print("batch mean", batch.mean().item())  # a logged value: a stand-in under the fake GPU
if sys.argv[1] == "check":
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist()
    # computed on the GPU with its data (an order copied alone keeps its real values: known_values.py)
    shuffled = torch.tensor(order).cuda() + (batch.sum() * 0).long()
    assert shuffled.tolist() == order, "wrong shuffled batch"
if sys.argv[1] == "storage":
    print("first weight", model.weight.untyped_storage().tolist()[:1])
if sys.argv[1] == "driver":
    ctypes.CDLL("libcuda.so.1").cuInit(0)
model(batch).sum().backward()
optimizer.step()
