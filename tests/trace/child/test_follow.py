"""Training that the program starts in a process of its own is traced, whatever starts it (`xmem.trace.child.follow`:
one start-up hook in every Python process of the job), on the job's own interpreter and libraries."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from tests.trace.test_launcher import FSDP2_EXAMPLE, parameter_bytes
from tests.torch_builds import PYTHONS

from xmem.trace import run_trace, sandbox
from xmem.trace.child import follow

XMEM_PARENT = str(Path(follow.__file__).resolve().parents[3])


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ---- what a command line runs, and whose result is the job's ------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["python", "-u", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]),
    (["python", "-X", "dev", "-W", "ignore", "-m", "torch.distributed.run", "t.py"],
     ["-m", "torch.distributed.run", "t.py"]),
    (["python", "-Bm", "pkg.train", "-x"], ["-m", "pkg.train", "-x"]),
    (["python", "-c", "import torch", "a"], ["-c", "import torch", "a"]),
    (["python", "--", "train.py"], ["train.py"]),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], None),
    (["python"], None), (["python", "-"], None), (["python", "--version"], None),
])
def test_the_program_a_python_command_line_runs(argv, expected):
    assert follow.program(argv) == expected


def test_the_jobs_result_is_a_trace_of_gpu_use_wherever_it_was_made():
    trace = {"used_cuda": True, "iterations": 2}
    no_gpu = {"used_cuda": False, "iterations": 0}
    ours = {"error": "not_modelled", "message": "not modelled: x"}
    theirs = {"error": "user_error", "message": "ValueError"}
    exited = {"error": "user_error", "message": "CalledProcessError"}
    assert follow.choose(trace, [ours, dict(trace)]) is trace  # the root's own training first
    forward_only = {"used_cuda": True, "iterations": 3, "forward_only": True}
    assert follow.choose(forward_only, [trace]) is trace  # then training wherever it ran
    assert follow.choose(no_gpu, [theirs, trace]) is trace
    assert follow.choose(no_gpu, [theirs, ours]) is ours  # a gap of the fake GPU is never the user's error
    assert follow.choose(exited, [theirs]) is theirs  # the root failed because its process did
    assert follow.choose(no_gpu, [theirs]) is no_gpu  # a failure the root went past is its own business
    assert follow.choose(no_gpu, []) is no_gpu


# ---- the start-up hook, without a trace --------------------------------------------------------------------------
def started(python: str, code: str, settings: dict | None, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", follow.ENV)}
    environment.update(env, PYTHONPATH=follow.BOOT_DIR)
    if settings is not None:
        environment[follow.ENV] = json.dumps(settings)
    return subprocess.run([python, "-c", code], env=environment, capture_output=True, text=True, timeout=120)


def test_a_rank_the_fake_process_group_stands_in_for_ends_at_once():
    settings = {"out": "/nonexistent/trace.json", "iterations": 1, "capability": "9.0", "device_count": 1,
                "root": 1, "progress": None, "deadline": None}
    for rank in ({"RANK": "1"}, {"LOCAL_RANK": "3", "RANK": "0"}):
        ended = started(sys.executable, "print('ran')", settings, **rank)
        assert (ended.returncode, ended.stdout, ended.stderr) == (0, "", "")


@pytest.mark.parametrize("python", PYTHONS)
def test_xmem_reaches_the_jobs_interpreter_alone(python):
    """The start-up hook makes xmem importable in an interpreter that lacks it, and puts nothing of the estimator's
    installation (its other packages, its pins) on the job's path."""
    code = "import sys, xmem; print(xmem.__file__); print('\\n'.join(sys.path))"
    ended = started(python, code, None)
    assert ended.returncode == 0, ended.stderr
    package, *path = ended.stdout.splitlines()
    assert package == os.path.join(XMEM_PARENT, "xmem", "__init__.py")
    assert XMEM_PARENT not in path


# ---- traced ------------------------------------------------------------------------------------------------------
TRAIN = """
    import os, sys, sysconfig
    import torch

    # the job's own interpreter and libraries: nothing of the estimator's installation on its path
    own = sysconfig.get_paths()["purelib"]
    assert not [p for p in sys.path if p in sys.argv[1:] and p != own], sys.path
    assert torch.__file__.startswith(sys.prefix) and "RANK" not in os.environ
    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        optimizer.step()
"""


# The other environment when there is one (the CPU build, torch 2.13), else this one: one trace either way.
OTHER_PYTHON = os.environ.get("XMEM_TEST_CPU_PYTHON") or sys.executable


@pytest.mark.parametrize("python", [OTHER_PYTHON], ids=["other-environment"])
def test_training_run_by_subprocess_on_the_programs_interpreter_is_traced(python, tmp_path):
    write(tmp_path / "train.py", TRAIN)
    outer = write(tmp_path / "outer.py", """
        import subprocess, sys
        subprocess.run([sys.executable, "train.py", *sys.argv[1:]], check=True)
        raise SystemExit("the job went on after its trace was made")
    """)
    installation = [XMEM_PARENT, sysconfig.get_paths()["purelib"]]  # the estimator's
    result = run_trace([python, str(outer), *installation], iterations=2, cwd=str(tmp_path))
    assert result.iterations == 2
    assert parameter_bytes(result) == [256 * 4, 256 * 256 * 4]


def test_torch_distributed_run_in_a_subprocess_traces_rank_zero_in_its_world(tmp_path):
    write(tmp_path / "fsdp2_example.py", FSDP2_EXAMPLE)
    outer = write(tmp_path / "outer.py", """
        import subprocess, sys
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        subprocess.run([*launch, "fsdp2_example.py"], check=True)
    """)
    result = run_trace([sys.executable, str(outer)], iterations=2, cwd=str(tmp_path))
    assert result.iterations == 2
    weight, bias = 512 * 512 * 4 // 2, 512 * 4 // 2  # rank 0 holds half of each parameter
    assert [n for n in parameter_bytes(result) if n in (weight, bias)] == sorted([weight, bias] * 2)


def test_an_environments_console_script_runs_on_that_environments_python(tmp_path):
    """`trl`, `tune`: an entry point pip wrote into an environment's bin/ runs on the python beside it, whose
    libraries the program uses, not on the estimator's."""
    venv = tmp_path / "env"  # a venv that sees this one's libraries through a path line, but not xmem
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    (Path(own) / "torch-beside.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    tool = venv / "bin" / "train-tool"
    tool.write_text(f"#!{python}\n" + textwrap.dedent(f"""
        import sys, torch
        assert sys.executable == {str(python)!r}, sys.executable
        model = torch.nn.Linear(4, 4).cuda()
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    """))
    tool.chmod(0o755)
    assert run_trace([str(tool)], iterations=1).iterations == 1


def test_a_child_python_process_writes_into_the_fallback_sandboxs_copy(tmp_path, monkeypatch):
    """No namespaces: a Python process the program starts redirects its writes as the tracer does (the same
    copy-on-write directory), instead of having them refused; the user's directory stays as it was."""
    monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    write(tmp_path / "child.py", """
        with open("cache.txt", "w") as f:
            f.write("tokens")
        assert open("cache.txt").read() == "tokens"
    """)
    outer = write(tmp_path / "outer.py", """
        import subprocess, sys, torch
        subprocess.run([sys.executable, "child.py"], check=True)
        model = torch.nn.Linear(4, 4).cuda()
        model(torch.randn(2, 4, device="cuda")).sum().backward()
    """)
    before = sorted(path.name for path in tmp_path.iterdir())
    assert run_trace([sys.executable, str(outer)], iterations=1, cwd=str(tmp_path)).iterations == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == before
