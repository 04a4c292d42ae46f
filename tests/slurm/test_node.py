"""Node side: the job stamp, the TaskProlog's exports (MPS memory limit) and the Epilog's record."""

import json
import os

import pytest

from xmem.slurm.node import (NodeSettings, epilog_record, exit_code_of, mps_limit_commands, mps_memory_limit,
                             mps_share_mib, prolog_exports, read_measure_file, sacct_gpumem)
from xmem.slurm.stamp import JobStamp, add_to_comment, comment_fields
from xmem.slurm.store import DEFAULT_STORE
from xmem.text import comment_value

GIB = 1 << 30
MIB = 1 << 20
STAMP = JobStamp(peak_bytes=7 * GIB, needed_bytes=8 * GIB, gpu_type="a100", request="mps:40", action="rewrite")


def no_comment(job_id):
    raise AssertionError("scontrol must not be asked when the environment has the stamp")


def test_stamp_roundtrips_through_env_and_comment():
    assert JobStamp.from_env(STAMP.env()) == STAMP
    assert JobStamp.from_comment(STAMP.comment()) == STAMP
    assert STAMP.comment() == f"xmem:peak={7 * GIB};need={8 * GIB};type=a100;req=mps:40;act=rewrite"


def test_stamp_values_never_break_sbatch_export_lists():
    stamp = JobStamp(request="gpu:a100:1,mps:10")
    assert stamp.env() == {"XMEM_REQUEST": "gpu:a100:1%2Cmps:10"}
    assert JobStamp.from_env(stamp.env()) == stamp


def test_comment_keeps_the_users_text_and_replaces_an_old_stamp():
    assert add_to_comment(None, STAMP) == STAMP.comment()
    assert add_to_comment("my run", STAMP) == "my run " + STAMP.comment()
    assert add_to_comment("my run xmem:peak=1;req=gpu:1", STAMP) == "my run " + STAMP.comment()
    assert JobStamp.from_comment("my run " + STAMP.comment()) == STAMP


def test_only_the_filters_token_is_read_whatever_the_user_wrote_before_it():
    assert comment_fields("xmem:mine " + STAMP.comment() + ";state=done") == {
        "peak": str(7 * GIB), "need": str(8 * GIB), "type": "a100", "req": "mps:40", "act": "rewrite", "state": "done"}
    assert comment_fields("xmem:mine;state=done") == {"state": "done"}  # a user's copy, alone: the job's own text
    assert comment_fields("xmem:mine;colour=blue") == {}  # not our keys
    assert comment_fields("axmem:state=done") == {} and comment_fields(None) == {}  # a word that merely holds it
    assert JobStamp.from_comment("xmem:peak=1 " + STAMP.comment()) == STAMP


@pytest.mark.parametrize("digits", ["²", "٣", "1²", "-5", "+5", "0x5", "5.0", "9" * 5000])
def test_a_number_that_is_not_ascii_digits_reads_as_absent_and_the_rest_stands(digits):
    """`peak=²` passed str.isdigit() and then failed int(): the TaskProlog and the Epilog gave up on the job."""
    stamp = JobStamp.from_comment(f"xmem:peak={digits};need={digits};type=a100;req=mps:40;act=rewrite")
    assert stamp == JobStamp(gpu_type="a100", request="mps:40", action="rewrite")
    env = {"XMEM_PEAK_BYTES": digits, "XMEM_NEEDED_BYTES": digits, "XMEM_GPU_TYPE": "a100"}
    assert JobStamp.from_env(env) == JobStamp(gpu_type="a100")


def test_a_malformed_stamp_still_gets_the_measure_file_and_the_record(tmp_path):
    comment = "xmem:note;peak=² " + "xmem:peak=²;need=³;type=a100;req=mps:40;act=rewrite;was=gpu:1"
    made = tmp_path / str(os.geteuid()) / "xmem-measure-42.json"
    made.parent.mkdir()
    made.touch()
    exports = dict(prolog_exports({"SLURM_JOB_ID": "42", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "٤٠"},
                                  total_bytes_of=lambda t: 40 * GIB, measure_dir=str(tmp_path),
                                  comment_of=lambda job: comment))
    assert exports["XMEM_MEASURE_FILE"] == str(made) and exports["XMEM_GPU_TYPE"] == "a100"
    assert "XMEM_PEAK_BYTES" not in exports and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in exports
    made.write_text(str(6 * GIB))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": str(os.geteuid()), "SLURM_JOB_COMMENT": comment,
           "SLURM_JOB_GPUS": "0,²", "SLURM_JOB_START_TIME": "¹⁷", "SLURM_JOB_EXIT_CODE2": "0:²"}
    seen = []
    record = epilog_record(env, measure_dir=str(tmp_path), nvml=lambda gpus, since: seen.append((gpus, since)))
    assert seen == [([0], None)]
    assert (record.gpu_type, record.gres, record.estimate_bytes, record.measured_bytes, record.exit_code) == (
        "a100", "mps:40", None, 6 * GIB, None)


