"""The native fake-CUDA shim: find torch without importing it, build the right shim with g++, load it.

Owns the C++ sources' build and cache (`$XMEM_SHIM_DIR`, which the runner sets from its own environment, else
`$XDG_CACHE_HOME/xmem-slurm/native/`, else `~/.cache/...`, else a private directory under the temporary one), keyed
by torch version, build kind and source hash, and the rule that only a library this user built is loaded, and only
with the content its builder recorded: the warm tracer loads it outside the sandbox, so nothing a traced program
wrote may pass (the cache is read-only in the sandbox; the digest catches what the sandbox could not stop, such as
a shim replaced before this rule). The runner builds it before a trace starts (`prepare`), outside the sandbox.
Must never import torch: the shim has to be loaded before torch is.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from xmem.userfiles import open_own, private_dir

NATIVE_DIR = Path(__file__).with_name("native")
DIR_ENV = "XMEM_SHIM_DIR"  # the cache the runner chose (a job's own HOME or XDG_CACHE_HOME never decides it)
DIGEST_SUFFIX = ".sha256"  # beside each shim: the digest of the bytes its builder wrote
SOURCES = {"cuda": NATIVE_DIR / "cuda_build_hooks.cpp", "cpu": NATIVE_DIR / "cpu_build_shim.cpp"}


class ShimError(RuntimeError):
    """The shim could not be built or loaded; the message says what to do."""


@dataclass(frozen=True)
class TorchInstall:
    root: Path  # .../site-packages/torch
    version: str
    build: str  # "cuda" (libtorch_cuda.so present) or "cpu"


def find_torch() -> TorchInstall:
    """Locate the torch package of this interpreter from its files alone."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ShimError("torch is not installed for this Python interpreter")
    return _install_at(Path(spec.origin).parent)


def _install_at(root: Path) -> TorchInstall:
    build = "cuda" if (root / "lib" / "libtorch_cuda.so").exists() else "cpu"
    return TorchInstall(root, _read_version(root), build)


def _read_version(root: Path) -> str:
    match = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", (root / "version.py").read_text())
    return match.group(1) if match else "unknown"


def cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xmem-slurm" / "native"


def temporary_cache_dir() -> Path:
    """Where the shim is kept when the user's cache directory cannot be written."""
    return Path(tempfile.gettempdir()) / f"xmem-slurm-native-{os.getuid()}"


# torch wheels since 2.x use the C++11 string ABI; their headers need C++20.
CXXFLAGS = ("-O1", "-std=c++20", "-fPIC", "-shared", "-D_GLIBCXX_USE_CXX11_ABI=1")


def shim_path(torch: TorchInstall) -> Path:
    """Where the shim for this torch lives: one file per (torch version, build, source and flags, install). The
    install counts because the shim links to its libraries by path (rpath): a shim built for another environment
    with the same torch would load that one's libraries, or none once it is deleted."""
    key = SOURCES[torch.build].read_bytes() + " ".join(CXXFLAGS).encode() + os.fsencode(torch.root.resolve())
    digest = hashlib.sha256(key).hexdigest()[:12]
    version = re.sub(r"[^A-Za-z0-9.+_-]", "_", torch.version)
    return cache_dir() / f"xmem_fake_cuda-{version}-{torch.build}-{digest}.so"


def build_shim(torch: TorchInstall) -> Path:
    """The shim for `torch`, compiled unless cached. Only a file this user owns, in a directory of theirs that
    no one else can write, is ever reused: another user could otherwise plant a library that runs as the victim
    (the shared temporary directory). Concurrent builders each write a private file and rename it in place."""
    target = shim_path(torch)
    _compiler()  # fail early with the actionable message, even when a cached file exists elsewhere
    for directory in (target.parent, temporary_cache_dir()):
        if not private_dir(directory):
            continue
        path = directory / target.name
        if _own_file(path):
            return path
        if _writable(directory):
            return _compile(torch, path)
    # No private place to keep it (a read-only home, another user squatting the temporary name): build afresh.
    return _compile(torch, Path(tempfile.mkdtemp(prefix="xmem-slurm-native-")) / target.name)


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise ShimError("g++ not found: the fake-CUDA tracer compiles a small C++ shim once "
                        "(install it, e.g. `apt-get install g++`, or set CXX)")
    return compiler


def _own_file(path: Path) -> bool:
    """A file of this user's whose content is what its builder recorded."""
    fd = open_own(path)
    if fd is None:
        return False
    try:
        return _as_built(path, fd)
    finally:
        os.close(fd)


def _as_built(path: Path, fd: int) -> bool:
    """Whether the open shim `fd` holds the bytes recorded beside `path` when it was built (no record: no)."""
    record = open_own(str(path) + DIGEST_SUFFIX)
    if record is None:
        return False
    with os.fdopen(record) as text:
        recorded = text.read().strip()
    digest = hashlib.sha256()
    with open(os.dup(fd), "rb") as data:
        data.seek(0)
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest() == recorded


