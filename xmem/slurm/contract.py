"""The submission contract with slurm/cli_filter.lua: the request sbatch hands over, its cache key, and the reply.

Owns the JSON both sides exchange (documented in slurm/README.md), which sbatch options key a cached analysis,
the `Verdict` (what the filter keeps of a job's analysis, cached; checked on read by xmem.slurm.cache_check), and
turning a verdict into the sbatch options to set (`gres`/`gpus`, `comment` carrying the job stamp, `export` carrying it
to the TaskProlog), the one line the user sees, the site's fail-open / fail-closed rule, and which variables of the
environment the Lua side starts the filter in are the user's own settings (`drop_user_settings`). Pure: no estimate,
no Slurm call. The inline path (xmem.slurm.inline) and the deferred one (xmem.slurm.deferred) both answer here.

Contract, in:  {"script": abs path | null, "argv": [...], "options": {long option: value, as
                slurm.json_cli_options gives them}, "user": str | null, "env": {name: value},
                "cwd": optional, default the filter's own working directory (sbatch's)}
         out:  {"set": {option: string}, "message": str | null, "reject": str | null, "fault": str | null,
                "defer": spool | null (post-submit runs its submit.sh: deferred mode queues the estimation job,
                xmem.slurm.deferred; a put-off job's estimate starts detached, xmem.slurm.putoff)}
`fault` is set only when the filter could not even learn the site's failure mode (the Lua side then applies
its install-time default). Option values in `set` are exact (what the user wrote passes unchanged: quotes,
backslashes); the Lua side decodes JSON strings. The lines for people (`message`, `reject`, `fault`) are one line
of at most MESSAGE_MAX_CHARS (`xmem.text.one_line`). `hetjob` in the input (the Lua side saw a `:` component
separator) or a `#SBATCH hetjob` line: heterogeneous jobs are not sized (cli_filter hands each component over on
its own, and the first's options leak into the next), so they pass unchanged with a notice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmem.cache import cache_key
from xmem.slurm.stamp import WHY_ENCODED_ENV, JobStamp, add_to_comment
from xmem.text import COMMENT_VALUE_MAX_CHARS, comment_value, one_line

if TYPE_CHECKING:
    from xmem.policy import Decision

# The variables the Lua side sets for the filter; every other XMEM_* variable the filter finds is the submitting
# user's (XMEM_CONFIG, XMEM_WARM_*, XMEM_SANDBOX, XMEM_SHIM_DIR...), and must not change or slow what it does.
FROM_LUA = frozenset({"XMEM_PROGRESS_FD"})
# A user's 1 MB exception message must not flood the terminal or the job comment, where the line travels whole.
MESSAGE_MAX_CHARS = COMMENT_VALUE_MAX_CHARS
# sbatch options that say nothing about the job's GPU memory: left out of the cache key.
OPTIONS_NOT_IN_KEY = frozenset({
    "argv", "output", "error", "input", "job-name", "parsable", "wait", "quiet", "verbose", "comment", "export",
    "mail-type", "mail-user", "open-mode", "begin", "hold", "dependency", "spank", "spank_job_env", "wrap",
})
# What the analysis needs from sbatch's options (everything else is the batch script's business).
ANALYSIS_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task", "partition", "constraint", "account",
                    "nodes", "ntasks", "ntasks-per-node", "chdir")


@dataclass(frozen=True)
class FilterRequest:
    """What the Lua side sends for one submission."""

    script: str | None
    argv: tuple[str, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None  # where sbatch runs: the job's default working directory
    hetjob: bool = False  # the sbatch command line has a `:` component separator

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FilterRequest:
        if not isinstance(data, Mapping):
            raise ValueError("filter input must be a JSON object")
        options = {str(k): _option_text(v) for k, v in (data.get("options") or {}).items()}
        return cls(script=data.get("script") or None, argv=tuple(str(a) for a in data.get("argv") or ()),
                   options=options, user=data.get("user") or None,
                   env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
                   cwd=data.get("cwd") or os.getcwd(),  # the filter runs in sbatch's directory
                   hetjob=bool(data.get("hetjob")))

    @property
    def script_args(self) -> tuple[str, ...]:
        return self.argv[1:] if self.script else ()

    def cli_options(self) -> dict[str, str]:
        """The options the analysis needs, as a user would have typed them: 22.05 reads `gres` back with a
        `gres:` prefix (and repeats it per item), which is stripped here."""
        picked = {k: self.options[k] for k in ANALYSIS_OPTIONS if self.options.get(k)}
        if "gres" in picked:
            picked["gres"] = ",".join(item.removeprefix("gres:") for item in picked["gres"].split(","))
        return picked


def drop_user_settings(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the submitting user's own xmem settings from the filter's (or a deferred step's) environment, so that
    the site's config alone decides: the user's job keeps them (the request's `env`). Returns the names removed."""
    names = [name for name in environ if name.startswith("XMEM_") and name not in FROM_LUA]
    for name in names:
        del environ[name]
    return names


