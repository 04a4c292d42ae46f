"""Deferred estimates (`[deferred] mode = "partition"`): sbatch returns at once, the estimate runs as a Slurm job.

Owns the flow after the filter decided to defer: the spool (the batch script as submitted, and the filter's
request), the estimation job on the CPU partition and its watchdog, applying the outcome to the held GPU job
(`scontrol update` + `release`, or `scancel` when the site fails closed), and `xmem-slurm status`. Runs as the
submitting user: in sbatch's post-submit (`submit`), then as that user's CPU jobs (`run`, `rescue`).

Facts from Slurm 22.05 this relies on (checked on the dev cluster): cli_filter can set `hold`; a pending job's
GPU request can be retyped within the gpu GRES only by clearing it first (`TresPerNode=` then
`TresPerNode=gres:gpu:h100:1`; setting it directly fails "with and without type identification"); an `mps`
count can be changed, but a gpu request cannot become mps (refused even after clearing), so a refused update
restores the original request and the job keeps it. `afternotok` fires when the estimation job fails, times out
or is cancelled, which is what starts the watchdog (`rescue`); a successful estimate cancels the watchdog.

What must never happen: a job left held for xmem (every step ends in release or, fail-closed, cancel, also when
the site config turned invalid meanwhile: the failure mode in force at submission stands in), a job released
without the GPU request it had (a retype is read back; a request that cannot be restored keeps the job held
with the fix in its comment), xmem's own jobs shaped by the user's SBATCH_* variables, or a spool left behind
(each run removes its own; one whose sbatch failed is swept by the next deferral).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from xmem.cache import user_cache_dir
from xmem.config import SiteConfig
from xmem.slurm.contract import (MESSAGE_MAX_CHARS, FilterReply, FilterRequest, drop_user_settings, failure_reply,
                                 reply_for, user_request)
from xmem.slurm.scontrol import SlurmUnreachable, scontrol_show_job
from xmem.slurm.stamp import JobStamp, add_to_comment, comment_fields
from xmem.text import comment_text, comment_value, one_line

NO_FILTER_ENV = "XMEM_NO_FILTER"  # set for sbatch calls made by xmem itself: cli_filter.lua leaves them alone
GPU_OPTIONS = {"gres": "TresPerNode", "gpus-per-node": "TresPerNode", "gpus": "TresPerJob"}
# Variables sbatch reads as options: the user's (SBATCH_GRES=gpu:2) must not shape xmem's own CPU jobs.
SBATCH_INPUT_PREFIX = "SBATCH_"
# A spool never queued (sbatch failed after the filter deferred: post-submit never ran) is swept after this.
UNQUEUED_SPOOL_MAX_AGE_S = 3600
# submit.sh's exit (its `settle` step's) when it could not queue but has released (or cancelled) the job itself:
# cli_filter.lua then has nothing left to do.
EXIT_HANDLED = 2
# sbatch puts --export's value into its own environment (SLURM_EXPORT_ENV) before post-submit; one variable
# longer than the kernel's MAX_ARG_STRLEN (32 pages) makes every program post-submit starts fail to exec, so
# such a job could be held and never released. It is not deferred.
MAX_ARG_STRLEN = 32 * 4096
EXPORT_ENV = "SLURM_EXPORT_ENV"
SUBMIT_SCRIPT = "submit.sh"  # in the spool: what post-submit runs (submit_script)


class RequestLost(RuntimeError):
    """Slurm refused the new GPU request and putting the old one back: the job must not run so."""


def spool_root(config: SiteConfig) -> Path:
    """Per user, under the cache directory (the user's home: visible from the CPU partition's nodes)."""
    return user_cache_dir(config.estimate.cache_dir) / "spool"


# --- in the filter: snapshot and defer ------------------------------------------------------------------------

def deferring(config: SiteConfig) -> bool:
    """Deferred mode: estimates that are not cached run as jobs on the CPU partition."""
    deferred = getattr(config, "deferred", None)
    return bool(deferred and deferred.mode == "partition" and deferred.cpu_partition)


def defer_reply(script: str, request: FilterRequest, config: SiteConfig) -> FilterReply:
    """The filter's reply for a submission deferred: held, with the token for post-submit; or, when it cannot be
    deferred, the site's failure rule."""
    if why := cannot_defer(request):
        return failure_reply(why, request, config.failure)
    reply, _ = defer(script, request, config)
    return reply


