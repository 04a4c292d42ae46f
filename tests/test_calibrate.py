"""The overhead fit (context + library terms per GPU type) and `xmem-slurm calibrate`, with hand-derived figures."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from xmem.bench.overhead_fit import OverheadSample, calibration_toml, fit_overheads, library_terms
from xmem.gpus import catalog_from_tables, find_gpu, overhead_bytes
from xmem.gpus.catalog import CATALOG_PATH

MIB = 1 << 20
CNN, TRANSFORMER = frozenset({"cublas", "cudnn"}), frozenset({"cublas"})


def samples() -> list[OverheadSample]:
    a = "RTX-3060-12GB"
    b = "A100-SXM4-40GB"
    return ([OverheadSample(a, r * MIB, TRANSFORMER) for r in (500, 520, 540)]
            + [OverheadSample(a, r * MIB, CNN) for r in (700, 720, 760)]
            + [OverheadSample(b, r * MIB, CNN) for r in (900, 1000)])


def test_library_term_is_the_median_difference_where_a_gpu_has_runs_with_and_without_it():
    # RTX 3060: median with cuDNN 720, without 520 -> 200 MiB; the A100 has no run without cuDNN.
    # cuBLAS is in every run: not identifiable, so no term.
    assert library_terms(samples()) == {"cudnn": 200 * MIB}


def test_context_is_the_median_after_library_terms_and_always_used_libraries_cost_zero():
    fits = fit_overheads(samples())
    # RTX 3060 bases: 500, 520, 540, 700-200, 720-200, 760-200 -> sorted 500 500 520 520 540 560 -> median 520
    assert fits["RTX-3060-12GB"].context_bytes == 520 * MIB
    assert fits["RTX-3060-12GB"].library_bytes == {"cublas": 0, "cudnn": 200 * MIB}
    # A100: the pooled cuDNN term applies: 900-200, 1000-200 -> median 750
    assert fits["A100-SXM4-40GB"].context_bytes == 750 * MIB
    # spread p10-p90 of the RTX 3060 bases: ranks 0.5 -> 500, 4.5 -> 550: 50 MiB
    assert fits["RTX-3060-12GB"].spread_bytes == 50 * MIB


def test_a_higher_quantile_moves_only_the_context():
    fits = fit_overheads(samples(), q=1.0)
    assert fits["RTX-3060-12GB"].context_bytes == 560 * MIB
    assert fits["RTX-3060-12GB"].library_bytes["cudnn"] == 200 * MIB
    with pytest.raises(ValueError, match="quantile"):
        fit_overheads(samples(), q=1.5)


def test_calibration_file_is_read_back_by_the_catalog():
    text = calibration_toml(fit_overheads(samples()), 'fitted on "dev" by `xmem-slurm calibrate` on today')
    catalog = catalog_from_tables(tomllib.loads(CATALOG_PATH.read_text()), tomllib.loads(text), {})
    gpu = find_gpu("NVIDIA GeForce RTX 3060", catalog)
    assert overhead_bytes(gpu, ["cublas", "cudnn"]) == 720 * MIB
    assert overhead_bytes(gpu, ["cublas"]) == 520 * MIB
    assert 'fitted on "dev"' in gpu.overhead_provenance and "6 runs" in gpu.overhead_provenance


def record(path: str, ground_mib: int, real_oom: bool = False) -> dict:
    return {"path": path, "result": {
        "train info": {"model": "MnasNet", "batch_size": 100, "optimiser": "SGD", "zero_grad_mode": None,
                       "total_gpu_memory": 12_622_168_064, "gpu_name": "NVIDIA GeForce RTX 3060"},
        "solution": {"memory": 1, "oom": False, "runtime": 1, "ground": ground_mib * MIB, "real_oom": real_oom}}}


def test_calibrate_command_joins_runs_and_estimates_and_writes_the_file(tmp_path):
    data, estimates, out = tmp_path / "d.jsonl", tmp_path / "e.jsonl", tmp_path / "cal.toml"
    data.write_text("\n".join(json.dumps(record(p, g, oom)) for p, g, oom in
                              [("a", 3000, False), ("b", 4100, False), ("c", 9000, True), ("d", 5000, False)]))
    lines = [("a", 2500, False), ("b", 3500, False), ("c", 8000, False), ("d", 4000, True)]
    estimates.write_text("\n".join(json.dumps({"path": p, "estimate_bytes": 0, "oom": oom, "seconds": 1,
                                               "peak_reserved_bytes": r * MIB, "libraries": ["cublas", "cudnn"]})
                                   for p, r, oom in lines))
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "calibrate", "--data", str(data), "--estimates",
                           str(estimates), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = tomllib.loads(out.read_text())["overhead"]["RTX-3060-12GB"]
    # c really ran out of memory and d was predicted to: only a (500 MiB) and b (600 MiB) count -> median 550.
    # xMem records' peaks leave the context out: the 550 MiB is what loaded during the run, written as cuBLAS's
    # term, and the catalog's context stands.
    assert table["library_bytes"]["cublas"] == 550 * MIB
    assert "context_bytes" not in table
    assert "xmem-slurm calibrate --data" in table["provenance"]


def runs_and_estimates(tmp_path) -> tuple:
    data, estimates = tmp_path / "d.jsonl", tmp_path / "e.jsonl"
    data.write_text("\n".join(json.dumps(record(p, g)) for p, g in [("a", 3000), ("b", 4100)]))
    estimates.write_text("\n".join(json.dumps({"path": p, "estimate_bytes": 0, "oom": False, "seconds": 1,
                                               "peak_reserved_bytes": r * MIB, "libraries": ["cublas", "cudnn"]})
                                   for p, r in [("a", 2500), ("b", 3500)]))
    return data, estimates


def test_calibrate_writes_the_sites_calibration_the_config_names_and_estimates_read_it(tmp_path):
    """issue 32: the default was the installed package's calibration.toml, which an upgrade replaces."""
    from xmem.config import load_site_config
    from xmem.gpus.catalog import CALIBRATION_PATH

    shipped = CALIBRATION_PATH.read_bytes()
    site_file, config = tmp_path / "etc" / "calibration.toml", tmp_path / "xmem.toml"
    config.write_text(f'[catalog]\ncalibration = "{site_file}"\n')
    data, estimates = runs_and_estimates(tmp_path)
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "calibrate", "--data", str(data), "--estimates",
                           str(estimates), "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert site_file.is_file() and CALIBRATION_PATH.read_bytes() == shipped
    gpu = find_gpu("rtx3060", load_site_config(config).catalog())
    assert gpu.libraries["cublas"] == 550 * MIB and "xmem-slurm calibrate --data" in gpu.overhead_provenance


