#!/usr/bin/env python3
"""How much time xmem-slurm's cli_filter adds to `sbatch`, measured on the real dev cluster.

    .venv/bin/python scripts/bench_filter.py [--repeat 10] [--fresh 3] [--mode inline|partition|handoff] [--warm]
                                             [--burst N] [--json]

Starts its own dev cluster (scripts/slurm-dev-cluster.sh, LAB in a temporary directory, ports 6857/6858), submits
held jobs (they never run) and reports the median wall time of `sbatch` for:
  baseline   the GPU job through a slurm.conf without the cli_filter (same controller)
  cpu        a CPU job through the filter (parsed, no estimate)
  fresh      the GPU job with a fresh estimate (the script's bytes changed each time); with --mode partition
             (deferred, issue 5) the estimate is queued as a CPU job instead: this is sbatch's latency then;
             with --mode handoff, inline if ready within [filter] wait_s, else queued
  cached     the unchanged GPU job again (the analysis comes from the cache)
  with --warm, also (the filter's estimates through the warm tracer, xmem.trace.warm, in a socket directory of
  its own):
  warm-first the first fresh estimate: it finds no server, starts one in the background and runs cold
  warm       fresh estimates once the server listens
and the filter's share: each minus the baseline. `--burst N`: only N distinct GPU jobs at once, sbatch's p50/p95 and
the load average; with --mode handoff (issue 35 item 5) also how many were handed to the cpu partition and, once
their estimation jobs are done, how many carry an estimate-based request. Run as root (the dev cluster needs it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xmem.trace import warm

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "slurm-dev-cluster.sh"
PORT = 6857
TRAIN = """\
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(device)
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    loss = model(torch.randn(64, 512, device=device)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def sbatch_seconds(script: Path, env: dict[str, str], expect: str | None = None) -> float:
    """Wall time of one held submission; `expect`: a text the filter's line must contain (else say so)."""
    started = time.perf_counter()
    done = subprocess.run(["sbatch", "--hold", "--parsable", "-o", "/dev/null", str(script)], cwd=script.parent,
                          env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"sbatch failed: {done.stderr.strip()}")
    if expect is not None and expect not in done.stderr:
        print(f"note: {script.name} took {seconds:.2f} s and the filter said: {done.stderr.strip()}",
              file=sys.stderr)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="submissions per cheap case (median reported)")
    parser.add_argument("--fresh", type=int, default=3, help="submissions with a fresh estimate")
    parser.add_argument("--mode", choices=("inline", "partition", "handoff"), default="inline",
                        help="the dev cluster's estimation mode (handoff: inline, with a cpu partition to hand an "
                             "estimate not ready within [filter] wait_s to)")
    parser.add_argument("--warm", action="store_true", help="also fresh estimates through the warm tracer (with "
                        "--burst: one submission first, so that the burst finds the user's server listening)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="only: N distinct GPU jobs submitted at once (each a fresh estimate)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="xmem-bench-filter-") as tmp:
        lab, work = Path(tmp) / "lab", Path(tmp) / "work"
        work.mkdir()
        env = {**os.environ, "XMEM_SLURM": str(Path(sys.executable).parent / "xmem-slurm"),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "PWD": str(work)}
        env.pop("SLURM_JOB_ID", None)
        up = subprocess.run(["bash", str(CLUSTER), "up", "--lab", str(lab), "--port", str(PORT), "--mode", args.mode],
                            env=env,
                            capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            raise SystemExit(f"dev cluster did not start:\n{up.stderr}")
        env.update(re.findall(r"(\w+)=(\S+)", up.stdout.strip().splitlines()[-1].removeprefix("export ")))
        try:
            if args.burst:
                primed = prime_warm_server(work, env) if args.warm else None
                figures = measure_burst(work, env, args.burst)
                if primed is not None:
                    figures["burst"]["warm_server_start_s"] = primed
            else:
                figures = measure(lab, work, env, args.repeat, args.fresh, args.mode)
            if args.warm and not args.burst:
                figures.update(measure_warm(work, env, args.fresh, figures["baseline"]["median_s"]))
        finally:
            subprocess.run(["bash", str(CLUSTER), "down", "--lab", str(lab)], env=env, capture_output=True,
                           timeout=120)
    report(figures, args.json)


def measure(lab: Path, work: Path, env: dict[str, str], repeat: int, fresh: int, mode: str) -> dict[str, dict]:
    (work / "train.py").write_text(TRAIN)
    gpu = work / "gpu.sh"
    gpu.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    cpu = work / "cpu.sh"
    cpu.write_text("#!/bin/bash\n#SBATCH --ntasks=1\npython train.py\n")
    # The same controller through a slurm.conf without the cli_filter: the baseline sbatch.
    plain = lab / "etc-plain"
    plain.mkdir()
    conf = (lab / "etc" / "slurm.conf").read_text()
    (plain / "slurm.conf").write_text(re.sub(r"(?m)^CliFilterPlugins=.*\n", "", conf))
    (plain / "gres.conf").write_text((lab / "etc" / "gres.conf").read_text())
    plain_env = {**env, "SLURM_CONF": str(plain / "slurm.conf")}

    samples: dict[str, list[float]] = {"baseline": [], "cpu": [], "fresh": [], "cached": []}
    for _ in range(repeat):
        samples["baseline"].append(sbatch_seconds(gpu, plain_env))
        samples["cpu"].append(sbatch_seconds(cpu, env))
    for i in range(fresh):
        changed = work / f"gpu-{i}.sh"
        changed.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# variant {i}\npython train.py\n")
        samples["fresh"].append(sbatch_seconds(changed, env))
    if mode != "inline":
        sbatch_seconds(gpu, env, expect="queued" if mode == "partition" else None)
        wait_for_estimates(env)  # the estimation jobs fill the cache (handoff: if it was handed off)
    else:
        sbatch_seconds(gpu, env, expect="smallest fit")  # fill the cache
    for _ in range(repeat):
        samples["cached"].append(sbatch_seconds(gpu, env, expect="(cached estimate)"))
    return summary(samples, statistics.median(samples["baseline"]))


def measure_burst(work: Path, env: dict[str, str], count: int) -> dict[str, dict]:
    """`count` distinct GPU jobs submitted at the same moment, as a user's loop of sbatch calls in the background
    does: each needs a fresh estimate, and the host's estimate slots ([estimate] max_concurrent) queue them; a
    submission whose wait and estimate pass [estimate] timeout_s goes through unchanged (fail-open). Per job the
    sbatch wall time, and how many were estimated (the rest fell back, unchanged)."""
    from concurrent.futures import ThreadPoolExecutor

    (work / "train.py").write_text(TRAIN)
    scripts = []
    for i in range(count):
        path = work / f"burst-{i}.sh"
        path.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# burst {i}\npython train.py\n")
        scripts.append(path)

    def one(path: Path) -> tuple[float, str, str]:
        started = time.perf_counter()
        done = subprocess.run(["sbatch", "--hold", "--parsable", "-o", "/dev/null", str(path)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=900)
        return time.perf_counter() - started, done.stderr, done.stdout.strip().split(";")[0]

    with ThreadPoolExecutor(max_workers=count) as pool:
        results = list(pool.map(one, scripts))
    load = os.getloadavg()[0]  # as the last sbatch returned: what the burst itself costs the machine
    seconds = sorted(s for s, _, _ in results)
    figures = summary({"burst": seconds}, 0.0)
    handed_off = [job for _, said, job in results if "queued on partition" in said]
    figures["burst"].update(p95_s=round(seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))], 3),
                            estimated=sum("smallest fit" in said for _, said, _ in results),
                            handed_off=len(handed_off), load_1min=round(load, 1))
    if handed_off:  # each must end with an estimate-based request (state=done), none lost or left pending
        started = time.monotonic()
        wait_for_estimates(env)
        states = [deferred_state(env, job) for job in handed_off]
        figures["burst"].update(deferred_done=states.count("done"), deferred_s=round(time.monotonic() - started),
                                deferred_other=sorted(s for s in states if s != "done"))
    return figures


