"""What counts as "this user's own" file or directory on a shared login node, in one place.

A file another user can write (or swap through a symlink, or a directory they own) is one they control: loading
it as a library runs their code as us (the native shim), reading it as a cached decision or a slot lets them steer
or block us. Owns the rule (owned by the current user, not a symlink, writable by no one else), making a private
directory, and a per-user subdirectory of a shared one (a sticky, world-writable parent such as /tmp). Callers
decide what to do when nothing private can be had; nothing here prints.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def is_own(info: os.stat_result) -> bool:
    """Owned by this user and writable by no one else."""
    return info.st_uid == os.geteuid() and not info.st_mode & OTHERS_WRITE


def private_dir(path: str | os.PathLike[str]) -> bool:
    """Make or accept `path` as a real directory (no symlink) of this user that only they can write. One of
    theirs that is group- or world-writable (a umask of 002, a 1777 they made) is tightened: anything another
    user put there is refused file by file anyway, by its owner."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        if info.st_mode & OTHERS_WRITE:
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~OTHERS_WRITE)
        return True
    except OSError:
        return False


def shared_parent(path: str | os.PathLike[str]) -> bool:
    """A directory others may share safely: ours or root's, and sticky when others can write to it (so no one
    can rename or remove another user's subdirectory), like /tmp."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid in (0, os.geteuid())
            and (not info.st_mode & OTHERS_WRITE or bool(info.st_mode & stat.S_ISVTX)))


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid with no passwd entry (a container): the number names it
        return str(os.geteuid())


def user_dir(root: str | os.PathLike[str]) -> Path | None:
    """This user's private directory at `root`: `root` itself when it is (or can be made) theirs alone, else
    `root/<user name>` when `root` is a safe shared directory (a site's 1777 cache or slot directory). None when
    neither can be had (someone else owns it or squats the name)."""
    root = Path(os.path.expanduser(str(root)))
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return root if private_dir(root) else None
    except OSError:
        return None
    if stat.S_ISDIR(info.st_mode) and is_own(info):
        return root
    mine = root / user_name()
    return mine if shared_parent(root) and private_dir(mine) else None


def open_own(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int | None:
    """A descriptor on `path` if it is a regular file of this user's that no one else can write, never following
    a symlink (checked on the open file, so it cannot be swapped after the check); None otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError:
        return None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and is_own(info):
        return fd
    os.close(fd)
    return None
