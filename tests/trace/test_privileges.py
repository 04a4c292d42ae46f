"""S2 (issue 14): the filter never runs a user's program as root.

Root submitting `sbatch --uid=alice job.sh` (or an admin submitting a user's script) runs the filter as uid 0;
the job's request is then kept as written, with a one-line notice, and the program is not started. Jobs that need
no trace are answered as before; root's own job (only root can write its files) is estimated as before. The
non-root side is the dev cluster's: tests/integration/test_multiuser.py submits as a throw-away user.
"""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.throwaway_users import SYSTEM_PYTHON, scratch, users_fixture  # noqa: F401 (scratch is a fixture)
from xmem.slurm import inline
from xmem.slurm.filter import filter_main
from xmem.trace import privileges

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pins what happens when root submits")

TRAIN = """\
import torch
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); model(torch.randn(8, 64, device="cuda")).sum().backward(); opt.step()
"""


users = users_fixture("owner")


def filter_reply(tmp_path, directives: str, owner=None, **options) -> dict:
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{directives}\npython train.py\n")
    if owner is not None:  # an admin submitting a user's files
        for path in (tmp_path, script, tmp_path / "train.py"):
            os.chown(path, owner.uid, owner.gid)
    config = tmp_path / "xmem.toml"
    config.write_text('[partitions]\ndefault = "debug"\n\n[partitions.gpu_types]\ndebug = ["a100"]\n\n'
                      f'[estimate]\ncache_dir = "{tmp_path}/cache"\n')
    request = {"script": str(script), "argv": [str(script)], "options": options, "user": "root",
               "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path)}
    out = io.StringIO()
    assert filter_main(config_path=str(config), stdin=io.StringIO(json.dumps(request)), stdout=out) == 0
    return json.loads(out.getvalue())


def test_root_submitting_for_a_user_keeps_the_request_and_runs_nothing(tmp_path):
    started = time.monotonic()
    reply = filter_reply(tmp_path, "#SBATCH --gres=gpu:1", gres="gres:gpu:1", uid="alice")
    assert time.monotonic() - started < 5  # no trace: a trace of this job takes several seconds
    assert "gres" not in reply["set"] and "gpus" not in reply["set"]
    assert reply["reject"] is None and reply["fault"] is None
    assert "for alice" in reply["message"] and "never runs a user's program as root" in reply["message"]
    assert "keeping gpu:1" in reply["message"]


def test_root_submitting_a_users_script_keeps_the_request(scratch, users):
    reply = filter_reply(scratch, "#SBATCH --gpus=1", owner=users[0], gpus="1")
    assert "gpus" not in reply["set"] and f"for {users[0].name}" in reply["message"]


def test_root_submitting_a_cpu_job_gets_the_usual_empty_reply(tmp_path):
    assert filter_reply(tmp_path, "#SBATCH --ntasks=1") == {"set": {}, "message": None, "reject": None,
                                                            "fault": None, "defer": None}


def test_as_root_the_estimator_refuses_before_anything_starts(tmp_path):
    refuse = inline.guarded_estimator({"uid": "alice"}, str(tmp_path / "job.sh"))
    with pytest.raises(privileges.RootTraceRefused, match="for alice"):
        refuse(["python", "train.py"], gpus=["a100"], cwd=str(tmp_path))
    assert inline.kept_decision([]) is None  # nothing refused: the analysis' own answer stands


# --- issue 21: `check` / `estimate` run by root on a user's files -----------------------------------------------------

MARKS_ITS_UID = "import os, sys\nopen(sys.argv[1], 'w').write(str(os.getuid()))\n"


def test_root_checking_a_users_script_runs_it_as_them_or_refuses(scratch, users):
    """The CLI reruns itself as the script's owner; here xmem's interpreter lives under /root (0700), so it cannot
    run as them: it refuses, naming them, and their program never runs (as root or anyone)."""
    (owner,) = users
    marker = scratch / "ran-as.txt"
    (scratch / "train.py").write_text(MARKS_ITS_UID)
    (scratch / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py {marker}\n")
    for path in (scratch, scratch / "train.py", scratch / "job.sh"):
        os.chown(path, owner.uid, owner.gid)
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "check", "--json", "job.sh"], cwd=scratch,
                          capture_output=True, text=True, timeout=300)
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    if owner.run(sys.executable, "-c", "import xmem", check=False).returncode != 0:  # xmem not runnable by them
        assert done.returncode == privileges.REFUSED_EXIT and reply["error"] == "not_as_root", done.stdout
        assert owner.name in reply["message"] and "never runs a user's program as root" in reply["message"]
    assert not marker.exists() or marker.read_text() == str(owner.uid)


