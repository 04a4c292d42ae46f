"""Measure what a trace costs: wall time of run_trace and peak RSS of the tracing child, per workload.

    .venv/bin/python scripts/bench_trace.py [WORKLOAD...] [--iterations 3] [--python PY] [--phases]

Workloads: gpt2, gpt2-bf16, llama7b, llama7b-fp32 (tests/scripts) and the dev benchmark's gpt2-dev (GPT-2 8x1024,
AdamW) and cnn-dev (ResNet-101, SGD, batch 32). Each is traced from a fresh parent process, so the child's peak RSS
(getrusage RUSAGE_CHILDREN) is its own. Prints one line per workload and a JSON summary.

`--phases` profiles instead: the trace runs in the measuring process itself (no sandbox, no runner), so each phase
gets its process CPU time as well as its wall time (on a loaded machine CPU time is the steadier figure): start-up
(the shim, torch, the program's imports and model build), each iteration, and then the estimate's replays on every
catalog GPU type. It also reports FakeTensorMode's dispatch cache (hits, misses, bypasses by reason).
"""

from __future__ import annotations

import argparse
import json
import os
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
    "gpt2-dev": ["benchmarks/jobs/transformer.py", "--model", "openai-community/gpt2", "--optimizer", "AdamW",
                 "--batch-size", "8"],
    "cnn-dev": ["benchmarks/jobs/cnn.py", "--model", "resnet101", "--optimizer", "SGD", "--batch-size", "32"],
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


def phases(name: str, iterations: int) -> dict:
    """Wall and CPU seconds per phase of one trace run in this process, the dispatch cache's figures, and the
    post-trace time of an estimate on every catalog GPU type (orchestrate and replay)."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    from xmem.trace.child.main import trace_program
    from xmem.trace.runner import fake_gpu
    marks: list[tuple[str, float, float]] = []
    trace = trace_program(list(WORKLOADS[name]), iterations, fake_gpu(), 1,
                          lambda message: marks.append((message, time.monotonic(), time.process_time())))
    marks.append(("end", time.monotonic(), time.process_time()))
    names = ["start-up" if message == "loading fake CUDA" else message for message, _, _ in marks]
    steps = {names[i]: {"wall_s": round(b[1] - a[1], 2), "cpu_s": round(b[2] - a[2], 2)}
             for i, (a, b) in enumerate(zip(marks, marks[1:]))}
    from torch._subclasses.fake_tensor import FakeTensorMode
    cache = FakeTensorMode.cache_info()
    return {"workload": name, "phases": _merge_start_up(steps), "events": len(trace.events),
            "ops": sum(trace.op_counts.values()), "post_trace": _post_trace(trace),
            "repeats_previous": _repeats_previous(trace),
            "dispatch_cache": {"hits": cache.hits, "misses": cache.misses, "bypasses": dict(cache.bypasses)}}


def _merge_start_up(steps: dict[str, dict]) -> dict[str, dict]:
    """One start-up phase: everything before the first forward (the child's marks in between are its own business)."""
    merged: dict[str, dict] = {"start-up": {"wall_s": 0.0, "cpu_s": 0.0}}
    seen_training = False
    for name, figures in steps.items():
        seen_training = seen_training or name == "training started"
        if seen_training:
            merged["iteration 1" if name == "training started" else _next_iteration(name)] = figures
        else:
            for key in figures:
                merged["start-up"][key] = round(merged["start-up"][key] + figures[key], 2)
    return merged


def _next_iteration(mark: str) -> str:
    """The phase that starts at the mark "iteration k/N" is iteration k+1 (the last one ends the trace: "stop")."""
    done, _, target = mark.removeprefix("iteration ").partition("/")
    return "stop" if done == target else f"iteration {int(done) + 1}"


def _repeats_previous(trace) -> dict[str, bool]:
    """For each iteration after the first: whether its events repeat the previous iteration's, event for event
    (action, size, stream, op; a free named by how many events of its iteration back its block was made, or as
    older). What an early stop would need to see before it could assume the next iteration repeats too."""
    by_iteration: dict[int, list] = {}
    for event in trace.events:
        by_iteration.setdefault(event.iteration, []).append(event)

    def shape(events: list) -> list[tuple]:
        born: dict[int, int] = {}
        rows = []
        for index, e in enumerate(events):
            if e.action == "alloc":
                born[e.block] = index
            back = index - born[e.block] if e.action == "free" and e.block in born else None
            rows.append((e.action, e.nbytes, e.stream, e.op, back))
        return rows
    done = sorted(i for i in by_iteration if i >= 0)
    return {f"{b + 1} repeats {a + 1}": shape(by_iteration[a]) == shape(by_iteration[b])
            for a, b in zip(done, done[1:])}


def _post_trace(trace) -> dict:
    from xmem.estimate import estimate_traces
    from xmem.gpus import load_catalog
    catalog = load_catalog()
    started = time.monotonic(), time.process_time()
    result = estimate_traces(("python", "job.py"), {"sm80+": trace, "pre-sm80": trace}, list(catalog.values()),
                             env={})
    return {"gpu_types": len(result.gpus), "wall_s": round(time.monotonic() - started[0], 3),
            "cpu_s": round(time.process_time() - started[1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the traced program")
    parser.add_argument("--phases", action="store_true", help="time each phase in-process (CPU and wall), see above")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = phases(args.workloads[0], args.iterations) if args.phases else \
            measure(args.workloads[0], args.iterations, args.python)
        print(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # the traced program may leave threads behind, as in the tracing child
    if args.phases:
        for name in args.workloads:
            _print_phases(name, args.iterations)
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


def _print_phases(name: str, iterations: int) -> None:
    done = subprocess.run([sys.executable, __file__, "--one", "--phases", name, "--iterations", str(iterations)],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0 or not done.stdout.strip():
        print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:]}")
        return
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for phase, figures in result["phases"].items():
        print(f"{name}: {phase:12s} wall {figures['wall_s']:6.2f} s  cpu {figures['cpu_s']:6.2f} s")
    post, cache = result["post_trace"], result["dispatch_cache"]
    print(f"{name}: post-trace   wall {post['wall_s']:6.2f} s  cpu {post['cpu_s']:6.2f} s  ({post['gpu_types']} GPU "
          f"types); {result['ops']} ops, {result['events']} events; dispatch cache {cache['hits']} hits, "
          f"{cache['misses']} misses, bypasses {cache['bypasses']}; {result['repeats_previous']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
