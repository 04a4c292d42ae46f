"""One batch job, start to decision: parse the script, estimate each training command on the eligible GPU types,
combine the peaks and ask the policy. What `xmem-slurm check` shows and what the sbatch filter acts on.

Owns the order of the steps, which GPU types are eligible (the site config, else the cluster), and how per-command
results and failures are gathered into one `JobAnalysis`. Reads the script file, may query Slurm for the
partition's GPU types, and runs the estimator; the decision itself is `xmem.policy` (pure).
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from xmem.config import EstimateSettings, SiteConfig
from xmem.jobscript import JobScript, TrainCommand, job_array_tasks, parse_jobscript, slurm_runtime_env
from xmem.policy import (Decision, decide, eligible_types, estimate_types, gpus_per_node, job_offers, job_partitions,
                         job_peak, screen)
from xmem.policy.options import OptionRow, OptionTable, option_table

if TYPE_CHECKING:
    from xmem.estimate_record import Estimate
    from xmem.gpus import GpuType

@dataclass(frozen=True)
class AnalysisError:
    """Why (part of) the analysis could not be made. kind: bad_input, not_understood, no_gpu_types, or an
    estimator kind (not_found, not_python, user_error, no_optimizer_step, timeout, internal, unknown_gpu)."""

    kind: str
    message: str
    user_traceback: str = ""
    line_no: int = 0

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class CommandEstimate:
    """One training command and its estimate, or the error it ended with."""

    command: TrainCommand
    estimate: Estimate | None = None
    error: AnalysisError | None = None
    skipped: str | None = None  # why the command does not count (it never used CUDA)
    no_cuda: bool = False  # the program never used CUDA under the trace: its GPU memory is unknown
    array_task: int | None = None  # the job array's task it was traced as (SLURM_ARRAY_TASK_ID)

    @property
    def counted(self) -> bool:
        """The command's estimate sizes the job."""
        return self.estimate is not None and not self.skipped

    def to_json(self) -> dict[str, Any]:
        estimate = self.estimate.to_json() if self.estimate else {"used_cuda": False} if self.no_cuda else None
        return {"command": self.command.to_json(), "estimate": estimate,
                "error": _error_json(self.error) if self.error else None, "skipped": self.skipped,
                "array_task": self.array_task}


@dataclass(frozen=True)
class JobAnalysis:
    job: JobScript | None
    estimates: tuple[CommandEstimate, ...] = ()
    gpu_types: tuple[str, ...] = ()  # the site's GPU types the job was estimated for (GRES names)
    peaks: Mapping[str, int] = field(default_factory=dict)  # per GPU type, max over commands, bytes per rank
    decision: Decision | None = None
    errors: tuple[AnalysisError, ...] = ()
    partitions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what was left out and why (e.g. a cluster GPU type the catalog lacks)
    options: OptionTable | None = None  # the offers the policy weighed, side by side: usable, need, the pick...

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job.to_json() if self.job else None,
            "partitions": list(self.partitions),
            "gpu_types": list(self.gpu_types),
            "estimates": [e.to_json() for e in self.estimates],
            "peaks": dict(self.peaks),
            "decision": self.decision.to_json() if self.decision else None,
            "errors": [_error_json(e) for e in self.errors],
            "notes": list(self.notes),
            "offers": [_offer_json(row) for row in self.options.rows] if self.options else [],
            "options": self.options.to_json() if self.options else None,
        }


Estimator = Callable[..., "Estimate"]  # xmem.estimate.estimate's signature


class ClusterInfo(Protocol):
    """What the analysis reads of the cluster's offers (xmem.slurm.cluster.ClusterInfo has it). A protocol, so that
    the analysis needs no Slurm: the caller that can ask Slurm hands the answer in."""

    @property
    def default_partition(self) -> str | None: ...

    @property
    def gpu_types(self) -> Mapping[str, tuple[str, ...]]: ...

    def gres_counts(self, partition: str) -> dict[str, dict[str, int]]: ...


