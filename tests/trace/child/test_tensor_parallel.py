"""Tensor parallelism (DTensor over a DeviceMesh) and FSDP2 x TP on a 2-D mesh, as rank 0 of N runs them, traced
from tests/scripts/tp_block.py (torchtitan's layout at toy sizes: token embedding, a LayerNorm + feed-forward block
with a residual, a final LayerNorm and an output head; AdamW) under torchrun. Each configuration is one trace for
the whole module (2 iterations); the figures are derived by hand from upstream's rules:
- torch/distributed/tensor/parallel/style.py: what each style shards and how it converts inputs and outputs;
- torch/distributed/tensor/placement_types.py, _redistribute.py, _collective_utils.py and
  torch/distributed/_functional_collectives.py: the buffers of each redistribution (all-reduce, all-gather,
  reduce-scatter and the copies around them);
- torch/distributed/fsdp/_fully_shard/_fsdp_param.py: how fully_shard shards a parameter that is already a DTensor.
Sizes (tp_block.py's defaults): batch B=2, sequence S=16, model D=64, hidden H=256, vocabulary V=512, fp32; every
sharded dimension divides by the mesh sizes used here, so no padding."""

import copy
import dataclasses
import math

import pytest

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import by_category, live_before
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.errors import TraceError
from xmem.trace.events import FACT_DTENSOR_PARAMETERS, Category

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what rank 0 allocates: forked warm

B, S, D, H, V = 2, 16, 64, 256, 512
FP32 = 4
ACTIVATION = B * S * D * FP32  # one (B, S, D) activation
LOGITS = B * S * V * FP32  # the whole (B, S, V) logits

# (plan, world, fully_shard's shard group, its replicas, more options): "tp" tensor parallelism alone; "lp" sequence
# parallelism (with a dropout on the sequence-sharded norm output: a DTensor random op; the block under activation
# checkpointing) and the loss computed on vocabulary-sharded logits (loss_parallel); "2d" sequence parallelism on the mesh's "tp" dimension and fully_shard
# over its "dp" dimension (torchtitan's FSDP x TP); "3d" the same with fully_shard over a 2-D ("replicate", "dp")
# mesh (HSDP x TP: each rank holds what it holds in the dp x tp world of one replica; the replicas' gradients are
# all-reduced in place), built on the meta device and materialised after sharding, as torchtitan initialises. TP at world 8 runs as `python tp_block.py --fake-world 8` (rank 0 alone over torch's fake
# process group, no launcher): the form in which one real GPU can measure rank 0's memory; it must give the figures
# a torchrun launch gives
CONFIGS = [("tp", 2, 1, 1, ()), ("tp", 8, 1, 1, ("--fake-world", "8")),
           ("lp", 4, 1, 1, ("--dropout", "0.1", "--checkpoint", "1")),
           ("2d", 4, 2, 1, ()), ("3d", 8, 2, 2, ("--meta", "1"))]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-world{c[1]}")
def config(request):
    plan, world, dp, replicate, more = request.param
    options = ["--sp", str(int(plan != "tp")), "--dp", str(dp), "--replicate", str(replicate),
               "--loss-parallel", str(int(plan == "lp")), *more]
    launcher = ["python"] if "--fake-world" in more else ["torchrun", f"--nproc_per_node={world}"]
    result = run_trace([*launcher, str(SCRIPTS / "tp_block.py"), *options], iterations=2)
    return plan, world // replicate, dp, result, more  # the figures are those of one replica's dp x tp world


