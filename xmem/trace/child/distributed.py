"""Distributed training under fake CUDA: one rank runs, alone, as the launcher described it.

Owns the patches of `torch.distributed.init_process_group` (torch's fake process group: collectives do nothing,
rank and world size as the launcher said), of `torch.multiprocessing.spawn` (rank 0 runs in-process), of the
device-to-device transfers of single-process `nn.DataParallel`, and of `DistributedDataParallel` (a stand-in that
runs the wrapped module and allocates the gradient buckets the C++ Reducer would; the real one reads parameter data
while it is built). For DTensor (tensor parallelism, fully_shard's parameters) it owns what the recorder needs to see
its dispatch as a GPU runs it (`dispatches_itself`, `is_wait_tensor`, sharding propagation unrecorded) and refuses
symmetric memory (not modelled).
Import only in the tracing child, after `xmem.trace.child.fakecuda`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

import xmem.trace.child.accelerate_launch as accelerate_launch
from xmem.trace.events import Category
from xmem.trace.child.on_import import patch_on_import, rebind_loaded

# upstream torch/distributed/constants + DDP defaults: the first bucket is small so communication starts early
FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25


_fake_cuda: Any = None  # the FakeCuda of this process, set by install()


def install(fake: Any) -> None:
    global _fake_cuda
    _fake_cuda = fake
    accelerate_launch.apply_launcher_environment()  # before the program reads it: `accelerate launch`'s variables
    import torch.distributed as dist
    if not dist.is_available():
        return
    _patch_init_process_group(fake, dist)
    _patch_object_collectives(dist)
    _patch_spawn()
    _patch_data_parallel_transfers()
    _patch_device_mesh()
    _patch_dtensor()
    _patch_fsdp_module_move()
    _patch_fsdp_storage_checks()
    _patch_fsdp_offload()
    _patch_lightning_launchers()
    _patch_distributed_checkpoint_save()
    _patch_fsdp2_post_forward_shards()
    _patch_fsdp1_optim_state_dict()
    import xmem.trace.child.pipelining as pipelining
    pipelining.install()
    import xmem.trace.child.rank_reads as rank_reads
    rank_reads.install()
    import torch.nn.parallel.distributed
    rebind_loaded(torch.nn.parallel.distributed.DistributedDataParallel, DistributedDataParallel)


def _patch_init_process_group(fake: Any, dist: Any) -> None:
    original_init = dist.init_process_group

    def init_fake_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                                world_size: int = -1, rank: int = -1, store: Any = None, **kwargs: Any) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
        if backend is None or "nccl" in str(backend):
            fake.on_library("nccl")
        kwargs.pop("device_id", None)  # binding a real device would initialise CUDA
        world_size = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
        rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
        extra = {"timeout": timeout} if timeout is not None else {}
        original_init(backend="fake", store=FakeStore(), world_size=world_size, rank=rank, **extra, **kwargs)
        import xmem.trace.child.rank_reads as rank_reads
        rank_reads.on_world_size(world_size)

    dist.init_process_group = init_fake_process_group


def _patch_object_collectives(dist: Any) -> None:
    """The object collectives (`broadcast_object_list`, `all_gather_object`, `gather_object`, `scatter_object_list`,
    `send_object_list`, `recv_object_list`) answer as they would on the traced rank of a real world, without the
    transfers: upstream pickles each object into a byte tensor on the collective's device and back, which the fake
    GPU cannot (its tensors hold no bytes). What the traced rank would receive from another rank is stood in for by
    what it has itself: its own object (or list entry), copied as unpickling would. The byte tensors upstream moves
    live only within the call, a few KiB that the allocator's small pool serves: not recorded."""
    import torch.distributed.distributed_c10d as c10d

    def root_is_me(group: Any, rank: Any, group_rank: Any) -> bool:
        group = group or c10d._get_default_group()
        if rank is None and group_rank is None:
            rank = 0  # upstream's default root before `src`/`dst` became optional
        return group.rank() == c10d._canonicalize_group_rank(group, rank, group_rank)

    def broadcast_object_list(object_list: list, src: Any = None, group: Any = None, device: Any = None,
                              group_src: Any = None, weights_only: bool = False) -> None:
        root_is_me(group, src, group_src)  # the root is checked as upstream checks it; the list stays this rank's

    def all_gather_object(object_list: list, obj: Any, group: Any = None, weights_only: bool = False) -> None:
        object_list[:] = [_received(obj) for _ in object_list]

    def gather_object(obj: Any, object_gather_list: list | None = None, dst: Any = None, group: Any = None,
                      group_dst: Any = None, weights_only: bool = False) -> None:
        if root_is_me(group, dst, group_dst) and object_gather_list is not None:
            object_gather_list[:] = [_received(obj) for _ in object_gather_list]

    def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Any = None,
                            src: Any = None, group: Any = None, group_src: Any = None,
                            weights_only: bool = False) -> None:  # upstream's argument names: callers pass them
        root_is_me(group, src, group_src)
        if scatter_object_input_list is not None:  # the root's list (or, elsewhere, a list this rank passed anyway)
            rank = (group or c10d._get_default_group()).rank()
            scatter_object_output_list[0] = _received(scatter_object_input_list[rank])

    def send_object_list(object_list: Any, dst: Any = None, group: Any = None, device: Any = None,
                         group_dst: Any = None, use_batch: bool = False, weights_only: bool = False) -> None: ...

    def recv_object_list(object_list: list, src: Any = None, group: Any = None, device: Any = None,
                         group_src: Any = None, use_batch: bool = False, weights_only: bool = False) -> int:
        return src if src is not None else (group_src if group_src is not None else 0)  # the sender's rank

    for function in (broadcast_object_list, all_gather_object, gather_object, scatter_object_list,
                     send_object_list, recv_object_list):
        setattr(dist, function.__name__, function)
        setattr(c10d, function.__name__, function)


