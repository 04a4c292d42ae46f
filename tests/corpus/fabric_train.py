"""Lightning `Fabric` on one or more GPUs (`--devices N`, DDP when more than one), bf16-mixed, with a torchmetrics
metric and a DistributedSampler set up by Fabric (corpus program)."""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 48, 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 192), nn.ReLU(), nn.Linear(192, 192), nn.ReLU(), nn.Linear(192, CLASSES))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(512, FEATURES)
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x.argmax(1) % CLASSES), batch_size=32, shuffle=True))
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES).to(fabric.device)
    for step, (inputs, targets) in enumerate(data):
        logits = model(inputs)
        loss = F.cross_entropy(logits, targets)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        accuracy(logits, targets)
        fabric.print(f"step {step} loss {loss:.4f} acc {accuracy.compute():.3f}")
        if step == 5:
            break


if __name__ == "__main__":
    main()
