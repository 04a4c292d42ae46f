"""HF `accelerate` loop: `Accelerator(mixed_precision="bf16")` prepares a small transformer encoder classifier, its
AdamW optimizer, a DataLoader and a scheduler; `accelerator.backward`, gradient clipping (corpus program)."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, CLASSES = 200, 24, 3


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(64, CLASSES)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def build_model() -> nn.Module:
    return EncoderClassifier()


def main():
    accelerator = Accelerator(mixed_precision="bf16")
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    ids = torch.randint(0, VOCAB, (128, SEQ))
    data = DataLoader(TensorDataset(ids, ids[:, 0] % CLASSES), batch_size=16, shuffle=True)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    model, optimizer, data, schedule = accelerator.prepare(model, optimizer, data, schedule)
    model.train()
    for step, (inputs, labels) in enumerate(data):
        loss = F.cross_entropy(model(inputs), labels)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {accelerator.gather(loss).mean().item():.4f}")


if __name__ == "__main__":
    main()
