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
- Every other op that FakeTensorMode answers from its cache: the tracer's fake mode (`fake_mode`, below) reaches
  that cache through a cheaper key, halving the cost of most ops.

(`xmem.trace.child.fakecuda` holds one more: an empty GPU tensor from empty data, made without a host tensor.)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from typing import Any, NamedTuple

import torch
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, in_kernel_invocation_manager

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


# ---- FakeTensorMode's own cache, reached through a cheaper key ------------------------------------------------------
# FakeTensorMode answers most ops from a cache of output metadata, but builds the key of every call from scratch
# (upstream `FakeTensorMode._cache_key`: a dataclass of 17 fields per tensor, flattened through generic Python): about
# 60 % of an op's cost in a trace. `QuickKeyCache` keeps, beside it, a map from a plain tuple (built from
# the same facts, read straight off the tensors) to the upstream key and entry it stands for; a call whose tuple is
# known gets its output from that entry by upstream's own `_output_from_cache_entry`, exactly as a cache hit does
# (or, where every output is plain, by the same steps that function takes, without its generic checks).
# Why equal tuples mean equal upstream keys: the tuple holds the op; the global state `_cache_key` reads (default
# dtype and device, inference mode, whether a proxy mode traces; no shape env: the tracer has none); each tensor's
# dtype, shape, stride, device, layout, storage offset and bytes, requires_grad, conj, neg and inference bits (the
# rest of upstream's `TensorMetadata` follows from these: memory format from shape and stride, quantized from dtype,
# sparse fields from layout); every other argument with its type (1 and 1.0 hash alike), lists and tuples with
# their type and length. Anything else (a real tensor, a constant, another mode's tensor, a symbolic size, a
# callable) makes no tuple and goes the upstream way, as does a call upstream would not cache.
# One uncached call is keyed too: a host tensor copied to the GPU (`_to_copy` of a real CPU tensor: every weight of
# `model.to("cuda")`, every batch), which upstream answers by making a fake copy of the host tensor first (about 3 ms
# a tensor). Its result is a new fake tensor whose metadata follows from the host tensor's metadata, the arguments
# and the current GPU alone (no constant: a host tensor of more than one element never becomes one), so the first
# result upstream gives for a key is the recipe for the rest.

_PLAIN_ARGUMENT_TYPES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device,
                                   torch.layout, torch.memory_format})
_NO_QUICK_KEY = object()  # not yet in the quick-key map
# Why a call went the upstream way (`QuickKeyCache.misses`), as upstream counts its own cache's bypasses by reason
# (`FakeTensorMode.cache_bypasses`): a quick key is a tuple, a miss its reason (a str).
_MISS_SHAPE_ENV = "a shape env or the cache crosscheck"
_MISS_HOST_TENSOR = "a host tensor of at most one element, or not dense, copied to the GPU"
_MISS_CONSTANT = "a fake tensor holding a constant"
_MISS_OTHER_MODE = "a fake tensor of another fake mode"
_MISS_NO_RECIPE = "a host copy whose first result is not a plain new tensor"
_MISS_NOT_CACHED = "an op upstream does not cache"
_MISS_DATA_DEPENDENT = "a data-dependent op (`.item()`): never cached upstream, dispatched without its key"
_HOST_COPY = torch.ops.aten._to_copy.default
_HOST_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class _UpstreamCache(NamedTuple):
    """Upstream's cache pieces the quick key relies on (torch._subclasses.fake_tensor)."""

    key_state: type  # _CacheKeyState
    valid_entry: type  # _DispatchCacheValidEntry
    bypass: type  # _BypassDispatchCache: a call upstream does not cache
    bypass_entry: type  # _DispatchCacheBypassEntry: upstream's negative entry
    set_cache_key: Any  # _set_cache_key


def _upstream_cache_api() -> _UpstreamCache | None:
    """Upstream's cache pieces, or None where this torch lacks one (then the plain mode)."""
    from torch._subclasses import fake_tensor
    try:
        from torch._subclasses._fake_tensor_utils import _CacheKeyState
    except ImportError:
        return None
    names = ("_DispatchCacheValidEntry", "_BypassDispatchCache", "_DispatchCacheBypassEntry", "_set_cache_key")
    methods = ("_cache_key", "_output_from_cache_entry", "_cached_dispatch_impl", "_dispatch_impl",
               "_make_cache_entry", "cache")
    if not all(hasattr(fake_tensor, name) for name in names) or \
            not all(hasattr(FakeTensorMode, name) for name in methods):
        return None
    return _UpstreamCache(_CacheKeyState, *(getattr(fake_tensor, name) for name in names))


