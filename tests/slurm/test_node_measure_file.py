"""S4 (issue 14): the Epilog (root) trusts a job's measure file only when the job's own user wrote it.

The measure directory is world-writable (every job writes its file there), so another user can plant
`xmem-measure-<id>.json` for someone else's job, point it elsewhere with a symlink, make it huge, or write numbers
that break a naive reader (`1e400` parses as infinity). Each is refused, the file removed, the record kept.
"""

import json
import os

import pytest

from tests.throwaway_users import users_fixture, visible_dir
from xmem.slurm.node import MEASURE_FILE_MAX_BYTES, epilog_record, read_measure_file
from xmem.slurm.stamp import JobStamp

GIB = 1 << 30
STAMP = JobStamp(peak_bytes=3 * GIB, needed_bytes=4 * GIB, gpu_type="a100", request="gpu:a100:1", action="rewrite")


users = users_fixture("jobuser", "other")


@pytest.fixture
def measure_dir():
    with visible_dir() as path:
        path.chmod(0o1777)  # as the dev cluster and the site install make it
        yield path


def epilog_env(job_id: str, user) -> dict:
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_USER": user.name, "SLURM_JOB_UID": str(user.uid),
            "SLURM_JOB_COMMENT": STAMP.comment(), "SLURM_JOB_EXIT_CODE2": "0:0"}


def write_as(user, path, text: str) -> None:
    user.run("/bin/sh", "-c", 'printf "%s" "$1" > "$2"', "sh", text, str(path))


def record_for(job_id, user, measure_dir):
    return epilog_record(epilog_env(job_id, user), measure_dir=str(measure_dir), nvml=lambda g, s: None)


def test_the_jobs_own_file_is_read_and_removed(users, measure_dir):
    job_user, _ = users
    path = measure_dir / "xmem-measure-11.json"
    write_as(job_user, path, json.dumps({"peak_bytes": 2 * GIB}))
    record = record_for("11", job_user, measure_dir)
    assert (record.measured_bytes, record.measured_by) == (2 * GIB, "file") and not path.exists()


def test_a_file_another_user_planted_for_the_job_is_refused_and_removed(users, measure_dir):
    job_user, other = users
    path = measure_dir / "xmem-measure-12.json"
    write_as(other, path, json.dumps({"peak_bytes": 99 * GIB}))
    record = record_for("12", job_user, measure_dir)
    assert record.measured_bytes is None and record.estimate_bytes == 3 * GIB and not path.exists()


def test_a_symlink_planted_by_the_job_user_is_not_followed(users, measure_dir):
    job_user, _ = users
    with visible_dir() as elsewhere:
        secret = elsewhere / "root-only.json"
        secret.write_text(json.dumps({"peak_bytes": 5 * GIB}))
        job_user.run("ln", "-s", str(secret), str(measure_dir / "xmem-measure-13.json"))
        record = record_for("13", job_user, measure_dir)
        assert record.measured_bytes is None and secret.exists()


@pytest.mark.parametrize("text", [
    "1e400", '{"peak_bytes": 1e400}', '{"peak_bytes": -1e400}', '{"peak_bytes": NaN}', "Infinity",
    '{"peak_bytes": 1e300}', '{"peak_bytes": true}', '{"peak_bytes": -5}', "[" * 3000 + "]" * 3000,
    '{"peak_bytes": 123}' + " " * MEASURE_FILE_MAX_BYTES,
], ids=["inf", "inf-field", "minus-inf", "nan", "infinity", "out-of-range", "bool", "negative", "deep-nesting",
        "over-4-KiB"])
def test_a_file_with_no_sane_number_gives_no_measurement_and_the_record_stays(users, measure_dir, text):
    job_user, _ = users
    path = measure_dir / "xmem-measure-14.json"
    write_as(job_user, path, text)
    record = record_for("14", job_user, measure_dir)
    assert record is not None and record.measured_bytes is None and record.estimate_bytes == 3 * GIB
    assert not path.exists()


def test_a_file_at_the_size_limit_is_read_whole(tmp_path):
    path = tmp_path / "m.json"
    body = '{"peak_bytes": 123}'
    path.write_text(body + " " * (MEASURE_FILE_MAX_BYTES - len(body)))
    assert read_measure_file(str(path), os.getuid()) == 123
    assert read_measure_file(str(path), os.getuid() + 1) is None  # not the job user's file
