"""What `estimate` answers where a job does not fit (issue 23 item 3): what it would need, torch's own words for
the allocation that failed, and the margin that "fits" applies; and (item 4) warnings only where they matter.
One trace serves the JSON and the table."""

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import xmem.cli.estimate  # noqa: F401 - registers the command
from xmem.cli import app
from xmem.cli.estimate import breakdown_title, show_estimate
from xmem.config import MarginConfig
from xmem.estimate import Estimate

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

MIB = 1 << 20
# Nine 1000 MiB buffers: 8.8 GiB, more than an RTX 4060 (7.75 GiB) holds, less than an RTX 3060 (11.76 GiB).
BIG = """\
import torch
hold = [torch.empty(1000 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(9)]
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    loss = model(torch.randn(32, 256, device="cuda")).sum()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.3f}")  # a stand-in value under the trace: a note, not a warning
"""


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("big")
    (where / "big.py").write_text(BIG)
    result = CliRunner().invoke(app, ["estimate", "-g", "rtx4060", "-g", "rtx3060", "-n", "2", "--json", "--",
                                      "python", str(where / "big.py")], env={"XMEM_CONFIG": ""})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_json_says_what_a_type_that_runs_out_would_need(record):
    small, large = record["gpus"]["RTX-4060-8GB"], record["gpus"]["RTX-3060-12GB"]
    assert not small["fits"] and small["oom"] is not None
    assert small["unlimited_peak_bytes"] > small["total_bytes"] > small["peak_bytes"]
    assert abs(small["unlimited_peak_bytes"] - large["peak_bytes"]) < 64 * MIB  # the same run, no limit
    assert large["unlimited_peak_bytes"] is None and large["fits"]
    assert record["margin"] == {"relative": 0.1, "absolute_bytes": 0}
    assert large["needed_bytes"] == MarginConfig().needed(large["peak_bytes"]) and large["fits_with_margin"]


@pytest.mark.slow
def test_table_says_needs_and_torchs_words(record):
    console = Console(record=True, width=220)
    show_estimate(console, Estimate.from_json(record), MarginConfig(relative=0.5))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "RTX-4060-8GB" in line)
    assert "needs 9.3" in row and "Tried to allocate 1000.00 MiB" in row
    row = next(line for line in text.splitlines() if "RTX-3060-12GB" in line)
    assert "fits without the margin only" in row  # 9.3 GiB x 1.5 > 11.76 GiB
    assert "site margin (+50 %)" in text


@pytest.mark.slow
def test_tracer_notes_are_in_the_json_and_behind_verbose(record):
    assert any("returned a stand-in" in w for w in record["warnings"])
    for verbose in (False, True):
        console = Console(record=True, width=220)
        show_estimate(console, Estimate.from_json(record), verbose=verbose)
        text = console.export_text()
        assert ("returned a stand-in" in text) == verbose
        assert ("--verbose shows them" in text) != verbose


def test_warnings_that_stay_say_what_to_do():
    from xmem.cli.estimate import shown_warnings
    from xmem.trace.child.fakecuda import GRAPH_WARNING, HOST_MODEL_WARNING

    lines = shown_warnings([GRAPH_WARNING, HOST_MODEL_WARNING], verbose=False)
    assert len(lines) == 2 and "measure one run on a GPU" in lines[0] and "--verbose shows them" in lines[1]


def test_each_warning_that_stays_is_said_in_plain_words_with_what_to_do():
    """The tracer's words (fake tensors, stand-ins) stay in the JSON; the terminal says what each note's kind means
    for the job (xmem.trace.wire.NoteKind), filled with the note's values."""
    from xmem.cli.estimate import shown_warnings
    from xmem.trace.child.fakecuda import GRAPH_WARNING, memory_size_warning
    from xmem.trace.child.standins import SELECTION_WARNING
    from xmem.trace.wire import Note, NoteKind

    made = [Note(NoteKind.SELECTION_ASSUMED_ALL, SELECTION_WARNING), GRAPH_WARNING, memory_size_warning(80 * 2**30),
            Note(NoteKind.LOOP_ENDED, "a condition on tensor data was answered True 100 times at one place; "
                                      "answered False from then on, to end the loop", 100),
            Note(NoteKind.TENSORS_EQUAL, "torch.equal() on fake CUDA tensors answered True (no real data under "
                                         "fake CUDA)", "equal"),
            Note(NoteKind.VALUES_READ_AS_ONES, "tensor.tolist() returned ones (no real data under fake CUDA)",
                 "tolist"),
            Note(NoteKind.GPUS_USED, "the job used 2 GPUs; figures are for the busiest one", 2)]
    lines = shown_warnings(made, verbose=False)
    assert len(lines) == len(made)
    for line in lines:
        assert not any(jargon in line for jargon in ("fake", "stand-in", "traced eagerly", "answered True")), line
    assert "every element was counted as selected" in lines[0] and "upper bound" in lines[0]
    assert "it was shown 80.0 GiB" in lines[2] and "(--gpu)" in lines[2]
    assert "ended after 100 rounds" in lines[3] and "--iterations" in lines[3]
    assert "torch.equal" in lines[4] and ".tolist()" in lines[5] and "2 GPUs" in lines[6]
    forward = Note(NoteKind.FORWARD_ONLY, "traced forward passes only (40 on the GPU, no backward pass or optimizer "
                                          "step, up to the trace's time limit, the peak still rising): the estimate "
                                          "is the peak of what the program ran", 40,
                   "no backward pass or optimizer step", "the trace's time limit, the peak still rising")
    assert shown_warnings([forward], verbose=False) == [
        "[yellow]warning:[/] the program ran 40 forward passes and no backward pass or optimizer step (until the "
        "trace's time limit, the peak still rising): the figures are the peak of what it ran, right for evaluation "
        "or inference; a training job that steps later than that needs a longer trace (--timeout)"]
    checkpoint = Note(NoteKind.CHECKPOINT_ON_HOST_FAKE, "checkpoint tensors loaded to the host past the trace's "
                      "memory limit are fake (no real values): host-side code that reads their values gets stand-ins")
    assert shown_warnings([checkpoint], verbose=False) == [
        "[dim]1 more note(s) of the tracer, which do not change the figures: --verbose shows them[/]"]
    assert checkpoint in shown_warnings([checkpoint], verbose=True)[0]


