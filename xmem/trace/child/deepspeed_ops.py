"""DeepSpeed's compiled ops under the fake GPU.

DeepSpeed installed without prebuilt ops (DS_BUILD_OPS=0, pip's default) compiles an op the first time the program
asks its builder for it (`OpBuilder.load` -> `jit_load`: ninja and nvcc, on the job's node). A traced program must
not compile: `OpBuilder.load` answers instead, for the ops whose kernels only write into tensors the program
allocated before the launch (as `xmem.trace.child.triton_launch` does for Triton): FusedAdam's `multi_tensor_adam`
(`deepspeed/ops/csrc/adam/multi_tensor_adam.cu`: the multi-tensor apply passes its addresses in the kernel's
arguments; the moments come from FusedAdam.step's own `zeros_like`). Their calls are checked (every tensor on the
GPU) and skipped; so are DeepSpeedCPUAdam's (`cpu_adam`, ZeRO-Offload's optimizer), whose host kernel writes in
place into host tensors (checked on the host). Any other op (async_io, the transformer kernels, ...) is not
modelled: named.

Where ZeRO reads GPU values back to decide (overflow and gradient-norm checks, ZeRO-3's rank-0 list broadcasts), the
checks still run and answer what a real rank 0 with finite gradients gets; accelerate's DummyOptim (the HF
Trainer's optimizer when DeepSpeed's config names one) follows the parameters the engine moves to the GPU.

Installed from `xmem.trace.child.fakecuda.install` once each module named here is imported.
"""

from __future__ import annotations

import os
import types
import weakref
from typing import Any, Callable

import torch

from xmem.trace.errors import NotModelled, as_on_a_gpu


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _in_place_kernel(op: str, function: str) -> Callable[..., None]:
    def launch(*args: Any) -> None:
        for tensor in _tensors(args):
            if tensor.device.type != "cuda":  # the kernel would read a host address
                raise as_on_a_gpu(RuntimeError(f"{op}.{function}: expected a CUDA tensor, got one on {tensor.device}"))
    launch.__name__ = function
    return launch


# op name (OpBuilder.NAME) -> the functions of its module whose kernels write in place and allocate nothing
IN_PLACE_OPS = {"fused_adam": ("multi_tensor_adam",)}

# The same for host ops: DeepSpeedCPUAdam (ZeRO's offload_optimizer to the CPU, ZeRO-Offload) steps the fp32
# partitions ZeRO keeps on the host (`csrc/adam/cpu_adam.cpp`: adam_update writes the parameter and its two moments
# in place, which DeepSpeedCPUAdam.step made before with zeros_like on the CPU; create_adam and destroy_adam keep the
# op's host-side settings per optimizer id): every tensor on the host, nothing on the GPU.
HOST_OPS = {"cpu_adam": ("create_adam", "destroy_adam", "adam_update", "adam_rollback")}


def _host_kernel(op: str, function: str) -> Callable[..., None]:
    def launch(*args: Any) -> None:
        for tensor in _tensors(args):
            if tensor.device.type != "cpu":  # the host kernel would read a GPU address
                raise as_on_a_gpu(RuntimeError(f"{op}.{function}: expected a CPU tensor, got one on {tensor.device}"))
    launch.__name__ = function
    return launch


def install(builder_module: Any) -> None:
    """Make DeepSpeed's op builders hand out checked-and-skipped launches instead of compiling."""
    op_builder = builder_module.OpBuilder

    def load(self: Any, verbose: bool = False) -> Any:
        if self.name in HOST_OPS:
            return types.SimpleNamespace(**{name: _host_kernel(self.name, name) for name in HOST_OPS[self.name]})
        functions = IN_PLACE_OPS.get(self.name)
        if functions is None:
            raise NotModelled(f"DeepSpeed's compiled op {self.name} ({type(self).__name__})")
        return types.SimpleNamespace(**{name: _in_place_kernel(self.name, name) for name in functions})

    op_builder.load = load


