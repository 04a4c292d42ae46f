"""S1 (issue 14): the native shim is loaded only from a file of the user's own, in a directory only they can write.

Another user who pre-creates the temporary fallback `xmem-slurm-native-<uid>/` with a library of theirs (here: one
whose constructor leaves a marker file) must not get it loaded by the victim: the victim builds a private copy.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.throwaway_users import scratch, users_fixture  # noqa: F401 (scratch is a fixture)
from xmem.trace import shim

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }
}
"""


attackers = users_fixture("attacker")


@pytest.fixture
def attacker(attackers):
    return attackers[0]


def plant_library(attacker, directory: Path, name: str, marker: Path) -> Path:
    """The attacker's library at `directory/name`, made and owned by the attacker."""
    source = directory.parent / "planted.c"
    source.write_text(PLANTED)
    attacker.run("mkdir", "-p", str(directory))
    attacker.run("gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(directory / name))
    return directory / name


def load_in_child(env: dict) -> subprocess.CompletedProcess:
    code = "from xmem.trace import shim; lib = shim.load_shim(); print(shim.build_shim(shim.find_torch()))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_planted_library_in_the_temporary_fallback_is_never_loaded(scratch, attacker):
    tmp_path = scratch
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)  # a shared /tmp
    blocker = tmp_path / "home-cache-is-a-file"
    blocker.write_text("")  # ~/.cache not writable: the fallback is taken
    marker = tmp_path / "planted-code-ran"
    name = shim.shim_path(shim.find_torch()).name
    planted = plant_library(attacker, tmp / f"xmem-slurm-native-{os.getuid()}", name, marker)
    assert planted.exists() and planted.stat().st_uid == attacker.uid

    done = load_in_child({"XDG_CACHE_HOME": str(blocker), "TMPDIR": str(tmp)})

    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the other user's library ran as the victim"
    used = Path(done.stdout.strip().splitlines()[-1])
    assert used != planted and used.stat().st_uid == os.getuid()
    assert not used.parent.stat().st_mode & 0o022


def test_a_symlinked_or_shared_cache_directory_is_not_trusted(scratch, attacker):
    """`~/.cache/xmem-slurm/native` pointing at the other user's directory: their file there is not loaded."""
    tmp_path = scratch
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    theirs = tmp / "theirs"
    marker = tmp_path / "planted-code-ran"
    name = shim.shim_path(shim.find_torch()).name
    plant_library(attacker, theirs, name, marker)
    cache = tmp_path / "cache" / "xmem-slurm"
    cache.mkdir(parents=True)
    (cache / "native").symlink_to(theirs)
    own = tmp / f"xmem-slurm-native-{os.getuid()}"  # the victim's own earlier build, in their private fallback
    own.mkdir(mode=0o700)
    shutil.copy2(shim.build_shim(shim.find_torch()), own / name)

    done = load_in_child({"XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp)})

    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert Path(done.stdout.strip().splitlines()[-1]) == own / name
