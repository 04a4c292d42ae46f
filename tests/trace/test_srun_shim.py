"""`srun` inside a traced job is the shim `launchers.srun_shim` writes: it finds the command by srun's grammar and
runs it once, as task 0 of the step (the trace has no allocation for a real step)."""

import subprocess

import pytest

from xmem.launchers import srun_shim


@pytest.fixture
def srun(tmp_path):
    path = tmp_path / "srun"
    path.write_text(srun_shim())
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("options", [[], ["--ntasks-per-node=4", "-n", "4"], ["--label", "-c8", "--cpu-bind", "cores"],
                                     ["-N", "2", "--kill-on-bad-exit", "--"]])
def test_the_shim_runs_its_command_once_as_task_0(srun, options):
    done = subprocess.run([str(srun), *options, "sh", "-c", 'echo "$SLURM_PROCID $SLURM_LOCALID $*"', "sh", "a b"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "SLURM_PROCID": "3"})
    assert done.returncode == 0 and done.stdout == "0 0 a b\n"


def test_the_shim_without_a_command_fails_as_srun_does(srun):
    done = subprocess.run([str(srun), "-n", "2"], capture_output=True, text=True)
    assert done.returncode == 1 and "no command" in done.stderr
