"""The estimate pipeline: trace the job once per capability class, then per GPU type orchestrate, simulate and
add the non-allocator overhead.

Owns the breakdown at the peak and the replays behind it (`busiest_replay`, shared between GPU types). The record
it makes is `xmem.estimate_record` (its names are importable from here too); the other capability classes' traces
run beside the first through `xmem.trace_scheduler`. Pure apart from the trace: no caching here (the Slurm glue
caches whole estimates).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xmem.audit import audit
import xmem.rank_traces as rank_traces
from xmem.config import DEFAULT_TRACE_MEMORY_BYTES, EstimateSettings
from xmem.estimate_record import ALLOCATOR_SLACK, OVERHEAD, Estimate, GpuEstimate, shown_gpu
from xmem.gpus import GpuType, cublas_workspace_bytes, find_gpu, load_catalog, overhead_bytes
from xmem.orchestrate import GpuOps, orchestrate, trace_devices
from xmem.simulate import ALLOC, FREE, AllocatorConfig, SimResult, simulate, simulate_limits
from xmem.trace import run_trace
from xmem.trace.events import ARCH_SENSITIVE_PROGRESS, Trace
from xmem.trace.wire import Note, NoteKind
from xmem.trace_scheduler import TracesBeside

NO_CUDA_WARNING = "the program never used CUDA"
# Compute capability 8.0 (Ampere) is where the GPU-dependent choices a trace can take change: bf16 support,
# the flash-attention SDPA backend, TF32. One trace per side of it is enough.
CAPABILITY_SPLIT = (8, 0)


class BadJobSettingError(ValueError):
    """The job's environment holds a setting the estimate cannot use (e.g. a malformed PYTORCH_CUDA_ALLOC_CONF)."""


def estimate(command: Sequence[str], gpus: Sequence[str] | None = None, iterations: int = 3,
             env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
             timeout: float | None = None, python: str | None = None,
             settings: EstimateSettings = EstimateSettings(),
             on_progress: Callable[[str], None] | None = None, gpus_per_node: int | None = None,
             keep_traces: dict[str, Trace] | None = None, keep_needed: dict[str, NeededReplay | None] | None = None,
             cancel: threading.Event | None = None) -> Estimate:
    """Trace `command` under fake CUDA and predict its peak GPU memory on each of `gpus` (None: every type).

    `settings`: the site's (its catalog, the host memory one trace may use, the warm tracer), made once from its
    config (`SiteConfig.estimate_settings`); the defaults are a caller's with no site. `gpus_per_node`: the GPUs the
    job's node shows the program (default: as `run_trace` finds them).
    `keep_traces`, if given, receives the traces by capability class (for pictures of the run: `xmem.pictures`).
    `keep_needed`, if given with catalog names of `gpus` as its keys, receives for each the replay that says what the
    job needs there (`needed_replay`: `xmem.fit`'s search reads each phase's tensors from it).
    `cancel`, set from another thread, stops the trace (the tracer's TraceCancelled): its answer is not wanted.
    Raises `UnknownGpuError` before tracing for an unknown GPU name, and the tracer's `TraceError` as
    it comes.
    """
    started = time.perf_counter()
    catalog = settings.catalog if settings.catalog is not None else load_catalog()
    targets = resolve_gpus(gpus, catalog)
    def trace_rank(more_env: Mapping[str, str]) -> dict[str, Trace]:
        return trace_per_capability_class(command, targets, iterations=iterations,
                                          env={**(os.environ if env is None else env), **more_env}, cwd=cwd,
                                          timeout=timeout, python=python, on_progress=on_progress,
                                          gpus_per_node=gpus_per_node,
                                          memory_limit_bytes=settings.memory_limit_bytes,
                                          warm_tracer=settings.warm_tracer, cancel=cancel)

    traces = trace_rank({})
    if keep_traces is not None:
        keep_traces.update(traces)
    ranks = rank_traces.trace_differing(traces, trace_rank, on_progress)  # -- issue 34: every rank that can differ
    estimates = {rank: estimate_traces(command, traced, targets, env=env, on_progress=on_progress, started=started)
                 for rank, traced in ranks.items()}
    answer = rank_traces.fullest(estimates, ranks)
    shown = {**traces, **(ranks[answer.fullest_rank] if answer.fullest_rank is not None else {})}
    if keep_traces is not None:  # the pictures show the rank the figures are
        keep_traces.update(shown)
    if keep_needed and answer.used_cuda:
        keep_needed.update({name: needed_replay(shown, catalog[name], env) for name in keep_needed})
    return answer


