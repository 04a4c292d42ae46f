"""`xmem-slurm estimate`: predict a training command's peak GPU memory on each GPU type.

Owns the command's I/O: the table for people, the JSON object for scripts, the progress display, what a job that
fits nowhere is told to try (`xmem.fit_trace.largest_batch`), and the exit codes (xmem/cli/exit_codes.py; 14 where
the job fits none of the GPU types asked). The work itself is `xmem.estimate.estimate`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from xmem.cli import app
from xmem.cli.common import (EXIT_NO_FIT, EXIT_USAGE, JSON_OPTION, PLOT_OPTION, VERBOSE_OPTION, WIDE_COLUMNS,
                              JsonErrorsCommand, add_gpu_column, fail, fail_on_error, margin_text, show_options,
                              shown_gpu, stdout_to_stderr, timeout_option)
from xmem.cli.pictures import KeptRun, PictureError, check_outputs, check_plot_gpu, write_pictures
from xmem.config import MarginConfig, SiteConfig, load_site_config
from xmem.estimate import ALLOCATOR_SLACK, OVERHEAD, Estimate, estimate as run_estimate
from xmem.fit_trace import BatchHint, batch_knob, fit_command_text, largest_batch
from xmem.policy import job_peak
from xmem.policy.options import OptionTable, site_option_table
from xmem.trace import privileges
from xmem.trace.wire import as_note
from xmem.units import size_text

# How the breakdown names its non-tensor parts for people.
PART_NAMES = {ALLOCATOR_SLACK: "allocator slack (cached, rounding)", OVERHEAD: "CUDA context + libraries"}


@app.command("estimate", cls=JsonErrorsCommand)
def estimate_command(
    command: list[str] = typer.Argument(..., metavar="-- COMMAND [ARGS]...",
                                        help="The training command, after `--`, e.g. `-- python train.py --lr 1e-3`."),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", "-g", metavar="TYPE",
                                            help="GPU type (repeatable; catalog name or alias). Default: all."),
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, help="Optimizer steps to trace."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, metavar="N",
                                                help="GPUs the job's node gives it (torch.cuda.device_count()). "
                                                     "Default: Slurm's SLURM_GPUS_ON_NODE, else the launcher's "
                                                     "processes per node, else 1."),
    as_json: bool = JSON_OPTION,
    timeout: Optional[float] = timeout_option("Give up tracing after S seconds."),
    python: Optional[str] = typer.Option(None, "--python", help="Python interpreter of the job (default: the one "
                                         "the command names by path, e.g. ~/env/bin/python, else this one)."),
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="Site config whose \\[catalog] and limits apply (default: $XMEM_CONFIG, "
                                              "/etc/xmem/xmem.toml)."),
    plot: Optional[str] = PLOT_OPTION,
    plot_gpu: Optional[str] = typer.Option(None, "--plot-gpu", metavar="TYPE",
                                           help="GPU type of --plot and --snapshot (default: the one shown: the "
                                                "first --gpu the job fits, or the site's pick with --config)."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", metavar="FILE.pickle",
                                           help="Write the simulated run as a torch.cuda.memory snapshot "
                                                "(for torch.cuda._memory_viz / pytorch.org/memory_viz)."),
    verbose: bool = VERBOSE_OPTION,
) -> None:
    """Predict the peak GPU memory of a PyTorch training command on each GPU type, with no GPU."""
    err = Console(stderr=True)
    # issue 21: root never runs another user's program: this same estimate runs as them, or is refused
    privileges.rerun_cli_as_owner(command, lambda why: fail(as_json, EXIT_USAGE, "not_as_root", why))
    try:
        site = load_site_config(config)
        settings = dict(gpus=gpu, iterations=iterations, timeout=timeout, python=python, gpus_per_node=gpus_per_node,
                        settings=site.estimate_settings())
        traces = _prepare_pictures(plot, snapshot, plot_gpu, gpu, site, settings)
        # stdout carries only our answer; what the traced program prints goes to stderr.
        with stdout_to_stderr() as out:
            result = run_estimate(command, **settings) if as_json else _estimate_with_progress(err, command, settings)
        options = _site_options(result, site) if config else None  # a site named: its offers side by side
        hint = _no_fit_hint(err, command, result, site, settings, as_json)
        if as_json:
            out.write(json.dumps({**with_margin(result.to_json(), site.margin),
                                  **({"options": options.to_json()} if options else {}),
                                  **(no_fit_json(result, hint) if fits_nowhere(result, site.margin) else {})}) + "\n")
            out.flush()
        else:
            show_estimate(Console(), result, site.margin, verbose, shown=_shown(result, options, site))
            if options is not None and options.rows:
                show_options(Console(), options)
            if fits_nowhere(result, site.margin):
                Console().print(f"[red]Fits none of the GPU types asked:[/] {escape(no_fit_message(result, hint))}",
                                highlight=False, soft_wrap=True)  # the command to copy stays on one line
        if traces is not None:
            _write_pictures(result, traces, plot, snapshot, plot_gpu, site, options)
    except PictureError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e))
    except Exception as e:  # noqa: BLE001 - each kind of error has its exit code
        fail_on_error(as_json, e)
    if fits_nowhere(result, site.margin):  # the answer was given; a script must still see that it says no
        raise typer.Exit(EXIT_NO_FIT)


def fits_nowhere(result: Estimate, margin: MarginConfig) -> bool:
    """The job fits none of the GPU types estimated, as the table's verdict says "fits" (the site margin on the
    peak at most the GPU's memory): exit EXIT_NO_FIT."""
    return result.used_cuda and bool(result.gpus) and not any(
        g.fits and margin.needed(g.peak_bytes) <= g.total_bytes for g in result.gpus.values())


