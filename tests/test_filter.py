"""`xmem-slurm filter`: from an analysis to the sbatch options, the user's line and the failure rule."""

import json

import pytest

from xmem.cache import AnalysisCache
from xmem.policy import Decision
from xmem.slurm.contract import Analysis, FilterReply, FilterRequest, plain, reply_for, with_exports
from xmem.slurm.inline import cached_analysis
from xmem.slurm.stamp import JobStamp

GIB = 1 << 30


def request(**options):
    return FilterRequest(script="/home/ann/job.sh", argv=("/home/ann/job.sh", "--lr", "1"), options=options,
                         user="ann", env={"PWD": "/home/ann"})


def decision(**fields):
    """A real policy decision, as the filter receives it."""
    d = dict(action="rewrite", reason="needs 8.0 GiB with margin: MPS 40 % of an a100 is the smallest fit",
             gres="mps:a100:40", option="gres", kind="mps", gpu_type="a100", peak_bytes=7 * GIB,
             needed_bytes=8 * GIB, granted_bytes=16 * GIB)
    d.update(fields)
    return Decision(**d)


PEAKS = {"a100": 7 * GIB, "h100": 7 * GIB + 5}


def test_request_from_lua_json_strips_the_gres_prefix_sbatch_reads_back():
    req = FilterRequest.from_json({"script": "/j.sh", "argv": ["/j.sh", "a"],
                                   "options": {"gres": "gres:gpu:a100:1,gres:mps:10", "parsable": "set",
                                               "partition": "gpu"},
                                   "user": "ann", "env": {"PWD": "/tmp"}})
    assert req.script_args == ("a",)
    assert req.cli_options() == {"gres": "gpu:a100:1,mps:10", "partition": "gpu"}


def test_rewrite_sets_gres_comment_and_exports():
    reply = reply_for(Analysis(decision(), PEAKS), request(gres="gres:gpu:1"), "open")
    stamp = JobStamp(peak_bytes=7 * GIB, needed_bytes=8 * GIB, gpu_type="a100", request="mps:a100:40",
                     action="rewrite")
    assert reply.set == {"gres": "mps:a100:40", "comment": stamp.comment(),
                         "export": "ALL," + ",".join(f"{k}={v}" for k, v in stamp.env().items())}
    assert reply.message.endswith("-> --gres=mps:a100:40") and reply.reject is None


@pytest.mark.parametrize("option", ["gpus", "gpus-per-node"])
def test_rewrite_in_the_users_gpus_form(option):
    d = decision(gres=None, gpus="h100:1", option=option, kind="gpu", gpu_type="h100", peak_bytes=None)
    reply = reply_for(Analysis(d, PEAKS), request(**{option: "1"}), "open")
    assert reply.set[option] == "h100:1" and "gres" not in reply.set
    assert reply.message.endswith(f"-> --{option}=h100:1")
    stamp = JobStamp.from_comment(reply.set["comment"])
    assert stamp.peak_bytes == 7 * GIB + 5 and stamp.request == f"{option}=h100:1"  # from peaks[h100]


def test_keep_leaves_the_request_and_still_stamps_the_job():
    reply = reply_for(Analysis(decision(action="keep", gres=None, gpu_type="h100"), PEAKS),
                      request(gres="gres:gpu:h100:1", comment="mine"), "open")
    assert "gres" not in reply.set and "gpus" not in reply.set
    assert reply.set["comment"].startswith("mine xmem:")
    assert JobStamp.from_comment(reply.set["comment"]).request == "gpu:h100:1"
    assert "keeping gpu:h100:1" in reply.message


def test_cpu_job_is_untouched_and_silent():
    assert reply_for(Analysis(decision(action="none", gres=None)), request(), "closed") == FilterReply()


def test_no_fit_warns_and_changes_nothing():
    reply = reply_for(Analysis(decision(action="no_fit", gres=None, reason="needs 90 GiB: no GPU type fits")),
                      request(gres="gres:gpu:1"), "closed")
    assert reply.set == {} and reply.reject is None and reply.message.startswith("warning: needs 90 GiB")


def test_estimator_fault_fails_open_with_one_line():
    reply = reply_for(Analysis(None, errors=("user_error: ImportError: no module named foo",)),
                      request(gres="gres:gpu:1"), "open")
    assert reply.set == {} and reply.reject is None
    assert reply.message == ("cannot estimate this job's GPU memory (user_error: ImportError: no module named foo)"
                             "; submitted unchanged")


def test_estimator_fault_is_refused_when_closed():
    reply = reply_for(Analysis(None, errors=("timeout: 60 s",)), request(gres="gres:gpu:1"), "closed")
    assert reply.set == {}
    assert reply.reject.startswith("cannot estimate this job's GPU memory (timeout: 60 s). This site requires")
    assert "xmem-slurm check /home/ann/job.sh" in reply.reject


def test_cached_analysis_says_so():
    reply = reply_for(Analysis(decision(), PEAKS, cached=True), request(), "open")
    assert reply.message.endswith("(cached estimate)")


@pytest.mark.parametrize("export, expected", [
    (None, "ALL,XMEM_PEAK_BYTES=1"),
    ("ALL", "ALL,XMEM_PEAK_BYTES=1"),
    ("ALL,FOO=2", "ALL,FOO=2,XMEM_PEAK_BYTES=1"),
    ("ALL,XMEM_PEAK_BYTES=9", "ALL,XMEM_PEAK_BYTES=1"),
    ("NONE", None),
    ("none", None),
    ("NONE,FOO=1", None),
])
def test_exports_respect_the_users_choice(export, expected):
    assert with_exports(export, {"XMEM_PEAK_BYTES": "1"}) == expected


