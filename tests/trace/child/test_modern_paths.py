"""The GPU paths of modern training, traced from small scripts (tests/scripts/), each pinned per category by
figures derived by hand from the shapes: autocast (bf16, fp16) with its weight-cast cache, fused / foreach /
for-loop AdamW, torch.utils.checkpoint (both use_reentrant settings), HF gradient checkpointing, LoRA (peft) with a
frozen base. This build only: each trace costs seconds."""

import sys

import pytest

from tests.trace.child.live_storages import live_before
from tests.trace.child.test_scripts import allocs, sizes, trace
from xmem.audit import audit

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what a program allocates: forked warm

TRACES: dict[tuple[str, ...], object] = {}


def traced(script, *args):
    """One trace per script and arguments for the whole module (2 iterations)."""
    key = (script, *args)
    if key not in TRACES:
        TRACES[key] = trace(sys.executable, script, *args, iterations=2)
    return TRACES[key]


def first_iteration(result):
    return [e for e in result.events if e.iteration == 0]


def live_at_first_backward(result, category="activation", inside=""):
    """Bytes of `category` (born in a module whose path contains `inside`) live when iteration 0's backward
    begins, and their sizes."""
    live = live_before(result, lambda e: e.iteration == 0 and e.phase == "backward")
    held = sorted(e.nbytes for e in live.values() if e.category == category and inside in e.module)
    return sum(held), held


def first_iteration_allocs(result, category=None, phase=None, op=None):
    return [e for e in allocs(result, category, phase) if e.iteration == 0 and op in (None, e.op)]


