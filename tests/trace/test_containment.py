"""Nothing of a trace outlives the estimate, and how a trace died reads as what happened: processes the program
starts are stopped with it, a caller killed with SIGKILL takes the tracer with it (and its scratch goes at the next
run), the host-memory limit holds, and a program ending its own process is named as such."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.trace.test_interrupt import processes_running, wait_for
from tests.torch_builds import SCRIPTS
from xmem.config import ConfigError, config_from_dict, load_site_config
from xmem.trace import TraceError, run_trace, sandbox
from xmem.trace.runner import SCRATCH_PREFIX, ChildRun, _no_result, remove_stale_scratch

MISBEHAVES = str(SCRIPTS / "misbehaves.py")


@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_processes_the_program_starts_do_not_outlive_the_estimate(monkeypatch, mode):
    if mode == "fallback":
        monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    marker = f"xmem-helper-{uuid.uuid4().hex}"
    try:
        last_progress = []
        trace = run_trace(["python", MISBEHAVES, "--how", "spawn", marker], iterations=2,
                          on_progress=lambda line: last_progress.append(time.monotonic()))
        assert trace.iterations == 2
        assert processes_running(marker) == [], "a process the program started outlived the estimate"
        # the forked worker held the progress pipe: the caller must not wait for it (it used to add 5 s)
        assert time.monotonic() - last_progress[-1] < 3
    finally:
        for pid in processes_running(marker):
            os.kill(pid, signal.SIGKILL)


def test_caller_killed_with_sigkill_takes_the_tracer_with_it(tmp_path):
    script = tmp_path / f"sleeps_{uuid.uuid4().hex}.py"
    script.write_text("import time\ntime.sleep(120)\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", f"from xmem.trace import run_trace; run_trace(['python', {str(script)!r}])"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def tracer() -> list[int]:
            return [p for p in processes_running(str(script)) if p != parent.pid]

        assert wait_for(tracer, 60), "the tracer never started"
        scratch = list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{parent.pid}-*"))
        assert len(scratch) == 1
        parent.kill()  # SIGKILL: no cleanup runs in the caller
        parent.wait(timeout=30)
        assert wait_for(lambda: not tracer(), 10), "the tracer outlived its killed caller"
        assert scratch[0].exists()  # what the next run cleans: a dead owner's scratch
        remove_stale_scratch(min_age_s=0)
        assert not scratch[0].exists()
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in processes_running(str(script)):
            os.kill(pid, signal.SIGKILL)


def test_stale_scratch_is_only_that_of_a_dead_owner_and_old_enough():
    live = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    young = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}999999999-"))  # no such pid, but just made
    try:
        remove_stale_scratch()
        assert young.exists()
        remove_stale_scratch(min_age_s=0)
        assert live.exists() and not young.exists()
    finally:
        for path in (live, young):
            if path.exists():
                path.rmdir()


@pytest.mark.parametrize("how, kind, words", [
    ("exit3", "user_error", "the program called os._exit(3) before the trace ended (last progress: "),
    ("kill9", "crashed", "killed by signal 9 (SIGKILL) before the trace ended (last progress: "),
    ("abort", "crashed", "killed by signal 6 (SIGABRT)"),
])
def test_a_program_that_ends_its_own_process_reads_as_what_happened(how, kind, words):
    with pytest.raises(TraceError) as caught:
        run_trace(["python", MISBEHAVES, "--how", how])
    error = caught.value
    assert error.kind == kind and words in error.message and "internal" not in error.message
    assert f"ending with {how}" in error.last_lines()


def test_a_program_killed_at_its_own_cpu_time_limit_is_not_said_to_lack_host_memory(tmp_path):
    """RLIMIT_CPU with equal soft and hard limits sends SIGKILL, as the out-of-memory killer does: it read as "most
    likely for host memory" (exit 10), which sent users to raise a memory limit that was never reached."""
    program = tmp_path / "spin.py"
    program.write_text("import resource, torch\n"
                       "used = resource.getrusage(resource.RUSAGE_SELF)\n"
                       "limit = int(used.ru_utime + used.ru_stime) + 2\n"
                       "resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))\n"
                       "print('spinning', flush=True)\n"
                       "while True:\n    pass\n")
    with pytest.raises(TraceError) as caught:
        run_trace(["python", str(program)], timeout=120)
    error = caught.value
    assert error.kind != "memory_limit" and "host memory" not in error.message.replace("not for host memory", "")
    assert "killed by signal 9 (SIGKILL)" in error.message and "CPU-time limit" in error.message


