"""The reference jobs under the tracer: they are estimated unchanged (tiny batches, to stay fast)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xmem.gpus import find_gpu, load_catalog
from xmem.trace import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

JOBS = Path(__file__).resolve().parents[2] / "benchmarks" / "jobs"
A10 = find_gpu("A10", load_catalog())  # sm86, as the dev data's RTX 30xx cards


@pytest.mark.slow
def test_convnext_job_traces_through_trunc_normal_rejection_loop():
    # torch 2.14's trunc_normal_ loops `while mask.any()`: under fake tensors that needs a False answer to end
    trace = run_trace([sys.executable, str(JOBS / "cnn.py"), "--model", "ConvNeXtTiny", "--optimizer", "AdamW",
                       "--batch-size", "2"], iterations=3, gpu=A10, timeout=300)
    assert trace.iterations == 3
    assert {"cublas", "cudnn"} <= set(trace.libraries)


@pytest.mark.slow
def test_transformer_job_traces_without_convolutions():
    trace = run_trace([sys.executable, str(JOBS / "transformer.py"), "--model", "distilbert/distilgpt2",
                       "--optimizer", "Adafactor", "--batch-size", "2", "--zero-grad-mode", "0"],
                      iterations=3, gpu=A10, timeout=300)
    assert trace.iterations == 3
    assert "cublas" in trace.libraries and "cudnn" not in trace.libraries
