"""The exit codes of `xmem-slurm`: the one table. The constants the verbs exit with, the epilog of
`xmem-slurm --help` and README's table (held to it by tests/cli/test_exit_codes.py) all come from `EXIT_CODES`.

No imports beyond the standard library: `xmem.cli` reads it at every start, the node-side verbs included.
"""

from __future__ import annotations

from typing import NamedTuple


class ExitCode(NamedTuple):
    code: int
    kinds: tuple[str, ...]  # the `error` field of the --json error object exiting with it (none for 0)
    meaning: str  # one line, what happened and what to do (plain text: README and --help show it as written)


EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NOT_UNDERSTOOD = 8  # `check`, `fit`: a batch script or command whose training command xmem cannot read
EXIT_NO_SLURM = 12  # `status`: Slurm cannot be asked (no scontrol, or it never reached slurmctld)
EXIT_NO_FIT = 14  # `estimate`, `check`: the answer was given, and the job fits none of the GPU types asked

# The answer given, and what `xmem-slurm` tells apart when it gives none.
EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, (), "the answer was given"),
    ExitCode(EXIT_INTERNAL, ("internal",), "internal error: xmem-slurm's own bug (please report it, with the command)"),
    ExitCode(EXIT_USAGE, ("bad_option", "unknown_gpu", "bad_input", "no_gpu_types", "not_a_batch_script",
                          "not_as_root", "unknown_job"),
             "bad option or argument: an unknown GPU type (or, for status, job), an unwritable --plot/--snapshot "
             "path, --plot without matplotlib (told before the trace), root tracing another user's program"),
    ExitCode(3, ("not_found",), "the command (or its script or module) was not found"),
    ExitCode(4, ("not_python",), "not a Python program"),
    ExitCode(5, ("user_error",), "the user's code raised what a GPU would raise too (its own traceback is shown), "
                                 "or the job's interpreter cannot import torch (the job would fail there too)"),
    ExitCode(6, ("no_optimizer_step",), "no optimizer step reached: the program made an optimizer but was still "
                                        "short of its first step (evaluating, say) at 80 % of the time limit"),
    ExitCode(7, ("timeout",), "timeout (--timeout, or the trace's CPU-time limit)"),
    ExitCode(EXIT_NOT_UNDERSTOOD, ("not_understood",),
             "(check, fit) the batch script or its training command was not understood"),
    ExitCode(9, ("no_cuda",), "the program ended without using the GPU (never a 0-byte answer: its last "
                                "output lines are shown)"),
    ExitCode(10, ("memory_limit",), "the trace went over its host-memory limit ([estimate] memory_limit_gib)"),
    ExitCode(11, ("not_modelled",), "not modelled: the program used something the fake GPU does not model (an op "
                                    "with no fake kernel, a GPU tensor's storage, a call that reached the real CUDA "
                                    "runtime, a library's own load of the driver), named in one line with the "
                                    "program's line that reached it"),
    ExitCode(EXIT_NO_SLURM, ("slurm_unreachable",), "(status) Slurm is not reachable, or gave no answer in a few seconds"),
    ExitCode(13, ("crashed",), "the program was killed by a signal (a crash in a native extension, say)"),
    ExitCode(EXIT_NO_FIT, ("no_fit",),
             "(estimate, check) the answer was given (the table, or the JSON with this `error` beside it), and the "
             "job fits none of the GPU types asked: it would run out of memory on each; the answer names the largest "
             "batch size that fits, where the command has one, and the `xmem-slurm fit` command to see more"),
)

# Every error kind to its exit code: the tracer's (`xmem.trace.errors.KINDS`, each in the table: a test says so)
# and the command line's own.
KIND_EXIT_CODES: dict[str, int] = {kind: row.code for row in EXIT_CODES for kind in row.kinds}


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