NeededReplay = tuple[GpuOps, SimResult]  # a job's ops on one GPU type and their replay with no memory limit


def needed_replay(traces: Mapping[str, Trace], gpu: GpuType, env: Mapping[str, str] | None) -> NeededReplay:
    """On `gpu`, the job's replay with no memory limit, on the busiest of its trace's devices: what the job needs
    there, whether it fits or not."""
    trace = traces[capability_class(gpu.capability)]
    job_env = dict(env) if env is not None else dict(os.environ)  # as the estimate reads the allocator settings
    config = allocator_config(trace, job_env)

    def replay(device: int) -> NeededReplay:
        ops = orchestrate(trace, gpu, job_env, device=device)
        return ops, simulate(ops.ops, config)

    ops, sim, _device = busiest_replay(trace, replay)
    return ops, sim


def estimate_traces(command: Sequence[str], traces: Mapping[str, Trace], targets: Sequence[GpuType], *,
                    env: Mapping[str, str] | None = None, on_progress: Callable[[str], None] | None = None,
                    started: float | None = None) -> Estimate:
    """The estimate's part after tracing: `traces` (by capability class, as `trace_per_capability_class` gives
    them) orchestrated, replayed and summed up on each of `targets`. `started`: the `time.perf_counter()` the
    estimate's `seconds` count from (default: now)."""
    started = time.perf_counter() if started is None else started
    first = next(iter(traces.values()))
    if not first.used_cuda:
        return _no_cuda_estimate(command, targets, first, time.perf_counter() - started)

    job_env = dict(env) if env is not None else dict(os.environ)  # the tracer runs the job with this env too
    config = allocator_config(first, job_env)
    results: dict[str, GpuEstimate] = {}
    breakdowns: dict[str, dict[str, int]] = {}
    # GPU types that replay the same ops (same trace, same cuBLAS workspace) share a replay where it is exact.
    same_ops = Counter((capability_class(g.capability), cublas_workspace_bytes(g, job_env)) for g in targets)
    devices = {id(t): trace_devices(t) for t in traces.values()}  # one scan of each trace's events
    replays = SharedReplays(limits={})
    for gpu in targets:
        trace = traces[capability_class(gpu.capability)]
        for device in devices[id(trace)]:
            replays.limits.setdefault(_replay_key(trace, gpu, job_env, device), set()).add(
                (_capacity(gpu, trace), gpu.total_bytes))
    for gpu in targets:
        if on_progress:
            on_progress(f"simulating the caching allocator on {gpu.name}")
        cls = capability_class(gpu.capability)
        shared = same_ops[cls, cublas_workspace_bytes(gpu, job_env)] > 1
        results[gpu.name], breakdowns[gpu.name] = estimate_gpu(traces[cls], gpu, config, job_env,
                                                               with_breakdown=True,
                                                               replays=replays if shared else None,
                                                               devices=devices[id(traces[cls])])
    shown = shown_gpu(list(results.values()))
    return Estimate(
        command=tuple(command),
        gpus=results,
        breakdown=breakdowns[shown],
        breakdown_gpu=shown,
        iterations=min(t.iterations for t in traces.values()),
        seconds=time.perf_counter() - started,
        warnings=_warnings(traces, {d for ds in devices.values() for d in ds}),
        libraries=tuple(sorted({lib for t in traces.values() for lib in t.libraries})),
        used_cuda=True,
        torch_version=first.torch_version,
        interpreter=first.interpreter,
        suspect_reasons=_audit(traces),
        sandbox=first.sandbox,
        forward_only=any(t.forward_only for t in traces.values()),
        breakdowns=breakdowns,
    )


def resolve_gpus(names: Sequence[str] | None, catalog: Mapping[str, GpuType]) -> list[GpuType]:
    """The requested GPU types, in the order given, without repeats; every catalog type for None or []."""
    if not names:
        return list(catalog.values())
    found = [find_gpu(name, catalog) for name in names]
    return list({g.name: g for g in found}.values())


