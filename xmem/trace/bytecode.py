"""The per-user bytecode cache of traces, so that a user's second and later traces do not compile the libraries again.

Every trace runs in a sandbox that drops what the traced program writes (`xmem.trace.sandbox`), and a venv made
without .pyc files (uv's) or a library the user never imported outside a trace has none to read: each trace compiled
torch.distributed, transformers, accelerate... again (27 % of a 70B FSDP trace's CPU seconds, issue 31). The runner
hands the tracer a directory of its own (`directory`), bound writable into the sandbox; every Python process of the
trace points `sys.pycache_prefix` there (`use_in_this_process`, called by the start-up hook and by the warm job),
so Python reads and writes the bytecode of what the job imports there instead of beside the sources.

Why it is safe (each rule is kept here or where named):
- It holds only what Python's import system writes for the sources the traced processes import: under the prefix,
  a file's bytecode mirrors the source's absolute path, and Python checks it against the source's modification time
  and size at every import, as it checks a __pycache__ file beside a source. A library upgraded in place is
  compiled again.
- It is this user's alone: a directory they own, that no one else can write, no symlink (`xmem.userfiles.user_dir`:
  0700, made by the user), under their own cache (~/.cache/xmem-slurm/bytecode, or $XMEM_BYTECODE_DIR from the
  estimator's own environment). Only this user's sandbox binds it; another user's trace gets their own and cannot
  read this one (mode 0700).
- Root has none: root's traces run as an unprivileged identity (`sandbox.trace_identity`, `nobody` by default) that
  would have to write it, and a cache root's trace reads must not be writable by anyone but root.
- It never touches the user's files: with the prefix set, Python writes no __pycache__ beside a source (the user's
  venv, their home, their project); and a directory that is not a private one of the user's is not used at all.
- The traced program can write into it (it is bound writable): a program that planted bytecode there would run it in
  a later trace of the same user, in that trace's sandbox, as that user, which is no more than the program can do
  when it runs for real. Nothing outside a sandbox reads it: the estimator never imports from it, and the warm
  tracer's server (outside the sandbox) is handed its own (`directory(warm=True)`, beside it): written by the server
  alone, which imports the installation's libraries and no code of the job's, and read-only in every trace (the
  runner protects it as it does the shim cache; in the fallback without Landlock, as the shim cache, it is not).
  Each job the server forks points its prefix to the traces' cache before it imports anything of the job's.
- The user's PYTHONDONTWRITEBYTECODE keeps bytecode out of the user's folders; the cache is not one of them, so a
  trace writes it all the same.
- It is bounded: before a trace, at most once per PRUNE_EVERY_S, the runner removes the least recently used files
  beyond MAX_BYTES (`prune_now_and_then`), outside the sandbox, never following a link and removing only regular
  files. A stamp the program set in the future is not believed.
- The real job is unaffected: the variable is set in the tracer's environment alone (`runner.run_trace`); nothing
  of it reaches the job script Slurm runs.

With the prefix set, Python reads no bytecode beside a source either: the .pyc files a venv ships (pip's) are
not used, so a user's first trace compiles those libraries once, into the cache (torch, transformers and
accelerate: about 12 CPU seconds).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from pathlib import Path

from xmem.userfiles import user_dir

ENV = "XMEM_BYTECODE_CACHE"  # in the tracer's environment: the directory every traced process writes bytecode to
DIR_ENV = "XMEM_BYTECODE_DIR"  # in the estimator's: where this user's cache lives (a site's or a test's choice)
HOME_DIR = "~/.cache/xmem-slurm/bytecode"
MAX_BYTES = 512 << 20  # one venv's torch + transformers + accelerate imports took 74 MiB
PRUNE_EVERY_S = 3600  # the walk over a full cache (3,200 files) took 0.15 s on the busy 2-core machine: not every time
PRUNE_STAMP = ".pruned"  # in the cache: its modification time says when it was last pruned
WARM_SUFFIX = "-warm"  # the warm tracer's server's own cache: the traces' one's name with this added


def directory(estimator_env: dict[str, str] | os._Environ = os.environ, warm: bool = False) -> Path | None:
    """This user's bytecode cache of traces (`warm`: of the warm tracer's server), made private if it is new; None
    for root, and where none of the user's own can be had (the configured one is someone else's): they then compile
    as before."""
    if os.geteuid() == 0:
        return None
    return user_dir((estimator_env.get(DIR_ENV) or HOME_DIR).rstrip("/") + (WARM_SUFFIX if warm else ""))


def use_in_this_process() -> None:
    """In a traced Python process, before it imports the job's libraries: read and write bytecode in the cache the
    runner named (nothing when it named none)."""
    cache = os.environ.get(ENV, "")
    if cache:
        sys.pycache_prefix = cache
        sys.dont_write_bytecode = False


def prune_now_and_then(cache: Path, max_bytes: int = MAX_BYTES, every_s: float = PRUNE_EVERY_S) -> int:
    """`prune`, unless the cache was pruned less than `every_s` ago (by its stamp, which is never followed through a
    link); the bytes removed."""
    stamp = cache / PRUNE_STAMP
    try:
        if 0 <= time.time() - os.lstat(stamp).st_mtime < every_s:
            return 0
        stamp.unlink()
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.close(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    return prune(cache, max_bytes)


def prune(cache: Path, max_bytes: int = MAX_BYTES) -> int:
    """Remove the least recently used files of `cache` until it holds at most `max_bytes`; empty folders go too.
    Recently used: read (the access time, where the filesystem keeps it) or written. Returns the bytes removed."""
    files, total, stamp = [], 0, os.path.join(cache, PRUNE_STAMP)
    for folder, _, names in os.walk(cache):  # links to folders are not followed
        for name in names:
            path = os.path.join(folder, name)
            if path == stamp:
                continue
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode):
                    files.append((max(info.st_atime, info.st_mtime), info.st_size, path))
                    total += info.st_size
    removed = 0
    for _, size, path in sorted(files):
        if total - removed <= max_bytes:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += size
    if removed:
        _remove_empty_folders(cache)
    return removed


def _remove_empty_folders(cache: Path) -> None:
    for folder, _, _ in sorted(os.walk(cache), key=lambda entry: -len(entry[0])):
        if folder != str(cache):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # refused while not empty
