"""An interrupted estimate leaves no tracing child behind (the child runs in a session of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from xmem.trace import TraceCancelled, run_trace

from tests.waiting import wait_for

def processes_running(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_estimating_process_stops_the_tracing_child(tmp_path, sig):
    script = tmp_path / f"sleeps_{sig.name}.py"
    script.write_text("import time\ntime.sleep(120)\n")
    # Ctrl-C as at a terminal: a suite started in the background (`cmd &` without job control) ignores SIGINT,
    # and an ignored signal is inherited, so the estimate would rightly ignore it too
    interactive = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"{interactive}; from xmem.trace import run_trace; "
                               f"run_trace(['python', {str(script)!r}])"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the tracer's command lines name the script and its options (a process forked from the parent shows the
        # parent's command line until it execs, so the script alone does not tell that the child has started)
        def children() -> list[int]:
            return [p for p in processes_running(str(script)) if p != parent.pid and p in processes_running("--out")]

        assert wait_for(children, 60), "the tracing child never started"
        os.kill(parent.pid, sig)
        parent.wait(timeout=60)  # it stops the child first: SIGTERM, up to 5 s, then SIGKILL
        assert wait_for(lambda: not children(), 10), "the tracing child outlived the interrupted estimate"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in processes_running(str(script)):
            os.kill(pid, signal.SIGKILL)


def test_a_cancelled_trace_stops_its_tracing_child(tmp_path):
    """The estimate cancels a trace it no longer needs (a capability class's, traced beside a first that failed)."""
    script = tmp_path / "sleeps_cancelled.py"
    script.write_text("import time\ntime.sleep(120)\n")
    cancel, outcome = threading.Event(), {}

    def trace() -> None:
        try:
            run_trace(["python", str(script)], cancel=cancel)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            outcome["error"] = error

    def children() -> list[int]:
        return [p for p in processes_running(str(script)) if p in processes_running("--out")]

    thread = threading.Thread(target=trace)
    thread.start()
    try:
        assert wait_for(children, 60), "the tracing child never started"
        cancel.set()
        thread.join(timeout=30)
        assert isinstance(outcome.get("error"), TraceCancelled), outcome
        assert wait_for(lambda: not children(), 10), "the tracing child outlived its cancelled trace"
    finally:
        cancel.set()
        thread.join(timeout=30)
        for pid in processes_running(str(script)):
            os.kill(pid, signal.SIGKILL)
