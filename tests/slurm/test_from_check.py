"""`check job.sh` then `sbatch job.sh` of the same job estimates once (issue 32 item 5): check files its analysis
under the key the filter computes for the submission cli_filter.lua sends, whose options hold the script's
#SBATCH lines merged in (they keyed apart: 49 s + 38 s of estimates)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.config import load_site_config
from xmem.slurm.contract import FilterRequest, key_for
from xmem.slurm.filter import run_filter
from xmem.slurm.from_check import SharedAnalysis, check_request
from xmem.slurm.inline import command_files, config_digest, parse_job

XMEM_SLURM = Path(sys.executable).parent / "xmem-slurm"
TRAIN = """\
import sys
import torch

model = torch.nn.Linear(int(sys.argv[1]), 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, int(sys.argv[1]), device="cuda")).sum().backward()
    opt.step()
"""
SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH -p debug --time=10 -J sized\npython train.py 64\n"


def site(tmp_path: Path) -> str:
    path = tmp_path / "xmem.toml"
    path.write_text(f'[partitions]\ndefault = "debug"\nfrom_cluster = false\n\n[partitions.gpu_types]\n'
                    f'debug = ["a100"]\n\n[estimate]\ncache_dir = "{tmp_path}/cache"\niterations = 2\n')
    return str(path)


def lua_request(script: Path, **options: str) -> FilterRequest:
    """What cli_filter.lua sends for `sbatch job.sh` from the script's directory: sbatch's options with the script's
    directives merged in (22.05 reads gres back with its `gres:` prefix)."""
    return FilterRequest(script=str(script), argv=(str(script),), options=options, user=os.environ.get("USER"),
                         env=dict(os.environ), cwd=str(script.parent))


def test_the_filter_keys_the_job_as_check_does(tmp_path):
    """The same job, whether its GPU request comes through the script's lines (check) or sbatch's merged options
    (the filter); a request that differs keys apart."""
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    config = load_site_config(site(tmp_path))
    checked = SharedAnalysis.start(str(script), check_request(str(script), [], None, os.environ, str(tmp_path)),
                                   config)
    submitted = lua_request(script, gres="gres:gpu:1", partition="debug", time="10", **{"job-name": "sized"})

    def filter_key(request):  # as xmem.slurm.filter.gpu_job_reply keys a submission
        job = parse_job(str(script), request)
        return key_for(str(script), request, config_digest(config), command_files(job, request, str(script)))

    assert filter_key(submitted) == checked.key
    assert filter_key(lua_request(script, gres="gres:gpu:2", partition="debug")) != checked.key


@pytest.mark.slow
def test_sbatch_after_check_uses_checks_estimate(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    config = site(tmp_path)
    done = subprocess.run([str(XMEM_SLURM), "check", str(script), "--config", config], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "Decision: request --gres=gpu:a100:1" in " ".join(done.stdout.split())

    def not_again(*args, **kwargs):
        raise AssertionError("the filter estimated the job again")

    submitted = lua_request(script, gres="gres:gpu:1", partition="debug", time="10", **{"job-name": "sized"})
    reply = run_filter(submitted, load_site_config(config), analyzer=not_again)
    assert reply.set["gres"] == "gpu:a100:1" and "cached" in reply.message
