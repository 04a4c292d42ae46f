"""What-if on one of the user's knobs: the largest value of NAME (a batch size, a sequence length) that fits each
GPU type and each way the site offers it, from a few traces rather than a search of full estimates.

Owns the `--vary NAME=LOW..HIGH` grammar, putting a value into the command (`{}`, or the value of `--NAME`), the
growth model and the search. The model: per phase of the run (forward, backward, optimizer), the tensors live at
that phase's peak, each category a line or a parabola in the value (attention scores grow with the square of the
sequence length); the run's peak is the largest phase's (the peak moves between phases as the value grows), plus
the allocator's slack and the overhead as the nearest trace shows them. The search: trace at a few small values,
then per option trace the model's limit and, once a trace fits, the value above it (the neighbour that confirms
it); a miss refits with what was traced (bisection on real traces after a few misses, so the answer is always one
confirmed by traces). One trace answers every GPU type and option (the replays per type are cheap). What fits is
decided as the policy decides it: the site margin on the peak (`job_peak`) against the option's usable memory
(`xmem.policy.options.fixed_options`).
Pure apart from the trace function it is given: `xmem.cli.fit` runs the estimates.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from xmem.policy.options import FixedOption
from xmem.text import WHOLE_NUMBER_MAX_DIGITS, ascii_whole_number
from xmem.simulate import ALLOC, FREE

if TYPE_CHECKING:
    from xmem.estimate_record import Estimate

PLACEHOLDER = "{}"
MODEL_ROUNDS = 6  # traces guided by the growth model per option before bisection on traces alone
BISECT_AFTER_TURNS = 3  # ... or once the traces have landed on the other side of the limit this often
# The model of each guess is fitted on the traces nearest the option's frontier: a category that changes its
# growth somewhere (a buffer that appears, a kernel chosen by size) misleads from far away.
LOCAL_POINTS = 3
# A category is quadratic when a straight line misses a traced point by more than this share of its largest value
# (the tensors' requested bytes are exact: no allocator rounding to mistake for a curve).
CURVE_SHARE = 0.01


class FitError(ValueError):
    """Bad input to `fit`: the --vary grammar, or a command with nowhere to put the value."""


def default_step(value: int) -> int:
    """The step an answer near `value` is given in unless the user sets one: exact below 64; from 64, multiples of
    8 (batch sizes and sequence lengths are taken in eights), or of 1 % of the value where that is coarser (in
    eights). Relative to the answer, not to HIGH: a range cut at the largest offer's bytes (1..10^24) still answers
    a batch size of 160 as 160."""
    return 1 if value < 64 else max(8, value // 100 // 8 * 8)


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

    def within(self, most_bytes: int) -> Vary:
        """The range cut at `most_bytes`, the memory of the largest offer: a value that adds memory adds at least
        a byte per unit, so none above it fits there; one that adds none fits at any value, and the search stops
        there all the same (`FitResult.searched_high` says so)."""
        return replace(self, high=min(self.high, max(self.low, most_bytes)))


def parse_vary(text: str) -> Vary:
    """`batch-size=1..512` -> Vary("batch-size", 1, 512)."""
    match = re.fullmatch(r"\s*([A-Za-z_][\w.-]*)\s*=\s*([0-9]+)\s*\.\.\s*([0-9]+)\s*", text, re.ASCII)
    if not match:
        raise FitError(f"--vary {text[:80]!r}: write NAME=LOW..HIGH with whole numbers, e.g. --vary batch-size=1..256")
    name, low, high = match.group(1), ascii_whole_number(match.group(2)), ascii_whole_number(match.group(3))
    if low is None or high is None:  # int() refuses 4300 digits and more; no knob needs 21
        raise FitError(f"--vary {text[:80]!r}: LOW and HIGH have at most {WHOLE_NUMBER_MAX_DIGITS} digits")
    if low < 1 or high < low:
        raise FitError(f"--vary {text[:80]!r}: need 1 <= LOW <= HIGH")
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


Phases = Mapping[str, Mapping[str, int]]  # phase of the run -> bytes live per category when its tensors peaked


def phase_peaks(ops: Sequence[tuple], labels: Sequence[tuple[str, str, int]]) -> dict[str, dict[str, int]]:
    """For each phase of the run (forward, backward, optimizer, other; over all iterations), the bytes live per
    category at the moment the live tensors peaked in it. Taken from the op sequence alone (requested bytes, no
    allocator): exact where the replay ran out of memory too.

    Each phase's peak is a sum of categories that grow smoothly with a knob, where the peak of the whole run jumps
    between phases (GPT-2: the optimizer step at small batches, the backward pass at large ones)."""
    live: dict[int, tuple[str, int]] = {}
    by_category: dict[str, int] = {}
    total, highest, peaks = 0, {}, {}
    for (action, block, nbytes, _stream), (category, phase, _iteration) in zip(ops, labels):
        if action == ALLOC:
            live[block] = (category, nbytes)
            by_category[category] = by_category.get(category, 0) + nbytes
            total += nbytes
        elif action == FREE and block in live:
            category, nbytes = live.pop(block)
            by_category[category] -= nbytes
            total -= nbytes
            continue
        if action == ALLOC and total > highest.get(phase, -1):
            highest[phase], peaks[phase] = total, {c: b for c, b in by_category.items() if b}
    return peaks


@dataclass(frozen=True)
class Point:
    """One trace at `value`: the bytes the job needs per GPU type as the policy counts them (`job_peak`: more than
    the GPU where it ran out of memory), which of them ran out, what each would need with no memory limit
    (`needs`: the growth model's figure, the OOM's too), and the tensors live at each phase's peak."""

    value: int
    peaks: Mapping[str, int]
    out_of_memory: frozenset[str]
    phases: Phases
    needs: Mapping[str, int]

    @classmethod
    def from_estimate(cls, value: int, estimate: Estimate, names: Mapping[str, str], phases: Phases,
                      unlimited_reserved: int) -> Point:
        """From `estimate`, its GPU types renamed by `names` (catalog name -> the name options use);
        `unlimited_reserved`: the peak reserved of a replay with no memory limit (what an OOM type would need
        besides its overhead)."""
        from xmem.policy import job_peak

        gpus = {names.get(name, name): g for name, g in estimate.gpus.items()}
        peaks = {name: job_peak(g) for name, g in gpus.items()}
        oom = frozenset(name for name, g in gpus.items() if peaks[name] != g.peak_bytes)
        needs = {name: unlimited_reserved + g.overhead_bytes if name in oom else peaks[name]
                 for name, g in gpus.items()}
        return cls(value, peaks, oom, phases, needs)


