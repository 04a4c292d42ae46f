"""From peak GPU memory per GPU type and the site config to the Slurm GPU request to make, with a one-line reason.

Owns the offers a partition makes (whole GPUs, MIG slices, MPS shares, shards) and what each gives in bytes,
the safety margin, the choice of the cheapest fitting offer in the site's order of preference, and the rules for
requests the user wrote (keep / fill generic ones / rewrite) and for excluded users, accounts and partitions.
What a request must never become: smaller on an estimate that ran out of memory (`job_peak`) or that cannot be
trusted (`untrusted`: no CUDA seen, a suspect estimate), nor a request Slurm would refuse where the user's was
accepted (GPUs asked through two options; more GPUs per node than a node has, counting per-task requests).
Pure: no file, no Slurm, no torch. The GPU catalog comes in as an argument (loaded from the config if omitted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xmem.config import SiteConfig
from xmem.gpus import GpuType, UnknownGpuError, find_gpu, mig_profile
from xmem.jobscript import SbatchRequest, parse_gpus
from xmem.units import gib_words, size_words

if TYPE_CHECKING:
    from xmem.estimate_record import GpuEstimate

ACTIONS = ("rewrite", "keep", "none", "excluded", "no_fit")


@dataclass(frozen=True)
class Offer:
    """One way to give the job GPU memory: `kind` gpu/mig/mps/shard on GRES type `gres_type` (a100, 1g.10gb),
    whose peak is that of `estimate_type` (a MIG slice runs as its parent GPU), `count` units granting
    `granted_bytes` per rank."""

    kind: str
    gres_type: str
    estimate_type: str
    count: int
    granted_bytes: int
    unit_bytes: int
    peak_bytes: int
    units_per_gpu: int = 1


@dataclass(frozen=True)
class Decision:
    """What to ask Slurm for. `option` names the sbatch option the new value belongs to ("gres", "gpus",
    "gpus-per-node"): `gres` holds it for "gres", `gpus` for the --gpus forms (the user's own form is kept, as
    cli_filter cannot unset an option). `gpu_type` is the GRES type the request lands on and a key of the job's
    peaks. The job's comment is made of these fields by the filter (xmem.slurm.stamp)."""

    action: str
    reason: str
    gres: str | None = None
    gpus: str | None = None
    option: str | None = None
    kind: str | None = None
    gpu_type: str | None = None
    peak_bytes: int | None = None
    needed_bytes: int | None = None
    granted_bytes: int | None = None

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def decide(peaks: Mapping[str, int], request: SbatchRequest, config: SiteConfig, *, user: str | None = None,
           account: str | None = None, partition: str | None = None,
           catalog: Mapping[str, GpuType] | None = None, available: Mapping[str, int] | None = None,
           untrusted: str | None = None, offers: Sequence[Offer] | None = None) -> Decision:
    """The request to make for a job whose peak is `peaks[gpu type]` bytes per rank (GRES type names or catalog
    names as keys; a MIG slice may be absent, its parent's peak is used; see `job_peak`). `available`: GPUs of
    each GRES type one node offers, when known (from the cluster); offers needing more are left out.
    `untrusted`: why the estimate cannot size this job; the user's request is then kept as written. `offers`: the
    job's offers when the caller has them already (`job_offers` on the same arguments)."""
    early = screen(request, config, user=user, account=account, partition=partition)
    if early is not None:
        return early
    if untrusted:
        return Decision("keep", untrusted)
    if len(gpu_options(request)) > 1:
        return Decision("keep", f"GPUs are asked for through {' and '.join('--' + o for o in gpu_options(request))}"
                                ": rewriting one would leave the other")
    partitions = job_partitions(request, config, partition)
    catalog = catalog if catalog is not None else config.catalog()
    option, _ = _request_form(request)
    offers = list(offers) if offers is not None else job_offers(peaks, request, config, partition=partition,
                                                                catalog=catalog)
    if available is not None:
        on_one_node = [o for o in offers if _fits_one_node(o, available, request)]
        if offers and not on_one_node:
            return Decision("no_fit", f"no node of partition {','.join(partitions)} has "
                                      f"{gpus_per_node(request)} GPUs of one type")
        offers = on_one_node
    if config.explicit_request == "keep" or (config.explicit_request == "fill_generic"
                                             and not request.is_generic_gpu_request):
        return _keep(request, offers, peaks, config, catalog)
    return _cheapest(offers, config, request, option, partitions)


