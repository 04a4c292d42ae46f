"""The sandbox a traced program runs in: its writes never land in the user's files, and nothing it starts outlives it.

The runner starts `python -I sandbox.py --scratch DIR ... -- TRACER ARGV` (this file runs as a script and imports
only the standard library). What protects the user, chosen at run time by what the kernel allows:

**namespaces** (Linux user, mount and pid namespaces; unprivileged since Linux 5.11 where the distribution allows
user namespaces; works here as root and as an ordinary user):
- a user namespace that maps the caller's own uid and gid to themselves (the program sees its real uid; files of
  other users show as `nobody`), and a private mount namespace;
- a fresh tmpfs under the scratch directory holds every upper layer; each writable filesystem the program could write
  into (the root filesystem's top-level directories and every other mount, except /proc, /sys, /dev and /run) gets
  an overlayfs of its own, with the real directory as the lower layer. Reads of the user's data see it unchanged,
  reads of what the program wrote see its private copy, and nothing reaches the real files. A mount that overlayfs
  refuses is bound back read-only (its writes fail rather than land). The tmpfs lives only as long as the
  namespace: the copy-on-write view is gone when the estimate ends, also when everything is killed with SIGKILL;
- the scratch directory (where the tracer writes its result) is bound back writable, the shim cache read-only (the
  warm tracer loads the shim outside the sandbox), the user's bytecode cache writable (`--shared`: kept between
  traces, never root's; why that is safe: `xmem.trace.bytecode`); an empty tmpfs covers /run (services' unix sockets: munge,
  databases, the session bus; sockets elsewhere sit behind an overlay, through which a connect is refused);
- a network namespace with loopback only (up: a fake process group's 127.0.0.1 store), no route anywhere else; an
  IPC namespace and a private /dev/shm (the user's running jobs' shared memory is out of reach);
- the tracer holds no capability and has no_new_privs (`drop_privileges`), also when it is not exec'ed (warm); the
  helper runs in a clean environment, the program's is applied to the tracer only;
- no trace runs as uid 0 (issue 35): where root started the helper, root makes the namespaces itself (no user
  namespace), each overlay's lower layer is an idmapped read-only view in which root's files show the trace
  identity as owner (`RootViews`: root's job still reads its script, venv and home; the kernel's checks of
  /proc/sys, /sys, signals see an unprivileged uid), and the tracer drops to that identity (`become_identity`:
  $XMEM_TRACE_USER, `nobody` by default; a site sets a dedicated user). A file the identity cannot read ends the
  trace before the program starts, naming it (`refuse_if_unreadable`); the scratch stays root's, sticky, its
  contents the identity's (`share_scratch`);
- a pid namespace whose init (this file) runs the tracer as pid 2 and reaps orphans; when the init ends, the kernel
  kills every process the program started (Popen children, setsid double forks, forks of the tracer).
- where overlayfs is refused in a user namespace (Linux before 5.11, or the directory has mounts below it, which a
  user namespace may not hide), the directory is bound read-only instead, and Python's writes under it are
  redirected as in the fallback below (a C-level write there fails with EROFS).

**fallback** (namespaces refused, or `XMEM_SANDBOX=fallback`): the helper becomes a child subreaper, so every
orphan of the program is reparented to it, and kills every descendant (found through /proc) when the tracer ends or
the estimate is stopped. The tracer starts through a bootstrap that calls `install_in_child()` before
`xmem.trace` runs (the tracer's own code needs no hook): it redirects Python's file APIs (builtins/io.open, os.open,
mkdir/makedirs, rename/replace, remove/unlink, rmdir, stat/lstat/access, listdir/scandir, chmod/utime/truncate,
symlink; pathlib and most of shutil go through them) into a copy-on-write directory under the scratch, and Landlock (where the kernel has it)
makes every other write outside the scratch fail with EACCES instead of landing. A Python process the program
starts redirects its writes the same way (the boot hook calls `install_in_child()` too). Not covered there: a C
extension or a program other than Python writing with its own open() gets EACCES under Landlock and, without Landlock, writes for real;
fd-relative calls (`dir_fd=`, `shutil.rmtree` of an existing directory) are not redirected; a removal is seen by
the process that made it only; and when the caller and helper are SIGKILLed, a daemon the program made survives (no pid
namespace to end it). Root's fallback runs as the trace identity too, in a mount namespace of its own where every
writable filesystem is root's idmapped read-only view (`_root_views`).

Both modes: every process of the chain dies with its parent (PR_SET_PDEATHSIG), so a caller killed with SIGKILL
takes the trace with it; the tracer has a hard CPU-time limit (RLIMIT_CPU) and a host-memory limit (RLIMIT_DATA:
it counts the heap and private writable mappings, not the address space the CUDA build of torch maps for its
libraries, which makes RLIMIT_AS unusable: a GPT-2 trace on the CUDA build measured 4.1 GiB VmSize, 0.95 GiB
VmData, 0.79 GiB RSS). Per process: a program's worker processes each get the limit; and a file mapped private
and writable (`torch.load(mmap=True)`) counts at its full size. A cgroup would bound the whole tree, but an
ordinary user on a login node cannot make one. The helper writes `sandbox.json` into the scratch: the protection
used and how the tracer ended.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import pwd
import resource
import shutil
import signal
import stat as stat_module
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = \
    0x00020000, 0x10000000, 0x20000000, 0x40000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# Where services listen (munge, databases, the user's session bus): an empty tmpfs covers it in the sandbox.
SERVICES_DIR = "/run"

RESULT_FILE = "sandbox.json"
COW_DIR = "cow"  # under the scratch: the copy-on-write layers
# Set for the tracer when Python's writes are redirected (see _redirecting_env), read by install_in_child().
COW_ENV = "XMEM_SANDBOX_COW"
# "fallback" forces the fallback (tests, or a site that wants no namespaces); "read-only" namespaces without
# overlays, as on kernels before 5.11 (tests). Read by the caller (helper_command), handed to the helper as --mode:
# the helper runs in a clean environment.
MODE_ENV = "XMEM_SANDBOX"
_mode = ""  # the helper's --mode
# Kernel and runtime state, not the user's files: left as they are.
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/run")
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "devtmpfs", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "efivarfs", "nsfs", "rpc_pipefs",
})

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(OSError):
    """A sandbox step the kernel refused."""


class NamespacesRefused(SandboxError):
    """The kernel allows no unprivileged namespaces here: the fallback protects the user instead."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise SandboxError(code, f"{what}: {os.strerror(code)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda s: s.encode() if s is not None else None)
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


# ---- root's trace runs as an unprivileged identity (issue 35, R1) ---------------------------------------------

# Who root's trace runs as: a user name or uid, read from root's own environment by the estimator (never from a
# user's: the helper starts clean). A site sets a dedicated user no other process runs as; `nobody` by default.
TRACE_USER_ENV = "XMEM_TRACE_USER"
DEFAULT_TRACE_USER = "nobody"
NOBODY = 65534  # the kernel's overflow uid and gid: nobody/nogroup where the user database has no `nobody`
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # one number on every architecture since 5.1
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, AT_EMPTY_PATH, AT_FDCWD = 1, 0o2000000, 0x1000, -100
MOUNT_ATTR_RDONLY, MOUNT_ATTR_IDMAP, MOVE_MOUNT_F_EMPTY_PATH = 0x1, 0x100000, 0x4


