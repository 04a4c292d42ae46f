"""One trace of a job at a value of one of its knobs, as `xmem.fit`'s search reads it (`point_tracer`), and what a
job that fits none of the GPU types asked is told to try: the largest batch size that fits, found by that search in
bounded time (`largest_batch`, `BatchHint`).

`fit --vary` (xmem.cli.fit), `estimate` (xmem.cli.estimate) and the analysis behind `check` and the filter
(xmem.analyze) use it. The search itself is `xmem.fit`'s; this module runs the estimates it asks for.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xmem.config import EstimateSettings, SiteConfig
from xmem.fit import Point, Tracer, Vary, command_at, find_limits, phase_peaks
from xmem.gpus import find_gpu
from xmem.policy.options import fixed_options

# How training programs name their batch size on the command line (argparse, HF TrainingArguments, Lightning CLI,
# Megatron): the knob a job that fits nowhere is told to turn. First found wins.
BATCH_OPTIONS = ("batch-size", "per-device-train-batch-size", "train-batch-size", "micro-batch-size", "bs",
                 "batch_size", "per_device_train_batch_size", "train_batch_size", "micro_batch_size")
# What the hint may add to an answer that already took a trace: a few more traces, never a long search (`fit --vary`
# is the command for that, and the hint names it).
HINT_BUDGET_S = 90.0

Estimator = Callable[..., Any]  # xmem.estimate.estimate's signature


def point_tracer(command: Sequence[str], vary: Vary, names: Mapping[str, str], settings: EstimateSettings,
                 job: Mapping[str, Any], estimator: Estimator | None = None,
                 progress: Callable[[int], Callable[[str], None] | None] | None = None) -> Tracer:
    """The job estimated at one value of `vary`'s knob on the GPU types `names` (catalog name -> the name the
    user knows), as a `Point`. `settings`: the site's (its catalog read); `job`: what the estimator takes besides
    the command, GPUs, settings and progress (iterations, env, cwd, ...); `progress(value)` gives the estimate's
    progress callback for that value."""
    if estimator is None:
        from xmem.estimate import estimate as estimator
    catalog = settings.catalog
    assert catalog is not None, "the site's catalog is read once, by the caller"
    largest = max((catalog[name] for name in names), key=lambda g: g.total_bytes).name  # the phases are read there

    def trace(value: int) -> Point:
        needed: dict[str, Any] = {largest: None}  # the estimate's replay with no memory limit there
        result = estimator(command_at(command, vary, value), gpus=list(names), settings=settings, keep_needed=needed,
                           on_progress=progress(value) if progress else None, **job)
        if not result.used_cuda:
            return Point.from_estimate(value, result, names, {}, 0)
        ops, sim = needed[largest]
        return Point.from_estimate(value, result, names, phase_peaks(ops.ops, ops.labels), sim.peak_reserved)
    return trace


def batch_knob(command: Sequence[str]) -> tuple[str, int] | None:
    """The command's batch-size option and its value (`--batch-size 64`, `--batch_size=64`), or None."""
    for name in BATCH_OPTIONS:
        for i, arg in enumerate(command):
            value = command[i + 1] if arg == f"--{name}" and i + 1 < len(command) else \
                arg.split("=", 1)[1] if arg.startswith(f"--{name}=") else None
            if value is not None and value.isascii() and value.isdigit() and len(value) <= 9 and int(value) >= 1:
                return name, int(value)
    return None


@dataclass(frozen=True)
class BatchHint:
    """The largest value of the batch option `name` below the one given (`given`) that fits the largest GPU type
    asked (None: not even 1). `complete` False: the time budget ended the search, `value` is the largest traced
    value that fits (a lower bound). `see_more`: the command that searches further."""

    name: str
    given: int
    value: int | None
    complete: bool
    see_more: str

    def text(self) -> str:
        """One line for people (and the filter's reason): what to try and how to see more."""
        if self.value is None and self.complete:
            found = f"it does not fit even at --{self.name} 1"
        elif self.value is None:
            found = f"no smaller --{self.name} was confirmed to fit in the time allowed"
        elif self.complete:
            found = f"the largest --{self.name} that fits is {self.value}"
        else:
            found = f"--{self.name} {self.value} fits (a larger one may: the search stopped at its time limit)"
        return f"{found}; to see more: {self.see_more}"

    def to_json(self) -> dict[str, Any]:
        return {"option": self.name, "given": self.given, "largest": self.value, "complete": self.complete,
                "see_more": self.see_more, "text": self.text()}


class _OutOfTime(Exception):
    """The hint's time budget is spent: the search stops with what it has."""


def largest_batch(command: Sequence[str], gpu_types: Sequence[str], site: SiteConfig, job: Mapping[str, Any],
                  see_more: str, *, budget_s: float = HINT_BUDGET_S, estimator: Estimator | None = None,
                  settings: EstimateSettings | None = None) -> BatchHint | None:
    """For a job that fits none of `gpu_types`: the largest batch size below the command's that fits the largest of
    them (the site margin applied, as `fit` applies it), in at most `budget_s` of traces; None when the command has
    no batch option or the search failed (the hint must never cost the answer it is added to). `job`: as
    `point_tracer`'s; `settings`: the site's when the caller made them (default: made from `site`)."""
    knob = batch_knob(command)
    if knob is None:
        return None
    name, given = knob
    if given == 1:  # the estimate itself was at 1
        return BatchHint(name, given, None, True, see_more)
    settings = settings if settings is not None and settings.catalog is not None else site.estimate_settings()
    catalog = settings.catalog
    names = {find_gpu(t, catalog).name: t for t in gpu_types}
    largest = max((o for t in gpu_types for o in fixed_options(site, t, catalog) if o.name == "whole"),
                  key=lambda o: o.usable_bytes, default=None)
    if largest is None:
        return None
    deadline = time.monotonic() + budget_s
    fitted: list[int] = []

    def bounded(value: int) -> Point:
        remaining = deadline - time.monotonic()
        if remaining <= 1:
            raise _OutOfTime
        timeout = min(remaining, job.get("timeout") or remaining)
        trace = point_tracer(command, Vary(name, 1, given - 1), names, settings, {**job, "timeout": timeout},
                             estimator)
        point = trace(value)
        if site.margin.needed(point.peaks.get(largest.gpu_type, 1 << 62)) <= largest.usable_bytes:
            fitted.append(value)
        return point

    try:
        result = find_limits(Vary(name, 1, given - 1), [largest], bounded, site.margin.needed, resolution=None)
    except _OutOfTime:
        return BatchHint(name, given, max(fitted, default=None), False, see_more)
    except Exception as e:  # noqa: BLE001 - a trace's own timeout ends the search like the budget; else no hint
        if getattr(e, "kind", None) == "timeout":
            return BatchHint(name, given, max(fitted, default=None), False, see_more)
        return None
    return BatchHint(name, given, result.limits[largest.gpu_type]["whole"], True, see_more)


def fit_command_text(command: Sequence[str], name: str, given: int, gpu_types: Sequence[str]) -> str:
    """`xmem-slurm fit --vary NAME=1..GIVEN --gpu ... -- COMMAND`: the search over the whole range."""
    gpus = "".join(f" --gpu {shlex.quote(t)}" for t in gpu_types)
    return f"xmem-slurm fit --vary {name}=1..{given}{gpus} -- {shlex.join(command)}"
