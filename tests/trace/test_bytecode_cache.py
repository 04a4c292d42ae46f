"""Issue 31: the per-user bytecode cache of traces (`xmem.trace.bytecode`).

A traced program imports a module from a folder with no __pycache__: the first trace compiles it into the user's
cache (bound writable into the sandbox), the second reads it from there without compiling, the user's folder gets
nothing, and another user's trace neither sees nor reads the first user's cache. Root's traces have none.

Like tests/trace/test_isolation.py, the traces here run the sandbox helper itself with the system Python and the
tracer's real start-up hook (xmem/trace/child/boot, first on PYTHONPATH), so that throw-away users, who cannot
reach the venv under /root, run them.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.throwaway_users import SYSTEM_PYTHON, User, users_fixture, visible_dir
from xmem.trace import bytecode, runner, sandbox, warm
from xmem.trace.child.follow import BOOT_DIR

REPO = str(Path(bytecode.__file__).resolve().parents[2])
users = users_fixture("owner", "other")

# Says whether `helper_mod` was compiled from its source in this process, or read as bytecode.
IMPORTS_A_MODULE = textwrap.dedent("""
    import importlib.machinery, sys
    compiled = []
    to_code = importlib.machinery.SourceFileLoader.source_to_code
    def counting(self, data, path, *args, **kwargs):
        compiled.append(path)
        return to_code(self, data, path, *args, **kwargs)
    importlib.machinery.SourceFileLoader.source_to_code = counting
    import helper_mod
    assert helper_mod.ANSWER == 42
    said = "compiled" if any(p.endswith("helper_mod.py") for p in compiled) else "read from bytecode"
    print("helper_mod", said, "prefix", sys.pycache_prefix, flush=True)
    for other in sys.argv[1:]:  # another user's cache: it must be out of reach
        try:
            print("listed", other, __import__("os").listdir(other), flush=True)
        except OSError as error:
            print("refused", other, error.errno, flush=True)
""")


def cache_of(user: User) -> Path:
    """The user's cache as the estimator makes it (`bytecode.directory`, run as them)."""
    done = user.run(SYSTEM_PYTHON, "-I", "-c", f"import sys; sys.path.insert(0, {REPO!r}); "
                    "from xmem.trace import bytecode; print(bytecode.directory())")
    return Path(done.stdout.strip())


def trace_as(user: User, shared: Path, library: Path, cache: Path | None, mode: str, *others: Path) -> str:
    """Run IMPORTS_A_MODULE in the sandbox as `user`, with `cache` bound and named as the runner does; its output."""
    scratch = shared / f"scratch-{secrets.token_hex(3)}"
    scratch.mkdir()
    os.chown(scratch, user.uid, user.gid)
    program = shared / "program.py"
    program.write_text(IMPORTS_A_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([BOOT_DIR, str(library)])}
    options = [f"--shared={cache}"] if cache else []
    if cache:
        env[bytecode.ENV] = str(cache)
    done = user.run(SYSTEM_PYTHON, sandbox.__file__, "--scratch", str(scratch), "--parent", str(os.getpid()),
                    "--mode", mode, *options, "--", SYSTEM_PYTHON, str(program), *map(str, others),
                    env=env, check=False, timeout=60)
    ended = sandbox.read_result(scratch)
    assert ended.get("status") == {"exit": 0}, done.stdout + done.stderr + str(ended)
    assert ended["protection"].startswith("fallback" if mode == "fallback" else "namespaces")
    return done.stdout


def library_of(user: User, shared: Path) -> Path:
    library = shared / f"lib-{user.name}"
    library.mkdir()
    (library / "helper_mod.py").write_text("ANSWER = 42\n")
    for path in (library, library / "helper_mod.py"):
        os.chown(path, user.uid, user.gid)
    return library


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) for p in [folder, *folder.rglob("*")]}


