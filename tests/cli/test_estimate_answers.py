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
from xmem.cli.estimate import show_estimate
from xmem.config import MarginConfig
from xmem.estimate import Estimate

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

    lines = shown_warnings(["CUDA graphs were traced eagerly: the graph's private memory pool is not modelled",
                            "torch.compile was ignored: the eager program was traced (compiled code often needs "
                            "less)"], verbose=False)
    assert len(lines) == 2 and "measure one run on a GPU" in lines[0] and "--verbose shows them" in lines[1]
