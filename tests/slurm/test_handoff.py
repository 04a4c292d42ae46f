"""sbatch within a wait (issue 35 item 5): an estimate ready within `[filter] wait_s` answers inline; one that is
not is handed to the CPU partition (held, one line), cancelled, and never answers inline afterwards (its result,
when it comes, reaches the cache); without a CPU partition a fail-closed site waits for the estimate as before.
(The flow on the real Slurm: tests/integration/test_deferred.py.)"""

import threading
import time

import pytest

from tests.slurm.submissions import PEAKS, decision
from xmem.config import ConfigError, config_from_dict
from xmem.slurm.contract import FilterReply, FilterRequest, Verdict
from xmem.slurm.filter import run_filter
from xmem.slurm.handoff import inline_or_handed_off
from xmem.slurm.stamp import comment_fields

WAIT_S = 1.0


@pytest.fixture(autouse=True)
def own_slots(tmp_path, monkeypatch):
    """The host's estimate slots in a folder of this test's: root's real ones are shared with whatever else runs
    as root here, and a submission finding them all taken is handed off at once."""
    monkeypatch.setattr("xmem.slurm.inline.SHARED_SLOTS_DIR", str(tmp_path / "slots"))
    return tmp_path / "slots"


def site(tmp_path, cpu_partition="cpu", wait_s=WAIT_S, mode="inline", failure="open", put_off=True):
    return config_from_dict({"partitions": {"default": "debug", "from_cluster": False,
                                            "gpu_types": {"debug": ["a100"]}},
                             "mps": {"enabled": True, "gpu_types": ["a100"]},
                             "policy": {"failure": failure},
                             "estimate": {"cache_dir": str(tmp_path / "cache")},
                             "deferred": {"mode": mode, "cpu_partition": cpu_partition},
                             "filter": {"wait_s": wait_s, "put_off": put_off}})


def submission(tmp_path, **options) -> FilterRequest:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    return FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1", **options},
                         user="ann", cwd=str(tmp_path))


def spools(tmp_path) -> list:
    root = tmp_path / "cache" / "spool"
    return sorted(root.iterdir()) if root.is_dir() else []


def policy(path, req, config) -> Verdict:
    """The real policy on fixed peaks (a cached answer is used only if the policy still makes it)."""
    from xmem.analyze import decide_on_peaks
    from xmem.slurm.inline import parse_job

    return Verdict(decide_on_peaks(parse_job(path, req), PEAKS, config), PEAKS)


def timed(request, config, analyzer) -> tuple[FilterReply, float]:
    started = time.monotonic()
    reply = run_filter(request, config, analyzer=analyzer)
    return reply, time.monotonic() - started


def test_an_estimate_ready_within_the_wait_answers_inline(tmp_path):
    quick = lambda path, req, config, **_: policy(path, req, config)  # noqa: E731
    reply, seconds = timed(submission(tmp_path), site(tmp_path), quick)
    assert reply.set["gres"].startswith("mps:a100:") and "hold" not in reply.set and reply.defer is None
    assert seconds < WAIT_S and spools(tmp_path) == []


def test_an_estimate_not_ready_is_handed_off_held_with_one_line_and_cancelled(tmp_path):
    seen = {}

    def slow(path, req, config, *, deadline, cancel):
        seen["cancelled"] = cancel.wait(30)  # a trace stops when it is cancelled
        return Verdict(decision=None, errors=("TraceCancelled",))

    reply, seconds = timed(submission(tmp_path, comment="my run"), site(tmp_path), slow)
    assert WAIT_S <= seconds < WAIT_S + 1.5  # the wait counts from the filter's start
    assert seen == {"cancelled": True}
    assert reply.set["hold"] == "set" and "gres" not in reply.set and reply.defer
    assert reply.message == ("GPU memory estimate not ready within 1 s, queued on partition cpu: the job is held "
                             "until it is done (xmem-slurm status JOBID)")
    assert "\n" not in reply.message and reply.reject is None
    assert reply.set["comment"].startswith("my run xmem:")
    assert comment_fields(reply.set["comment"])["state"] == "pending"
    assert [str(s) for s in spools(tmp_path)] == [reply.defer]  # the snapshot post-submit queues
    assert not list((tmp_path / "cache").rglob("analyses/*.json"))  # a cancelled estimate is no answer


