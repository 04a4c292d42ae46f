"""The parent side of a trace: `run_trace` starts the tracing child, relays its progress, returns its Trace.

Owns the subprocess: interpreter choice, PYTHONPATH so the child finds xmem from any venv, the environment of one
rank for distributed launchers, the timeout, capture of the program's output, the sandbox it runs in
(`xmem.trace.sandbox`: the limits, the shim cache kept writable, stale scratch directories removed), and turning
the child's error JSON, or how it ended without one (os._exit, a signal, the memory limit), into a TraceError.
With XMEM_WARM_TRACER=1 the same child is asked of the warm tracer (`xmem.trace.warm`) first, and started cold
whenever it does not run it to its end. Does not import torch.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from xmem.gpus import GpuType, find_gpu, load_catalog
from xmem.launchers import Target, gpus_per_node, is_python, launcher_env, named_interpreter, srun_shim
import xmem.trace.bytecode as bytecode
import xmem.trace.privileges as privileges  # -- issue 21
import xmem.trace.sandbox as sandbox
import xmem.trace.shim as shim
import xmem.trace.warm as warm
from xmem.trace.command import console_script_interpreter, is_binary, job_interpreter, parse_command, \
    starts_programs
from xmem.trace.errors import REAL_CUDA_SIGNS, TraceError
from xmem.trace.events import ARCH_SENSITIVE_PROGRESS, Trace
from xmem.trace.wire import (OFFLINE_BY_THE_TRACE_ENV, FakeGpu, Note, NoteKind, TraceRequest, alive, notes_from_json,
                             with_option)
from xmem.trace.child.follow import BOOT_DIR
from xmem.text import one_line
from xmem.units import GIB, gib_words

OUTPUT_TAIL = 4000  # characters of the program's output kept in a TraceError
NO_CUDA_MESSAGE = ("the program ended without using the GPU (torch.cuda.device_count() was {gpus}); its last "
                   "output lines say why")
NO_TORCH_MESSAGE = ("the job's interpreter {interpreter} cannot import torch, so the job would end on 'No module "
                    "named torch' too: activate the job's environment first (source ENV/bin/activate, conda "
                    "activate ENV), or name its interpreter (its path, or --python)")
NO_CUDA_SILENT = "the program ended without using the GPU (torch.cuda.device_count() was {gpus}) and printed nothing"
SCRATCH_PREFIX = "xmem-trace-"  # then the estimating process's pid: stale ones are found by it
MAX_TRACE_SECONDS = 3600  # the CPU-time limit's base when the caller sets no timeout
# The share of the timeout after which the tracer decides a program still short of its first step on what it ran
# (TrainingState.deadline), leaving the rest for the tracer to write its result.
DEADLINE_SHARE = 0.8
LOADING_PROGRESS = "loading fake CUDA"  # the tracer's progress line before the program runs
# The trace has no network (loopback only): libraries are told so, as on an offline compute node, so that they take
# their cached files at once instead of failing a download (huggingface_hub, transformers, datasets), and
# transformers uses its own PyTorch ops instead of fetching kernels from the hub (`kernels`, from 5.25 on a CUDA
# device; its fused rotary embedding holds no more than the PyTorch one does).
OFFLINE_NODE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "USE_HUB_KERNELS": "NO"}
LAUNCH_MODULE = "xmem.trace.child.launch"  # the root of a command that is not Python itself
STOP_GRACE_S = 5  # seconds the sandbox gets to end its processes before its group is killed
# The host memory a trace may hold where its caller names no limit. The site's default ([estimate]
# memory_limit_gib, xmem.config) is the same figure, stated there since config and trace import nothing of each
# other; tests/test_architecture.py holds the two equal.
DEFAULT_MEMORY_LIMIT_BYTES = 8 * GIB
DEFAULT_GPU = "H100-SXM5-80GB"  # the fake GPU of a trace whose caller names none


def run_trace(command: list[str], *, iterations: int = 3, gpu: GpuType | None = None,
              device_count: int | None = None, env: Mapping[str, str] | None = None, cwd: str | None = None,
              timeout: float | None = None, python: str | None = None,
              on_progress: Callable[[str], None] | None = None,
              memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES, warm_tracer: bool = False,
              cancel: threading.Event | None = None) -> Trace:
    """Run `command` (as the user would type it) under fake CUDA for `iterations` optimizer steps.

    Returns the Trace; a program that ends without using CUDA raises TraceError no_cuda (with its output).
    `gpu`: the catalog's type each of the node's fake GPUs is (its name, memory, capability, SMs, ...: `fake_gpu`;
    default DEFAULT_GPU); `device_count`: the GPUs of the job's node (default: `command.gpus_per_node`). Raises
    TraceError (one of errors.KINDS). `env`: the program's environment (default: this one). The program runs in
    `xmem.trace.sandbox`: its writes never reach
    the user's files, nothing it starts outlives it, and the tracer may hold at most `memory_limit_bytes` of host
    memory (0: no limit). The program runs on `python`, else on the interpreter the command names by its path
    (`launchers.named_interpreter`) or its console script's shebang names, else on the one the job's own PATH gives
    (`command.job_interpreter`: never this process's by default). `warm_tracer`: the
    site's choice of the warm tracer (`xmem.trace.warm.enabled`). Setting `cancel` (from another thread) stops the
    trace: TraceCancelled.
    """
    privileges.refuse_as_root(list(command), cwd)  # -- issue 21: root never starts another user's program
    job_env = os.environ if env is None else env
    if starts_programs(list(command), cwd, job_env):  # -- issue 31: run as the job runs it, every Python traced
        target, module, program = Target(command[0], None, tuple(command[1:])), LAUNCH_MODULE, list(command)
        interpreter, shim_python = sys.executable, _launched_python(python, job_env)  # the root only starts it
        warm_tracer = False  # the warm tracer serves `xmem.trace` only
    else:
        target = parse_command(list(command), cwd)
        interpreter = shim_python = _job_python(list(command), target, python, job_env, cwd)
        module, program = "xmem.trace", target.child_argv()
    gpus = gpus_per_node(target, job_env, device_count)
    remove_stale_scratch()
    if shim_python:
        shim.prepare(shim_python)  # -- issue 21: built outside the sandbox, where its cache is read-only
    compiled = _bytecode_cache()  # -- issue 31: the libraries' bytecode, kept from one trace to the next
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        out = Path(scratch) / "trace.json"
        helper = sandbox.helper_command(sys.executable, Path(scratch), memory_limit_bytes,
                                        _cpu_seconds(timeout), [*_shim_dirs(), *_warm_bytecode_dirs()],
                                        interpreter_binaries([interpreter, shim_python or ""], job_env),
                                        shared=[str(compiled)] if compiled else [])
        request = TraceRequest(tuple(program), str(out), fake_gpu(gpu), iterations, gpus,
                               time.monotonic() + DEADLINE_SHARE * (timeout or MAX_TRACE_SECONDS),
                               progress_fd=-1)  # the descriptor: set when started
        child_env = _with_srun_shim(_child_env(env, target, gpus), Path(scratch))
        if compiled:
            child_env[bytecode.ENV] = str(compiled)
        argv = [*helper, interpreter, "-m", module, *request.argv()]
        warm_run = _run_warm(argv, request.gpu, interpreter, child_env, cwd, timeout, on_progress, Path(scratch),
                             cancel) \
            if warm.enabled(warm_tracer) else None
        run = warm_run or _run_child(_cold_start(argv, child_env, cwd), timeout, on_progress, cancel)
        ended = sandbox.read_result(Path(scratch))
        payload = sandbox.read_json_file(out)  # -- issue 35: root's tracer may add links or FIFOs to its scratch
    if payload is None and "refused" in ended:  # -- issue 35: root's trace identity cannot read a file it needs
        raise privileges.RootTraceRefused(ended["refused"])
    if payload is None and "status" not in ended:  # the sandbox itself failed, or was killed
        reason = ended.get("failed") or f"the sandbox ended (status {run.returncode}): {_last_line(run.output)}"
        raise TraceError("internal", reason, output=run.output[-OUTPUT_TAIL:])
    if payload is None:
        raise _no_result(ended["status"], run, memory_limit_bytes)
    if "error" in payload:
        raise _classified(TraceError(payload["error"], payload["message"], payload.get("traceback", ""),
                                     output=run.output[-OUTPUT_TAIL:]), memory_limit_bytes)
    trace = Trace.from_json(payload)
    trace.warnings = notes_from_json(payload, trace.warnings)
    if not trace.used_cuda:  # a 0-byte answer would send a GPU job out with no memory to spare
        said = NO_CUDA_MESSAGE if run.output.strip() else NO_CUDA_SILENT  # no lines to point at: say so
        raise TraceError("no_cuda", said.format(gpus=gpus), output=run.output[-OUTPUT_TAIL:])
    trace.sandbox = ended.get("protection", "unknown")
    trace.interpreter = trace.interpreter or interpreter
    if not trace.sandbox.startswith("namespaces"):  # a weaker protection: say so where people look
        trace.warnings.append(Note(NoteKind.FILES_PROTECTED,
                                   f"the program's files were protected by the {trace.sandbox}"))
    return trace


def fake_gpu(gpu: GpuType | None = None) -> FakeGpu:
    """What the traced program is shown of `gpu` (default: the shipped catalog's DEFAULT_GPU), as the request
    carries it."""
    gpu = gpu or find_gpu(DEFAULT_GPU, load_catalog(calibration_path=None))
    return FakeGpu(name=gpu.device_name, total_bytes=gpu.total_bytes, capability=gpu.capability,
                   multi_processor_count=gpu.multi_processor_count, l2_cache_bytes=gpu.l2_cache_bytes,
                   max_threads_per_multi_processor=gpu.max_threads_per_multi_processor,
                   shared_memory_per_block_optin=gpu.shared_memory_per_block_optin,
                   registers_per_block=gpu.registers_per_block)


def _job_python(command: list[str], target: Target, python: str | None, env: Mapping[str, str],
                cwd: str | None) -> str:
    """The interpreter a Python command runs on (see run_trace), checked: root's alone when root traces, and able
    to import torch (else the job would end on its first `import torch`: TraceError user_error, saying so)."""
    wanted = python or named_interpreter(command, cwd) or console_script_interpreter(target) or \
        job_interpreter(command, target, env, cwd)
    interpreter = shutil.which(wanted, path=env.get("PATH", os.defpath))
    if interpreter is None:
        raise TraceError("not_found", f"Python interpreter {wanted} not found: give the job's python")
    privileges.refuse_foreign_code(interpreter, env)  # -- issue 35: nor another user's interpreter or modules
    if not shim.job_finds_torch(interpreter, env):
        raise TraceError("user_error", NO_TORCH_MESSAGE.format(interpreter=interpreter))
    return interpreter


def interpreter_binaries(named: list[str], env: Mapping[str, str]) -> list[str]:
    """The interpreter binaries the job can start (their real paths, once each): those `named`, and every
    `python*` on the job's PATH (an activated venv's links lead to its base interpreter's binary). Shell shims
    (pyenv's) are not binaries; the binary they run is among these when it is the job's."""
    found = [*named]
    for directory in env.get("PATH", "").split(os.pathsep):
        try:
            found += [os.path.join(directory, name) for name in os.listdir(directory or ".") if is_python(name)]
        except OSError:
            continue
    real = dict.fromkeys(os.path.realpath(path) for path in found if path)
    return [path for path in real if os.path.isfile(path) and is_binary(path)]


def _with_srun_shim(env: dict[str, str], scratch: Path) -> dict[str, str]:
    """`srun` inside the job (a batch script run whole, a wrapper) is `launchers.srun_shim`, first on the job's PATH:
    the real one would ask the controller for a step the trace has no allocation for."""
    shims = scratch / "bin"
    shims.mkdir(mode=0o700)
    srun = shims / "srun"
    srun.write_text(srun_shim())
    srun.chmod(0o700)
    return {**env, "PATH": os.pathsep.join([str(shims), env.get("PATH", os.defpath)])}


def _launched_python(python: str | None, env: Mapping[str, str]) -> str | None:
    """The python a launched command most likely runs (`python`, else the job's PATH's python3), whose torch's shim
    is built before the sandbox; None when there is none (the trace builds a private shim if it needs one)."""
    try:
        return python or job_interpreter(["python3"], Target(None, None, ()), env, None)
    except TraceError:
        return None


def remove_stale_scratch(min_age_s: float = 60.0) -> None:
    """Remove this user's scratch directories whose estimating process is gone (killed before it could clean up).

    The name carries the owner's pid; one younger than `min_age_s` is left alone (its pid may not be running yet
    in a reused-pid race), as is anything that is not ours."""
    now = time.time()
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        try:
            info = path.lstat()
            owner = int(path.name[len(SCRATCH_PREFIX):].split("-", 1)[0])
        except (OSError, ValueError):
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or now - info.st_mtime < min_age_s:
            continue
        if not alive(owner):
            shutil.rmtree(path, ignore_errors=True)


def _cpu_seconds(timeout: float | None) -> int:
    """The tracer's hard CPU-time limit: what the wall-clock timeout allows on every core, so that a tracer whose
    caller vanished still stops."""
    wall = timeout if timeout else MAX_TRACE_SECONDS
    return int(wall * (os.cpu_count() or 1)) + 60


def _shim_dirs() -> list[str]:
    """Where the native shim is cached: read-only inside the sandbox (the warm tracer loads it outside)."""
    cache = shim.cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    return [str(cache), str(shim.temporary_cache_dir())]


def _bytecode_cache(warm: bool = False) -> Path | None:
    """This user's bytecode cache of traces (`warm`: the warm tracer's server's, `xmem.trace.bytecode`: where it
    lives is the estimator's setting, never the job's), pruned to its bound; None where there is none (root)."""
    cache = bytecode.directory(os.environ, warm=warm)
    if cache is not None:
        bytecode.prune_now_and_then(cache)
    return cache


def _warm_bytecode_dirs() -> list[str]:
    """The warm tracer's server's bytecode cache: read-only inside the sandbox (the server runs outside it)."""
    cache = _bytecode_cache(warm=True)
    return [str(cache)] if cache else []


def _child_env(env: Mapping[str, str] | None, target: Target, gpus: int) -> dict[str, str]:
    """The job's environment as its launcher makes it for rank 0 (collectives are fake), on a node of `gpus`."""
    child_env = launcher_env(target, os.environ if env is None else env, gpus)
    paths = [BOOT_DIR] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    if "HF_HUB_OFFLINE" not in child_env:  # -- issue 31: a download that fails then is ours, not the program's
        child_env[OFFLINE_BY_THE_TRACE_ENV] = "1"
    for name, value in OFFLINE_NODE.items():  # -- issue 31: the job's own setting, where it has one, stays
        child_env.setdefault(name, value)
    child_env[shim.DIR_ENV] = str(shim.cache_dir())  # -- issue 21: ours, never the job's (it could name /dev/shm)
    return child_env


@dataclass
class ChildRun:
    output: str  # the program's stdout+stderr
    returncode: int  # the sandbox helper's
    last_progress: str = ""  # the tracer's last progress line ("iteration 2/3")
    # What tells a SIGKILL's cause (_no_result): out-of-memory kills the kernel counted on this node while the child
    # ran (None: unknown), and the CPU seconds the child's processes used (None: run by the warm tracer, whose
    # processes are not ours to count) against the tracer's CPU-time limit.
    oom_kills: int | None = None
    cpu_seconds: float | None = None
    cpu_limit_seconds: int = 0


class Started(Protocol):
    """A started sandbox helper: a Popen (cold), or a warm.WarmJob whose wait says None when its server vanished."""

    def wait(self, timeout: float | None = None) -> int | None: ...


# Starts the child with its output going to the file and its progress lines to the descriptor; None: not started.
Start = Callable[[Any, int], "Started | None"]


def _cold_start(argv: list[str], env: dict[str, str], cwd: str | None) -> Start:
    def start(log: Any, progress_fd: int) -> subprocess.Popen:
        command = with_option(argv, "--progress-fd", str(progress_fd))
        # -- issue 21: the helper starts clean; the program's environment is applied inside, to the tracer
        sandbox.write_program_env(Path(argv[argv.index("--scratch") + 1]), env)
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=sandbox.HELPER_ENV, cwd=cwd, pass_fds=(progress_fd,), start_new_session=True)
    return start


