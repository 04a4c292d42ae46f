"""A tiny Llama (transformers, built from its config) fine-tuned with AdamW: fully, or with LoRA adapters (peft)
on the attention's q/v projections, with or without HF gradient checkpointing (its default, or reentrant) (a valid
GPU script)."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--lora", action="store_true")
parser.add_argument("--checkpointing", choices=["off", "default", "reentrant"], default="off")
args = parser.parse_args()

config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=128, vocab_size=100, max_position_embeddings=64)
model = LlamaForCausalLM(config)
if args.lora:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
model = model.cuda()
if args.checkpointing != "off":
    kwargs = {"use_reentrant": True} if args.checkpointing == "reentrant" else None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for step in range(5):
    ids = torch.randint(0, 100, (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
