"""Running a user's unmodified PyTorch training program under fake CUDA and recording its GPU memory events.

Public API: `run_trace(command, ...) -> Trace` and `TraceError`. The work happens in a fresh child process
(`python -m xmem.trace`), because the fake-CUDA shim must be loaded before torch and patches torch for good.
Importing this package does not import torch.
"""

from xmem.trace.errors import TraceError
from xmem.trace.events import MemEvent, Trace
from xmem.trace.runner import run_trace

__all__ = ["MemEvent", "Trace", "TraceError", "run_trace"]