def capability_class(capability: tuple[int, int]) -> str:
    """The class of GPUs one trace is valid for when the trace is architecture-sensitive."""
    return "sm80+" if tuple(capability) >= CAPABILITY_SPLIT else "pre-sm80"


def trace_per_capability_class(command: Sequence[str], targets: Sequence[GpuType], *, iterations: int,
                               env: Mapping[str, str] | None, cwd: str | os.PathLike | None,
                               timeout: float | None, python: str | None,
                               on_progress: Callable[[str], None] | None,
                               gpus_per_node: int | None = None,
                               memory_limit_bytes: int = DEFAULT_TRACE_MEMORY_BYTES,
                               warm_tracer: bool = False, cancel: threading.Event | None = None) -> dict[str, Trace]:
    """One trace per capability class among `targets`, sharing the first when it is not architecture-sensitive.

    Each class is traced as its GPU of highest capability among `targets` (its name and memory are what the
    program sees); the newest class goes first. The others' traces start beside it as soon as it reports a choice
    that depends on the GPU generation (they are needed then; on a login node's second core the estimate waits
    about one trace, not one per class), and never start when it reports none.
    """
    representative: dict[str, GpuType] = {}
    for gpu in targets:
        cls = capability_class(gpu.capability)
        if cls not in representative or gpu.capability > representative[cls].capability:
            representative[cls] = gpu
    order = sorted(representative, key=lambda cls: representative[cls].capability, reverse=True)

    def trace(gpu: GpuType, progress: Callable[[str], None] | None, cancel: threading.Event | None = None) -> Trace:
        return run_trace(list(command), iterations=iterations, gpu=gpu, env=env, cwd=cwd,
                         timeout=timeout, python=python, on_progress=progress, device_count=gpus_per_node,
                         memory_limit_bytes=memory_limit_bytes, warm_tracer=warm_tracer, cancel=cancel)

    others = TracesBeside({cls: representative[cls] for cls in order[1:]}, trace, on_progress)

    def first_progress(line: str) -> None:
        if line == ARCH_SENSITIVE_PROGRESS:
            others.start()
        elif on_progress is not None:
            on_progress(line)

    try:
        first = trace(representative[order[0]], first_progress, cancel)
    except BaseException:
        others.cancel()
        raise
    if first.used_cuda and first.arch_sensitive:
        return {order[0]: first, **others.results()}
    others.cancel()
    return {cls: first for cls in order}


@dataclass
class SharedReplays:
    """What the GPU types of one estimate share (see `_replay`), by replay key (trace, cuBLAS workspace, device):
    the (capacity, device total) of each GPU type on those ops, and once made, the ops and every limit's replay."""

    limits: dict[tuple, set[tuple[int, int]]]
    done: dict[tuple, tuple[GpuOps, dict[tuple[int, int], SimResult] | None]] = dataclasses.field(default_factory=dict)
    unlimited: dict[tuple, SimResult] = dataclasses.field(default_factory=dict)  # by key: the replay with no limit
    # by (ops, op index): the tensors live there, per category (every type's breakdown is kept: one scan per peak)
    tensors_at: dict[tuple[int, int], dict[str, int]] = dataclasses.field(default_factory=dict)


