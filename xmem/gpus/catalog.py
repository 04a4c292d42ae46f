"""The GPU catalog: which GPU types exist, how much memory each gives a job, and what it costs besides tensors.

Owns `catalog.toml` (shipped defaults), the merge with `calibration.toml` (measured overheads: the shipped one, then
the site's, `[catalog] calibration`, which `xmem-slurm calibrate` writes) and with a site's overrides, name lookup (canonical names, Slurm GRES names, NVML names),
MIG profiles, the non-allocator overhead model and the cuBLAS workspace size per architecture.

Everything here is pure except `load_catalog`, which reads the TOML files shipped in this folder and the site's
calibration.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmem.units import GIB, MIB

CATALOG_PATH = Path(__file__).with_name("catalog.toml")
CALIBRATION_PATH = Path(__file__).with_name("calibration.toml")  # the project's, measured on its GPUs
# The site's own calibration (`[catalog] calibration` in the site config; this when it names none): outside the
# installed package, which an upgrade replaces. Per GPU type, its tables replace the shipped ones.
SITE_CALIBRATION_PATH = Path("/etc/xmem/calibration.toml")
SITE_CALIBRATION_KEY = "calibration"  # the key of [catalog] (`overrides`) that names it

# aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize(): ":4096:2:16:8" = 2 x 4 MiB + 8 x 16 KiB.
CUBLAS_DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680
# Same file: Hopper (major 9) gets 32 MiB. Newer code also gives it to Blackwell (10, 12; PR #175344), which
# a later PR proposed to revert; until that settles the catalog's Blackwell types (B200, RTX 5090) get the
# default here (24 MiB less per workspace if the newer rule holds).
CUBLAS_LARGE_WORKSPACE_BYTES = 32 * 1024 * 1024
CUBLAS_LARGE_WORKSPACE_MAJORS = frozenset({9})
REGISTERS_PER_BLOCK = 65_536  # 32-bit registers a block may use: every capability from 5.0 on


class UnknownGpuError(ValueError):
    """A GPU name that is neither a canonical name nor an alias in the catalog."""


class CatalogError(ValueError):
    """A catalog, calibration file or site override that cannot be used as written."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG GPU-instance profile, e.g. `3g.20gb`, with the memory the driver gives it."""

    name: str
    memory_bytes: int

    @property
    def compute_slices(self) -> int:
        """Sevenths of the GPU's compute: the `N` of `Ng.XXgb`."""
        return int(self.name.split("g.", 1)[0])


@dataclass(frozen=True, slots=True)
class GpuType:
    """One GPU type of the cluster: memory as the driver reports it, architecture, MIG profiles, overheads, and the
    device facts a traced program is shown (`catalog.toml`'s `sms`, `l2_cache_mib` and [capabilities])."""

    name: str
    total_bytes: int
    capability: tuple[int, int]
    multi_processor_count: int
    l2_cache_bytes: int
    max_threads_per_multi_processor: int
    shared_memory_per_block_optin: int
    aliases: tuple[str, ...] = ()
    mig_profiles: tuple[MigProfile, ...] = ()
    context_bytes: int = 0
    library_bytes: tuple[tuple[str, int], ...] = ()  # (library, bytes), sorted; a tuple keeps the record hashable
    overhead_provenance: str = ""

    @property
    def libraries(self) -> dict[str, int]:
        return dict(self.library_bytes)

    @property
    def registers_per_block(self) -> int:
        return REGISTERS_PER_BLOCK

    @property
    def device_name(self) -> str:
        """The name CUDA gives the device (torch.cuda.get_device_name): the catalog's with the vendor's prefix."""
        return self.name if self.name.startswith(("NVIDIA", "Tesla")) else f"NVIDIA {self.name}"


