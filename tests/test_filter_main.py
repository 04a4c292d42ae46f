"""The filter's entry point as cli_filter.lua runs it: JSON in, JSON out, failure modes, with the real analysis
(for jobs that need no estimate: CPU jobs and jobs with no training command)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.slurm.contract import FilterRequest
from xmem.slurm.filter import filter_main, wrapped_script

REPO = Path(__file__).resolve().parents[1]


def config(tmp_path, failure="open"):
    path = tmp_path / f"xmem-{failure}.toml"
    path.write_text(f'[policy]\nfailure = "{failure}"\n\n[partitions]\ndefault = "debug"\n\n'
                    f'[partitions.gpu_types]\ndebug = ["a100"]\n\n[estimate]\ncache_dir = "{tmp_path}/cache"\n')
    return str(path)


def run(stdin: str, config_path: str | None, *, failure_mode: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    rc = filter_main(config_path=config_path, failure_mode=failure_mode, stdin=io.StringIO(stdin), stdout=out)
    return rc, out.getvalue()


def submission(script: Path, **options) -> str:
    return json.dumps({"script": str(script), "argv": [str(script)], "options": options, "user": "ann",
                       "env": {"PATH": os.environ["PATH"]}, "cwd": str(script.parent)})


def test_cpu_job_gets_an_empty_reply(tmp_path):
    script = tmp_path / "cpu.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=4\npython train.py\n")
    rc, out = run(submission(script), config(tmp_path))
    assert rc == 0
    assert json.loads(out) == {"set": {}, "message": None, "reject": None, "fault": None, "defer": None}


def test_gpu_job_without_a_training_command_fails_open(tmp_path):
    script = tmp_path / "bin.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\n./simulate --steps 10\n")
    rc, out = run(submission(script), config(tmp_path))
    reply = json.loads(out)
    assert rc == 0 and reply["set"] == {} and reply["reject"] is None
    assert reply["message"].startswith("cannot estimate this job's GPU memory (not_understood")
    assert reply["message"].endswith("; submitted unchanged")


def test_gpu_job_without_a_training_command_is_refused_when_closed(tmp_path):
    script = tmp_path / "bin.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\n./simulate --steps 10\n")
    rc, out = run(submission(script, gres="gres:gpu:1"), config(tmp_path, "closed"))
    reply = json.loads(out)
    assert rc == 0 and reply["set"] == {}
    assert reply["reject"].endswith(f"job refused. Run `xmem-slurm check {script}` to see why.")


def test_failure_mode_is_printed_from_the_config(tmp_path, capsys):
    assert run("", config(tmp_path, "closed"), failure_mode=True) == (0, "closed\n")
    assert run("", config(tmp_path), failure_mode=True) == (0, "open\n")


def test_unreadable_config_is_a_fault_for_the_lua_side(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy]\nfailure = 'sometimes'\n")
    rc, out = run("{}", str(bad))
    reply = json.loads(out)
    assert rc == 0 and reply["fault"].startswith("site config: ") and "policy.failure" in reply["fault"]
    assert run("", str(bad), failure_mode=True)[0] == 3  # no mode to print: the Lua default applies


@pytest.mark.parametrize("stdin", ["", "not json", "[1, 2]"])
def test_garbage_input_is_a_fault(tmp_path, stdin):
    rc, out = run(stdin, config(tmp_path))
    assert rc == 0 and json.loads(out)["fault"].startswith("bad filter input")


def test_wrap_becomes_a_script_as_sbatch_builds_it():
    request = FilterRequest(script=None, options={"wrap": "python train.py --epochs 1"})
    with wrapped_script(request) as path:
        text = Path(path).read_text()
        assert text.startswith("#!/bin/sh\n") and text.endswith("\npython train.py --epochs 1\n")
    assert not os.path.exists(path)
    with wrapped_script(FilterRequest(script=None)) as nothing:
        assert nothing is None


def test_isolated_module_entry_point_runs(tmp_path):
    """cli_filter.lua runs `python -I -m xmem.slurm.filter` from the user's directory."""
    script = tmp_path / "cpu.sh"
    script.write_text("#!/bin/bash\necho hi\n")
    (tmp_path / "xmem").mkdir()  # a user's folder named like the package must not shadow it
    done = subprocess.run([sys.executable, "-I", "-m", "xmem.slurm.filter", "--config", config(tmp_path)],
                          input=submission(script), capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["set"] == {}
