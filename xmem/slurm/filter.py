"""`xmem-slurm filter`: the Python side of slurm/cli_filter.lua, run by sbatch as the submitting user.

Owns the I/O contract with the Lua side (documented in slurm/README.md), turning a job analysis into the sbatch
options to set (`gres`/`gpus`, `comment` carrying the estimate, `export` carrying it to the TaskProlog), the
one line the user sees, and the site's fail-open / fail-closed rule. Analyses are cached (xmem.cache), so an
unchanged resubmission skips the estimate. Parsing the script, the estimate and the policy belong to
xmem.jobscript, xmem.analyze and xmem.policy; nothing here second-guesses them.

Contract, in:  {"script": abs path | null, "argv": [...], "options": {long option: value, as
                slurm.json_cli_options gives them}, "user": str | null, "env": {name: value},
                "cwd": optional, default the filter's own working directory (sbatch's)}
         out:  {"set": {option: string}, "message": str | null, "reject": str | null, "fault": str | null,
                "defer": token | null (deferred mode: post-submit queues the estimation job, xmem.slurm.deferred)}
`fault` is set only when the filter could not even learn the site's failure mode (the Lua side then applies
its install-time default). Option values in `set` are exact (what the user wrote passes unchanged: quotes,
backslashes); the Lua side decodes JSON strings. The lines for people (`message`, `reject`, `fault`) are one line
of at most MESSAGE_MAX_CHARS. `hetjob` in the input (the Lua side saw a `:` component separator) or a
`#SBATCH hetjob` line: heterogeneous jobs are not sized (cli_filter hands each component over on its own, and the
first's options leak into the next), so they pass unchanged with a notice.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from xmem.cache import (SHARED_SLOTS_DIR, AnalysisCache, NoSlotFree, cache_key, estimate_slot, file_digest,
                        user_cache_dir)
from xmem.slurm.cache_check import valid_analysis
from xmem.slurm.node import JobStamp, add_to_comment

GIB = 1 << 30
MESSAGE_MAX_CHARS = 600  # a user's 1 MB exception message must not flood the terminal or the job comment
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
    defer: str | None = None  # deferred mode: the token post-submit hands to `python -m xmem.slurm.deferred`

    def to_json(self) -> dict[str, Any]:
        return {"set": {k: str(v) for k, v in self.set.items()}, "message": plain(self.message),
                "reject": plain(self.reject), "fault": plain(self.fault), "defer": plain(self.defer)}


def plain(text: str | None, limit: int = MESSAGE_MAX_CHARS) -> str | None:
    """A line for people: control characters as spaces, cut to `limit` characters (with a mark)."""
    if text is None:
        return None
    text = re.sub(r"[\x00-\x1f\x7f]+", " ", str(text)).strip()
    return text if len(text) <= limit else text[:limit - 15].rstrip() + " [... cut]"


# --- the analysis, cached -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Analysis:
    """What the filter keeps of `xmem.analyze.JobAnalysis`: plain data, cached as JSON."""

    decision: Mapping[str, Any] | None  # xmem.policy.Decision as a dict
    peaks: Mapping[str, int] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"decision": dict(self.decision) if self.decision else None, "peaks": dict(self.peaks),
                "errors": list(self.errors)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, cached: bool = False) -> Analysis:
        """The analysis back from `to_json()`; ValueError when `data` is not one (a damaged cache entry)."""
        decision, peaks, errors = data.get("decision"), data.get("peaks") or {}, data.get("errors") or []
        from xmem.policy import ACTIONS

        if not (isinstance(decision, Mapping) and decision.get("action") in ACTIONS
                and all(isinstance(v, str) or v is None for k, v in decision.items() if k in _DECISION_TEXT)
                and all(isinstance(v, int) or v is None for k, v in decision.items() if k.endswith("_bytes"))
                and isinstance(peaks, Mapping) and all(isinstance(v, int) for v in peaks.values())
                and isinstance(errors, list)):
            raise ValueError("not an analysis")
        return cls(decision=decision, peaks=peaks, errors=tuple(map(str, errors)), cached=cached)


_DECISION_TEXT = ("reason", "gres", "gpus", "option", "kind", "gpu_type", "comment")


def analysis_from_job(job_analysis: Any) -> Analysis:
    """Plain data from an `xmem.analyze.JobAnalysis`."""
    decision = job_analysis.decision
    if decision is not None and dataclasses.is_dataclass(decision):
        decision = dataclasses.asdict(decision)
    return Analysis(decision=decision, peaks={k: int(v) for k, v in (job_analysis.peaks or {}).items()},
                    errors=tuple(_error_text(e) for e in job_analysis.errors or ()))


def _error_text(error: Any) -> str:
    kind, message = getattr(error, "kind", None), getattr(error, "message", None)
    if kind and message:
        return f"{kind}: {message}"
    return str(error)


def analyze(script: str, request: FilterRequest, config: Any) -> Analysis:
    """Run the real analysis (parse, estimate, policy). Imported here: torch loads only on a cache miss."""
    from xmem.analyze import analyze_job
    from xmem.trace import privileges

    try:
        job_analysis = analyze_job(script, script_args=request.script_args, cli_options=request.cli_options(),
                                   config=config, env=dict(request.env) or None, user=request.user,
                                   submit_cwd=request.cwd,
                                   estimator=privileges.guarded_estimator(request.options, script))
    except Exception as e:  # an estimator fault of any kind: the failure mode decides what happens
        return Analysis(decision=None, errors=(_error_text(e),))
    kept = privileges.kept_decision(job_analysis.errors)  # a user's program is never traced as root
    return Analysis(decision=kept) if kept else analysis_from_job(job_analysis)


def parse_job(script: str, request: FilterRequest) -> Any:
    """The batch script as xmem.jobscript reads it, in the submitter's environment and directory; None when it
    is not understood here (the analysis then says why, in its own words)."""
    from xmem.jobscript import parse_jobscript

    try:
        return parse_jobscript(Path(script).read_text(errors="replace"), path=script,
                               script_args=list(request.script_args), submit_cwd=request.cwd,
                               cli_options=request.cli_options(), env=dict(request.env) or None)
    except Exception:
        return None


def command_files(job: Any, request: FilterRequest, script: str) -> list[str]:
    """Files the job's training commands name (train.py, a config...): their bytes belong in the cache key."""
    files = []
    for command in getattr(job, "commands", ()):
        cwd = command.cwd or request.cwd or os.path.dirname(script)
        for arg in command.argv[1:]:
            path = os.path.join(cwd, arg)
            if os.path.isfile(path):
                files.append(os.path.realpath(path))
    return files