def normalize_name(name: str) -> str:
    """The form names are compared in: lower case, vendor prefix dropped, spaces and underscores as '-', and a
    trailing memory size written one way (`a100-80`, `a100-80g`, `a100_80gb` are all `a100-80gb`)."""
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    for prefix in ("nvidia-", "tesla-", "geforce-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    # one to three digits: a size in GB, not a model number such as rtx-4090
    return re.sub(r"-(\d{1,3})(?:g|gb)?$", r"-\1gb", text)


def load_catalog(overrides: Mapping[str, Any] | None = None, *,
                 calibration_path: Path | None = CALIBRATION_PATH) -> dict[str, GpuType]:
    """Every GPU type by canonical name: shipped catalog, then calibration files (if present: `calibration_path`,
    then the site's, `site_calibration_path`), then `overrides`. `calibration_path=None`: the shipped catalog alone.

    `overrides` has the catalog's shape: `{"gpus": {name: {field: value}}, "overhead": {name|"default": {...}}}`;
    a `gpus` entry for an unknown name adds a new type (it then needs `total_bytes` and `capability`).
    """
    base = _read_toml(CATALOG_PATH)
    overrides = overrides or {}
    if calibration_path is None:
        return catalog_from_tables(base, {}, overrides)
    calibration = _optional_toml(calibration_path)
    site = _optional_toml(site_calibration_path(overrides))
    overhead = {**calibration.get("overhead", {}), **site.get("overhead", {})}  # per GPU type, the site's wins
    return catalog_from_tables(base, {"overhead": overhead}, overrides)


def site_calibration_path(overrides: Mapping[str, Any] | None) -> Path:
    """The site's calibration file: the one `[catalog] calibration` names, else SITE_CALIBRATION_PATH."""
    return Path((overrides or {}).get(SITE_CALIBRATION_KEY) or SITE_CALIBRATION_PATH)


def _optional_toml(path: Path) -> dict[str, Any]:
    try:
        return _read_toml(path) if path.is_file() else {}
    except (OSError, UnicodeDecodeError) as e:  # there but unreadable: the figures would silently change
        raise CatalogError(f"{path}: cannot read the calibration ({e})") from None


def catalog_from_tables(base: Mapping[str, Any], calibration: Mapping[str, Any],
                        overrides: Mapping[str, Any]) -> dict[str, GpuType]:
    """The pure part of `load_catalog`: merge the three tables and build the records."""
    gpus = {name: dict(fields) for name, fields in base.get("gpus", {}).items()}
    claimed: dict[str, str] = {}  # alias -> the site's type that claimed it
    for name, fields in overrides.get("gpus", {}).items():
        canonical = _canonical(name, gpus)
        site_aliases = list(fields.get("aliases", ()))
        for alias in map(normalize_name, site_aliases):
            if claimed.setdefault(alias, canonical) != canonical:
                raise CatalogError(f"GPU name {alias!r} is given to both {claimed[alias]!r} and {canonical!r}")
        _take_aliases(gpus, site_aliases, canonical)
        entry = gpus.setdefault(canonical, {})
        entry.update({key: value for key, value in fields.items() if key != "aliases"})
        entry["aliases"] = [*entry.get("aliases", ()), *site_aliases]
    overhead = _merge_overhead(dict(base.get("overhead", {})), calibration.get("overhead", {}), gpus, "calibration")
    overhead = _merge_overhead(overhead, overrides.get("overhead", {}), gpus, "site override [overhead]")
    capabilities = base.get("capabilities", {})
    catalog = {name: _build_gpu(name, fields, overhead, capabilities) for name, fields in gpus.items()}
    _check_aliases_unique(catalog)
    return catalog


def find_gpu(name: str, catalog: Mapping[str, GpuType]) -> GpuType:
    """The GPU type called `name` (canonical name or alias, any case); a clear error listing the known names."""
    wanted = normalize_name(name)
    for gpu in catalog.values():
        if wanted == normalize_name(gpu.name) or wanted in (normalize_name(a) for a in gpu.aliases):
            return gpu
    raise UnknownGpuError(f"unknown GPU type {name!r}{_did_you_mean(wanted, catalog)}; known types: "
                          f"{', '.join(sorted(catalog))} (`xmem-slurm gpus` lists their aliases)")


def _did_you_mean(wanted: str, catalog: Mapping[str, GpuType]) -> str:
    """'; did you mean X?' naming the type whose name or alias is closest to a mistyped one, or ''."""
    owner = {normalize_name(n): gpu.name for gpu in catalog.values() for n in (gpu.name, *gpu.aliases)}
    close = difflib.get_close_matches(wanted, owner, n=1, cutoff=0.6)
    return f"; did you mean {owner[close[0]]!r}?" if close else ""


def mig_profile(gpu: GpuType, profile: str) -> MigProfile:
    """The MIG profile `profile` (e.g. '3g.20gb', any case, optional 'MIG ' prefix) of `gpu`."""
    wanted = profile.strip().lower().removeprefix("mig").strip()
    for p in gpu.mig_profiles:
        if p.name == wanted:
            return p
    known = ", ".join(p.name for p in gpu.mig_profiles) or "none (no MIG on this type)"
    raise UnknownGpuError(f"{gpu.name} has no MIG profile {profile!r}; its profiles: {known}")


def overhead_bytes(gpu: GpuType, libraries: Iterable[str]) -> int:
    """GPU memory the job's process holds outside the caching allocator: CUDA context + libraries it used."""
    per_library = gpu.libraries
    return gpu.context_bytes + sum(per_library.get(lib, 0) for lib in set(libraries))


def cublas_workspace_bytes(gpu: GpuType, env: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLAS workspace (one per host thread and stream), as torch chooses it for `gpu`.

    `CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]` wins when set (torch sums SIZE x COUNT).
    """
    config = (env or {}).get("CUBLAS_WORKSPACE_CONFIG", "")
    if config:
        return _parse_cublas_workspace_config(config)
    if gpu.capability[0] in CUBLAS_LARGE_WORKSPACE_MAJORS:
        return CUBLAS_LARGE_WORKSPACE_BYTES
    return CUBLAS_DEFAULT_WORKSPACE_BYTES


def _parse_cublas_workspace_config(config: str) -> int:
    # parseChosenWorkspaceSize(): pairs of ":SIZE:COUNT", SIZE in KiB; a malformed string makes torch use the
    # default, and so do we.
    numbers = re.findall(r":(\d+):(\d+)", config)
    if not numbers:
        return CUBLAS_DEFAULT_WORKSPACE_BYTES
    return sum(int(size) * 1024 * int(count) for size, count in numbers)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"{path}: not valid TOML ({e})") from None


def _canonical(name: str, gpus: Mapping[str, Mapping[str, Any]]) -> str:
    """The canonical name `name` refers to among `gpus` (raw tables), or `name` itself if it is new."""
    wanted = normalize_name(name)
    for canonical, fields in gpus.items():
        if wanted == normalize_name(canonical) or wanted in (normalize_name(a) for a in fields.get("aliases", ())):
            return canonical
    return name


def _take_aliases(gpus: Mapping[str, dict[str, Any]], aliases: list[str], owner: str) -> None:
    """A site's aliases win: a site whose `a100` GRES is the 80 GB card says so, and the shipped type lets go."""
    taken = {normalize_name(a) for a in aliases}
    for name, fields in gpus.items():
        if name != owner and "aliases" in fields:
            fields["aliases"] = [a for a in fields["aliases"] if normalize_name(a) not in taken]


def _merge_overhead(overhead: dict[str, Any], update: Mapping[str, Any], gpus: Mapping[str, Any],
                    where: str) -> dict[str, Any]:
    merged = {name: dict(entry) for name, entry in overhead.items()}
    for name, entry in update.items():
        key = name if name == "default" else _canonical(name, gpus)
        if key != "default" and key not in gpus:
            known = ", ".join(sorted(gpus))
            raise CatalogError(f"{where}: overhead for unknown GPU type {name!r}; known types: {known}")
        target = merged.setdefault(key, {})
        libraries = {**target.get("library_bytes", {}), **entry.get("library_bytes", {})}
        target.update(entry)
        target["library_bytes"] = libraries
    return merged


def _build_gpu(name: str, fields: Mapping[str, Any], overhead: Mapping[str, Mapping[str, Any]],
               capabilities: Mapping[str, Mapping[str, int]]) -> GpuType:
    if "total_bytes" not in fields or "capability" not in fields:
        raise CatalogError(f"GPU type {name!r} needs total_bytes and capability")
    total, capability = fields["total_bytes"], tuple(fields["capability"])
    if not isinstance(total, int) or total <= 0:
        raise CatalogError(f"GPU type {name!r}: total_bytes must be a positive integer, got {total!r}")
    if len(capability) != 2 or not all(isinstance(c, int) for c in capability):
        raise CatalogError(f"GPU type {name!r}: capability must be [major, minor], got {fields['capability']!r}")
    default, own = overhead.get("default", {}), overhead.get(name, {})
    libraries = {**default.get("library_bytes", {}), **own.get("library_bytes", {})}
    shared = _capability_facts(capability, capabilities)
    return GpuType(
        name=name,
        total_bytes=total,
        capability=(capability[0], capability[1]),
        multi_processor_count=int(fields.get("sms", shared["typical_sms"])),
        l2_cache_bytes=int(fields.get("l2_cache_mib", shared["typical_l2_mib"])) * MIB,
        max_threads_per_multi_processor=int(shared["max_threads_per_multi_processor"]),
        shared_memory_per_block_optin=int(shared["shared_memory_per_block_optin"]),
        aliases=tuple(fields.get("aliases", ())),
        mig_profiles=tuple(MigProfile(p.lower(), round(gib * GIB)) for p, gib in fields.get("mig", {}).items()),
        context_bytes=int(own.get("context_bytes", default.get("context_bytes", 0))),
        library_bytes=tuple(sorted((lib, int(n)) for lib, n in libraries.items())),
        overhead_provenance=str(own.get("provenance", default.get("provenance", ""))),
    )


def _capability_facts(capability: tuple[int, ...], capabilities: Mapping[str, Mapping[str, int]]
                      ) -> Mapping[str, int]:
    """The [capabilities] table of `capability`, else of the nearest capability below it (the lowest listed for one
    below them all): a type of a capability the catalog does not list still shows its program a whole device."""
    known = sorted((tuple(int(part) for part in key.split(".")), key) for key in capabilities)
    below = [key for number, key in known if number <= tuple(capability)]
    return capabilities[below[-1] if below else known[0][1]]


def _check_aliases_unique(catalog: Mapping[str, GpuType]) -> None:
    owner: dict[str, str] = {}
    for gpu in catalog.values():
        for alias in {normalize_name(gpu.name), *(normalize_name(a) for a in gpu.aliases)}:
            if owner.setdefault(alias, gpu.name) != gpu.name:
                raise CatalogError(f"GPU name {alias!r} is used by both {owner[alias]!r} and {gpu.name!r}")
