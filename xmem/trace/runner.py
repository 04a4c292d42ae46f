"""The parent side of a trace: `run_trace` starts the tracing child, relays its progress, returns its Trace.

Owns the subprocess: interpreter choice, PYTHONPATH so the child finds xmem from any venv, the environment of one
rank for distributed launchers, the timeout, capture of the program's output, and turning the child's error JSON
into a TraceError. Does not import torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Mapping

from xmem.trace.command import Target, parse_command
from xmem.trace.errors import TraceError
from xmem.trace.events import Trace

XMEM_PARENT_DIR = str(Path(__file__).resolve().parent.parent.parent)  # the directory holding the xmem package
OUTPUT_TAIL = 4000  # characters of the program's output kept in a TraceError


def run_trace(command: list[str], *, iterations: int = 3, capability: tuple[int, int] = (9, 0),
              device_count: int = 1, env: Mapping[str, str] | None = None, cwd: str | None = None,
              timeout: float | None = None, python: str | None = None,
              on_progress: Callable[[str], None] | None = None) -> Trace:
    """Run `command` (as the user would type it) under fake CUDA for `iterations` optimizer steps.

    Returns the Trace; a program that never touches CUDA gives a Trace with used_cuda=False and no events.
    Raises TraceError (kind not_found, not_python, user_error, no_optimizer_step, timeout or internal).
    `env` (the program's environment; default: this one) may set XMEM_FAKE_GPU_NAME and XMEM_FAKE_TOTAL_MEMORY
    (bytes) so that torch.cuda.get_device_properties names the exact GPU instead of a typical one of `capability`.
    """
    target = parse_command(list(command), cwd)
    interpreter = python or sys.executable
    if shutil.which(interpreter) is None:
        raise TraceError("not_found", f"Python interpreter {interpreter} not found: give the job's python")
    with tempfile.TemporaryDirectory(prefix="xmem-trace-") as scratch:
        out = Path(scratch) / "trace.json"
        child = [interpreter, "-m", "xmem.trace", "--out", str(out), "--iterations", str(iterations),
                 "--capability", f"{capability[0]}.{capability[1]}", "--device-count", str(device_count)]
        output, returncode = _run_child(child, target, _child_env(env, target), cwd, timeout, on_progress)
        if not out.exists():
            raise TraceError("internal", f"the tracing child ended (status {returncode}) without writing a result: "
                                         f"{_last_line(output)}", output=output[-OUTPUT_TAIL:])
        payload = json.loads(out.read_text())
    if "error" in payload:
        raise TraceError(payload["error"], payload["message"], payload.get("traceback", ""),
                         output=output[-OUTPUT_TAIL:])
    return Trace.from_json(payload)


def _child_env(env: Mapping[str, str] | None, target: Target) -> dict[str, str]:
    child_env = dict(os.environ if env is None else env)
    paths = [XMEM_PARENT_DIR] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    if target.distributed:
        # Rank 0 of the job is estimated, in the world the launcher would make (collectives are fake).
        world = str(target.world_size)
        child_env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, GROUP_RANK="0")
        child_env.setdefault("MASTER_ADDR", "127.0.0.1")
        child_env.setdefault("MASTER_PORT", "29500")
    return child_env


def _run_child(child: list[str], target: Target, env: dict[str, str], cwd: str | None, timeout: float | None,
               on_progress: Callable[[str], None] | None) -> tuple[str, int]:
    """Run the child; return (its combined stdout+stderr, exit status). Progress lines arrive on a pipe."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([*child, "--progress-fd", str(write_fd), "--", *target.child_argv()],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        relay = threading.Thread(target=_relay_progress, args=(read_fd, on_progress), daemon=True)
        relay.start()
        started = time.monotonic()
        try:
            with _sigterm_raises():
                returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            relay.join(timeout=5)
            raise TraceError("timeout", f"the trace did not finish within {timeout:.0f} s (stopped after "
                                        f"{time.monotonic() - started:.0f} s); raise the timeout or trace fewer "
                                        "iterations", output=_read_tail(log)) from None
        except BaseException:
            # Interrupted (Ctrl-C, `timeout` around the filter, scancel of an estimation job): the child runs in a
            # session of its own, so it would outlive us and keep a login node's core busy.
            _kill_group(process)
            raise
        relay.join(timeout=5)
        log.seek(0)
        return log.read().decode(errors="replace"), returncode


def _relay_progress(read_fd: int, on_progress: Callable[[str], None] | None) -> None:
    with os.fdopen(read_fd, "r", errors="replace") as lines:
        for line in lines:
            if on_progress is not None:
                on_progress(line.rstrip("\n"))


@contextmanager
def _sigterm_raises():
    """Turn SIGTERM into SystemExit while waiting, so the cleanup above runs (by default SIGTERM ends Python at
    once). Only where it is ours to change: the main thread, and no handler set by the program embedding us."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _read_tail(log: Any) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-OUTPUT_TAIL:]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
