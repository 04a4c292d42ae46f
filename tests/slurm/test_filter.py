"""The filter: its entry point as cli_filter.lua runs it (JSON in, JSON out, failure modes, with the real analysis
for jobs that need no estimate: CPU jobs and jobs with no training command), and the path a submission takes."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.submissions import PEAKS, decision
from xmem.slurm.contract import FilterRequest, Verdict, drop_user_settings
from xmem.slurm.filter import filter_main, run_filter, wrapped_script
from xmem.slurm.stamp import comment_fields
from xmem.text import comment_value

REPO = Path(__file__).resolve().parents[2]


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
    assert rc == 0 and "gres" not in reply["set"] and reply["reject"] is None
    assert reply["message"].startswith("cannot estimate this job's GPU memory (not_understood")
    assert reply["message"].endswith("; submitted unchanged")
    fields = comment_fields(reply["set"]["comment"])  # the job keeps why it went unchanged
    assert (fields["state"], fields["why"]) == ("failed", comment_value(reply["message"]))


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


@pytest.mark.parametrize("users", ["fifo", "/dev/zero", "closed"])
def test_the_filter_takes_the_site_config_never_the_users(tmp_path, users):
    """cli_filter.lua runs the filter in the submitting user's environment: their XMEM_CONFIG naming a FIFO or
    /dev/zero held sbatch 76-340 s, and one of their own could change the site's rules (here, the failure mode)."""
    own = tmp_path / "mine.toml"
    if users == "fifo":
        os.mkfifo(own)
    else:
        own = Path(users) if users.startswith("/") else Path(config(tmp_path, "closed"))
    env = {**os.environ, "XMEM_CONFIG": str(own), "XMEM_SANDBOX": "fallback", "XMEM_WARM_TRACER": "1"}
    for site in ([], ["--config", config(tmp_path, "open")]):  # the admin's path in cli_filter.lua, or the default
        done = subprocess.run([sys.executable, "-I", "-m", "xmem.slurm.filter", *site, "--failure-mode"], env=env,
                              capture_output=True, text=True, cwd=tmp_path, timeout=30)
        assert (done.returncode, done.stdout) == (0, "open\n"), done.stderr


def test_user_settings_are_dropped_and_the_lua_sides_kept():
    environ = {"XMEM_CONFIG": "/tmp/fifo", "XMEM_WARM_DIR": "/x", "XMEM_PROGRESS_FD": "3", "PATH": "/bin"}
    assert sorted(drop_user_settings(environ)) == ["XMEM_CONFIG", "XMEM_WARM_DIR"]
    assert environ == {"XMEM_PROGRESS_FD": "3", "PATH": "/bin"}


def test_a_hetjob_passes_unchanged_with_a_notice(tmp_path):
    from xmem.config import config_from_dict

    script = tmp_path / "het.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH hetjob\n#SBATCH --gres=gpu:1\n"
                      "srun --het-group=1 python train.py\n")
    config = config_from_dict({"estimate": {"cache_dir": str(tmp_path / "c")}})
    never = lambda *a: pytest.fail("a hetjob must not be estimated")
    for req in (FilterRequest(script=str(script), argv=(str(script),), options={"ntasks": "1"}),
                FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"},
                              hetjob=True)):
        reply = run_filter(req, config, analyzer=never)
        assert reply.set == {} and "heterogeneous job" in reply.message and "unchanged" in reply.message


def test_one_deadline_bounds_the_wait_for_a_slot_and_the_estimate(tmp_path):
    import time

    from xmem.config import config_from_dict

    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    site = config_from_dict({"estimate": {"timeout_s": 30, "cache_dir": str(tmp_path / "cache")}})
    left = []

    def analyzer(path, req, config, *, deadline, **cancel):  # cancel: run in the handoff's thread (put-off default)
        left.append(deadline - time.monotonic())
        return Verdict(decision(), PEAKS)

    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        cwd=str(tmp_path))
    reply = run_filter(req, site, analyzer=analyzer)
    assert reply.set["gres"] == "mps:a100:40" and len(left) == 1
    assert 20 < left[0] < 30  # the site's 30 s from the submission's start, less what the filter spent first
    assert site.estimate.timeout_s == 30  # the config is not rewritten to carry it


