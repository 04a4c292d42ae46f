"""The client corpus (tests/corpus/): programs in the styles of the most used training stacks, each estimated with
the real tracer once. Each must succeed, and the parameter, gradient and optimizer-state bytes of its trace must
equal what its model and optimizer really hold, counted here from the same model built on the CPU."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "corpus"))
from programs import CORPUS_DIR, ITERATIONS, PROGRAMS  # noqa: E402

from xmem.trace import TraceError, run_trace  # noqa: E402

STEP_BYTES = 4  # a fused or capturable Adam keeps each parameter's `step` as an fp32 scalar on the GPU


def load(script: str):
    """The corpus program as a module (its main() is not run), to build its model here."""
    spec = importlib.util.spec_from_file_location(f"corpus_{Path(script).stem}", CORPUS_DIR / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def param_bytes(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)


def live_bytes(events, category: str) -> tuple[int, int]:
    """(bytes of `category` live after `events`, the most live at once among them)."""
    live = peak = 0
    for event in events:
        if event.category == category:
            live += event.nbytes if event.action == "alloc" else -event.nbytes if event.action == "free" else 0
            peak = max(peak, live)
    return live, peak


def held(trace) -> tuple[int, int, int]:
    """What the trace says the GPU held: the parameters once the program's setup is done (before its first
    training iteration: FSDP2's all-gathered copies come later), the most gradient and optimizer-state bytes live
    at once."""
    setup = [event for event in trace.events if event.iteration == -1]
    return (live_bytes(setup, "parameter")[0], live_bytes(trace.events, "gradient")[1],
            live_bytes(trace.events, "optimizer_state")[1])


# ---- what each program's model and optimizer really hold: (parameters, gradients, optimizer state) in bytes -----
def all_trainable(model, state_copies: int, step_on_gpu: bool = False) -> tuple[int, int, int]:
    """fp32 model, every parameter trained; `state_copies` fp32 tensors of state per parameter (Adam 2, momentum
    1, plain SGD 0)."""
    params = param_bytes(model)
    steps = STEP_BYTES * len(list(model.parameters())) if step_on_gpu else 0
    return params, params, state_copies * params + steps


def expect_hf_trainer():
    from transformers import TrainingArguments
    # the Trainer's default optimizer (adamw_torch_fused with torch >= 2.8) keeps each `step` on the GPU
    optim = TrainingArguments.__dataclass_fields__["optim"].default
    fused = "fused" in str(getattr(optim, "value", optim))
    return all_trainable(load("hf_trainer.py").build_model(), 2, step_on_gpu=fused)


def ddp(expected: tuple[int, int, int]) -> tuple[int, int, int]:
    """DDP without gradient_as_bucket_view (the default) holds every gradient twice: in `.grad` and in the
    Reducer's bucket it is all-reduced in."""
    params, gradients, state = expected
    return params, 2 * gradients, state


def expect_peft_lora():
    program = load("peft_lora.py")
    model = program.build_model(program.build_base().to(torch.bfloat16))  # loaded in bf16; adapters stay fp32
    trainable = param_bytes(model, trainable_only=True)
    assert trainable < param_bytes(model) / 4  # the base is frozen: it has no gradients and no state
    return param_bytes(model), trainable, 2 * trainable


def expect_fsdp2_rank0():
    """FSDP2 keeps on each rank dim-0 shard ceil(rows / world) of every parameter (rank 0 gets a full chunk), in
    fp32 (bf16 is only the all-gathered compute copy); gradients and AdamW's moments are sharded alike."""
    world = 2
    shard = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
                for p in load("fsdp2_torchrun.py").build_model().parameters())
    return shard, shard, 2 * shard


EXPECTED = {
    "hf_trainer": expect_hf_trainer,
    "peft_lora": expect_peft_lora,
    "lightning_trainer": lambda: all_trainable(load("lightning_trainer.py").build_model(), 2),
    "fabric_1": lambda: all_trainable(load("fabric_train.py").build_model(), 2),
    "fabric_2_ddp": lambda: ddp(all_trainable(load("fabric_train.py").build_model(), 2)),
    "timm_amp": lambda: all_trainable(load("timm_train.py").build_model(), 1),
    "accelerate_bf16": lambda: all_trainable(load("accelerate_train.py").build_model(), 2),
    "ddp_torchrun_2": lambda: ddp(all_trainable(load("ddp_torchrun.py").build_model(), 1)),
    "fsdp2_torchrun_2": expect_fsdp2_rank0,
    "lstm_lm_sgd": lambda: all_trainable(load("lstm_lm.py").build_model(), 0),  # plain SGD keeps no state
    "lstm_lm_by_hand": lambda: all_trainable(load("lstm_lm.py").build_model(), 0),  # p.data.add_(p.grad...)
    "example_loop": lambda: all_trainable(load("example_loop.py").build_model(), 1),
}


def test_every_corpus_program_has_its_expectation():
    assert EXPECTED.keys() == PROGRAMS.keys()


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def traced(request, warm_tracer):
    """(program, its Trace or the TraceError its estimate ended with): one trace per program, through the warm
    tracer (tests/conftest.py: Lightning's and Fabric's traces take 3-4 s instead of 30 on a loaded machine)."""
    program = PROGRAMS[request.param]
    try:
        return program, run_trace(program.command(), iterations=ITERATIONS, timeout=600, **program.options)
    except TraceError as error:
        return program, error


def succeeded(program, trace) -> None:
    if isinstance(trace, TraceError):
        pytest.fail(f"{program.name}: {trace.kind}: {trace}\n{trace.user_traceback[-2000:]}\n{trace.output[-1500:]}")
    assert trace.used_cuda and trace.iterations == ITERATIONS, program.name


# slow: each program imports a training stack and runs it, 15-40 s per trace here
@pytest.mark.slow
def test_the_estimate_succeeds(traced):
    succeeded(*traced)


@pytest.mark.slow
def test_parameter_gradient_and_state_bytes_are_what_the_program_holds(traced):
    program, trace = traced
    succeeded(program, trace)
    assert held(trace) == EXPECTED[program.name](), program.name


@pytest.mark.slow
def test_no_memory_size_warning_from_the_stacks_own_reads(traced):
    """None of these programs sizes itself by the GPU; the stacks' own reads (transformers' allocator warm-up under
    from_pretrained with a device_map, in peft_lora) only cap an allocation and must not make the estimate warn."""
    program, trace = traced
    succeeded(program, trace)
    assert not [w for w in trace.warnings if "memory size" in w], program.name