@dataclass(frozen=True)
class Growth:
    """Per phase, each category of tensors as a polynomial in the value (numpy order, highest power first); the
    tensors at a value are the largest phase's. Per GPU type and traced value, the level: what its peak adds to
    them (allocator slack, context, libraries; `predict` says how it is carried to other values)."""

    phases: Mapping[str, Mapping[str, tuple[float, ...]]]
    levels: Mapping[str, Mapping[int, float]]

    def tensors(self, value: float) -> float:
        return max((sum(float(np.polyval(c, value)) for c in categories.values())
                    for categories in self.phases.values()), default=0.0)

    def predict(self, gpu_type: str, value: float) -> float:
        """The tensors at `value` plus the level between the nearest traces below and above it, drawn as a line
        in the tensors (cached blocks grow with them: GPT-2's slack at 130 samples is not its slack at 4); beyond
        the traced values, the nearest trace's level."""
        levels = self.levels.get(gpu_type, {})
        below = max((v for v in levels if v <= value), default=None)
        above = min((v for v in levels if v >= value), default=None)
        tensors = self.tensors(value)
        if below is None or above is None:
            return tensors + (levels[below if above is None else above] if levels else 0.0)
        span = self.tensors(above) - self.tensors(below)
        share = (tensors - self.tensors(below)) / span if span > 0 else 0.0
        return tensors + levels[below] + min(max(share, 0.0), 1.0) * (levels[above] - levels[below])

    def degrees(self) -> dict[str, int]:
        """Per category, the highest power it grows with in any phase."""
        out: dict[str, int] = {}
        for categories in self.phases.values():
            for name, c in categories.items():
                out[name] = max(out.get(name, 0), len(c) - 1)
        return out


