"""Iteration boundaries without torch.optim (TrainingState): a hand-written update loop counts backward passes;
a program with no training loop at all ends promptly with no_optimizer_step instead of running to the timeout."""

import sys
import time

import pytest

from xmem.trace import TraceError, run_trace

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

INFERENCE = """import torch
model = torch.nn.Linear(64, 64).cuda()
with torch.no_grad():
    while True:
        model(torch.randn(4, 64, device="cuda"))
"""


def test_a_loop_without_an_optimizer_ends_after_n_backward_passes(tmp_path):
    script = tmp_path / "manual.py"
    script.write_text(MANUAL)
    result = run_trace([sys.executable, str(script)], iterations=3, timeout=120)
    assert result.iterations == 3
    grads = [e for e in result.events if e.action == "alloc" and e.nbytes == 256 * 256 * 4 and e.phase == "backward"]
    assert len(grads) == 3  # one gradient of w per backward pass, freed by the hand-written update


def test_a_program_without_a_training_loop_ends_promptly(tmp_path):
    script = tmp_path / "inference.py"
    script.write_text(INFERENCE)
    started = time.monotonic()
    with pytest.raises(TraceError) as raised:
        run_trace([sys.executable, str(script)], iterations=3, timeout=300)
    assert raised.value.kind == "no_optimizer_step"
    assert "forward passes without a backward pass" in raised.value.message
    assert time.monotonic() - started < 120  # well before the timeout
