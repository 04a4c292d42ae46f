"""`xmem-slurm check job.sh` then `sbatch job.sh` on a real Slurm 22.05 (issue 32 item 5): the submission reuses
check's estimate. cli_filter.lua hands the filter sbatch's options with the script's #SBATCH lines merged in
(what slurm.json_cli_options lists), where check has only its own command line: the cache key is the request as
parsed, which both agree on."""

from __future__ import annotations

import pytest

from tests.integration.test_slurm_glue import TRAIN, script, xmem_lines

pytestmark = pytest.mark.slurm


def test_sbatch_after_check_uses_checks_estimate(cluster, job_dir):
    work = job_dir("checked", TRAIN)
    path = script(work, "checked.sh", "#SBATCH --gres=gpu:1\n#SBATCH -p debug --time=10 -J checked\n#SBATCH -n 1")
    checked = cluster.run(cluster.env["XMEM_SLURM"], "check", str(path), cwd=work, timeout=300)
    assert checked.returncode == 0, checked.stderr
    before = cluster.analyses()
    assert before, "check filed nothing"
    sub = cluster.sbatch(path)
    assert sub.returncode == 0, sub.stderr
    (line,) = xmem_lines(sub.stderr)
    assert line.endswith("(cached estimate)"), line  # estimated once, by check
    assert cluster.analyses() == before
    print(f"\nfigure: sbatch after check took {sub.seconds:.2f} s")

