"""A 7B Llama-shaped model (hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000) from its config, AdamW,
B=1, T=2048, bf16 weights, activation checkpointing (the trace benchmark's large workload; a valid GPU script,
though it needs more than 80 GB). --dtype fp32 keeps fp32 weights; --checkpointing off stores every activation."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
parser.add_argument("--checkpointing", choices=["on", "off"], default="on")
args = parser.parse_args()

config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
model = LlamaForCausalLM(config)  # built on the CPU, as users do
if args.dtype == "bf16":
    model = model.to(torch.bfloat16)
model = model.to("cuda")
if args.checkpointing == "on":
    model.gradient_checkpointing_enable()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(5):
    ids = torch.randint(0, 32000, (1, args.seq)).cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
