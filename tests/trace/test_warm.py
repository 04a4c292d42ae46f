"""The warm tracer (xmem.trace.warm, its server xmem.trace.child.warm_server): a job it runs equals the cold trace and sees nothing of the job before it,
another user cannot reach it, an estimate goes on cold when it is stale or dies mid-way, and SIGTERM stops a job.

One server (started as the first estimate would start it) serves the module, in a socket directory of its own;
whether a trace was run warm is told by the CPU time of this process's children: a cold trace's child imports
torch (seconds), a warm one is no child of ours.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from xmem.trace import TraceError, run_trace, runner, sandbox, warm
from xmem.trace.command import parse_command
from xmem.trace.wire import FRAME_HEADER, WarmRequest

from tests.throwaway_users import users_fixture
from tests.waiting import wait_for

SCRIPTS = Path(__file__).parents[1] / "scripts"
MLP = ["python", str(SCRIPTS / "mlp_adam.py"), "--steps", "4"]
SERVER_START_S = 300  # a niced server loading torch on a loaded 2-core machine
COLD_CPU_S = 0.5  # a cold trace's child spends more than this importing torch; a warm trace spends nothing here

users = users_fixture("intruder")

LEAVES_STATE = """
import json, os, sys, torch
os.environ["XMEM_WARM_LEAK"] = "1"
os.chdir("/")
sys.path.append("/xmem-warm-leak")
torch._xmem_warm_leak = json._xmem_warm_leak = True
torch.set_default_dtype(torch.float64)
model = torch.nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
"""

SEES_NO_STATE = """
import json, os, sys, torch
leaks = [name for name, leaked in [
    ("env", "XMEM_WARM_LEAK" in os.environ), ("cwd", os.getcwd() != sys.argv[1]),
    ("sys.path", "/xmem-warm-leak" in sys.path), ("torch module", hasattr(torch, "_xmem_warm_leak")),
    ("json module", hasattr(json, "_xmem_warm_leak")), ("default dtype", torch.get_default_dtype() != torch.float32)]
    if leaked]
if leaks:
    raise RuntimeError(f"state of the job before: {leaks}")
model = torch.nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def traced(command: list[str], **kw) -> tuple[dict, float]:
    """The trace as JSON (without its duration) and the CPU time this process's children spent on it."""
    before = children_cpu()
    payload = run_trace(command, iterations=2, **kw).to_json()
    payload.pop("seconds", None)
    return payload, children_cpu() - before


def socket_for(command: list[str]) -> Path:
    env = runner._child_env(None, parse_command(command, None), 1)
    path = warm.socket_path(shutil.which(sys.executable), env)
    assert path is not None
    return path


def warm_settings(directory: Path) -> dict[str, str]:
    return {warm.ENABLE_ENV: "1", warm.DIR_ENV: str(directory), warm.IDLE_ENV: "600"}


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server():
    """(socket path, server process), for a directory of this module's own."""
    directory = Path(tempfile.mkdtemp(prefix="xw-"))  # short: a socket's path holds at most 108 bytes
    with pytest.MonkeyPatch.context() as patch:
        for name, value in warm_settings(directory).items():
            patch.setenv(name, value)
        path = socket_for(MLP)
        process = warm.start_server(shutil.which(sys.executable), path,
                                    warm.server_env(runner._child_env(None, parse_command(MLP, None), 1),
                                                    runner.BOOT_DIR))
        assert process is not None
        try:
            ready = wait_for(lambda: process.poll() is not None or warm.connect(path) is not None, SERVER_START_S, 0.5)
            assert ready and process.poll() is None, "the warm tracer did not start"
            yield path, process
        finally:
            stop(process)
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def warm_on(server, monkeypatch):
    for name, value in warm_settings(server[0].parent).items():
        monkeypatch.setenv(name, value)
    return server


