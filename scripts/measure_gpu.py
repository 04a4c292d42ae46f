#!/usr/bin/env python
"""Run the reference jobs on a real GPU and record their memory in the shared data's JSONL schema.

    .venv/bin/python scripts/measure_gpu.py --plan modern --out bench-out/gpu
    .venv/bin/python scripts/measure_gpu.py --data benchmarks/data/xmem-dev.jsonl --out bench-out/gpu --limit 20
    .venv/bin/python scripts/bench_accuracy.py --data bench-out/gpu/measurements.jsonl --out bench-out/gpu-score
    .venv/bin/python scripts/measure_gpu.py --check-mps-limit   # the root Prolog's MPS share holds (issue 21)
    .venv/bin/python scripts/measure_gpu.py --plan sharding --out bench-out/gpu --timeout 120   # issue 22's cases

Each job runs unchanged (benchmarks/jobs/*.py, via runpy) in its own fresh process, as the reference measurements
did: a thread polls NVML `memory.used` of the device every millisecond from before the job starts; the NVML peak is
the largest (used - used at the first sample). Per job it records that peak, `max_memory_reserved`,
`max_memory_allocated`, the non-allocator overhead at the end (NVML used - first sample - `memory_reserved`), whether
the job hit CUDA OOM, and an allocator snapshot (`torch.cuda.memory._snapshot()`, pickled under OUT/snapshots/).

Output: OUT/measurements.jsonl, one line per job: `{"path", "study", "result": {"train info": {...}, "ground":
{"memory", "real_oom", "max_memory_reserved", "max_memory_allocated", "context_bytes", ...}}}`, which
bench_accuracy.py and `xmem-slurm calibrate` read unchanged. Needs an NVIDIA GPU and its driver's libnvidia-ml.
The library stack is the interpreter's (recorded under `versions`): score such measurements with
`bench_accuracy.py --no-reference-stack` on the same stack, or measure with `PYTHONPATH=bench-out/reference-stack`
to match the shared data's transformers 4.51.3.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS_DIR = ROOT / "benchmarks" / "jobs"
sys.path.insert(0, str(ROOT))  # xmem.bench without an install, on a bare GPU machine

from xmem.bench.records import Reference, Unreproducible, job_command, job_env, load_references  # noqa: E402

POLL_SECONDS = 0.001
ITERATIONS = 4  # the reference jobs' iterations 0-3


@dataclass(frozen=True)
class JobSpec:
    """One job to measure: the fields of a record's `train info` that choose the job."""

    model: str
    optimizer: str
    batch_size: int
    zero_grad_mode: int = 1
    options: dict = field(default_factory=dict)  # amp, fused, dtype, alloc_conf

    @property
    def name(self) -> str:
        extras = "_".join(f"{k}-{v}" for k, v in sorted(self.options.items()) if v not in (None, False, "none"))
        base = f"{self.model.replace('/', '--')}_{self.optimizer}_{self.batch_size}_{self.zero_grad_mode}"
        return "".join(ch if ch.isalnum() or ch in "-_.=" else "-" for ch in f"{base}_{extras}".rstrip("_"))


# Modern variants the dev data lacks: bf16 autocast, fused AdamW, expandable segments, SDPA flash on fp16 weights.
MODERN_PLAN = (
    JobSpec("openai-community/gpt2", "AdamW", 16, 1, {"amp": "bf16"}),
    JobSpec("openai-community/gpt2", "AdamW", 16, 1, {"fused": True}),
    JobSpec("openai-community/gpt2", "AdamW", 16, 1, {"amp": "bf16", "fused": True}),
    JobSpec("openai-community/gpt2", "AdamW", 16, 1, {"alloc_conf": "expandable_segments:True"}),
    JobSpec("openai-community/gpt2", "SGD", 16, 1, {"dtype": "float16"}),
    JobSpec("facebook/opt-350m", "AdamW", 8, 0, {"amp": "bf16", "fused": True,
                                                  "alloc_conf": "expandable_segments:True"}),
    JobSpec("ConvNeXtTiny", "AdamW", 128, 1, {"amp": "bf16", "fused": True}),
    JobSpec("resnet101", "SGD", 128, 2, {"alloc_conf": "expandable_segments:True"}),
    # issue 22: VGG19 is 11 % under on held-out runs and the dev data has no VGG row; the reference job as measured
    # (fp32, cuDNN heuristics), with a snapshot to tell its cuDNN workspaces and allocator slack apart
    JobSpec("vgg19", "Adam", 128, 0),
    JobSpec("vgg16", "SGD", 200, 1),
)


