"""`xmem-slurm filter`: the Python side of slurm/cli_filter.lua, run by sbatch as the submitting user.

Owns the entry point (`python -m xmem.slurm.filter`, also `xmem-slurm filter`), the `--wrap` script, and which
path a submission takes: none (no script, a CPU job, a hetjob), inline (xmem.slurm.inline: estimated now, or
from the cache), deferred (xmem.slurm.deferred: held and estimated as a CPU job), or inline unless not ready
within `[filter] wait_s` (xmem.slurm.handoff), then deferred where the site has a CPU partition, or put off
(xmem.slurm.putoff: the job's start put off, or fail-closed the job held, while the estimate goes on detached) where
it has none.
The JSON exchanged with the Lua side and the reply are xmem.slurm.contract's; parsing the script, the estimate and the
policy belong to xmem.jobscript, xmem.analyze and xmem.policy, and nothing here second-guesses them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from xmem.cache import NoSlotFree
from xmem.config import SiteConfig
from xmem.slurm import deferred
from xmem.slurm.cache_check import REWRITE_OPTIONS, still_offered
from xmem.slurm.cluster import test_only_refusal
from xmem.slurm.contract import (HETJOB_NOTICE, FilterReply, FilterRequest, Verdict, drop_user_settings, failure_reply,
                                 key_for, recorded, reply_for)
from xmem.slurm.handoff import hands_off, inline_or_handed_off
from xmem.slurm.putoff import put_off_reply, puts_off
from xmem.slurm.site_log import log_fault
from xmem.slurm.inline import (analysis_cache, analyze_submission, cache_hit, cached_analysis, command_files,
                               config_digest, estimate_slots, parse_job)


# --- the whole filter ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def wrapped_script(request: FilterRequest) -> Iterator[str | None]:
    """The batch script's path; for `sbatch --wrap CMD`, a temporary script holding CMD as sbatch builds it."""
    if request.script:
        yield request.script
        return
    if not request.options.get("wrap"):
        yield None
        return
    fd, path = tempfile.mkstemp(prefix="xmem-wrap-", suffix=".sh")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("#!/bin/sh\n# This script was created by sbatch --wrap.\n\n" + request.options["wrap"] + "\n")
        yield path
    finally:
        os.unlink(path)


def run_filter(request: FilterRequest, config: SiteConfig, *,
               analyzer: Callable[..., Verdict] = analyze_submission, started: float | None = None) -> FilterReply:
    """One submission, start to reply. The site `config`'s estimate timeout bounds the
    wait for an estimate slot and the estimate together, and `[filter] wait_s` the wait before a handoff, both
    counted from `started` (time.monotonic(): when sbatch started; default now). `analyzer`:
    `inline.analyze_submission`'s signature."""
    started = time.monotonic() if started is None else started
    deadline = started + config.estimate.timeout_s

    def timed_analyzer(script: str, req: FilterRequest, site: Any, **cancel: Any) -> Verdict:
        # the slot's wait counts against the deadline; the estimate still gets a second to say it timed out
        return analyzer(script, req, site, deadline=max(deadline, time.monotonic() + 1.0), **cancel)

    with wrapped_script(request) as script:
        if script is None:
            return FilterReply()
        job = parse_job(script, request)
        if request.hetjob or (job is not None and job.het_line):
            return FilterReply(message=HETJOB_NOTICE)
        if job is not None and not job.directives.wants_gpu:
            return FilterReply()  # a CPU job: no estimate, no change, no message
        try:
            return gpu_job_reply(script, command_files(job, request, script), request, config, timed_analyzer,
                                 job=job, handoff_at=started + config.filter.wait_s)
        except NoSlotFree as e:
            return failure_reply(str(e), request, config.failure)
        except OSError as e:
            return failure_reply(f"cannot read {e.filename}: {e.strerror}", request, config.failure)