def test_a_note_of_no_kind_is_shown_as_its_maker_said_it():
    """Words that come with no kind (a record saved before notes were typed, a maker that gives none) are shown
    whole, never hidden and never reworded."""
    from xmem.cli.estimate import shown_warnings

    said = "cuFFT's work area and copies were left out of an FFT call (fft_r2c: reason)"
    assert shown_warnings([said], verbose=False) == [f"[yellow]warning:[/] {said}"]


def test_the_gpu_type_shown_is_the_first_asked_that_fits_else_the_largest():
    from tests.estimates import gpu_estimate
    from xmem.estimate import shown_gpu

    small, mid, large = (gpu_estimate(10, total=8 << 30, fits=False, name="RTX-4060-8GB"),
                         gpu_estimate(10, total=12 << 30, name="RTX-3060-12GB"),
                         gpu_estimate(10, total=80 << 30, name="H100-SXM5-80GB"))
    assert shown_gpu([small, mid, large]) == "RTX-3060-12GB"  # not the largest: the first asked that fits
    assert shown_gpu([large, mid]) == "H100-SXM5-80GB"
    none_fit = [small, gpu_estimate(10, total=12 << 30, fits=False, name="RTX-3060-12GB")]
    assert shown_gpu(none_fit) == "RTX-3060-12GB"  # nothing fits: the one whose replay went furthest


@pytest.mark.slow
def test_table_marks_the_type_shown_below_and_a_site_pick_moves_it(record):
    """The table's mark, the breakdown and --plot's default are one GPU type: the first that fits, or the pick."""
    from xmem.cli.common import shown_gpu
    from xmem.gpus import load_catalog

    result = Estimate.from_json(record)
    assert result.breakdown_gpu == "RTX-3060-12GB" and set(result.breakdowns) == {"RTX-4060-8GB", "RTX-3060-12GB"}
    for picked in (None, "rtx4060"):
        shown = shown_gpu(result, picked, load_catalog())
        console = Console(record=True, width=220)
        show_estimate(console, result, shown=shown)
        text = console.export_text()
        marked = [line.split()[1] for line in text.splitlines() if line.rstrip(" │").endswith("*")]
        assert marked == [shown] and breakdown_title(result, shown) in text and f"*: {shown}, the GPU type" in text
        parts = result.breakdowns[shown]
        assert f"{parts['overhead'] / MIB:.1f} MiB" in text
    assert shown == "RTX-4060-8GB"
    # where it does not fit, the breakdown is what it needs (issue 32), not what fitted before the failed allocation
    assert "What the job needs on RTX-4060-8GB" in text
    assert sum(result.breakdowns[shown].values()) == result.gpus[shown].unlimited_peak_bytes


# A GiB per sample: 8 samples need more than an RTX 4060 (7.75 GiB) or a T4 (15 GiB with the margin) hold.
PER_SAMPLE = """\
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int)
batch = torch.empty(parser.parse_args().batch_size * 2**30, dtype=torch.uint8, device="cuda")
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
"""


def estimate_per_sample(tmp_path, *args: str) -> tuple[int, dict]:
    (tmp_path / "per_sample.py").write_text(PER_SAMPLE)
    result = CliRunner().invoke(app, ["estimate", "-g", "rtx4060", "-n", "1", "--json", "--", "python",
                                      str(tmp_path / "per_sample.py"), *args], env={"XMEM_CONFIG": ""})
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_job_that_fits_nowhere_exits_14_with_its_largest_batch(tmp_path):
    """Issue 32: it exited 0; now a documented code, and the largest batch that fits with the command to see more."""
    code, data = estimate_per_sample(tmp_path, "--batch-size", "16")
    assert code == 14 and data["error"] == "no_fit" and data["exit_code"] == 14
    assert data["gpus"]["RTX-4060-8GB"]["fits"] is False  # the answer is there too
    hint = data["largest_batch"]
    # 6 GiB + the context fit 7.75 GiB with the 10 % margin; 7 do not
    assert hint["largest"] == 6 and hint["complete"] and hint["option"] == "batch-size"
    assert hint["see_more"].startswith("xmem-slurm fit --vary batch-size=1..16 --gpu RTX-4060-8GB -- python ")
    assert "the largest --batch-size that fits is 6" in data["message"]


@pytest.mark.slow
def test_a_job_that_fits_nowhere_at_batch_1_says_so(tmp_path):
    code, data = estimate_per_sample(tmp_path, "--batch-size=1")
    assert code == 0  # 1 GiB fits: the same script, the code follows the answer
    (tmp_path / "huge.py").write_text(PER_SAMPLE.replace("2**30", "9 * 2**30"))
    result = CliRunner().invoke(app, ["estimate", "-g", "rtx4060", "-n", "1", "--", "python",
                                      str(tmp_path / "huge.py"), "--batch-size", "1"], env={"XMEM_CONFIG": ""})
    assert result.exit_code == 14
    assert "it does not fit even at --batch-size 1" in " ".join(result.stdout.split())