def estimate_gpu(trace: Trace, gpu: GpuType, config: AllocatorConfig, env: Mapping[str, str] | None = None, *,
                 with_breakdown: bool = False, replays: SharedReplays | None = None,
                 devices: Sequence[int] | None = None) -> tuple[GpuEstimate, dict[str, int]]:
    """Orchestrate and simulate `trace` on `gpu`, and (if asked) the breakdown at the peak (where it ran out of
    memory, at the peak of the replay with no limit: what the job needs).

    With several devices in the trace, the device with the highest peak (or the first OOM) counts. `replays`, if
    given, shares replays between the GPU types of one estimate (see `_replay`).
    """
    overhead = overhead_bytes(gpu, trace.libraries)
    capacity = _capacity(gpu, trace)
    ops, sim, device = busiest_replay(trace, lambda d: _replay(trace, gpu, config, env, d, capacity, replays),
                                      devices)
    peak = sim.peak_reserved + overhead
    unlimited, needed = None, sim
    if sim.oom is not None:
        key = _replay_key(trace, gpu, env, device)
        needed = _unlimited_replay(ops, config, key, replays)
        unlimited = needed.peak_reserved + overhead
    gpu_estimate = GpuEstimate(
        gpu=gpu.name,
        total_bytes=gpu.total_bytes,
        peak_bytes=peak,
        peak_reserved_bytes=sim.peak_reserved,
        peak_allocated_bytes=sim.peak_allocated,
        overhead_bytes=overhead,
        capacity_bytes=capacity,
        fits=sim.oom is None and peak <= gpu.total_bytes,
        oom=sim.oom,
        fragmentation=sim.fragmentation_at_peak,
        traced_capability=tuple(trace.capability),
        unlimited_peak_bytes=unlimited,
    )
    if not with_breakdown:
        return gpu_estimate, {}
    # The breakdown says what the job needs: where the replay ran out of memory, the state at the failed
    # allocation is only what fitted before it, so the peak of the replay with no limit is broken down instead
    # (it adds up to `unlimited_peak_bytes`, the "needs" figure).
    if replays is None:
        return gpu_estimate, breakdown_at(ops, needed.fullest_peak_index, needed.peak_reserved, overhead)
    key = (id(ops), needed.fullest_peak_index)  # shared ops live as long as `replays`: their id is theirs
    if key not in replays.tensors_at:
        replays.tensors_at[key] = tensors_at(ops, needed.fullest_peak_index)
    return gpu_estimate, with_slack(replays.tensors_at[key], needed.peak_reserved, overhead)


def busiest_replay(trace: Trace, replay: Callable[[int], tuple[GpuOps, SimResult]],
                   devices: Sequence[int] | None = None) -> tuple[GpuOps, SimResult, int]:
    """The replay that counts among the trace's devices (`devices`, default all), each made by `replay(device)`:
    the first to run out of memory, else the highest peak reserved. The estimate's, the pictures' and fit's."""
    runs = [(*replay(device), device) for device in (devices if devices is not None else trace_devices(trace))]
    return max(runs, key=lambda run: (run[1].oom is not None, run[1].peak_reserved))


def _replay(trace: Trace, gpu: GpuType, config: AllocatorConfig, env: Mapping[str, str] | None, device: int,
            capacity: int, replays: SharedReplays | None) -> tuple[GpuOps, SimResult]:
    """`device`'s ops on `gpu` and their replay with `capacity`; with `replays`, shared between GPU types.

    The ops depend on the GPU type only through the cuBLAS workspace size. Without a memory fraction or expandable
    segments (the only uses of the device's size short of an OOM), the capacity is read at cudaMalloc only, so
    the replays of all capacities are made together (`simulate_limits`): one that never passes a capacity is the
    replay with that capacity, and one with a smaller capacity follows it up to the op that would pass it.
    """
    key = _replay_key(trace, gpu, env, device)
    if replays is not None and key not in replays.done:
        ops, limited = orchestrate(trace, gpu, env, device=device), None
        if config.memory_fraction is None and not config.expandable_segments:
            replays.unlimited[key], limited = simulate_limits(ops.ops, config, replays.limits[key])
        replays.done[key] = ops, limited
    ops, limited = replays.done[key] if replays is not None else (orchestrate(trace, gpu, env, device=device), None)
    if limited is not None:
        return ops, limited[capacity, gpu.total_bytes]
    # device_total: a memory fraction is a fraction of the whole device, as in torch's setMemoryFraction
    return ops, simulate(ops.ops, config, capacity=capacity, device_total=gpu.total_bytes)


def _unlimited_replay(ops: GpuOps, config: AllocatorConfig, key: tuple, replays: SharedReplays | None) -> SimResult:
    """The replay of `ops` with no memory limit (and no memory fraction): what a job that ran out would need."""
    if replays is not None and key in replays.unlimited:
        return replays.unlimited[key]
    sim = simulate(ops.ops, dataclasses.replace(config, memory_fraction=None))
    if replays is not None:
        replays.unlimited[key] = sim
    return sim


def _replay_key(trace: Trace, gpu: GpuType, env: Mapping[str, str] | None, device: int) -> tuple:
    """What a replay depends on besides the allocator settings and the limit: the GPU types with one key share it."""
    return id(trace), cublas_workspace_bytes(gpu, env), device