def _run_warm(argv: list[str], gpu: FakeGpu, interpreter: str, env: dict[str, str], cwd: str | None,
              timeout: float | None, on_progress: Callable[[str], None] | None, scratch: Path,
              cancel: threading.Event | None = None) -> ChildRun | None:
    """The child run by the warm tracer (`xmem.trace.warm`), when it can serve this job; None: go cold (and, where
    no server answers, one is started in the background for the next estimates)."""
    path = warm.socket_path(interpreter, env)
    if path is None:
        return None
    connection = warm.connect(path)
    if connection is None:
        warm.start_server(interpreter, path, warm.server_env(env, BOOT_DIR, bytecode.directory(os.environ, warm=True)),
                          after=scratch)
        return None

    # -- issue 32: the warm job writes into a scratch of its own, handed over only when it ran to its end: a job the
    # server still runs after we gave up on it (a late reply from a busy server, a dying handler) made the cold
    # run's sandbox folders first (`[Errno 17] File exists`) and merged its result into the cold one's.
    own = Path(tempfile.mkdtemp(prefix=f"{scratch.name}-warm-", dir=scratch.parent))
    request = warm.job_request(_in_scratch(argv, scratch, own), env, cwd, gpu)

    def start(log: Any, progress_fd: int) -> warm.WarmJob | None:
        return warm.WarmJob.submit(connection, request, [log.fileno(), progress_fd])

    try:
        run = _run_child(start, timeout, on_progress, cancel)
        if run is None:  # declined, or the server died mid-way: the cold child starts in the untouched scratch
            connection.close()
        else:
            for entry in own.iterdir():
                os.replace(entry, scratch / entry.name)
    finally:
        shutil.rmtree(own, ignore_errors=True)  # what a job still dying writes later: remove_stale_scratch's
    return run