@pytest.mark.skipif(os.geteuid() != 0, reason="makes throw-away users")
@pytest.mark.parametrize("mode", ["", "fallback"])
def test_a_second_trace_reads_the_first_ones_bytecode_and_no_one_elses(users, mode):
    """"": namespaces; fallback: Python's writes redirected, and Landlock (where there is one) allows the cache."""
    owner, other = users
    with visible_dir() as shared:
        library = library_of(owner, shared)
        before = listing(library)
        cache = cache_of(owner)
        assert cache == owner.home / ".cache" / "xmem-slurm" / "bytecode"
        assert cache.stat().st_mode & 0o777 == 0o700 and cache.stat().st_uid == owner.uid

        first = trace_as(owner, shared, library, cache, mode)
        assert f"helper_mod compiled prefix {cache}" in first, first
        cached = list((cache / str(library).lstrip("/")).glob("helper_mod.*.pyc"))  # the source's path, mirrored
        assert cached and cached[0].stat().st_uid == owner.uid, sorted(p for p in cache.rglob("*") if "xmem-shared" in str(p))
        written = cached[0].stat().st_mtime_ns

        second = trace_as(owner, shared, library, cache, mode)
        assert "helper_mod read from bytecode" in second, second
        assert cached[0].stat().st_mtime_ns == written
        assert listing(library) == before  # the user's folder got nothing: no __pycache__ beside the source

        their_library = library_of(other, shared)
        theirs = trace_as(other, shared, their_library, cache_of(other), mode, cache)
        assert "helper_mod compiled" in theirs and f"refused {cache} 13" in theirs, theirs  # EACCES
        assert not list(cache.rglob(f"*{other.name}*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="root's traces run as the trace identity")
def test_roots_trace_has_no_bytecode_cache(tmp_path, monkeypatch):
    """Root's trace runs as an unprivileged identity, whose writes root must not read back: the estimator names no
    cache, and the helper binds none even when asked."""
    monkeypatch.setenv(bytecode.DIR_ENV, str(tmp_path / "bytecode"))
    assert bytecode.directory() is None and runner._bytecode_cache() is None
    with visible_dir() as shared:
        asked = shared / "asked"
        asked.mkdir()
        asked.chmod(0o777)  # bound writable, the trace identity's write would land
        scratch = shared / "scratch"
        scratch.mkdir()
        program = shared / "program.py"
        program.write_text(f"open({str(asked / 'planted.pyc')!r}, 'wb').write(b'x')\n")
        done = subprocess.run([SYSTEM_PYTHON, sandbox.__file__, "--scratch", str(scratch), "--parent",
                               str(os.getpid()), f"--shared={asked}", "--", SYSTEM_PYTHON, str(program)],
                              capture_output=True, text=True, timeout=60, env=sandbox.HELPER_ENV)
        ended = sandbox.read_result(scratch)
        assert ended.get("status") == {"exit": 0}, done.stdout + done.stderr + str(ended)
        assert not list(asked.iterdir())  # it landed in the sandbox's copy, never in the directory


def test_the_cache_is_pruned_oldest_first_without_following_links(tmp_path):
    cache = tmp_path / "cache"
    outside = tmp_path / "users_file.pyc"
    outside.write_bytes(b"u" * 4000)
    for number in range(5):
        folder = cache / "work" / f"pkg{number}" / "__pycache__"
        folder.mkdir(parents=True)
        path = folder / "mod.cpython-311.pyc"
        path.write_bytes(b"b" * 1000)
        os.utime(path, (1_000_000 + number, 1_000_000 + number))
    (cache / "work" / "link.pyc").symlink_to(outside)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "old.pyc").write_bytes(b"e" * 4000)
    os.utime(elsewhere / "old.pyc", (1, 1))
    (cache / "linked").symlink_to(elsewhere, target_is_directory=True)

    removed = bytecode.prune(cache, max_bytes=2500)

    assert removed == 3000
    left = sorted(str(p.relative_to(cache)) for p in (cache / "work").rglob("*.pyc") if not p.is_symlink())
    assert left == ["work/pkg3/__pycache__/mod.cpython-311.pyc", "work/pkg4/__pycache__/mod.cpython-311.pyc"]
    assert not (cache / "work" / "pkg0").exists()  # its emptied folders went too
    assert outside.read_bytes() == b"u" * 4000 and (cache / "work" / "link.pyc").is_symlink()
    assert (elsewhere / "old.pyc").exists()  # the oldest file, but behind a link: not the cache's


WRITES_BOTH = textwrap.dedent("""
    import sys
    for folder in sys.argv[1:]:
        try:
            open(folder + "/planted.pyc", "wb").write(b"x")
            print("wrote", folder, flush=True)
        except OSError as error:
            print("refused", folder, error.errno, flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes throw-away users")
@pytest.mark.parametrize("mode", ["", "fallback"])
def test_the_warm_servers_cache_is_read_only_to_traces(users, mode):
    """The warm tracer's server runs outside the sandbox: its own cache (beside the traces') is protected as the
    runner protects it, so that nothing a traced program writes is run outside a sandbox."""
    owner, _ = users
    if mode == "fallback" and not sandbox.landlock_abi():
        pytest.skip("this kernel has no Landlock: the fallback cannot refuse a write there")
    traces = cache_of(owner)
    done = owner.run(SYSTEM_PYTHON, "-I", "-c", f"import sys; sys.path.insert(0, {REPO!r}); "
                     "from xmem.trace import bytecode; print(bytecode.directory(warm=True))")
    server = Path(done.stdout.strip())
    assert server == traces.with_name("bytecode-warm") and server.stat().st_mode & 0o777 == 0o700
    with visible_dir() as shared:
        scratch = shared / "scratch"
        scratch.mkdir()
        os.chown(scratch, owner.uid, owner.gid)
        (shared / "program.py").write_text(WRITES_BOTH)
        ran = owner.run(SYSTEM_PYTHON, sandbox.__file__, "--scratch", str(scratch), "--parent", str(os.getpid()),
                        "--mode", mode, f"--shared={traces}", f"--protect={server}", "--", SYSTEM_PYTHON,
                        str(shared / "program.py"), str(traces), str(server), check=False, timeout=60)
        assert sandbox.read_result(scratch).get("status") == {"exit": 0}, ran.stdout + ran.stderr
    assert f"wrote {traces}" in ran.stdout and f"refused {server}" in ran.stdout, ran.stdout
    assert (traces / "planted.pyc").exists() and not (server / "planted.pyc").exists()


def test_the_warm_server_is_handed_its_own_cache_never_the_traces():
    """The job's environment (which names the traces' cache) shapes the server's only by what decides its imports."""
    job = {bytecode.ENV: "/home/u/.cache/xmem-slurm/bytecode", "PATH": "/usr/bin"}
    assert bytecode.ENV not in warm.server_env(job, "/opt/xmem")
    server = Path("/home/u/.cache/xmem-slurm/bytecode-warm")
    assert warm.server_env(job, "/opt/xmem", server)[bytecode.ENV] == str(server)


