"""CPU offload, as rank 0 of N runs it under torchrun: FSDP1's `CPUOffload(offload_params=True)`, FSDP2's
`CPUOffloadPolicy` (pinned or pageable host memory) and DeepSpeed ZeRO-Offload (`offload_optimizer`, and ZeRO-3's
`offload_param`, to the CPU); FSDP1 and FSDP2 in fp32 and with bf16 mixed precision, DeepSpeed's engine in bf16.
The host keeps the shards, their gradients and the optimizer; the GPU holds what each upstream moves there for a
while: the units or parameters in flight, the gradients during backward, and ZeRO's own buffers. Each figure is
derived by hand from the layer shapes and the upstream function that makes the buffer
(torch/distributed/fsdp/_flat_param.py and _runtime_utils.py for FSDP1, _fully_shard/ for FSDP2,
deepspeed/runtime/zero/stage_1_and_2.py and stage3.py). One trace per configuration, shared by the module's tests
(2 iterations each; the numbers are those of the second, steady one)."""

import math

import pytest

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import walk
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.events import FACT_OFFLOADED, Category

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what rank 0 allocates: forked warm

FP32, BF16, FP64 = 4, 2, 8
BATCH, WIDTH = 8, 256

# tests/scripts/fsdp_offload.py: Linear(256, 256), ReLU, Linear(256, 256), ReLU, Linear(256, 16), each Linear one
# FSDP unit (L0, L2, head) under a root that holds no parameter; fp32; AdamW
LINEARS = [(256, 256), (256, 256), (16, 256)]  # (out, in) of L0, L2, head
UNIT_NUMELS = [rows * cols + rows for rows, cols in LINEARS]  # weight + bias: 65792, 65792, 4112

# configuration -> (world size, script, its options)
FSDP_CONFIGS = {
    "fsdp1-w2": (2, "fsdp_offload.py", ("--fsdp", "1", "--orig", "0", "--device-id", "0")),
    "fsdp1-orig-params-w4": (4, "fsdp_offload.py", ("--fsdp", "1", "--orig", "1", "--device-id", "1")),
    "fsdp2-pinned-w2": (2, "fsdp_offload.py", ("--fsdp", "2", "--pin", "1")),
    "fsdp2-pageable-w4": (4, "fsdp_offload.py", ("--fsdp", "2", "--pin", "0")),
    # with mixed precision: bf16 parameters, fp32 reduce
    "fsdp1-bf16-w2": (2, "fsdp_offload.py", ("--fsdp", "1", "--orig", "0", "--device-id", "0", "--mp", "bf16")),
    "fsdp1-bf16-w8": (8, "fsdp_offload.py", ("--fsdp", "1", "--orig", "0", "--device-id", "1", "--mp", "bf16")),
    "fsdp2-bf16-pinned-w4": (4, "fsdp_offload.py", ("--fsdp", "2", "--pin", "1", "--mp", "bf16")),
    "fsdp2-bf16-pageable-w8": (8, "fsdp_offload.py", ("--fsdp", "2", "--pin", "0", "--mp", "bf16")),
}


@pytest.fixture(scope="module", params=list(FSDP_CONFIGS))
def fsdp(request):
    world, script, options = FSDP_CONFIGS[request.param]
    result = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / script), *options], iterations=2)
    return request.param, world, result


# ---- reading a trace ---------------------------------------------------------------------------------------------
def held_after_first_step(result) -> dict[str, int]:
    """Bytes live per category once iteration 0 is over (its optimizer step done), before iteration 1's first event."""
    held: dict[str, int] = {}
    for e, live in walk(result):
        if e.iteration >= 1:
            break
        held = {}
        for alloc in live.values():
            held[alloc.category] = held.get(alloc.category, 0) + alloc.nbytes
    return held


def steady_peak(result) -> int:
    """The most GPU bytes live at once during iteration 1."""
    return max(sum(a.nbytes for a in live.values()) for e, live in walk(result) if e.iteration == 1)


def made(result, phase: str, op: str | None = None, stream=None, iteration: int = 1) -> list[int]:
    """Sizes of the storages iteration `iteration` made in `phase` by `op` (any), on `stream` (any; "side": any
    stream but the default one)."""
    return sorted(e.nbytes for e in result.events if e.action == "alloc" and e.iteration == iteration
                  and e.phase == phase and op in (None, e.op)
                  and (stream is None or (e.stream != 0 if stream == "side" else e.stream == stream)))


