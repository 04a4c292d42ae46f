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


def test_sharding_cases_are_programs_here_started_as_rank_0_of_one(tmp_path):
    names = [case.name for case in mg.SHARDING_PLAN]
    assert len(set(names)) == len(names)
    for case in mg.SHARDING_PLAN:
        command = case.command("python")
        assert Path(command[1]).is_file() and command[1].startswith(str(ROOT / "tests" / "scripts"))
        child = mg.child_command(case.name, ["--case", case.name], tmp_path, 0)
        assert child[child.index("--case") + 1] == case.name  # the child finds it by name
    scripts = {case.script for case in mg.SHARDING_PLAN}
    assert {"fsdp1_lora.py", "fsdp2_mixed_precision.py", "deepspeed_zero.py", "dtensor_tp.py"} <= scripts
    # torchrun's rank-0 variables at world size 1: what the programs' init_process_group and set_device read
    assert mg.WORLD_OF_ONE["WORLD_SIZE"] == "1" and mg.WORLD_OF_ONE["LOCAL_RANK"] == "0"


def test_case_record_keeps_the_allocator_peaks_and_the_nvml_rise():
    raw = {"gpu_name": "NVIDIA H200", "oom": False, "seconds": 2.0, "nvml_used": [100, 900, 700],
           "max_memory_reserved": 600, "max_memory_allocated": 500, "context_bytes": 200, "snapshot": "zero2.pickle",
           "error": None, "versions": {"torch": "2.14.1"}}
    line = mg.case_record(mg.SHARDING_PLAN[0], raw)
    assert line["case"] == "fsdp1-lora-orig" and line["command"][0].endswith("fsdp1_lora.py")
    assert (line["ground"]["memory"], line["ground"]["max_memory_allocated"], line["ground"]["max_memory_reserved"],
            line["ground"]["snapshot"]) == (800, 500, 600, "zero2.pickle")


def test_without_a_gpu_the_sharding_plan_stops_before_running_anything(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--plan", "sharding", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no usable NVIDIA GPU" in done.stderr
    assert not (tmp_path / "o").exists()
