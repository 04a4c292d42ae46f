"""accelerate's Accelerator with a DeepSpeedPlugin, used directly (no Trainer), launched by torchrun: the MLP of
deepspeed_zero.py (Linear(256, 512) -> ReLU -> Linear(512, 16)), a torch AdamW the program makes itself (DeepSpeed
wraps it as its client optimizer), bf16, a micro batch of 8; `accelerator.backward` and `optimizer.step`, 3 steps.
--stage 1|2|3 (argv), or --from-launcher: no plugin made here, the DeepSpeed settings are the ones `accelerate launch
--use_deepspeed --zero_stage N ...` hands the program (read by Accelerator() from its variables), the micro batch set
on its plugin as accelerate's docs say for a program without a dataloader."""
import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--from-launcher", action="store_true")
args = parser.parse_args()

if args.from_launcher:
    accelerator = Accelerator()
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8
else:
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                           "bf16": {"enabled": True}, "zero_optimization": {"stage": args.stage}})
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    loss = model(torch.randn(8, 256, device=accelerator.device, dtype=torch.bfloat16)).float().sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