def key_for(script: str, request: FilterRequest, config_digest: str, files: list[str]) -> str:
    options = {k: v for k, v in request.options.items() if k not in OPTIONS_NOT_IN_KEY}
    return cache_key(script=Path(script).read_bytes(), script_args=request.script_args, options=options,
                     env=request.env, files=files,
                     extra={"config": config_digest, "user": request.user or "", "cwd": request.cwd or ""})


def analysis_cache(config: Any) -> AnalysisCache:
    """The site's analysis cache: the user's private part of the cache directory, entries checked on read."""
    return AnalysisCache(user_cache_dir(config.estimate.cache_dir) / "analyses", validate=valid_analysis)


def config_digest(config: Any) -> str:
    """The site config's part of the cache key: its bytes, not its name."""
    return file_digest(config.source) if config.source else ""


def estimate_slots(config: Any) -> contextlib.AbstractContextManager:
    """One of the host's estimate slots, waiting at most the site's estimate timeout."""
    return estimate_slot(SHARED_SLOTS_DIR, config.estimate.max_concurrent, wait_s=config.estimate.timeout_s)


def cached_analysis(script: str, request: FilterRequest, config: Any, *, cache: AnalysisCache,
                    config_digest: str, files: Sequence[str] = (),
                    analyzer: Callable[[str, FilterRequest, Any], Analysis] = analyze,
                    slots: Callable[[], contextlib.AbstractContextManager] | None = None,
                    key: str | None = None) -> Analysis:
    """The analysis from the cache, else computed (holding an estimate slot) and cached if it succeeded.
    Failures are not cached: the next submission tries again (the cause may have been transient). `key`: the
    cache key when the caller has it already (key_for reads and hashes the script and its files).

    The key hashes the files before the trace reads them: the result is stored only if they hash the same
    afterwards (an edit during the estimate would otherwise file the edited program's estimate under the
    original's key). The answer itself stands: it is of the files the job will run."""
    key = key or key_for(script, request, config_digest, list(files))
    hit = _cached(cache, key)
    if hit is not None:
        return hit
    with slots() if slots else contextlib.nullcontext():
        hit = _cached(cache, key)  # a burst of the same job: the first slot holder's result serves the others
        if hit is not None:
            return hit
        analysis = analyzer(script, request, config)
    if analysis.decision is not None and not analysis.errors and _same_files(key, script, request, config_digest,
                                                                             files):
        with contextlib.suppress(OSError):  # a cache that cannot be written never costs the answer
            cache.put(key, analysis.to_json())
    return analysis


