"""The reference transformer training job of the xMem measurements, re-created exactly (synthetic wikitext batches).

One script serves both sides of the benchmark: `scripts/measure_gpu.py` runs it on a real GPU, and
`xmem-slurm estimate -- python benchmarks/jobs/transformer.py ...` estimates it unchanged. What it keeps identical to
the measured jobs (see /work/shared/notes/reference-measurements.md): the model randomly initialised from its
published configuration (fp32, the library's default attention), batches of `input_ids`, `attention_mask` and
`labels` (int64, sequence length 128, as `DataCollatorForLanguageModeling(mlm=False)` yields), the optimizer built on
the CPU parameters *before* `model.to`, lr 1e-3, StepLR(7, 0.1) stepped every iteration, the zero_grad position,
4 iterations, and the loop order. The configurations are in `benchmarks/data/hf-configs/` (no model hub needed).

    python benchmarks/jobs/transformer.py --model EleutherAI/gpt-neo-125M --optimizer AdamW --batch-size 20
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

CONFIG_DIR = Path(__file__).resolve().parent.parent / "data" / "hf-configs"
SEQUENCE_LENGTH = 128  # wikitext rows truncated at 128 tokens; a batch of 5+ rows almost always has one that long
OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adafactor")


def config_path(model_id: str, config_dir: Path = CONFIG_DIR) -> Path:
    return config_dir / (model_id.replace("/", "--") + ".json")


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The measured jobs ran transformers 4.51.3, whose T5 had only its own eager attention (scores, softmax and dropout
# kept for backward); newer releases give T5 SDPA, which keeps none of them. Other families: the library default.
ATTENTION_AS_MEASURED = {"t5": "eager"}
# from_config's dtype keyword: `torch_dtype` up to transformers 4.55 (the measured jobs ran 4.51.3), `dtype` since.
DTYPE_KEYWORD = "dtype" if tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"


def build_model(model_id: str, config_dir: Path = CONFIG_DIR, dtype: str = "float32",
                attention: str | None = None) -> torch.nn.Module:
    path = config_path(model_id, config_dir)
    if not path.is_file():
        known = sorted(p.stem.replace("--", "/") for p in config_dir.glob("*.json"))
        raise SystemExit(f"transformer.py: no configuration {path}; known models: {', '.join(known)}")
    config = AutoConfig.for_model(**json.loads(path.read_text()))
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    attention = attention or ATTENTION_AS_MEASURED.get(config.model_type)
    extra = {"attn_implementation": attention} if attention else {}
    extra[DTYPE_KEYWORD] = DTYPES[dtype]
    return auto.from_config(config, **extra)


def build_optimizer(name: str, params, fused: bool = False) -> torch.optim.Optimizer:
    if name == "Adafactor":
        return transformers.Adafactor(params, lr=1e-3, relative_step=False)
    # fused=True only when asked: the measured jobs used torch's default (foreach on CUDA)
    extra = {"fused": True} if fused else {}
    return getattr(torch.optim, name)(params, lr=1e-3, **extra)


def synthetic_batch(batch_size: int, vocab_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """What the language-modelling collator yields for a batch whose longest row has `seq_len` tokens."""
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), dtype=torch.int64)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.int64),
        "labels": input_ids.clone(),
    }


def train(model_id: str, optimizer_name: str, batch_size: int, zero_grad_mode: int, iterations: int,
          device: str, seq_len: int = SEQUENCE_LENGTH, dtype: str = "float32", amp: str = "none",
          fused: bool = False, attention: str | None = None) -> None:
    model = build_model(model_id, dtype=dtype, attention=attention)
    optimizer = build_optimizer(optimizer_name, model.parameters(), fused)  # on the CPU parameters, as measured
    model.to(device)
    model.train()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.1)
    for _ in range(iterations):
        if zero_grad_mode == 0:
            optimizer.zero_grad()
        batch = {k: v.to(device) for k, v in synthetic_batch(batch_size, model.config.vocab_size, seq_len).items()}
        with autocast(device, amp):
            out = model(**batch)
        if zero_grad_mode == 1:
            optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if zero_grad_mode == 2:
            optimizer.zero_grad()
        scheduler.step()


def autocast(device: str, amp: str) -> torch.autocast:
    """Mixed precision for the modern variants; "none" (the measured jobs) is a disabled autocast."""
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp, torch.float32)
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype, enabled=amp != "none")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model id as in the data, e.g. EleutherAI/gpt-neo-125M")
    parser.add_argument("--optimizer", required=True, choices=OPTIMIZERS)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--zero-grad-mode", type=int, default=1, choices=(0, 1, 2),
                        help="0: start of the iteration, 1: just before backward, 2: after optimizer.step()")
    parser.add_argument("--seq-len", type=int, default=SEQUENCE_LENGTH)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="model weights (modern variants)")
    parser.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"), help="autocast (modern variants)")
    parser.add_argument("--fused", action="store_true", help="fused optimizer (modern variants)")
    parser.add_argument("--attention", help="attn_implementation (default: as in the measured jobs)")
    args = parser.parse_args(argv)
    train(args.model, args.optimizer, args.batch_size, args.zero_grad_mode, args.iterations, args.device,
          args.seq_len, args.dtype, args.amp, args.fused, args.attention)


if __name__ == "__main__":
    main()
