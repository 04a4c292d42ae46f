"""Facts of a traced run taken from its own objects, not from the recorder's alloc stream: the parameters the
optimizers step (their param_groups), their gradients after the first backward, the optimizers' state after the
first step (observed, and by the optimizer kind's rule), the model state on the GPU and the first batch.

Owns `FactCollector` (the tracing child's global module-forward and optimizer-step hooks, active until each
optimizer's first step) and the pure functions it uses, which read tensor metadata only (shapes, dtypes, storages,
requires_grad): no op is dispatched, nothing is allocated. Each `Fact` carries the number of trace events
recorded when it was taken, so `xmem.audit` can compare it with the trace's bytes per category at that point.
Imports torch: child side only (and tests).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._pytree import tree_leaves

from xmem.trace.events import (FACT_BATCH, FACT_FSDP_GRADIENTS, FACT_FSDP_PARAMETERS, FACT_FULLEST_RANK_STATE,
                               FACT_GRADIENTS, FACT_HOST_STAND_IN, FACT_MODEL_STATE, FACT_STATE,
                               FACT_OFFLOADED, FACT_STATE_BY_RULE, FACT_STEPPED, FACT_ZERO_STATE, Category, Fact)
from xmem.trace.child.on_import import patch_on_import

# Trace categories a batch may carry: anything but model and optimizer state (a batch made on the GPU is born
# "temporary", one copied from the host "input").
BATCH_CATEGORIES = (Category.INPUT, Category.ACTIVATION, Category.TEMPORARY, Category.OTHER)

# Storages per device: {device: {storage id: nbytes}}.
Storages = dict[int, dict[int, int]]


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `tensor`'s memory: itself, or a wrapper subclass's inner tensors (DTensor's local
    shard; upstream protocol: __tensor_flatten__)."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter or not hasattr(tensor,
                                                                                       "__tensor_flatten__"):
        return [tensor]
    return [part for inner in inner_tensors(tensor) for part in plain_tensors(inner)]


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a traceable wrapper subclass holds, one level down (upstream protocol: __tensor_flatten__). A
    flatten that reads a GPU value cannot answer on fake tensors (torchao's WeightWithDynamicFloat8CastTensor lists
    its precomputed float8 scale `if` that scale is truthy: a sync on a GPU, where nobody flattens it in eager);
    the wrapper's tensor attributes are then what it holds."""
    try:
        names, _ = tensor.__tensor_flatten__()
    except DataDependentOutputException:
        return [value for value in vars(tensor).values() if isinstance(value, torch.Tensor)]
    return [inner for inner in (getattr(tensor, name) for name in names) if isinstance(inner, torch.Tensor)]


def storages(tensors: Iterable[Any], device_type: str = "cuda") -> Storages:
    """The distinct non-empty storages behind `tensors` (others ignored) on devices of `device_type`."""
    found: Storages = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for part in plain_tensors(tensor):
            if part.device.type != device_type or part.is_sparse:
                continue
            storage = part.untyped_storage()
            if storage.nbytes() > 0:
                found.setdefault(part.device.index or 0, {})[storage._cdata] = storage.nbytes()
    return found


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [leaf for per_param in optimizer.state.values() for leaf in tree_leaves(per_param)
            if isinstance(leaf, torch.Tensor)]


def module_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module tree's parameters and buffers."""
    return [*module.parameters(), *module.buffers()]


def state_copies(optimizer: torch.optim.Optimizer, group: dict) -> int | None:
    """How many parameter-sized state tensors `optimizer` keeps per stepped parameter of `group` (upstream: each
    torch.optim class's `_init_group`; step counters and other scalars come on top); None for a kind whose rule is
    not known here (subclasses included: they may keep more)."""
    kind = type(optimizer)
    if (kind.__module__, kind.__name__) == ("deepspeed.ops.adam.fused_adam", "FusedAdam"):
        return 2  # exp_avg, exp_avg_sq: zeros_like each parameter at its first step (FusedAdam.step)
    if kind.__module__.split(".")[:2] != ["torch", "optim"]:
        return None
    name = kind.__name__
    if name in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if name == "SGD":
        return 1 if group.get("momentum", 0) != 0 else 0  # momentum_buffer
    if name == "RMSprop":  # square_avg (+ momentum_buffer) (+ grad_avg)
        return 1 + (group.get("momentum", 0) > 0) + bool(group.get("centered"))
    if name in ("Adamax", "NAdam", "RAdam", "Adadelta", "Rprop"):
        return 2  # (exp_avg, exp_inf) / (exp_avg, exp_avg_sq) / (square_avg, acc_delta) / (prev, step_size)
    if name in ("Adagrad", "ASGD"):
        return 1  # sum / ax
    return None


