"""`xmem-slurm gpus`, `--version` and GPU names as a user types them (issue 23, item 1)."""

import json

import pytest
from typer.testing import CliRunner

import xmem.cli.gpus  # noqa: F401 - registers the command
from xmem.cli import app

RUNNER = CliRunner()
NEW_TYPES = ["L4", "A30", "A40", "RTX-A6000", "L40", "H100-NVL-94GB", "B200", "GH200-96GB", "RTX-5090"]


@pytest.fixture(scope="module")
def listed():
    result = RUNNER.invoke(app, ["gpus", "--json"], env={"XMEM_CONFIG": ""})
    assert result.exit_code == 0, result.output
    return {g["name"]: g for g in json.loads(result.stdout)["gpus"]}


def test_gpus_json_lists_every_type_with_memory_aliases_and_mig(listed):
    assert set(NEW_TYPES) <= set(listed)
    assert listed["L4"]["total_bytes"] == 23034 * 2**20  # nvidia-smi's figure
    assert listed["A100-SXM4-40GB"]["capability"] == [8, 0]
    assert "a100" in listed["A100-SXM4-40GB"]["aliases"]
    assert {p["name"] for p in listed["A30"]["mig_profiles"]} == {"1g.6gb", "2g.12gb", "4g.24gb"}
    assert listed["T4"]["mig_profiles"] == []


def test_gpus_table_names_the_types():
    result = RUNNER.invoke(app, ["gpus"], env={"XMEM_CONFIG": "", "COLUMNS": "200"})
    assert result.exit_code == 0 and "H100-NVL-94GB" in result.output and "3g.20gb" in result.output


def test_version():
    result = RUNNER.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("xmem-slurm ")


@pytest.mark.parametrize("name, canonical", [("h100-80", "H100-SXM5-80GB"), ("a100-80", "A100-SXM4-80GB"),
                                             ("a100-40g", "A100-SXM4-40GB"), ("A100_80G", "A100-SXM4-80GB"),
                                             ("rtx-5090", "RTX-5090"), ("gh200", "GH200-96GB")])
def test_size_aliases_follow_one_rule(name, canonical):
    from xmem.gpus import find_gpu, load_catalog

    assert find_gpu(name, load_catalog(calibration_path=None)).name == canonical


def test_a_typo_is_answered_with_the_closest_name():
    import xmem.cli.estimate  # noqa: F401

    result = RUNNER.invoke(app, ["estimate", "--gpu", "a100-4O", "--json", "--", "python", "train.py"])
    assert result.exit_code == 2
    assert "did you mean 'A100-SXM4-40GB'?" in json.loads(result.stdout)["message"]