def _in_scratch(argv: list[str], scratch: Path, own: Path) -> list[str]:
    """The helper's and tracer's options (before the program's `--`) with paths under `scratch` moved to `own`."""
    end = argv.index("--", argv.index("--") + 1)  # the helper's options end at the first, the tracer's here
    moved = [str(own) + arg[len(str(scratch)):] if arg == str(scratch) or arg.startswith(f"{scratch}{os.sep}")
             else arg for arg in argv[:end]]
    return moved + argv[end:]


def _run_child(start: Start, timeout: float | None, on_progress: Callable[[str], None] | None,
               cancel: threading.Event | None = None) -> ChildRun | None:
    """Run the child; return its output and status (None when the warm tracer did not run it to its end).
    Progress lines arrive on a pipe."""
    read_fd, write_fd = os.pipe()
    seen: list[str] = []

    def progress(line: str) -> None:
        if line != ARCH_SENSITIVE_PROGRESS:  # a signal to the estimate, not a stage an error could name
            seen[:] = [line]
        if on_progress is not None:
            on_progress(line)

    kills, cpu = _oom_kills(), _children_cpu_seconds()
    with tempfile.TemporaryFile() as log:
        try:
            process = start(log, write_fd)
        finally:
            os.close(write_fd)
        if process is None:
            os.close(read_fd)
            return None
        relay = threading.Thread(target=_relay_progress, args=(read_fd, progress), daemon=True)
        relay.start()
        started = time.monotonic()
        try:
            with sigterm_raises():
                returncode = _wait(process, timeout, cancel)
        except subprocess.TimeoutExpired:
            _stop(process)
            relay.join(timeout=1)
            raise TraceError("timeout", f"the trace did not finish within {timeout:.0f} s (stopped after "
                                        f"{time.monotonic() - started:.0f} s); raise the timeout or trace fewer "
                                        "iterations", output=_read_tail(log)) from None
        except BaseException:
            # Interrupted (Ctrl-C, `timeout` around the filter, scancel of an estimation job): the child runs in a
            # session of its own, so it would outlive us and keep a login node's core busy.
            _stop(process)
            raise
        relay.join(timeout=1)  # the sandbox has ended every process that could hold the pipe open
        if returncode is None:
            return None
        log.seek(0)
        after = _oom_kills()
        return ChildRun(log.read().decode(errors="replace"), returncode, seen[0] if seen else "",
                        oom_kills=None if kills is None or after is None else after - kills,
                        cpu_seconds=_children_cpu_seconds() - cpu if isinstance(process, subprocess.Popen) else None,
                        cpu_limit_seconds=_cpu_seconds(timeout))


