"""The GPU measurement runner's GPU-free parts: job plans, the NVML peak, the record schema, the no-GPU refusal."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from xmem.bench.records import job_command, job_env, load_references, parse_reference

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "measure_gpu.py"
JOBS = ROOT / "benchmarks" / "jobs"


def load_script():
    spec = importlib.util.spec_from_file_location("measure_gpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mg = load_script()


def test_nvml_peak_is_the_rise_over_the_first_sample():
    # the reference measurements' rule: max(used) - used at the first sample
    assert mg.nvml_peak([500, 900, 1700, 1200]) == 1200
    assert mg.nvml_peak([]) == 0


def test_poller_samples_a_reader_until_stopped():
    values = iter(range(10**6))
    poller = mg.Poller(lambda: next(values), period=0.001)
    assert poller.samples == [0]  # taken at construction, before the job starts
    poller.start()
    time.sleep(0.05)
    poller.stop.set()
    poller.join()
    assert len(poller.samples) > 5 and poller.samples == sorted(poller.samples)


def test_dev_data_gives_its_distinct_jobs():
    refs = load_references(ROOT / "benchmarks" / "data" / "xmem-dev.jsonl")
    distinct = {(r.model, r.optimizer, r.batch_size, r.zero_grad_mode, tuple(sorted(r.options.items())))
                for r in refs}
    assert len(distinct) < len(refs)  # the data repeats some jobs: the test must see them merged
    specs = mg.specs_from_data(refs)
    assert len(specs) == len(distinct)
    assert len({s.name for s in specs}) == len(distinct)


def test_every_modern_job_can_be_recreated():
    for spec in mg.MODERN_PLAN:
        assert job_command(mg.spec_reference(spec), JOBS)
    kinds = {k: v for s in mg.MODERN_PLAN for k, v in s.options.items()}
    assert {"amp", "fused", "alloc_conf", "dtype"} <= set(kinds)


def test_measurement_record_is_read_back_as_a_reference_with_its_options():
    spec = mg.JobSpec("openai-community/gpt2", "AdamW", 16, 0, {"amp": "bf16",
                                                                 "alloc_conf": "expandable_segments:True"})
    raw = {"gpu_name": "NVIDIA H200", "total_bytes": 150_000_000_000, "oom": False, "seconds": 3.2,
           "nvml_used": [600, 5_000_600, 4_000_600], "max_memory_reserved": 4_200_000,
           "max_memory_allocated": 3_900_000, "context_bytes": 500_000_000, "snapshot": "x.pickle"}
    ref = parse_reference(mg.measurement_record(spec, raw, "measure_gpu/modern"))
    assert (ref.ground_bytes, ref.real_oom, ref.measured_reserved_bytes) == (5_000_000, False, 4_200_000)
    assert (ref.model, ref.batch_size, ref.zero_grad_mode, ref.capacity_bytes) == ("openai-community/gpt2", 16, 0,
                                                                                   150_000_000_000)
    assert ref.estimators == {}
    cmd = job_command(ref, JOBS)
    assert cmd[cmd.index("--amp") + 1] == "bf16"
    assert job_env(ref) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_without_a_gpu_it_stops_before_running_anything(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--plan", "modern", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no usable NVIDIA GPU" in done.stderr
    assert not (tmp_path / "o").exists()