def screen(request: SbatchRequest, config: SiteConfig, *, user: str | None = None, account: str | None = None,
           partition: str | None = None) -> Decision | None:
    """The decision when the job needs no estimate (it asks for no GPU, or is excluded); None when it does."""
    if not request.wants_gpu:
        return Decision("none", "the job asks for no GPU")
    excluded = _exclusion(config, user, account or request.account, job_partitions(request, config, partition))
    return Decision("excluded", excluded) if excluded else None


def job_offers(peaks: Mapping[str, int], request: SbatchRequest, config: SiteConfig, *,
               partition: str | None = None, catalog: Mapping[str, GpuType] | None = None) -> list[Offer]:
    """Every offer of the job's partitions in the form of its request (`site_offers`): what `decide` and
    `considered_offers` weigh. Computed once per job by a caller that needs both (xmem.analyze)."""
    catalog = catalog if catalog is not None else config.catalog()
    option, count = _request_form(request)
    return site_offers(config, job_partitions(request, config, partition), catalog, peaks, count=count,
                       option=option)


def considered_offers(peaks: Mapping[str, int], request: SbatchRequest, config: SiteConfig, *,
                      partition: str | None = None, catalog: Mapping[str, GpuType] | None = None,
                      available: Mapping[str, int] | None = None,
                      offers: Sequence[Offer] | None = None) -> list[tuple[Offer, str, bool]]:
    """The offers `decide` weighs for this job, each with the request it would make and whether it fits (for
    showing people why), in the site's order of preference, smallest first. `offers`: as `decide`'s."""
    option, _ = _request_form(request)
    if offers is None:
        offers = job_offers(peaks, request, config, partition=partition, catalog=catalog)
    if available is not None:
        offers = [o for o in offers if _fits_one_node(o, available, request)]
    rank = {kind: i for i, kind in enumerate(config.preference)}
    offers = sorted((o for o in offers if o.kind in rank), key=lambda o: (rank[o.kind], o.granted_bytes))
    return [(o, _request_value(o, request, option), config.margin.needed(o.peak_bytes) <= o.granted_bytes)
            for o in offers]


def describe_offer(offer: Offer) -> str:
    """`MIG 1g.10gb (9.75 GiB)`, `MPS 34/100 of one a100 (13.45 GiB)`, `a whole h100 (79.65 GiB)`..."""
    return _describe(offer)


def job_partitions(request: SbatchRequest, config: SiteConfig, partition: str | None = None) -> tuple[str, ...]:
    """The partitions the job may run in: given, else requested (`-p a,b`), else the site's default."""
    text = partition or request.partition or config.partitions.default or ""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def eligible_types(config: SiteConfig, partitions: tuple[str, ...]) -> tuple[str, ...]:
    """GRES GPU types offered in every one of `partitions` (the job may land in any of them)."""
    lists = [config.partitions.gpu_types.get(p) for p in partitions]
    if not lists or any(types is None for types in lists):
        return ()
    first = list(lists[0])
    return tuple(t for t in first if all(t in types for types in lists[1:]))


def estimate_types(config: SiteConfig, partitions: tuple[str, ...]) -> tuple[str, ...]:
    """The GPU types to estimate for: whole GPU types, and the parent of each MIG slice offered."""
    types: list[str] = []
    for gres_type in eligible_types(config, partitions):
        parent = config.mig.parent_of(gres_type) or gres_type
        if parent not in types:
            types.append(parent)
    return tuple(types)