def _option_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


@dataclass(frozen=True)
class FilterReply:
    set: Mapping[str, str] = field(default_factory=dict)
    message: str | None = None
    reject: str | None = None
    fault: str | None = None
    defer: str | None = None  # deferred mode: the spool whose submit.sh post-submit runs (xmem.slurm.deferred)

    def to_json(self) -> dict[str, Any]:
        lines = {"message": self.message, "reject": self.reject, "fault": self.fault, "defer": self.defer}
        return {"set": {k: str(v) for k, v in self.set.items()},
                **{k: None if v is None else one_line(v, MESSAGE_MAX_CHARS) for k, v in lines.items()}}


# --- the verdict, as cached -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """What the filter keeps of `xmem.analyze.JobAnalysis`: the policy's decision, the peaks, the errors as text.
    JSON only in the cache (`to_json`, `from_json`)."""

    decision: Decision | None
    peaks: Mapping[str, int] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"decision": self.decision.to_json() if self.decision else None, "peaks": dict(self.peaks),
                "errors": list(self.errors)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, cached: bool = False) -> Verdict:
        """The verdict back from `to_json()`; ValueError (TypeError for a field Decision lacks) when `data` is
        not one (a damaged cache entry): what it may hold is `xmem.slurm.cache_check.valid_analysis`'s to say."""
        from xmem.policy import Decision
        from xmem.slurm.cache_check import valid_analysis

        decision = data.get("decision")
        if not (isinstance(decision, Mapping) and valid_analysis(data)):
            raise ValueError("not a verdict")
        return cls(decision=Decision(**decision), peaks=data.get("peaks", {}),
                   errors=tuple(data.get("errors", [])), cached=cached)


def key_for(script: str, request: FilterRequest, config_digest: str, files: list[str], job: Any = None) -> str:
    """The cache key of a submission: what its analysis reads (the script's bytes and arguments, the request as
    parsed, the relevant environment, the files its commands run, the site config, the user and directory).
    `job`: the script as `xmem.jobscript` parsed it for `request`, when the caller has it (else parsed here)."""
    return cache_key(script=Path(script).read_bytes(), script_args=request.script_args,
                     options=parsed_request(script, request, job), env=request.env, files=files,
                     extra={"config": config_digest, "user": request.user or "", "cwd": request.cwd or ""})


def parsed_request(script: str, request: FilterRequest, job: Any = None) -> dict[str, str]:
    """The job's request as the analysis reads it: the script's #SBATCH lines with sbatch's options and SBATCH_*
    variables over them (`xmem.jobscript`'s SbatchRequest, less the options that say nothing about GPU memory).

    Not the options as sent: sbatch hands cli_filter the script's directives merged in, where `check job.sh` has
    only its own command line, so the same job keyed twice and was estimated twice (check, then sbatch). A script
    that does not parse is keyed by the options as sent."""
    if job is None:
        from xmem.jobscript import parse_jobscript

        try:
            job = parse_jobscript(Path(script).read_text(errors="replace"), path=script,
                                  script_args=list(request.script_args), submit_cwd=request.cwd,
                                  cli_options=request.cli_options(), env=dict(request.env) or None)
        except Exception:  # noqa: BLE001 - the analysis says why in its own words; the key needs only to differ
            return {k: v for k, v in request.options.items() if k not in OPTIONS_NOT_IN_KEY}
    return {name: str(value) for name, value in vars(job.directives).items() if name not in ("raw", "job_name")}


# --- from verdict to reply -------------------------------------------------------------------------------------

def user_request(options: Mapping[str, str]) -> str | None:
    """The GPU request as it stands: gres read back without its `gres:` prefixes, or `gpus=...` /
    `gpus-per-node=...`."""
    for option in ("gres", "gpus", "gpus-per-node"):
        if options.get(option):
            value = ",".join(v.removeprefix("gres:") for v in options[option].split(","))
            return value if option == "gres" else f"{option}={value}"
    return None


