"""An example-style ImageNet loop: a dataset of 1,281,167 items sampled by a RandomSampler through a DataLoader,
AverageMeter/ProgressMeter that format tensors (`f"{loss:.4f}"`), top-k accuracy from `topk`, SGD with momentum and
a StepLR schedule (corpus program)."""
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

IMAGENET_TRAIN_IMAGES, CLASSES, IMAGE = 1_281_167, 1000, 32


class SyntheticImages(Dataset):
    """Stands in for ImageFolder: one small random image per index, made on demand."""

    def __len__(self):
        return IMAGENET_TRAIN_IMAGES

    def __getitem__(self, index):
        return torch.randn(3, IMAGE, IMAGE), index % CLASSES


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES))


class AverageMeter:
    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


def accuracy(output, target, topk=(1, 5)):
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0)) for k in topk]


def main():
    loader = DataLoader(SyntheticImages(), batch_size=32, sampler=RandomSampler(SyntheticImages()), num_workers=0,
                        pin_memory=True)
    model = build_model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    batch_time, losses, top1, top5 = (AverageMeter("Time", ":6.3f"), AverageMeter("Loss", ":.4e"),
                                      AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f"))
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        output = model(images)
        loss = F.cross_entropy(output, target)
        acc1, acc5 = accuracy(output, target)
        losses.update(loss, images.size(0))  # a tensor: formatted by AverageMeter.__str__
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        print(f"Epoch: [0][{i}/{len(loader)}]\t{batch_time}\t{losses}\t{top1}\t{top5}\tloss {loss:.4f}")
        if i == 5:
            break
    schedule.step()


if __name__ == "__main__":
    main()
