"""`xmem-slurm calibrate`: fit the per-GPU-type overhead (context + libraries) from real runs and our estimates.

Owns the command's I/O: reading the measurements and the benchmark's estimates, joining them, printing the fit,
and writing the site's calibration: the file the site config's `[catalog] calibration` names (default
/etc/xmem/calibration.toml; every estimate reads it), or `--out` (the project's own, shipped in the package:
`--out xmem/gpus/calibration.toml`). Never the installed package by default: an upgrade would replace it. The model
and the fit are `xmem.bench.overhead_fit`.

    xmem-slurm calibrate --data benchmarks/data/xmem-dev.jsonl --estimates benchmarks/results/dev/estimates.jsonl
    xmem-slurm calibrate --from-store [--store S] [--config SITE]   # the site's own jobs (xmem.slurm.store_fit)

Exit codes: 0 written (or printed with --dry-run), 2 unusable input.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from xmem.bench.overhead_fit import OverheadSample, calibration_toml, fit_overheads
from xmem.bench.records import BadRecord, Reference, load_references
from xmem.cli import app
from xmem.cli.common import add_gpu_column
from xmem.gpus import UnknownGpuError, find_gpu, load_catalog
from xmem.gpus.catalog import SITE_CALIBRATION_PATH, site_calibration_path
from xmem.slurm.store import DEFAULT_STORE
from xmem.slurm.store_fit import MAX_MOVE_BYTES, MIN_USERS, TRUSTED_MEASUREMENTS
from xmem.units import MIB



class CalibrationInputError(ValueError):
    pass


def read_estimates(path: Path) -> dict[str, dict]:
    """The benchmark's estimate lines by record path."""
    lines = {}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if text.strip():
            try:
                line = json.loads(text)
                lines[line["path"]] = line
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CalibrationInputError(f"{path}:{number}: not an estimates.jsonl line ({e})") from None
    return lines


def allocator_reserved(ref: Reference, line: dict) -> int | None:
    """The allocator's reserved peak of the run: measured when the record has it, else our simulated one."""
    if ref.measured_reserved_bytes is not None:
        return ref.measured_reserved_bytes
    return line.get("peak_reserved_bytes")


def samples_from(refs: list[Reference], estimates: dict[str, dict]) -> list[OverheadSample]:
    """One sample per run whose NVML peak is a real peak (no real OOM) and whose estimate reached the end."""
    catalog = load_catalog(calibration_path=None)  # names only: the shipped catalog
    samples = []
    for ref in refs:
        line = estimates.get(ref.path)
        if ref.real_oom or line is None or line.get("oom") is not False:
            continue
        reserved = allocator_reserved(ref, line)
        if reserved is None:
            continue
        gpu = find_gpu(ref.gpu_name, catalog).name
        samples.append(OverheadSample(gpu, ref.ground_bytes - reserved, frozenset(line.get("libraries", ())),
                                      ref.ground_has_context))
    return samples


def show_fits(console: Console, fits) -> None:
    table = Table(title="Fitted non-allocator overhead per GPU type")
    add_gpu_column(table)
    for name in ("runs", "context MiB", "unclamped base MiB", "library terms MiB", "spread p10-p90 MiB"):
        table.add_column(name, justify="right")
    for fit in fits.values():
        terms = ", ".join(f"{lib} {n / MIB:.0f}" for lib, n in fit.library_bytes.items())
        context = "catalog's" if fit.context_bytes is None else f"{fit.context_bytes / MIB:.0f}"
        table.add_row(fit.gpu, str(fit.samples), context, f"{fit.raw_base_bytes / MIB:.0f}", terms,
                      f"{fit.spread_bytes / MIB:.0f}")
    console.print(table)


