"""DeepSpeed ZeRO 1 and 2 through its own engine, as rank 0 of 2 runs it under torchrun
(tests/scripts/deepspeed_zero.py: an MLP of 139 792 bf16 parameters, AdamW as DeepSpeed's FusedAdam, a reduce bucket
of 50 000 elements), and through accelerate (the HF Trainer's, and an `Accelerator` with a DeepSpeedPlugin used
directly: tests/scripts/accelerate_zero.py, the same MLP). Its compiled FusedAdam is not built
(xmem/trace/child/deepspeed_ops.py: checked and skipped). The figures are derived by hand from deepspeed/runtime/zero/stage_1_and_2.py (DeepSpeedZeroOptimizer). Skipped where
deepspeed is not installed; each trace costs seconds."""

import dataclasses
import types

import pytest

from tests.trace.child.live_storages import walk
from tests.trace.child.test_scripts import allocs, sizes
from tests.torch_builds import SCRIPTS
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.child.facts import zero12_partitions
from xmem.trace.events import FACT_ZERO_STATE, Category

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what rank 0 allocates: forked warm

pytest.importorskip("deepspeed")

FP32, BF16 = 4, 2
WORLD = 2
# Linear(256, 512) and Linear(512, 16): every numel a multiple of 8, so no padding between parameters
# (__init__: param_alignment = 16 // gcd(16, element size) = 8 bf16 elements) and the total a multiple of
# nccl_start_alignment_factor (2) * world, so flatten_dense_tensors_aligned adds none at the end.
NUMEL = 256 * 512 + 512 + 512 * 16 + 16
REDUCE_BUCKET = 50000
TRACES: dict[int, object] = {}


def traced(stage: int):
    """deepspeed_zero.py at one ZeRO stage, traced once for the module (2 iterations)."""
    if stage not in TRACES:
        TRACES[stage] = run_trace(["torchrun", f"--nproc_per_node={WORLD}", str(SCRIPTS / "deepspeed_zero.py"),
                                   "--stage", str(stage)], iterations=2)
    return TRACES[stage]


def test_zero_flat_buffers_follow_stage_1_and_2():
    trace = traced(2)
    assert trace.iterations == 2
    partition = NUMEL // WORLD  # get_data_parallel_partitions: equal parts of the flat group, rank 0's first
    built = sizes([e for e in allocs(trace, Category.PARAMETER) if e.iteration < 0])
    # the model's parameters as the engine made them bf16 on the GPU, then __init__'s bit16_groups_flat (the whole
    # group, flattened, bf16) and single_partition_of_fp32_groups (rank 0's part, cloned to fp32): at world size 2
    # the two flat buffers are the same size
    model = [256 * 512 * BF16, 512 * BF16, 512 * 16 * BF16, 16 * BF16]
    assert built == sorted(model + [NUMEL * BF16, partition * FP32])
    for iteration in (0, 1):
        made = [e for e in trace.events if e.action == "alloc" and e.iteration == iteration]
        # setup_buckets: with contiguous_gradients one reduce bucket of reduce_bucket_size elements, in ZeRO-2's
        # low-precision staging dtype (_gradient_reduction_buffer_dtype: bf16 without a grad_accum attribute)
        assert sizes(e for e in made if e.phase == "backward" and e.nbytes == REDUCE_BUCKET * BF16) == \
            [REDUCE_BUCKET * BF16]
        # step: rank 0's gradient partition, in fp32 as single_partition_of_fp32_groups, once per step
        assert sizes(e for e in made if e.category == Category.GRADIENT) == [partition * FP32]
    # FusedAdam.step: exp_avg and exp_avg_sq of the fp32 partition, zeros_like at the first step only
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2


