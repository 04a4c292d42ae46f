"""FSDP as rank 0 of N runs it, traced from small programs (tests/scripts/): FSDP2 (`fully_shard`) with a bf16
MixedPrecisionPolicy under torchrun, and Lightning Fabric's FSDP strategy (FSDP1) and ModelParallelStrategy (FSDP2)
launched as `python train.py --devices N`, FSDP1 and FSDP2 units that mix frozen and trainable parameters (LoRA-like
adapters) under torchrun at world sizes 2, 4 and 8, FSDP1's hybrid strategies over 2 nodes, and how many FSDP1 units
its prefetch settings keep gathered at once. Each category is pinned by figures derived by hand from the layer
shapes and the upstream functions that make each buffer (torch/distributed/fsdp/_fully_shard/ for FSDP2,
_flat_param.py for FSDP1): the fp32 shards (parameters, gradients, AdamW's two moments) and the bf16 unsharded
parameters that live only while their unit runs (freed by `storage.resize_(0)`). This build only: each trace
costs seconds."""

import math
import sys

import pytest

from tests.trace.child.test_scripts import allocs, sizes
from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import by_category, walk
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.events import Category

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what rank 0 allocates: forked warm

FP32, BF16 = 4, 2
TRACES: dict[tuple, object] = {}


def traced(script: str, world: int):
    """One trace per program and world size for the whole module (2 iterations), launched as a user would."""
    key = (script, world)
    if key not in TRACES:
        if script.startswith("fabric"):  # Fabric launches its own ranks: the node has the GPUs it asks for
            TRACES[key] = run_trace([sys.executable, str(SCRIPTS / script), "--devices", str(world)], iterations=2,
                                    device_count=world)
        else:
            TRACES[key] = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / script)], iterations=2)
    return TRACES[key]