def _writable(directory: Path) -> bool:
    try:
        tempfile.NamedTemporaryFile(dir=directory).close()
    except OSError:  # a read-only home
        return False
    return True


def _compile(torch: TorchInstall, target: Path) -> Path:
    compiler = _compiler()
    libs = ["-lc10", "-ltorch_cpu"] + (["-ltorch_cuda"] if torch.build == "cuda" else [])
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *CXXFLAGS, f"-I{torch.root / 'include'}", str(SOURCES[torch.build]), "-o", tmp,
           f"-L{torch.root / 'lib'}", "-Wl,--no-as-needed", *libs, f"-Wl,-rpath,{torch.root / 'lib'}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or ["no error text"]
            raise ShimError(f"building the fake-CUDA shim with {compiler} failed: {errors[0].strip()}")
        os.chmod(tmp, 0o755)  # the linker keeps mkstemp's 0600 or applies the umask: state the mode once
        _record_digest(Path(tmp), target)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _record_digest(built: Path, target: Path) -> None:
    """Write the digest of the built bytes beside where they go (before they are moved there: a reader never
    sees a shim without its record)."""
    fd, tmp = tempfile.mkstemp(suffix=DIGEST_SUFFIX, dir=target.parent)
    with os.fdopen(fd, "w") as out:
        out.write(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
    os.replace(tmp, str(target) + DIGEST_SUFFIX)


# Run by the job's interpreter, isolated (-I: no PYTHONPATH, user site or current directory): where its torch is.
FIND_TORCH = "import importlib.util; s = importlib.util.find_spec('torch'); print(s.origin if s and s.origin else '')"


def prepare(interpreter: str) -> None:
    """Build the shim of `interpreter`'s torch now, outside the sandbox (where the cache is read-only), so that the
    trace finds it built. Best effort: a tracer that still finds none builds a private copy for itself."""
    try:
        # not resolved: a venv's python links to its base interpreter, yet finds the venv's own packages
        if os.path.abspath(interpreter) == os.path.abspath(sys.executable):
            torch = find_torch()
        else:
            origin = _torch_of(os.path.abspath(interpreter))
            if not origin:
                return
            torch = _install_at(Path(origin).parent)
        build_shim(torch)
    except (ShimError, OSError, ValueError, subprocess.TimeoutExpired):
        pass


@functools.lru_cache(maxsize=8)
def _torch_of(interpreter: str) -> str:
    """Where another interpreter (the job's venv) finds torch, asked in a clean environment, isolated; once per
    process (an estimate traces up to twice per capability class)."""
    done = subprocess.run([interpreter, "-I", "-c", FIND_TORCH], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.defpath}, stdin=subprocess.DEVNULL)
    return done.stdout.strip()


# The same question with the job's own search path: its PYTHONPATH entries (argv) and, unless it turns it off, the
# user's site directory, the places -I leaves out; still nothing of the job's code runs (find_spec only looks).
FIND_TORCH_AS_JOB = ("import importlib.util, os, site, sys; "
                     "sys.path[:0] = sys.argv[1:]; "
                     "os.environ.get('PYTHONNOUSERSITE') or sys.path.append(site.getusersitepackages()); "
                     "s = importlib.util.find_spec('torch'); print(s.origin if s and s.origin else '')")


def job_finds_torch(interpreter: str, env: Mapping[str, str]) -> bool:
    """Whether the job's `interpreter`, in the job's environment `env`, can import torch. True when that cannot be
    told (the trace then says what the program met)."""
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    quiet = {k: env[k] for k in ("HOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE") if k in env}
    try:
        done = subprocess.run([interpreter, "-I", "-c", FIND_TORCH_AS_JOB, *python_path], capture_output=True,
                              text=True, timeout=60, env={"PATH": os.defpath, **quiet}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode != 0 or bool(done.stdout.strip())


def load_shim() -> ctypes.CDLL:
    """Build if needed and load the shim globally. Call before `import torch`. The file is opened once, checked
    through its descriptor and loaded through that same descriptor, so it cannot be swapped after the check."""
    import sys
    if "torch" in sys.modules:
        raise ShimError("the fake-CUDA shim must be loaded before torch is imported")
    path = build_shim(find_torch())
    fd = open_own(path)
    if fd is not None and not _as_built(path, fd):
        os.close(fd)
        fd = None
    if fd is None:
        raise ShimError(f"refusing to load {path}: it is not a file of this user's that only they can write, "
                        "with the content its build recorded")
    through = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)  # no /proc: by name
    try:
        return ctypes.CDLL(through, mode=ctypes.RTLD_GLOBAL)
    finally:
        os.close(fd)