ClusterSource = Callable[[], "ClusterInfo | None"]  # what Slurm says, or None when it cannot be asked


def analyze_job(script_path: str | os.PathLike, *, script_args: Sequence[str] = (),
                cli_options: Mapping[str, str | None] | None = None, config: SiteConfig,
                env: Mapping[str, str] | None = None, user: str | None = None,
                gpus: Sequence[str] | None = None, submit_cwd: str | None = None,
                on_progress: Callable[[str], None] | None = None, estimator: Estimator | None = None,
                cluster: ClusterSource | None = None, deadline: float | None = None) -> JobAnalysis:
    """Analyse the batch script at `script_path` as it would be submitted (`sbatch [cli_options] script args`).

    `env`: the submitting environment (default: this process's). `gpus`: estimate these GPU types instead of the
    partition's. `estimator` defaults to `xmem.estimate.estimate`. `cluster`: what Slurm says (the caller's query,
    xmem.slurm.cluster.ask_slurm: the analysis never asks Slurm itself), asked at most once and only when the site
    config lets the cluster fill in what it leaves out (partitions, default, GPUs per node); None: no cluster.
    `deadline` (time.monotonic()) bounds the estimates; default: the site's estimate timeout from now."""
    env = dict(os.environ if env is None else env)
    path = os.path.abspath(script_path)
    submit_cwd = submit_cwd or os.getcwd()  # where sbatch (and the filter it runs) is: the job's default dir
    read = _read_job(path, script_args, cli_options, env, submit_cwd)
    if isinstance(read, AnalysisError):
        return JobAnalysis(None, errors=(read,))
    text, job = read
    user = user or env.get("USER")

    early = screen(job.directives, config, user=user)  # no GPU wanted, or excluded: no estimate needed
    if early is not None:
        return JobAnalysis(job, decision=early)
    if not job.commands:
        reasons = "; ".join(str(p) for p in job.problems) or "no training command found"
        return JobAnalysis(job, errors=(AnalysisError("not_understood", reasons),))

    ask_cluster = _once(cluster) if cluster and config.partitions.from_cluster else (lambda: None)
    scope = _gpu_scope(job, config, gpus, ask_cluster)
    if not scope.site_types:
        where = ", ".join(scope.partitions) or "(none named, and no default partition in the site config)"
        return JobAnalysis(job, partitions=scope.partitions, notes=scope.notes, errors=(AnalysisError(
            "no_gpu_types", f"no GPU types known for partition {where}: list them under "
                            "[partitions.gpu_types] in the site config"),))

    tasks = [job] + [parse_jobscript(text, path=path, script_args=list(script_args), submit_cwd=submit_cwd,
                                     cli_options=cli_options, env=env, array_task=t, run_unnamed=True)
                     for t in job_array_tasks(job.directives)[1:]]
    notes = scope.notes + _array_note(tasks)
    deadline = deadline if deadline is not None else time.monotonic() + config.estimate.timeout_s
    results = tuple(replace(_estimate_command(c, scope, {**env, **slurm_runtime_env(t.directives, submit_cwd,
                                                                                     t.array_task)},
                                              submit_cwd, deadline, estimator or _default_estimator(), on_progress),
                            array_task=t.array_task)
                    for t in tasks for c in t.commands)
    errors = tuple(r.error for r in results if r.error is not None) + _array_problems(tasks)
    counted = [r.estimate for r in results if r.counted]
    peaks = combined_peaks(counted, scope.site_types, scope.config, scope.catalog)
    untrusted = untrusted_estimate(results)
    if not errors and not peaks and not untrusted:
        errors = (AnalysisError("no_optimizer_step", "no command of the job reached an optimizer step on the GPU: "
                                + "; ".join(r.skipped or "" for r in results)),)
    if errors:
        return JobAnalysis(job, results, scope.site_types, peaks, errors=errors, partitions=scope.partitions,
                           notes=notes)
    decision, options = _decide(job, peaks, scope, user, ask_cluster, untrusted)
    if decision is not None and decision.action == "no_fit":
        hint = _BatchHintJob(path, tuple(script_args), job.directives, env, submit_cwd, deadline,
                             estimator or _default_estimator())
        decision = hint.added_to(decision, results, scope)
    return JobAnalysis(job, results, scope.site_types, peaks, decision, partitions=scope.partitions,
                       notes=notes, options=options)


