"""Orchestrate: a `Trace` + a GPU type -> the GPU-side allocation sequence the simulator replays.

Owns what fake kernels cannot show and that depends on the GPU type or on the job's environment:
- cuBLAS workspaces (one per host thread and stream, sized per architecture),
- cuDNN convolution workspaces (a documented model, see `ConvWorkspaceModel`),
- the scratch of fused attention backward kernels (a documented model, see `AttentionWorkspaceModel`),
and the labels (category, phase, iteration) that travel beside each op so the estimate can say what was live at
the peak. Per-stream program order is kept: events are only inserted, never moved.

Pure and fast: plain lists of tuples, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xmem.gpus import GpuType, cublas_workspace_bytes
from xmem.simulate import ALLOC, BEGIN_POOL, EMPTY_CACHE, END_POOL, FREE, RELEASE_POOL
from xmem.trace.events import CUBLAS_OPS, POOL_ACTIONS, Category, MemEvent, Phase, Trace
from xmem.units import MIB

Op = tuple  # (action, block, nbytes, stream), the simulator's input row
Label = tuple[str, str, int]  # (category, phase, iteration)

# ATen ops that run a cuDNN convolution on CUDA (fake CUDA reports them as `convolution`/`convolution_backward`).
CONV_OPS = frozenset({
    "convolution", "convolution_backward", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
    "convolution_overrideable", "convolution_backward_overrideable",
})

# The backward ops of the fused SDPA kernels (xmem.trace.child.attention): fake CUDA shows their dq, dk, dv only.
ATTENTION_BACKWARD_OPS = frozenset({
    "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
})
FLASH_BACKWARD = "_scaled_dot_product_flash_attention_backward"

AUTOGRAD_THREAD = "autograd"
MAIN_THREAD = "main"


@dataclass(frozen=True, slots=True)
class ConvWorkspaceModel:
    """A model, not a measurement: cuDNN's workspace for one convolution call.

    cuDNN (v8 API, benchmark off) allocates the chosen plan's workspace from the caching allocator for every call
    and frees it after the kernel (notes/torch-allocator.md A.10). Its size depends on the library, the GPU and the
    plan, which cannot be known without cuDNN. We model it as a transient allocation made right after each output
    of a convolution op is allocated and freed right after, sized `fraction` x that output's bytes, at most
    `cap_bytes`. With the defaults (1.0, 256 MiB) it is on the safe side for common CNNs: it only matters when a
    convolution sits at the peak. Set `fraction=0` to leave cuDNN workspaces out.
    """

    fraction: float = 1.0
    cap_bytes: int = 256 * MIB

    def size(self, output_nbytes: int) -> int:
        return min(int(output_nbytes * self.fraction), self.cap_bytes)


@dataclass(frozen=True, slots=True)
class AttentionWorkspaceModel:
    """A model, not a measurement: the scratch one fused attention backward takes from the caching allocator
    besides its dq, dk, dv, held while its kernels run and freed when the op returns.

    Each accumulates dq in fp32 across key blocks: flash-attention 2's `mha_bwd` allocates `dq_accum`
    (B, Tq rounded to 128, H, D rounded) fp32; the memory-efficient kernel's workspace holds a (B, H, Tq, D) fp32
    grad-q accumulator for 16-bit outputs (`kernel_backward.h` `workspace_size`; none for fp32, which the trace's
    events cannot tell apart: fp32 calls are over-counted); cuDNN's SDPA backward plan asks for a workspace whose
    size depends on the plan, not knowable without the library, taken as the same accumulator. We model it as
    `dq_fraction` x dq bytes (2: fp32 of a 16-bit dq). Flash with fewer k/v heads than q heads also computes dk and
    dv per query head (`dk_expanded`, `dv_expanded`, (B, Tk, Hq, D) each) before summing them: two more dq-sized
    blocks (self-attention: Tk = Tq). Forward passes are given none. `dq_fraction=0` leaves the model out.
    """

    dq_fraction: float = 2.0

    def sizes(self, op: str, outputs: list[int]) -> list[int]:
        """The scratch blocks of one `op` call whose outputs (dq, dk, dv) were `outputs` bytes."""
        if self.dq_fraction <= 0 or not outputs:
            return []
        dq = outputs[0]
        grouped = op == FLASH_BACKWARD and len(outputs) > 1 and outputs[1] < dq
        return [int(dq * self.dq_fraction)] + ([dq, dq] if grouped else [])


def _attention_backward_outputs(events: list[MemEvent], index: int) -> list[int]:
    """The outputs of the fused attention backward call whose last allocation is `events[index]` ([] if the call
    allocates more after it): the run of allocations of that op on that device ending there."""
    last = events[index]
    following = events[index + 1] if index + 1 < len(events) else None
    if following is not None and (following.op, following.action, following.device) == (last.op, "alloc", last.device):
        return []
    start = index
    while start > 0 and (events[start - 1].op, events[start - 1].action, events[start - 1].device) == (
            last.op, "alloc", last.device):
        start -= 1
    return [e.nbytes for e in events[start:index + 1]]


@dataclass(frozen=True, slots=True)
class GpuOps:
    """The sequence for one device of one GPU type: `ops[i]` is labelled by `labels[i]`."""

    device: int
    ops: list[Op]
    labels: list[Label]
    cublas_workspace_bytes: int  # size of one cuBLAS workspace on this GPU type
    cublas_workspaces: int  # how many were added (host threads x streams that ran cuBLAS work)
    conv_workspaces: int  # how many transient cuDNN workspaces were added
    attention_workspaces: int = 0  # how many fused attention backward calls were given scratch
    iteration_starts: dict[int, int] = field(default_factory=dict)  # iteration -> index of its first op


def trace_devices(trace: Trace) -> list[int]:
    """The CUDA devices the trace allocated on (device 0 if it allocated nothing)."""
    return sorted({e.device for e in trace.events}) or [0]


# The events without bytes that reach the allocator: the cache emptied, and a CUDA graph's pool actions.
_POOL_OPS = {"begin_pool": BEGIN_POOL, "end_pool": END_POOL, "release_pool": RELEASE_POOL}
_NO_BYTES_KEPT = frozenset({"empty_cache", *POOL_ACTIONS})


def reaches_allocator(event: MemEvent, device: int) -> bool:
    """Whether `event` becomes an op of `device`'s replay: a 0-byte request never reaches the caching allocator's
    malloc(); the cache emptied and a CUDA graph's pool actions do."""
    return event.device == device and (event.nbytes != 0 or event.action in _NO_BYTES_KEPT)


