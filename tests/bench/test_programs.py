"""CI's share of the corpus of real programs (scripts/bench_programs.py): its selection, and one shipped program whose
package the test venv has (accelerate's gradient-sync test script) estimated end to end, with the report's and the
result file's format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_programs.py"
# The test venv stands in for the programs' venv: it has accelerate, whose test scripts ship in its wheel.
VENV = Path(sys.executable).parent.parent


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--venv", str(VENV), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_selection_by_package_and_name_and_unknown_names_refused():
    listed = bench("--list", "--package", "accelerate")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert names == ["accelerate-test-sync", "accelerate-test-script", "accelerate-test"]
    every = bench("--list").stdout.splitlines()
    assert len(every) >= 25 and len({line.split()[1] for line in every}) >= 10
    refused = bench("--list", "--only", "no-such-program")
    assert refused.returncode != 0 and "no-such-program" in refused.stderr



def test_fixtures_made_without_the_package_are_what_its_program_reads(tmp_path):
    """nequip's config and lightly's image folder are made by the script alone (no package import), so CI checks
    them: the config names the sections nequip-train requires and resolves; the images are pictures PIL opens."""
    import yaml
    from PIL import Image

    for package in ("nequip", "lightly"):
        made = bench("--fixtures", package, "--work", str(tmp_path / package))
        assert made.returncode == 0, made.stderr
    config = yaml.safe_load((tmp_path / "nequip" / "train.yaml").read_text())
    assert {"run", "data", "trainer", "training_module"} <= set(config) and config["run"] == ["train"]
    model = config["training_module"]["model"]
    assert model["_target_"] == "nequip.model.NequIPGNNModel" and model["model_dtype"] == "float32"
    assert model["avg_num_neighbors"] == "${training_data_stats:num_neighbors_mean}"
    images = sorted((tmp_path / "lightly" / "images").iterdir())
    assert len(images) == 16 and Image.open(images[0]).size == (64, 64)


def test_yolo_data_sets_hold_the_traced_steps_inside_the_first_epoch(tmp_path):
    """ultralytics accumulates batches up to its nominal batch of 64 before each optimizer step (round(64 / batch)
    batches, at most an epoch's): each yolo program's training set must hold the batches of 3 steps (xmem-slurm's
    default --iterations) and more, or the trace runs into the epoch's end (8 pictures at batch 4: one step)."""
    made = bench("--fixtures", "ultralytics", "--work", str(tmp_path))
    assert made.returncode == 0, made.stderr
    for line in bench("--list", "--package", "ultralytics").stdout.splitlines():
        args = dict(arg.split("=", 1) for arg in line.split()[2:] if "=" in arg)
        batch = int(args["batch"])
        task = Path(args["data"]).stem  # the data set's task: several programs share the detect one
        images = list((tmp_path / task).glob("**/train/**/*.jpg"))
        assert len(images) > 3 * max(round(64 / batch), 1) * batch, line.split()[0]
        if task != "classify":
            assert line.split()[3] == task or task == "detect"  # `yolo TASK train`: its own set, or detect's
            assert all((tmp_path / task / "labels" / "train" / f"{image.stem}.txt").exists() for image in images)


@pytest.mark.slow
def test_a_shipped_program_is_estimated_and_checked_against_its_model_state(tmp_path):
    out = tmp_path / "programs.json"
    done = bench("--only", "accelerate-test-sync", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 of 1 answer (1 packages)" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("accelerate-test-sync"))
    assert row.split()[1:3] == ["accelerate", "0"]
    result = json.loads(out.read_text())
    assert (result["answered"], result["programs"]) == (1, 1)
    record = result["records"][0]
    assert record["answered"] and record["exit"] == 0 and record["reason"] == ""
    # its RegressionModel's two fp32 scalars: the lower bound the peak is checked against
    assert record["model_state_bytes"] == 8
    assert record["model_state_bytes"] <= record["peak_bytes"] <= record["capacity_bytes"]