def _received(obj: Any) -> Any:
    """A copy of `obj` as unpickling another rank's bytes would make it (a GPU tensor in it: a new GPU tensor)."""
    import copy
    import warnings
    with warnings.catch_warnings():  # deepcopy asks a tensor subclass for its data pointer: fakes warn of it
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return copy.deepcopy(obj)


def _patch_spawn() -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs): rank 0 runs here, in this process (fresh worker processes
    would have no fake CUDA), or the rank the estimate asks for (`launchers.TRACED_RANK_ENV`: a pipeline's stages).
    The world size is the number of processes asked for."""
    import torch.multiprocessing as mp
    from xmem.launchers import traced_rank

    def run_rank_zero(fn: Any, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                      start_method: str = "spawn", **kwargs: Any) -> None:
        rank = traced_rank(os.environ)
        os.environ.setdefault("WORLD_SIZE", str(nprocs))
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        fn(rank, *args)

    rebind_loaded(mp.spawn, run_rank_zero)
    rebind_loaded(mp.start_processes, run_rank_zero)


def _patch_device_mesh() -> None:
    """A DeviceMesh is host-side bookkeeping: a CPU tensor of ranks that it searches (`nonzero`). Under the fake
    mode that tensor would hold no values, so the mesh's own methods run on real CPU tensors."""
    import functools
    import inspect

    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def on_real_tensors(function: Any) -> Any:
        @functools.wraps(function)
        def run_without_fake_mode(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return function(*args, **kwargs)
        return run_without_fake_mode

    mesh_class = device_mesh.DeviceMesh
    for name, member in list(vars(mesh_class).items()):
        if inspect.isfunction(member) and (name == "__init__" or not name.startswith("__")):
            setattr(mesh_class, name, on_real_tensors(member))
    device_mesh.init_device_mesh = on_real_tensors(device_mesh.init_device_mesh)


# ---- DTensor (tensor parallelism, FSDP2's sharded parameters) -----------------------------------------------------
_dtensor_types: tuple[type, ...] = ()  # DTensor, once torch.distributed.tensor is imported


def _patch_dtensor() -> None:
    """DTensor's op dispatch runs as upstream's eager path runs it, its local ops in sight of the recorder.

    A DTensor op (C++ fast path, torch/csrc/autograd/python_variable.cpp dispatchDTensorOp; the Python tail in
    torch/distributed/tensor/_dispatch.py) first propagates shardings: it runs the op once on global-shape fake
    tensors made from the specs to learn the output's metadata (ShardingPropagator._propagate_tensor_meta_non_cached,
    under the fake mode it detects: ours). On a GPU that is metadata only, so it runs with the recorder paused. Then
    it redistributes the arguments the chosen strategy needs (OpDispatcher.redistribute_local_args:
    _redistribute.redistribute_local_tensor, e.g. a Replicate bias divided into a Partial one by RowwiseParallel's
    addmm) and runs the op on the local shards: those allocations are the rank's, recorded one by one because the
    recorder lets DTensor dispatch first (`dispatches_itself`), as upstream's own MemTracker does
    (torch/distributed/_tools/mem_tracker.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def patch_api(api: Any) -> None:
        global _dtensor_types
        _dtensor_types = (api.DTensor,)

    def patch_sharding_prop(sharding_prop: Any) -> None:
        propagator = sharding_prop.ShardingPropagator
        propagate = propagator._propagate_tensor_meta_non_cached

        def propagate_unrecorded(self: Any, op_schema: Any) -> Any:
            from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
            mode = _get_current_dispatch_mode()
            if mode is None or isinstance(mode, FakeTensorMode) or not getattr(mode, "records_allocations", False):
                return propagate(self, op_schema)
            with _pop_mode_temporarily():  # the recorder; the fake mode (an infra mode) stays
                return propagate(self, op_schema)

        propagator._propagate_tensor_meta_non_cached = propagate_unrecorded

    patch_on_import("torch.distributed.tensor._api", patch_api)
    patch_on_import("torch.distributed.tensor._sharding_prop", patch_sharding_prop)
    patch_on_import("torch.distributed._symmetric_memory", _refuse_symmetric_memory)


SYMMETRIC_MEMORY_GAP = ("symmetric memory (torch.distributed._symmetric_memory: async tensor parallelism's and "
                        "SymmetricMemory's peer-to-peer buffers, allocated outside the caching allocator)")


def _refuse_symmetric_memory(module: Any) -> None:
    """Buffers in symmetric memory (`empty`, `rendezvous`, and `get_symm_mem_workspace`, which async TP's fused
    all-gather-matmul and matmul-reduce-scatter take) come from their own allocator (CUDA virtual memory mapped by
    every rank of the group), which neither the fake GPU nor the caching allocator's model holds: not modelled,
    named. Only marking a group (`enable_symm_mem_for_group`) allocates nothing and passes."""
    from xmem.trace.errors import NotModelled

    def refuse(name: str) -> Any:
        def not_modelled(*args: Any, **kwargs: Any) -> Any:
            raise NotModelled(f"{SYMMETRIC_MEMORY_GAP}: {name}")
        return not_modelled

    for name in ("empty", "rendezvous", "get_symm_mem_workspace"):
        if hasattr(module, name):
            setattr(module, name, refuse(f"torch.distributed._symmetric_memory.{name}"))


def dispatches_itself(types: Any) -> bool:
    """Whether an op on tensors of `types` (its __torch_dispatch__ argument) is DTensor's to dispatch first: the
    recorder returns NotImplemented for it, and DTensor's local ops come back to the recorder."""
    return bool(_dtensor_types) and any(issubclass(kind, _dtensor_types) for kind in types)


def is_wait_tensor(func: Any) -> bool:
    """`_c10d_functional.wait_tensor`: on a GPU it returns the tensor it waited for (torch/csrc/distributed/c10d/
    Functional.cpp: wait_tensor), while its meta kernel, which the fake mode runs, allocates a new one
    (upstream's MemTracker answers it with its input for this reason). Under a fake mode torch's functional
    collectives wait at once (_functional_collectives._maybe_wrap_tensor: _are_we_tracing), so every all-gather,
    reduce-scatter and all-reduce of DTensor's redistribution would count its output twice."""
    global _wait_tensor
    if _wait_tensor is None:
        try:
            _wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        except (AttributeError, RuntimeError):  # a torch built without distributed
            _wait_tensor = False
    return func is _wait_tensor


_wait_tensor: Any = None


def _patch_fsdp_module_move() -> None:
    """FSDP1 given `device_id` moves a model's CPU tensors there by `param.data = param.to(device)`
    (`_init_utils._move_module_to_device`, "like the .data code path of nn.Module._apply"): a fake GPU tensor
    `.data`-assigned to a real CPU parameter leaves it on device meta, and FSDP stops ("Inconsistent compute device
    and `device_id` ... meta vs cuda:0"). Fabric's and accelerate's FSDP pass `device_id` with the model on the CPU.
    The same move runs first through the fake-aware `nn.Module._apply`, module by module as upstream walks them (not
    into nested FSDP instances; ignored tensors stay), which replaces the parameters by fake ones and rebinds the
    optimizers built before; upstream's move then finds nothing left on the CPU."""

    def patch(init_utils: Any) -> None:
        move = init_utils._move_module_to_device

        def move_fake_aware(module: nn.Module, ignored_params: set, ignored_buffers: set, device: Any) -> None:
            if device is not None:
                nested = init_utils.fsdp_file.FullyShardedDataParallel  # defined after _init_utils is loaded
                ignored = {id(t) for t in (*ignored_params, *ignored_buffers)}
                to_device = (lambda t: t if id(t) in ignored or t.device.type != "cpu" else t.to(device))
                queue = [module]
                while queue:
                    current = queue.pop()
                    current._apply(to_device, recurse=False)
                    queue.extend(child for child in current.children() if not isinstance(child, nested))
            move(module, ignored_params, ignored_buffers, device)

        init_utils._move_module_to_device = move_fake_aware

    patch_on_import("torch.distributed.fsdp._init_utils", patch)


def _patch_fsdp_storage_checks() -> None:
    """FSDP1's FlatParamHandle asks storages' data pointers whether a storage is allocated
    (`_data_ptr_allocated`: the writeback of a unit that skipped its sharded views, SHARD_GRAD_OP with
    use_orig_params) and whether two tensors share one (`_same_storage`: which original parameters the program
    replaced), and so does the end of backward whether a unit is already resharded (`_runtime_utils.
    _catch_all_reshard`: a unit whose post-backward hook never ran, e.g. one of frozen parameters only, is resharded
    there). A fake storage has no data pointer (0 for all), so each is asked of the storage itself: allocated
    when it holds bytes (FSDP frees by resizing to 0), the same when it is the same StorageImpl."""

    def storage_of(tensor: torch.Tensor) -> int:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's own shard (SHARD_GRAD_OP with TP), as upstream
        return local.untyped_storage()._cdata

    def patch(flat_param: Any) -> None:
        flat_param._data_ptr_allocated = lambda tensor: tensor.untyped_storage().nbytes() > 0
        flat_param._same_storage = lambda a, b: storage_of(a) == storage_of(b)

    def patch_runtime(runtime: Any) -> None:
        def catch_all_reshard(state: Any) -> None:
            handle = state._handle
            if not handle:
                return
            flat, shard = handle.flat_param, handle.flat_param._local_shard
            if (storage_of(flat) == storage_of(shard) and flat.storage_offset() == shard.storage_offset()
                    and not handle._skipped_use_sharded_views):
                return  # already resharded
            runtime._reshard(state, handle, runtime._should_free_in_backward(state, handle))

        runtime._catch_all_reshard = catch_all_reshard

    patch_on_import("torch.distributed.fsdp._flat_param", patch)
    patch_on_import("torch.distributed.fsdp._runtime_utils", patch_runtime)


def _patch_fsdp2_post_forward_shards() -> None:
    """fully_shard(reshard_after_forward=N) keeps, from a unit's forward to its backward, each parameter's 1/N slice
    of its all-gather output, cloned so that the output can be freed (FSDPParam.to_sharded_post_forward:
    _sharded_post_forward_param_data), and all-gathers from it again in backward: a partly gathered parameter,
    labelled as the unsharded parameters are (made by an op in forward, it would be an activation)."""

    def patch(fsdp_param: Any) -> None:
        param_class = fsdp_param.FSDPParam
        reshard = param_class.to_sharded_post_forward

        def to_sharded_post_forward(self: Any) -> None:
            reshard(self)
            _fake_cuda.on_module_tensor(self._sharded_post_forward_param_data, Category.UNSHARDED_PARAMETER)

        param_class.to_sharded_post_forward = to_sharded_post_forward

    patch_on_import("torch.distributed.fsdp._fully_shard._fsdp_param", patch)


def _patch_fsdp1_optim_state_dict() -> None:
    """FSDP1's optimizer state dict with use_orig_params (`FSDP.optim_state_dict`, what accelerate saves) learns what
    the other ranks hold by all_gather_object: the names of the parameters each rank's optimizer has state for
    (`_optim_utils._map_param_key_to_optim_keys`) and, per unit, each rank's state shapes
    (`_allgather_state_info`), from which it sizes the flat state it all-gathers. The object collectives' stand-in
    answers with the traced rank's own objects, which is wrong where the shards differ: a parameter that lies
    wholly outside rank 0's shard has no state there, upstream found none anywhere and stopped ("... is not in the
    optimizer state"). Each other rank's answer is made as that rank would make it: its optimizer holds state for
    every trainable parameter with elements in its shard (a 1-D view of them: `_use_sharded_views`), with the state
    names, dtypes and scalars of the traced rank's (one optimizer's state looks alike for every parameter)."""
    current: dict[str, Any] = {}  # the unit being gathered and a state to copy the layout of

    def patch(optim_utils: Any) -> None:
        map_keys, gather_info = optim_utils._map_param_key_to_optim_keys, optim_utils._allgather_state_info
        gather_unit = optim_utils._gather_all_orig_param_state

        def map_param_key_to_optim_keys(optim_state_dict: Any, group: Any, param_key_to_param: Any,
                                        param_to_fqns: Any, fqn_to_fsdp_param_info: Any,
                                        merge_keys: bool = False) -> Any:
            keys, local = map_keys(optim_state_dict, group, param_key_to_param, param_to_fqns,
                                   fqn_to_fsdp_param_info, merge_keys=merge_keys)
            current["template"] = next((state for state in optim_state_dict["state"].values() if state), None)
            if merge_keys:  # every trainable FSDP parameter has state on the ranks whose shards hold it
                keys = sorted({*keys, *(optim_utils._OptimStateKey(tuple(param_to_fqns[param]), True)
                                        for param in param_key_to_param.values() if param.requires_grad
                                        and param_to_fqns[param][0] in fqn_to_fsdp_param_info)})
            return keys, local

        def gather_all_orig_param_state(fsdp_param_info: Any, *args: Any, **kwargs: Any) -> Any:
            current["unit"] = fsdp_param_info
            try:
                return gather_unit(fsdp_param_info, *args, **kwargs)
            finally:
                current.pop("unit", None)

        def allgather_state_info(fsdp_state: Any, input_states: dict) -> list:
            gathered = gather_info(fsdp_state, input_states)  # the traced rank's, for every rank
            unit, template = current.get("unit"), current.get("template")
            if unit is None or fsdp_state.world_size < 2:
                return gathered
            if template is None:
                from xmem.trace.errors import NotModelled
                raise NotModelled("FSDP1's optimizer state dict on a rank whose shards hold no optimizer state")
            for rank in range(1, fsdp_state.world_size):
                gathered[rank] = {fqn: _state_info(optim_utils, unit, fqn, rank, template) for fqn in input_states}
            return gathered

        optim_utils._map_param_key_to_optim_keys = map_param_key_to_optim_keys
        optim_utils._gather_all_orig_param_state = gather_all_orig_param_state
        optim_utils._allgather_state_info = allgather_state_info

    patch_on_import("torch.distributed.fsdp._optim_utils", patch)


def _state_info(optim_utils: Any, unit: Any, fqn: str, rank: int, template: dict) -> Any:
    """The StateInfo rank `rank` gives for `fqn` in `_allgather_state_info`: nothing where its shard holds none of
    the parameter, else the template's state with each tensor of more than 0 dimensions as long as its part."""
    flat = unit.handle.flat_param
    shard = flat._sharded_size.numel()
    begin, end = rank * shard, (rank + 1) * shard  # the rank's range of the padded flat parameter
    held, offset, index = 0, 0, 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not is_padding:
            if index == unit.param_indices[fqn]:
                held = max(0, min(offset + numel, end) - max(offset, begin))
                break
            index += 1
        offset += numel
    info = optim_utils.StateInfo({}, {}, {})
    if held == 0:
        return info
    for name, value in template.items():
        if not torch.is_tensor(value):
            info.non_tensors[name] = value
        elif value.dim() == 0:
            info.scalar_tensors[name] = value.cpu()
        else:
            info.tensors[name] = optim_utils._PosDimTensorInfo(torch.Size([held]), value.dtype)
    return info


def _patch_distributed_checkpoint_save() -> None:
    """torch.distributed.checkpoint's save (and async_save) over more than one rank is not modelled: its
    coordinator merges every rank's save plan (_DistWrapper.reduce_scatter: gather_object, then
    DefaultSavePlanner.create_global_plan checks that the ranks' chunks cover each tensor), and the stand-in of
    gather_object can only give the traced rank's own plan for the others'; its writer copies each GPU tensor's bytes
    to the host, which a fake tensor has none of. Named, not guessed (the GPU memory of the save itself is the state
    dict it is given: its host copies are made one tensor at a time)."""
    import sys

    def patch(saver: Any) -> None:
        import torch.distributed as dist

        def refuse(original: Any) -> Any:
            import functools

            @functools.wraps(original)
            def save(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("no_dist") or not dist.is_initialized() or dist.get_world_size() < 2:
                    return original(*args, **kwargs)
                from xmem.trace.errors import NotModelled
                raise NotModelled(f"torch.distributed.checkpoint.{original.__name__} over {dist.get_world_size()} "
                                  "ranks (the ranks' merged save plan)")
            return save

        for name in ("save", "async_save"):
            if hasattr(saver, name):
                setattr(saver, name, refuse(getattr(saver, name)))

    def patch_package(checkpoint: Any) -> None:
        saver = sys.modules["torch.distributed.checkpoint.state_dict_saver"]  # imported by the package
        for name in ("save", "async_save"):
            if hasattr(checkpoint, name):
                setattr(checkpoint, name, getattr(saver, name))

    patch_on_import("torch.distributed.checkpoint.state_dict_saver", patch)
    patch_on_import("torch.distributed.checkpoint", patch_package)


def _patch_fsdp_offload() -> None:
    """FSDP's CPU offload, FSDP1's `CPUOffload(offload_params=True)` and FSDP2's `CPUOffloadPolicy`, run as upstream
    runs them; what the GPU holds follows from upstream's own code, with host tensors kept host-side (fakecuda's
    `.data` assignment takes the device of what it is given):
    - FSDP1 (_flat_param.py, _runtime_utils.py): the sharded FlatParameter lives on the host (`_local_shard`,
      pinned), and so does the sharded gradient (`_cpu_grad`, made beside it). Each unshard first copies the host
      shard to the GPU (`pre_unshard` -> `flat_param_to(device)`), then all-gathers it into the padded unsharded
      parameter; reshard points the parameter back at the host shard. In backward the unsharded gradient and the
      reduce-scatter output are on the GPU; the output (`_saved_grad_shard`) is copied into `_cpu_grad`
      (`_offload_grad`) and kept until the end of backward (`_finalize_params`: `prepare_gradient_for_optim`), when
      `_cpu_grad` becomes the parameter's gradient: the optimizer steps on the host and makes nothing on the GPU.
    - FSDP2 (_fully_shard/_fsdp_param.py, _fsdp_collectives.py): `fully_shard` moves the unit's tensors to the GPU
      (`_move_states_to_device`), shards them there and moves each padded shard to the host (`_init_sharded_param`:
      `.cpu()`, pinned or not: pinning is host memory). Each all-gather input is the shard copied to the GPU
      (`all_gather_inputs`: `.to(device)`); each sharded gradient, a view of the reduce-scatter output, is copied
      to the host (`foreach_reduce`: `.to("cpu")`) and the output freed at once.
    Upstream's offloaded tensors are host tensors with values; here a unit's host parameters and buffers that are
    still real become fake host tensors before FSDP takes them (as a model too large for the host budget is built),
    so that FSDP's moves between host and GPU keep one object, as they do on a GPU; host code that reads their
    values gets stand-ins."""

    def become_fake_host_tensors(modules: list[nn.Module], keep: set[int]) -> None:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if mode is None:
            return

        def to_fake(tensor: torch.Tensor) -> torch.Tensor:
            if (isinstance(tensor, FakeTensor) or id(tensor) in keep or tensor.device.type != "cpu"
                    or type(tensor) not in (torch.Tensor, nn.Parameter)):
                return tensor
            with unset_fake_temporarily():
                return mode.from_tensor(tensor.detach())

        for module in modules:
            module._apply(to_fake, recurse=False)  # the fake-aware _apply: replaced, optimizers rebound

    def patch_fsdp1(fsdp_file: Any) -> None:
        init_handle = fsdp_file._init_param_handle_from_module  # _init_utils', as FullyShardedDataParallel calls it

        def init_handle_offloaded(state: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if state.cpu_offload.offload_params:
                nested = fsdp_file.FullyShardedDataParallel
                managed, queue = [], [module]
                while queue:  # as upstream walks a unit's modules: not into nested FSDP instances
                    current = queue.pop()
                    managed.append(current)
                    queue.extend(child for child in current.children() if not isinstance(child, nested))
                become_fake_host_tensors(managed, {id(p) for p in state._ignored_params})
            return init_handle(state, module, *args, **kwargs)

        fsdp_file._init_param_handle_from_module = init_handle_offloaded

    def patch_fsdp2(fsdp_init: Any) -> None:
        managed_states = fsdp_init._get_managed_states

        def managed_states_fake_on_host(modules: list[nn.Module], ignored_params: Any = None, *args: Any,
                                        **kwargs: Any) -> Any:
            # a host model's tensors, which `_move_states_to_device` then moves by `.data =` (a real tensor cannot
            # take fake GPU data; a unit built on the GPU or on meta is left as it is)
            become_fake_host_tensors(list(modules), {id(p) for p in ignored_params or ()})
            return managed_states(modules, ignored_params, *args, **kwargs)

        fsdp_init._get_managed_states = managed_states_fake_on_host

    def gathering(tensor: torch.Tensor) -> None:
        """The GPU copy of an offloaded shard, made to be all-gathered: with what FSDP gathers in the breakdown."""
        if tensor.device.type == "cuda":
            _fake_cuda.on_module_tensor(tensor, Category.UNSHARDED_PARAMETER)

    def label_fsdp1_copy_in(flat_param_module: Any) -> None:
        handle_class = flat_param_module.FlatParamHandle
        pre_unshard = handle_class.pre_unshard

        def pre_unshard_labelled(self: Any) -> bool:
            ran = pre_unshard(self)
            if self._offload_params:
                gathering(self.flat_param)
            return ran

        handle_class.pre_unshard = pre_unshard_labelled

    def label_fsdp2_copy_in(fsdp_param: Any) -> None:
        inputs = fsdp_param.FSDPParam.all_gather_inputs

        def all_gather_inputs(self: Any) -> list[torch.Tensor]:
            tensors = inputs.fget(self)
            if self.offload_to_cpu:
                for tensor in tensors:
                    gathering(tensor)
            return tensors

        fsdp_param.FSDPParam.all_gather_inputs = property(all_gather_inputs)

    patch_on_import("torch.distributed.fsdp.fully_sharded_data_parallel", patch_fsdp1)
    patch_on_import("torch.distributed.fsdp._fully_shard._fsdp_init", patch_fsdp2)
    patch_on_import("torch.distributed.fsdp._flat_param", label_fsdp1_copy_in)
    patch_on_import("torch.distributed.fsdp._fully_shard._fsdp_param", label_fsdp2_copy_in)


# Where Lightning (Fabric, Trainer; either package layout) starts the other ranks of `python train.py` itself
_LIGHTNING_LAUNCHERS = tuple(f"{package}.strategies.launchers.subprocess_script" for package in (
    "lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning"))


class _NoChildProcesses:
    """Stands for the `subprocess` module of a Lightning launcher while it would start the other ranks."""

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> None:  # noqa: N802 (subprocess's name)
        return None


def _patch_lightning_launchers() -> None:
    """Lightning with devices=N, started as `python train.py`, starts ranks 1..N-1 as copies of the script
    (`_SubprocessScriptLauncher._call_children_scripts`: subprocess.Popen). They would run without fake CUDA and take
    the CPU from rank 0's trace: rank 0 runs alone, as under mp.spawn, with the environment upstream sets for it
    there (MASTER_ADDR/PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE), and no child for the launcher to watch; or the rank
    the estimate asks for (`_become_traced_rank`)."""

    def patch(module: Any) -> None:
        launcher = module._SubprocessScriptLauncher
        start_children = launcher._call_children_scripts

        def rank_zero_alone(self: Any) -> None:
            real, module.subprocess = module.subprocess, _NoChildProcesses
            try:
                start_children(self)
            finally:
                module.subprocess = real
            self.procs = []
            _become_traced_rank(self.num_processes)

        launcher._call_children_scripts = rank_zero_alone

    for name in _LIGHTNING_LAUNCHERS:
        patch_on_import(name, patch)


def _become_traced_rank(processes_per_node: int) -> None:
    """The process Lightning's launcher left (rank 0) runs as the rank the estimate asks for (`TRACED_RANK_ENV`),
    as the launcher would have started it: its LOCAL_RANK and NODE_RANK, which Lightning's cluster environment
    reads when the strategy sets the world's ranks, after the launch."""
    from xmem.launchers import traced_rank
    rank = traced_rank(os.environ)
    if rank:
        os.environ["LOCAL_RANK"] = str(rank % processes_per_node)
        os.environ["NODE_RANK"] = str(rank // processes_per_node)


def _patch_data_parallel_transfers() -> None:
    """nn.DataParallel over several fake GPUs: the transfers between devices are C++ kernels that need a driver,
    so they are re-stated with plain copies (same tensors, same devices), and the replicas run one after another
    on this thread, which the recorder watches (upstream runs them on worker threads)."""
    import functools
    import sys

    import torch.nn.parallel.comm as comm
    data_parallel = sys.modules["torch.nn.parallel.data_parallel"]  # the attribute of that name is a function

    def cuda_device(device: Any) -> torch.device:
        """A device as comm's functions take it: an index (None: 0), a name or a torch.device."""
        return torch.device("cuda", device or 0) if device is None or isinstance(device, int) else torch.device(device)

    def broadcast_coalesced(tensors: list, devices: list, buffer_size: int = 0) -> list[list[torch.Tensor]]:
        # upstream: the first device's outputs are the inputs themselves
        return [list(tensors) if i == 0 else [t.to(cuda_device(d)) for t in tensors] for i, d in enumerate(devices)]

    def reduce_add_coalesced(inputs: list, destination: Any = None, buffer_size: int = 0) -> list[torch.Tensor]:
        target = cuda_device(destination)
        return [functools.reduce(torch.add, [t.to(target) for t in same]) for same in zip(*inputs)]

    def scatter(tensor: torch.Tensor, devices: Any = None, chunk_sizes: Any = None, dim: int = 0,
                streams: Any = None, out: Any = None) -> tuple[torch.Tensor, ...]:
        chunks = tensor.split(chunk_sizes, dim) if chunk_sizes else tensor.chunk(len(devices), dim)
        return tuple(chunk.contiguous().to(cuda_device(d)) for chunk, d in zip(chunks, devices))

    def gather(tensors: list, dim: int = 0, destination: Any = None, out: Any = None) -> torch.Tensor:
        return torch.cat([t.to(cuda_device(destination)) for t in tensors], dim)

    def apply_one_by_one(modules: Any, inputs: Any, kwargs_tup: Any = None, devices: Any = None) -> list:
        kwargs_tup = kwargs_tup or ({},) * len(modules)
        return [module(*(args if isinstance(args, (list, tuple)) else (args,)), **kwargs)
                for module, args, kwargs in zip(modules, inputs, kwargs_tup)]

    comm.broadcast_coalesced, comm.reduce_add_coalesced = broadcast_coalesced, reduce_add_coalesced
    comm.scatter, comm.gather = scatter, gather
    data_parallel.parallel_apply = apply_one_by_one


def bucket_sizes(params: list[torch.Tensor], cap_bytes: int,
                 first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[tuple[torch.dtype, torch.device, int]]:
    """(dtype, device, elements) of the Reducer's gradient buckets (upstream: compute_bucket_assignment_by_size).

    Parameters are taken in reverse registration order (roughly the order backward produces their gradients),
    grouped by (dtype, device); a bucket closes once it reaches its cap, the first one at `first_cap_bytes`.
    """
    open_buckets: dict[tuple, list[int]] = {}  # key -> [elements, bytes, cap]
    closed: list[tuple[torch.dtype, torch.device, int]] = []
    seen_keys: list[tuple] = []
    for param in reversed(params):
        key = (param.dtype, param.device)
        if key not in open_buckets:
            open_buckets[key] = [0, 0, first_cap_bytes]
            seen_keys.append(key)
        bucket = open_buckets[key]
        bucket[0] += param.numel()
        bucket[1] += param.numel() * param.element_size()
        if bucket[1] >= bucket[2]:
            closed.append((*key, bucket[0]))
            open_buckets[key] = [0, 0, cap_bytes]
    closed.extend((*key, open_buckets[key][0]) for key in seen_keys if open_buckets[key][0])
    return closed


class DistributedDataParallel(nn.Module):
    """Stand-in for torch's DDP: the wrapped module computes; the gradient buckets exist as GPU memory.

    With gradient_as_bucket_view the gradients are views of the buckets, so the buckets cost nothing beyond the
    gradients the trace already records; otherwise they are a second copy of the gradients, allocated here.
    """

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.device_ids = device_ids
        self.gradient_as_bucket_view = gradient_as_bucket_view
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int((bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)
        self._buckets: list[torch.Tensor] = []
        if not gradient_as_bucket_view:
            for dtype, device, elements in bucket_sizes(params, cap):
                bucket = torch.empty(elements, dtype=dtype, device=device)
                _fake_cuda.on_module_tensor(bucket, Category.GRADIENT)
                self._buckets.append(bucket)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def join(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def register_comm_hook(self, state: Any, hook: Any) -> None: ...

    def _set_static_graph(self) -> None: ...
