"""Lightning Fabric's ModelParallelStrategy with FSDP2: a parallelize_fn that calls fully_shard on each block and on
the model, with a bf16 MixedPrecisionPolicy (gradients reduced in fp32); the model built on the meta device by
`fabric.init_module(empty_init=True)` and materialised sharded by `fabric.setup`. `python fabric_fsdp2.py
--devices N`: Fabric launches the other ranks itself."""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WIDTH, CLASSES = 256, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Classifier(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(model: Classifier, device_mesh) -> Classifier:
    mesh = device_mesh["data_parallel"]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root unit holds the head
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=args.devices,
                                     tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Classifier()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(args.steps):
        inputs = torch.randn(64, WIDTH, device=fabric.device)
        targets = torch.randint(0, CLASSES, (64,), device=fabric.device)
        loss = F.cross_entropy(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            fabric.print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
