"""Batch-script understanding: what a Slurm job asks for and which Python training command(s) it runs.

`parse_jobscript(text, ...)` -> `JobScript`: the `#SBATCH` request (command-line options win), the training
commands found by a static read, and the problems (with their line) that kept parts of the script from being
understood. Nothing is run and nothing is guessed. Owns no I/O beyond looking for a named conda environment.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from xmem.jobscript.commands import Finder, Problem, ShellState, TrainCommand, _mentions_launcher
from xmem.jobscript.directives import (MAGIC, DirectiveError, GresItem, SbatchRequest, array_task_ids, build_request,
                                       directive_arguments, parse_gpus, parse_gres, scan_directives)
from xmem.jobscript.shell import ShellSyntaxError, tokenize
from xmem.launchers import shebang_python

__all__ = ["JobScript", "SbatchRequest", "GresItem", "TrainCommand", "Problem", "parse_jobscript", "parse_gres",
           "parse_gpus", "DirectiveError", "slurm_runtime_env",
           "array_task_ids", "job_array_tasks"]

# What a job's environment holds before its first line runs, that depends only on the request.
# SLURM_JOB_ID is not known before submission; "0" stands in for it (it names files, it does not size memory).
_PLACEHOLDER_JOB_ID = "0"


@dataclass(frozen=True)
class JobScript:
    directives: SbatchRequest
    commands: tuple[TrainCommand, ...]
    problems: tuple[Problem, ...]
    path: str | None = None
    het_line: int = 0  # the first `#SBATCH hetjob` line: a heterogeneous job (its components are not told apart)
    array_task: int | None = None  # the job array's task the commands were read for (SLURM_ARRAY_TASK_ID)

    def to_json(self) -> dict:
        return {"path": self.path, "het_line": self.het_line, "directives": self.directives.to_json(),
                "commands": [c.to_json() for c in self.commands],
                "problems": [{"line_no": p.line_no, "line": p.line, "reason": p.reason} for p in self.problems]}


def parse_jobscript(text: str, *, path: str | None = None, script_args: Sequence[str] = (),
                    submit_cwd: str | None = None, cli_options: Mapping[str, str | None] | None = None,
                    env: Mapping[str, str] | None = None, array_task: int | None = None,
                    run_unnamed: bool = False) -> JobScript:
    """Read a batch script as sbatch and bash would, without running it.

    `cli_options`: sbatch's command-line options by long name (as cli_filter reports them); they override the
    SBATCH_* variables of `env`, which override the `#SBATCH` lines. `env`: the submitting environment (sbatch's
    default `--export=ALL` hands it to the job); defaults to this process's environment. `submit_cwd`: where
    sbatch runs (the job's default working directory). `array_task`: for a job array, the task to read the commands
    for (default: its first; `job_array_tasks` names the ones whose paths may differ). `run_unnamed`: where the
    static read cannot name the training command (a loop, a conditional, a value known only when the job runs) but
    the script names a Python launcher, the command is the script itself, run whole as Slurm runs it (what `check`
    and the filter estimate); its problems stay as notes.
    """
    lines = text.splitlines()
    scan = scan_directives(lines)
    het_line = het_separator_line(lines)
    problems = [Problem(n, line, f"#SBATCH: {reason}") for n, line, reason in scan.errors]
    env = os.environ if env is None else env
    request, request_errors = build_request(scan.directives, cli_options, env)
    problems += [Problem(n, lines[n - 1] if 0 < n <= len(lines) else "", f"#SBATCH: {reason}")
                 for n, reason in request_errors]

    cwd = _job_cwd(request.chdir, submit_cwd)
    tasks = job_array_tasks(request)
    array_task = (array_task if array_task is not None else tasks[0]) if tasks else None
    base_env = {**env, **slurm_runtime_env(request, submit_cwd, array_task)}
    shebang = _python_shebang(lines)
    if shebang is not None:
        commands = (TrainCommand(argv=("python", path or "script.py", *script_args), cwd=cwd, env={},
                                 python=shebang or None, launcher="python", line_no=1),)
        return JobScript(request, commands, tuple(problems), path, het_line, array_task)

    state = ShellState(base_env=base_env, positional=list(script_args), script_name=path or "", cwd=cwd)
    finder = Finder(state=state, lines=lines, default_ranks=request.ntasks_per_node or request.ntasks)
    try:
        finder.run(tokenize(text))
    except ShellSyntaxError as e:
        problems.append(Problem(e.line_no, lines[e.line_no - 1] if 0 < e.line_no <= len(lines) else "",
                                f"shell syntax: {e.reason}"))
    refused = _sbatch_refusals(text, lines)
    if run_unnamed and not finder.commands and finder.problems and not problems and not refused and \
            _mentions_launcher(text.split()):
        # -- issue 31: what the static read cannot name (a loop, a conditional, a value known only when the job runs)
        # is run as Slurm runs it: the whole script, in the sandbox, every Python process it starts traced
        whole = TrainCommand(argv=(*_shebang_words(lines), path or "job.sh", *script_args), cwd=cwd, env={},
                             python=None, launcher="batch script", line_no=0)
        notes = [replace(p, reason=f"{p.reason}; the script is run whole instead") for p in finder.problems]
        return JobScript(request, (whole,), tuple(notes), path, het_line, array_task)
    problems += finder.problems + refused
    if not finder.commands and not problems:
        problems.append(Problem(0, "", "no training command found (python/python3, torchrun, srun python, "
                                       "accelerate launch)"))
    return JobScript(request, tuple(finder.commands), tuple(problems), path, het_line, array_task)


def _shebang_words(lines: Sequence[str]) -> list[str]:
    """The interpreter Slurm runs the batch script with: its shebang's words (sbatch refuses a script without one;
    /bin/sh stands in)."""
    words = lines[0][2:].split() if lines and lines[0].startswith("#!") else []
    return words or ["/bin/sh"]


def job_array_tasks(request: SbatchRequest) -> tuple[int, ...]:
    """The tasks of a job array whose memory is traced: the first, the middle and the last (all, when there are
    so few), since a program may size itself by its SLURM_ARRAY_TASK_ID, and sizes usually grow or shrink along
    the ids. () for a job that is not an array (or whose task list sbatch would refuse)."""
    try:
        ids = array_task_ids(request.array) if request.array else ()
    except DirectiveError:
        return ()
    return tuple(dict.fromkeys((ids[0], ids[len(ids) // 2], ids[-1]))) if ids else ()


HET_SEPARATORS = ("hetjob", "packjob")  # packjob: the name before Slurm 20.02, still read by sbatch


def het_separator_line(lines: Sequence[str]) -> int:
    """The line of the first `#SBATCH hetjob` (or `packjob`) in the directive block, 0 when none: sbatch starts
    the next component of a heterogeneous job there (a directive whose first word is the separator)."""
    for line_no, line in enumerate(lines, 1):
        if line.startswith(MAGIC):
            try:
                words = directive_arguments(line[len(MAGIC):])
            except DirectiveError:
                continue
            if words and words[0] in HET_SEPARATORS:
                return line_no
        elif not (line.lstrip().startswith("#") or not line.strip()):
            return 0  # sbatch reads directives up to the first command (as scan_directives)
    return 0


def slurm_runtime_env(request: SbatchRequest, submit_dir: str | None,
                      array_task: int | None = None) -> dict[str, str]:
    """The SLURM_* variables of the batch step that follow from the request and where sbatch ran; for a job
    array's `array_task`, those of that task too."""
    env = {"SLURM_JOB_ID": _PLACEHOLDER_JOB_ID, "SLURM_JOBID": _PLACEHOLDER_JOB_ID,
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    if submit_dir:
        env["SLURM_SUBMIT_DIR"] = submit_dir
    optional = {
        "SLURM_JOB_NAME": request.job_name, "SLURM_JOB_PARTITION": request.partition,
        "SLURM_JOB_ACCOUNT": request.account,
        "SLURM_NTASKS": str(_task_count(request)) if _task_count(request) else None,
        "SLURM_NTASKS_PER_NODE": str(request.ntasks_per_node) if request.ntasks_per_node else None,
        "SLURM_JOB_NUM_NODES": request.nodes if request.nodes and request.nodes.isdigit() else None,
        "SLURM_GPUS_ON_NODE": str(request.gpus_on_node) if request.wants_gpu else None,
        # the job's GPUs as its processes see them (Slurm binds them and numbers them from 0)
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(request.gpus_on_node))) if request.wants_gpu else None,
    }
    for option, name in (("cpus-per-task", "SLURM_CPUS_PER_TASK"),):
        value = next((v for o, v, _ in reversed(request.raw) if o == option), None)
        optional[name] = value
    if optional["SLURM_NTASKS"]:
        optional["SLURM_NPROCS"] = optional["SLURM_NTASKS"]
    if optional["SLURM_JOB_NUM_NODES"]:
        optional["SLURM_NNODES"] = optional["SLURM_JOB_NUM_NODES"]
    env.update({k: v for k, v in optional.items() if v})
    if array_task is not None and request.array:
        env.update(_array_env(array_task_ids(request.array), array_task))
    return env