def _capacity(gpu: GpuType, trace: Trace) -> int:
    """What the caching allocator may reserve on `gpu`: its memory less the context and the libraries' own."""
    return gpu.total_bytes - overhead_bytes(gpu, trace.libraries)


def breakdown_at(ops: GpuOps, index: int, reserved: int, overhead: int) -> dict[str, int]:
    """Bytes live per category just after `ops.ops[index]`, plus the allocator's slack and the overhead.

    `allocator_slack` is `reserved` minus the live tensors' requested bytes: rounding, unsplit remainders and
    cached free blocks.
    """
    return with_slack(tensors_at(ops, index), reserved, overhead)


def tensors_at(ops: GpuOps, index: int) -> dict[str, int]:
    """Bytes live per category just after `ops.ops[index]` (as requested, before rounding)."""
    live: dict[int, tuple[str, int]] = {}
    for (action, block, nbytes, _stream), (category, _phase, _iteration) in zip(ops.ops[: index + 1], ops.labels):
        if action == ALLOC:
            live[block] = (category, nbytes)
        elif action == FREE:
            live.pop(block, None)
    tensors: dict[str, int] = {}
    for category, nbytes in live.values():
        tensors[category] = tensors.get(category, 0) + nbytes
    return tensors


def with_slack(tensors: Mapping[str, int], reserved: int, overhead: int) -> dict[str, int]:
    """The breakdown: `tensors` plus the allocator's slack (`reserved` minus their bytes) and the overhead."""
    return {**tensors, ALLOCATOR_SLACK: reserved - sum(tensors.values()), OVERHEAD: overhead}


def allocator_config(trace: Trace, env: Mapping[str, str]) -> AllocatorConfig:
    """The allocator settings the job's replay uses (also `fit`'s and the pictures' replays)."""
    # What the job really ran with wins: the tracer saw PYTORCH_(CUDA_)ALLOC_CONF as the job set it, even when
    # the script sets it itself before importing torch.
    try:
        if trace.alloc_conf:
            return AllocatorConfig.parse(trace.alloc_conf)
        return AllocatorConfig.from_environ(env)
    except ValueError as e:
        raise BadJobSettingError(f"the job's allocator settings: {e}") from None


def _warnings(traces: Mapping[str, Trace], devices: set[int]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for trace in traces.values():
        seen.update(dict.fromkeys(trace.warnings))
    distinct = {id(t) for t in traces.values()}
    if len(distinct) > 1:
        classes = ", ".join(f"{cls} at sm_{t.capability[0]}{t.capability[1]}" for cls, t in traces.items())
        seen[Note(NoteKind.TRACED_PER_CLASS,
                  f"the job takes GPU-dependent code paths; traced once per class ({classes})")] = None
    if len(devices) > 1:
        seen[Note(NoteKind.GPUS_USED, f"the job used {len(devices)} GPUs; figures are for the busiest one",
                  len(devices))] = None
    return tuple(seen)


def _audit(traces: Mapping[str, Trace]) -> tuple[str, ...]:
    """The self-audit's reasons over the distinct traces, each once."""
    distinct = {id(t): t for t in traces.values()}.values()
    return tuple(dict.fromkeys(reason for trace in distinct for reason in audit(trace)))


def _no_cuda_estimate(command: Sequence[str], targets: Sequence[GpuType], trace: Trace, seconds: float) -> Estimate:
    gpus = {
        gpu.name: GpuEstimate(gpu=gpu.name, total_bytes=gpu.total_bytes, peak_bytes=0, peak_reserved_bytes=0,
                              peak_allocated_bytes=0, overhead_bytes=0, capacity_bytes=gpu.total_bytes, fits=True,
                              oom=None, fragmentation=0.0, traced_capability=tuple(trace.capability))
        for gpu in targets
    }
    return Estimate(command=tuple(command), gpus=gpus, breakdown={},
                    breakdown_gpu=shown_gpu(list(gpus.values())), iterations=trace.iterations,
                    seconds=seconds, warnings=tuple(dict.fromkeys([*trace.warnings, NO_CUDA_WARNING])),
                    libraries=tuple(trace.libraries), used_cuda=False, torch_version=trace.torch_version,
                    interpreter=trace.interpreter,
                    sandbox=trace.sandbox)