def gpu_job_reply(script: str, files: list[str], request: FilterRequest, config: SiteConfig,
                  analyzer: Callable[..., Verdict], *, job: Any = None,
                  handoff_at: float | None = None) -> FilterReply:
    """A GPU job's reply: from the cache, else deferred when the site defers, else estimated now, or, where the
    site has a CPU partition, handed off to it when not ready by `handoff_at` (time.monotonic(); xmem.slurm.handoff);
    a rewrite Slurm would refuse is not made (`refused_rewrite`). `analyzer`: `inline.analyze_submission`'s
    signature, less the deadline."""
    cache, digest = analysis_cache(config), config_digest(config)
    key = key_for(script, request, digest, files)
    usable = lambda verdict: still_offered(verdict, job, config, request.user)  # noqa: E731
    missed = lambda: cache_hit(cache, key, usable) is None  # noqa: E731

    def analysis(cancel: threading.Event | None = None, slot_wait_s: float | None = None) -> Verdict:
        cancels = {"cancel": cancel} if cancel is not None else {}  # the test's analyzers need not take one
        return cached_analysis(script, request, config, cache=cache, config_digest=digest, files=files,
                               analyzer=lambda *a: analyzer(*a, **cancels), key=key, usable=usable,
                               slots=lambda: estimate_slots(config, cancel, slot_wait_s),
                               progress_limit_s=config.filter.wait_s if cancel else None)

    if deferred.deferring(config) and missed():
        return deferred.defer_reply(script, request, config)
    hand_off = None if handoff_at is None else _hand_off(script, request, config, handoff_at)
    if hand_off is not None and missed():
        # No waiting for a slot: with the user's estimates all running, the host is busy and the job goes at once
        verdict = inline_or_handed_off(lambda cancel: analysis(cancel, slot_wait_s=0.0), handoff_at, hand_off,
                                       waited_s=config.filter.wait_s)
        if isinstance(verdict, FilterReply):  # not ready in time: held for the CPU partition, or its start put off
            return verdict
    else:
        verdict = analysis()
    reply = reply_for(verdict, request, config.failure)
    return refused_rewrite(reply, job, request) or reply


def _hand_off(script: str, request: FilterRequest, config: SiteConfig,
              handoff_at: float) -> Callable[[str], tuple[FilterReply, Callable[[], None]]] | None:
    """Where a job whose estimate is not ready by `handoff_at` goes (the reply's maker, given why): held and
    estimated on the CPU partition (xmem.slurm.deferred), its start put off (fail-open) or the job held
    (fail-closed) while the estimate goes on detached (xmem.slurm.putoff: a site without one); None: nowhere, the
    estimate is waited for."""
    if hands_off(config, request):
        return lambda why: deferred.handoff_reply(script, request, config, why)
    if puts_off(config, request):
        sbatch_started = time.time() - (time.monotonic() - (handoff_at - config.filter.wait_s))  # as epoch seconds
        return lambda why: put_off_reply(script, request, config, why, sbatch_started)
    return None


# The options that decide where a job may run: with its new GPU request, what Slurm is asked to check.
PLACEMENT_OPTIONS = ("partition", "account", "qos", "reservation", "constraint", "nodes", "ntasks",
                     "ntasks-per-node", "nodelist", "exclude", "clusters")


def refused_rewrite(reply: FilterReply, job: Any, request: FilterRequest) -> FilterReply | None:
    """The reply to send instead of a rewrite Slurm would refuse (`sbatch --test-only` on the job's placement and
    the new GPU request): the job as the user wrote it, and why. None when the reply rewrites nothing, or Slurm
    takes the rewrite (or cannot be asked)."""
    rewritten = {o: v for o, v in reply.set.items() if o in REWRITE_OPTIONS}
    if not rewritten or job is None:
        return None
    written = {option: value for option, value, _ in job.directives.raw if value}  # the last one wins, as in sbatch
    placement = [f"--{o}={written[o]}" for o in PLACEMENT_OPTIONS if o in written]
    refusal = test_only_refusal(placement + [f"--{o}={v}" for o, v in rewritten.items()])
    if refusal is None:
        return None
    asked = ", ".join(f"--{o}={v}" for o, v in rewritten.items())
    line = f"Slurm would refuse the request xmem chose ({asked}: {refusal}); submitted as written"
    return FilterReply(set=recorded(line, request, state="unchanged"), message=line)


# --- entry point ------------------------------------------------------------------------------------------------