def no_fit_message(result: Estimate, hint: BatchHint | None) -> str:
    """What to do next, in one line: a smaller batch (`hint`), else more memory per GPU or more GPUs."""
    if hint is not None:
        return hint.text()
    return ("ask for a GPU type with more memory, shard the model over more GPUs (FSDP, ZeRO), or make it smaller; "
            "`xmem-slurm fit --vary NAME=LOW..HIGH -- COMMAND` finds the largest value of a knob that fits")


def no_fit_json(result: Estimate, hint: BatchHint | None) -> dict[str, Any]:
    """The fields --json adds to an answer that fits nowhere: the table's `error` kind and the next step."""
    return {"error": "no_fit", "message": no_fit_message(result, hint), "exit_code": EXIT_NO_FIT,
            "largest_batch": hint.to_json() if hint is not None else None}


def _no_fit_hint(err: Console, command: list[str], result: Estimate, site: SiteConfig, settings: dict[str, Any],
                 as_json: bool) -> BatchHint | None:
    """Where the job fits nowhere and its command has a batch size: the largest that fits (a few traces, bounded
    by HINT_BUDGET_S); else None, at no cost."""
    if not fits_nowhere(result, site.margin):
        return None
    types = list(result.gpus)
    knob = batch_knob(command)
    if knob is None:
        return None
    see_more = fit_command_text(command, knob[0], knob[1], types)
    kept = {k: v for k, v in settings.items() if k not in ("gpus", "settings", "keep_traces")}
    with stdout_to_stderr():  # what the traced program prints is not the answer
        if as_json or not err.is_terminal:
            return largest_batch(command, types, site, kept, see_more, settings=settings["settings"])
        with err.status(f"the job fits nowhere: looking for the largest --{knob[0]} that fits"):
            return largest_batch(command, types, site, kept, see_more, settings=settings["settings"])


def _shown(result: Estimate, options: OptionTable | None, site: SiteConfig) -> str:
    """The GPU type the answer shows: the site's pick with --config, else the estimate's (`shown_gpu`)."""
    chosen = options.chosen if options is not None else None
    return shown_gpu(result, chosen.gpu_type if chosen is not None else None, site.catalog())


