"""The warm tracer: a process per user, interpreter and import environment that has the native shim, torch,
torch._dynamo, the tracer's own modules and the common training libraries loaded, and forks one tracing child per
estimate, so that an estimate skips Python's start and those imports and no state passes between jobs.

Owns the server's life (started in the background by the first estimate that finds none, which itself runs cold;
reached through a unix socket in a 0700 directory of the user's; ended after an idle time, or as soon as its code or
torch changed on disk or its socket was taken away), its trust rule (a socket or directory someone else owns is
never used, `xmem.userfiles`; a peer whose uid or gid is not the server's is refused, SO_PEERCRED), the request one
estimate sends (the cold command line, the program's environment, cwd, umask and resource limits, its output and
progress descriptors), and the fork: each job is a fresh child of the server that takes the request's process state
and runs `xmem.trace.sandbox` in-process, which runs `xmem.trace.child.main` in-process instead of exec'ing it. A job the
server cannot serve exactly as the cold child would run (a preloaded module the job's path would import from
elsewhere, a user site-packages, limits it cannot take) is declined; the runner then starts cold. Off unless
XMEM_WARM_TRACER=1. Imports only the standard library and xmem.trace modules that do not import torch (the server
runs in the job's interpreter, the client in the estimator's).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import importlib.machinery
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xmem.trace.sandbox as sandbox
from xmem.userfiles import private_dir

ENABLE_ENV = "XMEM_WARM_TRACER"  # "1": estimates go through the warm tracer
DIR_ENV = "XMEM_WARM_DIR"  # where the sockets live (default: a 0700 directory of the user's in the temporary one)
IDLE_ENV = "XMEM_WARM_IDLE_S"
DEFAULT_IDLE_S = 900.0
SERVER_NICE = 10  # the server's imports must not slow the cold estimate that started it
CONNECT_TIMEOUT_S = 2.0  # a server that does not answer this fast is treated as absent
STOP_GRACE_S = 5  # as the runner gives the cold helper
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes
# Environment that shapes what importing the preloaded modules does (an interpreter's start-up settings, the dynamic
# loader, torch's and the libraries' import-time configuration): one server per distinct set. PYTHONPATH is not
# here: a job's own path is checked against where each preloaded module came from (`_shadowed`).
IMPORT_ENV_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                       "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TIMM_", "LIGHTNING_", "PL_", "TQDM_",
                       "XDG_", "NUMPY_", "TRITON_", "NCCL_", "LC_", "USE_", "XLA_", "WANDB_")
IMPORT_ENV_NAMES = ("HOME", "TMPDIR", "LANG")
# The server runs outside the sandbox, so it starts with none of what makes a process or an interpreter run code
# at start (the dynamic loader's LD_*, Python's PYTHONSTARTUP, PYTHONHOME, a pycache prefix, ...): of PYTHON*, only
# these settings pass. A job that sets anything else of that kind is traced cold, where its environment is applied
# inside the sandbox only.
SERVER_PYTHON_ENV = ("PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
                     "PYTHONUNBUFFERED", "PYTHONPATH")
# Imported by the server after torch when installed (their import runs no user code: only site-packages are on the
# server's path). A library a job would import from another place is not used warm (`_shadowed`). transformers
# loads lazily: its model base (modeling_utils, 1.3 s) and Trainer (2.8 s more) are what every HF job imports; a
# model's own file is a few milliseconds.
TRAINING_LIBRARIES = ("numpy", "torchvision", "transformers", "transformers.modeling_utils", "transformers.trainer",
                      "safetensors", "accelerate", "timm", "lightning", "pytorch_lightning", "tqdm")
LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_NPROC", "RLIMIT_CORE",
          "RLIMIT_FSIZE", "RLIMIT_MEMLOCK")
# The server's command (not `-m xmem.trace.warm`: the package imports this module first, through the runner).
SERVER_MAIN = "import sys; from xmem.trace.warm import main; main(sys.argv[1:])"
HEADER = struct.Struct("!Q")  # the request's length, sent with its descriptors


def enabled(site_default: bool = False) -> bool:
    """Whether estimates go through the warm tracer: $XMEM_WARM_TRACER ("1" or "0") when set, else the site's
    `[estimate] warm_tracer`."""
    value = os.environ.get(ENABLE_ENV, "")
    return value == "1" if value in ("0", "1") else site_default


# ---- where the server lives ----------------------------------------------------------------------------------

def socket_dir() -> Path | None:
    """This user's 0700 directory of sockets; None when it cannot be had (someone else owns the name)."""
    path = Path(os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(), f"xmem-warm-{os.geteuid()}"))
    if not private_dir(path):
        return None
    try:
        os.chmod(path, 0o700)  # only this user may even reach the socket
    except OSError:
        return None
    return path


