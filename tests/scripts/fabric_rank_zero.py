"""Lightning Fabric (DDP over --devices, Fabric launching the other ranks itself) where the main process alone
keeps an EMA copy of the weights, tested by `fabric.is_global_zero` (tests/trace/child/test_rank_reads.py): a
bias-free 2048 x 2048 fp32 layer, so rank 0 holds 16 MiB more than the others, all along."""
import argparse

import lightning as L
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy="ddp")
    fabric.launch()
    model = torch.nn.Linear(2048, 2048, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    ema = [p.detach().clone() for p in model.parameters()] if fabric.is_global_zero else []
    for _ in range(4):
        fabric.backward(model(torch.randn(4, 2048, device=fabric.device)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    del ema


if __name__ == "__main__":
    main()
