"""Put-off starts (issue 35 item 5) on the real dev cluster, inline mode without a CPU partition, as an ordinary
user: an estimate not ready within `[filter] wait_s` goes on detached while the job waits with its start put off;
done, it rewrites the pending job and brings its start back; killed, Slurm starts the job unchanged at the put-off
time; a user's own later --begin is kept; a fail-closed site holds the job instead and releases it with the estimate's
request."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.test_deferred import TRAIN, wait_settled
from tests.integration.test_deferred import xmem_state as state
from xmem.config import load_site_config
from xmem.jobscript import parse_jobscript
from xmem.policy import decide
from xmem.slurm.putoff import RUNNER_FILE, SLURM_TIME
from xmem.slurm.stamp import comment_fields
from xmem.slurm.store import read_records
from xmem.text import comment_text

pytestmark = pytest.mark.slurm

WAIT_S = 3
SLOW_S = WAIT_S + 2  # a slow start of the program: its estimate cannot be ready within the wait
PUT_OFF_MARGIN_S = 5  # the site's [filter] put_off_margin_s: a killed estimate's job starts 5 s after its deadline
MARGIN_S = 6  # the filter's start, the snapshot and post-submit's submit.sh, on a loaded 2-core machine
TIMEOUT_S = 180  # the estimate's: a cold trace on a loaded machine finishes well within it
PUT_OFF = re.compile(rf"xmem-slurm: GPU memory estimate (not ready within {WAIT_S} s|not started \([^)]*\)), goes on "
                     r"in the background until \d\d:\d\d:\d\d: ")


def slow(seconds: int) -> str:
    """A program whose estimate cannot be ready within the wait (a slow start: data loading, say)."""
    return f"import time\ntime.sleep({seconds})\n" + TRAIN


@pytest.fixture(scope="module")
def mine(submitter) -> Path:
    work = submitter.home / "putoff-jobs"
    work.mkdir()
    os.chown(work, submitter.uid, submitter.gid)
    return work


def users_job(user, work: Path, name: str, program: str) -> Path:
    """`name`.sh running `name`.py (`program`), both the user's."""
    (work / f"{name}.py").write_text(program)
    path = work / f"{name}.sh"
    path.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\npython {name}.py\n")
    for p in (path, work / f"{name}.py"):
        os.chown(p, user.uid, user.gid)
    return path


def put_off_config(cluster, *, timeout_s: int = TIMEOUT_S, failure: str = "open") -> str:
    """The inline cluster's config (no CPU partition) with put-off starts on."""
    text = cluster.config.read_text()
    for key, value in {"put_off": "true", "wait_s": str(WAIT_S), "timeout_s": str(timeout_s),
                       "put_off_margin_s": str(PUT_OFF_MARGIN_S), "failure": f'"{failure}"'}.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert n == 1, f"the cluster's config has no {key}"
    assert 'cpu_partition = ""' in text
    return text


def at(slurm_time: str) -> float:
    return datetime.strptime(slurm_time, SLURM_TIME).timestamp()


def wait_for(what, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := what()):
            return found
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def estimated(cluster, job_id: str, timeout: float) -> dict[str, str]:
    """The job once its detached estimate wrote its outcome (a state other than pending)."""
    return wait_for(lambda: (info := cluster.job(job_id)) and state(info) not in (None, "pending") and info, timeout)


def spools(cluster, user) -> list[Path]:
    root = cluster.user_cache(user.name) / "spool"
    return sorted(root.iterdir()) if root.is_dir() else []


def expected_gres(cluster, user, path: Path, before: set[Path]) -> str:
    """The policy's request for the job, from the estimate its detached run cached (the one new entry)."""
    (entry,) = cluster.analyses(user.name) - before
    peaks = json.loads(entry.read_text())["peaks"]
    job = parse_jobscript(path.read_text(), path=str(path), env=cluster.env)
    decision = decide(peaks, job.directives, load_site_config(cluster.config), user=user.name)
    assert decision.action == "rewrite"
    return decision.gres


def submitted_put_off(cluster, user, path: Path, *options: str, timeout_s: int = TIMEOUT_S):
    """sbatch of a slow job: back within the wait, one line, its start put off past the estimate's deadline."""
    before = time.time()
    sub = cluster.sbatch(path, *options, user=user)
    assert sub.returncode == 0, sub.stderr
    print(f"\nfigure: sbatch of a slow estimate (put off) returned in {sub.seconds:.2f} s (wait {WAIT_S} s)")
    assert sub.seconds < WAIT_S + MARGIN_S and PUT_OFF.search(sub.stderr), sub.stderr
    assert sum(line.startswith("xmem-slurm:") for line in sub.stderr.splitlines()) == 1, sub.stderr
    waiting = cluster.job(sub.job_id)
    assert (state(waiting), waiting["TresPerNode"]) == ("pending", "gres:gpu:1")
    assert waiting["Reason"] != "JobHeldUser"  # put off, not held
    if not options:
        put_off = at(waiting["StartTime"])
        assert before + timeout_s + PUT_OFF_MARGIN_S <= put_off <= time.time() + timeout_s + PUT_OFF_MARGIN_S + 2
    return sub, waiting