def test_option_values_pass_exactly_and_lines_for_people_are_one_short_line():
    export = 'ALL,MSG="hello world",WINPATH=C:\\dir\\x'
    reply = FilterReply(message='can\'t "parse"\nline \\2', set={"export": export, "comment": 'a"b\\c'})
    out = json.loads(json.dumps(reply.to_json()))
    assert out["set"] == {"export": export, "comment": 'a"b\\c'}
    assert out["message"] == 'can\'t "parse" line \\2'
    assert plain(None) is None
    long = plain("RuntimeError: " + "x" * 1_000_000)
    assert len(long) <= 600 and long.endswith("[... cut]")


def test_cache_skips_the_second_analysis_and_never_caches_a_failure(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        env={"PWD": str(tmp_path)})
    calls = []

    def analyzer(path, r, config):
        calls.append(path)
        return Analysis(decision(), PEAKS) if len(calls) != 1 else Analysis(None, errors=("timeout: 1 s",))

    cache = AnalysisCache(tmp_path / "cache")
    run = lambda: cached_analysis(str(script), req, None, cache=cache, config_digest="", analyzer=analyzer)
    assert run().errors == ("timeout: 1 s",)  # failed: not cached
    fresh = run()
    assert not fresh.cached and fresh.decision == decision()
    hit = run()
    assert hit.cached and hit.decision == decision() and hit.peaks == PEAKS
    assert len(calls) == 2
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --more\n")
    assert not run().cached and len(calls) == 3


def test_a_damaged_cache_entry_is_computed_again(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann")
    cache = AnalysisCache(tmp_path / "cache")
    calls = []

    def analyzer(path, r, config):
        calls.append(path)
        return Analysis(decision(), PEAKS)

    key = "k" * 64
    for damaged in ({"decision": "rewrite"}, {"decision": {"action": "rewrite", "gres": 7}, "peaks": {}},
                    {"decision": decision().to_json(), "peaks": {"a100": "big"}}, {"decision": None, "errors": []}):
        cache.put(key, damaged)
        got = cached_analysis(str(script), req, None, cache=cache, config_digest="", analyzer=analyzer, key=key)
        assert not got.cached and got.decision == decision()
    assert len(calls) == 4


def test_an_estimate_of_files_edited_during_the_trace_is_not_cached(tmp_path):
    """The cache key hashes train.py before the trace reads it: an edit meanwhile must not file the edited
    program's estimate under the original's key."""
    script, train = tmp_path / "job.sh", tmp_path / "train.py"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    train.write_text("print('v1')\n")
    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        cwd=str(tmp_path))
    cache = AnalysisCache(tmp_path / "cache")

    def editing_analyzer(path, r, config):
        train.write_text("print('v2: a bigger model')\n")  # the user edits right after sbatch
        return Analysis(decision(), PEAKS)

    run = lambda analyzer: cached_analysis(str(script), req, None, cache=cache, config_digest="",
                                           files=[str(train)], analyzer=analyzer)
    assert run(editing_analyzer).decision == decision()  # the answer stands (it is what the job will run)
    train.write_text("print('v1')\n")
    assert not run(lambda *a: Analysis(decision(peak_bytes=1), PEAKS)).cached  # v1's key holds nothing
    assert run(editing_analyzer).decision == decision(peak_bytes=1)  # v1's own estimate, now cached


def test_a_hetjob_passes_unchanged_with_a_notice(tmp_path):
    from xmem.config import config_from_dict
    from xmem.slurm.filter import run_filter

    script = tmp_path / "het.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH hetjob\n#SBATCH --gres=gpu:1\n"
                      "srun --het-group=1 python train.py\n")
    config = config_from_dict({"estimate": {"cache_dir": str(tmp_path / "c")}})
    never = lambda *a: pytest.fail("a hetjob must not be estimated")
    for req in (FilterRequest(script=str(script), argv=(str(script),), options={"ntasks": "1"}),
                FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"},
                              hetjob=True)):
        reply = run_filter(req, config, analyzer=never)
        assert reply.set == {} and "heterogeneous job" in reply.message and "unchanged" in reply.message


def test_an_untrusted_estimate_keeps_the_request_and_says_why_in_the_comment():
    why = "no command of the job used CUDA under the trace"
    reply = reply_for(Analysis(Decision("keep", why), {}), request(gres="gres:gpu:1", comment="run 3"),
                      "open")
    assert "gres" not in reply.set and reply.message.startswith(why) and "keeping gpu:1" in reply.message
    assert reply.set["comment"].startswith("run 3 xmem:") and "why=no+command+of+the+job" in reply.set["comment"]
    assert JobStamp.from_comment(reply.set["comment"]).peak_bytes is None  # no MPS limit from it


def test_one_deadline_bounds_the_wait_for_a_slot_and_the_estimate(tmp_path):
    import time

    from xmem.config import config_from_dict
    from xmem.slurm.filter import run_filter

    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    site = config_from_dict({"estimate": {"timeout_s": 30, "cache_dir": str(tmp_path / "cache")}})
    left = []

    def analyzer(path, req, config, *, deadline):
        left.append(deadline - time.monotonic())
        return Analysis(decision(), PEAKS)

    req = FilterRequest(script=str(script), argv=(str(script),), options={"gres": "gres:gpu:1"}, user="ann",
                        cwd=str(tmp_path))
    reply = run_filter(req, site, analyzer=analyzer)
    assert reply.set["gres"] == "mps:a100:40" and len(left) == 1
    assert 20 < left[0] < 30  # the site's 30 s from the submission's start, less what the filter spent first
    assert site.estimate.timeout_s == 30  # the config is not rewritten to carry it
