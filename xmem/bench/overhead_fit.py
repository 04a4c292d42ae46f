"""Fit the per-GPU-type non-allocator overhead (CUDA context + a term per library the job uses) from real runs.

Owns the overhead model's fit and the text of `xmem/gpus/calibration.toml`. Pure: the samples come in, the fit and
the TOML text go out (`xmem-slurm calibrate` does the reading and writing).

The model, per GPU type g and job j: NVML peak = allocator reserved + context_g + sum of term_l over the libraries l
the traced job uses. A sample's residual is NVML peak minus the allocator's reserved peak (measured where the record
has it, our simulated one otherwise). Some peaks do not count the context (the xMem data's: its harness created the
context before its first NVML sample); their residual is the libraries alone. The fit, with no per-record or
per-model term:

1. A library's term is identifiable where one GPU type has runs with and without it (cuDNN: CNN vs transformer
   jobs). It is the median over such GPU types of median(residual with l) - median(residual without l), at least 0.
   It is pooled over GPU types, since the data rarely separates it on each.
2. A library every run of a GPU type uses (cuBLAS: every training job) cannot be told apart from the context: its
   term there is 0 and the context includes it.
3. base_g = the `quantile` of (residual - identified library terms) over g's runs (0.5: the median), at least 0.
   A negative fit is physically impossible: it means the allocator figure used is already above the NVML peak,
   which the fit reports (`raw_base_bytes`) but does not subtract.
4. Where g's peaks count the context, base_g is its context. Where they do not (every run of g), base_g is what the
   run loaded after its start: it becomes the term of the library every training job loads (cuBLAS), and the
   context stays the catalog's (`context_bytes` None: not written).
"""

from __future__ import annotations

import json  # a JSON string is a valid TOML basic string
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from xmem.bench.metrics import percentile


ALWAYS_LOADED = "cublas"  # the library every traced training job loads (matmuls, linear layers)


@dataclass(frozen=True)
class OverheadSample:
    """One real run without OOM: its GPU type, what NVML showed beyond the allocator, the libraries it used."""

    gpu: str  # canonical catalog name
    residual_bytes: int  # NVML peak - allocator reserved peak
    libraries: frozenset[str]
    peak_has_context: bool = True  # False: the NVML peak left the CUDA context out (see the module docstring)


@dataclass(frozen=True)
class OverheadFit:
    gpu: str
    context_bytes: int | None  # None: the peaks fitted on left the context out; the catalog's stands
    library_bytes: dict[str, int]
    samples: int
    spread_bytes: int  # 10th to 90th percentile of the fitted model's residuals: how well one constant fits
    raw_base_bytes: int = 0  # the quantile before clamping at 0 (step 3)


def library_terms(samples: Iterable[OverheadSample]) -> dict[str, int]:
    """Step 1: the pooled term of every library some GPU type has runs with and without."""
    by_gpu: dict[str, list[OverheadSample]] = defaultdict(list)
    for s in samples:
        by_gpu[s.gpu].append(s)
    differences: dict[str, list[float]] = defaultdict(list)
    for runs in by_gpu.values():
        for lib in set().union(*(s.libraries for s in runs)):
            with_lib = [s.residual_bytes for s in runs if lib in s.libraries]
            without = [s.residual_bytes for s in runs if lib not in s.libraries]
            if with_lib and without:
                differences[lib].append(statistics.median(with_lib) - statistics.median(without))
    return {lib: max(0, round(statistics.median(d))) for lib, d in sorted(differences.items())}


def fit_overheads(samples: list[OverheadSample], q: float = 0.5) -> dict[str, OverheadFit]:
    """Steps 1-4 for every GPU type among `samples`."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be between 0 and 1, got {q}")
    by_gpu: dict[str, list[OverheadSample]] = defaultdict(list)
    for s in samples:
        by_gpu[s.gpu].append(s)
    # peaks that count the context fit a type's overhead; the others only where it has no such peak
    chosen = {gpu: [s for s in runs if s.peak_has_context] or runs for gpu, runs in by_gpu.items()}
    terms = library_terms(s for runs in chosen.values() for s in runs)
    fits = {}
    for gpu, runs in sorted(chosen.items()):
        with_context = runs[0].peak_has_context
        used = set().union(*(s.libraries for s in runs))
        own_terms = {lib: terms.get(lib, 0) for lib in sorted(used | set(terms))}  # step 2: unidentified -> 0
        bases = [s.residual_bytes - sum(own_terms[lib] for lib in s.libraries) for s in runs]
        raw = round(percentile(bases, 100 * q))
        spread = round(percentile(bases, 90) - percentile(bases, 10))
        if with_context:
            fits[gpu] = OverheadFit(gpu, max(0, raw), own_terms, len(runs), spread, raw)
        else:  # step 4: the base is what loads during the run, with cuBLAS
            own_terms[ALWAYS_LOADED] = own_terms.get(ALWAYS_LOADED, 0) + max(0, raw)
            fits[gpu] = OverheadFit(gpu, None, own_terms, len(runs), spread, raw)
    return fits


def calibration_toml(fits: dict[str, OverheadFit], provenance: str) -> str:
    """The text of calibration.toml: one [overhead."<GPU>"] table per fitted type."""
    lines = ["# Non-allocator overhead per GPU type, fitted by `xmem-slurm calibrate` (xmem/bench/overhead_fit.py).",
             "# Do not edit by hand: re-run the command in `provenance`.", ""]
    for fit in fits.values():
        libraries = ", ".join(f"{lib} = {n}" for lib, n in fit.library_bytes.items())
        if fit.context_bytes is None:
            context = []
            what = (f"peaks without the CUDA context (the catalog's stands): unclamped base "
                    f"{fit.raw_base_bytes / 2**20:.0f} MiB into {ALWAYS_LOADED}")
        else:
            context = [f"context_bytes = {fit.context_bytes}"]
            what = f"unclamped context {fit.raw_base_bytes / 2**20:.0f} MiB"
        lines += [f'[overhead."{fit.gpu}"]', *context,
                  f"library_bytes = {{ {libraries} }}",
                  "provenance = " + json.dumps(f"{provenance}; {fit.samples} runs, {what}, residual spread p10-p90 "
                                               f"{fit.spread_bytes / 2**20:.0f} MiB"), ""]
    return "\n".join(lines)
