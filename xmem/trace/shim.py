"""The native fake-CUDA shim: find torch without importing it, build the right shim with g++, load it.

Owns the C++ sources' build and cache (`$XDG_CACHE_HOME/xmem-slurm/native/`, else `~/.cache/...`), keyed by torch
version, build kind and source hash. Must never import torch: the shim has to be loaded before torch is.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

NATIVE_DIR = Path(__file__).with_name("native")
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
    root = Path(spec.origin).parent
    build = "cuda" if (root / "lib" / "libtorch_cuda.so").exists() else "cpu"
    return TorchInstall(root, _read_version(root), build)


def _read_version(root: Path) -> str:
    match = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", (root / "version.py").read_text())
    return match.group(1) if match else "unknown"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xmem-slurm" / "native"


# torch wheels since 2.x use the C++11 string ABI; their headers need C++20.
CXXFLAGS = ("-O1", "-std=c++20", "-fPIC", "-shared", "-D_GLIBCXX_USE_CXX11_ABI=1")


def shim_path(torch: TorchInstall) -> Path:
    """Where the shim for this torch lives: one file per (torch version, build, source and flags)."""
    digest = hashlib.sha256(SOURCES[torch.build].read_bytes() + " ".join(CXXFLAGS).encode()).hexdigest()[:12]
    version = re.sub(r"[^A-Za-z0-9.+_-]", "_", torch.version)
    return cache_dir() / f"xmem_fake_cuda-{version}-{torch.build}-{digest}.so"


def build_shim(torch: TorchInstall) -> Path:
    """Compile the shim unless cached. Concurrent builders each write a private file and rename it in place."""
    target = shim_path(torch)
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise ShimError("g++ not found: the fake-CUDA tracer compiles a small C++ shim once "
                        "(install it, e.g. `apt-get install g++`, or set CXX)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=target.parent)
        probe.close()
    except OSError:  # read-only home: build per user in the temporary directory instead
        target = Path(tempfile.gettempdir()) / f"xmem-slurm-native-{os.getuid()}" / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
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
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_shim() -> ctypes.CDLL:
    """Build if needed and load the shim globally. Call before `import torch`."""
    import sys
    if "torch" in sys.modules:
        raise ShimError("the fake-CUDA shim must be loaded before torch is imported")
    return ctypes.CDLL(str(build_shim(find_torch())), mode=ctypes.RTLD_GLOBAL)