def prime_warm_server(work: Path, env: dict[str, str]) -> float:
    """With --burst --warm: one submission first, as the user's earlier sbatch or check would have made, so that the
    burst finds the user's warm tracer listening (the filter follows the site's `warm_tracer`, on by default).
    Returns how long that first submission and the server's start took."""
    started = time.monotonic()
    (work / "train.py").write_text(TRAIN)
    first = work / "prime.sh"
    first.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\n# primes the warm tracer\npython train.py\n")
    subprocess.run(["sbatch", "--hold", "--parsable", "-o", "/dev/null", str(first)], cwd=work, env=env,
                   capture_output=True, text=True, timeout=900)
    while time.monotonic() - started < 300 and not any(Path(s.socket).exists() for s in warm.servers()):
        time.sleep(0.5)
    return round(time.monotonic() - started, 1)


def deferred_state(env: dict[str, str], job: str) -> str:
    """The outcome deferred estimation wrote in the job's comment (`state=`), or what is missing."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                           timeout=30).stdout
    match = re.search(r"xmem:\S*\bstate=(\w+)", shown)
    return match.group(1) if match else "no-state"


def summary(samples: dict[str, list[float]], base: float) -> dict[str, dict]:
    """Per case: median, min, max, count, and what the filter adds to the baseline's median."""
    return {case: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3),
                   "max_s": round(max(v), 3), "n": len(v),
                   "added_s": round(statistics.median(v) - base, 3) if case != "baseline" else 0.0}
            for case, v in samples.items()}


