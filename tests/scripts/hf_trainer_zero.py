"""The Hugging Face Trainer with a DeepSpeed ZeRO config dict (through accelerate), launched by torchrun: a 2-layer
GPT-2 of width 128 and a 1000-token vocabulary, built from its config, bf16, AdamW named by the DeepSpeed config
(the Trainer hands DeepSpeed an accelerate DummyOptim), 2 steps of 4 random sequences of 32 tokens.
--stage 1|2|3 (argv)."""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
args = parser.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        tokens = torch.randint(0, 1000, (32,))
        return {"input_ids": tokens, "labels": tokens}


model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))
zero = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": args.stage}}
arguments = TrainingArguments(output_dir="hf-zero-out", per_device_train_batch_size=4, max_steps=2, bf16=True,
                              deepspeed=zero, report_to=[], save_strategy="no")
Trainer(model=model, args=arguments, train_dataset=RandomTokens()).train()
