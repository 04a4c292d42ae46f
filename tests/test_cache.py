"""The analysis cache: what changes the key, atomic store, eviction, and the estimate slots."""

import os
import pwd
import threading
import time

import pytest

from xmem.cache import LARGE_FILE_BYTES, AnalysisCache, NoSlotFree, cache_key, estimate_slot, file_digest, relevant_env

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}


def key(**overrides):
    args = dict(script=b"#!/bin/bash\npython train.py\n", script_args=("--lr", "1"), options={"gres": "gpu:1"},
                env=BASE_ENV, files=(), extra={"config": "abc"})
    args.update(overrides)
    return cache_key(**args)


def test_same_submission_gives_same_key():
    assert key() == key()


@pytest.mark.parametrize("change", [
    {"script": b"#!/bin/bash\npython train.py --big\n"},
    {"script_args": ("--lr", "2")},
    {"options": {"gres": "gpu:2"}},
    {"env": {**BASE_ENV, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
    {"env": {**BASE_ENV, "CUDA_VISIBLE_DEVICES": "0,1"}},
    {"extra": {"config": "def"}},
])
def test_anything_the_estimate_depends_on_changes_the_key(change):
    assert key(**change) != key()


def test_unrelated_environment_does_not_change_the_key():
    assert key(env={**BASE_ENV, "HOME": "/home/other", "TERM": "xterm"}) == key()


def test_python_found_on_path_is_part_of_the_environment(tmp_path):
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    python = venv_bin / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    env = {**BASE_ENV, "PATH": f"{venv_bin}:/usr/bin"}
    assert relevant_env(env)["which python"] == str(python.resolve())
    assert key(env=env) != key()


def test_content_of_files_the_command_runs_is_part_of_the_key(tmp_path):
    train = tmp_path / "train.py"
    train.write_text("model = 1\n")
    before = key(files=(train,))
    train.write_text("model = 2\n")
    assert key(files=(train,)) != before


def test_a_large_file_is_keyed_by_size_and_time_without_reading_it(tmp_path):
    checkpoint = tmp_path / "last.ckpt"
    with checkpoint.open("wb") as f:  # sparse: nothing to read but zeros, and nothing is read
        f.truncate(LARGE_FILE_BYTES + 1)
    before = file_digest(checkpoint)
    assert before == f"size={LARGE_FILE_BYTES + 1} mtime_ns={checkpoint.stat().st_mtime_ns}"
    os.utime(checkpoint, ns=(1, 2))
    assert file_digest(checkpoint) != before
    small = tmp_path / "train.py"
    small.write_text("print()\n")
    assert len(file_digest(small)) == 64 and file_digest(tmp_path / "missing") == ""


def test_put_then_get_roundtrips(tmp_path):
    cache = AnalysisCache(tmp_path / "c")
    assert cache.get("k") is None
    cache.put("k", {"peaks": {"a100": 123}})
    assert cache.get("k") == {"peaks": {"a100": 123}}
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp-")]


def test_corrupt_entry_reads_as_miss(tmp_path):
    cache = AnalysisCache(tmp_path)
    (tmp_path / "k.json").write_text('{"peaks": ')
    assert cache.get("k") is None


def test_least_recently_used_entries_are_evicted(tmp_path):
    cache = AnalysisCache(tmp_path, max_entries=2)
    cache.put("old", {"n": 1})
    cache.put("mid", {"n": 2})
    os.utime(tmp_path / "old.json", (1, 1))
    os.utime(tmp_path / "mid.json", (2, 2))
    cache.put("new", {"n": 3})
    assert cache.get("old") is None
    assert cache.get("mid") == {"n": 2} and cache.get("new") == {"n": 3}


def test_entries_dated_in_the_future_do_not_evict_every_new_one(tmp_path):
    cache = AnalysisCache(tmp_path, max_entries=5)
    for i in range(5):
        cache.put(f"future{i}", {"n": i})
        os.utime(tmp_path / f"future{i}.json", (4e9, 4e9))  # the year 2096
    cache.put("new", {"n": 5})
    cache.put("newer", {"n": 6})
    assert cache.get("new") == {"n": 5} and cache.get("newer") == {"n": 6}
    assert len(list(tmp_path.glob("*.json"))) == 5


def test_concurrent_writers_leave_a_whole_value(tmp_path):
    cache = AnalysisCache(tmp_path)
    value = {"peaks": {f"gpu{i}": i for i in range(2000)}}
    threads = [threading.Thread(target=cache.put, args=("k", value)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.get("k") == value


def test_slots_cap_concurrent_estimates(tmp_path):
    with estimate_slot(tmp_path, 2, wait_s=0) as first:
        with estimate_slot(tmp_path, 2, wait_s=0) as second:
            assert {first, second} == {0, 1}
            with pytest.raises(NoSlotFree):
                with estimate_slot(tmp_path, 2, wait_s=0.3):
                    pass
    with estimate_slot(tmp_path, 2, wait_s=0) as again:  # released on exit
        assert again == 0


def test_a_wait_for_a_slot_ends_as_soon_as_it_is_cancelled(tmp_path):
    """The filter's handoff (issue 35 item 5) cancels an estimate still waiting for a slot: it stops waiting at once,
    not at the end of its wait, and takes no slot that frees meanwhile."""
    stop = threading.Event()
    cancel = threading.Timer(0.3, stop.set)
    with estimate_slot(tmp_path, 1, wait_s=0):
        cancel.start()
        started = time.monotonic()
        with pytest.raises(NoSlotFree, match="no longer wanted"):
            with estimate_slot(tmp_path, 1, wait_s=30, cancel=stop):
                pass
        assert 0.25 < time.monotonic() - started < 2
    with pytest.raises(NoSlotFree, match="no longer wanted"):  # set before: not even a free slot is taken
        with estimate_slot(tmp_path, 1, wait_s=30, cancel=stop):
            pass


def test_slots_live_in_a_private_per_user_subdirectory_of_the_shared_one(tmp_path):
    """The shared directory is sticky and world-writable like /tmp; each user's slot files are in a 0700
    subdirectory of their own (tests/test_cache_security.py: other users can neither hold nor squat them)."""
    slots = tmp_path / "slots"
    with estimate_slot(slots, 1, wait_s=0):
        pass
    assert (slots.stat().st_mode & 0o7777) == 0o1777
    mine = slots / pwd.getpwuid(os.geteuid()).pw_name
    assert (mine.stat().st_mode & 0o777) == 0o700 and (mine / "slot-0.lock").is_file()