def test_mps_limit_is_the_estimate_with_margin():
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "CUDA_VISIBLE_DEVICES": "1"}
    # 8 GiB needed, the 40 % share of a 40 GiB GPU is 16 GiB: the need wins, 8192 MiB on the client's device 0
    assert mps_memory_limit(env, STAMP, 40 * GIB) == "0=8192M"


def test_mps_limit_never_exceeds_the_share():
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_VISIBLE_DEVICES": "0"}
    # 10 % of 40 GiB = 4 GiB = 4096 MiB, below the 8 GiB the job would need
    assert mps_memory_limit(env, STAMP, 40 * GIB) == "0=4096M"


def test_mps_limit_rounds_up_to_whole_mib_and_covers_every_visible_device():
    stamp = JobStamp(needed_bytes=100 * MIB + 1)
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert mps_memory_limit(env, stamp, None) == "0=101M,1=101M"


def test_the_root_side_mps_share_is_what_slurm_allocated_never_the_stamp():
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0",
           **JobStamp(needed_bytes=1, gpu_type="h100").env()}  # the stamp's claims play no part
    shares = mps_share_mib(env, {0: 81920, 1: 40960}.get)
    assert shares == {1: 10240}  # 25 % of GPU 1 (the node's index, as the control daemon counts), in MiB
    assert mps_limit_commands(shares, ["4242"]) == ["set_default_device_pinned_mem_limit 1 10240M",
                                                    "set_device_pinned_mem_limit 4242 1 10240M"]
    assert mps_share_mib({"SLURM_JOB_GPUS": "0"}, {0: 40960}.get) == {}  # not an MPS job
    assert mps_share_mib({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "250"}, {1: 40960}.get) == {}


def test_no_mps_limit_for_a_job_without_mps():
    assert mps_memory_limit({"CUDA_VISIBLE_DEVICES": "0"}, STAMP, 40 * GIB) is None


