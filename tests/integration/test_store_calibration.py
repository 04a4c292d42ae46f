"""The calibration loop on a real Slurm 22.05 (the dev cluster): jobs submitted through the filter report a measured
peak in `$XMEM_MEASURE_FILE`, the real Epilog records them, and `xmem-slurm calibrate --from-store` fits the GPU
type's overhead from those records; `xmem-slurm report --plot` draws them.

Each job reports its estimate (`$XMEM_PEAK_BYTES`, exported by the TaskProlog) plus 100, 200 and 300 MiB as its
measured peak, so the fitted overhead is derived here by hand: the catalog's plus the median error, 200 MiB.
"""

from __future__ import annotations

import json
import time
import tomllib

import pytest

from tests.integration.test_slurm_glue import TRAIN, script
from xmem.bench.overhead_fit import ALWAYS_LOADED
from xmem.config import load_site_config
from xmem.gpus import find_gpu, load_catalog, overhead_bytes

pytestmark = pytest.mark.slurm

MIB = 1 << 20
EXTRA_MIB = (100, 300, 200)  # measured minus estimated, job by job

# The program xmem estimates at submission. Run as a job on the dev cluster (no GPU there) it stops at once: the
# TaskProlog's $XMEM_MEASURE_FILE is set only in a real job, and the job body reports a made-up measurement.
TRAIN_HERE = """\
import os
import sys

if os.environ.get("XMEM_MEASURE_FILE"):
    sys.exit(0)
""" + TRAIN

# The n-th job of this script (a counter beside it: the jobs run one after another) adds EXTRA_MIB[n].
JOB_BODY = """\
python train.py
n=$(cat runs 2>/dev/null || echo 0); echo $((n + 1)) > runs
extra=$(echo %s | cut -d' ' -f$((n + 1)))
[ -n "$XMEM_MEASURE_FILE" ] && echo "{\\"peak_bytes\\": $((XMEM_PEAK_BYTES + extra * 1048576))}" > "$XMEM_MEASURE_FILE"
""" % " ".join(map(str, EXTRA_MIB))


@pytest.fixture(scope="module")
def measured_jobs(cluster, job_dir, tmp_path_factory):
    """Three runs of one job (the estimate is cached after the first), and a store holding their real records."""
    work = job_dir("calibration", TRAIN_HERE)
    path = script(work, "measured.sh", "#SBATCH --gres=gpu:1", JOB_BODY)
    job_ids = []
    started = time.monotonic()
    for _ in EXTRA_MIB:
        sub = cluster.sbatch(path)
        assert sub.returncode == 0, sub.stderr
        assert cluster.wait(sub.job_id, timeout=300)["JobState"] == "COMPLETED"
        job_ids.append(sub.job_id)
        print(f"\nfigure: sbatch {sub.seconds:.1f} s, submitted to recorded {time.monotonic() - started:.1f} s")
    # the Epilog's own lines for these jobs, verbatim (the cluster's store holds other tests' jobs too)
    lines = [line for line in cluster.store.read_text().splitlines() if json.loads(line)["job_id"] in job_ids]
    store = tmp_path_factory.mktemp("store") / "records.jsonl"
    store.write_text("\n".join(lines) + "\n")
    return work, job_ids, store, [json.loads(line) for line in lines]


def test_the_epilog_recorded_each_jobs_measured_peak(measured_jobs):
    _work, job_ids, _store, records = measured_jobs
    assert sorted(r["job_id"] for r in records) == sorted(job_ids)
    by_job = {r["job_id"]: r for r in records}
    for job_id, extra in zip(job_ids, EXTRA_MIB):
        record = by_job[job_id]
        assert record["measured_by"] == "file" and record["exit_code"] == 0
        assert record["measured_bytes"] - record["estimate_bytes"] == extra * MIB


def test_calibrate_from_store_fits_the_median_error_into_the_overhead(cluster, measured_jobs, tmp_path):
    _work, _job_ids, store, records = measured_jobs
    out = tmp_path / "calibration.toml"
    # The jobs' own files and one user: what a site's calibration refuses by default (slurm/README.md), accepted
    # here by the admin's options, so that the loop itself is what this test checks.
    run = cluster.run("xmem-slurm", "calibrate", "--from-store", "--store", str(store), "--config",
                      str(cluster.config), "--out", str(out), "--trust-job-files", "--min-users", "1", timeout=120)
    assert run.returncode == 0, run.stderr
    site = load_site_config(cluster.config)
    (gres_type,) = {r["gpu_type"] for r in records}
    gpu = find_gpu(site.mig.parent_of(gres_type) or gres_type, load_catalog(site.catalog_overrides or None))
    fitted = tomllib.loads(out.read_text())["overhead"][gpu.name]
    assert fitted["context_bytes"] == overhead_bytes(gpu, {ALWAYS_LOADED}) + sorted(EXTRA_MIB)[1] * MIB
    assert "1 runs" in fitted["provenance"] and "one run per user" in fitted["provenance"]
    refused = cluster.run("xmem-slurm", "calibrate", "--from-store", "--store", str(store), "--config",
                          str(cluster.config), "--out", str(tmp_path / "refused.toml"), timeout=120)
    assert refused.returncode == 2 and "3 measured by file, not trusted" in " ".join(refused.stderr.split())


def test_report_plot_draws_the_jobs(cluster, measured_jobs, tmp_path):
    _work, _job_ids, store, _records = measured_jobs
    png = tmp_path / "report.png"
    run = cluster.run("xmem-slurm", "report", "--store", str(store), "--plot", str(png), "--config",
                      str(cluster.config), timeout=120)
    assert run.returncode == 0, run.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
