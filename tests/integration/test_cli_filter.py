"""slurm/cli_filter.lua with `xmem-slurm filter` on a real Slurm 22.05 (the dev cluster, inline mode): what sbatch
hands the filter that must come out as the user wrote it or as Slurm accepts it (issue 14: W2, W3, W4, W6, and
the user's line), submitted by an ordinary user. Each case is checked against the same submission with the filter
switched off."""

from __future__ import annotations

import json
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
    assert "act=keep;why=no%20command%20of%20the%20job%20used%20CUDA" in info["Comment"]  # percent-encoded
    cluster.run("scancel", sub.job_id)


def test_the_users_line_is_short_and_only_for_a_job_slurm_took(cluster, sbatch, work):
    loud = script(work, "loud.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\npython loud.py\n")
    sub = sbatch(loud, "--begin=now+3600")
    assert sub.returncode == 0 and "submitted unchanged" in sub.stderr
    assert len(sub.stderr) < 1000  # the program's 1 MB message is cut
    refused = sbatch(loud, "--partition=nosuch")  # Slurm refuses the job after the filter ran
    assert refused.returncode != 0 and "xmem-slurm" not in refused.stderr, refused.stderr
    cluster.run("scancel", sub.job_id)


def users_processes(user) -> str:
    """The user's processes but their warm tracer servers: the filter starts one (the site's default), which lives on
    by design after the submission, bounded and listed by `xmem-slurm warm`. A job a server forked (a warm trace, the
    user's program running in it) is listed: it has the server's command line and a server for its parent."""
    import subprocess

    from xmem.trace.warm import SERVER_MAIN

    # -ww: whole command lines (ps cuts them at 80 columns into a pipe, where "slow.py" never showed)
    listed = subprocess.run(["ps", "-ww", "-u", user.name, "-o", "pid=,ppid=,args="], capture_output=True,
                            text=True).stdout
    rows = [line.split(None, 2) for line in listed.splitlines() if len(line.split(None, 2)) == 3]
    servers = {pid for pid, _, args in rows if SERVER_MAIN in args}
    return "\n".join(f"{pid} {args}" for pid, parent, args in rows if pid not in servers or parent in servers)


def test_sbatch_killed_mid_estimate_leaves_no_process_and_no_file(cluster, submitter, work):
    """kill -9 of sbatch while its filter traces: the filter sees it gone and ends with its tracer within a
    second or two; the request file is gone from the temporary directory (the reply came through a pipe)."""
    import signal
    import subprocess
    import time

    (work / "slow.py").write_text("import time\ntime.sleep(600)\n")
    path = script(work, "slow.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\npython slow.py\n")
    os.chown(work / "slow.py", submitter.uid, submitter.gid)
    mine = {"SLURM_CONF": cluster.env["SLURM_CONF"], "XMEM_CONFIG": cluster.env["XMEM_CONFIG"],
            "PATH": cluster.env["PATH"]}
    sbatch = subprocess.Popen(submitter.argv("sbatch", "--begin=now+3600", str(path)), cwd=work,
                              env=submitter.env(mine), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    def tracing() -> bool:  # the program runs: started cold (its own command line) or in a warm server's fork
        running = users_processes(submitter)
        return "slow.py" in running or "warm_server" in running

    while not tracing() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tracing(), "the filter never started tracing slow.py"
    requests = [p for p in Path("/tmp").glob("lua_*") if p.stat().st_uid == submitter.uid]
    os.kill(sbatch.pid, signal.SIGKILL)
    sbatch.wait()
    killed = time.monotonic()
    while "xmem" in users_processes(submitter) and time.monotonic() < killed + 10:
        time.sleep(0.1)
    print(f"\nfigure: the filter and its tracer ended {time.monotonic() - killed:.1f} s after kill -9 of sbatch")
    assert "xmem" not in users_processes(submitter) and "slow.py" not in users_processes(submitter)
    assert time.monotonic() - killed < 5
    assert not requests and not [p for p in Path("/tmp").glob("lua_*") if p.stat().st_uid == submitter.uid]


def test_an_edited_cache_entry_slurm_would_refuse_is_not_used(cluster, sbatch, work):
    """An entry edited to gpu:8,mps:100 (well-formed; sbatch refuses it) is a miss: estimated again, the job
    takes the policy's request. The user's own resubmission is never lost."""
    path = script(work, "tamper.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1\n# tamper\npython train.py\n")
    user = path.parent.owner()
    before = cluster.analyses(user)
    first = sbatch(path, "--begin=now+3600")
    assert first.returncode == 0, first.stderr
    want = cluster.job(first.job_id)["TresPerNode"]
    (entry,) = cluster.analyses(user) - before
    # estimated now, with stderr a pipe: no progress line (test_progress.py: on a terminal), the one line as before
    assert first.stderr.startswith("xmem-slurm: ") and "estimating" not in first.stderr and "\r" not in first.stderr
    data = json.loads(entry.read_text())
    assert data["decision"]["gres"] == want.removeprefix("gres:")
    data["decision"]["gres"] = "gpu:8,mps:100"
    entry.write_text(json.dumps(data))  # the user's own file, still theirs
    again = sbatch(path, "--begin=now+3600")
    assert again.returncode == 0, again.stderr
    assert cluster.job(again.job_id)["TresPerNode"] == want and "cached" not in again.stderr
    cluster.run("scancel", first.job_id, again.job_id)


WIDE = """\
import os
import torch
import torch.nn as nn

width = 8192 * (1 + int(os.environ["SLURM_ARRAY_TASK_ID"]))
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(2):
    loss = model(torch.randn(4, width, device="cuda")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_an_array_job_is_sized_for_its_widest_task(cluster, sbatch, work):
    """Task t's model is (t + 1) times as wide (Adam: 1 GiB for task 0, 16 GiB for task 3): the request must hold
    the last task, not only task 0's MIG slice."""
    (work / "wide.py").write_text(WIDE)
    os.chown(work / "wide.py", work.stat().st_uid, work.stat().st_gid)
    single = sbatch(script(work, "wide1.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1 --array=3\npython wide.py\n"),
                    "--begin=now+3600")
    array = sbatch(script(work, "wide.sh", "#!/bin/bash\n#SBATCH --gres=gpu:1 --array=0-3\npython wide.py\n"),
                   "--begin=now+3600")
    assert single.returncode == 0 and array.returncode == 0, single.stderr + array.stderr
    assert cluster.job(array.job_id)["TresPerNode"] == cluster.job(single.job_id)["TresPerNode"]
    assert "1g.10gb" not in cluster.job(array.job_id)["TresPerNode"]
    assert re.search(r"needs (\S+) GiB", array.stderr)[1] == re.search(r"needs (\S+) GiB", single.stderr)[1]
    cluster.run("scancel", single.job_id, array.job_id)