# Issue 22: single-GPU stand-ins of the sharded cases the trace models (tests/scripts/ programs, the same wrappers at
# world size 1, started as their launcher starts rank 0), so that one GPU session settles them: FSDP1 units mixing
# frozen and trainable parameters (LoRA-like) with and without use_orig_params, FSDP2 in bf16, DeepSpeed ZeRO 1/2/3
# through its engine and through the HF Trainer (its FusedAdam is JIT-compiled on the first case: ninja and nvcc on
# the GPU machine), and
# tensor parallelism over a 1-device mesh. Each is recorded as the jobs are, in OUT/cases.jsonl.
SCRIPTS_DIR = ROOT / "tests" / "scripts"
WORLD_OF_ONE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}


@dataclass(frozen=True)
class ProgramCase:
    """A program of tests/scripts/ measured as rank 0 of a world of one."""

    name: str
    script: str
    args: tuple[str, ...] = ()

    def command(self, python: str = sys.executable) -> list[str]:
        return [python, str(SCRIPTS_DIR / self.script), *self.args]


SHARDING_PLAN = (
    ProgramCase("fsdp1-lora-orig", "fsdp1_lora.py", ("--orig", "1")),
    ProgramCase("fsdp1-lora-flat", "fsdp1_lora.py", ("--orig", "0")),
    ProgramCase("fsdp1-lora-orig-bf16", "fsdp1_lora.py", ("--orig", "1", "--mp", "bf16")),
    ProgramCase("fsdp1-full-shard-grad-op", "fsdp1_lora.py", ("--frozen", "0", "--strategy", "SHARD_GRAD_OP")),
    ProgramCase("fsdp2-bf16", "fsdp2_mixed_precision.py"),
    ProgramCase("zero1", "deepspeed_zero.py", ("--stage", "1")),
    ProgramCase("zero2", "deepspeed_zero.py", ("--stage", "2")),
    ProgramCase("zero3", "deepspeed_zero.py", ("--stage", "3")),
    ProgramCase("hf-trainer-zero2", "hf_trainer_zero.py", ("--stage", "2")),
    ProgramCase("hf-trainer-zero3", "hf_trainer_zero.py", ("--stage", "3")),
    ProgramCase("dtensor-tp-1", "dtensor_tp.py"),
    # FSDP1 itself runs NO_SHARD in a world of one, whatever the strategy (_init_utils._init_core_state), so its
    # HYBRID_SHARD and prefetch settings (tests/trace/child/test_fsdp.py) have no row: they need several GPUs
    ProgramCase("fsdp2-lora", "fsdp2_lora.py"),
    ProgramCase("fsdp2-lora-bf16-frozen-head", "fsdp2_lora.py", ("--mp", "bf16", "--frozen", "base+head")),
    # CPU offload, alone and with bf16 mixed precision (tests/trace/child/test_fsdp_offload.py); FSDP1's offload
    # stays on in a world of one (NO_SHARD keeps the flat parameter on the host between uses)
    ProgramCase("fsdp1-offload", "fsdp_offload.py", ("--fsdp", "1")),
    ProgramCase("fsdp1-offload-bf16", "fsdp_offload.py", ("--fsdp", "1", "--mp", "bf16")),
    ProgramCase("fsdp2-offload-bf16", "fsdp_offload.py", ("--fsdp", "2", "--mp", "bf16")),
)


def case_record(case: ProgramCase, raw: dict) -> dict:
    """One line of OUT/cases.jsonl: the case, its command, and what the GPU showed."""
    return {"case": case.name, "command": case.command("python")[1:], "env": WORLD_OF_ONE,
            "ground": {"memory": nvml_peak(raw["nvml_used"]), "real_oom": raw["oom"],
                       **{key: raw.get(key) for key in ("max_memory_allocated", "max_memory_reserved", "context_bytes",
                                                    "snapshot", "gpu_name", "seconds", "error", "versions")}}}


