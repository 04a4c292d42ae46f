"""`xmem-slurm check JOB.sh [ARGS...]`: what sbatch would do with this job, without submitting it.

Owns the command's I/O: the parsed job, the estimate per eligible GPU type and the request with its reason, as
tables for people or one JSON object (`--json`), and the exit codes: 0 analysed (whatever the decision), 2 bad
input or site config, 8 script not understood, 3-7 and 9 the estimator's (as `xmem-slurm estimate`), 14 no offer
fits (the decision names the largest batch size that does), 1 internal.
The work is `xmem.analyze.analyze_job`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from xmem.analyze import JobAnalysis, analyze_job
from xmem.cli import app
from xmem.cli.common import (EXIT_INTERNAL, EXIT_NO_FIT, EXIT_NOT_UNDERSTOOD, EXIT_USAGE, JSON_OPTION, PLOT_OPTION,
                             TRACE_EXIT_CODES, VERBOSE_OPTION, add_gpu_column, fail, margin_text, show_options,
                             shown_gpu, stdout_to_stderr, timeout_option)
from xmem.cli.estimate import breakdown_title, shown_warnings
from xmem.cli.pictures import KeepingEstimator, PictureError, check_outputs, check_plot_gpu, write_pictures
from xmem.config import DEFAULT_CONFIG_PATH, ConfigError, SiteConfig, load_site_config
from xmem.policy import gres_memory_bytes
from xmem.slurm.cluster import ask_slurm
from xmem.slurm.from_check import SharedAnalysis, check_request
from xmem.text import one_line
from xmem.trace import privileges
from xmem.units import MIB, gib_text, size_text

if TYPE_CHECKING:
    from xmem.estimate_record import Estimate

EXIT_OK = 0
# The estimator's codes are `xmem-slurm estimate`'s; the analysis adds its own kinds.
ANALYSIS_EXIT_CODES = {**TRACE_EXIT_CODES, "unknown_gpu": EXIT_USAGE, "bad_input": EXIT_USAGE,
                       "no_gpu_types": EXIT_USAGE, "not_understood": EXIT_NOT_UNDERSTOOD, "not_as_root": EXIT_USAGE}


@app.command("check")
def check_command(
    script: Optional[str] = typer.Argument(None, metavar="JOB.sh",
                                           help="The batch script, as you would give it to sbatch."),
    args: Optional[list[str]] = typer.Argument(None, metavar="[ARGS]...",
                                               help="The script's own arguments (after `--` if one starts with -)."),
    as_json: bool = JSON_OPTION,
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="Site config (default: $XMEM_CONFIG, else /etc/xmem/xmem.toml)."),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", "-g", metavar="TYPE",
                                            help="Estimate for this GPU type (repeatable) instead of the "
                                                 "partition's types."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p",
                                            help="As sbatch -p: overrides the script's #SBATCH --partition."),
    gres: Optional[str] = typer.Option(None, "--gres", help="As sbatch --gres: overrides the script's."),
    gpus: Optional[str] = typer.Option(None, "--gpus", "-G", help="As sbatch --gpus: overrides the script's."),
    wrap: Optional[str] = typer.Option(None, "--wrap", metavar="COMMAND",
                                       help="As sbatch --wrap: check this command instead of a script."),
    vary: Optional[str] = typer.Option(None, "--vary", metavar="NAME=LOW..HIGH",
                                       help="The largest value of the command's --NAME that fits each GPU type and "
                                            "offer (as `xmem-slurm fit`), instead of one estimate."),
    plot: Optional[str] = PLOT_OPTION,
    plot_gpu: Optional[str] = typer.Option(None, "--plot-gpu", metavar="TYPE",
                                           help="GPU type of --plot and --snapshot (default: the one picked)."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", metavar="FILE.pickle",
                                           help="Write the simulated run as a torch.cuda.memory snapshot."),
    timeout: Optional[float] = timeout_option("Give up tracing after S seconds (default: the site's "
                                              "estimate.timeout_s)."),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", min=1,
                                             help="Optimizer steps to trace (default: the site's)."),
    python: Optional[str] = typer.Option(None, "--python", help="Python interpreter for commands that name none "
                                         "(default: the site's estimate.python, else this one)."),
    step: Optional[int] = typer.Option(None, "--step", min=1, metavar="N",
                                       help="With --vary: answer in multiples of N (as `xmem-slurm fit --step`)."),
    verbose: bool = VERBOSE_OPTION,
) -> None:
    """Show what xmem would ask Slurm for: the parsed job, the estimate per GPU type, the request and why."""
    err = Console(stderr=True)
    if (script is None) == (wrap is None):
        fail(as_json, EXIT_USAGE, "bad_option", "give a batch script or --wrap COMMAND (one of them)", verb="check")
    if script is not None and _is_python_program(script):
        fail(as_json, EXIT_USAGE, "not_a_batch_script", f"{script} is a Python program, not a batch script: use "
             f"`xmem-slurm estimate -- python {script}`", verb="check")
    # issue 21: root never runs another user's program: this same check runs as them, or is refused
    privileges.rerun_cli_as_owner([script or ""], lambda why: fail(as_json, EXIT_USAGE, "not_as_root", why,
                                                                  verb="check"))
    try:
        site = _with_estimate_options(load_site_config(config), timeout, iterations, python)
    except ConfigError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb="check")
    given = {"partition": partition, "gres": gres, "gpus": gpus}
    cli_options = {name: value for name, value in given.items() if value} or None
    if vary:  # what-if on the job's own knob (xmem.cli.fit) instead of one estimate
        from xmem.cli.fit import fit_job

        with _script_file(script, wrap) as path:
            fit_job(path, list(args or ()), cli_options, site, gpu, vary, as_json, step=step)
        raise typer.Exit(EXIT_OK)
    estimator = _picture_estimator(as_json, plot, snapshot, plot_gpu, site)
    # what sbatch of this job will look up: the same job as the filter sees it (not another GPU type's, trace length's
    # or interpreter's analysis, nor a --wrap, whose script is a temporary file)
    shared = None if gpu or iterations or python or script is None else SharedAnalysis.start(
        script, check_request(script, list(args or ()), cli_options, os.environ, os.getcwd()), site)
    try:
        with _script_file(script, wrap) as path:
            analysis = _analyze(err, as_json, path, list(args or ()), cli_options, site, gpu, estimator)
    except Exception as e:  # noqa: BLE001 - our bug: one line, the right exit code
        fail(as_json, EXIT_INTERNAL, "internal", f"internal error: {type(e).__name__}: {e}", verb="check")
    analysis = _without_site_config(analysis, config, gpu)
    if shared is not None:
        shared.file(analysis)
    if estimator is not None and estimator.runs:
        _write_pictures(as_json, estimator, analysis, plot, snapshot, plot_gpu)
    code = exit_code(analysis)
    if as_json:
        sys.stdout.write(json.dumps({**analysis.to_json(), "exit_code": code}) + "\n")
        sys.stdout.flush()
    else:
        show_analysis(Console(), analysis, site, verbose)
        for error in analysis.errors:
            if error.user_traceback:
                sys.stderr.write(error.user_traceback.rstrip("\n") + "\n")
            if error.kind == "not_understood" and analysis.job and analysis.job.problems:
                line = f"not understood: {len(analysis.job.problems)} problem(s) listed above"
            else:
                line = one_line(error)
            sys.stderr.write(f"xmem-slurm check: {line}\n")
    raise typer.Exit(code)


def _is_python_program(script: str) -> bool:
    """A `.py` file, or one whose #! line names python: what `estimate` takes, not a batch script."""
    if script.endswith(".py"):
        return True
    try:
        with open(script, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False  # the analysis says why it cannot be read
    return first.startswith(b"#!") and b"python" in first


def _without_site_config(analysis: JobAnalysis, config: Optional[str], gpus: Optional[list[str]]) -> JobAnalysis:
    """With no site config, the user's words instead of the admin's: --gpu names the types (and a note says so),
    and without --gpu the one thing to do is to name them."""
    if config or os.environ.get("XMEM_CONFIG") or DEFAULT_CONFIG_PATH.is_file():
        return analysis
    if gpus:
        note = (f"no site config (--config, $XMEM_CONFIG, {DEFAULT_CONFIG_PATH}): estimated for --gpu "
                f"{', '.join(gpus)}; which request to make is the site's choice, so none is picked")
        return replace(analysis, notes=(note, *analysis.notes), decision=None, options=None)
    errors = tuple(replace(e, message=f"no site config (--config, $XMEM_CONFIG, {DEFAULT_CONFIG_PATH}) says which "
                           "GPU types the job may get: name them with --gpu TYPE (`xmem-slurm gpus` lists them)")
                   if e.kind == "no_gpu_types" else e for e in analysis.errors)
    return replace(analysis, errors=errors)


def _with_estimate_options(site: SiteConfig, timeout: Optional[float], iterations: Optional[int],
                           python: Optional[str]) -> SiteConfig:
    """The site config with the estimate settings given on the command line in place of its own."""
    given = {"timeout_s": timeout, "iterations": iterations, "python": python}
    given = {name: value for name, value in given.items() if value is not None}
    return replace(site, estimate=replace(site.estimate, **given)) if given else site


@contextmanager
def _script_file(script: Optional[str], wrap: Optional[str]) -> Iterator[str]:
    """The script to analyse; for --wrap, a temporary one holding the command as sbatch writes it."""
    if script is not None:
        yield script
        return
    with tempfile.NamedTemporaryFile("w", prefix="xmem-wrap-", suffix=".sh") as f:
        f.write(f"#!/bin/sh\n# This script was created by sbatch --wrap.\n\n{wrap}\n")
        f.flush()
        yield f.name


def exit_code(analysis: JobAnalysis) -> int:
    """0 when a decision was made, EXIT_NO_FIT when it is that no offer fits (as `estimate` says a job that fits no
    GPU type asked); else the code of the first error."""
    if analysis.decision is not None and analysis.decision.action == "no_fit":
        return EXIT_NO_FIT
    if analysis.decision is not None or not analysis.errors:
        return EXIT_OK
    return ANALYSIS_EXIT_CODES.get(analysis.errors[0].kind, EXIT_INTERNAL)


def _picture_estimator(as_json: bool, plot: Optional[str], snapshot: Optional[str], plot_gpu: Optional[str],
                       site: SiteConfig) -> Optional[KeepingEstimator]:
    """With --plot or --snapshot: the estimator that keeps the traces (the options checked first), else None."""
    if not (plot or snapshot):
        return None
    try:
        check_outputs(plot, snapshot)
        check_plot_gpu(plot_gpu, None, site.catalog())
    except PictureError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb="check")
    return KeepingEstimator()


