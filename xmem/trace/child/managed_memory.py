"""CUDA managed ("paged") memory under fake CUDA: bitsandbytes' paged optimizers.

bitsandbytes keeps a paged optimizer's state of a parameter of 1e5 elements or more (`Optimizer8bit.
get_state_buffer`) in memory its native library takes with cudaMallocManaged (`functional.get_paged`: a host tensor
over the managed pointer, marked `is_paged`, zeroed by its own kernel `fill`, moved by `prefetch_tensor`). Under fake
CUDA that buffer is a fake GPU tensor of the same shape and dtype, which the recorder marks as managed
(`FakeCuda.on_managed`): its alloc and free events are on `xmem.trace.events.MANAGED_STREAM`, and the simulator counts
them beside the caching allocator's reserved bytes, never in its segments.

The rule (stated for the estimate): managed bytes are device memory the job needs, counted in full at their requested
size, in the category of what they hold (optimizer state). The driver migrates managed pages to the GPU as kernels
touch them; paged optimizers touch all their state every step, so the state is resident while the job runs at speed.
Under memory pressure the driver pages it out to the host instead of failing, so it never causes an out-of-memory
error itself; a request that leaves no room for it gives a job that thrashes, which the estimate does not offer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from xmem.trace.child.on_import import patch_on_import


def install(fake: Any) -> None:
    """Model bitsandbytes' managed buffers once its functional module is imported (now, or when the program does)."""
    patch_on_import("bitsandbytes.functional", lambda functional: _patch_bitsandbytes(functional, fake))


def _patch_bitsandbytes(functional: Any, fake: Any) -> None:
    functional.get_paged = _managed_buffer(fake)
    functional.fill = _filled_in_place(functional.fill)
    functional.prefetch_tensor = _prefetch_of_fake_is_nothing(functional.prefetch_tensor)


def _managed_buffer(fake: Any) -> Callable[..., torch.Tensor]:
    def get_paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        """bitsandbytes.functional.get_paged: `shape` of `dtype` in managed memory, for the GPU `device`."""
        device = torch.device("cuda", 0) if device is None else torch.device(device)
        out = torch.empty(shape, dtype=dtype, device=device)
        fake.on_managed(out)
        out.is_paged = True
        out.page_deviceid = device.index or 0
        return out
    return get_paged


def _filled_in_place(fill: Callable[..., None]) -> Callable[..., None]:
    def fill_fake_in_place(A: torch.Tensor, value: Any, device: Any = None, prefetch: bool = True) -> None:
        """bitsandbytes.functional.fill: its native kernel on a real buffer; a fake one is filled as torch fills it
        (in place: nothing allocated)."""
        if isinstance(A, FakeTensor):
            A.fill_(value)
        else:
            fill(A, value, device, prefetch)
    return fill_fake_in_place


def _prefetch_of_fake_is_nothing(prefetch: Callable[..., None]) -> Callable[..., None]:
    def prefetch_tensor(A: torch.Tensor, to_cpu: bool = False) -> None:
        """bitsandbytes.functional.prefetch_tensor: migrating managed pages allocates nothing; a fake buffer has
        none to migrate."""
        if not isinstance(A, FakeTensor):
            prefetch(A, to_cpu)
    return prefetch_tensor


__all__ = ["install"]
