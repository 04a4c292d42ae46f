"""Put-off starts (issue 35 item 5): sbatch within `[filter] wait_s` where the site names no CPU partition. An
inline estimate not ready within the wait goes on detached on the submit host, as the user, while the job waits in
Slurm: at a fail-open site with its start put off (`begin` = the estimate's deadline plus `[filter]
put_off_margin_s`), at a fail-closed site held (Start.held). Once done the estimate rewrites the pending job (the GPU
request, the comment's stamp) and brings its start back to the user's own `--begin`, or now; a held job is released
instead (left held where the user gave --hold).

Owns which submissions are put off (`puts_off`), the filter's reply for them (`put_off_reply`: the spool, the start,
the user's line), and the detached estimate (`run`, started by the spool's submit.sh from post-submit). A put-off
job is fail-open by construction: Slurm itself starts a job nothing came back for (the estimate failed, died, or was
killed), unchanged, at its put-off time; its comment still says `state=pending`, which the Epilog records as a
failed estimate. Not where a user's own `--begin` cannot be read (SLURM_TIME_FORMAT set to another format) at a
fail-open site. A user's own `--begin` later than the put-off time is kept as it is. The detached estimate's cancel
is the job's: once the job is no longer pending (scancel, or started) the estimate stops; its progress is the
comment's (`xmem-slurm status`).

Fail-closed (a put-off job would run unestimated): the job is held, not put off, and the site's rule for an inline
failure applies once the estimate fails or its deadline passes: where the filter would have refused the submission,
the held job is cancelled, the reason in its comment (`xmem-slurm status JOBID`). A detached estimate that dies (the
OOM killer, a reboot) leaves the job held, its comment `state=pending`: blocked, not lost, as the site chose. The hold
is sbatch's --hold, a user hold: its owner may `scontrol release` it, and it then runs as submitted, unestimated (its
comment still pending, which the Epilog records as a failed estimate).
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
    own later --begin was kept, or the job is held), the start to bring back once the estimate is done (the user's
    own, or now), and whether the job is held instead (a fail-closed site: released, or cancelled, when done)."""

    estimate_until: float
    put_off: str | None
    start_at: str
    held: bool = False

    @classmethod
    def of(cls, request: FilterRequest, config: SiteConfig, sbatch_started: float) -> Start:
        until = sbatch_started + config.estimate.timeout_s
        if config.failure == "closed":
            return cls(until, None, "", held=True)
        put_off = until + config.filter.put_off_margin_s
        own = users_begin(request)
        if own is not None and own >= put_off:
            return cls(until, None, "")
        return cls(until, _slurm_time(put_off), request.options["begin"] if own is not None else "now")

    @property
    def failure(self) -> str:
        """The site's rule the detached estimate's answer is read under (the filter's, for an inline answer)."""
        return "closed" if self.held else "open"

    @property
    def resume(self) -> str | None:
        """deferred.apply's start_at: None releases a held job; else the start to bring back ("" keeps it)."""
        return None if self.held else self.start_at


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
    """Whether an estimate not ready within `[filter] wait_s` goes on detached, the job's start put off (fail-open)
    or the job held (fail-closed): the site's `[filter] put_off`, inline mode, no CPU partition, and a submission
    post-submit can start the estimate for (deferred.cannot_defer) whose --begin, if put off, can be read."""
    if not config.filter.put_off or config.deferred.mode != "inline" or config.deferred.cpu_partition:
        return False
    if config.failure == "open":
        try:
            users_begin(request)
        except UnreadableBegin:
            return False
    return deferred.cannot_defer(request) is None


# --- in the filter: the reply ------------------------------------------------------------------------------------