def fit_growth(points: Sequence[Point]) -> Growth:
    """Fit each category of each phase over the points (a phase a point lacks is left out of its fit)."""
    usable = sorted(points, key=lambda p: p.value)
    phases: dict[str, dict[str, tuple[float, ...]]] = {}
    for phase in sorted({phase for p in usable for phase in p.phases}):
        having = [p for p in usable if phase in p.phases]
        values = np.array([p.value for p in having], dtype=float)
        names = sorted({name for p in having for name in p.phases[phase]})
        phases[phase] = {name: _fit_category(values, np.array([p.phases[phase].get(name, 0) for p in having],
                                                               dtype=float)) for name in names}
    growth = Growth(phases, {})
    levels: dict[str, dict[int, float]] = {}
    for p in usable:
        for gpu, need in p.needs.items():
            levels.setdefault(gpu, {})[p.value] = need - growth.tensors(p.value)
    return Growth(phases, levels)


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
        if curve[0] > 0 and miss > CURVE_SHARE * float(np.max(np.abs(sizes))):
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
    searched_high: int | None = None  # where the search ended below HIGH: the largest offer's bytes (Vary.within)
    resolution: int = 1  # the answers are multiples of it (LOW aside): the user's step, else default_step
    # of the largest answer

    def at_least(self, value: int | None) -> bool:
        """An answer at the top of the range searched: larger values may fit too, none was tried."""
        return value is not None and value >= (self.searched_high or self.vary.high)

    @property
    def bound_note(self) -> str | None:
        """The answer's caveat when the range was cut: a limit equal to the cut means "at least this"."""
        if self.searched_high is None:
            return None
        return (f"searched up to {self.vary.name}={self.searched_high}, the largest offer's memory in bytes: a value "
                f"that adds memory adds at least a byte, so none above fits; a limit there means {self.vary.name} "
                "does not change the memory the job needs (any value fits)")

    @property
    def traces(self) -> int:
        return len(self.points)

    def to_json(self) -> dict[str, Any]:
        return {"vary": self.vary.name, "low": self.vary.low, "high": self.vary.high,
                "limits": {gpu: dict(options) for gpu, options in self.limits.items()},
                "traces": self.traces, "traced_values": sorted(p.value for p in self.points),
                "seconds": round(self.seconds, 3), "growth": dict(self.degrees), "searched_high": self.searched_high,
                "note": self.bound_note, "resolution": self.resolution,
                "at_least": {gpu: {name: self.at_least(v) for name, v in options.items()}
                             for gpu, options in self.limits.items()}}


Tracer = Callable[[int], Point]  # the job traced at one value of the knob


def find_limits(vary: Vary, options: Sequence[FixedOption], trace: Tracer,
                needed: Callable[[int], int], resolution: int | None = 1) -> FitResult:
    """The largest value in `vary`'s range that fits each option: `needed(peak)` (the site margin) at most the
    option's usable bytes, on traces (`trace(value)`), with the growth model choosing which values to trace.
    `resolution`: answers are multiples of it (or LOW), the search stopping once no multiple lies between a
    traced value that fits and one that does not (None: `default_step` of the answer, 1 % in eights)."""
    started = time.perf_counter()
    searched = vary.within(max((o.usable_bytes for o in options), default=vary.high))
    search = _Search(searched, trace, needed, resolution)
    for value in searched.first_values():
        search.point(value)
    limits: dict[str, dict[str, int | None]] = {}
    for option in sorted(options, key=lambda o: -o.usable_bytes):
        limits.setdefault(option.gpu_type, {})[option.name] = search.limit(option)
    degrees = fit_growth(list(search.points.values())).degrees()
    return FitResult(vary, limits, tuple(search.points[v] for v in sorted(search.points)),
                     time.perf_counter() - started, degrees,
                     searched.high if searched.high < vary.high else None, resolution or max(
                         (default_step(v) for options in limits.values() for v in options.values() if v), default=1))


