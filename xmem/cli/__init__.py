"""The `xmem-slurm` command line: one module per group of verbs, all registered on one Typer app.

- `estimate`            xmem/cli/estimate.py   (the estimator)
- `check`               xmem/cli/check.py      (a batch script: parse, estimate, policy, no submission)
- `filter`, `prolog`, `epilog`, `report`, `status`
                        xmem/cli/slurm.py      (Slurm glue)
- `calibrate`           xmem/cli/calibrate.py  (per-GPU overhead fit)
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="xmem-slurm",
    help="Predict a PyTorch training job's peak GPU memory on CPU, per GPU type, and the Slurm request it needs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Keep sub-command names even if only one command is registered (Typer drops a lone command's name)."""


# Each module registers its commands on `app` when imported. A module that is not there yet is skipped,
# so the CLI works while the project grows.
_COMMAND_MODULES = ("estimate", "check", "slurm", "calibrate")


def _load_commands() -> None:
    for name in _COMMAND_MODULES:
        try:
            importlib.import_module(f"xmem.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"xmem.cli.{name}":
                raise


def main() -> None:
    _load_commands()
    app()