def put_off_reply(script: str, request: FilterRequest, config: SiteConfig, why: str,
                  sbatch_started: float) -> tuple[FilterReply, Callable[[], None]]:
    """The reply for a submission whose inline estimate was not ready in time (`why`: "not ready within 4 s", ...):
    its start put off (unless its own --begin is later) or, fail-closed, held; its comment pending, the spool for
    post-submit; and the
    function that removes the spool again, should the estimate answer inline after all. `sbatch_started`: epoch
    seconds (the estimate's deadline counts from there, as inline)."""
    token, spool = deferred.snapshot(script, request, config)
    start = Start.of(request, config, sbatch_started)
    (spool / START_FILE).write_text(json.dumps(dataclasses.asdict(start)))
    (spool / deferred.SUBMIT_SCRIPT).write_text(submit_script(spool, config))
    until = datetime.fromtimestamp(start.estimate_until).strftime("%H:%M:%S")
    message = f"GPU memory estimate {why}, goes on in the background until {until}: {_waits(start)}"
    was = user_request(request.options) or "none"
    pairs = deferred.state_pairs("pending", was, why=message)
    comment = add_to_comment(request.options.get("comment"), JobStamp(), pairs)
    waits = {"hold": "set"} if start.held else {"begin": start.put_off} if start.put_off else {}
    return FilterReply(set={"comment": comment, **waits}, message=message, defer=str(spool)), \
        lambda: deferred.remove_spool(spool)


def _waits(start: Start) -> str:
    """How the job waits for its detached estimate, and what happens without one (the user's line)."""
    if start.held:
        return ("the job is held until it is done; this site requires an estimate: without one the job is cancelled "
                "(xmem-slurm status JOBID)")
    when = f"the job's start is put off to {start.put_off[11:]} until it is done" if start.put_off else \
        "the job keeps its own later start"
    return f"{when}; without one it starts unchanged (xmem-slurm status JOBID)"


def submit_script(spool: Path, config: SiteConfig, python: str = sys.executable) -> str:
    """The script post-submit runs (cli_filter.lua: `sh SPOOL/submit.sh JOBID`): the detached estimate started in
    a session of its own (setsid: no terminal's hangup, no signal to sbatch's process group reaches it; nothing ties
    it to sbatch, which returns at once), its output in the spool. It exits 0 once started: the job needs nothing
    from the Lua side whatever happens next (any other exit: post-submit applies the site's rule, cli_filter.lua)."""
    site = ["--config", config.source] if config.source else []
    command = shlex.join([python, "-I", "-m", "xmem.slurm.putoff", *site, str(spool)])
    log = shlex.quote(str(spool / "estimate.out"))
    return "\n".join([
        "#!/bin/sh",
        "# xmem-slurm: the estimate of job $1 goes on detached, the job put off or held meanwhile (cli_filter.lua)",
        "job=$1",
        "case $job in ''|*[!0-9]*) exit 1 ;; esac",
        "detach=; command -v setsid >/dev/null 2>&1 && detach=setsid",
        f'$detach {command} "$job" </dev/null >{log} 2>&1 &',
        "exit 0",
        ""])


# --- the detached estimate -----------------------------------------------------------------------------------------

def run(spool: Path, job_id: str, config: SiteConfig) -> str:
    """The detached estimate of a put-off or held job: the cached analysis, bounded by the deadline of the
    submission's, in one of the user's estimate slots; then its answer, read under the site's rule, written to the
    pending job and its start brought back (held: released, or cancelled on a refusal). Stops when the job no longer
    waits (cancelled, or started at its put-off time). Returns what happened, one line."""
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
    users = deferred.as_submitted(request, original)
    return deferred.apply(job_id, reply_for(analysis, users, start.failure), request, config, start_at=start.resume)


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


def settle(spool: Path, job_id: str, why: str) -> str:
    """A detached estimate that failed in a way it can say: the site's rule for an inline failure, the failure in
    the job's comment. Fail-open: the job gets its start back unchanged (what it would have got at its put-off time
    anyway, sooner); fail-closed: the held job is cancelled (where the filter would have refused it)."""
    request, original = deferred.load_request(spool)
    start = Start(**json.loads((spool / START_FILE).read_text()))
    if not _pending(job_id):
        return f"job {job_id} no longer waits: nothing to do"
    reply = failure_reply(why, deferred.as_submitted(request, original), start.failure)
    return deferred.apply(job_id, reply, request, None, start_at=start.resume)


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
            print(settle(spool, args.job_id, why))
        except Exception as again:  # put off: it starts unchanged all the same; held: it stays held (fail-closed)
            print(one_line(f"xmem-slurm: job {args.job_id} is left as it waits, put off or held ({again})",
                           MESSAGE_MAX_CHARS), file=sys.stderr)
        return 1
    finally:
        deferred.remove_spool(spool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
