"""The tracing child process: `python -m xmem.trace --out FILE [options] -- COMMAND...`.

Owns the life of one traced run: load the native shim, import torch, install the fake-CUDA world, run the user's
unmodified program (a script path or `-m module`, as `xmem.trace.command` prepared it) under FakeTensorMode with the
recorder above it, stop after N iterations, and write the Trace JSON or an error JSON
`{"error": kind, "message": ..., "traceback": ...}` to FILE. Each Python process the program starts runs the same
life (`xmem.trace.child.follow`), and what it made may be the job's result. The program's stdout/stderr stay its own
(the parent captures them); progress lines go to `--progress-fd`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import CodeType
from typing import Any, Callable, Collection, Iterator, Mapping, NoReturn

from xmem.trace.wire import FakeGpu, Note, NoteKind, TraceRequest, notes_json

XMEM_DIR = str(Path(__file__).resolve().parents[2])  # the xmem package directory


class ChildFailure(Exception):
    """Ends the child with an error JSON instead of a trace."""

    def __init__(self, kind: str, message: str, user_traceback: str = "") -> None:
        super().__init__(message)
        self.kind, self.message, self.user_traceback = kind, message, user_traceback


def _pipeline_note():
    """The pipeline schedule the program ran, where it ran one (xmem.trace.child.pipelining)."""
    if "xmem.trace.child.pipelining" not in sys.modules:
        return None
    return sys.modules["xmem.trace.child.pipelining"].note()


def _rank_note() -> tuple[int, list[str]]:
    """The world size and where the program tested its rank (xmem.trace.child.rank_reads), where it ran distributed."""
    if "xmem.trace.child.rank_reads" not in sys.modules:
        return 1, []
    rank_reads = sys.modules["xmem.trace.child.rank_reads"]
    return rank_reads.world_size(), rank_reads.tested_at()


def main(argv: list[str] | None = None) -> NoReturn:
    request = TraceRequest.from_argv(sys.argv[1:] if argv is None else argv)
    import xmem.trace.child.follow as follow  # the processes the program starts are traced too
    follow.hand_down(request)
    progress = _progress_writer(request.progress_fd)
    try:
        result = trace_program(list(request.command), request.iterations, request.gpu, request.device_count,
                               progress, request.deadline)
        payload = {**result.to_json(), "notes": notes_json(result.warnings)}
    except ChildFailure as failure:
        payload = {"error": failure.kind, "message": failure.message, "traceback": failure.user_traceback}
    except BaseException as error:  # our own bug: say so, with our traceback
        payload = {"error": "internal", "message": f"{type(error).__name__}: {_first_line(error)}",
                   "traceback": traceback.format_exc()}
    follow.finish(Path(request.out), payload)  # or what a process the program started made
    sys.stdout.flush()
    sys.stderr.flush()
    # The program may have left non-daemon threads or atexit work behind; the trace is written, so leave now.
    os._exit(0)


def trace_program(command: list[str], iterations: int, gpu: FakeGpu, device_count: int,
                  progress: Callable[[str], None], deadline: float | None = None):
    """Run the program under fake CUDA, on `device_count` of `gpu`, and return its Trace; raise ChildFailure for the
    error contract. `deadline` (time.monotonic()): the trace's own time limit for a program short of its first step."""
    _dump_stack_on_faults()
    capability = gpu.capability
    os.environ["XMEM_FAKE_SM"] = f"{capability[0]}{capability[1]}"  # the native shim's, in this process only
    os.environ["XMEM_FAKE_DEVICE_COUNT"] = str(device_count)
    progress("loading fake CUDA")
    preload()
    _quiet_fake_mode_raises()
    import xmem.trace.child.fakecuda as fakecuda
    import xmem.trace.child.shortcuts as shortcuts
    from xmem.trace.child.recorder import AllocationRecorder, NoStepInTime, StopTracing, TrainingState

    fake = fakecuda.FakeCuda(gpu, device_count)
    fakecuda.install(fake)
    from xmem.trace.child.facts import FactCollector
    state = TrainingState(iterations, progress, fake.optimizers, deadline)
    modules = ModulePaths()
    recorder = AllocationRecorder(fake, state, modules.innermost)
    facts = FactCollector(lambda: len(recorder.rows))  # each fact points at the number of events so far
    facts.install()  # before the state's hooks: its post-step hook raises StopTracing at the last step
    state.install()
    recorder.stand_ins.on_stand_in = facts.on_stand_in
    recorder.stand_ins.install_python_protocols()
    os.environ.setdefault("WANDB_MODE", "disabled")  # a trace logs no run to wandb
    progress("running the program")
    started = time.monotonic()
    outcome: BaseException | None = None
    fake_mode = None
    try:
        with shortcuts.fake_mode(allow_non_fake_inputs=True) as fake_mode, recorder, modules:
            _enter_in_new_threads(fake_mode, recorder)
            import xmem.trace.child.weights as weights
            weights.install(lambda: fake_mode)  # checkpoint tensors bound for the GPU: fake, from metadata only
            _run_user_program(command)
    except StopTracing:
        pass
    except NoStepInTime:
        raise ChildFailure("no_optimizer_step", f"the program created an optimizer but had not stepped it when the "
                                                f"trace's time limit came ({state.forward_passes} forward passes on "
                                                "the GPU before it): raise the timeout") from None
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            outcome = exit_
    except BaseException as error:
        outcome = error
    seconds = time.monotonic() - started
    if outcome is not None and not state.stopped:
        raise _failure_from(outcome, recorder.stand_ins.asked_in, recorder.stand_ins.sized_in)
    trace = recorder.to_trace(capability, seconds)
    trace.facts = facts.result()
    trace.pipeline = _pipeline_note()
    trace.world_size, trace.rank_tests = _rank_note()
    trace.quick_key_misses = shortcuts.quick_key_misses(fake_mode)
    if trace.used_cuda and trace.iterations == 0:
        _without_training(trace, state, len(fake.optimizers))
    return trace


