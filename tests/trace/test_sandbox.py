"""The traced program's writes never land in the user's files: it reads back what it wrote, the user's tree stays
identical (names, sizes, mtimes, hashes), under the namespaces sandbox and under its fallback."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.torch_builds import SCRIPTS
from xmem.trace import TraceError, privileges, run_trace, sandbox, warm


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (and root itself): kind, size, mtime and, for files, the sha256 of the content."""
    entries = {}
    for path in [root, *sorted(root.rglob("*"))]:
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        entries[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
    return entries


def make_run_directory(root: Path) -> Path:
    """The user's run directory as writes_everywhere.py expects it."""
    from PIL import Image
    for folder in ("data", "logs", "checkpoints"):
        (root / folder).mkdir(parents=True)
    (root / "data" / "train.txt").write_text("the user's data\n")
    (root / "logs" / "train.log").write_text("previous run\n")
    (root / "checkpoints" / "old_checkpoint.pt").write_bytes(b"the user's checkpoint")
    (root / "latest.txt").write_text("old_checkpoint.pt\n")
    (root / "metrics.csv").write_text("step,loss\n")
    Image.new("RGB", (4, 4), (0, 0, 255)).save(root / "real_samples.png")
    return root


@pytest.mark.parametrize("mode", ["namespaces", "read-only", "fallback"])
def test_writes_never_land_in_the_users_files(tmp_path, monkeypatch, mode):
    """read-only: namespaces where overlayfs is refused (kernels before 5.11)."""
    run = make_run_directory(tmp_path / "run")
    before = snapshot(tmp_path)
    if mode != "namespaces":
        monkeypatch.setenv(sandbox.MODE_ENV, mode)
    # torch.save to a path (namespaces, fallback: the trace opens it through Python's open(), which the fallback
    # redirects, not torch's C++ writer) and to a file object (read-only)
    extra = ["--save-to-file-object"] if mode == "read-only" else []
    trace = run_trace(["python", str(SCRIPTS / "writes_everywhere.py"), *extra], cwd=str(run), iterations=3)
    assert trace.iterations == 3  # the program read back every write (it exits 7 otherwise)
    after = snapshot(tmp_path)
    assert after == before, {name: (before.get(name), after.get(name)) for name in {*before, *after}
                             if before.get(name) != after.get(name)}
    assert trace.sandbox.startswith("fallback" if mode == "fallback" else "namespaces")
    assert (mode == "read-only") == ("overlay of nothing; read-only, Python's writes there redirected" in trace.sandbox)
    warned = [w for w in trace.warnings if "protected" in w]
    assert (mode == "fallback") == bool(warned) and (not warned or "Landlock" in warned[0])


def test_fallback_refuses_a_write_it_cannot_redirect(tmp_path, monkeypatch):
    """A subprocess writes past Python's file APIs: under the fallback, Landlock makes the write fail."""
    if not sandbox.landlock_abi():
        pytest.skip("this kernel has no Landlock")
    run = make_run_directory(tmp_path / "run")
    script = run / "shell_write.py"
    script.write_text("import subprocess\nsubprocess.run(['sh', '-c', 'echo overwritten > latest.txt'], check=True)\n")
    before = snapshot(tmp_path)
    monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    with pytest.raises(TraceError) as caught:
        run_trace(["python", str(script)], cwd=str(run))
    assert caught.value.kind == "user_error" and "CalledProcessError" in caught.value.message
    # as root (issue 35): root's fallback sees each filesystem through a read-only view, which refuses first
    assert "Permission denied" in caught.value.output or \
        os.geteuid() == 0 and "Read-only file system" in caught.value.output
    assert snapshot(tmp_path) == before


def test_the_shim_is_built_outside_the_sandbox_and_kept(tmp_path, monkeypatch):
    """Under the strictest mode (the fallback: Landlock), a first trace finds the shim built (by the runner, before
    the sandbox: the cache is read-only inside) and kept in the user's cache for the next one, with its digest."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    trace = run_trace(["python", str(SCRIPTS / "mlp_adam.py")], iterations=1)
    assert trace.iterations == 1
    assert list((tmp_path / "cache" / "xmem-slurm" / "native").glob("*.so"))
    assert list((tmp_path / "cache" / "xmem-slurm" / "native").glob("*.so.sha256"))


HELPER_PROGRAM = """
import os, subprocess, sys
home = sys.argv[1]
with open(os.path.join(home, "notes.txt"), "a") as f:
    f.write("appended by the program\\n")
os.makedirs(os.path.join(home, "runs", "1"))
os.remove(os.path.join(home, "keep.txt"))
assert open(os.path.join(home, "notes.txt")).read() == "the user's notes\\nappended by the program\\n"
assert not os.path.exists(os.path.join(home, "keep.txt"))
subprocess.run(["sh", "-c", f"echo shell > {home}/from_shell.txt"], check=True)  # C-level: covered too
assert open(os.path.join(home, "from_shell.txt")).read() == "shell\\n"
print("uid", os.getuid(), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root to make a user")
def test_namespaces_sandbox_as_an_ordinary_user(tmp_path):
    """As a non-root user: the kernel still gives the namespaces, the user's home is untouched, and the program
    sees its real uid. (The helper needs only the standard library, so the system Python runs it.)"""
    name = "xmem-sbx-test"
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", name], check=True)
    user = pwd.getpwnam(name)
    home = Path(user.pw_dir)
    for leftover in ("notes.txt", "keep.txt", "from_shell.txt", "runs"):
        shutil.rmtree(home / leftover, ignore_errors=True) if leftover == "runs" else \
            (home / leftover).unlink(missing_ok=True)
    (home / "notes.txt").write_text("the user's notes\n")
    (home / "keep.txt").write_text("keep me\n")
    for path in (home / "notes.txt", home / "keep.txt"):
        os.chown(path, user.pw_uid, user.pw_gid)
    before = snapshot(home)
    scratch = Path(subprocess.run(["runuser", "-u", name, "--", "mktemp", "-d"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    (scratch / "program.py").write_text(HELPER_PROGRAM)
    # sh execs the helper, so its parent (the process it dies with) is runuser: sh's $PPID
    helper = f"exec /usr/bin/python3 {sandbox.__file__} --scratch {scratch} --parent $PPID --"
    result = subprocess.run(["runuser", "-u", name, "--", "sh", "-c", f"{helper} /usr/bin/python3 "
                             f"{scratch}/program.py {home}"], capture_output=True, text=True, timeout=60)
    ended = sandbox.read_result(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    assert ended.get("status") == {"exit": 0}, result.stdout + result.stderr
    assert ended["protection"].startswith("namespaces")
    assert "root's trace runs as" not in ended["protection"]  # -- issue 35: an ordinary user's trace is theirs
    assert f"uid {user.pw_uid}" in result.stdout
    assert snapshot(home) == before


PROBES_HOST_STATE = """\
import errno, os, torch
said = []
for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/sys/kernel/mm/transparent_hugepage/enabled"):
    try:
        os.close(os.open(path, os.O_WRONLY))  # opened only: nothing is written, whatever happens
        said.append(path + "=writable")
    except OSError as error:
        said.append(path + "=" + errno.errorcode[error.errno])
block = [name for name in os.listdir("/dev") if os.path.exists("/dev/" + name)
         and __import__("stat").S_ISBLK(os.stat("/dev/" + name).st_mode)]
said.append("block=" + ",".join(block))
torch.zeros(1, device="cuda")
raise ValueError(" ".join(said))
"""


def test_the_hosts_state_is_out_of_reach_whoever_traces(tmp_path):
    """Issue 35, R1: root's uid (kept in the sandbox) could write /proc/sys (core_pattern runs a program as the real
    root), /sys and the host's disks; in the sandbox they are read-only or absent, for every caller."""
    (tmp_path / "probe.py").write_text(PROBES_HOST_STATE)
    with pytest.raises(TraceError) as raised:
        run_trace(["python", "probe.py"], cwd=str(tmp_path))
    said = dict(word.split("=", 1) for word in raised.value.message.split(" (at ")[0].split(": ", 1)[1].split())
    assert all(said[path] in ("EROFS", "EACCES", "ENOENT") for path in said if path.startswith("/")), said
    assert said["block"] == ""


# ---- issue 35: no trace runs as uid 0 ---------------------------------------------------------------------------

REPORTS_ITS_IDS = """\
import os, signal, sys, torch
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
signal.sigtimedwait([signal.SIGUSR1], 120)  # the test reads our ids from outside meanwhile, then wakes us
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
torch.zeros(1, device="cuda")
raise ValueError(f"uid={os.getuid()} gid={os.getgid()} groups={','.join(map(str, os.getgroups()))} "
                 f"capeff={int(status['CapEff'], 16)} home={os.access(os.path.expanduser('~'), os.R_OK)}")
"""

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a trace root starts")


def host_ids_while_it_runs(cwd: Path, found: dict, timeout: float = 240) -> None:
    """From outside the sandbox: the Uid and Gid lines of the program's process (waiting for SIGUSR1 in `cwd`; a
    warm job has its server's command line), with its parents' pids; then wake it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not found:
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or "sigtimedwait" not in (entry / "wchan").read_text() or \
                        os.readlink(entry / "cwd") != str(cwd):
                    continue
                status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines())
            except OSError:
                continue
            found[int(entry.name)] = (status["Uid"].split(), status["Gid"].split(), parents(int(entry.name)))
        time.sleep(0.2)
    for pid in found:
        os.kill(pid, signal.SIGUSR1)


def parents(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


def reported(error: TraceError) -> dict[str, str]:
    return dict(word.split("=", 1) for word in error.message.split(" (at ")[0].split(": ", 1)[1].split())


@as_root
@pytest.mark.parametrize("mode", ["namespaces", "fallback", "warm"])
def test_roots_trace_runs_as_the_trace_identity_to_the_host(tmp_path, monkeypatch, mode):
    """The kernel never sees uid 0 in a trace root starts, cold, warm or in the fallback: every id of the program's
    process (real, effective, saved, filesystem), read from outside while it runs, is the identity's; it holds no
    capability and no group, and still reads root's home (root's files show as its own, read-only)."""
    identity = sandbox.trace_identity()
    script = tmp_path / "ids.py"
    script.write_text(REPORTS_ITS_IDS)
    command = ["python", str(script)]
    if mode == "fallback":
        monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    server = start_warm_server(command, tmp_path, monkeypatch) if mode == "warm" else None
    try:
        found: dict = {}
        watcher = threading.Thread(target=host_ids_while_it_runs, args=(tmp_path, found))
        watcher.start()
        with pytest.raises(TraceError) as raised:
            run_trace(command, cwd=str(tmp_path), warm_tracer=mode == "warm")
        watcher.join()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
            shutil.rmtree(os.environ[warm.DIR_ENV], ignore_errors=True)
    assert len(found) == 1, f"the program was not seen running: {raised.value.message}"
    [(uids, gids, chain)] = found.values()
    assert uids == [str(identity.uid)] * 4 and gids == [str(identity.gid)] * 4
    assert (mode == "warm") == (server is not None and server.pid in chain)  # a job the warm server forked
    said = reported(raised.value)
    assert said == {"uid": str(identity.uid), "gid": str(identity.gid), "groups": "", "capeff": "0",
                    "home": "True"}, said


def start_warm_server(command: list[str], folder: Path, monkeypatch) -> subprocess.Popen:
    """A warm tracer for `command`'s jobs, answering (as root: the server is root's, its jobs' tracers are not)."""
    from tests.waiting import wait_for
    from xmem.trace import runner
    from xmem.trace.command import parse_command
    sockets = Path(tempfile.mkdtemp(prefix="xw-"))
    for name, value in {warm.ENABLE_ENV: "1", warm.DIR_ENV: str(sockets), warm.IDLE_ENV: "600"}.items():
        monkeypatch.setenv(name, value)
    env = runner._child_env(None, parse_command(command, None), 1)
    path = warm.socket_path(shutil.which(sys.executable), env)
    for _ in range(2):  # a second try: a test run beside this one stops, at its end, every server it did not start
        process = warm.start_server(shutil.which(sys.executable), path, warm.server_env(env, runner.BOOT_DIR))
        assert wait_for(lambda: process.poll() is not None or warm.connect(path) is not None, 300, 0.5)
        if process.poll() is None:
            return process
    raise AssertionError(f"the warm tracer did not start (status {process.returncode})")


WRITES_HOST_STATE = """\
import errno, os, re, torch
said = []
for path in ("/proc/sys/kernel/core_pattern", "/sys/kernel/mm/transparent_hugepage/enabled"):
    value = open(path).read()
    value = re.search(r"\\[(\\w+)\\]", value).group(1) if "[" in value else value  # the setting, as written
    try:
        with open(path, "w") as setting:  # the value it has: nothing would change, were the write allowed
            setting.write(value)
        said.append(path + "=written")
    except OSError as error:
        said.append(path + "=" + errno.errorcode[error.errno])
torch.zeros(1, device="cuda")
raise ValueError(" ".join(said))
"""


@as_root
@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_roots_trace_cannot_write_the_hosts_settings(tmp_path, monkeypatch, mode):
    """Issue 35, R1: a trace root starts writes core_pattern (which runs a program as the real root) and the
    transparent hugepage setting: both writes fail, in the namespaces (read-only mounts and an unprivileged uid)
    and in the fallback (the uid alone), and the host's values stay."""
    settings = [Path("/proc/sys/kernel/core_pattern"), Path("/sys/kernel/mm/transparent_hugepage/enabled")]
    if not all(path.exists() for path in settings):
        pytest.skip("this kernel has no transparent hugepages")
    before = [path.read_text() for path in settings]
    (tmp_path / "writes.py").write_text(WRITES_HOST_STATE)
    if mode == "fallback":
        monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    with pytest.raises(TraceError) as raised:
        run_trace(["python", "writes.py"], cwd=str(tmp_path))
    said = reported(raised.value)
    assert set(said) == {str(path) for path in settings}
    assert all(outcome in ("EROFS", "EACCES") for outcome in said.values()), said
    assert [path.read_text() for path in settings] == before


@as_root
def test_a_file_the_trace_identity_cannot_read_is_named_and_never_run_as_root(tmp_path):
    """Root may read a script of mode 000, its trace identity may not: the trace ends before the program starts,
    naming the file and what to do (privileges.RootTraceRefused, exit 2)."""
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "mlp_adam.py").read_text())
    script.chmod(0)
    with pytest.raises(privileges.RootTraceRefused) as refused:
        run_trace(["python", str(script)], cwd=str(tmp_path))
    identity = sandbox.trace_identity()
    assert f"{identity.name} cannot read {script}" in refused.value.message
    assert sandbox.TRACE_USER_ENV in refused.value.message


@as_root
def test_roots_estimate_of_a_normal_program_keeps_its_peak(tmp_path):
    """The identity changes nothing of what is traced: MLP + Adam's allocations are the hand-derived ones, and its
    live peak is the 692,316 bytes root's trace as uid 0 gave (measured before the change, same script)."""
    trace = run_trace(["python", str(SCRIPTS / "mlp_adam.py")], iterations=3)
    assert "root's trace runs as" in trace.sandbox
    assert [e.nbytes for e in trace.events[:4]] == [100 * 300 * 4, 300 * 4, 300 * 10 * 4, 10 * 4]
    live = peak = 0
    for event in trace.events:
        live += {"alloc": event.nbytes, "free": -event.nbytes}.get(event.action, 0)
        peak = max(peak, live)
    assert peak == 692_316
