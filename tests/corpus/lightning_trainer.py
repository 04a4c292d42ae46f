"""Lightning `Trainer` on one GPU with bf16-mixed precision: a LightningModule classifier that logs a torchmetrics
accuracy, trained with Adam for a few steps, with a validation loop (corpus program)."""
import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 32, 5


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, CLASSES))


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = build_model()
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_accuracy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_accuracy, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_accuracy(self.net(x), y)
        self.log("val_acc", self.val_accuracy)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader(n: int, shuffle: bool) -> DataLoader:
    x = torch.randn(n, FEATURES)
    return DataLoader(TensorDataset(x, (x.sum(1) > 0).long() % CLASSES), batch_size=16, shuffle=shuffle)


def main():
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, val_check_interval=2,
                        limit_val_batches=2, logger=False, enable_checkpointing=False, enable_model_summary=True)
    trainer.fit(Classifier(), loader(256, True), loader(64, False))


if __name__ == "__main__":
    main()