def handoff_reply(script: str, request: FilterRequest, config: SiteConfig,
                  why: str) -> tuple[FilterReply, Callable[[], None]]:
    """The reply for a submission whose inline estimate was not ready in time (xmem.slurm.handoff; `why`: "not ready
    within 4 s", ...): deferred as in partition mode, the line saying why; and the function that removes its snapshot
    again, should the estimate answer inline after all."""
    reply, token = defer(script, request, config, why=why)
    return reply, lambda: remove_spool(spool_root(config) / token)


def cannot_defer(request: FilterRequest) -> str | None:
    """Why this submission cannot be deferred (post-submit could not start the estimation job), or None."""
    size = len(f"{EXPORT_ENV}={request.options.get('export') or ''}".encode()) + 1
    if size > MAX_ARG_STRLEN:
        return (f"its --export value is {size // 1024} KiB, more than sbatch can hand on to the estimation job "
                f"({MAX_ARG_STRLEN // 1024} KiB): pass the variables in the environment instead")
    return None


def defer(script: str, request: FilterRequest, config: SiteConfig,
          why: str | None = None) -> tuple[FilterReply, str]:
    """Snapshot the submission and answer sbatch: hold the job, mark it pending, and name the spool (the reply's
    `defer`), whose submit.sh post-submit runs. Returns the reply and the spool's token. `why`: why the inline
    estimate was not used (its line says so)."""
    token, spool = snapshot(script, request, config)
    (spool / SUBMIT_SCRIPT).write_text(submit_script(spool, config))
    was = user_request(request.options) or "none"
    not_used = f" {why}," if why else ""
    message = (f"GPU memory estimate{not_used} queued on partition {config.deferred.cpu_partition}: the job is held "
               f"until it is done (xmem-slurm status JOBID)")
    comment = _with_state(request.options.get("comment"), state_pairs("pending", was, why=message))
    return FilterReply(set={"hold": "set", "comment": comment}, message=message, defer=str(spool)), token


def snapshot(script: str, request: FilterRequest, config: SiteConfig) -> tuple[str, Path]:
    """A new spool holding the submission as the filter saw it (load_request reads it back): its token and path.
    The spool's SUBMIT_SCRIPT, which post-submit runs, is the caller's to write."""
    token = uuid.uuid4().hex
    _sweep_unqueued(spool_root(config))
    spool = spool_root(config) / token
    spool.mkdir(parents=True, mode=0o700)
    shutil.copyfile(script, spool / "job.sh")  # the user may edit the file right after sbatch
    request_json = {"script": str(spool / "job.sh"), "original_script": script, "argv": list(request.argv),
                    "options": dict(request.options), "user": request.user, "env": dict(request.env),
                    "cwd": request.cwd}
    (spool / "request.json").write_text(json.dumps(request_json))
    return token, spool


def _sweep_unqueued(root: Path) -> None:
    """Remove spools whose job was never queued (no jobs.json, older than UNQUEUED_SPOOL_MAX_AGE_S): sbatch
    refused the job after the filter had deferred it."""
    if not root.is_dir():
        return
    cutoff = time.time() - UNQUEUED_SPOOL_MAX_AGE_S
    for spool in root.iterdir():
        try:
            if not spool.is_symlink() and spool.is_dir() and not (spool / "jobs.json").exists() \
                    and spool.stat().st_mtime < cutoff:
                shutil.rmtree(spool)
        except OSError:
            continue  # vanished meanwhile, or not ours to clean


def remove_spool(spool: Path) -> None:
    shutil.rmtree(spool, ignore_errors=True)


def state_pairs(state: str, was: str, **notes: str) -> str:
    """Deferred mode's pairs in the comment's token: `state=...;was=...`, then `why=` and `fix=` if given."""
    return ";".join(f"{key}={comment_value(value)}" for key, value in {"state": state, "was": was, **notes}.items())


def _with_state(user_comment: str | None, state: str, stamp: JobStamp | None = None) -> str:
    """The job comment: the user's text, then one `xmem:` token with the stamp (if any) and the state."""
    return add_to_comment(user_comment, stamp or JobStamp(), state)


# --- post-submit: the estimation job and its watchdog ---------------------------------------------------------

