"""GPT-2 small (124M) from its config, AdamW, B=8, T=1024 (a valid GPU script; the trace benchmark's workload).
--amp bf16 trains under autocast bf16."""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--amp", choices=["none", "bf16"], default="none")
args = parser.parse_args()

model = GPT2LMHeadModel(GPT2Config()).cuda()
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
for step in range(args.steps):
    ids = torch.randint(0, 50257, (args.batch, args.seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.3f}")
