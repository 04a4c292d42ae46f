"""Lightning Fabric's FSDP strategy (FSDP1; Fabric sets use_orig_params=True) fine-tuning LoRA-like adapters, as a
LoRA recipe wraps whole blocks: two blocks, each a frozen base Linear(256, 256) with a trainable rank-8 adapter beside
it (down 256->8, up 8->256, no bias), each block one FSDP unit (auto_wrap_policy={Adapted}: frozen and trainable
mixed in it), the root unit holding a trainable head Linear(256, 16); AdamW over the trainable parameters only, set
up with Fabric. The same model as fsdp1_lora.py. `python fabric_fsdp_lora.py --devices N --precision 32-true |
bf16-mixed | bf16-true [--empty-init 1]` (built under fabric.init_module(empty_init=True): on the meta device, FSDP
materialising it) [--ac 1] (each block checkpointed: activation_checkpointing_policy={Adapted}), Fabric launching
the other ranks itself."""
import argparse

import lightning as L
import torch
import torch.nn as nn
from lightning.fabric.strategies import FSDPStrategy

WIDTH, RANK, CLASSES = 256, 8, 16


class Adapted(nn.Module):
    """A frozen base layer and a low-rank update beside it, registered base first (as peft's LoRA layers are)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.up(self.down(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--empty-init", type=int, default=0)  # built on the meta device, materialised by FSDP
    parser.add_argument("--ac", type=int, default=0)  # activation checkpointing of each block, as LoRA recipes set
    args = parser.parse_args()
    strategy = FSDPStrategy(auto_wrap_policy={Adapted}, activation_checkpointing_policy={Adapted} if args.ac else None)
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=bool(args.empty_init)):
        model = nn.Sequential(Adapted(), Adapted(), nn.Linear(WIDTH, CLASSES))
    for name, param in model.named_parameters():
        param.requires_grad = ".base." not in name  # the adapters and the head train
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                          lr=1e-4))
    for _ in range(args.steps):
        loss = model(torch.randn(8, WIDTH, device=fabric.device)).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