def _write_pictures(as_json: bool, estimator: KeepingEstimator, analysis: JobAnalysis, plot: Optional[str],
                    snapshot: Optional[str], plot_gpu: Optional[str]) -> None:
    chosen = analysis.options.chosen if analysis.options is not None else None
    try:
        drawn = next((run for run in estimator.runs if run.estimate.used_cuda), estimator.runs[0])  # a GPU command
        lines = write_pictures(drawn, plot=plot, snapshot=snapshot, gpu_name=plot_gpu, chosen=chosen)
    except PictureError as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb="check")
    for line in lines:
        sys.stderr.write(line + "\n")


def _analyze(err: Console, as_json: bool, script: str, args: list[str], cli_options: Any, site: SiteConfig,
             gpus: Optional[list[str]], estimator: Optional[KeepingEstimator] = None) -> JobAnalysis:
    def run(on_progress: Any = None) -> JobAnalysis:
        return analyze_job(script, script_args=args, cli_options=cli_options, config=site, gpus=gpus or None,
                           on_progress=on_progress, estimator=estimator, cluster=ask_slurm)

    if as_json:

        with stdout_to_stderr():
            return run()
    if not err.is_terminal:
        return run()
    with err.status(f"analysing {script}") as status:
        return run(lambda message: status.update(str(message)))


