"""`xmem-slurm calibrate --from-store` and `xmem-slurm report --plot` on a hand-made record store."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from xmem.bench.overhead_fit import ALWAYS_LOADED
from xmem.gpus import find_gpu, load_catalog, overhead_bytes
from xmem.slurm.store import JobRecord, append_record
from xmem.slurm.store_fit import kept_tables, store_samples

MIB = 1 << 20
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
SITE = """\
[partitions.gpu_types]
debug = ["a100", "h100", "1g.10gb"]
[mig]
h100 = ["1g.10gb"]
"""


def xmem(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmem.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def record(job_id: int, gpu_type: str | None, estimate: int | None, measured: int | None,
           exit_code: int | None = 0, user: str | None = None, measured_by: str = "nvml") -> JobRecord:
    """A record of its own user (`u<job_id>` unless named), measured by the root Epilog's NVML by default."""
    return JobRecord(job_id=str(job_id), user=user or f"u{job_id}", gpu_type=gpu_type, estimate_bytes=estimate,
                     measured_bytes=measured, measured_by=measured_by if measured else None, exit_code=exit_code)


def overhead_now(name: str) -> int:
    return overhead_bytes(find_gpu(name, load_catalog()), {ALWAYS_LOADED})


def make_store(path: Path) -> dict[str, list[int]]:
    """A100 jobs measured above their estimate by 100, 300 and 200 MiB; H100 (two as its 1g.10gb slice) below by
    50 and 150 MiB; and records that must not count. Returns the measured-minus-estimate errors per type."""
    errors = {"a100": [100 * MIB, 300 * MIB, 200 * MIB], "h100": [-50 * MIB, -150 * MIB]}
    job = 0
    for gres_type, deltas in (("a100", errors["a100"]), ("1g.10gb", errors["h100"])):
        for i, delta in enumerate(deltas):
            job += 1
            estimate = (2 + i) * GIB
            append_record(path, record(job, gres_type, estimate, estimate + delta))
    append_record(path, record(90, "a100", 3 * GIB, 9 * GIB, exit_code=1))  # crashed (out of memory): no peak
    append_record(path, record(91, "a100", 3 * GIB, None))  # nothing measured
    append_record(path, record(92, "tpu-v9", 3 * GIB, 4 * GIB))  # a type the catalog does not know
    append_record(path, record(93, None, None, 4 * GIB))  # measured, never estimated
    return errors


def test_a_records_residual_is_what_the_gpu_held_beyond_the_estimates_allocator_part(tmp_path):
    store = tmp_path / "records.jsonl"
    make_store(store)
    from xmem.slurm.store import read_records

    catalog = load_catalog()
    found = store_samples(read_records(store), catalog, {"1g.10gb": "h100"}.get)
    a100 = find_gpu("a100", catalog).name
    residuals = sorted(s.residual_bytes for s in found.samples if s.gpu == a100)
    assert residuals == sorted(overhead_now("a100") + d for d in (100 * MIB, 200 * MIB, 300 * MIB))
    assert {s.gpu for s in found.samples} == {a100, find_gpu("h100", catalog).name}
    assert found.skipped == {"the job failed": 1, "nothing measured": 1, "GPU type tpu-v9 not in the catalog": 1,
                             "no estimate": 1}
    assert sorted(found.points[a100]) == [(2 * GIB, 2 * GIB + 100 * MIB), (3 * GIB, 3 * GIB + 300 * MIB),
                                          (4 * GIB, 4 * GIB + 200 * MIB)]


