"""Deferred mode's pure parts: the spool snapshot, the comment states, the scontrol form of a request.
(The flow itself is tested on the real Slurm: tests/integration/test_deferred.py.)"""

import json
from pathlib import Path
from types import SimpleNamespace

from xmem.slurm.contract import FilterRequest, user_request
from xmem.slurm.deferred import _tres, _with_state, defer, deferring, load_request
from xmem.slurm.stamp import JobStamp
from xmem.text import comment_value


def site(tmp_path, mode="partition", cpu_partition="cpu"):
    return SimpleNamespace(estimate=SimpleNamespace(cache_dir=str(tmp_path / "cache")), source=None, failure="open",
                           deferred=SimpleNamespace(mode=mode, cpu_partition=cpu_partition, time_limit="00:15:00",
                                                    mem="2G"))


def test_deferring_needs_partition_mode_and_a_cpu_partition(tmp_path):
    assert deferring(site(tmp_path))
    assert not deferring(site(tmp_path, mode="inline"))
    assert not deferring(site(tmp_path, cpu_partition=None))


def test_defer_snapshots_the_script_and_holds_the_job(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    request = FilterRequest(script=str(script), argv=(str(script), "x"), user="ann",
                            options={"gres": "gres:gpu:1", "comment": "my run"}, env={"A": "1"}, cwd=str(tmp_path))
    reply, token = defer(str(script), request, site(tmp_path))
    assert "queued on partition cpu" in reply.message
    assert reply.set == {"hold": "set", "comment": "my run xmem:state=pending;was=gpu:1;why=" +
                         comment_value(reply.message)}  # `status` shows the line sbatch showed
    script.write_text("edited\n")
    spool = tmp_path / "cache" / "spool" / token
    snapshot, original = load_request(spool)
    assert Path(snapshot.script).read_text() == "#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n"
    assert original == str(script)
    assert (snapshot.argv, snapshot.options, snapshot.env, snapshot.cwd) == (
        (str(script), "x"), request.options, {"A": "1"}, str(tmp_path))
    assert json.loads((spool / "request.json").read_text())["user"] == "ann"
    assert reply.defer == str(spool) and (spool / "submit.sh").is_file()  # what post-submit runs


def test_comment_states_keep_the_users_text_and_the_stamp():
    stamp = JobStamp(peak_bytes=5, needed_bytes=6, gpu_type="h100", request="gpu:h100:1", action="rewrite")
    assert _with_state("mine xmem:state=pending;was=gpu:1", "state=done;was=gpu:1", stamp) == (
        "mine " + stamp.comment() + ";state=done;was=gpu:1")
    assert _with_state(None, "state=failed;why=x") == "xmem:state=failed;why=x"
    assert JobStamp.from_comment(_with_state(None, "state=done", stamp)) == stamp


def test_requests_in_scontrol_form():
    assert _tres("gres", "gpu:1g.10gb:1") == "gres:gpu:1g.10gb:1"
    assert _tres("gres", "gpu:a100:1,mps:10") == "gres:gpu:a100:1,gres:mps:10"
    assert _tres("gpus", "h100:2") == "gres:gpu:h100:2"
    assert user_request({"gres": "gres:gpu:1"}) == "gpu:1"
    assert user_request({"gpus-per-node": "a100:1"}) == "gpus-per-node=a100:1"
    assert user_request({}) is None


def test_the_submit_script_is_sh_and_queues_nothing_for_a_job_id_that_is_not_a_number(tmp_path):
    """post-submit's submit.sh (its queuing on the real Slurm: tests/integration/test_deferred.py, a space in the
    cache folder and the user's SBATCH_* variables included)."""
    import subprocess

    from xmem.slurm.deferred import submit_script

    spool = tmp_path / "it's a spool" / "spool" / "ab12"
    spool.mkdir(parents=True)
    (spool / "submit.sh").write_text(submit_script(spool, site(tmp_path)))
    assert subprocess.run(["sh", "-n", str(spool / "submit.sh")]).returncode == 0
    bin_dir, ran = tmp_path / "bin", tmp_path / "sbatch-ran"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch '{ran}'\nexit 1\n")  # only says whether sbatch was started
    (bin_dir / "sbatch").chmod(0o755)
    for job in ("", "12;rm", "$(id)", "12 13"):
        done = subprocess.run(["/bin/sh", str(spool / "submit.sh"), job], env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert done.returncode == 1 and not ran.exists()
    assert not (spool / "jobs.json").exists()


def test_an_export_post_submit_could_not_hand_on_is_not_deferred():
    from xmem.slurm.deferred import cannot_defer

    assert cannot_defer(FilterRequest(script="/j.sh", options={"export": "ALL,A=1"})) is None
    why = cannot_defer(FilterRequest(script="/j.sh", options={"export": "ALL,A=" + "x" * 140_000}))
    assert "136 KiB" in why and "128 KiB" in why


def test_unqueued_spools_are_swept_and_queued_or_fresh_ones_kept(tmp_path):
    import os
    import time

    from xmem.slurm.deferred import _sweep_unqueued

    old = time.time() - 2 * 3600
    for name, queued, age in (("stale", False, old), ("queued", True, old), ("fresh", False, None)):
        d = tmp_path / name
        d.mkdir()
        if queued:
            (d / "jobs.json").write_text("{}")
        if age:
            os.utime(d, (age, age))
    _sweep_unqueued(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "queued"]
