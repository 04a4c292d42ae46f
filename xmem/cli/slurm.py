"""Slurm glue commands: `filter` (for cli_filter.lua), `prolog` (TaskProlog), `root-prolog` (Prolog), `epilog`
(Epilog), `report`.

Owns only the I/O: reading stdin and the environment, printing, exit codes, the site config's path. The logic
is in xmem.slurm (filter, deferred, node, store). Nothing heavy is imported at module level:
sbatch waits on `filter`, and a cached resubmission must stay well under a second.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import typer

from xmem.cli import app
from xmem.slurm.store import DEFAULT_STORE
from xmem.units import gib_text

ConfigOption = typer.Option(None, "--config", help="Site config (default: $XMEM_CONFIG, /etc/xmem/xmem.toml).")
# The store's and the measure directory's variables are read when the command runs (xmem.slurm.node.NodeSettings).
StoreOption = typer.Option(None, "--store", help="The JSONL store of job records the epilog writes "
                                                 f"(default: $XMEM_STORE, else {DEFAULT_STORE}).")
MeasureDirOption = typer.Option(None, "--measure-dir", help="Where jobs leave their measured peak "
                                                            "(XMEM_MEASURE_FILE; default: $XMEM_MEASURE_DIR).")


def _load_config(explicit: Optional[str]) -> Any:
    from xmem.config import load_site_config

    return load_site_config(explicit)


@app.command("filter")
def filter_command(
    failure_mode: bool = typer.Option(False, "--failure-mode", help="Print the site's failure mode (open|closed)."),
    config: Optional[str] = typer.Option(None, "--config", help="Site config (default: /etc/xmem/xmem.toml; never "
                                                                 "$XMEM_CONFIG: the filter reads the site's only)."),
) -> None:
    """For slurm/cli_filter.lua: read one submission as JSON on stdin, print what to change as JSON on stdout.

    The contract is in slurm/README.md. Exits 0 whenever it printed a reply, a refusal included.
    (`python -m xmem.slurm.filter` is the same command without the rest of the CLI: faster under sbatch.)"""
    from xmem.slurm.contract import drop_user_settings
    from xmem.slurm.filter import filter_main

    drop_user_settings(os.environ)  # as `python -m xmem.slurm.filter` does
    raise typer.Exit(filter_main(config_path=config, failure_mode=failure_mode))


def _gpu_total_bytes(config: Any) -> Any:
    def total(gpu_type: str) -> Optional[int]:
        try:
            from xmem.config import SiteConfig
            from xmem.gpus import find_gpu

            return find_gpu(gpu_type, (config or SiteConfig()).catalog()).total_bytes
        except Exception:
            return None
    return total


@app.command("prolog")
def prolog_command(
    measure_dir: Optional[str] = MeasureDirOption,
    config: Optional[str] = ConfigOption,
) -> None:
    """For TaskProlog: print `export NAME=value` lines (estimate, MPS memory limit). Never fails the task."""
    try:
        from xmem.slurm.node import NodeSettings, prolog_exports

        try:
            site = _load_config(config)
        except Exception:
            site = None
        settings = NodeSettings.read(os.environ, measure_dir=measure_dir)
        for name, value in prolog_exports(os.environ, total_bytes_of=_gpu_total_bytes(site),
                                          measure_dir=settings.measure_dir):
            print(f"export {name}={value}")
    except Exception as e:
        print(f"xmem-slurm prolog: {type(e).__name__}: {e}", file=sys.stderr)


@app.command("root-prolog")
def root_prolog_command(
    measure_dir: Optional[str] = MeasureDirOption,
    mps_control: str = typer.Option("nvidia-cuda-mps-control", "--mps-control",
                                    help="The MPS control program; absent from PATH: the site runs no MPS."),
) -> None:
    """For Prolog (root, on the node, before the job): the job's measure file, and for an MPS job the control
    daemon's memory limit from the share Slurm allocated. Never fails the job: errors go to stderr, exit 0."""
    import shutil

    from xmem.slurm.node import NodeSettings, enforce_mps_share, gpu_total_mib, job_uid, prepare_measure_file
    from xmem.text import ascii_whole_number

    env, uid = os.environ, job_uid(os.environ)
    job_id = env.get("SLURM_JOB_ID", "")
    settings = NodeSettings.read(env, measure_dir=measure_dir)
    if settings.measure_dir and uid >= 0:
        try:
            gid = ascii_whole_number(env.get("SLURM_JOB_GID"))
            gid = _gid_of(uid) if gid is None else gid
            prepare_measure_file(settings.measure_dir, uid, gid, job_id)
        except Exception as e:
            print(f"xmem-slurm root-prolog: job {job_id}: no measure file: {e}", file=sys.stderr)
    control = shutil.which(mps_control)
    if control and uid >= 0:
        try:
            enforce_mps_share(env, uid, control=control, total_mib_of=gpu_total_mib)
        except Exception as e:
            print(f"xmem-slurm root-prolog: job {job_id}: MPS memory limit not set: {e}", file=sys.stderr)


def _gid_of(uid: int) -> int:
    import pwd

    return pwd.getpwuid(uid).pw_gid