def _site_options(result: Estimate, site: SiteConfig) -> OptionTable | None:
    """The site's offers for a one-GPU job in its default partition, from the peak per GPU type."""
    if not result.used_cuda:
        return None
    peaks = {name: job_peak(g) for name, g in result.gpus.items()}
    return site_option_table(peaks, site)


def _prepare_pictures(plot: Optional[str], snapshot: Optional[str], plot_gpu: Optional[str],
                      gpus: Optional[list[str]], site: SiteConfig, settings: dict[str, Any]) -> Optional[dict]:
    """Check the picture options before tracing; the dict that will keep the traces, or None without pictures."""
    if not (plot or snapshot):
        return None
    check_outputs(plot, snapshot)
    check_plot_gpu(plot_gpu, gpus, site.catalog())
    settings["keep_traces"] = traces = {}
    return traces


def _write_pictures(result: Estimate, traces: dict, plot: Optional[str], snapshot: Optional[str],
                    plot_gpu: Optional[str], site: SiteConfig, options: Optional[OptionTable]) -> None:
    run = KeptRun(result.command, result, traces, dict(os.environ), None)
    chosen = options.chosen if options is not None else None
    for line in write_pictures(run, plot=plot, snapshot=snapshot, gpu_name=plot_gpu, chosen=chosen,
                               catalog_overrides=site.catalog_overrides or None):
        sys.stderr.write(line + "\n")


def _estimate_with_progress(err: Console, command: list[str], settings: dict[str, Any]) -> Estimate:
    if not err.is_terminal:
        return run_estimate(command, **settings)
    with err.status(f"tracing {' '.join(command)}") as status:
        return run_estimate(command, **settings, on_progress=lambda message: status.update(str(message)))


def with_margin(record: dict[str, Any], margin: MarginConfig) -> dict[str, Any]:
    """`Estimate.to_json()` with the site margin (`margin`) and, per GPU type, `needed_bytes` (the peak with the
    margin, or what a replay that ran out would need) and `fits_with_margin`: "fits" as `check` and `fit` mean it.
    `fits` stays the peak against the GPU's memory with no margin."""
    for g in record["gpus"].values():
        g["needed_bytes"] = margin.needed(g["unlimited_peak_bytes"] or g["peak_bytes"])
        g["fits_with_margin"] = g["fits"] and g["needed_bytes"] <= g["total_bytes"]
    return {**record, "margin": {"relative": margin.relative, "absolute_bytes": margin.absolute_bytes}}


def shown_warnings(warnings: Sequence[str], verbose: bool) -> list[str]:
    """The lines a person sees: each note that can change the figures or the program's path (all of them with
    --verbose; the quiet ones are the tracer's bookkeeping: `NoteKind.quiet`), in its kind's words for people, and a
    note saying how many were left out. Rich markup; escaped text."""
    notes = [as_note(warning) for warning in warnings]
    shown = [note for note in notes if verbose or not note.quiet]
    hidden = len(notes) - len(shown)
    return [f"[yellow]warning:[/] {escape(note.for_people())}" for note in shown] + (
        [f"[dim]{hidden} more note(s) of the tracer, which do not change the figures: --verbose shows them[/]"]
        if hidden else [])


