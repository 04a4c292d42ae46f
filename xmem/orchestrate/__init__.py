"""Orchestrate: a `Trace` + a GPU type -> the GPU-side allocation sequence the simulator replays.

Owns what fake kernels cannot show and that depends on the GPU type or on the job's environment:
- cuBLAS workspaces (one per host thread and stream, sized per architecture),
- cuDNN convolution workspaces (a documented model, see `ConvWorkspaceModel`),
and the labels (category, phase, iteration) that travel beside each op so the estimate can say what was live at
the peak. Per-stream program order is kept: events are only inserted, never moved.

Pure and fast: plain lists of tuples, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xmem.gpus import GpuType, cublas_workspace_bytes
from xmem.simulate import ALLOC, EMPTY_CACHE, FREE
from xmem.trace.events import CUBLAS_OPS, MemEvent, Trace

Op = tuple  # (action, block, nbytes, stream), the simulator's input row
Label = tuple[str, str, int]  # (category, phase, iteration)

MIB = 1 << 20

# ATen ops that run a cuDNN convolution on CUDA (fake CUDA reports them as `convolution`/`convolution_backward`).
CONV_OPS = frozenset({
    "convolution", "convolution_backward", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
    "convolution_overrideable", "convolution_backward_overrideable",
})

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
class GpuOps:
    """The sequence for one device of one GPU type: `ops[i]` is labelled by `labels[i]`."""

    device: int
    ops: list[Op]
    labels: list[Label]
    cublas_workspace_bytes: int  # size of one cuBLAS workspace on this GPU type
    cublas_workspaces: int  # how many were added (host threads x streams that ran cuBLAS work)
    conv_workspaces: int  # how many transient cuDNN workspaces were added
    iteration_starts: dict[int, int] = field(default_factory=dict)  # iteration -> index of its first op


def trace_devices(trace: Trace) -> list[int]:
    """The CUDA devices the trace allocated on (device 0 if it allocated nothing)."""
    return sorted({e.device for e in trace.events}) or [0]


def host_thread(event: MemEvent) -> str:
    """The host thread that issued `event`'s op.

    The trace records no thread ids. On CUDA the autograd engine runs backward on its own device thread, and the
    rest of a training step (forward, loss, optimizer) runs on the Python thread that called it.
    """
    return AUTOGRAD_THREAD if event.phase == "backward" else MAIN_THREAD


def orchestrate(trace: Trace, gpu: GpuType, env: Mapping[str, str] | None = None, *, device: int = 0,
                conv_workspace: ConvWorkspaceModel = ConvWorkspaceModel()) -> GpuOps:
    """The op sequence of `device` on `gpu`, with cuBLAS and cuDNN workspaces added, and its labels."""
    workspace_bytes = cublas_workspace_bytes(gpu, env)
    next_block = max((e.block for e in trace.events), default=0) + 1
    has_workspace: set[tuple[str, int]] = set()  # (host thread, stream) that already holds a cuBLAS workspace
    ops: list[Op] = []
    labels: list[Label] = []
    iteration_starts: dict[int, int] = {}
    conv_count = 0

    for e in trace.events:
        if e.device != device or (e.nbytes == 0 and e.action != "empty_cache"):
            continue  # a 0-byte request never reaches the caching allocator's malloc()
        if e.iteration >= 0:
            iteration_starts.setdefault(e.iteration, len(ops))
        if e.action == "empty_cache":
            ops.append((EMPTY_CACHE, 0, 0, e.stream))
            labels.append(("other", e.phase, e.iteration))
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
            labels.append(("workspace", e.phase, e.iteration))
            next_block += 1
        if e.op in CONV_OPS and (size := conv_workspace.size(e.nbytes)) > 0:
            ops.append((ALLOC, next_block, size, e.stream))
            ops.append((FREE, next_block, size, e.stream))
            labels.extend([("workspace", e.phase, e.iteration)] * 2)
            next_block += 1
            conv_count += 1

    return GpuOps(device=device, ops=ops, labels=labels, cublas_workspace_bytes=workspace_bytes,
                  cublas_workspaces=len(has_workspace), conv_workspaces=conv_count,
                  iteration_starts=iteration_starts)


__all__ = [
    "CONV_OPS", "CUBLAS_OPS", "ConvWorkspaceModel", "GpuOps", "Label", "Op", "host_thread", "orchestrate",
    "trace_devices",
]