def specs_from_data(refs: list[Reference]) -> list[JobSpec]:
    """The distinct jobs of a data file, in file order."""
    seen: dict[tuple, JobSpec] = {}
    for r in refs:
        spec = JobSpec(r.model, r.optimizer, r.batch_size, r.zero_grad_mode, dict(r.options))
        seen.setdefault((spec.name,), spec)
    return list(seen.values())


def spec_reference(spec: JobSpec, gpu_name: str = "", capacity: int = 0) -> Reference:
    return Reference(path=spec.name, study="measure_gpu", model=spec.model, optimizer=spec.optimizer,
                     batch_size=spec.batch_size, gpu_name=gpu_name, capacity_bytes=capacity,
                     zero_grad_mode=spec.zero_grad_mode, ground_bytes=0, real_oom=False, options=dict(spec.options))


def nvml_peak(samples: list[int]) -> int:
    """The reference measurements' figure: the largest used - used at the first sample (0 for no samples)."""
    return max(samples) - samples[0] if samples else 0


def measurement_record(spec: JobSpec, raw: dict, study: str) -> dict:
    """A child's raw result as a line of the shared data's schema (plus the `ground` section)."""
    gpu_slug = raw["gpu_name"].replace(" ", "-")
    info = {"model": spec.model, "batch_size": spec.batch_size, "target_iteration": ITERATIONS - 1,
            "optimiser": spec.optimizer, "device": raw.get("device", 0), "zero_grad_mode": spec.zero_grad_mode,
            "total_gpu_memory": raw["total_bytes"], "gpu_name": raw["gpu_name"], "options": dict(spec.options)}
    ground = {"memory": nvml_peak(raw["nvml_used"]), "real_oom": raw["oom"],
              "max_memory_reserved": raw["max_memory_reserved"], "max_memory_allocated": raw["max_memory_allocated"],
              "context_bytes": raw["context_bytes"], "samples": len(raw["nvml_used"]), "seconds": raw["seconds"],
              "snapshot": raw.get("snapshot"), "error": raw.get("error"), "versions": raw.get("versions", {})}
    return {"path": f"measure_gpu/{gpu_slug}/{spec.name}", "study": study,
            "result": {"train info": info, "ground": ground}}


# ---------------------------------------------------------------------------------------------------------------
# The child: one job in this process, NVML polled by a thread. Needs a GPU.

class Nvml:
    """The three NVML calls the measurement needs, through the driver's libnvidia-ml (no Python package)."""

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self, index: int) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "GetHandleByIndex")

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVML {call} failed with status {status}")

    def used(self) -> int:
        memory = self._Memory()
        self._check(self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(memory)), "GetMemoryInfo")
        return memory.used


class Poller(threading.Thread):
    def __init__(self, read, period: float = POLL_SECONDS) -> None:
        super().__init__(daemon=True)
        self.read, self.period = read, period
        self.samples: list[int] = [read()]  # the first sample is taken before the job starts
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(self.read())
            time.sleep(self.period)


def run_child(spec: JobSpec, snapshot_path: Path, nvml_index: int) -> dict:
    """Run one job here. torch sees only the measured GPU (index 0); NVML ignores CUDA_VISIBLE_DEVICES."""
    return run_command(job_command(spec_reference(spec), JOBS_DIR, python=sys.executable), snapshot_path,
                       nvml_index)


