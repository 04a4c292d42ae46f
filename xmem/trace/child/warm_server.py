"""The warm tracer's server: what runs in the job's interpreter with the native shim, torch, torch._dynamo, the
tracer's own modules and the common training libraries loaded (`preload`), and forks one tracing job per request.
Its client, where servers live, is `xmem.trace.warm` (it runs in the estimator); the frames both read are
`xmem.trace.wire`'s.

Owns the server's life (`serve`: one per socket, under a lock; it loads only once the cold estimate that started it
is done; ended after an idle time, as soon as its code or torch changed on disk (`code_signature`) or its socket was
taken away), its trust rule (a peer whose uid or gid is not the server's is refused, SO_PEERCRED), and each job: a
fresh child of the server (`_handle`) that declines what it cannot run exactly as the cold child would (a preloaded
module the job's path would import from elsewhere, a user site-packages, limits it cannot take: `_declined`), else
forks the job, which takes the request's process state (`_become_job`) and runs `xmem.trace.sandbox` in-process,
which runs `xmem.trace.child.main` in-process instead of exec'ing it. Started by `xmem.trace.warm.start_server`.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import importlib.machinery
import os
import resource
import select
import signal
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xmem.trace.bytecode as bytecode
import xmem.trace.sandbox as sandbox
from xmem.trace.wire import DEFAULT_IDLE_S, FRAME_HEADER, REQUEST_TIMEOUT_S, STOP_GRACE_S, WarmReply, WarmRequest, \
    alive, peer_ids, with_option

SERVER_NICE = 10  # the server's imports must not slow the cold estimate that started it
# Imported by the server after torch when installed (their import runs no user code: only site-packages are on the
# server's path). A library a job would import from another place is not used warm (`_shadowed`). transformers
# loads lazily: its model base (modeling_utils, 1.3 s) is what every HF job imports; a model's own file is a few
# milliseconds. Not its Trainer: transformers.trainer imports peft, which imports bitsandbytes (below).
TRAINING_LIBRARIES = ("numpy", "torchvision", "transformers", "transformers.modeling_utils", "safetensors",
                      "accelerate", "timm", "lightning", "pytorch_lightning", "tqdm")
# Libraries that choose their native code at import by whether CUDA is there (bitsandbytes: get_native_library in
# cextension.py loads its CPU-only library without a GPU). The server has no fake GPU yet, so one of these loaded by
# a preloaded library would run every job on its CPU code (a paged optimizer said "not available in CPU-only
# version" instead of reaching the real CUDA runtime): the server then declines every job, which runs cold.
CHOOSE_BY_CUDA_AT_IMPORT = ("bitsandbytes",)
# Libraries that define kernels at import only where a GPU of at least a capability is there (torchao's MX formats:
# torchao.prototype.mx_formats.kernels asks is_sm_at_least_100(); transformers.modeling_utils pulls it in). The
# server imported them with no GPU, as if below it: a job whose GPU reaches it runs cold, its fake GPU there first.
KERNELS_BY_CAPABILITY_AT_IMPORT = {"torchao": (10, 0)}


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
    triton_as_with_a_gpu()
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


def triton_as_with_a_gpu() -> None:
    """Libraries decide at import whether Triton kernels exist by torch.utils._triton.has_triton(), which asks
    whether a Triton-capable device is there and caches the answer; the server has no fake GPU yet, so it would
    answer no, for good, in every job (torchao's MX casts, pulled in by transformers.modeling_utils, were defined as
    'needs triton' stubs, where a cold trace, whose fake GPU is there first, traces them). Every job runs with a
    GPU: the cache is filled with a capable device's answer (Triton installed with its NVIDIA backend built); each
    job asks again of its own GPU once it has one (fakecuda._ask_triton_again)."""
    try:
        from torch._dynamo.device_interface import CudaInterface
        from torch.utils import _triton
    except Exception:  # noqa: BLE001 - an older torch: nothing cached to correct
        return
    if not _triton.has_triton_package():
        return
    asked = CudaInterface.is_available, CudaInterface.is_triton_capable
    CudaInterface.is_available = staticmethod(lambda: True)
    CudaInterface.is_triton_capable = staticmethod(lambda device=None: True)
    try:
        _triton.has_triton.cache_clear()
        _triton.has_triton()
    except Exception:  # noqa: BLE001 - the backend's own check failed: imports decide as torch would
        _triton.has_triton.cache_clear()
    finally:
        CudaInterface.is_available, CudaInterface.is_triton_capable = asked


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
    xmem_dir = str(Path(__file__).resolve().parents[2]) + os.sep  # xmem/trace/child/warm_server.py
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
            _send(connection, WarmReply(declined=reason))
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            connection.close()
            _become_job(request, fds, loaded)
        for fd in fds:
            os.close(fd)
        _send(connection, WarmReply(started=pid))
        _send(connection, WarmReply(status=_watch(connection, pid)))
    except BaseException:  # noqa: BLE001 - the client falls back to a cold start
        pass
    os._exit(0)


def _receive(connection: socket.socket) -> tuple[WarmRequest, list[int]]:
    connection.settimeout(REQUEST_TIMEOUT_S)
    header, fds, _, _ = socket.recv_fds(connection, FRAME_HEADER.size, 2)
    if len(header) != FRAME_HEADER.size or len(fds) != 2:
        raise OSError("a malformed request")
    (length,) = FRAME_HEADER.unpack(header)
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise OSError("the request was cut short")
        body += chunk
    connection.settimeout(None)
    return WarmRequest.decode(body), fds


def _declined(request: WarmRequest, loaded: Loaded) -> str:
    """Why this job cannot be run here exactly as the cold child would run it; "" when it can."""
    if file_stamps([name for name, _, _ in loaded.signature]) != loaded.signature:
        os.kill(os.getppid(), signal.SIGTERM)  # stale: the next estimate starts a fresh server
        return "xmem, torch or a preloaded library changed since the warm tracer started"
    loaded_early = [name for name in CHOOSE_BY_CUDA_AT_IMPORT if name in loaded.origins]
    if loaded_early:
        return f"{loaded_early[0]} was imported before the job's fake GPU (it picks its native library by CUDA then)"
    for name, at_least in KERNELS_BY_CAPABILITY_AT_IMPORT.items():
        if name in loaded.origins and request.gpu.capability >= at_least:
            return (f"{name} was imported before the job's fake GPU (it defines its kernels for sm{at_least[0]}"
                    f"{at_least[1]} and up at import, where such a GPU is there)")
    env, cwd = request.env, request.cwd
    if _user_site(env) and os.path.isdir(_user_site(env)):
        return "a user site-packages exists (the warm tracer imports from the installation's alone)"
    for name, value in request.limits.items():
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


def _send(connection: socket.socket, reply: WarmReply) -> None:
    try:
        connection.sendall(reply.line())
    except OSError:
        pass


def _become_job(request: WarmRequest, fds: list[int], loaded: Loaded) -> None:
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
        os.umask(request.umask)
        for name, value in request.limits.items():
            resource.setrlimit(getattr(resource, name), value)
        env, cwd = request.env, request.cwd
        os.chdir(cwd)  # the environment stays the server's clean one: the job's is applied inside the sandbox
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path[:] = _job_path(cwd, env, loaded.base_path)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=bool(env.get("PYTHONUNBUFFERED")))
        helper = list(request.argv[3:])  # [python, -I, sandbox.py, OPTIONS..., --, TRACER...]
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


def _trace_in_process(argv: list[str], env: dict) -> None:
    """sandbox.become_tracer for a warm job: what `python -m xmem.trace ARGS` (or the fallback's bootstrap) would
    do, in this process, with torch already loaded."""
    os.environ.clear()
    os.environ.update(env)
    sandbox.install_in_child()
    bytecode.use_in_this_process()  # what the job imports beyond the server's libraries: the user's cache
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
    parser = argparse.ArgumentParser(prog="xmem.trace.child.warm_server", description="the warm tracer's server")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_S, help="seconds without a request before it ends")
    parser.add_argument("--after", type=Path, help="load once this path (the first trace's scratch) is gone")
    parser.add_argument("--caller", type=int, default=0, help="or once this process (the first estimate) is gone")
    args = parser.parse_args(argv)
    serve(args.socket, args.idle, args.after, args.caller)


if __name__ == "__main__":
    main(sys.argv[1:])
