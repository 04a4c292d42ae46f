"""How a command line starts a Python training program: the interpreter's own options, and the launchers that
start one process per GPU (`torchrun` / `python -m torch.distributed.run`, `accelerate launch` /
`python -m accelerate.commands.launch`, `deepspeed`), with the machine and world each shows rank 0.

The one grammar of these command lines: the batch-script reader (`xmem.jobscript`) reads a script's lines through
it, the tracer (`xmem.trace`) the command it is given. Rank 0 is the one traced (or the rank the estimate names,
one per pipeline stage), in the world the launcher would make, so that FSDP/ZeRO shard by the real world size. Launchers a traced program starts itself need none of this:
the tracer follows every Python process of the job (`xmem.trace.child.follow`). Also the one rule for a program file run
directly (`shebang_python`): an environment's console script (`trl`, `tune`) or a script with a python shebang is a
Python program. Pure: reads no file (callers hand it a file's first line).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)*)?$")
LAUNCHER_NAMES = ("torchrun", "accelerate", "deepspeed")  # console scripts beside their environment's python
_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
_DISTRIBUTED_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_ACCELERATE_MODULES = {"accelerate.commands.launch"}
_TORCHRUN_FLAGS = {"--standalone", "--module", "-m", "--run-path", "--use-env", "--no-python"}

# What torchrun's elastic agent gives rank 0 besides the world's sizes (torch/distributed/elastic/agent/server/
# api.py); `accelerate launch` and `deepspeed` start their ranks through the same agent.
_RANK_ZERO = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
# The rank to trace, where the estimate traces another than rank 0 (one per pipeline stage: xmem.rank_traces); the
# launcher's variables are then that rank's, and so is the rank torch.multiprocessing.spawn runs.
TRACED_RANK_ENV = "XMEM_TRACE_RANK"
# What that rank's pipeline stages receive from the stages before them, as the ranks traced before it recorded
# sending it (JSON: {stage index: [events.ActivationMeta.to_json(), ...]}; xmem.trace.child.pipelining reads it)
PIPELINE_INPUTS_ENV = "XMEM_PIPELINE_INPUTS"
# The options `accelerate launch` was given (JSON list), from which the traced rank's environment is made by the
# job's accelerate itself (xmem.trace.child.accelerate_launch): its flags and its config file are too many to read here
ACCELERATE_LAUNCH_ENV = "XMEM_ACCELERATE_LAUNCH"
_RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # the job's own, where it sets them
_ACCELERATE_SETTINGS = {"--mixed_precision": "ACCELERATE_MIXED_PRECISION", "--mixed-precision":
                        "ACCELERATE_MIXED_PRECISION"}  # what `accelerate launch` hands the script's Accelerator
# The process and node counts of the launchers read by scanning: (process options, node options, whether the
# process count is over all nodes). accelerate's --num_processes is the job's total; deepspeed's --num_gpus per node.
_SCANNED_COUNTS = {"accelerate": (("--num_processes", "--num-processes"), ("--num_machines", "--num-machines"), True),
                   "deepspeed": (("--num_gpus", "--num-gpus"), ("--num_nodes", "--num-nodes"), False)}

# srun's grammar, as far as finding its command goes: the short options that take a value, and the long ones that
# take none (`srun --label python train.py`); any other long option takes one (`--ntasks 4` or `--ntasks=4`).
SRUN_SHORT_WITH_VALUE = set("AbBcCdDeGiJLmMnNopqrStTwWx")
SRUN_LONG_FLAGS = {"contiguous", "exact", "help", "hold", "label", "multi-prog", "no-allocate", "no-kill",
                   "overcommit", "overlap", "oversubscribe", "preserve-env", "pty", "quiet", "quit-on-interrupt",
                   "reboot", "resv-ports", "spread-job", "test-only", "unbuffered", "usage", "use-min-nodes",
                   "verbose", "version", "disable-status", "x11", "exclusive", "kill-on-bad-exit", "immediate",
                   "compress", "send-libs", "propagate", "nice"}


class LaunchError(ValueError):
    """A command this grammar cannot read as a Python program: kind "not_found" (no program in it) or "not_python"
    (a program that is not Python)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass(frozen=True)
