"""The site-wide record of finished jobs (one JSON object per line) and its summary, estimate against measured.

Owns the record's fields, appending a record safely while other epilogs append too (one `write` of one line
under an exclusive flock), reading the file back (a damaged line, or one whose fields hold what the Epilog never
writes, is skipped and counted, never fatal), and the per-GPU-type
summary `xmem-slurm report` prints. The epilog (xmem.slurm.node) decides what goes into a record.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STORE = "/var/lib/xmem/records.jsonl"


@dataclass(frozen=True)
class JobRecord:
    """One finished job: what xmem-slurm estimated and requested, and what the job really used if known."""

    job_id: str
    user: str | None = None
    gpu_type: str | None = None  # GRES type the estimate was for (a100, 1g.10gb...), None if unknown
    gres: str | None = None  # the request the job ran with, as xmem-slurm set or kept it
    estimate_bytes: int | None = None  # predicted peak on gpu_type, without margin
    needed_bytes: int | None = None  # predicted peak plus the site's margin (what the request was sized for)
    exit_code: int | None = None
    measured_bytes: int | None = None  # measured peak, if the job or NVML reported one
    measured_by: str | None = None  # "nvml" or "file"
    ended_at: float | None = None  # Unix time the epilog ran
    # the comment's `state=`: deferred mode's outcome (done, kept, unchanged, failed); inline, only a job submitted
    # unchanged has one (failed: no estimate, also a put-off job whose estimate never came back, xmem.slurm.putoff;
    # unchanged: nothing fits, or Slurm would refuse the rewrite)
    deferred_state: str | None = None
    request_before: str | None = None  # the request as submitted, before the estimate (any job the filter saw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> JobRecord:
        """The record of one store line; ValueError when a field holds what the Epilog never writes (a hand-edited
        or damaged line: `"estimate_bytes": "5"`, a list, `Infinity`, a negative size)."""
        known = {f.name: f.type.split(" |")[0] for f in dataclasses.fields(cls)}  # "int | None" -> "int"
        fields = {k: v for k, v in data.items() if k in known}
        for name, value in fields.items():
            if not (value is None and name != "job_id" or _FIELD_CHECKS[known[name]](value)):
                raise ValueError(f"{name}: {value!r:.40} is not what a record holds")
            if name in _SIZES and value is not None and value < 0:
                raise ValueError(f"{name}: a negative size")
        return cls(**fields)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Per field type, as JobRecord's annotations name it: what a value must be. Sizes and exit codes fit 64 bits.
_FIELD_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: _whole(v) and -(1 << 63) <= v < 1 << 63,
    "float": lambda v: (_whole(v) or isinstance(v, float)) and math.isfinite(v),
}
_SIZES = ("estimate_bytes", "needed_bytes", "measured_bytes")


def append_record(path: str | os.PathLike[str], record: JobRecord) -> None:
    """Append one line. O_APPEND plus one write under flock keeps concurrent epilogs' lines whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record.to_json(), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
    finally:
        os.close(fd)  # closing releases the lock


def read_records(path: str | os.PathLike[str]) -> list[JobRecord]:
    """Every well-formed record in the store, in file order; a missing store is empty."""
    return read_store(path)[0]


def read_store(path: str | os.PathLike[str]) -> tuple[list[JobRecord], int]:
    """The store's well-formed records, in file order, and how many non-blank lines were left out as damaged. A
    missing store is empty; OSError when it cannot be read (a directory, no permission)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return [], 0
    records, damaged = [], 0
    for line in filter(str.strip, text.splitlines()):
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            records.append(JobRecord.from_json(data))
        except (ValueError, TypeError, RecursionError):  # RecursionError: a line of 100000 nested brackets
            damaged += 1
    return records, damaged


@dataclass(frozen=True)
class TypeSummary:
    """Estimate against measurement for the jobs of one GPU type.

    Relative error = (estimate - measured) / measured, so a negative value is an under-estimate (the dangerous
    side: the job may not fit its request)."""

    gpu_type: str
    jobs: int  # records of this type
    measured: int  # of which have both an estimate and a measurement
    median_abs_rel_error: float | None
    p90_abs_rel_error: float | None
    mean_rel_error: float | None
    underestimates: int  # measured peak above the estimate (without margin)
    over_request: int  # measured peak above the margin-included size the request was made for


def summarize(records: Iterable[JobRecord]) -> list[TypeSummary]:
    """One summary per GPU type (records without a type under "unknown"), sorted by type name."""
    by_type: dict[str, list[JobRecord]] = {}
    for r in records:
        by_type.setdefault(r.gpu_type or "unknown", []).append(r)
    return [_summarize_type(t, rs) for t, rs in sorted(by_type.items())]


def _summarize_type(gpu_type: str, records: list[JobRecord]) -> TypeSummary:
    from xmem.bench.metrics import percentile  # here, not at the top: the node hooks need no numpy

    pairs = [r for r in records if r.estimate_bytes and r.measured_bytes]
    errors = [(r.estimate_bytes - r.measured_bytes) / r.measured_bytes for r in pairs]  # type: ignore[operator]
    magnitudes = [abs(e) for e in errors]
    return TypeSummary(
        gpu_type=gpu_type,
        jobs=len(records),
        measured=len(pairs),
        median_abs_rel_error=percentile(magnitudes, 50),
        p90_abs_rel_error=percentile(magnitudes, 90),
        mean_rel_error=sum(errors) / len(errors) if errors else None,
        underestimates=sum(1 for e in errors if e < 0),
        over_request=sum(1 for r in pairs
                         if r.needed_bytes and r.measured_bytes > r.needed_bytes),  # type: ignore[operator]
    )
