"""Meta kernels for the aten ops that upstream gives a CUDA kernel and no meta one, so that the fake mode sizes their
outputs instead of running its fallback, which makes real tensors on the op's device (`run_fallback_kernel`): on
the fake GPU that reached the real CUDA runtime ("Found no NVIDIA driver").

The ops are SyncBatchNorm's (torch/nn/modules/_functions.py, SyncBatchNorm.forward and backward), whose CUDA
kernels are in aten's cuda/Normalization.cu(h): each output's size, dtype and layout here is the one those kernels
allocate. The cross-rank all_gather between them is the fake process group's (xmem.trace.child.distributed).
Registered once per process (`install`); a kernel upstream adds later wins (none is registered over one). Any other
op without a fake kernel whose tensors are on the GPU ends the trace naming the op (`_named_instead_of_run`).
Import only in the tracing child.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch._subclasses.fake_tensor as fake_tensor

from xmem.trace.errors import NotModelled

_LIBRARY: torch.library.Library | None = None  # kept alive: dropping it would unregister the kernels


def _statistics_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The accumulation type on CUDA (at::toAccumulateType(..., is_cuda=true)): half and bfloat16 keep float ones."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def _per_channel(input: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return input.new_empty((input.shape[1],), dtype=dtype)


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_norm_stats_cuda: the local mean and inverse std, one per channel, in the accumulation type."""
    dtype = _statistics_dtype(input)
    return _per_channel(input, dtype), _per_channel(input, dtype)


def batch_norm_gather_stats_with_counts(input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                                        running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                                        momentum: float, eps: float, counts: torch.Tensor) -> tuple:
    """batch_norm_gather_stats_cuda_template: the global mean and inverse std from the gathered (world, C) ones, in
    the gathered stats' dtype (float for half/bfloat16). Upstream's shape checks first: the kernel's loops trust
    them."""
    torch._check(mean.dim() == 2, lambda: f"batch_norm_gather_stats_with_counts: expected mean to be 2-dimensional "
                                          f"(world_size, num_features), but got mean of sizes {list(mean.shape)}")
    torch._check(invstd.shape == mean.shape, lambda: "batch_norm_gather_stats_with_counts: expected invstd to have "
                                                     f"the same shape as mean ({list(mean.shape)})")
    torch._check(counts.numel() >= mean.shape[0], lambda: "batch_norm_gather_stats_with_counts: expected counts to "
                                                          "have at least one element per entry in mean")
    dtype = _statistics_dtype(mean)
    return mean.new_empty((mean.shape[1],), dtype=dtype), mean.new_empty((mean.shape[1],), dtype=dtype)


def batch_norm_gather_stats(input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                            running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                            eps: float, count: int) -> tuple:
    """batch_norm_gather_stats_cuda: the same with one count for every rank."""
    counts = mean.new_empty((mean.shape[0],))
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts)


def batch_norm_elemt(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """batch_norm_elemt_cuda: the normalised input, laid out as the input (empty_like)."""
    return torch.empty_like(input)


def batch_norm_backward_reduce(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor,
                               invstd: torch.Tensor, weight: torch.Tensor | None, input_g: bool, weight_g: bool,
                               bias_g: bool) -> tuple:
    """batch_norm_backward_reduce_cuda: sum_dy and sum_dy_xmu (as mean) when the input needs a gradient, the
    weight's and bias's gradients (as the weight) when they do; an output not asked for is undefined (None)."""
    sums = (torch.empty_like(mean, memory_format=torch.contiguous_format) for _ in range(2)) if input_g else \
        (None, None)
    like = weight if weight is not None else mean
    grad_weight = like.new_empty((input.shape[1],)) if weight_g else None
    grad_bias = like.new_empty((input.shape[1],)) if bias_g else None
    return (*sums, grad_weight, grad_bias)


def batch_norm_backward_elemt(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor,
                              invstd: torch.Tensor, weight: torch.Tensor | None, sum_dy: torch.Tensor,
                              sum_dy_xmu: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """batch_norm_backward_elemt_cuda: the input's gradient, in the input's suggested layout (channels-last kernels
    keep it; the others write a contiguous one of the input's shape)."""
    return torch.empty_like(input, memory_format=torch.channels_last if _channels_last(input) else
                            torch.contiguous_format)


def batch_norm_update_stats(input: torch.Tensor, running_mean: torch.Tensor | None,
                            running_var: torch.Tensor | None, momentum: float) -> tuple:
    """batch_norm_update_stats_cuda: the batch's mean and variance, one per channel, in the accumulation type."""
    dtype = _statistics_dtype(input)
    return _per_channel(input, dtype), _per_channel(input, dtype)


def _channels_last(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last) and \
        not tensor.is_contiguous()


KERNELS: dict[str, Callable] = {
    "batch_norm_stats": batch_norm_stats,
    "batch_norm_gather_stats": batch_norm_gather_stats,
    "batch_norm_gather_stats_with_counts": batch_norm_gather_stats_with_counts,
    "batch_norm_elemt": batch_norm_elemt,
    "batch_norm_backward_reduce": batch_norm_backward_reduce,
    "batch_norm_backward_elemt": batch_norm_backward_elemt,
    "batch_norm_update_stats": batch_norm_update_stats,
}


def install() -> None:
    """Register each kernel for the Meta key of its aten op, where upstream has none."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library("aten", "IMPL")
    for name, kernel in KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            _LIBRARY.impl(name, kernel, "Meta")
    fake_tensor.run_fallback_kernel = _named_instead_of_run(fake_tensor.run_fallback_kernel)


class NoFakeKernel(NotModelled, RuntimeError):
    """A RuntimeError still, as the runtime's refusal it replaces: code that catches one to take another path goes
    on as before."""


def _named_instead_of_run(run_fallback_kernel: Callable) -> Callable:
    """The fake mode runs an op that has no fake kernel for real, on zero-filled inputs made on each fake tensor's
    device (upstream `run_fallback_kernel`). On the CPU that stays as upstream; on the fake GPU it can only reach the
    real runtime, whose "no NVIDIA driver" named neither the op nor the gap: the trace ends naming the op."""
    def run_unless_on_the_gpu(fake_mode: fake_tensor.FakeTensorMode, func: torch._ops.OpOverload, flat_args: list,
                              *args: object, **kwargs: object) -> object:
        if any(isinstance(arg, fake_tensor.FakeTensor) and arg.fake_device.type != "cpu" for arg in flat_args):
            raise NoFakeKernel(f"an op with no fake kernel ({func}), which the fake mode would run on a real GPU")
        return run_fallback_kernel(fake_mode, func, flat_args, *args, **kwargs)
    return run_unless_on_the_gpu