def host_thread(event: MemEvent) -> str:
    """The host thread that issued `event`'s op.

    The trace records no thread ids. On CUDA the autograd engine runs backward on its own device thread, and the
    rest of a training step (forward, loss, optimizer) runs on the Python thread that called it.
    """
    return AUTOGRAD_THREAD if event.phase == Phase.BACKWARD else MAIN_THREAD


def orchestrate(trace: Trace, gpu: GpuType, env: Mapping[str, str] | None = None, *, device: int = 0,
                conv_workspace: ConvWorkspaceModel = ConvWorkspaceModel(),
                attention_workspace: AttentionWorkspaceModel = AttentionWorkspaceModel()) -> GpuOps:
    """The op sequence of `device` on `gpu`, with cuBLAS and cuDNN workspaces added, and its labels."""
    workspace_bytes = cublas_workspace_bytes(gpu, env)
    next_block = max((e.block for e in trace.events), default=0) + 1
    has_workspace: set[tuple[str, int]] = set()  # (host thread, stream) that already holds a cuBLAS workspace
    ops: list[Op] = []
    labels: list[Label] = []
    iteration_starts: dict[int, int] = {}
    conv_count = attention_count = 0

    for index, e in enumerate(trace.events):
        if not reaches_allocator(e, device):
            continue
        if e.iteration >= 0:
            iteration_starts.setdefault(e.iteration, len(ops))
        if e.action == "empty_cache":
            ops.append((EMPTY_CACHE, 0, 0, e.stream))
            labels.append((Category.OTHER, e.phase, e.iteration))
            continue
        if e.action in POOL_ACTIONS:  # a CUDA graph's pool: the capture's allocations on its stream go there
            ops.append((_POOL_OPS[e.action], e.block, 0, e.stream))
            labels.append((Category.OTHER, e.phase, e.iteration))
            continue
        ops.append((ALLOC if e.action == "alloc" else FREE, e.block, e.nbytes, e.stream))
        labels.append((e.category, e.phase, e.iteration))
        if e.action != "alloc":
            continue
        # cuBLAS: the handle's workspace is taken from the caching allocator at the thread's first GEMM on a
        # stream (after the GEMM's output exists) and kept for the life of the process (CublasHandlePool.cpp).
        key = (host_thread(e), e.stream)
        if e.op in CUBLAS_OPS and key not in has_workspace:
            has_workspace.add(key)
            ops.append((ALLOC, next_block, workspace_bytes, e.stream))
            labels.append((Category.WORKSPACE, e.phase, e.iteration))
            next_block += 1
        if e.op in CONV_OPS and (size := conv_workspace.size(e.nbytes)) > 0:
            ops.append((ALLOC, next_block, size, e.stream))
            ops.append((FREE, next_block, size, e.stream))
            labels.extend([(Category.WORKSPACE, e.phase, e.iteration)] * 2)
            next_block += 1
            conv_count += 1
        if e.op in ATTENTION_BACKWARD_OPS and (outputs := _attention_backward_outputs(trace.events, index)):
            blocks = [(next_block + i, size) for i, size in enumerate(attention_workspace.sizes(e.op, outputs))]
            ops.extend([(ALLOC, block, size, e.stream) for block, size in blocks] +
                       [(FREE, block, size, e.stream) for block, size in blocks])
            labels.extend([(Category.WORKSPACE, e.phase, e.iteration)] * (2 * len(blocks)))
            next_block += len(blocks)
            attention_count += bool(blocks)

    return GpuOps(device=device, ops=ops, labels=labels, cublas_workspace_bytes=workspace_bytes,
                  cublas_workspaces=len(has_workspace), conv_workspaces=conv_count,
                  attention_workspaces=attention_count,
                  iteration_starts=iteration_starts)


__all__ = [
    "ATTENTION_BACKWARD_OPS", "AttentionWorkspaceModel", "CONV_OPS", "CUBLAS_OPS", "ConvWorkspaceModel", "GpuOps",
    "Label", "Op", "host_thread", "orchestrate", "reaches_allocator", "trace_devices",
]