def test_warm_trace_equals_the_cold_one(warm_on, monkeypatch):
    warm_trace, warm_cpu = traced(MLP)
    monkeypatch.setenv(warm.ENABLE_ENV, "0")
    cold_trace, cold_cpu = traced(MLP)
    assert warm_cpu < COLD_CPU_S < cold_cpu, "the first trace was not run warm"
    assert warm_trace == cold_trace


def test_a_preloaded_library_that_bound_torchs_ddp_gets_the_stand_in(warm_on, tmp_path):
    """The server imports Lightning before any job, and its strategies bind DDP by name then: a warm job's
    Lightning must build the tracer's DDP as a cold one does (torch's own read the fake collectives' unwritten
    buffers: Fabric with 2 devices failed at random, 'DDP expects same model' or an int overflow)."""
    if importlib.util.find_spec("lightning") is None:  # not imported here: it sets PYTORCH_NVML_BASED_CUDA_CHECK
        pytest.skip("lightning is not installed")
    script = tmp_path / "lightning_ddp.py"
    script.write_text("import torch, torch.nn.parallel as parallel\n"
                      "from lightning.fabric.strategies import ddp\n"
                      "assert ddp.DistributedDataParallel is parallel.DistributedDataParallel, 'torch DDP kept'\n"
                      + (SCRIPTS / "mlp_adam.py").read_text())
    _, cpu = traced(["python", str(script), "--steps", "4"], cwd=str(tmp_path))
    assert cpu < COLD_CPU_S, "the trace was not run warm"


def test_a_preloaded_library_that_bound_safe_open_reads_no_weights(warm_on, tmp_path):
    """transformers.modeling_utils takes `safe_open` by name when the server imports it, before the job's
    checkpoint patch: a warm from_pretrained then read every weight (a 70B FSDP estimate read 8.3 GiB of its
    checkpoint warm, 0.5 MiB cold). The name it holds must be the patched one, as in a cold trace."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    script = tmp_path / "bound_safe_open.py"
    script.write_text("import safetensors, transformers.modeling_utils as modeling\n"
                      "assert modeling.safe_open is safetensors.safe_open, 'the unpatched safe_open kept'\n"
                      + (SCRIPTS / "mlp_adam.py").read_text())
    _, cpu = traced(["python", str(script), "--steps", "4"], cwd=str(tmp_path))
    assert cpu < COLD_CPU_S, "the trace was not run warm"


def test_a_program_reaching_the_real_cuda_runtime_is_not_modelled_warm_too(warm_on, tmp_path):
    """In a warm child (a fork of a process that loaded CUDA) torch's own init asserts `is_device_in_bad_fork` before
    the runtime can say it has no device: the same gap of ours as cold, exit 11, never the program's error."""
    script = tmp_path / "driver.py"
    script.write_text("import torch\nx = torch.zeros(4, device='cuda')\ntorch._C._cuda_init()\n")
    before = children_cpu()
    with pytest.raises(TraceError) as raised:
        run_trace([sys.executable, str(script)], timeout=120)
    assert children_cpu() - before < COLD_CPU_S, "the trace was not run warm"
    assert raised.value.kind == "not_modelled" and "reached the real CUDA runtime" in raised.value.message


def test_the_sites_choice_applies_unless_the_users_environment_says_otherwise(warm_on, monkeypatch):
    monkeypatch.delenv(warm.ENABLE_ENV)
    _, site_on = traced(MLP, warm_tracer=True)  # [estimate] warm_tracer = true
    _, site_off = traced(MLP)  # the default: off
    monkeypatch.setenv(warm.ENABLE_ENV, "0")
    _, user_off = traced(MLP, warm_tracer=True)
    assert site_on < COLD_CPU_S < min(site_off, user_off)


