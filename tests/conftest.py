"""How the suite splits over pytest-xdist's workers (scripts/test.sh runs `-n 2 --dist loadgroup`).

A test goes to any free worker, except:
- every test marked `slurm` runs on one worker: munged is one per machine, and the integration clusters are
  session fixtures on fixed ports (tests/integration/conftest.py) that a second worker would start again;
- the tests of a module that share a module- or class-scoped fixture (a trace, throw-away users, a warm server)
  run on one worker, so that the fixture is made once, not once per worker (one group per value of a parametrized
  one, e.g. per torch build, so those still split).
"""

from __future__ import annotations

import re

import pytest

SHARED_SCOPES = ("module", "class", "package")


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
