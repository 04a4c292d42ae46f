"""`xmem-slurm prolog`, `root-prolog` and `epilog` as Slurm runs them: environment in, export lines / a record out."""

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
    measure = tmp_path / "measure"
    measure.mkdir(mode=0o755)
    env = {"SLURM_JOB_ID": "31", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_VISIBLE_DEVICES": "1",
           "XMEM_MEASURE_DIR": str(measure), "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
           **STAMP.env()}
    made = run("root-prolog", "--mps-control", str(tmp_path / "no-mps-here"), env=env)  # the Prolog, first
    assert (made.returncode, made.stderr) == (0, ""), made.stderr
    done = run("prolog", env=env)
    assert done.returncode == 0, done.stderr
    total = find_gpu("a100", load_catalog()).total_bytes
    share_mib = -(-(total * 10 // 100) // MIB)  # 10 % of the a100 is below the 6 GiB needed
    assert done.stdout.splitlines() == [f"export {k}={v}" for k, v in STAMP.env().items()] + [
        f"export XMEM_MEASURE_FILE={measure}/{os.getuid()}/xmem-measure-31.json",
        f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={share_mib}M"]


def stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_root_prolog_sets_the_mps_daemons_limit_from_slurms_allocation(tmp_path):
    """A recording stand-in of nvidia-cuda-mps-control (its stdin, one command per call, goes to a log; it answers
    get_server_list with this test's own pid, a server of the job's user) and of nvidia-smi (an 80 GiB GPU 2)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "mps.log"
    bin_dir.mkdir()
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"]) \
        if os.geteuid() == 0 else None  # a server of another user: left alone
    servers = f"{os.getpid()} {other.pid if other else ''} 999999999"
    stand_in(bin_dir, "nvidia-cuda-mps-control", f'read -r line; echo "$line" >> {log}\n'
                                                 f'[ "$line" = get_server_list ] && echo "{servers}"\nexit 0\n')
    stand_in(bin_dir, "nvidia-smi", '[ "$1" = --id=2 ] && echo 81920 || exit 6\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "32", "SLURM_JOB_UID": str(os.getuid()),
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_GPUS": "2",
           "SLURM_JOB_COMMENT": JobStamp(needed_bytes=70 * GIB, request="mps:90").comment()}  # the user's words
    try:
        done = run("root-prolog", env=env)
    finally:
        if other:
            other.kill()
            other.wait()
    assert (done.returncode, done.stderr) == (0, "")
    share = 81920 * 30 // 100
    assert log.read_text().splitlines() == ["get_server_list", f"set_default_device_pinned_mem_limit 2 {share}M",
                                            f"set_device_pinned_mem_limit {os.getpid()} 2 {share}M"]
    log.unlink()
    not_mps = run("root-prolog", env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": ""})
    assert not_mps.returncode == 0 and not log.exists()
    stand_in(bin_dir, "nvidia-cuda-mps-control", "echo 'Cannot find MPS control daemon' >&2; exit 1\n")
    down = run("root-prolog", env=env)
    assert down.returncode == 0 and "MPS memory limit not set" in down.stderr  # logged; never fails the job


def test_prolog_never_fails_the_task(tmp_path):
    # Not a job xmem-slurm saw, scontrol unreachable, a config that does not load: nothing printed, exit 0.
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    done = run("prolog", env={"SLURM_JOB_ID": "5", "XMEM_CONFIG": str(bad), "SLURM_CONF": "/nonexistent"})
    assert (done.returncode, done.stdout) == (0, "")


def test_epilog_appends_the_record(tmp_path):
    store = tmp_path / "records.jsonl"
    (tmp_path / str(os.getuid())).mkdir()
    (tmp_path / str(os.getuid()) / "xmem-measure-77.json").write_text(json.dumps({"peak_bytes": 4 * GIB}))
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_without_a_reachable_slurm_says_so_in_one_line(tmp_path):
    """No scontrol on PATH, or a controller nobody answers for (the real scontrol, a port nothing listens on):
    one line and exit 12, never scontrol's own errors; --json says the same as an object."""
    import shutil

    gone = run("status", "5", env={"PATH": str(tmp_path)})
    assert gone.returncode == 12 and gone.stdout == ""
    assert gone.stderr == "xmem-slurm status: Slurm is not reachable from here (no scontrol on PATH)\n"
    if shutil.which("scontrol") is None:
        return
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort={free_port()}\nMessageTimeout=1\n")
    silent = run("status", "5", "--json", env={"SLURM_CONF": str(conf)})
    assert silent.returncode == 12, silent.stderr
    assert silent.stderr.splitlines() == [
        "xmem-slurm status: Slurm is not reachable from here (scontrol: Unable to contact slurm controller)"]
    answer = json.loads(silent.stdout)
    assert (answer["error"], answer["exit_code"]) == ("slurm_unreachable", 12)


def fake_scontrol(where: Path, body: str) -> dict[str, str]:
    """A PATH whose scontrol is the shell script `body`: what a real one says, without a cluster."""
    where.mkdir(exist_ok=True)
    (where / "scontrol").write_text(f"#!/bin/sh\n{body}\n")
    (where / "scontrol").chmod(0o755)
    return {"PATH": f"{where}:{os.environ['PATH']}"}


def test_status_of_an_unknown_job_is_one_line_and_json(tmp_path):
    """Issue 32: it printed scontrol's raw error, and no JSON with --json."""
    env = fake_scontrol(tmp_path / "bin", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    for args in (("status", "99"), ("status", "99", "--json")):
        done = run(*args, env=env)
        assert done.returncode == 2
        assert done.stderr == "xmem-slurm status: Slurm does not know job 99 (Invalid job id specified)\n"
    answer = json.loads(done.stdout)
    assert (answer["error"], answer["exit_code"]) == ("unknown_job", 2)
    assert answer["message"] == "Slurm does not know job 99 (Invalid job id specified)"


def test_status_gives_up_on_a_silent_slurm_within_seconds(tmp_path):
    """Issue 32: with no reachable Slurm (configless DNS lookups) it hung 31 s; a SLURM_CONF naming no file was
    'job unknown'."""
    import time

    from xmem.cli.slurm import STATUS_TIMEOUT_S

    started = time.monotonic()
    silent = run("status", "5", "--json", env=fake_scontrol(tmp_path / "bin", "exec sleep 60"))
    assert time.monotonic() - started < STATUS_TIMEOUT_S + 5
    assert silent.returncode == 12 and json.loads(silent.stdout)["error"] == "slurm_unreachable"
    assert silent.stderr == (f"xmem-slurm status: Slurm is not reachable from here (scontrol had no answer in "
                             f"{STATUS_TIMEOUT_S:g} s)\n")
    missing = run("status", "5", env=fake_scontrol(
        tmp_path / "bin", 'echo "scontrol: error: s_p_parse_file: unable to read file" >&2; '
                          'echo "scontrol: fatal: Unable to process configuration file" >&2; exit 1'))
    assert missing.returncode == 12
    assert missing.stderr == ("xmem-slurm status: Slurm is not reachable from here (scontrol: Unable to process "
                              "configuration file)\n")