def _cached(cache: AnalysisCache, key: str) -> Analysis | None:
    """A cache hit, or None: a damaged entry counts as a miss, so it is computed (and written) again."""
    hit = cache.get(key)
    if hit is None:
        return None
    try:
        return Analysis.from_json(hit, cached=True)
    except (ValueError, TypeError, AttributeError):
        return None


def _same_files(key: str, script: str, request: FilterRequest, config_digest: str, files: Sequence[str]) -> bool:
    try:
        return key_for(script, request, config_digest, list(files)) == key
    except OSError:
        return False


# --- from analysis to reply ------------------------------------------------------------------------------------

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


def stamp_for(analysis: Analysis, request_text: str | None) -> JobStamp:
    d = analysis.decision or {}
    gpu_type = d.get("gpu_type")
    peak = d.get("peak_bytes") or (analysis.peaks.get(gpu_type) if gpu_type else None)
    return JobStamp(peak_bytes=peak,
                    needed_bytes=d.get("needed_bytes"), gpu_type=gpu_type, request=request_text,
                    action=d.get("action"))


def reply_for(analysis: Analysis, request: FilterRequest, failure: str) -> FilterReply:
    """The options to set and the user's line, from the analysis and the site's failure mode."""
    if analysis.decision is None or analysis.errors:
        return failure_reply("; ".join(analysis.errors) or "no decision", request, failure)
    d = analysis.decision
    action, reason = d.get("action"), d.get("reason") or ""
    cached = " (cached estimate)" if analysis.cached else ""
    if action == "none":
        return FilterReply()  # no GPU wanted: the job is not ours to touch
    if action == "excluded":
        return FilterReply(message=f"{reason}; submitted unchanged")
    if action == "no_fit":
        return FilterReply(message=f"warning: {reason}; submitted unchanged{cached}")
    options: dict[str, str] = {}
    if action == "rewrite":
        options.update(rewrite_options(d))
        request_text = d.get("gres") or ",".join(f"{k}={v}" for k, v in rewrite_options(d).items()) or None
        line = f"{reason} -> {describe_request(d)}{cached}"
    else:  # keep: the user's explicit request stands; the estimate still travels with the job
        request_text = user_request(request.options)
        line = f"{reason}; keeping {request_text}{cached}"
    stamp = stamp_for(analysis, request_text)
    why = "" if stamp.peak_bytes is not None or action != "keep" else f"why={comment_word(reason)}"
    options["comment"] = add_to_comment(request.options.get("comment"), stamp, why)
    export = with_exports(request.options.get("export"), stamp.env())
    if export is not None:
        options["export"] = export
    return FilterReply(set=options, message=line)


def comment_word(text: str, limit: int = 200) -> str:
    """`text` as one value of the comment's `xmem:` token: no spaces, commas, semicolons or quotes, short."""
    return re.sub(r"[,;\s\"'\\]+", "+", text)[:limit]


HETJOB_NOTICE = ("a heterogeneous job (hetjob): xmem-slurm does not size its components; submitted unchanged")


def rewrite_options(decision: Mapping[str, Any]) -> dict[str, str]:
    """The one option the decision rewrites. The policy answers in the user's own form (`gres`, `gpus` or
    `gpus-per-node`) because cli_filter cannot unset an option: a new value in another form would double it."""
    option = decision.get("option") or ("gres" if decision.get("gres") else "gpus")
    value = decision.get("gres") if option == "gres" else decision.get("gpus")
    return {option: value} if value else {}


def describe_request(decision: Mapping[str, Any]) -> str:
    return " ".join(f"--{k}={v}" for k, v in rewrite_options(decision).items()) or "no change"


