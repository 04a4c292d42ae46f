"""The on-disk cache of job analyses, so that resubmitting an unchanged job costs a file read, not an estimate.

Owns the cache key (what makes two submissions "the same job" for the estimator) and the store: one JSON file
per key in a directory of the user's own (xmem.userfiles), written atomically (temporary file + rename), safe for
concurrent sbatch processes, bounded in entries by evicting the least recently used. Also owns the per-user slot
lock that caps how many estimates run at once on a login node. It does not know what an analysis contains:
values are plain JSON objects, checked on read by the caller's `validate`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from xmem.userfiles import open_own, private_dir, user_dir

DEFAULT_MAX_ENTRIES = 500
CLOCK_SLACK_S = 60.0  # a use time this far ahead of the clock is still believed (another host's clock on NFS)
KEY_VERSION = "1"  # bump when the meaning of a cached value changes

# Environment variables that change what the estimator sees or how the job allocates GPU memory.
RELEVANT_ENV_PREFIXES = ("CUDA_", "PYTORCH_", "TORCH_", "NCCL_", "XMEM_")
RELEVANT_ENV_NAMES = ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "HF_HOME", "TRANSFORMERS_CACHE")


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that can change an estimate: CUDA/PyTorch settings, the venv, and which
    `python` the PATH finds (not the whole PATH, which differs between shells for no reason that matters)."""
    picked = {k: v for k, v in env.items() if k.startswith(RELEVANT_ENV_PREFIXES) or k in RELEVANT_ENV_NAMES}
    picked.pop("XMEM_CONFIG", None)  # the config file is keyed by its content, not its name
    picked["which python"] = _which("python", env.get("PATH", "")) or ""
    picked["which python3"] = _which("python3", env.get("PATH", "")) or ""
    return picked


def _which(name: str, path: str) -> str | None:
    for d in path.split(os.pathsep):
        candidate = os.path.join(d, name)
        if d and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    return None


def package_versions() -> dict[str, str]:
    """xmem's, torch's and transformers' versions, read from their source files: importing torch would cost
    seconds, and importlib.metadata a tenth of one, on a path (sbatch) that must stay fast."""
    import xmem

    versions = {"xmem": xmem.__version__, "python": sys.version.split()[0]}
    for name in ("torch", "transformers"):
        versions[name] = _source_version(name)
    return versions


def _source_version(package: str) -> str:
    """`__version__` as written in the installed package's version.py or __init__.py ("" if not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin:
        return ""
    folder = Path(spec.origin).parent
    for candidate in ("version.py", "__init__.py"):
        try:
            match = _VERSION.search((folder / candidate).read_text(errors="replace"))
        except OSError:
            continue
        if match:
            return match.group(1)
    return ""


_VERSION = re.compile(r"""(?m)^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""")


LARGE_FILE_BYTES = 16 << 20  # a command names a checkpoint or a dataset: key it by size and time, not content


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in chunks; for a file over LARGE_FILE_BYTES its size and modification time
    instead, so that a submission never reads gigabytes; "" if it cannot be read (a missing file is part of the key
    too)."""
    try:
        info = os.stat(path)
        if info.st_size > LARGE_FILE_BYTES:
            return f"size={info.st_size} mtime_ns={info.st_mtime_ns}"
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ""


