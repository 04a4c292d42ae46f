"""One model trained three ways, for the breakdown's categories (tests/trace/child/test_categories.py):
`plain` (forward, backward, step), `closure` (the forward and backward inside `optimizer.step(closure)`), and
`lightning` (Lightning's Trainer, whose loop runs the training step in the optimizer's closure). Activations dominate
the peak: a wide batch through a small MLP."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

BATCH, FEATURES, WIDTH = 2048, 256, 1024


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, 10))


def batches(n: int = 4):
    x = torch.randn(n * BATCH, FEATURES)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(n * BATCH, dtype=torch.long)),
                                       batch_size=BATCH)


def by_hand(closure: bool) -> None:
    net = build().cuda()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for x, y in batches():
        x, y = x.cuda(), y.cuda()

        def train_step():
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        if closure:
            optimizer.step(train_step)
        else:
            train_step()
            optimizer.step()


def with_lightning() -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build()

        def training_step(self, batch, index):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    L.Trainer(accelerator="gpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(Module(), batches())


if __name__ == "__main__":
    if sys.argv[1] == "lightning":
        with_lightning()
    else:
        by_hand(closure=sys.argv[1] == "closure")