def filter_main(*, config_path: str | None = None, failure_mode: bool = False, stdin: IO[str] = sys.stdin,
                stdout: IO[str] = sys.stdout, started: float | None = None) -> int:
    """The whole `xmem-slurm filter` command: read the request, write the reply. Also reachable as
    `python -m xmem.slurm.filter`, which cli_filter.lua uses because it skips loading the other commands
    (a cached resubmission then costs a third of the CPU time). The config is the site's: `config_path` (what the
    admin wrote into cli_filter.lua), else /etc/xmem/xmem.toml; never the submitting user's $XMEM_CONFIG.
    `started`: when sbatch started (run_filter's)."""
    from xmem.config import load_site_config

    try:
        site = load_site_config(config_path, user_env=False)
    except Exception as e:  # the failure mode itself is unknown: the Lua side applies its default
        log_fault(f"site config: {e}")  # -- issue 32: to syslog, as its own [filter] log is unknown too
        if failure_mode:
            print(f"xmem-slurm filter: {e}", file=sys.stderr)
            return 3
        return _emit(stdout, FilterReply(fault=f"site config: {e}"))
    if failure_mode:
        print(site.failure, file=stdout)
        return 0
    try:
        request = FilterRequest.from_json(json.load(stdin))
    except (ValueError, TypeError, AttributeError) as e:
        log_fault(f"bad filter input: {e}", site.filter.log)
        return _emit(stdout, FilterReply(fault=f"bad filter input: {e}"))
    try:
        reply = run_filter(request, site, started=started)
    except Exception as e:  # a bug of ours must not look like the user's fault, nor stop the submission
        log_fault(f"internal error: {type(e).__name__}: {e} ({_where(e)}), script {request.script}", site.filter.log)
        reply = failure_reply(f"internal error: {type(e).__name__}: {e}", request, site.failure)
    return _emit(stdout, reply)


def _where(error: BaseException) -> str:
    """The file and line that raised `error`: what an admin's bug report needs."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "no traceback"


def _emit(stdout: IO[str], reply: FilterReply) -> int:
    stdout.write(json.dumps(reply.to_json(), ensure_ascii=True) + "\n")
    stdout.flush()
    return 0


def take_request(path: str) -> IO[str]:
    """The request cli_filter.lua wrote to `path`, which is deleted once read: a sbatch killed meanwhile leaves
    nothing behind in the temporary directory."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return io.StringIO(f.read())
    except OSError:
        return io.StringIO("")  # read as no request: a fault for the Lua side
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def watch_caller(pid: int, *, interval_s: float = 0.25, grace_s: float = 3.0) -> threading.Thread | None:
    """End this filter once `pid` (the sbatch waiting for its answer) is gone: killed with -9, its terminal
    closed. SIGTERM first, which a running trace turns into its own cleanup (xmem.trace.runner.sigterm_raises;
    the tracer's processes die with their parent), then an exit after `grace_s`. A pid reused meanwhile is told
    apart by its start time. None when nothing can be watched (no /proc)."""
    born = _start_time(pid)
    if born is None and not os.path.isdir("/proc/self"):
        return None

    def watch() -> None:
        while born is not None and _start_time(pid) == born:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)
    thread = threading.Thread(target=watch, name="xmem-watch-sbatch", daemon=True)
    thread.start()
    return thread


def age_s(pid: int) -> float | None:
    """Seconds since process `pid` started, by its start time in /proc against the boot clock the kernel counts it
    on; None when it is gone. Under a burst the filter itself may start seconds after sbatch: the user waits from
    sbatch's start."""
    ticks = _start_time(pid)
    if ticks is None or not ticks.isdigit():
        return None
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK"))


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (after the parenthesised name, which may hold spaces); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem.slurm.filter",
                                     description="xmem-slurm filter for cli_filter.lua (see slurm/README.md)")
    parser.add_argument("--failure-mode", action="store_true", help="print the site's failure mode")
    parser.add_argument("--config", default=None, help="site config (default: /etc/xmem/xmem.toml; never $XMEM_CONFIG)")
    parser.add_argument("--request", help="read the request from this file (deleted once read), not stdin")
    parser.add_argument("--sbatch-pid", type=int, help="end when this process (the waiting sbatch) is gone")
    args = parser.parse_args(argv)
    drop_user_settings(os.environ)  # the site's config alone decides (cli_filter.lua runs us in the user's env)
    started = None
    if args.sbatch_pid:
        watch_caller(args.sbatch_pid)
        started = time.monotonic() - (age_s(args.sbatch_pid) or 0.0)  # the wait counts from sbatch's start
    stdin = take_request(args.request) if args.request else sys.stdin
    return filter_main(config_path=args.config, failure_mode=args.failure_mode, stdin=stdin, started=started)


if __name__ == "__main__":
    sys.exit(main())