def test_zero3_partitions_each_parameter_and_steps_rank_0s_part():
    trace = traced(3)
    assert trace.iterations == 2  # the order checks (assert_ints_same_as_other_ranks) agree as rank 0 with itself
    # partition_parameters.py's _partition_param: each parameter's ds_tensor is ceil(numel / world) elements (every
    # numel here is even: no padding); stage3.py flattens rank 0's into fp16_partitioned_groups_flat and clones that
    # to fp32 (fp32_partitioned_groups_flat), the optimizer's parameter, whose gradient partition is fp32 too
    partition = sum(-(-numel // WORLD) for numel in (256 * 512, 512, 512 * 16, 16))
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2
    for iteration in (0, 1):
        assert sizes(e for e in allocs(trace, Category.GRADIENT) if e.iteration == iteration) == [partition * FP32]


def zero_state_fact(trace):
    return next(fact for fact in trace.facts if fact.what == FACT_ZERO_STATE)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_audit_checks_zero_state_against_the_fullest_ranks_partitions(stage):
    trace = traced(stage)
    # the fullest rank's partitions: stage 1/2 cut the padded flat group in equal parts (no padding here), stage 3
    # each parameter in ceil(numel / N) parts; FusedAdam keeps two fp32 moments of each element
    partition = NUMEL // WORLD if stage < 3 else sum(-(-numel // WORLD) for numel in (256 * 512, 512, 512 * 16, 16))
    fact = zero_state_fact(trace)
    assert fact.nbytes == 2 * partition * FP32 and "rank 0's partitions" in fact.source
    assert audit(trace) == ()


def test_a_zero_trace_that_lost_its_partitions_state_is_suspect():
    # as a tracer that made the moments of partitions half as large (partitioned by twice the ranks) would record
    trace = traced(2)
    halved = [dataclasses.replace(e, nbytes=e.nbytes // 2) if e.category == Category.OPTIMIZER_STATE else e
              for e in trace.events]
    wrong = dataclasses.replace(trace, events=halved)
    reasons = audit(wrong)
    assert any(reason.startswith(FACT_ZERO_STATE) and "DeepSpeedZeroOptimizer: rank 0's partitions of "
               f"{NUMEL // WORLD} elements" in reason for reason in reasons), reasons


def test_zero_1_and_2_partitions_pad_each_parameter_and_the_group():
    # bf16 numels 5, 3, 12 with 16-byte parameter alignment (8 elements): 5 -> 8, 3 -> 8, the last 12 unpadded: 28,
    # padded to a multiple of 2 x 3 ranks: 30, in three parts of 10; without alignment 20 -> 24 in parts of 8
    assert zero12_partitions([5, 3, 12], BF16, True, 3) == [10, 10, 10]
    assert zero12_partitions([5, 3, 12], BF16, False, 3) == [8, 8, 8]
    assert zero12_partitions([5, 3, 12], FP32, True, 1) == [8 + 4 + 12]  # fp32: 4 elements to 16 bytes


def test_cpu_adam_is_checked_on_the_host_and_any_other_compiled_op_is_named_not_modelled():
    # OpBuilder.load as the trace installs it, on throw-away subclasses of DeepSpeed's own builders (the process's
    # classes stay as they are). DeepSpeedCPUAdam's op (offload_optimizer) steps host tensors in place: its calls
    # are checked and skipped (a ZeRO-Offload run is traced in test_fsdp_offload.py); async_io (ZeRO-Infinity's
    # NVMe swapping) is compiled code this does not model: named
    import torch
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
    from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder

    from xmem.trace.child import deepspeed_ops
    from xmem.trace.errors import NotModelled, raised_as_on_a_gpu

    class CPUAdam(CPUAdamBuilder): ...

    class AsyncIO(AsyncIOBuilder): ...

    for builder in (CPUAdam, AsyncIO):
        deepspeed_ops.install(types.SimpleNamespace(OpBuilder=builder))
    op = CPUAdam().load()
    host = [torch.zeros(4) for _ in range(4)]  # parameter, gradient, exp_avg, exp_avg_sq
    op.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    op.adam_update(0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, *host)
    with pytest.raises(RuntimeError, match="adam_update: expected a CPU tensor") as failed:
        op.adam_update(0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, host[0].to("meta"), *host[1:])
    assert raised_as_on_a_gpu(failed.value)  # the program's error, as the real kernel's would be
    with pytest.raises(NotModelled, match="async_io"):
        AsyncIO().load()


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 2), (3, 2), (3, 4), (2, 8)])
def test_hf_trainer_hands_zero_the_moved_parameters(stage, world):
    # The Trainer's DummyOptim holds the host parameters DeepSpeed's engine moves to the GPU (accelerate passes its
    # list as model_parameters): the trace points it at the moved ones, as a GPU keeps each Parameter object.
    trace = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "hf_trainer_zero.py"), "--stage",
                       str(stage)], iterations=2)
    assert trace.iterations == 2
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                                                 n_positions=64))
    numel = sum(p.numel() for p in model.parameters())  # the tied lm_head counted once, as named_parameters does
    # two groups (weight decay or not), every parameter's numel a multiple of 128: no padding anywhere at worlds up
    # to 8 (the flat groups' alignment is 2 x world elements); FusedAdam's two moments of each group's fp32 partition,
    # 1/world of the group (ZeRO-1 and 2: the flat group cut in world parts; ZeRO-3: each parameter cut in world
    # parts, _partition_param, all of them in one sub-group: the same total)
    assert sum(sizes(allocs(trace, Category.OPTIMIZER_STATE))) == 2 * (numel // world) * FP32
    # the first step's state (both groups at ZeRO-2) is what ZeRO's partition rule asks of the fullest rank
    assert zero_state_fact(trace).nbytes == 2 * (numel // world) * FP32 and audit(trace) == ()


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_with_a_deepspeed_plugin_partitions_the_programs_own_adamw(stage):
    # Accelerator(deepspeed_plugin=...) used directly: prepare() hands DeepSpeed the torch AdamW the program made (its
    # client optimizer), which keeps exp_avg and exp_avg_sq of rank 0's fp32 partition only: ZeRO-2 cuts the flat
    # group in WORLD equal parts (no padding: NUMEL divides by 2 x WORLD), ZeRO-3 each parameter (ceil(numel / WORLD)
    # each, every numel even here): the same NUMEL / WORLD elements, as one flat tensor per moment
    trace = run_trace(["torchrun", f"--nproc_per_node={WORLD}", str(SCRIPTS / "accelerate_zero.py"), "--stage",
                       str(stage)], iterations=2)
    assert trace.iterations == 2
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [NUMEL // WORLD * FP32] * 2
    assert zero_state_fact(trace).nbytes == 2 * (NUMEL // WORLD) * FP32 and audit(trace) == ()


# ---- ZeRO 1 at world 4 and ZeRO 3 at world 8, through the engine (deepspeed_zero.py, same MLP and config) ---------
WEIGHTS = [256 * 512, 512 * 16]  # numels above stage3_param_persistence_threshold (1000)
BIASES = [512, 16]  # at or under it: persistent in ZeRO-3
AT_WORLD: dict[tuple[int, int], object] = {}


def traced_at(stage: int, world: int, *options: str):
    if (stage, world, *options) not in AT_WORLD:
        AT_WORLD[stage, world, *options] = run_trace(["torchrun", f"--nproc_per_node={world}",
                                                      str(SCRIPTS / "deepspeed_zero.py"), "--stage", str(stage),
                                                      *options], iterations=2)
    return AT_WORLD[stage, world, *options]


def live_at_end_of(trace, iteration: int, phase: str) -> list[int]:
    """Sizes of the storages live just after the last event of `phase` in `iteration`."""
    last = None
    for e, live in walk(trace):
        if e.iteration == iteration and e.phase == phase:
            last = sorted(alloc.nbytes for alloc in live.values())
    assert last is not None
    return last


def test_zero1_at_world_4_partitions_only_the_optimizer_state_and_reduces_after_backward():
    world = 4
    trace = traced_at(1, world)
    assert trace.iterations == 2
    partition = NUMEL // world  # 34 948: NUMEL divides by 2 x 4 (nccl_start_alignment_factor x dp), no padding
    # __init__ as at stage 2: the model's bf16 parameters, the flat bf16 group (bit16_groups_flat, whole) and rank 0's
    # fp32 partition of it (single_partition_of_fp32_groups)
    built = sizes([e for e in allocs(trace, Category.PARAMETER) if e.iteration < 0])
    assert built == sorted([256 * 512 * BF16, 512 * BF16, 512 * 16 * BF16, 16 * BF16, NUMEL * BF16, partition * FP32])
    for iteration in (0, 1):
        made = [e for e in trace.events if e.action == "alloc" and e.iteration == iteration]
        # setup_buckets (first gradient hook: contiguous_gradients installs the hooks at stage 1 too): one reduce
        # bucket of reduce_bucket_size elements in the model's dtype (_gradient_reduction_buffer_dtype: no
        # grad_accum attribute)
        assert sizes(e for e in made if e.phase == "backward" and e.nbytes == REDUCE_BUCKET * BF16) == \
            [REDUCE_BUCKET * BF16]
        # the step's gradient partition: get_flat_partition of rank 0's part in fp32, once per step
        assert sizes(e for e in made if e.category == Category.GRADIENT) == [partition * FP32]
    # stage 1 (partition_gradients False, no overlap_comm): process_gradients only sets the bucket up; nothing is
    # reduced or cleared in backward (reduce_gradients runs after it), so every parameter's whole bf16 gradient is
    # live when backward ends, beside the bucket (ZeRO-2 clears the other ranks' gradients as it reduces them)
    live = live_at_end_of(trace, 1, "backward")
    for nbytes in [256 * 512 * BF16, 512 * BF16, 512 * 16 * BF16, REDUCE_BUCKET * BF16]:
        assert nbytes in live
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2  # FusedAdam's two moments
    fact = zero_state_fact(trace)
    assert fact.nbytes == 2 * partition * FP32 and audit(trace) == ()


def test_zero3_at_world_8_gathers_only_the_parameters_above_the_persistence_threshold_in_forward():
    world = 8
    trace = traced_at(3, world)
    assert trace.iterations == 2
    # _partition_param: ceil(numel / 8) elements of each parameter (17 474 in all, 2 of the last bias); the fp32
    # flat partition, its gradient partition (once per step) and FusedAdam's two moments of it
    partition = sum(-(-numel // world) for numel in (256 * 512, 512, 512 * 16, 16))
    assert partition == 16384 + 64 + 1024 + 2
    assert sizes(e for e in allocs(trace, Category.PARAMETER) if e.iteration < 0 and e.nbytes == partition * FP32) \
        == [partition * FP32]
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2
    for iteration in (0, 1):
        assert sizes(e for e in allocs(trace, Category.GRADIENT) if e.iteration == iteration) == [partition * FP32]
    # a steady iteration: the parameters whose numel is at or under stage3_param_persistence_threshold (the biases,
    # ds_persist: mark_persistent_parameters) are all-gathered by the previous step's _post_step, before the batch;
    # the forward's fetches gather the others whole in bf16 (the coordinator never releases persistent ones:
    # __params_to_release skips them; release_and_reset_all at the step drops every gathered one)
    gathered = [e for e in allocs(trace, Category.PARAMETER) if e.iteration == 1]
    assert sizes(e for e in gathered if e.phase == "forward") == sorted(n * BF16 for n in WEIGHTS)
    assert sizes(e for e in gathered if e.phase != "forward") == sorted(n * BF16 for n in BIASES)
    order = [(e.phase, e.category == Category.INPUT) for e in trace.events if e.iteration == 1 and
             e.action == "alloc" and (e.category == Category.INPUT or e in gathered and e.phase != "forward")]
    assert order[:3] == [("other", False), ("other", False), ("other", True)]  # both biases, then the batch
    # stage3_prefetch_bucket_size (50 000 elements): once fetch_sub_module has gathered the first Linear's weight, it
    # prefetches the next parameters of the recorded order that are not available until that many elements are on
    # their way: the second weight (8 192; its bias persists), all-gathered before the first Linear runs
    forward = [(e.category, e.nbytes) for e in trace.events if e.iteration == 1 and e.phase == "forward"
               and e.action == "alloc" and e.nbytes >= 1024]  # not the scalars
    assert forward[:3] == [(Category.PARAMETER, WEIGHTS[0] * BF16), (Category.PARAMETER, WEIGHTS[1] * BF16),
                           (Category.ACTIVATION, 8 * 512 * BF16)]
    assert zero_state_fact(trace).nbytes == 2 * partition * FP32 and audit(trace) == ()


def test_zero2_overlap_comm_at_world_4_double_buffers_the_bucket_and_reduces_on_its_own_stream():
    world = 4
    trace = traced_at(2, world, "--overlap", "1")
    partition = NUMEL // world
    for iteration in (0, 1):
        made = [e for e in trace.events if e.action == "alloc" and e.iteration == iteration]
        # setup_buckets: with overlap_comm a second buffer of reduce_bucket_size elements beside the first (the
        # bucket being reduced and the one being filled), both dropped at the end of backward (_release_ipg_buffers)
        buckets = [e for e in made if e.phase == "backward" and e.nbytes == REDUCE_BUCKET * BF16]
        assert len(buckets) == 2
        freed = {e.block: e.iteration for e in trace.events if e.action == "free"}
        assert all(freed.get(e.block) == iteration for e in buckets)
        # average_tensor runs on reduction_stream under overlap_comm: the reduction's buffers are not on the default
        # stream (without overlap, as in the ZeRO-1 trace, they are)
        assert any(e.stream != 0 for e in made if e.phase not in ("forward", "backward", "optimizer"))
        assert sizes(e for e in made if e.category == Category.GRADIENT) == [partition * FP32]
    assert all(e.stream == 0 for e in traced_at(1, 4).events if e.action == "alloc")
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2
    assert zero_state_fact(trace).nbytes == 2 * partition * FP32 and audit(trace) == ()


def test_zero2_without_contiguous_gradients_at_world_8_flattens_each_bucket_and_keeps_only_its_partitions_grads():
    world = 8
    trace = traced_at(2, world, "--contiguous", "0")
    partition = NUMEL // world  # 17 474: inside Linear(256, 512)'s weight, the first parameter of the flat group
    freed = {e.block: e.phase for e in trace.events if e.action == "free"}
    for iteration in (0, 1):
        made = [e for e in trace.events if e.action == "alloc" and e.iteration == iteration]
        # setup_buckets allocates a reduce bucket only with contiguous_gradients: none here
        assert not [e for e in made if e.nbytes == REDUCE_BUCKET * BF16]
        # the gradients arrive last layer first: 16 + 8192 + 512 elements fit in the bucket (reduce_bucket_size
        # 50 000), the first weight's 131 072 do not, so reduce_independent_p_g_buckets_and_remove_grads reduces the
        # three first: buffered_reduce_fallback flattens them (one bf16 cat), all-reduces and copies back; the big
        # gradient goes alone at the epilogue, flattened as a view (_flatten_dense_tensors of one tensor)
        flat = [e for e in made if e.op == "cat" and e.phase in ("backward", "other")]
        assert sizes(flat) == [(16 + 8192 + 512) * BF16]
        # stage 2: the gradients of parameters outside rank 0's partition are cleared once reduced, in backward;
        # the first weight's (partly rank 0's) lives to the step, which takes its fp32 partition
        grads = {e.nbytes: e for e in made if e.phase == "backward" and e.op in ("mm", "sum")
                 and e.nbytes in (512 * 16 * BF16, 512 * BF16, 256 * 512 * BF16)}
        assert freed[grads[512 * 16 * BF16].block] == freed[grads[512 * BF16].block] == "backward"
        assert freed.get(grads[256 * 512 * BF16].block) != "backward"
        assert sizes(e for e in made if e.category == Category.GRADIENT) == [partition * FP32]
    assert sizes(allocs(trace, Category.OPTIMIZER_STATE)) == [partition * FP32] * 2
    assert zero_state_fact(trace).nbytes == 2 * partition * FP32 and audit(trace) == ()
