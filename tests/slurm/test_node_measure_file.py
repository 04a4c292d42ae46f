"""The job's measure file: made by the root Prolog for the job's user (issue 21), trusted by the Epilog (root) only
when it is still that user's regular file (issue 14).

The measure directory is root's (0755): the Prolog makes `<dir>/<uid>/` (0700, the user's) and in it the job's file,
exclusively, without following links. Another user can plant nothing there (issue 21: in the old world-writable
directory a symlink at the next job's name made the victim's job overwrite the victim's own file). Inside their
own directory the job's user can still leave a link or write numbers that break a naive reader (`1e400` parses
as infinity): each is refused, the file removed, the record kept.
"""

import json
import os
import stat

import pytest

from tests.throwaway_users import users_fixture, visible_dir
from xmem.slurm.node import (MEASURE_FILE_MAX_BYTES, MeasureDirRefused, epilog_record, prepare_measure_file,
                             read_measure_file)
from xmem.slurm.stamp import JobStamp

GIB = 1 << 30
STAMP = JobStamp(peak_bytes=3 * GIB, needed_bytes=4 * GIB, gpu_type="a100", request="gpu:a100:1", action="rewrite")


users = users_fixture("jobuser", "other")


@pytest.fixture
def measure_dir():
    with visible_dir() as path:  # root's, 0755: as the dev cluster and the site install make it
        yield path


def prepared(measure_dir, job_id: str, user) -> str:
    """What the root Prolog does before the job (the TaskProlog then exports the path as XMEM_MEASURE_FILE)."""
    return prepare_measure_file(str(measure_dir), user.uid, user.gid, job_id)


def epilog_env(job_id: str, user) -> dict:
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_USER": user.name, "SLURM_JOB_UID": str(user.uid),
            "SLURM_JOB_COMMENT": STAMP.comment(), "SLURM_JOB_EXIT_CODE2": "0:0"}


def write_as(user, path, text: str) -> None:
    user.run("/bin/sh", "-c", 'printf "%s" "$1" > "$2"', "sh", text, str(path))


def record_for(job_id, user, measure_dir):
    return epilog_record(epilog_env(job_id, user), measure_dir=str(measure_dir), nvml=lambda g, s: None)


def test_the_jobs_own_file_is_read_and_removed(users, measure_dir):
    job_user, _ = users
    path = prepared(measure_dir, "11", job_user)
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == job_user.uid and stat.S_IMODE(info.st_mode) == 0o600
    own = os.lstat(os.path.dirname(path))
    assert own.st_uid == job_user.uid and stat.S_IMODE(own.st_mode) == 0o700
    write_as(job_user, path, json.dumps({"peak_bytes": 2 * GIB}))
    record = record_for("11", job_user, measure_dir)
    assert (record.measured_bytes, record.measured_by) == (2 * GIB, "file") and not os.path.exists(path)


def test_another_users_symlink_cannot_make_the_victims_job_overwrite_its_file(users, measure_dir):
    victim, attacker = users
    precious = victim.home / "precious.txt"
    write_as(victim, precious, "the victim's work")
    prepared(measure_dir, "20", victim)  # the victim's directory exists from an earlier job
    os.unlink(measure_dir / str(victim.uid) / "xmem-measure-20.json")
    for where in (measure_dir / "xmem-measure-21.json", measure_dir / str(victim.uid) / "xmem-measure-21.json",
                  measure_dir / str(attacker.uid + 1000)):
        planted = attacker.run("ln", "-s", str(precious), str(where), check=False)
        assert planted.returncode != 0 and not os.path.lexists(where)
    path = prepared(measure_dir, "21", victim)
    write_as(victim, path, json.dumps({"peak_bytes": GIB}))  # the job, through $XMEM_MEASURE_FILE
    assert precious.read_text() == "the victim's work"


def test_a_world_writable_measure_directory_is_refused(users, measure_dir):
    victim, attacker = users
    measure_dir.chmod(0o1777)  # the old layout: anyone could plant the victim's directory as a link
    attacker.run("ln", "-s", str(attacker.home), str(measure_dir / str(victim.uid)))
    with pytest.raises(MeasureDirRefused, match="writable by root only"):
        prepared(measure_dir, "22", victim)
    assert not any(p.name.startswith("xmem-measure") for p in attacker.home.iterdir())


def test_the_job_users_own_leftover_link_is_replaced_not_followed(users, measure_dir):
    job_user, _ = users
    prepared(measure_dir, "23", job_user)
    with visible_dir() as elsewhere:
        secret = elsewhere / "root-only.json"
        secret.write_text("root's")
        link = measure_dir / str(job_user.uid) / "xmem-measure-24.json"
        job_user.run("ln", "-s", str(secret), str(link))
        path = prepared(measure_dir, "24", job_user)
        assert secret.read_text() == "root's" and not os.path.islink(path) and os.lstat(path).st_uid == job_user.uid


def test_a_symlink_planted_by_the_job_user_is_not_followed(users, measure_dir):
    job_user, _ = users
    with visible_dir() as elsewhere:
        secret = elsewhere / "root-only.json"
        secret.write_text(json.dumps({"peak_bytes": 5 * GIB}))
        path = prepared(measure_dir, "13", job_user)
        job_user.run("ln", "-sf", str(secret), path)  # after the Prolog, in the user's own directory
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
    path = prepared(measure_dir, "14", job_user)
    write_as(job_user, path, text)
    record = record_for("14", job_user, measure_dir)
    assert record is not None and record.measured_bytes is None and record.estimate_bytes == 3 * GIB
    assert not os.path.exists(path)


def test_a_file_at_the_size_limit_is_read_whole(tmp_path):
    path = tmp_path / "m.json"
    body = '{"peak_bytes": 123}'
    path.write_text(body + " " * (MEASURE_FILE_MAX_BYTES - len(body)))
    assert read_measure_file(str(path), os.getuid()) == 123
    assert read_measure_file(str(path), os.getuid() + 1) is None  # not the job user's file
