"""A tiny Llama (transformers) with gradient checkpointing, bf16 autocast, AdamW (a valid GPU script)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=128, vocab_size=100, max_position_embeddings=64)
model = LlamaForCausalLM(config).cuda()
model.gradient_checkpointing_enable()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(5):
    ids = torch.randint(0, 100, (2, 16)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
