"""Every way the site offers each GPU type, side by side, for one job: what `check` and `estimate --config` show.

Owns two views built on the policy's own offers (`rules.considered_offers`, `rules.decide`: nothing here sizes
an offer a second way):
- `option_table`: per offer the usable memory, the job's peak, the need with the site margin, fits or not and by how
  much, the one the policy picks (with its reason) and the closest cheaper offer that did not fit;
- `fixed_options`: each offer as a fixed amount of memory (whole GPU, each MIG profile, a few MPS and shard
  counts), for questions that vary the job itself (`xmem.fit`).
Pure: no file, no Slurm, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xmem.config import SiteConfig
from xmem.gpus import GpuType, UnknownGpuError, find_gpu
from xmem.jobscript import SbatchRequest
from xmem.policy.rules import (Decision, Offer, considered_offers, decide, describe_offer, gres_memory_bytes,
                               share_bytes)

MPS_FRACTIONS = (4, 2)  # MPS shares of 100 are too many to list: a quarter and a half of the GPU stand for them
MAX_LISTED_SHARDS = 8  # shards of a GPU up to this many are listed one count each, more as MPS_FRACTIONS


@dataclass(frozen=True)
class OptionRow:
    """One offer for the job: `gres_type` the GRES type it lands on (`1g.10gb`), `gpu_type` the GPU the job runs as
    (a MIG slice's parent), `request` the value the policy would ask Slurm for. `slack_bytes` = usable - needed:
    what is left, or (negative) how far off."""

    gpu_type: str
    gres_type: str
    kind: str
    request: str
    description: str
    usable_bytes: int
    peak_bytes: int
    needed_bytes: int
    fits: bool
    chosen: bool = False

    @property
    def slack_bytes(self) -> int:
        return self.usable_bytes - self.needed_bytes

    def to_json(self) -> dict[str, Any]:
        return {"gpu_type": self.gpu_type, "gres_type": self.gres_type, "kind": self.kind, "request": self.request,
                "description": self.description, "usable_bytes": self.usable_bytes, "peak_bytes": self.peak_bytes,
                "needed_bytes": self.needed_bytes, "fits": self.fits, "slack_bytes": self.slack_bytes,
                "chosen": self.chosen}


@dataclass(frozen=True)
class OptionTable:
    """All the offers in the site's order of preference (smallest first within a kind), the policy's pick and
    why, and `closest_miss`: the cheaper offer (earlier in that order) that did not fit, the nearest to fitting
    (when nothing fits: the largest offer)."""

    rows: tuple[OptionRow, ...]
    action: str
    reason: str
    closest_miss: OptionRow | None = None

    @property
    def chosen(self) -> OptionRow | None:
        return next((row for row in self.rows if row.chosen), None)

    def to_json(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"rows": [row.to_json() for row in self.rows], "action": self.action, "reason": self.reason,
                "chosen": chosen.to_json() if chosen else None,
                "closest_miss": self.closest_miss.to_json() if self.closest_miss else None}


def option_table(peaks: Mapping[str, int], request: SbatchRequest, config: SiteConfig, decision: Decision, *,
                 partition: str | None = None, catalog: Mapping[str, GpuType] | None = None,
                 available: Mapping[str, int] | None = None, offers: Sequence[Offer] | None = None) -> OptionTable:
    """The offers `decision` (from `decide` on the same arguments) was chosen among, side by side. `offers`: the
    job's offers when the caller has them (`job_offers`)."""
    picked = decision.gres or decision.gpus if decision.action == "rewrite" else None
    rows = tuple(OptionRow(offer.estimate_type, offer.gres_type, offer.kind, value, describe_offer(offer),
                           offer.granted_bytes, offer.peak_bytes, config.margin.needed(offer.peak_bytes), fits,
                           chosen=value == picked and offer.kind == decision.kind)
                 for offer, value, fits in considered_offers(peaks, request, config, partition=partition,
                                                             catalog=catalog, available=available, offers=offers))
    return OptionTable(rows, decision.action, decision.reason, _closest_miss(rows))


def _closest_miss(rows: tuple[OptionRow, ...]) -> OptionRow | None:
    chosen_at = next((i for i, row in enumerate(rows) if row.chosen), len(rows))
    missed = [row for row in rows[:chosen_at] if not row.fits]
    return max(missed, key=lambda row: (row.slack_bytes, -row.usable_bytes), default=None)


@dataclass(frozen=True)
class FixedOption:
    """An offer as a fixed amount of memory: `name` is `whole`, a MIG profile (`1g.10gb`), `shard:N` or `mps:N`."""

    gpu_type: str
    name: str
    usable_bytes: int


def fixed_options(config: SiteConfig, gpu_type: str, catalog: Mapping[str, GpuType]) -> list[FixedOption]:
    """The site's offers of `gpu_type` (a GRES or catalog name of a whole GPU), largest first: the whole GPU, each
    MIG profile the site offers on it, and share counts where MPS or shards are enabled for it. The sizes are the
    policy's (`gres_memory_bytes`, `share_bytes`)."""
    whole = gres_memory_bytes(gpu_type, None, catalog)
    if whole is None:
        return []
    options = [FixedOption(gpu_type, "whole", whole)]
    for parent, profiles in config.mig.profiles.items():
        if _same_gpu(parent, gpu_type, catalog):
            options += [FixedOption(gpu_type, p, size) for p in profiles
                        if (size := gres_memory_bytes(p, parent, catalog)) is not None]
    for kind, enabled, units, listed in (("shard", config.shard.enabled, config.shard.per_gpu,
                                          config.shard.gpu_types),
                                         ("mps", config.mps.enabled, config.mps.count_per_gpu, config.mps.gpu_types)):
        if enabled and any(_same_gpu(name, gpu_type, catalog) for name in listed):
            options += [FixedOption(gpu_type, f"{kind}:{n}", share_bytes(whole, n, units))
                        for n in _share_counts(kind, units)]
    return sorted(options, key=lambda o: -o.usable_bytes)


def _share_counts(kind: str, units: int) -> list[int]:
    """The share counts worth listing: every count below the whole GPU for a few shards, else fractions of it."""
    if kind == "shard" and units <= MAX_LISTED_SHARDS:
        return list(range(1, units))
    return sorted({units // d for d in MPS_FRACTIONS if 0 < units // d < units})


def _same_gpu(a: str, b: str, catalog: Mapping[str, GpuType]) -> bool:
    if a.lower() == b.lower():
        return True
    try:
        return find_gpu(a, catalog).name == find_gpu(b, catalog).name
    except UnknownGpuError:
        return False


def site_option_table(peaks: Mapping[str, int], config: SiteConfig,
                      catalog: Mapping[str, GpuType] | None = None) -> OptionTable:
    """The option table for a plain one-GPU job (`--gres=gpu:1`) in the site's default partition: what
    `estimate --config` shows, where there is no batch script to say more."""
    from xmem.jobscript import parse_jobscript

    request = parse_jobscript("#!/bin/sh\n", cli_options={"gres": "gpu:1"}, env={}).directives
    decision = decide(peaks, request, config, catalog=catalog)
    return option_table(peaks, request, config, decision, catalog=catalog)
