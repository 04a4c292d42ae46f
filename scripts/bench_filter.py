#!/usr/bin/env python3
"""How much time xmem-slurm's cli_filter adds to `sbatch`, measured on the real dev cluster.

    .venv/bin/python scripts/bench_filter.py [--repeat 10] [--fresh 3] [--mode inline|partition|handoff] [--warm]
                                             [--burst N [--users U] [--record FILE]] [--json]

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
and the filter's share: each minus the baseline. `--burst N`: only N distinct GPU jobs at once (each its own script and
training arguments, dealt in turn to `--users` throw-away login users, 2 by default), sbatch's p50/p95 and the load
average; with --mode handoff (issue 35 item 5) also how many were handed to the cpu partition and, once
their estimation jobs are done, how many carry an estimate-based request. Run as root (the dev cluster needs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the burst's users are the tests' throw-away ones

from tests.throwaway_users import User, throwaway_users  # noqa: E402
from xmem.trace import warm  # noqa: E402

CLUSTER = REPO / "scripts" / "slurm-dev-cluster.sh"
PORT = 6857
TRAIN = """\
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(512, args.width), nn.ReLU(), nn.Linear(args.width, 10)).to(device)
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    loss = model(torch.randn(args.batch_size, 512, device=device)).sum()
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
    parser.add_argument("--users", type=int, default=2, metavar="U",
                        help="with --burst: the jobs come from U throw-away login users in turn (0: root's)")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="with --burst: write each submission's start, end, user and answer to FILE (JSON)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="xmem-bench-filter-") as tmp:
        os.chmod(tmp, 0o755)  # the burst's users reach the cluster's config and cache under it
        lab, work = Path(tmp) / "lab", Path(tmp) / "work"
        work.mkdir()
        bindir = site_install(Path(tmp) / "site") if args.burst and args.users else Path(sys.executable).parent
        env = {**os.environ, "XMEM_SLURM": str(bindir / "xmem-slurm"),
               "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "PWD": str(work)}
        env.pop("SLURM_JOB_ID", None)
        up = subprocess.run(["bash", str(CLUSTER), "up", "--lab", str(lab), "--port", str(PORT), "--mode", args.mode],
                            env=env,
                            capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            raise SystemExit(f"dev cluster did not start:\n{up.stderr}")
        env.update(re.findall(r"(\w+)=(\S+)", up.stdout.strip().splitlines()[-1].removeprefix("export ")))
        try:
            if args.burst:
                figures = burst(Path(tmp), env, args)
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


def site_install(prefix: Path) -> Path:
    """A site install every user can run, sharing this venv's packages (scripts/install.sh --packages-from, as the
    integration tests make): the burst's users run the filter and their jobs' `python` from it. Its bin folder."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--prefix", str(prefix), "--packages-from",
                           sys.prefix], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"no site install for the burst's users (--users 0: root's jobs):\n{done.stderr}")
    return prefix / "venv" / "bin"


@contextmanager
def burst_users(count: int) -> Iterator[list[User]]:
    """`count` throw-away login users (tests/throwaway_users.py), as the issue's burst has two users submitting;
    their warm tracers stopped at the end, before the users are removed."""
    with throwaway_users(*(f"bench{i}" for i in range(count))) as made:
        try:
            yield made
        finally:
            for user in made:
                for pid in warm.server_pids(Path(tempfile.gettempdir()) / f"xmem-warm-{user.uid}"):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGTERM)


def cluster_env(user: User, env: dict[str, str]) -> dict[str, str]:
    """A user's login environment with the dev cluster's PATH and SLURM_CONF."""
    return user.env({k: env[k] for k in ("PATH", "SLURM_CONF")})


def burst_jobs(users: list[User], count: int) -> list[tuple[User, Path]]:
    """`count` distinct GPU jobs, dealt to `users` in turn: each its own script, with its own training arguments
    (so that no two share an estimate), in its user's own work directory."""
    jobs = []
    for i in range(count):
        user = users[i % len(users)]
        work = user.home / "work"
        work.mkdir(exist_ok=True)
        (work / "train.py").write_text(TRAIN)
        path = work / f"burst-{i}.sh"
        path.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --width {1024 + 64 * i} "
                        f"--batch-size {32 + i}\n")
        for made in (work, work / "train.py", path):
            os.chown(made, user.uid, user.gid)
        jobs.append((user, path))
    return jobs


def measure_burst(jobs: list[tuple[User, Path]], env: dict[str, str], record: Path | None) -> dict[str, dict]:
    """The `jobs` submitted at the same moment, as users' loops of sbatch calls in the background do: each needs a
    fresh estimate, and the host's estimate slots ([estimate] max_concurrent) queue them; a submission whose wait
    and estimate pass [estimate] timeout_s goes through unchanged (fail-open). Per job the sbatch wall time, and how
    many were estimated (the rest fell back, unchanged). `record`: each submission's times, user and answer, as
    JSON, to set beside the filter's own timestamps."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[User, Path]) -> dict:
        user, path = job
        started = time.time()
        process = subprocess.Popen(user.argv("sbatch", "--hold", "--parsable", "-o", "/dev/null", str(path)),
                                   cwd=path.parent, env=cluster_env(user, env), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        out, err = process.communicate(timeout=900)
        return {"user": user.name, "script": path.name, "pid": process.pid, "start": started, "end": time.time(),
                "seconds": time.time() - started, "stderr": err, "job": out.strip().split(";")[0]}

    cpu_before = _children_cpu_s()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    load = os.getloadavg()[0]  # as the last sbatch returned: what the burst itself costs the machine
    # What the sbatch calls cost in CPU, with every process they waited for (the filters, their estimates,
    # post-submit's steps): not the machine's other work, nor the estimation jobs Slurm runs
    cpu_s = _children_cpu_s() - cpu_before
    seconds = sorted(r["seconds"] for r in results)
    figures = summary({"burst": seconds}, 0.0)
    handed_off = [r["job"] for r in results if "queued on partition" in r["stderr"]]
    figures["burst"].update(p95_s=round(seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))], 3),
                            estimated=sum("smallest fit" in r["stderr"] for r in results),
                            handed_off=len(handed_off), load_1min=round(load, 1),
                            users=len({r["user"] for r in results}), cpu_s=round(cpu_s, 1))
    if handed_off:  # each must end with an estimate-based request (state=done), none lost or left pending
        started = time.monotonic()
        wait_for_estimates(env)
        states = [deferred_state(env, job) for job in handed_off]
        figures["burst"].update(deferred_done=states.count("done"), deferred_s=round(time.monotonic() - started),
                                deferred_other=sorted(s for s in states if s != "done"))
    if record is not None:
        record.write_text(json.dumps(results, indent=1))
    return figures


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def burst(tmp: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, dict]:
    """--burst: the users, their distinct jobs, the warm tracers primed with --warm, then the burst itself."""
    root = User("root", 0, 0, tmp / "work")
    with burst_users(args.users) if args.users else contextlib.nullcontext([root]) as users:
        jobs = burst_jobs(users, args.burst)
        primed = prime_warm_servers(jobs[:len(users)], env) if args.warm else None
        figures = measure_burst(jobs, env, args.record)
    if primed is not None:
        figures["burst"]["warm_server_start_s"] = primed
    return figures


def prime_warm_servers(firsts: list[tuple[User, Path]], env: dict[str, str]) -> float:
    """With --burst --warm: one submission per user first (a held job of its own), as the user's earlier sbatch or
    check would have made, so that the burst finds each user's warm tracer listening (the filter follows the site's
    `warm_tracer`, on by default). Returns how long that took."""
    started = time.monotonic()
    for user, script in firsts:
        prime = script.with_name("prime.sh")
        prime.write_text(script.read_text() + "# primes the warm tracer\n")
        os.chown(prime, user.uid, user.gid)
        subprocess.run(user.argv("sbatch", "--hold", "--parsable", "-o", "/dev/null", str(prime)), cwd=prime.parent,
                       env=cluster_env(user, env), capture_output=True, text=True, timeout=900)
    listening = lambda: {s.uid for s in warm.servers() if Path(s.socket).exists()}  # noqa: E731
    while time.monotonic() - started < 300 and not {u.uid for u, _ in firsts} <= listening():
        time.sleep(0.5)
    return round(time.monotonic() - started, 1)


def deferred_state(env: dict[str, str], job: str) -> str:
    """The outcome deferred estimation wrote in the job's comment (`state=`, with its `why=` when not done), or what
    is missing."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                           timeout=30).stdout
    match = re.search(r"xmem:\S*\bstate=(\w+)", shown)
    if not match:
        return "no-state"
    why = re.search(r"xmem:\S*\bwhy=([^;\s]*)", shown)
    return match.group(1) if match.group(1) == "done" or not why else f"{match.group(1)}: {why.group(1)[:200]}"


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
              f"submitted unchanged; from {f['users']} user(s); the sbatch calls' CPU {f['cpu_s']} s in all")
        if f["handed_off"]:
            print(f"handed off: {f['deferred_done']} released with an estimate-based request (state=done) within "
                  f"{f['deferred_s']} s of the burst; others: {f['deferred_other'] or 'none'}")


if __name__ == "__main__":
    main()