class Target:
    """What to run: `module` (for -m) or `script` (a path), with the program's own arguments.

    `launcher` (torchrun, accelerate, deepspeed; None: plain python) starts `nproc_per_node` processes on each of
    `nnodes` nodes (None: one per GPU, as torchrun's `--nproc-per-node gpu`); `settings` are variables the
    launcher sets from its own options.
    """

    script: str | None
    module: str | None
    args: tuple[str, ...]
    launcher: str | None = None
    nproc_per_node: int | None = 1
    nnodes: int = 1
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def distributed(self) -> bool:
        return self.launcher is not None

    def child_argv(self) -> list[str]:
        return (["-m", self.module] if self.module else [self.script or ""]) + list(self.args)

    def local_world_size(self, gpus_per_node: int) -> int:
        return self.nproc_per_node or gpus_per_node

    def world_size(self, gpus_per_node: int) -> int:
        return self.local_world_size(gpus_per_node) * self.nnodes


def srun_shim() -> str:
    """A POSIX shell `srun` for inside a trace (no controller to ask): it reads its options by the grammar above and
    runs its command once, as the step's task 0 (the fake process group stands in for the others, as for every
    launcher), in the batch step's environment."""
    flags = "|".join(f"--{name}" for name in sorted(SRUN_LONG_FLAGS))
    letters = "".join(sorted(SRUN_SHORT_WITH_VALUE))
    return (f"#!/bin/sh\n# srun in a traced job (xmem-slurm): its command once, as task 0 of the step\n"
            f"while [ $# -gt 0 ]; do\n  case \"$1\" in\n    --) shift; break ;;\n    --*=*|{flags}) shift ;;\n"
            f"    --*) shift; [ $# -gt 0 ] && shift ;;\n    -[{letters}]) shift; [ $# -gt 0 ] && shift ;;\n"
            f"    -*) shift ;;\n    *) break ;;\n  esac\ndone\n"
            f"[ $# -gt 0 ] || {{ echo 'srun: no command given' >&2; exit 1; }}\n"
            f"export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_STEP_ID=0\nexec \"$@\"\n")


def is_python(name: str) -> bool:
    """`python`, `python3`, `python3.11`: an interpreter by its file name."""
    return bool(PYTHON_NAME.match(name))


