"""The exit codes of `xmem-slurm`: the one table. The constants the verbs exit with, the epilog of
`xmem-slurm --help` and README's table (held to it by tests/cli/test_exit_codes.py) all come from `EXIT_CODES`;
which kinds exit with each code is `xmem.error_kinds.ErrorKind`'s (each kind names its code), so a row lists them.

No imports beyond the standard library and `xmem.error_kinds`: `xmem.cli` reads it at every start, the node-side
verbs included.
"""

from __future__ import annotations

from typing import NamedTuple

from xmem.error_kinds import ErrorKind


class ExitCode(NamedTuple):
    code: int
    kinds: tuple[str, ...]  # the `error` field of the --json error object exiting with it (none for 0)
    meaning: str  # one line, what happened and what to do (plain text: README and --help show it as written)


def _row(code: int, meaning: str) -> ExitCode:
    return ExitCode(code, tuple(kind.value for kind in ErrorKind if kind.exit_code == code), meaning)


EXIT_OK = 0
EXIT_INTERNAL = ErrorKind.INTERNAL.exit_code
EXIT_USAGE = ErrorKind.BAD_OPTION.exit_code
EXIT_NOT_UNDERSTOOD = ErrorKind.NOT_UNDERSTOOD.exit_code  # `check`, `fit`: a training command xmem cannot read
EXIT_NO_SLURM = ErrorKind.SLURM_UNREACHABLE.exit_code  # `status`: Slurm cannot be asked (no scontrol, or no answer)
EXIT_NO_FIT = ErrorKind.NO_FIT.exit_code  # `estimate`, `check`: the answer was given, and the job fits no type asked

# The answer given, and what `xmem-slurm` tells apart when it gives none.
EXIT_CODES: tuple[ExitCode, ...] = (
    _row(EXIT_OK, "the answer was given"),
    _row(EXIT_INTERNAL, "internal error: xmem-slurm's own bug (please report it, with the command)"),
    _row(EXIT_USAGE, "bad option or argument: an unknown GPU type (or, for status, job), an unwritable "
                     "--plot/--snapshot path, --plot without matplotlib (told before the trace); as root, another "
                     "user's program that cannot be run again as its owner, or a file the trace identity cannot "
                     "read (named)"),
    _row(3, "the command (or its script or module) was not found"),
    _row(4, "not a Python program"),
    _row(5, "the user's code raised what a GPU would raise too (its own traceback is shown), or the job's "
            "interpreter cannot import torch (the job would fail there too)"),
    _row(6, "no optimizer step reached: the program made an optimizer but was still short of its first step "
            "(evaluating, say) at 80 % of the time limit"),
    _row(7, "timeout (--timeout, or the trace's CPU-time limit)"),
    _row(EXIT_NOT_UNDERSTOOD, "(check, fit) the batch script or its training command was not understood"),
    _row(9, "the program ended without using the GPU (never a 0-byte answer: its last output lines are shown)"),
    _row(10, "the trace went over its host-memory limit ([estimate] memory_limit_gib)"),
    _row(11, "not modelled: the program used something the fake GPU does not model (an op with no fake kernel, a "
             "GPU tensor's storage, a call that reached the real CUDA runtime, a library's own load of the driver), "
             "named in one line with the program's line that reached it"),
    _row(EXIT_NO_SLURM, "(status) Slurm is not reachable, or gave no answer in a few seconds"),
    _row(13, "the program was killed by a signal (a crash in a native extension, say)"),
    _row(EXIT_NO_FIT, "(estimate, check) the answer was given (the table, or the JSON with this `error` beside it), "
                      "and the job fits none of the GPU types asked: it would run out of memory on each; the answer "
                      "names the largest batch size that fits, where the command has one, and the `xmem-slurm fit` "
                      "command to see more"),
)

# Every error kind to its exit code (the tracer's and the command line's own).
KIND_EXIT_CODES: dict[str, int] = {kind.value: kind.exit_code for kind in ErrorKind}


def code_of(kind: str) -> int:
    """The exit code of a --json error kind (EXIT_INTERNAL for one the table lacks)."""
    return KIND_EXIT_CODES.get(kind, EXIT_INTERNAL)


def table_lines() -> list[str]:
    """The table as `--help` prints it: one line per code."""
    return [f"{row.code:>3}  {row.meaning}" for row in EXIT_CODES]


def markdown_table() -> str:
    """The table as README.md holds it (tests/cli/test_exit_codes.py compares the two)."""
    rows = ["| exit | `--json` error | meaning |", "|---:|---|---|"]
    for row in EXIT_CODES:
        kinds = ", ".join(f"`{kind}`" for kind in row.kinds)
        rows.append(f"| {row.code} | {kinds} | {row.meaning} |")
    return "\n".join(rows) + "\n"