def submit_script(spool: Path, config: SiteConfig, python: str = sys.executable) -> str:
    """The script post-submit runs (cli_filter.lua: `sh SPOOL/submit.sh JOBID`) to queue the estimation job and its
    watchdog for the held job. The filter writes it, with the site config at hand, so that post-submit, in sbatch's
    time, starts no Python of its own (a burst of 30 held jobs on 2 busy cores: sbatch's p50 46 s, 22 s without it).
    The user's SBATCH_* variables are unset (they must not shape xmem's own jobs) and XMEM_NO_FILTER set
    (cli_filter.lua leaves these sbatch calls alone). When either job cannot be queued, the `settle` step applies
    the failure mode to the held job (exit 2); if even that fails the Lua side releases (or cancels) it."""
    q = shlex.quote
    site = ["--config", config.source] if config.source else []  # the site's, as the filter read it

    def step(name: str) -> str:  # the script appends the job id (digits, checked) as the last word
        return shlex.join([python, "-I", "-m", "xmem.slurm.deferred", "--failure-default", config.failure, *site,
                           name, str(spool)]) + " "
    common = f"--partition={q(config.deferred.cpu_partition or '')} --parsable --export=ALL --ntasks=1"
    settle_step = step("settle") + '"$job"'
    return "\n".join([
        "#!/bin/sh",
        "# xmem-slurm: queues the estimation job and its watchdog for held job $1 (cli_filter.lua's post-submit)",
        "job=$1",
        "case $job in ''|*[!0-9]*) exit 1 ;; esac",
        f"for name in $(env | sed -n 's/^\\({SBATCH_INPUT_PREFIX}[A-Za-z0-9_]*\\)=.*/\\1/p'); do unset \"$name\"; done",
        f"{NO_FILTER_ENV}=1; export {NO_FILTER_ENV}",
        f"est=$(sbatch {common} --time={q(config.deferred.time_limit)} --mem={q(config.deferred.mem)} "
        f"--job-name=xmem-estimate-$job --output={q(str(spool / 'estimate-%j.out'))} --wrap={q(step('run'))}\"$job\")"
        f" || exec {settle_step}",
        "est=${est%%;*}",
        f"wd=$(sbatch {common} --time=00:05:00 --mem=500M --dependency=afternotok:$est --job-name=xmem-watchdog-$job "
        f"--output={q(str(spool / 'watchdog-%j.out'))} --wrap={q(step('rescue'))}\"$job\")"
        f" || {{ scancel \"$est\"; exec {settle_step}; }}",  # no watchdog, no estimation job
        "wd=${wd%%;*}",
        f"printf '{{\"job\": \"%s\", \"estimate\": \"%s\", \"watchdog\": \"%s\"}}\\n' \"$job\" \"$est\" \"$wd\" "
        f"> {q(str(spool / 'jobs.json'))}",
        ""])


# --- the estimation job: analyse the snapshot, then update and release (or cancel) ------------------------------

def load_request(spool: Path) -> tuple[FilterRequest, str]:
    """The submission as the filter saw it (its script: the snapshot), and the path the user submitted."""
    data = json.loads((spool / "request.json").read_text())
    request = FilterRequest(script=data["script"], argv=tuple(data["argv"]), options=data["options"],
                            user=data.get("user"), env=data.get("env") or {}, cwd=data.get("cwd"))
    return request, data["original_script"]


def as_submitted(request: FilterRequest, original: str) -> FilterRequest:
    """The snapshot's request naming the script as the user submitted it: what a refusal tells them to check
    (`xmem-slurm check PATH`), not the spool's copy, removed when the estimate ends."""
    return dataclasses.replace(request, script=original)


def run(spool: Path, job_id: str, config: SiteConfig) -> str:
    """Runs as the estimation job. Returns what happened, one line (also in the job's comment). Always cold: a
    warm tracer started here would outlive the job on the estimation node (0.7 GiB for its idle time), and no
    later estimate of this user is sure to land on the same node to use it (the user's own XMEM_WARM_TRACER is gone:
    `main` dropped the user's settings, so the site's, made cold here, decide)."""
    # Here, not at the top: post-submit's `submit` runs in sbatch's time, and a burst's 30 of them share the CPUs
    from xmem.slurm.cache_check import still_offered
    from xmem.slurm.inline import (analysis_cache, cached_analysis, command_files, config_digest, estimate_slots,
                                   parse_job)

    cold = dataclasses.replace(config, estimate=dataclasses.replace(config.estimate, warm_tracer=False))
    request, original = load_request(spool)
    job = parse_job(request.script, request)
    analysis = cached_analysis(
        request.script, request, cold, cache=analysis_cache(config), config_digest=config_digest(config),
        files=command_files(job, request, original), slots=lambda: estimate_slots(config),
        usable=lambda verdict: still_offered(verdict, job, config, request.user))
    outcome = apply(job_id, reply_for(analysis, as_submitted(request, original), config.failure), request, config)
    _cancel_watchdog(spool)
    remove_spool(spool)
    return outcome


