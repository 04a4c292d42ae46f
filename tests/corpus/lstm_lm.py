"""Word-level LSTM language model in the classic style: embedding, 2-layer cuDNN LSTM with dropout, tied decoder,
truncated BPTT with the hidden state detached between batches, gradient clipping, plain SGD: by hand on each
parameter as the classic example does (`--update by-hand`), or torch.optim.SGD (corpus program)."""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, EMBED, BPTT, BATCH = 1000, 128, 35, 20


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, EMBED)
        self.rnn = nn.LSTM(EMBED, EMBED, num_layers=2, dropout=0.2)
        self.decoder = nn.Linear(EMBED, VOCAB)
        self.decoder.weight = self.encoder.weight  # tied weights: one parameter for both

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, batch: int):
        weight = next(self.parameters())
        return (weight.new_zeros(2, batch, EMBED), weight.new_zeros(2, batch, EMBED))


def build_model() -> nn.Module:
    return RNNModel()


def batchify(stream: torch.Tensor, batch: int) -> torch.Tensor:
    columns = stream.size(0) // batch
    return stream[:columns * batch].view(batch, -1).t().contiguous()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--update", choices=["by-hand", "sgd"], default="by-hand")
    args = parser.parse_args()
    device = torch.device("cuda")
    corpus = batchify(torch.randint(0, VOCAB, (BATCH * BPTT * 8 + 1,)), BATCH).to(device)
    model = build_model().to(device)
    lr = 20.0
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if args.update == "sgd" else None
    hidden = model.init_hidden(BATCH)
    model.train()
    for batch, i in enumerate(range(0, corpus.size(0) - 1, BPTT)):
        length = min(BPTT, corpus.size(0) - 1 - i)
        data, targets = corpus[i:i + length], corpus[i + 1:i + 1 + length].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = F.cross_entropy(output.view(-1, VOCAB), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        if optimizer is not None:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        print(f"| batch {batch:3d} | lr {lr:.2f} | loss {loss.item():5.2f} | ppl {math.exp(loss.item()):8.2f}")


if __name__ == "__main__":
    main()