def _read_job(path: str, script_args: Sequence[str], cli_options: Mapping[str, str | None] | None,
              env: Mapping[str, str], submit_cwd: str) -> tuple[str, JobScript] | AnalysisError:
    """The batch script's text and what it asks and runs, as submitted (`sbatch [cli_options] path script_args`)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return AnalysisError("bad_input", f"cannot read {path}: {e.strerror}")
    return text, parse_jobscript(text, path=path, script_args=list(script_args), submit_cwd=submit_cwd,
                                 cli_options=cli_options, env=env, run_unnamed=True)


def command_settings(command: TrainCommand, config: SiteConfig, job_env: Mapping[str, str],
                     submit_cwd: str) -> dict[str, Any]:
    """What `estimate()` is given for one training command of a job besides its GPU types, time left and the site's
    settings: the iterations, the command's environment (the job's, `job_env`, with the command's own), its
    directory and its interpreter."""
    return {"iterations": config.estimate.iterations, "env": {**job_env, **command.env},
            "cwd": command.cwd or submit_cwd, "python": command.python or config.estimate.python}


@dataclass(frozen=True)
class FirstCommand:
    """A batch script's first training command as the analysis estimates it (`check JOB.sh --vary` searches it)."""

    command: TrainCommand
    targets: tuple[str, ...]  # the GPU types the analysis estimates the job for (none: its partitions name none)
    job: dict[str, Any]  # `command_settings`


def first_command(script_path: str | os.PathLike, *, script_args: Sequence[str] = (),
                  cli_options: Mapping[str, str | None] | None = None, config: SiteConfig,
                  env: Mapping[str, str] | None = None, gpus: Sequence[str] | None = None,
                  submit_cwd: str | None = None) -> FirstCommand | AnalysisError:
    """The job's first training command, the GPU types and the settings `analyze_job` would estimate it with (the
    script read, the partitions scoped, the SLURM_* variables of its step), or why there is none (bad_input,
    not_understood)."""
    env = dict(os.environ if env is None else env)
    path = os.path.abspath(script_path)
    submit_cwd = submit_cwd or os.getcwd()
    read = _read_job(path, script_args, cli_options, env, submit_cwd)
    if isinstance(read, AnalysisError):
        return read
    _, job = read
    if not job.commands:
        return AnalysisError("not_understood", "; ".join(str(p) for p in job.problems) or "no training command found")
    scope = _gpu_scope(job, config, gpus, lambda: None)
    job_env = {**env, **slurm_runtime_env(job.directives, submit_cwd, job.array_task)}
    return FirstCommand(job.commands[0], scope.targets, command_settings(job.commands[0], config, job_env, submit_cwd))