def site_offers(config: SiteConfig, partitions: tuple[str, ...], catalog: Mapping[str, GpuType],
                peaks: Mapping[str, int], *, count: int = 1, option: str = "gres") -> list[Offer]:
    """Every offer of the partitions for a job of `count` GPUs, sized to the job's need where the unit is a share
    (MPS, shards). Types the catalog does not know, or without a peak, are left out."""
    offers: list[Offer] = []
    for gres_type in eligible_types(config, partitions):
        parent = config.mig.parent_of(gres_type)
        estimate_type = parent or gres_type
        memory = gres_memory_bytes(gres_type, parent, catalog)
        peak = peak_for(estimate_type, peaks, catalog)
        if memory is None or peak is None:
            continue
        needed = config.margin.needed(peak)
        offers.append(Offer("mig" if parent else "gpu", gres_type, estimate_type, count, memory, memory, peak))
        if count != 1 or option != "gres":
            continue  # a share is of one GPU, and only --gres can ask for one
        if config.mps.enabled and _listed(gres_type, config.mps.gpu_types):
            offers.append(_share("mps", gres_type, estimate_type, memory, config.mps.count_per_gpu, peak, needed))
        if config.shard.enabled and _listed(gres_type, config.shard.gpu_types):
            offers.append(_share("shard", gres_type, estimate_type, memory, config.shard.per_gpu, peak, needed))
    return offers


def _fits_one_node(offer: Offer, available: Mapping[str, int], request: SbatchRequest) -> bool:
    """Whole GPUs and MIG slices are counted per node (a per-task count times the tasks a node runs); MPS and
    shards come out of one GPU."""
    wanted = offer.count * request.tasks_per_node if request.gpus_per_task else offer.count
    return offer.kind not in ("gpu", "mig") or wanted <= available.get(offer.gres_type, 0)


def gpu_options(request: SbatchRequest) -> tuple[str, ...]:
    """The sbatch options the job asks for GPUs through (`gres`, `gpus`, `gpus-per-node`, `gpus-per-task`)."""
    options = ("gres",) if any(g.name in ("gpu", "mps", "shard") and g.count > 0 for g in request.gres) else ()
    return options + tuple(name for name, value in (("gpus", request.gpus), ("gpus-per-node", request.gpus_per_node),
                                                    ("gpus-per-task", request.gpus_per_task)) if value)


def gpus_per_node(request: SbatchRequest) -> int:
    """Whole GPUs one node must hold for the job: a per-task request counts once per task the node runs."""
    return request.gpus_on_node


def job_peak(g: GpuEstimate) -> int:
    """The bytes a job needs on one GPU type, from its estimate there: the peak, or one byte more than the GPU
    holds when the replay ran out of memory (`fits` false): the peak reached before an out-of-memory stop is not
    the job's, so it must never size a request; the type and its slices then do not fit, and a larger type (or the
    user's request) is chosen."""
    if g.fits and g.oom is None:
        return g.peak_bytes
    return max(g.peak_bytes, g.total_bytes + 1)


def peak_for(gpu_type: str, peaks: Mapping[str, int], catalog: Mapping[str, GpuType]) -> int | None:
    """The peak for `gpu_type`, whether `peaks` is keyed by GRES type names or catalog names."""
    if gpu_type in peaks:
        return peaks[gpu_type]
    wanted = _catalog_name(gpu_type, catalog)
    for key, value in peaks.items():
        if wanted is not None and _catalog_name(key, catalog) == wanted:
            return value
    return None


def _share(kind: str, gres_type: str, estimate_type: str, memory: int, units: int, peak: int,
           needed: int) -> Offer:
    """The fewest units of `units` per GPU whose memory (memory * count / units) holds `needed`."""
    count = min(units, max(1, math.ceil(needed * units / memory)))
    while count < units and share_bytes(memory, count, units) < needed:  # integer rounding of the share
        count += 1
    return Offer(kind, gres_type, estimate_type, count, share_bytes(memory, count, units), memory // units, peak,
                 units)


def share_bytes(memory: int, count: int, units: int) -> int:
    """The memory `count` of `units` shares (MPS, shards) of a GPU of `memory` bytes give."""
    return memory * count // units


def gres_memory_bytes(gres_type: str, parent: str | None, catalog: Mapping[str, GpuType]) -> int | None:
    """The memory of one GPU of `gres_type`: the MIG profile's when `parent` is its GPU, else the whole GPU's
    (the driver's total: not `GpuEstimate.capacity_bytes`, which is what the caching allocator may reserve of it);
    None when the catalog does not know it."""
    try:
        if parent:
            return mig_profile(find_gpu(parent, catalog), gres_type).memory_bytes
        return find_gpu(gres_type, catalog).total_bytes
    except UnknownGpuError:
        return None