def test_calibrate_from_store_fits_the_median_error_into_each_types_overhead(tmp_path):
    store = tmp_path / "records.jsonl"
    errors = make_store(store)
    (tmp_path / "site.toml").write_text(SITE)
    out = tmp_path / "calibration.toml"
    out.write_text('# an older fit\n\n[overhead."A100-SXM4-40GB"]\ncontext_bytes = 1\nprovenance = "old"\n\n'
                   '[overhead."T4"]\ncontext_bytes = 333\nlibrary_bytes = { cublas = 7 }\nprovenance = "t4 runs"\n')
    run = xmem("calibrate", "--from-store", "--store", str(store), "--config", str(tmp_path / "site.toml"),
               "--out", str(out), "--min-users", "2", cwd=tmp_path)  # the H100 has two users' records
    assert run.returncode == 0, run.stderr
    fitted = tomllib.loads(out.read_text())["overhead"]
    a100, h100 = fitted["A100-SXM4-40GB"], fitted["H100-SXM5-80GB"]
    assert a100["context_bytes"] == overhead_now("a100") + 200 * MIB  # the median of +100, +300, +200 MiB
    assert h100["context_bytes"] == overhead_now("h100") + round((errors["h100"][0] + errors["h100"][1]) / 2)
    assert a100["library_bytes"] == {ALWAYS_LOADED: 0}  # cuBLAS cannot be told from the context: in it
    assert "--from-store" in a100["provenance"] and "3 runs" in a100["provenance"]
    assert fitted["T4"] == {"context_bytes": 333, "library_bytes": {"cublas": 7}, "provenance": "t4 runs"}
    assert "records left out: 1 GPU type tpu-v9 not in the catalog, 1 no estimate" in " ".join(run.stderr.split())


def test_calibrate_from_store_without_usable_records_says_why(tmp_path):
    store = tmp_path / "records.jsonl"
    append_record(store, record(1, "a100", 3 * GIB, None))
    run = xmem("calibrate", "--from-store", "--store", str(store), "--dry-run", cwd=tmp_path)
    said = " ".join(run.stderr.split())  # rich wraps long lines
    assert run.returncode == 2
    assert "no usable record" in said and ": 1 nothing measured" in said
    missing = xmem("calibrate", "--from-store", "--store", str(tmp_path / "none.jsonl"), "--dry-run", cwd=tmp_path)
    assert missing.returncode == 2 and "no record store at" in missing.stderr
    neither = xmem("calibrate", cwd=tmp_path)
    assert neither.returncode == 2 and "--from-store" in neither.stderr


def test_kept_tables_drop_only_the_refitted_types():
    text = '# header\n\n[overhead."A"]\nx = 1\n\n[overhead."B"]\nx = 2\nprovenance = "b"\n'
    assert kept_tables(text, {"A"}) == '[overhead."B"]\nx = 2\nprovenance = "b"\n'
    assert kept_tables(text, {"A", "B"}) == ""


