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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from xmem.slurm.filter import (FilterReply, FilterRequest, analysis_cache, cached_analysis, command_files,
                               config_digest, estimate_slots, failure_reply, parse_job, reply_for, user_request)
from xmem.slurm.node import COMMENT_TAG, JobStamp, add_to_comment, comment_fields, scontrol_show_job

NO_FILTER_ENV = "XMEM_NO_FILTER"  # set for sbatch calls made by xmem itself: cli_filter.lua leaves them alone
GPU_OPTIONS = {"gres": "TresPerNode", "gpus-per-node": "TresPerNode", "gpus": "TresPerJob"}


def spool_root(config: Any) -> Path:
    """Per user, under the cache directory (the user's home: visible from the CPU partition's nodes)."""
    return Path(os.path.expanduser(config.estimate.cache_dir)) / "spool"


# --- in the filter: snapshot and defer ------------------------------------------------------------------------

def defer(script: str, request: FilterRequest, config: Any) -> tuple[FilterReply, str]:
    """Snapshot the submission and answer sbatch: hold the job, mark it pending. Returns the reply and the token
    the Lua side hands to post-submit (`submit`)."""
    token = uuid.uuid4().hex
    spool = spool_root(config) / token
    spool.mkdir(parents=True, mode=0o700)
    shutil.copyfile(script, spool / "job.sh")  # the user may edit the file right after sbatch
    request_json = {"script": str(spool / "job.sh"), "original_script": script, "argv": list(request.argv),
                    "options": dict(request.options), "user": request.user, "env": dict(request.env),
                    "cwd": request.cwd}
    (spool / "request.json").write_text(json.dumps(request_json))
    was = user_request(request.options) or "none"
    comment = _with_state(request.options.get("comment"), f"state=pending;was={_plain(was)}")
    message = (f"GPU memory estimate queued on partition {config.deferred.cpu_partition}: the job is held until "
               f"it is done (xmem-slurm status JOBID)")
    return FilterReply(set={"hold": "set", "comment": comment}, message=message), token


def _plain(text: str) -> str:
    return re.sub(r"[,;\s\"'\\]+", "+", text)


def _with_state(user_comment: str | None, state: str, stamp: JobStamp | None = None) -> str:
    """The job comment: the user's text, then one `xmem:` token with the stamp (if any) and the state."""
    return add_to_comment(user_comment, stamp or JobStamp(), state)


# --- post-submit: the estimation job and its watchdog ---------------------------------------------------------

def submit(token: str, job_id: str, config: Any, python: str = sys.executable) -> str:
    """Submit the estimation job and its watchdog for held job `job_id`; returns the line for the user."""
    spool = spool_root(config) / token
    env = {**os.environ, NO_FILTER_ENV: "1"}
    common = [f"--partition={config.deferred.cpu_partition}", "--parsable", "--export=ALL", "--ntasks=1"]
    estimate = _sbatch([*common, f"--time={config.deferred.time_limit}", f"--mem={config.deferred.mem}",
                        f"--job-name=xmem-estimate-{job_id}", f"--output={spool}/estimate-%j.out",
                        f"--wrap={python} -I -m xmem.slurm.deferred run {spool} {job_id}"], env)
    try:
        watchdog = _sbatch([*common, "--time=00:05:00", "--mem=500M", f"--dependency=afternotok:{estimate}",
                            f"--job-name=xmem-watchdog-{job_id}", f"--output={spool}/watchdog-%j.out",
                            f"--wrap={python} -I -m xmem.slurm.deferred rescue {spool} {job_id}"], env)
    except RuntimeError:
        subprocess.run(["scancel", estimate], capture_output=True, timeout=30)  # no watchdog, no estimate job
        raise
    (spool / "jobs.json").write_text(json.dumps({"job": job_id, "estimate": estimate, "watchdog": watchdog}))
    return f"estimate job {estimate} for job {job_id}"


def _sbatch(args: Sequence[str], env: Mapping[str, str]) -> str:
    done = subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=60, env=dict(env))
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args[:2])}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


# --- the estimation job: analyse the snapshot, then update and release (or cancel) ------------------------------

def load_request(spool: Path) -> tuple[FilterRequest, str]:
    """The submission as the filter saw it (its script: the snapshot), and the path the user submitted."""
    data = json.loads((spool / "request.json").read_text())
    request = FilterRequest(script=data["script"], argv=tuple(data["argv"]), options=data["options"],
                            user=data.get("user"), env=data.get("env") or {}, cwd=data.get("cwd"))
    return request, data["original_script"]


def run(spool: Path, job_id: str, config: Any) -> str:
    """Runs as the estimation job. Returns what happened, one line (also in the job's comment)."""
    request, original = load_request(spool)
    job = parse_job(request.script, request)
    analysis = cached_analysis(
        request.script, request, config, cache=analysis_cache(config), config_digest=config_digest(config),
        files=command_files(job, request, original), slots=lambda: estimate_slots(config))
    reply = reply_for(analysis, request, config.failure)
    outcome = apply(job_id, reply, request, config)
    _cancel_watchdog(spool)
    return outcome


