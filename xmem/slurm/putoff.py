"""Put-off starts (issue 35 item 5): sbatch within `[filter] wait_s` where the site fails open and names no CPU
partition. An inline estimate not ready within the wait goes on detached on the submit host, as the user, while the
job waits in Slurm with its start put off (`begin` = the estimate's deadline plus `[filter] put_off_margin_s`); once
done it rewrites the pending job (the GPU request, the comment's stamp) and brings its start back to the user's own
`--begin`, or now.

Owns which submissions are put off (`puts_off`), the filter's reply for them (`put_off_reply`: the spool, the start,
the user's line), and the detached estimate (`run`, started by the spool's submit.sh from post-submit). Fail-open by
construction: Slurm itself starts a job nothing came back for (the estimate failed, died, or was killed), unchanged,
at its put-off time; its comment still says `state=pending`, which the Epilog records as a failed estimate. Not for a
fail-closed site (its job would run unestimated: the filter waits for the estimate there, as before), nor where a
user's own `--begin` cannot be read (SLURM_TIME_FORMAT set to another format). A user's own `--begin` later than the
put-off time is kept as it is. The detached estimate's cancel is the job's: once the job is no longer pending
(scancel, or started at its put-off time) the estimate stops; its progress is the comment's (`xmem-slurm status`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from xmem.config import SiteConfig
from xmem.slurm import deferred
from xmem.slurm.contract import (MESSAGE_MAX_CHARS, FilterReply, FilterRequest, drop_user_settings, failure_reply,
                                 reply_for, user_request)
from xmem.slurm.scontrol import scontrol_show_job
from xmem.slurm.stamp import JobStamp, add_to_comment
from xmem.text import one_line

# How often the detached estimate asks whether its job still waits (the job's scancel is the estimate's cancel); it
# also touches the spool, so that the sweep of spools nobody uses (an hour old) never takes a running one.
WATCH_S = 5.0
# The form Slurm prints times in unless SLURM_TIME_FORMAT says otherwise (slurm_make_time_str's "%FT%T"), which
# --begin and scontrol's StartTime also take.
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"
START_FILE = "start.json"  # in the spool: when the estimate must be done, and the start to bring back
RUNNER_FILE = "runner.json"  # in the spool: the detached estimate's pid, while it runs


@dataclasses.dataclass(frozen=True)
class Start:
    """A put-off job's timing: the estimate's deadline (epoch seconds), the put-off begin it got (None: the user's
    own later --begin was kept), and the start to bring back once the estimate is done (the user's own, or now)."""

    estimate_until: float
    put_off: str | None
    start_at: str

    @classmethod
    def of(cls, request: FilterRequest, config: SiteConfig, sbatch_started: float) -> Start:
        until = sbatch_started + config.estimate.timeout_s
        put_off = until + config.filter.put_off_margin_s
        own = users_begin(request)
        if own is not None and own >= put_off:
            return cls(until, None, "")
        return cls(until, _slurm_time(put_off), request.options["begin"] if own is not None else "now")


class UnreadableBegin(ValueError):
    """The user's --begin is in a form this side does not read (SLURM_TIME_FORMAT): whether it is later than the
    put-off time cannot be told."""


def users_begin(request: FilterRequest) -> float | None:
    """The user's own --begin (as sbatch reports it to cli_filter: an absolute time), in epoch seconds; None when
    none was given. UnreadableBegin when it is not in Slurm's default form."""
    given = request.options.get("begin")
    if not given:
        return None
    try:
        return datetime.strptime(given, SLURM_TIME).timestamp()
    except ValueError:
        raise UnreadableBegin(given) from None


def _slurm_time(epoch: float) -> str:
    return datetime.fromtimestamp(int(epoch) + 1).strftime(SLURM_TIME)  # rounded up: never before the deadline


def puts_off(config: SiteConfig, request: FilterRequest) -> bool:
    """Whether an estimate not ready within `[filter] wait_s` goes on detached with the job's start put off: the
    site's `[filter] put_off`, inline mode, no CPU partition, a fail-open site, and a submission whose --begin (if
    any) can be read and post-submit can start the estimate for (deferred.cannot_defer)."""
    if not config.filter.put_off or config.deferred.mode != "inline" or config.deferred.cpu_partition \
            or config.failure != "open":
        return False
    try:
        users_begin(request)
    except UnreadableBegin:
        return False
    return deferred.cannot_defer(request) is None


# --- in the filter: the reply ------------------------------------------------------------------------------------

def put_off_reply(script: str, request: FilterRequest, config: SiteConfig, why: str,
                  sbatch_started: float) -> tuple[FilterReply, Callable[[], None]]:
    """The reply for a submission whose inline estimate was not ready in time (`why`: "not ready within 4 s", ...):
    its start put off (unless its own --begin is later), its comment pending, the spool for post-submit; and the
    function that removes the spool again, should the estimate answer inline after all. `sbatch_started`: epoch
    seconds (the estimate's deadline counts from there, as inline)."""
    token, spool = deferred.snapshot(script, request, config)
    start = Start.of(request, config, sbatch_started)
    (spool / START_FILE).write_text(json.dumps(dataclasses.asdict(start)))
    (spool / deferred.SUBMIT_SCRIPT).write_text(submit_script(spool, config))
    until = datetime.fromtimestamp(start.estimate_until).strftime("%H:%M:%S")
    when = f"the job's start is put off to {start.put_off[11:]} until it is done" if start.put_off else \
        "the job keeps its own later start"
    message = (f"GPU memory estimate {why}, goes on in the background until {until}: {when}; "
               f"without one it starts unchanged (xmem-slurm status JOBID)")
    was = user_request(request.options) or "none"
    pairs = deferred.state_pairs("pending", was, why=message)
    comment = add_to_comment(request.options.get("comment"), JobStamp(), pairs)
    options = {"comment": comment, **({"begin": start.put_off} if start.put_off else {})}
    return FilterReply(set=options, message=message, defer=str(spool)), lambda: deferred.remove_spool(spool)


def submit_script(spool: Path, config: SiteConfig, python: str = sys.executable) -> str:
    """The script post-submit runs (cli_filter.lua: `sh SPOOL/submit.sh JOBID`): the detached estimate started in
    a session of its own (setsid: no terminal's hangup, no signal to sbatch's process group reaches it; nothing ties
    it to sbatch, which returns at once), its output in the spool. It exits 0 once started: a put-off job needs
    nothing from the Lua side whatever happens next."""
    site = ["--config", config.source] if config.source else []
    command = shlex.join([python, "-I", "-m", "xmem.slurm.putoff", *site, str(spool)])
    log = shlex.quote(str(spool / "estimate.out"))
    return "\n".join([
        "#!/bin/sh",
        "# xmem-slurm: the estimate of job $1 goes on detached, its start put off meanwhile (cli_filter.lua)",
        "job=$1",
        "case $job in ''|*[!0-9]*) exit 1 ;; esac",
        "detach=; command -v setsid >/dev/null 2>&1 && detach=setsid",
        f'$detach {command} "$job" </dev/null >{log} 2>&1 &',
        "exit 0",
        ""])


# --- the detached estimate -----------------------------------------------------------------------------------------

def run(spool: Path, job_id: str, config: SiteConfig) -> str:
    """The detached estimate of a put-off job: the cached analysis, bounded by the deadline of the submission's, in
    one of the user's estimate slots; then its answer written to the pending job and its start brought back. Stops
    when the job no longer waits (cancelled, or started at its put-off time). Returns what happened, one line."""
    from xmem.slurm.cache_check import still_offered
    from xmem.slurm.inline import analysis_cache, analyze_submission, cached_analysis, command_files, config_digest, \
        estimate_slots, parse_job

    (spool / RUNNER_FILE).write_text(json.dumps({"pid": os.getpid(), "job": job_id}))
    request, original = deferred.load_request(spool)
    start = Start(**json.loads((spool / START_FILE).read_text()))
    deadline = time.monotonic() + max(1.0, start.estimate_until - time.time())
    cancel = threading.Event()
    watch = threading.Thread(target=_watch_job, args=(job_id, spool, cancel), name="xmem-watch-job", daemon=True)
    watch.start()
    job = parse_job(request.script, request)
    analysis = cached_analysis(
        request.script, request, config, cache=analysis_cache(config), config_digest=config_digest(config),
        files=command_files(job, request, original),
        analyzer=lambda *a: analyze_submission(*a, deadline=deadline, cancel=cancel),
        slots=lambda: estimate_slots(config, cancel, max(0.0, deadline - time.monotonic())),
        usable=lambda verdict: still_offered(verdict, job, config, request.user))
    if cancel.is_set() or not _pending(job_id):
        return f"job {job_id} no longer waits: its estimate is not used"
    return deferred.apply(job_id, reply_for(analysis, request, "open"), request, config, start_at=start.start_at)


def _watch_job(job_id: str, spool: Path, cancel: threading.Event) -> None:
    """Set `cancel` once the job no longer waits; touch the spool meanwhile (deferred's sweep spares it)."""
    while not cancel.wait(WATCH_S):
        try:
            os.utime(spool)
        except OSError:
            pass
        if not _pending(job_id):
            cancel.set()


def _pending(job_id: str) -> bool:
    """Whether the job still waits; a Slurm that cannot be asked right now counts as yes (asked again later)."""
    try:
        return scontrol_show_job(job_id).get("JobState") == "PENDING"
    except LookupError:
        return False
    except Exception:  # noqa: BLE001 - a busy controller or a timeout: no reason to stop the estimate
        return True


def fail_open(spool: Path, job_id: str, why: str) -> str:
    """A detached estimate that failed in a way it can say: the job gets its start back unchanged, the failure in
    its comment (what it would have got at its put-off time anyway, sooner)."""
    request, original = deferred.load_request(spool)
    start = Start(**json.loads((spool / START_FILE).read_text()))
    if not _pending(job_id):
        return f"job {job_id} no longer waits: nothing to do"
    reply = failure_reply(why, dataclasses.replace(request, script=original), "open")
    return deferred.apply(job_id, reply, request, None, start_at=start.start_at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem.slurm.putoff", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="the site config (default: /etc/xmem/xmem.toml; never $XMEM_CONFIG)")
    parser.add_argument("where", help="the spool directory")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    drop_user_settings(os.environ)  # run as the user, for the site: the user's XMEM_* settings change nothing
    from xmem.config import load_site_config

    spool = Path(args.where)
    try:
        print(run(spool, args.job_id, load_site_config(args.config, user_env=False)))
    except Exception as e:
        why = f"xmem failed ({type(e).__name__}: {e})"
        print(one_line(f"xmem-slurm put-off estimate: {why}", MESSAGE_MAX_CHARS), file=sys.stderr)
        try:
            print(fail_open(spool, args.job_id, why))
        except Exception as again:  # the job starts unchanged at its put-off time all the same
            print(one_line(f"xmem-slurm: job {args.job_id} starts at its put-off time ({again})", MESSAGE_MAX_CHARS),
                  file=sys.stderr)
        return 1
    finally:
        deferred.remove_spool(spool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