def with_exports(export: str | None, variables: Mapping[str, str]) -> str | None:
    """The --export value carrying `variables` to the job, or None to leave --export alone: `NONE` is the
    user's explicit choice (the TaskProlog then reads the comment instead). Older XMEM_* entries are replaced."""
    current = (export or "ALL").strip()
    if current.upper() == "NONE" or current.upper().startswith("NONE,"):
        return None
    kept = [item for item in current.split(",") if item and not item.startswith("XMEM_")]
    return ",".join(kept + [f"{k}={v}" for k, v in variables.items()])


def stamp_for(decision: Decision, peaks: Mapping[str, int], request_text: str | None) -> JobStamp:
    gpu_type = decision.gpu_type
    peak = decision.peak_bytes or (peaks.get(gpu_type) if gpu_type else None)
    return JobStamp(peak_bytes=peak, needed_bytes=decision.needed_bytes, gpu_type=gpu_type, request=request_text,
                    action=decision.action)


def reply_for(verdict: Verdict, request: FilterRequest, failure: str) -> FilterReply:
    """The options to set and the user's line, from the verdict and the site's failure mode."""
    if verdict.decision is None or verdict.errors:
        return failure_reply("; ".join(verdict.errors) or "no decision", request, failure)
    d = verdict.decision
    action, reason = d.action, d.reason or ""
    cached = " (cached estimate)" if verdict.cached else ""
    if action == "none":
        return FilterReply()  # no GPU wanted: the job is not ours to touch
    if action == "excluded":  # the site keeps xmem off this job: nothing of ours on it
        return FilterReply(message=f"{reason}; submitted unchanged")
    if action == "no_fit":
        line = f"warning: {reason}; submitted unchanged{cached}"
        return FilterReply(set=recorded(line, request, state="unchanged"), message=line)
    options: dict[str, str] = {}
    if action == "rewrite":
        options.update(rewrite_options(d))
        request_text = d.gres or ",".join(f"{k}={v}" for k, v in rewrite_options(d).items()) or None
        line = f"{reason} -> {describe_request(d)}{cached}"
    else:  # keep: the user's explicit request stands; the estimate still travels with the job
        request_text = user_request(request.options)
        line = f"{reason}; keeping {request_text}{cached}"
    options.update(recorded(line, request, stamp_for(d, verdict.peaks, request_text)))
    return FilterReply(set=options, message=line)


def recorded(line: str, request: FilterRequest, stamp: JobStamp | None = None,
             state: str | None = None) -> dict[str, str]:
    """The options that leave the user's line (`why`) and the GPU request as submitted (`was`) on the job, for
    `xmem-slurm status` and the job itself: the comment's `xmem:` token (the stamp's pairs first; `state` when
    no request came of the estimate: `failed`, `unchanged`) and the job's environment (the stamp's `XMEM_*`
    and the line percent-encoded, which the TaskProlog decodes into XMEM_WHY; not with the user's --export=NONE,
    where the TaskProlog reads the comment)."""
    stamp = stamp or JobStamp()
    notes = {"state": state, "why": line, "was": user_request(request.options) or "none"}
    pairs = ";".join(f"{key}={comment_value(value)}" for key, value in notes.items() if value)
    options = {"comment": add_to_comment(request.options.get("comment"), stamp, pairs)}
    export = with_exports(request.options.get("export"), {**stamp.env(), WHY_ENCODED_ENV: comment_value(line)})
    if export is not None:
        options["export"] = export
    return options


HETJOB_NOTICE = ("a heterogeneous job (hetjob): xmem-slurm does not size its components; submitted unchanged")


def rewrite_options(decision: Decision) -> dict[str, str]:
    """The one option the decision rewrites. The policy answers in the user's own form (`gres`, `gpus` or
    `gpus-per-node`) because cli_filter cannot unset an option: a new value in another form would double it."""
    option = decision.option or ("gres" if decision.gres else "gpus")
    value = decision.gres if option == "gres" else decision.gpus
    return {option: value} if value else {}


def describe_request(decision: Decision) -> str:
    return " ".join(f"--{k}={v}" for k, v in rewrite_options(decision).items()) or "no change"


def failure_reply(why: str, request: FilterRequest, failure: str) -> FilterReply:
    what = f"cannot estimate this job's GPU memory ({one_line(why, MESSAGE_MAX_CHARS // 2)})"  # the outcome stays
    if failure == "closed":
        target = request.script or "the script"
        return FilterReply(reject=f"{what}. This site requires an estimate: job refused. "
                                  f"Run `xmem-slurm check {target}` to see why.")
    line = f"{what}; submitted unchanged"
    return FilterReply(set=recorded(line, request, state="failed"), message=line)