@dataclass(frozen=True)
class Identity:
    """The unprivileged host uid and gid root's trace runs as (never 0), and its name for messages."""

    uid: int
    gid: int
    name: str

    def option(self) -> str:
        return f"{self.uid}:{self.gid}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> "Identity":
        uid, gid, name = text.split(":", 2)
        return cls(int(uid), int(gid), name)


def trace_identity(env: Mapping[str, str] = os.environ) -> Identity:
    """Who a trace started by root runs as: $XMEM_TRACE_USER (a name or uid of the user database), else `nobody`.
    Raises SandboxError for a setting that names no user, or root's uid or group."""
    wanted = env.get(TRACE_USER_ENV, "").strip() or DEFAULT_TRACE_USER
    try:
        entry = pwd.getpwuid(int(wanted)) if wanted.isascii() and wanted.isdigit() else pwd.getpwnam(wanted)
    except (KeyError, ValueError):
        if wanted != DEFAULT_TRACE_USER:
            raise SandboxError(errno.EINVAL, f"{TRACE_USER_ENV}={wanted}: no such user to run root's traces as")
        return Identity(NOBODY, NOBODY, "nobody")
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise SandboxError(errno.EINVAL, f"{TRACE_USER_ENV}={wanted}: root's traces never run as uid or gid 0")
    return Identity(entry.pw_uid, entry.pw_gid, entry.pw_name)


_identity: Identity | None = None  # the helper's --run-as: set when root started it


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class RootViews:
    """Root's files as the trace identity's own, read-only: idmapped clones of a directory (Linux 5.12+, on
    filesystems that allow it) through which an inode root owns shows the identity as its owner (group 0: the
    identity's group), and every other owner stays a stranger. Root's trace keeps the access to root's files it had
    as uid 0 (the job's script, its venv, root's home), read-only below the overlay that takes its writes, and the
    kernel sees an unprivileged uid everywhere else (/proc/sys, /sys, signals). Made by root, before the drop."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.namespace = _idmap_namespace(identity)  # -1: idmapping is not possible here

    def tree(self, path: str) -> int | None:
        """A detached, read-only, idmapped clone of the mount at `path` (its own filesystem only, no mounts below
        it); None where the kernel or the filesystem refuses."""
        if self.namespace < 0:
            return None
        fd = _libc.syscall(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), path.encode(),
                           ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC))
        if fd < 0:
            return None
        attr = _MountAttr(MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY, 0, 0, self.namespace)
        if _libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
            os.close(fd)
            return None
        return fd

    def owner_of(self, path: str) -> tuple[int, int]:
        """The owner the trace sees for `path` (an overlay's upper takes it): the identity where root owns it."""
        info = os.stat(path)
        mapped = (lambda real, ours: ours if real == 0 else real)
        return mapped(info.st_uid, self.identity.uid), mapped(info.st_gid, self.identity.gid)


def _idmap_namespace(identity: Identity) -> int:
    """A user namespace whose uid and gid 0 are the identity's (the idmap of `RootViews`), held by an fd; -1 where
    one cannot be made. Its maps are written by root from outside, as only a process privileged over the parent
    namespace may map other ids than its own."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return -1
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # lives only until its namespace is held
        os.close(ready_read)
        os.close(done_write)
        os.write(ready_write, b"1" if _libc.unshare(CLONE_NEWUSER) == 0 else b"0")
        os.read(done_read, 1)
        os._exit(0)
    os.close(ready_write)
    os.close(done_read)
    try:
        if os.read(ready_read, 1) != b"1":
            return -1
        Path(f"/proc/{pid}/uid_map").write_text(f"0 {identity.uid} 1")
        Path(f"/proc/{pid}/setgroups").write_text("deny")
        Path(f"/proc/{pid}/gid_map").write_text(f"0 {identity.gid} 1")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    finally:
        os.close(ready_read)
        os.close(done_write)
        os.waitpid(pid, 0)


def _attach(tree: int, path: str) -> None:
    """Put a detached mount (`RootViews.tree`) at `path`."""
    _check(_libc.syscall(SYS_MOVE_MOUNT, ctypes.c_int(tree), b"", ctypes.c_int(AT_FDCWD), path.encode(),
                         ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount {path}")


def become_identity(identity: Identity, parent: int) -> None:
    """Root's tracer becomes the unprivileged identity for good: the capability bounding set emptied while it still
    may, no supplementary groups, then gid and uid (real, effective and saved: none can be regained); every
    capability goes with uid 0. The kernel clears the parent-death signal on a change of credentials: set again,
    and a parent that died meanwhile ends us. Checked: a process left with any id 0 does not go on."""
    for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
        _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
    _take_ids(identity)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    if 0 in (*os.getresuid(), *os.getresgid(), *os.getgroups()):
        raise SandboxError(errno.EPERM, "root's ids were not all dropped")


def _take_ids(identity: Identity) -> None:
    """No supplementary group, then the identity's gid and uid, real, effective and saved (in that order: without
    uid 0 no gid could be set)."""
    os.setgroups([])
    os.setresgid(identity.gid, identity.gid, identity.gid)
    os.setresuid(identity.uid, identity.uid, identity.uid)


def give_to_tracer(path: Path) -> None:
    """What the tracer writes in (what is made in the scratch for it) belongs to root's trace identity; an
    ordinary user's stays theirs. Links are not followed."""
    if _identity is None:
        return
    for folder, dirs, files in os.walk(path):
        for name in [folder, *(os.path.join(folder, entry) for entry in [*dirs, *files])]:
            os.lchown(name, _identity.uid, _identity.gid)


def share_scratch(scratch: Path) -> None:
    """Root's scratch: what is in it becomes the trace identity's, and the identity's group may add to it (the
    tracer writes its result there). The folder stays root's and sticky, so that the helper's own record (written
    before) cannot be replaced by a link the program makes; the helper and the runner open what is there without
    following links."""
    if _identity is None:
        return
    for entry in scratch.iterdir():
        if entry.name != RESULT_FILE:
            give_to_tracer(entry)
    os.chown(scratch, 0, _identity.gid)
    os.chmod(scratch, 0o1770)