@app.command("calibrate")
def calibrate_command(
    data: Optional[Path] = typer.Option(None, "--data",
                                        help="Real runs (JSONL: the shared data's or measure_gpu.py's schema)."),
    estimates: Optional[Path] = typer.Option(None, "--estimates",
                                             help="scripts/bench_accuracy.py's estimates.jsonl for the same records."),
    from_store: bool = typer.Option(False, "--from-store",
                                    help="Fit on the Epilog's records of the site's jobs instead (--store)."),
    store: Optional[str] = typer.Option(None, "--store", help="With --from-store: the record store "
                                                              f"(default: $XMEM_STORE, else {DEFAULT_STORE})."),
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="The site config: its [catalog] calibration is where the fit is "
                                              "written; with --from-store, also its MIG slices and catalog."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the calibration TOML (default: the site "
                                                           "config's [catalog] calibration, else "
                                                           f"{SITE_CALIBRATION_PATH})."),
    quantile: float = typer.Option(0.5, "--quantile", min=0.0, max=1.0,
                                   help="Quantile of the residuals taken as the fitted overhead (0.5: median)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the fit and the TOML; write nothing."),
    min_users: int = typer.Option(MIN_USERS, "--min-users", min=1,
                                  help="With --from-store: distinct users a GPU type's fit needs."),
    max_move_mib: int = typer.Option(MAX_MOVE_BYTES // MIB, "--max-move-mib", min=0,
                                     help="With --from-store: how far one fit may move a type's overhead (MiB)."),
    sacct: bool = typer.Option(False, "--sacct",
                               help="With --from-store: take each job's peak from Slurm's accounting (gres/gpumem "
                                    "in sacct's TRESUsageInMax) where NVML gave none."),
    trust_job_files: bool = typer.Option(False, "--trust-job-files",
                                         help="With --from-store: also count peaks the jobs wrote themselves "
                                              "(XMEM_MEASURE_FILE), which their users control."),
) -> None:
    """Fit CUDA context + per-library overhead per GPU type from real runs, and write the calibration file."""
    err = Console(stderr=True)
    out = out or _site_calibration(err, config)
    if from_store:
        trusted = TRUSTED_MEASUREMENTS | {"file"} if trust_job_files else TRUSTED_MEASUREMENTS
        _calibrate_from_store(err, store, config, out, quantile, dry_run,
                              StoreRules(trusted, min_users, max_move_mib * MIB, sacct))
        return
    if data is None or estimates is None:
        err.print("[red]error:[/] give --data and --estimates (a benchmark's runs), or --from-store")
        raise typer.Exit(2)
    try:
        samples = samples_from(load_references(data), read_estimates(estimates))
    except (OSError, BadRecord, CalibrationInputError, UnknownGpuError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if not samples:
        err.print(f"[red]error:[/] no usable run: {estimates} has no estimate without OOM for a record of {data} "
                  "without OOM; run scripts/bench_accuracy.py on the same data first")
        raise typer.Exit(2)
    fits = fit_overheads(samples, quantile)
    today = datetime.date.today().isoformat()
    provenance = (f"fitted on {data} against {estimates} by `xmem-slurm calibrate --data {data} "
                  f"--estimates {estimates} --quantile {quantile}` on {today}")
    text = calibration_toml(fits, provenance)
    show_fits(Console(stderr=True, width=120), fits)
    if dry_run:
        typer.echo(text)
        return
    _write(err, out, text)


@dataclass(frozen=True)
class StoreRules:
    """What keeps one user's records from moving the site's calibration (xmem.slurm.store_fit)."""

    trusted: frozenset[str]
    min_users: int
    max_move_bytes: int
    sacct: bool = False  # ask Slurm's accounting for gres/gpumem


def _calibrate_from_store(err: Console, store: Optional[str], config: Optional[str], out: Path, quantile: float,
                          dry_run: bool, rules: StoreRules) -> None:
    """The fit on the site's own jobs; GPU types the store has no usable record of keep their calibration."""
    from xmem.config import ConfigError, load_site_config
    from xmem.slurm.node import NodeSettings, sacct_gpumem
    from xmem.slurm.store import read_store
    from xmem.slurm.store_fit import bounded, kept_tables, store_samples, with_slurm_accounting

    store = NodeSettings.read(os.environ, store=store).store
    if not os.path.exists(store):
        err.print(f"[red]error:[/] no record store at {store} (set --store or $XMEM_STORE)")
        raise typer.Exit(2)
    try:
        site = load_site_config(config)
    except ConfigError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    catalog = site.catalog()
    try:
        records, damaged = read_store(store)
    except OSError as e:
        err.print(f"[red]error:[/] cannot read the record store {store}: {e.strerror}")
        raise typer.Exit(2) from None
    if damaged:  # hand-edited or cut short: said, so that a short count of records is not a mystery
        err.print(f"{damaged} damaged line(s) of {store} left out (not a record the Epilog writes)")
    if rules.sacct:
        records = with_slurm_accounting(records, sacct_gpumem([r.job_id for r in records if r.measured_by != "nvml"]))
    found = store_samples(records, catalog, site.mig.parent_of, trusted=rules.trusted, min_users=rules.min_users)
    left_out = ", ".join(f"{n} {why}" for why, n in sorted(found.skipped.items()))
    if not found.samples:
        err.print(f"[red]error:[/] no usable record in {store} (a record needs an estimate and a peak measured by "
                  f"{' or '.join(sorted(rules.trusted))} of a job that ended well, on a GPU type at least "
                  f"{rules.min_users} users ran){': ' + left_out if left_out else ''}")
        raise typer.Exit(2)
    fits, held = bounded(fit_overheads(found.samples, quantile), catalog, rules.max_move_bytes)
    provenance = (f"fitted on the job records of {store} by `xmem-slurm calibrate --from-store --store {store} "
                  f"--quantile {quantile} --min-users {rules.min_users} --max-move-mib "
                  f"{rules.max_move_bytes // MIB}{' --sacct' if rules.sacct else ''}"
                  f"{' --trust-job-files' if 'file' in rules.trusted else ''}` on "
                  f"{datetime.date.today().isoformat()}, one run per user (the median of their jobs)")
    kept = kept_tables(_existing(err, out), fits)
    text = calibration_toml(fits, provenance) + (f"\n{kept}" if kept else "")
    show_fits(Console(stderr=True, width=120), fits)
    if left_out:
        err.print(f"records left out: {left_out}")
    if held:
        err.print(f"held to a step of {rules.max_move_bytes // MIB} MiB from the calibration in effect: "
                  f"{', '.join(held)} (calibrate again on new records to go further)")
    if dry_run:
        typer.echo(text)
        return
    _write(err, out, text)


def _site_calibration(err: Console, config: Optional[str]) -> Path:
    """The calibration file every estimate of the site reads (xmem.gpus.catalog.site_calibration_path)."""
    from xmem.config import ConfigError, load_site_config

    try:
        return site_calibration_path(load_site_config(config).catalog_overrides)
    except ConfigError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None


def _existing(err: Console, out: Path) -> str:
    """The calibration file in effect (its other GPU types' tables are kept), "" when there is none yet."""
    try:
        return out.read_text() if out.exists() else ""
    except (OSError, UnicodeDecodeError) as e:  # hand-edited into another encoding, or not a file
        err.print(f"[red]error:[/] cannot read the calibration in effect, {out}: {e}; fix or move it, then run again")
        raise typer.Exit(2) from None


def _write(err: Console, out: Path, text: str) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # /etc/xmem on a site's first calibration
        out.write_text(text)
    except OSError as e:
        err.print(f"[red]error:[/] cannot write {out}: {e.strerror}")
        raise typer.Exit(2) from None
    err.print(f"wrote {out}")
