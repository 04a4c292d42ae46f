"""The error contract of run_trace: each way a program can fail to be traced gives its own TraceError kind, with a
one-line message, and for user errors the user's own traceback frames only."""

import stat
import sys

import pytest

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.trace import TraceError, run_trace


def trace_error(command, **options) -> TraceError:
    with pytest.raises(TraceError) as caught:
        run_trace(command, **options)
    assert "\n" not in caught.value.message
    return caught.value


def test_missing_script_is_not_found(tmp_path):
    error = trace_error(["python", "no_such_train.py"], cwd=str(tmp_path))
    assert error.kind == "not_found" and "no_such_train.py" in error.message


def test_missing_module_is_not_found(tmp_path):
    error = trace_error(["python", "-m", "no_such_package.train"], cwd=str(tmp_path))
    assert error.kind == "not_found" and "no_such_package.train" in error.message


def test_shell_script_that_starts_no_python_ended_without_the_gpu(tmp_path):
    """A shell wrapper is run as the job runs it (xmem.trace.child.launch); one that starts no Python process that
    uses the GPU has nothing to estimate."""
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\necho training\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    assert trace_error([str(script)]).kind == "no_cuda"


def test_binary_program_is_not_python():
    assert trace_error(["/bin/ls", "-l"]).kind == "not_python"
    assert trace_error(["python", "/bin/ls"]).kind == "not_python"


@pytest.mark.parametrize("python", PYTHONS)
def test_user_exception_gives_the_users_frames_only(python):
    error = trace_error(["python", str(SCRIPTS / "raises.py")], python=python)
    assert error.kind == "user_error"
    assert error.message == "ValueError: dataset shard 0 is missing (at raises.py:6)"
    frames = [line for line in error.user_traceback.splitlines() if line.startswith("  File ")]
    assert len(frames) == 2 and all("raises.py" in line for line in frames)
    assert error.user_traceback.rstrip().endswith("ValueError: dataset shard 0 is missing")


def test_nonzero_exit_is_a_user_error(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nprint('bad config')\nsys.exit(3)\n")
    error = trace_error(["python", str(script)])
    assert error.kind == "user_error" and "status 3" in error.message
    assert "bad config" in error.output


def test_cuda_without_optimizer_step_is_the_peak_of_its_forward_pass(python=sys.executable):  # this build only
    trace = run_trace(["python", str(SCRIPTS / "no_step.py")], python=python)
    assert trace.forward_only and trace.forward_passes == 1 and trace.iterations == 0
    assert any(e.action == "alloc" and e.nbytes == 4 * 1 * 4 and e.iteration == 0 for e in trace.events)  # output


def test_timeout_stops_the_program(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    error = trace_error(["python", str(script)], timeout=4)
    assert error.kind == "timeout"


def test_users_output_is_captured_not_printed(capfd):
    run_trace(["python", str(SCRIPTS / "mlp_adam.py")], iterations=1)
    printed = capfd.readouterr()
    assert "step 0 loss" not in printed.out + printed.err


def test_missing_interpreter_is_not_found():
    error = trace_error(["python", str(SCRIPTS / "mlp_adam.py")], python="/no/such/venv/bin/python")
    assert error.kind == "not_found" and "/no/such/venv/bin/python" in error.message


def test_a_job_whose_python_has_no_torch_is_told_so_not_traced_on_ours(tmp_path):
    """With no environment activated, `python3` is the one on the job's PATH: a fresh venv without torch here. The
    job would fail on the node too; the trace never falls back to xmem's own interpreter (issue 31)."""
    import subprocess
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    (tmp_path / "train.py").write_text("import torch\n")
    env = {"PATH": f"{tmp_path / 'bare' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    error = trace_error(["python3", "train.py"], cwd=str(tmp_path), env=env)
    assert error.kind == "user_error"
    assert f"{tmp_path / 'bare' / 'bin' / 'python3'} cannot import torch" in error.message
