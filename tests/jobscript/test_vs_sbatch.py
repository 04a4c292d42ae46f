"""The directive parser against the real thing: each script is submitted (held, never run) to a throw-away
single-node Slurm 22.05 started here, and what slurmctld recorded (`scontrol show job -o`) must equal what
`parse_jobscript` read. No cli_filter: sbatch alone. Its ports are free ones picked at start, so other
clusters on this machine (the dev cluster, the integration tests', a parallel test run) are left alone."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from xmem.jobscript import parse_jobscript
from xmem.slurm.scontrol import parse_scontrol_record

pytestmark = pytest.mark.slurm

SLURM_CONF = """\
ClusterName=xmemparse
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={lab}/state
SlurmdSpoolDir={lab}/spool
SlurmctldPidFile={lab}/run/slurmctld.pid
SlurmdPidFile={lab}/run/slurmd.pid
SlurmctldLogFile={lab}/log/slurmctld.log
SlurmdLogFile={lab}/log/slurmd.log
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MessageTimeout=5
SlurmdParameters=config_overrides
GresTypes=gpu,mps,shard
NodeName=localhost CPUs=16 Sockets=1 CoresPerSocket=16 ThreadsPerCore=1 RealMemory=8000 \
Gres=gpu:a100:2,gpu:h100:1,gpu:1g.10gb:1,mps:200,shard:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=big Nodes=ALL MaxTime=60 State=UP
"""
GRES_CONF = """\
AutoDetect=off
Name=gpu Type=a100 File={lab}/dev/nvidia0
Name=gpu Type=a100 File={lab}/dev/nvidia1
Name=gpu Type=h100 File={lab}/dev/nvidia2
Name=gpu Type=1g.10gb File={lab}/dev/nvidia3
Name=mps Count=100 File={lab}/dev/nvidia0
Name=mps Count=100 File={lab}/dev/nvidia1
Name=shard Count=4 File={lab}/dev/nvidia2
Name=shard Count=4 File={lab}/dev/nvidia3
"""


def _run(*argv: str, env: dict | None = None, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)


def _wait(predicate, what: str, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def free_ports(n: int) -> list[int]:
    """Ports nothing listens on now (the OS picks them)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _start_munge() -> None:
    if _run("munge", "-n").returncode == 0:
        return
    _run("install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge")
    _run("install", "-d", "-o", "munge", "-g", "munge", "-m", "0700", "/var/log/munge", "/var/lib/munge")
    _run("runuser", "-u", "munge", "--", "/usr/sbin/munged")
    _wait(lambda: _run("munge", "-n").returncode == 0, "munged")


