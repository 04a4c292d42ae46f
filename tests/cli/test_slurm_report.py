"""`xmem-slurm report`: the JSON and the table, from a store written by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import xmem.cli.slurm  # noqa: F401  (registers report on the app, long before the variable below is set)
from xmem.cli import app
from xmem.slurm.store import JobRecord, append_record

GIB = 1 << 30
XMEM_SLURM = str(Path(sys.executable).parent / "xmem-slurm")


def report(*args):
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run([XMEM_SLURM, "report", *args], capture_output=True, text=True, timeout=60, env=env)


def test_report_json_per_gpu_type(tmp_path):
    store = tmp_path / "r.jsonl"
    # h100: estimates 9 and 11 GiB against 10 GiB measured: |errors| 0.1 and 0.1, one under-estimate
    append_record(store, JobRecord("1", gpu_type="h100", estimate_bytes=9 * GIB, measured_bytes=10 * GIB))
    append_record(store, JobRecord("2", gpu_type="h100", estimate_bytes=11 * GIB, measured_bytes=10 * GIB))
    append_record(store, JobRecord("3", gpu_type="a100", estimate_bytes=GIB))
    done = report("--store", str(store), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["records"] == 3
    a100, h100 = data["gpu_types"]
    assert (a100["gpu_type"], a100["jobs"], a100["measured"]) == ("a100", 1, 0)
    assert (h100["jobs"], h100["measured"], h100["underestimates"]) == (2, 2, 1)
    assert abs(h100["median_abs_rel_error"] - 0.1) < 1e-9 and abs(h100["mean_rel_error"]) < 1e-9


def test_report_table_for_people(tmp_path):
    store = tmp_path / "r.jsonl"
    append_record(store, JobRecord("1", gpu_type="h100", estimate_bytes=9 * GIB, measured_bytes=10 * GIB))
    done = report("--store", str(store))
    assert done.returncode == 0, done.stderr
    assert "h100" in done.stdout and "10.0 %" in done.stdout


def test_report_without_a_store_says_where_it_looked(tmp_path):
    done = report("--store", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2
    assert f"no record store at {tmp_path / 'none.jsonl'}" in done.stderr


def test_report_reads_xmem_store_when_it_runs_not_when_imported(tmp_path, monkeypatch):
    store = tmp_path / "r.jsonl"
    append_record(store, JobRecord("1", gpu_type="h100", estimate_bytes=9 * GIB, measured_bytes=10 * GIB))
    monkeypatch.setenv("XMEM_STORE", str(store))
    done = CliRunner().invoke(app, ["report", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["store"] == str(store)