def test_a_slow_estimate_puts_the_start_off_then_the_job_gets_its_request_and_its_start_back(cluster, submitter,
                                                                                           mine):
    path = users_job(submitter, mine, "slow", slow(SLOW_S))
    before = cluster.analyses(submitter.name)
    with cluster.site_config_text(put_off_config(cluster)):
        sub, waiting = submitted_put_off(cluster, submitter, path)
        info = estimated(cluster, sub.job_id, TIMEOUT_S + PUT_OFF_MARGIN_S)
    assert state(info) == "done", info["Comment"]
    assert info["TresPerNode"] == f"gres:{expected_gres(cluster, submitter, path, before)}"
    # brought back to now: started, or pending with no start planned yet (Slurm says Unknown), no longer for its begin
    assert info["JobState"] != "PENDING" or info["StartTime"] == "Unknown" or \
        at(info["StartTime"]) < at(waiting["StartTime"]) - PUT_OFF_MARGIN_S, info
    assert info["Reason"] != "BeginTime"
    assert wait_for(lambda: not spools(cluster, submitter), 10)
    cluster.run("scancel", sub.job_id)


def test_a_killed_estimate_leaves_the_job_to_start_unchanged_at_its_put_off_time(cluster, submitter, mine):
    short = 15  # the estimate's timeout: the job starts 20 s after sbatch however the estimate ends
    path = users_job(submitter, mine, "killed", "import time\nwhile True:\n    time.sleep(1)\n")
    with cluster.site_config_text(put_off_config(cluster, timeout_s=short)):
        sub, waiting = submitted_put_off(cluster, submitter, path, timeout_s=short)
        (spool,) = spools(cluster, submitter)
        runner = wait_for(lambda: (spool / RUNNER_FILE).exists() and json.loads((spool / RUNNER_FILE).read_text()), 30)
        assert runner["job"] == sub.job_id
        os.kill(runner["pid"], signal.SIGKILL)  # the OOM killer, a reboot, the user's session limits
        assert time.time() < at(waiting["StartTime"])  # killed while the job waits: Slurm alone starts it
        started = wait_for(lambda: (info := cluster.job(sub.job_id))["JobState"] != "PENDING" and info,
                           short + PUT_OFF_MARGIN_S + 60)
    assert at(started["StartTime"]) >= at(waiting["StartTime"])  # at its put-off time, not before
    assert (started["TresPerNode"], state(started)) == ("gres:gpu:1", "pending")  # unchanged
    cluster.run("scancel", sub.job_id)
    record = wait_for(lambda: {r.job_id: r for r in read_records(cluster.store)}.get(sub.job_id), 60)
    assert record.deferred_state == "failed"  # the Epilog: no estimate came back


def test_an_estimate_that_fails_gives_the_job_its_start_back_unchanged(cluster, submitter, mine):
    fails = f"import time\ntime.sleep({SLOW_S})\nraise RuntimeError('no /data here')\n"
    path = users_job(submitter, mine, "fails", fails)
    with cluster.site_config_text(put_off_config(cluster)):
        sub, waiting = submitted_put_off(cluster, submitter, path, "--begin=now+120")  # pending, brought back
        info = estimated(cluster, sub.job_id, TIMEOUT_S + PUT_OFF_MARGIN_S)
    assert (state(info), info["TresPerNode"]) == ("failed", "gres:gpu:1"), info["Comment"]
    assert comment_text(comment_fields(info["Comment"])["why"]).startswith("cannot estimate this job's GPU memory")
    assert at(info["StartTime"]) <= at(waiting["StartTime"]) - PUT_OFF_MARGIN_S  # its own --begin, not the put-off
    cluster.run("scancel", sub.job_id)


def test_the_users_own_later_begin_is_kept(cluster, submitter, mine):
    path = users_job(submitter, mine, "later", slow(SLOW_S))
    before = cluster.analyses(submitter.name)
    with cluster.site_config_text(put_off_config(cluster)):
        sub, waiting = submitted_put_off(cluster, submitter, path, "--begin=now+3600")
        assert "the job keeps its own later start" in sub.stderr
        own = at(waiting["StartTime"])
        assert own >= time.time() + 3500
        info = estimated(cluster, sub.job_id, TIMEOUT_S + PUT_OFF_MARGIN_S)
    assert state(info) == "done", info["Comment"]
    assert info["TresPerNode"] == f"gres:{expected_gres(cluster, submitter, path, before)}"
    assert (info["JobState"], at(info["StartTime"])) == ("PENDING", own)
    cluster.run("scancel", sub.job_id)


def test_a_fail_closed_site_holds_the_job_then_its_estimate_releases_it_with_its_request(cluster, submitter, mine):
    path = users_job(submitter, mine, "closed", slow(SLOW_S))
    before, left = cluster.analyses(submitter.name), set(spools(cluster, submitter))  # a killed estimate's stays
    with cluster.site_config_text(put_off_config(cluster, failure="closed")):
        sub = cluster.sbatch(path, "--begin=now+3600", user=submitter)  # released, it stays pending: its begin kept
        assert sub.returncode == 0, sub.stderr
        print(f"\nfigure: sbatch of a slow estimate (fail-closed, held) returned in {sub.seconds:.2f} s "
              f"(wait {WAIT_S} s)")
        assert sub.seconds < WAIT_S + MARGIN_S and PUT_OFF.search(sub.stderr), sub.stderr
        assert "the job is held until it is done; this site requires an estimate" in sub.stderr
        held = cluster.job(sub.job_id)
        assert (state(held), held["TresPerNode"], held["Reason"]) == ("pending", "gres:gpu:1", "JobHeldUser")
        info = wait_settled(cluster, sub.job_id, TIMEOUT_S)  # its outcome written, then released
    assert (state(info), info["JobState"]) == ("done", "PENDING"), info["Comment"]
    assert info["TresPerNode"] == f"gres:{expected_gres(cluster, submitter, path, before)}"
    assert at(info["StartTime"]) >= time.time() + 3500  # released to its own begin
    assert wait_for(lambda: set(spools(cluster, submitter)) <= left, 10)
    cluster.run("scancel", sub.job_id)
