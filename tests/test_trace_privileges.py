"""S2 (issue 14): the filter never runs a user's program as root.

Root submitting `sbatch --uid=alice job.sh` (or an admin submitting a user's script) runs the filter as uid 0;
the job's request is then kept as written, with a one-line notice, and the program is not started. Jobs that need
no trace are answered as before; root's own job (only root can write its files) is estimated as before. The
non-root side is the dev cluster's: tests/integration/test_multiuser.py submits as a throw-away user.
"""

import io
import json
import os
import time

import pytest

from tests.throwaway_users import scratch, users_fixture  # noqa: F401 (scratch is a fixture)
from xmem.slurm.filter import filter_main
from xmem.trace import privileges

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pins what happens when root submits")

TRAIN = """\
import torch
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); model(torch.randn(8, 64, device="cuda")).sum().backward(); opt.step()
"""


users = users_fixture("owner")


def filter_reply(tmp_path, directives: str, owner=None, **options) -> dict:
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{directives}\npython train.py\n")
    if owner is not None:  # an admin submitting a user's files
        for path in (tmp_path, script, tmp_path / "train.py"):
            os.chown(path, owner.uid, owner.gid)
    config = tmp_path / "xmem.toml"
    config.write_text('[partitions]\ndefault = "debug"\n\n[partitions.gpu_types]\ndebug = ["a100"]\n\n'
                      f'[estimate]\ncache_dir = "{tmp_path}/cache"\n')
    request = {"script": str(script), "argv": [str(script)], "options": options, "user": "root",
               "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path)}
    out = io.StringIO()
    assert filter_main(config_path=str(config), stdin=io.StringIO(json.dumps(request)), stdout=out) == 0
    return json.loads(out.getvalue())


def test_root_submitting_for_a_user_keeps_the_request_and_runs_nothing(tmp_path):
    started = time.monotonic()
    reply = filter_reply(tmp_path, "#SBATCH --gres=gpu:1", gres="gres:gpu:1", uid="alice")
    assert time.monotonic() - started < 5  # no trace: a trace of this job takes several seconds
    assert "gres" not in reply["set"] and "gpus" not in reply["set"]
    assert reply["reject"] is None and reply["fault"] is None
    assert "for alice" in reply["message"] and "never runs a user's program as root" in reply["message"]
    assert "keeping gpu:1" in reply["message"]


def test_root_submitting_a_users_script_keeps_the_request(scratch, users):
    reply = filter_reply(scratch, "#SBATCH --gpus=1", owner=users[0], gpus="1")
    assert "gpus" not in reply["set"] and f"for {users[0].name}" in reply["message"]


def test_root_submitting_a_cpu_job_gets_the_usual_empty_reply(tmp_path):
    assert filter_reply(tmp_path, "#SBATCH --ntasks=1") == {"set": {}, "message": None, "reject": None,
                                                            "fault": None, "defer": None}


def test_as_root_the_estimator_refuses_before_anything_starts(tmp_path):
    refuse = privileges.guarded_estimator({"uid": "alice"}, str(tmp_path / "job.sh"))
    with pytest.raises(privileges.RootTraceRefused, match="for alice"):
        refuse(["python", "train.py"], gpus=["a100"], cwd=str(tmp_path))
    assert privileges.kept_decision([]) is None  # nothing refused: the analysis' own answer stands