def show_analysis(console: Console, analysis: JobAnalysis, site: SiteConfig, verbose: bool = False) -> None:
    """The analysis for people: job, commands, problems, estimate per GPU type, decision. Text that comes from
    the script is escaped: `[...]` in it is not Rich markup."""
    job = analysis.job
    if job is None:
        return
    request = job.directives
    console.print(f"[bold]Job[/] {escape(job.path or '')}")
    if request.raw:
        lines = {line_no for _, _, line_no in request.raw}
        caption = "line 0: sbatch command line; -1: SBATCH_* variable" if lines & {0, -1} else None
        table = Table(title="Slurm options", caption=caption)
        for column in ("line", "option", "value"):
            table.add_column(column)
        for option, value, line_no in request.raw:
            table.add_row(str(line_no), f"--{option}", escape(value) if value is not None else "")
        console.print(table)
    console.print("GPU request: " + (", ".join(str(i) for i in request.gpu_items) or "none"))
    if job.het_line:
        console.print(f"[yellow]heterogeneous job[/] (#SBATCH hetjob, line {job.het_line}): sbatch through xmem "
                      "leaves it unchanged; what follows reads its components as one job")
    for command in job.commands:
        extra = [f"cwd {command.cwd}"] if command.cwd else []
        extra += [f"python {command.python}"] if command.python else []
        extra += [f"{command.ranks} ranks per node (one estimated)"] if command.ranks and command.ranks > 1 else []
        console.print(f"command (line {command.line_no}, {command.launcher}): [cyan]{escape(' '.join(command.argv))}"
                      "[/]" + (f"  ({escape('; '.join(extra))})" if extra else ""))
    # a script run whole (xmem.jobscript: what the static read could not name) lists what it could not read as notes
    label = "read by running it" if any(c.launcher == "batch script" for c in job.commands) else "not understood"
    for problem in job.problems:
        console.print(f"[yellow]{label}:[/] {escape(str(problem))}")
    chosen = analysis.options.chosen if analysis.options is not None else None
    picked = chosen.gpu_type if chosen is not None else None
    _show_estimates(console, analysis, site, chosen.gres_type if chosen is not None else None)
    for estimate in analysis.estimates:
        if estimate.skipped:
            console.print(f"[yellow]skipped:[/] {escape(estimate.skipped)}")
        if estimate.estimate is not None:
            shown = shown_gpu(estimate.estimate, picked, site.catalog())
            _show_estimate(console, estimate.command.line_no, estimate.estimate, verbose, shown)
    _show_offers(console, analysis)
    for note in analysis.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    decision = analysis.decision
    if decision is not None:
        what = {"rewrite": f"request --{decision.option}={decision.gres or decision.gpus}",
                "keep": "keep the request as written", "none": "leave the job alone (no GPU)",
                "excluded": "leave the job alone (excluded)", "no_fit": "no request fits"}[decision.action]
        console.print(f"[bold]Decision:[/] {escape(what)}: {escape(decision.reason)}")