def _catalog_name(name: str, catalog: Mapping[str, GpuType]) -> str | None:
    try:
        return find_gpu(name, catalog).name
    except UnknownGpuError:
        return None


def _listed(gres_type: str, types: tuple[str, ...]) -> bool:
    return gres_type.lower() in (t.lower() for t in types)


def _exclusion(config: SiteConfig, user: str | None, account: str | None, partitions: tuple[str, ...]) -> str:
    exclude = config.exclude
    if user and user in exclude.users:
        return f"user {user} is excluded from xmem by the site config"
    if account and account in exclude.accounts:
        return f"account {account} is excluded from xmem by the site config"
    for p in partitions:
        if p in exclude.partitions:
            return f"partition {p} is excluded from xmem by the site config"
    return ""


def _request_form(request: SbatchRequest) -> tuple[str, int]:
    """The option the user asked for GPUs with, and how many GPUs it says (per node for --gres)."""
    gres_gpus = [g for g in request.gres if g.name in ("gpu", "mps", "shard") and g.count > 0]
    if gres_gpus:
        return "gres", max(1, sum(g.count for g in gres_gpus if g.name == "gpu"))
    for option, value in (("gpus", request.gpus), ("gpus-per-node", request.gpus_per_node),
                          ("gpus-per-task", request.gpus_per_task)):
        if value:
            return option, max(1, sum(item.count for item in parse_gpus(value)))
    return "gres", 1


def _cheapest(offers: list[Offer], config: SiteConfig, request: SbatchRequest,
              option: str, partitions: tuple[str, ...]) -> Decision:
    if not offers:
        where = ", ".join(partitions) or "(no partition)"
        return Decision("no_fit", f"no GPU type with an estimate is configured for partition {where}")
    for kind in config.preference:
        fitting = [o for o in offers if o.kind == kind and config.margin.needed(o.peak_bytes) <= o.granted_bytes]
        if fitting:
            best = min(fitting, key=lambda o: (o.granted_bytes, o.gres_type))
            return _rewrite(best, config, request, option, offers)
    largest = max(offers, key=lambda o: o.granted_bytes)
    whole = {o.estimate_type: o.granted_bytes for o in offers if o.kind == "gpu"}
    measured = [o.peak_bytes for o in offers if o.peak_bytes != whole.get(o.estimate_type, -1) + 1]  # job_peak's mark
    if not measured:
        return Decision("no_fit", f"runs out of memory on every GPU type offered, the largest {_describe(largest)}")
    best_peak = min(measured)
    return Decision("no_fit", f"needs {gib_words(config.margin.needed(best_peak))} {_margin_text(config)}: more than "
                              f"the largest offer, {_describe(largest)}", peak_bytes=best_peak,
                    needed_bytes=config.margin.needed(best_peak))


def _rewrite(offer: Offer, config: SiteConfig, request: SbatchRequest, option: str,
             offers: list[Offer]) -> Decision:
    peak = offer.peak_bytes
    needed = config.margin.needed(peak)
    value = _request_value(offer, request, option)
    offered = {o.kind for o in offers}
    kinds_before = [k for k in config.preference[:config.preference.index(offer.kind)] if k in offered]
    skipped = f" (no {'/'.join(k if k == 'shard' else k.upper() for k in kinds_before)} fits)" \
        if kinds_before else ""
    reason = f"needs {gib_words(needed)} {_margin_text(config)}: {_describe(offer)} is the smallest fit{skipped}"
    return Decision(
        "rewrite", reason, gres=value if option == "gres" else None, gpus=value if option != "gres" else None,
        option=option, kind=offer.kind, gpu_type=offer.gres_type, peak_bytes=peak, needed_bytes=needed,
        granted_bytes=offer.granted_bytes)


