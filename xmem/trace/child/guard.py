"""Every start of a Python interpreter inside the sandbox passes through here, so that no Python process of the job
escapes the trace (issue 31, and issue 35's "wrong request").

The start-up hook (`boot/sitecustomize.py`, first on PYTHONPATH) traces every Python process the job starts, but a
process can skip it: `python -S` (no site, so no sitecustomize), `-I` or `-E` (PYTHONPATH ignored), or a cleared
environment (`env -i python ...`, `subprocess.run(..., env={})`). Such a process would run untraced, fail on the
real CUDA runtime, and a starter that ignores its status would leave the job's estimate without the training.

The sandbox (`xmem.trace.sandbox.guard_interpreters`) binds a small wrapper over each interpreter binary the job can
reach, which runs this file on the real binary, isolated (`-I -S`, standard library and `xmem.launchers` only):
`guard.py REAL SCRATCH ARGV0 ARGS...`. A command line that keeps the hook runs unchanged (exec of the real binary,
argv[0] as it was, so that a venv is still known by its path). One that would skip it gets it back, as close to what
it asked as the hook allows: -I becomes -s -P (no user site, no script directory on the path), -E drops the job's
own PYTHON* variables instead, -S is removed (site runs: the hook is in it), and the tracer's settings, which the root
left in the scratch (`follow.hand_down`), are put back into its environment. Before the root has handed anything
down (the tracer itself starting), every command line runs unchanged.
"""

import json
import os
import sys

SETTINGS_FILE = "follow-env.json"  # in the scratch: the tracer's XMEM_* variables and the boot directory
SKIPPING_LETTERS = "ISE"  # the interpreter options that skip the hook


def main(argv: list[str]) -> None:
    real, scratch, argv0, *args = argv
    settings = _settings(scratch)
    if settings is None or not _skips_hook(args, os.environ, settings):
        os.execv(real, [argv0, *args])
        return  # not reached: exec replaced this process
    flags, program = _split(args)
    letters = {letter for flag in flags if _is_letters(flag) for letter in flag[1:]}
    env = dict(os.environ)
    if letters & {"I", "E"}:  # the job asked for none of its PYTHON* variables: it gets none but the hook's
        env = {name: value for name, value in env.items() if not name.startswith("PYTHON")}
    for name, value in settings["env"].items():  # what the process set itself stays (a cleared env: all back)
        env.setdefault(name, value)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != settings["boot"]]
    env["PYTHONPATH"] = os.pathsep.join([settings["boot"], *kept])
    flags = [_without_skips(flag) for flag in flags]
    extra = ["-s", "-P"] if "I" in letters and sys.version_info >= (3, 11) else ["-s"] if "I" in letters else []
    os.execve(real, [argv0, *extra, *filter(None, flags), *program], env)


def _settings(scratch: str) -> dict | None:
    try:
        with open(os.path.join(scratch, SETTINGS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _skips_hook(args: list[str], env: dict, settings: dict) -> bool:
    flags, _ = _split(args)
    asked = any(_is_letters(flag) and set(flag[1:]) & set(SKIPPING_LETTERS) for flag in flags)
    hooked = settings["boot"] in env.get("PYTHONPATH", "").split(os.pathsep)
    return asked or not hooked or settings["marker"] not in env


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """The interpreter's own options, and the rest (the program and its arguments), by xmem.launchers' grammar."""
    from xmem.launchers import python_program
    program = python_program(args)
    if program is None:  # no program: an interactive or stdin interpreter, --version; its options are all there is
        return [], list(args)
    return list(args[:len(args) - len(program)]), program


def _is_letters(flag: str) -> bool:
    """A word of single-letter options (`-I`, `-uIB`): not a long option, not -W/-X with an attached value."""
    return flag.startswith("-") and not flag.startswith("--") and flag[1:2] not in ("W", "X", "") and \
        flag[1:].isalpha()


def _without_skips(flag: str) -> str:
    if not _is_letters(flag):
        return flag
    rest = "".join(letter for letter in flag[1:] if letter not in SKIPPING_LETTERS)
    return f"-{rest}" if rest else ""


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))))  # xmem's parent, for xmem.launchers
    main(sys.argv[1:])
