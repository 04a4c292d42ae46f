"""A Llama fine-tune from a local checkpoint under accelerate's FSDP2 (as the HF Trainer's `--fsdp` and trl's fsdp2
config run it), launched by torchrun: `from_pretrained` in bf16 on the host, an AdamW made on those parameters,
`accelerator.prepare(model, optimizer)` (fp32 master weights, one fully_shard unit per decoder layer), bf16 mixed
precision, 3 steps of one sequence. argv: the checkpoint's folder [--seq N] [--checkpointing] (transformers'
activation checkpointing; scripts/bench_checkpoint.py's 70B case runs it so)."""
import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--checkpointing", action="store_true")
args = parser.parse_args()

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
if args.checkpointing:
    model.gradient_checkpointing_enable()
    model.train()  # from_pretrained gives eval mode, where transformers' checkpointing is off (the Trainer sets it)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    ids = torch.randint(0, 1000, (1, args.seq), device=accelerator.device)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
