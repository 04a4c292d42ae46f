"""Turning what the user would type into what the tracing child runs: a script path or a module, plus its argv.

Owns launcher handling (`python [opts]`, `python -m torch.distributed.run`, `torchrun`, `accelerate launch`,
`deepspeed`, a `.py` file, an executable with a python shebang) and the machine the program is shown: how many GPUs
its node has (`gpus_per_node`) and the environment its launcher gives rank 0 (`launcher_variables`, used by the
batch-script reader too, and `launcher_env`). Rank 0 is the one
estimated, in the world the launcher would make, so that FSDP/ZeRO shard by the real world size. Pure apart from
reading the first bytes of files to tell Python from other programs.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Mapping

from xmem.trace.errors import TraceError

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}
_DISTRIBUTED_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_TORCHRUN_FLAGS = {"--standalone", "--module", "-m", "--run-path", "--run_path", "--use-env", "--use_env"}


# What torchrun's elastic agent gives rank 0 besides the world's sizes (torch/distributed/elastic/agent/server/
# api.py); `accelerate launch` and `deepspeed` start their ranks through the same agent.
_RANK_ZERO = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
_RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # the job's own, where it sets them
_ACCELERATE_SETTINGS = {"--mixed_precision": "ACCELERATE_MIXED_PRECISION", "--mixed-precision":
                        "ACCELERATE_MIXED_PRECISION"}  # what `accelerate launch` hands the script's Accelerator


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


def gpus_per_node(target: Target, env: Mapping[str, str], requested: int | None = None) -> int:
    """The GPUs the program's node shows it: `requested` if given (estimate --gpus-per-node), else what Slurm gives
    the job (`SLURM_GPUS_ON_NODE`, narrowed by a CUDA_VISIBLE_DEVICES the job sets), else one per process the
    launcher starts on the node, else 1. A CUDA_VISIBLE_DEVICES outside a Slurm job (a login node's) says nothing
    about the job's node and is ignored."""
    if requested:
        return requested
    on_node = _leading_int(env.get("SLURM_GPUS_ON_NODE", ""), default=0)
    if on_node:
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return len(visible) or on_node
    if target.distributed and target.nproc_per_node:
        return target.nproc_per_node
    return 1


def launcher_variables(target: Target, gpus: int) -> dict[str, str]:
    """What the launcher sets in rank 0's environment on a node of `gpus`: its settings and, when it starts its
    processes through the elastic agent, their ranks and the world's sizes (a run of `accelerate launch` with one
    process is a plain `python`)."""
    variables = dict(target.settings)
    local, world = target.local_world_size(gpus), target.world_size(gpus)
    if not target.distributed or world == 1 and target.launcher == "accelerate":
        return variables
    variables.update(_RANK_ZERO, WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local),
                     GROUP_WORLD_SIZE=str(target.nnodes))
    return variables


def launcher_env(target: Target, env: Mapping[str, str], gpus: int) -> dict[str, str]:
    """Rank 0's environment: `env` with the launcher's variables; CUDA_VISIBLE_DEVICES lists the node's `gpus` as
    Slurm numbers them for a job. The job's own rendezvous address and thread count stay."""
    variables = launcher_variables(target, gpus)
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
    if _PYTHON_NAME.match(name):
        return path
    if name in ("torchrun", "accelerate", "deepspeed"):
        return os.path.join(os.path.dirname(path), "python")
    return None


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
        # one process unless told; --multi_gpu without a count: one per GPU (accelerate's own defaults)
        every_gpu = "--multi_gpu" in rest or "--multi-gpu" in rest
        return _parse_scanned_launcher(rest[1:], cwd, "accelerate", None if every_gpu else 1)
    if name == "deepspeed":  # one process per GPU of the node unless told
        return _parse_scanned_launcher(rest, cwd, "deepspeed", None)
    return _script_target(program, rest, cwd)


# The process and node counts of the launchers parsed by scanning: (process options, node options, whether the
# process count is over all nodes). accelerate's --num_processes is the job's total; deepspeed's --num_gpus per node.
_SCANNED_COUNTS = {"accelerate": (("--num_processes", "--num-processes"), ("--num_machines", "--num-machines"), True),
                   "deepspeed": (("--num_gpus", "--num-gpus"), ("--num_nodes", "--num-nodes"), False)}


def _parse_scanned_launcher(args: list[str], cwd: str | None, launcher: str, processes: int | None) -> Target:
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
            processes = _leading_int(value)
        if name in node_options:
            nodes = _leading_int(value)
        if name in _ACCELERATE_SETTINGS:
            settings[_ACCELERATE_SETTINGS[name]] = value
        per_node = max(1, processes // nodes) if total and processes else processes
        launched = dict(launcher=launcher, nproc_per_node=per_node, nnodes=nodes, settings=tuple(settings.items()))
        if arg in ("-m", "--module") and i + 1 < len(args):
            return Target(None, args[i + 1], tuple(args[i + 2:]), **launched)
        if arg.endswith(".py") and not arg.startswith("-"):
            target = _script_target(arg, args[i + 1:], cwd, require_python=False)
            return Target(target.script, None, target.args, **launched)
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
    per_node = values.get("--nproc-per-node", "1")
    launched = dict(launcher="torchrun", nnodes=_leading_int(values.get("--nnodes", "1")),
                    nproc_per_node=None if per_node in ("gpu", "auto") else _leading_int(per_node))
    if as_module:
        return Target(None, args[i], tuple(args[i + 1:]), **launched)
    target = _script_target(args[i], args[i + 1:], cwd, require_python=False)
    return Target(target.script, None, target.args, **launched)


def _leading_int(text: str, default: int = 1) -> int:
    """'4' -> 4, '1:4' (elastic min:max nodes) -> 1, '4(x2)' (Slurm's repeat counts) -> 4; no number: `default`."""
    match = re.match(r"\d+", text.strip())
    return max(1, int(match.group())) if match else default


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
