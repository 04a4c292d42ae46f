"""The dev cluster used by an ordinary user, as on a shared login node (issue 14): the site install runs for them,
their estimate is cached in their own 0700 directory, their job's measured peak is recorded; root submitting for
them (`sbatch --uid`) never runs their program; another user's planted measure file is refused by the Epilog.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_slurm_glue import JOB_BODY, MEASURED, TRAIN, expected_decision, xmem_lines
from tests.throwaway_users import throwaway_users
from xmem.slurm.stamp import JobStamp
from xmem.slurm.store import read_records

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def home(submitter):
    """A job directory of the submitter's own, with the training script."""
    work = submitter.home / "jobs"
    submitter.run("mkdir", "-p", str(work))
    submitter.run("/bin/sh", "-c", 'printf "%s" "$1" > "$2"', "sh", TRAIN, str(work / "train.py"))
    return work


def job_script(user, work: Path, name: str, text: str) -> Path:
    path = work / name
    user.run("/bin/sh", "-c", 'printf "%s" "$1" > "$2"', "sh", text, str(path))
    return path


def test_an_ordinary_users_job_is_estimated_cached_privately_and_recorded(cluster, submitter, home):
    path = job_script(submitter, home, "generic.sh", f"#!/bin/bash\n#SBATCH --gres=gpu:1\n{JOB_BODY}")
    before = cluster.analyses(submitter.name)  # other modules' tests submit as this user to this cluster too
    sub = cluster.sbatch(path, user=submitter)
    assert sub.returncode == 0, sub.stderr
    lines = xmem_lines(sub.stderr)
    # the decision line; a notice may come before it (in a full run another test's state can add one)
    line = next((text for text in lines if "->" in text), "")
    assert line and "cannot" not in line, lines
    print(f"\nfigure: sbatch as an ordinary user with a fresh estimate took {sub.seconds:.2f} s")

    (entry,) = cluster.analyses(submitter.name) - before
    mine = cluster.user_cache(submitter.name)
    for p in (mine, entry):
        info = p.lstat()
        assert info.st_uid == submitter.uid and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700

    info = cluster.wait(sub.job_id, timeout=300)
    expected = expected_decision(cluster, path, json.loads(entry.read_text())["peaks"])
    assert info["JobState"] == "COMPLETED" and info["TresPerNode"] == f"gres:{expected.gres}"
    assert info["UserId"].startswith(f"{submitter.name}(")
    record = {r.job_id: r for r in read_records(cluster.store)}[sub.job_id]
    assert (record.user, record.measured_bytes, record.measured_by) == (submitter.name, MEASURED, "file")
    assert record.estimate_bytes == JobStamp.from_comment(info["Comment"]).peak_bytes


def test_root_submitting_for_the_user_keeps_their_request_and_runs_nothing(cluster, submitter, home):
    path = job_script(submitter, home, "for-user.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\n# for root\n"
                                                      "python train.py\n")
    sub = cluster.sbatch(path, f"--uid={submitter.name}", "--begin=now+3600")
    assert sub.returncode == 0, sub.stderr
    (line,) = xmem_lines(sub.stderr)
    assert "never runs a user's program as root" in line and submitter.name in line
    assert sub.seconds < 10  # nothing traced
    assert cluster.job(sub.job_id)["TresPerNode"] == "gres:gpu:1"
    cluster.run("scancel", sub.job_id)


def test_another_user_can_plant_no_measure_file_for_a_job(cluster, submitter, home):
    with throwaway_users("planter") as (planter,):
        path = job_script(submitter, home, "cpu.sh", "#!/bin/bash\ntrue\n")
        sub = cluster.sbatch(path, "--hold", user=submitter)
        assert sub.returncode == 0, sub.stderr
        for planted in (cluster.lab / "measure" / f"xmem-measure-{sub.job_id}.json",
                        cluster.lab / "measure" / str(submitter.uid) / f"xmem-measure-{sub.job_id}.json"):
            tried = planter.run("/bin/sh", "-c", f"echo '{{\"peak_bytes\": 12345}}' > {planted}", check=False)
            assert tried.returncode != 0 and not planted.exists()  # root's directory, the submitter's 0700 one
        cluster.run("scontrol", "release", sub.job_id)
        cluster.wait(sub.job_id, timeout=60)
        records = {r.job_id: r for r in read_records(cluster.store)}
        assert sub.job_id not in records  # a CPU job with nothing measured: no record


def test_the_site_install_links_nowhere_private_and_runs_as_nobody(site_install):
    """Nothing in the install points into a directory other users cannot enter (pyenv's /root, mode 700)."""
    if site_install is None:
        pytest.skip("no site install here")
    venv = site_install / "venv"
    assert "/root" not in (venv / "pyvenv.cfg").read_text()
    for link in (p for p in venv.rglob("*") if p.is_symlink()):
        target = link.resolve()
        assert all(os.stat(d).st_mode & 0o001 for d in target.parents), f"{link} -> {target}"
    assert stat.S_IMODE((site_install / "var" / "cache").stat().st_mode) == 0o1777
    measure = (site_install / "var" / "measure").stat()  # root's: the Prolog makes a 0700 directory per user
    assert (measure.st_uid, stat.S_IMODE(measure.st_mode)) == (0, 0o755)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                           str(venv / "bin" / "xmem-slurm"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
