"""The caching allocator's settings, as PyTorch reads them from `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`.

Owns: `AllocatorConfig` (the settings that change where device memory goes) and its parser, which follows
upstream's `ConfigTokenizer` + `AcceleratorAllocatorConfig::parseArgs` (c10/core/AllocatorConfig.{h,cpp}) and
`CUDAAllocatorConfig::parseArgs` (c10/cuda/CUDAAllocatorConfig.{h,cpp}): the same keys, the same token grammar
(`key:value` pairs split by `,`; `[...]` lists), the same range checks. Bad input raises `ValueError` with one
clear line. We are stricter than upstream in one way: a malformed number (`-5`, `20.5`, `abc`) is an error here,
where upstream's `stoull` silently reads a prefix or wraps around.

Must not: read the environment itself (`from_environ` takes the mapping), or touch torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xmem.alloc_conf import alloc_conf_setting
from xmem.units import MIB as MiB  # spelt as upstream's comments spell it

# The allocator's constants, named and valued as upstream (c10/core/AllocatorConfig.h in torch 2.13/2.14, except
# kLargeBuffer, from c10/cuda/CUDACachingAllocator.cpp). They live here because the settings are checked against them.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 * MiB  # "small" allocations are packed in 2 MiB segments
kLargeBuffer = 20 * MiB  # allocations between 1 and 10 MiB use 20 MiB segments (default large_segment_size)
kMinLargeAlloc = 10 * MiB  # allocations of 10 MiB or more get their own segment
kRoundLarge = 2 * MiB  # round up large allocations to 2 MiB
kRoundUpPowerOfTwoIntervals = 16  # roundup_power2_divisions intervals: 1 MiB .. 64 GiB

# Keys upstream accepts that do not change the device memory of the native allocator (pinned host memory,
# locking, IPC, error style): parsed past, value ignored.
_NO_EFFECT_KEYS = frozenset({
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom",
})
_MODELLED_KEYS = (
    "expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
    "garbage_collection_threshold", "per_process_memory_fraction", "large_segment_size_mb", "backend",
)
_SEPARATORS = frozenset(",:[]")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options that shape device memory; defaults are upstream's (torch 2.13/2.14)."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None = SIZE_MAX (upstream default: every block may split)
    max_non_split_rounding: int = 20 * MiB
    roundup_power2_divisions: tuple[int, ...] = ()  # 16 buckets (1 MiB .. 64 GiB intervals) or () = off
    garbage_collection_threshold: float = 0.0
    memory_fraction: float | None = None  # set_per_process_memory_fraction / per_process_memory_fraction
    large_segment_size: int = 20 * MiB  # large_segment_size_mb (newest)

    def __post_init__(self) -> None:
        divisions = self.roundup_power2_divisions
        if divisions and len(divisions) != kRoundUpPowerOfTwoIntervals:
            raise ValueError(f"roundup_power2_divisions needs {kRoundUpPowerOfTwoIntervals} buckets or none, "
                             f"got {len(divisions)}")
        if any(d != 0 and not _is_power_of_2(d) for d in divisions):
            raise ValueError(f"roundup_power2_divisions must be powers of 2 or 0, got {divisions}")
        if self.max_split_size is not None and self.max_split_size < self.large_segment_size:
            raise ValueError(f"max_split_size must be >= large_segment_size ({self.large_segment_size} bytes), "
                             f"got {self.max_split_size}")
        if self.max_non_split_rounding <= 0:
            raise ValueError(f"max_non_split_rounding must be positive, got {self.max_non_split_rounding}")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ValueError(f"garbage_collection_threshold must be in [0.0, 1.0), "
                             f"got {self.garbage_collection_threshold}")
        if self.memory_fraction is not None and not 0.0 <= self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in [0.0, 1.0], got {self.memory_fraction}")
        if self.large_segment_size <= kMinLargeAlloc:
            raise ValueError(f"large_segment_size must be > {kMinLargeAlloc} bytes (10 MiB), "
                             f"got {self.large_segment_size}")

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """Parse an allocator setting string such as "expandable_segments:True,max_split_size_mb:128"."""
        return cls(**_Parser(text).parse())

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> AllocatorConfig:
        """The config a CUDA job runs with (see `alloc_conf_setting`)."""
        setting = alloc_conf_setting(env)
        if setting is None:
            return cls()
        name, text = setting
        try:
            return cls.parse(text)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer: separators `,:[]` are tokens of their own; whitespace is dropped."""
    tokens: list[str] = []
    buffer = ""
    for ch in text:
        if ch in _SEPARATORS:
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


