"""`xmem-slurm gpus`: every GPU type the estimator knows, with its memory, the names it answers to and its MIG
profiles (the shipped catalog, merged with the site config's `[catalog]` when one is found)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from xmem.cli import app
from xmem.cli.common import EXIT_USAGE, JSON_OPTION, add_gpu_column, fail
from xmem.config import ConfigError, load_site_config
from xmem.gpus import CatalogError, GpuType
from xmem.units import size_text


@app.command("gpus")
def gpus_command(
    as_json: bool = JSON_OPTION,
    config: Optional[str] = typer.Option(None, "--config", metavar="PATH",
                                         help="Site config whose \\[catalog] applies (default: $XMEM_CONFIG, "
                                              "/etc/xmem/xmem.toml)."),
) -> None:
    """List every GPU type: memory as the driver reports it, aliases (any of them works for --gpu), MIG profiles."""
    try:
        catalog = load_site_config(config).catalog()
    except (ConfigError, CatalogError) as e:
        fail(as_json, EXIT_USAGE, "bad_option", str(e), verb="gpus")
    gpus = sorted(catalog.values(), key=lambda g: (g.total_bytes, g.name))
    if as_json:
        sys.stdout.write(json.dumps({"gpus": [gpu_json(g) for g in gpus]}) + "\n")
        return
    table = Table(title="GPU types (any name in a row works for --gpu; a100-80 works as a100-80gb does)")
    add_gpu_column(table)
    table.add_column("memory", justify="right")
    table.add_column("compute capability")
    for column in ("aliases", "MIG profiles"):  # names --gpu takes: folded onto the next line, never cut
        table.add_column(column, overflow="fold")
    for g in gpus:
        table.add_row(g.name, size_text(g.total_bytes), f"{g.capability[0]}.{g.capability[1]}",
                      ", ".join(g.aliases), ", ".join(p.name for p in g.mig_profiles) or "-")
    Console().print(table)


def gpu_json(gpu: GpuType) -> dict:
    return {"name": gpu.name, "total_bytes": gpu.total_bytes, "capability": list(gpu.capability),
            "aliases": list(gpu.aliases),
            "mig_profiles": [{"name": p.name, "memory_bytes": p.memory_bytes} for p in gpu.mig_profiles]}