def test_second_job_sees_nothing_of_the_first(warm_on, tmp_path):
    first, second = tmp_path / "leaves_state.py", tmp_path / "sees_no_state.py"
    first.write_text(LEAVES_STATE)
    second.write_text(SEES_NO_STATE)
    _, first_cpu = traced(["python", str(first)], cwd=str(tmp_path))
    _, second_cpu = traced(["python", str(second), str(tmp_path)], cwd=str(tmp_path))  # raises if it sees a leak
    assert first_cpu < COLD_CPU_S and second_cpu < COLD_CPU_S, "a job was not run warm"


def test_warm_job_without_namespaces_runs_in_the_fallback_sandbox(warm_on, monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "fallback")
    before = children_cpu()
    trace = run_trace(MLP, iterations=2)
    assert children_cpu() - before < COLD_CPU_S
    assert trace.sandbox.startswith("fallback") and trace.iterations == 2


def test_another_user_cannot_reach_or_be_served(server, users):
    path, _ = server
    (intruder,) = users
    connect = (f"import socket; s = socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect({str(path)!r}); "
               "print('answer', s.recv(100))")
    refused = intruder.python(connect, check=False)
    assert "PermissionError" in refused.stderr, refused.stdout + refused.stderr
    os.chmod(path.parent, 0o711)  # as if the directory had been opened up: the server itself must refuse
    os.chmod(path, 0o777)
    try:
        done = intruder.python(connect, check=False)
    finally:
        os.chmod(path, 0o600)
        os.chmod(path.parent, 0o700)
    assert "answer b''" in done.stdout, done.stdout + done.stderr  # closed without a word


def test_a_server_that_loaded_a_library_choosing_its_code_by_cuda_runs_no_job(tmp_path):
    # bitsandbytes picks its CPU-only library when imported without a GPU: a server whose preloaded libraries pulled
    # it in (transformers.trainer -> peft -> bitsandbytes, before it left the preload) would trace every job on it
    from xmem.trace.child import warm_server

    request = WarmRequest((), {"HOME": str(tmp_path)}, str(tmp_path), 0o022, {}, runner.fake_gpu())
    clean = warm_server.Loaded(origins={}, signature=[], base_path=[], library_bytes=0)
    assert warm_server._declined(request, clean) == ""
    tainted = warm_server.Loaded(origins={"bitsandbytes": "/x/bitsandbytes/__init__.py"}, signature=[], base_path=[],
                                 library_bytes=0)
    assert "bitsandbytes was imported before the job's fake GPU" in warm_server._declined(request, tainted)
    assert not set(warm_server.CHOOSE_BY_CUDA_AT_IMPORT) & set(warm_server.TRAINING_LIBRARIES)


def test_a_job_whose_gpu_reaches_a_librarys_import_time_kernels_runs_cold(tmp_path):
    # torchao defines its MX kernels at import only for sm100+: a server that imported it without a GPU cannot serve
    # a Blackwell job; the decision reads the request's own GPU field, whatever the command line holds
    from xmem.gpus import load_catalog
    from xmem.trace.child import warm_server

    catalog = load_catalog(calibration_path=None)
    blackwell = next(gpu for gpu in catalog.values() if gpu.capability >= (10, 0))
    ampere = next(gpu for gpu in catalog.values() if gpu.capability == (8, 0))
    loaded = warm_server.Loaded(origins={"torchao": "/x/torchao/__init__.py"}, signature=[], base_path=[],
                                library_bytes=0)
    for gpu, declined in ((ampere, False), (blackwell, True)):
        request = WarmRequest((), {"HOME": str(tmp_path)}, str(tmp_path), 0o022, {}, runner.fake_gpu(gpu))
        assert ("torchao was imported before the job's fake GPU" in warm_server._declined(request, loaded)) == declined