def test_a_site_calibration_must_be_an_absolute_path(tmp_path):
    from xmem.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="catalog.calibration: an absolute path"):
        config_from_dict({"catalog": {"calibration": "calibration.toml"}})


def test_calibrate_without_usable_runs_says_what_to_do(tmp_path):
    data, estimates = tmp_path / "d.jsonl", tmp_path / "e.jsonl"
    data.write_text(json.dumps(record("a", 3000)))
    estimates.write_text("")
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "calibrate", "--data", str(data), "--estimates",
                           str(estimates), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "run scripts/bench_accuracy.py" in done.stderr


def test_a_negative_context_fit_is_clamped_at_zero_and_reported():
    # simulated reserved above the NVML peak: residuals -100 and -50 MiB -> median -75, written as 0
    fits = fit_overheads([OverheadSample("T4", -100 * MIB, TRANSFORMER), OverheadSample("T4", -50 * MIB, TRANSFORMER)])
    assert fits["T4"].context_bytes == 0
    assert fits["T4"].raw_base_bytes == -75 * MIB
    assert "unclamped context -75 MiB" in calibration_toml(fits, "p")


def test_peaks_without_the_context_fit_the_always_loaded_library_and_keep_the_catalog_context():
    a = "RTX-3060-12GB"
    runs = ([OverheadSample(a, r * MIB, TRANSFORMER, peak_has_context=False) for r in (60, 80, 100)]
            + [OverheadSample(a, r * MIB, CNN, peak_has_context=False) for r in (90, 100, 110)])
    fit = fit_overheads(runs)[a]
    # cuDNN: median with 100 - median without 80 = 20 MiB; bases 60 80 100 70 80 90 -> median 80, into cuBLAS
    assert fit.context_bytes is None
    assert fit.library_bytes == {"cublas": 80 * MIB, "cudnn": 20 * MIB}
    text = calibration_toml({a: fit}, "p")
    assert "context_bytes" not in text and "catalog's stands" in text
    shipped = tomllib.loads(CATALOG_PATH.read_text())
    gpu = find_gpu(a, catalog_from_tables(shipped, tomllib.loads(text), {}))
    context = shipped["overhead"]["default"]["context_bytes"]
    assert overhead_bytes(gpu, ["cublas", "cudnn"]) == context + 100 * MIB


def test_peaks_with_the_context_are_the_ones_that_fit_it():
    a = "RTX-3060-12GB"
    runs = ([OverheadSample(a, 500 * MIB, TRANSFORMER), OverheadSample(a, 520 * MIB, TRANSFORMER)]
            + [OverheadSample(a, 80 * MIB, TRANSFORMER, peak_has_context=False)])
    fit = fit_overheads(runs)[a]
    assert (fit.context_bytes, fit.samples) == (510 * MIB, 2)