def shebang_python(first_line: str) -> str | None:
    """The python a program file's first line names, when it is a Python program run directly (pip writes each
    console script, `trl`, `tune`, `litgpt`, so): `#!/opt/env/bin/python3` gives that path, `#!/usr/bin/env python3`
    "" (the python found on PATH). None for a file that is not one (another interpreter, a binary, no `#!`)."""
    if not first_line.startswith("#!"):
        return None
    words = first_line[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [word for word in words[1:] if not word.startswith("-")]  # `env -S python3 -u`
    program = words[0] if words else ""
    if not is_python(os.path.basename(program)):
        return None
    return program if os.sep in program else ""


def console_script_python(path: str, first_line: str) -> str | None:
    """The interpreter of an environment's own console script (`/opt/env/bin/trl`, found by path or on PATH): the
    `python` beside it that its shebang names, the environment whose libraries the program uses. None for any other
    file (a script whose shebang names another place runs on the caller's interpreter)."""
    interpreter = shebang_python(first_line)
    beside = bool(interpreter) and os.path.dirname(interpreter) == os.path.dirname(path)
    return interpreter if beside else None


def python_program(args: list[str]) -> list[str] | None:
    """What the interpreter runs, given its arguments (its own options first): `[script, *args]`,
    `["-m", module, *args]` or `["-c", code, *args]`; None for no program (standard input, an interactive
    interpreter, --version or --help)."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        option = args[i]
        if option == "--":
            i += 1
            break
        if option.startswith("--"):
            if option not in _PYTHON_OPTIONS_WITH_VALUE:
                return None  # --help, --version
            i += 2
            continue
        for at, letter in enumerate(option[1:], 2):  # letters may share a word: -uB, -Wignore, -mpkg
            attached = option[at:]
            if letter in "cm":
                value = attached or (args[i + 1] if i + 1 < len(args) else "")
                return [f"-{letter}", value, *args[i + (1 if attached else 2):]] if value else None
            if letter in "WX":
                i += 0 if attached else 1
                break
            if letter in "hV":
                return None
        i += 1
    return args[i:] if i < len(args) and args[i] != "-" else None


def parse_launch(command: list[str]) -> Target | None:
    """Read `command` when it starts a Python program: a python interpreter or a launcher (by name or path). None
    for anything else (a script run directly, another program). The script's path is as written. Raises
    LaunchError when no program can be found in it, or the one it starts is not Python."""
    if not command:
        raise LaunchError("not_found", "empty command: give the training command, e.g. python train.py")
    name, rest = os.path.basename(command[0]), command[1:]
    if is_python(name):
        return _python(rest)
    if name == "torchrun":
        return _torchrun(rest)
    if name == "accelerate" and rest[:1] == ["launch"]:
        return _accelerate(rest[1:])
    if name == "deepspeed":  # one process per GPU of the node unless told
        return _scanned(rest, "deepspeed", None)
    return None


def gpus_per_node(target: Target, env: Mapping[str, str], requested: int | None = None) -> int:
    """The GPUs the program's node shows it: `requested` if given (estimate --gpus-per-node), else what Slurm gives
    the job (`SLURM_GPUS_ON_NODE`, narrowed by a CUDA_VISIBLE_DEVICES the job sets), else one per process the
    launcher starts on the node, else 1. A CUDA_VISIBLE_DEVICES outside a Slurm job (a login node's) says nothing
    about the job's node and is ignored."""
    if requested:
        return requested
    on_node = leading_int(env.get("SLURM_GPUS_ON_NODE", ""), default=0)
    if on_node:
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return len(visible) or on_node
    if target.distributed and target.nproc_per_node:
        return target.nproc_per_node
    return 1


def launcher_variables(target: Target, gpus: int, rank: int = 0) -> dict[str, str]:
    """What the launcher sets in the environment of rank `rank` (default 0) on a node of `gpus`: its settings and,
    when it starts its processes through the elastic agent, their ranks and the world's sizes (a run of
    `accelerate launch` with one process is a plain `python`)."""
    variables = dict(target.settings)
    local, world = target.local_world_size(gpus), target.world_size(gpus)
    if not target.distributed or world == 1 and target.launcher == "accelerate":
        return variables
    variables.update(_RANK_ZERO, WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local),
                     GROUP_WORLD_SIZE=str(target.nnodes))
    return {**variables, **rank_variables(rank, local)} if rank else variables


def rank_variables(rank: int, local_world_size: int) -> dict[str, str]:
    """What the elastic agent sets apart for global rank `rank` when each node runs `local_world_size` processes:
    its rank, its place on its node, and its node's (torchrun's node rank is the agent's group rank)."""
    return {"RANK": str(rank), "ROLE_RANK": str(rank), "LOCAL_RANK": str(rank % local_world_size),
            "GROUP_RANK": str(rank // local_world_size)}


def traced_rank(env: Mapping[str, str]) -> int:
    """The rank the estimate asks to trace (`TRACED_RANK_ENV`; rank 0 where it asks none)."""
    return int(env.get(TRACED_RANK_ENV, "0") or 0)


def launcher_env(target: Target, env: Mapping[str, str], gpus: int) -> dict[str, str]:
    """The traced rank's environment (rank 0, or the one `env` names by `TRACED_RANK_ENV`): `env` with the launcher's
    variables; CUDA_VISIBLE_DEVICES lists the node's `gpus` as Slurm numbers them for a job. The job's own rendezvous
    address and thread count stay."""
    variables = launcher_variables(target, gpus, traced_rank(env))
    if "RANK" in variables:
        variables = {**_RENDEZVOUS, **variables}
        if target.local_world_size(gpus) > 1:
            variables["OMP_NUM_THREADS"] = "1"  # torchrun's default for several processes per node
    kept = {name: env[name] for name in ("OMP_NUM_THREADS", *_RENDEZVOUS) if name in env}
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus)), **variables, **kept}


def named_interpreter(command: list[str], cwd: str | None = None) -> str | None:
    """The interpreter a command names by its path, which its program runs on: `/opt/env/bin/python train.py`, and
    `/opt/env/bin/torchrun` (or accelerate, deepspeed), which runs `/opt/env/bin/python`. None for a bare name
    (`python`, `torchrun`) or a script: the caller's interpreter then, or the job script's (xmem.jobscript)."""
    program = command[0] if command else ""
    if os.sep not in program:
        return None
    name = os.path.basename(program)
    path = os.path.join(cwd or os.getcwd(), program)
    if is_python(name):
        return path
    if name in LAUNCHER_NAMES:
        return os.path.join(os.path.dirname(path), "python")
    return None