def _array_env(ids: Sequence[int], task: int) -> dict[str, str]:
    """What Slurm sets in an array task (sbatch(1), OUTPUT ENVIRONMENT VARIABLES)."""
    steps = {b - a for a, b in zip(ids, ids[1:])}
    return {"SLURM_ARRAY_JOB_ID": _PLACEHOLDER_JOB_ID, "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_COUNT": str(len(ids)), "SLURM_ARRAY_TASK_MIN": str(ids[0]),
            "SLURM_ARRAY_TASK_MAX": str(ids[-1]), "SLURM_ARRAY_TASK_STEP": str(steps.pop() if len(steps) == 1 else 1)}


def _task_count(request: SbatchRequest) -> int | None:
    """The job's tasks as Slurm counts them: --ntasks, else --ntasks-per-node on each of a fixed --nodes."""
    if request.ntasks:
        return request.ntasks
    if request.ntasks_per_node and request.nodes and request.nodes.isdigit():
        return request.ntasks_per_node * int(request.nodes)
    return None


def _sbatch_refusals(text: str, lines: list[str]) -> list[Problem]:
    """What makes sbatch itself refuse a script (src/sbatch/sbatch.c): no `#!` line, DOS line breaks."""
    problems = []
    if not text.startswith("#!"):
        problems.append(Problem(1, lines[0] if lines else "", "sbatch refuses a script whose first line is not "
                                                              "#! and an interpreter (e.g. #!/bin/bash)"))
    if "\r\n" in text:
        line_no = text[:text.index("\r\n")].count("\n") + 1
        problems.append(Problem(line_no, lines[line_no - 1], "sbatch refuses DOS line breaks (\\r\\n): convert "
                                                             "the script with dos2unix"))
    return problems


def _job_cwd(chdir: str | None, submit_cwd: str | None) -> str | None:
    if chdir and submit_cwd and not chdir.startswith("/"):
        return posixpath.normpath(posixpath.join(submit_cwd, chdir))
    return chdir or submit_cwd


def _python_shebang(lines: list[str]) -> str | None:
    """`#!/usr/bin/env python3` or `#!/x/bin/python`: the batch script is itself the training script.
    Returns the interpreter path, "" for one found on PATH, None when the script is not Python."""
    return shebang_python(lines[0]) if lines else None