@dataclass(frozen=True)
class _BatchHintJob:
    """What the hint of a job that fits no offer needs of the analysis: the script as submitted, its environment and
    directory, the time left and the estimator."""

    path: str
    script_args: tuple[str, ...]
    directives: Any  # the job's xmem.jobscript.SbatchRequest: the SLURM_* variables its commands see
    env: Mapping[str, str]
    submit_cwd: str
    deadline: float
    estimator: Estimator

    def added_to(self, decision: Decision, results: Sequence[CommandEstimate], scope: _Scope) -> Decision:
        """`decision` with the largest batch size of the first counted command that has one (`xmem.fit_trace`)
        added to its reason, the filter's line and check's decision: found in what is left of the time limit, at
        most HINT_BUDGET_S (a few traces); unchanged where there is no batch option or no time."""
        from xmem.fit_trace import HINT_BUDGET_S, batch_knob, largest_batch

        first = next((r for r in results if r.counted and batch_knob(r.command.argv)), None)
        budget = min(HINT_BUDGET_S, self.deadline - time.monotonic())
        if first is None or budget <= 1:
            return decision
        name, given = batch_knob(first.command.argv) or ("", 0)
        config, command = scope.config, first.command
        see_more = f"xmem-slurm check --vary {name}=1..{given} {shlex.quote(self.path)}" + (
            f" -- {shlex.join(self.script_args)}" if self.script_args else "")
        job_env = {**self.env, **slurm_runtime_env(self.directives, self.submit_cwd, first.array_task)}
        settings = {**command_settings(command, config, job_env, self.submit_cwd), "timeout": budget}
        hint = largest_batch(command.argv, scope.targets, config, settings, see_more, budget_s=budget,
                             estimator=self.estimator, settings=scope.settings)
        return decision if hint is None else replace(decision, reason=f"{decision.reason}; {hint.text()}")


def decide_on_peaks(job: JobScript, peaks: Mapping[str, int], config: SiteConfig, *, user: str | None = None,
                    cluster: ClusterSource | None = None) -> Decision:
    """The policy's decision for `job` on peaks already known, weighed against the cluster's offers as
    `analyze_job` weighs them: what a cached decision must still be to be used (xmem.slurm.cache_check)."""
    ask_cluster = _once(cluster) if cluster and config.partitions.from_cluster else (lambda: None)
    return _decide(job, peaks, _gpu_scope(job, config, None, ask_cluster), user, ask_cluster)[0]


def _array_note(tasks: Sequence[JobScript]) -> tuple[str, ...]:
    if len(tasks) < 2:
        return ()
    return (f"job array: tasks {', '.join(str(t.array_task) for t in tasks)} traced (the first, the middle, the "
            "last); one request serves every task, so it is sized for the largest",)


def _array_problems(tasks: Sequence[JobScript]) -> tuple[AnalysisError, ...]:
    """A later array task whose commands cannot be read: its memory is unknown, so the request cannot cover it."""
    return tuple(AnalysisError("not_understood", f"array task {t.array_task}: " + (
        "; ".join(str(p) for p in t.problems) or "no training command found")) for t in tasks[1:] if not t.commands)


@dataclass(frozen=True)
class _Scope:
    """Where the job may run and what it is estimated for: the config completed from the cluster, the partitions,
    the site's GPU types there (GRES names), the types to estimate (MIG slices as their parent), the GPU catalog
    (read once for the job: the types, the peaks and the policy all need it) and notes."""

    config: SiteConfig
    partitions: tuple[str, ...]
    site_types: tuple[str, ...]
    targets: tuple[str, ...]
    catalog: Mapping[str, GpuType]
    notes: tuple[str, ...] = ()

    @property
    def settings(self) -> EstimateSettings:
        """What every estimate of the job takes from the site (its catalog as read once for the job)."""
        return self.config.estimate_settings(self.catalog)


def _gpu_scope(job: JobScript, config: SiteConfig, gpus: Sequence[str] | None,
               ask_cluster: ClusterSource) -> _Scope:
    partitions = job_partitions(job.directives, config)
    if not partitions and (info := ask_cluster()) and info.default_partition:
        partitions = (info.default_partition,)
    config = _with_cluster_partitions(config, partitions, ask_cluster)
    catalog = config.catalog()
    if gpus:
        return _Scope(config, partitions, tuple(gpus), tuple(gpus), catalog)
    site_types, notes = _known_types(eligible_types(config, partitions), config, catalog)
    if not eligible_types(config, partitions) and (asked := _asked_types(job, config, catalog)):
        where = ", ".join(partitions) or "the default partition"
        return _Scope(config, partitions, asked, asked, catalog, notes + (
            f"no site config names the GPU types of {where}: estimated for the type the job asks for "
            f"({', '.join(asked)})",))
    return _Scope(config, partitions, site_types, estimate_types(config, partitions), catalog, notes)


