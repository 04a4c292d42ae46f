"""PEFT LoRA on a small Llama saved locally and loaded back in bf16 with `device_map` (the base is frozen), trained
with a hand-written loop: AdamW over the adapters, a warmup schedule, gradient clipping (corpus program)."""
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

VOCAB, SEQ = 128, 32
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def build_base() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def build_model(base: LlamaForCausalLM):
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))


def main():
    checkpoint = tempfile.mkdtemp(prefix="tiny-llama-")
    build_base().save_pretrained(checkpoint)  # a local checkpoint, as a downloaded model would be
    base = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda")
    model = build_model(base)
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    model.train()
    for step in range(10):
        ids = torch.randint(0, VOCAB, (4, SEQ), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f} lr {schedule.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