# ---- FSDP1: CPUOffload(offload_params=True) ----------------------------------------------------------------------
def fsdp1_shard(numel: int, world: int) -> int:
    """Elements of rank 0's shard of a unit's flat parameter (FlatParamHandle._get_shard: torch.chunk over the
    world, padded to the first chunk's size); every parameter numel here is a multiple of 4, so use_orig_params'
    16-byte alignment adds no padding inside."""
    return math.ceil(numel / world)


def fsdp1_figures(world: int, orig: bool, bf16: bool = False) -> dict[str, object]:
    """Per unit, in its order: `copy_in`, the host shard copied to the GPU before each all-gather (pre_unshard ->
    flat_param_to(device), on the pre-unshard stream); `unsharded`, the padded all-gather output
    (_full_param_padded, regrown by resize_); `flat_grad`, the unsharded flat gradient autograd makes (the cat of
    the views' gradients: unpadded numel); `reduced`, the reduce-scatter output (_get_reduce_scatter_tensors:
    empty_like one chunk), kept in `_saved_grad_shard` until the end of backward after its copy to `_cpu_grad`.
    `peak`: the most bytes live in a steady iteration, in L2's backward as its flat gradient is made: L2's and the
    prefetched L0's unsharded parameters (BACKWARD_PRE: the next unit is all-gathered in this one's pre-backward),
    the head's reduce-scatter output, L2's flat gradient and, before the cat frees them, the gradients of its
    weight and bias and of its input; the batch (saved by L0) and the first ReLU's output (saved by L2 and by
    itself); the loss and its ones_like. With use_orig_params the copy-ins of L2 and L0 are live too: the original
    parameters view the GPU copy of the shard (flat_param_to -> _use_sharded_views) until the unit reshards.

    With bf16 parameters (MixedPrecision, fp32 reduce; use_orig_params off) the shard is cast on the GPU first:
    _use_low_precision_shard regrows `_mp_shard` (bf16, resize_) and copies the fp32 copy-in into it, and the
    all-gather output, the activations, the flat gradient and the loss are bf16. The post-backward hook casts each
    flat gradient to the fp32 reduce dtype (`flat_param.grad.to(_reduce_dtype)`, on the post-backward stream) while
    its local `autograd_computed_grad` keeps the bf16 one to the hook's end. So the peak moves to L2's
    reduce-scatter output: L0's unsharded parameter (L2's is resharded first, _post_backward_reshard), L2's bf16
    flat gradient and its fp32 cast, L2's and the head's reduce-scatter outputs; the bf16 input (the batch cast by
    _cast_forward_inputs, saved by L0), the first ReLU's output and the gradient of L2's input; the loss and its
    ones_like."""
    compute = BF16 if bf16 else FP32
    shards = [fsdp1_shard(n, world) for n in UNIT_NUMELS]
    unsharded = [world * s * compute for s in shards]
    w, b = LINEARS[1][0] * LINEARS[1][1] * FP32, LINEARS[1][0] * FP32
    activation = BATCH * WIDTH * compute
    if bf16:
        peak = (unsharded[0] + UNIT_NUMELS[1] * (BF16 + FP32) + (shards[1] + shards[2]) * FP32 + 3 * activation
                + 2 * BF16)
    else:
        peak = (unsharded[1] + unsharded[0] + shards[2] * FP32 + UNIT_NUMELS[1] * FP32 + w + b + activation
                + 2 * activation + 2 * FP32)
    if orig:
        peak += shards[1] * FP32 + shards[0] * FP32
    mp_shards = [s * BF16 for s in shards] if bf16 else []  # _mp_shard, regrown by resize_ as the gathers are
    return {"copy_in": [s * FP32 for s in shards], "unsharded": unsharded + mp_shards,
            "flat_grad": [n * compute for n in UNIT_NUMELS], "reduced": [s * FP32 for s in shards],
            "cast": [n * FP32 for n in UNIT_NUMELS] if bf16 else [], "peak": peak}


