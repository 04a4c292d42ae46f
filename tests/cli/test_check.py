"""`xmem-slurm check`: run as a user would (the installed console script), with the real estimator."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO / "etc" / "xmem.toml"
XMEM_SLURM = Path(sys.executable).parent / "xmem-slurm"

TRAIN = """\
import sys
import torch

hidden = int(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    loss = model(torch.randn(64, hidden, device="cuda")).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def check(*args: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess:
    command = [str(XMEM_SLURM), "check", *args] if XMEM_SLURM.exists() else \
        [sys.executable, "-m", "xmem.cli", "check", *args]
    # a stale $PWD must not matter: the job starts where check runs, as in sbatch
    env = {**os.environ, "PWD": "/", **env_vars}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


@pytest.mark.slow
def test_json_on_a_real_training_script(workdir):
    pytest.importorskip("xmem.estimate", reason="the estimator (xmem.estimate) has not landed")
    (workdir / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1   # any GPU\n#SBATCH -p debug\n"
                                    f"cd {workdir}\npython train.py \"$1\"\n")
    done = check(str(workdir / "job.sh"), "1024", "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["job"]["commands"][0]["argv"] == ["python", "train.py", "1024"]
    assert data["job"]["commands"][0]["cwd"] == str(workdir)
    assert data["gpu_types"] == ["a100", "h100", "1g.10gb"]
    # Parameters: 1024*1024 + 1024 + 10*1024 + 10 = 1,059,850 fp32 = 4,239,400 B; with gradients and Adam's two
    # states, 4 x that = 16,957,600 B live at once. Context and workspace add a few hundred MiB: far under 2 GiB.
    peaks = data["peaks"]
    assert set(peaks) == {"a100", "h100", "1g.10gb"}
    assert all(4 * 4 * 1_059_850 < peak < 2 * 2**30 for peak in peaks.values())
    assert peaks["1g.10gb"] == peaks["h100"]
    decision = data["decision"]
    assert (decision["action"], decision["gres"]) == ("rewrite", "gpu:1g.10gb:1")
    assert decision["reason"].endswith("MIG 1g.10gb (9.75 GiB) is the smallest fit")
    assert data["exit_code"] == 0


@pytest.mark.slow
def test_human_output_shows_job_estimate_and_decision(workdir):
    pytest.importorskip("xmem.estimate", reason="the estimator (xmem.estimate) has not landed")
    (workdir / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\ncd {workdir}\npython train.py 512\n")
    done = check(str(workdir / "job.sh"), "--config", str(EXAMPLE_CONFIG), cwd=workdir, COLUMNS="200")
    assert done.returncode == 0, done.stderr
    for text in ("--gres", "python train.py 512", "Predicted peak GPU memory", "at the peak on", "optimizer state",
                 "Every way the site offers", "picked:", "Decision:"):
        assert text in done.stdout


def test_script_not_understood_exits_8_with_the_line(workdir):
    # sbatch refuses a script without #!: the static read's problems stand, nothing is run
    (workdir / "job.sh").write_text("#SBATCH --gres=gpu:1\n\nfor s in 1 2; do python train.py 8; done\n")
    done = check(str(workdir / "job.sh"), "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir)
    assert done.returncode == 8
    data = json.loads(done.stdout)
    assert data["job"]["problems"][0]["line_no"] == 3
    assert data["errors"][0]["kind"] == "not_understood"


def test_job_without_gpu_exits_0_with_decision_none(workdir):
    (workdir / "job.sh").write_text("#!/bin/bash\n#SBATCH -p debug\npython train.py 8\n")
    done = check(str(workdir / "job.sh"), "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir)
    assert done.returncode == 0
    data = json.loads(done.stdout)
    assert data["decision"]["action"] == "none"
    assert data["job"]["commands"][0]["cwd"] == str(workdir)


def test_bad_config_exits_2_naming_the_key(workdir):
    (workdir / "bad.toml").write_text("[mps]\ncount = 3\n")
    (workdir / "job.sh").write_text("#!/bin/bash\npython train.py 8\n")
    done = check(str(workdir / "job.sh"), "--config", str(workdir / "bad.toml"), cwd=workdir)
    assert done.returncode == 2
    assert "unknown key 'mps.count'" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("xmem-slurm check: ")


def test_json_error_has_the_same_shape_as_estimates(workdir):
    """`check --json` and `estimate --json` answer a usage error with the same object (one shape for scripts)."""
    (workdir / "bad.toml").write_text("[mps]\ncount = 3\n")
    (workdir / "job.sh").write_text("#!/bin/bash\npython train.py 8\n")
    checked = check(str(workdir / "job.sh"), "--json", "--config", str(workdir / "bad.toml"), cwd=workdir)
    estimated = subprocess.run([sys.executable, "-m", "xmem.cli", "estimate", "--json", "--config",
                                str(workdir / "bad.toml"), "--", sys.executable, "train.py"],
                               cwd=workdir, capture_output=True, text=True, timeout=120)
    assert checked.returncode == estimated.returncode == 2
    from_check, from_estimate = json.loads(checked.stdout), json.loads(estimated.stdout)
    assert from_check.keys() == from_estimate.keys() >= {"error", "message", "exit_code"}
    assert from_check["error"] == from_estimate["error"] == "bad_option"
    assert from_check["exit_code"] == from_estimate["exit_code"] == 2
    assert "mps.count" in from_check["message"] and "mps.count" in from_estimate["message"]


def test_missing_script_exits_2(workdir):
    done = check(str(workdir / "absent.sh"), "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir)
    assert done.returncode == 2
    assert json.loads(done.stdout)["errors"][0]["kind"] == "bad_input"


@pytest.mark.slow
def test_user_error_in_the_training_script_exits_5(workdir):
    pytest.importorskip("xmem.estimate", reason="the estimator (xmem.estimate) has not landed")
    (workdir / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\ncd {workdir}\npython train.py oops\n")
    done = check(str(workdir / "job.sh"), "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir)
    assert done.returncode == 5, done.stderr
    error = json.loads(done.stdout)["errors"][0]
    assert error["kind"] == "user_error" and error["line_no"] == 4


def test_partition_unknown_to_config_and_cluster_exits_2(workdir):
    (workdir / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py 8\n")
    done = check(str(workdir / "job.sh"), "-p", "nowhere", "--json", "--config", str(EXAMPLE_CONFIG), cwd=workdir,
                 SLURM_CONF=str(workdir / "no-slurm.conf"))  # no cluster to ask either
    assert done.returncode == 2
    data = json.loads(done.stdout)
    assert data["partitions"] == ["nowhere"] and data["errors"][0]["kind"] == "no_gpu_types"


def test_human_output_shows_script_text_literally(workdir):
    (workdir / "job.sh").write_text("#SBATCH --gres=gpu:1\n\n"
                                    "for s in 1 2; do python train.py [red]x; done\n")
    done = check(str(workdir / "job.sh"), "--config", str(EXAMPLE_CONFIG), cwd=workdir, COLUMNS="200")
    assert done.returncode == 8
    assert "[for s in 1 2; do python train.py [red]x; done]" in done.stdout  # not taken as Rich markup
    assert done.stderr.strip().endswith("not understood: 2 problem(s) listed above")  # the loop; sbatch's refusal


def test_wrap_is_checked_like_sbatch_wraps_it(workdir):
    done = check("--wrap", "python train.py 8", "-p", "debug", "--json", "--config", str(EXAMPLE_CONFIG),
                 cwd=workdir)
    assert done.returncode == 0  # no GPU asked: nothing to estimate
    data = json.loads(done.stdout)
    assert data["job"]["commands"][0]["argv"] == ["python", "train.py", "8"]
    assert data["job"]["problems"] == [] and data["decision"]["action"] == "none"


def test_gres_and_gpus_options_override_the_script(workdir):
    (workdir / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\nfor i in 1; do python t.py; done\n")
    done = check(str(workdir / "job.sh"), "--gres", "gpu:a100:1", "-G", "h100:1", "--json", "--config",
                 str(EXAMPLE_CONFIG), cwd=workdir)
    request = json.loads(done.stdout)["job"]["directives"]
    assert (request["gres"], request["gpus"]) == (["gpu:a100:1"], "h100:1")
    assert [r[2] for r in request["raw"]] == [2, 0, 0]  # the script's line, then the command line


def test_script_and_wrap_together_is_a_usage_error(workdir):
    done = check("job.sh", "--wrap", "true", cwd=workdir)
    assert done.returncode == 2 and "one of them" in done.stderr


def test_a_hetjob_is_named_as_one_sbatch_leaves_unchanged(workdir):
    (workdir / "het.sh").write_text("#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH hetjob\n#SBATCH --gres=gpu:1\n"
                                    "srun --het-group=1 python train.py 64\n")
    done = check(str(workdir / "het.sh"), "--config", str(EXAMPLE_CONFIG), cwd=workdir, COLUMNS="200")
    assert done.returncode == 0, done.stderr
    assert "heterogeneous job (#SBATCH hetjob, line 3): sbatch through xmem leaves it unchanged" in done.stdout


@pytest.mark.slow
def test_the_type_picked_is_the_one_shown_marked_and_drawn(workdir):
    """One GPU type shown (issue 23): the example site picks a MIG slice of an H100; the table marks the slice,
    the breakdown is the H100's (the slice's parent, as the slice is estimated) and --plot draws the H100 with the
    slice as its level."""
    (workdir / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py 1024\n")
    done = check("job.sh", "--config", str(EXAMPLE_CONFIG), "--plot", "job.png", cwd=workdir, COLUMNS="160")
    assert done.returncode == 0, done.stderr
    assert "Decision: request --gres=gpu:1g.10gb:1" in done.stdout
    marked = [line.split("│")[1].strip() for line in done.stdout.splitlines() if line.startswith("│")
              and line.split("│")[1].strip().endswith("*")]
    assert marked == ["1g.10gb *"]
    assert "line 3, at the peak on H100-SXM5-80GB: " in done.stdout
    assert "wrote job.png (memory over the run on H100-SXM5-80GB)" in done.stderr


PER_SAMPLE = """\
import sys
import torch

batch = torch.empty(int(sys.argv[2]) * 2**30, dtype=torch.uint8, device="cuda")  # a GiB per sample
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_job_that_fits_no_offer_exits_14_with_its_largest_batch(workdir):
    """Issue 32: 'no request fits' with no next step, exit 0; now exit 14 and the batch size that fits the largest
    offer (an 80 GB H100), with the command that shows more."""
    (workdir / "per_sample.py").write_text(PER_SAMPLE)
    (workdir / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH -p debug\ncd {workdir}\n"
                                    "python per_sample.py --batch-size 100\n")
    done = check(str(workdir / "job.sh"), "--json", "--config", str(EXAMPLE_CONFIG), "-n", "1", cwd=workdir,
                 XMEM_WARM_TRACER="1")
    assert done.returncode == 14, done.stderr
    data = json.loads(done.stdout)
    assert data["exit_code"] == 14 and data["decision"]["action"] == "no_fit"
    # 64 GiB and the context fit 79.65 GiB with the 10 % margin, 72 do not (answers in eights above 64)
    assert data["decision"]["reason"].endswith(
        f"; the largest --batch-size that fits is 64; to see more: xmem-slurm check --vary batch-size=1..100 "
        f"{workdir / 'job.sh'}")
