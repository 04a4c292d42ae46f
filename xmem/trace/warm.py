"""The warm tracer's client: a server per user, interpreter and import environment has the native shim, torch,
torch._dynamo, the tracer's own modules and the common training libraries loaded, and forks one tracing child per
estimate, so that an estimate skips Python's start and those imports and no state passes between jobs. The server
is `xmem.trace.child.warm_server` (it runs in the job's interpreter); this side runs in the estimator.

Owns where a server lives and how one is found (a unix socket in a 0700 directory of the user's, one per
interpreter and import environment: `socket_path`; a socket or directory someone else owns is never used,
`xmem.userfiles`; a server whose uid is not ours is not spoken to, SO_PEERCRED), starting one in the background
(`start_server`: the first estimate that finds none, which itself runs cold), and the request one estimate sends
(`job_request`: the cold command line, the program's environment, cwd, umask and resource limits; `WarmJob`: sent
with its output and progress descriptors, then waited on or stopped). The frames both ends read are
`xmem.trace.wire`'s (`WarmRequest`, `WarmReply`). A job the server declines runs cold. On unless the site's `warm_tracer` is false (or
XMEM_WARM_TRACER=0). Also what bounds and reports the servers' memory: at most MAX_SERVERS_PER_USER per user (the
least recently used one stops for a new one), `servers` lists the running ones with what each holds.
Imports only the standard library and xmem modules that do not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from xmem.trace.wire import DEFAULT_IDLE_S, FRAME_HEADER, REQUEST_TIMEOUT_S, STOP, STOP_GRACE_S, FakeGpu, \
    WarmReply, WarmRequest, peer_ids
from xmem.userfiles import private_dir

ENABLE_ENV = "XMEM_WARM_TRACER"  # "1": estimates go through the warm tracer
DIR_ENV = "XMEM_WARM_DIR"  # where the sockets live (default: a 0700 directory of the user's in the temporary one)
IDLE_ENV = "XMEM_WARM_IDLE_S"
# A user has one server per interpreter and import environment; most have one or two (single-process jobs, and jobs a
# launcher starts as several processes a node). The bound keeps a user of many environments at about 1.3 GiB of
# servers' own memory (0.65 GiB each) on a shared login node.
MAX_SERVERS_PER_USER = 2
CONNECT_TIMEOUT_S = 2.0  # a server that does not answer this fast is treated as absent
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes
# Environment that shapes what importing the preloaded modules does (an interpreter's start-up settings, the dynamic
# loader, torch's and the libraries' import-time configuration): one server per distinct set. PYTHONPATH is not
# here: a job's own path is checked against where each preloaded module came from (`_shadowed`).
IMPORT_ENV_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                       "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TIMM_", "LIGHTNING_", "PL_", "TQDM_",
                       "XDG_", "NUMPY_", "TRITON_", "NCCL_", "LC_", "USE_", "XLA_", "WANDB_")
IMPORT_ENV_NAMES = ("HOME", "TMPDIR", "LANG")
# -- issue 32: what no import reads, only the running job, where its whole environment is applied; in the key, each
# value had a server of its own. The allocator's setting (read at the job's first allocation: the recorder's alloc_conf), the elastic agent's restart counters and
# run id (`launchers._RANK_ZERO`; read when the job's process group starts), and inductor's cache folder, which torch
# itself writes into the environment of a process the first time it compiles (cache_dir_utils.cache_dir): a test
# run or a notebook that compiled once then keyed every later job apart. Not the node's GPUs (CUDA_VISIBLE_DEVICES
# stays in the key): a library may read them at import.
# Also torch's NVML device-count switch (read when the job first asks for its GPUs), which importing Lightning
# writes into the importing process's environment: every estimate made after one had a server of its own.
RUNTIME_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHINDUCTOR_CACHE_DIR",
               "PYTORCH_NVML_BASED_CUDA_CHECK")
# The server runs outside the sandbox, so it starts with none of what makes a process or an interpreter run code
# at start (the dynamic loader's LD_*, Python's PYTHONSTARTUP, PYTHONHOME, a pycache prefix, ...): of PYTHON*, only
# these settings pass. A job that sets anything else of that kind is traced cold, where its environment is applied
# inside the sandbox only.
SERVER_PYTHON_ENV = ("PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
                     "PYTHONUNBUFFERED", "PYTHONPATH")
LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_NPROC", "RLIMIT_CORE",
          "RLIMIT_FSIZE", "RLIMIT_MEMLOCK")
# The server's command (not `-m`: runpy would run the module a second time beside the package's import of it).
SERVER_MAIN = "import sys; from xmem.trace.child.warm_server import main; main(sys.argv[1:])"


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
    key = json.dumps([_interpreter_identity(interpreter), os.geteuid(), os.getegid(), sorted(os.getgroups()),
                      imports])
    path = directory / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.sock"
    return path if len(str(path)) <= MAX_SOCKET_PATH else None


def _interpreter_identity(interpreter: str) -> list[str]:
    """The interpreter however the job names it (`python`, `python3`, a relative path, a link): its binary and the
    directory it is started from, whose `pyvenv.cfg` (or the one above) picks the environment. -- issue 32: the
    path as written gave `.venv/bin/python` and its `python3` a server each."""
    path = os.path.abspath(interpreter)
    return [os.path.realpath(os.path.dirname(path)), os.path.realpath(path)]


def _shapes_imports(name: str) -> bool:
    return (name.startswith(IMPORT_ENV_PREFIXES) or name in IMPORT_ENV_NAMES) and name not in RUNTIME_ENV


def _runs_code_at_start(name: str) -> bool:
    return name.startswith("LD_") or (name.startswith("PYTHON") and name not in SERVER_PYTHON_ENV)


def server_env(env: dict[str, str], xmem_parent: str, compiled: Path | None = None) -> dict[str, str]:
    """The server's environment (it runs outside the sandbox): of the job's, only what shapes its imports (the key
    of its socket), nothing that runs code at start, the shim cache the runner chose, the server's own bytecode cache
    `compiled` (never the traces' one: `xmem.trace.bytecode`), and xmem alone on PYTHONPATH. The job's whole
    environment is applied inside its sandbox (`_trace_in_process`)."""
    import xmem.trace.bytecode as bytecode
    import xmem.trace.shim as shim
    kept = {k: v for k, v in env.items() if _shapes_imports(k) and not _runs_code_at_start(k)}
    return {"PATH": os.defpath, **kept, **{k: env[k] for k in (shim.DIR_ENV,) if k in env},
            **({bytecode.ENV: str(compiled)} if compiled else {}), "PYTHONPATH": xmem_parent}


def start_server(interpreter: str, path: Path, env: dict[str, str],
                 after: Path | None = None) -> subprocess.Popen | None:
    """Start the server in the background (it locks, waits until `after` is gone, loads, then listens); the caller
    goes on cold meanwhile."""
    idle = os.environ.get(IDLE_ENV, str(DEFAULT_IDLE_S))
    wait = ["--after", str(after), "--caller", str(os.getpid())] if after is not None else []
    make_room(path.parent)
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


@dataclass(frozen=True)
class Server:
    """A running warm server, as `xmem-slurm warm` reports it."""
    pid: int
    uid: int
    socket: str
    interpreter: str
    idle_s: float  # since its last estimate (its socket's mtime: `connect` marks each use)
    private_bytes: int  # memory it holds of its own (not the libraries' code all servers share): what stopping frees


def servers(directory: Path | None = None) -> list[Server]:
    """The warm servers running (a job forked from one is not one), those listening in `directory` when given. Every
    user's for root; another user's memory reads as 0 where /proc hides it."""
    found = _server_commands()
    listed = []
    for pid, argv in found.items():
        path = argv[argv.index("--socket") + 1] if "--socket" in argv[:-1] else ""
        if _parent(pid) in found or (directory is not None and Path(path).parent != directory):
            continue
        try:
            uid, idle = os.stat(f"/proc/{pid}").st_uid, time.time() - os.lstat(path).st_mtime
        except OSError:
            uid, idle = _owner(pid), 0.0  # still loading: no socket yet
        listed.append(Server(pid, uid, path, argv[0], max(idle, 0.0), _private_bytes(pid)))
    return [server for server in listed if server.uid >= 0]


def make_room(directory: Path) -> list[Server]:
    """Stop this directory's least recently used servers so that one more keeps its user within
    MAX_SERVERS_PER_USER; returns those stopped (a job one still runs ends on its own: it is a process of its own)."""
    running = sorted(servers(directory), key=lambda server: server.idle_s)
    stopped = running[MAX_SERVERS_PER_USER - 1:]
    for server in stopped:
        stop(server)
    return stopped


def stop(server: Server) -> None:
    try:
        os.kill(server.pid, signal.SIGTERM)  # the server removes its socket and leaves
    except (ProcessLookupError, PermissionError):
        pass


def _server_commands() -> dict[int, list[str]]:
    commands = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if SERVER_MAIN in argv:
                commands[int(entry.name)] = argv
    return commands


def _parent(pid: int) -> int:
    try:  # the field after the command's closing parenthesis: state, then the parent's pid
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _owner(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1  # gone


def _private_bytes(pid: int) -> int:
    """Private_Clean + Private_Dirty of /proc/PID/smaps_rollup (kB there): the pages no other process maps."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:")))


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
        os.utime(path, follow_symlinks=False)  # used now: the least recently used server is the one `make_room` stops
    except OSError:
        connection.close()
        return None
    return connection