def measure_warm(work: Path, env: dict[str, str], fresh: int, base: float) -> dict[str, dict]:
    """Fresh estimates through the warm tracer: the first (which starts the server), then `fresh` more."""
    sockets = Path(tempfile.mkdtemp(prefix="xwb-"))  # short: a socket's path holds at most 108 bytes
    warm_env = {**env, warm.ENABLE_ENV: "1", warm.DIR_ENV: str(sockets), warm.IDLE_ENV: "600"}
    samples: dict[str, list[float]] = {"warm-first": [], "warm": []}
    try:
        for i in range(fresh + 1):
            changed = work / f"gpu-warm-{i}.sh"
            changed.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# warm variant {i}\npython train.py\n")
            samples["warm" if i else "warm-first"].append(sbatch_seconds(changed, warm_env))
            deadline = time.monotonic() + 300
            while i == 0 and time.monotonic() < deadline and not list(sockets.glob("*.sock")):
                time.sleep(0.5)  # the server loads in the background
    finally:
        for pid in warm.server_pids(sockets):
            os.kill(pid, signal.SIGTERM)
        shutil.rmtree(sockets, ignore_errors=True)
    return summary(samples, base)


def wait_for_estimates(env: dict[str, str], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = subprocess.run(["squeue", "-h", "-o", "%j"], env=env, capture_output=True, text=True,
                               timeout=30).stdout.split()
        if not any(n.startswith("xmem-estimate-") for n in names):
            return
        time.sleep(1)
    raise SystemExit(f"estimation jobs still running after {timeout_s} s")


def report(figures: dict[str, dict], as_json: bool) -> None:
    load = os.getloadavg()[0]
    if as_json:
        print(json.dumps({"figures": figures, "load_average_1min": load}, indent=2))
        return
    print(f"sbatch wall time (load average {load:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'case':<10} {'median':>8} {'min':>8} {'max':>8} {'n':>3} {'added by filter':>16}")
    for case, f in figures.items():
        print(f"{case:<10} {f['median_s']:>7.2f}s {f['min_s']:>7.2f}s {f['max_s']:>7.2f}s {f['n']:>3} "
              f"{f['added_s']:>15.2f}s")
    if "burst" in figures:
        f = figures["burst"]
        print(f"burst: p50 {f['median_s']:.1f} s, p95 {f['p95_s']:.1f} s (load {f['load_1min']} as the last sbatch "
              f"returned); {f['estimated']} of {f['n']} estimated inline, {f['handed_off']} handed off, the rest "
              "submitted unchanged")
        if f["handed_off"]:
            print(f"handed off: {f['deferred_done']} released with an estimate-based request (state=done) within "
                  f"{f['deferred_s']} s of the burst; others: {f['deferred_other'] or 'none'}")


if __name__ == "__main__":
    main()
