"""Issue 21: the traced program cannot leave its sandbox.

It holds no capability (umount2 of its overlay is refused, so a write under HOME still lands in the copy), cold
(exec) or warm (in-process, as the warm tracer runs it), as root and as an ordinary user; it has loopback only and
no service's socket; the shim cache is read-only to it and a shim whose bytes are not what its builder recorded is
never reused or loaded; the job's environment reaches the tracer only, never the helper or the warm server.

Most cases run the sandbox helper itself with the system Python and stdlib-only programs (no torch: fast, and
runnable by a throw-away user, who cannot reach the venv under /root); one case goes through run_trace.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.throwaway_users import SYSTEM_PYTHON, User, users_fixture, visible_dir
from xmem.trace import TraceError, run_trace, sandbox, shim, warm

users = users_fixture("sandboxed")

ESCAPE = textwrap.dedent("""
    import ctypes, os, sys
    home = sys.argv[1]
    libc = ctypes.CDLL(None, use_errno=True)
    points = [line.split()[4] for line in open("/proc/self/mountinfo")]
    point = max((p for p in points if (home + "/").startswith(p.rstrip("/") + "/")), key=len)
    result = libc.umount2(point.encode(), 2)  # MNT_DETACH: uncover the real directory below the overlay
    print("umount2", point, result, ctypes.get_errno(), flush=True)
    try:
        with open(os.path.join(home, "escaped.txt"), "w") as out:
            out.write("escaped\\n")
        print("wrote under HOME", flush=True)
    except OSError as error:  # e.g. a parent owned by a uid the namespace does not map
        print("write under HOME failed", error.errno, flush=True)
    for line in open("/proc/self/status"):
        if line.startswith(("CapEff", "CapPrm", "CapBnd", "NoNewPrivs")):
            print(line.strip().replace("\\t", " "), flush=True)
""")

# The warm tracer's way: the helper runs the tracer in its own process (sandbox.become_tracer replaced), no exec.
IN_PROCESS = textwrap.dedent("""
    import os, runpy, sys
    sys.path.insert(0, sys.argv.pop(1))
    import sandbox
    def in_process(argv, env):
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")
        sys.stdout.flush()
        os._exit(0)
    sandbox.become_tracer = in_process
    sandbox.main(sys.argv[1:])
""")


def run_sandboxed(shared: Path, program: str, args: list[str], user: User | None = None, warm: bool = False,
                  protect: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `program` (Python source) in the sandbox helper with the system Python, as `user` (None: root)."""
    scratch = shared / f"scratch-{secrets.token_hex(3)}"
    scratch.mkdir()
    (shared / "program.py").write_text(program)
    (shared / "in_process.py").write_text(IN_PROCESS)
    front = [str(shared / "in_process.py"), str(Path(sandbox.__file__).parent)] if warm else [sandbox.__file__]
    options = ["--scratch", str(scratch), "--parent", str(os.getpid()), *[f"--protect={p}" for p in protect]]
    command = [SYSTEM_PYTHON, *front, *options, "--", SYSTEM_PYTHON, str(shared / "program.py"), *args]
    if user is not None:
        os.chown(scratch, user.uid, user.gid)
        done = user.run(*command, check=False, timeout=60)
    else:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=sandbox.HELPER_ENV)
    ended = sandbox.read_result(scratch)
    assert ended.get("status") == {"exit": 0}, done.stdout + done.stderr + str(ended)
    return done, ended


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a throw-away user")
@pytest.mark.parametrize("who", ["root", "user"])
@pytest.mark.parametrize("how", ["cold", "warm"])
def test_the_traced_program_holds_no_capability(users, who, how):
    (user,) = users
    runner = None if who == "root" else user
    with visible_dir() as shared, visible_dir() as home:  # HOME straight under /tmp: the copy can be written
        if runner is not None:
            os.chown(home, user.uid, user.gid)
        done, _ = run_sandboxed(shared, ESCAPE, [str(home)], runner, warm=how == "warm")
        assert not (home / "escaped.txt").exists(), done.stdout
    assert "wrote under HOME" in done.stdout, done.stdout  # into its private copy
    assert " -1 1" in done.stdout.splitlines()[0], done.stdout  # umount2 refused: EPERM
    for line in ("CapEff: 0000000000000000", "CapPrm: 0000000000000000", "NoNewPrivs: 1"):
        assert line in done.stdout, done.stdout
    assert who == "user" or "CapBnd: 0000000000000000" in done.stdout  # root: exec would grant nothing either


