"""`xmem-slurm fit --vary NAME=LOW..HIGH -- COMMAND`: the largest value of one knob that fits each GPU type and
each way the site offers it; `check JOB.sh --vary ...` does the same for a batch script's training command.

Owns the verb's I/O (the table for people, `--json`), which GPU types and offers are searched (`--gpu`, else the
site's types, else the catalog's) and the estimate run at each value. The search itself is `xmem.fit`.
Exit codes as `xmem-slurm estimate` (2 for a bad --vary or a command with nowhere to put the value).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from xmem.cli import app
from xmem.cli.common import (EXIT_NOT_UNDERSTOOD, EXIT_USAGE, JsonErrorsCommand, add_gpu_column, fail,
                             fail_on_error, margin_text, stdout_to_stderr, timeout_option)
from xmem.config import MarginConfig, SiteConfig, load_site_config
from xmem.estimate import estimate as run_estimate
from xmem.fit import FitError, FitResult, Point, Vary, command_at, find_limits, parse_vary
from xmem.fit_trace import point_tracer
from xmem.gpus import find_gpu
from xmem.policy import estimate_types
from xmem.policy.options import FixedOption, fixed_options
from xmem.units import MIB, gib_text, size_text


@app.command("fit", cls=JsonErrorsCommand)
def fit_command(
    command: list[str] = typer.Argument(..., metavar="-- COMMAND [ARGS]...",
                                        help="The training command, `{}` where the value goes (or a plain "
                                             "`--NAME value`), e.g. `-- python train.py --batch-size {}`."),
    vary: str = typer.Option(..., "--vary", metavar="NAME=LOW..HIGH", help="The knob and the range to search."),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", "-g", metavar="TYPE",
                                            help="GPU type (repeatable). Default: the site's types, else all."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", min=1,
                                             help="Optimizer steps per trace (default: the site's)."),
    timeout: Optional[float] = timeout_option("Give up one trace after S seconds."),
    python: Optional[str] = typer.Option(None, "--python", help="Python interpreter of the job (default: as run)."),
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="Site config: its offers, margin and catalog (default: $XMEM_CONFIG, "
                                              "/etc/xmem/xmem.toml)."),
    step: Optional[int] = typer.Option(None, "--step", min=1, metavar="N",
                                       help="Answer in multiples of N (default: exact below 64, else multiples "
                                            "of 8, or of 1 % of HIGH where that is coarser)."),
) -> None:
    """The largest value of one knob (batch size, sequence length...) that fits each GPU type and offer."""
    verb = "fit"
    try:
        site = load_site_config(config)
        job = {"iterations": iterations or site.estimate.iterations, "timeout": timeout, "python": python}
        run_fit(command, parse_vary(vary), site, gpu, job, as_json, step=step)
    except FitError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb=verb)
    except Exception as e:  # noqa: BLE001 - each kind of error has its exit code
        fail_on_error(as_json, e, verb)


def run_fit(command: Sequence[str], vary: Vary, site: SiteConfig, gpus: Sequence[str] | None,
            job: Mapping[str, Any], as_json: bool, site_types: Sequence[str] = (),
            step: int | None = None) -> None:
    """Search, then print the answer (`job`: what `xmem.estimate.estimate` takes besides the command, GPUs and the
    site's settings). `site_types`: the types to search when `gpus` names none (default: every type of the site)."""
    with stdout_to_stderr() as out:
        result, options = search(command, vary, site, gpus, job, site_types, progress=not as_json, step=step)
    if as_json:
        margin = {"relative": site.margin.relative, "absolute_bytes": site.margin.absolute_bytes}
        out.write(json.dumps({**result.to_json(), "margin": margin}) + "\n")
        out.flush()
    else:
        show_fit(Console(), result, {(o.gpu_type, o.name): o.usable_bytes for o in options}, site.margin)


def search(command: Sequence[str], vary: Vary, site: SiteConfig, gpus: Sequence[str] | None,
           job: Mapping[str, Any], site_types: Sequence[str] = (),
           progress: bool = False, step: int | None = None) -> tuple[FitResult, list[FixedOption]]:
    """The limits and the offers searched (see `run_fit`), an estimate at each value `xmem.fit` asks for."""
    command_at(command, vary, vary.low)  # nowhere to put the value: say so before any trace
    catalog = site.catalog()
    types = list(gpus or site_types or _site_types(site) or catalog)
    names = {find_gpu(t, catalog).name: t for t in types}  # catalog name -> the name the user knows
    options = [o for t in types for o in fixed_options(site, t, catalog)]
    err = Console(stderr=True)

    traced: list[int] = []
    updates: dict[int, Callable[[str], None] | None] = {}
    tracer = point_tracer(command, vary, names, site.estimate_settings(catalog), job, run_estimate,
                          progress=updates.get)

    def trace(value: int) -> Point:
        traced.append(value)
        with _progress(err, progress, f"trace {len(traced)}: {vary.name}={value}") as update:
            updates[value] = update
            return tracer(value)

    return find_limits(vary, options, trace, site.margin.needed, resolution=step), options


@contextmanager
def _progress(err: Console, wanted: bool, what: str) -> Iterator[Callable[[str], None] | None]:
    """A line per trace and a live status while it runs, on a terminal only (quiet when piped or with --json)."""
    if not (wanted and err.is_terminal):
        yield None
        return
    err.print(what, highlight=False)
    with err.status(what) as status:
        yield lambda message: status.update(f"{what}: {message}")


def _site_types(site: SiteConfig) -> list[str]:
    """Every whole GPU type the site's partitions offer (a MIG slice as its parent)."""
    types: list[str] = []
    for partition in site.partitions.gpu_types:
        types += [t for t in estimate_types(site, (partition,)) if t not in types]
    return types


def show_fit(console: Console, result: FitResult, usable: Mapping[tuple[str, str], int],
             margin: MarginConfig = MarginConfig()) -> None:
    vary = result.vary
    step = f", in steps of {result.resolution}" if result.resolution > 1 else ""
    table = Table(title=f"Largest {vary.name} in {vary.low}..{vary.high} that fits{step}",
                  caption=f"fits: the peak with the site margin ({margin_text(margin)}) is at most the offer's "
                          "usable memory, as in `estimate` and `check`")
    add_gpu_column(table)
    for column in ("offer", "usable", f"largest {vary.name}"):
        table.add_column(column, justify="left" if column == "offer" else "right")
    for gpu, limits in result.limits.items():
        for name, value in limits.items():
            shown = "[red]none[/] (not even " + str(vary.low) + ")" if value is None else str(value)
            shown = f"at least {value} (the top of the range)" if result.at_least(value) else shown
            table.add_row(gpu, name, gib_text(usable[gpu, name]), shown)
    console.print(table)
    values = ", ".join(str(p.value) for p in result.points)
    console.print(f"{result.traces} traces ({vary.name} = {values}) in {result.seconds:.1f} s; "
                  f"{growth_text(result)}", highlight=False)
    if result.bound_note:
        console.print(result.bound_note, highlight=False)


def growth_text(result: FitResult) -> str:
    """How the memory the job needs grows with the knob, read off the traces on one GPU type: the slope of the
    peak, and whether it curves upwards (attention over the sequence length). Not per category: what is live at
    the peak changes with the value (the peak moves from the optimizer step to the backward pass), and a category
    that does not depend on the value (gradients, for a batch size) would read as growing."""
    points = sorted(result.points, key=lambda p: p.value)
    gpu = next((g for g in result.limits if all(g in p.needs for p in points)), None)
    if gpu is None or len(points) < 2:
        return "too few traces to say how memory grows"
    values = np.array([p.value for p in points], dtype=float)
    needs = np.array([p.needs[gpu] for p in points], dtype=float)
    line = np.polyfit(values, needs, 1)
    slope, name = float(line[0]), result.vary.name
    if slope * (values[-1] - values[0]) < MIB:
        return f"the memory needed does not grow with {name}"
    miss = float(np.max(np.abs(np.polyval(line, values) - needs)))
    curved = len(points) >= 3 and np.polyfit(values, needs, 2)[0] > 0 and miss > 0.05 * float(np.max(needs))
    how = "faster than linearly (as attention does over the sequence length)" if curved else "linearly"
    return f"the memory needed grows {how}, about {size_text(int(slope))} per unit of {name} (on {gpu})"


def fit_job(script: str, args: Sequence[str], cli_options: Mapping[str, str] | None, site: SiteConfig,
            gpus: Sequence[str] | None, vary_text: str, as_json: bool, step: int | None = None) -> None:
    """`check JOB.sh --vary ...`: the search on the script's (first) training command as the analysis of `check`
    estimates it (`xmem.analyze.first_command`: its environment, directory and interpreter, the GPU types of its
    partitions)."""
    from xmem.analyze import AnalysisError, first_command

    verb = "check"
    try:
        vary = parse_vary(vary_text)
    except FitError as e:
        fail(as_json, EXIT_USAGE, "bad_input", str(e), verb=verb)
    first = first_command(script, script_args=list(args), cli_options=cli_options, config=site)
    if isinstance(first, AnalysisError):
        code = EXIT_NOT_UNDERSTOOD if first.kind == "not_understood" else EXIT_USAGE
        fail(as_json, code, first.kind, first.message, verb=verb)
    try:
        run_fit(first.command.argv, vary, site, gpus, {**first.job, "timeout": site.estimate.timeout_s}, as_json,
                site_types=first.targets, step=step)
    except FitError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb=verb)
    except Exception as e:  # noqa: BLE001 - each kind of error has its exit code
        fail_on_error(as_json, e, verb)