# ---- the sharding rules ------------------------------------------------------------------------------------------
def dim0_shard(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's shard of one parameter in FSDP2: torch.chunk along dim 0 gives rank 0 ceil(rows / N)
    rows; FSDPParam._init_sharded_param keeps it in a buffer of that padded size (new_zeros)."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def dim0_padded(shape: tuple[int, ...], world: int) -> int:
    """Elements of one unsharded parameter as FSDP2 all-gathers it: N padded shards (init_all_gather_outputs)."""
    return dim0_shard(shape, world) * world


def live_at_first_step(result) -> dict[str, list[int]]:
    """Sizes of the storages live per category at the first event of iteration 0's optimizer step; just after its
    backward if the step allocated nothing (a rank whose shards hold no trainable element steps nothing)."""
    after_backward = None
    for e, live in walk(result):
        if e.iteration == 0 and e.phase == "optimizer":
            return by_category(live)
        if e.iteration == 0 and e.phase == "backward":
            after_backward = by_category(live)
    assert after_backward is not None, "no backward in iteration 0"
    return after_backward


def peak_live(result, counted, since: int = 0) -> int:
    """The most bytes live at once, from iteration `since` on, among the allocations for which `counted(alloc)`
    holds."""
    return max(sum(alloc.nbytes for alloc in live.values() if counted(alloc))
               for e, live in walk(result) if e.iteration >= since)


def unsharded_per_pass(result, iteration: int, phase: str) -> list[int]:
    return sizes(e for e in allocs(result, Category.UNSHARDED_PARAMETER, phase) if e.iteration == iteration)


def freed_within_their_iteration(result, category: str) -> bool:
    born = {e.block: e.iteration for e in allocs(result, category) if e.iteration >= 0}
    freed = {e.block: e.iteration for e in result.events if e.action == "free" and e.block in born}
    return freed == born


# ---- FSDP2 + MixedPrecisionPolicy(bf16 params, fp32 reduce): fsdp2_mixed_precision.py --------------------------
# 3 blocks (Linear(256, 512), Linear(512, 256)) and a head Linear(256, 10), each its own fully_shard unit; the
# root unit holds no parameter of its own
BLOCK = [(512, 256), (512,), (256, 512), (256,)]
HEAD = [(10, 256), (10,)]
MP_UNITS = [BLOCK] * 3 + [HEAD]


def fsdp2_figures(units: list[list[tuple[int, ...]]], world: int) -> dict[str, list[int]]:
    """What FSDP2 (with a bf16 param_dtype and an fp32 reduce_dtype) keeps on rank 0, from the upstream code:
    - parameter: each fp32 shard (FSDPParam._init_sharded_param);
    - gradient: one fp32 flat buffer per unit, the reduce-scatter output (foreach_reduce: reduce_output in the
      reduce dtype, which is the parameters' dtype, so the sharded grads are views of it);
    - optimizer_state: AdamW's exp_avg and exp_avg_sq, zeros_like each shard (its step counter stays on the CPU);
    - unsharded (bf16): per parameter, N padded shards (FSDPParam.init_all_gather_outputs, regrown by
      alloc_all_gather_outputs and dropped by free_unsharded_param: storage resize_);
    - all_gather (bf16): per unit, the flat all-gather output (foreach_all_gather: all_gather_comm.allocate) and
      rank 0's copy-in (_get_param_all_gather_inputs: flat_foreach_copy_input)."""
    shards = [[dim0_shard(shape, world) for shape in unit] for unit in units]
    unsharded = [[dim0_padded(shape, world) * BF16 for shape in unit] for unit in units]
    return {
        "parameter": sorted(n * FP32 for unit in shards for n in unit),
        "gradient": sorted(sum(unit) * FP32 for unit in shards),
        "optimizer_state": sorted(n * FP32 for unit in shards for n in unit for _moment in range(2)),
        "unsharded": sorted(n for unit in unsharded for n in unit),
        "unit_unsharded": [sum(unit) for unit in unsharded],
        "all_gather": sorted(n for unit in unsharded for n in (sum(unit), sum(unit) // world)),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_mixed_precision_keeps_fp32_shards_and_gathers_bf16_one_unit_at_a_time(world):
    result = traced("fsdp2_mixed_precision.py", world)
    figures = fsdp2_figures(MP_UNITS, world)
    held = live_at_first_step(result)
    assert held["parameter"] == figures["parameter"]  # the fp32 shards alone: no unsharded parameter left
    assert held["gradient"] == figures["gradient"]
    assert Category.UNSHARDED_PARAMETER not in held  # every unit resharded after its backward
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == figures["optimizer_state"]
    for iteration in (0, 1):  # every unit gathered in bf16 for its forward and again for its backward
        for phase in ("forward", "backward"):
            assert unsharded_per_pass(result, iteration, phase) == figures["unsharded"]
    assert freed_within_their_iteration(result, Category.UNSHARDED_PARAMETER)
    # FSDP2 copies a unit's all-gather out into its parameters in that unit's own pre-forward / pre-backward
    # (FSDPParamGroup.wait_for_unshard) and frees them in its reshard, before the next unit's: one unit at a time
    assert peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER) == max(figures["unit_unsharded"])
    # with the flat all-gather buffers: at least a unit's parameters and the next unit's prefetched output; at most
    # also the previous unit's output (kept in forward until the next copy-out) and one copy-in
    gathered = peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER or (
        e.stream != 0 and e.op == "empty" and e.category != "gradient"))
    largest = max(figures["unit_unsharded"])
    assert 2 * largest <= gathered <= 3 * largest + largest // world
    flat = [e for e in allocs(result) if e.iteration == 0 and e.phase == "forward" and e.stream != 0]
    assert sizes(flat) == figures["all_gather"]  # each unit's all-gather output and copy-in, in bf16
    # reduce-scatter in fp32: each unit's bf16 unsharded gradients copied into one fp32 buffer (foreach_reduce)
    scatter_inputs = [e.nbytes for e in allocs(result, phase="backward") if e.iteration == 0 and e.op == "empty"
                      and e.stream == 0]
    assert sorted(scatter_inputs) == sorted(n // BF16 * FP32 for n in figures["unit_unsharded"])
    assert audit(result) == ()


# ---- FSDP2 with frozen and trainable parameters in one unit (fsdp2_lora.py, launched by torchrun) --------------
# Two blocks (a frozen base Linear(256, 256), a trainable rank-8 adapter down (8, 256), up (256, 8)) each a unit, the
# root unit holding the head Linear(256, 16), trainable or frozen; (shape, trainable) in registration order
FSDP2_LORA_BLOCK = [((256, 256), False), ((256,), False), ((8, 256), True), ((256, 8), True)]


def fsdp2_lora_units(frozen: str) -> list[list[tuple[tuple[int, ...], bool]]]:
    head = [((16, 256), "head" not in frozen), ((16,), "head" not in frozen)]
    return [FSDP2_LORA_BLOCK, FSDP2_LORA_BLOCK, head]


def fsdp2_lora_figures(world: int, mp: str, frozen: str, reduce: str = "fp32") -> dict[str, list[int]]:
    """What FSDP2 keeps on rank 0 when a unit mixes frozen and trainable parameters, from the upstream code
    (torch/distributed/fsdp/_fully_shard/): every parameter, frozen or not, is sharded on dim 0 into its own padded
    buffer (FSDPParam._init_sharded_param) and all-gathered whole for the unit's forward and, but for the root
    (not resharded after forward), again for its backward (FSDPParamGroup.unshard gathers all of the group's
    parameters); only the parameters with a gradient are reduced (FSDPParamGroup.post_backward passes
    foreach_reduce those whose grad is set): one fp32 reduce-scatter input of their padded unsharded sizes and one
    output of rank 0's shards of them, whose views are the sharded gradients (fp32 reduce dtype = the parameters'
    dtype); a unit with none reduces nothing and keeps no gradient. AdamW's two moments of the trainable shards
    only. Per unit the flat all-gather output (foreach_all_gather: all_gather_comm.allocate) in the compute dtype,
    and with a bf16 param_dtype the flat bf16 copy of the shards (_get_param_all_gather_inputs: the foreach-copy
    input); in fp32 the shards are the copy-in's inputs as they are. A bf16 reduce_dtype makes the reduce-scatter
    input (and output) bf16 (foreach_reduce: reduce_scatter_comm.allocate(dtype=reduce_dtype)), and the sharded
    gradients the fp32 copy of that output (_to_dtype_if_needed to the parameters' dtype)."""
    compute = BF16 if mp == "bf16" else FP32
    reduced = BF16 if reduce == "bf16" else FP32
    units = fsdp2_lora_units(frozen)
    trained = [[shape for shape, trainable in unit if trainable] for unit in units]
    gathered = [[dim0_padded(shape, world) * compute for shape, _ in unit] for unit in units]
    return {
        "parameter": sorted(dim0_shard(shape, world) * FP32 for unit in units for shape, _ in unit),
        "gradient": sorted(sum(dim0_shard(shape, world) for shape in unit) * FP32 for unit in trained if unit),
        "optimizer_state": sorted(dim0_shard(shape, world) * FP32 for unit in trained for shape in unit
                                  for _moment in range(2)),
        "unsharded_forward": sorted(n for unit in gathered for n in unit),
        "unsharded_backward": sorted(n for unit in gathered[:-1] for n in unit),
        "reduce_input": sorted(sum(dim0_padded(shape, world) for shape in unit) * reduced for unit in trained if unit),
        "all_gather": sorted(n for unit in gathered for n in [sum(unit)] + ([sum(unit) // world] if mp == "bf16"
                                                                           else [])),
    }


@pytest.mark.parametrize("config", [(2, "none", "base", "fp32"), (4, "bf16", "base+head", "fp32"),
                                    (8, "bf16", "base", "fp32"), (2, "bf16", "base", "bf16")],
                         ids=lambda c: "-".join(map(str, c)))
def test_fsdp2_lora_shards_frozen_parameters_but_reduces_and_steps_the_trainable_ones_only(config):
    world, mp, frozen, reduce = config
    key = ("fsdp2_lora.py", *config)
    if key not in TRACES:
        TRACES[key] = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "fsdp2_lora.py"), "--mp", mp,
                                 "--frozen", frozen, "--reduce", reduce], iterations=2)
    result = TRACES[key]
    figures = fsdp2_lora_figures(world, mp, frozen, reduce)
    held = live_at_first_step(result)
    assert held["parameter"] == figures["parameter"]  # the frozen shards too, though no optimizer names them
    assert held["gradient"] == figures["gradient"]
    assert Category.UNSHARDED_PARAMETER not in held
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == figures["optimizer_state"]
    for iteration in (0, 1):
        assert unsharded_per_pass(result, iteration, "forward") == figures["unsharded_forward"]
        assert unsharded_per_pass(result, iteration, "backward") == figures["unsharded_backward"]
        flat = [e for e in allocs(result, phase="forward") if e.iteration == iteration and e.stream != 0]
        assert sizes(flat) == figures["all_gather"]
        scatter_inputs = [e for e in allocs(result, phase="backward") if e.iteration == iteration and e.op == "empty"
                          and e.stream == 0]
        assert sizes(scatter_inputs) == figures["reduce_input"]
    assert audit(result) == ()


def test_fsdp2_hsdp_shards_within_a_node_and_replicates_across_nodes():
    # a 2-D mesh (replicate across 2 nodes, shard over each node's 2 GPUs): FSDPParam shards on the mesh's shard
    # dimension only, and the gradients' all-reduce across the replicas is in place (foreach_reduce)
    result = run_trace(["torchrun", "--nnodes=2", "--nproc_per_node=2", str(SCRIPTS / "fsdp2_lora.py"), "--hsdp", "1"],
                       iterations=2)
    figures = fsdp2_lora_figures(2, "none", "base")
    held = live_at_first_step(result)
    assert held["parameter"] == figures["parameter"] != fsdp2_lora_figures(4, "none", "base")["parameter"]
    assert held["gradient"] == figures["gradient"]
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == figures["optimizer_state"]
    assert unsharded_per_pass(result, 1, "forward") == figures["unsharded_forward"]
    assert audit(result) == ()


# ---- Fabric(strategy="fsdp", precision="bf16-mixed"): FSDP1, the whole model one unit (fabric_fsdp.py) ----------
# Linear(128, 512), GELU, Linear(512, 128), LayerNorm(128), Linear(128, 4): one flat parameter. With
# use_orig_params (Fabric's default) FSDP1 aligns each parameter to 16 bytes (4 fp32 elements): every numel here is
# a multiple of 4, so no padding inside; 132484 elements divide by 2 and 4, so none at the end either
FABRIC_PARAMS = [128 * 512, 512, 512 * 128, 128, 128, 128, 128 * 4, 4]
FLAT = sum(FABRIC_PARAMS)


def views_in_shard(numels: list[int], shard: int) -> list[int]:
    """Elements of each original parameter inside rank 0's shard (the first `shard` elements of the flat
    parameter): with use_orig_params the optimizer steps these views."""
    held, start = [], 0
    for numel in numels:
        inside = min(start + numel, shard) - start
        if inside > 0:
            held.append(inside)
        start += numel
    return held


def test_fabric_fsdp1_bf16_mixed_shards_one_flat_parameter_and_gathers_it_in_bf16():
    world = 2
    result = traced("fabric_fsdp.py", world)
    shard = FLAT // world
    held = live_at_first_step(result)
    # FlatParamHandle.shard: rank 0 keeps the first FLAT / N elements in fp32; its gradient is the fp32 copy of the
    # bf16 reduce-scatter output (_cast_grad_to_param_dtype); the step sees the views of the layers inside the shard
    assert held["parameter"] == [shard * FP32]
    assert held["gradient"] == [shard * FP32]
    assert views_in_shard(FABRIC_PARAMS, shard) == [128 * 512, 512, shard - 128 * 512 - 512]
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == sorted(n * FP32 for n in views_in_shard(FABRIC_PARAMS, shard) for _moment in range(2))
    # each iteration: the bf16 copy of the shard (_mp_shard, FlatParamHandle._use_low_precision_shard) and the bf16
    # unsharded flat parameter (_full_param_padded, _alloc_padded_unsharded_flat_param), both regrown by resize_
    for iteration in (0, 1):
        regrown = [e for e in allocs(result, Category.UNSHARDED_PARAMETER)
                   if e.iteration == iteration and e.op == "resize_"]
        assert sizes(regrown) == sorted([shard * BF16, FLAT * BF16])
    # the first forward's lazy init (FlatParamHandle.init_flat_param_attributes) makes each buffer once and frees
    # it at once (_free_storage): the bf16 shard, the bf16 unsharded and the fp32 unsharded flat parameter (that one
    # for summon_full_params)
    made = [e for e in allocs(result, Category.UNSHARDED_PARAMETER, "forward")
            if e.iteration == 0 and e.op != "resize_"]
    assert sizes(made) == sorted([shard * BF16, FLAT * BF16, FLAT * FP32])
    # in steady state the root unit is not resharded after forward: the unsharded flat parameter lives through
    # forward and backward, the low-precision shard only until its all-gather is done
    unsharded = peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER, since=1)
    assert unsharded == FLAT * BF16 + shard * BF16
    assert freed_within_their_iteration(result, Category.UNSHARDED_PARAMETER)
    assert audit(result) == ()