def test_prolog_exports_the_stamp_the_measure_file_and_the_mps_limit(tmp_path):
    made = tmp_path / str(os.geteuid()) / "xmem-measure-42.json"  # as the root Prolog leaves it
    made.parent.mkdir()
    made.touch()
    env = {"SLURM_JOB_ID": "42", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "CUDA_VISIBLE_DEVICES": "0",
           **STAMP.env()}
    exports = dict(prolog_exports(env, total_bytes_of=lambda t: 40 * GIB if t == "a100" else None,
                                  measure_dir=str(tmp_path), comment_of=no_comment))
    assert exports == {**STAMP.env(), "XMEM_MEASURE_FILE": str(made),
                       "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}
    made.unlink()
    made.symlink_to(tmp_path / "elsewhere")  # no file the Prolog made: nothing to write to
    assert "XMEM_MEASURE_FILE" not in dict(prolog_exports(env, total_bytes_of=lambda t: None,
                                                          measure_dir=str(tmp_path), comment_of=no_comment))


def test_prolog_reads_the_comment_when_the_job_exported_nothing():
    asked = []

    def comment_of(job_id):
        asked.append(job_id)
        return "note " + STAMP.comment()

    exports = dict(prolog_exports({"SLURM_JOB_ID": "7"}, total_bytes_of=lambda t: None, measure_dir=None,
                                  comment_of=comment_of))
    assert asked == ["7"] and exports == STAMP.env()


def test_prolog_exports_the_users_line_decoded_from_the_comment_or_the_exported_line():
    """The job's XMEM_WHY is the line exactly as the user saw it at sbatch: decoded from the comment's `why` (a
    deferred job, rewritten after sbatch; --export=NONE) or from XMEM_WHY_ENCODED, which the filter exported. A
    job step inherits the batch script's decoded XMEM_WHY: it is never decoded again."""
    line = "needs 8 GiB + 256 MiB -> --gres=mps:40 (the user's, as asked; 100%)"
    done = "note " + STAMP.comment() + f";state=done;was=gpu:1;why={comment_value(line)}"
    exports = prolog_exports({"SLURM_JOB_ID": "7"}, total_bytes_of=lambda t: None, measure_dir=None,
                             comment_of=lambda j: done)
    assert exports == [*STAMP.env().items(), ("XMEM_WHY", line)]
    failed = "xmem:state=failed;why=cannot%20estimate;was=gpu:1"
    assert prolog_exports({"SLURM_JOB_ID": "7"}, total_bytes_of=lambda t: None, measure_dir=None,
                          comment_of=lambda j: failed) == [("XMEM_WHY", "cannot estimate")]
    step = {"SLURM_JOB_ID": "7", "XMEM_WHY_ENCODED": comment_value("50%41 off"), "XMEM_WHY": "50%41 off",
            **STAMP.env()}
    assert prolog_exports(step, total_bytes_of=lambda t: None, measure_dir=None,
                          comment_of=lambda j: None)[-1] == ("XMEM_WHY", "50%41 off")
    hostile = "xmem:state=failed;why=a%0Aexport%20LD_PRELOAD=/x.so"  # a comment the user set: still one line
    assert prolog_exports({"SLURM_JOB_ID": "7"}, total_bytes_of=lambda t: None, measure_dir=None,
                          comment_of=lambda j: hostile) == [("XMEM_WHY", "a export LD_PRELOAD=/x.so")]


def test_prolog_exports_nothing_for_a_job_xmem_never_saw():
    assert prolog_exports({"SLURM_JOB_ID": "7"}, total_bytes_of=lambda t: None, measure_dir="/m",
                          comment_of=lambda j: "plain comment") == []


def test_measure_file_forms(tmp_path):
    bare, obj, junk = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    bare.write_text("123456\n")
    obj.write_text(json.dumps({"peak_bytes": 2 * GIB, "device": "cuda:0"}))
    junk.write_text("not a number")
    assert read_measure_file(str(bare)) == 123456
    assert read_measure_file(str(obj)) == 2 * GIB
    assert read_measure_file(str(junk)) is None
    assert read_measure_file(str(tmp_path / "missing")) is None


def test_measure_file_symlink_is_refused(tmp_path):
    target = tmp_path / "secret"
    target.write_text("99")
    (tmp_path / "link").symlink_to(target)
    assert read_measure_file(str(tmp_path / "link")) is None


def test_exit_code_from_slurm_variables():
    assert exit_code_of({"SLURM_JOB_EXIT_CODE2": "3:0", "SLURM_JOB_EXIT_CODE": "768"}) == 3
    assert exit_code_of({"SLURM_JOB_EXIT_CODE2": "0:9"}) == 137
    assert exit_code_of({"SLURM_JOB_EXIT_CODE": "256"}) == 1
    assert exit_code_of({}) is None


def test_epilog_record_from_comment_and_measure_file(tmp_path):
    path = tmp_path / str(os.getuid()) / "xmem-measure-42.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"peak_bytes": 6 * GIB}))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "ann", "SLURM_JOB_UID": str(os.getuid()),  # the file's owner
           "SLURM_JOB_COMMENT": "x " + STAMP.comment(),
           "SLURM_JOB_EXIT_CODE2": "0:0", "SLURM_JOB_GPUS": "0"}
    record = epilog_record(env, measure_dir=str(tmp_path), nvml=lambda g, s: None, now=lambda: 5.0)
    assert record.to_json() == {"job_id": "42", "user": "ann", "gpu_type": "a100", "gres": "mps:40",
                                "estimate_bytes": 7 * GIB, "needed_bytes": 8 * GIB, "exit_code": 0,
                                "measured_bytes": 6 * GIB, "measured_by": "file", "ended_at": 5.0,
                                "deferred_state": None, "request_before": None}
    assert not path.exists()


