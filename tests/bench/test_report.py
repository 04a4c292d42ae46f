"""The benchmark's report and its command line, on hand-made records (no estimator needed: --rescore)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.bench.records import parse_reference
from xmem.bench.report import OURS, BenchResult, summary, table_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_accuracy.py"
GIB = 1 << 30
MIB = 1 << 20


def line(path: str, model: str, ground: int, real_oom: bool = False, xmem: int | None = None) -> dict:
    section = {"memory": xmem if xmem is not None else ground, "oom": False, "runtime": 20_000_000_000,
               "ground": ground, "real_oom": real_oom, "2nd verification": {"oom": None}}
    return {"path": path, "study": "s", "result": {
        "train info": {"model": model, "batch_size": 100, "optimiser": "SGD", "zero_grad_mode": None,
                       "total_gpu_memory": 12 * GIB, "gpu_name": "NVIDIA GeForce RTX 3060"},
        "solution": section}}


def load_script():
    spec = importlib.util.spec_from_file_location("bench_accuracy_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_record_whose_job_cannot_be_recreated_is_reported_with_the_reason():
    ref = parse_reference(line("a", "AlexNet", 4 * GIB))
    result = load_script().estimate_record(ref, sys.executable, iterations=3, timeout=60)
    assert result.estimate_bytes is None
    assert "unknown model 'AlexNet'" in result.error
    report = summary([ref], {ref.path: result}, {})
    assert report["not_estimated"] == [{"path": "a", "reason": result.error}]


def test_summary_scores_ours_and_the_recorded_estimator_per_model():
    refs = [parse_reference(line("a", "MnasNet", 4 * GIB, xmem=5 * GIB)),
            parse_reference(line("b", "MnasNet", 4 * GIB, xmem=3 * GIB)),
            parse_reference(line("c", "vgg16", 8 * GIB))]
    results = {"a": BenchResult("a", 4 * GIB + GIB // 10, False, 2.0),  # +2.5 %
               "b": BenchResult("b", 4 * GIB - GIB // 5, False, 4.0),  # -5 %, an under-estimate
               "c": BenchResult("c", 8 * GIB, False, 3.0)}  # exact
    report = summary(refs, results, {"data": "hand"})
    ours = report["scores"][OURS]
    assert ours["MnasNet"]["mre"] == pytest.approx(0.0375)  # median of 2.5 % and 5 %
    assert ours["overall"]["mre"] == pytest.approx(0.025)  # median of 0, 2.5 %, 5 %
    assert ours["overall"]["under_share"] == pytest.approx(1 / 3)
    assert ours["overall"]["median_seconds"] == pytest.approx(3.0)
    assert report["scores"]["xMem"]["MnasNet"]["mre"] == pytest.approx(0.25)  # 5 vs 4 and 3 vs 4 GiB
    assert report["targets_met"]["under_share"] is False
    assert [row[:2] for row in table_rows(report)][:2] == [["MnasNet", OURS], ["MnasNet", "xMem"]]
    assert ours["overall"]["short_request_share"] is None  # no margin given

    with_margin = summary(refs, results, {}, needed=lambda estimate: int(estimate * 1.1))
    assert with_margin["scores"][OURS]["overall"]["short_request_share"] == 0  # b: 3.8 GiB x 1.1 covers 4 GiB
    assert with_margin["scores"]["xMem"]["MnasNet"]["short_request_share"] == pytest.approx(1 / 2)  # 3.3 < 4


def test_rescore_writes_summary_and_picture(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(line(p, "MnasNet", 4 * GIB)) for p in ("a", "b")) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "estimates.jsonl").write_text(
        json.dumps({"path": "a", "estimate_bytes": 4 * GIB, "oom": False, "seconds": 1.0}) + "\n"
        + json.dumps({"path": "b", "estimate_bytes": None, "oom": None, "seconds": 0.5,
                      "error": "estimate failed: TraceError: boom"}) + "\n")
    estimation = {"command": "bench_accuracy.py --jobs 1", "date": "2026-11-29T12:00:00+00:00", "jobs": 1,
                  "reference_stack": True, "wall_seconds": 1053.0}
    (out / "summary.json").write_text(json.dumps({"estimation": estimation}))
    done = subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), "--rescore"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "summary.json").read_text())
    assert report["estimated"] == 1
    assert report["not_estimated"] == [{"path": "b", "reason": "estimate failed: TraceError: boom"}]
    assert report["estimation"] == estimation  # the estimates' own run, not the rescore, accounts for them
    assert report["margin"]["relative"] == pytest.approx(0.10)  # etc/xmem.toml's margin
    assert (out / "accuracy.png").stat().st_size > 10_000
    assert "not estimated: b: estimate failed: TraceError: boom" in done.stdout


def test_bad_data_file_is_a_one_line_error(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"path": "x"}\n')
    done = subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "data.jsonl:1: missing field 'result'" in done.stderr


def test_identical_jobs_share_one_key_and_the_order_interleaves_kinds():
    script = load_script()
    a1 = parse_reference(line("a1", "MnasNet", 4 * GIB))
    a2 = parse_reference(line("a2", "MnasNet", 4 * GIB))  # same job, same GPU and capacity as a1
    b = parse_reference(line("b", "vgg16", 4 * GIB))
    unknown1, unknown2 = parse_reference(line("u1", "AlexNet", GIB)), parse_reference(line("u2", "AlexNet", GIB))
    assert script.job_key(a1) == script.job_key(a2) != script.job_key(b)
    assert script.job_key(unknown1) != script.job_key(unknown2)  # each keeps its own reason
    assert [r.path for r in script.interleaved([a1, a2, b])] == ["a1", "b", "a2"]


def demo_wheel(directory: Path, version: str) -> Path:
    """A minimal pure-Python wheel, so pip installs it with no index."""
    import zipfile
    wheel = directory / f"demo_stack_pkg-{version}-py3-none-any.whl"
    info = f"demo_stack_pkg-{version}.dist-info"
    files = {
        "demo_stack_pkg/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: demo-stack-pkg\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def test_reference_stack_installs_once_and_again_when_the_pins_change(tmp_path):
    script = load_script()
    requirements, target = tmp_path / "requirements.txt", tmp_path / "stack"
    requirements.write_text(f"{demo_wheel(tmp_path, '1.0')}\n")
    assert script.reference_stack(sys.executable, requirements, target) == target
    assert "1.0" in (target / "demo_stack_pkg" / "__init__.py").read_text()

    (target / "left-by-hand").write_text("")  # an up-to-date stack is reused as it is
    script.reference_stack(sys.executable, requirements, target)
    assert (target / "left-by-hand").exists()

    requirements.write_text(f"{demo_wheel(tmp_path, '2.0')}\n")  # new pins: a clean reinstall
    script.reference_stack(sys.executable, requirements, target)
    assert "2.0" in (target / "demo_stack_pkg" / "__init__.py").read_text()
    assert not (target / "left-by-hand").exists()


def test_reference_interpreter_imports_the_stack_first_then_the_interpreters_own_libraries(tmp_path):
    script = load_script()
    requirements, target = tmp_path / "requirements.txt", tmp_path / "stack"
    requirements.write_text(f"{demo_wheel(tmp_path, '1.0')}\n")
    script.reference_stack(sys.executable, requirements, target)
    interpreter = script.reference_interpreter(sys.executable, target)
    assert Path(interpreter).parent.parent == tmp_path / "reference-venv"
    shown = subprocess.run([interpreter, "-c", "import demo_stack_pkg, torch, xmem; print(demo_stack_pkg.__file__, "
                            "torch.__file__, xmem.__file__)"], capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout.split()
    import torch
    import xmem
    assert shown == [str(target / "demo_stack_pkg" / "__init__.py"), torch.__file__, xmem.__file__]
    assert script.reference_interpreter(sys.executable, target) == interpreter  # made once, reused


def test_our_figure_leaves_the_context_out_where_the_record_does():
    from xmem.bench.report import our_outcome
    xmem_record = parse_reference(line("a", "MnasNet", 4 * GIB))  # the xMem harness's peaks leave the context out
    measured = parse_reference({"path": "m", "result": {
        "train info": line("m", "MnasNet", 4 * GIB)["result"]["train info"],
        "ground": {"memory": 4 * GIB, "real_oom": False}}})  # measure_gpu.py's peaks count it
    result = BenchResult("a", 4 * GIB + 300 * MIB, False, 1.0, details={"context_bytes": 300 * MIB})
    assert not xmem_record.ground_has_context and measured.ground_has_context
    assert our_outcome(xmem_record, result).estimate == 4 * GIB
    assert our_outcome(measured, result).estimate == 4 * GIB + 300 * MIB
