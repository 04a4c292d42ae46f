"""The `Estimate` record: what `xmem-slurm estimate --json` prints and what policy, fit, the pictures and the Slurm
glue consume, per GPU type (`GpuEstimate`) and for the whole command, with its JSON form (`to_json`, `from_json`:
add fields, never rename), the breakdown's part names beside the memory categories, and which GPU type an answer
shows (`shown_gpu`). Made by the pipeline, `xmem.estimate`. Pure: imports no tracer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xmem.simulate import OomInfo
from xmem.trace.wire import notes_from_json, notes_json

# The breakdown's parts beside the memory categories (xmem.trace.events.Category): named once, here.
ALLOCATOR_SLACK = "allocator_slack"
OVERHEAD = "overhead"


@dataclass(frozen=True, slots=True)
class GpuEstimate:
    """The predicted peak of the job on one GPU type."""

    gpu: str
    total_bytes: int
    peak_bytes: int  # what NVML would show: peak reserved + overhead
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    overhead_bytes: int  # CUDA context + libraries, outside the caching allocator
    capacity_bytes: int  # what the caching allocator may reserve: total - overhead
    fits: bool
    oom: OomInfo | None
    fragmentation: float
    traced_capability: tuple[int, int]
    # where the replay ran out of memory: the peak (with overhead) of the same replay with no memory limit, i.e.
    # what the job would need; None where it fits
    unlimited_peak_bytes: int | None = None

    @property
    def headroom_bytes(self) -> int:
        return self.total_bytes - self.peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "overhead_bytes": self.overhead_bytes,
            "capacity_bytes": self.capacity_bytes,
            "total_bytes": self.total_bytes,
            "fits": self.fits,
            "oom": dataclasses.asdict(self.oom) if self.oom is not None else None,
            "fragmentation": self.fragmentation,
            "traced_capability": list(self.traced_capability),
            "unlimited_peak_bytes": self.unlimited_peak_bytes,
        }

    @classmethod
    def from_json(cls, name: str, d: Mapping[str, Any]) -> GpuEstimate:
        oom = d.get("oom")
        return cls(gpu=name, total_bytes=d["total_bytes"], peak_bytes=d["peak_bytes"],
                   peak_reserved_bytes=d["peak_reserved_bytes"], peak_allocated_bytes=d["peak_allocated_bytes"],
                   overhead_bytes=d["overhead_bytes"], capacity_bytes=d["capacity_bytes"], fits=d["fits"],
                   oom=OomInfo(**oom) if oom is not None else None, fragmentation=d["fragmentation"],
                   traced_capability=tuple(d.get("traced_capability", (0, 0))),
                   unlimited_peak_bytes=d.get("unlimited_peak_bytes"))


@dataclass(frozen=True, slots=True)
class Estimate:
    """The whole answer for one command: every requested GPU type, and what was live at the peak.

    `breakdown` is taken on `breakdown_gpu`, the GPU type the answer shows (`shown_gpu`: the first asked for on
    which the job runs to its end): bytes live per category at the peak (SimResult.fullest_peak_index), plus
    `allocator_slack` (peak reserved minus the live tensors' requested bytes: rounding, unsplit remainders, cached
    free blocks) and `overhead` (context and libraries). Its values add up to that type's `peak_bytes`.
    `breakdowns` holds the same for every GPU type estimated (a site's pick may be another type).

    `suspect_reasons`: where a trace contradicts the facts of its own run (`xmem.audit`); a suspect estimate may be
    far below what the job needs, so nothing should shrink a request on it.
    """

    command: tuple[str, ...]
    gpus: dict[str, GpuEstimate]
    breakdown: dict[str, int]
    breakdown_gpu: str
    iterations: int
    seconds: float
    warnings: tuple[str, ...]
    libraries: tuple[str, ...]
    used_cuda: bool
    torch_version: str
    suspect_reasons: tuple[str, ...] = ()
    sandbox: str = ""  # what kept the traced program's writes out of the user's files
    forward_only: bool = False  # no training step was traced: the peak of what the program ran (Trace.forward_only)
    breakdowns: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # by GPU type
    interpreter: str = ""  # the job's Python interpreter that was traced (Trace.interpreter)
    # Where ranks differ (pipeline stages: xmem.rank_traces): the rank whose figures these are, each traced rank's
    # peak on the shown GPU type, and the stages each holds; None and empty where one rank stands for all
    fullest_rank: int | None = None
    rank_peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    rank_stages: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def suspect(self) -> bool:
        return bool(self.suspect_reasons)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": list(self.command),
            "gpus": {name: g.to_json() for name, g in self.gpus.items()},
            "breakdown": dict(self.breakdown),
            "breakdown_gpu": self.breakdown_gpu,
            "iterations": self.iterations,
            "seconds": round(self.seconds, 3),
            "warnings": list(self.warnings),
            "notes": notes_json(self.warnings),  # each warning's kind (xmem.trace.wire), for who shows them
            "libraries": list(self.libraries),
            "used_cuda": self.used_cuda,
            "torch_version": self.torch_version,
            "interpreter": self.interpreter,
            "suspect": self.suspect,
            "suspect_reasons": list(self.suspect_reasons),
            "sandbox": self.sandbox,
            "forward_only": self.forward_only,
            "breakdowns": {name: dict(parts) for name, parts in self.breakdowns.items()},
            "fullest_rank": self.fullest_rank,
            "rank_peaks": {str(rank): peak for rank, peak in self.rank_peaks.items()},
            "rank_stages": {str(rank): list(stages) for rank, stages in self.rank_stages.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Estimate:
        """The record back from `to_json()` (e.g. from a cache)."""
        return cls(command=tuple(d["command"]),
                   gpus={name: GpuEstimate.from_json(name, g) for name, g in d["gpus"].items()},
                   breakdown=dict(d["breakdown"]), breakdown_gpu=d.get("breakdown_gpu", ""),
                   iterations=d["iterations"], seconds=d["seconds"], warnings=tuple(notes_from_json(d, d["warnings"])),
                   libraries=tuple(d["libraries"]), used_cuda=d["used_cuda"], torch_version=d["torch_version"],
                   suspect_reasons=tuple(d.get("suspect_reasons", ())), sandbox=d.get("sandbox", ""),
                   forward_only=d.get("forward_only", False), interpreter=d.get("interpreter", ""),
                   breakdowns={name: dict(parts) for name, parts in d.get("breakdowns", {}).items()},
                   fullest_rank=d.get("fullest_rank"),
                   rank_peaks={int(rank): peak for rank, peak in d.get("rank_peaks", {}).items()},
                   rank_stages={int(rank): tuple(stages) for rank, stages in d.get("rank_stages", {}).items()})


def shown_gpu(gpus: Sequence[GpuEstimate]) -> str:
    """The GPU type an answer shows (its breakdown, its row marked in the table, the plot's default), of `gpus` in
    the order asked: the first on which the job runs to its end, else the one with the most memory (whose replay
    went furthest). Where a site config picks a request, the pick's type is shown instead (`xmem.cli.common`)."""
    return next((g.gpu for g in gpus if g.fits), max(gpus, key=lambda g: g.total_bytes).gpu)