def first_unreadable(paths: list[tuple[str, int]], identity: Identity) -> str | None:
    """The first of `paths` (each with the os.access mode it needs) that `identity` cannot use, as it sees them
    from here (a child takes its ids and asks the kernel); None when it can use all."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _take_ids(identity)
            found = next((path for path, mode in paths if not os.access(path, mode)), "")
            os.write(write, found.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        found = answer.read().decode()
    os.waitpid(pid, 0)
    return found or None


def needed_by_tracer(argv: list[str], env: Mapping[str, str]) -> list[tuple[str, int]]:
    """What the tracer cannot start without, with the access it needs: its interpreter, the working directory,
    the folders on its PYTHONPATH (xmem's, the start-up hook's, the job's), and the files the program's command
    names (those that exist)."""
    program = argv[argv.index("--") + 1:] if "--" in argv else []
    needed = [(argv[0], os.X_OK), (os.getcwd(), os.X_OK)]
    needed += [(entry, os.R_OK | os.X_OK) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    needed += [(os.path.abspath(arg), os.R_OK) for arg in program if os.path.isfile(arg)]
    return [(path, mode) for path, mode in needed if os.path.exists(path)]


def refuse_if_unreadable(argv: list[str], env: Mapping[str, str], scratch: Path) -> None:
    """Root's trace ends here, naming the file, when its identity cannot use what the tracer needs (the runner
    raises privileges.RootTraceRefused with the words): never run as root instead."""
    if _identity is None:
        return
    path = first_unreadable([*needed_by_tracer(argv, env), (str(scratch), os.W_OK | os.X_OK)], _identity)
    if path:
        _write_result(scratch, {"refused": unreadable_notice(_identity, path)})
        os._exit(1)


def unreadable_notice(identity: Identity, path: str) -> str:
    return (f"root's trace runs as {identity.name} (uid {identity.uid}), never as root, and {identity.name} cannot "
            f"read {path}: make it readable by {identity.name}, set {TRACE_USER_ENV} to a user who can read it, "
            "or estimate the job as an ordinary user")


# ---- namespaces -------------------------------------------------------------------------------------------------

def enter_namespaces(scratch: Path, protected: list[str], cow_bytes: int,
                     identity: Identity | None = None, shared: list[str] = ()) -> tuple[str, list[str]]:
    """Move this process into new user, mount, pid and network namespaces and cover the filesystems with overlays;
    `protected` (the shim cache: what runs outside the sandbox later) is bound back read-only, the scratch and
    `shared` (the user's bytecode cache, `xmem.trace.bytecode`: kept from one trace to the next) writable.
    With `identity` (root started the helper), no user namespace: root makes the mounts itself, every overlay's
    lower layer is `RootViews`' idmapped view (root's files show the identity as owner), and the tracer will run as
    the identity (`become_identity`).

    Returns a description of what now protects the user's files, and the directories made read-only instead of
    overlaid (all of them where overlayfs is not allowed in a user namespace, before Linux 5.11: Python's writes
    there are then redirected, as in the fallback). Raises NamespacesRefused if the kernel refuses
    the namespaces (nothing has changed then), SandboxError if a later step fails (no fallback is possible then).
    """
    uid, gid = os.getuid(), os.getgid()
    user = CLONE_NEWUSER if identity is None else 0  # root holds every capability already
    # made first: it forks, and the first child after the unshare would be the new pid namespace's init
    views = RootViews(identity) if identity is not None else None
    # A network namespace of its own: loopback only (what a fake process group's TCPStore needs), no route out.
    # An IPC namespace too: the user's other processes' SysV shared memory and queues are out of reach.
    network = _libc.unshare(user | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET) == 0
    if not network and _libc.unshare(user | CLONE_NEWNS | CLONE_NEWPID) != 0:
        raise NamespacesRefused(ctypes.get_errno(), f"unshare: {os.strerror(ctypes.get_errno())}")
    if user:
        Path("/proc/self/setgroups").write_text("deny")  # needed before an unprivileged gid_map
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    if network:
        _loopback_up()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    targets = [path for path, writable in overlay_targets(scratch).items() if writable]
    # Handles on the real directories, taken before any overlay hides them (fds from after the unshare: a mount of
    # the host's namespace cannot be the source of one in ours).
    # A mount point may be a file (a container's /etc/hosts): overlayfs refuses it, so it is made read-only.
    real = {path: os.open(path, os.O_PATH) for path in [*targets, str(scratch), *shared, *protected]}
    trees = {path: views.tree(path) for path in [*targets, *protected]} if views else {}
    owners = {path: views.owner_of(path) for path in targets} if views else {}
    cow = scratch / COW_DIR
    cow.mkdir(mode=0o700)
    owned = f",uid={identity.uid},gid={identity.gid}" if identity else ""
    _mount("xmem-cow", str(cow), "tmpfs", MS_NOSUID | MS_NODEV, f"size={cow_bytes},mode=700{owned}")
    real["cow"] = os.open(cow, os.O_PATH | os.O_DIRECTORY)  # the path may soon lead into an overlay
    covered, read_only = [], []
    for number, path in enumerate(targets):
        lower = trees.get(path) or real[path]
        if _overlay(path, lower, Path(f"/proc/self/fd/{real['cow']}/{number}"), owners.get(path)):
            covered.append(path)
        else:  # e.g. it has mounts below it, which a user namespace may not hide: its own writes fail instead
            _bind_view(path, real[path], trees.get(path))
            read_only.append(path)
    services = _hide_services(uid, cow_bytes, identity)
    for path in [str(scratch), *shared, *protected]:
        if _under(path, (SERVICES_DIR,)):  # a TMPDIR under /run/user: its mount point, in the new tmpfs
            os.makedirs(path, exist_ok=True)
        if path == str(scratch) or path in shared:
            _bind(real[path], path, read_only=False)
        else:
            _bind_view(path, real[path], trees.get(path))
    for fd in [*real.values(), *(tree for tree in trees.values() if tree is not None)]:
        os.close(fd)
    if views and views.namespace >= 0:
        os.close(views.namespace)
    os.chdir(os.getcwd())  # the working directory still points into the real tree: enter its overlay
    text = f"namespaces: writes go to a private copy-on-write overlay of {', '.join(covered) or 'nothing'}"
    if read_only:
        text += f"; read-only, Python's writes there redirected: {', '.join(read_only)}"
    text += "; network: loopback only" if network else "; network NOT isolated (the kernel refused a namespace)"
    if identity is not None:
        text += f"; {_identity_words(identity, [path for path in targets if trees.get(path) is None])}"
    return text + f"; {services}", read_only


def _identity_words(identity: Identity, unmapped: list[str]) -> str:
    said = f"root's trace runs as {identity.name} (uid {identity.uid}), root's files shown as its own, read-only"
    return said + (f" (not under {', '.join(unmapped)}: its filesystem cannot be idmapped)" if unmapped else "")


def _bind_view(path: str, real_fd: int, tree: int | None) -> None:
    """`path` read-only: root's idmapped view of it where there is one, else the directory itself."""
    if tree is not None:
        _attach(tree, path)
    else:
        _bind(real_fd, path, read_only=True)


