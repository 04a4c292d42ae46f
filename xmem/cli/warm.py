"""`xmem-slurm warm`: the warm tracer's servers (xmem.trace.warm) that are running, with the memory each holds of its
own and how long it has been idle; `--stop` ends them. A user sees their own; root with `--all` every user's, with a
total per user (what the site's `warm_tracer = true` costs its login node right now)."""

from __future__ import annotations

import json
import os
import pwd
import sys
from collections import defaultdict

import typer
from rich.console import Console
from rich.table import Table

from xmem.cli import app
from xmem.cli.common import EXIT_USAGE, JSON_OPTION, fail
from xmem.trace import warm
from xmem.units import size_text


@app.command("warm")
def warm_command(
    stop: bool = typer.Option(False, "--stop", help="Stop the servers listed (a running estimate ends on its own)."),
    every_user: bool = typer.Option(False, "--all", help="Every user's servers (root only)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """List the warm tracer's servers: who owns each, its idle time and the memory it holds of its own."""
    if every_user and os.geteuid() != 0:
        fail(as_json, EXIT_USAGE, "bad_option", "--all lists other users' servers: run it as root", verb="warm")
    listed = [server for server in warm.servers() if every_user or server.uid == os.geteuid()]
    for server in listed if stop else []:
        warm.stop(server)
    if as_json:
        sys.stdout.write(json.dumps({"servers": [_server_json(server) for server in listed], "stopped": stop}) + "\n")
        return
    if not listed:
        typer.echo("No warm tracer server is running" + (" for any user." if every_user else " for you."))
        return
    table = Table(title="Warm tracer servers" + (" (stopped)" if stop else ""))
    for column in ("user", "pid", "idle", "own memory", "interpreter"):
        table.add_column(column, justify="right" if column in ("pid", "idle", "own memory") else "left",
                         overflow="fold")
    for server in listed:
        table.add_row(_user(server.uid), str(server.pid), f"{server.idle_s / 60:.0f} min",
                      size_text(server.private_bytes), server.interpreter)
    Console().print(table)
    for uid, total in _totals(listed).items():
        typer.echo(f"{_user(uid)}: {size_text(total)} in {sum(s.uid == uid for s in listed)} server(s)")


def _totals(listed: list[warm.Server]) -> dict[int, int]:
    totals: dict[int, int] = defaultdict(int)
    for server in listed:
        totals[server.uid] += server.private_bytes
    return dict(totals)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _server_json(server: warm.Server) -> dict:
    return {"pid": server.pid, "uid": server.uid, "user": _user(server.uid), "socket": server.socket,
            "interpreter": server.interpreter, "idle_s": round(server.idle_s, 1),
            "private_bytes": server.private_bytes}
