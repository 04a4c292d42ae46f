"""slurm/cli_filter.lua with `xmem-slurm filter` on a real Slurm 22.05 (the dev cluster, inline mode): what sbatch
hands the filter that must come out as the user wrote it or as Slurm accepts it (issue 14: W2, W3, W4, W6, and
the user's line), submitted by an ordinary user. Each case is checked against the same submission with the filter
switched off."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

TRAIN = """\
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(16, 128, device=device)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
UNFILTERED = {"XMEM_NO_FILTER": "1"}  # cli_filter.lua leaves such a submission alone


@pytest.fixture(scope="module")
def work(submitter) -> Path:
    """The submitter's own job directory."""
    d = submitter.home / "cli-filter-jobs"
    d.mkdir()
    (d / "train.py").write_text(TRAIN)
    (d / "tf.py").write_text("print('a TensorFlow job: CUDA is used, but not through torch')\n")
    (d / "loud.py").write_text("raise RuntimeError('bad value: ' + 'x' * 1_000_000)\n")
    for p in (d, *d.iterdir()):
        os.chown(p, submitter.uid, submitter.gid)
    return d


@pytest.fixture
def sbatch(cluster, submitter):
    """sbatch as the submitter, with the filter (or, filtered=False, without it)."""
    def run(path: Path, *options: str, filtered: bool = True):
        return cluster.sbatch(path, *options, env=None if filtered else UNFILTERED, user=submitter)
    return run


def script(work: Path, name: str, text: str) -> Path:
    path = work / name
    path.write_text(text)
    os.chown(path, work.stat().st_uid, work.stat().st_gid)
    return path


def components(cluster, job_id: str) -> list[dict[str, str]]:
    """`scontrol show job -o`, one record per component of a heterogeneous job."""
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return [dict(p.split("=", 1) for p in re.split(r" (?=[A-Z][A-Za-z:/]*=)", line) if "=" in p)
            for line in out.strip().splitlines()]


@pytest.mark.parametrize("form", ["directive", "command line"])
def test_a_hetjob_passes_unchanged_component_by_component(cluster, sbatch, work, form):
    if form == "directive":
        path = script(work, "het.sh", "#!/bin/bash\n#SBATCH --ntasks=1 --comment=mine\n#SBATCH hetjob\n"
                                      "#SBATCH --gres=gpu:1\nsrun --het-group=1 python train.py\n")
        options: tuple[str, ...] = ()
    else:
        path = script(work, "het-cli.sh", "#!/bin/bash\nsrun --het-group=1 python train.py\n")
        options = ("--ntasks=1", "--comment=mine", ":", "--gres=gpu:1")
    sub = sbatch(path, "--begin=now+3600", *options)
    plain = sbatch(path, "--begin=now+3600", *options, filtered=False)
    assert sub.returncode == 0 and plain.returncode == 0, sub.stderr + plain.stderr
    assert "heterogeneous job" in sub.stderr and "submitted unchanged" in sub.stderr
    fields = ("TresPerNode", "Comment", "NumTasks")
    got, want = components(cluster, sub.job_id), components(cluster, plain.job_id)
    assert len(got) == 2 and [{f: c.get(f) for f in fields} for c in got] == \
        [{f: c.get(f) for f in fields} for c in want]
    cluster.run("scancel", sub.job_id, plain.job_id)


def test_per_task_gpus_are_rewritten_to_a_type_one_node_has_enough_of(cluster, sbatch, work):
    path = script(work, "per-task.sh", "#!/bin/bash\n#SBATCH --ntasks=2 --gpus-per-task=1\npython train.py\n")
    sub = sbatch(path, "--begin=now+3600")
    assert sub.returncode == 0, sub.stderr
    info = components(cluster, sub.job_id)[0]
    assert info["TresPerTask"] in ("gres:gpu:1", "gres:gpu:a100:1")  # the node has 2 a100s, one of the others
    cluster.run("scancel", sub.job_id)


def test_gpus_through_two_options_are_kept_as_slurm_accepted_them(cluster, sbatch, work):
    path = script(work, "two-options.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1 --gpus=1\npython train.py\n")
    sub = sbatch(path, "--begin=now+3600")
    plain = sbatch(path, "--begin=now+3600", filtered=False)
    assert sub.returncode == 0 and plain.returncode == 0, sub.stderr
    assert "keeping gpu:1" in sub.stderr
    got, want = components(cluster, sub.job_id)[0], components(cluster, plain.job_id)[0]
    assert (got["TresPerNode"], got["TresPerJob"]) == (want["TresPerNode"], want["TresPerJob"])
    cluster.run("scancel", sub.job_id, plain.job_id)


def test_export_and_comment_reach_the_job_as_written(cluster, sbatch, work):
    path = script(work, "export.sh", '#!/bin/bash\n#SBATCH --gres=gpu:1\necho "MSG=[$MSG] WINPATH=[$WINPATH]"\n'
                                     "python train.py\n")
    export, comment = 'ALL,MSG="hello world",WINPATH=C:\\dir\\x', 'my "quoted" C:\\x xmem: word'
    sub = sbatch(path, f"--export={export}", f"--comment={comment}")
    plain = sbatch(path, f"--export={export}", f"--comment={comment}", filtered=False)
    assert sub.returncode == 0 and plain.returncode == 0, sub.stderr
    assert "xmem:" in cluster.job(sub.job_id)["Comment"].removeprefix(comment)
    assert cluster.job(sub.job_id)["Comment"].startswith(comment + " xmem:peak=")
    cluster.wait(sub.job_id), cluster.wait(plain.job_id)
    line = cluster.output(work, plain.job_id).splitlines()[0]
    assert cluster.output(work, sub.job_id).splitlines()[0] == line == 'MSG=["hello world"] WINPATH=[C:\\dir\\x]'


def test_a_job_that_never_uses_cuda_keeps_its_request(cluster, sbatch, work):
    sub = sbatch(script(work, "tf.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\npython tf.py\n"),
                         "--begin=now+3600")
    assert sub.returncode == 0, sub.stderr
    info = cluster.job(sub.job_id)
    assert info["TresPerNode"] == "gres:gpu:1" and "used CUDA" in sub.stderr
    assert "act=keep;why=no+command+of+the+job+used+CUDA" in info["Comment"]
    cluster.run("scancel", sub.job_id)


def test_the_users_line_is_short_and_only_for_a_job_slurm_took(cluster, sbatch, work):
    loud = script(work, "loud.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\npython loud.py\n")
    sub = sbatch(loud, "--begin=now+3600")
    assert sub.returncode == 0 and "submitted unchanged" in sub.stderr
    assert len(sub.stderr) < 1000  # the program's 1 MB message is cut
    refused = sbatch(loud, "--partition=nosuch")  # Slurm refuses the job after the filter ran
    assert refused.returncode != 0 and "xmem-slurm" not in refused.stderr, refused.stderr
    cluster.run("scancel", sub.job_id)
