"""The submission contract: the Lua side's request read, from an analysis to the sbatch options, the user's line
and the failure rule."""

import json

import pytest

from tests.slurm.submissions import GIB, PEAKS, decision, request
from xmem.policy import Decision
from xmem.slurm.contract import MESSAGE_MAX_CHARS, FilterReply, FilterRequest, Verdict, reply_for, with_exports
from xmem.slurm.stamp import JobStamp, comment_fields
from xmem.text import comment_text, comment_value


def test_request_from_lua_json_strips_the_gres_prefix_sbatch_reads_back():
    req = FilterRequest.from_json({"script": "/j.sh", "argv": ["/j.sh", "a"],
                                   "options": {"gres": "gres:gpu:a100:1,gres:mps:10", "parsable": "set",
                                               "partition": "gpu"},
                                   "user": "ann", "env": {"PWD": "/tmp"}})
    assert req.script_args == ("a",)
    assert req.cli_options() == {"gres": "gpu:a100:1,mps:10", "partition": "gpu"}


def test_rewrite_sets_gres_comment_and_exports():
    reply = reply_for(Verdict(decision(), PEAKS), request(gres="gres:gpu:1"), "open")
    stamp = JobStamp(peak_bytes=7 * GIB, needed_bytes=8 * GIB, gpu_type="a100", request="mps:a100:40",
                     action="rewrite")
    why = comment_value(reply.message)  # the user's line, as the comment and the environment hold it
    assert reply.set == {"gres": "mps:a100:40", "comment": f"{stamp.comment()};why={why};was=gpu:1",
                         "export": "ALL," + ",".join(f"{k}={v}" for k, v in stamp.env().items()) +
                                   f",XMEM_WHY_ENCODED={why}"}
    assert reply.message.endswith("-> --gres=mps:a100:40") and reply.reject is None


@pytest.mark.parametrize("option", ["gpus", "gpus-per-node"])
def test_rewrite_in_the_users_gpus_form(option):
    d = decision(gres=None, gpus="h100:1", option=option, kind="gpu", gpu_type="h100", peak_bytes=None)
    reply = reply_for(Verdict(d, PEAKS), request(**{option: "1"}), "open")
    assert reply.set[option] == "h100:1" and "gres" not in reply.set
    assert reply.message.endswith(f"-> --{option}=h100:1")
    stamp = JobStamp.from_comment(reply.set["comment"])
    assert stamp.peak_bytes == 7 * GIB + 5 and stamp.request == f"{option}=h100:1"  # from peaks[h100]


@pytest.mark.parametrize("mine", ["xmem:mine", "xmem:peak=1+my+note", "xmem:hello;peak=²;state=fake x",
                                  "notes xmem: xmem:why=mine"])
def test_the_filters_stamp_is_found_after_a_users_comment_that_starts_with_xmem(mine):
    """Deferred mode reads the stamp back from the reply's comment (deferred.apply): a user's own `xmem:` word read
    first made a rewritten job `state=unchanged`."""
    reply = reply_for(Verdict(decision(), PEAKS), request(gres="gres:gpu:1", comment=mine), "open")
    assert JobStamp.from_comment(reply.set["comment"]) == JobStamp(
        peak_bytes=7 * GIB, needed_bytes=8 * GIB, gpu_type="a100", request="mps:a100:40", action="rewrite")
    assert comment_fields(reply.set["comment"])["was"] == "gpu:1"
    assert "state" not in comment_fields(reply.set["comment"])


def test_keep_leaves_the_request_and_still_stamps_the_job():
    reply = reply_for(Verdict(decision(action="keep", gres=None, gpu_type="h100"), PEAKS),
                      request(gres="gres:gpu:h100:1", comment="mine"), "open")
    assert "gres" not in reply.set and "gpus" not in reply.set
    assert reply.set["comment"].startswith("mine xmem:")
    assert JobStamp.from_comment(reply.set["comment"]).request == "gpu:h100:1"
    assert "keeping gpu:h100:1" in reply.message


