"""`xmem-slurm check --json` on the dev cluster: the option table (issue 11 item 1) is built from the GRES Slurm
declares (gpu:a100:2, gpu:h100:1, gpu:1g.10gb:1, mps:200), read through sinfo, not from a list in the site config.

The expected rows are derived here from what sinfo says and the site's own rules, never written as constants."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.config import load_site_config
from xmem.gpus import load_catalog
from xmem.policy import gres_memory_bytes

pytestmark = pytest.mark.slurm

TRAIN = """\
import torch
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture(scope="module")
def site_from_cluster(cluster, job_dir) -> tuple[Path, Path]:
    """The cluster's site config with its partition's GPU list taken out: the types come from Slurm."""
    work = job_dir("options", TRAIN)
    text = re.sub(r"(?m)^debug\s*=\s*\[.*\]\s*$", "", cluster.config.read_text())
    assert "from_cluster = true" in text
    config = work / "xmem.toml"
    config.write_text(text)
    return work, config


def slurm_gpu_types(cluster) -> set[str]:
    """The GPU GRES types of partition debug, as sinfo lists them."""
    out = cluster.run("sinfo", "-h", "-p", "debug", "-o", "%G").stdout
    return {m.group(1) for m in re.finditer(r"gpu:([^:,()]+):\d+", out)}


def generic_job(work: Path) -> Path:
    job = work / "job.sh"
    job.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH -p debug\ncd {work}\npython train.py\n")
    return job


def test_check_lists_every_offer_of_the_clusters_gres(cluster, site_from_cluster):
    work, config = site_from_cluster
    job = generic_job(work)
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "check", str(job), "--json", "--config", str(config)],
                          capture_output=True, text=True, timeout=600, cwd=work, env=cluster.env)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    site, catalog = load_site_config(config), load_catalog()
    types = slurm_gpu_types(cluster)
    assert types == {"a100", "h100", "1g.10gb"} and set(data["gpu_types"]) == types

    rows = data["options"]["rows"]
    # Whole GPUs and MIG slices: one row per GRES type Slurm declares, its memory the catalog's.
    for kind in ("gpu", "mig"):
        declared = {t for t in types if (site.mig.parent_of(t) is not None) == (kind == "mig")}
        assert {r["gres_type"] for r in rows if r["kind"] == kind} == declared
    for row in rows:
        parent = site.mig.parent_of(row["gres_type"])
        memory = gres_memory_bytes(row["gres_type"], parent, catalog)
        peak = data["peaks"][row["gres_type"]]
        assert row["peak_bytes"] == peak and row["needed_bytes"] == site.margin.needed(peak)
        assert row["fits"] == (row["needed_bytes"] <= row["usable_bytes"])
        assert row["slack_bytes"] == row["usable_bytes"] - row["needed_bytes"]
        if row["kind"] in ("gpu", "mig"):
            assert row["usable_bytes"] == memory
        else:  # MPS on the types the site lists (shards are off on this cluster): a share of the GPU
            assert row["kind"] == "mps" and row["gres_type"] in site.mps.gpu_types
            assert row["usable_bytes"] <= memory
    kinds = [r["kind"] for r in rows]
    assert kinds == sorted(kinds, key=site.preference.index)  # the site's order of preference

    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0] == data["options"]["chosen"]
    assert chosen[0]["request"] == data["decision"]["gres"] and data["options"]["reason"] == data["decision"]["reason"]
    earlier = rows[:rows.index(chosen[0])]
    missed = [r for r in earlier if not r["fits"]]
    assert data["options"]["closest_miss"] == (max(missed, key=lambda r: r["slack_bytes"]) if missed else None)


def test_check_prints_the_table_for_people(cluster, site_from_cluster):
    work, config = site_from_cluster
    job = generic_job(work)
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "check", str(job), "--config", str(config)],
                          capture_output=True, text=True, timeout=600, cwd=work, env={**cluster.env, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "Every way the site offers" in done.stdout and "<- picked" in done.stdout
    assert re.search(r"picked: .*: needs .* is the smallest fit", done.stdout)
