"""The one exception the tracer raises to its callers, with a kind that says what went wrong."""

from __future__ import annotations

from xmem.error_kinds import TRACER_KINDS, ErrorKind

KINDS = TRACER_KINDS  # what a trace can end in (xmem.error_kinds says what each means, and its exit code)
SHOWN_LINES = 20  # of the program's output, beside its traceback
# What the CUDA runtime (through torch, or a native extension printing its error) says with no device here; and
# what torch says instead in a child of the warm tracer (a fork of a process that loaded CUDA: `torch._C._cuda_init`
# asserts `is_device_in_bad_fork` before it reaches the runtime).
REAL_CUDA_SIGNS = ("Found no NVIDIA driver", "CUDA driver version is insufficient", "no CUDA GPUs are available",
                   "Torch not compiled with CUDA enabled", "CUDA error:", "is_device_in_bad_fork(at::kCUDA)")


class TraceError(Exception):
    """The program could not be traced.

    kind: one of KINDS (given as the kind or its name). message: one line saying what to do. user_traceback: the
    user's own frames and the exception line (empty unless kind is "user_error"). output: the program's captured
    stdout+stderr tail, if it ran.
    """

    def __init__(self, kind: ErrorKind | str, message: str, user_traceback: str = "", output: str = "") -> None:
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.user_traceback = user_traceback
        self.output = output

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    def last_lines(self, count: int = SHOWN_LINES) -> str:
        """The last `count` lines the program printed (what a user looks at first when a run fails)."""
        lines = self.output.rstrip("\n").splitlines()[-count:]
        return "\n".join(lines) + "\n" if lines else ""


class NotModelled(Exception):
    """Raised inside the traced program where the fake GPU knows it lacks something: the trace ends as
    "not_modelled" with this message (what is missing, in one line; `xmem.trace.child.attribution` adds where)."""


_GPU_WOULD_RAISE = "_xmem_gpu_would_raise"


def as_on_a_gpu(error: BaseException) -> BaseException:
    """Mark an exception raised by xmem's own code because a real GPU would raise it too (a Triton launch given a
    host tensor): the program's error, not the fake GPU's. Returns `error`, for `raise as_on_a_gpu(...)`."""
    setattr(error, _GPU_WOULD_RAISE, True)
    return error


def raised_as_on_a_gpu(error: BaseException) -> bool:
    return getattr(error, _GPU_WOULD_RAISE, False)
