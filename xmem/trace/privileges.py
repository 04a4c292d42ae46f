"""User code never runs as root: the rule for the estimates sbatch starts (issue 14, S2).

Root submitting `sbatch --uid=alice job.sh`, or an admin submitting a user's script, runs the filter as uid 0 on
the login node; tracing the job there would run that user's program as root. Owns the decision and its words: as
root, a job that is another user's (`--uid`, or a batch script, working directory or file its command runs that
is not root's alone) is not estimated and keeps its request, with a one-line notice saying how to have it sized.
Root's own job, all of whose files only root can write, is estimated as before: it is root's code, and it will
run as root anyway. The filter (xmem.slurm.inline) wraps its estimator in `foreign_owner`'s check, so a job that
needs no trace (a CPU job, one that is not understood) is answered as before; only the step that would start the
program is checked. The tracer decides nothing of Slurm's: it never imports the pipeline above it.

`xmem-slurm check` and `estimate` run by root on another user's script or program (issue 21) are run again as that
user (`rerun_as`: their groups, uid and a clean environment set before exec, as login does), so the program runs
as its owner; where that cannot be done (no such user, xmem's interpreter not reachable by them) they refuse.

Root's own traces never run as uid 0 either (issue 35): the sandbox runs them as the site's trace identity
(`xmem.trace.sandbox.trace_identity`, $XMEM_TRACE_USER or `nobody`); a file it cannot read ends the trace before
the program starts (the runner raises RootTraceRefused, naming the file), never run as root instead.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from collections.abc import Mapping, Sequence
from typing import Callable

KIND = "not_as_root"  # the AnalysisError kind of a refused trace
OTHERS_WRITE = 0o022


class RootTraceRefused(RuntimeError):
    """The program would have run as root."""

    kind = KIND

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def as_root() -> bool:
    return os.geteuid() == 0


def owner_if_not_root(path: str) -> str | None:
    """Who besides root controls `path` (its owner, or "other users" when they may write it); None if only root."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if info.st_uid != 0:
        try:
            return pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            return f"uid {info.st_uid}"
    return "other users" if info.st_mode & OTHERS_WRITE and not os.path.isdir(path) else None


def user_name(uid_option: str) -> str:
    """`--uid` as sbatch hands it on (a number, once resolved) or as typed (a name), as a name where known."""
    if not uid_option.isdigit():
        return uid_option
    try:
        return pwd.getpwuid(int(uid_option)).pw_name
    except KeyError:
        return f"uid {uid_option}"


def foreign_owner(options: Mapping[str, str], script: str | None, command: Sequence[str] = (),
                  cwd: str | None = None) -> str | None:
    """Whose code the job would run, when it is not root's alone; None when tracing it as root is root's own
    business (or when not root at all)."""
    if not as_root():
        return None
    job_user = user_name(options.get("uid") or "")
    if job_user and job_user != "root":
        return job_user
    candidates = [p for p in (script, cwd) if p]
    candidates += [os.path.join(cwd or "", arg) for arg in command if os.path.isfile(os.path.join(cwd or "", arg))]
    return next((who for who in map(owner_if_not_root, candidates) if who), None)


def notice(who: str) -> str:
    """The user's line: whose job it is, why it is not estimated, what to do."""
    return (f"submitted by root for {who}: xmem-slurm never runs a user's program as root, so this job is not "
            f"estimated and keeps its request (submit it as {who} to have it sized)")


# --- issue 21: the CLI as root on another user's files -------------------------------------------------------------

XMEM_PARENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFUSED_EXIT = 2  # as a bad option: nothing was run


def login_env(entry: pwd.struct_passwd) -> dict[str, str]:
    """What a login gives the user, and nothing of root's environment; xmem on the path of its interpreter."""
    env = {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name, "SHELL": entry.pw_shell or "/bin/sh",
           "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": XMEM_PARENT_DIR}
    return {**env, **{k: os.environ[k] for k in ("TERM", "XMEM_CONFIG") if k in os.environ}}


