"""Categories come from what a tensor is, whoever runs the loop (xmem/trace/child/recorder.py, TrainingState): a
forward pass run inside the optimizer's step, as its closure (`optimizer.step(closure)`, Lightning's Trainer), makes
activations, and the gradients its backward makes are gradients, as in a plain loop."""

import sys
from pathlib import Path

import pytest

from xmem.estimate import estimate

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "closure_loops.py"


def run(tmp_path, how: str):
    result = estimate([sys.executable, str(SCRIPT), how], gpus=["a100"], cwd=tmp_path)
    return result.gpus["A100-SXM4-40GB"].peak_bytes, result.breakdown


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), "plain")


def assert_like_plain(loop, plain):
    (peak, breakdown), (plain_peak, plain_breakdown) = loop, plain
    assert peak == plain_peak
    assert breakdown.keys() == plain_breakdown.keys()
    # activations held for backward: three hidden layers' worth of the batch (and the logits), most of the peak
    assert breakdown["activation"] >= 2 * 2048 * 1024 * 4
    for category, nbytes in plain_breakdown.items():
        assert abs(breakdown[category] - nbytes) <= 1024, category  # the loss scalar may live a little longer


def test_a_forward_in_the_optimizers_closure_makes_activations(tmp_path, plain):
    """Before: the closure's forward ran in the step's phase, and its activations were 'temporary'."""
    assert_like_plain(run(tmp_path, "closure"), plain)


def test_a_lightning_modules_activations_are_activations(tmp_path, plain):
    pytest.importorskip("lightning")
    assert_like_plain(run(tmp_path, "lightning"), plain)
