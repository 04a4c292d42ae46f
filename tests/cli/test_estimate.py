"""`xmem-slurm estimate` as a user runs it: a real subprocess, the real tracer, exit codes and the JSON contract."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYTHON = sys.executable

MLP_SCRIPT = """
    import torch
    print("hello from the training script")          # must not reach stdout in --json mode
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(5):
        x = torch.randn(64, 512, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def xmem(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "xmem.cli", "estimate", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def json_stdout(run: subprocess.CompletedProcess) -> dict:
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got: {run.stdout!r}"
    return json.loads(lines[0])


def test_json_estimate_of_an_mlp(tmp_path):
    script = write(tmp_path, "train.py", MLP_SCRIPT)
    run = xmem("--json", "--gpu", "a100", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json_stdout(run)
    assert set(data["gpus"]) == {"A100-SXM4-40GB", "T4"}
    a100 = data["gpus"]["A100-SXM4-40GB"]
    assert a100["fits"] is True and a100["oom"] is None
    assert a100["peak_bytes"] == a100["peak_reserved_bytes"] + a100["overhead_bytes"]
    # Parameters: (512*1024 + 1024) + (1024*10 + 10) floats; Adam keeps two states per parameter.
    param_bytes = 4 * (512 * 1024 + 1024 + 1024 * 10 + 10)
    assert data["breakdown"]["parameter"] == param_bytes
    assert data["breakdown"]["optimizer_state"] >= 2 * param_bytes
    assert data["used_cuda"] is True and data["iterations"] >= 1


def test_table_for_people(tmp_path):
    script = write(tmp_path, "train.py", MLP_SCRIPT)
    run = xmem("--gpu", "rtx3060", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "RTX-3060-12GB" in run.stdout and "fits" in run.stdout
    assert "hello from the training script" not in run.stdout  # stdout holds only the table
    assert "parameter" in run.stdout and "GiB" in run.stdout


def test_program_that_never_uses_cuda_is_an_error_not_a_0_byte_answer(tmp_path):
    script = write(tmp_path, "cpu.py", """
        import torch
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    """)
    run = xmem("--json", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 9, run.stderr
    assert json_stdout(run)["error"] == "no_cuda"


def test_site_config_catalog_applies(tmp_path):
    config = write(tmp_path, "xmem.toml", """
        [catalog.gpus."Site-GPU-24GB"]
        total_bytes = 25_000_000_000
        capability = [8, 9]
        aliases = ["sitegpu"]
    """)
    script = write(tmp_path, "site.py", """
        import torch
        assert torch.cuda.get_device_properties(0).total_memory == 25_000_000_000  # the program sees the site's GPU
        model = torch.nn.Linear(4, 4).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4, device="cuda")).sum().backward()
            opt.step()
    """)
    run = xmem("--json", "--config", str(config), "--gpu", "sitegpu", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json_stdout(run)["gpus"]["Site-GPU-24GB"]["total_bytes"] == 25_000_000_000


def test_broken_site_config_exits_2(tmp_path):
    config = write(tmp_path, "xmem.toml", "[catalog.gpus.X]\ncapability = [8, 0]\n")
    run = xmem("--json", "--config", str(config), "--", PYTHON, "x.py", cwd=tmp_path)
    assert run.returncode == 2
    assert json_stdout(run)["error"] == "bad_option" and "total_bytes" in json_stdout(run)["message"]


def test_unknown_gpu_exits_2_before_tracing(tmp_path):
    run = xmem("--json", "--gpu", "X9000", "--", PYTHON, "does-not-exist.py", cwd=tmp_path)
    assert run.returncode == 2
    assert json_stdout(run)["error"] == "unknown_gpu"
    assert run.stderr.strip().splitlines()[-1].startswith("xmem-slurm estimate: unknown GPU type 'X9000'")


def test_bad_option_exits_2(tmp_path):
    assert xmem("--iterations", "0", "--", PYTHON, "x.py", cwd=tmp_path).returncode == 2
    run = xmem("--json", "--iterations", "zero", "--", PYTHON, "x.py", cwd=tmp_path)
    assert run.returncode == 2
    assert json_stdout(run)["error"] == "bad_option" and "--iterations" in json_stdout(run)["message"]


def test_command_not_found_exits_3(tmp_path):
    run = xmem("--json", "--gpu", "t4", "--", "no-such-command-xmem-test", cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    assert json_stdout(run)["error"] == "not_found"


def test_not_a_python_program_exits_4(tmp_path):
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))  # a compiled program: its GPU use is native
    binary.chmod(0o755)
    run = xmem("--json", "--gpu", "t4", "--", str(binary), cwd=tmp_path)
    assert run.returncode == 4, run.stderr
    assert json_stdout(run)["error"] == "not_python"


def test_a_shell_script_that_starts_no_python_exits_9_with_what_it_printed(tmp_path):
    script = write(tmp_path, "job.sh", "#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    run = xmem("--json", "--gpu", "t4", "--", str(script), cwd=tmp_path)
    assert run.returncode == 9, run.stderr
    assert json_stdout(run)["error"] == "no_cuda" and "hi" in json_stdout(run)["output"]


def test_user_code_raising_exits_5_with_its_traceback(tmp_path):
    script = write(tmp_path, "broken.py", """
        import torch
        def load_data():
            raise FileNotFoundError("data/train.bin")
        load_data()
    """)
    run = xmem("--json", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 5, run.stderr
    assert "load_data" in run.stderr and "FileNotFoundError" in run.stderr  # the user's traceback, for people
    data = json_stdout(run)
    assert data["error"] == "user_error" and "load_data" in data["traceback"]
    # the line to fix is in the one line too (issue 32): where a log keeps only the last line, or the filter's reply
    assert data["message"].endswith("(at broken.py:4)")
    assert run.stderr.splitlines()[-1] == f"xmem-slurm estimate: {data['message']}"


def test_a_syntax_error_names_its_file_and_line_in_one_line(tmp_path):
    script = write(tmp_path, "typo.py", """
        import torch
        x = torch.zeros(3, device="cuda"
        print(x)
    """)
    run = xmem("--json", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 5, run.stderr
    assert json_stdout(run)["message"].endswith("(typo.py, line 3)")


def test_no_optimizer_step_within_the_time_limit_exits_6(tmp_path):
    """A program that made an optimizer is heading for a step however long it evaluates: only the trace's own time
    limit ends it, and then no step was reached (an inference job without one gets its forward passes' peak)."""
    script = write(tmp_path, "evaluates.py", """
        import time
        import torch
        model = torch.nn.Linear(8, 8).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            while True:
                model(torch.randn(4, 8, device="cuda"))
                time.sleep(0.05)  # waits for the time limit without taking a core from the tests beside it
    """)
    run = xmem("--json", "--timeout", "25", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 6, run.stderr
    data = json_stdout(run)
    assert data["error"] == "no_optimizer_step" and "had not stepped it when the trace's time limit" in data["message"]


def test_timeout_exits_7(tmp_path):
    script = write(tmp_path, "slow.py", "import time\ntime.sleep(120)\n")
    run = xmem("--json", "--timeout", "3", "--gpu", "t4", "--", PYTHON, str(script), cwd=tmp_path)
    assert run.returncode == 7, run.stderr
    assert json_stdout(run)["error"] == "timeout"