def run_command(command: list[str], snapshot_path: Path, nvml_index: int) -> dict:
    """Run `python script ARGS` here, unchanged (runpy), and measure it."""
    import runpy

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("measure_gpu.py: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                         "run it on a machine with an NVIDIA GPU")
    nvml = Nvml(nvml_index)
    poller = Poller(nvml.used)  # first sample before anything creates the CUDA context
    poller.start()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    started, oom, error = time.perf_counter(), False, None
    sys.argv = command[1:]
    try:
        runpy.run_path(command[1], run_name="__main__")
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        oom, error = True, str(e).splitlines()[0]
    seconds = time.perf_counter() - started
    time.sleep(0.05)  # let the poller see the last frees' effect (they do not lower NVML: the cache keeps them)
    poller.stop.set()
    poller.join()
    used_now = nvml.used()
    reserved_now = torch.cuda.memory_reserved()
    with snapshot_path.open("wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    torch.cuda.memory._record_memory_history(enabled=None)
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu_name": torch.cuda.get_device_name(0), "device": nvml_index,
        "total_bytes": props.total_memory, "oom": oom, "error": error, "seconds": round(seconds, 3),
        "nvml_used": poller.samples, "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "context_bytes": used_now - poller.samples[0] - reserved_now, "snapshot": snapshot_path.name,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "capability": list(torch.cuda.get_device_capability()),
                     # the model code's library, when the job imported it (the transformer jobs)
                     "transformers": getattr(sys.modules.get("transformers"), "__version__", None)},
    }


# ---------------------------------------------------------------------------------------------------------------
# The parent: one fresh process per job, results appended as they come.

def measure(spec: JobSpec, out: Path, device_index: int, timeout: float) -> dict | None:
    return measured_child(spec.name, ["--child", json.dumps(asdict(spec))], job_env(spec_reference(spec)), out,
                          device_index, timeout)


def child_command(name: str, what: list[str], out: Path, device_index: int) -> list[str]:
    """This script again, in a fresh process, measuring one job or case (`what`: --child SPEC or --case NAME)."""
    return [sys.executable, __file__, *what, "--device", str(device_index), "--raw", str(out / "raw" / f"{name}.json"),
            "--snapshot", str(out / "snapshots" / f"{name}.pickle")]