def _dump_stack_on_faults() -> None:
    """A fault in native code (SIGSEGV, SIGBUS, SIGILL, SIGFPE) dumps the Python stack onto the program's output,
    where the runner names the program's line that reached it (runner._fault_site); the process still dies of its
    signal. The program's own abort() stays as it was, with no dump (faulthandler takes SIGABRT too)."""
    faulthandler.enable()
    if threading.current_thread() is threading.main_thread():  # where Python may set a signal's handler
        signal.signal(signal.SIGABRT, signal.SIG_DFL)


def _without_training(trace: Any, state: Any, optimizers: int) -> None:
    """A trace with no training iteration is the peak of what the program ran (evaluation, batch inference,
    embedding extraction), said as such; one whose program made an optimizer it never stepped is suspect too."""
    trace.forward_only, trace.forward_passes, trace.unstepped_optimizers = True, state.forward_passes, optimizers
    trace.peak_rising = state.peak_rising
    how = "the trace's time limit, the peak still rising" if state.peak_rising else \
        "the trace's limit for a program without an optimizer" if state.forward_only else "the program's end"
    what = "a backward pass but no optimizer step" if state.trained else "no backward pass or optimizer step"
    trace.warnings.append(Note(NoteKind.FORWARD_ONLY, f"traced forward passes only ({state.forward_passes} on the "
                                                      f"GPU, {what}, up to {how}): the estimate is the peak of what "
                                                      "the program ran", state.forward_passes, what, how))


_preloaded = False  # the shim and torch are loaded in this process (the warm tracer forks after loading them)


def preload() -> None:
    """Load the shim, then torch and the tracer's modules, once per process. Nothing here may depend on the job:
    the warm tracer's server (xmem.trace.child.warm_server) calls it before forking one child per job (the shim reads $XMEM_FAKE_SM and
    $XMEM_FAKE_DEVICE_COUNT at its first use, not at load)."""
    global _preloaded
    if _preloaded:
        return
    import xmem.trace.shim as shim
    if importlib.util.find_spec("torch") is None:  # the job would end on `import torch` too: the user's, not ours
        raise ChildFailure("user_error", f"the job's interpreter {sys.executable} cannot import torch: activate the "
                                         "job's environment first, or name its interpreter (its path, or --python)")
    try:
        shim.load_shim()
    except shim.ShimError as error:
        raise ChildFailure("internal", str(error)) from None
    with loading_for_good():
        import torch._subclasses.fake_tensor  # noqa: F401 - the first import of torch: after the shim
        import torch._dynamo  # noqa: F401 - FakeTensorMode() imports it (its config), and so an optimizer's step

        import xmem.trace.child.facts  # noqa: F401
        import xmem.trace.child.fakecuda  # noqa: F401
        import xmem.trace.child.recorder  # noqa: F401
        import xmem.trace.child.weights  # noqa: F401
    _preloaded = True