def cached_site(tmp_path):
    from xmem.config import config_from_dict

    return config_from_dict({"partitions": {"default": "debug", "from_cluster": False,
                                            "gpu_types": {"debug": ["a100", "h100"]}},
                             "mps": {"enabled": True, "gpu_types": ["a100"]}, "policy": {"preference": ["mps", "gpu"]},
                             "estimate": {"cache_dir": str(tmp_path / "cache")}})


def test_a_cached_rewrite_the_policy_would_not_make_is_a_miss(tmp_path):
    """An entry edited to gpu:8,mps:100 (well-formed, refused by sbatch) is estimated again, not used."""
    from xmem.analyze import decide_on_peaks
    from xmem.slurm.inline import parse_job

    site, script = cached_site(tmp_path), tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        cwd=str(tmp_path))
    calls = []

    def analyzer(path, r, config, *, deadline, **cancel):  # the real policy on fixed peaks
        calls.append(path)
        return Verdict(decide_on_peaks(parse_job(path, r), PEAKS, config), PEAKS)

    first = run_filter(req, site, analyzer=analyzer)
    entry = next((tmp_path / "cache").rglob("*.json"))
    data = json.loads(entry.read_text())
    assert data["decision"]["gres"] == first.set["gres"] == "mps:a100:20"
    assert run_filter(req, site, analyzer=analyzer).set["gres"] == "mps:a100:20" and len(calls) == 1  # a hit
    data["decision"]["gres"] = "gpu:8,mps:100"
    entry.write_text(json.dumps(data))
    again = run_filter(req, site, analyzer=analyzer)
    assert again.set["gres"] == "mps:a100:20" and len(calls) == 2


def test_a_rewrite_slurm_refuses_leaves_the_job_as_written(tmp_path, monkeypatch):
    """`sbatch --test-only` (here a stand-in on PATH that refuses what it is given) turns a rewrite into the job as
    the user wrote it, with Slurm's reason; an sbatch that cannot reach the controller refuses nothing."""
    site, script = cached_site(tmp_path), tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1 -p debug\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={}, user="ann", cwd=str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text('#!/bin/sh\necho "$@ $XMEM_NO_FILTER" > "$0.args"\necho "allocation failure: Requested node '
                    'configuration is not available" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SBATCH_GPUS", "1")
    reply = run_filter(req, site, analyzer=lambda *a, **k: Verdict(decision(), PEAKS))
    assert set(reply.set) == {"comment", "export"}  # no GPU option: the request as written, and why
    assert "Requested node configuration is not available" in reply.message
    assert comment_fields(reply.set["comment"])["why"] == comment_value(reply.message)
    assert reply.message.endswith("submitted as written") and "--gres=mps:a100:40" in reply.message
    assert (bin_dir / "sbatch.args").read_text() == "--test-only --partition=debug --gres=mps:a100:40 --wrap=true 1\n"
    fake.write_text('#!/bin/sh\necho "sbatch: error: Unable to contact slurm controller (connect failure)" >&2\n'
                    'exit 1\n')
    assert run_filter(req, site, analyzer=lambda *a, **k: Verdict(decision(), PEAKS)).set["gres"] == "mps:a100:40"


def test_the_request_file_is_gone_once_read_and_the_filter_ends_with_its_sbatch(tmp_path):
    """kill -9 of sbatch: the filter it started sees it gone (a pid watched by start time) and ends, SIGTERM
    first; the request file was deleted as soon as it was read (the integration test does it through sbatch)."""
    import signal
    import time

    from xmem.slurm.filter import take_request

    request = tmp_path / "lua_req"
    request.write_text('{"script": null}')
    assert take_request(str(request)).read() == '{"script": null}' and not request.exists()
    assert take_request(str(request)).read() == ""  # gone: no request, a fault for the Lua side

    sbatch = subprocess.Popen(["sleep", "60"])
    filt = subprocess.Popen([sys.executable, "-c", "import time; from xmem.slurm.filter import watch_caller; "
                             f"watch_caller({sbatch.pid}, interval_s=0.05); time.sleep(60)"], cwd=REPO)
    time.sleep(1.0)
    assert filt.poll() is None  # the sbatch is alive: the filter works on
    sbatch.kill()
    sbatch.wait()
    killed = time.monotonic()
    assert filt.wait(timeout=10) == -signal.SIGTERM and time.monotonic() - killed < 2
