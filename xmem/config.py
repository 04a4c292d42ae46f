"""The site configuration: what the cluster offers (partitions, MIG, MPS, shards) and how xmem may act on jobs.

Owns the `SiteConfig` records, loading a TOML file (`etc/xmem.toml` is the documented example) with `tomllib`,
where the file is looked for, and validation: an unknown key or a bad value is a `ConfigError` naming the key path
and what is allowed. Reads one file; decides nothing about jobs (that is `xmem.policy`).
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmem.units import GIB, MIB

if TYPE_CHECKING:
    from xmem.gpus import GpuType

DEFAULT_CONFIG_PATH = Path("/etc/xmem/xmem.toml")
CONFIG_ENV = "XMEM_CONFIG"  # a user's own config, for the commands they run for themselves
CONFIG_MAX_BYTES = 1 << 20  # the documented example is 5 KiB: a larger file is a mistake, not a config
REQUEST_KINDS = ("mig", "shard", "mps", "gpu")
EXPLICIT_MODES = ("keep", "fill_generic", "rewrite")
FAILURE_MODES = ("open", "closed")
DEFERRED_MODES = ("inline", "partition")
DEFAULT_TRACE_MEMORY_BYTES = 8 * GIB  # the tracer's host-memory limit unless the site sets one
# The longest estimate timeout taken, here and on the command line: a week is beyond any wait for an estimate, and
# far below what the waits it becomes can hold (threading's TIMEOUT_MAX; 1e308 s overflowed them).
MAX_TIMEOUT_S = 7 * 24 * 3600
# The longest [filter] wait_s taken: sbatch blocks that long before a slow estimate is handed off, and a wait of
# minutes is what the handoff exists to avoid.
MAX_FILTER_WAIT_S = 60.0


class ConfigError(ValueError):
    """A site config that cannot be used as written: the message names the file, the key and what is allowed."""


@dataclass(frozen=True)
class PartitionsConfig:
    """GPU types (GRES type names, as in gres.conf, or catalog names) offered per partition."""

    gpu_types: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    default: str | None = None  # the partition of jobs that name none (slurm.conf's Default=YES)
    from_cluster: bool = True  # partitions not listed: read their GPU types from Slurm


@dataclass(frozen=True)
class MigConfig:
    """MIG profiles offered as GRES types (`gpu:1g.10gb:1`), per parent GPU type."""

    profiles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def parent_of(self, gres_type: str) -> str | None:
        """The GPU type a MIG GRES type is cut from, or None if it is not a MIG slice."""
        wanted = gres_type.lower()
        return next((gpu for gpu, profiles in self.profiles.items() if wanted in (p.lower() for p in profiles)),
                    None)


@dataclass(frozen=True)
class MpsConfig:
    """`--gres=mps:N`: a share N of count_per_gpu gets total_memory * N / count_per_gpu."""

    enabled: bool = False
    count_per_gpu: int = 100
    gpu_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardConfig:
    """`--gres=shard:N`: each of per_gpu shards of a GPU stands for 1/per_gpu of its memory."""

    enabled: bool = False
    per_gpu: int = 4
    gpu_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class MarginConfig:
    """needed = peak * (1 + relative) + absolute_bytes."""

    relative: float = 0.10
    absolute_bytes: int = 0

    def needed(self, peak_bytes: int) -> int:
        return int(-(-peak_bytes * (1 + self.relative) // 1)) + self.absolute_bytes


@dataclass(frozen=True)
class ExcludeConfig:
    users: tuple[str, ...] = ()
    accounts: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()


@dataclass(frozen=True)
class EstimateConfig:
    timeout_s: float = 300.0
    iterations: int = 3
    cache_dir: str = "~/.cache/xmem-slurm"
    max_concurrent: int = 2
    python: str | None = None  # interpreter for jobs that name none (None: the one xmem runs on)
    memory_limit_bytes: int = DEFAULT_TRACE_MEMORY_BYTES  # host memory one trace may use (0: no limit)
    warm_tracer: bool = True  # estimates through a warm tracer per user (xmem.trace.warm); $XMEM_WARM_TRACER wins


@dataclass(frozen=True)
class EstimateSettings:
    """What a site decides for every estimate it makes, handed to `xmem.estimate.estimate(settings=...)` as one
    object: made once from the site config (`SiteConfig.estimate_settings`), or the defaults of a caller with no site
    (the shipped catalog, the default host-memory limit, no warm tracer). What differs per job (the command, its
    iterations, time left and interpreter, which the analysis resolves against [estimate]) is estimate()'s own."""

    catalog: Mapping[str, GpuType] | None = None  # the GPU catalog with the site's [catalog]; None: the shipped one
    memory_limit_bytes: int = DEFAULT_TRACE_MEMORY_BYTES  # host memory one trace may use ([estimate] memory_limit_gib)
    warm_tracer: bool = False  # [estimate] warm_tracer (xmem.trace.warm.enabled; $XMEM_WARM_TRACER wins)


