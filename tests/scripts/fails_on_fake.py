"""A training step that fails in one of three ways (argv[1]): "shape" (the program's own mistake, which a GPU
refuses too), "storage" (it reads a GPU tensor's storage, which the fake GPU does not hold), "driver" (it loads the
CUDA driver itself, as a library with its own ctypes binding does)."""
import ctypes
import sys

import torch

model = torch.nn.Linear(16, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batch = torch.randn(8, 12 if sys.argv[1] == "shape" else 16, device="cuda")
if sys.argv[1] == "storage":
    print("first weight", model.weight.untyped_storage().tolist()[:1])
if sys.argv[1] == "driver":
    ctypes.CDLL("libcuda.so.1").cuInit(0)
model(batch).sum().backward()
optimizer.step()