def socket_path(interpreter: str, env: dict[str, str]) -> Path | None:
    """The socket of the server for this interpreter and import environment, for this user and groups."""
    directory = socket_dir()
    if directory is None:
        return None
    if any(_runs_code_at_start(name) for name in env):
        return None  # cold: such a variable is applied inside the sandbox only
    imports = sorted((k, v) for k, v in env.items() if k != "PYTHONPATH" and _shapes_imports(k))
    key = json.dumps([os.path.abspath(interpreter), os.geteuid(), os.getegid(), sorted(os.getgroups()), imports])
    path = directory / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.sock"
    return path if len(str(path)) <= MAX_SOCKET_PATH else None


def _shapes_imports(name: str) -> bool:
    return name.startswith(IMPORT_ENV_PREFIXES) or name in IMPORT_ENV_NAMES


def _runs_code_at_start(name: str) -> bool:
    return name.startswith("LD_") or (name.startswith("PYTHON") and name not in SERVER_PYTHON_ENV)


def server_env(env: dict[str, str], xmem_parent: str) -> dict[str, str]:
    """The server's environment (it runs outside the sandbox): of the job's, only what shapes its imports (the key
    of its socket), nothing that runs code at start, the shim cache the runner chose, and xmem alone on
    PYTHONPATH. The job's whole environment is applied inside its sandbox (`_trace_in_process`)."""
    import xmem.trace.shim as shim
    kept = {k: v for k, v in env.items() if _shapes_imports(k) and not _runs_code_at_start(k)}
    return {"PATH": os.defpath, **kept, **{k: env[k] for k in (shim.DIR_ENV,) if k in env},
            "PYTHONPATH": xmem_parent}


