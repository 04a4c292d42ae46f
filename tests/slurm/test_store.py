"""The epilog's JSONL store and `report`'s summary, figures derived by hand."""

import json
import multiprocessing

import pytest

from xmem.slurm.store import JobRecord, append_record, read_records, summarize

GIB = 1 << 30


def test_records_roundtrip_in_order(tmp_path):
    store = tmp_path / "sub" / "records.jsonl"
    a = JobRecord(job_id="1", user="ann", gpu_type="a100", gres="mps:40", estimate_bytes=10, needed_bytes=11,
                  exit_code=0, measured_bytes=9, measured_by="file", ended_at=1.5)
    b = JobRecord(job_id="2")
    append_record(store, a)
    append_record(store, b)
    assert read_records(store) == [a, b]


def test_damaged_and_foreign_lines_are_skipped(tmp_path):
    store = tmp_path / "r.jsonl"
    store.write_text('{"job_id": "1", "gpu_type": "h100"}\n{"job_id": \n[1, 2]\n{"no_id": 1}\n'
                     '{"job_id": "2", "future_field": true}\n')
    assert [r.job_id for r in read_records(store)] == ["1", "2"]


def test_missing_store_is_empty(tmp_path):
    assert read_records(tmp_path / "none.jsonl") == []


def _append_many(args):
    path, start = args
    for i in range(start, start + 50):
        append_record(path, JobRecord(job_id=str(i), user="u" * 500))


def test_concurrent_epilogs_never_interleave_lines(tmp_path):
    store = tmp_path / "r.jsonl"
    with multiprocessing.Pool(4) as pool:
        pool.map(_append_many, [(store, k * 100) for k in range(4)])
    lines = store.read_text().splitlines()
    assert len(lines) == 200
    assert all(json.loads(line)["user"] == "u" * 500 for line in lines)


def test_summary_per_gpu_type():
    records = [
        # a100: estimates 10, 12, 8 GiB against 10 GiB measured: errors 0, +0.2, -0.2
        JobRecord("1", gpu_type="a100", estimate_bytes=10 * GIB, needed_bytes=11 * GIB, measured_bytes=10 * GIB),
        JobRecord("2", gpu_type="a100", estimate_bytes=12 * GIB, needed_bytes=13 * GIB, measured_bytes=10 * GIB),
        JobRecord("3", gpu_type="a100", estimate_bytes=8 * GIB, needed_bytes=9 * GIB, measured_bytes=10 * GIB),
        JobRecord("4", gpu_type="a100", estimate_bytes=8 * GIB),  # no measurement
        JobRecord("5", estimate_bytes=GIB, measured_bytes=2 * GIB),  # type unknown
    ]
    a100, unknown = summarize(records)
    assert (a100.gpu_type, a100.jobs, a100.measured) == ("a100", 4, 3)
    assert a100.median_abs_rel_error == pytest.approx(0.2)  # |errors| sorted 0, 0.2, 0.2
    assert a100.p90_abs_rel_error == pytest.approx(0.2)
    assert a100.mean_rel_error == pytest.approx(0.0)
    assert a100.underestimates == 1
    assert a100.over_request == 1  # job 3: 10 GiB used, request sized for 9
    assert (unknown.gpu_type, unknown.measured, unknown.underestimates) == ("unknown", 1, 1)
    assert unknown.median_abs_rel_error == pytest.approx(0.5)


def test_summary_without_measurements_has_no_error_figures():
    (s,) = summarize([JobRecord("1", gpu_type="h100", estimate_bytes=GIB)])
    assert s.measured == 0 and s.median_abs_rel_error is None and s.underestimates == 0
