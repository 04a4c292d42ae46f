"""S3 and S5 (issue 14): estimate slots and the analysis cache on a login node shared with other users.

S3: another user can neither hold a victim's slots (a lock needs only an open file), nor squat the shared slot
directory, nor plant a symlink that root then follows. S5: a cached decision carries only what the filter sets,
an entry that is not the user's own file is ignored, a malformed one is a miss (computed again), and a cache that
cannot be written never costs the estimate. Other users are throw-away accounts; a non-root victim runs the
project's code on the system Python (xmem.cache needs only the standard library).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.throwaway_users import scratch, users_fixture  # noqa: F401 (scratch is a fixture)
from xmem.cache import AnalysisCache, estimate_slot, user_cache_dir
from xmem.slurm.cache_check import valid_analysis
from xmem.slurm.contract import FilterRequest, Verdict, reply_for
from xmem.slurm.inline import analysis_cache
from xmem.userfiles import user_name

REPO = Path(__file__).resolve().parents[1]

HOLD_EVERY_LOCK = """
import fcntl, os, sys, time
held = []
for root, dirs, files in os.walk(sys.argv[1]):
    for name in files:
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(fd)
        except OSError:
            pass
for i in range(8):  # and the names the old shared layout used, made first
    try:
        fd = os.open(os.path.join(sys.argv[1], f"slot-{i}.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    except OSError:  # held already, through the walk
        pass
print(len(held), flush=True)
time.sleep(60)
"""


users = users_fixture("victim", "attacker")


def shared_dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir()
    path.chmod(0o1777)  # as the site install makes it, like /tmp
    return path


def victim_python(victim, code: str, **kw) -> subprocess.CompletedProcess:
    return victim.python(f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + code, **kw)


# --- S3: slots -------------------------------------------------------------------------------------------------

def test_another_user_holding_every_lock_they_can_open_does_not_block_us(scratch, users, monkeypatch):
    _, attacker = users
    monkeypatch.setenv("HOME", str(scratch))
    slots = shared_dir(scratch, "slots")
    with estimate_slot(slots, 2, wait_s=0):
        pass  # our slot files exist: the attacker tries to lock them too
    holder = subprocess.Popen(attacker.argv("/usr/bin/python3", "-I", "-c", HOLD_EVERY_LOCK, str(slots)),
                              stdout=subprocess.PIPE, text=True, env=attacker.env())
    try:
        assert int(holder.stdout.readline()) >= 1  # it does hold the old layout's shared files
        started = time.monotonic()
        with estimate_slot(slots, 2, wait_s=0) as slot:
            assert slot == 0
        assert time.monotonic() - started < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_squatted_slot_directory_does_not_stop_a_non_root_users_estimate(scratch, users):
    victim, attacker = users
    scratch.chmod(0o1777)  # a /tmp
    squatted = scratch / "slots"
    attacker.run("mkdir", "-m", "700", str(squatted))  # made first, by someone else, private to them
    done = victim_python(victim, f"""
from xmem.cache import estimate_slot
with estimate_slot({str(squatted)!r}, 1, wait_s=0) as slot:
    print("slot", slot)
""")
    assert "slot 0" in done.stdout, done.stderr
    assert (victim.home / ".cache" / "xmem-slurm" / "slots" / "slot-0.lock").exists()


def test_root_never_follows_a_symlink_planted_in_the_shared_slot_directory(scratch, users, monkeypatch):
    _, attacker = users
    monkeypatch.setenv("HOME", str(scratch))
    slots = shared_dir(scratch, "slots")
    target = scratch / "created-by-root"
    scratch.chmod(0o1777)  # the attacker may create the target's name: the point is who would create it
    attacker.run("ln", "-s", str(target), str(slots / "slot-0.lock"))  # the old layout's file
    attacker.run("ln", "-s", str(target), str(slots / user_name()))  # and this layout's directory
    with estimate_slot(slots, 1, wait_s=0) as slot:
        assert slot == 0
    assert not os.path.lexists(target)


# --- S5: the cache ---------------------------------------------------------------------------------------------

GOOD = {"decision": {"action": "rewrite", "reason": "peak 1.2 GiB", "gres": "mps:a100:2", "gpus": None,
                     "option": "gres", "kind": "mps", "gpu_type": "a100", "peak_bytes": 1288490188,
                     "needed_bytes": 1500000000, "granted_bytes": 1600000000},
        "peaks": {"a100": 1288490188}, "errors": []}


def tampered(**decision) -> dict:
    return {**GOOD, "decision": {**GOOD["decision"], **decision}}


@pytest.mark.parametrize("entry", [
    tampered(option="chdir", gres="/tmp/elsewhere"),
    tampered(gres="gpu:h100:1 --chdir=/tmp"),
    tampered(gres="gpu:1,license:abc:1"),
    tampered(option="gpus", gpus="h100:one"),
    tampered(action="run-this"),
    tampered(peak_bytes=float("inf")),
    tampered(peak_bytes="12"),
    {**GOOD, "decision": "rewrite"},
    {**GOOD, "peaks": [1, 2]},
    {**GOOD, "errors": "none"},
], ids=["chdir", "second-option", "not-a-gpu", "bad-count", "action", "inf", "text-size", "decision-not-object",
        "peaks-not-object", "errors-not-list"])
def test_an_entry_the_filter_could_not_have_written_is_a_miss(tmp_path, entry):
    cache = AnalysisCache(tmp_path, validate=valid_analysis)
    cache.put("k", entry)
    assert cache.get("k") is None


def test_a_valid_entry_reads_back_and_sets_only_the_gpu_option(tmp_path):
    cache = AnalysisCache(tmp_path, validate=valid_analysis)
    cache.put("k", GOOD)
    reply = reply_for(Verdict.from_json(cache.get("k"), cached=True), FilterRequest(script="/j.sh"), "open")
    assert set(reply.set) == {"gres", "comment", "export"} and reply.set["gres"] == "mps:a100:2"


def test_an_entry_that_is_not_the_users_own_file_is_ignored(tmp_path, users):
    _, attacker = users
    cache = AnalysisCache(tmp_path, validate=valid_analysis)
    cache.put("theirs", GOOD)
    os.chown(tmp_path / "theirs.json", attacker.uid, attacker.gid)
    cache.put("writable", GOOD)
    (tmp_path / "writable.json").chmod(0o666)
    cache.put("real", GOOD)
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert [cache.get(k) for k in ("theirs", "writable", "link")] == [None, None, None]
    assert cache.get("real") == GOOD


def test_a_cache_that_cannot_be_written_costs_the_entry_not_the_caller(tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = AnalysisCache(blocker / "analyses")  # mkdir under a regular file fails, even for root
    assert cache.put("k", GOOD) is False
    assert cache.get("k") is None
    notice = capfd.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "not cached" in notice[0] and "used all the same" in notice[0]


def test_a_shared_site_cache_directory_gives_each_user_a_private_subdirectory(scratch, users):
    """A site's root-owned 1777 cache_dir: the user's entries go to <cache_dir>/<user>, mode 700, made by them.
    A root-owned 0755 one (no place for them): their own ~/.cache/xmem-slurm, never a failed write."""
    victim, _ = users
    shared = shared_dir(scratch, "cache")
    closed = scratch / "closed"
    closed.mkdir(mode=0o755)
    done = victim_python(victim, f"""
from xmem.cache import AnalysisCache, user_cache_dir
for site in ({str(shared)!r}, {str(closed)!r}):
    mine = user_cache_dir(site)
    print(mine, AnalysisCache(mine / "analyses").put("k", {{"decision": None}}))
""")
    lines = done.stdout.split("\n")
    assert lines[0] == f"{shared / victim.name} True", done.stderr
    assert lines[1] == f"{victim.home / '.cache' / 'xmem-slurm'} True", done.stderr
    assert (shared / victim.name).stat().st_mode & 0o777 == 0o700
    assert (shared / victim.name).stat().st_uid == victim.uid


def test_the_filters_cache_lives_in_the_users_private_directory(tmp_path):
    config = type("Config", (), {"estimate": type("Estimate", (), {"cache_dir": str(tmp_path / "c")})()})()
    cache = analysis_cache(config)
    assert cache.directory == user_cache_dir(tmp_path / "c") / "analyses" and cache.validate is valid_analysis
    cache.put("k", tampered(option="chdir"))
    assert cache.get("k") is None
