"""Reference records: parsing, the job command that re-creates each, and the reference jobs running for real."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.bench.records import (
    CNN_MODELS, BadRecord, Unreproducible, job_command, job_env, load_references, parse_reference,
)

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "benchmarks" / "jobs"
DEV_DATA = ROOT / "benchmarks" / "data" / "xmem-dev.jsonl"


def record(model="ConvNeXtTiny", optimiser="AdamW", mode=None, **extra_info) -> dict:
    section = {"memory": 3_000_000_000, "oom": False, "runtime": 2_500_000_000, "ground": 2_900_000_000,
               "real_oom": False, "2nd verification": {"oom": False, "error": 0.01}}
    return {"path": "p/x.json", "study": "001-Anova/CNN",
            "result": {"train info": {"model": model, "batch_size": 300, "optimiser": optimiser,
                                      "zero_grad_mode": mode, "total_gpu_memory": 12_622_168_064,
                                      "gpu_name": "NVIDIA GeForce RTX 3060", **extra_info},
                       "solution": section, "DNNmem": {**section, "2nd verification": {"oom": None}}}}


def test_record_fields_and_estimators_are_parsed():
    ref = parse_reference(record())
    assert (ref.model, ref.optimizer, ref.batch_size, ref.capacity_bytes) == ("ConvNeXtTiny", "AdamW", 300,
                                                                            12_622_168_064)
    assert (ref.ground_bytes, ref.real_oom) == (2_900_000_000, False)
    assert ref.estimators["solution"].seconds == pytest.approx(2.5)  # the data stores nanoseconds
    assert ref.estimators["solution"].capped_oom is False
    assert ref.estimators["DNNmem"].capped_oom is None


def test_null_zero_grad_mode_means_just_before_backward():
    assert parse_reference(record(mode=None)).zero_grad_mode == 0
    assert parse_reference(record(mode=0)).zero_grad_mode == 0


def test_missing_field_names_the_field():
    line = record()
    del line["result"]["train info"]["batch_size"]
    with pytest.raises(BadRecord, match="batch_size"):
        parse_reference(line)


def test_bad_line_reports_its_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record()) + "\n{not json\n")
    with pytest.raises(BadRecord, match=r"d.jsonl:2"):
        load_references(path)


def test_cnn_record_builds_the_cnn_job_command():
    cmd = job_command(parse_reference(record(mode=2)), JOBS, python="py")
    assert cmd == ["py", str(JOBS / "cnn.py"), "--model", "ConvNeXtTiny", "--optimizer", "AdamW",
                   "--batch-size", "300", "--zero-grad-mode", "2"]


def test_transformer_record_builds_the_transformer_job_command():
    cmd = job_command(parse_reference(record(model="EleutherAI/gpt-neo-125M", optimiser="Adafactor")), JOBS)
    assert cmd[1] == str(JOBS / "transformer.py")
    assert cmd[cmd.index("--model") + 1] == "EleutherAI/gpt-neo-125M"


def test_modern_options_become_flags_and_environment():
    ref = parse_reference(record(model="openai-community/gpt2",
                                 options={"amp": "bf16", "fused": True, "alloc_conf": "expandable_segments:True"}))
    cmd = job_command(ref, JOBS)
    assert cmd[-3:] == ["--amp", "bf16", "--fused"]
    assert job_env(ref) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_unknown_model_or_optimizer_is_unreproducible_with_a_reason():
    with pytest.raises(Unreproducible, match="unknown model 'AlexNet'"):
        job_command(parse_reference(record(model="AlexNet")), JOBS)
    with pytest.raises(Unreproducible, match="optimizer 'LBFGS'"):
        job_command(parse_reference(record(optimiser="LBFGS")), JOBS)


def test_every_dev_record_has_a_job():
    refs = load_references(DEV_DATA)
    assert len(refs) == sum(1 for text in DEV_DATA.read_text().splitlines() if text.strip())  # none skipped
    assert all(job_command(r, JOBS) for r in refs)


def test_cnn_model_list_matches_the_cnn_job():
    spec = importlib.util.spec_from_file_location("bench_cnn_job", JOBS / "cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.MODELS) == CNN_MODELS


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_cnn_job_trains_for_real_on_cpu(mode):
    subprocess.run([sys.executable, str(JOBS / "cnn.py"), "--model", "MnasNet", "--optimizer", "Adagrad",
                    "--batch-size", "2", "--iterations", "2", "--zero-grad-mode", str(mode), "--device", "cpu"],
                   check=True, timeout=120)


def test_transformer_job_trains_for_real_on_cpu():
    subprocess.run([sys.executable, str(JOBS / "transformer.py"), "--model", "T5-small", "--optimizer", "Adafactor",
                    "--batch-size", "2", "--seq-len", "8", "--iterations", "2", "--device", "cpu"],
                   check=True, timeout=180)
