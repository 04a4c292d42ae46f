"""A job launched through a shell wrapper or a command that starts one (`bash train.sh`, `./run.sh`, `env A=1
python ...`) is run as the batch script runs it, and the Python process it starts is traced
(`xmem.trace.child.launch`): the same peak as the training command typed directly (issue 31)."""

import stat
import textwrap

import pytest

from tests.trace.child.live_storages import peak_live_bytes as peak
from xmem.trace import TraceError, run_trace

TRAIN = """\
import os, torch
assert os.environ["FROM_WRAPPER"] == "1"  # the wrapper's environment reaches the program
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(4):
    opt.zero_grad(); model(torch.randn(32, 256, device="cuda")).sum().backward(); opt.step()
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wrapped")
    (folder / "train.py").write_text(TRAIN)
    wrapper = folder / "train.sh"
    wrapper.write_text(textwrap.dedent("""\
        #!/bin/bash
        set -e
        cd "$(dirname "$0")"
        export FROM_WRAPPER=1
        echo "starting"
        python train.py "$@"
    """))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    direct = run_trace(["python", "train.py"], cwd=str(folder), env=_env(FROM_WRAPPER="1"))
    return folder, direct


def _env(**extra):
    import os
    return {**os.environ, **extra}


@pytest.mark.parametrize("command", [["bash", "train.sh"], ["./train.sh"], ["sh", "-c", "bash train.sh"]])
def test_a_shell_wrapped_launch_is_traced_as_the_program_typed_directly(job, command):
    folder, direct = job
    trace = run_trace(command, cwd=str(folder))
    assert trace.iterations == direct.iterations and trace.used_cuda
    assert peak(trace) == peak(direct) > 0
    assert trace.interpreter.endswith("python")  # the job's python, not the launching root's


def test_env_in_front_of_python_is_a_launch_too(job):
    folder, direct = job
    trace = run_trace(["env", "FROM_WRAPPER=1", "python", "train.py"], cwd=str(folder))
    assert peak(trace) == peak(direct)


def test_a_wrapper_that_fails_before_training_is_the_jobs_error_with_its_status(tmp_path):
    with pytest.raises(TraceError) as raised:
        run_trace(["bash", "-c", "echo no data here; exit 3"], cwd=str(tmp_path))
    assert raised.value.kind == "user_error" and "status 3" in raised.value.message
    assert "no data here" in raised.value.output


def test_a_wrapper_that_starts_no_python_ended_without_the_gpu(tmp_path):
    with pytest.raises(TraceError) as raised:
        run_trace(["bash", "-c", "echo only shell"], cwd=str(tmp_path))
    assert raised.value.kind == "no_cuda"


def test_a_python_error_inside_a_wrapper_is_the_programs_own_traceback(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\nx = torch.zeros(2, device='cuda')\nraise ValueError('no shard')\n")
    with pytest.raises(TraceError) as raised:
        run_trace(["bash", "-c", "python bad.py"], cwd=str(tmp_path))
    assert raised.value.kind == "user_error" and "no shard" in raised.value.message


def test_srun_inside_a_wrapper_runs_the_training_once_under_the_trace(job):
    folder, direct = job
    trace = run_trace(["bash", "-c", "srun --ntasks-per-node=1 -c 2 python train.py"], cwd=str(folder),
                      env=_env(FROM_WRAPPER="1"))
    assert peak(trace) == peak(direct)
