"""Float8 training as torchao converts it: a few bf16 Linear layers swapped to Float8Linear
(torchao.float8.convert_to_float8_training, recipe tensorwise or rowwise), AdamW, eager or compiled (a valid script
on a GPU of compute capability 8.9 or above); --recipe mxfp8: torchao's MXFP8 training instead
(quantize_ with MXFP8TrainingOpConfig: compute capability 10.0 or above)."""
import argparse

import torch
import torch.nn as nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

parser = argparse.ArgumentParser()
parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
parser.add_argument("--compile", action="store_true")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

DIM, HIDDEN, TOKENS = 256, 1024, 512
model = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, DIM, bias=False))
model = model.to(device="cuda", dtype=torch.bfloat16)
if args.recipe == "mxfp8":
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    quantize_(model, MXFP8TrainingOpConfig())
else:
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(args.recipe))
if args.compile:
    model = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
