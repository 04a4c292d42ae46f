"""timm image classifier from scratch: AMP (fp16 autocast + GradScaler), channels_last, SGD with Nesterov momentum,
a cosine schedule, and a validation loop under `torch.no_grad()` that reads accuracy with `.item()` (corpus
program)."""
import timm
import torch
import torch.nn.functional as F

CLASSES, IMAGE = 10, 64


def build_model() -> torch.nn.Module:
    return timm.create_model("resnet18", pretrained=False, num_classes=CLASSES)


def batches(n: int, size: int):
    for _ in range(n):
        yield torch.randn(size, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (size,))


def validate(model) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, targets in batches(2, 16):
            images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
            targets = targets.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                predicted = model(images).argmax(dim=1)
            correct += (predicted == targets).sum().item()
            total += targets.numel()
    model.train()
    return 100.0 * correct / total


def main():
    model = build_model().cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)
    scaler = torch.amp.GradScaler("cuda")
    for step, (images, targets) in enumerate(batches(8, 16)):
        images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
        targets = targets.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(images), targets, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        if step % 2 == 1:
            print(f"step {step} loss {loss.item():.3f} val top-1 {validate(model):.1f}%")


if __name__ == "__main__":
    main()
