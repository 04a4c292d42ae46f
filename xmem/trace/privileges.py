"""User code never runs as root: the rule for the estimates sbatch starts (issue 14, S2).

Root submitting `sbatch --uid=alice job.sh`, or an admin submitting a user's script, runs the filter as uid 0 on
the login node; tracing the job there would run that user's program as root. Owns the decision and its words: as
root, a job that is another user's (`--uid`, or a batch script, working directory or file its command runs that
is not root's alone) is not estimated and keeps its request, with a one-line notice saying how to have it sized.
Root's own job, all of whose files only root can write, is estimated as before: it is root's code, and it will
run as root anyway. The filter passes `guarded_estimator` to the analysis, so a job that needs no trace (a CPU
job, one that is not understood) is answered as before; only the step that would start the program is checked.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping, Sequence
from typing import Any, Callable

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


def guarded_estimator(options: Mapping[str, str], script: str | None) -> Callable[..., Any] | None:
    """None for an ordinary user (the analysis uses the real estimator); as root, the real estimator behind the
    check, which refuses before anything starts."""
    if not as_root():
        return None

    def estimate(command: Sequence[str], **kw: Any) -> Any:
        who = foreign_owner(options, script, command, kw.get("cwd"))
        if who:
            raise RootTraceRefused(notice(who))
        from xmem.estimate import estimate as real

        return real(list(command), **kw)
    return estimate


def kept_decision(errors: Sequence[Any]) -> dict[str, Any] | None:
    """The policy's "keep" decision when a trace was refused as root (its notice is the reason), else None."""
    refused = [e for e in errors if getattr(e, "kind", None) == KIND]
    return {"action": "keep", "reason": refused[0].message} if refused else None