def show_estimate(console: Console, result: Estimate, margin: MarginConfig = MarginConfig(),
                  verbose: bool = False, shown: str | None = None) -> None:
    """The estimate for people: one row per GPU type, then the breakdown at the peak on the type shown (`shown`,
    default the estimate's `breakdown_gpu`; its row is marked, --plot draws it), why the estimate is suspect (if it
    is), warnings and time. "fits" applies the site margin, as `check` and `fit` do."""
    shown = shown if shown in result.breakdowns else result.breakdown_gpu  # a record from before `breakdowns`
    table = Table(title=f"Predicted peak GPU memory of: {' '.join(result.command)}")
    compact = console.width < WIDE_COLUMNS  # headroom is memory less peak; torch's words go below the table
    add_gpu_column(table)
    for column in ("predicted peak", "with margin", "GPU memory", *(() if compact else ("headroom",)), "verdict"):
        table.add_column(column, justify="left" if column == "verdict" else "right")
    below = []
    for g in sorted(result.gpus.values(), key=lambda g: g.total_bytes):
        needed = margin.needed(g.unlimited_peak_bytes or g.peak_bytes)
        peak, headroom, verdict = size_text(g.peak_bytes), size_text(g.headroom_bytes), "[green]fits[/]"
        if g.fits and needed > g.total_bytes:
            verdict = "[yellow]fits without the margin only[/]"
        if not g.fits:
            # the replay stopped where the real job would crash: show what it would need, and torch's own words
            needs = g.unlimited_peak_bytes or g.peak_bytes
            peak, headroom = f"needs {size_text(needs)}", f"-{size_text(needs - g.total_bytes)}"
            oom = f"out of memory: {_tried(g.oom.message)}" if g.oom else ""
            verdict = "[red]does not fit[/]" + (f" ({oom})" if oom and not compact else "")
            below += [f"{g.gpu}: {oom}"] if oom and compact else []
        verdict += " [bold]*[/]" if g.gpu == shown and result.breakdown else ""
        table.add_row(g.gpu, peak, size_text(needed), size_text(g.total_bytes), *(() if compact else (headroom,)),
                      verdict)
    console.print(table)
    for line in below:
        console.print(escape(line), highlight=False)
    console.print(f"fits: the peak with the site margin ({margin_text(margin)}) is at most the GPU's memory, as in "
                  "`check` and `fit`", highlight=False)
    if result.breakdown:
        console.print(f"*: {shown}, the GPU type shown below and drawn by --plot", highlight=False)
    breakdown = result.breakdowns.get(shown, result.breakdown)
    if breakdown:
        peak = sum(breakdown.values())
        parts = Table(title=breakdown_title(result, shown))
        parts.add_column("category")
        parts.add_column("memory", justify="right")
        parts.add_column("share", justify="right")
        for category, nbytes in sorted(breakdown.items(), key=lambda kv: -kv[1]):
            share = f"{100 * nbytes / peak:.1f} %" if peak else "-"
            parts.add_row(PART_NAMES.get(category, category.replace("_", " ")), size_text(nbytes), share)
        console.print(parts)
    for reason in result.suspect_reasons:
        console.print(f"[red]suspect:[/] {reason}", highlight=False)
    if result.suspect:
        console.print("[red]The trace contradicts the run's own objects: these figures may be far too low.[/]",
                      highlight=False)
    for line in shown_warnings(result.warnings, verbose):
        console.print(line, highlight=False)
    traced = "forward passes only (no training step)" if result.forward_only else \
        f"{result.iterations} iteration(s)"
    console.print(f"{traced} traced in {result.seconds:.1f} s"
                  f" (torch {result.torch_version or 'unknown'} on {result.interpreter or 'an unknown interpreter'}).",
                  highlight=False)


def breakdown_title(result: Estimate, shown: str) -> str:
    """Where the breakdown is taken: at the peak; on a type the job does not fit, at the peak it would reach on a
    device large enough (`xmem.estimate.estimate_gpu`), which is what it needs."""
    g = result.gpus.get(shown)
    if g is not None and not g.fits and g.unlimited_peak_bytes:
        return f"What the job needs on {shown} (its peak)"
    return f"At the peak on {shown}"


def _tried(oom_message: str) -> str:
    """'Tried to allocate 1000.00 MiB' out of torch's out-of-memory message, or the message's first sentence."""
    found = re.search(r"Tried to allocate [^.]+(?:\.\d+ \w+)?", oom_message)
    return found.group(0) if found else oom_message.split(". ")[0]
