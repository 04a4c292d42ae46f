"""The site's own jobs as calibration samples: the Epilog's records (estimate against measured peak) turned into the
overhead fit's samples, and the points of `xmem-slurm report --plot`.

Owns which records count and what a record's residual is. A record holds the predicted peak on its GRES type
(allocator reserved + the overhead the estimate added) and the measured peak (NVML, or the job's own file: both
count the CUDA context). The estimate's allocator part is the prediction minus the overhead the catalog in effect
gives that GPU type for a job loading cuBLAS (every training job does; the record does not say which other
libraries it loaded), so a residual is measured - (estimate - that overhead): what the GPU held beyond the
allocator, as in the benchmark fit. The fit itself is `xmem.bench.overhead_fit.fit_overheads`, the same rules.

No user can move the site's calibration alone (slurm/README.md, "Trust in the calibration"): a measured peak counts
only from a source the job cannot write (TRUSTED_MEASUREMENTS: NVML read by the root Epilog; the job's own file
only where the admin says so); each user is one sample per GPU type (the median of their records' residuals), so
the fit is the median over users, made only where at least `min_users` users ran; and `bounded` keeps a fit within
a step of the calibration in effect. The estimate in a record is the job's comment, which the user can write: these
rules, not the record, are what make it safe.
Must not: read or write files (the CLI does).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from xmem.bench.overhead_fit import ALWAYS_LOADED, OverheadFit, OverheadSample
from xmem.gpus import GpuType, UnknownGpuError, find_gpu, overhead_bytes
from xmem.slurm.store import JobRecord


# What the job cannot write: NVML read by the root Epilog, Slurm's own accounting of the steps (`gres/gpumem`,
# xmem.slurm.node.sacct_gpumem, taken by `calibrate --sacct`); "file" is the job's own report.
TRUSTED_MEASUREMENTS = frozenset({"nvml", "gpumem"})
MIN_USERS = 3  # distinct users a GPU type's fit needs: the median over users then moves with none of them alone
MAX_MOVE_BYTES = 512 << 20  # how far one fit may move a type's overhead from the calibration in effect


@dataclass(frozen=True)
class StoreSamples:
    samples: list[OverheadSample]  # one per user and GPU type: the median residual of the user's records
    points: dict[str, list[tuple[int, int]]]  # catalog GPU type -> (estimate, measured) of each usable record
    skipped: dict[str, int]  # why records were left out -> how many
    users: dict[str, int]  # catalog GPU type -> the distinct users of its samples


def store_samples(records: Iterable[JobRecord], catalog: Mapping[str, GpuType],
                  parent_of: Callable[[str], str | None] = lambda gres_type: None, *,
                  trusted: frozenset[str] | None = TRUSTED_MEASUREMENTS, min_users: int = 1) -> StoreSamples:
    """One sample per user and GPU type from the records with an estimate and a measurement (by a `trusted`
    source; None: any) of a job that ended well, on a GPU type the catalog knows, where `min_users` users have
    such records. `parent_of` names the GPU a MIG GRES type is cut from (the site config's `mig.parent_of`): a
    slice's estimate is its parent's."""
    skipped: dict[str, int] = {}
    points: dict[str, list[tuple[int, int]]] = {}
    residuals: dict[str, dict[str, list[int]]] = {}  # GPU type -> user -> residuals
    for record in records:
        why = _unusable(record, trusted)
        gpu = None if why else _catalog_gpu(record.gpu_type, catalog, parent_of)
        if why is None and gpu is None:
            why = f"GPU type {record.gpu_type} not in the catalog"
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        reserved = record.estimate_bytes - overhead_bytes(gpu, {ALWAYS_LOADED})
        residuals.setdefault(gpu.name, {}).setdefault(record.user or "", []).append(record.measured_bytes - reserved)
        points.setdefault(gpu.name, []).append((record.estimate_bytes, record.measured_bytes))
    samples, users = [], {}
    for gpu_name, by_user in residuals.items():
        if len(by_user) < min_users:
            why = f"{gpu_name} has records of {len(by_user)} user(s), fewer than {min_users}"
            skipped[why] = skipped.get(why, 0) + sum(map(len, by_user.values()))
            continue
        users[gpu_name] = len(by_user)
        samples += [OverheadSample(gpu_name, round(statistics.median(r)), frozenset({ALWAYS_LOADED}))
                    for r in by_user.values()]
    return StoreSamples(samples, points, skipped, users)


def with_slurm_accounting(records: Iterable[JobRecord], gpumem: Mapping[str, int]) -> list[JobRecord]:
    """The records, each measured by Slurm's `gres/gpumem` (`gpumem`: job id -> bytes) where it has that and
    nothing NVML measured: Slurm's figure replaces the job's own file."""
    return [dataclasses.replace(r, measured_bytes=gpumem[r.job_id], measured_by="gpumem")
            if r.measured_by != "nvml" and gpumem.get(r.job_id) else r for r in records]


def bounded(fits: Mapping[str, OverheadFit], catalog: Mapping[str, GpuType],
            max_move: int = MAX_MOVE_BYTES) -> tuple[dict[str, OverheadFit], list[str]]:
    """The fits with each type's overhead (context, into which cuBLAS goes) kept within `max_move` of the
    catalog's in effect, and the types that were held back. A real change larger than the step takes several
    calibrations, each on new records: no burst of records moves a type far at once."""
    out, held = {}, []
    for name, fit in fits.items():
        old = overhead_bytes(catalog[name], {ALWAYS_LOADED})
        new = fit.context_bytes
        if new is not None and abs(new - old) > max_move:
            new = old + max_move if new > old else max(0, old - max_move)
            fit = dataclasses.replace(fit, context_bytes=new)
            held.append(name)
        out[name] = fit
    return out, held


def _unusable(record: JobRecord, trusted: frozenset[str] | None) -> str | None:
    if not record.estimate_bytes:
        return "no estimate"
    if not record.measured_bytes:
        return "nothing measured"
    if trusted is not None and record.measured_by not in trusted:
        return f"measured by {record.measured_by or 'nothing named'}, not trusted"
    if not record.user:
        return "no user"
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


__all__ = ["MAX_MOVE_BYTES", "MIN_USERS", "TRUSTED_MEASUREMENTS", "StoreSamples", "bounded", "kept_tables",
           "store_samples", "with_slurm_accounting"]