# ---- Fabric ModelParallelStrategy + fully_shard with a bf16 policy, meta-device init (fabric_fsdp2.py) ----------
# 2 blocks (LayerNorm(256), Linear(256, 1024), GELU, Linear(1024, 256)) each a unit; the root unit holds the head
# Linear(256, 8)
FABRIC_BLOCK = [(256,), (256,), (1024, 256), (1024,), (256, 1024), (256,)]
FABRIC_UNITS = [FABRIC_BLOCK] * 2 + [[(8, 256), (8,)]]


def test_fabric_model_parallel_fsdp2_materialises_shards_and_keeps_the_root_unit_gathered():
    world = 4
    result = traced("fabric_fsdp2.py", world)
    figures = fsdp2_figures(FABRIC_UNITS, world)
    held = live_at_first_step(result)
    # fabric.setup: fully_shard on the meta model, then to_empty + reset_parameters make the fp32 shards only
    assert held["parameter"] == figures["parameter"]
    assert sizes(allocs(result, "parameter")) == figures["parameter"]  # never the whole model on one GPU
    assert held["gradient"] == figures["gradient"]
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == figures["optimizer_state"]
    blocks = fsdp2_figures(FABRIC_UNITS[:-1], world)["unsharded"]
    for iteration in (0, 1):
        assert unsharded_per_pass(result, iteration, "forward") == figures["unsharded"]
        # the root unit is not resharded after forward: only the blocks are gathered again for backward
        assert unsharded_per_pass(result, iteration, "backward") == blocks
    # the root's gathered head stays while each block is gathered in turn
    root_bytes, block_bytes = figures["unit_unsharded"][-1], figures["unit_unsharded"][0]
    assert peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER) == root_bytes + block_bytes
    assert audit(result) == ()


