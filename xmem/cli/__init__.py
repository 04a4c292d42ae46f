"""The `xmem-slurm` command line: one module per group of verbs, all registered on one Typer app.

- `estimate`            xmem/cli/estimate.py   (the estimator)
- `check`               xmem/cli/check.py      (a batch script: parse, estimate, policy, no submission)
- `filter`, `prolog`, `root-prolog`, `epilog`, `report`, `status`
                        xmem/cli/slurm.py      (Slurm glue)
- `calibrate`           xmem/cli/calibrate.py  (per-GPU overhead fit)
- `fit`                 xmem/cli/fit.py        (the largest value of one knob that fits each offer)
- `gpus`                xmem/cli/gpus.py       (the GPU types, their memory, aliases and MIG profiles)
- `admin ...`           xmem/cli/admin.py      (a site's install: the Slurm files, filled in)
- `warm`                xmem/cli/warm.py       (the warm tracer's servers: memory, idle time; --stop)

Shell completion (typer's): `xmem-slurm --install-completion` (bash, zsh, fish; then a new shell),
`xmem-slurm --show-completion` prints the script instead.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.markup import escape

from xmem.cli.exit_codes import table_lines

app = typer.Typer(
    name="xmem-slurm",
    help="Predict a PyTorch training job's peak GPU memory on CPU, per GPU type, and the Slurm request it needs.",
    # the one exit-code table (xmem/cli/exit_codes.py), one line per code; `filter` exits 0 whenever it replied
    epilog=escape("Exit codes (README.md has the same table):\n"
                  + "\n".join(table_lines())),
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion (issue 32: they were off)
    pretty_exceptions_enable=False,
)


def _print_version(wanted: bool) -> None:
    if wanted:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"xmem-slurm {version('xmem-slurm')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("xmem-slurm (not installed: version unknown)")
        raise typer.Exit(0)


@app.callback()
def _root(_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                        help="Print the version and exit.")) -> None:
    """Keep sub-command names even if only one command is registered (Typer drops a lone command's name)."""


# Which module registers which command (each module does `@app.command()` when imported). Only the module of the
# command being run is imported: the node-side verbs (prolog, epilog) stay fast and do not depend on the estimator.
COMMAND_MODULES: dict[str, str] = {
    "estimate": "estimate",
    "check": "check",
    "filter": "slurm", "prolog": "slurm", "root-prolog": "slurm", "epilog": "slurm", "report": "slurm",
    "status": "slurm",
    "calibrate": "calibrate",
    "fit": "fit",
    "gpus": "gpus",
    "admin": "admin",
    "warm": "warm",
}


def _load_commands(argv: list[str]) -> None:
    if argv[:1] == ["--version"]:
        return
    wanted = COMMAND_MODULES.get(argv[0]) if argv else None
    modules = [wanted] if wanted else sorted(set(COMMAND_MODULES.values()))  # help or an unknown verb: all
    for name in modules:
        importlib.import_module(f"xmem.cli.{name}")


def main() -> None:
    _load_commands(sys.argv[1:])
    app()