# What finite gradients answer, per module: ZeRO's overflow checks all-reduce a byte of "a gradient is not finite"
# and read it with `.item()`, and `is_invalid_grad_norm` asks `(~isfinite(norm) | (norm < 0)).any()`; their
# stand-ins (1, True) would skip every step, so that no optimizer state is ever made. A real run's gradients are
# finite; where fp16's dynamic loss scale skips a first step on a GPU, that step allocates less than the traced one.
FINITE_GRADIENTS = {
    "deepspeed.runtime.zero.stage_1_and_2": ("DeepSpeedZeroOptimizer.has_overflow", "is_invalid_grad_norm"),
    "deepspeed.runtime.zero.stage3": ("DeepSpeedZeroOptimizer_Stage3.has_overflow", "is_invalid_grad_norm")}


def finite_gradients(module: Any) -> None:
    """The checks of FINITE_GRADIENTS still run (their reductions and flags are allocated as on the GPU) and answer
    False."""
    for path in FINITE_GRADIENTS[module.__name__]:
        *owner_path, name = path.split(".")
        owner = module
        for part in owner_path:
            owner = getattr(owner, part)
        check = getattr(owner, name)

        def answers_false(*args: Any, _check: Callable[..., Any] = check, **kwargs: Any) -> bool:
            _check(*args, **kwargs)
            return False

        setattr(owner, name, answers_false)


def rank_0_lists(zero_utils: Any) -> None:
    """ZeRO-3 checks that every rank built the same parameter order (`assert_ints_same_as_other_ranks`): rank 0
    broadcasts a GPU tensor of its list (`get_lst_from_rank0`; its length first, `assert_lst_len_same_as_other_ranks`)
    and reads it back with `.item()`s, whose stand-ins (1) disagree with the list. The trace is rank 0, which agrees
    with itself: the int64 tensor is made, broadcast and copied to the host as upstream does, and the answer is rank
    0's own list, read from no stand-in."""

    def get_lst_from_rank0(lst: list[int]) -> list[int]:
        device = torch.device(zero_utils.get_accelerator().device_name(os.environ["LOCAL_RANK"]))
        values = torch.tensor(lst, dtype=int, device=device, requires_grad=False)
        zero_utils.dist.broadcast(values, src=0, async_op=False)
        values.cpu()
        return list(lst)

    def assert_lst_len_same_as_other_ranks(lst: list[int]) -> None:
        get_lst_from_rank0([len(lst)])  # upstream's is a 0-d int64 tensor: the same 8 bytes, one 512-byte block

    zero_utils.get_lst_from_rank0 = get_lst_from_rank0
    zero_utils.assert_lst_len_same_as_other_ranks = assert_lst_len_same_as_other_ranks


# accelerate's DummyOptim (the Trainer's optimizer when DeepSpeed's config names one) holds the parameters DeepSpeed
# will step; it is made before the engine moves the model to the GPU, which under the fake GPU replaces each
# Parameter (xmem.trace.child.fakecuda's _apply): like torch's optimizers, it is pointed at the replacements.
_DUMMY_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()


def track_dummy_optimizers(accelerate_deepspeed: Any) -> None:
    dummy = accelerate_deepspeed.DummyOptim
    init = dummy.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _DUMMY_OPTIMIZERS.add(self)

    dummy.__init__ = tracked


def rebind_dummy_optimizers(replaced: dict[int, torch.Tensor]) -> None:
    """Point live DummyOptims at replaced parameters (keyed by the old parameter's id), in place: accelerate hands
    the same list (or its groups' dicts) to deepspeed.initialize as model_parameters. An iterator is left as it is
    (reading it would consume the program's)."""
    for dummy in list(_DUMMY_OPTIMIZERS):
        if not isinstance(dummy.params, list):
            continue
        for index, item in enumerate(dummy.params):
            if isinstance(item, dict) and isinstance(item.get("params"), list):
                item["params"][:] = [replaced.get(id(p), p) for p in item["params"]]
            elif isinstance(item, torch.Tensor):
                dummy.params[index] = replaced.get(id(item), item)