def start_server(interpreter: str, path: Path, env: dict[str, str],
                 after: Path | None = None) -> subprocess.Popen | None:
    """Start the server in the background (it locks, waits until `after` is gone, loads, then listens); the caller
    goes on cold meanwhile."""
    idle = os.environ.get(IDLE_ENV, str(DEFAULT_IDLE_S))
    wait = ["--after", str(after), "--caller", str(os.getpid())] if after is not None else []
    try:
        # -s: no user site-packages outside the sandbox (a job that has one is declined, `_declined`)
        return subprocess.Popen([interpreter, "-s", "-c", SERVER_MAIN, "--socket", str(path), "--idle", idle, *wait],
                                env=env, cwd=str(path.parent), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:  # no warm tracer this time: estimates go on cold
        return None


def server_pids(directory: Path) -> list[int]:
    """The servers whose socket lies in `directory`, by their command line (to stop them: tests, benchmarks)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{directory}/".encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


# ---- the client side ---------------------------------------------------------------------------------------------

def connect(path: Path) -> socket.socket | None:
    """A connection to the server at `path` if it is this user's own and answers; None otherwise (go cold)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(CONNECT_TIMEOUT_S)
    try:
        connection.connect(str(path))
        if peer_ids(connection)[0] != os.geteuid():
            raise OSError("the socket's server is another user's")
    except OSError:
        connection.close()
        return None
    return connection


def peer_ids(connection: socket.socket) -> tuple[int, int]:
    """(uid, gid) of the process at the other end, as the kernel says."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, gid = struct.unpack("3i", creds)
    return uid, gid


def job_request(argv: list[str], env: dict[str, str], cwd: str | None) -> dict[str, Any]:
    """What the cold child would inherit from this process, beside its command line and environment."""
    umask = os.umask(0o022)
    os.umask(umask)
    return {"argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()), "umask": umask,
            "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}}


class WarmJob:
    """One estimate on the server: `wait` as Popen.wait (None when the server vanished), `stop` to end it."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.pending = b""

    @classmethod
    def submit(cls, connection: socket.socket, request: dict[str, Any], fds: list[int]) -> "WarmJob | None":
        """Send the request with the program's output and progress descriptors; None unless the server started it."""
        body = json.dumps(request).encode()
        job = cls(connection)
        try:
            socket.send_fds(connection, [HEADER.pack(len(body))], fds)
            connection.sendall(body)
            started = job._reply(CONNECT_TIMEOUT_S * 5)
        except (OSError, ValueError):  # no answer, or not one of ours: go cold
            started = None
        if not started or "started" not in started:
            connection.close()
            return None
        return job

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            reply = self._reply(timeout)
        except socket.timeout:
            raise subprocess.TimeoutExpired("warm tracer", timeout or 0) from None
        except (OSError, ValueError):
            reply = None
        self.connection.close()
        return reply.get("status") if reply else None

    def stop(self) -> None:
        """Ask the server to end the job (as the cold helper is sent SIGTERM), and wait until it has."""
        try:
            self.connection.sendall(b"stop\n")
            self._reply(STOP_GRACE_S + 5)
        except (OSError, ValueError):
            pass  # the server is gone, and with it the job (it dies with its parent)
        self.connection.close()

    def _reply(self, timeout: float | None) -> dict | None:
        """The server's next line, None at the end of the connection."""
        self.connection.settimeout(timeout)
        while b"\n" not in self.pending:
            chunk = self.connection.recv(4096)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


# ---- the server ------------------------------------------------------------------------------------------------

def serve(path: Path, idle_s: float, after: Path | None = None, caller: int = 0) -> None:
    os.nice(SERVER_NICE)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another server of the same key runs or is starting
    _wait_until_gone(after, caller)
    loaded = preload()
    collapse_into_huge_pages()
    listener = _listen(path)
    inode = os.lstat(path).st_ino
    signal.signal(signal.SIGTERM, lambda *_: _leave(path, inode))
    last_request = time.monotonic()
    while time.monotonic() - last_request < idle_s and _same_socket(path, inode):
        _reap_jobs()
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            continue
        connection, _ = listener.accept()
        last_request = time.monotonic()
        if peer_ids(connection) != (os.getuid(), os.getgid()):  # never another user's job
            connection.close()
            continue
        if os.fork() == 0:
            listener.close()
            os.close(lock)  # a running job must not keep the next server out
            _handle(connection, loaded)
        connection.close()
    _leave(path, inode)


def _wait_until_gone(after: Path | None, caller: int) -> None:
    """Load only once the estimate that started us has finished its cold trace (its scratch directory `after` is
    gone, or the process itself): on a login node's few cores, the server's imports would slow that first one."""
    while after is not None and after.exists() and alive(caller):
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (the runner's stale-scratch rule asks it too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@dataclass(frozen=True)
class Loaded:
    """What the server loaded, as each job checks and adjusts against it."""

    origins: dict[str, str]  # top-level module -> the file it came from
    signature: list  # code_signature at start
    base_path: list[str]  # sys.path without PYTHONPATH: the installation's own
    library_bytes: int  # the training libraries' share of the data segment (RLIMIT_DATA counts it)


def preload() -> Loaded:
    """Load what every trace loads, then the training libraries that import cleanly."""
    import xmem.trace.child.main as child
    child.preload()
    before = _data_bytes()
    with child.loading_for_good():  # frozen too: a job's collections walk its own objects only
        for name in TRAINING_LIBRARIES:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - not installed, or broken: jobs import it themselves
                continue
    tops = {name.partition(".")[0] for name in sys.modules}
    origins = {name: _origin(sys.modules[name]) for name in sorted(tops) if name in sys.modules and
               _origin(sys.modules[name]) and sys.modules[name].__spec__.name == name}  # not aliases (__main__)
    return Loaded(origins, code_signature(origins), [p for p in sys.path if p not in _pythonpath(os.environ)],
                  max(_data_bytes() - before, 0))


HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # Linux 6.1+: make the range's pages huge now, whatever the system's THP setting


def collapse_into_huge_pages() -> int:
    """Back the server's anonymous memory (torch's and the libraries' data: about 0.5 GiB) by huge pages, so that
    each fork of a job copies one page-table entry per 2 MiB instead of per 4 KiB: a warm job forks the server's
    image four times (job handler, sandbox helper, namespace init, tracer), each about 45 ms with small pages and
    15 ms with huge ones. What a child writes is still copied 4 KiB at a time (the kernel splits a shared huge page
    on a write). Kernels without MADV_COLLAPSE refuse it: nothing changes. Returns the bytes collapsed."""
    import ctypes
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    asked = 0
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    for line in maps:
        fields = line.split()
        if "w" not in fields[1] or "p" not in fields[1] or (len(fields) > 5 and fields[5] != "[heap]"):
            continue  # file mappings, the stack and the like stay as they are
        start, end = (int(address, 16) for address in fields[0].split("-"))
        start, end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, MADV_COLLAPSE) == 0:
            asked += end - start
    return asked


def _data_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def _origin(module: Any) -> str:
    """The file a module was imported from; "" for built-in, frozen and generated ones."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or ""
    return origin if os.path.isabs(origin) and os.path.isfile(origin) else ""


def code_signature(origins: dict[str, str]) -> list:
    """What makes a server stale when it changes on disk: the files of the xmem modules it loaded, and each
    preloaded package's first file (an upgrade rewrites it). A job imports everything else from disk itself."""
    xmem_dir = str(Path(__file__).resolve().parent.parent) + os.sep
    loaded = [_origin(module) for module in list(sys.modules.values())]
    return file_stamps(sorted({name for name in loaded if name.startswith(xmem_dir)} | set(origins.values())))


def file_stamps(files: list[str]) -> list:
    stamps = []
    for name in files:
        try:
            info = os.stat(name)
        except OSError:
            info = None
        stamps.append((name, info.st_mtime_ns if info else 0, info.st_size if info else 0))
    return stamps


def _listen(path: Path) -> socket.socket:
    try:
        path.unlink()  # a dead server's socket (we hold the lock: no live one uses it)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(16)
    return listener


def _same_socket(path: Path, inode: int) -> bool:
    try:
        return os.lstat(path).st_ino == inode
    except OSError:
        return False


def _leave(path: Path, inode: int) -> None:
    if _same_socket(path, inode):
        path.unlink()
    os._exit(0)


def _reap_jobs() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _pythonpath(env: dict[str, str] | os._Environ) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# ---- one job: the server's child that runs it, and its child that becomes the sandbox -------------------------

def _handle(connection: socket.socket, loaded: Loaded) -> None:
    """Run one job and tell the client when it started and how it ended; stop it when the client asks or goes."""
    try:
        request, fds = _receive(connection)
        reason = _declined(request, loaded)
        if reason:
            _send(connection, {"declined": reason})
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            connection.close()
            _become_job(request, fds, loaded)
        for fd in fds:
            os.close(fd)
        _send(connection, {"started": pid})
        _send(connection, {"status": _watch(connection, pid)})
    except BaseException:  # noqa: BLE001 - the client falls back to a cold start
        pass
    os._exit(0)


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    connection.settimeout(CONNECT_TIMEOUT_S * 5)
    header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 2)
    if len(header) != HEADER.size or len(fds) != 2:
        raise OSError("a malformed request")
    (length,) = HEADER.unpack(header)
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise OSError("the request was cut short")
        body += chunk
    connection.settimeout(None)
    return json.loads(body), fds


