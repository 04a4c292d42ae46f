"""The command the tracer is given, read with the one launcher grammar (`xmem.launchers`), and its program's file
found: a script path (or a module) and its arguments, as the tracing child runs them. Raises TraceError not_found
/ not_python. Reads only the first bytes of files, to tell Python from other programs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from typing import Mapping

from xmem.launchers import LAUNCHER_NAMES, LaunchError, Target, console_script_python, is_python, parse_launch, \
    shebang_python
from xmem.trace.errors import TraceError

ELF_MAGIC = b"\x7fELF"
# Asked of an interpreter found on PATH that is not itself a binary (pyenv's and asdf's shims are shell scripts):
# the interpreter it ends up running, whose path keeps a venv's identity (its pyvenv.cfg).
WHICH_EXECUTABLE = "import sys; print(sys.executable)"


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


# Programs that start other programs and are no Python themselves: the shells a launcher script is written for, and
# the commands that run another one (`env VAR=1 torchrun ...`, `time python ...`). A command led by one of these, or
# a script with another interpreter's shebang (`./train.sh`), is run as the job runs it, and every Python process it
# starts is traced (`xmem.trace.child.launch`).
PROCESS_STARTERS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "env", "time", "nohup", "nice", "stdbuf",
                              "numactl", "taskset", "exec", "setsid", "chrt", "ionice"})


def starts_programs(command: list[str], cwd: str | None, env: Mapping[str, str]) -> bool:
    """Whether `command` is not a Python program itself but one that starts programs (see PROCESS_STARTERS): a
    shell, one of the commands that run another, or a script with a shebang that names no python."""
    program = command[0] if command else ""
    if os.path.basename(program) in PROCESS_STARTERS:
        return True
    path = os.path.join(cwd or os.getcwd(), program) if os.sep in program else \
        shutil.which(program, path=env.get("PATH", os.defpath))
    if not path or not os.path.isfile(path) or program.endswith(".py"):
        return False
    first = _first_line(path)
    return first.startswith("#!") and shebang_python(first) is None


def console_script_interpreter(target: Target) -> str | None:
    """The interpreter of an environment's own console script run by name or path (`trl`, `tune`, a `bin/` entry
    point pip wrote): its shebang names the `python` beside it, the environment whose libraries the program uses.
    None for anything else (a script whose shebang names another place runs on the caller's interpreter)."""
    if not target.script or target.launcher is not None or target.script.endswith(".py") or \
            os.path.isdir(target.script):
        return None
    return console_script_python(target.script, _first_line(target.script))


def job_interpreter(command: list[str], target: Target, env: Mapping[str, str], cwd: str | None) -> str:
    """The interpreter the job's own shell would run for `command`, found as the shell finds it, on the job's PATH
    (an activated venv's `bin` first): `python3 train.py`; a launcher run by name (`torchrun`: the python its
    console script's shebang names); a script run directly whose shebang is `#!/usr/bin/env python3`. Never this
    process's interpreter by default: a job whose `python` has no torch fails on the node too, and the trace says
    so. Raises TraceError not_found when the job's PATH has none."""
    path = env.get("PATH", os.defpath)
    program = command[0] if command else ""
    if is_python(program):
        wanted = program
    elif program in LAUNCHER_NAMES:
        launcher = shutil.which(program, path=path)
        wanted = (shebang_python(_first_line(launcher)) if launcher else None) or "python3"
    else:
        wanted = (shebang_python(_first_line(target.script)) if target.script and os.path.isfile(target.script)
                  else None) or "python3"
    found = wanted if os.sep in wanted else shutil.which(wanted, path=path)
    if found is None:
        raise TraceError("not_found", f"{wanted}: not found on the job's PATH ({path}); activate the job's "
                                      "environment first, or name its interpreter (--python, or its path)")
    return _real_interpreter(os.path.abspath(found))


@functools.lru_cache(maxsize=16)
def _real_interpreter(found: str) -> str:
    """`found` itself when it is a binary (a venv's `bin/python` link included); else what the wrapper it is runs
    (asked once, in a clean environment but the PATH it was found on)."""
    if is_binary(found):
        return found
    try:
        done = subprocess.run([found, "-c", WHICH_EXECUTABLE], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TraceError("not_found", f"{found} does not run as a Python interpreter ({error})") from None
    executable = done.stdout.strip()
    if done.returncode != 0 or not os.path.isfile(executable):
        raise TraceError("not_found", f"{found} does not run as a Python interpreter: "
                                      f"{(done.stderr.strip().splitlines() or ['no answer'])[-1]}")
    return executable


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


def is_binary(path: str) -> bool:
    """A compiled program (an ELF file): an interpreter binary, not a shell shim; False when it cannot be read."""
    try:
        return _first_bytes(path, 4) == ELF_MAGIC
    except TraceError:
        return False


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
