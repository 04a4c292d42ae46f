"""Ops whose fake result the recorder can give without FakeTensorMode's per-tensor work, because what the GPU would do
with them is known exactly: the speed of a trace, not its content (a shortcut's trace is the same event for event).

- `.device` of a fake tensor: every optimizer step asks it thousands of times (grouping tensors by device and dtype);
  the answer is the tensor's fake device, as `FakeTensor.__torch_dispatch__` gives it outside a kernel.
- The foreach ops of an optimizer step over tensor lists of one shape and dtype per position. FakeTensorMode runs
  them tensor by tensor through the meta kernels and, since a list result is not cacheable, first builds a cache key
  of every tensor for nothing (upstream `FakeTensorMode._cached_dispatch_impl`: a bypass entry). On CUDA an in-place
  foreach op allocates nothing (upstream `foreach_tensor_*_cuda_`: the kernel writes through its inputs), and an
  out-of-place elementwise one allocates `empty_like` of each input, in list order (`ForeachUnaryOp.cu` and
  `ForeachBinaryOp*.cu`: `at::native::empty_like(t)` per tensor before one launch). Only plainly valid calls are
  taken (floating tensors, each position the same shape, dtype and device in every list, real scalars), so no
  error the real op would raise is skipped; anything else is NOT_TAKEN and goes the normal way.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

DEVICE_QUERY = torch.ops.prim.device.default

# Out-of-place foreach ops whose outputs are elementwise over the first list: one `empty_like` per tensor.
_ELEMENTWISE_FOREACH = frozenset({
    "_foreach_abs", "_foreach_add", "_foreach_addcdiv", "_foreach_addcmul", "_foreach_clamp_max",
    "_foreach_clamp_min", "_foreach_div", "_foreach_exp", "_foreach_lerp", "_foreach_maximum", "_foreach_minimum",
    "_foreach_mul", "_foreach_neg", "_foreach_reciprocal", "_foreach_sign", "_foreach_sqrt", "_foreach_sub",
})
SWITCH_ENV = "XMEM_TRACE_SHORTCUTS"  # "0": every op goes through the fake mode (to check that a trace is unchanged)
NOT_TAKEN = object()  # a shortcut that does not apply: dispatch the normal way


def enabled(env: dict[str, str] | os._Environ = os.environ) -> bool:
    return env.get(SWITCH_ENV, "1") != "0"


def device_of(func: Any, args: tuple) -> Any:
    """The answer to `tensor.device` of a fake tensor outside a kernel, else NOT_TAKEN."""
    if func is DEVICE_QUERY and len(args) == 1 and type(args[0]) is FakeTensor \
            and not args[0].fake_mode.in_kernel_invocation:
        return args[0].fake_device
    return NOT_TAKEN


def foreach(func: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """The result of a plainly valid foreach op over fake tensors (None for an in-place one, the new tensors for an
    out-of-place elementwise one), else NOT_TAKEN. Runs with the recorder's mode off, under the fake mode."""
    if not name.startswith("_foreach_"):
        return NOT_TAKEN
    in_place = name.endswith("_")
    if in_place == bool(func._schema.returns) or (not in_place and name not in _ELEMENTWISE_FOREACH):
        return NOT_TAKEN
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if not args or not _plain_floating_list(args[0], mode):
        return NOT_TAKEN
    first = args[0]
    for value in (*args[1:], *kwargs.values()):
        if not _fits(value, first):
            return NOT_TAKEN
    if in_place:
        return None
    return [torch.empty_like(tensor) for tensor in first]


def _plain_floating_list(value: Any, mode: Any) -> bool:
    """Floating fake tensors of the running fake mode (another mode's are its error to raise), none a constant."""
    return isinstance(value, (list, tuple)) and bool(value) and all(
        type(t) is FakeTensor and t.fake_mode is mode and t.dtype.is_floating_point and t.constant is None
        for t in value)


def _fits(value: Any, first: list) -> bool:
    """An argument that cannot make the op fail or change a result's shape or dtype: a real scalar, a list of them as
    long as the first list, or a tensor list matching the first one position by position."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if not isinstance(value, (list, tuple)) or len(value) != len(first):
        return False
    if all(isinstance(item, (bool, int, float)) for item in value):
        return True
    return all(type(item) is FakeTensor and item.fake_mode is ref.fake_mode and item.shape == ref.shape
               and item.dtype == ref.dtype and item.fake_device == ref.fake_device for item, ref in zip(value, first))
