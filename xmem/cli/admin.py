"""`xmem-slurm admin ...`: what a site's administrator runs once per install or upgrade.

- `install-slurm-files --to DIR`: the Slurm files shipped with the package (cli_filter.lua, the Prolog, TaskProlog
  and Epilog scripts, slurm.conf/gres.conf snippets and their README) with their `@NAME@` settings filled in from
  this install (`xmem.slurm.site_files`), and the example site config as xmem.toml.example; then what to put in
  slurm.conf. Exit 0 written, 2 a setting that cannot be used or files already there without --replace.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

import typer

from xmem.cli import app

admin_app = typer.Typer(help="For the site's administrator: install the Slurm files of this xmem-slurm.",
                        no_args_is_help=True)
app.add_typer(admin_app, name="admin")

LUA_STARTUP_S = 30  # the Lua side's limit beyond the config's estimate timeout: xmem-slurm's own start
DEFAULT_MEASURE_DIR = "/var/lib/xmem/measure"


@admin_app.command("install-slurm-files")
def install_slurm_files_command(
    to: Path = typer.Option(..., "--to", metavar="DIR", help="Where to write them (cli_filter.lua belongs in the "
                                                             "directory of slurm.conf)."),
    config: str = typer.Option("", "--config", metavar="PATH",
                               help="The site config the filter and node scripts read (default: /etc/xmem/xmem.toml)."),
    python: str = typer.Option(sys.executable, "--python", help="The Python that has xmem-slurm installed."),
    xmem_slurm: Optional[str] = typer.Option(None, "--xmem-slurm", help="The xmem-slurm executable (default: the "
                                                                        "one beside --python, else on PATH)."),
    failure: str = typer.Option("open", "--failure", help="open or closed: only when the config cannot be read."),
    store: Optional[str] = typer.Option(None, "--store", help="The Epilog's record store (default "
                                                              "/var/lib/xmem/records.jsonl)."),
    measure_dir: str = typer.Option(DEFAULT_MEASURE_DIR, "--measure-dir",
                                    help="root's directory (0755, node-local) for each job's measure file."),
    replace: bool = typer.Option(False, "--replace", help="Replace files already there (an upgrade)."),
) -> None:
    """Write the Slurm files, filled in for this install, and say what slurm.conf needs."""
    from xmem.config import ConfigError, load_site_config
    from xmem.slurm.site_files import SiteFilesError, install
    from xmem.slurm.store import DEFAULT_STORE

    try:
        site = load_site_config(config or None, user_env=False)
        settings = {"XMEM_PYTHON": python, "XMEM_SLURM": xmem_slurm or _xmem_slurm_beside(python),
                    "XMEM_CONFIG": config, "TIMEOUT_S": str(int(site.estimate.timeout_s) + LUA_STARTUP_S),
                    "FAILURE": failure, "XMEM_STORE": store or DEFAULT_STORE, "XMEM_MEASURE_DIR": measure_dir}
        written = install(to, settings, replace=replace)
    except (ConfigError, SiteFilesError, OSError) as e:
        typer.echo(f"xmem-slurm admin install-slurm-files: {e}", err=True)
        raise typer.Exit(2) from None
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(_next_steps(to.resolve(), measure_dir))


def _xmem_slurm_beside(python: str) -> str:
    beside = Path(python).with_name("xmem-slurm")
    return str(beside) if beside.is_file() else (shutil.which("xmem-slurm") or str(beside))


def _next_steps(to: Path, measure_dir: str) -> str:
    return (f"next (slurm/README.md, 'Files for administrators'):\n"
            f"  slurm.conf: CliFilterPlugins=cli_filter/lua (cli_filter.lua in the directory of slurm.conf),\n"
            f"              Prolog={to}/prolog.sh TaskProlog={to}/task_prolog.sh Epilog={to}/epilog.sh\n"
            f"  install -d -m 0755 {measure_dir}   (on every node)\n"
            f"  the site config: {to}/xmem.toml.example documents every key (default place /etc/xmem/xmem.toml)")