def test_stale_socket_falls_back_to_cold(monkeypatch, tmp_path):
    directory = Path(tempfile.mkdtemp(prefix="xw-"))
    try:
        for name, value in warm_settings(directory).items():
            monkeypatch.setenv(name, value)
        path = socket_for(MLP)
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(path))  # a socket file no server listens on (its server was killed)
        dead.close()
        _, cpu = traced(MLP)
        assert cpu > COLD_CPU_S
        assert warm.server_pids(directory), "the estimate started no server for the next ones"
    finally:
        for pid in warm.server_pids(directory):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def test_server_dying_mid_way_falls_back_to_cold(warm_on, tmp_path):
    _, process = warm_on
    script = tmp_path / "slow_start.py"
    script.write_text("import time\ntime.sleep(4)\n" + (SCRIPTS / "mlp_adam.py").read_text())
    outcome: dict = {}

    def estimate() -> None:
        outcome["trace"], outcome["cpu"] = traced(["python", str(script), "--steps", "4"])

    assert wait_for(lambda: not sandbox.descendants(process.pid), 10)  # the jobs before have ended
    thread = threading.Thread(target=estimate)
    thread.start()
    assert wait_for(lambda: sandbox.descendants(process.pid), 30), "the job never started warm"
    for pid in sandbox.descendants(process.pid)[:1]:  # the server's child that runs the job: the job dies with it
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert outcome.get("trace", {}).get("iterations") == 2 and outcome["cpu"] > COLD_CPU_S
    assert wait_for(lambda: not sandbox.descendants(process.pid), 10)


def test_one_socket_per_interpreter_and_import_environment_whatever_the_job():
    """issue 32: the interpreter as the job names it and the launcher's per-job GPU list gave each job its own
    server (12 under one test worker); what shapes the server's imports still does."""
    venv_bin = os.path.dirname(sys.executable)
    names = [sys.executable, os.path.join(venv_bin, "python3"), os.path.join(venv_bin, ".", "python")]
    base = {"HOME": "/home/u", "PATH": "/usr/bin"}
    jobs = [base, {**base, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
             {**base, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"},  # a torchrun of 1 process
             {**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}]  # torch's own, once a process compiled
    assert len({warm.socket_path(name, env) for name in names for env in jobs}) == 1
    assert warm.socket_path(sys.executable, {**base, "OMP_NUM_THREADS": "1"}) != warm.socket_path(sys.executable, base)
    assert warm.socket_path(sys.executable, {**base, "HF_HOME": "/x"}) != warm.socket_path(sys.executable, base)
    gpus = {warm.socket_path(sys.executable, {**base, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n)))})
            for n in (1, 2)}
    assert len(gpus) == 2  # what the server preloads depends on the node's GPUs


