"""Deferred mode (issue 5) on the real dev cluster: sbatch returns at once with the job held, the estimate runs as
a job on the `cpu` partition, then the GPU job is retyped and released, released unchanged (fail-open) or cancelled
(fail-closed); a dead estimation job never leaves the GPU job held. Expected requests come from the policy."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from xmem.config import load_site_config
from xmem.jobscript import parse_jobscript
from xmem.policy import decide
from xmem.slurm.store import read_records

pytestmark = pytest.mark.slurm

TRAIN = """\
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(32, 256, device=device)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained on", device)
"""
BURST = 50


@pytest.fixture(scope="module")
def work(job_dir) -> Path:
    return job_dir("deferred-jobs", TRAIN)


def script(work: Path, name: str, body: str = "python train.py\n", directives: str = "#SBATCH --gres=gpu:1") -> Path:
    path = work / name
    path.write_text(f"#!/bin/bash\n{directives}\n{body}")
    return path


def xmem_state(info: dict[str, str]) -> str | None:
    match = re.search(r"xmem:\S*\bstate=(\w+)", info.get("Comment", ""))
    return match.group(1) if match else None


def wait_settled(cluster, job_id: str, timeout: float = 180) -> dict[str, str]:
    """Until the estimate's outcome is on the job (state other than pending) and it is no longer held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = cluster.job(job_id)
        if xmem_state(info) not in (None, "pending") and info.get("Reason") != "JobHeldUser":
            return info
        if info.get("JobState") == "CANCELLED":
            return info
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still held after {timeout} s: {cluster.job(job_id)}")


def expected_gres(cluster, path: Path, text: str, before: set[Path]) -> str:
    """The policy's request for the job, from the estimate its deferred run cached (the one new entry)."""
    (entry,) = cluster.analyses() - before
    peaks = json.loads(entry.read_text())["peaks"]
    job = parse_jobscript(text, path=str(path), env=cluster.env)
    decision = decide(peaks, job.directives, load_site_config(cluster.config), user="root")
    assert decision.action == "rewrite"
    return decision.gres


def test_deferred_job_end_to_end_estimates_the_submitted_version(deferred_cluster, work):
    cluster = deferred_cluster
    path = script(work, "job.sh", "env | grep ^XMEM_ | sort\npython train.py\n")
    submitted = path.read_text()
    before = cluster.analyses()
    sub = cluster.sbatch(path)
    path.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython broken.py\n")  # edited right after sbatch
    assert sub.returncode == 0, sub.stderr
    assert "estimate queued on partition cpu: the job is held" in sub.stderr
    held = cluster.job(sub.job_id)
    assert (held["JobState"], held["Reason"], xmem_state(held)) == ("PENDING", "JobHeldUser", "pending")
    started = time.monotonic()
    info = wait_settled(cluster, sub.job_id)
    print(f"\nfigure: deferred sbatch took {sub.seconds:.2f} s; submission to release "
          f"{sub.seconds + time.monotonic() - started:.1f} s")
    assert xmem_state(info) == "done"
    assert info["TresPerNode"] == f"gres:{expected_gres(cluster, path, submitted, before)}"
    status = json.loads(cluster.run("xmem-slurm", "status", sub.job_id, "--json").stdout)
    assert (status["estimate"], status["request_before"]) == ("done", "gpu:1")
    assert status["request_now"] == f"TresPerNode={info['TresPerNode']}"
    done = cluster.wait(sub.job_id)
    assert done["JobState"] == "COMPLETED"  # the submitted version ran, not the edited one
    out = cluster.output(work, sub.job_id)
    assert "trained on cpu" in out and f"XMEM_PEAK_BYTES={status['stamp']['peak_bytes']}" in out
    record = {r.job_id: r for r in read_records(cluster.store)}[sub.job_id]  # the Epilog's record
    assert (record.deferred_state, record.request_before, record.gres) == ("done", "gpu:1", info["TresPerNode"][5:])


def test_failed_estimate_releases_the_job_unchanged(deferred_cluster, work):
    cluster = deferred_cluster
    sub = cluster.sbatch(script(work, "broken.sh", "python broken.py\n"))
    assert sub.returncode == 0, sub.stderr
    info = wait_settled(cluster, sub.job_id)
    assert (xmem_state(info), info["TresPerNode"]) == ("failed", "gres:gpu:1")
    assert "cannot+estimate" in info["Comment"]
    assert cluster.wait(sub.job_id)["JobState"] == "FAILED"  # it ran, and failed as the user's script does


def test_failed_estimate_cancels_the_job_when_fail_closed(deferred_cluster, work, tmp_path):
    cluster = deferred_cluster
    closed = tmp_path / "closed.toml"
    closed.write_text(re.sub(r'(?m)^failure = "open"', 'failure = "closed"', cluster.config.read_text()))
    sub = cluster.sbatch(script(work, "broken-closed.sh", "python broken.py\n"),
                         env={"XMEM_CONFIG": str(closed)})
    assert sub.returncode == 0, sub.stderr
    info = wait_settled(cluster, sub.job_id)
    assert (info["JobState"], xmem_state(info)) == ("CANCELLED", "refused")
    assert "job+refused" in info["Comment"]


def test_estimation_job_cancelled_by_hand_releases_the_job(deferred_cluster, work):
    cluster = deferred_cluster
    sub = cluster.sbatch(script(work, "cancelled.sh", "# another version\npython train.py\n"))
    assert sub.returncode == 0, sub.stderr
    estimate = cluster.run("squeue", "-h", "-n", f"xmem-estimate-{sub.job_id}", "-o", "%i").stdout.split()
    assert len(estimate) == 1
    cluster.run("scancel", estimate[0])
    info = wait_settled(cluster, sub.job_id)
    assert (xmem_state(info), info["TresPerNode"]) == ("failed", "gres:gpu:1")
    assert "estimation+job+failed" in info["Comment"]


def test_burst_of_submissions_each_get_their_request_none_left_held(deferred_cluster, work):
    cluster = deferred_cluster
    path = script(work, "burst.sh")
    before = cluster.analyses()
    ids: list[str] = []
    lock = threading.Lock()

    def submit():
        # --begin keeps the released jobs pending: the test checks their requests, it does not train 50 times
        sub = cluster.sbatch(path, "--begin=now+3600")
        with lock:
            ids.append(sub.job_id if sub.returncode == 0 else f"error: {sub.stderr}")

    started = time.monotonic()
    threads = [threading.Thread(target=submit) for _ in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = time.monotonic() - started
    assert len(ids) == BURST and all(i and i.isdigit() for i in ids), ids
    infos = {i: wait_settled(cluster, i, timeout=600) for i in ids}
    print(f"\nfigure: {BURST} deferred submissions: sbatch burst {submitted:.1f} s, all released after "
          f"{time.monotonic() - started:.1f} s")
    expected = expected_gres(cluster, path, path.read_text(), before)  # one estimate served all 50
    assert {i: (xmem_state(v), v["TresPerNode"]) for i, v in infos.items()} == {
        i: ("done", f"gres:{expected}") for i in ids}
    cluster.run("scancel", *ids)