def apply(job_id: str, reply: FilterReply, request: FilterRequest, config: SiteConfig | None,
          start_at: str | None = None) -> str:
    """Carry the filter's reply over to the held job, then release it (or cancel it on a refusal). `start_at`: the
    job is not held but its start put off (xmem.slurm.putoff): its StartTime is set to this instead (a Slurm time:
    the user's own --begin, or "now"); "" leaves the start as it is (the user's own later --begin)."""
    was = user_request(request.options) or "none"
    user_comment = request.options.get("comment")
    if reply.reject:
        _scontrol("update", f"JobId={job_id}",
                  "Comment=" + _with_state(user_comment, state_pairs("refused", was, why=reply.reject)))
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        return f"job {job_id} cancelled: {reply.reject}"
    stamp = JobStamp.from_comment(reply.set.get("comment"))
    changes = {o: v for o, v in reply.set.items() if o in GPU_OPTIONS}
    state, note = "done", reply.message or ""
    for option, value in changes.items():
        field = GPU_OPTIONS[option]
        old = _current(job_id, field)
        try:
            refused = retype(job_id, field, _tres(option, value), old)
        except RequestLost as e:  # never released without its GPU request: held, with the fix in the comment
            if start_at is not None:  # a put-off job is not held yet: it would start GPU-less at its put-off time
                _scontrol("hold", job_id)
            fix = f"scontrol update JobId={job_id} {field}={old} && scontrol release {job_id}"
            _scontrol("update", f"JobId={job_id}", "Comment=" + _with_state(
                user_comment, state_pairs("stuck", was, why=str(e), fix=fix)))
            return f"job {job_id} left held: {e}; to run it as submitted: {fix}"
        if refused:
            state, note = "kept", f"Slurm refused {option}={value} on the pending job ({refused}); kept {was}"
            stamp = JobStamp(stamp.peak_bytes, stamp.needed_bytes, stamp.gpu_type, was, "keep")
    if stamp.is_empty():  # nothing estimated (fail-open), or the policy changes nothing (excluded, no fit)
        state = "failed" if note.startswith("cannot estimate") else "unchanged"
    why = {"why": note} if note else {}  # the line the user would have seen inline, whatever the outcome
    comment = _with_state(user_comment, state_pairs(state, was, **why), stamp)
    _scontrol("update", f"JobId={job_id}", f"Comment={comment}")
    if start_at is not None:  # the start last: the job must not start before its new request is set
        if not start_at:
            return f"job {job_id} keeps its own start ({state}): {note}"
        _scontrol("update", f"JobId={job_id}", f"StartTime={start_at}")
        return f"job {job_id} may start {'now' if start_at == 'now' else 'at ' + start_at} ({state}): {note}"
    if request.options.get("hold"):  # the user's own --hold: theirs to release
        return f"job {job_id} left held, as submitted ({state}): {note}"
    _scontrol("release", job_id)
    return f"job {job_id} released ({state}): {note}"


def _tres(option: str, value: str) -> str:
    """The scontrol form of a request: every item with its `gres:` prefix (gpus options name gpu items)."""
    items = value.split(",")
    if option != "gres":
        items = [i if i.startswith("gpu:") else f"gpu:{i}" for i in items]
    return ",".join(f"gres:{i}" for i in items)


def _current(job_id: str, field: str) -> str | None:
    try:
        value = scontrol_show_job(job_id).get(field)
    except LookupError:
        return None
    return value if value not in (None, "", "(null)") else None


def retype(job_id: str, field: str, new: str, old: str | None) -> str | None:
    """Set a pending job's GPU request: clear, then set (22.05 refuses a type change in one step). If Slurm
    refuses the new value, the old one is put back and read back, so a job never runs without its GPU.
    Returns Slurm's refusal, or None; RequestLost when the job holds neither request at the end."""
    _update(job_id, field, "")
    refused = _update(job_id, field, new)
    if refused is None and _current(job_id, field) == new:
        return None
    refused = refused or f"read back {_current(job_id, field)}"
    if old is None:
        return refused
    for _ in range(3):  # a busy controller: try again before giving up
        if _update(job_id, field, old) is None and _current(job_id, field) == old:
            return refused
        time.sleep(1)
    raise RequestLost(f"Slurm refused {field}={new} ({refused}) and putting back {field}={old}")


def _update(job_id: str, field: str, value: str) -> str | None:
    """`scontrol update` of one field; Slurm's refusal, or None."""
    try:
        done = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"{field}={value}"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def _scontrol(*args: str) -> None:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"scontrol {' '.join(args[:2])}: {done.stderr.strip()}")


