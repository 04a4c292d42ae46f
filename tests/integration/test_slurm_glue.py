"""xmem-slurm on a real Slurm 22.05 (the dev cluster): sbatch through cli_filter.lua and `xmem-slurm filter`,
the TaskProlog's exports, the Epilog's record, fail-open and fail-closed, CPU jobs left alone, the cache.

Expected requests are computed here from the estimate (the filter's cached analysis) and the site policy, never
written as constants.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from xmem.config import load_site_config
from xmem.gpus import find_gpu, load_catalog
from xmem.jobscript import parse_jobscript
from xmem.policy import decide
from xmem.slurm.stamp import JobStamp
from xmem.slurm.store import read_records

pytestmark = pytest.mark.slurm

MIB = 1 << 20
MEASURED = 654_321_000  # what the test jobs report as their measured peak (no GPU here to measure)

TRAIN = """\
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(device)
opt = torch.optim.Adam(model.parameters())
for step in range(5):
    x = torch.randn(64, 512, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained on", device)
"""

# The job shows what the TaskProlog exported, trains, and leaves its "measured" peak where the Epilog looks.
JOB_BODY = """\
env | grep -E '^(XMEM_|CUDA_)' | sort
python train.py
[ -n "$XMEM_MEASURE_FILE" ] && echo '{"peak_bytes": %d}' > "$XMEM_MEASURE_FILE"
""" % MEASURED


@pytest.fixture(scope="module")
def work(job_dir) -> Path:
    return job_dir("jobs", TRAIN)


def script(work: Path, name: str, directives: str, body: str = JOB_BODY) -> Path:
    path = work / name
    path.write_text(f"#!/bin/bash\n{directives}\n{body}")
    return path


def new_analyses(cluster, before: set[Path], stderr: str = "") -> dict:
    """The analysis the filter cached for the submission just made (one new cache entry)."""
    entries = cluster.analyses() - before
    assert len(entries) == 1, f"no new analysis; sbatch said: {stderr}"
    return json.loads(entries.pop().read_text())


def expected_decision(cluster, job_script: Path, peaks: dict, cli_options: dict | None = None):
    config = load_site_config(cluster.config)
    job = parse_jobscript(job_script.read_text(), path=str(job_script), cli_options=cli_options,
                          env=cluster.env)
    return decide(peaks, job.directives, config, user="root")


def xmem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("xmem-slurm:")]


@pytest.fixture(scope="module")
def generic(cluster, work):
    """A generic `--gres=gpu:1` job with a real (small) training script: submitted once, waited for."""
    path = script(work, "generic.sh", "#SBATCH --gres=gpu:1")
    before = cluster.analyses()
    sub = cluster.sbatch(path)
    assert sub.returncode == 0 and xmem_lines(sub.stderr), sub.stderr
    analysis = new_analyses(cluster, before, sub.stderr)
    print(f"\nfigure: sbatch with a fresh estimate took {sub.seconds:.2f} s")
    return path, sub, analysis, cluster.wait(sub.job_id, timeout=300)


def test_generic_gpu_job_is_rewritten_to_the_policys_request(cluster, generic):
    path, sub, analysis, info = generic
    expected = expected_decision(cluster, path, analysis["peaks"])
    assert expected.action == "rewrite" and expected.gres
    assert info["TresPerNode"] == f"gres:{expected.gres}"
    (line,) = xmem_lines(sub.stderr)
    assert line.endswith(f"-> --gres={expected.gres}")
    stamp = JobStamp.from_comment(info["Comment"])
    assert (stamp.peak_bytes, stamp.needed_bytes, stamp.gpu_type, stamp.request, stamp.action) == (
        expected.peak_bytes, expected.needed_bytes, expected.gpu_type, expected.gres, "rewrite")
    assert info["JobState"] == "COMPLETED"


def test_job_environment_holds_the_prologs_exports(cluster, work, generic):
    _, sub, _, info = generic
    out = cluster.output(work, sub.job_id)
    stamp = JobStamp.from_comment(info["Comment"])
    for name, value in stamp.env().items():
        assert f"{name}={value}\n" in out
    # made by the root Prolog in the job user's own directory (root's job here)
    assert f"XMEM_MEASURE_FILE={cluster.lab}/measure/{os.getuid()}/xmem-measure-{sub.job_id}.json\n" in out
    assert "trained on cpu" in out


def test_epilog_record_appears_and_report_summarises_it(cluster, generic):
    _, sub, _, info = generic
    stamp = JobStamp.from_comment(info["Comment"])
    records = {r.job_id: r for r in read_records(cluster.store)}
    record = records[sub.job_id]
    assert (record.gpu_type, record.gres, record.estimate_bytes, record.needed_bytes, record.exit_code) == (
        stamp.gpu_type, stamp.request, stamp.peak_bytes, stamp.needed_bytes, 0)
    assert (record.measured_bytes, record.measured_by) == (MEASURED, "file")
    report = cluster.run("xmem-slurm", "report", "--store", str(cluster.store), "--json")
    assert report.returncode == 0, report.stderr
    summary = {s["gpu_type"]: s for s in json.loads(report.stdout)["gpu_types"]}[stamp.gpu_type]
    mine = [r for r in records.values() if r.gpu_type == stamp.gpu_type and r.measured_bytes]
    errors = sorted(abs(r.estimate_bytes - r.measured_bytes) / r.measured_bytes for r in mine)
    middle = len(errors) // 2
    median = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    assert summary["measured"] == len(mine)
    assert summary["median_abs_rel_error"] == pytest.approx(median)


def status_of(cluster, job_id: str) -> dict:
    done = cluster.run("xmem-slurm", "status", job_id, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def as_printed(line: str) -> str:
    """The user's line at sbatch, without the filter's prefix: what status and the job's XMEM_WHY must show."""
    return line.removeprefix("xmem-slurm: ")


def test_status_and_the_job_have_the_users_line_and_the_request_before(cluster, work, generic):
    _, sub, _, info = generic
    (line,) = xmem_lines(sub.stderr)
    status = status_of(cluster, sub.job_id)
    assert (status["estimate"], status["why"], status["request_before"]) == ("done", as_printed(line), "gpu:1")
    assert status["request_now"] == f"TresPerNode={info['TresPerNode']}"
    assert f"XMEM_WHY={as_printed(line)}\n" in cluster.output(work, sub.job_id)  # decoded by the TaskProlog


def test_resubmission_hits_the_cache(cluster, generic):
    path, first, _, first_info = generic
    before = cluster.analyses()
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    assert cluster.analyses() == before  # nothing new estimated
    (line,) = xmem_lines(sub.stderr)
    assert line.endswith("(cached estimate)")
    assert cluster.job(sub.job_id)["TresPerNode"] == first_info["TresPerNode"]  # set at submission
    print(f"\nfigure: sbatch with a cached estimate took {sub.seconds:.2f} s")


def test_explicit_request_is_kept_per_policy(cluster, work, generic):
    _, _, analysis, _ = generic
    path = script(work, "explicit.sh", "#SBATCH --gres=gpu:h100:1")
    expected = expected_decision(cluster, path, analysis["peaks"])  # same train.py, same peaks
    assert expected.action == "keep"  # etc/xmem.toml: explicit_request = "fill_generic"
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    info = cluster.job(sub.job_id)  # the request is settled at submission: no need to wait for the job
    assert info["TresPerNode"] == "gres:gpu:h100:1"
    stamp = JobStamp.from_comment(info["Comment"])
    assert (stamp.action, stamp.gpu_type, stamp.request) == ("keep", "h100", "gpu:h100:1")
    assert "keeping gpu:h100:1" in xmem_lines(sub.stderr)[0]


def test_generic_gpus_request_is_rewritten_in_the_same_form(cluster, work):
    path = script(work, "gpus.sh", "#SBATCH --gpus=1")
    before = cluster.analyses()
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    expected = expected_decision(cluster, path, new_analyses(cluster, before, sub.stderr)["peaks"])
    assert (expected.action, expected.option) == ("rewrite", "gpus")
    info = cluster.job(sub.job_id)  # settled at submission
    assert info["TresPerJob"] == f"gres:gpu:{expected.gpus}"
    assert info.get("TresPerNode", "(null)") == "(null)"  # not doubled by a gres request


def test_wrapped_command_is_estimated_like_a_script(cluster, work):
    before = cluster.analyses()
    started = cluster.run("sbatch", "--parsable", "-o", str(work / "out-%j.txt"), "--gres=gpu:1",
                          "--wrap", "python train.py --wrapped", cwd=work, timeout=400)
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip().split(";")[0]
    wrapped = work / "wrapped.sh"
    wrapped.write_text("#!/bin/sh\n#SBATCH --gres=gpu:1\npython train.py --wrapped\n")
    expected = expected_decision(cluster, wrapped, new_analyses(cluster, before, started.stderr)["peaks"])
    assert cluster.job(job_id)["TresPerNode"] == f"gres:{expected.gres}"


@pytest.mark.parametrize("export", ["ALL", "NONE"])
def test_mps_job_gets_its_pinned_memory_limit(cluster, work, export):
    path = script(work, "mps.sh", "#SBATCH --gres=mps:40")
    sub = cluster.sbatch(path, f"--export={export}")
    assert sub.returncode == 0, sub.stderr
    info = cluster.wait(sub.job_id)
    assert info["TresPerNode"] == "gres:mps:40"
    stamp = JobStamp.from_comment(info["Comment"])
    share = find_gpu("a100", load_catalog(load_site_config(cluster.config).catalog_overrides or None)).total_bytes
    limit_mib = math.ceil(min(stamp.needed_bytes, share * 40 // 100) / MIB)
    out = cluster.output(work, sub.job_id)
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={limit_mib}M\n" in out
    # With --export=NONE the filter adds no variables: the TaskProlog read the job's comment instead.
    assert f"XMEM_PEAK_BYTES={stamp.peak_bytes}\n" in out


def test_job_the_estimator_cannot_handle_runs_unchanged(cluster, work):
    path = script(work, "broken.sh", "#SBATCH --gres=gpu:1", 'echo "XMEM_WHY=$XMEM_WHY"\npython broken.py\n')
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    (line,) = xmem_lines(sub.stderr)
    assert re.fullmatch(r"xmem-slurm: cannot estimate this job's GPU memory \(.+\); submitted unchanged", line)
    assert "RuntimeError" in line or "needs /data/imagenet" in line
    info = cluster.wait(sub.job_id)
    assert info["TresPerNode"] == "gres:gpu:1"
    assert JobStamp.from_comment(info["Comment"]).is_empty()  # no estimate: nothing for the node to enforce
    assert info["JobState"] == "FAILED"  # it ran, and failed as the user's script does
    # why it went unchanged stays with the job: `status`, and the job's own environment
    status = status_of(cluster, sub.job_id)
    assert (status["estimate"], status["why"], status["request_before"]) == ("failed", as_printed(line), "gpu:1")
    assert f"XMEM_WHY={as_printed(line)}\n" in cluster.output(work, sub.job_id)  # its apostrophe and ; too


def test_non_python_gpu_job_runs_unchanged(cluster, work):
    path = script(work, "binary.sh", "#SBATCH --gres=gpu:1", "echo simulated CUDA binary\n")
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    (line,) = xmem_lines(sub.stderr)
    assert line.endswith("; submitted unchanged")
    info = cluster.wait(sub.job_id)
    assert (info["TresPerNode"], info["JobState"]) == ("gres:gpu:1", "COMPLETED")
    assert "simulated CUDA binary" in cluster.output(work, sub.job_id)


def test_job_the_estimator_cannot_handle_is_refused_when_fail_closed(cluster, work):
    closed = re.sub(r'(?m)^failure = "open"', 'failure = "closed"', cluster.config.read_text())
    assert 'failure = "closed"' in closed
    path = script(work, "broken.sh", "#SBATCH --gres=gpu:1", "python broken.py\n")
    known = cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split()  # finished jobs stay listed
    with cluster.site_config_text(closed):
        sub = cluster.sbatch(path)
    assert sub.returncode != 0 and sub.job_id is None
    (line,) = xmem_lines(sub.stderr)
    assert "cannot estimate this job's GPU memory" in line
    assert f"This site requires an estimate: job refused. Run `xmem-slurm check {path}` to see why." in line
    assert set(cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split()) == set(known)


@pytest.mark.parametrize("own", ["fifo", "/dev/zero", "closed"])
def test_a_users_own_xmem_config_neither_holds_nor_changes_the_filter(cluster, work, tmp_path, own):
    """The filter ran with the submitting user's XMEM_CONFIG: a FIFO or /dev/zero held sbatch 76-340 s, and a
    fail-closed config of their own refused what the site lets through."""
    mine = tmp_path / "mine.toml"
    if own == "fifo":
        os.mkfifo(mine)
    elif own == "closed":
        mine.write_text(re.sub(r'(?m)^failure = "open"', 'failure = "closed"', cluster.config.read_text()))
    else:
        mine = Path(own)
    path = script(work, f"own-config-{own.strip('/').replace('/', '-')}.sh", "#SBATCH --gres=gpu:1",
                  "python broken.py\n")
    sub = cluster.sbatch(path, env={"XMEM_CONFIG": str(mine)})
    assert sub.returncode == 0, sub.stderr  # the site fails open
    (line,) = xmem_lines(sub.stderr)
    assert "cannot estimate this job's GPU memory" in line and "submitted unchanged" in line
    assert sub.seconds < 60
    cluster.run("scancel", sub.job_id)


def test_cpu_job_is_untouched(cluster, work):
    path = script(work, "cpu.sh", "#SBATCH --ntasks=1", "echo cpu only\n")
    sub = cluster.sbatch(path)
    assert sub.returncode == 0 and xmem_lines(sub.stderr) == []
    info = cluster.wait(sub.job_id)
    assert info.get("TresPerNode", "(null)") == "(null)" and info.get("Comment", "(null)") == "(null)"
    assert "XMEM_" not in cluster.output(work, sub.job_id)


def test_the_root_prolog_sets_the_mps_daemons_limit_from_the_allocation(cluster, work):
    """Slurm 22.05 gives the Prolog the job's MPS percentage and GPU; the Prolog sends the control daemon the share.
    A recording stand-in of nvidia-cuda-mps-control (and of nvidia-smi: a 40 GiB GPU) in bin/ beside prolog.sh;
    the job asks for mps:50 past the filter with a forged stamp claiming 1 byte, which plays no part."""
    bin_dir, log = cluster.lab / "etc" / "bin", cluster.lab / "mps-control.log"
    bin_dir.mkdir(exist_ok=True)
    try:
        for name, body in (("nvidia-cuda-mps-control", f'read -r line; echo "$line" >> {log}; exit 0\n'),
                           ("nvidia-smi", "echo 40960\n")):
            (bin_dir / name).write_text("#!/bin/sh\n" + body)
            (bin_dir / name).chmod(0o755)
        path = script(work, "mps.sh", "#SBATCH --gres=mps:50", "true\n")
        sub = cluster.sbatch(path, "--comment=xmem:peak=1;need=1;type=a100;req=mps:50", env={"XMEM_NO_FILTER": "1"})
        assert sub.returncode == 0, sub.stderr
        assert cluster.wait(sub.job_id, timeout=120)["JobState"] == "COMPLETED"
        sent = log.read_text().splitlines()
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
    device = int(sent[1].split()[1])  # the GPU Slurm gave the job (its SLURM_JOB_GPUS)
    assert sent == ["get_server_list", f"set_default_device_pinned_mem_limit {device} 20480M"]
