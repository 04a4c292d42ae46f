"""What every verb of the command line shares: the exit codes, the options declared alike, the error exit (one
line on stderr, and with `--json` one object on stdout), stdout kept for the JSON while the program prints, the
margin in words, and the site's offers side by side. The verbs import it; it imports none of them.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

# The exit codes: one table, xmem/cli/exit_codes.py (README's and --help's); the verbs import them from here.
from xmem.cli.exit_codes import (EXIT_INTERNAL, EXIT_NO_FIT, EXIT_NO_SLURM, EXIT_NOT_UNDERSTOOD,  # noqa: F401
                                 EXIT_USAGE)
from xmem.cli.exit_codes import KIND_EXIT_CODES as TRACE_EXIT_CODES
from xmem.config import MAX_TIMEOUT_S, ConfigError, MarginConfig
from xmem.estimate import BadJobSettingError
from xmem.gpus import CatalogError, GpuType, UnknownGpuError, find_gpu
from xmem.policy.options import OptionTable
from xmem.text import one_line
from xmem.trace import TraceError, privileges
from xmem.units import gib_text, size_text

# Options that `estimate` and `check` (and `fit`) declare alike: written once, here.
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else.")
PLOT_OPTION = typer.Option(None, "--plot", metavar="FILE.png",
                           help="Draw memory over the traced iterations on one GPU type (PNG).")
VERBOSE_OPTION = typer.Option(False, "--verbose", "-v", help="Also show the tracer's notes that do not change the "
                                                           "figures (always in the --json output's warnings).")


def timeout_option(help_text: str) -> Any:
    """`--timeout S`, as `estimate`, `check` and `fit` declare it: a finite number of seconds, a week at most."""
    return typer.Option(None, "--timeout", min=0.0, max=float(MAX_TIMEOUT_S), callback=_finite_seconds, metavar="S",
                        help=help_text)


def _finite_seconds(value: float | None) -> float | None:
    # click's range check lets nan through (every comparison with nan is false); it reached the tracer as int(nan)
    if value is not None and math.isnan(value):
        raise typer.BadParameter("nan is not a number of seconds")
    return value

class JsonErrorsCommand(TyperCommand):
    """Keeps the `--json` promise for option errors too: click reports those before our code runs."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # copies: click's parser consumes `args`
        options, has_separator = (args[: args.index("--")] if "--" in args else list(args)), "--" in args
        try:
            return super().parse_args(ctx, args)
        except typer.TyperException as e:  # typer's own (vendored) click UsageError; usage errors exit 2
            if not has_separator and type(e).__name__ == "NoSuchOption":  # the training command's own option
                e.message = (f"{e.message}: if it is your program's option, put the training command after `--`, "
                             f"e.g. xmem-slurm {ctx.info_name} [OPTIONS] -- python train.py {e.option_name} ...")
            if "--json" in options and getattr(e, "exit_code", None) == EXIT_USAGE:
                sys.stdout.write(json.dumps({"error": "bad_option", "message": str(e.format_message()),
                                             "traceback": None}) + "\n")
                sys.stdout.flush()
            raise


def fail(as_json: bool, code: int, kind: str, message: str, traceback: str = "", printed: str = "",
         verb: str = "estimate") -> NoReturn:
    """Exit with `code`: one line on stderr (after the program's traceback and last output), and with `--json` one
    object on stdout that says the same (the shape every command's JSON error has)."""
    line = one_line(message) or kind
    if printed:  # what the program printed last, often the reason: beside its traceback
        rows = "".join(f"  | {row}\n" for row in printed.splitlines())
        sys.stderr.write(f"the program's last output lines:\n{rows}")
    if traceback:
        sys.stderr.write(traceback if traceback.endswith("\n") else traceback + "\n")
    sys.stderr.write(f"xmem-slurm {verb}: {line}\n")  # not through rich: it would wrap the one line
    if as_json:
        payload: dict[str, Any] = {"error": kind, "message": line, "traceback": traceback or None,
                                   "output": printed or None, "exit_code": code}
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()
    raise typer.Exit(code)


