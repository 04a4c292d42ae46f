#!/usr/bin/env python
"""Score xmem-slurm's estimates against real GPU measurements, side by side with the recorded estimators.

    .venv/bin/python scripts/bench_accuracy.py --data benchmarks/data/xmem-dev.jsonl --out benchmarks/results/dev

For every record of the data (the xMem `evaluation_result.json` schema, or what scripts/measure_gpu.py writes), it
re-creates the job with benchmarks/jobs/, estimates it with `xmem.estimate.estimate` for the record's GPU type with
the record's total memory as capacity, and writes:

- OUT/estimates.jsonl: one line per record, `{"path", "estimate_bytes", "oom", "seconds"}` plus details (reserved,
  allocated, overhead, libraries, command); a record with no estimate carries `"error"`: why.
- OUT/summary.json: MRE, p90, under-estimate share, short-request share (the estimate with the site margin of
  `--config`, default etc/xmem.toml, still below the measured peak), OOM recall, PEF, MCP and median seconds, per
  model and overall,
  for us and for every estimator recorded in the data; the targets and whether they are met.
- OUT/accuracy.png: estimated vs measured, and the signed error distribution per estimator.

`--rescore` skips estimating and rebuilds summary, table and picture from an existing OUT/estimates.jsonl.
`--trace-cache DIR` keeps each job's trace there and reuses it: a re-run after a change that does not touch the
tracer (a new overhead calibration, a simulator fix) repeats everything after the trace. `seconds` then counts only
that part; the first run's full seconds stay in its own estimates.jsonl.
`--reference-stack` (the default) runs the jobs with the library stack they were measured with
(benchmarks/requirements-reference.txt: transformers 4.51.3), installed once into bench-out/reference-stack from PyPI
and put first on the path of a venv beside it (bench-out/reference-venv: that directory, then the interpreter's own
site-packages) that runs the jobs; `--no-reference-stack` runs them with the interpreter's own libraries.
Records whose job is identical (same command, environment, GPU type and capacity) are estimated once; the others
carry `"same_job_as"`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from xmem.bench.records import BadRecord, Reference, Unreproducible, job_command, job_env, load_references
from xmem.bench.report import BenchResult, print_table, summary, write_picture
from xmem.config import ConfigError, EstimateSettings, load_site_config
from xmem.gpus import find_gpu, load_catalog

ROOT = Path(__file__).resolve().parent.parent
JOBS_DIR = ROOT / "benchmarks" / "jobs"
REFERENCE_REQUIREMENTS = ROOT / "benchmarks" / "requirements-reference.txt"
REFERENCE_STACK = ROOT / "bench-out" / "reference-stack"


def reference_stack(python: str, requirements: Path = REFERENCE_REQUIREMENTS, target: Path = REFERENCE_STACK) -> Path:
    """`target` holding exactly the pinned `requirements`, installed with `python`'s pip when missing or stale."""
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    marker = target / ".requirements-sha256"
    if marker.is_file() and marker.read_text() == digest:
        return target
    shutil.rmtree(target, ignore_errors=True)
    command = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), "-r", str(requirements)]
    print(f"bench_accuracy: installing the reference stack: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    marker.write_text(digest)
    return target


def reference_interpreter(python: str, stack: Path) -> str:
    """An interpreter whose site-packages are `stack` first, then `python`'s own (a venv with one .pth file): the jobs
    import the reference stack as installed libraries, as a user's venv would give them, instead of from PYTHONPATH,
    which the warm tracer (xmem.trace.warm) does not preload from."""
    venv = stack.parent / "reference-venv"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    interpreter = venv / "bin" / "python"
    if not interpreter.exists():
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    own = subprocess.run([str(interpreter), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    # a .pth line is a path, or code when it starts with "import": addsitedir also reads the venv's own .pth files
    (Path(own) / "reference-stack.pth").write_text(f"{stack}\nimport site; site.addsitedir({purelib!r})\n")
    return str(interpreter)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def use_trace_cache(directory: Path) -> None:
    """Make this process's estimates read and write traces in `directory` (keyed by everything run_trace gets)."""
    import xmem.estimate
    from xmem.trace.events import Trace

    trace = xmem.estimate.run_trace
    if getattr(trace, "cache_directory", None) == directory:
        return

    def cached_trace(command, **kwargs):
        env = kwargs.get("env") or {}
        gpu = kwargs.get("gpu")  # the fake GPU the program is shown (its capability picks the kernels)
        shown = [gpu.name, gpu.total_bytes, list(gpu.capability)] if gpu is not None else []
        key = json.dumps([command, kwargs.get("iterations"), shown,
                          {k: v for k, v in env.items() if k.startswith(("PYTORCH_", "CUDA", "CUBLAS", "PYTHONPATH"))}])
        path = directory / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
        if path.is_file():
            return Trace.load(path)
        result = trace(command, **kwargs)
        result.save(path)
        return result

    cached_trace.cache_directory = directory
    xmem.estimate.run_trace = cached_trace


def estimate_record(ref: Reference, python: str, iterations: int, timeout: float,
                    trace_cache: Path | None = None) -> BenchResult:
    """Our estimate of one record; any failure becomes the result's `error` (the run goes on)."""
    try:
        command = job_command(ref, JOBS_DIR, python=python)
    except Unreproducible as e:
        return BenchResult(ref.path, error=f"job not re-creatable: {e}")
    from xmem.estimate import estimate

    if trace_cache is not None:
        use_trace_cache(trace_cache)

    env = {**os.environ, **job_env(ref)}
    started = time.perf_counter()
    try:  # the catalog load is part of an estimate, as in `xmem-slurm estimate`, and may fail like it
        catalog = load_catalog({"gpus": {ref.gpu_name: {"total_bytes": ref.capacity_bytes}}})
        result = estimate(command, gpus=[ref.gpu_name], iterations=iterations, env=env, cwd=str(ROOT),
                          timeout=timeout, settings=EstimateSettings(catalog))
    except Exception as e:  # noqa: BLE001 - a failed estimate is a benchmark result, not a crash
        return BenchResult(ref.path, seconds=time.perf_counter() - started,
                           error=f"estimate failed: {type(e).__name__}: {last_line(str(e))}",
                           details={"command": command})
    seconds = time.perf_counter() - started
    (gpu,) = result.gpus.values()
    context = find_gpu(gpu.gpu, catalog).context_bytes
    return BenchResult(
        ref.path, estimate_bytes=gpu.peak_bytes, oom=not gpu.fits, seconds=seconds,
        details={"gpu": gpu.gpu, "peak_reserved_bytes": gpu.peak_reserved_bytes,
                 "peak_allocated_bytes": gpu.peak_allocated_bytes, "overhead_bytes": gpu.overhead_bytes,
                 "context_bytes": context,
                 "libraries": list(result.libraries), "breakdown": result.breakdown,
                 "warnings": list(result.warnings), "command": command},
    )


def job_key(ref: Reference) -> tuple:
    try:
        command = tuple(job_command(ref, JOBS_DIR))
    except Unreproducible:
        command = (ref.path,)  # its own key: each such record reports its reason
    return command, tuple(sorted(job_env(ref).items())), ref.gpu_name, ref.capacity_bytes


def interleaved(refs: list[Reference]) -> list[Reference]:
    """Round-robin over (model, optimizer), so that a run stopped early still covers every kind of job."""
    groups: dict[tuple, list[Reference]] = {}
    for ref in refs:
        groups.setdefault((ref.model, ref.optimizer), []).append(ref)
    queues = list(groups.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def run_estimates(refs: list[Reference], jobs: int, python: str, iterations: int, timeout: float,
                  out_file: Path, trace_cache: Path | None = None) -> dict[str, BenchResult]:
    """Estimate every distinct job once, `jobs` at a time, appending each record's line as it comes."""
    by_job: dict[tuple, list[Reference]] = {}
    for ref in interleaved(refs):
        by_job.setdefault(job_key(ref), []).append(ref)
    results: dict[str, BenchResult] = {}
    out_file.write_text("")
    with ProcessPoolExecutor(max_workers=jobs) as pool, out_file.open("a") as sink:
        futures = {pool.submit(estimate_record, same[0], python, iterations, timeout, trace_cache): same
                   for same in by_job.values()}
        for done, future in enumerate(as_completed(futures), start=1):
            same = futures[future]
            first = future.result()
            for ref in same:
                result = first if ref is same[0] else BenchResult(
                    ref.path, first.estimate_bytes, first.oom, first.seconds, first.error,
                    {**first.details, "same_job_as": same[0].path})
                results[ref.path] = result
                sink.write(json.dumps(result.to_json()) + "\n")
            sink.flush()
            ref = same[0]
            figure = (f"{first.estimate_bytes / 2**30:.2f} GiB vs {ref.ground_bytes / 2**30:.2f}"
                      if first.estimate_bytes is not None else f"ERROR {first.error}")
            print(f"[{done}/{len(by_job)}] {ref.model} {ref.optimizer} b{ref.batch_size} x{len(same)}: {figure} "
                  f"({first.seconds or 0:.1f} s)", flush=True)
    return results


def previous_estimation(summary_file: Path) -> dict | None:
    """The `estimation` account (command, date, jobs, wall seconds) of the run whose estimates are rescored."""
    try:
        return json.loads(summary_file.read_text()).get("estimation")
    except (OSError, ValueError, AttributeError):
        return None


def read_results(path: Path) -> dict[str, BenchResult]:
    return {r.path: r for r in (BenchResult.from_json(json.loads(line))
                                for line in path.read_text().splitlines() if line.strip())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="JSONL of reference measurements")
    parser.add_argument("--out", type=Path, required=True, help="directory for estimates.jsonl, summary.json, png")
    parser.add_argument("--jobs", type=int, default=1, help="estimates run at once (default 1)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the jobs under the tracer")
    parser.add_argument("--iterations", type=int, default=3, help="training iterations to trace (default 3)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per estimate (default 1800)")
    parser.add_argument("--only", default="", help="estimate only records whose model contains this text")
    parser.add_argument("--rescore", action="store_true", help="reuse OUT/estimates.jsonl, do not estimate")
    parser.add_argument("--trace-cache", type=Path, help="directory to keep and reuse the jobs' traces")
    parser.add_argument("--config", type=Path, default=ROOT / "etc" / "xmem.toml",
                        help="site configuration whose [margin] the short-request share applies "
                             "(default etc/xmem.toml)")
    parser.add_argument("--reference-stack", action=argparse.BooleanOptionalAction, default=True,
                        help="run the jobs with the measured library stack (default; see the module docstring)")
    args = parser.parse_args(argv)

    try:
        margin = load_site_config(args.config).margin
    except (OSError, ConfigError) as e:
        print(f"bench_accuracy: cannot read the site configuration: {e}", file=sys.stderr)
        return 2
    try:
        refs = load_references(args.data)
    except (OSError, BadRecord) as e:
        print(f"bench_accuracy: cannot read the data: {e}", file=sys.stderr)
        return 2
    if args.only:
        refs = [r for r in refs if args.only.lower() in r.model.lower()]
    duplicates = len(refs) - len({r.path for r in refs})
    if duplicates:
        print(f"bench_accuracy: {duplicates} records repeat a path; each path is estimated once", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    estimates_file = args.out / "estimates.jsonl"
    started = time.perf_counter()
    if args.rescore:
        if not estimates_file.is_file():
            print(f"bench_accuracy: --rescore needs {estimates_file}; run without --rescore first", file=sys.stderr)
            return 2
        results = read_results(estimates_file)
    else:
        unique = list({r.path: r for r in refs}.values())
        if args.trace_cache:
            args.trace_cache.mkdir(parents=True, exist_ok=True)
        if args.reference_stack:
            try:
                stack = reference_stack(args.python)
            except (OSError, subprocess.CalledProcessError) as e:
                print(f"bench_accuracy: cannot install the reference stack ({e}); "
                      "install it by hand or pass --no-reference-stack", file=sys.stderr)
                return 2
            args.python = reference_interpreter(args.python, stack)
        results = run_estimates(unique, args.jobs, args.python, args.iterations, args.timeout, estimates_file,
                                args.trace_cache)

    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.rescore:  # the estimates, their seconds and wall time are the earlier run's: keep its account
        estimation = previous_estimation(args.out / "summary.json")
    else:
        estimation = {"command": command, "date": now, "jobs": args.jobs, "reference_stack": args.reference_stack,
                      "wall_seconds": round(time.perf_counter() - started, 1)}
    meta = {
        "data": str(args.data),
        "command": command,
        "date": now,
        "estimation": estimation,
        "margin": {"relative": margin.relative, "absolute_bytes": margin.absolute_bytes, "config": str(args.config)},
    }
    report = summary(refs, results, meta, needed=margin.needed)
    (args.out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    write_picture(refs, results, args.out / "accuracy.png")
    print_table(report)
    for missing in report["not_estimated"]:
        print(f"not estimated: {missing['path']}: {missing['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