def _loopback_up() -> None:
    """Bring up the new network namespace's loopback (it starts down): 127.0.0.1 for a fake process group."""
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(handle, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(handle, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def _hide_services(uid: int, shm_bytes: int, identity: Identity | None = None) -> str:
    """An empty tmpfs over /run: the unix sockets of the host's services (munge, and so Slurm; databases; the
    user's session bus, which could start processes outside) are not reachable by path. (Sockets in the other
    directories are behind their overlay, through which a connect is refused; abstract ones are per network
    namespace.) $XDG_RUNTIME_DIR is made again, empty. A private /dev/shm: what the program puts there (its
    DataLoader workers share it) neither lasts nor touches the user's running jobs' segments."""
    for path, size, mode in ((SERVICES_DIR, 64 << 20, "755"), ("/dev/shm", shm_bytes, "1777")):
        try:
            _mount("xmem-private", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size},mode={mode}")
        except SandboxError as error:
            return f"{path} NOT made private ({error.strerror})"
    runtime = Path(SERVICES_DIR) / "user" / str(uid)
    runtime.mkdir(parents=True, mode=0o700)
    if identity is not None:  # root's $XDG_RUNTIME_DIR, as root's files, is the trace identity's
        os.chown(runtime, identity.uid, identity.gid)
    return f"{SERVICES_DIR} replaced by an empty tmpfs (no service's socket), /dev/shm private"


def overlay_targets(scratch: Path) -> dict[str, bool]:
    """The directories to cover, parents before children, each with whether the program could write there.

    The root filesystem is covered by its top-level directories (an overlay on / itself would leave the running
    processes on the old root); every other mount by its own overlay, since an overlay hides the mounts below it.
    """
    mounts = read_mounts()
    tops = [str(entry) for entry in Path("/").iterdir() if entry.is_dir() and not entry.is_symlink()]
    paths = {p for p in [*tops, *mounts] if p != "/" and not _under(p, SYSTEM_DIRS) and not _under(p, (str(scratch),))}
    ordered = sorted(paths, key=lambda p: (p.count("/"), p))
    return {path: _writable(mounts[_mount_of(path, mounts)]) for path in ordered}


def read_mounts() -> dict[str, tuple[str, bool]]:
    """mount point -> (filesystem type, mounted read-only), from /proc/self/mountinfo (the last mount wins)."""
    mounts = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space, as the kernel writes it
        mounts[point] = (fields[separator + 1], "ro" in fields[5].split(","))
    return mounts


def _writable(mount: tuple[str, bool]) -> bool:
    fstype, read_only = mount
    return not read_only and fstype not in PSEUDO_FILESYSTEMS


def _mount_of(path: str, mounts: dict[str, tuple[str, bool]]) -> str:
    return max((point for point in mounts if _under(path, (point,))), key=len)


def _under(path: str, parents: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _overlay(path: str, lower_fd: int, layer: Path, owner: tuple[int, int] | None = None) -> bool:
    if _mode == "read-only":
        return False
    upper, work = layer / "upper", layer / "work"
    upper.mkdir(parents=True)
    work.mkdir()
    upper.chmod(os.stat(lower_fd).st_mode & 0o7777)  # the merged directory shows the upper's mode
    if owner is not None:  # and its owner: root's trace sees root's directories as its own
        os.chown(upper, *owner)
    base = f"lowerdir=/proc/self/fd/{lower_fd},upperdir={upper},workdir={work}"
    for options in (base + ",userxattr", base):  # userxattr: what an unprivileged overlay needs on older kernels
        try:
            _mount("xmem-overlay", path, "overlay", 0, options)
            return True
        except SandboxError:
            continue
    return False


def _bind(source_fd: int, path: str, read_only: bool) -> None:
    # recursive: a user namespace may not uncover what the mounts below a directory hide
    _mount(f"/proc/self/fd/{source_fd}", path, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


# ---- host state out of reach (issue 35, R1) ---------------------------------------------------------------------

# What a process can change on the host without any capability, by its uid alone: root's uid (a trace root starts
# keeps it, mapped to itself) may write the kernel's tunables (/proc/sys/kernel/core_pattern runs a program as the
# real root), sysrq, IRQ and bus settings, /sys (transparent hugepages, device and cgroup settings) and the host's
# device nodes (a disk is root's, writable by its owner). In the sandbox these are read-only, masked or absent.
READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs")
MASKED_PROC = ("kcore", "keys", "timer_list", "sched_debug", "kmsg")  # covered by /dev/null
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # the device nodes a program may open


def hide_host_state() -> str:
    """Make the host's state read-only or absent, after the pid namespace's own /proc is mounted: /proc's
    tunables read-only and its kernel views masked, a read-only /sys, and a /dev of the harmless devices only
    (with the private /dev/shm and a devpts of its own). Returns what was done, for the sandbox line; a step the
    kernel refuses is named there (the caller decides whether root may still run)."""
    refused = []
    for name in READ_ONLY_PROC:
        path = f"/proc/{name}"
        if os.path.exists(path) and not _try_read_only(path):
            refused.append(path)
    for name in MASKED_PROC:
        path = f"/proc/{name}"
        if os.path.exists(path) and not _try(lambda: _mount("/dev/null", path, None, MS_BIND)):
            refused.append(path)
    fresh_sys = _try(lambda: _mount("sysfs", "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC))
    if not fresh_sys and not _try_read_only("/sys"):
        refused.append("/sys")
    if not _try(_minimal_dev):
        refused.append("/dev")
    done = "/proc/sys and the kernel's other settings read-only, /sys read-only, /dev only " + ", ".join(DEVICES)
    return done if not refused else f"{done}, except: {', '.join(refused)} (the kernel refused)"


def _try(step) -> bool:
    try:
        step()
        return True
    except (SandboxError, OSError):
        return False


def _try_read_only(path: str) -> bool:
    return _try(lambda: (_mount(path, path, None, MS_BIND | MS_REC),
                         _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)))


def _minimal_dev() -> None:
    """A tmpfs over /dev with the harmless device nodes bound in from the host's, the private /dev/shm bound back,
    a devpts instance of its own, and the usual links into /proc."""
    kept = {name: os.open(f"/dev/{name}", os.O_PATH) for name in (*DEVICES, "shm") if os.path.exists(f"/dev/{name}")}
    try:
        _mount("xmem-dev", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=1m,mode=755")
        for name, fd in kept.items():
            target = Path("/dev") / name
            target.mkdir() if name == "shm" else target.touch()
            _mount(f"/proc/self/fd/{fd}", str(target), None, MS_BIND)
    finally:
        for fd in kept.values():
            os.close(fd)
    Path("/dev/pts").mkdir()
    if _try(lambda: _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666")):
        os.symlink("pts/ptmx", "/dev/ptmx")
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{link}")


# ---- every interpreter start passes the guard (issue 31) --------------------------------------------------------

GUARD_SCRIPT = Path(__file__).resolve().parent / "child" / "guard.py"
GUARD_SHELL = "/bin/bash"  # `exec -a` keeps argv[0], by which Python knows its venv; POSIX sh has no -a


def guard_interpreters(binaries: list[str], scratch: Path) -> list[str]:
    """Bind a wrapper over each interpreter binary of `binaries` (their real paths), so that every Python process
    the program starts, with whatever options and environment, runs `xmem/trace/child/guard.py` first, which gives
    back the start-up hook to one that would skip it. The real binary stays reachable under the copy-on-write
    tmpfs (ours, so never noexec). Each guard is tried once; one that does not run is taken away again. Returns
    the binaries guarded."""
    if not os.access(GUARD_SHELL, os.X_OK) or not GUARD_SCRIPT.is_file():
        return []
    folder = scratch / COW_DIR / "interpreters"
    folder.mkdir(mode=0o700)
    give_to_tracer(folder)
    guarded = []
    for number, binary in enumerate(binaries):
        real, wrapper = folder / f"python-{number}", folder / f"python-{number}.sh"
        try:
            real.touch(mode=0o700)
            _mount(binary, str(real), None, MS_BIND)
            wrapper.write_text(f'#!{GUARD_SHELL}\nexec -a "$0" {_quoted(real)} -I -S {_quoted(GUARD_SCRIPT)} '
                               f'{_quoted(real)} {_quoted(scratch)} "$0" "$@"\n')
            wrapper.chmod(0o755)
            _mount(str(wrapper), binary, None, MS_BIND)
        except (SandboxError, OSError):
            continue
        if _runs(binary):
            guarded.append(binary)
        else:
            _libc.umount2(binary.encode(), 2)  # MNT_DETACH: the binary as it was
    return guarded


def _quoted(path: Path | str) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def _runs(binary: str) -> bool:
    import subprocess
    ids = {"user": _identity.uid, "group": _identity.gid, "extra_groups": []} if _identity else {}
    try:  # as the tracer would start it: root's check runs as the trace identity
        return subprocess.run([binary, "-S", "-c", ""], env={"PATH": os.defpath}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, **ids).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_init(argv: list[str], limits: Limits, scratch: Path, env: dict, guard: list[str] = ()) -> None:
    """Pid 1 of the new pid namespace: mount its /proc, guard the interpreters (here: the check each guard runs
    must not be the namespace's first process), run the tracer, reap orphans, leave when the tracer ends (the
    kernel then kills whatever the program left running)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)  # pids as the program sees them (psutil, /proc/self)
    except SandboxError:
        pass
    hidden = hide_host_state()
    _write_result(scratch, {"protection": f"{read_result(scratch).get('protection', '')}; {hidden}"})
    if os.geteuid() == 0 and "(the kernel refused)" in hidden:  # root's uid with host state in reach: never run
        _write_result(scratch, {"failed": f"root's trace is not run: the sandbox could not hide the host's state "
                                          f"({hidden}); run it as an ordinary user"})
        os._exit(1)
    refuse_if_unreadable(argv, env, scratch)
    if guard:
        guarded = guard_interpreters(guard, scratch)
        said = f"every start of {', '.join(guarded)} traced, whatever its options and environment" if guarded else \
            "interpreters NOT guarded (a Python process started with -I, -S, -E or a cleared environment escapes)"
        _write_result(scratch, {"protection": f"{read_result(scratch).get('protection', '')}; {said}"})
    tracer = _start_tracer(argv, limits, env)
    status = _wait_for(tracer, limits.memory_bytes)
    _write_result(scratch, {"status": status})
    os._exit(0)


# ---- fallback -------------------------------------------------------------------------------------------------

def run_fallback(argv: list[str], limits: Limits, scratch: Path, protected: list[str], refused: str,
                 program_env: dict, shared: list[str] = ()) -> dict:
    """No namespaces: redirect Python's writes in the tracer, Landlock the rest, reap and kill every descendant.
    `protected` (the shim cache) is passed through unredirected, so that Landlock refuses a write there; `shared`
    (the bytecode cache) too, and Landlock lets the tracer write there as in the scratch."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    views = _root_views(scratch, protected, _identity) if _identity is not None else ""
    cow = scratch / COW_DIR
    cow.mkdir(mode=0o700)
    give_to_tracer(cow)
    env = _redirecting_env(program_env, cow, scratch, [*shared, *protected], only_under=None)
    refuse_if_unreadable(argv, env, scratch)
    landlock = landlock_abi()
    tracer = _start_tracer(_redirected(argv), limits, env, writable=[str(scratch), *shared] if landlock else None)
    _stop_descendants_on_signal()
    status = _wait_for(tracer, limits.memory_bytes)
    kill_descendants()
    backstop = f"Landlock (ABI {landlock}) refuses other writes" if landlock else \
        "no Landlock: C-level writes land, the shim cache is not protected"
    return {"status": status, "protection": f"fallback ({refused}): Python's file APIs redirected to a copy-on-write "
                                            f"directory; {backstop}; the program's processes killed at the end "
                                            f"(subreaper); network NOT isolated{views}"}


def _root_views(scratch: Path, protected: list[str], identity: Identity) -> str:
    """Root's fallback, where no pid or user namespace is to be had: root may still make a mount namespace, in
    which each writable filesystem is replaced by `RootViews`' read-only view (root's files shown as the trace
    identity's own, so that root's job still reads them; writes there fail rather than land), the scratch bound
    back writable and `protected` read-only. Returns the words for the sandbox line."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        return f"; root's trace runs as {identity.name} (uid {identity.uid}); root's own files stay unreadable to it"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    views = RootViews(identity)
    targets = [path for path, writable in overlay_targets(scratch).items() if writable]
    real = {path: os.open(path, os.O_PATH) for path in [str(scratch), *protected]}
    trees = {path: views.tree(path) for path in [*targets, *protected]}
    for path in targets:
        if trees[path] is not None:
            _attach(trees[path], path)
    for path in protected:
        _bind_view(path, real[path], trees[path])
    _bind(real[str(scratch)], str(scratch), read_only=False)
    for fd in [*real.values(), *(tree for tree in trees.values() if tree is not None)]:
        os.close(fd)
    os.chdir(os.getcwd())
    unmapped = [path for path in targets if trees[path] is None]
    return "; " + _identity_words(identity, unmapped)


# Runs `python -m MODULE ARGS` with Python's file APIs redirected first (before the module imports anything).
BOOTSTRAP = ("import runpy, sys; from xmem.trace.sandbox import install_in_child; install_in_child(); "
             "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def _redirecting_env(program_env: dict, cow: Path, scratch: Path, passthrough: list[str],
                     only_under: list[str] | None) -> dict:
    """The tracer's environment that makes install_in_child() redirect: writes under `only_under` (None: anywhere)
    but not in the scratch or `passthrough` go to `cow`. TMPDIR points into the scratch, so that what writes
    temporary files past Python (g++ building the shim, a subprocess) can."""
    spec = {"cow": str(cow), "passthrough": [str(scratch), *passthrough], "only_under": only_under}
    temporary = scratch / "tmp"
    temporary.mkdir(mode=0o700)
    give_to_tracer(temporary)
    return dict(program_env, **{COW_ENV: json.dumps(spec), "TMPDIR": str(temporary)})


def _redirected(argv: list[str]) -> list[str]:
    """The tracer's command (`python -m xmem.trace ...`) with the redirection installed before it starts (any
    other command runs as it is, under Landlock only)."""
    return [argv[0], "-c", BOOTSTRAP, *argv[2:]] if argv[1:2] == ["-m"] else argv


def kill_descendants() -> None:
    """SIGKILL every process below this one (orphans are ours as subreaper) and reap them, until none is left."""
    while True:
        pids = descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all()


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap_all() -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _stop_descendants_on_signal() -> None:
    def stop(signum: int, frame: object) -> None:
        kill_descendants()
        os._exit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)


# ---- Landlock: the fallback's backstop --------------------------------------------------------------------------

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # same on x86/arm64
LANDLOCK_RULE_PATH_BENEATH = 1
# Every filesystem right that changes something, by ABI version (landlock.h): the rights a write needs.
WRITE_RIGHTS = {1: (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10)
                | (1 << 11) | (1 << 12), 2: 1 << 13, 3: 1 << 14}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 if it has none (or the architecture's syscall numbers differ)."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return 0
    version = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(version, 0)


def restrict_writes(writable: list[str], abi: int) -> None:
    """This process and its children may write only beneath `writable` and /dev (null, tty, shm)."""
    rights = 0
    for version in range(1, min(abi, 3) + 1):
        rights |= WRITE_RIGHTS[version]
    attr = _RulesetAttr(rights)
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                            ctypes.c_uint32(0))
    if ruleset < 0:
        raise SandboxError(ctypes.get_errno(), "landlock_create_ruleset")
    for path in [*writable, "/dev"]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneathAttr(rights, fd)
        _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                             ctypes.c_uint32(0)), f"landlock_add_rule {path}")
        os.close(fd)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


# ---- the tracer process -----------------------------------------------------------------------------------------

class Limits:
    """What the tracer may use: host memory (resident bytes per process, watched by `_wait_for`; RLIMIT_DATA at
    DATA_BACKSTOP times it) and CPU seconds (RLIMIT_CPU)."""

    def __init__(self, memory_bytes: int, cpu_seconds: int) -> None:
        self.memory_bytes, self.cpu_seconds = memory_bytes, cpu_seconds

    def apply(self) -> None:
        if self.memory_bytes > 0:
            backstop = self.memory_bytes * DATA_BACKSTOP
            _lower_limit(resource.RLIMIT_DATA, backstop, backstop)
        if self.cpu_seconds > 0:  # SIGXCPU at the soft limit, SIGKILL at the hard one
            _lower_limit(resource.RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds + 5)


def _lower_limit(which: int, soft: int, hard: int) -> None:
    """Set a limit, never above one the site or the user already set (an unprivileged process cannot raise it)."""
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def become_tracer(argv: list[str], env: dict) -> None:
    """How the tracer process turns into the tracer: exec its command. The warm tracer's job (xmem.trace.child.warm_server), which has
    torch loaded already, replaces this with a run of the tracing child in the same process."""
    os.execvpe(argv[0], argv, env)


def _start_tracer(argv: list[str], limits: Limits, env: dict, writable: list[str] | None = None) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        parent = os.getppid()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        limits.apply()
        if writable is not None:
            restrict_writes(writable, landlock_abi())
        if _identity is not None:
            become_identity(_identity, parent)
        drop_privileges()
        become_tracer(argv, env)
    except BaseException as error:  # noqa: BLE001 - the fork must never return into the helper's code
        sys.stderr.write(f"xmem sandbox: cannot start the tracer: {error}\n")
    os._exit(127)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    """The tracer holds no capability and can gain none, whoever runs it, warm or cold: in the user namespace the
    helper has all of them (umount2 of an overlay would uncover the user's files), root keeps them across exec,
    and the warm tracer does not exec at all. no_new_privs (no setuid or file capabilities at exec), the bounding
    set emptied (what exec as uid 0 would grant), the ambient set cleared, then capset to nothing. Checked: a
    tracer left with any capability is not started."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
        _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)  # EPERM: no CAP_SETPCAP, so none to drop
    _libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)  # EINVAL before Linux 4.3
    _check(_libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), (_CapData * 2)()), "capset")
    held = capabilities()
    if held["NoNewPrivs"] != 1 or any(held[name] for name in ("CapInh", "CapPrm", "CapEff", "CapAmb")) or \
            (os.geteuid() == 0 and held["CapBnd"]):
        raise SandboxError(errno.EPERM, f"the tracer would keep privileges: {held}")
    if 0 in os.getresuid():  # -- issue 35: no trace runs as uid 0, in a namespace or not
        raise SandboxError(errno.EPERM, "the tracer would run as uid 0")


def capabilities() -> dict[str, int]:
    """This process's capability sets and no_new_privs, as /proc/self/status shows them."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name], 16 if name.startswith("Cap") else 10)
            for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")}


def _wait_for(pid: int, resident_limit: int = 0) -> dict:
    """Wait for `pid`, reaping every other child (orphans) meanwhile; how it ended: {"exit": N} or {"signal": N}.
    With `resident_limit`, every process below this one is watched too: the first whose resident memory passes it
    ends `pid` (SIGKILL), and the result says so: {"signal": 9, "resident": bytes, "pid": N}."""
    over = None
    while True:
        try:
            done, status = os.waitpid(-1, os.WNOHANG if resident_limit else 0)
        except InterruptedError:
            continue
        except ChildProcessError:  # nothing left to wait for (the tracer was reaped already)
            return {"exit": 0}
        if done == pid:
            if over is not None:
                return {"signal": signal.SIGKILL, **over}
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.WEXITSTATUS(status)}
        if done == 0:  # none ended: look at the memory, then again in a moment
            over = over or _over_memory(resident_limit)
            if over is not None:
                _kill_quietly(pid)
            time.sleep(MEMORY_POLL_S)


# The host-memory limit is on what a process holds resident (anonymous pages and shared memory), checked every
# MEMORY_POLL_S, per process as before: a reservation it never touches (a pinned offload buffer that the fake GPU
# never fills, a checkpoint's place) costs the login node nothing and no longer counts. RLIMIT_DATA stays as a
# backstop against runaway reservations, at DATA_BACKSTOP times the limit.
MEMORY_POLL_S = 0.05
DATA_BACKSTOP = 16


def _over_memory(limit: int) -> dict | None:
    """The first process below this one whose resident memory is over `limit`: {"resident": bytes, "pid": N}."""
    for child in descendants(os.getpid()):
        resident = resident_bytes(child)
        if resident > limit:
            return {"resident": resident, "pid": child}
    return None


def resident_bytes(pid: int) -> int:
    """What `pid` holds in memory of its own: RssAnon + RssShmem of /proc/PID/status (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) << 10 for name in ("RssAnon", "RssShmem"))


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _write_result(scratch: Path, fields: dict) -> None:
    path = scratch / RESULT_FILE
    previous = read_result(scratch)
    # never through a link: in root's scratch the program may add entries (share_scratch)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w") as out:
        out.write(json.dumps({**previous, **fields}))


def read_result(scratch: Path) -> dict:
    """What the helper wrote: {"protection": str, "status": {"exit": N} | {"signal": N}}; {} if it wrote nothing."""
    return read_json_file(Path(scratch) / RESULT_FILE) or {}


MAX_RESULT_BYTES = 1 << 30


def read_json_file(path: Path) -> object | None:
    """The JSON of a regular file in the scratch, None when there is none (or it is not one: a link, a FIFO, a
    device the program put there), never blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with open(fd, "rb") as handle:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            return json.loads(handle.read(MAX_RESULT_BYTES))
        except ValueError:
            return None


# ---- the helper -------------------------------------------------------------------------------------------------

PROGRAM_ENV_FILE = "program-env.json"  # in the scratch: the program's environment, read and removed by the helper
# The helper's own environment: nothing of the job's (an LD_PRELOAD there would run outside the sandbox).
HELPER_ENV = {"PATH": os.defpath, "LC_ALL": "C.UTF-8"}


def helper_command(python: str, scratch: Path, memory_bytes: int, cpu_seconds: int,
                   protected: list[str], guarded: list[str] = (), shared: list[str] = ()) -> list[str]:
    """The command line that runs `sandbox.py` (isolated from the user's PYTHONPATH) in front of the tracer; start
    it with HELPER_ENV, after `write_program_env`. `protected` directories are read-only in the sandbox; every
    start of a `guarded` interpreter binary passes the guard (`guard_interpreters`)."""
    command = [python, "-I", str(Path(__file__).resolve()), "--scratch", str(scratch), "--parent", str(os.getpid()),
               "--memory-bytes", str(memory_bytes), "--cpu-seconds", str(cpu_seconds),
               "--mode", os.environ.get(MODE_ENV, ""), "--program-env", str(scratch / PROGRAM_ENV_FILE)]
    if os.geteuid() == 0:  # -- issue 35: root's own setting, from root's environment
        command += ["--run-as", trace_identity().option()]
    for path in protected:
        command += ["--protect", path]
    for path in shared:
        command += ["--shared", path]
    for binary in guarded:
        command += ["--guard", binary]
    return [*command, "--"]


def write_program_env(scratch: Path, env: Mapping[str, str]) -> None:
    """Hand the program's environment to the helper through the scratch (private to the user): the helper starts
    in a clean one and applies this one only when it starts the tracer, inside the sandbox."""
    path = scratch / PROGRAM_ENV_FILE
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as out:
        json.dump(dict(env), out)


def _read_program_env(path: Path | None) -> dict[str, str]:
    """The program's environment from the caller's file (removed once read), else this process's own."""
    if path is None:
        return dict(os.environ)
    env = json.loads(path.read_text())
    path.unlink()
    return env


def main(argv: list[str], program_env: dict[str, str] | None = None) -> None:
    """Run the helper. `program_env`: the tracer's environment when the caller has it at hand (the warm tracer),
    else read from --program-env."""
    parser = argparse.ArgumentParser(description="run a command in xmem's sandbox")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True, help="pid of the caller: we die with it")
    parser.add_argument("--memory-bytes", type=int, default=0)
    parser.add_argument("--cpu-seconds", type=int, default=0)
    parser.add_argument("--protect", action="append", default=[], help="a directory read-only in the sandbox")
    parser.add_argument("--shared", action="append", default=[],
                        help="a directory of the user's, writable in the sandbox and kept (the bytecode cache)")
    parser.add_argument("--guard", action="append", default=[], help="an interpreter binary to guard")
    parser.add_argument("--mode", default="", help=f"as ${MODE_ENV}")
    parser.add_argument("--program-env", type=Path, help="JSON file of the program's environment (then removed)")
    parser.add_argument("--run-as", type=Identity.parse, help="UID:GID:NAME root's trace runs as (trace_identity)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent:  # the caller died before the line above took effect
        os._exit(1)
    global _mode, _identity
    _mode = args.mode
    if program_env is None:
        program_env = _read_program_env(args.program_env)
    limits = Limits(args.memory_bytes, args.cpu_seconds)
    keep = [path for path in args.protect if os.path.isdir(path)]
    # never root's: root's trace runs as an identity whose writes root must not read back (xmem.trace.bytecode)
    shared = [path for path in args.shared if os.path.isdir(path)] if os.geteuid() != 0 else []
    try:
        # -- issue 35: no trace runs as uid 0; root's runs as the identity, which owns what the tracer writes
        _identity = (args.run_as or trace_identity({})) if os.geteuid() == 0 else None
        _write_result(args.scratch, {})
        share_scratch(args.scratch)
        if _mode == "fallback":
            raise NamespacesRefused(errno.EPERM, f"{MODE_ENV}=fallback is set")
        protection, read_only = enter_namespaces(args.scratch, keep, cow_bytes=max(limits.memory_bytes, 1 << 30),
                                                 identity=_identity, shared=shared)
    except NamespacesRefused as refused:
        _write_result(args.scratch, run_fallback(command, limits, args.scratch, keep, f"no namespaces: {refused}",
                                                 program_env, shared))
        os._exit(0)
    except OSError as error:  # half-way into the namespaces: the user's files cannot be promised safe
        _write_result(args.scratch, {"failed": f"the sandbox could not be set up: {error}"})
        os._exit(1)
    _write_result(args.scratch, {"protection": protection + "; the program's processes end with it (pid namespace)"})
    env = program_env
    if read_only:
        cow = args.scratch / COW_DIR / "python"
        cow.mkdir()
        give_to_tracer(cow)
        env = _redirecting_env(program_env, cow, args.scratch, [*shared, *keep], only_under=read_only)
        command = _redirected(command)
    init = os.fork()
    if init == 0:
        run_init(command, limits, args.scratch, env, [b for b in args.guard if os.path.isfile(b)])
    _kill_on_signal(init)
    _wait_for(init)
    os._exit(0)


def _kill_on_signal(init: int) -> None:
    """Stopping the helper stops the namespace: its init's death kills everything in it."""
    def stop(signum: int, frame: object) -> None:
        os.kill(init, signal.SIGKILL)
        os._exit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)


# ---- the tracer side of the fallback ----------------------------------------------------------------------------

def install_in_child() -> None:
    """In the tracer, before anything else (the fallback's bootstrap calls it): redirect Python's file APIs into
    the copy-on-write directory the helper made. A no-op under namespaces, where the kernel does it. The setting
    stays in the environment: every Python process the program starts calls this at start-up too (the boot hook,
    `xmem/trace/child/boot`), so that its writes land in the same copy instead of being refused. Once per process: a
    second CopyOnWrite would take the first one's functions for the real ones."""
    global _installed
    spec = os.environ.get(COW_ENV, "")
    if spec and not _installed:
        settings = json.loads(spec)
        CopyOnWrite(settings["cow"], settings["passthrough"], settings["only_under"]).install()
        _installed = True


_installed = False  # whether this process's file APIs are redirected


class CopyOnWrite:
    """Python's file APIs over a copy-on-write directory: a write to /a/b goes to COW/a/b (copied from /a/b first
    when the write keeps the old content), a read of /a/b sees COW/a/b if the program wrote it, a removal of a real
    file only hides it (in this process). Paths under `passthrough` (the scratch, the shim cache), /dev, /proc and
    /sys are left alone, and so is everything outside `only_under` when it is given."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def __init__(self, cow: str, passthrough: list[str], only_under: list[str] | None = None) -> None:
        self.cow = os.path.realpath(cow)
        self.passthrough = (*map(os.path.realpath, passthrough), *SYSTEM_DIRS)
        self.only_under = tuple(only_under) if only_under is not None else None
        self.hidden: set[str] = set()  # real paths the program removed or renamed away
        self.real = {name: getattr(os, name) for name in
                     ("open", "mkdir", "rename", "replace", "remove", "unlink", "rmdir", "stat", "lstat", "listdir",
                      "scandir", "access", "chmod", "utime", "truncate", "symlink")}
        import builtins
        import io
        self.real_open = io.open
        self.modules = (builtins, io)

    def install(self) -> None:
        for module in self.modules:
            module.open = self.open
        os.open, os.mkdir, os.rmdir = self.os_open, self.mkdir, self.rmdir
        os.rename = os.replace = self.rename
        os.remove = os.unlink = self.remove
        os.stat, os.lstat, os.access = self.stat, self.lstat, self.access
        os.listdir, os.scandir = self.listdir, self.scandir
        # metadata changes: Landlock does not refuse these, so they must reach the copy
        os.chmod, os.utime, os.truncate = self.chmod, self.utime, self.truncate
        os.symlink = self.symlink

    # -- where a path lives (checked with the real os functions: the patched ones would see the copies) --
    def _key(self, path) -> str | None:
        """The absolute path if it is redirected, else None (fds, pass-through paths)."""
        if isinstance(path, int):
            return None
        absolute = os.path.abspath(os.fsdecode(path))
        elsewhere = self.only_under is not None and not _under(absolute, self.only_under)
        return None if elsewhere or _under(absolute, self.passthrough) else absolute

    def _copy(self, key: str) -> str:
        return self.cow + key

    def _mode(self, path: str) -> int | None:
        try:
            return self.real["stat"](path).st_mode
        except OSError:
            return None

    def _is_dir(self, path: str) -> bool:
        return stat_module.S_ISDIR(self._mode(path) or 0)

    def _lexists(self, path: str) -> bool:
        try:
            self.real["lstat"](path)
        except OSError:
            return False
        return True

    def _exists_real(self, key: str) -> bool:
        return key not in self.hidden and self._lexists(key)

    def _for_read(self, path):
        key = self._key(path)
        if key is None:
            return path
        if self._lexists(self._copy(key)):
            return self._copy(key)
        if key in self.hidden:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(path))
        return path

    def _for_write(self, path, keep_content: bool):
        key = self._key(path)
        if key is None:
            return path
        copy = self._copy(key)
        self._make_parents(key)
        if keep_content and not self._lexists(copy) and self._exists_real(key) and \
                stat_module.S_ISREG(self._mode(key) or 0):
            shutil.copy2(key, copy)
        self.hidden.discard(key)
        return copy

    def _make_parents(self, key: str) -> None:
        parent = self._copy(os.path.dirname(key))
        if not self._is_dir(parent):
            os.makedirs(parent, exist_ok=True)  # under the scratch: the real os.mkdir does the work

    # -- the patched APIs --
    def open(self, file, mode="r", *args, **kwargs):
        if "x" in mode and self._key(file) and self.access(file, os.F_OK):
            raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(file))
        writes = any(flag in mode for flag in "wax+")
        target = self._for_write(file, keep_content="w" not in mode) if writes else self._for_read(file)
        return self.real_open(target, mode, *args, **kwargs)

    def os_open(self, path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            return self.real["open"](path, flags, mode, dir_fd=dir_fd)
        if flags & self.WRITE_FLAGS:
            target = self._for_write(path, keep_content=not flags & os.O_TRUNC)
        else:
            target = self._for_read(path)
        return self.real["open"](target, flags, mode)

    def mkdir(self, path, mode=0o777, *, dir_fd=None):
        key = self._key(path)
        if key is None or dir_fd is not None:
            return self.real["mkdir"](path, mode, dir_fd=dir_fd)
        if self._exists_real(key) or self._lexists(self._copy(key)):
            raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(path))
        parent = os.path.dirname(key)
        if not (self._is_dir(self._copy(parent)) or (self._exists_real(parent) and self._is_dir(parent))):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(path))
        self._make_parents(key)
        self.hidden.discard(key)
        self.real["mkdir"](self._copy(key), mode)

    def rename(self, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        source, key = self._key(src), self._key(dst)
        if src_dir_fd is not None or dst_dir_fd is not None or (source is None and key is None):
            return self.real["replace"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        origin = self._for_read(src)
        target = self._for_write(dst, keep_content=False) if key else dst
        if origin == src and source is not None:  # a real file: copy it, and hide the original
            (shutil.copytree if self._is_dir(source) else shutil.copy2)(source, target)
            self.hidden.add(source)
        else:
            self.real["replace"](origin, target)

    def remove(self, path, *, dir_fd=None):
        key = self._key(path)
        if key is None or dir_fd is not None:
            return self.real["unlink"](path, dir_fd=dir_fd)
        copy = self._copy(key)
        if self._lexists(copy):
            self.real["unlink"](copy)
            if not self._exists_real(key):
                return
        elif not self._exists_real(key):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(path))
        self.hidden.add(key)

    def rmdir(self, path, *, dir_fd=None):
        key = self._key(path)
        if key is None or dir_fd is not None:
            return self.real["rmdir"](path, dir_fd=dir_fd)
        if self.listdir(path):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", os.fsdecode(path))
        if self._is_dir(self._copy(key)):
            self.real["rmdir"](self._copy(key))
        self.hidden.add(key)

    def stat(self, path, *, dir_fd=None, follow_symlinks=True):
        if dir_fd is not None:
            return self.real["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        return self.real["stat"](self._for_read(path), follow_symlinks=follow_symlinks)

    def lstat(self, path, *, dir_fd=None):
        return self.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def chmod(self, path, mode, *, dir_fd=None, follow_symlinks=True):
        if dir_fd is not None:
            return self.real["chmod"](path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        return self.real["chmod"](self._for_write(path, keep_content=True), mode, follow_symlinks=follow_symlinks)

    def utime(self, path, times=None, *, ns=None, dir_fd=None, follow_symlinks=True):
        target = path if dir_fd is not None else self._for_write(path, keep_content=True)
        extra = {"ns": ns} if ns is not None else {}
        return self.real["utime"](target, times, dir_fd=dir_fd, follow_symlinks=follow_symlinks, **extra)

    def truncate(self, path, length):
        return self.real["truncate"](self._for_write(path, keep_content=True), length)

    def symlink(self, src, dst, target_is_directory=False, *, dir_fd=None):
        target = dst if dir_fd is not None else self._for_write(dst, keep_content=False)
        return self.real["symlink"](src, target, target_is_directory, dir_fd=dir_fd)

    def access(self, path, mode, **kwargs):
        try:
            target = self._for_read(path)
        except FileNotFoundError:
            return False
        return self.real["access"](target, mode, **kwargs)

    def _names(self, path) -> dict[str, str]:
        """name -> where it lives, for the merged directory `path` (a redirected one)."""
        key = self._key(path)
        names = {}
        if self._exists_real(key) and self._is_dir(key):
            names = {n: os.path.join(key, n) for n in self.real["listdir"](key) if os.path.join(key, n) not in
                     self.hidden}
        if self._is_dir(self._copy(key)):
            names.update({n: os.path.join(self._copy(key), n) for n in self.real["listdir"](self._copy(key))})
        elif not names and not (self._exists_real(key) and self._is_dir(key)):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(path))
        return names

    def listdir(self, path="."):
        if self._key(path) is None:
            return self.real["listdir"](path)
        names = sorted(self._names(path))
        return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names

    def scandir(self, path="."):
        if self._key(path) is None:
            return self.real["scandir"](path)
        wanted = self._names(path)
        entries = []
        for folder in {os.path.dirname(where) for where in wanted.values()}:
            with self.real["scandir"](folder) as found:
                entries += [e for e in found if wanted.get(e.name) == e.path]
        return _EntryList(entries)


class _EntryList(list):
    """What os.scandir returns, as a context manager too."""

    def __enter__(self) -> "_EntryList":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None


if __name__ == "__main__":
    main(sys.argv[1:])