def leading_int(text: str, default: int | None = 1) -> int | None:
    """'4' -> 4, '1:4' (elastic min:max nodes) -> 1, '4(x2)' (Slurm's repeat counts) -> 4; no number: `default`."""
    match = re.match(r"\d+", text.strip())
    return max(1, int(match.group())) if match else default


def _python(args: list[str]) -> Target:
    program = python_program(args)
    if program is None:
        raise LaunchError("not_found", "no script given to python: give the training script, e.g. python train.py")
    if program[0] == "-c":
        raise LaunchError("not_python", "python -c is not supported: put the training code in a .py file")
    if program[0] == "-m" and program[1] in _DISTRIBUTED_MODULES:
        return _torchrun(program[2:])
    if program[0] == "-m" and program[1] in _ACCELERATE_MODULES:
        return _accelerate(program[2:])
    if program[0] == "-m":
        return Target(None, program[1], tuple(program[2:]))
    return Target(program[0], None, tuple(program[1:]))


def _torchrun(args: list[str]) -> Target:
    i, as_module, values = 0, False, {}
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].partition("=")
        option = name.replace("_", "-")
        if option == "--no-python":
            raise LaunchError("not_python", "torchrun --no-python runs a non-Python program; it cannot be traced")
        as_module = as_module or option in ("-m", "--module")
        if eq or option in _TORCHRUN_FLAGS:
            values[option] = value
            i += 1
        else:
            values[option] = args[i + 1] if i + 1 < len(args) else ""
            i += 2
    if i >= len(args):
        raise LaunchError("not_found", "no training script given to torchrun")
    per_node = values.get("--nproc-per-node", "1")
    launched = dict(launcher="torchrun", nnodes=leading_int(values.get("--nnodes", "1")) or 1,
                    nproc_per_node=leading_int(per_node, default=None))  # "gpu", "auto", unknown: one per GPU
    if as_module:
        return Target(None, args[i], tuple(args[i + 1:]), **launched)
    return Target(args[i], None, tuple(args[i + 1:]), **launched)


def _accelerate(args: list[str]) -> Target:
    # one process unless told; --multi_gpu without a count: one per GPU (accelerate's own defaults)
    every_gpu = "--multi_gpu" in args or "--multi-gpu" in args
    if "--no_python" in args or "--no-python" in args:
        raise LaunchError("not_python", "accelerate launch --no_python runs a non-Python program; it cannot be "
                                        "traced")
    return _scanned(args, "accelerate", None if every_gpu else 1)


def _scanned(args: list[str], launcher: str, processes: int | None) -> Target:
    """accelerate launch / deepspeed: too many flags to know which take values, so the program is the first
    argument ending in .py (or the one after -m/--module); the counts come from `_SCANNED_COUNTS` (processes
    default: `processes`, None for one per GPU)."""
    process_options, node_options, total = _SCANNED_COUNTS[launcher]
    settings: dict[str, str] = {}
    nodes = 1
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if name in process_options:
            processes = leading_int(value, default=None)
        if name in node_options:
            nodes = leading_int(value) or 1
        if name in _ACCELERATE_SETTINGS:
            settings[_ACCELERATE_SETTINGS[name]] = value
        per_node = max(1, processes // nodes) if total and processes else processes
        launched = dict(launcher=launcher, nproc_per_node=per_node, nnodes=nodes)
        if arg in ("-m", "--module") and i + 1 < len(args):
            return Target(None, args[i + 1], tuple(args[i + 2:]), settings=_settings(launcher, settings, args[:i]),
                          **launched)
        if arg.endswith(".py") and not arg.startswith("-"):
            return Target(arg, None, tuple(args[i + 1:]), settings=_settings(launcher, settings, args[:i]), **launched)
    raise LaunchError("not_found", "no training script (.py) found in the launcher's arguments")


def _settings(launcher: str, read: dict[str, str], options: list[str]) -> tuple[tuple[str, str], ...]:
    """The variables read from the launcher's flags, and for `accelerate launch` its options as given, from which
    the traced process's environment is made as accelerate makes it (ACCELERATE_LAUNCH_ENV)."""
    if launcher != "accelerate":
        return tuple(read.items())
    return (*read.items(), (ACCELERATE_LAUNCH_ENV, json.dumps(options)))
