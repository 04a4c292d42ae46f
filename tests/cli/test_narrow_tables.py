"""Tables at 80 columns (issue 32 item 5): rich's width for a pipe or a log file. GPU names were cut so that the
40 GB and 80 GB A100s both read 'A100-SXM4-8…'; every table now keeps them whole and stays within 80 columns."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from tests.estimates import estimate, gpu_estimate
from xmem.cli.common import show_options
from xmem.cli.estimate import show_estimate
from xmem.cli.fit import show_fit
from xmem.fit import FitResult, Vary
from xmem.policy.options import OptionRow, OptionTable
from xmem.slurm.store import JobRecord, append_record

GIB = 1 << 30
XMEM_SLURM = str(Path(sys.executable).parent / "xmem-slurm")
A100S = ("A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIE-80GB", "H100-SXM5-80GB")


def rendered(show, *args) -> str:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    show(console, *args)
    return console.export_text()


def assert_readable(text: str, names=A100S) -> None:
    assert max(map(len, text.splitlines())) <= 80, text
    assert "…" not in text, text
    for name in names:
        assert name in text, f"{name} is cut:\n{text}"


def test_estimate_table_keeps_gpu_names_and_torchs_words_at_80_columns():
    no_fit = replace(gpu_estimate(int(23.5 * GIB), total=int(39.56 * GIB), fits=False, name=A100S[0]),
                     unlimited_peak_bytes=int(63.92 * GIB))
    gpus = {A100S[0]: no_fit, **{name: gpu_estimate(int(63.92 * GIB), total=int(79.15 * GIB), name=name)
                                 for name in A100S[1:]}}
    record = replace(estimate(gpus), breakdowns={A100S[1]: {"activation": 60 * GIB, "overhead": GIB}})
    text = rendered(show_estimate, record)
    assert_readable(text)
    assert "needs 63.92 GiB" in text and "A100-SXM4-40GB: out of memory: CUDA out of memory" in text
    wide = Console(width=160, record=True, file=open(os.devnull, "w"))
    show_estimate(wide, record)
    assert "headroom" in wide.export_text() and "headroom" not in text  # memory less peak: left out when narrow


def test_offers_and_fit_tables_keep_gpu_names_at_80_columns():
    rows = tuple(OptionRow(name, name, "mps", f"mps:{name[:4].lower()}-{i}:25", f"a share of {name}", 80 * GIB,
                           70 * GIB, 77 * GIB, True, chosen=i == 1) for i, name in enumerate(A100S))
    assert_readable(rendered(show_options, OptionTable(rows, "rewrite", "the smallest fit", rows[0])))
    limits = {name: {"whole": 48, "mps:25": None} for name in A100S}
    usable = {(name, option): 40 * GIB for name in A100S for option in ("whole", "mps:25")}
    fit = FitResult(Vary("per-device-train-batch-size", 1, 512), limits, (), 1.0)
    assert_readable(rendered(show_fit, fit, usable))


def run_piped(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # a pipe: rich's 80
    return subprocess.run([XMEM_SLURM, *args], capture_output=True, text=True, timeout=120, env=env)


def test_gpus_and_report_through_a_pipe_keep_every_name(tmp_path):
    from xmem.gpus import load_catalog

    catalog = load_catalog()
    done = run_piped("gpus")
    assert done.returncode == 0, done.stderr
    assert_readable(done.stdout, [g.name for g in catalog.values()] + [a for g in catalog.values()
                                                                        for a in g.aliases if " " not in a])
    store = tmp_path / "r.jsonl"
    for i, name in enumerate(A100S):
        append_record(store, JobRecord(str(i), gpu_type=name, estimate_bytes=9 * GIB, measured_bytes=10 * GIB))
    done = run_piped("report", "--store", str(store))
    assert done.returncode == 0, done.stderr
    assert_readable(done.stdout)


def test_estimate_through_a_pipe_at_80_columns(tmp_path):
    """The real command, its table piped (rich's 80 columns) with COLUMNS=80 set as a log's runner might."""
    (tmp_path / "train.py").write_text(
        "import torch\nmodel = torch.nn.Linear(256, 256).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n    model(torch.randn(8, 256, device='cuda')).sum().backward()\n    opt.step()\n")
    for columns in (None, "80"):
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        done = subprocess.run([XMEM_SLURM, "estimate", "-n", "1", "--gpu", "a100", "--gpu", "a100-80gb", "--gpu",
                               "a100-pcie-80gb", "--", sys.executable, str(tmp_path / "train.py")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**env, "XMEM_CONFIG": "", **({"COLUMNS": columns} if columns else {})})
        assert done.returncode == 0, done.stderr
        assert_readable(done.stdout, A100S[:3])