def stepped_bytes(params: Iterable[torch.Tensor], device_type: str = "cuda") -> dict[int, int]:
    """Per device, the bytes of the parameters that have a gradient (the ones an optimizer step makes state
    for), each counted at its own size (a view of a flat buffer by its elements, not the whole storage)."""
    found: dict[int, int] = {}
    for param in {id(p): p for p in params}.values():  # a parameter listed twice has one state (upstream's keyed)
        if param.grad is None:
            continue
        for part in plain_tensors(param):
            if part.device.type == device_type:
                device = part.device.index or 0
                found[device] = found.get(device, 0) + part.numel() * part.element_size()
    return found


def state_by_rule(optimizer: torch.optim.Optimizer, device_type: str = "cuda") -> tuple[dict[int, int], str]:
    """Per device, the state bytes `optimizer` must hold after a step by its kind's rule, and the rule in words
    ("" when its kind has no known rule). Call it before the step: only parameters with a gradient get state."""
    expected: dict[int, int] = {}
    rules: list[str] = []
    for group in optimizer.param_groups:
        copies = state_copies(optimizer, group)
        if copies is None:
            return {}, ""
        for device, nbytes in stepped_bytes(group["params"], device_type).items():
            expected[device] = expected.get(device, 0) + copies * nbytes
        rules.append(f"{copies} x")
    unique = sorted(set(rules))
    return expected, f"{type(optimizer).__name__} rule: {' or '.join(unique)} stepped parameter bytes"


def fsdp1_handle(module: torch.nn.Module) -> Any:
    """The FlatParamHandle of an FSDP1 unit (`FullyShardedDataParallel._handle`), None for any other module."""
    return getattr(module, "_handle", None) if type(module).__name__ == "FullyShardedDataParallel" else None


def fsdp1_flat_parameter(module: torch.nn.Module) -> torch.Tensor | None:
    """The FlatParameter of an FSDP1 unit, None for any other module. With use_orig_params it is registered on no
    module, and an optimizer steps only views of it (none at all on a rank whose shard holds only frozen weights),
    yet it and its sharded gradient hold the unit's memory."""
    flat = getattr(fsdp1_handle(module), "flat_param", None)
    return flat if isinstance(flat, torch.Tensor) else None