def apply(job_id: str, reply: FilterReply, request: FilterRequest, config: Any) -> str:
    """Carry the filter's reply over to the held job, then release it (or cancel it on a refusal)."""
    was = user_request(request.options) or "none"
    user_comment = request.options.get("comment")
    if reply.reject:
        _scontrol("update", f"JobId={job_id}",
                  f"Comment={_with_state(user_comment, f'state=refused;was={_plain(was)};why={_plain(reply.reject)}')}")
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        return f"job {job_id} cancelled: {reply.reject}"
    stamp = JobStamp.from_comment(reply.set.get("comment"))
    changes = {o: v for o, v in reply.set.items() if o in GPU_OPTIONS}
    state, note = "done", reply.message or ""
    for option, value in changes.items():
        refused = retype(job_id, GPU_OPTIONS[option], _tres(option, value), _current(job_id, GPU_OPTIONS[option]))
        if refused:
            state, note = "kept", f"Slurm refused {option}={value} on the pending job ({refused}); kept {was}"
            stamp = JobStamp(stamp.peak_bytes, stamp.needed_bytes, stamp.gpu_type, was, "keep")
    if stamp.is_empty():  # nothing estimated (fail-open), or the policy changes nothing (excluded, no fit)
        state = "failed" if note.startswith("cannot estimate") else "unchanged"
    comment = _with_state(user_comment, f"state={state};was={_plain(was)}" +
                          (f";why={_plain(note)}" if state != "done" else ""), stamp)
    _scontrol("update", f"JobId={job_id}", f"Comment={comment}")
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
    refuses the new value, the old one is put back, so a job never runs without its GPU. Returns Slurm's
    refusal, or None."""
    _scontrol("update", f"JobId={job_id}", f"{field}=")
    done = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"{field}={new}"], capture_output=True,
                          text=True, timeout=30)
    if done.returncode == 0:
        return None
    if old:
        _scontrol("update", f"JobId={job_id}", f"{field}={old}")
    return done.stderr.strip() or f"exit {done.returncode}"


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

def rescue(spool: Path, job_id: str, config: Any) -> str:
    """Runs when the estimation job failed, timed out or was cancelled: apply the site's failure mode, so the
    GPU job is never left held."""
    request, original = load_request(spool)
    request = dataclasses.replace(request, script=original)  # named as the user knows it, in the refusal
    if _current(job_id, "JobState") != "PENDING":
        return f"job {job_id} is no longer pending: nothing to do"
    reply = failure_reply("the estimation job failed, timed out or was cancelled", request, config.failure)
    return apply(job_id, reply, request, config)


# --- status --------------------------------------------------------------------------------------------------

def job_status(job_id: str) -> dict[str, Any]:
    """Where a job stands, from `scontrol show job`: its state and the xmem token of its comment."""
    fields = scontrol_show_job(job_id)
    comment = fields.get("Comment", "")
    pairs = comment_fields(comment)
    stamp = JobStamp.from_comment(comment)
    estimate = "none" if COMMENT_TAG not in comment else pairs.get("state", "done")
    request = next((f"{k}={v}" for k, v in ((k, fields.get(k)) for k in ("TresPerNode", "TresPerJob"))
                    if v and v != "(null)"), None)
    return {"job_id": job_id, "job_state": fields.get("JobState"), "reason": fields.get("Reason"),
            "estimate": estimate, "request_before": pairs.get("was", "").replace("+", " ") or None,
            "request_now": request, "why": pairs.get("why", "").replace("+", " ") or None,
            "stamp": asdict(stamp) if not stamp.is_empty() else None}


# --- entry point ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem.slurm.deferred", description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("submit", "run", "rescue"))
    parser.add_argument("where", help="submit: the filter's token; run/rescue: the spool directory")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    from xmem.config import load_site_config

    config = load_site_config()
    try:
        if args.step == "submit":
            submit(args.where, args.job_id, config)  # silent: the filter already told the user
        elif args.step == "run":
            print(run(Path(args.where), args.job_id, config))
        else:
            print(rescue(Path(args.where), args.job_id, config))
    except Exception as e:
        print(f"xmem-slurm deferred {args.step}: {type(e).__name__}: {e}", file=sys.stderr)
        if args.step == "submit":  # no estimation job: the held job must not stay held
            try:
                request, _ = load_request(spool_root(config) / args.where)
                reply = failure_reply(f"could not queue the estimate: {e}", request, config.failure)
                apply(args.job_id, reply, request, config)
            except Exception as again:
                print(f"xmem-slurm: job {args.job_id} is held: release it with `scontrol release "
                      f"{args.job_id}` ({again})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
