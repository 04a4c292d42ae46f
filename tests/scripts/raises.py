"""Fails in the user's own code, in a helper called from the training loop."""
import torch


def load_batch(step):
    raise ValueError(f"dataset shard {step} is missing")


model = torch.nn.Linear(8, 1).cuda()
for step in range(3):
    x = load_batch(step)
