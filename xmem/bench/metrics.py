"""Accuracy metrics of a memory estimator against real runs, as the xMem paper computes them.

Owns the definitions (reference-measurements.md, "Metrics"); pure functions over `Outcome` records, no I/O.

- error = |estimate - ground| / ground, on runs with neither a real nor a predicted OOM (on a real OOM, `ground` is
  only the level reached before it, not a peak). MRE is its median, p90 its 90th percentile.
- under-estimate share: runs with no real OOM whose estimate is below the measured peak.
- short-request share: the same with the site's safety margin added to the estimate (`needed`, as the policy asks
  for it): the runs a scheduler acting on the estimate would really have under-sized.
- OOM recall: share of the runs that really ran out of memory for which OOM was predicted.
- PEF: share of runs that are not accurate. Accurate = (no real OOM, no OOM predicted, and a run capped at the
  estimate would not OOM) or (real OOM, OOM predicted). "Capped run would not OOM" is the recorded second real run
  where there is one, and estimate >= ground otherwise.
- MCP (GiB per run): (sum over accurate runs without OOM of capacity - estimate, minus sum over failed runs of the
  memory they claimed, min(estimate, capacity)) / number of runs. A correctly predicted OOM saves nothing here: the
  paper's notebook is not available, and this is the conservative reading.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy

from xmem.units import GIB


@dataclass(frozen=True)
class Outcome:
    """One estimate of one real run."""

    estimate: int  # predicted peak as NVML would show it, bytes
    oom: bool  # predicted OOM
    ground: int  # measured NVML peak, bytes
    real_oom: bool
    capacity: int  # the GPU's total memory, bytes
    seconds: float | None = None  # time the estimate took
    capped_oom: bool | None = None  # a second real run capped at the estimate ran out of memory (None: not run)


@dataclass(frozen=True)
class Scores:
    runs: int
    scored: int  # runs with neither a real nor a predicted OOM (those MRE and p90 use)
    mre: float | None
    p90: float | None
    bias: float | None  # median signed error (estimate - ground) / ground on the same runs: + over, - under
    under_share: float | None
    short_request_share: float | None  # None when no margin was given
    oom_recall: float | None
    pef: float | None
    mcp_gib: float | None
    median_seconds: float | None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def relative_error(o: Outcome) -> float:
    return abs(o.estimate - o.ground) / o.ground


def percentile(values: list[float], q: float) -> float | None:
    """numpy's (linear-interpolation) percentile, q in [0, 100]; None for no values."""
    return float(numpy.percentile(values, q)) if values else None


def scored_errors(outcomes: list[Outcome]) -> list[float]:
    return [relative_error(o) for o in outcomes if not o.real_oom and not o.oom]


def under_share(outcomes: list[Outcome]) -> float | None:
    return short_request_share(outcomes, lambda estimate: estimate)  # the estimate itself as the request


def short_request_share(outcomes: list[Outcome], needed: Callable[[int], int]) -> float | None:
    fits = [o for o in outcomes if not o.real_oom]
    return sum(needed(o.estimate) < o.ground for o in fits) / len(fits) if fits else None


def oom_recall(outcomes: list[Outcome]) -> float | None:
    ooms = [o for o in outcomes if o.real_oom]
    return sum(o.oom for o in ooms) / len(ooms) if ooms else None


def capped_run_ok(o: Outcome) -> bool:
    return not o.capped_oom if o.capped_oom is not None else o.estimate >= o.ground


def accurate(o: Outcome) -> bool:
    if o.real_oom:
        return o.oom
    return not o.oom and capped_run_ok(o)


def pef(outcomes: list[Outcome]) -> float | None:
    return sum(not accurate(o) for o in outcomes) / len(outcomes) if outcomes else None


def mcp_gib(outcomes: list[Outcome]) -> float | None:
    if not outcomes:
        return None
    saved = sum(o.capacity - o.estimate for o in outcomes if accurate(o) and not o.real_oom)
    claimed = sum(min(max(o.estimate, 0), o.capacity) for o in outcomes if not accurate(o))
    return (saved - claimed) / len(outcomes) / GIB


def score(outcomes: list[Outcome], needed: Callable[[int], int] | None = None) -> Scores:
    """The figures of `outcomes`; `needed` (estimate -> bytes requested, the site margin) adds the short-request
    share."""
    errors = scored_errors(outcomes)
    signed = [(o.estimate - o.ground) / o.ground for o in outcomes if not o.real_oom and not o.oom]
    seconds = [o.seconds for o in outcomes if o.seconds is not None]
    return Scores(
        runs=len(outcomes),
        scored=len(errors),
        mre=statistics.median(errors) if errors else None,
        p90=percentile(errors, 90),
        bias=statistics.median(signed) if signed else None,
        under_share=under_share(outcomes),
        short_request_share=short_request_share(outcomes, needed) if needed else None,
        oom_recall=oom_recall(outcomes),
        pef=pef(outcomes),
        mcp_gib=mcp_gib(outcomes),
        median_seconds=statistics.median(seconds) if seconds else None,
    )