def _oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills on this node, the cgroups' included (`oom_kill` in /proc/vmstat,
    Linux 4.13+, readable by everyone); None where it cannot be read."""
    try:
        with open("/proc/vmstat") as f:
            counters = dict(line.split(None, 1) for line in f if " " in line)
        return int(counters["oom_kill"])
    except (OSError, KeyError, ValueError):
        return None


def _children_cpu_seconds() -> float:
    """CPU time of this process's children that have ended, theirs included: the sandbox helper waits for the tracer,
    so a cold trace's whole CPU time is counted here once the helper is reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class TraceCancelled(Exception):
    """The trace was stopped because its caller set `cancel` (its result was no longer needed)."""


CANCEL_POLL_S = 0.1  # how often a cancellable trace looks at its `cancel`


def _wait(process: Started, timeout: float | None, cancel: threading.Event | None) -> int | None:
    """`process.wait(timeout)`, raising TraceCancelled as soon as `cancel` is set."""
    if cancel is None:
        return process.wait(timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return process.wait(timeout=CANCEL_POLL_S if left is None else min(CANCEL_POLL_S, left))
        except subprocess.TimeoutExpired:
            if cancel.is_set():
                raise TraceCancelled() from None
            if left is not None and left <= CANCEL_POLL_S:
                raise


def _relay_progress(read_fd: int, on_progress: Callable[[str], None] | None) -> None:
    with os.fdopen(read_fd, "r", errors="replace") as lines:
        for line in lines:
            if on_progress is not None:
                on_progress(line.rstrip("\n"))


@contextmanager
def sigterm_raises():
    """Turn SIGTERM into SystemExit while waiting on a trace, so that its cleanup runs (by default SIGTERM ends
    Python at once). Only where it is ours to change: the main thread, and no handler set by the program embedding
    us."""
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


def _stop(process: Started) -> None:
    """Ask the sandbox helper to end everything it runs (SIGTERM), then kill its process group outright."""
    if isinstance(process, warm.WarmJob):
        process.stop()
        return
    try:
        process.terminate()
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _no_result(status: dict, run: ChildRun, memory_limit_bytes: int) -> TraceError:
    """The tracer ended without writing a result: say what happened to it, in the program's terms."""
    output = run.output[-OUTPUT_TAIL:]
    when = f"before the trace ended (last progress: {run.last_progress})" if run.last_progress else \
        "before the trace ended"
    if "signal" not in status:
        code = status["exit"]
        if run.last_progress in ("", LOADING_PROGRESS):  # the program never started: our failure
            return TraceError("internal", f"the tracer ended (status {code}) before running the program: "
                                          f"{_last_line(run.output)}", output=output)
        real_cuda = [line for line in run.output.splitlines() if any(sign in line for sign in REAL_CUDA_SIGNS)]
        if real_cuda:  # a native extension called the CUDA runtime itself (no device here) and ended the process
            return TraceError("not_modelled", f"not modelled: a native library reached the real CUDA runtime and "
                                              f"ended the program {when}: {one_line(real_cuda[-1], 200)}",
                              output=output)
        return TraceError("user_error", f"the program called os._exit({code}) {when}; xmem records a program that "
                                        "returns or calls sys.exit()", output=output)
    number = status["signal"]
    name = _signal_name(number)
    if "resident" in status:  # the sandbox ended it at the host-memory limit: no guess needed
        return TraceError("memory_limit", f"the program needed more host memory than the trace may use "
                                          f"({gib_words(memory_limit_bytes)}: estimate.memory_limit_gib in the site "
                                          f"config): it held {gib_words(status['resident'])} {when}", output=output)
    # RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard one (at once where the two are equal, as a
    # program may set them); the out-of-memory killer sends SIGKILL too, and the kernel counts each of its kills.
    if number == signal.SIGXCPU or number == signal.SIGKILL and _cpu_limit_reached(run):
        return TraceError("timeout", f"the trace used up its CPU-time limit {when}", output=output)
    if _out_of_memory(run.output) or number == signal.SIGKILL and run.oom_kills != 0:
        limit = f"; the trace's own limit is {gib_words(memory_limit_bytes)}" if memory_limit_bytes else ""
        return TraceError("memory_limit", f"the tracer was killed by signal {number} ({name}) {when}, most likely "
                                          f"for host memory (the node's out-of-memory killer{limit}: "
                                          "estimate.memory_limit_gib in the site config)", output=output)
    if number in FAULTS:
        return TraceError("not_modelled", f"not modelled: the traced program crashed on signal {number} ({name}) "
                                          f"{when}{_fault_site(run.output)}, in native code running under the fake "
                                          "GPU: a gap of xmem's, not the program's error", output=output)
    if number == signal.SIGKILL:
        return TraceError("crashed", f"the program was killed by signal {number} ({name}) {when}, not for host "
                                     "memory (the kernel counted no out-of-memory kill meanwhile): by a CPU-time "
                                     f"limit it set itself, or by another process: {_last_line(run.output)}",
                          output=output)
    return TraceError("crashed", f"the program was killed by signal {number} ({name}) {when}: "
                                 f"{_last_line(run.output)}", output=output)


def _cpu_limit_reached(run: ChildRun) -> bool:
    return run.cpu_seconds is not None and run.cpu_limit_seconds > 0 and run.cpu_seconds >= run.cpu_limit_seconds


def _classified(error: TraceError, memory_limit_bytes: int) -> TraceError:
    """A user error that is the host-memory limit (MemoryError, a C++ bad_alloc, torch's CPU allocator) says so."""
    if error.kind != "user_error" or not memory_limit_bytes or not _out_of_memory(error.message):
        return error
    return TraceError("memory_limit", f"the program needed more host memory than the trace may use "
                                      f"({gib_words(memory_limit_bytes)}: estimate.memory_limit_gib in the site "
                                      "config): "
                                      f"{error.message}", error.user_traceback, error.output)


def _out_of_memory(text: str) -> bool:
    return any(sign in text for sign in ("MemoryError", "std::bad_alloc", "can't allocate memory"))


# What a process's own native code dies of when it faults. Under the fake GPU that is native code given what only a
# real GPU holds (a GPU tensor's data: there is none), or a fault of the tracer's own: ours to name (exit 11), where
# an outside signal (SIGTERM, SIGINT) or the program's own abort() reads as "crashed".
FAULTS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
# A frame of the Python stack that the tracing child's faulthandler writes on such a crash (most recent first).
FAULT_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+)', re.MULTILINE)
NOT_THE_PROGRAMS = ("site-packages", "dist-packages", f"{os.sep}lib{os.sep}python3", f"{os.sep}xmem{os.sep}trace",
                    "<frozen")


def _fault_site(output: str) -> str:
    """" (at train.py:12)": the innermost frame of the program's own files in the Python stack the crash dumped
    (the last one dumped); "" where none was."""
    dumped = output[output.rfind("Fatal Python error"):] if "Fatal Python error" in output else ""
    for frame in FAULT_FRAME.finditer(dumped):
        if not any(part in frame["path"] for part in NOT_THE_PROGRAMS):
            return f" (at {os.path.basename(frame['path'])}:{frame['line']})"
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"



def _read_tail(log: Any) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-OUTPUT_TAIL:]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