def fake_mode(**options: Any) -> FakeTensorMode:
    """The FakeTensorMode the tracer enters, answering cached ops through the quick key unless shortcuts are off or
    this torch's cache differs from the one the key was written against. A plain FakeTensorMode whose cache lookup
    is replaced on the instance: its type must stay FakeTensorMode, by which higher-order ops find their fake rule."""
    mode = FakeTensorMode(**options)
    api = _upstream_cache_api()
    if api is not None and enabled():
        mode._cached_dispatch_impl = QuickKeyCache(mode, api).dispatch
    return mode


def quick_key_misses(mode: FakeTensorMode | None) -> dict[str, int]:
    """Why calls of `mode` (made by `fake_mode`) went the upstream way, counted by reason; {} without the quick key."""
    cache = getattr(getattr(mode, "_cached_dispatch_impl", None), "__self__", None)
    return dict(cache.misses) if isinstance(cache, QuickKeyCache) else {}


class QuickKeyCache:
    """The quick-key map of one fake mode, in front of its upstream cache lookup."""

    def __init__(self, mode: FakeTensorMode, api: _UpstreamCache) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
        self.mode, self.api, self.proxy_mode = mode, api, get_proxy_mode
        self.upstream = functools.partial(FakeTensorMode._cached_dispatch_impl, mode)
        self.guard_data_pointer = torch._C._set_warn_deprecated_on_mutable_data_ptr \
            if mode._allow_unsafe_data_ptr_access else torch._C._set_throw_on_mutable_data_ptr  # as __new__ does
        self.known: dict[tuple, tuple | str] = {}  # quick key -> (upstream key, entry, outputs' recipe) or a miss
        self.hits = 0  # calls answered through the quick key
        self.misses: collections.Counter[str] = collections.Counter()  # calls that went upstream, by reason
        self.wrappers: dict[torch.device, dict] = {}  # device -> the Python state FakeTensor() gives a tensor there

    def dispatch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        quick = self._quick_key(func, args, kwargs)
        if type(quick) is str:
            self.misses[quick] += 1
            return self.upstream(func, types, args, kwargs)
        known = self.known.get(quick, _NO_QUICK_KEY)
        if known is _NO_QUICK_KEY:
            return self._learn(quick, func, types, args, kwargs)
        if known is _MISS_DATA_DEPENDENT:
            return self._data_dependent(func, types, args, kwargs)
        if type(known) is str:
            self.misses[known] += 1
            return self.upstream(func, types, args, kwargs)
        key, entry, recipe = known
        output = self._outputs(*recipe, args) if recipe is not None else \
            self.mode._output_from_cache_entry(self.api.key_state(None), entry, key, func, args)
        FakeTensorMode.cache_hits += 1
        self.hits += 1
        return output

    def _outputs(self, is_tuple: bool, makes_tensors: bool, recipe: tuple, args: Any) -> Any:
        """The outputs as upstream's `_get_output_tensor_from_cache_entry` makes them: an in-place op's is its
        argument; any other an empty meta tensor of the cached shape, stride, dtype and layout (for a view op set onto
        its argument's storage at the cached offset), wrapped as a FakeTensor outside the kernel context."""
        with in_kernel_invocation_manager(self.mode) if makes_tensors else contextlib.nullcontext():
            made = [None if out is None else args[out.index] if out.kind is _IN_PLACE else _empty_meta(out, args)
                    for out in recipe]
        if makes_tensors:
            made = [t if out is None or out.kind is _IN_PLACE else self._wrap(t, out.device)
                    for t, out in zip(made, recipe)]
        return tuple(made) if is_tuple else made[0]

    def _wrap(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        """`FakeTensor(mode, meta, device)` without its generic argument checks: the subclass made as its __new__
        makes it, then given the Python state a FakeTensor of this mode and device is born with (all of it the
        same for every such tensor: the device, the mode, no constant, no real tensor, empty memos), copied from the
        first one made the upstream way."""
        state = self.wrappers.get(device)
        if state is None or FakeTensorConfig.debug:  # debug: each tensor keeps the stack that made it
            made = FakeTensor(self.mode, meta, device)
            if device.index is not None or device.type == "cpu":  # else the device's index is today's GPU
                self.wrappers[device] = dict(vars(made))
            return made
        fake = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                           device_for_backend_keys=device)
        self.guard_data_pointer(fake)
        fake.__dict__.update(state)
        return fake

    def _learn(self, quick: tuple, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """The upstream path, then which upstream entry (if any) this quick key stands for from now on."""
        if func is _HOST_COPY and type(args[0]) is not FakeTensor:  # uncached upstream: its result is the recipe
            output = self.upstream(func, types, args, kwargs)
            recipe = _host_copy_recipe(self.mode, output, args[0])
            self.known[quick] = (None, None, recipe) if recipe is not None else _MISS_NO_RECIPE
            if recipe is None:
                self.misses[_MISS_NO_RECIPE] += 1
            return output
        if torch.Tag.data_dependent_output in getattr(func, "tags", ()):
            self.known[quick] = _MISS_DATA_DEPENDENT
            return self._data_dependent(func, types, args, kwargs)
        return self._upstream_once(quick, func, types, args, kwargs)

    def _data_dependent(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """An op tagged data_dependent_output (`_local_scalar_dense`, which `.item()` reaches once per environment
        step in a rollout): upstream's `_validate_cache_key` refuses to cache one, so upstream builds its full key,
        finds no entry and dispatches (`_dispatch_impl`), which without a shape env raises
        DataDependentOutputException before anything is cached, or else stores a bypass entry and counts it. The
        output is `_dispatch_impl`'s either way; the key, half the call's cost, is skipped. Upstream's count of the
        bypass is kept."""
        self.misses[_MISS_DATA_DEPENDENT] += 1
        output = self.mode._dispatch_impl(func, types, args, kwargs)
        FakeTensorMode.cache_bypasses["data dependent output"] += 1
        return output

    def _upstream_once(self, quick: tuple, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """Upstream's `_cached_dispatch_impl` without a shape env (the quick key needs none), restated step for step
        so that the call's key is computed once (it costs about as much as a cached op); then the entry this quick
        key stands for from now on, if any."""
        mode, api, cache = self.mode, self.api, FakeTensorMode.cache
        state = api.key_state(None)
        try:
            key = mode._cache_key(state, func, args, kwargs)
        except api.bypass as bypass:
            FakeTensorMode.cache_bypasses[bypass.reason] += 1
            key, why = None, bypass.reason
        if key is None:  # dispatched outside the handler, as upstream does: an op's own error has no cache context
            self._missed(quick, why)
            return mode._dispatch_impl(func, types, args, kwargs)
        entry = cache.get(key)
        if entry is None:
            output = mode._dispatch_impl(func, types, args, kwargs)
            try:
                entry = mode._make_cache_entry(state, key, func, args, kwargs, output)
            except api.bypass as bypass:
                FakeTensorMode.cache_bypasses[bypass.reason] += 1
                entry = api.bypass_entry(bypass.reason)
            else:
                FakeTensorMode.cache_misses += 1
            api.set_cache_key(cache, key, entry)
        elif isinstance(entry, api.bypass_entry):
            FakeTensorMode.cache_bypasses[entry.reason] += 1
            output = mode._dispatch_impl(func, types, args, kwargs)
        else:
            output = mode._output_from_cache_entry(state, entry, key, func, args)
            FakeTensorMode.cache_hits += 1
        if type(entry) is api.valid_entry:
            self.known[quick] = (key, entry, _recipe(func, entry))
        else:
            self._missed(quick, getattr(entry, "reason", "not a plain entry"))
        return output

    def _missed(self, quick: tuple, upstream_reason: str) -> None:
        """`quick` goes the upstream way from now on, for upstream's reason (a bypass reason of its cache)."""
        self.known[quick] = miss = f"{_MISS_NOT_CACHED}: {upstream_reason}"
        self.misses[miss] += 1

    def _quick_key(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The call as a tuple of everything upstream's key is made of (the op, the global state it reads, each
        tensor's metadata, each other argument with its type), or why there is none (a str)."""
        if self.mode.shape_env is not None or self.mode.cache_crosscheck_enabled:
            return _MISS_SHAPE_ENV
        parts = [func, torch.get_default_dtype(), torch._C._get_default_device(),
                 torch.is_inference_mode_enabled(), self.proxy_mode() is not None]
        if func is _HOST_COPY and args and type(args[0]) in _HOST_TENSOR_TYPES:
            host = _host_tensor_key(args[0])
            if host is None or len(args) != 1:
                return _MISS_HOST_TENSOR
            parts.append(host)
            target = kwargs.get("device")
            if type(target) is torch.device and target.type == "cuda" and target.index is None:
                parts.append(torch.cuda.current_device())  # where a "cuda" without an index lands
        else:
            miss = self._add_arguments(parts, args)
            if miss:
                return miss
        if kwargs:
            parts.append(tuple(kwargs))
            miss = self._add_arguments(parts, kwargs.values())
            if miss:
                return miss
        return tuple(parts)

    def _add_arguments(self, parts: list, values: Any) -> str:
        """Each value's part of the quick key added to `parts`; "" when all have one, else why one has not."""
        for value in values:
            kind = type(value)
            if kind is FakeTensor:
                if value.fake_mode is not self.mode:
                    return _MISS_OTHER_MODE
                if value.constant is not None:
                    return _MISS_CONSTANT
                parts.append((value.dtype, value.shape, value.stride(), value.fake_device, value.layout,
                              value.storage_offset(), value.untyped_storage().nbytes(), value.requires_grad,
                              value.is_conj(), value.is_neg(), value.is_inference()))
            elif kind in _PLAIN_ARGUMENT_TYPES:
                parts.append(kind)
                parts.append(value)
            elif kind is list or kind is tuple:
                parts.append(kind)
                parts.append(len(value))
                miss = self._add_arguments(parts, value)
                if miss:
                    return miss
            else:  # a real tensor, a symbolic value, a callable...: upstream decides
                return f"an argument of type {kind.__name__}"
        return ""


def _host_tensor_key(tensor: torch.Tensor) -> tuple | None:
    """A plain host tensor's metadata for the quick key of its copy to the GPU; None for one that could be (or be
    memoised as) a constant, or is not dense host memory."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() <= 1:
        return None
    return ("host", tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.requires_grad,
            tensor.is_conj(), tensor.is_neg(), tensor.is_inference())


def _host_copy_recipe(mode: FakeTensorMode, output: Any, host: torch.Tensor) -> tuple | None:
    """The recipe of a host tensor's copy to the GPU, from upstream's first result: a plain new fake tensor of this
    mode, on storage of its own of exactly its size. Else None (never quick)."""
    if type(output) is not FakeTensor or output.fake_mode is not mode or output.constant is not None or \
            output.layout != torch.strided or output.is_conj() or output.is_neg() or output.storage_offset() != 0:
        return None
    shape, stride = tuple(output.shape), output.stride()
    if not all(type(v) is int for v in (*shape, *stride)):
        return None
    if output.untyped_storage().nbytes() != compute_required_storage_length(shape, stride, 0) * output.element_size():
        return None
    made = _Output(_NEW, None, shape, stride, 0, output.dtype, output.layout, output.requires_grad,
                   output.fake_device)
    return False, True, (made,)


_IN_PLACE, _NEW, _VIEW = "in place", "new", "view"  # what an output of a cache entry is


class _Output(NamedTuple):
    """How to make one output of a cache entry: the in-place argument at `index`, or a new tensor (for a view, on
    the storage of the argument at `index`) of this metadata."""

    kind: str
    index: int | None
    shape: tuple = ()
    stride: tuple = ()
    offset: int = 0
    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    device: Any = None


def _empty_meta(out: _Output, args: Any) -> torch.Tensor:
    meta = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, layout=out.layout, device="meta",
                               requires_grad=out.requires_grad)
    if out.kind is _VIEW:
        meta.set_(args[out.index].untyped_storage(), out.offset, out.shape, out.stride)
    return meta


def _recipe(func: Any, entry: Any) -> tuple | None:
    """(is_tuple, whether any output is a new tensor, per output None or an `_Output`) for an entry whose outputs
    are all plain: no symbolic size, no conjugate or negative bit, no constant but None. Else None: upstream builds
    the outputs."""
    is_view = getattr(func, "is_view", None)
    if is_view is None:
        return None
    outputs: list[_Output | None] = []
    for info in entry.output_infos:
        meta = info.metadata
        if info.inplace_idx is None and meta is None and info.view_idx is None:
            if info.constant_value is not None:
                return None
            outputs.append(None)
        elif info.inplace_idx is not None:
            outputs.append(_Output(_IN_PLACE, info.inplace_idx))
        elif meta is None or meta.is_conj or meta.is_neg or meta.layout != torch.strided or \
                not all(type(v) is int for v in (*meta.shape, *meta.stride, meta.storage_offset)) or \
                is_view != (info.view_idx is not None):
            return None
        else:
            outputs.append(_Output(_VIEW if is_view else _NEW, info.view_idx, tuple(meta.shape), tuple(meta.stride),
                                   meta.storage_offset, meta.dtype, meta.layout, meta.requires_grad, meta.device))
    makes_tensors = any(out is not None and out.kind is not _IN_PLACE for out in outputs)
    return entry.is_output_tuple, makes_tensors, tuple(outputs)