def rerun_as(who: str, argv: Sequence[str], refuse: Callable[[str], None]) -> int:
    """As root: run `argv` as user `who` (initgroups, setgid, setuid, then exec with `login_env`), wait, return its
    exit status. When that cannot be done, `refuse(message)` is called (in the child, which then exits
    REFUSED_EXIT) and nothing of the user's runs."""
    try:
        entry = pwd.getpwnam(who)
    except KeyError:
        refuse(notice_cli(who, "there is no such user to run it as"))
        return REFUSED_EXIT
    if entry.pw_uid == 0:
        refuse(notice_cli(who, "it is root's"))
        return REFUSED_EXIT
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(os.getgrouplist(entry.pw_name, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)  # all three ids: root cannot be regained
            if 0 in (os.getuid(), os.geteuid(), os.getgid()) or os.getgroups().count(0):
                raise PermissionError("root's ids were not all dropped")
            os.execve(argv[0], list(argv), login_env(entry))
        except OSError as error:
            refuse(notice_cli(who, f"running it as {who} failed ({error.strerror or error}: {argv[0]})"))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(REFUSED_EXIT)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def notice_cli(who: str, why: str) -> str:
    return (f"these are {who}'s files and xmem-slurm never runs a user's program as root; {why}: run it as {who}, "
            "or install xmem where every user can run it (scripts/install.sh --prefix /opt/xmem)")


def refuse_as_root(command: Sequence[str], cwd: str | None) -> None:
    """The last guard, where a trace starts (every door: check, estimate, fit, the library): as root, a program
    whose files or directory are another user's is not started (RootTraceRefused)."""
    who = foreign_owner({}, None, command, cwd or os.getcwd()) if as_root() else None
    if who:
        raise RootTraceRefused(notice_cli(who, "it is not started"))


# -- issue 35 (R2): every way code can be named, not only the command's files -----------------------------------------

# Variables that make an interpreter run code from a path (PYTHONSTARTUP only runs interactively; PYTHONUSERBASE
# adds a user site directory).
CODE_PATH_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP")


def writer_besides_root(path: str) -> str | None:
    """Who besides root could change what `path` names: the owner (or "other users", when the group or others may
    write) of the file or of any directory above it (a root-owned file in a user's folder is theirs to replace;
    a sticky directory such as /tmp protects what root owns in it). None when only root can. Symlinks are followed
    as the interpreter would follow them: both the path as written and where it leads are checked."""
    for name in dict.fromkeys([os.path.abspath(path), os.path.realpath(path)]):
        current = name
        while True:
            who = _writer_of(current, is_leaf=current == name)
            if who:
                return who
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
    return None


def _writer_of(path: str, is_leaf: bool) -> str | None:
    try:
        info = os.lstat(path) if not is_leaf else os.stat(path)
    except OSError:
        return None  # nothing there to run
    if info.st_uid != 0:
        try:
            return pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            return f"uid {info.st_uid}"
    sticky = info.st_mode & 0o1000 and os.path.isdir(path)
    link = stat.S_ISLNK(info.st_mode)  # a link's mode means nothing (always 777): only its folder can change it
    return "other users" if info.st_mode & OTHERS_WRITE and not (sticky or link) else None


def refuse_foreign_code(interpreter: str, env: Mapping[str, str]) -> None:
    """As root, the last guard before a trace starts: the interpreter it would run, and every path the job's
    environment adds code from (PYTHONPATH, PYTHONHOME, ...), must be root's alone; else RootTraceRefused, naming
    whose it is. An ordinary user's traces run their own choices."""
    if not as_root():
        return
    named = [("the interpreter " + interpreter, interpreter)]
    for variable in CODE_PATH_VARIABLES:
        named += [(f"{variable} entry {entry}", entry) for entry in env.get(variable, "").split(os.pathsep) if entry]
    for what, path in named:
        who = writer_besides_root(path)
        if who:
            raise RootTraceRefused(notice_cli(who, f"{what} is theirs to change, so it is not run"))


def cli_owner(paths: Sequence[str], cwd: str) -> str | None:
    """As root, whose code `check`/`estimate` would run (the script, the program's files, the directory), when not
    root's alone; None otherwise."""
    return foreign_owner({}, None, [p for p in paths if p], cwd) if as_root() else None


def rerun_cli_as_owner(paths: Sequence[str], refuse: Callable[[str], None]) -> None:
    """The CLI's guard: as root on another user's files, run this same command as them and exit with its status;
    otherwise return (run here)."""
    who = cli_owner(paths, os.getcwd())
    if who is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(rerun_as(who, [sys.executable, "-m", "xmem.cli", *sys.argv[1:]], refuse))
