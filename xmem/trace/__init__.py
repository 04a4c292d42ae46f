"""Running a user's unmodified PyTorch training program under fake CUDA and recording its GPU memory events.

Public API: `run_trace(command, ...) -> Trace` and `TraceError`. The work happens in a fresh child process
(`python -m xmem.trace`), because the fake-CUDA shim must be loaded before torch and patches torch for good.
Importing this package does not import torch.

How a trace works: **only what the GPU would hold is fake.** The child enters torch's FakeTensorMode and, above it,
the recorder (a TorchDispatchMode that sees every ATen op). An op whose inputs are all real host tensors and that
asks for no cuda device runs for real, below the fake mode, at real speed with real values (data loading,
samplers, metrics, a model whose shape is computed from CPU tensors, a CPU loop that stops on a real loss). An op
that touches a fake tensor or makes one on cuda goes to the fake mode: its outputs carry shapes and dtypes but no
data, and each new cuda storage is recorded as an allocation, its death as a free. Both modes are entered in every
thread the program starts (dispatch modes are per thread). Model tensors built on the host stay real up to 64 MiB
and are born fake past it, so a 7B model built on the CPU costs no host memory. Values Python takes out of a cuda
tensor get stand-ins (`standins.py`), each kind warned once.

Two sides, two folders. This package is the estimator's side: `runner` (the child process, its sandbox and
limits), `sandbox`, `warm` (the client of the pre-loaded tracer, whose server is `child.warm_server`), `shim`
(building the native part), `command` (the command's program, read by `xmem.launchers`), `privileges`; `events`
(the Trace record), `errors` and `wire` (everything else that crosses: the request with its fake GPU, the notes,
the warm tracer's frames) are what both sides share. `xmem.trace.child` is what runs inside the traced program (see its docstring).
"""

from typing import Any

from xmem.trace.errors import TraceError
from xmem.trace.events import MemEvent, Trace


def __getattr__(name: str) -> Any:
    """The runner (and the GPU catalog it reads) only when asked for: the traced child imports this package for
    `wire`, `events` and `errors` alone, and would otherwise load the estimator's side at every start."""
    if name in ("run_trace", "TraceCancelled"):
        from xmem.trace import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MemEvent", "Trace", "TraceCancelled", "TraceError", "run_trace"]