# ---- FSDP2: fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=...)) ----------------------------------------
def fsdp2_shard(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's padded shard of one parameter (FSDPParam._init_sharded_param: ceil(rows / N) rows),
    which `.cpu()` moves to the host (and pin_memory pins there: host memory either way)."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def fsdp2_figures(world: int, bf16: bool = False) -> dict[str, object]:
    """Per parameter: `copy_in`, its host shard copied to the GPU as the all-gather input (FSDPParam.
    all_gather_inputs: `.to(device, non_blocking=True)`; no foreach copy-in under offload); `unsharded`, its
    N padded shards (init_all_gather_outputs / alloc_all_gather_outputs). Per unit: `gathered`, the flat all-gather
    output (foreach_all_gather), and in backward `reduce_in`, the reduce-scatter input of the padded unsharded
    gradients (foreach_reduce), `reduce_out` its output, whose views are copied to the host (`.to("cpu")`) and
    dropped at once. `peak`: the most bytes live in a steady iteration, in L2's backward as its bias gradient is
    made: L2's unsharded parameters, L0's all-gather output (prefetched in L2's pre-backward), the head's
    reduce-scatter input (held until the next reduce-scatter: FSDPCommContext's reduce_scatter_state), the
    gradients of L2's weight, bias and input and the gradient flowing into L2 (the second ReLU's backward); the
    batch and the first ReLU's output; the loss and its ones_like.

    With bf16 parameters (MixedPrecisionPolicy, fp32 reduce) all_gather_inputs casts each copied-in shard to bf16
    (`.to(param_dtype)`), and the all-gather outputs, the unsharded parameters, their gradients, the activations
    (the batch cast by cast_forward_inputs) and the loss are bf16; the reduce-scatter input and output are in the
    fp32 reduce dtype. Then the peak is at L2's reduce-scatter input: post_backward has resharded L2 and released
    the head's input first (at most reduce_scatter_max_input_buffers, 1, kept), and L2's bf16 weight and bias
    gradients stay until foreach_reduce copies them in; with L0's all-gather output (prefetched), the bf16 batch,
    the first ReLU's output and the gradient of L2's input, the loss and its ones_like."""
    compute = BF16 if bf16 else FP32
    params = [[(rows, cols), (rows,)] for rows, cols in LINEARS]
    shards = [[fsdp2_shard(shape, world) for shape in unit] for unit in params]
    w, b = LINEARS[1][0] * LINEARS[1][1] * compute, LINEARS[1][0] * compute
    activation = BATCH * WIDTH * compute
    gathered = [world * sum(unit) * compute for unit in shards]
    reduce_in = [world * sum(unit) * FP32 for unit in shards]
    if bf16:
        peak = reduce_in[1] + gathered[0] + w + b + 3 * activation + 2 * BF16
    else:
        peak = (sum(world * s * FP32 for s in shards[1]) + gathered[0] + gathered[2] + w + b + 2 * activation
                + 2 * activation + 2 * FP32)
    copied = (FP32, BF16) if bf16 else (FP32,)  # each shard copied in, then (bf16) cast, on the copy-in stream
    return {"copy_in": sorted(s * size for unit in shards for s in unit for size in copied),
            "unsharded": sorted(world * s * compute for unit in shards for s in unit),
            "gathered": sorted(gathered), "reduce_in": sorted(reduce_in),
            "reduce_out": sorted(sum(unit) * FP32 for unit in shards), "peak": peak}


def test_offloaded_fsdp_keeps_no_parameter_gradient_or_optimizer_state_on_the_gpu(fsdp):
    config, world, result = fsdp
    held = held_after_first_step(result)
    # between steps nothing of the model is on the GPU: the shards, their gradients and AdamW's moments are on the
    # host (FSDP1: _local_shard, _cpu_grad; FSDP2: the sharded DTensors and their .to("cpu") gradients)
    assert not {Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE,
                Category.UNSHARDED_PARAMETER} & set(held), held
    assert sum(held.values()) <= 2 * FP32  # the last loss and its ones_like at most
    assert made(result, "optimizer", iteration=0) == made(result, "optimizer") == []  # the step runs on the host
    # the audit knows the stepped parameters are host shards, which a GPU step without a GPU parameter needs
    assert audit(result) == ()
    assert any(f.what == FACT_OFFLOADED and "FSDP's CPU offload" in f.source for f in result.facts)


def test_offloaded_fsdp_moves_each_unit_to_the_gpu_only_while_it_runs(fsdp):
    config, world, result = fsdp
    bf16 = "bf16" in config
    if config.startswith("fsdp1"):
        figures = fsdp1_figures(world, orig="orig" in config, bf16=bf16)
        for phase in ("forward", "backward"):  # every unit gathered for its forward and again for its backward
            casts = figures["cast"] if phase == "backward" else []  # the flat gradients cast to the reduce dtype
            assert made(result, phase, "_to_copy", "side") == sorted(figures["copy_in"] + casts)
            assert made(result, phase, "resize_") == sorted(figures["unsharded"])
        assert made(result, "backward", "cat") == sorted(figures["flat_grad"])
        assert made(result, "backward", "empty_like", "side") == sorted(figures["reduced"])
        # the reduce-scatter outputs live until the end of backward (_finalize_params: _cpu_grad becomes .grad)
        reduced = {e.block for e in result.events if e.action == "alloc" and e.iteration == 1
                   and e.op == "empty_like" and e.stream != 0}
        last_made = max(i for i, e in enumerate(result.events) if e.block in reduced and e.action == "alloc")
        freed = [i for i, e in enumerate(result.events) if e.block in reduced and e.action == "free"]
        assert len(freed) == len(reduced) and min(freed) > last_made
    else:
        figures = fsdp2_figures(world, bf16=bf16)
        for phase in ("forward", "backward"):
            assert made(result, phase, "_to_copy", "side") == figures["copy_in"]
            assert made(result, phase, "resize_") == figures["unsharded"]
            assert made(result, phase, "empty", "side") == sorted(figures["gathered"] + (
                figures["reduce_out"] if phase == "backward" else []))
        assert made(result, "backward", "empty", 0) == figures["reduce_in"]
        # each reduce-scatter output is freed as soon as its views went to the host, before the next is made
        outputs = [e for e in result.events if e.iteration == 1 and e.op == "empty" and e.stream not in (0, 1)]
        for alloc in outputs:
            after = result.events[result.events.index(alloc) + 1:]
            free_at = next(i for i, e in enumerate(after) if e.action == "free" and e.block == alloc.block)
            assert not any(e.action == "alloc" and e.op == "empty" and e.stream == alloc.stream
                           for e in after[:free_at])
    assert steady_peak(result) == figures["peak"]



# ---- DeepSpeed ZeRO-Offload: offload_optimizer (and ZeRO-3's offload_param) to the CPU -------------------------
# tests/scripts/deepspeed_zero.py --offload 1: Linear(256, 512), ReLU, Linear(512, 16) in bf16, AdamW
# (DeepSpeedCPUAdam under offload: xmem/trace/child/deepspeed_ops.py skips its host kernel), a reduce bucket of
# 50 000 elements
DS_PARAMS = [256 * 512, 512, 512 * 16, 16]  # numels, in registration order
DS_NUMEL = sum(DS_PARAMS)  # 139 792: every numel a multiple of 8 and the total of 2 x 4 ranks: no padding anywhere
REDUCE_BUCKET = 50000
DS_CONFIGS = {
    "zero2-w2": (2, ("--stage", "2", "--offload", "1")),
    "zero3-offload-param-w4": (4, ("--stage", "3", "--offload", "1", "--offload-param", "1", "--pin", "0")),
}


def traced_zero(config: str):
    pytest.importorskip("deepspeed")
    world, options = DS_CONFIGS[config]
    result = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "deepspeed_zero.py"), *options],
                       iterations=2)
    return config, world, result


