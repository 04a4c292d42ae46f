"""A Llama-style decoder with grouped-query attention (32 query heads, 4 key/value heads), bf16 weights, AdamW,
trained on random token batches: the shape of nearly every LLM trained today. The default is a 1.1B-parameter
model (hidden 2048, 22 layers, MLP 5632, vocab 32000) at batch 4 x 2048; transformers' SDPA attention passes
enable_gqa=True when there is no padding mask, so the GPU runs a fused kernel (cuDNN attention on H100/B200 with
torch 2.14, flash elsewhere) and never holds B x H x T x T scores.

    xmem-slurm estimate --gpu h100 --json -- python benchmarks/jobs/llama_gqa.py
    python benchmarks/jobs/llama_gqa.py --layers 2 --batch-size 1 --seq 256   # small, for tests
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=22)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

config = LlamaConfig(hidden_size=2048, num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632, vocab_size=32000, max_position_embeddings=max(2048, args.seq),
                     attn_implementation="sdpa")
torch.set_default_dtype(torch.bfloat16)  # bf16 weights, built where they train
with torch.device("cuda"):
    model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
