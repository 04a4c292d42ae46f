"""`xmem-slurm prolog` and `xmem-slurm epilog` as Slurm runs them: environment in, export lines / a record out."""

import json
import os
import subprocess
import sys
from pathlib import Path

from xmem.gpus import find_gpu, load_catalog
from xmem.slurm.stamp import JobStamp
from xmem.slurm.store import read_records

GIB = 1 << 30
MIB = 1 << 20
XMEM_SLURM = str(Path(sys.executable).parent / "xmem-slurm")
STAMP = JobStamp(peak_bytes=5 * GIB, needed_bytes=6 * GIB, gpu_type="a100", request="mps:a100:10", action="keep")


def run(*args, env):
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([XMEM_SLURM, *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_prolog_prints_exports_with_the_mps_limit_capped_by_the_share(tmp_path):
    env = {"SLURM_JOB_ID": "31", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_VISIBLE_DEVICES": "1",
           "XMEM_MEASURE_DIR": str(tmp_path), **STAMP.env()}
    done = run("prolog", env=env)
    assert done.returncode == 0, done.stderr
    total = find_gpu("a100", load_catalog()).total_bytes
    share_mib = -(-(total * 10 // 100) // MIB)  # 10 % of the a100 is below the 6 GiB needed
    assert done.stdout.splitlines() == [f"export {k}={v}" for k, v in STAMP.env().items()] + [
        f"export XMEM_MEASURE_FILE={tmp_path}/xmem-measure-31.json",
        f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={share_mib}M"]


def test_prolog_never_fails_the_task(tmp_path):
    # Not a job xmem-slurm saw, scontrol unreachable, a config that does not load: nothing printed, exit 0.
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    done = run("prolog", env={"SLURM_JOB_ID": "5", "XMEM_CONFIG": str(bad), "SLURM_CONF": "/nonexistent"})
    assert (done.returncode, done.stdout) == (0, "")


def test_epilog_appends_the_record(tmp_path):
    store = tmp_path / "records.jsonl"
    (tmp_path / "xmem-measure-77.json").write_text(json.dumps({"peak_bytes": 4 * GIB}))
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_USER": "ann", "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_COMMENT": STAMP.comment(),
           "SLURM_JOB_EXIT_CODE2": "0:0", "SLURM_JOB_GPUS": "0"}
    done = run("epilog", "--store", str(store), "--measure-dir", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr
    (record,) = read_records(store)
    assert (record.job_id, record.gpu_type, record.gres, record.estimate_bytes, record.measured_bytes) == (
        "77", "a100", "mps:a100:10", 5 * GIB, 4 * GIB)


def test_epilog_skips_jobs_with_nothing_to_record(tmp_path):
    store = tmp_path / "records.jsonl"
    done = run("epilog", "--store", str(store), env={"SLURM_JOB_ID": "78", "SLURM_JOB_COMMENT": "mine"})
    assert done.returncode == 0 and not store.exists()