def _asked_types(job: JobScript, config: SiteConfig, catalog: Mapping[str, GpuType]) -> tuple[str, ...]:
    """The GPU types the job's own request names (`--gres=gpu:a100:1`, `--gpus=h100:2`) that the catalog knows: what
    a newcomer without a site config, or a partition the config leaves out, is estimated for."""
    named = tuple(dict.fromkeys(item.type for item in job.directives.gpu_items if item.type))
    return _known_types(named, config, catalog)[0]


def untrusted_estimate(results: Sequence[CommandEstimate]) -> str | None:
    """Why the job's estimates cannot size its request (the policy then keeps the user's): no command used CUDA
    under the trace (TensorFlow or JAX, CUDA only in a subprocess, an early exit), or an estimate failed its
    self-audit (`suspect_reasons`). None when they can."""
    suspect = [reason for r in results if r.counted for reason in r.estimate.suspect_reasons]
    if suspect:
        return "the estimate is suspect (" + "; ".join(dict.fromkeys(suspect)) + ")"
    if any(r.counted for r in results):
        return None
    if any(r.no_cuda for r in results):
        return ("no command of the job used CUDA under the trace (TensorFlow or JAX, CUDA only in a subprocess, "
                "an early exit?), so its GPU memory is unknown")
    return None


def _decide(job: JobScript, peaks: Mapping[str, int], scope: _Scope, user: str | None,
            ask_cluster: ClusterSource,
            untrusted: str | None = None) -> tuple[Decision, OptionTable]:
    """The policy's decision, and the offers it weighed side by side (for people: `check` shows them)."""
    request, partition = job.directives, ",".join(scope.partitions)
    available = _gpus_per_node(ask_cluster(), scope.partitions) if gpus_per_node(request) > 1 else None
    weighed = job_offers(peaks, request, scope.config, partition=partition, catalog=scope.catalog)
    decision = decide(peaks, request, scope.config, user=user, partition=partition, catalog=scope.catalog,
                      available=available, untrusted=untrusted, offers=weighed)
    options = option_table(peaks, request, scope.config, decision, partition=partition, catalog=scope.catalog,
                           available=available, offers=weighed)
    return decision, options


def combined_peaks(estimates: Sequence[Estimate], site_types: Sequence[str],
                   config: SiteConfig, catalog: Mapping[str, GpuType] | None = None) -> dict[str, int]:
    """Per site GPU type (GRES name), the largest need over the commands (`job_peak`: more than the GPU holds where
    a replay ran out of memory). A MIG slice gets its parent's peak.
    Estimates are keyed by catalog names; they are matched to the site's names through the catalog."""
    from xmem.gpus import UnknownGpuError, find_gpu

    catalog = catalog if catalog is not None else config.catalog()
    peaks: dict[str, int] = {}
    for site_type in site_types:
        parent = config.mig.parent_of(site_type) or site_type
        try:
            name = find_gpu(parent, catalog).name
        except UnknownGpuError:
            continue
        values = [job_peak(gpu) for e in estimates for key, gpu in e.gpus.items() if key == name or key == parent]
        if values:
            peaks[site_type] = max(values)
    return peaks