@pytest.fixture(scope="module", params=list(DS_CONFIGS))
def zero(request):
    return traced_zero(request.param)


def test_zero_offload_keeps_the_master_weights_gradients_and_adam_on_the_host(zero):
    config, world, result = zero
    # ZeRO's fp32 partitions, their gradients and DeepSpeedCPUAdam's moments are host tensors: no optimizer state
    # and no gradient partition on the GPU at any time, nothing made by the step
    assert not any(e.category in (Category.OPTIMIZER_STATE, Category.GRADIENT) for e in result.events)
    assert made(result, "optimizer", iteration=0) == made(result, "optimizer") == []
    held = held_after_first_step(result)
    # what stays between steps: ZeRO-2 the whole bf16 flat group (bit16_groups_flat, the model's parameters view
    # it); ZeRO-3 under offload_param none of the parameters (each ds_tensor partition lives on the host)
    assert held.get(Category.PARAMETER, 0) == (DS_NUMEL * BF16 if config.startswith("zero2") else 0)
    assert audit(result) == ()
    assert any(f.what == FACT_OFFLOADED and "offload_optimizer" in f.source for f in result.facts)
    # each parameter's gradient partition goes to the host in fp32 (stage_1_and_2:
    # async_inplace_copy_grad_to_fp32_buffer_from_gpu; stage3: _offload_grad_partition_at_boundary), a GPU copy in
    # fp32 first, after its norm in fp64 (set_norm_for_param_grad_in_gpu / _constant_buffered_norm2: get_norm_dtype)
    if config.startswith("zero2"):  # rank 0's partition, the first P elements of the flat group: all in weight 0
        slices = [DS_NUMEL // world]
    else:  # each parameter's own partition: ceil(numel / N)
        slices = [math.ceil(n / world) for n in DS_PARAMS]
    copies = made(result, "backward", "_to_copy") + made(result, "other", "_to_copy")
    for n in slices:
        assert copies.count(n * FP32) >= 1 and copies.count(n * FP64) >= 1, (n, copies)


@pytest.mark.parametrize("zero", ["zero2-w2"], indirect=True)
def test_zero2_offload_buffers_follow_stage_1_and_2(zero):
    config, world, result = zero
    partition, largest = DS_NUMEL // world, max(DS_PARAMS)
    setup = [e for e in result.events if e.action == "alloc" and e.iteration < 0]
    # the engine's bf16 model, flattened into bit16_groups_flat; rank 0's partition cloned on the GPU before it
    # goes to the host in fp32 (weights_partition: .detach().clone().to(device="cpu", dtype=fp32)), and
    # temp_grad_buffer_for_gpu_offload: zeros of the largest parameter's numel in bf16, kept
    assert sorted(e.nbytes for e in setup if e.category == Category.PARAMETER) == sorted(
        [n * BF16 for n in DS_PARAMS] + [DS_NUMEL * BF16])
    assert [e.nbytes for e in setup if e.op == "clone"] == [partition * BF16]
    assert [e.nbytes for e in setup if e.op == "zeros"] == [largest * BF16]
    # each backward: the reduce bucket (contiguous gradients, reduce_bucket_size elements in bf16) and, for the one
    # parameter larger than the bucket, its gradient cloned (reduce_independent_p_g_buckets_and_remove_grads under
    # _offload_gradient_safety_enabled), both kept until the step
    assert made(result, "backward", "empty") == [REDUCE_BUCKET * BF16]
    assert made(result, "backward", "clone") == [largest * BF16]
    # the peak: at the fp64 copy of the partition for its norm, with the flat group, the temp buffer, the bucket,
    # the cloned gradient, the norm of the bucket's parameters so far (8 bytes) and the loss with the engine's two
    # scalars of it (divided by the gradient accumulation steps, multiplied by the loss scale)
    assert steady_peak(result) == (DS_NUMEL * BF16 + largest * BF16 + REDUCE_BUCKET * BF16 + largest * BF16
                                   + partition * FP64 + FP64 + 3 * FP32)


@pytest.mark.parametrize("zero", ["zero3-offload-param-w4"], indirect=True)
def test_zero3_offload_param_gathers_each_parameter_from_its_host_partition(zero):
    config, world, result = zero
    steady = [e for e in result.events if e.iteration == 1]
    gathered = [e for e in steady if e.action == "alloc" and e.category == Category.PARAMETER]
    # each parameter all-gathered whole (numel x bf16) for its use, from its host partition copied to the GPU
    # first (partition_parameters.py: the ds_tensor on the CPU, .to(device) before the all-gather)
    assert sorted(e.nbytes for e in gathered) == sorted(n * BF16 for n in DS_PARAMS)
    copies = made(result, "other", "_to_copy") + made(result, "forward", "_to_copy")
    for n in DS_PARAMS:
        assert math.ceil(n / world) * BF16 in copies, (n, copies)
    # and released within the iteration: nothing of them is on the GPU between steps
    freed = {e.block for e in steady if e.action == "free"}
    assert all(e.block in freed for e in gathered)
    # the peak: as weight 0's gradient partition is normed, in L0's backward. Gathered: the biases (ds_persist:
    # numel <= stage3_param_persistence_threshold, 1000) and weight 0 (kept from its forward to its backward: once
    # the coordinator's trace is complete it releases a module's parameters only if they do not recur within
    # stage3_max_reuse_distance, 1e9 elements); the reduce bucket (reduce_bucket_size in bf16, made once);
    # autograd's gradients of weight 0 and bias 0; partition_grads' GPU copy of weight 0's gradient partition
    # (grad_buffer.to(device), after its copy into the host buffer) and _constant_buffered_norm2's fp64 copy of it;
    # three fp64 norms (weight 2's and bias 2's kept in norm_for_param_grads, weight 0's being taken); the loss,
    # the engine's two scalars of it and its ones_like
    w0, b0 = DS_PARAMS[0], DS_PARAMS[1]
    part = math.ceil(w0 / world)
    assert steady_peak(result) == ((DS_PARAMS[1] + DS_PARAMS[3]) * BF16 + REDUCE_BUCKET * BF16 + w0 * BF16
                                   + (w0 + b0) * BF16 + part * BF16 + part * FP64 + 3 * FP64 + 4 * FP32)
