"""FSDP units with activation checkpointing, FSDP2's reshard_after_forward, and model state dicts taken and saved on
rank 0 inside the training loop, traced on rank 0 (tests/scripts/fsdp_units.py: two blocks Linear(256, 512), GELU,
Linear(512, 256), each a unit, the root unit holding the head Linear(256, 16), a batch of 8; after each step the
program takes the state dict, torch.saves it and drops it). Expected per-rank bytes derived by hand from upstream's
rules: torch/distributed/fsdp/_runtime_utils.py, _state_dict_utils.py and _unshard_param_utils.py for FSDP1,
_fully_shard/_fsdp_state.py, _fsdp_param_group.py and _fsdp_param.py for FSDP2, torch/distributed/checkpoint/
state_dict.py and torch/distributed/_state_dict_utils.py for its state dicts, torch/utils/checkpoint.py. Every
dimension 0 divides by 8 and every numel by 4: no padding anywhere. Each trace (2 iterations; iteration 1 is steady,
and the save after the first step is its first work, before its batch) is shared by the tests that read it: one
configuration shows several rules."""

import math

import pytest

from tests.torch_builds import SCRIPTS
from tests.trace.child.live_storages import walk
from tests.trace.child.test_fsdp import peak_live, unsharded_per_pass
from tests.trace.child.test_scripts import allocs
from xmem.audit import audit
from xmem.trace import run_trace
from xmem.trace.errors import TraceError
from xmem.trace.events import Category

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what rank 0 allocates: forked warm

FP32, BF16 = 4, 2
BATCH = 8
BLOCK = [(512, 256), (512,), (256, 512), (256,)]  # a block's parameters in registration (= state dict) order
HEAD = [(16, 256), (16,)]

# name -> (world, the script's options); the name says what each trace shows
CONFIGS = {
    "fsdp1-w2-ac_inside-bf16-full+optim": (2, ["--api", "fsdp1", "--ac", "inside", "--mp", "bf16", "--kind", "full",
                                               "--optim", "1"]),
    "fsdp1-w4-ac_around-full_offload": (4, ["--api", "fsdp1", "--ac", "around", "--kind", "full", "--offload", "1"]),
    "fsdp1-w8-sharded": (8, ["--api", "fsdp1", "--kind", "sharded"]),
    "fsdp2-w8-ac_inside-full_offload": (8, ["--api", "fsdp2", "--ac", "inside", "--kind", "full", "--offload", "1"]),
    "fsdp2-w8-reshard_false-sharded_offload+optim": (8, ["--api", "fsdp2", "--reshard", "false", "--kind", "sharded",
                                                         "--offload", "1", "--optim", "1"]),
    "fsdp2-w8-reshard_2-full+optim": (8, ["--api", "fsdp2", "--reshard", "2", "--kind", "full", "--optim", "1"]),
    # the same rules at the other worlds (benchmarks/results/sharding/coverage.md)
    "fsdp2-w4-ac_inside-full": (4, ["--api", "fsdp2", "--ac", "inside", "--kind", "full"]),
    "fsdp2-w2-reshard_false-sharded": (2, ["--api", "fsdp2", "--reshard", "false", "--kind", "sharded"]),
    "fsdp1-w8-full+optim": (8, ["--api", "fsdp1", "--kind", "full", "--optim", "1"]),
}
TRACES: dict[str, object] = {}


@pytest.fixture(scope="module")
def units(request):
    """(configuration name, its trace), one trace per configuration for the module."""
    name = request.param
    if name not in TRACES:
        world, options = CONFIGS[name]
        TRACES[name] = run_trace(["torchrun", f"--nproc_per_node={world}", str(SCRIPTS / "fsdp_units.py"), *options],
                                 iterations=2)
    return name, TRACES[name]


def on(*names: str):
    return pytest.mark.parametrize("units", names, indirect=True)


def option(name: str, flag: str, default: str) -> str:
    options = CONFIGS[name][1]
    return options[options.index(flag) + 1] if flag in options else default


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def flat(params: list[tuple[int, ...]], world: int) -> int:
    """FSDP1's padded unsharded flat parameter of a unit in fp32 (use_orig_params: each numel a multiple of 4, no
    padding inside; ceil(numel / N) * N elements)."""
    return math.ceil(sum(numel(shape) for shape in params) / world) * world * FP32