def test_the_cache_is_pruned_at_most_once_an_interval_by_a_stamp_that_is_not_followed(tmp_path):
    cache = tmp_path / "cache"
    (cache / "work").mkdir(parents=True)
    old = cache / "work" / "a.pyc"
    old.write_bytes(b"b" * 1000)
    os.utime(old, (1, 1))
    assert bytecode.prune_now_and_then(cache, max_bytes=0) == 1000  # no stamp yet: pruned, and stamped
    old.parent.mkdir()
    old.write_bytes(b"b" * 1000)
    assert bytecode.prune_now_and_then(cache, max_bytes=0) == 0 and old.exists()  # stamped a moment ago
    stamp = cache / bytecode.PRUNE_STAMP
    future = time.time() + 10 * bytecode.PRUNE_EVERY_S
    os.utime(stamp, (future, future))  # a stamp a traced program set ahead: not believed
    assert bytecode.prune_now_and_then(cache, max_bytes=0) == 1000
    users_file = tmp_path / "users_file"
    users_file.write_text("theirs")
    os.utime(users_file, (1, 1))
    stamp.unlink()
    stamp.symlink_to(users_file)  # a link the program put in place of the stamp: removed, never touched through
    os.utime(stamp, (1, 1), follow_symlinks=False)
    bytecode.prune_now_and_then(cache, max_bytes=0)
    assert users_file.stat().st_mtime == 1 and users_file.read_text() == "theirs" and not stamp.is_symlink()
