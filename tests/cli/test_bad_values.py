"""Bad values a user or an admin can type (issue 35 item 3): each is refused in one line with its documented exit
code, before any trace, never with a traceback."""

import json

import pytest
from typer.testing import CliRunner

import xmem.cli.calibrate  # noqa: F401 - registers the commands
import xmem.cli.check  # noqa: F401
import xmem.cli.estimate  # noqa: F401
import xmem.cli.fit  # noqa: F401
import xmem.cli.slurm  # noqa: F401
from xmem.cli import app
from xmem.cli.exit_codes import EXIT_USAGE
from xmem.config import ConfigError, load_site_config

RUNNER = CliRunner()
NEVER_RUN = "raise SystemExit('the program must not run: the option is refused first')\n"


def refused(args: list[str], code: int = EXIT_USAGE) -> str:
    """Run the CLI; it must exit with `code` on its own (SystemExit), not on an exception of ours. Its stderr."""
    result = RUNNER.invoke(app, args)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(NEVER_RUN)
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --batch-size 4\n")
    return tmp_path


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "NaN"])
@pytest.mark.parametrize("verb", [
    ["check", "--gpu", "a100", "job.sh"],
    ["estimate", "--gpu", "a100", "--", "python", "train.py"],
    ["fit", "--gpu", "a100", "--vary", "batch-size=1..8", "--", "python", "train.py", "--batch-size", "{}"],
])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_a_bad_option(job, verb, value):
    """int(nan) and int(inf) in the tracer's CPU limit were internal errors (exit 1) after the job was parsed."""
    out = refused([verb[0], "--timeout", value, *verb[1:]])
    assert "--timeout" in out


def test_a_timeout_refused_under_json_is_one_json_object(job):
    result = RUNNER.invoke(app, ["estimate", "--json", "--timeout", "nan", "--", "python", "train.py"])
    assert result.exit_code == EXIT_USAGE
    assert json.loads(result.stdout)["error"] == "bad_option"


@pytest.mark.parametrize("vary", ["batch-size=1.." + "9" * 5000, "batch-size=" + "1" * 21 + ".." + "2" * 21,
                                  "batch-size=1..²", "batch-size=1..٣٢"])
def test_a_vary_range_beyond_whole_ascii_numbers_is_a_bad_option(job, vary):
    """A 5000-digit HIGH reached int(), which refuses 4300 digits: an internal error (exit 1)."""
    out = refused(["fit", "--vary", vary, "--", "python", "train.py", "--batch-size", "{}"])
    line = out.strip().splitlines()[-1]
    assert line.startswith("xmem-slurm fit: --vary") and len(line) < 200


@pytest.mark.parametrize("setting", ["timeout_s = nan", "timeout_s = inf", "timeout_s = 1e9",
                                     "memory_limit_gib = inf", "memory_limit_gib = nan"])
def test_a_site_config_number_that_is_not_finite_is_a_config_error(tmp_path, setting):
    path = tmp_path / "xmem.toml"
    path.write_text(f"[estimate]\n{setting}\n")
    with pytest.raises(ConfigError, match=f"estimate.{setting.split()[0]}"):
        load_site_config(path)


STORE_LINES = {
    "a size as text": {"estimate_bytes": "5000000000"},
    "a user as a list": {"user": ["ann"]},
    "an infinite peak": {"measured_bytes": float("inf")},
    "a GPU type as a number": {"gpu_type": 7},
    "a source as a list": {"measured_by": ["nvml"]},
    "a negative size": {"estimate_bytes": -5},
    "an exit code of 70 digits": {"exit_code": 10 ** 70},
    "a job id as a number": {"job_id": 5},
}


def store_line(**changed: object) -> str:
    good = {"job_id": "1", "user": "ann", "gpu_type": "a100", "estimate_bytes": 5 << 30, "measured_bytes": 6 << 30,
            "measured_by": "nvml", "exit_code": 0}
    return json.dumps({**good, **changed}) + "\n"


@pytest.mark.parametrize("what", STORE_LINES)
def test_calibrate_and_report_on_a_hand_corrupted_store_say_so_in_a_line(tmp_path, what):
    store = tmp_path / "records.jsonl"
    store.write_text(store_line(**STORE_LINES[what]) + '{"job_id": "2", "user": [[[[\n')
    out = refused(["calibrate", "--from-store", "--store", str(store), "--min-users", "1", "--dry-run"])
    assert "2 damaged line(s)" in out and "no usable record" in out
    assert RUNNER.invoke(app, ["report", "--store", str(store), "--json"]).exit_code == 0


def test_calibrate_on_a_store_that_is_not_a_file_says_so(tmp_path):
    (tmp_path / "records.jsonl").mkdir()
    out = refused(["calibrate", "--from-store", "--store", str(tmp_path / "records.jsonl"), "--dry-run"])
    assert "cannot read the record store" in out
    assert "cannot read the record store" in refused(["report", "--store", str(tmp_path / "records.jsonl")])


def test_calibrate_with_an_unreadable_calibration_in_effect_says_so(tmp_path):
    store, out = tmp_path / "records.jsonl", tmp_path / "calibration.toml"
    store.write_text(store_line())
    out.write_bytes(b"\xff\xfe[overhead.\"a100\"]\n")
    said = refused(["calibrate", "--from-store", "--store", str(store), "--min-users", "1", "--out", str(out)])
    assert "cannot read the calibration in effect" in said
    assert out.read_bytes().startswith(b"\xff")  # left as it was
