"""Throw-away login users for the tests that pin what one user can do to another (issue 14).

Made with `useradd` (a home of their own under a temporary base), removed with `userdel -r` at the end; commands run
as them through `setpriv` with their own groups and a clean environment. Needs root; the tests skip otherwise.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

SYSTEM_PYTHON = "/usr/bin/python3"  # world-usable, unlike a venv whose interpreter lives under /root (mode 700)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def argv(self, *command: str) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--", *command]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "PATH": "/usr/bin:/bin",
                "LANG": "C.UTF-8", **(extra or {})}

    def run(self, *command: str, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
            timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.argv(*command), capture_output=True, text=True, timeout=timeout,
                              env=self.env(env), cwd=cwd or self.home)
        if check and done.returncode != 0:
            raise AssertionError(f"as {self.name}: {command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def python(self, code: str, **kw) -> subprocess.CompletedProcess:
        """Standard-library Python as this user (the attacker's side needs nothing else)."""
        return self.run(SYSTEM_PYTHON, "-I", "-c", code, **kw)


def can_make_users() -> str | None:
    """None when users can be made here, else why not."""
    if os.geteuid() != 0:
        return "making throw-away users needs root"
    missing = [tool for tool in ("useradd", "userdel", "setpriv") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


@contextmanager
def throwaway_users(*roles: str) -> Iterator[list[User]]:
    """One new user per role (`xs<role><random>`), removed with their home at the end."""
    why_not = can_make_users()
    if why_not:
        pytest.skip(why_not)
    base = Path(tempfile.mkdtemp(prefix="xmem-users-"))
    base.chmod(0o755)
    users: list[User] = []
    try:
        for role in roles:
            name = f"xs{role[:8]}{secrets.token_hex(3)}"
            subprocess.run(["useradd", "--create-home", "--base-dir", str(base), "--shell", "/bin/sh",
                            "--user-group", name], check=True, capture_output=True, timeout=30)
            entry = pwd.getpwnam(name)
            users.append(User(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)))
        yield users
    finally:
        for user in users:
            subprocess.run(["userdel", "--remove", user.name], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def visible_dir() -> Iterator[Path]:
    """A scratch directory the throw-away users can reach (pytest's tmp_path lies under a root-only 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="xmem-shared-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def users_fixture(*roles: str):
    """A module-scoped fixture giving one throw-away user per role: `users = users_fixture("victim", "other")`."""
    @pytest.fixture(scope="module")
    def users():
        with throwaway_users(*roles) as made:
            yield made
    return users


@pytest.fixture
def scratch():
    """A `visible_dir` for one test (import it into the test module to use it)."""
    with visible_dir() as path:
        yield path
