"""FSDP2 with float8 all-gather (torchao's `Float8LinearConfig(enable_fsdp_float8_all_gather=True)`, torchtitan's
float8 default) traced as rank 0 of N runs it (tests/scripts/fsdp2_float8.py, launched by torchrun).

The program: Linear(256, 512), ReLU, Linear(512, 256), ReLU, Linear(256, 512), bias-free, each Linear a Float8Linear
and its own fully_shard unit (the root holds no parameter), fp32 master weights, a bf16 MixedPrecisionPolicy with an
fp32 reduce dtype, AdamW, 256 tokens. By hand from the upstream code:
- torchao wraps each weight in a WeightWithDynamicFloat8CastTensor (torchao.float8.fsdp_utils); FSDP2 sees its
  `fsdp_pre_all_gather` and so skips its bf16 foreach copy-in (_fsdp_collectives._get_param_all_gather_inputs):
  the all-gather input is the float8 cast of the fp32 shard itself, made on the copy-in stream. Dynamic scaling
  (hp_tensor_to_float8_dynamic with reduce_amax=True) allocates, for an n-element fp32 shard: abs (4n), its max (4),
  the functional all_reduce's output of that amax across the mesh (4; tensor_to_amax), the amax as float64 (8),
  clamped (8), the float8 maximum over it (reciprocal, mul: 8 each), the scale as float32 (4); then the shard times
  the scale (4n; already float32: no copy), clamped to the float8 range (4n; to_fp8_saturated) and the float8 bits
  (n). With `precompute_float8_dynamic_scale_for_fsdp` the scale is made after the step for all weights at once,
  and the pre-all-gather casts with it (hp_tensor_and_scale_to_float8): the last three only;
- foreach_all_gather: one flat output for the unit (all_gather_comm.allocate: N x n bytes of float8, all inputs one
  dtype), the rank's input a narrow of it (all_gather_copy_in); the float8 shard dies after the copy;
- FSDPParam.init_all_gather_outputs: per weight, N x n bytes of float8 (empty, then regrown by
  alloc_all_gather_outputs' resize_ and dropped by free_unsharded_param), viewed by `fsdp_post_all_gather` as a
  Float8TrainingTensor: the unsharded weight is float8, half its bf16 size;
- Float8Linear's matmul (matmul_with_hp_or_float8_args) casts the weight only when it is not float8 already: forward
  casts the input alone, backward grad_output twice and the input (no weight cast);
- precompute_float8_dynamic_scale_for_fsdp, for k weights: `_foreach_norm` (inf) of each local shard (k x 4 B), their
  stack (4k), the Partial-to-Replicate all-reduce of the clamp (its output, 4k) and the clamp (4k), the float64 copy
  (8k), finfo.max over it (reciprocal, mul: 8k each) and the float32 scales kept by the weights (4k).
"""

import importlib.util

import pytest

from tests.trace.child.live_storages import by_category
from tests.trace.child.test_float8 import float8_matmul, ops, tensorwise_cast
from tests.trace.child.test_fsdp import FP32, dim0_padded, dim0_shard, live_at_first_step, peak_live
from tests.trace.child.test_scripts import allocs, sizes
from tests.torch_builds import SCRIPTS
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.events import Category

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (float8 "
                                 "training is torchao's)"),
              pytest.mark.usefixtures("warm_tracer")]

DIM, HIDDEN, TOKENS = 256, 512, 256
WEIGHTS = [(HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM)]  # (out, in), in forward order: one unit each
FLOAT8 = 1
TRACES: dict[tuple, object] = {}


def traced(world: int, precompute: bool):
    key = (world, precompute)
    if key not in TRACES:
        TRACES[key] = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "fsdp2_float8.py"),
                                 *(["--precompute"] if precompute else [])], iterations=2)
    return TRACES[key]


def fp32_shard_cast(numel: int, precomputed: bool) -> list[tuple[str, int]]:
    """What fsdp_pre_all_gather allocates for an fp32 shard of `numel` elements, in order (module docstring)."""
    scale = [("abs", 4 * numel), ("max", 4), ("all_reduce", 4), ("_to_copy", 8), ("clamp", 8), ("reciprocal", 8),
             ("mul", 8), ("_to_copy", 4)]
    return ([] if precomputed else scale) + [("mul", 4 * numel), ("clamp", 4 * numel), ("_to_copy", numel)]