def fail_on_error(as_json: bool, e: Exception, verb: str = "estimate") -> NoReturn:
    """Exit with the code and one-line message of an error of the estimate (shared with `fit`)."""
    if isinstance(e, UnknownGpuError):
        fail(as_json, EXIT_USAGE, "unknown_gpu", str(e), verb=verb)
    if isinstance(e, (ConfigError, CatalogError, BadJobSettingError)):
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb=verb)
    if isinstance(e, privileges.RootTraceRefused):  # nothing was run
        fail(as_json, EXIT_USAGE, privileges.KIND, e.message, verb=verb)
    if isinstance(e, TraceError):
        fail(as_json, TRACE_EXIT_CODES.get(e.kind, EXIT_INTERNAL), e.kind, e.message, e.user_traceback,
             e.last_lines(), verb=verb)
    fail(as_json, EXIT_INTERNAL, "internal", f"internal error: {type(e).__name__}: {e}", verb=verb)  # our bug


def shown_gpu(result: Any, picked: str | None = None, catalog: Mapping[str, GpuType] | None = None) -> str:
    """The one GPU type an answer shows (the breakdown, the table's mark, the plot's default): the site's pick
    (`picked`: `OptionRow.gpu_type`, a MIG slice's parent) where one was made and estimated, else the estimate's
    own (`xmem.estimate.shown_gpu`: the first type asked for on which the job runs to its end)."""
    if picked and catalog is not None:
        try:
            name = find_gpu(picked, catalog).name
        except UnknownGpuError:
            name = ""
        if name in result.gpus:
            return name
    return result.breakdown_gpu


# Below this console width a table drops what can be read off its other columns (80: rich's width for a pipe or a
# log file, and many terminals).
WIDE_COLUMNS = 100


def add_gpu_column(table: Table, header: str = "GPU type") -> None:
    """The column of GPU type names, never cut: at 80 columns rich cut 'A100-SXM4-40GB' and 'A100-SXM4-80GB' to
    the same 'A100-SXM4-8…'; the other columns wrap instead."""
    table.add_column(header, no_wrap=True)


def margin_text(margin: MarginConfig) -> str:
    """The margin in words, e.g. '+10 %' or '+10 % + 512 MiB' (said the same by every command)."""
    text = f"+{100 * margin.relative:g} %"
    return text + (f" + {size_text(margin.absolute_bytes)}" if margin.absolute_bytes else "")


def show_options(console: Console, options: OptionTable) -> None:
    """Every offer of the site side by side (`xmem.policy.options`), the pick and the nearest cheaper miss."""
    table = Table(title="Every way the site offers the job's GPU types (site preference order, smallest first)")
    add_gpu_column(table, "GPU")
    table.add_column("request", no_wrap=True)  # what to type, as the GPU names: never cut
    for column in ("usable", "peak", "with margin", "fits"):
        table.add_column(column, justify="left" if column == "fits" else "right")
    for row in options.rows:
        slack = size_text(abs(row.slack_bytes), mib_digits=0)
        mark = f"[green]yes[/], {slack} spare" if row.fits else f"[red]no[/], {slack} short"
        picked = " [bold]<- picked[/]" if row.chosen else ""
        table.add_row(escape(row.gpu_type), escape(row.request), gib_text(row.usable_bytes),
                      gib_text(row.peak_bytes), gib_text(row.needed_bytes), mark + picked)
    console.print(table)
    chosen, miss = options.chosen, options.closest_miss
    if chosen is not None:
        console.print(f"picked: {escape(chosen.description)}: {escape(options.reason)}")
    if miss is not None:
        what = "next cheaper offer" if chosen is not None else "closest offer"
        short = size_text(-miss.slack_bytes, mib_digits=0)
        console.print(f"{what}, does not fit: {escape(miss.description)}, {short} short "
                      f"(needs {gib_text(miss.needed_bytes)}, gives {gib_text(miss.usable_bytes)})")


@contextmanager
def stdout_to_stderr() -> Iterator[io.TextIOBase]:
    """Send everything written to stdout (by us, libraries or child processes) to stderr; yield the real stdout.

    `--json` promises exactly one JSON object on stdout, the table should not be mixed with the program's output,
    and the traced program may print.
    """
    real = sys.stdout
    real.flush()
    try:
        saved_fd = os.dup(real.fileno())
    except (AttributeError, io.UnsupportedOperation, OSError):  # not a real file (e.g. a test runner's buffer)
        saved_fd = None
    if saved_fd is not None:
        os.dup2(sys.stderr.fileno(), real.fileno())
    sys.stdout = sys.stderr
    try:
        yield real
    finally:
        sys.stdout.flush()
        sys.stdout = real
        if saved_fd is not None:
            os.dup2(saved_fd, real.fileno())
            os.close(saved_fd)