def test_the_progress_line_says_the_wait_and_ends_before_sbatch_goes_on(tmp_path, monkeypatch):
    """On sbatch's terminal the count's "at most" is the wait, and its line is ended before the handoff's own
    line (printed by the Lua side after the reply) starts."""
    import os
    import pty

    terminal, passed = pty.openpty()
    monkeypatch.setenv("XMEM_PROGRESS_FD", str(passed))  # the filter closes it, as it closes the Lua side's

    def slow(path, req, config, *, deadline, cancel):
        cancel.wait(30)
        return Verdict(decision=None, errors=("TraceCancelled",))

    reply = run_filter(submission(tmp_path), site(tmp_path), analyzer=slow)
    assert reply.set["hold"] == "set"
    shown = _read_line_end(terminal)
    os.close(terminal)
    assert "(not cached, at most 1 s)" in shown and shown.endswith("\r\n")


def _read_line_end(terminal: int, within_s: float = 5.0) -> str:
    """What the terminal shows once the line is ended: the ticker writes its end from its own thread, which the
    filter waits for at most one tick (on a loaded machine the end can come just after the reply)."""
    import os
    import select
    shown, deadline = "", time.monotonic() + within_s
    while not shown.endswith("\r\n") and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.1)[0]:
            shown += os.read(terminal, 4096).decode()
    return shown


def test_with_the_users_estimates_all_running_a_submission_is_handed_off_without_waiting(tmp_path, own_slots):
    """Admission: the user's `[estimate] max_concurrent` slots are all held (a burst's first estimates), so this
    estimate could not even start within the wait: the job goes to the CPU partition at once, the line says why."""
    from xmem.cache import estimate_slot

    called = []
    slow = lambda *a, **kw: called.append(a) or time.sleep(30)  # noqa: E731
    config = site(tmp_path, wait_s=10.0)
    with estimate_slot(own_slots, 2, wait_s=1), estimate_slot(own_slots, 2, wait_s=1):
        reply, seconds = timed(submission(tmp_path), config, slow)
    assert seconds < 1.0 and called == []
    assert reply.set["hold"] == "set" and reply.defer and [str(s) for s in spools(tmp_path)] == [reply.defer]
    assert reply.message.startswith("GPU memory estimate not started (2 of your estimates already running on this "
                                    "host), queued on partition cpu: the job is held")


def test_a_free_slot_is_taken_and_the_estimate_answers_inline(tmp_path, own_slots):
    from xmem.cache import estimate_slot

    quick = lambda path, req, config, **_: policy(path, req, config)  # noqa: E731
    with estimate_slot(own_slots, 2, wait_s=1):  # one of the two taken
        reply, _ = timed(submission(tmp_path), site(tmp_path), quick)
    assert reply.set["gres"].startswith("mps:a100:") and "hold" not in reply.set


def test_the_wait_counts_from_sbatchs_start_not_the_filters(tmp_path):
    """A filter that started late (a burst's imports on busy CPUs) waits only what is left of the wait."""
    def slow(path, req, config, *, deadline, cancel):
        cancel.wait(30)
        return Verdict(decision=None, errors=("TraceCancelled",))

    sbatch_started = time.monotonic() - 0.7  # sbatch began 0.7 s before this filter
    started = time.monotonic()
    reply = run_filter(submission(tmp_path), site(tmp_path), analyzer=slow, started=sbatch_started)
    assert reply.set["hold"] == "set" and time.monotonic() - started < WAIT_S - 0.2


def test_a_process_age_is_read_from_its_start_time():
    import subprocess

    from xmem.slurm.filter import age_s

    child = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.5)
        assert 0.4 <= age_s(child.pid) <= 3.0
    finally:
        child.kill()
        child.wait()
    assert age_s(child.pid) is None


def test_an_estimate_done_after_the_handoff_never_answers_inline_and_is_cached(tmp_path):
    """It ignored its cancel and finished during the handoff: the job is held all the same (the estimation job
    finds the answer in the cache), and a later identical submission is answered from the cache at once."""
    calls = []

    def late(path, req, config, *, deadline, cancel):
        calls.append(path)
        time.sleep(WAIT_S + 0.3)
        return policy(path, req, config)

    config, request = site(tmp_path), submission(tmp_path)
    reply, _ = timed(request, config, late)
    assert reply.set["hold"] == "set" and "gres" not in reply.set and reply.defer
    again, seconds = timed(request, config, late)
    assert again.set["gres"].startswith("mps:a100:") and "hold" not in again.set
    assert "(cached estimate)" in again.message
    assert len(calls) == 1 and seconds < WAIT_S


