"""The site's own jobs as calibration samples: the Epilog's records (estimate against measured peak) turned into the
overhead fit's samples, and the points of `xmem-slurm report --plot`.

Owns which records count and what a record's residual is. A record holds the predicted peak on its GRES type
(allocator reserved + the overhead the estimate added) and the measured peak (NVML, or the job's own file: both
count the CUDA context). The estimate's allocator part is the prediction minus the overhead the catalog in effect
gives that GPU type for a job loading cuBLAS (every training job does; the record does not say which other
libraries it loaded), so a residual is measured - (estimate - that overhead): what the GPU held beyond the
allocator, as in the benchmark fit. The fit itself is `xmem.bench.overhead_fit.fit_overheads`, the same rules.
Must not: read or write files (the CLI does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from xmem.bench.overhead_fit import ALWAYS_LOADED, OverheadSample
from xmem.gpus import GpuType, UnknownGpuError, find_gpu, overhead_bytes
from xmem.slurm.store import JobRecord


@dataclass(frozen=True)
class StoreSamples:
    samples: list[OverheadSample]
    points: dict[str, list[tuple[int, int]]]  # catalog GPU type -> (estimate, measured) of each sample
    skipped: dict[str, int]  # why records were left out -> how many


def store_samples(records: Iterable[JobRecord], catalog: Mapping[str, GpuType],
                  parent_of: Callable[[str], str | None] = lambda gres_type: None) -> StoreSamples:
    """One sample per record with an estimate and a measurement of a job that ended well, on a GPU type the
    catalog knows. `parent_of` names the GPU a MIG GRES type is cut from (the site config's `mig.parent_of`): a
    slice's estimate is its parent's."""
    samples, skipped = [], {}
    points: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        why = _unusable(record)
        gpu = None if why else _catalog_gpu(record.gpu_type, catalog, parent_of)
        if why is None and gpu is None:
            why = f"GPU type {record.gpu_type} not in the catalog"
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        reserved = record.estimate_bytes - overhead_bytes(gpu, {ALWAYS_LOADED})
        samples.append(OverheadSample(gpu.name, record.measured_bytes - reserved, frozenset({ALWAYS_LOADED})))
        points.setdefault(gpu.name, []).append((record.estimate_bytes, record.measured_bytes))
    return StoreSamples(samples, points, skipped)


def _unusable(record: JobRecord) -> str | None:
    if not record.estimate_bytes:
        return "no estimate"
    if not record.measured_bytes:
        return "nothing measured"
    if record.exit_code not in (0, None):  # an out-of-memory crash's peak is not the job's peak
        return "the job failed"
    if not record.gpu_type:
        return "no GPU type"
    return None


def _catalog_gpu(gres_type: str, catalog: Mapping[str, GpuType],
                 parent_of: Callable[[str], str | None]) -> GpuType | None:
    try:
        return find_gpu(parent_of(gres_type) or gres_type, catalog)
    except UnknownGpuError:
        return None


_TABLE = re.compile(r'^\[overhead\."([^"]+)"\]', re.MULTILINE)


def kept_tables(existing: str, refitted: Iterable[str]) -> str:
    """The `[overhead."GPU"]` tables of a calibration file's text for GPU types not in `refitted`, verbatim: a fit
    from the store covers the types the site's jobs ran on, and must not drop the others' calibration."""
    starts = [m.start() for m in _TABLE.finditer(existing)] + [len(existing)]
    skip = set(refitted)
    kept = [existing[a:b].rstrip() + "\n" for a, b in zip(starts, starts[1:])
            if _TABLE.match(existing, a).group(1) not in skip]
    return "\n".join(kept)


__all__ = ["StoreSamples", "kept_tables", "store_samples"]