NETWORK = textwrap.dedent("""
    import socket, sys
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    socket.create_connection(listener.getsockname(), timeout=5).close()
    print("loopback ok", flush=True)
    open("/dev/shm/xmem-isolation-test", "w").write("kept?")  # private: gone with the sandbox
    for target in sys.argv[1:]:
        host, _, port = target.rpartition(":")
        connection = socket.socket(socket.AF_UNIX) if target.startswith("/") else socket.socket()
        connection.settimeout(5)
        try:
            connection.connect(target if target.startswith("/") else (host, int(port)))
            print("reached", target, flush=True)
        except OSError as error:
            print("unreachable", target, error.errno, flush=True)
""")


def host_address() -> str | None:
    """This machine's address on its default route (no packet is sent), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.skipif(os.geteuid() != 0, reason="puts a service's socket under /run, as munge's is")
def test_the_traced_program_has_loopback_only_and_no_services_socket():
    run_dir = Path(f"/run/xmem-test-{secrets.token_hex(3)}")
    run_dir.mkdir()
    munge = socket.socket(socket.AF_UNIX)
    munge.bind(str(run_dir / "munge.socket.2"))
    munge.listen()
    tcp = socket.create_server(("0.0.0.0", 0))
    address = host_address()
    targets = [str(run_dir / "munge.socket.2")] + ([f"{address}:{tcp.getsockname()[1]}"] if address else [])
    try:
        for target in targets:  # reachable from here: the sandbox is what stops them
            probe = socket.socket(socket.AF_UNIX) if target.startswith("/") else socket.socket()
            probe.connect(target if target.startswith("/") else (address, tcp.getsockname()[1]))
            probe.close()
        with visible_dir() as shared:
            done, ended = run_sandboxed(shared, NETWORK, targets)
    finally:
        munge.close()
        tcp.close()
        shutil.rmtree(run_dir)
    assert "loopback ok" in done.stdout, done.stdout + done.stderr
    assert "reached" not in done.stdout and done.stdout.count("unreachable") == len(targets), done.stdout
    assert "network: loopback only" in ended["protection"] and "/run replaced" in ended["protection"]
    assert not Path("/dev/shm/xmem-isolation-test").exists()


OVERWRITE = textwrap.dedent("""
    import os, sys
    for name in os.listdir(sys.argv[1]):
        try:
            with open(os.path.join(sys.argv[1], name), "wb") as out:
                out.write(b"planted")
            print("overwrote", name, flush=True)
        except OSError as error:
            print("refused", name, error.errno, flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a throw-away user")
@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_the_shim_cache_is_read_only_in_the_sandbox(users, mode):
    """fallback: where Landlock is there (without it, the digest check is what is left)."""
    (user,) = users
    if mode == "fallback" and not sandbox.landlock_abi():
        pytest.skip("this kernel has no Landlock")
    with visible_dir() as shared:
        cache = shared / "cache"
        cache.mkdir(mode=0o700)
        (cache / "xmem_fake_cuda-x.so").write_bytes(b"the real shim")
        for path in (cache, cache / "xmem_fake_cuda-x.so"):
            os.chown(path, user.uid, user.gid)
        if mode == "namespaces":
            done, _ = run_sandboxed(shared, OVERWRITE, [str(cache)], user, protect=(str(cache),))
        else:
            done = _fallback(shared, cache, user)
        assert (cache / "xmem_fake_cuda-x.so").read_bytes() == b"the real shim", done.stdout + done.stderr
    assert "refused xmem_fake_cuda-x.so" in done.stdout and "overwrote" not in done.stdout, done.stdout


def _fallback(shared: Path, cache: Path, user: User) -> subprocess.CompletedProcess:
    scratch = shared / "scratch-fallback"
    scratch.mkdir()
    os.chown(scratch, user.uid, user.gid)
    (shared / "program.py").write_text(OVERWRITE)
    done = user.run(SYSTEM_PYTHON, sandbox.__file__, "--scratch", str(scratch), "--parent", str(os.getpid()),
                    "--mode", "fallback", f"--protect={cache}", "--", SYSTEM_PYTHON, str(shared / "program.py"),
                    str(cache), check=False, timeout=60)
    assert sandbox.read_result(scratch).get("status") == {"exit": 0}, done.stdout + done.stderr
    return done


def test_a_shim_is_reused_only_with_the_bytes_its_builder_recorded(tmp_path, monkeypatch):
    """A library replaced in the cache (or one left from before digests were recorded) is neither reused nor
    loaded: the builder's record beside it no longer matches."""
    built = shim.build_shim(shim.find_torch())
    cache = tmp_path / "native"
    cache.mkdir(mode=0o700)
    copy = cache / built.name
    shutil.copy2(built, copy)
    assert not shim._own_file(copy)  # no record: not trusted
    shutil.copy2(str(built) + shim.DIGEST_SUFFIX, str(copy) + shim.DIGEST_SUFFIX)
    assert shim._own_file(copy)
    with open(copy, "ab") as out:
        out.write(b"\0planted")
    assert not shim._own_file(copy)
    monkeypatch.setenv(shim.DIR_ENV, str(cache))
    assert shim.cache_dir() == cache  # the runner's choice wins over the job's HOME / XDG_CACHE_HOME


def test_the_warm_server_starts_without_what_runs_code_at_start():
    job = {"LD_PRELOAD": "/tmp/hook.so", "PYTHONSTARTUP": "/tmp/s.py", "PYTHONPYCACHEPREFIX": "/dev/shm/pyc",
           "TORCH_SHOW_CPP_STACKTRACES": "1", "HOME": "/home/someone", shim.DIR_ENV: "/cache/native",
           "PYTHONHASHSEED": "0", "SECRET_TOKEN": "x"}
    env = warm.server_env(job, "/opt/xmem")
    assert not {"LD_PRELOAD", "PYTHONSTARTUP", "PYTHONPYCACHEPREFIX", "SECRET_TOKEN"} & set(env)
    assert env["TORCH_SHOW_CPP_STACKTRACES"] == "1" and env[shim.DIR_ENV] == "/cache/native"
    assert env["PYTHONPATH"] == "/opt/xmem" and env["PYTHONHASHSEED"] == "0"
    assert warm.socket_path(sys.executable, {"LD_PRELOAD": "/tmp/hook.so"}) is None  # traced cold
    assert warm.socket_path(sys.executable, {"PYTHONSTARTUP": "/tmp/s.py"}) is None


HOOK = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void hook(void) {
    char ns[64] = {0};
    const char *marker = getenv("HOOK_MARKER");
    if (!marker || readlink("/proc/self/ns/user", ns, sizeof ns - 1) < 0) return;
    FILE *f = fopen(marker, "a");
    if (f) { fprintf(f, "%s\n", ns); fclose(f); }
}
"""

# Every way out at once, then the end without CUDA (so the trace's output comes back in the error).
ATTEMPTS = ESCAPE + textwrap.dedent("""
    import glob
    for name in glob.glob(os.path.join(os.environ["XMEM_SHIM_DIR"], "*")):
        try:
            open(name, "ab").write(b"planted")
            print("overwrote", name, flush=True)
        except OSError as error:
            print("shim cache refused", error.errno, flush=True)
    print("hook lines seen inside:", len(open(os.environ["HOOK_MARKER"]).read().splitlines()), flush=True)
""")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="builds an LD_PRELOAD hook")
def test_a_traced_program_cannot_leave_through_capabilities_the_shim_cache_or_the_helpers_environment(
        tmp_path, monkeypatch):
    monkeypatch.setenv(warm.ENABLE_ENV, "1")  # the LD_PRELOAD job is run cold: no server starts for it
    monkeypatch.setenv(warm.DIR_ENV, str(tmp_path / "w"))
    home, marker = tmp_path / "home", tmp_path / "hook-ran.txt"
    home.mkdir()
    (tmp_path / "hook.c").write_text(HOOK)
    subprocess.run(["gcc", "-shared", "-fPIC", str(tmp_path / "hook.c"), "-o", str(tmp_path / "hook.so")], check=True)
    (tmp_path / "attempts.py").write_text(ATTEMPTS)
    shim.prepare(sys.executable)
    cached = {p: p.read_bytes() for p in shim.cache_dir().iterdir()}
    env = {**os.environ, "HOME": str(home), "LD_PRELOAD": str(tmp_path / "hook.so"), "HOOK_MARKER": str(marker)}
    with pytest.raises(TraceError) as ended:
        run_trace(["python", str(tmp_path / "attempts.py"), str(home)], env=env, cwd=str(tmp_path), iterations=1)
    output = ended.value.output
    assert ended.value.kind == "no_cuda", ended.value
    assert not (home / "escaped.txt").exists() and " -1 1" in output, output
    assert "overwrote" not in output and "shim cache refused" in output, output
    assert {p: p.read_bytes() for p in shim.cache_dir().iterdir()} == cached
    assert "hook lines seen inside:" in output and "hook lines seen inside: 0" not in output, output  # it ran inside
    assert not marker.exists(), marker.read_text()  # ... and never outside (where its write would have landed)
    assert not list((tmp_path / "w").glob("*.sock"))


def test_the_shim_of_another_interpreters_torch_is_built_before_the_trace(tmp_path, monkeypatch):
    """The job's own venv (its python links to the base interpreter, yet finds the venv's packages): the runner asks
    it, isolated and in a clean environment, where its torch is, and builds that shim outside the sandbox."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    torch_site = Path(shim.find_torch().root).parent  # this venv's packages, through a .pth as a site might
    next((venv / "lib").glob("python3*/site-packages")).joinpath("theirs.pth").write_text(f"{torch_site}\n")
    monkeypatch.setenv(shim.DIR_ENV, str(tmp_path / "native"))
    shim.prepare(str(venv / "bin" / "python"))
    assert shim._own_file(shim.shim_path(shim.find_torch()))