def test_rerun_as_drops_to_the_user_with_their_groups_and_a_clean_environment(users, monkeypatch):
    (owner,) = users
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/hook.so")
    code = ("import os, json; print(json.dumps([os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), "
            "dict(os.environ)]))")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rerun writes to stdout: capture it through a pipe in a child of ours
        os.dup2(write, 1)
        os._exit(privileges.rerun_as(owner.name, [SYSTEM_PYTHON, "-c", code], lambda why: None))
    os.close(write)
    with os.fdopen(read) as out:
        uid, euid, gid, groups, env = json.loads(out.read())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (uid, euid, gid) == (owner.uid, owner.uid, owner.gid) and 0 not in groups
    assert env["HOME"] == str(owner.home) and env["USER"] == owner.name and "LD_PRELOAD" not in env


def test_rerun_as_refuses_where_there_is_no_one_to_run_it_as():
    said = []
    assert privileges.rerun_as("other users", ["/bin/true"], said.append) == privileges.REFUSED_EXIT
    assert "never runs a user's program as root" in said[0]


def test_as_root_no_trace_starts_another_users_program(scratch, users):
    """The guard where every trace starts (fit, check's commands, the library): a refusal, nothing run."""
    from xmem.trace import run_trace
    (owner,) = users
    marker = scratch / "ran.txt"
    (scratch / "train.py").write_text(MARKS_ITS_UID)
    os.chown(scratch / "train.py", owner.uid, owner.gid)
    with pytest.raises(privileges.RootTraceRefused, match=owner.name):
        run_trace(["python", str(scratch / "train.py"), str(marker)])
    assert not marker.exists()


# --- issue 35 (R2): every way code can be named, as root -------------------------------------------------------------

def test_as_root_a_trace_refuses_an_interpreter_or_module_path_another_user_can_change(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's folder: what they put there would run as root
    (theirs / "python3").symlink_to(sys.executable)
    with pytest.raises(privileges.RootTraceRefused, match="the interpreter"):
        privileges.refuse_foreign_code(str(theirs / "python3"), {})
    with pytest.raises(privileges.RootTraceRefused, match="PYTHONPATH entry"):
        privileges.refuse_foreign_code(sys.executable, {"PYTHONPATH": f"/usr/lib:{theirs}"})
    with pytest.raises(privileges.RootTraceRefused, match="PYTHONPATH entry"):
        privileges.refuse_foreign_code(sys.executable, {"PYTHONPATH": str(theirs / "pkg")})  # not yet made: theirs
    privileges.refuse_foreign_code(sys.executable, {"PYTHONPATH": "/usr/lib"})  # root's alone: traced as before


def test_a_root_owned_file_in_a_sticky_directory_is_roots_alone(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    sticky.chmod(0o1777)
    mine = sticky / "mod.py"
    mine.write_text("")
    assert privileges.writer_besides_root(str(mine)) is None
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)  # anyone may replace what is in it
    assert privileges.writer_besides_root(str(loose / "mod.py")) == "other users"


def test_a_root_owned_link_is_roots_alone_whatever_its_mode(tmp_path):
    """A link's mode is always 777 and means nothing: only its folder decides who can change it (a venv reached
    through a link root made, as .venv -> /opt/envs/x, is root's)."""
    (tmp_path / "env").symlink_to(Path(sys.executable).parent)
    assert privileges.writer_besides_root(str(tmp_path / "env" / Path(sys.executable).name)) is None


# --- issue 35 (R1): root's traces run as an unprivileged identity -----------------------------------------------------

def test_the_trace_identity_is_the_sites_choice_and_never_root(monkeypatch):
    from xmem.trace import sandbox
    assert sandbox.trace_identity({}).name == "nobody" and sandbox.trace_identity({}).uid != 0
    assert sandbox.trace_identity({sandbox.TRACE_USER_ENV: "daemon"}).name == "daemon"
    assert sandbox.trace_identity({sandbox.TRACE_USER_ENV: "1"}).name == "daemon"  # by uid too
    for wrong, said in (("root", "never run as uid or gid 0"), ("0", "never run as uid or gid 0"),
                        ("xmem-no-such-user", "no such user")):
        with pytest.raises(sandbox.SandboxError, match=said):
            sandbox.trace_identity({sandbox.TRACE_USER_ENV: wrong})
    monkeypatch.setenv(sandbox.TRACE_USER_ENV, "daemon")  # root's own environment names it for the helper
    command = sandbox.helper_command(sys.executable, Path("/tmp"), 0, 0, [])
    assert command[command.index("--run-as") + 1] == "1:1:daemon"


def test_what_the_identity_can_read_is_asked_of_the_kernel_as_it():
    """`first_unreadable` takes the identity's ids in a child and asks: root's 600 file is named, a 644 file is
    not; nothing changes for root itself."""
    from tests.throwaway_users import visible_dir
    from xmem.trace import sandbox
    identity = sandbox.trace_identity({})
    with visible_dir() as folder:
        shared = folder / "shared.py"
        shared.write_text("")
        shared.chmod(0o644)
        private = folder / "private.py"
        private.write_text("")
        private.chmod(0o600)
        assert sandbox.first_unreadable([(str(shared), os.R_OK)], identity) is None
        assert sandbox.first_unreadable([(str(shared), os.R_OK), (str(private), os.R_OK)], identity) == str(private)
        assert os.geteuid() == 0 and os.access(private, os.R_OK)