def job_request(argv: list[str], env: dict[str, str], cwd: str | None, gpu: FakeGpu) -> WarmRequest:
    """What the cold child would inherit from this process, beside its command line, environment and fake GPU."""
    umask = os.umask(0o022)
    os.umask(umask)
    return WarmRequest(tuple(argv), dict(env), os.path.abspath(cwd or os.getcwd()), umask,
                       {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}, gpu)


class WarmJob:
    """One estimate on the server: `wait` as Popen.wait (None when the server vanished), `stop` to end it."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.pending = b""

    @classmethod
    def submit(cls, connection: socket.socket, request: WarmRequest, fds: list[int]) -> "WarmJob | None":
        """Send the request with the program's output and progress descriptors; None unless the server started it."""
        body = request.encode()
        job = cls(connection)
        try:
            socket.send_fds(connection, [FRAME_HEADER.pack(len(body))], fds)
            connection.sendall(body)
            started = job._reply(REQUEST_TIMEOUT_S)
        except (OSError, ValueError, TypeError):  # no answer, or not one of ours: go cold
            started = None
        if started is None or started.started is None:
            connection.close()
            return None
        return job

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            reply = self._reply(timeout)
        except socket.timeout:
            raise subprocess.TimeoutExpired("warm tracer", timeout or 0) from None
        except (OSError, ValueError, TypeError):
            reply = None
        self.connection.close()
        return reply.status if reply else None

    def stop(self) -> None:
        """Ask the server to end the job (as the cold helper is sent SIGTERM), and wait until it has."""
        try:
            self.connection.sendall(STOP)
            self._reply(STOP_GRACE_S + 5)
        except (OSError, ValueError, TypeError):
            pass  # the server is gone, and with it the job (it dies with its parent)
        self.connection.close()

    def _reply(self, timeout: float | None) -> WarmReply | None:
        """The server's next line, None at the end of the connection."""
        self.connection.settimeout(timeout)
        while b"\n" not in self.pending:
            chunk = self.connection.recv(4096)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return WarmReply.from_line(line)
