"""torch.compile'd programs traced as compiled (xmem/trace/child/compiled.py): the activations AOTAutograd's
partitioner (Inductor's choice, min-cut rematerialization) saves, the values Inductor writes to memory, each freed
after its last use; a region not followed is traced eagerly with a warning that names it. The programs are
tests/scripts/compiled_models.py; the swish model's figures are derived by hand below."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.trace.child.live_storages import live_before, walk
from xmem.trace.runner import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what a program allocates: forked warm

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compiled_models.py"
MiB = 1 << 20


def trace(*options: str):
    result = run_trace([sys.executable, str(SCRIPT), *options], iterations=2)
    assert result.iterations == 2
    return result


def steady_peak(result) -> int:
    """The most bytes live at once from the second iteration on (the first compiles, with the first batch alone)."""
    return max(sum(e.nbytes for e in live.values()) for event, live in walk(result) if event.iteration >= 1)


def live_at_first_backward(result) -> int:
    events = result.events
    first = next(e for e in events if e.iteration == 1 and e.phase == "backward")
    return sum(e.nbytes for e in live_before(result, lambda e: e is first).values())


@pytest.fixture(scope="module")
def swish():
    return {mode: trace("--model", "swish", "--compile", mode) for mode in ("none", "module")}


def test_compiled_swish_peak_is_the_hand_derived_one(swish):
    # fp32, batch 16384: x 16 MiB, each 1024-wide activation 64 MiB, the output 16 MiB; weights 1 + 1 MiB.
    # Inductor's partition saves h = up(x) and y = h*sigmoid(h)*2+1 (the down projection's input) and recomputes
    # sigmoid(h) in backward. The peak is in the loss's eager backward (pow(2).mean()): weights 2, x 16, h and y
    # 128, the output 16 (pow saved it), the loss and its ones 4 B each, and pow/mean's four 16 MiB temporaries.
    compiled = swish["module"]
    assert steady_peak(compiled) == (2 + 16 + 128 + 16 + 4 * 16) * MiB + 8
    assert compiled.warnings == []


def test_compiled_swish_saves_one_activation_less_than_eager(swish):
    # eager saves sigmoid(h) too (its mul's input); the compiled program recomputes it: 64 MiB less held as the
    # backward pass begins, and a lower peak
    eager, compiled = swish["none"], swish["module"]
    assert live_at_first_backward(eager) - live_at_first_backward(compiled) == 64 * MiB
    assert steady_peak(compiled) < steady_peak(eager)


def test_eager_swish_peak_is_the_hand_derived_one(swish):
    # without torch.compile nothing of the compiled path runs (no warning). The eager peak is in the chain's
    # backward: weights 2, x 16, h and sigmoid(h) 128, the down weight's gradient 1, y's gradient 64 and two 64 MiB
    # temporaries of the unfused products' gradients, the loss and its ones 4 B each
    eager = swish["none"]
    assert steady_peak(eager) == (2 + 16 + 128 + 1 + 64 + 2 * 64) * MiB + 8
    assert not any("torch.compile" in w for w in eager.warnings)


@pytest.fixture(scope="module")
def block():
    return {mode: trace("--model", "block", "--compile", mode) for mode in ("none", "module", "method")}


def test_compiled_transformer_block_needs_less_than_eager(block):
    eager, compiled = block["none"], block["module"]
    assert compiled.warnings == []
    assert steady_peak(compiled) < 0.8 * steady_peak(eager)
    assert live_at_first_backward(compiled) < live_at_first_backward(eager)


def test_model_compile_method_traces_as_torch_compile_of_the_model(block):
    assert steady_peak(block["method"]) == steady_peak(block["module"])
    # the tracer's module hooks still see the model's call: its forward is the forward phase
    assert any(e.phase == "forward" for e in block["method"].events)


def test_a_compiled_loss_function_is_followed(block):
    compiled = trace("--model", "block", "--compile", "function")
    assert compiled.warnings == []
    assert steady_peak(compiled) < steady_peak(block["none"])


def test_a_graph_break_still_traces_compiled(block):
    broken = trace("--model", "block", "--compile", "module", "--graph-break")
    assert broken.warnings == []
    assert steady_peak(broken) < steady_peak(block["none"])


def test_a_backend_of_the_program_is_named_and_traced_eagerly(block):
    result = trace("--model", "block", "--compile", "backend")
    assert any("backend 'backend_of_the_program' was not followed" in w for w in result.warnings)
    assert steady_peak(result) == steady_peak(block["none"])


def test_a_region_our_backend_cannot_compile_runs_eagerly_and_is_named(monkeypatch):
    from xmem.trace.child import compiled
    heard: list[str] = []
    monkeypatch.setattr(compiled, "_fake_cuda", SimpleNamespace(on_warning=heard.append))

    def scale(x):
        return torch.sigmoid(x) * 3

    graph = torch.fx.symbolic_trace(scale)
    run = compiled.traced_backend(graph, [])  # AOTAutograd cannot trace it with no example inputs
    assert run == graph.forward  # dynamo's graph, run as captured
    assert len(heard) == 1 and heard[0].startswith("torch.compile: a compiled region (2 ops") and \
        "was traced eagerly" in heard[0]