@dataclass(frozen=True)
class DeferredConfig:
    """Where estimates that are not cached run: in the submission (inline) or in a job on `cpu_partition`
    (partition; xmem.slurm.deferred)."""

    mode: str = "inline"
    cpu_partition: str | None = None
    time_limit: str = "00:15:00"
    mem: str = "16G"


@dataclass(frozen=True)
class FilterConfig:
    """sbatch's side (xmem.slurm.filter): how long a submission waits for an estimate that is not cached before the
    job is handed to deferred estimation (where [deferred] cpu_partition names a partition to hand it to), or, at a
    fail-open site without one, goes with its start put off while the estimate goes on detached (`put_off`)."""

    wait_s: float = 4.0
    # Fail-open sites without a CPU partition: put a slow estimate's job off (xmem.slurm.putoff); false: sbatch waits
    put_off: bool = True
    # A put-off job's begin comes this long after the estimate's deadline: the time to write its answer to the job (a
    # few scontrol calls on a busy controller) before Slurm starts the job unchanged.
    put_off_margin_s: float = 30.0
    # Where the filter's own faults go (xmem.slurm.site_log): "syslog", an absolute path of a file, or "none".
    log: str = "syslog"


@dataclass(frozen=True)
class SiteConfig:
    partitions: PartitionsConfig = PartitionsConfig()
    mig: MigConfig = MigConfig()
    mps: MpsConfig = MpsConfig()
    shard: ShardConfig = ShardConfig()
    margin: MarginConfig = MarginConfig()
    preference: tuple[str, ...] = REQUEST_KINDS
    explicit_request: str = "fill_generic"
    failure: str = "open"
    exclude: ExcludeConfig = ExcludeConfig()
    estimate: EstimateConfig = EstimateConfig()
    catalog_overrides: Mapping[str, Any] = field(default_factory=dict)  # xmem.gpus.load_catalog(overrides)
    deferred: DeferredConfig = DeferredConfig()
    filter: FilterConfig = FilterConfig()
    source: str | None = None  # the file it was read from; None: built-in defaults

    def catalog(self) -> Mapping[str, GpuType]:
        """The GPU catalog with the site's [catalog] overrides: the one way every stage reads it (for a job,
        once: xmem.analyze passes it on)."""
        from xmem.gpus import load_catalog  # imported here: torch-free, but not needed to read a config

        return load_catalog(self.catalog_overrides or None)

    def estimate_settings(self, catalog: Mapping[str, GpuType] | None = None) -> EstimateSettings:
        """The settings every estimate for this site takes (`catalog`: `catalog()` when the caller read it already)."""
        return EstimateSettings(self.catalog() if catalog is None else catalog, self.estimate.memory_limit_bytes,
                                self.estimate.warm_tracer)

    def with_partitions(self, gpu_types: Mapping[str, tuple[str, ...]]) -> SiteConfig:
        """A copy that also knows `gpu_types` (e.g. read from the cluster) for partitions the file leaves out."""
        merged = {**gpu_types, **self.partitions.gpu_types}
        return replace(self, partitions=replace(self.partitions, gpu_types=merged))