# ---- autocast: nn.Sequential(Linear(256, 512), ReLU(), Linear(512, 256)) in fp32, called twice per step --------
AUTOCAST_PARAMS = [512 * 256 * 4, 512 * 4, 256 * 512 * 4, 256 * 4]
# live when backward begins: both weight casts (saved by the second call's matmuls: its inputs need grad), the two
# ReLU outputs (32x512 half), the input's cast (32x256 half, saved for the first weight's grad), the two outputs
# of the last layer (32x256 half: one is the second call's input, one is `h`), h.float() (saved by pow), the loss
AUTOCAST_LIVE = 2 * 256 * 512 * 2 + 2 * 32 * 512 * 2 + 32 * 256 * 2 + 2 * 32 * 256 * 2 + 32 * 256 * 4 + 4


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_casts_each_weight_once_per_step_from_its_cache(dtype):
    result = traced("autocast_cache.py", "--dtype", dtype)
    casts = first_iteration_allocs(result, phase="forward", op="_to_copy")
    # 4 parameters cast to half once although each layer ran twice; then the input (32x256) to half, h to fp32
    assert sizes(casts) == sorted([n // 2 for n in AUTOCAST_PARAMS] + [32 * 256 * 2, 32 * 256 * 4])
    assert sizes(first_iteration_allocs(result, "gradient", "backward")) == sorted(AUTOCAST_PARAMS)  # fp32 grads


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_cache_is_dropped_at_exit_and_saved_casts_live_into_backward(dtype):
    result = traced("autocast_cache.py", "--dtype", dtype)
    held, _ = live_at_first_backward(result)
    scaler = 3 * 4 if dtype == "fp16" else 0  # GradScaler's scale and growth tracker, and the scaled loss
    assert held == AUTOCAST_LIVE + scaler
    bias_casts = {e.block for e in first_iteration_allocs(result, phase="forward", op="_to_copy")
                  if e.nbytes in (512 * 2, 256 * 2)}
    frees = {e.block: e.phase for e in first_iteration(result) if e.action == "free" and e.block in bias_casts}
    assert frees == dict.fromkeys(bias_casts, "forward")  # freed when autocast exits, before backward


# ---- AdamW: nn.Sequential(Linear(100, 300), ReLU(), Linear(300, 10)) in fp32 ----------------------------------
ADAMW_PARAMS = [100 * 300 * 4, 300 * 4, 300 * 10 * 4, 10 * 4]


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_state_gradients_and_temporaries_per_implementation(impl):
    result = traced("adamw_impl.py", "--impl", impl)
    state = first_iteration_allocs(result, "optimizer_state", "optimizer")
    # exp_avg and exp_avg_sq per parameter; fused keeps its fp32 `step` scalars on the GPU, the others on the CPU
    steps = [4] * 4 if impl == "fused" else []
    assert sizes(state) == sorted(ADAMW_PARAMS * 2 + steps)
    assert sizes(first_iteration_allocs(result, "gradient", "backward")) == sorted(ADAMW_PARAMS)
    temporaries = first_iteration_allocs(result, "temporary", "optimizer")
    # fused: one kernel, no temporary; foreach: sqrt(exp_avg_sq) as one list; for-loop: sqrt then div per parameter
    expected = {"fused": [], "foreach": ADAMW_PARAMS, "for-loop": ADAMW_PARAMS * 2}[impl]
    assert sizes(temporaries) == sorted(expected)
    kernel = {"fused": "_fused_adamw_", "foreach": "_foreach_sqrt", "for-loop": "sqrt"}[impl]
    assert {e.op for e in temporaries} <= {kernel, "div"} and result.op_counts.get(kernel, 0) >= 2


# ---- torch.utils.checkpoint: Linear(64, 256), then 3 residual blocks x + fc2(relu(fc1(x))), 256 -> 1024 -> 256 ---
UNIT = 32 * 256 * 4  # one block's output (batch 32, fp32)


@pytest.mark.parametrize("mode, live, recomputed", [
    # the projection's output, each block's ReLU output (4 units, saved by fc2) and output, the loss
    ("none", UNIT + 3 * (4 * UNIT + UNIT) + 4, 0),
    # each checkpoint keeps only its input; the whole block runs again in backward
    ("reentrant", UNIT + 3 * UNIT + 4, 3 * 2),
    # non-reentrant stops recomputing once the block's saved tensors are back: fc2 does not run again (a real CPU
    # run of the same blocks recomputes 3 addmm too)
    ("non-reentrant", UNIT + 3 * UNIT + 4, 3 * 1),
])
def test_checkpointing_keeps_only_the_block_inputs(mode, live, recomputed):
    result = traced("checkpoint_blocks.py", "--mode", mode)
    assert live_at_first_backward(result)[0] == live
    assert len(first_iteration_allocs(result, phase="backward", op="addmm")) == recomputed
    param_bytes = (64 * 256 + 256 + 3 * (256 * 1024 + 1024 + 1024 * 256 + 256)) * 4
    assert sum(sizes(first_iteration_allocs(result, "gradient", "backward"))) == param_bytes


# ---- a tiny Llama built from its config: hidden 64, 2 layers, MLP 128, vocabulary 100, batch 2 x 16 tokens -----
H, LAYERS, MLP, VOCAB, TOKENS = 64, 2, 128, 100, 2 * 16
LLAMA_PARAM_BYTES = (VOCAB * H + LAYERS * (4 * H * H + 3 * H * MLP + 2 * H) + H + VOCAB * H) * 4  # untied head
ADAPTER_BYTES = 8 * H * 4  # LoRA r=8: A (8 x 64) or B (64 x 8), fp32
ADAPTERS = LAYERS * 2 * 2  # q_proj and v_proj in each layer, A and B


@pytest.mark.parametrize("checkpointing", ["default", "reentrant"])
def test_hf_gradient_checkpointing_keeps_one_hidden_state_per_layer(checkpointing):
    result = traced("hf_llama_finetune.py", "--checkpointing", checkpointing)
    # inside the decoder layers only each layer's output (2 x 16 x 64 fp32) is live when backward begins
    assert live_at_first_backward(result, inside=".layers.")[1] == [TOKENS * H * 4] * LAYERS
    without, _ = live_at_first_backward(traced("hf_llama_finetune.py"), inside=".layers.")
    assert without > 8 * LAYERS * TOKENS * H * 4  # the projections, norms and MLP activations of every layer
    assert sum(sizes(first_iteration_allocs(result, "gradient"))) == LLAMA_PARAM_BYTES
    assert sum(sizes(first_iteration_allocs(result, "optimizer_state"))) == 2 * LLAMA_PARAM_BYTES


@pytest.mark.parametrize("checkpointing", ["off", "reentrant"])
def test_lora_frozen_base_has_no_gradient_and_no_optimizer_state(checkpointing):
    result = traced("hf_llama_finetune.py", "--lora", "--checkpointing", checkpointing)
    assert sizes(first_iteration_allocs(result, "gradient")) == [ADAPTER_BYTES] * ADAPTERS
    assert sizes(first_iteration_allocs(result, "optimizer_state")) == [ADAPTER_BYTES] * (2 * ADAPTERS)
    assert live_at_first_backward(result, "parameter")[0] == LLAMA_PARAM_BYTES + ADAPTERS * ADAPTER_BYTES
    if checkpointing != "off":
        assert live_at_first_backward(result, inside=".layers.")[1] == [TOKENS * H * 4] * LAYERS


@pytest.mark.parametrize("script, args", [
    ("autocast_cache.py", ("--dtype", "fp16")), ("adamw_impl.py", ("--impl", "fused")),
    ("checkpoint_blocks.py", ("--mode", "reentrant")), ("hf_llama_finetune.py", ("--lora", "--checkpointing",
                                                                                 "reentrant")),
])
def test_modern_paths_pass_their_self_audit(script, args):
    result = traced(script, *args)
    if result.facts is None:
        pytest.skip("this tracer does not collect the run's facts yet (xmem.trace.child.facts.FactCollector)")
    assert audit(result) == ()
