"""Following the traced program into every Python process it starts, whatever starts it: a training script run by
`subprocess.run([sys.executable, ...])`, a CLI that calls `accelerate launch` which starts `python train.py`, a
`python -m torch.distributed.run` in a subprocess. One mechanism, so that no launcher needs a grammar of its own.

The tracer (`xmem.trace.child.main`, the root of the job's processes) hands its settings down in the environment
(`hand_down`), and every Python process of the job runs `boot/sitecustomize.py` at start-up (its directory is
first on PYTHONPATH), which asks `child_argv`. There, a process its launcher made a rank other than 0 (RANK or
LOCAL_RANK) ends at once: the fake process group stands in for it, as for the root's own distributed runs. Any
other process runs its program under the tracer as the root runs its own, in the world its launcher described
(WORLD_SIZE; at least LOCAL_WORLD_SIZE GPUs on the node). A process that reaches the iterations asked writes its
trace to the root's `--out` and ends the root (the sandbox then ends the rest): the job is traced. Any other
outcome worth knowing (a trace that ended early, a failure) is left beside `--out` for the root, which chooses
when it ends (`finish`). Runs in the traced program's processes; imports torch only through the tracer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import xmem.trace.child.guard as guard
from xmem.launchers import python_program
from xmem.trace.wire import FakeGpu, TraceRequest

ENV = "XMEM_TRACE_FOLLOW"  # the root's settings, as JSON, in every process of the job
BOOT_DIR = str(Path(__file__).resolve().parent / "boot")  # first on the job's PYTHONPATH
RANKS = ("RANK", "LOCAL_RANK")  # as torchrun, accelerate and deepspeed number the processes they start


def hand_down(request: TraceRequest) -> None:
    """In the root: the settings every process the program starts is traced with (kept as they are in those)."""
    if ENV in os.environ and json.loads(os.environ[ENV])["root"] != os.getpid():
        return
    fd = request.progress_fd
    progress = f"/proc/{os.getpid()}/fd/{fd}" if fd is not None else None
    os.environ[ENV] = json.dumps({"out": request.out, "iterations": request.iterations,
                                  "gpu": request.gpu.to_json(),
                                  "device_count": request.device_count, "root": os.getpid(), "progress": progress,
                                  "deadline": request.deadline})  # time.monotonic(): the machine's clock, everywhere
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if BOOT_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *filter(None, paths)])
    _leave_for_guard(Path(request.out).parent)


def _leave_for_guard(scratch: Path) -> None:
    """What a process that skipped the start-up hook gets back (`xmem.trace.child.guard`, run by the sandbox's
    wrapper of each interpreter): the tracer's settings, whatever the process's own environment lost."""
    settings = {"boot": BOOT_DIR, "marker": ENV,
                "env": {name: value for name, value in os.environ.items() if name.startswith("XMEM_")}}
    written = scratch / f"{guard.SETTINGS_FILE}.{os.getpid()}.tmp"
    written.write_text(json.dumps(settings))
    os.replace(written, scratch / guard.SETTINGS_FILE)


def child_argv() -> list[str] | None:
    """At the start-up of a Python process of the job (boot/sitecustomize.py): the tracer's arguments that trace its
    program as the root traces its own (the caller hands them to `xmem.trace.child.main`, which ends the process
    through `finish`). None for a process that runs no program of the job (the tracer itself, multiprocessing's
    workers): it is left as it is."""
    settings = os.environ.get(ENV)
    command = program(sys.orig_argv)
    if not settings or command is None or command[:2] == ["-m", "xmem.trace"]:
        return None
    if any(os.environ.get(name, "0") != "0" for name in RANKS):
        os._exit(0)  # a rank the fake process group stands in for: it spends no CPU
    given = json.loads(settings)
    devices = max(given["device_count"], _int(os.environ.get("LOCAL_WORLD_SIZE")))
    return TraceRequest(tuple(command), given["out"], FakeGpu.from_json(given["gpu"]), given["iterations"], devices,
                        given["deadline"] or None,  # the trace's own time limit, the same in every process
                        _root_progress(given["progress"])).argv()


def finish(out: Path, own: dict) -> None:
    """The end of a traced process: the root writes the job's result (unless a process it started wrote a whole
    trace there); a process it started leaves its own for the root, or ends the root with a whole trace."""
    given = json.loads(os.environ[ENV])
    if "error" not in own and own.get("used_cuda"):
        own = {**own, "interpreter": sys.executable}  # the one this process ran on (a launched job's own)
    if given["root"] != os.getpid():
        _finish_started(out, own, given["iterations"], given["root"])
    chosen = choose(own, [json.loads(path.read_text()) for path in _left_beside(out)])
    written = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    written.write_text(json.dumps(chosen))
    try:
        os.link(written, out)
    except FileExistsError:
        pass
    written.unlink()


def _finish_started(out: Path, own: dict, iterations: int, root: int) -> None:
    if _trained(own) and own["iterations"] >= iterations:
        _write(out, own)
        os.kill(root, signal.SIGKILL)  # the job's trace is made: the sandbox ends the rest with the root
    elif "error" in own or own["used_cuda"]:
        _write(out.with_name(f"{out.stem}.{os.getpid()}{out.suffix}"), own)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "error" in own else 0)  # a failure as the program's starter would see it


def choose(own: dict, theirs: list[dict]) -> dict:
    """The job's result from the root's own and those its processes left (in the order they ended): a trace of
    training (the root's first), else one of GPU use (forward passes only); else a failure the fake GPU or the
    tracer caused, or a process that used the GPU without stepping (never blamed on the user); else, when the root
    failed too, most likely because its process did, that process's failure; else the root's own."""
    traces = [payload for payload in (own, *theirs) if "error" not in payload and payload.get("used_cuda")]
    trained = [payload for payload in traces if _trained(payload)]
    ours = [payload for payload in theirs if payload.get("error") not in (None, "user_error")]
    failed = [payload for payload in theirs if "error" in payload] if "error" in own else []
    return (trained or traces or ours or failed or [own])[0]


def _trained(payload: dict) -> bool:
    """A trace of training iterations (not of forward passes alone: an evaluation before the training is not the
    job's estimate)."""
    return "error" not in payload and payload["iterations"] > 0 and not payload.get("forward_only")


def program(argv: list[str]) -> list[str] | None:
    """What a Python command line (`sys.orig_argv`) runs, as the tracer takes it: `[script, *args]`,
    `["-m", module, *args]` or `["-c", code, *args]`. None when it runs no program of the job: standard input or an
    interactive interpreter, `--version`, multiprocessing's own workers and helpers (they run a parent's code)."""
    found = python_program(argv[1:])
    workers = found is not None and found[0] == "-c" and found[1].startswith("from multiprocessing")
    return None if workers else found


def _left_beside(out: Path) -> list[Path]:
    """What the root's processes left beside `out`, in the order they ended."""
    return sorted(out.parent.glob(f"{out.stem}.*{out.suffix}"), key=lambda path: path.stat().st_mtime_ns)


def _write(path: Path, payload: dict) -> None:
    """Whole or not at all: the root may read it at any time."""
    written = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    written.write_text(json.dumps(payload))
    os.replace(written, path)


def _root_progress(path: str | None) -> int | None:
    """The root's progress pipe (a process the program starts does not inherit it); None: none to write to."""
    try:
        return os.open(path, os.O_WRONLY) if path else None
    except OSError:
        return None


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