class _Search:
    """The traces taken so far (each value once), and the search for one option's limit over them."""

    def __init__(self, vary: Vary, trace: Tracer, needed: Callable[[int], int], resolution: int | None = 1) -> None:
        self.vary, self.trace, self.needed, self.resolution = vary, trace, needed, resolution
        self.points: dict[int, Point] = {}

    def point(self, value: int) -> Point:
        if value not in self.points:
            self.points[value] = self.trace(value)
        return self.points[value]

    def limit(self, option: FixedOption) -> int | None:
        """Each round traces the model's limit inside the bracket; once a trace fits, the model's next answer is
        the value above it (the neighbour that confirms it). The peak is a staircase (the allocator rounds blocks
        to 2 MiB) that a smooth model cannot place to the value, and the slack between two far traces is a guess:
        where traces keep landing on one side, the next goes twice as far as the last move (a gallop), and once
        the traces have turned sides a few times, or the model has had its rounds, bisection on traces ends it."""
        step, last, turns, previous = 1, None, 0, 0
        for rounds in itertools.count():
            low, high = self._bracket(option)
            r = self.resolution or default_step(max(low, 1))  # the user's step, else one relative to the answer
            # (no multiple of it left between a value that fits and one that does not: the answer is found)
            first, last_multiple = self._multiples(low, high, r)
            if first > last_multiple:  # no answer left between them at this resolution
                break
            if turns >= BISECT_AFTER_TURNS or rounds >= MODEL_ROUNDS:
                value = (low + high) // 2
            else:
                value = self._predicted(option, low, high)
                value = max(value, low + step) if last else min(value, high - step) if last is False else value
            here = self.resolution or default_step(value)  # a value is traced at the step of its own size
            value = min(max(value // here * here, first), last_multiple)
            fits = self._fits(self.point(value), option)
            if fits == last:  # the model fell short again on this side: go twice as far as last time
                step = max(2, 2 * abs(value - previous))
            else:
                step, turns = 1, turns + (last is not None)
            last, previous = fits, value
        return low if low >= self.vary.low else None

    def _multiples(self, low: int, high: int, r: int) -> tuple[int, int]:
        """The first and last multiples of the resolution strictly between `low` and `high` (first > last: none);
        HIGH itself counts as one, as the range's end."""
        last = self.vary.high if high == self.vary.high + 1 else (high - 1) // r * r
        return (low // r + 1) * r if r > 1 else low + 1, last

    def _fits(self, point: Point, option: FixedOption) -> bool:
        peak = point.peaks.get(option.gpu_type)
        return peak is not None and self.needed(peak) <= option.usable_bytes

    def _bracket(self, option: FixedOption) -> tuple[int, int]:
        """(largest traced value that fits, or LOW-1; smallest traced value above it that does not, or HIGH+1)."""
        fitting = [v for v, p in self.points.items() if self._fits(p, option)]
        low = max(fitting, default=self.vary.low - 1)
        above = [v for v, p in self.points.items() if v > low and not self._fits(p, option)]
        return low, min(above, default=self.vary.high + 1)

    def _predicted(self, option: FixedOption, low: int, high: int) -> int:
        """The largest value the growth model says fits (LOW-1 if none): a bisection on the model, no trace. The
        model is fitted on the traces nearest the bracket (`low`, `high`) the option's limit lies in."""
        def distance(value: int) -> int:
            return max(low - value, value - high, 0)

        nearest = sorted(self.points, key=lambda v: (distance(v), -v))[:LOCAL_POINTS]
        growth = fit_growth([self.points[v] for v in nearest])

        def fits(value: int) -> bool:
            return self.needed(max(0, int(growth.predict(option.gpu_type, value)))) <= option.usable_bytes

        low, high = self.vary.low - 1, self.vary.high + 1
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low
