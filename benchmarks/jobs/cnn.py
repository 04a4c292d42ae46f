"""The reference CNN training job of the xMem measurements, re-created exactly (synthetic CIFAR-10 data).

One script serves both sides of the benchmark: `scripts/measure_gpu.py` runs it on a real GPU, and
`xmem-slurm estimate -- python benchmarks/jobs/cnn.py ...` estimates it unchanged. What it must keep identical to the
measured jobs (see /work/shared/notes/reference-measurements.md): the model (torchvision, weights=None), the input
shapes and dtypes (fp32 [B,3,86,86], int64 labels in 0..9), the optimizer built after `model.to`, lr 1e-3 with torch
defaults, StepLR(7, 0.1) stepped every iteration, the zero_grad position, 4 iterations, and the loop order.

    python benchmarks/jobs/cnn.py --model ConvNeXtTiny --optimizer AdamW --batch-size 300 --zero-grad-mode 1
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.models.mobilenetv3 import _mobilenet_v3_conf

IMAGE_SIZE = 86  # CIFAR-10 resized to 86x86 in the measured jobs
CIFAR_CLASSES = 10
OPTIMIZERS = ("SGD", "Adam", "RMSprop", "Adagrad", "AdamW")


def _mobilenet_v3(arch: str) -> nn.Module:
    # The data's "MobeNetV3Small/Large": the standard inverted-residual settings, width 1.0, a 10-class head.
    settings, last_channel = _mobilenet_v3_conf(arch)
    return torchvision.models.MobileNetV3(settings, last_channel, num_classes=CIFAR_CLASSES)


# Model names as the data spells them, normalised (lower case, letters and digits only).
MODELS = {
    "vgg16": partial(torchvision.models.vgg16, weights=None),
    "vgg19": partial(torchvision.models.vgg19, weights=None),
    "resnet101": partial(torchvision.models.resnet101, weights=None),
    "resnet152": partial(torchvision.models.resnet152, weights=None),
    "mobilenetv2": partial(torchvision.models.mobilenet_v2, weights=None),
    "convnexttiny": partial(torchvision.models.convnext_tiny, weights=None),
    "convnextbase": partial(torchvision.models.convnext_base, weights=None),
    "regnetx400mf": partial(torchvision.models.regnet_x_400mf, weights=None),
    "regnety400mf": partial(torchvision.models.regnet_y_400mf, weights=None),
    "mobenetv3small": partial(_mobilenet_v3, "mobilenet_v3_small"),
    "mobenetv3large": partial(_mobilenet_v3, "mobilenet_v3_large"),
    "mnasnet": partial(torchvision.models.MNASNet, alpha=1.0, num_classes=CIFAR_CLASSES),
}


def model_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def build_model(name: str) -> nn.Module:
    key = model_key(name)
    if key not in MODELS:
        raise SystemExit(f"cnn.py: unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]()


class SyntheticCifar(Dataset):
    """Stands in for CIFAR-10 train after Resize(86), ToTensor, Normalize: same shapes and dtypes, no download."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.randn(3, IMAGE_SIZE, IMAGE_SIZE), index % CIFAR_CLASSES


def build_optimizer(name: str, params, fused: bool = False) -> torch.optim.Optimizer:
    # fused=True only when asked: the measured jobs used torch's default (foreach on CUDA)
    extra = {"fused": True} if fused else {}
    return getattr(torch.optim, name)(params, lr=1e-3, **extra)


def train(model_name: str, optimizer_name: str, batch_size: int, zero_grad_mode: int, iterations: int,
          device: str, amp: str = "none", fused: bool = False) -> None:
    model = build_model(model_name)
    model.to(device)
    model.train()
    optimizer = build_optimizer(optimizer_name, model.parameters(), fused)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.1)
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(SyntheticCifar(batch_size * iterations), batch_size=batch_size, shuffle=True)
    for iteration, (inputs, labels) in enumerate(loader):
        if iteration >= iterations:
            break
        if zero_grad_mode == 0:
            optimizer.zero_grad()
        inputs, labels = inputs.to(device), labels.to(device)
        with autocast(device, amp):
            outputs = model(inputs)
            loss = criterion(outputs, labels)
        if zero_grad_mode == 1:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.max(outputs, 1)
        if zero_grad_mode == 2:
            optimizer.zero_grad()
        scheduler.step()


def autocast(device: str, amp: str) -> torch.autocast:
    """Mixed precision for the modern variants; "none" (the measured jobs) is a disabled autocast."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp, torch.float32)
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=amp != "none")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="as the data spells it, e.g. ConvNeXtTiny, MnasNet, vgg16")
    parser.add_argument("--optimizer", required=True, choices=OPTIMIZERS)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--zero-grad-mode", type=int, default=1, choices=(0, 1, 2),
                        help="0: start of the iteration, 1: just before backward, 2: after optimizer.step()")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"), help="autocast (modern variants)")
    parser.add_argument("--fused", action="store_true", help="fused optimizer (modern variants)")
    args = parser.parse_args(argv)
    train(args.model, args.optimizer, args.batch_size, args.zero_grad_mode, args.iterations, args.device,
          args.amp, args.fused)


if __name__ == "__main__":
    main()