def test_one_server_serves_jobs_that_differ(monkeypatch, tmp_path):
    """Several warm traces of jobs that differ (interpreter named python or python3, cwd) start one server, and the
    jobs after it run on it."""
    directory = Path(tempfile.mkdtemp(prefix="xw-"))
    python3 = os.path.join(os.path.dirname(sys.executable), "python3")
    try:
        for name, value in warm_settings(directory).items():
            monkeypatch.setenv(name, value)
        traced(MLP)  # cold: it starts the server
        assert wait_for(lambda: warm.connect(socket_for(MLP)) is not None, SERVER_START_S, 0.5), "no server"
        for command, options in [([python3, *MLP[1:]], {}), ([sys.executable, *MLP[1:]], {"cwd": str(tmp_path)})]:
            _, cpu = traced(command, **options)
            assert cpu < COLD_CPU_S, f"{command[0]} {options} was not run warm"
        assert len(list(directory.glob("*.sock"))) == 1
        assert wait_for(lambda: len(warm.server_pids(directory)) == 1, 10), warm.server_pids(directory)
    finally:
        for pid in warm.server_pids(directory):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_warm_job_that_goes_on_after_its_server_gave_out_leaves_the_cold_run_alone(monkeypatch, tmp_path):
    """issue 32: a server that never said the job started (busy, or its handler died) may still run the job, whose
    sandbox then made its folders in the scratch the cold run was given: `[Errno 17] File exists`. Here the
    "server" takes the request, hangs up, and the job's sandbox sets up 0.2 s later, as the cold run starts."""
    client, server_end = socket.socketpair()
    for name, value in warm_settings(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(warm, "socket_path", lambda interpreter, env: tmp_path / "server.sock")
    monkeypatch.setattr(warm, "connect", lambda path: client)
    wrote: list[Path] = []

    def late_job() -> None:
        _, fds, _, _ = socket.recv_fds(server_end, FRAME_HEADER.size, 2)
        request = WarmRequest.decode(server_end.recv(1 << 20))
        server_end.close()
        for fd in fds:
            os.close(fd)
        helper = request.argv
        scratch = Path(helper[helper.index("--scratch") + 1])
        time.sleep(0.2)
        try:
            (scratch / sandbox.COW_DIR).mkdir()
            (scratch / sandbox.RESULT_FILE).write_text('{"status": {"exit": 3}}')
            wrote.append(scratch)
        except FileNotFoundError:  # its own scratch, removed already
            pass

    job = threading.Thread(target=late_job)
    job.start()
    trace, cpu = traced(MLP)
    job.join()
    assert trace["iterations"] == 2 and cpu > COLD_CPU_S


def test_sigterm_stops_a_warm_job(warm_on, tmp_path):
    _, process = warm_on
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(120)\n")
    assert wait_for(lambda: not sandbox.descendants(process.pid), 10)  # the jobs before have ended
    parent = subprocess.Popen([sys.executable, "-c", f"from xmem.trace import run_trace; run_trace(['python', "
                                                     f"{str(script)!r}])"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: len(sandbox.descendants(process.pid)) >= 3, 30), "the job never started warm"
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        assert wait_for(lambda: not sandbox.descendants(process.pid), 10), "the warm job outlived its estimate"
    finally:
        stop(parent)



HUGE_PAGES_CHECK = """
import os, sys
from xmem.trace.child import warm_server
data = bytearray(os.urandom(1 << 20) * 64)  # 64 MiB of the process's own data
def huge():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
before, asked = huge(), warm_server.collapse_into_huge_pages()
if not asked:
    print("refused"); sys.exit(0)
pid = os.fork()
if pid == 0:  # a job writes to its copy: the server's stays as it was
    data[::4096] = bytes(len(data[::4096]))
    os._exit(0 if not any(data[::4096]) else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "huge", huge() - before >= 32 << 10, "intact", any(data[::4096]))
"""


def test_the_servers_memory_in_huge_pages_forks_as_before():
    """collapse_into_huge_pages (cheaper forks) keeps what a fork is: the child's writes are its own."""
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "refused":
        pytest.skip("this kernel has no MADV_COLLAPSE")
    assert done.stdout.split() == ["child", "0", "huge", "True", "intact", "True"], done.stdout


# issue 21: a warm job runs in the server's process, with no exec to shed what the sandbox's namespace gives
ESCAPES_THEN_TRAINS = """
import ctypes, os, sys, torch
home = sys.argv[1]
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
point = max((p for p in points if (home + "/").startswith(p.rstrip("/") + "/")), key=len)
if ctypes.CDLL(None, use_errno=True).umount2(point.encode(), 2) == 0:
    raise RuntimeError(f"umount2 of {point} was allowed")
with open(os.path.join(home, "escaped.txt"), "w") as out:
    out.write("escaped")
model = torch.nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
"""


def test_a_warm_job_holds_no_capability(warm_on, tmp_path):
    home = Path(tempfile.mkdtemp(prefix="xmem-home-"))  # straight under /tmp: the overlay's copy takes the write
    try:
        (tmp_path / "escape.py").write_text(ESCAPES_THEN_TRAINS)
        _, cpu = traced(["python", str(tmp_path / "escape.py"), str(home)], cwd=str(tmp_path))
        assert cpu < COLD_CPU_S, "the job was not run warm"
        assert not (home / "escaped.txt").exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)