def _stop(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return

    def gone() -> bool:
        state = _run("ps", "-o", "stat=", "-p", str(pid)).stdout.strip()
        return not state or state.startswith("Z")  # PID 1 here reaps late: a zombie is stopped
    try:
        _wait(gone, f"pid {pid} to stop", 10)
    except RuntimeError:
        os.kill(pid, 9)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    needed = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
    if not all(shutil.which(n) for n in needed) or os.geteuid() != 0:
        pytest.skip("needs Slurm's daemons and root (apt-get install slurmctld slurmd slurm-client munge)")
    lab = tmp_path_factory.mktemp("parse-lab")
    for sub in ("etc", "state", "spool", "log", "run", "dev"):
        (lab / sub).mkdir()
    for i in range(4):
        (lab / "dev" / f"nvidia{i}").symlink_to("/dev/null")
    ctld_port, slurmd_port = free_ports(2)
    (lab / "etc" / "slurm.conf").write_text(SLURM_CONF.format(lab=lab, ctld_port=ctld_port, slurmd_port=slurmd_port))
    (lab / "etc" / "gres.conf").write_text(GRES_CONF.format(lab=lab))
    env = {**os.environ, "SLURM_CONF": str(lab / "etc" / "slurm.conf")}
    for name in list(env):
        if name.startswith("SBATCH_") or name.startswith("SLURM_JOB"):
            del env[name]
    _start_munge()
    try:
        _run("slurmctld", env=env)
        _wait(lambda: "is UP" in _run("scontrol", "ping", env=env, timeout=3).stdout, "slurmctld")
        _run("slurmd", "-N", "localhost", env=env)
        _wait(lambda: set(_run("sinfo", "-h", "-N", "-o", "%T", env=env, timeout=3).stdout.split()) == {"idle"},
              "the node to be idle")
        yield env, lab
    finally:
        ids = _run("squeue", "-h", "-o", "%i", env=env, timeout=5).stdout.split()
        if ids:
            _run("scancel", *ids, env=env)
        _stop(lab / "run" / "slurmd.pid")
        _stop(lab / "run" / "slurmctld.pid")


def submit(slurm, text: str, *options: str, extra_env: dict | None = None) -> dict[str, str]:
    env, lab = slurm
    script = lab / "job.sh"  # sbatch's default job name
    script.write_text(text)
    done = _run("sbatch", "--parsable", "--hold", "-o", "/dev/null", *options, str(script),
                env={**env, **(extra_env or {})})
    assert done.returncode == 0, done.stderr
    shown = _run("scontrol", "show", "job", "-o", done.stdout.strip().split(";")[0], env=env)
    return parse_scontrol_record(shown.stdout)


def expected(text: str, cli: dict | None = None, extra_env: dict | None = None) -> dict[str, str]:
    """What slurmctld should record, from parse_jobscript's reading of the script."""
    r = parse_jobscript(text, env=extra_env or {}, cli_options=cli).directives
    per_node = [f"gres:{g}" for g in r.gres] + [f"gres:gpu:{v}" for v in (r.gpus_per_node or "").split(",") if v]
    return {"JobName": r.job_name or "job.sh", "Partition": r.partition or "debug", "Account": r.account or "(null)",
            "TresPerNode": ",".join(per_node) or None, "TresPerJob": f"gres:gpu:{r.gpus}" if r.gpus else None,
            "NumTasks": str(r.ntasks or 1)}


def recorded(job: dict[str, str]) -> dict[str, str]:
    return {"JobName": job["JobName"], "Partition": job["Partition"], "Account": job.get("Account", "(null)"),
            "TresPerNode": job.get("TresPerNode"), "TresPerJob": job.get("TresPerJob"), "NumTasks": job["NumTasks"]}


SCRIPTS = {
    "long, short, prefix, comment, late and indented directives": (
        "#!/bin/bash\n#SBATCH -J first -A acct1 --part=big\n#SBATCH --gres=gpu:a100:1   # one A100\n"
        "#SBATCH -G h100:1\n#SBATCH --gpus-per-node=a100:1\n#SBATCH -n 2\n  #SBATCH -J indented\n"
        "# SBATCH -J spaced\ntrue\n#SBATCH -J second\n"),
    "space-separated values and an untyped count": (
        "#!/bin/bash\n#SBATCH --job-name job2\n#SBATCH --gres gpu:2\n#SBATCH --partition debug\ntrue\n"),
    "mps share": "#!/bin/bash\n#SBATCH -Jm --gres=mps:50\ntrue\n",
    "typed shard": "#!/bin/bash\n#SBATCH --gres=shard:h100:2 --ntasks=4\ntrue\n",
    "job-wide gpus, glued short value": "#!/bin/bash\n#SBATCH -G2 -Jg\n\n# a comment line\n#SBATCH -pbig\ntrue\n",
    "quoted value holding a #": '#!/bin/bash\n#SBATCH -J "a#b" --gres=gpu:1g.10gb:1\ntrue\n',
    "later option wins": "#!/bin/bash\n#SBATCH -p big\n#SBATCH -p debug --gres=gpu:h100:1 --gres=gpu:a100:1\ntrue\n",
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_parser_reads_directives_as_slurm_records_them(slurm, name):
    text = SCRIPTS[name]
    assert recorded(submit(slurm, text)) == expected(text)


def test_command_line_overrides_directives(slurm):
    text = "#!/bin/bash\n#SBATCH -p big -J x --gres=gpu:h100:1\ntrue\n"
    job = submit(slurm, text, "-p", "debug", "--gres=gpu:a100:1")
    assert recorded(job) == expected(text, cli={"partition": "debug", "gres": "gpu:a100:1"})
    assert job["Partition"] == "debug"


def test_sbatch_environment_variables_override_directives(slurm):
    text = "#!/bin/bash\n#SBATCH -p big -J x\ntrue\n"
    env = {"SBATCH_PARTITION": "debug", "SBATCH_JOB_NAME": "from-env"}
    job = submit(slurm, text, extra_env=env)
    assert recorded(job) == expected(text, extra_env=env)
    assert (job["Partition"], job["JobName"]) == ("debug", "from-env")


@pytest.mark.parametrize("directives", ["--gres=gpu:a100:1,gpu:1", "--gres=gpu:1 -G a100:1",
                                        "--gres=gpu:a100:1,mps:50", "--gres=shard:2 -G 1"])
def test_requests_slurm_refuses_are_problems(slurm, directives):
    env, lab = slurm
    text = f"#!/bin/bash\n#SBATCH {directives}\ntrue\n"
    script = lab / "refused.sh"
    script.write_text(text)
    done = _run("sbatch", "--parsable", "--hold", "-o", "/dev/null", str(script), env=env)
    assert done.returncode != 0, f"Slurm accepted {directives}"
    problems = parse_jobscript(text, env={}).problems
    assert [p.line_no for p in problems] == [2] and "refuses" in problems[0].reason
