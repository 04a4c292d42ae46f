"""Put-off starts (issue 35 item 5), the filter's side: at a fail-open site without a CPU partition, an estimate not
ready within `[filter] wait_s` answers with the job's start put off past the estimate's deadline (unless the user's
own --begin is later), at a fail-closed one with the job held; its comment pending, and a spool whose submit.sh
starts the estimate detached. (The flow on the
real Slurm, the detached estimate included: tests/integration/test_putoff.py.)"""

import dataclasses
import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.slurm.test_handoff import WAIT_S, own_slots, site, spools, submission, timed  # noqa: F401 - the fixture
from xmem.slurm.contract import Verdict
from xmem.slurm.putoff import SLURM_TIME, START_FILE, Start, puts_off
from xmem.slurm.stamp import comment_fields

TIMEOUT_S = 60.0
PUT_OFF_MARGIN_S = 7.0  # the site's [filter] put_off_margin_s (not the default: the begin follows the site's)


def no_partition(tmp_path, **kw):
    config = site(tmp_path, cpu_partition=None, **kw)
    return dataclasses.replace(config, estimate=dataclasses.replace(config.estimate, timeout_s=TIMEOUT_S),
                               filter=dataclasses.replace(config.filter, put_off_margin_s=PUT_OFF_MARGIN_S))


def never_ready(path, req, config, *, deadline, cancel):
    cancel.wait(30)
    return Verdict(decision=None, errors=("TraceCancelled",))


def at(text: str) -> float:
    return datetime.strptime(text, SLURM_TIME).timestamp()


def test_a_slow_estimate_puts_the_jobs_start_off_past_its_deadline(tmp_path):
    before = time.time()
    reply, seconds = timed(submission(tmp_path, comment="my run"), no_partition(tmp_path), never_ready)
    assert WAIT_S <= seconds < WAIT_S + 1.5
    assert "hold" not in reply.set and "gres" not in reply.set and reply.defer
    put_off = at(reply.set["begin"])
    assert before + TIMEOUT_S + PUT_OFF_MARGIN_S <= put_off <= time.time() + TIMEOUT_S + PUT_OFF_MARGIN_S + 1
    assert reply.message.startswith(f"GPU memory estimate not ready within {WAIT_S:g} s, goes on in the background")
    assert f"the job's start is put off to {reply.set['begin'][11:]}" in reply.message and "\n" not in reply.message
    assert reply.set["comment"].startswith("my run xmem:")
    assert comment_fields(reply.set["comment"])["state"] == "pending"
    (spool,) = spools(tmp_path)
    assert str(spool) == reply.defer
    start = json.loads((spool / START_FILE).read_text())
    assert (start["put_off"], start["start_at"]) == (reply.set["begin"], "now")
    assert start["estimate_until"] + PUT_OFF_MARGIN_S <= put_off


def test_the_users_own_later_begin_is_kept_an_earlier_one_brought_back(tmp_path):
    later = datetime.fromtimestamp(time.time() + 3600).strftime(SLURM_TIME)  # as sbatch reports --begin=now+3600
    reply, _ = timed(submission(tmp_path, begin=later), no_partition(tmp_path), never_ready)
    assert "begin" not in reply.set and "keeps its own later start" in reply.message
    assert json.loads((Path(reply.defer) / START_FILE).read_text())["start_at"] == ""
    earlier = datetime.fromtimestamp(time.time() + 10).strftime(SLURM_TIME)
    reply, _ = timed(submission(tmp_path, begin=earlier), no_partition(tmp_path), never_ready)
    assert at(reply.set["begin"]) > at(earlier)
    assert json.loads((Path(reply.defer) / START_FILE).read_text())["start_at"] == earlier


@pytest.mark.parametrize("setting, options", [({"put_off": False}, {}), ({}, {"begin": "Tomorrow 10:00"})])
def test_no_put_off_where_the_site_says_so_or_the_begin_cannot_be_read(tmp_path, setting, options):
    """put_off = false, or a --begin in a form set by the user's SLURM_TIME_FORMAT: waited for."""
    config, request = no_partition(tmp_path, **setting), submission(tmp_path, **options)
    assert not puts_off(config, request)
    assert puts_off(no_partition(tmp_path), submission(tmp_path))


@pytest.mark.parametrize("options", [{}, {"begin": "Tomorrow 10:00"}])
def test_a_fail_closed_site_holds_the_job_instead_whatever_its_begin(tmp_path, options):
    """A put-off job would run unestimated: held, its own --begin (read or not) left as it is; the detached estimate
    answers under the site's fail-closed rule and releases the job (Start.resume None), or cancels it."""
    closed = no_partition(tmp_path, failure="closed")
    reply, seconds = timed(submission(tmp_path, comment="my run", **options), closed, never_ready)
    assert WAIT_S <= seconds < WAIT_S + 1.5
    assert reply.set["hold"] == "set" and "begin" not in reply.set and "gres" not in reply.set and reply.defer
    assert reply.message.startswith(f"GPU memory estimate not ready within {WAIT_S:g} s, goes on in the background")
    assert reply.message.endswith("the job is held until it is done; this site requires an estimate: without one "
                                  "the job is cancelled (xmem-slurm status JOBID)")
    assert comment_fields(reply.set["comment"])["state"] == "pending"
    start = Start(**json.loads((Path(reply.defer) / START_FILE).read_text()))
    assert start.held and start.put_off is None and (start.failure, start.resume) == ("closed", None)
    assert start.estimate_until <= time.time() + TIMEOUT_S
    opened = Start(**json.loads((Path(timed(submission(tmp_path), no_partition(tmp_path), never_ready)[0].defer)
                                 / START_FILE).read_text()))
    assert not opened.held and (opened.failure, opened.resume) == ("open", "now")


def test_the_spools_submit_script_starts_the_estimate_detached_and_returns(tmp_path):
    """submit.sh (what post-submit runs) returns at once, while what it started goes on in a session of its own."""
    reply, _ = timed(submission(tmp_path), no_partition(tmp_path), never_ready)
    script = Path(reply.defer) / "submit.sh"
    text = script.read_text()
    assert "setsid" in text and "-m xmem.slurm.putoff" in text
    # The same script with the estimate's command swapped for one that reports its session and outlives the script
    probe = tmp_path / "probe.out"
    command = f"sh -c 'sleep 1; ps -o sid= -p $$ > {probe}'"
    line = next(line for line in text.splitlines() if "xmem.slurm.putoff" in line)
    script.write_text(text.replace(line, f"$detach {command} </dev/null >/dev/null 2>&1 &"))
    started = time.monotonic()
    done = subprocess.run(["sh", str(script), "123"], capture_output=True, timeout=30)
    assert done.returncode == 0 and time.monotonic() - started < 1.0
    assert subprocess.run(["sh", str(script), "12x"], capture_output=True, timeout=30).returncode == 1
    deadline = time.monotonic() + 10
    while not (probe.exists() and probe.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe.read_text().strip() not in ("", str(os.getsid(0)))  # its own session: not sbatch's