def _estimate_command(command: TrainCommand, scope: _Scope, env: Mapping[str, str], submit_cwd: str,
                      deadline: float, estimator: Estimator,
                      on_progress: Callable[[str], None] | None) -> CommandEstimate:
    config = scope.config
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return CommandEstimate(command, error=AnalysisError(
            "timeout", f"the estimate time limit ({config.estimate.timeout_s:g} s) was spent before line "
                       f"{command.line_no}", line_no=command.line_no))
    try:
        result = estimator(list(command.argv), gpus=list(scope.targets), timeout=remaining, settings=scope.settings,
                           on_progress=on_progress, **command_settings(command, config, env, submit_cwd))
    except Exception as e:  # the estimator's own errors carry a kind; anything else is reported as internal
        kind = getattr(e, "kind", None) or ("unknown_gpu" if type(e).__name__ == "UnknownGpuError" else "internal")
        message = getattr(e, "message", None) or str(e) or type(e).__name__
        error = AnalysisError(kind, f"line {command.line_no} ({' '.join(command.argv)}): {message}",
                              getattr(e, "user_traceback", "") or "", command.line_no)
        if kind == "no_cuda":  # TensorFlow, JAX, an early exit: its GPU memory is unknown (see untrusted_estimate)
            said = "".join(f"\n  | {line}" for line in e.last_lines().splitlines()) if hasattr(e, "last_lines") else ""
            return CommandEstimate(command, skipped=error.message + (f":{said}" if said else ""), no_cuda=True)
        return CommandEstimate(command, error=error)
    if not result.used_cuda:
        return CommandEstimate(command, result, skipped=f"line {command.line_no}: the program never used CUDA",
                               no_cuda=True)
    return CommandEstimate(command, result)


def _with_cluster_partitions(config: SiteConfig, partitions: Sequence[str],
                             ask_cluster: ClusterSource) -> SiteConfig:
    """Partitions the site config leaves out get their GPU types from Slurm."""
    missing = [p for p in partitions if p not in config.partitions.gpu_types]
    info = ask_cluster() if missing else None
    if info is None:
        return config
    found = {p: types for p in missing if (types := info.gpu_types.get(p))}
    return config.with_partitions(found) if found else config


def _known_types(types: Sequence[str], config: SiteConfig,
                 catalog: Mapping[str, GpuType]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The GPU types the catalog can size (MIG slices through their parent), and a note for each one left out
    (only Slurm can name those: the site config's own types are checked when it is loaded)."""
    from xmem.gpus import UnknownGpuError, find_gpu

    known, notes = [], []
    for gpu_type in types:
        try:
            find_gpu(config.mig.parent_of(gpu_type) or gpu_type, catalog)
            known.append(gpu_type)
        except UnknownGpuError:
            notes.append(f"GPU type {gpu_type!r} (from Slurm) is not in the GPU catalog and was left out; "
                         "add it under [catalog.gpus] or [mig] in the site config")
    return tuple(known), tuple(notes)


def _gpus_per_node(info: ClusterInfo | None, partitions: Sequence[str]) -> dict[str, int] | None:
    """Per GPU GRES type, the most one node has in every one of `partitions`: a multi-GPU request cannot ask more."""
    if info is None or not partitions:
        return None
    per_partition = [info.gres_counts(p).get("gpu", {}) for p in partitions]
    types = set.intersection(*(set(counts) for counts in per_partition))
    return {t: min(counts[t] for counts in per_partition) for t in types if t}


def _once(source: ClusterSource) -> ClusterSource:
    answer: list[ClusterInfo | None] = []

    def ask() -> ClusterInfo | None:
        if not answer:
            answer.append(source())
        return answer[0]
    return ask


def _default_estimator() -> Estimator:
    from xmem.estimate import estimate

    return estimate


def _offer_json(row: OptionRow) -> dict[str, Any]:
    """One offer as `check --json` lists it under `offers` (the option table's row, in the older field names)."""
    return {"kind": row.kind, "request": row.request, "gpu_type": row.gres_type, "granted_bytes": row.usable_bytes,
            "needed_bytes": row.needed_bytes, "fits": row.fits, "description": row.description}


def _error_json(error: AnalysisError) -> dict[str, Any]:
    return {"kind": error.kind, "message": error.message, "user_traceback": error.user_traceback or None,
            "line_no": error.line_no}