def fsdp2_sharded_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters an FSDP2 unit (`fully_shard`) manages, its nested units' included; [] for any other module.
    Outside its forward and backward they are the sharded DTensors (FSDPParam.to_sharded puts them back on their
    modules), and its own forward runs its children's, so a frozen shard, which no optimizer names, is known as a
    parameter only through its unit."""
    is_unit = any(kind.__name__ == "FSDPModule" for kind in type(module).__mro__)
    return list(module.parameters()) if is_unit else []


def dtensor_local_numel(tensor: torch.Tensor) -> int | None:
    """Elements of this rank's local shard of a DTensor by upstream's placement rule (torch/distributed/tensor/
    _utils.py compute_local_shape_and_global_offset: each Shard(d) on a mesh dimension keeps torch.chunk's piece of
    dimension d for this rank's coordinate, Replicate and Partial the whole), from its global shape, mesh and
    placements alone; None for any other tensor. Padding (fully_shard keeps its shards in buffers of ceil(rows / N)
    rows) is not counted: the storages may hold more, never less."""
    placements, mesh = getattr(tensor, "placements", None), getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None or not hasattr(tensor, "_local_tensor"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return math.prod(shape)


def fsdp1_shard_numel(handle: Any) -> int:
    """Elements of each rank's shard of the unit's flat parameter (FlatParamHandle._get_shard: torch.chunk over
    the shard group, the last chunks padded to the first's size); the whole of it when not sharded."""
    numel = handle.flat_param._unpadded_unsharded_size.numel()
    return -(-numel // handle.world_size) if handle.uses_sharded_strategy else numel


def fsdp1_gradient_itemsize(handle: Any) -> int:
    """The sharded gradient's element size: cast back to the parameters' dtype after the reduce-scatter
    (_runtime_utils._cast_grad_to_param_dtype) unless the unit keeps low-precision gradients."""
    keep_low = handle._keep_low_precision_grads and handle._reduce_dtype is not None
    return handle._reduce_dtype.itemsize if keep_low else handle.flat_param.dtype.itemsize


def fsdp1_trainable_per_rank(handle: Any) -> list[int]:
    """Per rank of the shard group, the trainable elements of the original parameters inside its shard: what an
    optimizer given the original parameters (use_orig_params) steps there. A unit that mixes frozen and trainable
    parameters gives its ranks unequal shares, and the traced rank (0) may hold fewer than another."""
    flat = handle.flat_param
    params = iter(flat._params) if flat._params is not None else None  # use_orig_params=False: uniform
    trainable: list[tuple[int, int]] = []  # [start, end) of trainable elements in the flat parameter
    start = 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not padding and (next(params).requires_grad if params is not None else flat.requires_grad):
            trainable.append((start, start + numel))
        start += numel
    shard = fsdp1_shard_numel(handle)
    ranks = handle.world_size if handle.uses_sharded_strategy else 1
    return [sum(max(0, min(end, (r + 1) * shard) - max(begin, r * shard)) for begin, end in trainable)
            for r in range(ranks)]


def offloaded_shards(roots: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The host tensors in which FSDP's CPU offload keeps the units' shards inside the module trees `roots`, which
    an optimizer steps on the host: FSDP1's FlatParameter of each handle with `_offload_params` and, with
    use_orig_params, the original parameters viewing it; FSDP2's sharded parameters whose FSDPParam has
    `offload_to_cpu`."""
    found: list[torch.Tensor] = []
    for handle in fsdp1_units(roots):
        if handle._offload_params:
            found += [handle.flat_param, *(handle.flat_param._params or ())]
    for root in roots:
        for module in root.modules():
            if fsdp2_sharded_parameters(module):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    found += [p.sharded_param for p in group.fsdp_params if p.offload_to_cpu]
    return found


def fsdp1_units(roots: Iterable[torch.nn.Module]) -> list[Any]:
    """The FlatParamHandles of the FSDP1 units inside the module trees `roots`, each once."""
    handles = {id(h): h for root in roots for m in root.modules() if (h := fsdp1_handle(m)) is not None}
    return list(handles.values())


# DeepSpeed's ZeRO optimizers (module -> class): each wraps a torch optimizer that steps its rank's fp32 partitions
ZERO_OPTIMIZERS = {"deepspeed.runtime.zero.stage_1_and_2": "DeepSpeedZeroOptimizer",
                   "deepspeed.runtime.zero.stage3": "DeepSpeedZeroOptimizer_Stage3"}


def split_evenly(numel: int, parts: int) -> list[int]:
    """Sizes of `parts` consecutive pieces of `numel` elements, the first `numel % parts` one larger (DeepSpeed's
    stage_1_and_2 get_data_parallel_partitions)."""
    return [numel // parts + (rank < numel % parts) for rank in range(parts)]


def zero12_partitions(numels: list[int], itemsize: int, aligned_params: bool, dp: int) -> list[int]:
    """Per data-parallel rank, the elements of its partition of one ZeRO-1/2 parameter group
    (stage_1_and_2.DeepSpeedZeroOptimizer.__init__): the group's trainable parameters laid end to end in one flat
    buffer, each but the last padded to 16 bytes where the optimizer aligns parameters (parameter_alignment), the
    whole padded to a multiple of 2 x dp elements (nccl_start_alignment_factor; flatten_dense_tensors_aligned), cut
    by get_data_parallel_partitions."""
    step = 16 // math.gcd(16, itemsize) if aligned_params else 1
    flat = sum(n + (-n % step if i < len(numels) - 1 else 0) for i, n in enumerate(numels))
    flat += -flat % (2 * dp)
    return split_evenly(flat, dp)


def zero3_partitions(numels: list[int], dp: int) -> list[int]:
    """Per data-parallel rank, the elements of its partitions of ZeRO-3's parameters (partition_parameters
    _partition_param): each parameter padded to a multiple of dp (_padding_size) and cut in dp equal parts, its
    ds_tensor; the optimizer's fp32 partitions are those, flattened per sub-group."""
    return [sum(-(-n // dp) for n in numels)] * dp


def zero_partitions(zero: Any) -> list[int]:
    """Per rank of its data-parallel group(s), the elements of the partitions a ZeRO optimizer's wrapped optimizer
    has stepped there, from the trainable parameters' sizes. ZeRO-3 steps one sub-group per call of the wrapped
    optimizer (stage3 _optimizer_step): only the sub-groups whose fp32 partition has state so far count."""
    import torch.distributed as dist
    if any(kind.__name__ == ZERO_OPTIMIZERS["deepspeed.runtime.zero.stage3"] for kind in type(zero).__mro__):
        stepped = {id(t) for t in zero.optimizer.state}
        per_group = [zero3_partitions([p.ds_numel for p in group], dist.get_world_size(group=process_group))
                     for group, process_group, fp32 in zip(zero.fp16_groups, zero.sub_group_process_groups,
                                                           zero.fp32_partitioned_groups_flat) if id(fp32) in stepped]
    else:
        per_group = [zero12_partitions([p.numel() for p in params], params[0].element_size(),
                                       bool(getattr(zero, "parameter_alignment", False)),
                                       dist.get_world_size(group=zero.real_dp_process_group[i]))
                     for i, params in enumerate(zero.bit16_groups) if params]
    ranks = max((len(parts) for parts in per_group), default=0)
    return [sum(parts[rank] for parts in per_group if rank < len(parts)) for rank in range(ranks)]


def facts_of(what: str, categories: tuple[str, ...], found: Storages, at_event: int, source: str) -> list[Fact]:
    """One Fact per device of `found`."""
    return [Fact(what, categories, device, len(ids), sum(ids.values()), at_event, source)
            for device, ids in sorted(found.items())]


def merged(*parts: Storages) -> Storages:
    out: Storages = {}
    for part in parts:
        for device, ids in part.items():
            out.setdefault(device, {}).update(ids)
    return out


def _never_raising(hook: Callable) -> Callable:
    """A fault in taking facts must not end the user's program: the collector gives up (its result is None)."""
    def guarded(self: "FactCollector", *args: Any) -> None:
        if self.broken:
            return
        try:
            hook(self, *args)
        except Exception as error:  # noqa: BLE001 - the audit is lost, not the trace
            self.broken = f"{type(error).__name__}: {error}"
    return guarded


class FactCollector:
    """Takes the run's facts in the tracing child, through its own global hooks (`install`).

    - At the first outermost module call: the CUDA tensors passed to it (the batch).
    - Whenever the tracer makes up a value of a tensor the GPU would not hold (`on_stand_in`, called by the tracer):
      the first such value.
    - At each optimizer's first step, before it: the parameters stepped by the optimizers seen so far and their
      gradients, and the first time also the model state (the parameters and buffers of every module tree called
      so far, on the GPU); after it: their state, as the optimizer objects hold it and by each kind's rule.
    Facts are cumulative over the optimizers seen so far, so that one optimizer's bytes cannot hide another's.
    `event_count()` must say how many trace events have been recorded. `device_type`: where the tensors that
    count live ("cuda" in a trace; "cpu" lets a test take the facts of a real CPU run).
    """

    def __init__(self, event_count: Callable[[], int], device_type: str = "cuda") -> None:
        self.event_count = event_count
        self.device_type = device_type
        self.facts: list[Fact] = []
        self.broken = ""  # why taking facts failed, if it did
        self._optimizers: list[weakref.ref] = []  # in the order of their first step
        self._rules: dict[int, tuple[dict[int, int], str]] = {}  # id(optimizer) -> state_by_rule before its step
        self._roots: weakref.WeakSet = weakref.WeakSet()
        self._calls = threading.local()  # per thread: module calls under way (DataParallel calls in threads)
        self._batch_taken = False
        self._step_depth = 0
        self._first_step: torch.optim.Optimizer | None = None
        self._module_hooks: list = []
        self._zero: weakref.WeakSet = weakref.WeakSet()  # DeepSpeed ZeRO optimizers made so far

    def install(self) -> None:
        """Hook module calls (removed at the first step) and optimizer steps. Install before anything whose
        post-step hook may end the trace (TrainingState's stop), so that the first step's state is seen. ZeRO's
        optimizers are no torch optimizers: each is noted when made, to be found by the optimizer it wraps."""
        for module_name, class_name in ZERO_OPTIMIZERS.items():
            patch_on_import(module_name, lambda module, name=class_name: self._note_made(getattr(module, name)))
        from torch.nn.modules import module
        from torch.optim import optimizer
        self._module_hooks = [module.register_module_forward_pre_hook(self._before_call),
                              module.register_module_forward_hook(self._after_call, with_kwargs=True,
                                                                  always_call=True)]
        optimizer.register_optimizer_step_pre_hook(self.on_step_begin)
        optimizer.register_optimizer_step_post_hook(self.on_step_end)

    # ---- module calls, until the first step ---------------------------------------------------------------------
    def result(self) -> list[Fact] | None:
        """The facts for `Trace.facts`; None if taking them failed (no audit then)."""
        return None if self.broken else list(self.facts)

    @_never_raising
    def on_stand_in(self, tensor: torch.Tensor, what: str) -> None:
        """The tracer made up `what` (e.g. "tensor.item()") for `tensor`, which has no data under fake CUDA. Only
        a tensor outside the GPU matters here (the stand-ins tell of none made from GPU data: a metric's `.cpu()`
        copy stands for GPU data): the GPU would not hold it, so the program computed with a value a real run
        computes for real, and may have built another model or batch than the one traced."""
        if tensor.device.type == self.device_type or any(f.what == FACT_HOST_STAND_IN for f in self.facts):
            return
        self.facts.append(Fact(FACT_HOST_STAND_IN, (), -1, 1, 0, self.event_count(),
                               f"{what} of a {tensor.device.type} tensor of shape {tuple(tensor.shape)}"))

    @_never_raising
    def _before_call(self, module: torch.nn.Module, args: Any) -> None:
        depth = getattr(self._calls, "depth", 0)
        if depth == 0:
            self._roots.add(module)
            self._calls.began = self.event_count()
        self._calls.depth = depth + 1

    @_never_raising
    def _after_call(self, module: torch.nn.Module, args: Any, *kwargs_and_output: Any) -> None:
        # (kwargs, output) after a forward; (output,) only when the forward raised (torch's always_call path)
        kwargs = kwargs_and_output[0] if len(kwargs_and_output) == 2 else {}
        self._calls.depth = depth = getattr(self._calls, "depth", 1) - 1
        if depth == 0 and not self._batch_taken:
            self._batch_taken = True  # the first call only, even if it had no CUDA argument
            # the call's inputs were alive when it began: the fact holds at that point
            found = storages(tree_leaves((args, kwargs)), self.device_type)
            self.facts += facts_of(FACT_BATCH, BATCH_CATEGORIES, found, getattr(self._calls, "began", 0),
                                   "the first model call's arguments")

    def _note_made(self, kind: type) -> None:
        made = kind.__init__

        def init_and_note(zero: Any, *args: Any, **kwargs: Any) -> None:
            made(zero, *args, **kwargs)
            self._zero.add(zero)

        kind.__init__ = init_and_note

    def _stop_watching_modules(self) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []

    # ---- optimizer steps ----------------------------------------------------------------------------------------
    @_never_raising
    def on_step_begin(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._step_depth += 1
        if self._step_depth > 1 or any(ref() is optimizer for ref in self._optimizers):
            return  # a step nested in another's (part of it), or not the first
        at = self.event_count()
        self._first_step = optimizer
        self._optimizers.append(weakref.ref(optimizer))
        self._rules[id(optimizer)] = state_by_rule(optimizer, self.device_type)
        if self._module_hooks:
            self._stop_watching_modules()
            model = merged(*(storages(module_state(m), self.device_type) for m in list(self._roots)))
            self.facts += facts_of(FACT_MODEL_STATE, (Category.PARAMETER, Category.BUFFER), model, at,
                                   "parameters and buffers of the modules called before the first step")
            self.facts += self._fsdp1_facts(at)
            self.facts += self._dtensor_facts(at)
        optimizers = self._seen()
        kinds = ", ".join(type(o).__name__ for o in optimizers)
        params = [p for o in optimizers for p in optimizer_params(o)]
        self.facts += facts_of(FACT_STEPPED, (Category.PARAMETER,), storages(params, self.device_type), at,
                               f"param_groups of {kinds}")
        self.facts += self._offloaded(params, kinds, at)
        grads = storages((p.grad for p in params), self.device_type)
        self.facts += facts_of(FACT_GRADIENTS, (Category.GRADIENT,), grads, at, f".grad of the parameters of {kinds}")

    @_never_raising
    def on_step_end(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._step_depth -= 1
        if self._step_depth > 0 or optimizer is not self._first_step:
            return
        self._first_step = None
        at = self.event_count()
        optimizers = self._seen()
        kinds = ", ".join(type(o).__name__ for o in optimizers)
        held = storages((t for o in optimizers for t in optimizer_state_tensors(o)), self.device_type)
        self.facts += facts_of(FACT_STATE, (Category.OPTIMIZER_STATE,), held, at, f"the state of {kinds}")
        rules = [self._rules[id(o)] for o in optimizers if self._rules.get(id(o), ({}, ""))[1]]
        by_device: dict[int, int] = {}
        for expected, _ in rules:
            for device, nbytes in expected.items():
                by_device[device] = by_device.get(device, 0) + nbytes
        source = "; ".join(dict.fromkeys(rule for _, rule in rules))
        self.facts += [Fact(FACT_STATE_BY_RULE, (Category.OPTIMIZER_STATE,), device, 0, nbytes, at, source)
                       for device, nbytes in sorted(by_device.items()) if nbytes > 0]
        self.facts += self._fullest_rank_state(optimizers, by_device, at)
        self.facts += self._zero_state(optimizers, at)

    def _offloaded(self, params: list[torch.Tensor], kinds: str, at: int) -> list[Fact]:
        """FACT_OFFLOADED when the optimizers step host tensors that a wrapper's CPU offload keeps there: FSDP's
        host shards (offloaded_shards) or the fp32 partitions of a ZeRO optimizer offloading its optimizer
        (stage_1_and_2's `cpu_offload`, stage3's `offload_optimizer`): by upstream's rules none of them is on the
        GPU at the step."""
        wrappers = {id(t): "FSDP's CPU offload" for t in offloaded_shards(list(self._roots))}
        for zero in list(self._zero):
            if getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False):
                wrappers.update({id(t): f"{type(zero).__name__}'s offload_optimizer"
                                 for t in optimizer_params(zero.optimizer)})
        host = [wrappers[id(p)] for p in params if id(p) in wrappers and p.device.type != self.device_type]
        if not host:
            return []
        return [Fact(FACT_OFFLOADED, (Category.PARAMETER,), 0, 0, 0, at,
                     f"{len(host)} parameter(s) of {kinds}: {', '.join(dict.fromkeys(host))}")]

    def _fsdp1_facts(self, at: int) -> list[Fact]:
        """What each FSDP1 unit keeps on this rank by upstream's rules, from its FlatParamHandle: the sharded flat
        parameter, and, when any of its parameters is trainable, a sharded gradient of the same elements (the
        unit's whole flat parameter requires grad; frozen parts are reduced and kept like the rest)."""
        params: dict[int, list[int]] = {}
        grads: dict[int, list[int]] = {}
        facts: list[Fact] = []
        for handle in fsdp1_units(self._roots):
            flat = handle.flat_param
            if flat.device.type != self.device_type:
                continue
            shard, device = fsdp1_shard_numel(handle), flat.device.index or 0
            for found, itemsize, counted in ((params, flat.dtype.itemsize, True),
                                             (grads, fsdp1_gradient_itemsize(handle), flat.requires_grad)):
                if counted:
                    total = found.setdefault(device, [0, 0])
                    total[0], total[1] = total[0] + 1, total[1] + shard * itemsize
        rule = "FlatParamHandle: one shard of ceil(flat numel / shard group) elements per unit"
        for what, category, found in ((FACT_FSDP_PARAMETERS, Category.PARAMETER, params),
                                      (FACT_FSDP_GRADIENTS, Category.GRADIENT, grads)):
            facts += [Fact(what, (category,), device, count, nbytes, at, rule)
                      for device, (count, nbytes) in sorted(found.items())]
        return facts

    def _dtensor_facts(self, at: int) -> list[Fact]:
        """What the DTensor parameters of the modules called so far (tensor parallelism's shards, fully_shard's)
        hold on this rank by their placements (dtensor_local_numel), not by the local tensors the fake run made: a
        trace whose meshes or shards went wrong holds less than this."""
        from xmem.trace.events import FACT_DTENSOR_PARAMETERS
        found: dict[int, list[int]] = {}  # device -> [parameters, bytes]
        seen: set[int] = set()
        for root in list(self._roots):
            for param in root.parameters():
                local = getattr(param, "_local_tensor", None)
                if id(param) in seen or local is None or local.device.type != self.device_type:
                    continue
                seen.add(id(param))
                numel = dtensor_local_numel(param)
                if numel is not None:
                    total = found.setdefault(local.device.index or 0, [0, 0])
                    total[0], total[1] = total[0] + 1, total[1] + numel * param.element_size()
        return [Fact(FACT_DTENSOR_PARAMETERS, (Category.PARAMETER,), device, 0, nbytes, at,
                     f"compute_local_shape_and_global_offset of {count} DTensor parameter(s)")
                for device, (count, nbytes) in sorted(found.items()) if nbytes > 0]

    def _fullest_rank_state(self, optimizers: list[torch.optim.Optimizer], traced: dict[int, int],
                            at: int) -> list[Fact]:
        """The optimizer state the fullest rank needs, where FSDP1 units with use_orig_params give another rank
        more trainable elements than the traced one (frozen and trainable parameters in one unit): the traced
        rank's state by rule plus the other rank's surplus, at the most parameter-sized copies any group keeps."""
        copies = max((c for o in optimizers for g in o.param_groups if (c := state_copies(o, g))), default=0)
        surplus: dict[int, dict[int, int]] = {}  # device -> other rank -> bytes more than the traced rank's
        for handle in fsdp1_units(self._roots):
            flat = handle.flat_param
            if not handle._use_orig_params or flat.device.type != self.device_type:
                continue
            per_rank = fsdp1_trainable_per_rank(handle)
            mine = per_rank[handle.rank] if handle.uses_sharded_strategy else per_rank[0]
            ranks = surplus.setdefault(flat.device.index or 0, {})
            for rank, trainable in enumerate(per_rank):
                ranks[rank] = ranks.get(rank, 0) + (trainable - mine) * copies * flat.dtype.itemsize
        facts = []
        for device, ranks in sorted(surplus.items()):
            rank, extra = max(ranks.items(), key=lambda item: item[1])
            if extra > 0:
                facts.append(Fact(FACT_FULLEST_RANK_STATE, (Category.OPTIMIZER_STATE,), device, 0,
                                  traced.get(device, 0) + extra, at,
                                  f"rank {rank}'s shards hold {extra} bytes more state than the traced rank's"))
        return facts

    def _zero_state(self, optimizers: list[torch.optim.Optimizer], at: int) -> list[Fact]:
        """The optimizer state the fullest rank of each ZeRO optimizer's data-parallel group needs, by ZeRO's
        partition rule and the wrapped optimizer kind's copies per stepped element (in the master weights' dtype):
        the trace is rank 0's, whose partitions are the largest (the first ranks get the remainder), so a trace
        that holds less made the wrong partitions or lost their state."""
        by_device: dict[int, int] = {}
        sources: list[str] = []
        for zero in list(self._zero):
            inner = getattr(zero, "optimizer", None)
            if not any(inner is o for o in optimizers):
                continue
            copies = {state_copies(inner, group) for group in inner.param_groups}
            params = optimizer_params(inner)
            if len(copies) != 1 or None in copies or not params or params[0].device.type != self.device_type:
                continue  # a kind without a known rule, or state kept off the GPU (offload)
            per_rank = zero_partitions(zero)
            if not per_rank:
                continue
            rank = max(range(len(per_rank)), key=per_rank.__getitem__)
            device = params[0].device.index or 0
            by_device[device] = by_device.get(device, 0) + copies.pop() * per_rank[rank] * params[0].element_size()
            sources.append(f"{type(zero).__name__}: rank {rank}'s partitions of {per_rank[rank]} elements, "
                           f"{type(inner).__name__} state per element")
        return [Fact(FACT_ZERO_STATE, (Category.OPTIMIZER_STATE,), device, 0, nbytes, at, "; ".join(sources))
                for device, nbytes in sorted(by_device.items()) if nbytes > 0]

    def _seen(self) -> list[torch.optim.Optimizer]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]