def failure_reply(why: str, request: FilterRequest, failure: str) -> FilterReply:
    what = f"cannot estimate this job's GPU memory ({plain(why, MESSAGE_MAX_CHARS // 2)})"  # the outcome stays
    if failure == "closed":
        target = request.script or "the script"
        return FilterReply(reject=f"{what}. This site requires an estimate: job refused. "
                                  f"Run `xmem-slurm check {target}` to see why.")
    return FilterReply(message=f"{what}; submitted unchanged")


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


def deferring(config: Any) -> bool:
    """Deferred mode: estimates that are not cached run as jobs on the CPU partition (xmem.slurm.deferred)."""
    deferred = getattr(config, "deferred", None)
    return bool(deferred and deferred.mode == "partition" and deferred.cpu_partition)


def run_filter(request: FilterRequest, config: Any, *,
               analyzer: Callable[[str, FilterRequest, Any], Analysis] = analyze) -> FilterReply:
    """One submission, start to reply. `config` is an xmem.config.SiteConfig; its estimate timeout bounds the
    wait for an estimate slot and the estimate together."""
    failure = config.failure
    cache = analysis_cache(config)
    started = time.monotonic()

    def timed_analyzer(script: str, req: FilterRequest, site: Any) -> Analysis:
        left = max(1.0, site.estimate.timeout_s - (time.monotonic() - started))
        return analyzer(script, req, dataclasses.replace(site, estimate=dataclasses.replace(site.estimate,
                                                                                             timeout_s=left)))

    with wrapped_script(request) as script:
        if script is None:
            return FilterReply()
        job = parse_job(script, request)
        if request.hetjob or (job is not None and job.het_line):
            return FilterReply(message=HETJOB_NOTICE)
        if job is not None and not job.directives.wants_gpu:
            return FilterReply()  # a CPU job: no estimate, no change, no message
        digest = config_digest(config)
        files = command_files(job, request, script)
        try:
            key = key_for(script, request, digest, files)
            if deferring(config) and _cached(cache, key) is None:
                from xmem.slurm.deferred import cannot_defer, defer

                if why := cannot_defer(request):
                    return failure_reply(why, request, failure)
                reply, token = defer(script, request, config)
                return dataclasses.replace(reply, defer=token)
            analysis = cached_analysis(script, request, config, cache=cache, config_digest=digest, files=files,
                                       analyzer=timed_analyzer, slots=lambda: estimate_slots(config), key=key)
        except NoSlotFree as e:
            return failure_reply(str(e), request, failure)
        except OSError as e:
            return failure_reply(f"cannot read {e.filename}: {e.strerror}", request, failure)
    return reply_for(analysis, request, failure)


# --- entry point ------------------------------------------------------------------------------------------------

def filter_main(*, config_path: str | None = None, failure_mode: bool = False, stdin: IO[str] = sys.stdin,
                stdout: IO[str] = sys.stdout) -> int:
    """The whole `xmem-slurm filter` command: read the request, write the reply. Also reachable as
    `python -m xmem.slurm.filter`, which cli_filter.lua uses because it skips loading the other commands
    (a cached resubmission then costs a third of the CPU time)."""
    from xmem.config import load_site_config

    try:
        site = load_site_config(config_path)
    except Exception as e:  # the failure mode itself is unknown: the Lua side applies its default
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
        return _emit(stdout, FilterReply(fault=f"bad filter input: {e}"))
    try:
        reply = run_filter(request, site)
    except Exception as e:  # a bug of ours must not look like the user's fault, nor stop the submission
        reply = failure_reply(f"internal error: {type(e).__name__}: {e}", request, site.failure)
    return _emit(stdout, reply)


def _emit(stdout: IO[str], reply: FilterReply) -> int:
    stdout.write(json.dumps(reply.to_json(), ensure_ascii=True) + "\n")
    stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem.slurm.filter",
                                     description="xmem-slurm filter for cli_filter.lua (see slurm/README.md)")
    parser.add_argument("--failure-mode", action="store_true", help="print the site's failure mode")
    parser.add_argument("--config", default=None, help="site config (default: $XMEM_CONFIG, /etc/xmem/xmem.toml)")
    args = parser.parse_args(argv)
    return filter_main(config_path=args.config, failure_mode=args.failure_mode)


if __name__ == "__main__":
    sys.exit(main())
