"""Turning what the user would type into what the tracing child runs: a script path or a module, plus its argv.

Owns launcher handling (`python [opts]`, `python -m torch.distributed.run`, `torchrun`, a `.py` file, an executable
with a python shebang). One rank is estimated: launcher options are dropped. Pure apart from reading the first
bytes of files to tell Python from other programs.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from xmem.trace.errors import TraceError

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}
_DISTRIBUTED_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_TORCHRUN_FLAGS = {"--standalone", "--module", "-m", "--run-path", "--run_path", "--use-env", "--use_env"}


@dataclass(frozen=True)
class Target:
    """What to run: `module` (for -m) or `script` (a path), with the program's own arguments."""

    script: str | None
    module: str | None
    args: tuple[str, ...]
    distributed: bool = False
    world_size: int = 1  # processes the launcher would start (nproc per node x nodes)

    def child_argv(self) -> list[str]:
        return (["-m", self.module] if self.module else [self.script or ""]) + list(self.args)


def parse_command(command: list[str], cwd: str | None = None) -> Target:
    """Understand `command` (as typed by the user). Raises TraceError not_found / not_python."""
    if not command:
        raise TraceError("not_found", "empty command: give the training command, e.g. python train.py")
    program, rest = command[0], command[1:]
    name = os.path.basename(program)
    if _PYTHON_NAME.match(name):
        return _parse_python_args(rest, cwd)
    if name == "torchrun":
        return _parse_torchrun_args(rest, cwd)
    if name == "accelerate" and rest[:1] == ["launch"]:
        return _parse_scanned_launcher(rest[1:], cwd, ("--num_processes", "--num-processes"))
    if name == "deepspeed":
        return _parse_scanned_launcher(rest, cwd, ("--num_gpus", "--num-gpus"))
    return _script_target(program, rest, cwd)


def _parse_scanned_launcher(args: list[str], cwd: str | None, process_options: tuple[str, ...]) -> Target:
    """accelerate launch / deepspeed: too many flags to know which take values, so the program is the first
    argument ending in .py (or the one after -m/--module); the process count comes from `process_options`."""
    world = 1
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in process_options:
            world = _leading_int(value or (args[i + 1] if i + 1 < len(args) else "1"))
        if arg in ("-m", "--module") and i + 1 < len(args):
            return Target(None, args[i + 1], tuple(args[i + 2:]), distributed=True, world_size=world)
        if arg.endswith(".py") and not arg.startswith("-"):
            target = _script_target(arg, args[i + 1:], cwd, require_python=False)
            return Target(target.script, None, target.args, distributed=True, world_size=world)
    raise TraceError("not_found", "no training script (.py) found in the launcher's arguments")


def _parse_python_args(args: list[str], cwd: str | None) -> Target:
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        option = args[i]
        if option == "-m" and i + 1 < len(args):
            module, rest = args[i + 1], args[i + 2:]
            if module in _DISTRIBUTED_MODULES:
                return _parse_torchrun_args(rest, cwd)
            return Target(None, module, tuple(rest))
        if option == "-c":
            raise TraceError("not_python", "python -c is not supported: put the training code in a .py file")
        i += 2 if option in _PYTHON_OPTIONS_WITH_VALUE else 1
    if i >= len(args):
        raise TraceError("not_found", "no script given to python: give the training script, e.g. python train.py")
    return _script_target(args[i], args[i + 1:], cwd, require_python=False)


def _parse_torchrun_args(args: list[str], cwd: str | None) -> Target:
    i, as_module, values = 0, False, {}
    while i < len(args) and args[i].startswith("-"):
        option = args[i]
        if option in ("--no-python", "--no_python"):
            raise TraceError("not_python", "torchrun --no-python runs a non-Python program; it cannot be traced")
        if option in ("-m", "--module"):
            as_module = True
        if "=" in option:
            name, value = option.split("=", 1)
            values[name.replace("_", "-")] = value
            i += 1
        elif option in _TORCHRUN_FLAGS:
            i += 1
        else:
            values[option.replace("_", "-")] = args[i + 1] if i + 1 < len(args) else ""
            i += 2
    if i >= len(args):
        raise TraceError("not_found", "no training script given to torchrun")
    world = _leading_int(values.get("--nproc-per-node", "1")) * _leading_int(values.get("--nnodes", "1"))
    if as_module:
        return Target(None, args[i], tuple(args[i + 1:]), distributed=True, world_size=world)
    target = _script_target(args[i], args[i + 1:], cwd, require_python=False)
    return Target(target.script, None, target.args, distributed=True, world_size=world)


def _leading_int(text: str) -> int:
    """'4' -> 4, '1:4' (elastic min:max nodes) -> 1; 'gpu'/'auto' (count the node's GPUs) -> 1."""
    match = re.match(r"\d+", text)
    return max(1, int(match.group())) if match else 1


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


def _has_python_shebang(path: str) -> bool:
    first_line = _first_bytes(path).split(b"\n", 1)[0]
    return first_line.startswith(b"#!") and b"python" in first_line


def _looks_binary(path: str) -> bool:
    return b"\0" in _first_bytes(path)
