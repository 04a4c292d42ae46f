#!/usr/bin/env python
"""Speed and memory of `xmem-slurm estimate` end to end, as a user sees it.

Runs `xmem-slurm estimate --json` as a subprocess (Python start-up, tracing and simulation included) on plain user
training scripts written to a temporary folder, and reports for each:
- wall time of the whole command;
- peak RSS: the largest single process of the estimate (kernel figure, `os.wait4`'s rusage over the process and
  its reaped children) and the largest sum over the live process tree (parent + children, sampled every 50 ms
  from /proc);
- the predicted peak on the A100-80GB, the H100 and the H200 ("OOM" where the simulated job runs out of memory:
  the figure is then what it had reserved when it failed).

Cases: (a) GPT-2 124M from config (transformers), batch 8 x 1024, AdamW; (b) a 7B Llama-shaped model
(hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000), batch 1 x 2048, AdamW; (c) `small`, an MLP
with Adam (what every fresh estimate pays besides the model: start-up and imports).
Targets (issue #12): GPT-2 <= 3 s; 7B <= 15 s and <= 2 GiB peak RSS; `small` <= 2.5 s (the dev benchmark's median).

`--warm` runs each case R times cold and R times through the warm tracer (xmem.trace.warm, in a socket directory
of its own: a first estimate starts it, as a user's first estimate would, and is reported on its own line) and
prints the median wall time of each; a warm run's RSS columns cover the estimating process only (the traced job
is the warm server's child). With --warm it also times, R times, a fresh interpreter importing what the case's
script imports (`python -c "import torch; from transformers import ..."`: the job's own libraries, cold) and prints
the warm estimate's median over that import's (issue 35 item 6: the default estimate at most 0.6x of it).

    .venv/bin/python scripts/bench_estimate.py [--case gpt2|llama7b|small] [--iterations N] [--repeat R] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from xmem.trace import warm

GIB = 1 << 30
MIB = 1 << 20

GPT2_SCRIPT = """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(10):
        input_ids = torch.randint(0, 50257, (8, 1024), device="cuda")
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

LLAMA7B_SCRIPT = """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         intermediate_size=11008, vocab_size=32000)
    device = torch.device("cuda")
    model = LlamaForCausalLM(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for step in range(10):
        input_ids = torch.randint(0, 32000, (1, 2048), device=device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

SMALL_SCRIPT = """
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(10):
        loss = model(torch.randn(32, 256, device="cuda")).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

BENCH_GPUS = {"a100-80gb": "A100-SXM4-80GB", "h100": "H100-SXM5-80GB", "h200": "H200-141GB"}
GPU_ARGS = [arg for name in BENCH_GPUS for arg in ("--gpu", name)]

CASES = {
    "gpt2": (GPT2_SCRIPT, 3.0, None),  # (script, target seconds, target peak RSS bytes)
    "llama7b": (LLAMA7B_SCRIPT, 15.0, 2 * GIB),
    "small": (SMALL_SCRIPT, 2.5, None),
}
WARM_START_S = 300  # the most a warm server may take to load (niced, on a loaded machine)


@dataclass
class Run:
    case: str
    seconds: float
    max_process_rss: int
    max_tree_rss: int
    returncode: int
    result: dict
    mode: str = "cold"