@contextlib.contextmanager
def loading_for_good() -> Iterator[None]:
    """Imports that live as long as the process (torch, the tracer; the warm tracer's libraries), before any program
    runs: they make about a million objects and little garbage, so the cyclic collector is off meanwhile (in a cold
    trace of a small MLP it took 0.5 s of 5 walking them), and they are frozen after (upstream gc.freeze: out of every
    later collection, which then walks only the program's own objects; what a program frees, and when, is its own)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


def _enter_in_new_threads(*modes: Any) -> None:
    """Dispatch modes are per thread: every thread the program starts (a ThreadPoolExecutor copying weights to cuda,
    a data-loading thread) runs under the trace's modes too, so its cuda tensors are fake and recorded."""
    start_thread = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_under_modes(thread: threading.Thread) -> None:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            start_thread(thread)

    threading.Thread._bootstrap_inner = bootstrap_under_modes  # type: ignore[attr-defined]


class ModulePaths:
    """The path of the innermost module running forward ("GPT2LMHeadModel.transformer.h.0.attn"), from two global
    forward hooks. torch's ModTracker also follows backward, but hooks every module call's inputs and outputs in
    autograd to do it, which cost about 15 % of a transformer trace; backward events carry the phase, not a module.
    """

    def __init__(self) -> None:
        import weakref
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.stack: list[str] = []
        self.handles: list = []

    def __enter__(self) -> "ModulePaths":
        from torch.nn.modules import module
        self.handles = [module.register_module_forward_pre_hook(self._enter),
                        module.register_module_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _enter(self, module: object, args: object) -> None:
        name = self.names.get(module)
        if name is None:  # a root seen for the first time: name its whole tree, as ModTracker does
            root = type(module).__name__
            for path, sub in module.named_modules():  # type: ignore[attr-defined]
                self.names.setdefault(sub, f"{root}.{path}" if path else root)
            name = self.names[module]
        self.stack.append(name)

    def _leave(self, module: object, args: object, output: object) -> None:
        if self.stack:
            self.stack.pop()

    def innermost(self) -> str:
        return self.stack[-1] if self.stack else ""

def _quiet_fake_mode_raises() -> None:
    """torch's fake mode logs, with torch's frames (about 25 lines on the program's stderr), an exception it raises
    on: a meta kernel's check (a shape mismatch), a TypeError. The exception itself goes on to the program, and the
    failure is told from it (its one line, the program's own traceback): the log only pushed the program's last
    output lines out of what a failed estimate shows. Its other records pass."""
    import logging
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(lambda record: record.exc_info is None)


def _run_user_program(command: list[str]) -> None:
    if command[0] == "-m":
        module = command[1]
        sys.argv = [module, *command[2:]]
        sys.path.insert(0, os.getcwd())
        import importlib.util
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ChildFailure("not_found", f"no module named {module} (from {os.getcwd()})")
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif command[0] == "-c":  # a process the program started (xmem.trace.child.follow): the runner refuses `python -c`
        sys.argv = ["-c", *command[2:]]
        sys.path.insert(0, "")
        exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        script = command[0]
        sys.argv = [script, *command[1:]]
        sys.path.insert(0, script if os.path.isdir(script) else os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


def _failure_from(error: BaseException, stand_in_askers: Collection[CodeType] = (),
                  stand_in_sizes: Mapping[CodeType, str] | None = None) -> ChildFailure:
    """User code raised (or exited non-zero): whose fault it is (xmem.trace.child.attribution), the one-line message and
    the user's own frames (a non-zero exit while handling an exception is that exception's)."""
    if isinstance(error, ChildFailure):
        return error
    from xmem.trace.child.attribution import attribute
    found = attribute(error, stand_in_askers, stand_in_sizes)
    return ChildFailure(found.kind, found.message, found.user_traceback)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def _progress_writer(fd: int | None) -> Callable[[str], None]:
    if fd is None:
        return lambda message: None
    stream = os.fdopen(fd, "w", buffering=1)

    def write(message: str) -> None:
        try:
            stream.write(message + "\n")
        except OSError:  # the parent stopped listening; progress is optional
            pass
    return write
