#!/usr/bin/env python
"""What compiling changes in the estimate: the project's benchmark jobs estimated eagerly and with their model
compiled (`model.compile()` after the job builds it: scripts/compiled_job.py), one job per model of the data.

    .venv/bin/python scripts/bench_compiled.py --data benchmarks/data/xmem-dev.jsonl \
        --out benchmarks/results/compiled

For each model of the data (benchmarks/data/xmem-dev.jsonl, re-created by benchmarks/jobs/ as
scripts/bench_accuracy.py re-creates it) it takes one record: the median batch size among that model's records (the
smaller of the two middle ones), its optimizer, GPU type and capacity. Both programs are estimated for that GPU
(`xmem.estimate.estimate`, as the accuracy benchmark does), and OUT/estimates.jsonl gets one line per model and mode
(peak, the warnings that name a compiled region traced eagerly); OUT/table.md the table this prints: per model
family, the eager and compiled peaks and their difference. There is no GPU measurement of the compiled jobs: the
measured column is the eager job's, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from xmem.bench.records import Reference, Unreproducible, job_command, job_env, load_references
from xmem.config import EstimateSettings
from xmem.gpus import load_catalog

ROOT = Path(__file__).resolve().parent.parent
JOBS_DIR = ROOT / "benchmarks" / "jobs"
COMPILED_JOB = ROOT / "scripts" / "compiled_job.py"
GiB = 1 << 30


def one_record_per_model(refs: list[Reference]) -> list[Reference]:
    """Per model (in the data's order of first appearance), its record of median batch size that benchmarks/jobs can
    re-create."""
    chosen: list[Reference] = []
    for model in dict.fromkeys(ref.model for ref in refs):
        usable = sorted((ref for ref in refs if ref.model == model and _recreatable(ref)),
                        key=lambda ref: (ref.batch_size, ref.optimizer, ref.path))
        if usable:
            chosen.append(usable[(len(usable) - 1) // 2])
    return chosen


def _recreatable(ref: Reference) -> bool:
    try:
        job_command(ref, JOBS_DIR)
    except Unreproducible:
        return False
    return not ref.options


def commands(ref: Reference, python: str) -> dict[str, list[str]]:
    eager = job_command(ref, JOBS_DIR, python=python)
    return {"eager": eager, "compiled": [python, str(COMPILED_JOB), *eager[1:]]}


def estimate_one(ref: Reference, mode: str, command: list[str], iterations: int, timeout: float) -> dict:
    from xmem.estimate import estimate
    started = time.perf_counter()
    line = {"model": ref.model, "mode": mode, "gpu": ref.gpu_name, "batch_size": ref.batch_size,
            "optimizer": ref.optimizer, "measured_eager_bytes": ref.ground_bytes, "command": command}
    try:
        catalog = load_catalog({"gpus": {ref.gpu_name: {"total_bytes": ref.capacity_bytes}}})
        result = estimate(command, gpus=[ref.gpu_name], iterations=iterations, env={**os.environ, **job_env(ref)},
                          cwd=str(ROOT), timeout=timeout, settings=EstimateSettings(catalog))
    except Exception as error:  # noqa: BLE001 - a failed estimate is a row of the table, not a crash
        return {**line, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1:]}",
                "seconds": round(time.perf_counter() - started, 1)}
    (gpu,) = result.gpus.values()
    return {**line, "peak_bytes": gpu.peak_bytes, "peak_allocated_bytes": gpu.peak_allocated_bytes,
            "seconds": round(time.perf_counter() - started, 1),
            "compile_warnings": [w for w in result.warnings if w.startswith("torch.compile")]}


def table(lines: list[dict]) -> str:
    """Markdown: per model, eager and compiled peaks (GiB) and the compiled one's difference."""
    by_model: dict[str, dict[str, dict]] = {}
    for line in lines:
        by_model.setdefault(line["model"], {})[line["mode"]] = line
    rows = ["| model family | job | eager peak | compiled peak | difference | measured (eager) | compiled regions "
            "traced eagerly |", "|---|---|---:|---:|---:|---:|---|"]
    for model, modes in by_model.items():
        eager, compiled = modes.get("eager", {}), modes.get("compiled", {})
        job = f"{eager.get('optimizer', '?')}, batch {eager.get('batch_size', '?')}, {eager.get('gpu', '?')}"
        peaks = [mode.get("peak_bytes") for mode in (eager, compiled)]
        cells = [f"{p / GiB:.2f} GiB" if p else f"error: {mode.get('error', 'not run')}"
                 for p, mode in zip(peaks, (eager, compiled))]
        difference = f"{(peaks[1] - peaks[0]) / peaks[0]:+.1%}" if all(peaks) else "-"
        fallbacks = len(compiled.get("compile_warnings", []))
        rows.append(f"| {model} | {job} | {cells[0]} | {cells[1]} | {difference} | "
                    f"{eager.get('measured_eager_bytes', 0) / GiB:.2f} GiB | {fallbacks} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data" / "xmem-dev.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="directory for estimates.jsonl and table.md")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the jobs under the tracer")
    parser.add_argument("--jobs", type=int, default=1, help="estimates run at once (default 1)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per estimate (default 1800)")
    parser.add_argument("--only", default="", help="only models whose name contains this text")
    args = parser.parse_args(argv)
    refs = [ref for ref in one_record_per_model(load_references(args.data)) if args.only in ref.model]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [(ref, mode, command) for ref in refs for mode, command in commands(ref, args.python).items()]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(estimate_one, ref, mode, command, args.iterations, args.timeout)
                   for ref, mode, command in runs]
        lines = []
        for future in futures:
            lines.append(future.result())
            print(json.dumps({k: v for k, v in lines[-1].items() if k != "command"}), file=sys.stderr, flush=True)
    (args.out / "estimates.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = table(lines)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