def _request_value(offer: Offer, request: SbatchRequest, option: str) -> str:
    if option != "gres":
        return f"{offer.gres_type}:{offer.count}"
    gpu_item = {"gpu": f"gpu:{offer.gres_type}:{offer.count}", "mig": f"gpu:{offer.gres_type}:{offer.count}",
                "mps": f"mps:{offer.gres_type}:{offer.count}", "shard": f"shard:{offer.gres_type}:{offer.count}"}
    return ",".join([gpu_item[offer.kind], *_other_gres(request)])


def _other_gres(request: SbatchRequest) -> list[str]:
    """The job's non-GPU GRES items as the user wrote them (`tmpfs:10G`): a rewrite must keep them."""
    written = next((value for option, value, _ in reversed(request.raw) if option == "gres" and value), "")
    items = [item.strip().removeprefix("gres:") for item in written.split(",") if item.strip()]
    return [item for item in items if item.split(":")[0] not in ("gpu", "mps", "shard", "none")]


def _keep(request: SbatchRequest, offers: list[Offer], peaks: Mapping[str, int], config: SiteConfig,
          catalog: Mapping[str, GpuType]) -> Decision:
    why = "an explicit request, kept by site policy" if config.explicit_request != "keep" \
        else "GPU requests are kept by site policy"
    gpu_type = request.explicit_type
    parent = config.mig.parent_of(gpu_type) if gpu_type else None
    peak = peak_for(parent or gpu_type, peaks, catalog) if gpu_type else None
    if peak is None and offers:
        peak = min(o.peak_bytes for o in offers)
    estimated = parent or gpu_type or next((o.estimate_type for o in offers if o.peak_bytes == peak), None)
    if peak is not None and estimated and peak == (gres_memory_bytes(estimated, None, catalog) or -1) + 1:
        # job_peak's mark, not a peak: no figure for the job's stamp (nor an MPS limit sized from it)
        return Decision("keep", f"{why}; runs out of memory on a whole {estimated}: it may not be enough",
                        gpu_type=gpu_type)
    needed = config.margin.needed(peak) if peak is not None else None
    reason = why  # the caller names the request it keeps (the filter's line, the job stamp's `req=`)
    if needed is not None:
        reason += f"; needs {gib_words(needed)} {_margin_text(config)}"
        granted = _granted_by(request, offers, config)
        if granted is not None and granted < needed:
            reason += f", more than the {gib_words(granted)} it asks for: it may run out of memory"
    return Decision("keep", reason, kind=None, gpu_type=gpu_type, peak_bytes=peak, needed_bytes=needed)


def _granted_by(request: SbatchRequest, offers: list[Offer], config: SiteConfig) -> int | None:
    """Memory per rank the user's own typed request gives, when the site's offers say."""
    for item in request.gpu_items:
        if item.count <= 0 or item.type is None:
            continue
        for offer in offers:
            if offer.gres_type.lower() != item.type.lower():
                continue
            if item.name == "gpu" and offer.kind in ("gpu", "mig"):
                return offer.unit_bytes
            if item.name == offer.kind:
                return offer.unit_bytes * min(item.count, offer.units_per_gpu)
    return None


def _describe(offer: Offer) -> str:
    size = gib_words(offer.granted_bytes)
    if offer.kind == "mig":
        return f"MIG {offer.gres_type} ({size})" if offer.count == 1 else f"{offer.count} x MIG {offer.gres_type} " \
                                                                        f"({size} each)"
    if offer.kind == "mps":
        return f"MPS {offer.count}/{offer.units_per_gpu} of one {offer.gres_type} ({size})"
    if offer.kind == "shard":
        return f"{offer.count} of {offer.units_per_gpu} shards of one {offer.gres_type} ({size})"
    return f"a whole {offer.gres_type} ({size})" if offer.count == 1 else f"{offer.count} x {offer.gres_type} " \
                                                                          f"({size} each)"


def _margin_text(config: SiteConfig) -> str:
    parts = []
    if config.margin.relative:
        parts.append(f"{config.margin.relative * 100:g} %")
    if config.margin.absolute_bytes:
        parts.append(size_words(config.margin.absolute_bytes))
    return f"with {' + '.join(parts)} margin" if parts else "with no margin"

