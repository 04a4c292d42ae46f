"""Doors a new user walks through (issue 23 item 2): check's own estimate options, check without a site config,
check given a Python program, and a training option given before `--`."""

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import xmem.cli.check  # noqa: F401 - registers the commands
import xmem.cli.estimate  # noqa: F401
from xmem.cli import app
from xmem.config import DEFAULT_CONFIG_PATH

RUNNER = CliRunner()
TRAIN = """\
import torch
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    opt.step()
"""
no_site_config = pytest.mark.skipif(DEFAULT_CONFIG_PATH.is_file(), reason="this machine has a site config")


@pytest.fixture
def job(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("XMEM_CONFIG", raising=False)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    return tmp_path / "job.sh"


def test_check_of_a_python_program_points_to_estimate(job):
    result = RUNNER.invoke(app, ["check", "train.py"])
    assert result.exit_code != 0
    assert "is a Python program" in result.output and "xmem-slurm estimate -- python train.py" in result.output


def test_a_training_option_before_the_separator_says_where_it_goes():
    result = RUNNER.invoke(app, ["estimate", "--json", "python", "train.py", "--batch-size", "8"])
    assert result.exit_code == 2
    message = json.loads(result.stdout.splitlines()[0])["message"]
    assert "No such option: --batch-size" in message and "put the training command after `--`" in message


@no_site_config
def test_check_without_a_site_config_asks_for_gpu(job):
    result = RUNNER.invoke(app, ["check", str(job), "--json"])
    assert result.exit_code == 2
    error = json.loads(result.stdout)["errors"][0]
    assert "no site config" in error["message"] and "--gpu TYPE" in error["message"]


@no_site_config
@pytest.mark.slow
def test_check_without_a_site_config_estimates_for_gpu_with_its_own_options(job):
    result = RUNNER.invoke(app, ["check", str(job), "--gpu", "t4", "--iterations", "2", "--timeout", "300",
                                 "--python", sys.executable, "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert data["notes"][0].startswith("no site config") and data["decision"] is None
    estimate = data["estimates"][0]["estimate"]
    assert estimate["iterations"] == 2 and "T4" in estimate["gpus"]


def test_check_passes_python_to_the_estimator(job):
    result = RUNNER.invoke(app, ["check", str(job), "--gpu", "t4", "--python", "/nonexistent/bin/python", "--json"])
    error = json.loads(result.stdout)["errors"][0]
    assert result.exit_code != 0 and "/nonexistent/bin/python" in error["message"]