def precomputed_scales(weights: int) -> list[tuple[str, int]]:
    return ([("_foreach_norm", 4)] * weights + [("stack", 4 * weights), ("all_reduce", 4 * weights),
                                                ("clamp", 4 * weights), ("_to_copy", 8 * weights),
                                                ("reciprocal", 8 * weights), ("mul", 8 * weights),
                                                ("_to_copy", 4 * weights)])


CONFIGS = [(2, False), (8, False), (4, True)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"world{c[0]}{'-precompute' if c[1] else ''}")
def test_weights_are_gathered_and_held_unsharded_in_float8(config):
    world, precompute = config
    result = traced(*config)
    shards = [dim0_shard(shape, world) for shape in WEIGHTS]
    unsharded = sorted(dim0_padded(shape, world) * FLOAT8 for shape in WEIGHTS)
    for iteration in (0, 1):
        for phase in ("forward", "backward"):  # each unit resharded after forward (none is the root)
            gathered = [e for e in allocs(result, Category.UNSHARDED_PARAMETER, phase) if e.iteration == iteration]
            assert sizes(gathered) == unsharded
    # one unit's float8 weight at a time: half of what the bf16 all-gather holds
    assert peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER) == max(unsharded)
    # the copy-in stream's work, unit after unit: the shard cast to float8, then the unit's flat float8 output
    copy_in = [e for e in allocs(result, phase="forward") if e.iteration == 1 and e.stream != 0]
    assert ops(copy_in) == [op for shard in shards
                            for op in fp32_shard_cast(shard, precompute) + [("empty", shard * world * FLOAT8)]]


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"world{c[0]}")
def test_fp32_shards_gradients_and_adamw_state_stay_full_precision(config):
    world, _ = config
    result = traced(*config)
    shards = [dim0_shard(shape, world) * FP32 for shape in WEIGHTS]
    held = live_at_first_step(result)
    assert held["parameter"] == sorted(shards)
    assert held["gradient"] == sorted(shards)  # one weight a unit: its fp32 reduce-scatter output
    assert Category.UNSHARDED_PARAMETER not in held
    state = [e for e in allocs(result, "optimizer_state") if e.iteration == 0]
    assert sizes(state) == sorted(shards * 2)
    # kept across iterations: each unsharded weight's float8 scale (fsdp_post_all_gather sets it on the
    # Float8TrainingTensor, which outlives the freed data), the loss, and the batch
    assert held["temporary"] == [4] * len(WEIGHTS)
    assert audit(result) == ()


def test_forward_casts_the_input_only_and_backward_never_casts_the_weight():
    result = traced(2, False)
    first = [(e.op, e.nbytes) for e in allocs(result, phase="forward")
             if e.iteration == 1 and e.stream == 0 and e.module == "FSDPSequential.0"]
    out, inner = WEIGHTS[0]
    assert first == ([("resize_", out * inner * FLOAT8)] + tensorwise_cast(TOKENS * inner)
                     + float8_matmul(TOKENS * out * 2))
    casts = [e.nbytes for e in allocs(result, phase="backward") if e.iteration == 1 and e.stream == 0
             and e.op == "abs"]
    # per layer, last first: grad_output (bf16) for grad_input and again for grad_weight, then the input
    assert casts == [n for out, inner in reversed(WEIGHTS) for n in (TOKENS * out * 2, TOKENS * out * 2,
                                                                      TOKENS * inner * 2)]


def test_precomputed_scales_replace_the_amax_all_reduce_of_every_all_gather():
    result = traced(4, True)
    after_step = [e for e in allocs(result) if e.iteration == 1 and e.phase == "other" and e.category != "input"]
    assert ops(after_step) == precomputed_scales(len(WEIGHTS))
    assert by_category({e.block: e for e in after_step})["parameter"] == [4 * len(WEIGHTS)]  # held by the weights
