"""Iteration boundaries (TrainingState): a hand-written update loop without torch.optim counts backward passes;
evaluation before the first step and nn.Module transforms on host data never end a training trace; a program that
only runs forward passes is traced as such, one pass per iteration, and ends promptly with its peak."""

import sys
import time

from xmem.estimate import estimate_traces, resolve_gpus
from xmem.gpus import load_catalog
from xmem.trace import run_trace
from xmem.trace.child.recorder import FORWARD_ONLY_PASSES

MANUAL = """import torch
w = torch.zeros(256, 256, device="cuda", requires_grad=True)
step = 0
while True:  # only the tracer's stop ends this loop
    loss = (torch.randn(8, 256, device="cuda") @ w).square().mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
        w.grad = None
    step += 1
"""

STEPS = 700  # generated per batch: more than half of FORWARD_ONLY_PASSES
GENERATION = f"""import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda()
with torch.no_grad():
    while True:  # batch inference that never ends by itself
        cache = [model(torch.randn(4, 64, device="cuda"))]
        for _ in range({STEPS} - 1):  # one pass per new token, the cache growing with each
            cache.append(model(cache[-1]))
"""

# Before its first step the program runs 300 nn.Module transforms per sample on host data (torchvision style), then
# evaluates 300 batches under no_grad, before it has an optimizer, with a batch larger than training's.
EVAL_FIRST = """import torch
from torch import nn

class Jitter(nn.Module):
    def forward(self, x):
        return x + 0.01 * torch.randn_like(x)

transform = nn.Sequential(Jitter(), Jitter())
samples = [transform(torch.randn(64)) for _ in range(300)]
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
with torch.no_grad():
    for _ in range(300):
        model(torch.randn(2048, 64, device="cuda"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
while True:
    batch = torch.stack([transform(s) for s in samples[:8]]).cuda()
    loss = model(batch).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_a_loop_without_an_optimizer_ends_after_n_backward_passes(tmp_path):
    script = tmp_path / "manual.py"
    script.write_text(MANUAL)
    result = run_trace([sys.executable, str(script)], iterations=3, timeout=120)
    assert result.iterations == 3
    grads = [e for e in result.events if e.action == "alloc" and e.nbytes == 256 * 256 * 4 and e.phase == "backward"]
    assert len(grads) == 3  # one gradient of w per backward pass, freed by the hand-written update


def test_evaluation_and_host_transforms_before_the_first_step_are_part_of_the_training_trace(tmp_path):
    script = tmp_path / "eval_first.py"
    script.write_text(EVAL_FIRST)
    result = run_trace([sys.executable, str(script)], iterations=2, timeout=300)
    assert result.iterations == 2 and not result.forward_only
    evaluated = [e for e in result.events if e.action == "alloc" and e.nbytes == 2048 * 256 * 4]
    assert len(evaluated) == 2 * 300 and {e.iteration for e in evaluated} == {0}  # the job's peak sees them


def test_a_forward_only_program_is_traced_pass_by_pass_until_its_peak_holds(tmp_path):
    script = tmp_path / "generation.py"
    script.write_text(GENERATION)
    started = time.monotonic()
    result = run_trace([sys.executable, str(script)], iterations=3, timeout=300)
    assert time.monotonic() - started < 120  # well before the timeout
    assert result.forward_only and result.iterations == 0 and not result.unstepped_optimizers
    assert not result.peak_rising
    assert any(w.startswith("traced forward passes only") for w in result.warnings)
    peaks = per_iteration_peaks(result.events)
    assert sorted(peaks) == list(range(result.forward_passes))  # one iteration per pass
    highest = max(peaks.values())
    rose = min(number for number, peak in peaks.items() if peak == highest)
    assert STEPS - 1 <= rose <= STEPS  # the first batch's longest sequence (or the next's first pass beside it)
    assert highest > STEPS * 4 * 64 * 4  # every step's output held
    assert result.forward_passes >= max(FORWARD_ONLY_PASSES, 2 * (rose + 1))  # held through as many passes again
    estimated = estimate_traces(["python", str(script)], {"sm80+": result}, resolve_gpus(["a100-40gb"], load_catalog()))
    assert estimated.forward_only and estimated.to_json()["forward_only"] and not estimated.suspect


def per_iteration_peaks(events):
    live, peaks = 0, {}
    for event in events:
        live += event.nbytes if event.action == "alloc" else -event.nbytes if event.action == "free" else 0
        if event.iteration >= 0:
            peaks[event.iteration] = max(peaks.get(event.iteration, 0), live)
    return peaks