def _declined(request: dict[str, Any], loaded: Loaded) -> str:
    """Why this job cannot be run here exactly as the cold child would run it; "" when it can."""
    if file_stamps([name for name, _, _ in loaded.signature]) != loaded.signature:
        os.kill(os.getppid(), signal.SIGTERM)  # stale: the next estimate starts a fresh server
        return "xmem, torch or a preloaded library changed since the warm tracer started"
    env, cwd = request["env"], request["cwd"]
    if _user_site(env) and os.path.isdir(_user_site(env)):
        return "a user site-packages exists (the warm tracer imports from the installation's alone)"
    for name, value in request["limits"].items():
        _, hard = resource.getrlimit(getattr(resource, name))
        if hard != resource.RLIM_INFINITY and (value[1] == resource.RLIM_INFINITY or value[1] > hard):
            return f"the estimate's {name} is above the warm tracer's"
    return _shadowed(loaded.origins, _job_path(cwd, env, loaded.base_path))


def _user_site(env: dict[str, str]) -> str:
    """The job's user site-packages directory, as `site` would find it ("" when it is switched off)."""
    if env.get("PYTHONNOUSERSITE"):
        return ""
    base = env.get("PYTHONUSERBASE") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local")
    return os.path.join(base, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")


def _job_path(cwd: str, env: dict[str, str], base_path: list[str]) -> list[str]:
    """sys.path as `python -m xmem.trace` starts with it in `cwd`: the directory, the job's PYTHONPATH, the rest."""
    return [cwd, *_pythonpath(env), *[p for p in base_path if p not in _pythonpath(env)]]


def _shadowed(preloaded: dict[str, str], path: list[str]) -> str:
    """A preloaded module that the job's path would import from another file (a local `transformers/`)."""
    stdlib = sysconfig.get_paths()["stdlib"]  # once: it expands every install scheme's paths
    for name, origin in preloaded.items():
        if name == "xmem":  # the job's start-up (trace/child/boot) takes it from where it lies, whatever the path
            continue
        if name not in sys.builtin_module_names and not origin.startswith(stdlib):
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            found = spec.origin if spec is not None else None
            if found != origin:
                return f"{name} would be imported from {found or 'nowhere'}, not from {origin}"
    return ""


def _watch(connection: socket.socket, pid: int) -> int:
    """Wait for the job; on "stop" or the client's end, stop it as the runner stops a cold helper. Its status as
    Popen.returncode gives it."""
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd, connection], [], [])
    if pidfd not in ready:  # the client asked to stop, or went away
        os.kill(pid, signal.SIGTERM)
        ended, _, _ = select.select([pidfd], [], [], STOP_GRACE_S)
        if not ended:
            os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    return os.waitstatus_to_exitcode(status)


