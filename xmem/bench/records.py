"""Reference measurement records (the xMem `evaluation_result.json` schema) and the job command that re-creates one.

Owns the parsing of a JSONL line into a `Reference` and the mapping from a record to a command line of
`benchmarks/jobs/`. Reads files only in `load_references`; everything else is pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Estimator sections of a record, and how the report names them.
ESTIMATORS = {"solution": "xMem", "DNNmem": "DNNmem", "SchedTune": "SchedTune", "LLmem": "LLmem"}

# zero_grad mode of records that do not say it. The notes guessed mode 1 (just before backward), but the data says
# mode 0: the 22 configurations measured both with null and with 0 on the same GPU differ by 0.2-3.8 % (median
# 0.5 %; GPT-Neo: null reads 24-38 MiB below 0 at every batch size), while mode 1 keeps the previous gradients
# through the forward pass (+0.5 GiB for GPT-Neo 125M with Adam). Mode 0 is also PyTorch's CIFAR-10 tutorial loop.
DEFAULT_ZERO_GRAD_MODE = 0

CNN_MODELS = frozenset({  # the CNN job's model keys (lower case, letters and digits only)
    "vgg16", "vgg19", "resnet101", "resnet152", "mobilenetv2", "convnexttiny", "convnextbase", "regnetx400mf",
    "regnety400mf", "mobenetv3small", "mobenetv3large", "mnasnet",
})
CNN_OPTIMIZERS = frozenset({"SGD", "Adam", "RMSprop", "Adagrad", "AdamW"})
TRANSFORMER_OPTIMIZERS = CNN_OPTIMIZERS | {"Adafactor"}


class BadRecord(ValueError):
    """A line of the data file that is not a usable record; the message says which field."""


@dataclass(frozen=True)
class EstimatorRun:
    """One estimator's published answer for one real run."""

    memory: int  # predicted peak, bytes (negative: the estimator gave no answer)
    oom: bool  # predicted OOM
    seconds: float | None  # the estimator's runtime (the data stores nanoseconds)
    capped_oom: bool | None  # the second real run, capped at `memory`, ran out of memory (None: not run)


@dataclass(frozen=True)
class Reference:
    """One real training run on a real GPU and what each estimator predicted for it."""

    path: str
    study: str
    model: str
    optimizer: str
    batch_size: int
    gpu_name: str
    capacity_bytes: int  # total_gpu_memory
    zero_grad_mode: int  # resolved: DEFAULT_ZERO_GRAD_MODE where the record has null
    ground_bytes: int  # NVML peak of the real run (level reached before the OOM when real_oom)
    real_oom: bool
    # Whether `ground` counts the CUDA context. measure_gpu.py samples NVML before the job creates it: yes. The
    # xMem harness had created it before its first sample: no. Evidence: on the dev data, ground minus our simulated
    # reserved is within 10 MiB for 18 of 21 T5 runs and exactly 94 MiB for 3 of the 4 distinct A100 jobs, where a
    # context (hundreds of MiB) would show.
    ground_has_context: bool = True
    options: dict = field(default_factory=dict)  # modern variants: amp, fused, dtype, alloc_conf (measure_gpu.py)
    measured_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved() of the real run, where measured
    estimators: dict[str, EstimatorRun] = field(default_factory=dict)


def _estimator_run(section: dict) -> EstimatorRun:
    runtime = section.get("runtime")
    capped = (section.get("2nd verification") or {}).get("oom")
    return EstimatorRun(
        memory=int(section["memory"]),
        oom=bool(section["oom"]),
        seconds=runtime / 1e9 if runtime is not None and runtime >= 0 else None,
        capped_oom=None if capped is None else bool(capped),
    )