def dim0_chunk(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's torch.chunk of a tensor along dim 0."""
    return math.ceil(shape[0] / world) * numel(shape[1:])


# ---- activation checkpointing inside / around each unit -----------------------------------------------------------
# Upstream, the recomputation in backward does not gather a unit again: it runs after the unit's pre-backward hook
# has gathered it (the hook sits on the unit's outputs, reached before the ops whose saved tensors trigger the
# recompute), and a forward that runs then skips FSDP's own pre- and post-forward (FSDP1 _pre_forward / _post_forward:
# "recomputed forward", the handle in BACKWARD_PRE; FSDP2 FSDPState._pre_forward / _post_forward: PRE_BACKWARD, which
# unshards only a group that is not unsharded). So each pass gathers as without checkpointing: the forward every
# unit, the backward the blocks (the root is not resharded after forward). What changes is the activations: each
# block's inner outputs (Linear(256, 512)'s, 8 x 512 in the compute dtype, and GELU's, the same) are freed in forward
# and made again in backward; torch.utils.checkpoint's non-reentrant recompute stops once the last tensor the forward
# saved is saved again (_StopRecomputationError), which is Linear(512, 256)'s input, saved before that op runs: its
# output is not recomputed.
def gathered_per_pass(api: str, world: int) -> tuple[list[int], list[int]]:
    """(forward, backward) sizes of the fp32 unsharded parameters allocated in a steady iteration: FSDP1 one flat
    parameter per unit (_alloc_padded_unsharded_flat_param), FSDP2 one per parameter (FSDPParam
    alloc_all_gather_outputs: N padded dim-0 shards, here its own size)."""
    if api == "fsdp1":
        units = [[flat(HEAD, world)], [flat(BLOCK, world)], [flat(BLOCK, world)]]
    else:
        units = [[numel(s) * FP32 for s in params] for params in (HEAD, BLOCK, BLOCK)]
    return sorted(n for unit in units for n in unit), sorted(n for unit in units[1:] for n in unit)


def fsdp1_bf16_per_pass(world: int) -> tuple[list[int], list[int]]:
    """FSDP1 with MixedPrecision(param_dtype=bf16) gathers per unit the bf16 copy of its shard
    (_use_low_precision_shard: _mp_shard) and the bf16 unsharded flat parameter (_full_param_padded)."""
    units = [flat(HEAD, world) // FP32, flat(BLOCK, world) // FP32, flat(BLOCK, world) // FP32]
    per_unit = [[n * BF16, n // world * BF16] for n in units]
    return sorted(n for unit in per_unit for n in unit), sorted(n for unit in per_unit[1:] for n in unit)


def inner_allocations(result, phase: str) -> list:
    return [e for e in allocs(result, phase=phase) if e.iteration == 1 and ".inner." in e.module]


@on("fsdp1-w2-ac_inside-bf16-full+optim", "fsdp1-w4-ac_around-full_offload", "fsdp2-w8-ac_inside-full_offload",
    "fsdp2-w4-ac_inside-full")
def test_activation_checkpointing_in_fsdp_units_recomputes_without_gathering_again(units):
    name, result = units
    world, api = CONFIGS[name][0], option(name, "--api", "")
    compute = BF16 if option(name, "--mp", "none") == "bf16" else FP32
    forward, backward = fsdp1_bf16_per_pass(world) if compute == BF16 else gathered_per_pass(api, world)
    assert unsharded_per_pass(result, 1, "forward") == forward
    assert unsharded_per_pass(result, 1, "backward") == backward  # no gather for the recompute
    recomputed = [BATCH * 512 * compute] * 2  # per block: Linear(256, 512)'s output, GELU's
    # forward: each block's Linear(256, 512) and GELU outputs die within the forward (the block's input is what is
    # kept); Linear(512, 256)'s output is the next block's input
    made = {e.block: e for e in inner_allocations(result, "forward") if not e.module.endswith("inner.2")}
    assert sorted(e.nbytes for e in made.values()) == recomputed * 2
    freed_in_forward = {e.block for e in result.events if e.action == "free" and e.iteration == 1
                        and e.phase == "forward"}
    assert set(made) <= freed_in_forward
    # backward: the same two outputs made again per block, by the same modules' ops, the last block first
    again = inner_allocations(result, "backward")
    assert [(e.op, e.nbytes) for e in again] == [("addmm", recomputed[0]), ("gelu", recomputed[1])] * 2
    assert [e.module.split(".inner.")[0].rsplit("blocks.", 1)[1][0] for e in again] == ["1", "1", "0", "0"]
    assert audit(result) == ()


# ---- FSDP2 reshard_after_forward True / False / int at world 8 (2, 4)----------------------------------------------
def fsdp2_reshard_figures(reshard: str) -> dict[str, object]:
    """What fully_shard(block, reshard_after_forward=...) gathers on rank 0 in a steady iteration, from upstream
    (the root unit's reshard_after_forward is set False by its lazy init, whatever was asked; FSDPParamGroup.reshard
    in forward):
    - True: each block resharded in its post-forward (free_unsharded_param) and gathered again in its pre-backward;
    - False: kept from its forward to its post-backward: nothing gathered in backward, every block's parameters
      live at the end of forward;
    - an int N: resharded to N ranks: each parameter's 1/N of the all-gather output is cloned and kept
      (FSDPParam.to_sharded_post_forward: _sharded_post_forward_param_data), the gathered parameter freed; in
      backward it is gathered again from those (to_unsharded frees them after the copy-out)."""
    head, block = [numel(s) * FP32 for s in HEAD], [numel(s) * FP32 for s in BLOCK]
    kept = [n // int(reshard) for n in block] if reshard not in ("true", "false") else []
    return {
        "forward": sorted(head + block * 2 + kept * 2),
        "backward": [] if reshard == "false" else sorted(block * 2),
        # gathered parameters live at the end of forward: the root's, and the blocks' (False) or their 1/N
        "after_forward": sum(head) + (2 * sum(block) if reshard == "false" else 2 * sum(kept)),
    }


def live_unsharded_after_forward(result) -> int:
    """Unsharded parameter bytes live after iteration 1's last forward event."""
    held = None
    for e, live in walk(result):
        if e.iteration == 1 and e.phase == "backward":
            break
        if e.iteration == 1 and e.phase == "forward":
            held = sum(a.nbytes for a in live.values() if a.category == Category.UNSHARDED_PARAMETER)
    assert held is not None, "no forward in iteration 1"
    return held


@on("fsdp2-w8-ac_inside-full_offload", "fsdp2-w8-reshard_false-sharded_offload+optim", "fsdp2-w8-reshard_2-full+optim",
    "fsdp2-w4-ac_inside-full", "fsdp2-w2-reshard_false-sharded")
def test_fsdp2_reshard_after_forward_sets_what_each_block_keeps_until_its_backward(units):
    name, result = units
    reshard = option(name, "--reshard", "true")
    figures = fsdp2_reshard_figures(reshard)
    assert unsharded_per_pass(result, 1, "forward") == figures["forward"]
    assert unsharded_per_pass(result, 1, "backward") == figures["backward"]
    assert live_unsharded_after_forward(result) == figures["after_forward"]
    block, head = sum(numel(s) * FP32 for s in BLOCK), sum(numel(s) * FP32 for s in HEAD)
    most = peak_live(result, lambda e: e.category == Category.UNSHARDED_PARAMETER, since=1)
    if reshard == "false":  # every unit gathered at once at the end of forward
        assert most == head + 2 * block
    else:  # one block at a time beside the root (or the other block's 1/N), two in backward (prefetch) at most
        assert head + block <= most <= head + 2 * block
    assert audit(result) == ()


# ---- state dicts saved on rank 0 ----------------------------------------------------------------------------------
# Rank 0 is the fullest rank: with FSDP1's rank0_only or FSDP2's cpu_offload (ranks_only=(0,)) the other ranks drop
# what they gathered at once.
def save_events(result) -> list:
    """The state dict's allocations and frees: iteration 1's events before its batch is drawn, but the frees of the
    first step's gradients (zero_grad)."""
    window = []
    for e in result.events:
        if e.iteration == 1 and e.category == Category.INPUT:
            break
        if e.iteration == 1 and e.category != Category.GRADIENT:
            window.append(e)
    return window


def replayed(events: list[tuple[str, int]]) -> tuple[list[int], int, int]:
    """(sizes allocated in order, the most bytes live at once, bytes left live at the end) of a list of
    ("alloc" | "free", bytes); a free names the bytes of the oldest live allocation of that size."""
    live: list[int] = []
    made, peak = [], 0
    for action, nbytes in events:
        if action == "alloc":
            live.append(nbytes)
            made.append(nbytes)
        else:
            live.remove(nbytes)
        peak = max(peak, sum(live))
    return made, peak, sum(live)


def traced_save(result) -> tuple[list[int], int, int]:
    return replayed([(e.action, e.nbytes) for e in save_events(result)])


def fsdp1_save(world: int, kind: str, offload: bool, optim: bool = False) -> list[tuple[str, int]]:
    """Rank 0's GPU allocations and frees while FSDP1 (use_orig_params) makes a state dict, by upstream's rules:
    - nn.Module.state_dict runs each FSDP module's pre-hook before its children and its post-hook after them, so the
      root unit is unsharded first and resharded last, each block unsharded and resharded in turn inside it
      (_pre_state_dict_hook / _post_state_dict_hook -> _enter/_exit_unshard_params_ctx);
    - unsharding allocates the padded unsharded flat parameter in full precision even under a bf16 MixedPrecision
      (_unshard_fsdp_state_params is SUMMON_FULL_PARAMS, FlatParamHandle._force_full_precision, the
      _full_prec_full_param_padded buffer): ceil(numel / N) * N fp32 elements;
    - FULL_STATE_DICT, no offload: the post-hook clones each of the unit's parameters on the GPU before resharding
      (_full_post_state_dict_hook: detach().clone()), and the clones are the dict's values: kept until dropped;
    - FULL_STATE_DICT, offload_to_cpu (rank 0 of rank0_only): FlatParamHandle.to_cpu copies the unsharded flat
      parameter to the host and frees it (_offload_to_cpu -> _free_unsharded_flat_param); the clones are host
      tensors; on exit it is allocated again and copied back from the host (_restore_unsharded_flat_param_from_cpu)
      before _reshard frees it: each unit's flat parameter twice, one at a time;
    - SHARDED_STATE_DICT (offload_to_cpu ignored while unsharding): the post-hook keeps rank 0's dim-0 chunk of each
      parameter, cloned (_shard_utils._create_chunk_sharded_tensor: chunks[rank].clone()), as a ShardedTensor;
    - the optimizer's state dict (FSDP.optim_state_dict with use_orig_params, its default full config:
      offload_to_cpu), taken while the model's is held: per unit, in the order of the sorted parameter names (the
      blocks, then the root's head), _allgather_orig_param_states allocates the unit's padded unsharded flat state
      (empty: the state's dtype, fp32) and, per tensor state (AdamW's exp_avg, exp_avg_sq), rank 0's flat shard of it
      (torch.cat of its views' states and of empty padding: ceil(numel / N) elements), which it all-gathers into
      the flat state; each parameter's view of that is copied to the host (_unflatten_orig_param_states). The second
      shard is made while the first is still named (local_shard); both and the flat state die when it returns."""
    root, block = flat(HEAD, world), flat(BLOCK, world)
    kept = (lambda shape: numel(shape) * FP32) if kind == "full" else (lambda shape: dim0_chunk(shape, world) * FP32)
    events = [("alloc", root)] + ([("free", root)] if offload else [])  # the root's pre-hook
    for _block in range(2):  # each block: pre-hook, its parameters, post-hook
        events.append(("alloc", block))
        events += [("free", block), ("alloc", block)] if offload else [("alloc", kept(shape)) for shape in BLOCK]
        events.append(("free", block))
    if offload:  # the root's post-hook: restored from the host, then resharded
        events += [("alloc", root), ("free", root)]
    else:  # the root's post-hook: the head's clones, then resharded
        events += [("alloc", kept(shape)) for shape in HEAD] + [("free", root)]
    for unit in [block, block, root] if optim else []:
        shard = unit // world
        events += [("alloc", unit), ("alloc", shard), ("alloc", shard), ("free", shard), ("free", shard),
                   ("free", unit)]
    # the program drops the dict after saving it
    events += [] if offload else [("free", kept(shape)) for shape in BLOCK * 2 + HEAD]
    return events


@on("fsdp1-w2-ac_inside-bf16-full+optim", "fsdp1-w4-ac_around-full_offload", "fsdp1-w8-sharded", "fsdp1-w8-full+optim")
def test_fsdp1_state_dict_on_rank_0_gathers_each_unit_in_full_precision_and_keeps_what_upstream_keeps(units):
    name, result = units
    world, kind, offload = CONFIGS[name][0], option(name, "--kind", ""), option(name, "--offload", "0") == "1"
    made, peak, left = replayed(fsdp1_save(world, kind, offload, optim=option(name, "--optim", "0") == "1"))
    assert traced_save(result) == (made, peak, left)
    assert left == 0  # torch.save keeps no reference: the dict's GPU tensors die with it, before the next batch
    gathers = {e.category for e in save_events(result) if e.action == "alloc" and e.op == "resize_"}
    assert gathers == {Category.UNSHARDED_PARAMETER}


def test_fsdp1_state_dict_figures_in_one_number_each():
    # the root's flat parameter, both blocks' clones and the second block's flat parameter (world 2); with
    # offload_to_cpu the largest unit's flat parameter alone; sharded (world 8): the root's and a block's flat
    # parameters and both blocks' 1/8 chunks
    assert replayed(fsdp1_save(2, "full", False))[1] == 4112 * FP32 + 3 * 262912 * FP32
    assert replayed(fsdp1_save(4, "full", True))[1] == 262912 * FP32
    assert replayed(fsdp1_save(8, "sharded", False))[1] == 4112 * FP32 + 262912 * FP32 + 2 * 262912 // 8 * FP32


def fsdp2_save(kind: str, offload: bool, optim: bool = False) -> list[tuple[str, int]]:
    """Rank 0's GPU allocations and frees for FSDP2's state dict, by upstream's rules: model.state_dict() gives the
    sharded DTensor parameters (nothing allocated), and a sharded state dict is that (with cpu_offload, host copies
    of the shards: _offload_state_dict_to_cpu). A full one: _maybe_full_or_cpu_state_dict -> _gather_state_dict
    redistributes each, in the dict's order, from Shard(0) to Replicate: one all-gather output of the whole parameter
    (funcol.all_gather_tensor; dims divide evenly, so no padding and no copy; wait_tensor returns it); with
    cpu_offload (ranks_only=(0,)) _iterate_state_dict replaces it by its host copy (ret.to(cpu)) at once, so it dies
    there; without, every gathered parameter stays on the GPU until the dict is dropped. The optimizer's
    (get_optimizer_state_dict with the same options, after the model's) goes the same way through each parameter's
    state in the optimizer's order: AdamW's step (a host scalar, nothing), exp_avg and exp_avg_sq (sharded DTensors,
    each all-gathered whole)."""
    if kind == "sharded":  # with cpu_offload, host copies of the shards (_offload_state_dict_to_cpu): nothing either
        return []
    gathered = [numel(shape) * FP32 for shape in BLOCK * 2 + HEAD]
    gathered += [n for n in gathered for _moment in range(2)] if optim else []
    events: list[tuple[str, int]] = []
    for nbytes in gathered:
        events += [("alloc", nbytes)] + ([("free", nbytes)] if offload else [])
    return events + ([] if offload else [("free", nbytes) for nbytes in gathered])


@on("fsdp2-w8-ac_inside-full_offload", "fsdp2-w8-reshard_false-sharded_offload+optim", "fsdp2-w8-reshard_2-full+optim",
    "fsdp2-w4-ac_inside-full", "fsdp2-w2-reshard_false-sharded")
def test_fsdp2_state_dict_on_rank_0_gathers_each_parameter_whole_when_full(units):
    name, result = units
    kind, offload, optim = option(name, "--kind", ""), option(name, "--offload", "0") == "1", option(name, "--optim",
                                                                                                 "0") == "1"
    made, peak, left = replayed(fsdp2_save(kind, offload, optim))
    assert traced_save(result) == (made, peak, left)
    if kind == "full":  # one parameter at a time, or the whole model (and its two moments)
        assert peak == (max(made) if offload else sum(made)) == (524288 if offload else (3 if optim else 1) * (
            2 * 262912 + 4112) * FP32)
        assert all(e.op == "all_gather_into_tensor" for e in save_events(result) if e.action == "alloc")


def test_distributed_checkpoint_save_over_ranks_is_named_not_modelled():
    # dcp.save merges every rank's plan on a coordinator (gather_object): the traced rank alone cannot stand in
    with pytest.raises(TraceError) as failure:
        run_trace(["torchrun", "--nproc_per_node=2", str(SCRIPTS / "fsdp_units.py"), "--api", "fsdp2", "--kind",
                   "sharded", "--save", "dcp"], iterations=2)
    assert failure.value.kind == "not_modelled" and "torch.distributed.checkpoint.save" in str(failure.value)