def _cancel_watchdog(spool: Path) -> None:
    try:
        watchdog = json.loads((spool / "jobs.json").read_text()).get("watchdog")
    except (OSError, ValueError):
        return
    if watchdog:
        subprocess.run(["scancel", watchdog], capture_output=True, timeout=30)


# --- the watchdog: the estimation job died ----------------------------------------------------------------------

def rescue(spool: Path, job_id: str, config: SiteConfig) -> str:
    """Runs when the estimation job failed, timed out or was cancelled: apply the site's failure mode, so the
    GPU job is never left held."""
    request, original = load_request(spool)
    request = as_submitted(request, original)
    if _current(job_id, "JobState") != "PENDING":
        remove_spool(spool)
        return f"job {job_id} is no longer pending: nothing to do"
    reply = failure_reply("the estimation job failed, timed out or was cancelled", request, config.failure)
    outcome = apply(job_id, reply, request, config)
    remove_spool(spool)
    return outcome


# --- status --------------------------------------------------------------------------------------------------

def job_status(job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Where a job stands, from `scontrol show job`: its state and the xmem token of its comment (inline or
    deferred: `why`, the user's line; `request_before`, the GPU request as submitted). LookupError for a job
    Slurm does not know; SlurmUnreachable when Slurm cannot be asked (or gives no answer in `timeout_s`)."""
    try:
        fields = scontrol_show_job(job_id, timeout_s)
    except FileNotFoundError:
        raise SlurmUnreachable("no scontrol on PATH") from None
    except subprocess.TimeoutExpired as e:
        raise SlurmUnreachable(f"scontrol had no answer in {e.timeout:g} s") from None
    comment = fields.get("Comment", "")
    pairs = comment_fields(comment)
    stamp = JobStamp.from_comment(comment)
    estimate = pairs.get("state", "done") if pairs else "none"  # a user's own `xmem:` word is no estimate
    request = next((f"{k}={v}" for k, v in ((k, fields.get(k)) for k in ("TresPerNode", "TresPerJob"))
                    if v and v != "(null)"), None)
    return {"job_id": job_id, "job_state": fields.get("JobState"), "reason": fields.get("Reason"),
            "estimate": estimate, "request_before": comment_text(pairs.get("was", "")) or None,
            "request_now": request, "why": comment_text(pairs.get("why", "")) or None,
            "fix": comment_text(pairs.get("fix", "")) or None,
            "stamp": asdict(stamp) if not stamp.is_empty() else None}


# --- entry point ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem.slurm.deferred", description=__doc__.splitlines()[0])
    parser.add_argument("--failure-default", choices=("open", "closed"), default="open",
                        help="the failure mode when the site config cannot be read (the one in force at submission)")
    parser.add_argument("--config", default=None,
                        help="the site config (default: /etc/xmem/xmem.toml; never $XMEM_CONFIG)")
    parser.add_argument("step", choices=("settle", "run", "rescue"))
    parser.add_argument("where", help="the spool directory")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    drop_user_settings(os.environ)  # run as the user, for the site: the user's XMEM_* settings change nothing
    from xmem.config import load_site_config

    spool, failure = Path(args.where), args.failure_default
    if args.step == "settle":  # submit.sh could not queue the estimation job or its watchdog
        return EXIT_HANDLED if settle(spool, args.job_id, "the estimation job could not be queued", failure) else 1
    try:
        config = load_site_config(args.config, user_env=False)
        failure = config.failure
        if args.step == "run":
            print(run(spool, args.job_id, config))
        else:
            print(rescue(spool, args.job_id, config))
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        print(one_line(f"xmem-slurm deferred {args.step}: {why}", MESSAGE_MAX_CHARS), file=sys.stderr)
        return EXIT_HANDLED if settle(spool, args.job_id, f"xmem failed ({why})", failure) else 1
    return 0


def settle(spool: Path, job_id: str, why: str, failure: str) -> bool:
    """The last resort after a step failed: the failure mode applied to the held job (released unchanged, or
    cancelled), its watchdog cancelled and its spool removed. False when even that failed (said on stderr)."""
    try:
        request, original = load_request(spool)
        reply = failure_reply(why, as_submitted(request, original), failure)
        print(apply(job_id, reply, request, None))
    except Exception as again:
        print(one_line(f"xmem-slurm: job {job_id} may be held: release it with `scontrol release {job_id}` "
                       f"({type(again).__name__}: {again})", MESSAGE_MAX_CHARS), file=sys.stderr)
        return False
    _cancel_watchdog(spool)
    remove_spool(spool)
    return True


if __name__ == "__main__":
    sys.exit(main())