@app.command("epilog")
def epilog_command(
    store: Optional[str] = StoreOption,
    measure_dir: Optional[str] = MeasureDirOption,
) -> None:
    """For Epilog (root, on the node): append the finished job's record to the store."""
    from xmem.slurm.node import NodeSettings, epilog_record
    from xmem.slurm.store import append_record

    try:
        settings = NodeSettings.read(os.environ, store=store, measure_dir=measure_dir)
        record = epilog_record(os.environ, measure_dir=settings.measure_dir)
        if record is not None:
            append_record(settings.store, record)
    except Exception as e:
        print(f"xmem-slurm epilog: job {os.environ.get('SLURM_JOB_ID')}: {type(e).__name__}: {e}", file=sys.stderr)
        raise typer.Exit(1)


@app.command("report")
def report_command(
    store: Optional[str] = StoreOption,
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
    plot: Optional[str] = typer.Option(None, "--plot", metavar="FILE.png",
                                       help="Also draw estimate against measured peak per GPU type (PNG)."),
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="With --plot: the site config (MIG slices, catalog)."),
) -> None:
    """Estimate against measured peak, per GPU type, from the epilog's records."""
    import dataclasses

    from xmem.slurm.node import NodeSettings
    from xmem.slurm.store import read_records, summarize

    store = NodeSettings.read(os.environ, store=store).store
    if not os.path.exists(store):
        typer.echo(f"error: no record store at {store} (set --store or $XMEM_STORE)", err=True)
        raise typer.Exit(2)
    try:
        records = read_records(store)
    except OSError as e:
        typer.echo(f"error: cannot read the record store {store}: {e.strerror}", err=True)
        raise typer.Exit(2) from None
    summaries = summarize(records)
    if plot:
        _plot_store(records, plot, config, store)
    if as_json:
        typer.echo(json.dumps({"store": store, "records": len(records),
                               "gpu_types": [dataclasses.asdict(s) for s in summaries]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from xmem.cli.common import add_gpu_column

    def pct(x: Optional[float]) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    table = Table(title=f"xmem-slurm: estimate vs measured peak ({len(records)} jobs, {store})")
    add_gpu_column(table)
    # at 80 columns the figures wrap (folded where a word is longer than its column), never cut: GPU names whole
    for column in ("jobs", "measured", "median |err|", "p90 |err|", "mean err", "under-est.", "over request"):
        table.add_column(column, justify="right", overflow="fold")
    for s in summaries:
        table.add_row(s.gpu_type, str(s.jobs), str(s.measured), pct(s.median_abs_rel_error),
                      pct(s.p90_abs_rel_error), pct(s.mean_rel_error), str(s.underestimates), str(s.over_request))
    Console().print(table)


def _plot_store(records: list, path: str, config: Optional[str], store: str) -> None:
    """The figure of `report --plot`: the records that count for calibration, per catalog GPU type."""
    from xmem.config import ConfigError, load_site_config
    from xmem.report_plots import plot_store
    from xmem.slurm.store_fit import store_samples

    try:
        site = load_site_config(config)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    points = store_samples(records, site.catalog(), site.mig.parent_of, trusted=None).points
    if not points:
        typer.echo(f"error: no record in {store} has both an estimate and a measured peak: nothing to draw", err=True)
        raise typer.Exit(2)
    try:
        plot_store(points, path, title=f"Estimate against measured peak GPU memory ({store})")
    except OSError as e:
        typer.echo(f"error: cannot write {path}: {e.strerror}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}", err=True)


# A controller that answers does so in well under a second; one that does not (no configuration, configless Slurm's
# DNS lookups, a controller down) kept `status` waiting 31 s: a person asking is told at once instead.
STATUS_TIMEOUT_S = 5.0


@app.command("status")
def status_command(
    job_id: str = typer.Argument(..., help="The Slurm job id."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of lines."),
) -> None:
    """Where a job stands with xmem-slurm: estimate pending / done / failed, the line sbatch showed (why), the
    request before and now. Exit 2: Slurm does not know the job; 12: Slurm cannot be asked from here."""
    from xmem.cli.common import EXIT_NO_SLURM, EXIT_USAGE, fail
    from xmem.slurm.deferred import job_status
    from xmem.slurm.scontrol import SlurmUnreachable

    try:
        status = job_status(job_id, timeout_s=STATUS_TIMEOUT_S)
    except SlurmUnreachable as e:  # one line, not scontrol's pages of DNS retries
        fail(as_json, EXIT_NO_SLURM, "slurm_unreachable", f"Slurm is not reachable from here ({e})", verb="status")
    except LookupError as e:  # one line (and the JSON object), not scontrol's own error
        fail(as_json, EXIT_USAGE, "unknown_job", f"Slurm does not know job {job_id} ({e})", verb="status")
    if as_json:
        typer.echo(json.dumps(status, indent=2))
        return
    typer.echo(f"job {status['job_id']}: {status['job_state']} ({status['reason']})")
    typer.echo(f"estimate: {status['estimate']}" + (f" ({status['why']})" if status["why"] else ""))
    typer.echo(f"request before: {status['request_before'] or '-'}")
    typer.echo(f"request now:    {status['request_now'] or '-'}")
    if status.get("fix"):
        typer.echo(f"to run it as submitted: {status['fix']}")
    stamp = status["stamp"]
    if stamp and stamp.get("peak_bytes"):
        typer.echo(f"peak {gib_text(stamp['peak_bytes'])} on {stamp['gpu_type']}, request sized for "
                   f"{gib_text(stamp['needed_bytes'] or 0)}")
