"""Measure what a trace costs: wall time of run_trace and peak RSS of the tracing child, per workload.

    .venv/bin/python scripts/bench_trace.py [gpt2] [gpt2-bf16] [llama7b] [llama7b-fp32] [--iterations 3] [--python PY]

Each workload is traced from a fresh parent process, so the child's peak RSS (getrusage RUSAGE_CHILDREN) is its own.
Prints one line per workload and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "gpt2": ["tests/scripts/gpt2_train.py"],  # GPT2LMHeadModel(GPT2Config()), B=8, T=1024, AdamW, fp32
    "gpt2-bf16": ["tests/scripts/gpt2_train.py", "--amp", "bf16"],
    "llama7b": ["tests/scripts/llama7b_train.py"],  # 7B Llama shape, B=1, T=2048, AdamW, bf16, checkpointing
    "llama7b-fp32": ["tests/scripts/llama7b_train.py", "--dtype", "fp32", "--checkpointing", "off"],
}


def measure(name: str, iterations: int, python: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from xmem.trace import run_trace
    marks: list[tuple[float, str]] = []
    started = time.monotonic()
    trace = run_trace(["python", *WORKLOADS[name]], iterations=iterations, python=python, cwd=str(ROOT),
                      on_progress=lambda message: marks.append((time.monotonic() - started, message)))
    wall = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = peak = 0
    for event in trace.events:
        live += event.nbytes if event.action == "alloc" else -event.nbytes if event.action == "free" else 0
        peak = max(peak, live)
    iteration_marks = [t for t, message in marks if message.startswith("iteration")]
    return {"workload": name, "iterations": trace.iterations, "run_trace_s": round(wall, 1),
            "program_s": round(trace.seconds, 1),
            "per_iteration_s": [round(b - a, 2) for a, b in zip(iteration_marks, iteration_marks[1:])],
            "child_peak_rss_mib": round(usage.ru_maxrss / 1024), "child_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "events": len(trace.events), "tensor_peak_gib": round(peak / 2**30, 2),
            "attention": sorted(op for op in trace.op_counts if "scaled_dot_product" in op)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the traced program")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.workloads[0], args.iterations, args.python)))
        return
    results = []
    for name in args.workloads:
        done = subprocess.run([sys.executable, __file__, "--one", name, "--iterations", str(args.iterations),
                               "--python", args.python], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{name}: run_trace {result['run_trace_s']} s (program {result['program_s']} s, iterations "
              f"{result['per_iteration_s']} s apart), child peak RSS {result['child_peak_rss_mib']} MiB, "
              f"tensor peak {result['tensor_peak_gib']} GiB, {result['events']} events")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
