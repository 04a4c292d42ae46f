"""Lightning Fabric with its FSDP strategy (FSDP1: the whole model one FullyShardedDataParallel unit, Fabric's
default use_orig_params=True) in bf16-mixed precision, as Fabric's docs write a loop: `python fabric_fsdp.py
--devices N`, Fabric launching the other ranks itself."""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES = 128, 512, 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, FEATURES), nn.LayerNorm(FEATURES),
                         nn.Linear(FEATURES, CLASSES))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy="fsdp", precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(42)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(args.steps):
        inputs = torch.randn(32, FEATURES, device=fabric.device)
        targets = torch.randint(0, CLASSES, (32,), device=fabric.device)
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        fabric.print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