def load_site_config(path: str | Path | None = None, *, user_env: bool = True) -> SiteConfig:
    """The explicit `path`, else `$XMEM_CONFIG` (only with `user_env`: what a user runs for themselves, `check`,
    `estimate`; never the filter, which runs as the user for the site), else /etc/xmem/xmem.toml if it exists,
    else built-in defaults."""
    if path is None:
        chosen = os.environ.get(CONFIG_ENV) if user_env else None
        path = chosen or (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None)
    if path is None:
        return SiteConfig()
    path = Path(path)
    text = config_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    try:
        return replace(config_from_dict(data), source=str(path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_text(path: Path) -> str:
    """The file's text, read without waiting on it: opened non-blocking, a regular file only (a FIFO or a device
    such as /dev/zero held sbatch for minutes), at most CONFIG_MAX_BYTES, UTF-8. ConfigError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the site config ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: the site config must be a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, CONFIG_MAX_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > CONFIG_MAX_BYTES:
                raise ConfigError(f"{path}: the site config is larger than {CONFIG_MAX_BYTES // 1024} KiB")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the site config ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: the site config is not UTF-8 text (byte {e.start})") from None


def config_from_dict(data: Mapping[str, Any]) -> SiteConfig:
    """Validate a parsed TOML document and build the config. Pure."""
    # the sections: SiteConfig's fields that are records, [policy] (SiteConfig's own settings) and [catalog]
    _only_keys(data, "", (*(f.name for f in fields(SiteConfig) if is_dataclass(f.default)), "policy", "catalog"))
    policy = _table(data, "policy", ("preference", "explicit_request", "failure"))
    config = SiteConfig(
        partitions=_partitions(_table(data, "partitions", _keys(PartitionsConfig))),
        mig=MigConfig({gpu: _strings(v, f"mig.{gpu}") for gpu, v in _table(data, "mig", None).items()}),
        mps=_mps(_table(data, "mps", _keys(MpsConfig))),
        shard=_shard(_table(data, "shard", _keys(ShardConfig))),
        margin=_margin(_table(data, "margin", (*_keys(MarginConfig), "absolute_mib"))),
        preference=_preference(_get(policy, "preference", SiteConfig)),
        explicit_request=_choice(_get(policy, "explicit_request", SiteConfig), "policy.explicit_request",
                                 EXPLICIT_MODES),
        failure=_choice(_get(policy, "failure", SiteConfig), "policy.failure", FAILURE_MODES),
        exclude=_exclude(_table(data, "exclude", _keys(ExcludeConfig))),
        estimate=_estimate(_table(data, "estimate", _keys(EstimateConfig, memory_limit_bytes="memory_limit_gib"))),
        catalog_overrides=_catalog(_table(data, "catalog", ("gpus", "overhead", "calibration"))),
        deferred=_deferred(_table(data, "deferred", _keys(DeferredConfig))),
        filter=_filter(_table(data, "filter", _keys(FilterConfig))),
    )
    _check_gpu_types(config)
    return config


# -- sections ---------------------------------------------------------------------------------------------------

def _partitions(table: Mapping[str, Any]) -> PartitionsConfig:
    gpu_types = _table(table, "gpu_types", None, prefix="partitions.")
    config = PartitionsConfig(
        gpu_types={name: _strings(types, f"partitions.gpu_types.{name}") for name, types in gpu_types.items()},
        default=_optional_string(table.get("default"), "partitions.default"),
        from_cluster=_bool(_get(table, "from_cluster", PartitionsConfig), "partitions.from_cluster"),
    )
    if config.default and config.gpu_types and not config.from_cluster and config.default not in config.gpu_types:
        raise ConfigError(f"partitions.default: {config.default!r} is not one of the partitions listed in "
                          f"partitions.gpu_types ({', '.join(config.gpu_types)})")
    return config


def _mps(table: Mapping[str, Any]) -> MpsConfig:
    return MpsConfig(enabled=_bool(_get(table, "enabled", MpsConfig), "mps.enabled"),
                     count_per_gpu=_positive_int(_get(table, "count_per_gpu", MpsConfig), "mps.count_per_gpu"),
                     gpu_types=_strings(_get(table, "gpu_types", MpsConfig), "mps.gpu_types"))


def _shard(table: Mapping[str, Any]) -> ShardConfig:
    return ShardConfig(enabled=_bool(_get(table, "enabled", ShardConfig), "shard.enabled"),
                       per_gpu=_positive_int(_get(table, "per_gpu", ShardConfig), "shard.per_gpu"),
                       gpu_types=_strings(_get(table, "gpu_types", ShardConfig), "shard.gpu_types"))


def _margin(table: Mapping[str, Any]) -> MarginConfig:
    if "absolute_bytes" in table and "absolute_mib" in table:
        raise ConfigError("margin: give absolute_bytes or absolute_mib, not both")
    relative = _get(table, "relative", MarginConfig)
    if isinstance(relative, bool) or not isinstance(relative, (int, float)) or not 0 <= relative <= 10:
        raise ConfigError(f"margin.relative: must be a number from 0 to 10 (0.1 = 10 %), got {relative!r}")
    if "absolute_mib" in table:
        absolute = _non_negative_number(table["absolute_mib"], "margin.absolute_mib") * MIB
    else:
        absolute = _non_negative_number(_get(table, "absolute_bytes", MarginConfig), "margin.absolute_bytes")
    return MarginConfig(relative=float(relative), absolute_bytes=int(absolute))


def _preference(value: Any) -> tuple[str, ...]:
    kinds = _strings(value, "policy.preference")
    for kind in kinds:
        if kind not in REQUEST_KINDS:
            raise ConfigError(f"policy.preference: {kind!r} is not a request kind; allowed: "
                              f"{', '.join(REQUEST_KINDS)}")
    if len(set(kinds)) != len(kinds) or not kinds:
        raise ConfigError(f"policy.preference: list each of {', '.join(REQUEST_KINDS)} at most once, "
                          f"and at least one; got {list(kinds)}")
    return kinds


def _exclude(table: Mapping[str, Any]) -> ExcludeConfig:
    return ExcludeConfig(users=_strings(_get(table, "users", ExcludeConfig), "exclude.users"),
                         accounts=_strings(_get(table, "accounts", ExcludeConfig), "exclude.accounts"),
                         partitions=_strings(_get(table, "partitions", ExcludeConfig), "exclude.partitions"))


def _estimate(table: Mapping[str, Any]) -> EstimateConfig:
    timeout = _non_negative_number(_get(table, "timeout_s", EstimateConfig), "estimate.timeout_s")
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"estimate.timeout_s: must be more than 0 seconds and at most {MAX_TIMEOUT_S} (a week)")
    return EstimateConfig(
        timeout_s=float(timeout),
        iterations=_positive_int(_get(table, "iterations", EstimateConfig), "estimate.iterations"),
        cache_dir=_optional_string(_get(table, "cache_dir", EstimateConfig), "estimate.cache_dir")
        or EstimateConfig.cache_dir,
        max_concurrent=_positive_int(_get(table, "max_concurrent", EstimateConfig), "estimate.max_concurrent"),
        python=_optional_string(table.get("python"), "estimate.python"),
        memory_limit_bytes=int(GIB * _non_negative_number(
            table.get("memory_limit_gib", DEFAULT_TRACE_MEMORY_BYTES / GIB), "estimate.memory_limit_gib")),
        warm_tracer=_bool(_get(table, "warm_tracer", EstimateConfig), "estimate.warm_tracer"),
    )


def _catalog(table: Mapping[str, Any]) -> Mapping[str, Any]:
    """Checked by the catalog itself, in _check_gpu_types (one load); `calibration` (the site's calibration file,
    which `xmem-slurm calibrate` writes and every estimate reads) must be an absolute path."""
    path = table.get("calibration")
    if path is not None and not (isinstance(path, str) and os.path.isabs(path)):
        raise ConfigError(f"catalog.calibration: an absolute path, e.g. \"/etc/xmem/calibration.toml\" (got {path!r})")
    return dict(table)


def _deferred(table: Mapping[str, Any]) -> DeferredConfig:
    mode = _choice(_get(table, "mode", DeferredConfig), "deferred.mode", DEFERRED_MODES)
    cpu_partition = _optional_string(table.get("cpu_partition"), "deferred.cpu_partition")
    if mode == "partition" and not cpu_partition:
        raise ConfigError('deferred.cpu_partition: required when deferred.mode is "partition" (the partition the '
                          "estimation jobs run on)")
    return DeferredConfig(
        mode=mode,
        cpu_partition=cpu_partition,
        time_limit=_optional_string(_get(table, "time_limit", DeferredConfig), "deferred.time_limit")
        or DeferredConfig.time_limit,
        mem=_optional_string(_get(table, "mem", DeferredConfig), "deferred.mem") or DeferredConfig.mem,
    )


def _filter(table: Mapping[str, Any]) -> FilterConfig:
    wait = _non_negative_number(_get(table, "wait_s", FilterConfig), "filter.wait_s")
    if not 0 < wait <= MAX_FILTER_WAIT_S:
        raise ConfigError(f"filter.wait_s: must be more than 0 seconds and at most {MAX_FILTER_WAIT_S:g}")
    log = _get(table, "log", FilterConfig)
    if not isinstance(log, str) or not (log in ("syslog", "none") or os.path.isabs(log)):
        raise ConfigError(f"filter.log: \"syslog\", \"none\" or an absolute path of a file (got {log!r})")
    margin = _non_negative_number(_get(table, "put_off_margin_s", FilterConfig), "filter.put_off_margin_s")
    if not 0 < margin <= MAX_TIMEOUT_S:
        raise ConfigError(f"filter.put_off_margin_s: must be more than 0 seconds and at most {MAX_TIMEOUT_S} (a week)")
    return FilterConfig(wait_s=float(wait), log=log,
                        put_off=_bool(_get(table, "put_off", FilterConfig), "filter.put_off"),
                        put_off_margin_s=float(margin))


def _check_gpu_types(config: SiteConfig) -> None:
    """[catalog] overrides must pass the catalog's own checks (unknown type, missing total_bytes, bad capability),
    and every GPU type named must be in the catalog (its memory comes from there) or be a MIG profile offered."""
    from xmem.gpus import CatalogError, UnknownGpuError, find_gpu, mig_profile

    try:
        catalog = config.catalog()
    except (CatalogError, ValueError, TypeError) as e:
        raise ConfigError(f"catalog: {e}") from None
    for gpu_name, profiles in config.mig.profiles.items():
        try:
            gpu = find_gpu(gpu_name, catalog)
            for profile in profiles:
                mig_profile(gpu, profile)
        except UnknownGpuError as e:
            raise ConfigError(f"mig.{gpu_name}: {e}") from None
    named = [(f"partitions.gpu_types.{p}", t) for p, types in config.partitions.gpu_types.items() for t in types]
    named += [("mps.gpu_types", t) for t in config.mps.gpu_types] + [("shard.gpu_types", t)
                                                                     for t in config.shard.gpu_types]
    for key, gpu_type in named:
        if config.mig.parent_of(gpu_type):
            continue
        try:
            find_gpu(gpu_type, catalog)
        except UnknownGpuError as e:
            raise ConfigError(f"{key}: {e}; a MIG slice must be listed under [mig], a new GPU type under "
                              "[catalog.gpus]") from None


# -- value checks -----------------------------------------------------------------------------------------------

def _get(table: Mapping[str, Any], key: str, record: type) -> Any:
    """The table's value for `key`, else the default of the record's field of that name: each default is written
    once, on the dataclass (a tuple default as the list TOML would give)."""
    default = record.__dataclass_fields__[key].default
    return table.get(key, list(default) if isinstance(default, tuple) else default)


def _keys(record: type, **toml_names: str) -> tuple[str, ...]:
    """The keys of the section `record` is read from: its fields, each written once, on the dataclass
    (`toml_names`: a field the file gives under another name, as memory_limit_bytes in GiB)."""
    return tuple(toml_names.get(f.name, f.name) for f in fields(record))


def _only_keys(table: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}{key}" if prefix else key
            raise ConfigError(f"unknown key {where!r}; allowed here: {', '.join(allowed)}")


def _table(data: Mapping[str, Any], key: str, allowed: tuple[str, ...] | None, prefix: str = "") -> Mapping:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{prefix}{key}: must be a table ([{prefix}{key}]), got {value!r}")
    if allowed is not None:
        _only_keys(value, f"{prefix}{key}.", allowed)
    return value


def _strings(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}: must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {value!r}")
    return value


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: must be a whole number above 0, got {value!r}")
    return value


def _non_negative_number(value: Any, key: str) -> float:
    # TOML has nan and inf: nan passes every comparison, and int() of either was an internal error later
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}: must be a number of at least 0, got {value!r}")
    return value


def _optional_string(value: Any, key: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string, got {value!r}")
    return value


def _choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{key}: must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value