# ---- FSDP1 with frozen and trainable parameters in one unit (fsdp1_lora.py, launched by torchrun) --------------
# Two units of a frozen base Linear(256, 256) beside a trainable rank-8 adapter (256->8, 8->256, no bias), then the
# root unit holding a trainable head Linear(256, 16); AdamW over the trainable parameters only. Every numel is a
# multiple of 4 (use_orig_params aligns each parameter to 16 bytes: no padding inside) and each flat parameter
# divides by 8 (no padding at its end).
LORA_BLOCK = [(256 * 256, False), (256, False), (8 * 256, True), (256 * 8, True)]  # (numel, trainable) in order
LORA_HEAD = [(16 * 256, True), (16, True)]
LORA_UNITS = [LORA_BLOCK, LORA_BLOCK, LORA_HEAD]  # in forward order


def trained(frozen: str) -> list[list[tuple[int, bool]]]:
    """The units' (numel, trainable) as the script's --frozen leaves them: "base" (LoRA), "none", "base+head"."""
    block = LORA_BLOCK if "base" in frozen else [(numel, True) for numel, _ in LORA_BLOCK]
    head = [(numel, "head" not in frozen) for numel, _ in LORA_HEAD]
    return [block, block, head]


def fsdp1_figures(world: int, orig: bool, strategy: str, mp: str, reduce: str, frozen: str,
                  nodes: int = 1) -> dict[str, list[int]]:
    """What FSDP1 keeps on rank 0, from the upstream code (torch/distributed/fsdp/_flat_param.py, _runtime_utils.py):
    - parameter: each unit's fp32 flat parameter, sharded (FlatParamHandle._get_shard: ceil(numel / N) elements,
      the whole of it under NO_SHARD; N the world, or under the hybrid strategies the GPUs of one node: upstream's
      _init_intra_node_process_group shards over dist.new_subgroups(device_count()), and the replicas' sharded
      gradients are all-reduced in place across the nodes, _reduce_grad);
    - gradient: each unit's sharded fp32 gradient. Its flat parameter requires grad when any of its parameters
      does (_validate_tensors_to_flatten), so the whole shard has a gradient, frozen elements included (a unit of
      frozen parameters only has none, and is resharded at the end of backward: _catch_all_reshard); it is the
      reduce-scatter output (_get_reduce_scatter_tensors: empty_like(chunks[0])), cast to fp32 after a bf16 reduce
      (_cast_grad_to_param_dtype). NO_SHARD all-reduces the unsharded gradient in place and keeps it;
    - optimizer_state: AdamW's two moments of what it steps: with use_orig_params, the views of the trainable
      parameters inside rank 0's shard (_use_sharded_views; a frozen view gets no gradient: _use_sharded_grad_views),
      else the flat parameter's shard;
    - unsharded (forward of a steady iteration): per unit the full flat parameter in the compute dtype
      (_alloc_padded_unsharded_flat_param), and with mixed precision the low-precision copy of the shard
      (_use_low_precision_shard). FULL_SHARD and HYBRID_SHARD gather the blocks again for backward, not the root
      (_should_free_in_backward / the root is not resharded after forward); SHARD_GRAD_OP and
      _HYBRID_SHARD_ZERO2 keep them (NO_RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES);
    - reduce (backward, per unit in autograd's order): the unit's unsharded gradient, full size in the compute dtype:
      autograd's backward of the views (_get_unflat_views: split) concatenates every view's gradient, frozen ones
      included; then, on the post-backward stream, its copy in an fp32 reduce dtype (_post_backward_hook) and the
      reduce-scatter output, or the bf16 output and its fp32 cast."""
    compute = BF16 if mp == "bf16" else FP32
    reduce_bytes = BF16 if mp == "bf16" and reduce == "bf16" else FP32
    units = trained(frozen)
    numels = [sum(numel for numel, _ in unit) for unit in units]
    has_grad = [any(trainable for _, trainable in unit) for unit in units]
    sharded = strategy != "NO_SHARD"
    group = world // nodes if "HYBRID" in strategy else world
    shards = [math.ceil(n / group) if sharded else n for n in numels]
    state = []
    for unit, shard in zip(units, shards):
        if not orig:
            state += [shard * FP32] * 2
            continue
        start = 0
        for numel, trainable in unit:
            inside = max(0, min(start + numel, shard) - start)
            state += [inside * FP32] * 2 if trainable and inside else []
            start += numel
    gathered = [n * compute for n in numels] + ([s * BF16 for s in shards] if mp == "bf16" else [])
    regathered = [n * compute for n in numels[:-1]] + ([s * BF16 for s in shards[:-1]] if mp == "bf16" else [])
    if not sharded:  # nothing gathered; with bf16 params the whole low-precision copy (_mp_shard) is the unsharded
        # parameter, made before each forward and backward and freed at every reshard (post_reshard), the root's too
        gathered = regathered = [n * BF16 for n in numels] if mp == "bf16" else []
    reduce = []
    per_unit = [(n, s) for n, s, grad in zip(numels, shards, has_grad) if grad]
    # autograd runs the views' backward latest made first: the blocks in reverse, then the root, whose views were
    # made first (it unshards before its children)
    for numel, shard in (per_unit[-2::-1] + per_unit[-1:]) if has_grad[-1] else per_unit[::-1]:
        reduce.append(numel * compute)
        if not sharded:  # all-reduced in place; a bf16 gradient is cast to fp32 once: before a fp32 reduce, or
            # after a bf16 one (_cast_grad_to_param_dtype)
            reduce += [numel * FP32] if compute != FP32 else []
            continue
        if compute != reduce_bytes:  # the unsharded gradient cast to the fp32 reduce dtype
            reduce.append(numel * reduce_bytes)
        reduce.append(shard * reduce_bytes)
        if reduce_bytes != FP32:  # the bf16 reduce-scatter output cast back to the fp32 parameters' dtype
            reduce.append(shard * FP32)
    return {
        "parameter": sorted(s * FP32 for s in shards),
        "gradient": sorted(s * FP32 for s, grad in zip(shards, has_grad) if grad),
        "optimizer_state": sorted(state),
        "unsharded_forward": sorted(gathered),
        "unsharded_backward": sorted(regathered) if strategy in ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD") else [],
        "reduce": reduce,
    }


