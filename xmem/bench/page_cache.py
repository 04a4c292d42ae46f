"""What a run read of some files, whether through read() or memory maps: drop them from the page cache before it,
count their cached bytes after it. Used by the weight-loading tests and `scripts/bench_checkpoint.py`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Drop the files' pages from the page cache (written back first: dirty pages are not dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths: Iterable[str | os.PathLike]) -> int:
    """Bytes of the files in the page cache (util-linux `fincore`)."""
    names = [os.fspath(p) for p in paths]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *names],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(word) for word in out.split())