def test_report_plot_draws_estimate_against_measured(tmp_path):
    store = tmp_path / "records.jsonl"
    make_store(store)
    (tmp_path / "site.toml").write_text(SITE)
    run = xmem("report", "--store", str(store), "--plot", "report.png", "--config", str(tmp_path / "site.toml"),
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "wrote report.png" in run.stderr
    empty = tmp_path / "empty.jsonl"
    append_record(empty, record(1, "a100", 3 * GIB, None))
    nothing = xmem("report", "--store", str(empty), "--plot", "x.png", cwd=tmp_path)
    assert nothing.returncode == 2 and "nothing to draw" in nothing.stderr


# --- issue 21: no user moves the site's calibration alone ---------------------------------------------------------

def honest_and_forged(path: Path, *, forged_by: str, honest_users: int = 3) -> None:
    """`honest_users` users' A100 jobs measured 100-300 MiB above their estimate, and six jobs of one user whose
    comment claims a tiny estimate for a large NVML peak: 60 GiB of residual each (the campaign's attack)."""
    job = 0
    for u in range(honest_users):
        for delta in (100, 200, 300):
            job += 1
            append_record(path, record(job, "a100", 4 * GIB, 4 * GIB + (delta + 10 * u) * MIB, user=f"honest{u}"))
    for _ in range(6):
        job += 1
        append_record(path, record(job, "a100", 1, 60 * GIB, user="mallory", measured_by=forged_by))


def calibrated_a100(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, int | None]:
    out = tmp_path / "calibration.toml"
    run = xmem("calibrate", "--from-store", "--store", str(tmp_path / "records.jsonl"), "--out", str(out), *args,
               cwd=tmp_path)
    fitted = tomllib.loads(out.read_text())["overhead"] if out.exists() else {}
    return run, fitted.get("A100-SXM4-40GB", {}).get("context_bytes")


def test_peaks_the_jobs_wrote_themselves_never_calibrate(tmp_path):
    honest_and_forged(tmp_path / "records.jsonl", forged_by="file")
    run, context = calibrated_a100(tmp_path)
    assert run.returncode == 0, run.stderr
    assert context == overhead_now("a100") + 210 * MIB  # the median honest user (+200 MiB, +10 MiB each)
    assert "6 measured by file, not trusted" in " ".join(run.stderr.split())


def test_one_users_forged_estimates_are_one_vote_among_the_users(tmp_path):
    honest_and_forged(tmp_path / "records.jsonl", forged_by="nvml")  # the peak is real, the comment is not
    run, context = calibrated_a100(tmp_path)
    assert run.returncode == 0, run.stderr
    # four users' medians: +200, +210, +220 MiB and mallory's ~60 GiB: the median lies between two honest users
    assert overhead_now("a100") + 210 * MIB <= context <= overhead_now("a100") + 220 * MIB


def test_one_user_alone_moves_nothing(tmp_path):
    honest_and_forged(tmp_path / "records.jsonl", forged_by="nvml", honest_users=0)
    run, context = calibrated_a100(tmp_path)
    assert run.returncode == 2 and context is None
    assert "records of 1 user(s), fewer than 3" in " ".join(run.stderr.split())


def test_a_fit_moves_the_overhead_by_one_bounded_step(tmp_path):
    store = tmp_path / "records.jsonl"
    for u in range(3):  # every user agrees on +3 GiB: a real change, taken a step at a time
        append_record(store, record(u, "a100", 4 * GIB, 7 * GIB, user=f"user{u}"))
    run, context = calibrated_a100(tmp_path, "--max-move-mib", "512")
    assert run.returncode == 0, run.stderr
    assert context == overhead_now("a100") + 512 * MIB
    assert "held to a step of 512 MiB" in " ".join(run.stderr.split())


def test_slurms_own_gpumem_accounting_replaces_the_jobs_claims(tmp_path):
    """`--sacct`: sacct's TRESUsageInMax (a stand-in printing its real format: per step, binary units) gives each
    job's peak; the jobs' own files claimed 60 GiB."""
    store = tmp_path / "records.jsonl"
    lines = []
    for u in range(3):
        append_record(store, record(u + 1, "a100", 4 * GIB, 60 * GIB, user=f"user{u}", measured_by="file"))
        lines += [f"{u + 1}|", f"{u + 1}.batch|cpu=00:01:02,energy=0,gres/gpumem={4096 + 200 + 10 * u}M,"
                               "gres/gpuutil=97,mem=1024K,pages=0,vmem=2048K",
                  f"{u + 1}.extern|cpu=00:00:00,energy=0,gres/gpumem=0,gres/gpuutil=0,mem=0,pages=0,vmem=0"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "sacct.out").write_text("\n".join(lines) + "\n")
    (bin_dir / "sacct").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/sacct.args\n'
                                   f'cat {tmp_path}/sacct.out\n')
    (bin_dir / "sacct").chmod(0o755)
    out = tmp_path / "calibration.toml"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = xmem("calibrate", "--from-store", "--store", str(store), "--out", str(out), "--sacct", cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "sacct.args").read_text().split() == ["-n", "-P", "-j", "1,2,3", "-o",
                                                             "JobIDRaw,TRESUsageInMax"]
    context = tomllib.loads(out.read_text())["overhead"]["A100-SXM4-40GB"]["context_bytes"]
    assert context == overhead_now("a100") + 210 * MIB  # the median user's +210 MiB, not the files' 56 GiB