def _ground(result: dict) -> tuple[int, bool]:
    """The real run's NVML peak and OOM flag: every estimator section repeats them; measure_gpu.py writes `ground`."""
    if "ground" in result:
        return int(result["ground"]["memory"]), bool(result["ground"]["real_oom"])
    for name in ESTIMATORS:
        if name in result:
            return int(result[name]["ground"]), bool(result[name]["real_oom"])
    raise BadRecord("no measured peak: neither a 'ground' section nor an estimator section with 'ground'")


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def parse_reference(line: dict) -> Reference:
    try:
        result = line["result"]
        info = result["train info"]
        ground, real_oom = _ground(result)
        mode = info.get("zero_grad_mode")
        return Reference(
            path=str(line["path"]),
            study=str(line.get("study", "")),
            model=str(info["model"]),
            optimizer=str(info["optimiser"]),
            batch_size=int(info["batch_size"]),
            gpu_name=str(info["gpu_name"]),
            capacity_bytes=int(info["total_gpu_memory"]),
            zero_grad_mode=DEFAULT_ZERO_GRAD_MODE if mode is None else int(mode),
            ground_bytes=ground,
            real_oom=real_oom,
            ground_has_context="ground" in result,
            options=dict(info.get("options") or {}),
            measured_reserved_bytes=_optional_int((result.get("ground") or {}).get("max_memory_reserved")),
            estimators={name: _estimator_run(result[name]) for name in ESTIMATORS if name in result},
        )
    except KeyError as e:
        raise BadRecord(f"missing field {e}") from None
    except (TypeError, ValueError) as e:
        raise BadRecord(str(e)) from None


def load_references(path: Path) -> list[Reference]:
    """All records of a JSONL file; a bad line stops with its line number (nothing is skipped silently)."""
    references = []
    for number, text in enumerate(Path(path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            references.append(parse_reference(json.loads(text)))
        except (json.JSONDecodeError, BadRecord) as e:
            raise BadRecord(f"{path}:{number}: {e}") from None
    return references


class Unreproducible(ValueError):
    """The record's job cannot be re-created by the benchmark jobs; the message is the reason."""


def model_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def hf_config_path(model: str, jobs_dir: Path) -> Path:
    return jobs_dir.parent / "data" / "hf-configs" / (model.replace("/", "--") + ".json")


def _option_args(options: dict, transformer: bool) -> list[str]:
    args = []
    if options.get("amp", "none") != "none":
        args += ["--amp", str(options["amp"])]
    if options.get("fused"):
        args.append("--fused")
    if options.get("dtype", "float32") != "float32":
        if not transformer:
            raise Unreproducible(f"weight dtype {options['dtype']} is only supported by the transformer job")
        args += ["--dtype", str(options["dtype"])]
    return args


def job_command(ref: Reference, jobs_dir: Path, python: str = "python") -> list[str]:
    """The command line that re-creates `ref`'s training job with `benchmarks/jobs/` (raises Unreproducible)."""
    transformer = hf_config_path(ref.model, jobs_dir).is_file()
    if transformer:
        script, optimizers = "transformer.py", TRANSFORMER_OPTIMIZERS
    elif model_key(ref.model) in CNN_MODELS:
        script, optimizers = "cnn.py", CNN_OPTIMIZERS
    else:
        raise Unreproducible(f"unknown model {ref.model!r}: neither a CNN of cnn.py nor a configuration in "
                             f"{hf_config_path(ref.model, jobs_dir).parent}")
    if ref.optimizer not in optimizers:
        raise Unreproducible(f"optimizer {ref.optimizer!r} is not supported by {script}")
    if ref.batch_size < 1:
        raise Unreproducible(f"batch size {ref.batch_size} is not positive")
    return [python, str(jobs_dir / script), "--model", ref.model, "--optimizer", ref.optimizer,
            "--batch-size", str(ref.batch_size), "--zero-grad-mode", str(ref.zero_grad_mode),
            *_option_args(ref.options, transformer)]


def job_env(ref: Reference) -> dict[str, str]:
    """Environment variables the job ran with beyond the defaults (the allocator configuration)."""
    conf = ref.options.get("alloc_conf")
    return {"PYTORCH_CUDA_ALLOC_CONF": str(conf)} if conf else {}