def _send(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _become_job(request: dict[str, Any], fds: list[int], loaded: Loaded) -> None:
    """Take the cold helper's process state (session, descriptors, cwd, umask, limits, environment, signals, path),
    then run the sandbox in this process. Never returns."""
    try:
        os.setsid()
        log, progress = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        os.umask(request["umask"])
        for name, value in request["limits"].items():
            resource.setrlimit(getattr(resource, name), tuple(value))
        env, cwd = request["env"], request["cwd"]
        os.chdir(cwd)  # the environment stays the server's clean one: the job's is applied inside the sandbox
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path[:] = _job_path(cwd, env, loaded.base_path)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=bool(env.get("PYTHONUNBUFFERED")))
        argv = request["argv"]
        helper = argv[3:]  # [python, -I, sandbox.py, OPTIONS..., --, TRACER...]
        helper = with_option(with_option(helper, "--parent", str(os.getppid())), "--progress-fd", str(progress))
        helper = _memory_for_libraries(helper, loaded.library_bytes)
        sandbox.become_tracer = _trace_in_process
        sandbox.main(helper, program_env=env)
    except BaseException as error:  # noqa: BLE001 - the fork must never return into the server's code
        sys.stderr.write(f"xmem warm tracer: cannot start the job: {error}\n")
    os._exit(127)


def _memory_for_libraries(helper: list[str], library_bytes: int) -> list[str]:
    """The host-memory limit (RLIMIT_DATA) raised by what the preloaded libraries hold: a job that does not import
    them must not run out of memory where its cold trace would not."""
    limit = int(helper[helper.index("--memory-bytes") + 1])
    return with_option(helper, "--memory-bytes", str(limit + library_bytes)) if limit > 0 else helper


def with_option(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with the value of option `name` replaced: options come before the program's arguments, so the first
    `name` is ours."""
    changed = list(argv)
    changed[changed.index(name) + 1] = value
    return changed


def _trace_in_process(argv: list[str], env: dict) -> None:
    """sandbox.become_tracer for a warm job: what `python -m xmem.trace ARGS` (or the fallback's bootstrap) would
    do, in this process, with torch already loaded."""
    os.environ.clear()
    os.environ.update(env)
    sandbox.install_in_child()
    importlib.invalidate_caches()  # a package installed since the server listed its directories
    _fresh_random_state()
    import xmem.trace.child.main as child
    child.main(argv[argv.index("xmem.trace") + 1:])


def _fresh_random_state() -> None:
    """The random generators as a fresh interpreter has them (Python's and numpy's seeded from the OS, torch's at its
    fixed default), not as the server's imports left them for every job."""
    import random

    import torch
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch.default_generator.manual_seed(torch.default_generator.initial_seed())


def main(argv: list[str]) -> None:
    if sys.path and sys.path[0] in ("", os.getcwd()):  # the socket directory: nothing to import from there
        sys.path.pop(0)
    parser = argparse.ArgumentParser(prog="python -m xmem.trace.warm", description="the warm tracer's server")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_S, help="seconds without a request before it ends")
    parser.add_argument("--after", type=Path, help="load once this path (the first trace's scratch) is gone")
    parser.add_argument("--caller", type=int, default=0, help="or once this process (the first estimate) is gone")
    args = parser.parse_args(argv)
    serve(args.socket, args.idle, args.after, args.caller)


if __name__ == "__main__":
    main(sys.argv[1:])