def test_epilog_takes_nvml_before_the_file_the_job_wrote(tmp_path):
    seen = []

    def nvml(gpus, since):
        seen.append(gpus)
        return 3 * GIB

    path = tmp_path / str(os.getuid()) / "xmem-measure-9.json"
    path.parent.mkdir()
    path.write_text("99")  # the job's own claim: not what root measured
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_COMMENT": STAMP.comment(),
           "SLURM_JOB_GPUS": "1,3"}
    record = epilog_record(env, measure_dir=str(tmp_path), nvml=nvml)
    assert seen == [[1, 3]] and (record.measured_bytes, record.measured_by) == (3 * GIB, "nvml")
    assert not path.exists()


def test_epilog_records_nothing_for_a_job_with_no_estimate_and_no_measurement(tmp_path):
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_COMMENT": "plain", "SLURM_JOB_GPUS": "0"}
    assert epilog_record(env, measure_dir=str(tmp_path), nvml=lambda g, s: None) is None


def test_epilog_records_the_outcome_of_a_deferred_estimate(tmp_path):
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_COMMENT": STAMP.comment() + ";state=done;was=gpu:1"}
    record = epilog_record(env, measure_dir=str(tmp_path), nvml=lambda g, s: None)
    assert (record.deferred_state, record.request_before, record.gres) == ("done", "gpu:1", "mps:40")
    failed = {"SLURM_JOB_ID": "13", "SLURM_JOB_COMMENT": "xmem:state=failed;was=gpu:1;why=cannot+estimate"}
    record = epilog_record(failed, measure_dir=str(tmp_path), nvml=lambda g, s: None)
    assert (record.deferred_state, record.estimate_bytes) == ("failed", None)


def test_epilog_records_a_put_off_job_whose_estimate_never_came_back_as_failed(tmp_path):
    """A job that ran with its comment still pending (xmem.slurm.putoff: the detached estimate died) ran unchanged."""
    env = {"SLURM_JOB_ID": "14", "SLURM_JOB_COMMENT": "xmem:state=pending;was=gpu:1;why=goes+on+in+the+background"}
    record = epilog_record(env, measure_dir=str(tmp_path), nvml=lambda g, s: None)
    assert (record.deferred_state, record.request_before, record.estimate_bytes) == ("failed", "gpu:1", None)


def test_scontrol_record_keeps_spaces_inside_a_value():
    from xmem.slurm.scontrol import parse_scontrol_record
    line = ("JobId=42 JobName=train job UserId=alice(1000) JobState=PENDING Reason=JobHeldUser "
            "Comment=xmem:state=pending why=estimating+now TresPerNode=gres:gpu:a100:1 TresPerJob=(null)\n")
    fields = parse_scontrol_record(line)
    assert fields["JobName"] == "train job"
    assert fields["Comment"] == "xmem:state=pending why=estimating+now"
    assert fields["TresPerNode"] == "gres:gpu:a100:1"
    assert fields["TresPerJob"] == "(null)"


def test_node_settings_come_from_the_option_else_the_environment_else_the_default():
    env = {"XMEM_STORE": "/site/records.jsonl", "XMEM_MEASURE_DIR": "/tmp/measure"}
    assert NodeSettings.read(env) == NodeSettings("/site/records.jsonl", "/tmp/measure")
    assert NodeSettings.read(env, store="/mine.jsonl", measure_dir="/m") == NodeSettings("/mine.jsonl", "/m")
    assert NodeSettings.read({}) == NodeSettings(DEFAULT_STORE, None)
    assert NodeSettings.read({"XMEM_MEASURE_DIR": ""}).measure_dir is None  # empty: unset, as --measure-dir's was


def test_sacct_gpumem_takes_each_jobs_largest_step_in_slurms_units(tmp_path):
    sacct = tmp_path / "sacct"
    sacct.write_text("#!/bin/sh\ncat <<'EOF'\n7|\n7.batch|cpu=00:00:01,gres/gpumem=1.5G,mem=10K\n"
                     "7.0|cpu=00:00:02,gres/gpumem=2048M,gres/gpuutil=3\n8.batch|cpu=1,gres/gpumem=0,mem=1K\n"
                     "9.batch|gres/gpumem=512\nEOF\n")
    sacct.chmod(0o755)
    assert sacct_gpumem(["7", "8", "9", "x;rm"], sacct=str(sacct)) == {"7": 2 * GIB, "9": 512}
    assert sacct_gpumem(["7"], sacct=str(tmp_path / "absent")) == {}