# (world, use_orig_params, sharding_strategy, param dtype, reduce dtype, what is frozen): use_orig_params=False
# refuses a unit that mixes frozen and trainable parameters (_validate_tensors_to_flatten), so it trains them all;
# "base+head" leaves the root unit without a trainable parameter, as peft's get_peft_model freezes a head
FSDP1_CONFIGS = [
    (2, True, "FULL_SHARD", "none", "fp32", "base"),
    (4, True, "FULL_SHARD", "bf16", "fp32", "base+head"),
    (8, True, "SHARD_GRAD_OP", "bf16", "bf16", "base"),
    (2, True, "NO_SHARD", "none", "fp32", "base"),
    (4, False, "FULL_SHARD", "bf16", "bf16", "none"),
    # the same rules at the other worlds (coverage.md): use_orig_params=False at 2 and 8, SHARD_GRAD_OP at 2 and 4,
    # NO_SHARD at 4 and 8 (every rank holds every flat parameter whole, whatever the world)
    (2, False, "SHARD_GRAD_OP", "bf16", "fp32", "none"),
    (4, True, "SHARD_GRAD_OP", "bf16", "bf16", "base"),
    (4, True, "NO_SHARD", "none", "fp32", "base+head"),
    (8, False, "NO_SHARD", "none", "fp32", "none"),
    (4, True, "NO_SHARD", "bf16", "fp32", "base"),  # the bf16 copy is the unsharded parameter; fp32 reduce
]