def test_cpu_job_is_untouched_and_silent():
    assert reply_for(Verdict(decision(action="none", gres=None)), request(), "closed") == FilterReply()


def test_no_fit_warns_and_changes_nothing():
    reply = reply_for(Verdict(decision(action="no_fit", gres=None, reason="needs 90 GiB: no GPU type fits")),
                      request(gres="gres:gpu:1"), "closed")
    assert reply.reject is None and reply.message.startswith("warning: needs 90 GiB")
    assert set(reply.set) == {"comment", "export"}  # the request as written; the reason kept with the job
    assert comment_fields(reply.set["comment"]) == {"state": "unchanged", "why": comment_value(reply.message),
                                                    "was": "gpu:1"}


def test_estimator_fault_fails_open_with_one_line():
    reply = reply_for(Verdict(None, errors=("user_error: ImportError: no module named foo",)),
                      request(gres="gres:gpu:1", comment="run 3"), "open")
    assert reply.reject is None
    assert reply.message == ("cannot estimate this job's GPU memory (user_error: ImportError: no module named foo)"
                             "; submitted unchanged")
    # the job keeps its request; why, and what it asked for, stay with it (comment, environment)
    line = ("cannot%20estimate%20this%20job%27s%20GPU%20memory%20(user_error:%20ImportError:%20no%20module%20named"
            "%20foo)%3B%20submitted%20unchanged")
    assert reply.set == {"comment": f"run 3 xmem:state=failed;why={line};was=gpu:1",
                         "export": f"ALL,XMEM_WHY_ENCODED={line}"}
    assert comment_text(comment_fields(reply.set["comment"])["why"]) == reply.message  # exactly as the user saw it


def test_estimator_fault_is_refused_when_closed():
    reply = reply_for(Verdict(None, errors=("timeout: 60 s",)), request(gres="gres:gpu:1"), "closed")
    assert reply.set == {}
    assert reply.reject.startswith("cannot estimate this job's GPU memory (timeout: 60 s). This site requires")
    assert "xmem-slurm check /home/ann/job.sh" in reply.reject


def test_cached_analysis_says_so():
    reply = reply_for(Verdict(decision(), PEAKS, cached=True), request(), "open")
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
    assert out["message"] == 'can\'t "parse" line \\2' and out["reject"] is None
    long = FilterReply(message="RuntimeError: " + "x" * 1_000_000).to_json()["message"]
    assert len(long) <= MESSAGE_MAX_CHARS and long.endswith("[... cut]")


def test_an_untrusted_estimate_keeps_the_request_and_says_why_in_the_comment():
    why = "no command of the job used CUDA under the trace"
    reply = reply_for(Verdict(Decision("keep", why), {}), request(gres="gres:gpu:1", comment="run 3"),
                      "open")
    assert "gres" not in reply.set and reply.message.startswith(why) and "keeping gpu:1" in reply.message
    assert reply.set["comment"].startswith("run 3 xmem:") and "why=no%20command%20of%20the%20job" in reply.set["comment"]
    assert JobStamp.from_comment(reply.set["comment"]).peak_bytes is None  # no MPS limit from it


def test_the_users_line_and_request_travel_whatever_the_export_and_the_request():
    """--export=NONE is the user's: no variable is added (the TaskProlog reads the comment); a job that named
    no GPU request (a partition's default) was submitted with `none`."""
    reply = reply_for(Verdict(decision(), PEAKS), request(export="NONE"), "open")
    assert "export" not in reply.set
    fields = comment_fields(reply.set["comment"])
    assert (fields["why"], fields["was"]) == (comment_value(reply.message), "none")
    again = reply_for(Verdict(decision(), PEAKS), request(comment=reply.set["comment"], gres="gres:gpu:2"), "open")
    assert again.set["comment"].count("xmem:") == 1 and comment_fields(again.set["comment"])["was"] == "gpu:2"