class _Parser:
    """One pass over the tokens of one setting string, in the shape of AcceleratorAllocatorConfig::parseArgs."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def fail(self, why: str) -> ValueError:
        return ValueError(f"allocator setting {self.text!r}: {why}")

    def take(self, what: str) -> str:
        if self.i >= len(self.tokens):
            raise self.fail(f"ends early, expected {what}")
        token = self.tokens[self.i]
        self.i += 1
        return token

    def expect(self, separator: str, after: str) -> None:
        token = self.take(f"{separator!r} after {after!r}")
        if token != separator:
            raise self.fail(f"expected {separator!r} after {after!r}, got {token!r}")

    def parse(self) -> dict[str, object]:
        """The fields the string sets, checked; AllocatorConfig's defaults fill the rest."""
        config: dict[str, object] = {}
        while self.i < len(self.tokens):
            key = self.take("a key")
            if key in _SEPARATORS:
                raise self.fail(f"expected a key, got {key!r}")
            self.expect(":", key)
            config = self.parse_value(key, config)
            if self.i < len(self.tokens):
                self.expect(",", key)
        self.check_minimums(config)
        return config

    def check_minimums(self, config: dict[str, object]) -> None:
        """Both split limits must be at least the large segment size, wherever it appears in the string.

        Seen on torch 2.14.1: "large_segment_size_mb:32,max_split_size_mb:30" and the reverse order both fail with
        "must be >= 32"; with the default large segment size the minimum is 20.
        """
        large_segment_size = config.get("large_segment_size", kLargeBuffer)
        minimum = large_segment_size // MiB
        for key, field in (("max_split_size_mb", "max_split_size"),
                           ("max_non_split_rounding_mb", "max_non_split_rounding")):
            value = config.get(field)
            if value is not None and value < large_segment_size:
                raise self.fail(f"{key} must be >= {minimum} (large_segment_size_mb), got {value // MiB}")

    def parse_value(self, key: str, config: dict[str, object]) -> dict[str, object]:
        if key == "roundup_power2_divisions":
            divisions = self.parse_divisions(config.get("roundup_power2_divisions", ()))
            return dict(config, roundup_power2_divisions=divisions)
        if key in _NO_EFFECT_KEYS:
            self.skip_value(key)
            return config
        value = self.take(f"a value for {key!r}")
        if key == "expandable_segments":
            return dict(config, expandable_segments=self.to_bool(key, value))
        if key == "max_split_size_mb":  # parseMaxSplitSize (its minimum is checked in check_minimums)
            return dict(config, max_split_size=self.to_mib(key, value, minimum=0))
        if key == "max_non_split_rounding_mb":  # parseMaxNonSplitRoundingSize (likewise)
            return dict(config, max_non_split_rounding=self.to_mib(key, value, minimum=0))
        if key == "large_segment_size_mb":  # parseLargeSegmentSize: "must be > 10 MB"
            return dict(config, large_segment_size=self.to_mib(key, value, minimum=kMinLargeAlloc // MiB + 1))
        if key == "garbage_collection_threshold":  # parseGarbageCollectionThreshold: open interval (0, 1)
            threshold = self.to_float(key, value)
            if not 0.0 < threshold < 1.0:
                raise self.fail(f"garbage_collection_threshold must be in (0.0, 1.0), got {value}")
            return dict(config, garbage_collection_threshold=threshold)
        if key == "per_process_memory_fraction":  # parsePerProcessMemoryFraction: closed interval [0, 1]
            fraction = self.to_float(key, value)
            if not 0.0 <= fraction <= 1.0:
                raise self.fail(f"per_process_memory_fraction must be in [0.0, 1.0], got {value}")
            return dict(config, memory_fraction=fraction)
        if key == "backend":
            if value == "native":
                return config
            if value == "cudaMallocAsync":
                raise self.fail("backend:cudaMallocAsync is not modelled; only the native caching allocator is")
            raise self.fail(f"unknown backend {value!r}; options are native and cudaMallocAsync")
        raise self.fail(f"unknown key {key!r}; known keys: {', '.join(_MODELLED_KEYS)} "
                        f"(and pinned/locking keys, which do not change device memory)")

    def skip_value(self, key: str) -> None:
        """ConfigTokenizer::skipKey: a single token, or everything up to the closing bracket."""
        if self.take(f"a value for {key!r}") != "[":
            return
        while self.take(f"']' closing the list of {key!r}") != "]":
            pass

    def parse_divisions(self, current: tuple[int, ...]) -> tuple[int, ...]:
        """parseRoundUpPower2Divisions: `N` for every interval, or `[MB:N, ..., >:N]` per interval."""
        divisions = list(current) or [0] * kRoundUpPowerOfTwoIntervals
        token = self.take("a value for 'roundup_power2_divisions'")
        if token != "[":
            value = self.to_int("roundup_power2_divisions", token)
            if not _is_power_of_2(value):
                raise self.fail(f"roundup_power2_divisions must be a power of 2, got {token}")
            return (value,) * kRoundUpPowerOfTwoIntervals
        first_value, last_index = True, 0
        while (boundary := self.take("']' closing roundup_power2_divisions")) != "]":
            self.expect(":", boundary)
            value_token = self.take(f"a division count after {boundary!r}")
            value = self.to_int("roundup_power2_divisions", value_token)
            if value != 0 and not _is_power_of_2(value):
                raise self.fail(f"roundup_power2_divisions: divisions must be a power of 2 or 0, got {value}")
            if boundary == ">":
                divisions[last_index + 1:] = [value] * (kRoundUpPowerOfTwoIntervals - last_index - 1)
            else:
                size_mb = self.to_int("roundup_power2_divisions", boundary)
                if not _is_power_of_2(size_mb):
                    raise self.fail(f"roundup_power2_divisions: interval starts must be powers of 2 (MB), "
                                    f"got {boundary}")
                index = min(size_mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
                if first_value:  # the first interval's value also covers every interval below it
                    divisions[:index] = [value] * index
                    first_value = False
                divisions[index] = value
                last_index = index
            if self.i < len(self.tokens) and self.tokens[self.i] != "]":
                self.expect(",", value_token)
        return tuple(divisions) if any(divisions) else ()

    def to_int(self, key: str, token: str) -> int:
        if not token.isdigit():
            raise self.fail(f"{key} expects a non-negative whole number, got {token!r}")
        return int(token)

    def to_mib(self, key: str, token: str, minimum: int) -> int:
        value = self.to_int(key, token)
        if value < minimum:
            raise self.fail(f"{key} must be >= {minimum}, got {value}")
        return value * MiB

    def to_float(self, key: str, token: str) -> float:
        try:
            return float(token)
        except ValueError:
            raise self.fail(f"{key} expects a number, got {token!r}") from None

    def to_bool(self, key: str, token: str) -> bool:
        if token not in ("True", "False"):
            raise self.fail(f"{key} expects True or False (capitalised), got {token!r}")
        return token == "True"