def fsdp1_traced(world: int, orig: bool, strategy: str, mp: str, reduce: str, frozen: str, nodes: int = 1):
    key = ("fsdp1_lora.py", world, orig, strategy, mp, reduce, frozen, nodes)
    if key not in TRACES:  # rank 0 of `nodes` nodes of world / nodes GPUs each
        TRACES[key] = run_trace(["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={world // nodes}",
                                 str(SCRIPTS / "fsdp1_lora.py"),
                                 "--orig", str(int(orig)), "--strategy", strategy, "--mp", mp, "--reduce", reduce,
                                 "--frozen", frozen], iterations=2)
    return TRACES[key]


def reduce_allocations(result, iteration: int) -> list[int]:
    """In one backward pass, in order: each unit's unsharded gradient (autograd's cat of its views' gradients) and
    what the post-backward stream allocates to reduce it."""
    return [e.nbytes for e in allocs(result, phase="backward") if e.iteration == iteration
            and e.category != Category.UNSHARDED_PARAMETER and (e.op == "cat" or e.stream != 0)]


def assert_as_fsdp1_figures(result, figures: dict[str, list[int]]) -> None:
    """The trace holds what `fsdp1_figures` derives: at the first step the sharded flat parameters and gradients
    (frozen elements' gradients included) and no unsharded parameter (every unit resharded, one without gradients
    too), the optimizer state of the first step, and a steady iteration's gathers and reduce buffers."""
    held = live_at_first_step(result)
    assert held["parameter"] == figures["parameter"]
    assert held["gradient"] == figures["gradient"]
    assert Category.UNSHARDED_PARAMETER not in held
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == figures["optimizer_state"]
    assert unsharded_per_pass(result, 1, "forward") == figures["unsharded_forward"]
    assert unsharded_per_pass(result, 1, "backward") == figures["unsharded_backward"]
    assert reduce_allocations(result, 1) == figures["reduce"]


