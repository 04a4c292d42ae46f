"""No Python process of the job escapes the trace (issue 31; issue 35's "wrong request"): a process started with
-I, -S, -E or a cleared environment, which skips the start-up hook, still runs under the tracer, because every
start of an interpreter binary in the sandbox passes `xmem.trace.child.guard` (`sandbox.guard_interpreters`)."""

import sys

import pytest

from tests.trace.child.live_storages import peak_live_bytes as peak
from xmem.trace import run_trace, sandbox
from xmem.trace.child import guard

TRAIN = """\
import torch
model = torch.nn.Linear(128, 128).cuda()
opt = torch.optim.Adam(model.parameters())
for _ in range(4):
    opt.zero_grad(); model(torch.randn(16, 128, device="cuda")).sum().backward(); opt.step()
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("escapes")
    (path / "train.py").write_text(TRAIN)
    return path


@pytest.fixture(scope="module")
def direct(folder):
    return run_trace(["python", "train.py"], cwd=str(folder))


@pytest.mark.parametrize("starter", [
    'subprocess.run([sys.executable, "-I", "train.py"])',
    'subprocess.run([sys.executable, "-S", "train.py"])',
    'subprocess.run([sys.executable, "-E", "train.py"], env={"PYTHONPATH": "/nowhere"})',
    'subprocess.run([sys.executable, "-uIS", "train.py"])',
    'subprocess.run([sys.executable, "train.py"], env={})',
    'subprocess.run(["env", "-i", sys.executable, "train.py"])',
])
def test_a_process_that_skips_the_start_up_hook_is_traced_all_the_same(folder, direct, starter):
    (folder / "parent.py").write_text(f"import subprocess, sys\nresult = {starter}\nprint('status', result.returncode)\n")
    trace = run_trace(["python", "parent.py"], cwd=str(folder))
    if "NOT guarded" in trace.sandbox or not trace.sandbox.startswith("namespaces"):
        pytest.skip(f"no guard here: {trace.sandbox}")
    assert "traced, whatever its options" in trace.sandbox
    assert trace.iterations == direct.iterations and peak(trace) == peak(direct) > 0


@pytest.mark.parametrize("args, flags", [
    (["-I", "train.py", "-I"], ["-s", "-P"] if sys.version_info >= (3, 11) else ["-s"]),
    (["-uSB", "-m", "pkg", "-S"], ["-uB"]),
    (["-E", "-W", "ignore", "-c", "pass"], ["-W", "ignore"]),
])
def test_the_guard_gives_back_the_hook_and_keeps_the_other_options(tmp_path, monkeypatch, args, flags):
    settings = {"boot": "/boot-dir", "marker": "XMEM_TRACE_FOLLOW", "env": {"XMEM_TRACE_FOLLOW": "{}"}}
    (tmp_path / guard.SETTINGS_FILE).write_text(__import__("json").dumps(settings))
    run = {}
    monkeypatch.setattr(guard.os, "execve", lambda path, argv, env: run.update(argv=argv, env=env))
    monkeypatch.setattr(guard.os, "environ", {"PATH": "/bin", "PYTHONWARNINGS": "error"})
    guard.main(["/real/python", str(tmp_path), "/venv/bin/python", *args])
    program = args[len(args) - len(guard._split(args)[1]):]
    assert run["argv"] == ["/venv/bin/python", *flags, *program]  # argv[0] kept: the venv is known by it
    assert run["env"]["PYTHONPATH"] == "/boot-dir" and run["env"]["XMEM_TRACE_FOLLOW"] == "{}"
    assert ("PYTHONWARNINGS" in run["env"]) == (not {"I", "E"} & set("".join(args[:1])))  # -I/-E: none of theirs


def test_before_the_tracer_hands_down_every_start_runs_unchanged(tmp_path, monkeypatch):
    run = {}
    monkeypatch.setattr(guard.os, "execv", lambda path, argv: run.update(path=path, argv=argv))
    guard.main(["/real/python", str(tmp_path), "/venv/bin/python", "-I", "-m", "xmem.trace"])
    assert run == {"path": "/real/python", "argv": ["/venv/bin/python", "-I", "-m", "xmem.trace"]}


def test_the_sandbox_guards_the_interpreters_of_the_jobs_path():
    from xmem.trace.runner import interpreter_binaries
    import os
    found = interpreter_binaries([sys.executable], os.environ)
    assert os.path.realpath(sys.executable) in found and all(os.path.isabs(p) for p in found)
    assert sandbox.GUARD_SCRIPT.is_file()
