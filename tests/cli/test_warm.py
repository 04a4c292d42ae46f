"""`xmem-slurm warm` and the bound on a user's warm tracer servers (xmem.trace.warm: MAX_SERVERS_PER_USER, the least
recently used one stopped for a new one). The servers are real (`warm.start_server`), held before they load torch:
each waits on a path of the test's (`--after`), as the first estimate's server waits for that estimate's scratch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from xmem.trace import warm

from tests.waiting import wait_for

XMEM = [sys.executable, "-m", "xmem.cli"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def held(tmp_path):
    """(socket directory, start(name, last_used) -> pid): servers that never get past their wait, each with a socket
    of its own last used `last_used` seconds ago (made here: a held server has not listened yet)."""
    directory = Path(tempfile.mkdtemp(prefix="xw-"))  # short: a socket's path holds at most 108 bytes
    gate = tmp_path / "gate"
    gate.mkdir()
    sockets = []

    def start(name: str, last_used: float) -> int:
        path = directory / f"{name}.sock"
        process = warm.start_server(sys.executable, path, {"PYTHONPATH": str(ROOT), "PATH": os.defpath}, after=gate)
        assert process is not None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        sockets.append(listener)
        os.utime(path, (time.time() - last_used,) * 2, follow_symlinks=False)
        assert wait_for(lambda: process.pid in {s.pid for s in warm.servers(directory)}, 20)
        return process.pid

    yield directory, start
    for server in warm.servers(directory):
        warm.stop(server)
    for listener in sockets:
        listener.close()
    subprocess.run(["rm", "-rf", str(directory)], check=False)


def test_a_new_server_stops_the_users_least_recently_used_one_beyond_the_bound(held):
    directory, start = held
    assert warm.MAX_SERVERS_PER_USER == 2
    oldest, recent = start("oldest", last_used=600), start("recent", last_used=60)
    newest = start("newest", last_used=0)  # its start made room first
    running = {server.pid for server in warm.servers(directory)}
    assert wait_for(lambda: oldest not in {server.pid for server in warm.servers(directory)}, 20)
    assert {recent, newest} <= running


def test_the_report_lists_each_server_with_its_own_memory_and_stop_ends_them(held):
    directory, start = held
    pid = start("listed", last_used=120)
    report = json.loads(subprocess.run([*XMEM, "warm", "--json"], capture_output=True, text=True, check=True).stdout)
    [mine] = [server for server in report["servers"] if server["pid"] == pid]
    assert mine["uid"] == os.geteuid() and mine["socket"] == str(directory / "listed.sock")
    assert mine["private_bytes"] > 0 and mine["idle_s"] >= 119
    text = subprocess.run([*XMEM, "warm"], capture_output=True, text=True, check=True).stdout
    assert str(pid) in text and "server(s)" in text
    subprocess.run([*XMEM, "warm", "--stop"], capture_output=True, check=True)
    assert wait_for(lambda: pid not in {server.pid for server in warm.servers()}, 20)