@pytest.mark.parametrize("config", FSDP1_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_fsdp1_keeps_whole_sharded_gradients_of_units_that_mix_frozen_and_trainable_parameters(config):
    world, orig, strategy, mp, reduce, frozen = config
    result = fsdp1_traced(*config)
    assert_as_fsdp1_figures(result, fsdp1_figures(*config))
    reasons = audit(result)
    if orig and frozen != "none" and strategy != "NO_SHARD":
        # the adapters lie at the end of each block's flat parameter: the last rank's shard holds them, rank 0's
        # only frozen weights, so the last rank keeps 2 x 2 x 4096 fp32 moments more than the traced rank
        assert f"rank {world - 1}'s shards hold {2 * 2 * 4096 * FP32} bytes more" in reasons[0]
        # with the head frozen too, rank 0 steps nothing at all
        assert len(reasons) == (2 if "head" in frozen else 1)
    else:
        assert reasons == ()


# Lightning Fabric's FSDP strategy over the same model (fabric_fsdp_lora.py: Fabric sets use_orig_params=True, the
# blocks wrapped whole by auto_wrap_policy={Adapted}, as a LoRA recipe wraps its transformer blocks): each block's
# flat parameter holds its frozen base beside its adapter and requires grad as a whole (_validate_tensors_to_flatten;
# torch's FSDP docs: the memory is "equivalent to not freezing those parameters"), so rank 0 holds the gradient of
# its whole shard, frozen elements included, and autograd makes the whole unsharded gradient in backward.
# Fabric's precision -> (MixedPrecision param dtype, reduce dtype) in fsdp1_figures' terms (FSDPPrecision:
# "32-true" asks for fp32, the parameters' own dtype, so no low-precision copy: as no MixedPrecision at all)
FABRIC_LORA = {"32-true": ("none", "fp32"), "bf16-mixed": ("bf16", "bf16")}
# each run's (precision, script options); with activation checkpointing of each block (as LoRA recipes set it, the
# checkpoint inside the unit) the same figures hold: the recompute in backward uses the gathered flat parameter
FABRIC_LORA_RUNS = {"32-true": ("32-true",), "bf16-mixed": ("bf16-mixed",), "32-true+ac": ("32-true", "--ac", "1")}


def fabric_lora_traced(precision: str, *options: str):
    world = 2
    key = ("fabric_fsdp_lora.py", world, precision, *options)
    if key not in TRACES:  # Fabric launches its own ranks: the node has the GPUs it asks for
        TRACES[key] = run_trace([sys.executable, str(SCRIPTS / "fabric_fsdp_lora.py"), "--devices", str(world),
                                 "--precision", precision, *options], iterations=2, device_count=world)
    return world, TRACES[key]


@pytest.mark.parametrize("run", FABRIC_LORA_RUNS)
def test_fabric_fsdp1_lora_keeps_the_whole_gradient_of_units_that_mix_frozen_and_trainable_parameters(run):
    precision, *options = FABRIC_LORA_RUNS[run]
    world, result = fabric_lora_traced(precision, *options)
    figures = fsdp1_figures(world, True, "FULL_SHARD", *FABRIC_LORA[precision], "base")
    assert_as_fsdp1_figures(result, figures)
    # the blocks' gradients are their whole shards: 34944 elements each, of which rank 0's trainable ones are none
    # (the adapters lie at the end of each flat parameter, in rank 1's shard)
    block_shard = sum(numel for numel, _ in LORA_BLOCK) // world
    assert figures["gradient"] == sorted([block_shard * FP32] * 2 + [(16 * 256 + 16) // world * FP32])
    reasons = audit(result)
    assert len(reasons) == 1 and f"rank {world - 1}'s shards hold {2 * 2 * 4096 * FP32} bytes more" in reasons[0]


def test_fabric_fsdp1_lora_bf16_true_from_the_meta_device_keeps_every_figure_in_bf16():
    """precision="bf16-true" with fabric.init_module(empty_init=True): built on the meta device in bf16, materialised
    by FSDP; MixedPrecision's bf16 equals the parameters' dtype, so nothing is cast and no low-precision copy is made:
    each figure of "32-true" at half the bytes (parameters, whole-shard gradients, AdamW's moments, gathers, the
    unsharded gradient and its reduce-scatter output all bf16)."""
    world, result = fabric_lora_traced("bf16-true", "--empty-init", "1")
    figures = fsdp1_figures(world, True, "FULL_SHARD", "none", "fp32", "base")
    assert_as_fsdp1_figures(result, {name: [n * BF16 // FP32 for n in sizes_] for name, sizes_ in figures.items()})


def test_fsdp1_mixed_precision_buffer_dtype_keeps_each_buffer_whole_in_bf16_on_every_rank():
    # fsdp1_lora.py --buffers 1: each block holds an fp32 buffer of 256 elements. FSDP1 flattens parameters only:
    # buffers stay whole on every rank, whatever the world. The root's lazy init (_lazy_init:
    # _cast_buffers_to_dtype_and_device) sets each buffer's .data to a copy in MixedPrecision.buffer_dtype, so the
    # fp32 storage (made by model.cuda()) goes and a bf16 one stays through training; the flat parameters, gradients,
    # gathers and reduce buffers are those of the same configuration without buffers
    world, config = 8, (8, True, "FULL_SHARD", "bf16", "fp32", "base")
    result = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "fsdp1_lora.py"), "--strategy",
                        "FULL_SHARD", "--mp", "bf16", "--reduce", "fp32", "--frozen", "base", "--buffers", "1"],
                       iterations=2)
    assert_as_fsdp1_figures(result, fsdp1_figures(*config))
    assert live_at_first_step(result)["buffer"] == [256 * BF16] * 2
    made = allocs(result, Category.BUFFER)
    freed = {e.block for e in result.events if e.action == "free"}
    assert sorted(e.nbytes for e in made if e.block in freed) == [256 * FP32] * 2  # the fp32 originals, cast once
    assert sorted(e.nbytes for e in made if e.block not in freed) == [256 * BF16] * 2
    reasons = audit(result)  # the adapters lie in the last rank's shards, as in FSDP1_CONFIGS
    assert len(reasons) == 1 and f"rank {world - 1}'s shards hold {2 * 2 * 4096 * FP32} bytes more" in reasons[0]


# (world, nodes, use_orig_params, hybrid strategy, param dtype, reduce dtype): LoRA-like units (base frozen)
HYBRID_CONFIGS = [
    (4, 2, True, "HYBRID_SHARD", "none", "fp32"),
    (8, 2, True, "_HYBRID_SHARD_ZERO2", "bf16", "bf16"),
    (8, 2, True, "HYBRID_SHARD", "bf16", "fp32"),  # 2 x 4: the blocks gathered again for backward
    (4, 2, True, "_HYBRID_SHARD_ZERO2", "none", "fp32"),  # 2 x 2: kept from forward to backward
]


@pytest.mark.parametrize("config", HYBRID_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_fsdp1_hybrid_shard_shards_within_a_node_only(config):
    world, nodes, orig, strategy, mp, reduce = config
    result = fsdp1_traced(world, orig, strategy, mp, reduce, "base", nodes=nodes)
    figures = fsdp1_figures(world, orig, strategy, mp, reduce, "base", nodes=nodes)
    # each rank keeps 1 / (GPUs per node) of every flat parameter and of its gradient, not 1 / world; the inter-node
    # all-reduce of the sharded gradient is in place: nothing beyond the reduce-scatter's buffers
    assert figures["parameter"] != fsdp1_figures(world, orig, "FULL_SHARD", mp, reduce, "base")["parameter"]
    assert_as_fsdp1_figures(result, figures)
    # the adapters lie in the last shard of the node's group: its last rank steps 2 x 2 x 4096 fp32 moments more
    reasons = audit(result)
    assert len(reasons) == 1 and f"rank {world // nodes - 1}'s shards hold {2 * 2 * 4096 * FP32} bytes more" in \
        reasons[0]


@pytest.mark.parametrize("config", [("HYBRID_SHARD", "none", "fp32"), ("_HYBRID_SHARD_ZERO2", "bf16", "bf16")],
                         ids=lambda c: "-".join(c))
def test_fsdp1_hybrid_over_nodes_of_one_gpu_keeps_everything_whole(config):
    # 2 nodes x 1 GPU: the hybrid strategies shard over the node's group, here of one rank, and upstream's
    # _init_core_state clamps any strategy to NO_SHARD when that group's size is 1. So each rank holds every flat
    # parameter and gradient whole, as NO_SHARD does at any world, and gathers nothing; the gradient is all-reduced
    # over the node's group of one (in place, no buffer)
    strategy, mp, reduce = config
    result = fsdp1_traced(2, True, strategy, mp, reduce, "base", nodes=2)
    assert_as_fsdp1_figures(result, fsdp1_figures(2, True, "NO_SHARD", mp, reduce, "base"))
    assert audit(result) == ()  # whole shards: every rank steps the same adapters


# (forward_prefetch, backward_prefetch, limit_all_gathers) -> the most blocks gathered at once in a steady forward and
# backward (iteration 1), besides the root unit, which FULL_SHARD keeps gathered from its forward to the end of
# backward: three LoRA-like blocks at world 2 (4 and 8 for two of them), each a unit. Upstream (_runtime_utils):
# - forward: a unit is gathered in its pre-forward (_pre_forward_unshard) and freed in its post-forward; with
#   forward_prefetch that pre-forward also gathers the next unit of the first iteration's order
#   (_prefetch_handle, get_handle_to_forward_prefetch; none in the first iteration, whose order is being recorded):
#   1 block, or 2;
# - backward: a unit is gathered in its pre-backward hook (unless prefetched) and freed in its post-backward hook,
#   which runs once autograd reaches the split of its flat parameter into views (_use_unsharded_views); autograd
#   runs ready nodes latest made first. BACKWARD_PRE gathers the previous unit in the pre-backward hook, after this
#   one; BACKWARD_POST in the post-backward hook, after freeing this one. Without forward_prefetch a unit's views are
#   made after the previous unit's forward ops, so its post-backward runs before the previous unit's ops: 2 blocks
#   (PRE) or 1 (POST). With forward_prefetch a unit's views are made in the previous unit's pre-forward, before that
#   unit's ops, whose backward (and pre-backward hook, which gathers it) therefore runs before this unit is freed:
#   one more, 3 (PRE) or 2 (POST);
# - limit_all_gathers only makes the host wait for a GPU event before an all-gather (_unshard: the rate limiter): the
#   allocations and frees come in the same order, so it changes none of these.
PREFETCH_CONFIGS = {  # (forward_prefetch, backward_prefetch, limit_all_gathers, world): none of it depends on world
    (False, "PRE", True, 2): (1, 2),
    (True, "PRE", True, 2): (2, 3),
    (True, "POST", True, 2): (2, 2),
    (False, "POST", False, 2): (1, 1),
    (True, "PRE", False, 4): (2, 3),
    (False, "POST", True, 8): (1, 1),
}


def most_alive_at_once(result, iteration: int, phase: str, nbytes: int) -> int:
    return max(sum(alloc.nbytes == nbytes and alloc.category == Category.UNSHARDED_PARAMETER for alloc in live.values())
               for e, live in walk(result) if e.iteration == iteration and e.phase == phase)


@pytest.mark.parametrize("config", PREFETCH_CONFIGS, ids=lambda c: "fwd{:d}-{}-limit{:d}-w{}".format(*c))
def test_fsdp1_prefetch_settings_set_how_many_units_are_gathered_at_once(config):
    forward_prefetch, backward_prefetch, limit, world = config
    blocks = 3
    result = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "fsdp1_lora.py"), "--blocks",
                        str(blocks), "--forward-prefetch", str(int(forward_prefetch)), "--backward-prefetch",
                        backward_prefetch, "--limit", str(int(limit))], iterations=2)
    block = math.ceil(sum(numel for numel, _ in LORA_BLOCK) / world) * world * FP32  # the padded unsharded flat
    root = math.ceil(sum(numel for numel, _ in LORA_HEAD) / world) * world * FP32
    assert block != root
    forward, backward = PREFETCH_CONFIGS[config]
    assert most_alive_at_once(result, 1, "forward", block) == forward
    assert most_alive_at_once(result, 1, "backward", block) == backward
    # the root unit stays gathered beside them: the peak of all gathered parameters is theirs and its
    assert peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER, since=1) == \
        root + max(forward, backward) * block
