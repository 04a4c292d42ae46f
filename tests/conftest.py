"""How the suite splits over pytest-xdist's workers (scripts/test.sh runs `-n 2 --dist loadgroup`).

A test goes to any free worker, except:
- every test marked `slurm` runs on one worker: munged is one per machine, and the integration clusters are
  session fixtures on fixed ports (tests/integration/conftest.py) that a second worker would start again;
- the tests of a module that share a module- or class-scoped fixture (a trace, throw-away users, a warm server)
  run on one worker, so that the fixture is made once, not once per worker (one group per value of a parametrized
  one, e.g. per torch build, so those still split).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

SHARED_SCOPES = ("module", "class", "package")


def _as_if_activated() -> None:
    """The suite runs as a user who activated the project's environment (`source .venv/bin/activate`): a bare
    `python` in a traced command is the job's interpreter found on PATH (xmem.trace.command.job_interpreter), so
    it must be the one with torch, as it would be for that user."""
    bin_dir = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)])
    os.environ.setdefault("VIRTUAL_ENV", os.path.dirname(bin_dir))


_as_if_activated()
# The product's default is the warm tracer (`[estimate] warm_tracer = true`); the suite's estimates run cold unless a
# module takes the `warm_tracer` fixture below (or a test sets it), so that a test's answer never depends on which
# server an earlier test left running. The filter ignores this (the site's setting alone): `pytest_sessionfinish`.
os.environ.setdefault("XMEM_WARM_TRACER", "0")


def xdist_group(item: pytest.Item) -> str | None:
    """The group `item` must share a worker with, None when it may run anywhere."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    shared = [name for name in item.fixturenames
              if (defs := definitions.name2fixturedefs.get(name)) and defs[-1].scope in SHARED_SCOPES]
    if not shared:
        return None
    values = [f"{name}={params[name]}" for name in sorted(shared) if name in params]
    # the group name follows the test's id after an "@": keep it to characters that cannot end an id
    return re.sub(r"[^\w./-]", "_", "-".join([item.nodeid.split("::")[0], *values]))


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect, which match the ids as written
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    for item in items:
        group = xdist_group(item)
        if group and "@" not in item.nodeid:
            put_group_in_id(item, group)


def put_group_in_id(item: pytest.Item, group: str) -> None:
    """What an `xdist_group` mark does, by hand: xdist's scheduler reads a test's group from the end of its id
    ("...@slurm"). (xdist 3.8 writes a mark's group into `item._nodeid`, which pytest 9.2 no longer reads: the id is
    `item._id`, a NodeId.)"""
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(f"{item.nodeid}@{group}")
    else:
        item._nodeid = f"{item.nodeid}@{group}"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's own process (xdist's controller, or the only one)
        from xmem.trace import warm

        config.stash[_SERVERS_BEFORE] = {server.pid for server in warm.servers()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the very end of the run (in its own process, after every xdist worker), stop the warm servers started
    meanwhile wherever they were started (the filter under test starts them as the submitting users, in their own
    directories): each would otherwise idle 15 minutes. Not in a worker: one that ends first would stop the servers
    another worker still uses."""
    before = session.config.stash.get(_SERVERS_BEFORE, None)
    if before is None:
        return
    from xmem.trace import warm

    for server in warm.servers():
        if server.pid not in before:
            warm.stop(server)


_SERVERS_BEFORE = pytest.StashKey[set]()


@pytest.fixture(scope="session")
def warm_servers():
    """The directory of this worker's warm tracer servers, shared by every module that takes `warm_tracer`: a server
    loads torch and the training libraries once (10-20 s of CPU, and its module's traces run cold until it answers),
    so one per worker and import environment (`xmem.trace.warm.socket_path`: one for single-process jobs, one for
    jobs a launcher runs as several processes a node) serves the whole run. Stopped at the end."""
    from xmem.trace import warm

    directory = Path(tempfile.mkdtemp(prefix="xw-"))  # short: a socket's path holds at most 108 bytes
    yield directory
    for pid in warm.server_pids(directory):
        os.kill(pid, signal.SIGTERM)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def warm_tracer(warm_servers):
    """For a module of many traces that are not about how a trace starts: its traces go through the warm tracer
    (xmem.trace.warm), as on a site with `warm_tracer = true`. A trace that finds no server answering runs cold and
    starts one, which has torch and the training stacks imported; the next ones fork from it instead of importing
    them again (tests/trace/test_warm.py checks that a warm trace equals the cold one). The settings are in
    os.environ (subprocesses inherit them) for the module's tests only."""
    from xmem.trace import warm

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {warm.ENABLE_ENV: "1", warm.DIR_ENV: str(warm_servers), warm.IDLE_ENV: "3600"}.items():
            patch.setenv(name, value)
        yield
