"""Reading the user's command: which script or module runs, with which arguments, and what is refused."""

import json
import os
import stat
import sys

import pytest

from xmem.launchers import ACCELERATE_LAUNCH_ENV, Target, named_interpreter
from xmem.trace.command import job_interpreter, parse_command
from xmem.trace.errors import TraceError


@pytest.fixture
def train(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return script


def test_python_script_with_arguments(train, tmp_path):
    target = parse_command(["python3", "-u", "-W", "ignore", "train.py", "--bs", "8"], cwd=str(tmp_path))
    assert target == Target(str(train), None, ("--bs", "8"))
    assert target.child_argv() == [str(train), "--bs", "8"]


def test_python_module(tmp_path):
    target = parse_command(["python", "-m", "pkg.train", "--lr", "0.1"], cwd=str(tmp_path))
    assert target == Target(None, "pkg.train", ("--lr", "0.1"))
    assert target.child_argv() == ["-m", "pkg.train", "--lr", "0.1"]


def test_versioned_interpreter_path(train, tmp_path):
    target = parse_command(["/opt/venv/bin/python3.11", str(train)], cwd=str(tmp_path))
    assert target.script == str(train)


def test_torchrun_is_stripped_to_one_rank(train, tmp_path):
    command = ["torchrun", "--nproc_per_node=4", "--nnodes", "1", "--standalone", "train.py", "--epochs", "1"]
    target = parse_command(command, cwd=str(tmp_path))
    assert target == Target(str(train), None, ("--epochs", "1"), launcher="torchrun", nproc_per_node=4)


def test_torch_distributed_run_module_with_module_target(tmp_path):
    command = ["python", "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "pkg.train", "--x"]
    expected = Target(None, "pkg.train", ("--x",), launcher="torchrun", nproc_per_node=8)
    assert parse_command(command, cwd=str(tmp_path)) == expected


def test_script_run_directly_by_suffix_or_shebang(train, tmp_path):
    assert parse_command(["train.py", "--a"], cwd=str(tmp_path)).script == str(train)
    runner = tmp_path / "run-training"
    runner.write_text("#!/usr/bin/env python3\nprint('hi')\n")
    runner.chmod(runner.stat().st_mode | stat.S_IEXEC)
    assert parse_command(["./run-training"], cwd=str(tmp_path)).script == str(runner)


def test_executable_found_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "train-tool"
    tool.write_text("#!/usr/bin/python3\nprint('hi')\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    assert parse_command(["train-tool", "--a"], cwd=str(tmp_path)) == Target(str(tool), None, ("--a",))


@pytest.mark.parametrize("command, kind", [
    ([], "not_found"),
    (["python"], "not_found"),
    (["python", "-c", "print(1)"], "not_python"),
    (["python", "missing.py"], "not_found"),
    (["torchrun", "--no-python", "train.sh"], "not_python"),
    (["no-such-program-xmem"], "not_found"),
])
def test_refused_commands(command, kind, tmp_path):
    with pytest.raises(TraceError) as caught:
        parse_command(command, cwd=str(tmp_path))
    assert caught.value.kind == kind


def test_shell_script_is_not_python(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(TraceError) as caught:
        parse_command([str(script)])
    assert caught.value.kind == "not_python"


def test_torchrun_world_size_is_processes_per_node_times_nodes(train, tmp_path):
    command = ["torchrun", "--nnodes=2", "--nproc-per-node", "4", "train.py"]
    assert parse_command(command, cwd=str(tmp_path)).world_size(gpus_per_node=4) == 8
    every_gpu = parse_command(["torchrun", "--nproc_per_node=gpu", "train.py"], cwd=str(tmp_path))
    assert every_gpu.world_size(gpus_per_node=2) == 2 and every_gpu.world_size(gpus_per_node=8) == 8
    assert parse_command(["python", "train.py"], cwd=str(tmp_path)).world_size(gpus_per_node=4) == 1


def test_accelerate_and_deepspeed_launchers(train, tmp_path):
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "4", "--mixed_precision", "bf16",
               "train.py", "--lr", "1"]
    options = json.dumps(command[2:7])  # the launcher's own, from which the traced process's variables are made
    assert parse_command(command, cwd=str(tmp_path)) == Target(str(train), None, ("--lr", "1"), "accelerate", 4,
                                                               settings=(("ACCELERATE_MIXED_PRECISION", "bf16"),
                                                                         (ACCELERATE_LAUNCH_ENV, options)))
    command = ["deepspeed", "--num_gpus=2", "train.py", "--deepspeed_config", "ds.json"]
    assert parse_command(command, cwd=str(tmp_path)) == Target(str(train), None, ("--deepspeed_config", "ds.json"),
                                                               "deepspeed", 2)


@pytest.mark.parametrize("command, expected", [
    (["/opt/env/bin/python", "train.py"], "/opt/env/bin/python"),
    (["/opt/env/bin/python3.11", "-m", "pkg.train"], "/opt/env/bin/python3.11"),
    (["env/bin/python", "train.py"], "/job/env/bin/python"),  # relative: from the job's directory
    (["/opt/env/bin/torchrun", "--nproc-per-node", "2", "train.py"], "/opt/env/bin/python"),
    (["/opt/env/bin/accelerate", "launch", "train.py"], "/opt/env/bin/python"),
    (["python", "train.py"], None), (["torchrun", "train.py"], None), (["./train.py"], None), ([], None),
])
def test_the_interpreter_a_command_names_by_its_path(command, expected):
    assert named_interpreter(command, "/job") == expected


# --- the job's own interpreter, found as its shell finds it (issue 31) ---------------------------------------------

def _venv_bin(root, name="python3"):
    """A directory that stands for an activated environment's bin/: `name` links to this interpreter."""
    bin_dir = root / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / name).symlink_to(sys.executable)
    return bin_dir


def test_a_bare_python_is_the_one_on_the_jobs_path_not_ours(train, tmp_path):
    bin_dir = _venv_bin(tmp_path)
    command = ["python3", "train.py"]
    found = job_interpreter(command, parse_command(command, str(tmp_path)), {"PATH": f"{bin_dir}:/usr/bin"},
                            str(tmp_path))
    assert found == str(bin_dir / "python3")  # the link kept: a venv is known by its bin/python's path


def test_a_python_missing_from_the_jobs_path_is_said_not_replaced(train, tmp_path):
    command = ["python", "train.py"]
    with pytest.raises(TraceError) as raised:
        job_interpreter(command, parse_command(command, str(tmp_path)), {"PATH": str(tmp_path / "none")},
                        str(tmp_path))
    assert raised.value.kind == "not_found" and "activate the job's environment" in raised.value.message


def test_a_shell_shim_on_path_resolves_to_the_interpreter_it_runs(train, tmp_path):
    shims = tmp_path / "shims"
    shims.mkdir()
    shim = shims / "python"  # as pyenv's shims are: a shell script that execs the chosen interpreter
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    command = ["python", "train.py"]
    found = job_interpreter(command, parse_command(command, str(tmp_path)), {"PATH": str(shims)}, str(tmp_path))
    assert found == sys.executable


def test_a_launcher_on_path_runs_the_python_its_shebang_names(train, tmp_path):
    bin_dir = _venv_bin(tmp_path)
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f"#!{bin_dir / 'python3'}\nimport sys\n")
    torchrun.chmod(0o755)
    command = ["torchrun", "--nproc_per_node=2", "train.py"]
    found = job_interpreter(command, parse_command(command, str(tmp_path)), {"PATH": f"{bin_dir}:/usr/bin"},
                            str(tmp_path))
    assert found == str(bin_dir / "python3")