def xmem_slurm_command() -> list[str]:
    """The installed console script beside this interpreter, else `python -m xmem.cli`."""
    script = Path(sys.executable).with_name("xmem-slurm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "xmem.cli"]


def tree_rss(root: int) -> int:
    """Sum of VmRSS over `root` and its live descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid, ppid = int(entry), int(fields.get("PPid", "0").strip() or 0)
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def run_case(case: str, workdir: Path, iterations: int, env: dict[str, str] | None = None, mode: str = "cold") -> Run:
    body, _, _ = CASES[case]
    script = workdir / f"train_{case}.py"
    script.write_text(textwrap.dedent(body))
    command = [*xmem_slurm_command(), "estimate", "--json", "--iterations", str(iterations),
               *GPU_ARGS, "--", sys.executable, str(script)]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    peak_tree = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_tree
        while not done.is_set():
            peak_tree = max(peak_tree, tree_rss(process.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(process.stdout.read()), daemon=True)
    err_chunks: list[bytes] = []
    err_reader = threading.Thread(target=lambda: err_chunks.append(process.stderr.read()), daemon=True)
    reader.start()
    err_reader.start()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    done.set()
    reader.join()
    err_reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    stdout = b"".join(out_chunks).decode()
    try:
        result = json.loads(stdout)
    except json.JSONDecodeError:
        result = {"error": "no JSON", "message": stdout[-500:] + b"".join(err_chunks).decode()[-2000:]}
    return Run(case, seconds, usage.ru_maxrss * 1024, peak_tree, process.returncode, result, mode)


def warm_env(directory: Path) -> dict[str, str]:
    return {**os.environ, warm.ENABLE_ENV: "1", warm.DIR_ENV: str(directory), warm.IDLE_ENV: "600"}


def cold_env() -> dict[str, str]:
    return {**os.environ, warm.ENABLE_ENV: "0"}


def first_warm_estimate(workdir: Path, directory: Path, iterations: int) -> Run:
    """The estimate that finds no server: it starts one in the background and runs cold. Returns once the server
    listens."""
    first = run_case("small", workdir, iterations, warm_env(directory), "first")
    deadline = time.monotonic() + WARM_START_S
    while time.monotonic() < deadline and not list(directory.glob("*.sock")):
        time.sleep(0.5)
    return first


def stop_servers(directory: Path) -> None:
    for pid in warm.server_pids(directory):
        os.kill(pid, signal.SIGTERM)


def cold_import_seconds(case: str) -> float:
    """Wall time of a fresh interpreter that only imports what the case's script imports."""
    imports = "\n".join(line for line in textwrap.dedent(CASES[case][0]).splitlines()
                        if line.startswith(("import ", "from ")))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", imports], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def print_medians(runs: list[Run], imports: dict[str, list[float]]) -> None:
    print("\nmedian wall s   " + "".join(f" {mode:>8}" for mode in ("cold", "warm", "import")) + "  warm/import")
    for case in dict.fromkeys(run.case for run in runs):
        cells = []
        for mode in ("cold", "warm"):
            times = [r.seconds for r in runs if r.case == case and r.mode == mode and r.returncode == 0]
            cells.append(statistics.median(times) if times else None)
        cells.append(statistics.median(imports[case]) if imports.get(case) else None)
        ratio = f"{cells[1] / cells[2]:.2f}x" if cells[1] and cells[2] else "-"
        print(f"{case:<16}" + "".join(f" {c:>8.2f}" if c else f" {'-':>8}" for c in cells) + f"  {ratio:>11}")


def peak_cell(gpu: dict | None) -> str:
    if not gpu:
        return "-"
    return f"{gpu['peak_bytes'] / GIB:.2f} GiB" + ("" if gpu["fits"] else " OOM" if gpu["oom"] else " >total")


def verdict(run: Run) -> str:
    _, target_s, target_rss = CASES[run.case]
    ok = run.returncode == 0 and run.seconds <= target_s
    if target_rss is not None:
        ok = ok and max(run.max_process_rss, run.max_tree_rss) <= target_rss
    return "meets target" if ok else "MISSES target"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--warm", action="store_true", help="compare cold estimates with warm-tracer ones")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="xmem-bench-"))
    sockets = Path(tempfile.mkdtemp(prefix="xwb-"))  # short: a socket's path holds at most 108 bytes
    runs: list[Run] = []
    imports: dict[str, list[float]] = {}
    try:
        if args.warm:
            runs.append(first_warm_estimate(workdir, sockets, args.iterations))
        for case in args.case or ["gpt2", "llama7b"]:
            for _ in range(args.repeat):
                runs.append(run_case(case, workdir, args.iterations, cold_env()))
                if args.warm:
                    runs.append(run_case(case, workdir, args.iterations, warm_env(sockets), "warm"))
                    imports.setdefault(case, []).append(cold_import_seconds(case))
    finally:
        stop_servers(sockets)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)

    header = f"{'case':<9} {'mode':<5} {'wall s':>7} {'max proc RSS':>13} {'max tree RSS':>13}" + "".join(
        f" {name:>16}" for name in BENCH_GPUS) + "  verdict"
    print(header)
    print("-" * len(header))
    for run in runs:
        gpus = run.result.get("gpus", {})
        cells = "".join(f" {peak_cell(gpus.get(canonical)):>16}" for canonical in BENCH_GPUS.values())
        print(f"{run.case:<9} {run.mode:<5} {run.seconds:>7.1f} {run.max_process_rss / MIB:>9.0f} MiB"
              f" {run.max_tree_rss / MIB:>9.0f} MiB{cells}  {verdict(run)}")
        if run.returncode != 0:
            print(f"  exit {run.returncode}: {run.result.get('error')}: {run.result.get('message')}")
        elif run.result.get("breakdown"):
            largest_first = sorted(run.result["breakdown"].items(), key=lambda kv: -kv[1])
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in largest_first)
            print(f"  breakdown (GiB) on {run.result.get('breakdown_gpu')}: {parts}")
    if args.warm:
        print_medians(runs, imports)
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