def cache_key(
    *,
    script: bytes,
    script_args: Sequence[str] = (),
    options: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    files: Sequence[str | os.PathLike[str]] = (),
    extra: Mapping[str, object] | None = None,
) -> str:
    """sha256 over everything an analysis depends on: the batch script's bytes, its arguments, the sbatch
    options that matter, the relevant environment, the bytes of the files its commands run (train.py...),
    package versions, and `extra` (e.g. the site config's digest)."""
    material = {
        "v": KEY_VERSION,
        "script": hashlib.sha256(script).hexdigest(),
        "args": list(script_args),
        "options": {k: options[k] for k in sorted(options or {})},
        "env": relevant_env(env or {}),
        "files": {str(f): file_digest(f) for f in sorted(map(str, files))},
        "versions": package_versions(),
        "extra": dict(extra or {}),
    }
    blob = json.dumps(material, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


HOME_CACHE_DIR = "~/.cache/xmem-slurm"
MAX_ENTRY_BYTES = 1 << 20  # a cached analysis is a few KiB; anything far larger is not one of ours


def user_cache_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """This user's private part of the site's `cache_dir`: the directory itself when it is theirs alone, its
    `<user>` subdirectory when it is shared (a site's sticky 1777 directory); when another user owns or squats it,
    the user's own ~/.cache/xmem-slurm. If none can be had, the configured path stands and writes fail softly."""
    return user_dir(cache_dir) or user_dir(HOME_CACHE_DIR) or Path(os.path.expanduser(str(cache_dir)))


class AnalysisCache:
    """JSON values by key, one file each under `directory`; at most `max_entries` kept (least recently used go).

    Readers never see a half-written file (writes go to a temporary file renamed into place); a corrupt, vanished
    or foreign entry (not the user's own file, writable by others, a symlink, too large, or refused by `validate`)
    reads as a miss, so it is computed again. A write that fails costs the cache entry, never the caller's value:
    a one-line notice goes to stderr. Two processes writing the same key both write the same value, so the last
    rename winning is harmless.
    """

    def __init__(self, directory: str | os.PathLike[str], max_entries: int = DEFAULT_MAX_ENTRIES,
                 validate: Callable[[dict], bool] | None = None) -> None:
        self.directory = Path(os.path.expanduser(str(directory)))
        self.max_entries = max_entries
        self.validate = validate

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> dict | None:
        path = self._path(key)
        fd = open_own(path)
        if fd is None:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                blob = f.read(MAX_ENTRY_BYTES + 1)
            value = json.loads(blob) if len(blob) <= MAX_ENTRY_BYTES else None
        except (OSError, ValueError):
            return None
        if not isinstance(value, dict) or (self.validate is not None and not self.validate(value)):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # mark as recently used, for eviction
        return value

    def put(self, key: str, value: Mapping[str, object]) -> bool:
        """Store `value`; False (with a notice on stderr) when it could not be written."""
        try:
            blob = json.dumps(value).encode()
        except (TypeError, ValueError) as e:
            return _not_cached(self.directory, f"not JSON: {e}")
        if not private_dir(self.directory):
            return _not_cached(self.directory, "not a directory of this user's that only they can write")
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return _not_cached(self.directory, e.strerror or str(e))
        self._evict()
        return True

    def _evict(self) -> None:
        """Keep the `max_entries` most recently used. A use time in the future (a clock set back, `touch -d`)
        says nothing of use: such an entry counts as the oldest, or 500 of them would evict every new one."""
        entries, now = [], time.time()
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError):
                mtime = path.stat().st_mtime
                entries.append((mtime if mtime <= now + CLOCK_SLACK_S else 0.0, path))
        entries.sort()
        for _, path in entries[: max(0, len(entries) - self.max_entries)]:
            with contextlib.suppress(OSError):
                path.unlink()


def _not_cached(directory: Path, why: str) -> bool:
    print(f"xmem-slurm: estimate not cached in {directory} ({why}); it is used all the same", file=sys.stderr)
    return False


class NoSlotFree(Exception):
    """All estimate slots stayed busy for the whole wait."""


# Each user's slots live in their own subdirectory of this sticky directory (made 1777 by the site install, or by
# the first user), else in their home cache: another user can neither hold nor squat them.
SHARED_SLOTS_DIR = os.path.join(tempfile.gettempdir(), "xmem-slurm-slots")
SLOT_POLL_S = 0.2  # how often a waiting estimate tries the slots again


@contextlib.contextmanager
def estimate_slot(directory: str | os.PathLike[str], max_concurrent: int, wait_s: float,
                  cancel: threading.Event | None = None) -> Iterator[int]:
    """Hold one of this user's `max_concurrent` slots (flock'ed files in their private slot directory under
    `directory`) while an estimate runs, so that a burst of submissions does not start more estimates than the
    login node can take. Slots are per user: a lock file anyone can open is one anyone can hold, blocking everyone.
    Waits up to `wait_s` for a slot, then raises NoSlotFree; also as soon as `cancel` is set (the estimate is no
    longer wanted: the filter handed the job off). A slot is released when its holder exits, however it exits."""
    slots = slot_dir(directory)
    deadline = time.monotonic() + wait_s
    while True:
        if cancel is not None and cancel.is_set():
            raise NoSlotFree("the estimate was no longer wanted while it waited for a slot")
        for i in range(max(1, max_concurrent)):
            fd = open_own(slots / f"slot-{i}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                yield i
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if time.monotonic() >= deadline:
            raise NoSlotFree(f"{max_concurrent} of your estimates already running on this host")
        if cancel is None:
            time.sleep(SLOT_POLL_S)
        else:
            cancel.wait(SLOT_POLL_S)  # woken at once when set: the check above then ends the wait


def slot_dir(directory: str | os.PathLike[str]) -> Path:
    """This user's slot directory: `<directory>/<user>`, else (the shared directory is someone else's, or the
    name is squatted) their home cache's `slots`, else a fresh private one (no cap then, but never a block)."""
    shared = Path(os.path.expanduser(str(directory)))
    if not shared.exists():
        with contextlib.suppress(OSError):
            shared.mkdir(parents=True, mode=0o1777)
            os.chmod(shared, 0o1777)  # mkdir's mode is masked by the umask
    return user_dir(shared) or user_dir(Path(HOME_CACHE_DIR) / "slots") or Path(tempfile.mkdtemp(prefix="xmem-slots-"))