def measured_child(name: str, what: list[str], job_environment: dict, out: Path, device_index: int,
                   timeout: float) -> dict | None:
    raw_path = out / "raw" / f"{name}.json"
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    (out / "snapshots").mkdir(exist_ok=True)
    # the child's torch sees only the measured GPU; --device is the index NVML (which ignores this variable) uses
    env = {**os.environ, **job_environment, "CUDA_VISIBLE_DEVICES": str(device_index)}
    try:
        done = subprocess.run(child_command(name, what, out, device_index), env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        print(f"  {name}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    if done.returncode != 0 or not raw_path.is_file():
        print(f"  {name}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(raw_path.read_text())


# --- issue 21: the MPS share the root Prolog sets, on a real GPU -----------------------------------------------

MPS_SHARE_PERCENT = 10
# The client: ask the driver for more than the share in one piece, then for half the share. It sets the advisory
# variable to the whole GPU first, as a job undoing the TaskProlog's export would.
MPS_CLIENT = """
import json, sys, torch
share = int(sys.argv[1])
def fits(n):
    try:
        torch.empty(n, dtype=torch.uint8, device="cuda"); return True
    except torch.OutOfMemoryError:
        return False
print(json.dumps({"over_share": fits(share + (1 << 30)), "half_share": fits(share // 2)}))
"""


def check_mps_limit(device: int) -> dict:
    """Start a private MPS control daemon, let xmem's root Prolog logic set the share of a 10 % MPS job on
    `device`, and see whether a client that raised its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT can allocate past it.
    Without a GPU or the MPS control program it does nothing and says so."""
    import shutil
    import tempfile

    from xmem.slurm.node import enforce_mps_share, gpu_total_mib

    control = shutil.which("nvidia-cuda-mps-control")
    total = gpu_total_mib(device)
    if control is None or total is None:
        return {"skipped": "no GPU or no nvidia-cuda-mps-control here"}
    private = Path(tempfile.mkdtemp(prefix="xmem-mps-"))
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(private / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(private / "log"), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    for name in ("pipe", "log"):
        (private / name).mkdir()
    saved = dict(os.environ)
    os.environ.update(env)  # the Prolog logic calls the control program with this process's environment
    try:
        subprocess.run([control, "-d"], env=env, check=True, timeout=30)
        sent = enforce_mps_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(MPS_SHARE_PERCENT),
                                  "SLURM_JOB_GPUS": str(device)}, os.getuid(), control=control,
                                 total_mib_of=gpu_total_mib)
        share = total * MPS_SHARE_PERCENT // 100 << 20
        client = subprocess.run([sys.executable, "-c", MPS_CLIENT, str(share)], capture_output=True, text=True,
                                timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": str(device),
                                                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={total}M"})
        result = json.loads(client.stdout.strip().splitlines()[-1]) if client.returncode == 0 else \
            {"client_failed": client.stderr.strip()[-500:]}
        return {"commands": sent, "share_bytes": share, **result,
                "enforced": result.get("over_share") is False and result.get("half_share") is True}
    finally:
        subprocess.run([control], input="quit\n", text=True, env=env, timeout=30)
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(private, ignore_errors=True)


def measure_cases(cases: tuple[ProgramCase, ...], out: Path, device_index: int, timeout: float) -> int:
    """Each case in a fresh process, its line appended to OUT/cases.jsonl as it comes."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "cases.jsonl").open("a") as sink:
        for number, case in enumerate(cases, start=1):
            raw = measured_child(case.name, ["--case", case.name], WORLD_OF_ONE, out, device_index, timeout)
            if raw is None:
                continue
            line = case_record(case, raw)
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            ground = line["ground"]
            print(f"[{number}/{len(cases)}] {case.name}: allocated {ground['max_memory_allocated']} B, reserved "
                  f"{ground['max_memory_reserved']} B ({raw['seconds']:.1f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for measurements.jsonl, raw/, snapshots/")
    parser.add_argument("--plan", choices=("modern", "sharding"),
                        help="built-in job list (sharding: issue 22's single-GPU stand-ins, OUT/cases.jsonl)")
    parser.add_argument("--data", type=Path, help="measure the distinct jobs of this JSONL's records")
    parser.add_argument("--limit", type=int, default=0, help="measure at most this many jobs")
    parser.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job (default 1800)")
    parser.add_argument("--check-mps-limit", action="store_true",
                        help="only check that the MPS control daemon's share (set as the root Prolog sets it) "
                             "holds against a client that raises its own limit; does nothing without a GPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--raw", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.check_mps_limit:
        result = check_mps_limit(args.device)
        print(json.dumps(result))
        return 0 if result.get("enforced") or "skipped" in result else 1

    if args.child:  # in the fresh process: CUDA_VISIBLE_DEVICES already picks the device
        raw = run_child(JobSpec(**json.loads(args.child)), args.snapshot, args.device)
        args.raw.write_text(json.dumps(raw))
        return 0
    if args.case:  # in the fresh process, with WORLD_OF_ONE in its environment
        case = {case.name: case for case in SHARDING_PLAN}[args.case]
        args.raw.write_text(json.dumps(run_command(case.command(), args.snapshot, args.device)))
        return 0
    if not args.out or not (args.plan or args.data):
        parser.error("give --out and --plan or --data")
    try:
        Nvml(args.device)
    except (OSError, RuntimeError) as e:
        print(f"measure_gpu.py: no usable NVIDIA GPU {args.device} ({e}); run it on a machine with a GPU",
              file=sys.stderr)
        return 2
    if args.plan == "sharding":
        return measure_cases(SHARDING_PLAN[: args.limit] if args.limit else SHARDING_PLAN, args.out, args.device,
                             args.timeout)
    specs = list(MODERN_PLAN) if args.plan == "modern" else specs_from_data(load_references(args.data))
    specs = specs[: args.limit] if args.limit else specs
    for spec in specs:  # fail before any GPU time is spent on a job that cannot be re-created
        try:
            job_command(spec_reference(spec), JOBS_DIR)
        except Unreproducible as e:
            print(f"measure_gpu.py: {spec.name}: {e}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    study = f"measure_gpu/{args.plan or args.data.name}"
    with (args.out / "measurements.jsonl").open("a") as sink:
        for number, spec in enumerate(specs, start=1):
            raw = measure(spec, args.out, args.device, args.timeout)
            if raw is None:
                continue
            line = measurement_record(spec, raw, study)
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            ground = line["result"]["ground"]
            print(f"[{number}/{len(specs)}] {spec.name}: NVML peak {ground['memory'] / 2**30:.3f} GiB, reserved "
                  f"{ground['max_memory_reserved'] / 2**30:.3f} GiB, overhead {ground['context_bytes'] / 2**20:.0f} "
                  f"MiB{' OOM' if ground['real_oom'] else ''} ({raw['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
