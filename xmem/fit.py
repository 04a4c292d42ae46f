"""What-if on one of the user's knobs: the largest value of NAME (a batch size, a sequence length) that fits each
GPU type and each way the site offers it, from a few traces rather than a search of full estimates.

Owns the `--vary NAME=LOW..HIGH` grammar, putting a value into the command (`{}`, or the value of `--NAME`), the
growth model (how each memory category of the breakdown grows with the value: linear, or quadratic where the traces
show a curve, as attention scores do in the sequence length) and the search: trace at a few small values, predict
each option's limit from the model, confirm it with a trace at the limit and one at the next value, and where the
model was wrong, refit with what was traced and try again (bisection on real traces after a few misses, so the
answer is always one confirmed by traces). What fits is decided as the policy decides it: the site margin on the
peak (`job_peak`) against the option's usable memory (`xmem.policy.options.fixed_options`).
Pure apart from the trace function it is given: `xmem.cli.fit` runs the estimates.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xmem.policy.options import FixedOption

PLACEHOLDER = "{}"
MODEL_ROUNDS = 3  # guesses from the growth model per option before closing in on traces alone
# The model of each guess is fitted on the traces nearest the option's frontier: where the peak changes regime (at
# small batches the optimizer step, at large ones the activations) the traces far from it mislead.
LOCAL_POINTS = 3
# A category is quadratic when a straight line misses a traced point by more than this share of its largest value
# and this many bytes (the allocator's 2 MiB rounding alone must not make a curve).
CURVE_SHARE, CURVE_BYTES = 0.02, 4 << 20
# Not the program's tensors: the allocator's rounding and cached blocks. It does not grow with the program (small
# values use 2 and 20 MiB segments, large ones are rounded to 2 MiB): the model takes it, with the context and
# libraries, from the trace nearest the value (`Growth.levels`).
SLACK = "allocator_slack"


class FitError(ValueError):
    """Bad input to `fit`: the --vary grammar, or a command with nowhere to put the value."""


@dataclass(frozen=True)
class Vary:
    """`--vary NAME=LOW..HIGH`: the knob and the integer range searched."""

    name: str
    low: int
    high: int

    def first_values(self) -> list[int]:
        """The small values traced first: LOW, about 2 LOW and 4 LOW (three points show a curve)."""
        values = [self.low]
        for _ in range(2):
            values.append(max(values[-1] + 1, 2 * values[-1]))
        return [v for v in dict.fromkeys(values) if v <= self.high]


def parse_vary(text: str) -> Vary:
    """`batch-size=1..512` -> Vary("batch-size", 1, 512)."""
    match = re.fullmatch(r"\s*([A-Za-z_][\w.-]*)\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*", text)
    if not match:
        raise FitError(f"--vary {text!r}: write NAME=LOW..HIGH with whole numbers, e.g. --vary batch-size=1..256")
    name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
    if low < 1 or high < low:
        raise FitError(f"--vary {text!r}: need 1 <= LOW <= HIGH")
    return Vary(name, low, high)


def command_at(command: Sequence[str], vary: Vary, value: int) -> list[str]:
    """`command` with `value` for the knob: in place of every `{}`, else as the value of `--NAME` (`--NAME V` or
    `--NAME=V`; `-` and `_` in NAME are the same)."""
    if any(PLACEHOLDER in arg for arg in command):
        return [arg.replace(PLACEHOLDER, str(value)) for arg in command]
    spellings = {f"--{vary.name}", f"--{vary.name.replace('_', '-')}", f"--{vary.name.replace('-', '_')}"}
    out, found = list(command), False
    for i, arg in enumerate(out):
        if arg in spellings and i + 1 < len(out):
            out[i + 1], found = str(value), True
        elif arg.split("=", 1)[0] in spellings and "=" in arg:
            out[i], found = f"{arg.split('=', 1)[0]}={value}", True
    if not found:
        raise FitError(f"the command has no {PLACEHOLDER} and no --{vary.name} VALUE: put {PLACEHOLDER} where the "
                       f"value of {vary.name} goes, e.g. `-- python train.py --{vary.name} {PLACEHOLDER}`")
    return out


@dataclass(frozen=True)
class Point:
    """One trace at `value`: the bytes the job needs per GPU type (`job_peak`: more than the GPU where it ran out
    of memory), which of them ran out, and the breakdown at the peak on `breakdown_gpu` (its values add up to that
    type's peak; empty when that replay ran out of memory: then it says nothing about growth)."""

    value: int
    peaks: Mapping[str, int]
    out_of_memory: frozenset[str]
    breakdown: Mapping[str, int]
    breakdown_gpu: str

    @classmethod
    def from_estimate(cls, value: int, estimate: Mapping[str, Any], names: Mapping[str, str]) -> Point:
        """From `Estimate.to_json()`, its GPU types renamed by `names` (catalog name -> the name options use)."""
        from xmem.policy import job_peak

        gpus = {names.get(name, name): g for name, g in estimate["gpus"].items()}
        oom = frozenset(name for name, g in gpus.items() if job_peak(g) != g["peak_bytes"])
        gpu = names.get(estimate.get("breakdown_gpu", ""), estimate.get("breakdown_gpu", ""))
        breakdown = {} if gpu in oom else dict(estimate.get("breakdown") or {})
        return cls(value, {name: job_peak(g) for name, g in gpus.items()}, oom, breakdown, gpu)


@dataclass(frozen=True)
class Growth:
    """Each category of tensors as a polynomial in the value (numpy order, highest power first), and per GPU type
    and traced value what its peak adds to them (allocator slack, context, libraries, workspace): the prediction
    at a value is the tensors there plus the lesser level of the nearest traces below and above it (the rounding
    wobbles by a few MiB between neighbours and small values waste whole segments: a guess too high is caught by
    its trace)."""

    categories: Mapping[str, tuple[float, ...]]
    levels: Mapping[str, Mapping[int, float]]

    def tensors(self, value: float) -> float:
        return sum(float(np.polyval(c, value)) for c in self.categories.values())

    def predict(self, gpu_type: str, value: float) -> float:
        levels = self.levels.get(gpu_type, {})
        below = max((v for v in levels if v <= value), default=None)
        above = min((v for v in levels if v >= value), default=None)
        return self.tensors(value) + min((levels[v] for v in (below, above) if v is not None), default=0.0)

    def degrees(self) -> dict[str, int]:
        return {name: len(c) - 1 for name, c in self.categories.items()}


def fit_growth(points: Sequence[Point]) -> Growth:
    """Fit each category of tensors over the points that have a breakdown."""
    usable = sorted((p for p in points if p.breakdown), key=lambda p: p.value)
    names = sorted({name for p in usable for name in p.breakdown} - {SLACK, "overhead"})
    values = np.array([p.value for p in usable], dtype=float)
    growth = Growth({name: _fit_category(values, np.array([p.breakdown.get(name, 0) for p in usable], dtype=float))
                     for name in names}, {})
    levels: dict[str, dict[int, float]] = {}
    for p in usable:
        for gpu, peak in p.peaks.items():
            if gpu not in p.out_of_memory:
                levels.setdefault(gpu, {})[p.value] = peak - growth.tensors(p.value)
    return Growth(growth.categories, levels)


def _fit_category(values: np.ndarray, sizes: np.ndarray) -> tuple[float, ...]:
    """A line through the points, or a parabola where the line misses them (and it curves upwards)."""
    if len(values) == 0:
        return (0.0,)
    if len(set(values.tolist())) < 2:
        return (float(sizes.mean()),)
    line = np.polyfit(values, sizes, 1)
    if len(set(values.tolist())) >= 3:
        miss = float(np.max(np.abs(np.polyval(line, values) - sizes)))
        curve = np.polyfit(values, sizes, 2)
        if curve[0] > 0 and miss > max(CURVE_BYTES, CURVE_SHARE * float(np.max(np.abs(sizes)))):
            return tuple(float(c) for c in curve)
    return tuple(float(c) for c in line)


@dataclass(frozen=True)
class FitResult:
    """The largest value that fits per GPU type and option (None: not even LOW), and the traces it took."""

    vary: Vary
    limits: Mapping[str, Mapping[str, int | None]]
    points: tuple[Point, ...]
    seconds: float
    degrees: Mapping[str, int] = field(default_factory=dict)  # the growth model's last fit, per category

    @property
    def traces(self) -> int:
        return len(self.points)

    def to_json(self) -> dict[str, Any]:
        return {"vary": self.vary.name, "low": self.vary.low, "high": self.vary.high,
                "limits": {gpu: dict(options) for gpu, options in self.limits.items()},
                "traces": self.traces, "traced_values": sorted(p.value for p in self.points),
                "seconds": round(self.seconds, 3), "growth": dict(self.degrees)}


Tracer = Callable[[int], Point]  # the job traced at one value of the knob


def find_limits(vary: Vary, options: Sequence[FixedOption], trace: Tracer,
                needed: Callable[[int], int]) -> FitResult:
    """The largest value in `vary`'s range that fits each option: `needed(peak)` (the site margin) at most the
    option's usable bytes, on traces (`trace(value)`), with the growth model choosing which values to trace."""
    started = time.perf_counter()
    search = _Search(vary, trace, needed)
    for value in vary.first_values():
        search.point(value)
    limits: dict[str, dict[str, int | None]] = {}
    for option in sorted(options, key=lambda o: -o.usable_bytes):
        limits.setdefault(option.gpu_type, {})[option.name] = search.limit(option)
    degrees = fit_growth(list(search.points.values())).degrees()
    return FitResult(vary, limits, tuple(search.points[v] for v in sorted(search.points)),
                     time.perf_counter() - started, degrees)


class _Search:
    """The traces taken so far (each value once), and the search for one option's limit over them."""

    def __init__(self, vary: Vary, trace: Tracer, needed: Callable[[int], int]) -> None:
        self.vary, self.trace, self.needed = vary, trace, needed
        self.points: dict[int, Point] = {}

    def point(self, value: int) -> Point:
        if value not in self.points:
            self.points[value] = self.trace(value)
        return self.points[value]

    def limit(self, option: FixedOption) -> int | None:
        for _ in range(MODEL_ROUNDS):
            low, high = self._bracket(option)
            if high - low <= 1:
                return low if low >= self.vary.low else None
            guess = min(max(self._predicted(option, high), low + 1), high - 1)
            for value in (guess, guess + 1):
                if value < high:
                    self.point(value)
        low, high = self._bracket(option)
        for step in itertools.count():  # the model kept missing: close in on traces alone
            if high - low <= 1:
                break
            self.point(self._interpolated(option, low, high) if step % 2 == 0 else (low + high) // 2)
            low, high = self._bracket(option)
        return low if low >= self.vary.low else None

    def _interpolated(self, option: FixedOption, low: int, high: int) -> int:
        """Between the traced ends of the bracket, where a straight line through their needs meets the option's
        memory (bisection's midpoint where an end is not traced)."""
        if low < self.vary.low or high > self.vary.high:
            return (low + high) // 2
        need_low, need_high = (self.needed(self.points[v].peaks[option.gpu_type]) for v in (low, high))
        if need_high <= need_low:
            return (low + high) // 2
        share = (option.usable_bytes - need_low) / (need_high - need_low)
        return min(max(low + int(share * (high - low)), low + 1), high - 1)

    def _fits(self, point: Point, option: FixedOption) -> bool:
        peak = point.peaks.get(option.gpu_type)
        return peak is not None and self.needed(peak) <= option.usable_bytes

    def _bracket(self, option: FixedOption) -> tuple[int, int]:
        """(largest traced value that fits, or LOW-1; smallest traced value above it that does not, or HIGH+1)."""
        fitting = [v for v, p in self.points.items() if self._fits(p, option)]
        low = max(fitting, default=self.vary.low - 1)
        above = [v for v, p in self.points.items() if v > low and not self._fits(p, option)]
        return low, min(above, default=self.vary.high + 1)

    def _predicted(self, option: FixedOption, high: int) -> int:
        """The largest value the growth model says fits (LOW-1 if none): a bisection on the model, no trace. The
        model is fitted on the traces nearest `high`, the option's first failing value, and none beyond it (a new
        buffer, a replay out of memory there says nothing about the values below)."""
        below = sorted((v for v in self.points if v <= high), key=lambda v: high - v)[:LOCAL_POINTS]
        growth = fit_growth([self.points[v] for v in below])

        def fits(value: int) -> bool:
            return self.needed(max(0, int(growth.predict(option.gpu_type, value)))) <= option.usable_bytes

        low, high = self.vary.low - 1, self.vary.high + 1
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