@pytest.mark.parametrize("run, kind", [
    (ChildRun("", -9, oom_kills=1, cpu_seconds=3.0, cpu_limit_seconds=100), "memory_limit"),  # the kernel's kill
    (ChildRun("", -9, oom_kills=None, cpu_seconds=None, cpu_limit_seconds=100), "memory_limit"),  # unknown: likely
    (ChildRun("", -9, oom_kills=0, cpu_seconds=105.2, cpu_limit_seconds=100), "timeout"),  # the tracer's hard limit
    (ChildRun("", -9, oom_kills=0, cpu_seconds=3.0, cpu_limit_seconds=100), "crashed"),  # neither: not memory
    (ChildRun("MemoryError\n", -9, oom_kills=0, cpu_seconds=3.0, cpu_limit_seconds=100), "memory_limit"),
])
def test_a_sigkill_reads_as_what_the_kernel_counted(run, kind):
    assert _no_result({"signal": signal.SIGKILL}, run, 1 << 30).kind == kind
    assert _no_result({"signal": signal.SIGXCPU}, run, 1 << 30).kind == "timeout"


def test_host_memory_limit_from_the_site_config_is_its_own_error(tmp_path):
    site = tmp_path / "xmem.toml"
    site.write_text("[estimate]\nmemory_limit_gib = 1.5\n")
    assert load_site_config(site).estimate.memory_limit_bytes == int(1.5 * (1 << 30))
    assert config_from_dict({}).estimate.memory_limit_bytes == 8 << 30  # the safe default
    with pytest.raises(ConfigError, match="estimate.memory_limit_gib"):
        config_from_dict({"estimate": {"memory_limit_gib": -1}})
    run = subprocess.run([sys.executable, "-m", "xmem.cli", "estimate", "--config", str(site), "--",
                          "python", MISBEHAVES, "--how", "hold", "3"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 10, run.stderr
    assert "more host memory than the trace may use (1.5 GiB: estimate.memory_limit_gib" in run.stderr


def test_the_tracer_runs_under_a_cpu_time_and_a_host_memory_limit():
    """So that a tracer whose caller vanished still stops, and a program cannot take the login node's memory: the
    limit is on resident memory (watched by the sandbox), with RLIMIT_DATA as a backstop for reservations."""
    with pytest.raises(TraceError) as caught:
        run_trace(["python", MISBEHAVES, "--how", "limits"], timeout=200, memory_limit_bytes=3 << 30)
    assert f"cpu {200 * os.cpu_count() + 60} data {sandbox.DATA_BACKSTOP * (3 << 30)}" in caught.value.output


def test_failed_estimate_shows_what_the_program_printed(tmp_path):
    """The CLI prints the program's last lines beside its traceback (and --json carries them)."""
    script = tmp_path / "train.py"
    script.write_text("for shard in range(30):\n    print(f'loading shard {shard}')\n"
                      "raise FileNotFoundError('shard 30 is missing')\n")
    run = subprocess.run([sys.executable, "-m", "xmem.cli", "estimate", "--json", "--", "python", str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 5
    printed = run.stderr.split("the program's last output lines:\n", 1)[1]
    assert "  | loading shard 29\n" in printed and "loading shard 9\n" not in printed  # the last 20
    assert printed.index("loading shard 29") < printed.index("FileNotFoundError: shard 30 is missing")
    assert "loading shard 29" in json.loads(run.stdout)["output"]


def test_host_memory_reserved_but_never_touched_is_not_held(tmp_path):
    """The limit is on what the program holds resident: a 3 GiB host buffer it never fills (as ZeRO-3's offload
    reserves for what the fake GPU never writes) passes a 1.5 GiB limit; filling 3 GiB does not (test above)."""
    script = tmp_path / "reserves.py"
    script.write_text("import torch\nbuffer = torch.empty(3 << 30, dtype=torch.uint8)\n"
                      "layer = torch.nn.Linear(8, 8).cuda()\noptimizer = torch.optim.SGD(layer.parameters())\n"
                      "for _ in range(2):\n"
                      "    layer(torch.randn(2, 8, device='cuda')).sum().backward(); optimizer.step()\n")
    trace = run_trace(["python", str(script)], iterations=2, memory_limit_bytes=int(1.5 * (1 << 30)))
    assert trace.iterations == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="a trace root starts")
def test_roots_trace_leaves_nothing_of_its_identity_behind():
    """Issue 35: root's trace writes as the trace identity in a scratch that stays root's (sticky, its contents the
    identity's); when the estimate ends, nothing the identity owns is left in the temporary folder."""
    identity = sandbox.trace_identity()
    folder = Path(tempfile.gettempdir())

    def identitys() -> set[str]:
        return {entry.name for entry in folder.iterdir() if entry.lstat().st_uid == identity.uid}

    before = identitys()
    trace = run_trace(["python", str(SCRIPTS / "mlp_adam.py")], iterations=1)
    assert "root's trace runs as" in trace.sandbox
    assert identitys() - before == set()
