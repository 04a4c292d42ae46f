"""HF `Trainer` fine-tuning a small Llama built from its config: bf16, gradient checkpointing, gradient accumulation,
AdamW (the Trainer's default), output in a temporary directory, no reporting integrations (corpus program)."""
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 128, 32


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


class RandomTokens(Dataset):
    """Token sequences drawn once on the host, as a tokenized dataset would hold them."""

    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf-trainer-"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, gradient_checkpointing=True, bf16=True, max_steps=3,
                             learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[])
    trainer = Trainer(model=build_model(), args=args, train_dataset=RandomTokens(64))
    result = trainer.train()
    print(f"train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
