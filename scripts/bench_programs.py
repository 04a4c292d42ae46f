#!/usr/bin/env python
"""A standing corpus of real programs (issue 20): public training programs that PyPI packages ship in their wheels
(CLIs and recipes), run unmodified under `xmem-slurm estimate`, each answer checked against a plausible range.

    .venv/bin/python scripts/bench_programs.py --setup [--package PKG...]  # the programs' venvs, pinned
    .venv/bin/python scripts/bench_programs.py [--only NAME...] [--package PKG...] [--list] [--out FILE]
                                               [--iterations N] [--timeout S] [--product DIR]
    .venv/bin/python scripts/bench_programs.py --merge RUN.json... --out programs.json --label "DATE COMMIT"

Nothing here is written by the project: each program is what its package installs (`tune run`, `trl sft`,
`litgpt finetune_lora`, `yolo train`, `python -m open_clip_train.main`, ...), started as a user of an activated venv
types it. No hub is reachable, so what a program would download is made first in a temporary folder (never the
user's or the repository's files): tokenizers trained on generated text, models built from configs and saved as the
package's checkpoint format, small generated data sets. The programs' packages live in their own venvs
(`.venv-programs`, and `.venv-programs-PKG` for a package whose pins the others exclude; gitignored; `--setup` makes
them with the pins below and the product's torch), so they never constrain the product's; the estimate runs the
program on its venv's interpreter (`estimate --python`). The audio programs (coqui-tts, f5-tts) need FFmpeg's shared
libraries on the machine (Debian: `apt-get install ffmpeg`), as a GPU node that runs them would: torchaudio 2.11 reads
clips through torchcodec, which loads them.

Each answer (`estimate --json --gpu h100`) is checked against a plausible range: at least the model state of the
same model built on the CPU (its parameters and buffers at the dtype the program trains in; computed in the
programs' venv), at most the GPU's capacity. The report says "N of M answer" and, for each other program, its exit
code and one-line message; `--out` writes the records as JSON (benchmarks/results/programs/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-programs"
OUT_DIR = ROOT / "benchmarks" / "results" / "programs"
GPU = "h100"
GIB = 1 << 30
# The product's torch (scripts/install.sh, XMEM_TORCH=cuda): the programs run on the torch xmem supports.
TORCH_PINS = ("torch==2.14.1", "torchvision==0.29.1")
# The packages whose programs are run, pinned. litgpt pins huggingface-hub<1.4, which the others' current
# releases exclude: like a user's own environment, it gets a venv of its own (VENV-litgpt).
# deepspeed: trl's shipped ZeRO configs launch it.
PACKAGE_PINS = {"": ("accelerate==1.15.0", "trl==1.16.0", "deepspeed==0.19.8", "ultralytics==8.4.190",
                     "open_clip_torch[training]==3.3.0", "rl_zoo3==2.9.2", "torchtune==0.6.1", "torchao==0.11.0",
                     "chemprop==2.3.1", "pykeen==1.11.1", "lightly==1.6.0", "nequip==0.19.1", "nnunetv2==2.8.1"),
                "litgpt": ("litgpt==0.5.13", "requests"),  # requests: jsonargparse reads configs by URL
                "llamafactory": ("llamafactory==0.9.5",), "mace": ("mace-torch==0.3.16",),
                "torchtitan": ("torchtitan==0.3.0",),
                "yolov5": ("yolov5==7.0.14", "setuptools<81"),  # it imports pkg_resources
                "ms-swift": ("ms-swift==4.6.0", "deepspeed==0.19.8"),
                # anomalib's CLI needs what its `anomalib install` would add
                "anomalib": ("anomalib==2.7.0", "lightning==2.6.6", "open_clip_torch==3.3.0", "timm==1.0.31",
                             "FrEIA==0.2", "kornia==0.9.0", "einops==0.8.2", "jsonargparse[signatures]==4.46.0",
                             "omegaconf==2.4.0"),
                # the second wave (issue 31 item 6): one venv each, as each package's users have it
                "gluonts": ("gluonts[torch,shell]==0.17.0",), "ludwig": ("ludwig==0.11.0",), "axolotl": ("axolotl==0.17.0",),
                "monai": ("monai[nibabel,fire,ignite,einops]==1.6.1",), "schnetpack": ("schnetpack==2.2.0",),
                "coqui-tts": ("coqui-tts[codec]==0.28.0", "torchaudio==2.11.1", "six"), "cellpose": ("cellpose==3.1.1.3",),
                "nequip-allegro": ("nequip-allegro==0.8.3",),
                "imitation": ("imitation==1.0.1", "setuptools<81"),  # it imports pkg_resources
                "sample-factory": ("sample-factory==2.1.1",),
                # cleanrl 1.2.0 requires pygame 2.1.0, which has no wheel for Python 3.11 (only its renderer
                # uses it): its own package without dependencies, then what its agents import
                "cleanrl": ("gym==0.23.1", "pygame==2.6.1", "gymnasium==1.2.0", "tyro", "tensorboard",
                            "stable-baselines3==1.2.0"),  # its own pin: current releases refuse gym 0.23 spaces
                # ...but its dqn, moved to gymnasium before the rest, refuses stable-baselines3 below 2.0 and tells
                # its user to install 2.0.0a1 ("Ongoing migration"): that user's venv, apart (Program.venv)
                "cleanrl-gymnasium": ("gym==0.23.1", "pygame==2.6.1", "tyro", "tensorboard",
                                      "stable-baselines3==2.0.0a1"),
                "lerobot": ("lerobot==0.3.2",), "piper-tts": ("piper-tts[train]==1.8.0",),
                "sevenn": ("sevenn==0.13.0",),
                # the third wave (kinds the corpus covered least: Lightning-CLI programs, medical imaging, audio)
                "torchgeo": ("torchgeo==0.8.1", "requests"),  # its OpenStreetMap data set imports requests undeclared
                "kaiko-eva": ("kaiko-eva[vision]==0.4.5",),
                # audio (as coqui-tts): needs FFmpeg on the machine (the module's docstring)
                "f5-tts": ("f5-tts==1.1.22", "torchaudio==2.11.1")}
PACKAGE_PYTHON = {"schnetpack": "3.12"}  # schnetpack's current release requires Python 3.12 (uv finds it by version)
# installed after PACKAGE_PINS, without their dependencies. ludwig pins bitsandbytes<0.41, whose libraries stop at
# CUDA 12.2: on the product's torch (CUDA 13) it fails on a real GPU node as well, so its users take a newer one
NO_DEPS = {"cleanrl": ("cleanrl==1.2.0",), "cleanrl-gymnasium": ("cleanrl==1.2.0",),
           "ludwig": ("bitsandbytes==0.50.2",)}
# Settings of an offline cluster, and caches kept in the work folder (never the user's home).
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "YOLO_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Program:
    """One shipped program: `argv` as typed in an activated venv ({work}: the package's fixtures, {out}: a fresh
    output folder); `model` builds the same model on the CPU at the dtype it trains in (the lower bound); `env`: the
    variables its docs have users set (the same placeholders)."""

    name: str
    package: str
    argv: tuple[str, ...]
    model: Callable[[Path], Any] | None = None
    env: tuple[tuple[str, str], ...] = ()
    venv: str = ""  # the PACKAGE_PINS key of its venv where not its package's


@dataclass
class Record:
    name: str
    package: str
    command: str
    exit: int
    seconds: float
    peak_bytes: int | None = None
    model_state_bytes: int | None = None
    capacity_bytes: int | None = None
    answered: bool = False
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    suspect: list[str] = field(default_factory=list)  # the self-audit's reasons: the filter keeps such a request
    run: str = ""  # when and on which product commit it ran ("2026-12-07 a8a561d"), stamped by --merge


def words(n: int, seed: int) -> list[str]:
    """`n` sentences of a small made-up language: enough text to train a tokenizer and fill a data set."""
    rng = random.Random(seed)
    vocab = ["the", "model", "learns", "a", "small", "task", "from", "data", "and", "memory", "grows", "with",
             "batch", "size", "gpu", "cluster", "job", "step", "loss", "falls", "slowly", "quickly", "train",
             "token", "layer", "weight", "answer", "question", "why", "how", "what", "good", "bad", "very"]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(6, 24))) + "." for _ in range(n)]


# --- fixtures: what each package's programs would otherwise download (run in the programs' venv) ---------------


def bpe_tokenizer(folder: Path) -> Any:
    """A byte-level BPE tokenizer trained on generated text, saved as tokenizer.json with a tokenizer_config.json
    naming its special tokens (what litgpt's Tokenizer reads; transformers' fast tokenizers read the same)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(words(2000, 0), trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "bos_token": "<|endoftext|>", "add_bos_token": False,
                                                              "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    return tok


def hf_tokenizer(folder: Path) -> Any:
    """`bpe_tokenizer` as transformers saves it, with a chat template for trainers that format conversations."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(folder), eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", bos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(folder)
    return fast


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def fixtures_trl(work: Path) -> None:
    """A small Qwen2 causal LM from its config with its tokenizer, and local data sets in each trainer's format."""
    from transformers import AutoModelForCausalLM

    hf_tokenizer(work / "model")
    trl_model(work).save_pretrained(work / "model")
    AutoModelForCausalLM.from_pretrained(work / "model")  # proves the folder loads offline
    text = words(64, 1)
    write_jsonl(work / "sft" / "train.jsonl", [{"text": t} for t in text])
    write_jsonl(work / "pref" / "train.jsonl", [{"prompt": t[:20], "chosen": t[20:], "rejected": t[::-1][:30]}
                                                for t in text])
    write_jsonl(work / "kto" / "train.jsonl", [{"prompt": t[:20], "completion": t[20:], "label": i % 2 == 0}
                                               for i, t in enumerate(text)])
    write_jsonl(work / "prompts" / "train.jsonl", [{"prompt": [{"role": "user", "content": t[:40]}]} for t in text])
    hf_tokenizer(work / "llama-7b")
    sparse_safetensors(llama_7b(), work / "llama-7b")
    (work / "ds_zero3_offload.json").write_text(json.dumps(DS_ZERO3_OFFLOAD))
    (work / "fsdp.json").write_text(json.dumps({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}))
    (work / "sft.sh").write_text("#!/bin/bash\n# a user's wrapper, as a batch script's body runs it\nset -euo pipefail\n"
                                 "export OMP_NUM_THREADS=1\ncd \"$1\"\nshift\nexec trl sft \"$@\"\n")


def fixtures_llamafactory(work: Path) -> None:
    """trl's small Qwen2 model and tokenizer, and a data folder as LLaMA-Factory reads one: dataset_info.json naming an
    instruction set (alpaca columns) and a ranked preference set."""
    fixtures_trl(work)
    text = words(64, 2)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "tiny.json").write_text(json.dumps([{"instruction": t[:20], "input": "", "output": t[20:]} for t in text]))
    (data / "pref.json").write_text(json.dumps([{"instruction": t[:20], "chosen": t[20:], "rejected": t[::-1][:30]}
                                                for t in text]))
    (data / "dataset_info.json").write_text(json.dumps({
        "tiny": {"file_name": "tiny.json"},
        "tiny_pref": {"file_name": "pref.json", "ranking": True,
                      "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}}))


def fixtures_swift(work: Path) -> None:
    """trl's small Qwen2 model and tokenizer, and conversations in the `messages` layout ms-swift reads."""
    fixtures_trl(work)
    write_jsonl(work / "chat.jsonl", [
        {"messages": [{"role": "user", "content": t[:20]}, {"role": "assistant", "content": t[20:] or t}]}
        for t in words(64, 4)])


def swift_args(*options: str) -> tuple[str, ...]:
    return ("swift", "sft", "--model", "{work}/model", "--model_type", "qwen2", "--template", "qwen", "--dataset",
            "{work}/chat.jsonl", "--output_dir", "{out}", "--max_steps", "3", "--per_device_train_batch_size", "2",
            "--max_length", "64", "--report_to", "none", "--save_strategy", "no", "--dataloader_num_workers", "0",
            *options)


def llamafactory_args(stage: str, finetuning: str, dataset: str = "tiny") -> tuple[str, ...]:
    return ("llamafactory-cli", "train", "--stage", stage, "--do_train", "true", "--model_name_or_path",
            "{work}/model", "--dataset", dataset, "--dataset_dir", "{work}/data", "--template", "default",
            "--finetuning_type", finetuning, "--cutoff_len", "64", "--output_dir", "{out}",
            "--per_device_train_batch_size", "2", "--max_steps", "3", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--bf16", "true", "--overwrite_cache", "true")


# Llama 2 7B's shape (Hugging Face's LlamaConfig), bf16 as its checkpoints are published
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
            "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 0}
# DeepSpeed ZeRO-3 with the optimizer and parameters offloaded to the host, "auto" values filled in by the HF Trainer
DS_ZERO3_OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                          "offload_param": {"device": "cpu", "pin_memory": True},
                                          "overlap_comm": True, "contiguous_gradients": True,
                                          "stage3_gather_16bit_weights_on_model_save": True},
                    "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto",
                    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                    "gradient_clipping": "auto"}


def llama_7b(work: Path | None = None, shards: int = 1) -> Any:
    """Llama 2 7B built on the meta device (no memory) in bf16; `shards` > 1 keeps one rank's share of its
    parameters for the lower bound of a job sharded over that many GPUs (FSDP, ZeRO-3)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_7B, dtype="bfloat16"), dtype=torch.bfloat16)
    if shards > 1:
        return ShardOf(model, shards)
    return model


class ShardOf:
    """One rank's share of a model's state when it is sharded evenly over `shards` GPUs (model_state_bytes reads
    its parameters and buffers)."""

    def __init__(self, model: Any, shards: int) -> None:
        import torch

        total = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
        dtype = next(model.parameters()).dtype
        self.share = torch.empty(total // shards, dtype=dtype, device="meta")

    def parameters(self) -> list[Any]:
        return [self.share]

    def buffers(self) -> list[Any]:
        return []


def sparse_safetensors(model: Any, folder: Path) -> None:
    """`model` saved as Hugging Face saves it (config.json, model.safetensors) without writing its weights: the
    safetensors header names every tensor and the data part is a hole of the right size (a sparse file), which is
    all a trace that loads weights fake reads."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it (AutoModel reads it)
    model.config.save_pretrained(folder)
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in model.state_dict().items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data part starts 8-byte aligned, as safetensors writes it
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def trl_model(work: Path, head: str = "causal") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if head == "reward":
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def accelerate_model(work: Path) -> Any:
    from accelerate.test_utils import RegressionModel

    return RegressionModel()


def trl_args(script: str, data: str) -> tuple[str, ...]:
    return (script, "--model_name_or_path", "{work}/model", "--dataset_name", "{work}/" + data,
            "--output_dir", "{out}", "--max_steps", "3", "--per_device_train_batch_size", "2",
            "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--max_length", "64")


def llama_7b_args(script: str) -> tuple[str, ...]:
    """`trl_args` for the local Llama 2 7B checkpoint in bf16 with activation checkpointing, as 7B recipes run."""
    args = list(trl_args(script, "sft"))
    args[args.index("{work}/model")] = "{work}/llama-7b"
    args[args.index("--per_device_train_batch_size") + 1] = "1"
    return (*args, "--bf16", "true", "--gradient_checkpointing", "true")


def litgpt_model(work: Path) -> Any:
    from litgpt import Config
    from litgpt.model import GPT

    return GPT(Config.from_name("pythia-14m"))


def fixtures_litgpt(work: Path) -> None:
    """A checkpoint folder as `litgpt download` leaves it (config, weights, tokenizer) for pythia-14m built from
    litgpt's own config table, and an instruction data set in the JSON layout litgpt's `JSON` data module reads."""
    import torch
    from litgpt.utils import save_config

    folder = work / "checkpoint"
    folder.mkdir(parents=True)
    model = litgpt_model(work)
    torch.save(model.state_dict(), folder / "lit_model.pth")
    save_config(model.config, folder)
    bpe_tokenizer(folder)
    text = words(48, 2)
    (work / "data.json").write_text(json.dumps([{"instruction": t[:30], "input": "", "output": t[30:]}
                                                for t in text]))


def litgpt_args(verb: str) -> tuple[str, ...]:
    return ("litgpt", verb, "{work}/checkpoint", "--data", "JSON", "--data.json_path", "{work}/data.json",
            "--data.val_split_fraction", "0.1", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
            "--train.max_steps", "4", "--eval.interval", "100", "--out_dir", "{out}", "--precision", "32-true",
            "--devices", "1")


def picture(path: Path, rng: random.Random, size: int = 64) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(path)


# ultralytics label lines per task (normalised coordinates): a box, a polygon, a box with 3 keypoints, a rotated box
YOLO_LABELS = {"detect": "{c} 0.5 0.5 0.4 0.3", "segment": "{c} 0.3 0.3 0.7 0.3 0.7 0.6 0.3 0.6",
               "pose": "{c} 0.5 0.5 0.4 0.4 0.4 0.4 2 0.5 0.5 2 0.6 0.6 2",
               "obb": "{c} 0.3 0.3 0.7 0.35 0.65 0.7 0.25 0.6"}
YOLO_CONFIGS = {"detect": "yolo11n.yaml", "segment": "yolo11n-seg.yaml", "classify": "yolo11n-cls.yaml",
                "pose": "yolo11n-pose.yaml", "obb": "yolo11n-obb.yaml"}  # model configs ultralytics ships
YOLO_EXTRA = {"pose": "kpt_shape: [3, 3]\nflip_idx: [0, 1, 2]\n"}
# ultralytics' default batch; its nominal batch (nbs) of 64 makes an optimizer step of 64 / 16 = 4 batches. The
# training set holds the batches of 3 steps (xmem-slurm's default --iterations) and one more, so that the traced
# steps are whole batches inside the first epoch (with 8 pictures, its only step came at its end, and the trace
# went on into the final evaluation).
YOLO_BATCH = 16
YOLO_STEP_BATCHES = 64 // YOLO_BATCH
YOLO_TRAIN_IMAGES = (3 * YOLO_STEP_BATCHES + 1) * YOLO_BATCH
YOLO_VAL_IMAGES = 8


def fixtures_ultralytics(work: Path) -> None:
    """Per task a data set in the YOLO layout (images/, labels/, a data YAML) of generated pictures; for
    classification a folder per class."""
    rng = random.Random(3)
    splits = {"train": YOLO_TRAIN_IMAGES, "val": YOLO_VAL_IMAGES}
    for task, label in YOLO_LABELS.items():
        root = work / task
        for split, count in splits.items():
            (root / "labels" / split).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                picture(root / "images" / split / f"{i}.jpg", rng)
                (root / "labels" / split / f"{i}.txt").write_text(label.format(c=i % 2) + "\n")
        (work / f"{task}.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/val\n"
                                           f"names:\n  0: cat\n  1: dog\n{YOLO_EXTRA.get(task, '')}")
    for split, count in splits.items():
        for i in range(count):
            picture(work / "classify" / split / ("cat", "dog")[i % 2] / f"{i}.jpg", rng)


def yolo_model(task: str) -> Callable[[Path], Any]:
    def build(work: Path) -> Any:
        from ultralytics.nn import tasks

        cfg = YOLO_CONFIGS[task]
        kind = {"detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "pose": tasks.PoseModel,
                "classify": tasks.ClassificationModel, "obb": tasks.OBBModel}[task]
        extra = {"data_kpt_shape": (3, 3)} if task == "pose" else {}
        return kind(cfg, nc=2, verbose=False, **extra)
    return build


def yolo_args(task: str) -> tuple[str, ...]:
    data = "{work}/classify" if task == "classify" else "{work}/" + task + ".yaml"
    model = YOLO_CONFIGS[task]
    return ("yolo", task, "train", f"data={data}", f"model={model}", "epochs=1", "imgsz=64", f"batch={YOLO_BATCH}",
            "workers=0", "device=0", "plots=False", "project={out}")


def fixtures_anomalib(work: Path) -> None:
    """A data set in anomalib's Folder layout: generated pictures, normal ones and a few anomalous."""
    rng = random.Random(5)
    for kind, count in (("good", 24), ("bad", 8)):
        for i in range(count):
            picture(work / "data" / kind / f"{i}.png", rng)


def anomalib_args(model: str, *options: str) -> tuple[str, ...]:
    return ("anomalib", "fit", "--model", model, "--data", "anomalib.data.Folder", "--data.name", "toy",
            "--data.root", "{work}/data", "--data.normal_dir", "good", "--data.abnormal_dir", "bad",
            "--data.train_batch_size", "8", "--data.eval_batch_size", "8", "--data.num_workers", "0",
            "--trainer.max_epochs", "1", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
            "--default_root_dir", "{out}", *options)


TORCHGEO_CLASSES = 21  # UC Merced's land-use classes


def fixtures_torchgeo(work: Path) -> None:
    """UC Merced's layout (UCMerced_LandUse/Images/<class>/<name>.tif, one split file per split naming its
    pictures), generated 256 x 256 RGB pictures, two per class in each split; a LightningCLI config of a
    classification task (a timm ResNet-18 from random weights: no hub) on torchgeo's UC Merced data module."""
    from PIL import Image

    rng = random.Random(11)
    root = work / "ucmerced"
    for split in ("train", "val", "test"):
        names = []
        for label in range(TORCHGEO_CLASSES):
            for i in range(2):
                name = f"class{label:02d}{split}{i}.tif"
                path = root / "UCMerced_LandUse" / "Images" / f"class{label:02d}" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.frombytes("RGB", (256, 256), rng.randbytes(256 * 256 * 3)).save(path)
                names.append(name)
        (root / f"uc_merced-{split}.txt").write_text("\n".join(names) + "\n")
    (work / "classification.yaml").write_text(f"""model:
  class_path: torchgeo.trainers.ClassificationTask
  init_args:
    model: resnet18
    weights: null
    in_channels: 3
    num_classes: {TORCHGEO_CLASSES}
data:
  class_path: torchgeo.datamodules.UCMercedDataModule
  init_args:
    batch_size: 16
    num_workers: 0
  dict_kwargs:
    root: {root}
trainer:
  accelerator: gpu
  devices: 1
  max_epochs: 1
  logger: false
""")


# MHIST's split sizes and labels, which eva's MHIST data set checks before it trains
MHIST_SPLITS = {"train": 2175, "test": 977}


def fixtures_eva(work: Path) -> None:
    """MHIST's layout (images/, annotations.csv: image name, majority label SSA or HP, partition), generated 64 x 64
    pictures in the split sizes eva checks; an eva config (its `eva fit` CLI, jsonargparse) of a head trained on a
    frozen timm ResNet-18 from random weights (no hub), as eva's online classification runs it."""
    from PIL import Image

    rng = random.Random(13)
    root = work / "mhist"
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = ["Image Name,Majority Vote Label,Number of Annotators who Selected SSA (Out of 7),Partition"]
    for split, count in MHIST_SPLITS.items():
        for i in range(count):
            name = f"{split}{i:04d}.png"
            Image.frombytes("RGB", (64, 64), rng.randbytes(64 * 64 * 3)).save(root / "images" / name)
            label = "SSA" if i < count // 2 else "HP"  # eva checks the first and last labels: SSA, then HP
            rows.append(f"{name},{label},{7 if label == 'SSA' else 0},{split}")
    (root / "annotations.csv").write_text("\n".join(rows) + "\n")
    dataset = """
        class_path: eva.vision.datasets.MHIST
        init_args:
          root: {root}
          split: {split}
          transforms:
            class_path: eva.vision.data.transforms.ResizeAndCrop
            init_args:
              size: 64"""
    (work / "mhist.yaml").write_text(f"""trainer:
  class_path: eva.Trainer
  init_args:
    n_runs: 1
    default_root_dir: {work / "logs"}
    max_steps: 50
    accelerator: gpu
    devices: 1
    logger: false
model:
  class_path: eva.HeadModule
  init_args:
    backbone:
      class_path: eva.vision.models.wrappers.TimmModel
      init_args:
        model_name: resnet18
        pretrained: false
        model_kwargs:
          num_classes: 0
    head:
      class_path: torch.nn.Linear
      init_args:
        in_features: 512
        out_features: 1
    criterion: torch.nn.functional.binary_cross_entropy_with_logits
    optimizer:
      class_path: torch.optim.AdamW
      init_args:
        lr: 0.001
data:
  class_path: eva.DataModule
  init_args:
    datasets:
      train:{dataset.format(root=root, split="train")}
      val:{dataset.format(root=root, split="test")}
    dataloaders:
      train:
        batch_size: 64
        shuffle: true
      val:
        batch_size: 64
""")


def fixtures_yolov5(work: Path) -> None:
    """The detection data set of `fixtures_ultralytics`, and the font yolov5 downloads when it checks a data set
    (check_font), placed where it looks first (YOLOV5_CONFIG_DIR) as on an offline cluster: matplotlib's DejaVu Sans
    under the name it asks for."""
    import matplotlib

    fixtures_ultralytics(work)
    (work / "yolov5-config").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf",
                work / "yolov5-config" / "Arial.ttf")


def yolov5_model(cfg: str) -> Callable[[Path], Any]:
    def build(work: Path) -> Any:
        from yolov5.models.yolo import Model
        from yolov5.utils.general import check_yaml

        return Model(check_yaml(cfg), nc=2)  # the shipped YAML, found as `yolov5 train --cfg` finds it
    return build


def yolov5_args(cfg: str, *options: str) -> tuple[str, ...]:
    return ("yolov5", "train", "--data", "{work}/detect.yaml", "--weights", "", "--cfg", cfg, "--img", "64",
            "--epochs", "1", "--batch-size", str(YOLO_BATCH), "--workers", "0", "--device", "0", "--project", "{out}",
            "--noplots", *options)


def open_clip_model(name: str) -> Callable[[Path], Any]:
    def build(work: Path) -> Any:
        import open_clip

        return open_clip.create_model(name)
    return build


def open_clip_args(name: str) -> tuple[str, ...]:
    return ("python", "-m", "open_clip_train.main", "--dataset-type", "synthetic", "--train-num-samples", "32",
            "--batch-size", "4", "--epochs", "1", "--workers", "0", "--model", name, "--logs", "{out}")


def sb3_model(algo: str, env: str) -> Callable[[Path], Any]:
    """The algorithm's default policy (the zoo's settings only widen it): its networks' state."""
    def build(work: Path) -> Any:
        import stable_baselines3

        return getattr(stable_baselines3, algo.upper())("MlpPolicy", env, device="cpu").policy
    return build


def zoo_args(algo: str, env: str, steps: int) -> tuple[str, ...]:
    return ("python", "-m", "rl_zoo3.train", "--algo", algo, "--env", env, "--device", "cuda", "-n", str(steps),
            "--eval-freq", "-1", "-f", "{out}")


TUNE_LLAMA2 = {"vocab_size": 512, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "embed_dim": 128,
               "max_seq_len": 256}


def tune_model(work: Path) -> Any:
    from torchtune.models.llama2 import llama2

    return llama2(**TUNE_LLAMA2)


def fixtures_torchtune(work: Path) -> None:
    """A SentencePiece tokenizer trained on generated text, a small Llama 2 built by torchtune's own builder and
    saved as torchtune's checkpointer reads it, and an Alpaca-style JSON data set."""
    import sentencepiece
    import torch

    work.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(words(2000, 4)), model_prefix=str(work / "tok"),
                                             vocab_size=TUNE_LLAMA2["vocab_size"] // 2, model_type="bpe",
                                             hard_vocab_limit=False, minloglevel=2)
    (work / "checkpoint").mkdir()
    torch.save(tune_model(work).state_dict(), work / "checkpoint" / "model.pt")
    text = words(48, 5)
    (work / "data.json").write_text(json.dumps([{"instruction": t[:30], "input": "", "output": t[30:]}
                                                for t in text]))
    def turn(prompt: str, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    (work / "pairs.json").write_text(json.dumps([{"chosen": turn(t[:30], t[30:]), "rejected": turn(t[:30], t[::-1])}
                                                 for t in text]))


def tune_args(recipe: str, config: str, lora: bool, *extra: str) -> tuple[str, ...]:
    """`tune run RECIPE --config CONFIG` with overrides, as torchtune's docs have users point a shipped config at
    their own model, tokenizer, checkpoint and data."""
    builder = "lora_llama2" if lora else "llama2"
    model = [f"model._component_=torchtune.models.llama2.{builder}"] + [f"model.{k}={v}" for k, v in
                                                                         TUNE_LLAMA2.items()]
    return ("tune", "run", recipe, "--config", config, *model,
            "tokenizer.path={work}/tok.model", "~tokenizer.max_seq_len",
            "checkpointer._component_=torchtune.training.FullModelTorchTuneCheckpointer",
            "checkpointer.checkpoint_dir={work}/checkpoint", "checkpointer.checkpoint_files=[model.pt]",
            "checkpointer.output_dir={out}", "output_dir={out}", "dataset.source=json", "batch_size=2", "epochs=1",
            "max_steps_per_epoch=4", "gradient_accumulation_steps=1",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger", "metric_logger.log_dir={out}",
            *extra)


def chemprop_args(task: str) -> tuple[str, ...]:
    return ("chemprop", "train", "--data-path", "{work}/molecules.csv", "--smiles-columns", "smiles",
            "--target-columns", "regression" if task == "regression" else "classification", "--task-type", task,
            "--epochs", "3", "--batch-size", "8", "--num-workers", "0", "--accelerator", "gpu", "--devices", "1",
            "--output-dir", "{out}")


def fixtures_chemprop(work: Path) -> None:
    """Molecules as SMILES (chains, rings, small functional groups) with a made-up property and class."""
    rng = random.Random(6)
    parts = ["C", "CC", "CO", "CN", "C(=O)O", "c1ccccc1", "C1CC1", "C(Cl)", "C(F)", "C(C#N)", "CC(C)C"]  # any order
    work.mkdir(parents=True, exist_ok=True)
    rows = ["smiles,regression,classification"]
    for i in range(64):
        smiles = "".join(rng.choice(parts) for _ in range(rng.randint(1, 4)))
        rows.append(f"{smiles},{rng.uniform(-2, 2):.3f},{i % 2}")
    (work / "molecules.csv").write_text("\n".join(rows) + "\n")


def chemprop_model(task: str) -> Callable[[Path], Any]:
    """chemprop's default MPNN (bond message passing, mean aggregation, a feed-forward head for the task)."""
    def build(work: Path) -> Any:
        from chemprop import nn
        from chemprop.models import MPNN

        head = nn.RegressionFFN() if task == "regression" else nn.BinaryClassificationFFN()
        return MPNN(nn.BondMessagePassing(), nn.MeanAggregation(), head)
    return build


def pykeen_model(name: str) -> Callable[[Path], Any]:
    """The knowledge-graph embedding model on the Nations data set pykeen ships (its default dimensions)."""
    def build(work: Path) -> Any:
        from pykeen.datasets import Nations
        from pykeen.models import model_resolver

        return model_resolver.make(name, triples_factory=Nations().training)
    return build


def pykeen_args(name: str) -> tuple[str, ...]:
    return ("pykeen", "train", name.lower(), "--dataset", "nations", "--device", "cuda", "--number-epochs", "2",
            "--silent", "--output-directory", "{out}")


def fixtures_lightly(work: Path) -> None:
    """A folder of generated pictures, the unlabelled image folder lightly's CLI trains on."""
    rng = random.Random(7)
    for i in range(16):
        picture(work / "images" / f"{i}.jpg", rng)


def lightly_model(resnet: str) -> Callable[[Path], Any]:
    """The SimCLR model lightly's CLI trains (its train_cli: the ResNetGenerator backbone without its classifier, a
    1x1 convolution to the config's num_ftrs (32), the projection head to out_dim (128)), from scratch."""
    def build(work: Path) -> Any:
        from torch import nn

        from lightly.cli._cli_simclr import _SimCLR
        from lightly.models import ResNetGenerator
        from lightly.models.batchnorm import get_norm_layer

        backbone = ResNetGenerator(resnet, 1)
        features = nn.Sequential(get_norm_layer(3, 0), *list(backbone.children())[:-1],
                                 nn.Conv2d(list(backbone.children())[-1].in_features, 32, 1), nn.AdaptiveAvgPool2d(1))
        return _SimCLR(features, num_ftrs=32, out_dim=128)
    return build


def lightly_args(command: str, resnet: str, *extra: str) -> tuple[str, ...]:
    """Hydra overrides as lightly's help has users type them; pre_trained=False: its zoo's weights are downloads."""
    return (command, "input_dir={work}/images", "pre_trained=False", f"model.name={resnet}", "loader.batch_size=8",
            "loader.num_workers=0", "trainer.max_epochs=1", *extra)


# nequip's model settings: one place for the config the program reads and the model built for the lower bound
NEQUIP_MODEL = {"seed": 0, "type_names": ["Cu"], "r_max": 4.0, "parity": True, "num_layers": 2, "num_features": 16,
                "radial_mlp_depth": 1, "radial_mlp_width": 16}


def fixtures_nequip(work: Path) -> None:
    """A nequip training config (hydra YAML; JSON is YAML) on the EMT copper data set nequip generates itself
    (ASE's EMT calculator on jittered supercells), a small NequIP model, one epoch on the GPU."""
    species = NEQUIP_MODEL["type_names"]
    transforms = [{"_target_": "nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper", "model_type_names": species,
                   "chemical_species_to_atom_type_map": {s: s for s in species}},
                  {"_target_": "nequip.data.transforms.NeighborListTransform", "r_max": NEQUIP_MODEL["r_max"]}]
    loader = {"_target_": "torch.utils.data.DataLoader", "batch_size": 4}
    config = {
        "run": ["train"],
        "data": {"_target_": "nequip.data.datamodule.NequIPDataModule", "seed": 0,
                 "split_dataset": {"dataset": {"_target_": "nequip.data.dataset.EMTTestDataset",
                                               "transforms": transforms, "supercell": [3, 3, 3], "seed": 0,
                                               "num_frames": 20, "element": species[0]}, "train": 16, "val": 4},
                 "train_dataloader": {**loader, "shuffle": True}, "val_dataloader": loader,
                 "stats_manager": {"_target_": "nequip.data.CommonDataStatisticsManager", "type_names": species}},
        "trainer": {"_target_": "lightning.Trainer", "accelerator": "gpu", "devices": 1, "max_epochs": 1,
                    "enable_checkpointing": False, "logger": False},
        "training_module": {
            "_target_": "nequip.train.EMALightningModule",
            "loss": {"_target_": "nequip.train.EnergyForceLoss", "per_atom_energy": True,
                     "coeffs": {"total_energy": 1.0, "forces": 1.0}},
            "val_metrics": {"_target_": "nequip.train.EnergyForceMetrics",
                            "coeffs": {"total_energy_mae": 1.0, "forces_mae": 1.0}},
            "optimizer": {"_target_": "torch.optim.Adam", "lr": 0.01},
            "model": {"_target_": "nequip.model.NequIPGNNModel", **NEQUIP_MODEL, "model_dtype": "float32", "l_max": 1,
                      # what nequip's resolvers compute from the training data (they size no parameter)
                      "avg_num_neighbors": "${training_data_stats:num_neighbors_mean}",
                      "per_type_energy_shifts": "${training_data_stats:per_atom_energy_mean}",
                      "per_type_energy_scales": "${training_data_stats:forces_rms}"}}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.yaml").write_text(json.dumps(config, indent=1))


def fixtures_torchtitan(work: Path) -> None:
    """What torchtitan's debug configs read from its source tree's test assets, which the wheel does not ship: a
    tokenizer folder (`--hf_assets_path`) and a local text data set in the C4 layout (`--dataloader.dataset_path`)."""
    bpe_tokenizer(work / "tokenizer")  # 512 tokens: within the debug model's 2048
    write_jsonl(work / "c4" / "train.jsonl", [{"text": t} for t in words(256, 3)])


def torchtitan_args(gpus: int, *options: str) -> tuple[str, ...]:
    return ("torchrun", f"--nproc_per_node={gpus}", "-m", "torchtitan.train", "--module", "llama3", "--config",
            "llama3_debugmodel", "--hf_assets_path", "{work}/tokenizer", "--dataloader.dataset_path", "{work}/c4",
            "--dump_folder", "{out}", "--training.seq_len", "256", *options)


def copper_cells(count: int, seed: int) -> list[Any]:
    """`count` copper supercells (2x2x2 cubic, 32 atoms) with jittered positions, each with ASE's EMT calculator
    attached to label it."""
    import numpy as np
    from ase.build import bulk
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(seed)
    cells = []
    for _ in range(count):
        atoms = bulk("Cu", cubic=True) * (2, 2, 2)
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        atoms.calc = EMT()
        cells.append(atoms)
    return cells


def fixtures_mace(work: Path) -> None:
    """An extended-XYZ training set as MACE reads one: jittered copper supercells labelled by ASE's EMT calculator,
    under MACE's recommended keys (REF_energy, REF_forces, so ASE's own calculator fields never shadow them)."""
    import ase.io

    frames = []
    for atoms in copper_cells(24, 0):
        atoms.info["REF_energy"] = atoms.get_potential_energy()
        atoms.arrays["REF_forces"] = atoms.get_forces()
        atoms.calc = None
        frames.append(atoms)
    work.mkdir(parents=True, exist_ok=True)
    ase.io.write(work / "train.xyz", frames, format="extxyz")


def mace_args(*options: str) -> tuple[str, ...]:
    return ("mace_run_train", "--name", "cu", "--work_dir", "{out}", "--train_file", "{work}/train.xyz",
            "--valid_fraction", "0.1", "--E0s", "average", "--energy_key", "REF_energy", "--forces_key", "REF_forces",
            "--r_max", "4.0", "--batch_size", "4", "--max_num_epochs", "1", "--num_workers", "0", "--device", "cuda",
            *options)


def nequip_model(dtype: str, l_max: int) -> Callable[[Path], Any]:
    def build(work: Path) -> Any:
        from nequip.model import NequIPGNNModel
        from nequip.utils.global_state import set_global_state

        set_global_state()  # nequip builds models only after its global state is set, as nequip-train does
        species = NEQUIP_MODEL["type_names"]
        return NequIPGNNModel(**NEQUIP_MODEL, model_dtype=dtype, l_max=l_max, avg_num_neighbors=10.0,
                              per_type_energy_shifts={s: 0.0 for s in species},
                              per_type_energy_scales={s: 1.0 for s in species})
    return build


def nequip_args(*overrides: str) -> tuple[str, ...]:
    return ("nequip-train", "-cp", "{work}", "-cn", "train", *overrides)


# nnU-Net finds its data sets through three variables (raw, preprocessed, results), as its docs have users set them
NNUNET_ENV = (("nnUNet_raw", "{work}/raw"), ("nnUNet_preprocessed", "{work}/preprocessed"),
              ("nnUNet_results", "{out}/results"))
NNUNET_DATASET = "Dataset001_Blobs"


def fixtures_nnunet(work: Path) -> None:
    """A 2D data set in nnU-Net's raw layout (grey noise pictures, a square blob as the label, dataset.json), then
    planned and preprocessed by nnU-Net's own command, as its docs have users do before training."""
    from PIL import Image

    rng = random.Random(8)
    raw = work / "raw" / NNUNET_DATASET
    for folder in ("imagesTr", "labelsTr"):
        (raw / folder).mkdir(parents=True, exist_ok=True)
    cases = 6  # nnU-Net's default split is 5-fold cross-validation
    for i in range(cases):
        Image.frombytes("L", (64, 64), bytes(rng.randrange(256) for _ in range(64 * 64))).save(
            raw / "imagesTr" / f"case{i:03d}_0000.png")
        x, y = rng.randrange(8, 40), rng.randrange(8, 40)
        blob = bytes(int(x <= c % 64 < x + 16 and y <= c // 64 < y + 16) for c in range(64 * 64))
        Image.frombytes("L", (64, 64), blob).save(raw / "labelsTr" / f"case{i:03d}.png")
    (raw / "dataset.json").write_text(json.dumps({"channel_names": {"0": "noise"}, "file_ending": ".png",
                                                  "labels": {"background": 0, "blob": 1}, "numTraining": cases}))
    env = {**os.environ, **{k: v.format(work=work, out=work) for k, v in NNUNET_ENV}}
    subprocess.run([str(Path(sys.executable).parent / "nnUNetv2_plan_and_preprocess"), "-d", "1", "-c", "2d",
                    "-np", "1", "-npfp", "1"], env=env, check=True, stdout=subprocess.DEVNULL)  # its errors: stderr


def nnunet_model(deep_supervision: bool) -> Callable[[Path], Any]:
    """The network nnU-Net's trainer builds from the plans the fixtures made (one input channel, two labels)."""
    def build(work: Path) -> Any:
        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

        plans = PlansManager(str(work / "preprocessed" / NNUNET_DATASET / "nnUNetPlans.json"))
        return nnUNetTrainer.build_network_architecture(plans, plans.get_configuration("2d"), 1, 2,
                                                        deep_supervision)
    return build


# --- the second wave (issue 31 item 6): one venv per package, fixtures as small as each program's input allows ---


def gluonts_folder(work: Path) -> None:
    """SageMaker's /opt/ml layout that `python -m gluonts.shell train` reads (--data-path): hyperparameters.json
    (values as SageMaker passes them, strings) and a `train` channel of hourly series in GluonTS' JSON lines."""
    rng = random.Random(9)
    base = work / "ml"
    (base / "input" / "config").mkdir(parents=True, exist_ok=True)
    (base / "model").mkdir(parents=True, exist_ok=True)
    (base / "output").mkdir(parents=True, exist_ok=True)
    hyper = {"freq": "H", "prediction_length": 24, "context_length": 48, "batch_size": 16,
             "num_batches_per_epoch": 4, "trainer_kwargs": {"max_epochs": 1}, "patch_len": 8}
    (base / "input" / "config" / "hyperparameters.json").write_text(
        json.dumps({k: json.dumps(v) if not isinstance(v, str) else v for k, v in hyper.items()}))
    write_jsonl(base / "input" / "data" / "train" / "series.json", [
        {"start": "2024-01-01 00:00:00", "target": [rng.gauss(10, 3) for _ in range(400)]} for _ in range(8)])


def gluonts_args(estimator: str) -> tuple[str, ...]:
    return ("python", "-m", "gluonts.shell", "train", "--data-path", "{work}/ml", "--forecaster", estimator)


LUDWIG_CONFIGS = {
    "text": {"input_features": [{"name": "text", "type": "text", "encoder": {"type": "parallel_cnn"}},
                                {"name": "x", "type": "number"}],
             "output_features": [{"name": "label", "type": "category"}]},
    "transformer": {"input_features": [{"name": "text", "type": "text",
                                        "encoder": {"type": "transformer", "num_layers": 2, "hidden_size": 128}}],
                    "output_features": [{"name": "label", "type": "category"}, {"name": "y", "type": "number"}]},
    "image": {"input_features": [{"name": "image", "type": "image", "encoder": {"type": "stacked_cnn"},
                                  "preprocessing": {"height": 64, "width": 64}}],
              "output_features": [{"name": "label", "type": "category"}]}}


def fixtures_ludwig(work: Path) -> None:
    """A CSV of made-up sentences, a number, generated pictures and two targets; one config per model (YAML is
    JSON), one epoch on whatever GPU there is."""
    rng = random.Random(10)
    rows = ["text,x,image,label,y"]
    for i, t in enumerate(words(96, 11)):
        picture(work / "img" / f"{i}.png", rng)
        rows.append(f"\"{t}\",{rng.random():.3f},{work}/img/{i}.png,{('a', 'b', 'c')[i % 3]},{rng.random():.3f}")
    (work / "data.csv").write_text("\n".join(rows) + "\n")
    for name, config in LUDWIG_CONFIGS.items():
        (work / f"{name}.yaml").write_text(json.dumps({**config, "trainer": {"epochs": 1, "batch_size": 16}}))


def ludwig_args(config: str) -> tuple[str, ...]:
    return ("ludwig", "train", "--config", "{work}/" + config + ".yaml", "--dataset", "{work}/data.csv",
            "--output_directory", "{out}", "--skip_save_processed_input", "--skip_save_model")


def fixtures_axolotl(work: Path) -> None:
    """trl's small Qwen2 model and text, and axolotl configs (YAML is JSON) for a LoRA and a full fine-tune."""
    fixtures_trl(work)
    base = {"base_model": str(work / "model"), "datasets": [{"path": str(work / "sft" / "train.jsonl"),
                                                           "ds_type": "json", "type": "completion"}],
            "dataset_prepared_path": str(work / "prepared"), "val_set_size": 0, "sequence_len": 64,
            "micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_epochs": 1, "max_steps": 3,
            "optimizer": "adamw_torch", "learning_rate": 0.0001, "output_dir": "./outputs", "bf16": True,
            "logging_steps": 1, "save_strategy": "no"}
    (work / "full.yml").write_text(json.dumps(base))
    (work / "lora.yml").write_text(json.dumps({**base, "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
                                               "lora_dropout": 0.0, "lora_target_linear": True}))


# MONAI bundle configs (the bundle's train.json, the program's input): synthetic volumes made by MONAI itself
MONAI_COMMON = {
    "imports": ["$import torch", "$import numpy as np", "$import monai"],
    "device": "$torch.device('cuda:0')",
    "optimizer": {"_target_": "torch.optim.Adam", "params": "$@network.parameters()", "lr": 0.0001},
    "dataloader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": 2, "shuffle": True,
                   "num_workers": 0},
    "run": ["$@trainer.run()"]}
MONAI_VOLUMES = ("$[dict(zip(['image', 'label'], monai.data.synthetic.create_test_image_3d(64, 64, 64, "
                 "num_seg_classes=1, channel_dim=0, random_state=np.random.RandomState(i)))) for i in range(8)]")
MONAI_SEGMENTATION = {
    "network": "$@network_def.to(@device)",
    "loss": {"_target_": "DiceCELoss", "to_onehot_y": True, "softmax": True},
    "dataset": {"_target_": "Dataset", "data": MONAI_VOLUMES,
                "transform": {"_target_": "EnsureTyped", "keys": ["image", "label"]}},
    "trainer": {"_target_": "SupervisedTrainer", "max_epochs": 1, "device": "@device",
                "train_data_loader": "@dataloader", "network": "@network", "optimizer": "@optimizer",
                "loss_function": "@loss", "amp": True}}
MONAI_BUNDLES = {
    "unet3d": {**MONAI_SEGMENTATION, "network_def": {
        "_target_": "UNet", "spatial_dims": 3, "in_channels": 1, "out_channels": 2, "channels": [16, 32, 64, 128],
        "strides": [2, 2, 2], "num_res_units": 2}},
    "swinunetr": {**MONAI_SEGMENTATION, "network_def": {
        "_target_": "SwinUNETR", "in_channels": 1, "out_channels": 2, "feature_size": 24,
        "use_checkpoint": True}},
    # a 2D latent-free DDPM: MONAI's diffusion UNet trained to predict the noise its DDPM scheduler adds
    "ddpm": {
        "network_def": {"_target_": "DiffusionModelUNet", "spatial_dims": 2, "in_channels": 1, "out_channels": 1,
                        "channels": [32, 64, 64], "attention_levels": [False, False, True], "num_res_blocks": 1,
                        "num_head_channels": 32},
        "network": "$@network_def.to(@device)",
        "scheduler": {"_target_": "DDPMScheduler", "num_train_timesteps": 1000},
        "dataset": {"_target_": "Dataset", "data": (
            "$[{'image': monai.data.synthetic.create_test_image_2d(64, 64, channel_dim=0, "
            "random_state=np.random.RandomState(i))[0]} for i in range(16)]"),
                    "transform": {"_target_": "EnsureTyped", "keys": ["image"]}},
        "inferer": {"_target_": "DiffusionInferer", "scheduler": "@scheduler"},
        "trainer": {"_target_": "SupervisedTrainer", "max_epochs": 1, "device": "@device",
                    "train_data_loader": "@dataloader", "network": "@network", "optimizer": "@optimizer",
                    "loss_function": "$torch.nn.MSELoss()", "inferer": "@inferer",
                    "prepare_batch": "$monai.engines.DiffusionPrepareBatch(num_train_timesteps=1000)"}}}


def fixtures_monai(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for name, bundle in MONAI_BUNDLES.items():
        (work / f"{name}.json").write_text(json.dumps({**MONAI_COMMON, **bundle}, indent=1))


def monai_model(name: str) -> Callable[[Path], Any]:
    def build(work: Path) -> Any:
        from monai.bundle import ConfigParser

        parser = ConfigParser({**MONAI_COMMON, **MONAI_BUNDLES[name]})
        return parser.get_parsed_content("network_def")
    return build


def fixtures_schnetpack(work: Path) -> None:
    """An ASE database as schnetpack's AtomsDataModule reads one: jittered copper cells labelled by ASE's EMT
    calculator (energy, forces), made with schnetpack's own writer."""
    import numpy as np
    from schnetpack.data import ASEAtomsData

    atoms_list, properties = [], []
    for atoms in copper_cells(24, 1):
        properties.append({"energy": np.array([atoms.get_potential_energy()]), "forces": atoms.get_forces()})
        atoms.calc = None
        atoms_list.append(atoms)
    work.mkdir(parents=True, exist_ok=True)
    db = ASEAtomsData.create(str(work / "cu.db"), distance_unit="Ang",
                             property_unit_dict={"energy": "eV", "forces": "eV/Ang"})
    db.add_systems(properties, atoms_list)


def spktrain_args(*overrides: str) -> tuple[str, ...]:
    """`spktrain` with schnetpack's MD17 experiment (energy and forces) pointed at a custom database, as its docs
    have users train on their own data."""
    return ("spktrain", "experiment=md17", "data=custom", "data.datapath={work}/cu.db", "run.experiment=cu",
            "data.num_train=16", "data.num_val=4", "data.batch_size=4", "data.num_workers=0",
            "data.property_units.energy=eV", "data.property_units.forces=eV/Ang", "trainer.max_epochs=1",
            "trainer.accelerator=gpu", "logger=csv", *overrides)


def spoken_tones(work: Path) -> None:
    """An LJSpeech-layout data set (metadata.csv: id|text|normalised text, wavs/ at 22.05 kHz): one-second tones
    standing for the recordings of made-up sentences."""
    import wave

    import numpy as np

    rng = np.random.default_rng(2)
    (work / "wavs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, text in enumerate(words(24, 12)):
        tone = np.sin(np.arange(22050) * rng.uniform(200, 600) * 2 * np.pi / 22050) * 0.3
        with wave.open(str(work / "wavs" / f"s{i}.wav"), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(22050)
            w.writeframes((tone * 32767).astype("<i2").tobytes())
        lines.append(f"s{i}|{text}|{text}")
    (work / "metadata.csv").write_text("\n".join(lines) + "\n")


def fixtures_coqui(work: Path) -> None:
    """`spoken_tones`, and a Glow-TTS and a VITS config on characters (no phonemizer), saved by TTS's own config
    classes."""
    from TTS.config.shared_configs import BaseDatasetConfig
    from TTS.tts.configs.glow_tts_config import GlowTTSConfig
    from TTS.tts.configs.vits_config import VitsConfig

    spoken_tones(work)
    dataset = BaseDatasetConfig(formatter="ljspeech", meta_file_train="metadata.csv", path=str(work))
    common = {"batch_size": 4, "eval_batch_size": 4, "num_loader_workers": 0, "num_eval_loader_workers": 0,
              "run_eval": False, "test_delay_epochs": -1, "epochs": 1, "text_cleaner": "basic_cleaners",
              "use_phonemes": False, "print_step": 1, "mixed_precision": False, "output_path": str(work / "runs"),
              "datasets": [dataset], "eval_split_size": 2, "test_sentences": []}
    GlowTTSConfig(**common).save_json(str(work / "glow_tts.json"))
    VitsConfig(**common).save_json(str(work / "vits.json"))


def f5_data_folder(name: str) -> Path:
    """Where F5-TTS reads a data set and its vocabulary (`load_dataset`, `get_tokenizer`): NAME_TOKENIZER under the
    `data` folder two levels above its package (its repository's, or the venv's lib folder for a wheel)."""
    from importlib.resources import files

    return Path(str(files("f5_tts").joinpath(f"../../data/{name}"))).resolve()


def fixtures_f5(work: Path) -> None:
    """`spoken_tones` listed in F5-TTS's CSV layout (audio_file|text, absolute paths) and prepared by its own
    script (`prepare_csv_wavs --pretrain`: an Arrow table, durations, a character vocabulary) into its data folder
    as the data set "toy" with the char tokenizer."""
    spoken_tones(work)
    rows = [line.split("|") for line in (work / "metadata.csv").read_text().splitlines()]
    (work / "f5.csv").write_text("audio_file|text\n" + "".join(f"{work / 'wavs' / (key + '.wav')}|{text}\n"
                                                                for key, text, _ in rows))
    subprocess.run([sys.executable, "-m", "f5_tts.train.datasets.prepare_csv_wavs", str(work / "f5.csv"),
                    str(f5_data_folder("toy_char")), "--pretrain", "--workers", "1"], check=True)


def f5_model(work: Path) -> Any:
    """F5TTS_v1_Base as finetune_cli builds it (a DiT in a CFM) on the data set's vocabulary."""
    from f5_tts.model import CFM, DiT
    from f5_tts.model.utils import get_tokenizer

    vocab, size = get_tokenizer("toy", "char")
    return CFM(transformer=DiT(dim=1024, depth=22, heads=16, ff_mult=2, text_dim=512, conv_layers=4,
                               text_num_embeds=size, mel_dim=100), vocab_char_map=vocab)


def piper_args(*options: str) -> tuple[str, ...]:
    """piper's trainer (a LightningCLI: `python -m piper.train fit`) on `spoken_tones`, espeak-ng's phonemes."""
    return ("python", "-m", "piper.train", "fit", "--data.voice_name", "toy", "--data.csv_path", "{work}/metadata.csv",
            "--data.audio_dir", "{work}/wavs", "--model.sample_rate", "22050", "--data.espeak_voice", "en-us",
            "--data.cache_dir", "{out}/cache", "--data.config_path", "{out}/config.json", "--data.batch_size", "4",
            "--data.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.accelerator", "gpu",
            "--trainer.devices", "1", "--trainer.default_root_dir", "{out}", *options)


def fixtures_lerobot(work: Path) -> None:
    """A LeRobot data set made by LeRobot's own writer (LeRobotDataset.create, add_frame, save_episode) in a local
    folder: 4 episodes of 32 frames, a camera picture (PNG frames, no video), a 2-D state and action."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    rng = np.random.default_rng(4)
    features = {"observation.image": {"dtype": "image", "shape": (96, 96, 3),
                                      "names": ["height", "width", "channels"]},
                "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
                "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]}}
    dataset = LeRobotDataset.create("local/toy", fps=10, features=features, root=work / "toy", use_videos=False)
    for _ in range(4):
        for _ in range(32):
            dataset.add_frame({"observation.image": rng.integers(0, 255, (96, 96, 3), dtype=np.uint8),
                               "observation.state": rng.normal(size=2).astype(np.float32),
                               "action": rng.normal(size=2).astype(np.float32)}, task="push the block")
        dataset.save_episode()


def lerobot_args(policy: str, *options: str) -> tuple[str, ...]:
    return ("lerobot-train", "--dataset.repo_id=local/toy", "--dataset.root={work}/toy", f"--policy.type={policy}",
            "--policy.device=cuda", "--policy.push_to_hub=false", "--steps=3", "--batch_size=4", "--num_workers=0",
            "--output_dir={out}/run", "--wandb.enable=false", "--save_checkpoint=false", *options)


def fixtures_cellpose(work: Path) -> None:
    """A folder of grey pictures with bright round cells and their label masks (NAME_masks.png), the training
    layout cellpose's CLI reads."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[:128, :128]
    for split, count in (("train", 8), ("test", 2)):
        (work / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image = rng.normal(20, 5, (128, 128))
            mask = np.zeros((128, 128), np.uint16)
            for label in range(1, 9):
                cy, cx, r = rng.integers(15, 113), rng.integers(15, 113), rng.integers(6, 12)
                inside = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
                image[inside] += 150
                mask[inside] = label
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(work / split / f"c{i}.png")
            Image.fromarray(mask).save(work / split / f"c{i}_masks.png")


def cellpose_args(*options: str) -> tuple[str, ...]:
    return ("python", "-m", "cellpose", "--train", "--dir", "{work}/train", "--test_dir", "{work}/test",
            "--pretrained_model", "None", "--chan", "0", "--chan2", "0", "--n_epochs", "1", "--batch_size", "4",
            "--use_gpu", "--verbose", *options)


def fixtures_sevenn(work: Path) -> None:
    """SevenNet's `base` preset (its `sevenn_preset` prints it) set to one epoch on an extended-XYZ file of
    jittered copper cells labelled by ASE's EMT calculator (energy, forces, stress), as `sevenn` reads one."""
    import ase.io
    import yaml
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = []
    for atoms in copper_cells(16, 5):
        labels = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
        atoms.calc = SinglePointCalculator(atoms, **labels)
        frames.append(atoms)
    work.mkdir(parents=True, exist_ok=True)
    ase.io.write(work / "train.extxyz", frames[:12], format="extxyz")
    ase.io.write(work / "valid.extxyz", frames[12:], format="extxyz")
    preset = subprocess.run([str(Path(sys.executable).parent / "sevenn_preset"), "base"], capture_output=True,
                            text=True, check=True).stdout
    config = yaml.safe_load(preset)
    config["train"]["epoch"] = 1
    config["data"]["load_trainset_path"] = [str(work / "train.extxyz")]
    config["data"]["load_validset_path"] = [str(work / "valid.extxyz")]
    config["data"].pop("load_testset_path", None)
    (work / "input.yaml").write_text(yaml.safe_dump(config))


def fixtures_allegro(work: Path) -> None:
    """nequip's EMT copper config with Allegro's model in place of NequIP's (Allegro's docs train it with
    nequip-train)."""
    fixtures_nequip(work)
    config = json.loads((work / "train.yaml").read_text())
    model = config["training_module"]["model"]
    config["training_module"]["model"] = {
        "_target_": "allegro.model.AllegroModel", "seed": 0, "model_dtype": "float32", "type_names": ["Cu"],
        "r_max": 4.0, "l_max": 1, "parity": True, "num_layers": 2, "num_scalar_features": 32,
        "num_tensor_features": 8, "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed",
                                                            "num_bessels": 8},
        "radial_chemical_embed_dim": 32, "scalar_embed_mlp_hidden_layers_depth": 1,
        "scalar_embed_mlp_hidden_layers_width": 32, "allegro_mlp_hidden_layers_depth": 1,
        "allegro_mlp_hidden_layers_width": 32, "readout_mlp_hidden_layers_depth": 1,
        "readout_mlp_hidden_layers_width": 16, "avg_num_neighbors": model["avg_num_neighbors"],
        "per_type_energy_shifts": model["per_type_energy_shifts"],
        "per_type_energy_scales": model["per_type_energy_scales"]}
    (work / "train.yaml").write_text(json.dumps(config, indent=1))


PROGRAMS: list[Program] = [
    # accelerate: the scripts its `accelerate test` and its own test suite launch
    Program("accelerate-test-sync", "accelerate", ("python", "-m", "accelerate.test_utils.scripts.test_sync"),
            accelerate_model),
    Program("accelerate-test-script", "accelerate", ("python", "-m", "accelerate.test_utils.scripts.test_script"),
            accelerate_model),
    Program("accelerate-test", "accelerate", ("accelerate", "test"), accelerate_model),
    # trl: its CLI (which starts `accelerate launch`) and the scripts the CLI launches
    Program("trl-sft-cli", "trl", ("trl",) + trl_args("sft", "sft"), lambda w: trl_model(w)),
    Program("trl-sft", "trl", ("python", "-m") + trl_args("trl.scripts.sft", "sft"), lambda w: trl_model(w)),
    Program("trl-dpo", "trl", ("python", "-m") + trl_args("trl.scripts.dpo", "pref"), lambda w: trl_model(w)),
    Program("trl-reward", "trl", ("python", "-m") + trl_args("trl.scripts.reward", "pref"),
            lambda w: trl_model(w, "reward")),
    Program("trl-kto", "trl", ("python", "-m") + trl_args("trl.scripts.kto", "kto"), lambda w: trl_model(w)),
    # its CLI over 2 GPUs with the accelerate configs it ships (trl/accelerate_configs): DeepSpeed ZeRO and FSDP
    *(Program(f"trl-sft-{config}", "trl", ("trl",) + trl_args("sft", "sft") + (
        "--accelerate_config", config, "--num_processes", "2"), lambda w: trl_model(w))
      for config in ("zero1", "zero2", "zero3", "fsdp1", "fsdp2")),
    # GRPO (reinforcement learning from a reward function trl ships) and a torch.compile'd SFT
    Program("trl-grpo", "trl", ("python", "-m") + trl_args("trl.scripts.grpo", "prompts")[:-2] + (
        "--reward_funcs", "think_format_reward", "--num_generations", "2", "--max_completion_length", "16"),
        lambda w: trl_model(w)),
    Program("trl-sft-compile", "trl", ("trl",) + trl_args("sft", "sft") + ("--torch_compile", "true"),
            lambda w: trl_model(w)),
    # a user's shell wrapper starting trl's CLI, and torchrun under `env`, as batch scripts write them
    Program("trl-sft-bash", "trl", ("bash", "{work}/sft.sh", "{out}") + trl_args("sft", "sft")[1:],
            lambda w: trl_model(w)),
    Program("trl-sft-env-torchrun", "trl", ("env", "OMP_NUM_THREADS=1", "torchrun", "--nproc_per_node", "2", "-m")
            + trl_args("trl.scripts.sft", "sft"), lambda w: trl_model(w)),
    # Llama 2 7B fine-tuned from a local Hugging Face checkpoint over 2 GPUs, the ways people shard it: trl's FSDP2
    # config, the Trainer's own --fsdp under torchrun (Alpaca style), ZeRO-3 with host offload by the deepspeed
    # launcher and by `accelerate launch`'s flags
    Program("trl-sft-7b-fsdp2", "trl", ("trl",) + llama_7b_args("sft") + ("--accelerate_config", "fsdp2", "--num_processes", "2"),
            lambda w: llama_7b(w, 2)),
    Program("trl-sft-7b-torchrun-fsdp", "trl", ("torchrun", "--nproc_per_node", "2", "-m") + llama_7b_args(
        "trl.scripts.sft") + ("--fsdp", "full_shard auto_wrap", "--fsdp_config", "{work}/fsdp.json"),
            lambda w: llama_7b(w, 2)),
    Program("trl-sft-7b-deepspeed-zero3-offload", "trl", ("deepspeed", "--num_gpus", "2", "--module") + llama_7b_args(
        "trl.scripts.sft") + ("--deepspeed", "{work}/ds_zero3_offload.json")),
    Program("trl-sft-7b-accelerate-zero3-offload", "trl", (
        "accelerate", "launch", "--num_processes", "2", "--use_deepspeed", "--zero_stage", "3",
        "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu", "--zero3_init_flag", "true",
        "--mixed_precision", "bf16", "-m") + llama_7b_args("trl.scripts.sft")),
    # LLaMA-Factory: its CLI's `train` verb, LoRA / full / freeze tuning and DPO, flags as its docs give them
    Program("llamafactory-sft-lora", "llamafactory", llamafactory_args("sft", "lora"), lambda w: trl_model(w)),
    Program("llamafactory-sft-full", "llamafactory", llamafactory_args("sft", "full"), lambda w: trl_model(w)),
    Program("llamafactory-pt-freeze", "llamafactory", llamafactory_args("pt", "freeze"), lambda w: trl_model(w)),
    Program("llamafactory-dpo-lora", "llamafactory", llamafactory_args("dpo", "lora", "tiny_pref"),
            lambda w: trl_model(w)),
    # yolov5: the pip package's CLI (`yolov5 train`), from the model YAMLs it ships, SGD and Adam
    *(Program(f"yolov5-{name}", "yolov5", yolov5_args(*args), yolov5_model(args[0]),
              env=(("YOLOV5_CONFIG_DIR", "{work}/yolov5-config"),))
      for name, args in (("n", ("yolov5n.yaml",)), ("s-adam", ("yolov5s.yaml", "--optimizer", "Adam")))),
    # ms-swift: its CLI's sft verb (LoRA, full), and over 2 GPUs with the DeepSpeed config it ships
    # (NPROC_PER_NODE: swift starts torchrun itself)
    Program("swift-sft-lora", "ms-swift", swift_args("--tuner_type", "lora"), lambda w: trl_model(w)),
    Program("swift-sft-full", "ms-swift", swift_args("--tuner_type", "full"), lambda w: trl_model(w)),
    Program("swift-sft-zero2", "ms-swift", swift_args("--tuner_type", "lora", "--deepspeed", "zero2"),
            lambda w: trl_model(w), env=(("NPROC_PER_NODE", "2"),)),
    # anomalib: its CLI's fit verb on a Folder data set, models it trains by gradient descent: a GAN from scratch,
    # and normalizing flows over a frozen backbone (random weights: no hub)
    Program("anomalib-ganomaly", "anomalib", anomalib_args("Ganomaly")),
    Program("anomalib-fastflow", "anomalib", anomalib_args("Fastflow", "--model.backbone", "resnet18",
                                                           "--model.pre_trained", "false")),
    # torchtitan: its trainer (`python -m torchtitan.train` under torchrun) on its llama3 debug config: one GPU,
    # FSDP2 over 2, tensor parallel over 2
    Program("torchtitan-debug", "torchtitan", torchtitan_args(1)),
    Program("torchtitan-fsdp2", "torchtitan", torchtitan_args(2)),
    Program("torchtitan-tp2", "torchtitan", torchtitan_args(2, "--parallelism.tensor_parallel_degree", "2")),
    # litgpt: its CLI's fine-tuning verbs on a checkpoint folder
    *(Program(f"litgpt-{verb}", "litgpt", litgpt_args(verb), litgpt_model)
      for verb in ("finetune_lora", "finetune_full", "finetune_adapter", "finetune_adapter_v2")),
    # ultralytics: `yolo TASK train` from the model YAMLs it ships
    *(Program(f"yolo-{task}", "ultralytics", yolo_args(task), yolo_model(task))
      for task in ("detect", "segment", "classify", "pose", "obb")),
    # open_clip_torch: its training entry point (open_clip_train) on its synthetic data set
    *(Program(f"open-clip-{name}", "open_clip_torch", open_clip_args(name), open_clip_model(name))
      for name in ("RN50", "ViT-B-32", "coca_ViT-B-32")),
    # rl_zoo3: its trainer with the zoo's tuned settings
    Program("zoo-ppo", "rl_zoo3", zoo_args("ppo", "CartPole-v1", 2048), sb3_model("ppo", "CartPole-v1")),
    Program("zoo-a2c", "rl_zoo3", zoo_args("a2c", "CartPole-v1", 2048), sb3_model("a2c", "CartPole-v1")),
    Program("zoo-dqn", "rl_zoo3", zoo_args("dqn", "CartPole-v1", 3000), sb3_model("dqn", "CartPole-v1")),
    Program("zoo-sac", "rl_zoo3", zoo_args("sac", "Pendulum-v1", 3000), sb3_model("sac", "Pendulum-v1")),
    # torchtune: `tune run` of its single-device recipes, shipped configs pointed at local files
    Program("tune-lora", "torchtune", tune_args("lora_finetune_single_device", "llama2/7B_lora_single_device", True,
                                                 "dataset.data_files={work}/data.json"), tune_model),
    Program("tune-full", "torchtune", tune_args("full_finetune_single_device", "llama2/7B_full_low_memory", False,
                                                 "dataset.data_files={work}/data.json",
                                                 "optimizer._component_=torch.optim.AdamW"), tune_model),
    Program("tune-lora-dpo", "torchtune", tune_args(
        "lora_dpo_single_device", "llama2/7B_lora_dpo_single_device", True,
        "dataset._component_=torchtune.datasets.preference_dataset", "dataset.data_files={work}/pairs.json"),
        tune_model),
    # chemprop: its CLI's training of a message-passing network on molecules
    Program("chemprop-regression", "chemprop", chemprop_args("regression"), chemprop_model("regression")),
    Program("chemprop-classification", "chemprop", chemprop_args("classification"), chemprop_model("classification")),
    # pykeen: its CLI's training of knowledge-graph embeddings on a data set it ships
    *(Program(f"pykeen-{name.lower()}", "pykeen", pykeen_args(name), pykeen_model(name))
      for name in ("TransE", "ComplEx", "RotatE")),
    # lightly: its CLI's self-supervised (SimCLR) training on a folder of images, and its train-then-embed verb
    Program("lightly-resnet18", "lightly", lightly_args("lightly-ssl-train", "resnet-18"), lightly_model("resnet-18")),
    Program("lightly-resnet50-fp16", "lightly", lightly_args("lightly-ssl-train", "resnet-50", "trainer.precision=16"),
            lightly_model("resnet-50")),
    Program("lightly-magic", "lightly", lightly_args("lightly-magic", "resnet-18"), lightly_model("resnet-18")),
    # nequip: its trainer on a config naming the data set it generates (EMT copper), in float32 and float64
    # MACE: its training CLI, a small float32 model and the defaults (float64, 128 channels up to L=1)
    Program("mace-small-f32", "mace", mace_args("--model", "MACE", "--num_channels", "16", "--max_L", "1",
                                                "--default_dtype", "float32")),
    Program("mace-default", "mace", mace_args("--model", "MACE")),
    Program("nequip-f32", "nequip", nequip_args(), nequip_model("float32", 1)),
    Program("nequip-f64-lmax2", "nequip", nequip_args("training_module.model.model_dtype=float64",
                                                      "training_module.model.l_max=2"), nequip_model("float64", 2)),
    # nnunetv2: its trainer (fold 0 of the 2d configuration) on a data set planned and preprocessed by nnU-Net
    Program("nnunet-2d", "nnunetv2", ("nnUNetv2_train", "1", "2d", "0"), nnunet_model(True), NNUNET_ENV),
    Program("nnunet-2d-nodeepsup", "nnunetv2", ("nnUNetv2_train", "1", "2d", "0", "-tr",
                                                "nnUNetTrainerNoDeepSupervision"), nnunet_model(False), NNUNET_ENV),
    # --- the second wave (issue 31 item 6) ---
    # torchtune: a torch.compile'd LoRA, QLoRA (torchao's NF4 base), and its distributed recipes over 2 GPUs
    Program("tune-lora-compile", "torchtune", tune_args("lora_finetune_single_device", "llama2/7B_lora_single_device",
                                                         True, "dataset.data_files={work}/data.json", "compile=True"),
            tune_model),
    Program("tune-qlora", "torchtune", tune_args("lora_finetune_single_device", "llama2/7B_qlora_single_device", True,
                                                  "dataset.data_files={work}/data.json",
                                                  "model.quantize_base=True")),
    Program("tune-lora-distributed", "torchtune", ("tune", "run", "--nproc_per_node", "2") + tune_args(
        "lora_finetune_distributed", "llama2/7B_lora", True, "dataset.data_files={work}/data.json")[2:], tune_model),
    Program("tune-full-distributed", "torchtune", ("tune", "run", "--nproc_per_node", "2") + tune_args(
        "full_finetune_distributed", "llama2/7B_full", False, "dataset.data_files={work}/data.json")[2:]),
    # ultralytics: RT-DETR and YOLOv8 from their shipped YAMLs, and a torch.compile'd YOLO11
    Program("yolo-rtdetr", "ultralytics", tuple(a.replace("yolo11n.yaml", "rtdetr-l.yaml") for a in yolo_args("detect"))),
    Program("yolo-v8n", "ultralytics", tuple(a.replace("yolo11n.yaml", "yolov8n.yaml") for a in yolo_args("detect"))),
    Program("yolo-detect-compile", "ultralytics", yolo_args("detect") + ("compile=True",), yolo_model("detect")),
    # open_clip_torch with its --torchcompile
    Program("open-clip-rn50-compile", "open_clip_torch", open_clip_args("RN50") + ("--torchcompile",),
            open_clip_model("RN50")),
    # rl_zoo3: off-policy continuous control (TD3, DDPG) and sb3-contrib's TQC and QR-DQN from the zoo's settings
    Program("zoo-td3", "rl_zoo3", zoo_args("td3", "Pendulum-v1", 3000), sb3_model("td3", "Pendulum-v1")),
    Program("zoo-ddpg", "rl_zoo3", zoo_args("ddpg", "Pendulum-v1", 3000), sb3_model("ddpg", "Pendulum-v1")),
    Program("zoo-tqc", "rl_zoo3", zoo_args("tqc", "Pendulum-v1", 3000)),
    Program("zoo-qrdqn", "rl_zoo3", zoo_args("qrdqn", "CartPole-v1", 3000)),
    # gluonts: its SageMaker shell's train command (`python -m gluonts.shell train`), torch estimators
    *(Program(f"gluonts-{name}", "gluonts", gluonts_args(estimator)) for name, estimator in (
        ("deepar", "gluonts.torch.model.deepar.DeepAREstimator"),
        ("tft", "gluonts.torch.model.tft.TemporalFusionTransformerEstimator"),
        ("patchtst", "gluonts.torch.model.patch_tst.PatchTSTEstimator"),
        ("feedforward", "gluonts.torch.model.simple_feedforward.SimpleFeedForwardEstimator"))),
    # ludwig: its CLI's train verb on a CSV: a text CNN with a number, a transformer encoder, an image CNN
    *(Program(f"ludwig-{name}", "ludwig", ludwig_args(name)) for name in LUDWIG_CONFIGS),
    # axolotl: its CLI's train verb on a YAML config (LoRA and full fine-tune of a local model)
    Program("axolotl-lora", "axolotl", ("axolotl", "train", "{work}/lora.yml"), lambda w: trl_model(w)),
    Program("axolotl-full", "axolotl", ("axolotl", "train", "{work}/full.yml"), lambda w: trl_model(w)),
    # MONAI: `python -m monai.bundle run` on bundle configs: 3D UNet and SwinUNETR segmentation, a 2D DDPM
    *(Program(f"monai-{name}", "monai", ("python", "-m", "monai.bundle", "run", "--config_file",
                                         "{work}/" + name + ".json"), monai_model(name)) for name in MONAI_BUNDLES),
    # schnetpack: `spktrain` (hydra) on an ASE database of its own format, SchNet and PaiNN
    Program("spktrain-schnet", "schnetpack", spktrain_args()),
    Program("spktrain-painn", "schnetpack", spktrain_args("model/representation=painn")),
    # coqui-tts: its trainer script on an LJSpeech-layout folder, Glow-TTS and VITS
    *(Program(f"coqui-{name}", "coqui-tts", ("python", "-m", "TTS.bin.train_tts", "--config_path",
                                             "{work}/" + name + ".json")) for name in ("glow_tts", "vits")),
    # torchgeo: its CLI (a LightningCLI: `torchgeo fit --config`) on UC Merced's layout, a ResNet-18 classifier
    Program("torchgeo-classification", "torchgeo", ("torchgeo", "fit", "--config", "{work}/classification.yaml",
                                                    "--trainer.default_root_dir", "{out}")),
    # kaiko-eva: its CLI (`eva fit --config`) on MHIST's layout, a classification head on a frozen backbone
    Program("eva-mhist", "kaiko-eva", ("eva", "fit", "--config", "{work}/mhist.yaml")),
    # F5-TTS: its training CLI (F5TTS_v1_Base from scratch, a flow-matching DiT) on a data set its own script prepared
    Program("f5-tts-v1-base", "f5-tts", ("f5-tts_finetune-cli", "--exp_name", "F5TTS_v1_Base", "--dataset_name",
                                         "toy", "--tokenizer", "char", "--epochs", "1", "--batch_size_per_gpu", "400",
                                         "--num_warmup_updates", "2", "--save_per_updates", "1000",
                                         "--last_per_updates", "1000"), f5_model),
    # piper-tts: its VITS trainer, a LightningCLI program, on espeak-ng's phonemes of the sentences
    Program("piper-vits", "piper-tts", piper_args()),
    # LeRobot: its trainer on a local data set, a diffusion policy and ACT (no pretrained backbone: no hub)
    Program("lerobot-diffusion", "lerobot", lerobot_args("diffusion")),
    Program("lerobot-act", "lerobot", lerobot_args("act", "--policy.pretrained_backbone_weights=null")),
    # cellpose: its CLI's training of a network from scratch on pictures with masks
    Program("cellpose-train", "cellpose", cellpose_args()),
    # SevenNet: its CLI (`sevenn input.yaml`) on its base preset
    Program("sevenn-base", "sevenn", ("sevenn", "{work}/input.yaml")),
    # Allegro: nequip-train with Allegro's model, as Allegro's docs run it
    Program("allegro", "nequip-allegro", nequip_args()),
    # CleanRL: its single-file agents as `python -m cleanrl.NAME` (tyro flags; CUDA by default)
    *(Program(f"cleanrl-{name}", "cleanrl", ("python", "-m", f"cleanrl.{name}", *flags)) for name, flags in (
        ("ppo", ("--total-timesteps", "2048")),
        ("c51", ("--total-timesteps", "12000", "--learning-starts", "10000")),
        ("sac_continuous_action", ("--env-id", "Pendulum-v1", "--total-timesteps", "5100", "--learning-starts",
                                   "5000")),
        ("td3_continuous_action", ("--env-id", "Pendulum-v1", "--total-timesteps", "25100")))),
    # CleanRL's dqn in the venv its "Ongoing migration" message asks for (gymnasium, stable-baselines3 2.0.0a1);
    # 1000 environment steps before it learns, where 10000 took longer than the trace's limit for c51
    Program("cleanrl-dqn", "cleanrl", ("python", "-m", "cleanrl.dqn", "--total-timesteps", "1100", "--learning-starts",
                                       "1000"), venv="cleanrl-gymnasium"),
    # Sample Factory: its gym example's trainer (asynchronous PPO), as its docs start it
    Program("sample-factory-cartpole", "sample-factory", (
        "python", "-m", "sf_examples.train_gym_env", "--env=CartPole-v1", "--experiment=cartpole",
        "--train_dir={out}", "--device=gpu", "--train_for_env_steps=20000")),
    # imitation: its sacred scripts' RL trainer with the named configs it ships
    *(Program(f"imitation-rl-{name}", "imitation", ("imitation-train-rl", "with", name,
                                                     "total_timesteps=4096", "logging.log_root={out}"))
      for name in ("cartpole", "pendulum")),
]
FIXTURES: dict[str, Callable[[Path], None]] = {"trl": fixtures_trl, "llamafactory": fixtures_llamafactory,
                                               "mace": fixtures_mace, "torchtitan": fixtures_torchtitan,
                                               "yolov5": fixtures_yolov5, "ms-swift": fixtures_swift,
                                               "anomalib": fixtures_anomalib,
                                               "litgpt": fixtures_litgpt,
                                               "ultralytics": fixtures_ultralytics, "torchtune": fixtures_torchtune,
                                               "chemprop": fixtures_chemprop, "lightly": fixtures_lightly,
                                               "nequip": fixtures_nequip, "nnunetv2": fixtures_nnunet,
                                               "gluonts": gluonts_folder, "ludwig": fixtures_ludwig,
                                               "axolotl": fixtures_axolotl, "monai": fixtures_monai,
                                               "schnetpack": fixtures_schnetpack, "coqui-tts": fixtures_coqui,
                                               "cellpose": fixtures_cellpose, "nequip-allegro": fixtures_allegro,
                                               "piper-tts": spoken_tones, "lerobot": fixtures_lerobot,
                                               "sevenn": fixtures_sevenn, "torchgeo": fixtures_torchgeo,
                                               "kaiko-eva": fixtures_eva, "f5-tts": fixtures_f5}


# --- running ----------------------------------------------------------------------------------------------------


def program_env(venv: Path, work: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The environment of an activated venv on an offline cluster, caches in the work folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OFFLINE, PATH=f"{venv}/bin:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               HF_HOME=str(work / "hf-home"), MPLCONFIGDIR=str(work / "mpl"), YOLO_CONFIG_DIR=str(work / "yolo"),
               WANDB_DIR=str(work / "wandb"))
    env.update(dict(extra))
    return env


def in_venv(venv: Path, work: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """This script's helper verbs (fixtures, model state), run on the programs' interpreter."""
    return subprocess.run([str(venv / "bin" / "python"), __file__, *args, "--work", str(work)], capture_output=True,
                          text=True, env=program_env(venv, work), timeout=timeout)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def xmem_slurm(product: Path | None) -> list[str]:
    """The product's command: this checkout's, or the xmem package of `product` (a snapshot of one commit, so that
    a run's figures belong to that commit while the checkout changes) on this checkout's interpreter."""
    if product is None:
        return [str(ROOT / ".venv" / "bin" / "xmem-slurm")]
    return [str(ROOT / ".venv" / "bin" / "python"), "-c", f"import sys; sys.path.insert(0, {str(product)!r}); "
            "from xmem.cli import main; sys.argv[0] = 'xmem-slurm'; sys.exit(main())"]


def run_program(program: Program, venv: Path, work: Path, iterations: int, timeout: float,
                product: Path | None = None) -> Record:
    out = Path(tempfile.mkdtemp(prefix=program.name + "-", dir=work))
    argv = [a.format(work=work / program.package, out=out) for a in program.argv]
    env = tuple((k, v.format(work=work / program.package, out=out)) for k, v in program.env)  # same placeholders
    command = [*xmem_slurm(product), "estimate", "--json", "--gpu", GPU,
               "--iterations", str(iterations), "--timeout", str(timeout), "--python", str(venv / "bin" / "python"),
               "--", *argv]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=out, timeout=timeout + 120,
                              env=program_env(venv, work, env))
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = 7, "", f"no answer within {timeout + 120:.0f} s"
    record = Record(program.name, program.package, " ".join(argv), code, round(time.monotonic() - started, 1))
    try:
        reply = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    except json.JSONDecodeError:
        reply = {}
    if code != 0:
        record.reason = last_line(reply.get("message") or "") or last_line(stderr) or "no output"
        return record
    gpu = reply["gpus"][next(iter(reply["gpus"]))]
    record.peak_bytes, record.capacity_bytes = gpu["peak_bytes"], gpu["capacity_bytes"]
    record.warnings = [last_line(w) for w in reply.get("warnings", [])]
    record.suspect = list(reply.get("suspect_reasons") or [])
    state = in_venv(venv, work / program.package, "--model-state", program.name) if program.model else None
    if state is not None and state.returncode != 0:
        record.reason = f"model state not computed: {last_line(state.stderr)}"
        return record
    record.model_state_bytes = int(state.stdout.split()[-1]) if state else 0
    if record.peak_bytes < record.model_state_bytes:
        record.reason = (f"implausible: peak {record.peak_bytes / GIB:.3f} GiB is below the model state "
                         f"{record.model_state_bytes / GIB:.3f} GiB")
    elif record.peak_bytes > record.capacity_bytes:
        record.reason = f"implausible: peak {record.peak_bytes / GIB:.1f} GiB is over the GPU's capacity"
    else:
        record.answered = True
    return record


def model_state_bytes(module: Any) -> int:
    """Parameters and buffers, each storage once (tied weights share one)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def report(records: list[Record]) -> str:
    lines = [f"{'program':28} {'package':16} {'exit':>4} {'peak GiB':>9} {'state GiB':>9} {'s':>6}"]
    for r in records:
        peak = f"{r.peak_bytes / GIB:9.3f}" if r.peak_bytes is not None else f"{'-':>9}"
        state = f"{r.model_state_bytes / GIB:9.3f}" if r.model_state_bytes is not None else f"{'-':>9}"
        lines.append(f"{r.name:28} {r.package:16} {r.exit:>4} {peak} {state} {r.seconds:6.1f}")
    answered = [r for r in records if r.answered]
    packages = {r.package for r in records}
    suspect = [r for r in answered if r.suspect]
    lines.append(f"\n{len(answered)} of {len(records)} answer ({len(packages)} packages), "
                 f"{len(suspect)} marked suspect")
    for r in records:
        if not r.answered:
            lines.append(f"  {r.name}: exit {r.exit}: {r.reason}")
    for r in suspect:
        lines.append(f"  {r.name}: suspect: {last_line(r.suspect[0])}")
    return "\n".join(lines)


def venv_of(package: str, base: Path) -> Path:
    """The venv a package's programs run in: `base`, or `base-PACKAGE` for one pinned apart (PACKAGE_PINS)."""
    return Path(f"{base}-{package}") if package and package in PACKAGE_PINS else base


def setup(base: Path, packages: list[str] | None = None) -> None:
    """Make the programs' venvs (all, or those of `packages`) from this interpreter's base Python, each with the
    product's torch and its pinned packages in one resolution (so no package can replace that torch). uv, where
    the product's venv has it, links its cached wheels instead of copying (a venv in seconds, little disk)."""
    python = getattr(sys, "_base_executable", sys.executable)
    uv = ROOT / ".venv" / "bin" / "uv"
    for package, pins in PACKAGE_PINS.items():
        if packages and (package or "") not in packages:
            continue
        venv = venv_of(package, base)
        target = str(venv / "bin" / "python")
        if uv.exists():
            subprocess.run([str(uv), "venv", "-q", "--clear", "-p", PACKAGE_PYTHON.get(package, python), str(venv)],
                           check=True)
            install = [str(uv), "pip", "install", "-q", "-p", target]
        else:
            subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
            install = [target, "-m", "pip", "install", "-q"]
        subprocess.run([*install, *TORCH_PINS, *pins, "pip"], check=True)
        if package in NO_DEPS:
            subprocess.run([*install, "--no-deps", *NO_DEPS[package]], check=True)


def write_records(path: Path, records: list[Record], iterations: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": GPU, "iterations": iterations, "answered": sum(r.answered for r in records),
                                "programs": len(records), "records": [asdict(r) for r in records]}, indent=1) + "\n")


def merge_records(out: Path, new_files: list[Path], label: str) -> None:
    """Merge the records of `new_files` into `out`, stamping each unstamped new record with `label`: a program run
    again replaces its old record, the others keep theirs, in the order of PROGRAMS."""
    old = json.loads(out.read_text()) if out.exists() else {"gpu": GPU, "iterations": 2, "records": []}
    by_name = {r["name"]: r for r in old["records"]}
    for path in new_files:
        for record in json.loads(path.read_text())["records"]:
            by_name[record["name"]] = {**record, "run": record.get("run") or label}
    order = {p.name: i for i, p in enumerate(PROGRAMS)}
    records = sorted(by_name.values(), key=lambda r: order.get(r["name"], len(order)))
    out.write_text(json.dumps({**old, "answered": sum(r["answered"] for r in records), "programs": len(records),
                               "packages": len({r["package"] for r in records}), "records": records},
                              indent=1) + "\n")


def select(only: list[str] | None, packages: list[str] | None) -> list[Program]:
    named = {p.name: p for p in PROGRAMS}
    chosen = [named[n] for n in dict.fromkeys(only) if n in named] if only else PROGRAMS  # in the order asked
    chosen = [p for p in chosen if not packages or p.package in packages]
    unknown = set(only or ()) - {p.name for p in PROGRAMS}
    if unknown:
        raise SystemExit(f"unknown program(s): {', '.join(sorted(unknown))} (see --list)")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="make the programs' venv (pinned packages) and stop")
    parser.add_argument("--venv", type=Path, default=VENV, help="the programs' venv (default .venv-programs)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these programs only")
    parser.add_argument("--package", nargs="+", metavar="PKG", help="the programs of these packages only")
    parser.add_argument("--list", action="store_true", help="list the programs and stop")
    parser.add_argument("--iterations", type=int, default=2, help="optimizer steps each estimate traces")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each estimate may trace")
    parser.add_argument("--out", type=Path, help="write the records as JSON here")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge these runs' records into --out (kept: the programs not run again) and stop")
    parser.add_argument("--label", default="", help="(--merge) the run's date and product commit, stamped on its "
                        "records")
    parser.add_argument("--product", type=Path, help="estimate with the xmem package of this folder (e.g. `git "
                        "archive HEAD` unpacked) instead of this checkout's")
    parser.add_argument("--work", type=Path, help="(helper verbs) the fixtures' folder")
    parser.add_argument("--fixtures", metavar="PKG", help="(helper, programs' venv) make PKG's fixtures in --work")
    parser.add_argument("--model-state", metavar="NAME", help="(helper, programs' venv) print NAME's model state")
    args = parser.parse_args()
    args.venv = args.venv.absolute()  # not resolved: a venv's python is a link to its base interpreter
    if args.fixtures:
        args.work.mkdir(parents=True, exist_ok=True)
        FIXTURES[args.fixtures](args.work)
        return 0
    if args.model_state:
        program = next(p for p in PROGRAMS if p.name == args.model_state)
        print(model_state_bytes(program.model(args.work)))
        return 0
    if args.merge:
        merge_records(args.out, args.merge, args.label)
        return 0
    if args.setup:
        setup(args.venv, args.package)
        return 0
    programs = select(args.only, args.package)
    if args.list:
        for p in programs:
            print(f"{p.name:28} {p.package:16} {' '.join(p.argv)}")
        return 0
    records = []
    with tempfile.TemporaryDirectory(prefix="xmem-programs-") as tmp:
        work = Path(tmp)
        unmade: dict[str, str] = {}  # package -> why its fixtures failed
        for program in programs:
            venv = venv_of(program.venv or program.package, args.venv)
            if program.package in FIXTURES and not (work / program.package).exists():
                made = in_venv(venv, work / program.package, "--fixtures", program.package)
                if made.returncode != 0:
                    unmade[program.package] = f"fixtures not made: {last_line(made.stderr)}"
            if program.package in unmade:
                record = Record(program.name, program.package, " ".join(program.argv), -1, 0.0,
                                reason=unmade[program.package])
            else:
                record = run_program(program, venv, work, args.iterations, args.timeout, args.product)
            print(f"{record.name}: exit {record.exit}, {record.seconds} s {record.reason}", file=sys.stderr,
                  flush=True)
            records.append(record)
            if args.out:  # after each program, so that a long run's figures so far are kept
                write_records(args.out, records, args.iterations)
    print(report(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
