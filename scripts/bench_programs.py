#!/usr/bin/env python
"""A standing corpus of real programs (issue 20): public training programs that PyPI packages ship in their wheels
(CLIs and recipes), run unmodified under `xmem-slurm estimate`, each answer checked against a plausible range.

    .venv/bin/python scripts/bench_programs.py --setup        # make .venv-programs with the pinned packages
    .venv/bin/python scripts/bench_programs.py [--only NAME...] [--package PKG...] [--list] [--out FILE]
                                               [--iterations N] [--timeout S] [--python PY]

Nothing here is written by the project: each program is what its package installs (`tune run`, `trl sft`,
`litgpt finetune_lora`, `yolo train`, `python -m open_clip_train.main`, ...), started as a user of an activated venv
types it. No hub is reachable, so what a program would download is made first in a temporary folder (never the
user's or the repository's files): tokenizers trained on generated text, models built from configs and saved as the
package's checkpoint format, small generated data sets. The programs' packages live in their own venvs
(`.venv-programs`, and `.venv-programs-PKG` for a package whose pins the others exclude; gitignored; `--setup` makes
them with the pins below and the product's torch), so they never constrain the product's; the estimate runs the
program on its venv's interpreter (`estimate --python`).

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
                             "omegaconf==2.4.0")}
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


def fixtures_mace(work: Path) -> None:
    """An extended-XYZ training set as MACE reads one: jittered copper supercells labelled by ASE's EMT calculator,
    under MACE's recommended keys (REF_energy, REF_forces, so ASE's own calculator fields never shadow them)."""
    import ase.io
    import numpy as np
    from ase.build import bulk
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(0)
    frames = []
    for _ in range(24):
        atoms = bulk("Cu", cubic=True) * (2, 2, 2)
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        atoms.calc = EMT()
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
]
FIXTURES: dict[str, Callable[[Path], None]] = {"trl": fixtures_trl, "llamafactory": fixtures_llamafactory,
                                               "mace": fixtures_mace, "torchtitan": fixtures_torchtitan,
                                               "yolov5": fixtures_yolov5, "ms-swift": fixtures_swift,
                                               "anomalib": fixtures_anomalib,
                                               "litgpt": fixtures_litgpt,
                                               "ultralytics": fixtures_ultralytics, "torchtune": fixtures_torchtune,
                                               "chemprop": fixtures_chemprop, "lightly": fixtures_lightly,
                                               "nequip": fixtures_nequip, "nnunetv2": fixtures_nnunet}


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


def run_program(program: Program, venv: Path, work: Path, iterations: int, timeout: float) -> Record:
    out = Path(tempfile.mkdtemp(prefix=program.name + "-", dir=work))
    argv = [a.format(work=work / program.package, out=out) for a in program.argv]
    env = tuple((k, v.format(work=work / program.package, out=out)) for k, v in program.env)  # same placeholders
    command = [str(ROOT / ".venv" / "bin" / "xmem-slurm"), "estimate", "--json", "--gpu", GPU,
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


def setup(base: Path) -> None:
    """Make the programs' venvs from this interpreter's base Python, each with the product's torch and its pinned
    packages in one resolution (so no package can replace that torch)."""
    python = getattr(sys, "_base_executable", sys.executable)
    for package, pins in PACKAGE_PINS.items():
        venv = venv_of(package, base)
        subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *TORCH_PINS, *pins], check=True)


def write_records(path: Path, records: list[Record], iterations: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": GPU, "iterations": iterations, "answered": sum(r.answered for r in records),
                                "programs": len(records), "records": [asdict(r) for r in records]}, indent=1) + "\n")


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
    if args.setup:
        setup(args.venv)
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
            venv = venv_of(program.package, args.venv)
            if program.package in FIXTURES and not (work / program.package).exists():
                made = in_venv(venv, work / program.package, "--fixtures", program.package)
                if made.returncode != 0:
                    unmade[program.package] = f"fixtures not made: {last_line(made.stderr)}"
            if program.package in unmade:
                record = Record(program.name, program.package, " ".join(program.argv), -1, 0.0,
                                reason=unmade[program.package])
            else:
                record = run_program(program, venv, work, args.iterations, args.timeout)
            print(f"{record.name}: exit {record.exit}, {record.seconds} s {record.reason}", file=sys.stderr,
                  flush=True)
            records.append(record)
            if args.out:  # after each program, so that a long run's figures so far are kept
                write_records(args.out, records, args.iterations)
    print(report(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
