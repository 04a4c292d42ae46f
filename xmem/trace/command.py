"""The command the tracer is given, read with the one launcher grammar (`xmem.launchers`), and its program's file
found: a script path (or a module) and its arguments, as the tracing child runs them. Raises TraceError not_found
/ not_python. Reads only the first bytes of files, to tell Python from other programs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from xmem.launchers import LaunchError, Target, console_script_python, parse_launch, shebang_python
from xmem.trace.errors import TraceError


def parse_command(command: list[str], cwd: str | None = None) -> Target:
    """Understand `command` (as typed by the user): a python interpreter, a launcher, or a Python script run
    directly (a .py file or a python shebang, by path or on PATH)."""
    try:
        target = parse_launch(command)
    except LaunchError as error:
        raise TraceError(error.kind, error.message) from None
    if target is None:
        return _script_target(command[0], command[1:], cwd)
    if target.module:
        return target
    found = _script_target(target.script or "", list(target.args), cwd, require_python=False)
    return dataclasses.replace(target, script=found.script)


def console_script_interpreter(target: Target) -> str | None:
    """The interpreter of an environment's own console script run by name or path (`trl`, `tune`, a `bin/` entry
    point pip wrote): its shebang names the `python` beside it, the environment whose libraries the program uses.
    None for anything else (a script whose shebang names another place runs on the caller's interpreter)."""
    if not target.script or target.launcher is not None or target.script.endswith(".py") or \
            os.path.isdir(target.script):
        return None
    return console_script_python(target.script, _first_line(target.script))


def _script_target(program: str, args: list[str], cwd: str | None, require_python: bool = True) -> Target:
    path = os.path.join(cwd or os.getcwd(), program)
    if not os.path.exists(path):
        found = shutil.which(program) if os.sep not in program else None
        if found is None:
            raise TraceError("not_found", f"{program}: no such file (looked in {cwd or os.getcwd()} and on PATH)")
        path = found
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "__main__.py")):
            return Target(os.path.abspath(path), None, tuple(args))
        raise TraceError("not_python", f"{program} is a directory without __main__.py")
    if require_python and not program.endswith(".py") and not _has_python_shebang(path):
        raise TraceError("not_python", f"{program} is not a Python program (no .py suffix or python shebang); "
                                       "only PyTorch training in Python can be traced")
    if not require_python and _looks_binary(path):
        raise TraceError("not_python", f"{program} is a binary file, not a Python script")
    return Target(os.path.abspath(path), None, tuple(args))


def _first_bytes(path: str, n: int = 512) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as error:
        raise TraceError("not_found", f"{path}: cannot be read ({error.strerror})") from None


def _first_line(path: str) -> str:
    return _first_bytes(path).split(b"\n", 1)[0].decode(errors="replace")


def _has_python_shebang(path: str) -> bool:
    return shebang_python(_first_line(path)) is not None


def _looks_binary(path: str) -> bool:
    return b"\0" in _first_bytes(path)