# ---- what each rank holds -----------------------------------------------------------------------------------------
def tp_local_shapes(plan: str, tp: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shape on a rank of the "tp" dimension (style.py):
    - ColwiseParallel._partition_linear_fn: weight Shard(0) and bias Shard(0) (w1, the head);
    - RowwiseParallel._partition_linear_fn: weight Shard(1), bias Replicate (w2);
    - RowwiseParallel._partition_embedding_fn: the embedding's weight Shard(0) (rows of the vocabulary);
    - SequenceParallel._replicate_module_fn: the LayerNorms' parameters Replicate.
    DTensor's Shard(d) keeps torch.chunk's piece along d (rank 0: the first, ceil(size / tp)).
    Registration order (the optimizer's): tok, block.norm, w1, w2, norm, head."""
    shapes = {"tok.weight": (V // tp, D)}
    if plan != "tp":
        shapes |= {"block.norm.weight": (D,), "block.norm.bias": (D,)}
    shapes |= {"block.ffn.w1.weight": (H // tp, D), "block.ffn.w1.bias": (H // tp,),
               "block.ffn.w2.weight": (D, H // tp), "block.ffn.w2.bias": (D,)}
    if plan != "tp":
        shapes |= {"norm.weight": (D,), "norm.bias": (D,)}
    return shapes | {"head.weight": (V // tp, D)}


def fsdp_shard(shape: tuple[int, ...], dp: int) -> int:
    """Elements of rank 0's shard of a parameter under fully_shard over dp ranks. For a DTensor parameter,
    FSDPParam._init_sharded_param shards its local tensor (the TP shard) as it shards a plain one: torch.chunk on
    dim 0 into dp pieces, kept in a buffer padded to ceil(rows / dp) rows (its placements become
    (_StridedShard(0) on "dp", the TP placement on "tp") for dim-0 TP shards, (Shard(0), Shard(1)) for w2)."""
    return math.ceil(shape[0] / dp) * math.prod(shape[1:])


UNITS = {"block": ("block.norm.weight", "block.norm.bias", "block.ffn.w1.weight", "block.ffn.w1.bias",
                   "block.ffn.w2.weight", "block.ffn.w2.bias"),
         "root": ("tok.weight", "norm.weight", "norm.bias", "head.weight")}


def held_figures(plan: str, world: int, dp: int) -> dict[str, list[int]]:
    """Bytes rank 0 holds per storage when the optimizer first steps.
    TP alone: each parameter's local shard; its gradient the same, except the embedding's: DTensor's strategies for
    embedding_dense_backward (_ops/_embedding_ops.py) have none that yields a Shard(0) weight gradient from a
    Replicate (or, with SP, all-gathered) grad_output and Replicate indices, so it is computed whole, Replicate:
    V x D on every rank, until zero_grad. The LayerNorms' gradients are Partial (each rank's sequence shard's sum):
    local size D. AdamW: exp_avg and exp_avg_sq, zeros_like each local shard.
    2-D: each parameter's fully_shard shard of its TP shard; the gradients one flat fp32 buffer per unit, the
    reduce-scatter output whose views are the sharded gradients (foreach_reduce), after FSDPParam's
    _get_grad_inner_tensor has redistributed each DTensor gradient to the parameter's TP placements (the
    embedding's Replicate one to Shard(0), the LayerNorms' Partial ones all-reduced) and taken its local tensor."""
    tp = world // dp
    shapes = tp_local_shapes(plan, tp)
    if dp == 1:
        params = [math.prod(shape) * FP32 for shape in shapes.values()]
        grads = [V * D * FP32 if name == "tok.weight" else math.prod(shape) * FP32 for name, shape in shapes.items()]
    else:
        params = [fsdp_shard(shape, dp) * FP32 for shape in shapes.values()]
        grads = [sum(fsdp_shard(shapes[name], dp) for name in unit) * FP32 for unit in UNITS.values()]
    return {"parameter": sorted(params), "gradient": sorted(grads),
            "optimizer_state": sorted(n for n in params for _moment in range(2))}


# ---- the collectives of one iteration -----------------------------------------------------------------------------
def all_reduce(nbytes: int) -> list[tuple[str, int]]:
    """Partial -> Replicate (Partial._reduce_value: funcol.all_reduce): the C++ op clones its input into the output
    and reduces that in place; wait_tensor returns it as it is (Functional.cpp)."""
    return [("all_reduce", nbytes)]


def all_gather(whole: int) -> list[tuple[str, int]]:
    """Shard(d) -> Replicate for d != 0 (Shard._to_replicate_tensor: funcol.all_gather_single): all_gather_into_tensor
    stacks the N shards on dim 0 (the whole tensor's bytes), then _maybe_view_chunk_cat re-cuts them along d with
    a cat (a second whole-size buffer; a view only when the dims before d are 1: not at batch 2), the first freed."""
    return [("all_gather_into_tensor", whole), ("cat", whole)]


def reduce_scatter(whole: int, n: int) -> list[tuple[str, int]]:
    """Partial -> Shard(d) for d != 0 (Shard._reduce_shard_tensor: funcol.reduce_scatter_single): the input's N
    pieces along d are concatenated on dim 0 (_chunk_or_narrow_cat: a whole-size copy), reduce_scatter_tensor's
    output is one piece."""
    return [("cat", whole), ("reduce_scatter_tensor", whole // n)]


def collective_figures(plan: str, tp: int, checkpointed: bool = False) -> dict[str, list[tuple[str, int]]]:
    """The collectives' buffers (op, bytes) of one forward and one backward, in program order (style.py):
    TP alone -
      forward: the embedding's _MaskPartial output all-reduced to Replicate (output_layouts); w2's Partial output
      all-reduced (RowwiseParallel's default Replicate output); the head's Shard(-1) logits all-gathered
      (output_layouts=Replicate()), V x B x S;
      backward: each ColwiseParallel input was a Replicate from_local of a tensor that needs a gradient: its Partial
      gradient is all-reduced (the head's, then w1's). The logits' Replicate gradient goes back to Shard(-1) by a
      local chunk (no collective; a clone, checked apart).
    SP -
      forward: the embedding reduce-scattered to Shard(1) (sequence); PrepareModuleInput gathers the block's input
      (Shard(1) -> Replicate); w2 reduce-scatters to Shard(1); the head's ColwiseParallel(input_layouts=Shard(1))
      gathers its input, then its logits as above;
      backward: each in reverse, the conjugate collective (the head's input gradient reduce-scattered, w2's output
      gradient gathered, the block input's gradient reduce-scattered, the embedding's output gradient gathered).
    loss_parallel (lp): the head's logits stay Shard(-1) (no gather); the loss all-reduces three (B x S) vectors
      (tensor/parallel/loss.py: the max and the sum of exponentials of log_softmax, the target's logit).
    A checkpointed block (non-reentrant torch.utils.checkpoint) is recomputed when backward reaches it, after the
    head's input gradient is reduce-scattered: its input gathered again, then early stop (the recompute ends at the
    last tensor backward needs, w2's matmul, so w2's reduce-scatter is not redone)."""
    if plan == "tp":
        return {"forward": all_reduce(ACTIVATION) + all_reduce(ACTIVATION) + all_gather(LOGITS),
                "backward": all_reduce(ACTIVATION) + all_reduce(ACTIVATION)}
    sequence = reduce_scatter(ACTIVATION, tp) + all_gather(ACTIVATION) + reduce_scatter(ACTIVATION, tp)
    head = all_gather(ACTIVATION)
    rows = B * S * FP32
    loss = all_gather(LOGITS) if plan != "lp" else all_reduce(rows) * 3
    recompute = all_gather(ACTIVATION) if checkpointed else []
    backward = (reduce_scatter(ACTIVATION, tp) + recompute + all_gather(ACTIVATION) + reduce_scatter(ACTIVATION, tp)
                + all_gather(ACTIVATION))
    return {"forward": sequence + head + loss, "backward": backward}


COLLECTIVE_OPS = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "cat"}  # the model has no cat


def collectives(result, iteration: int, phase: str) -> list[tuple[str, int]]:
    return [(e.op, e.nbytes) for e in result.events if e.action == "alloc" and e.iteration == iteration
            and e.phase == phase and e.op in COLLECTIVE_OPS]


# ---- helpers on a trace -------------------------------------------------------------------------------------------
def live_at_first_step(result) -> dict[str, list[int]]:
    """Storage sizes live per category at iteration 0's first optimizer event."""
    return by_category(live_before(result, lambda e: e.iteration == 0 and e.phase == "optimizer"))


def allocated(result, category: str, iteration: int) -> list[int]:
    return sorted(e.nbytes for e in result.events if e.action == "alloc" and e.category == category
                  and e.iteration == iteration)


# ---- the tests ----------------------------------------------------------------------------------------------------
def test_each_rank_holds_its_shards_their_gradients_and_adamw_state(config):
    plan, world, dp, result, more = config
    figures = held_figures(plan, world, dp)
    held = live_at_first_step(result)
    assert held["parameter"] == figures["parameter"]
    assert held["gradient"] == figures["gradient"]
    assert allocated(result, Category.OPTIMIZER_STATE, 0) == figures["optimizer_state"]
    assert audit(result) == ()
    meta = "--meta" in more
    if meta:  # built on meta: each parameter is made once, as its shard
        made = sorted(e.nbytes for e in result.events if e.action == "alloc" and e.category == Category.PARAMETER)
        assert made == figures["parameter"]
    # built on the GPU, the whole embedding (V x D) exists before distribute_tensor cuts it; from meta, never
    before = [e.nbytes for e in result.events if e.action == "alloc" and e.iteration < 0]
    assert (V * D * FP32 in before) == (not meta)


def test_dropout_on_a_sequence_shard_draws_its_mask_locally(config):
    plan, world, dp, result, more = config
    if plan != "lp":
        pytest.skip("no dropout in this configuration")
    # SequenceParallel on the dropout: native_dropout on the local (B, S / tp, D) shard, run by DTensor's RNG
    # tracker (OffsetBasedRNGTracker: run_dtensor_rng_op), its fp32 output and its bool mask
    for phase in ("forward", "backward"):  # drawn again (same RNG state) when checkpointing recomputes the block
        drawn = [e.nbytes for e in result.events if e.action == "alloc" and e.iteration == 1 and e.phase == phase
                 and e.op == "run_dtensor_rng_op"]
        assert drawn == [ACTIVATION // world, ACTIVATION // world // FP32]


def test_the_audit_checks_the_dtensor_shards_by_their_placements(config):
    plan, world, dp, result, more = config
    # every parameter here is a DTensor; no dimension is padded, so the placements' rule gives rank 0's storages
    facts = [f for f in result.facts if f.what == FACT_DTENSOR_PARAMETERS]
    assert [(f.device, f.nbytes) for f in facts] == [(0, sum(held_figures(plan, world, dp)["parameter"]))]
    # a trace that held the shards as something else (or not at all) is suspect, by that fact among others
    relabelled = copy.copy(result)
    relabelled.events = [dataclasses.replace(e, category=Category.TEMPORARY) if e.category == Category.PARAMETER
                         else e for e in result.events]
    assert any(reason.startswith(FACT_DTENSOR_PARAMETERS) for reason in audit(relabelled))


def test_collectives_allocate_what_upstream_redistribution_allocates(config):
    plan, world, dp, result, more = config
    figures = collective_figures(plan, world // dp, "--checkpoint" in more)
    for iteration in (0, 1):
        assert collectives(result, iteration, "forward") == figures["forward"]
    if dp == 1:  # under fully_shard the post-backward hooks add their own (see the 2-D test)
        assert collectives(result, 1, "backward") == figures["backward"]
    # wait_tensor returns its input on a GPU: no collective's output is counted twice
    assert not any(e.op == "wait_tensor" for e in result.events)


def test_redistributions_inside_an_op_are_recorded(config):
    # DTensor redistributes an op's arguments inside its dispatch when the op's strategy needs other placements
    # (OpDispatcher.redistribute_local_args); those buffers live only within the op, yet count at the peak
    plan, world, dp, result, more = config
    tp = world // dp
    ops = [e for e in result.events if e.action == "alloc" and e.iteration == 1]
    # RowwiseParallel's addmm: its matmul is Partial, so its Replicate bias is made Partial first
    # (Partial._partition_value: divided by tp), D elements, freed after the addmm
    assert [e.nbytes for e in ops if e.phase == "forward" and e.op == "div"
            and e.module.endswith("block.ffn.w2")] == [D * FP32]
    if dp > 1:
        return  # fully_shard hands the optimizer local shards of its own
    step = [(e.op, e.nbytes) for e in ops if e.phase == "optimizer" and e.op in ("clone", "all_reduce")]
    # AdamW's foreach ops take each gradient with its parameter: the embedding's Replicate gradient is cut to the
    # parameter's Shard(0) (a clone of V / tp rows) once by _foreach_lerp_ and twice by _foreach_addcmul_ (grad,
    # grad); with SP each LayerNorm's Partial gradient is all-reduced there as often (4 gradients of D elements)
    norms = 0 if plan == "tp" else 4
    assert sorted(step) == sorted([("clone", V // tp * D * FP32)] * 3 + all_reduce(D * FP32) * 3 * norms)


def test_logits_are_gathered_whole_unless_the_loss_is_parallel(config):
    plan, world, dp, result, more = config
    tp = world // dp
    forward = [e.nbytes for e in result.events if e.action == "alloc" and e.iteration == 1 and e.phase == "forward"]
    # the head's local logits (B, S, V / tp) always; the whole (B, S, V) only when they are gathered
    assert LOGITS // tp in forward
    assert (LOGITS in forward) == (plan != "lp")
    if plan != "lp":
        # backward: the logits' Replicate gradient goes back to the head's Shard(-1) by a local chunk, copied
        # (Replicate -> Shard: Shard._replicate_to_shard, _select_split_tensor(clone=True))
        clones = [e.nbytes for e in result.events if e.action == "alloc" and e.iteration == 1
                  and e.phase == "backward" and e.op == "clone"]
        assert LOGITS // tp in clones


def test_fully_shard_over_tp_gathers_the_tp_shards_per_unit(config):
    plan, world, dp, result, more = config
    if dp == 1:
        pytest.skip("no fully_shard in this configuration")
    tp = world // dp
    shapes = tp_local_shapes(plan, tp)
    # FSDP2's all-gather rebuilds each parameter's TP shard (dp padded shards, FSDPParam.init_all_gather_outputs),
    # never the global parameter: per unit, the block gathered in forward and again in backward, the root (not
    # resharded after forward) in forward only
    gathered = {unit: sorted(fsdp_shard(shapes[name], dp) * dp * FP32 for name in names)
                for unit, names in UNITS.items()}
    unsharded = {phase: sorted(e.nbytes for e in result.events if e.action == "alloc" and e.iteration == 1
                               and e.phase == phase and e.category == Category.UNSHARDED_PARAMETER)
                 for phase in ("forward", "backward")}
    assert unsharded["forward"] == sorted(gathered["block"] + gathered["root"])
    assert unsharded["backward"] == gathered["block"]
    # the TP collectives of backward are the SP ones, plus the LayerNorms' Partial gradients all-reduced by
    # _get_grad_inner_tensor before each unit's reduce-scatter (4 of D elements)
    backward = collectives(result, 1, "backward")
    expected = collective_figures(plan, tp)["backward"] + all_reduce(D * FP32) * 4
    assert sorted(backward) == sorted(expected)
    # the embedding's gradient is still made whole (Replicate, V x D) by its backward, then cut to the TP shard
    # (a clone of V / tp rows) before the reduce-scatter, which makes the FSDP shard of it
    made = [(e.op, e.nbytes) for e in result.events if e.action == "alloc" and e.iteration == 1
            and e.phase == "backward"]
    whole = made.index(("embedding_dense_backward", V * D * FP32))
    assert ("clone", V // tp * D * FP32) in made[whole:]


def test_symmetric_memory_is_not_modelled_and_says_so():
    # async TP's peer-to-peer buffers come from symmetric memory, outside the caching allocator
    with pytest.raises(TraceError) as failure:
        run_trace(["python", str(SCRIPTS / "tp_symm_mem.py")], iterations=1)  # no launcher: the cheapest start
    assert failure.value.kind == "not_modelled" and "symmetric memory" in str(failure.value)
    assert "_symmetric_memory.empty" in str(failure.value)
