"""Every kind of failure xmem-slurm reports, each with its exit code: the `error` field of a `--json` error object,
`TraceError.kind` (the tracer's kinds, `TRACER_KINDS`) and the command line's own. The exit-code table
(`xmem.cli.exit_codes`: what each code means, for `--help` and README) groups these kinds by their code.

Below every part that names a kind (the tracer on both sides of its process boundary, the analysis, the command
line), so it imports nothing of xmem; and nothing beyond the standard library, since every start reads it. Runs on
Python 3.10 too: the traced side runs on the job's interpreter.
"""

from __future__ import annotations

from enum import Enum

try:
    from enum import StrEnum
except ImportError:  # Python 3.10 (a job's interpreter, which the traced side runs on): the same, by hand
    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return self.value


class ErrorKind(StrEnum):
    """A kind of failure (its value: the stable name scripts read) and the code xmem-slurm exits with for it. A
    StrEnum, so a kind is its name wherever text is wanted (JSON, messages, comparisons with a name)."""

    exit_code: int

    def __new__(cls, name: str, exit_code: int) -> ErrorKind:
        kind = str.__new__(cls, name)
        kind._value_ = name
        kind.exit_code = exit_code
        return kind

    INTERNAL = "internal", 1
    BAD_OPTION = "bad_option", 2
    UNKNOWN_GPU = "unknown_gpu", 2
    BAD_INPUT = "bad_input", 2
    NO_GPU_TYPES = "no_gpu_types", 2
    NOT_A_BATCH_SCRIPT = "not_a_batch_script", 2
    NOT_AS_ROOT = "not_as_root", 2
    UNKNOWN_JOB = "unknown_job", 2
    NOT_FOUND = "not_found", 3
    NOT_PYTHON = "not_python", 4
    USER_ERROR = "user_error", 5
    NO_OPTIMIZER_STEP = "no_optimizer_step", 6
    TIMEOUT = "timeout", 7
    NOT_UNDERSTOOD = "not_understood", 8
    NO_CUDA = "no_cuda", 9
    MEMORY_LIMIT = "memory_limit", 10
    NOT_MODELLED = "not_modelled", 11
    SLURM_UNREACHABLE = "slurm_unreachable", 12
    CRASHED = "crashed", 13
    NO_FIT = "no_fit", 14


# What a trace can end in (`xmem.trace.errors.TraceError`). no_optimizer_step: the program made an optimizer and had
# not stepped it by the trace's time limit (one that makes none and only runs forward passes is estimated:
# forward_only); memory_limit: the tracer hit its host-memory limit (or was killed, most likely for memory);
# crashed: the program died of a signal (an abort, a segfault in an extension); no_cuda: the program ended without
# using the GPU; not_modelled: the program used something the fake GPU does not model (named in the message).
TRACER_KINDS = (ErrorKind.NOT_FOUND, ErrorKind.NOT_PYTHON, ErrorKind.USER_ERROR, ErrorKind.NO_OPTIMIZER_STEP,
                ErrorKind.TIMEOUT, ErrorKind.MEMORY_LIMIT, ErrorKind.CRASHED, ErrorKind.NO_CUDA,
                ErrorKind.NOT_MODELLED, ErrorKind.INTERNAL)