def test_an_estimate_that_wins_while_the_snapshot_is_made_answers_and_the_snapshot_goes():
    done, undone = threading.Event(), []

    def analyze(cancel):
        time.sleep(0.3)
        done.set()
        return Verdict(decision(), PEAKS)

    def hand_off(why):
        done.wait(5)  # the snapshot takes longer than the rest of the estimate
        return FilterReply(set={"hold": "set"}), lambda: undone.append(True)

    verdict = inline_or_handed_off(analyze, time.monotonic() + 0.1, hand_off, waited_s=0.1)
    assert isinstance(verdict, Verdict) and verdict.decision == decision() and undone == [True]


def test_a_snapshot_that_cannot_be_made_keeps_the_submission_inline():
    def analyze(cancel):
        time.sleep(0.5)
        return Verdict(decision(), PEAKS)

    def hand_off(why):
        raise PermissionError(13, "Permission denied", "/home/ann/.cache/xmem-slurm/spool")

    verdict = inline_or_handed_off(analyze, time.monotonic() + 0.1, hand_off, waited_s=0.1)
    assert isinstance(verdict, Verdict) and verdict.decision == decision()


def test_an_estimates_own_error_reaches_the_filter_as_before(tmp_path):
    def broken(path, req, config, *, deadline, cancel):
        raise OSError(2, "No such file or directory", "train.py")

    reply = run_filter(submission(tmp_path), site(tmp_path), analyzer=broken)
    assert reply.message.startswith("cannot estimate this job's GPU memory (cannot read train.py")


@pytest.mark.parametrize("setting", [{"cpu_partition": None, "put_off": False}, {"mode": "partition"}])
def test_without_a_cpu_partition_sbatch_waits_for_the_estimate_as_before(tmp_path, setting):
    """No CPU partition at a site that chose no put-off starts: the estimate answers inline however long it takes
    (at most [estimate] timeout_s, then the failure mode). Partition mode defers every miss at once. (Without a CPU
    partition the job is put off, or fail-closed held: tests/slurm/test_putoff.py.)"""
    def slow(path, req, config, *, deadline, **cancel):
        time.sleep(WAIT_S + 0.5)
        return Verdict(decision(), PEAKS)

    if setting.get("mode") == "partition":
        reply, seconds = timed(submission(tmp_path), site(tmp_path, mode="partition"), slow)
        assert reply.set["hold"] == "set" and seconds < WAIT_S and "not ready" not in reply.message
        return
    reply, seconds = timed(submission(tmp_path), site(tmp_path, **setting), slow)
    assert reply.set["gres"] == "mps:a100:40" and "hold" not in reply.set and reply.defer is None
    assert seconds >= WAIT_S + 0.5 and spools(tmp_path) == []


def test_a_submission_that_cannot_be_deferred_waits_for_its_estimate(tmp_path):
    """An --export too long to hand on to the estimation job (deferred.cannot_defer) is estimated inline."""
    def slow(path, req, config, *, deadline, **cancel):
        time.sleep(WAIT_S + 0.3)
        return Verdict(decision(), PEAKS)

    request = submission(tmp_path, export="ALL,BIG=" + "x" * 200_000)
    reply, seconds = timed(request, site(tmp_path), slow)
    assert reply.set["gres"] == "mps:a100:40" and "hold" not in reply.set and seconds >= WAIT_S + 0.3


def test_the_cancel_reaches_the_estimator(tmp_path, monkeypatch):
    from xmem.slurm import inline
    from xmem.trace import TraceCancelled

    cancel, given = threading.Event(), []
    monkeypatch.setattr("xmem.estimate.estimate", lambda command, **kw: given.append(kw["cancel"]))
    estimator = inline.guarded_estimator({}, str(submission(tmp_path).script), cancel)
    estimator(["python", "train.py"], cwd=str(tmp_path))
    cancel.set()
    with pytest.raises(TraceCancelled):  # an array's next task starts no trace once cancelled
        estimator(["python", "train.py"], cwd=str(tmp_path))
    assert given == [cancel]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 61, "5", True])
def test_the_wait_is_a_positive_number_of_seconds_of_at_most_a_minute(value):
    with pytest.raises(ConfigError, match="filter.wait_s"):
        config_from_dict({"filter": {"wait_s": value}})


def test_the_wait_defaults_to_a_few_seconds():
    assert config_from_dict({}).filter.wait_s == 4.0
    assert config_from_dict({"filter": {"wait_s": 2.5}}).filter.wait_s == 2.5
    with pytest.raises(ConfigError, match="unknown key 'filter.wait'"):
        config_from_dict({"filter": {"wait": 2}})