def _show_estimate(console: Console, line_no: int, estimate: Estimate, verbose: bool = False,
                   shown: str = "") -> None:
    """One command's breakdown at the peak on the GPU type shown (`shown_gpu`: the site's pick, else the
    estimate's), its self-audit and its warnings."""
    shown = shown if shown in estimate.breakdowns else estimate.breakdown_gpu  # a record from before `breakdowns`
    breakdown = estimate.breakdowns.get(shown, estimate.breakdown)
    if breakdown:
        parts = ", ".join(f"{name.replace('_', ' ')} {size_text(n, mib_digits=0)}" for name, n in
                          sorted(breakdown.items(), key=lambda kv: -kv[1]) if n >= MIB)
        where = breakdown_title(estimate, str(shown))
        console.print(f"line {line_no}, {escape(where[0].lower() + where[1:])}: {escape(parts)}")
    for reason in estimate.suspect_reasons:
        console.print(f"[red]suspect:[/] {escape(reason)}")
    for line in shown_warnings(estimate.warnings, verbose):
        console.print(line)


def _show_estimates(console: Console, analysis: JobAnalysis, site: SiteConfig, picked: Optional[str] = None) -> None:
    """The peak per GPU type; the site's pick (`picked`, its GRES type: the type shown below and drawn by --plot)
    marked *."""
    if not analysis.peaks:
        return
    table = Table(title="Predicted peak GPU memory per rank",
                  caption=f"fits: the peak with the site margin ({margin_text(site.margin)}) is at most the GPU's "
                          "memory, as in `estimate` and `fit`" + ("; *: the type picked, shown below and drawn by "
                                                                   "--plot" if picked else ""))
    add_gpu_column(table)
    for column in ("predicted peak", "with margin", "GPU memory"):
        table.add_column(column, justify="right")
    catalog = site.catalog()
    for gpu_type, peak in analysis.peaks.items():
        total = gres_memory_bytes(gpu_type, site.mig.parent_of(gpu_type), catalog)
        needed = site.margin.needed(peak)
        style = "" if total is None or needed <= total else "[red]"
        # job_peak: a replay that ran out of memory needs more than the GPU, whatever it reached before
        whole = gres_memory_bytes(site.mig.parent_of(gpu_type) or gpu_type, None, catalog)
        shown = "[red]out of memory[/]" if whole and peak > whole else gib_text(peak)
        mark = " *" if picked and gpu_type == picked else ""
        table.add_row(gpu_type + mark, shown, f"{style}{gib_text(needed)}", gib_text(total) if total else "?")
    console.print(table)


def _show_offers(console: Console, analysis: JobAnalysis) -> None:
    if analysis.options is not None and analysis.options.rows:
        show_options(console, analysis.options)


__all__ = ["check_command", "exit_code", "show_analysis"]
