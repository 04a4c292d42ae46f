"""Pictures of an estimate: the allocator's history, `--plot FILE.png` and `--snapshot FILE.pickle` of `estimate` and
`check`, the snapshot read by torch's own memory viewer tools."""

import json
import os
import pickle
import random
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate
from xmem.simulate.allocator_settings import MiB

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TRAIN = """\
import torch


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


model = torch.nn.Sequential(Block(512), Block(512)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    x = torch.randn(384, 512, device="cuda")
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def replay_totals(trace: list[dict]) -> tuple[int, int]:
    """Peak allocated and peak reserved as a reader of the snapshot's device trace counts them."""
    allocated = reserved = peak_allocated = peak_reserved = 0
    for e in trace:
        sign = {"alloc": 1, "free_completed": -1, "segment_alloc": 1, "segment_map": 1, "segment_free": -1,
                "segment_unmap": -1}.get(e["action"], 0)
        if e["action"] in ("alloc", "free_completed"):
            allocated += sign * e["size"]
        elif sign:
            reserved += sign * e["size"]
        peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
    return peak_allocated, peak_reserved


def check_consistent(snapshot: dict) -> None:
    """What torch's segment viewer relies on: every block lies in a live segment; the segments at the end are those
    the trace leaves, their blocks tile them, and the active blocks are the allocations left live."""
    live_segments: dict[int, int] = {}
    live_blocks: dict[int, int] = {}
    trace = next(t for t in snapshot["device_traces"] if t)
    for e in trace:
        if e["action"] in ("segment_alloc", "segment_map"):
            live_segments[e["addr"]] = e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            assert not any(e["addr"] <= a < e["addr"] + e["size"] for a in live_blocks), "segment freed in use"
            live_segments.pop(e["addr"], None)
        elif e["action"] == "alloc":
            assert any(s <= e["addr"] and e["addr"] + e["size"] <= s + n for s, n in live_segments.items()
                       ) or snapshot["segments"][0]["is_expandable"], f"alloc outside every segment: {e}"
            live_blocks[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live_blocks.pop(e["addr"]) == e["size"]
    for seg in snapshot["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        offsets = [b["address"] for b in seg["blocks"]]
        assert offsets == sorted(offsets) and offsets[0] == seg["address"]
    active = {b["address"]: b["size"] for seg in snapshot["segments"] for b in seg["blocks"]
              if b["state"] == "active_allocated"}
    assert active == live_blocks


# --- the replay's history -----------------------------------------------------------------------------------------

def random_ops(seed: int, n: int = 3000) -> list[tuple]:
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    for _ in range(n):
        roll = rng.random()
        if roll < 0.55 or not live:
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 64 * MiB)])
            ops.append((ALLOC, next_id, size, rng.choice([0, 0, 0, 7])))
            live.append(next_id)
            next_id += 1
        elif roll < 0.98:
            ops.append((FREE, live.pop(rng.randrange(len(live))), 0, 0))
        else:
            ops.append((EMPTY_CACHE, 0, 0, 0))
    return ops


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9"])
def test_history_changes_no_decision_and_adds_up_to_the_peaks(conf):
    ops = random_ops(len(conf))
    config = AllocatorConfig.parse(conf)
    capacity = 1 << 30
    plain = simulate(ops, config, capacity=capacity)
    history: list = []
    recorded = simulate(ops, config, capacity=capacity, history=history)
    assert recorded == plain
    entries = [{"action": h.action, "addr": h.addr, "size": h.size} for h in history]
    assert replay_totals(entries) == (plain.peak_allocated, plain.peak_reserved)
    assert {h.action for h in history} >= {"alloc", "free_requested", "free_completed"}
    if "expandable" in conf:
        assert {"segment_map", "segment_unmap"} <= {h.action for h in history}
    else:
        assert {"segment_alloc", "segment_free"} <= {h.action for h in history}


def test_history_records_the_out_of_memory_and_stops_there():
    history: list = []
    result = simulate([(ALLOC, 1, 600 * MiB, 0), (ALLOC, 2, 600 * MiB, 0), (ALLOC, 3, MiB, 0)],
                      capacity=1 << 30, history=history)
    assert result.oom is not None and result.oom.index == 1
    assert [h.action for h in history] == ["segment_alloc", "alloc", "oom"]
    assert history[-1].op_index == 1 and history[-1].requested == 600 * MiB
    assert history[-1].device_free == (1 << 30) - 600 * MiB  # what cudaMalloc had left


# --- estimate --plot --snapshot, end to end -----------------------------------------------------------------------

def xmem(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "xmem.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def estimated(tmp_path_factory):
    """One `estimate --json --plot --snapshot` of the training program on two GPU types, drawn on the second."""
    folder = tmp_path_factory.mktemp("pictures")
    (folder / "train.py").write_text(TRAIN)
    run = xmem("estimate", "--json", "--gpu", "a100", "--gpu", "t4", "--plot-gpu", "t4", "--plot", "run.png",
               "--snapshot", "run.pickle", "--", PYTHON, "train.py", cwd=folder)
    assert run.returncode == 0, run.stderr
    return folder, json.loads(run.stdout), run.stderr


def test_estimate_writes_a_png_and_says_so(estimated):
    folder, _data, stderr = estimated
    png = (folder / "run.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000  # a drawn figure, not an empty canvas
    assert "wrote run.png (memory over the run on T4)" in stderr


def test_snapshot_totals_are_the_estimates(estimated):
    folder, data, _stderr = estimated
    snapshot = pickle.loads((folder / "run.pickle").read_bytes())
    t4 = data["gpus"]["T4"]
    trace = snapshot["device_traces"][0]
    assert replay_totals(trace) == (t4["peak_allocated_bytes"], t4["peak_reserved_bytes"])
    check_consistent(snapshot)


def test_snapshot_names_the_ops_and_modules_behind_each_allocation(estimated):
    folder, _data, _stderr = estimated
    snapshot = pickle.loads((folder / "run.pickle").read_bytes())
    frames = [e["frames"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    modules = {f[0]["filename"] for f in frames}
    ops = {f[0]["name"] for f in frames}
    assert {"Sequential.0.up", "Sequential.0.down", "Sequential.1.up", "Sequential.1.down"} <= modules, modules
    assert "addmm" in ops or "mm" in ops, ops
    assert any(f[-1]["name"].startswith("activation (forward, iteration") for f in frames)
    assert any(f[-1]["name"].startswith("optimizer_state (optimizer") for f in frames)
    categories = {e["category"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"}
    assert {"parameter", "gradient", "optimizer_state", "activation"} <= categories  # the viewer's colours


def line_of(text: str) -> int:
    """The line of TRAIN that starts (after its indent) with `text`."""
    return next(n for n, line in enumerate(TRAIN.splitlines(), 1) if line.strip().startswith(text))


def test_snapshot_frames_point_at_the_programs_line_of_each_allocation(estimated):
    """issue 32: each allocation's frames hold the line of train.py that made it (the forward's line for an
    activation, `loss.backward()` for a gradient, `opt.step()` for the optimizer's state), as memory_viz shows it."""
    folder, _data, _stderr = estimated
    snapshot = pickle.loads((folder / "run.pickle").read_bytes())
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    where = {}
    for e in allocs:
        program = [f for f in e["frames"] if f["filename"].endswith("train.py")]
        where.setdefault(e["category"], set()).update((f["line"], f["name"]) for f in program)
    assert (line_of("return x + self.down"), "forward") in where["activation"], where
    assert (line_of("loss.backward()"), "<module>") in where["gradient"], where
    assert (line_of("opt.step()"), "<module>") in where["optimizer_state"], where
    assert (line_of("x = torch.randn"), "<module>") in where["input"], where
    assert all(f["filename"] == str(folder / "train.py") for e in allocs for f in e["frames"][1:-1])
    blocks = [b for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert any(f["filename"].endswith("train.py") for b in blocks for f in b["frames"])  # segment_plot's view


@pytest.mark.parametrize("kind", ["trace_plot", "segment_plot", "stats"])
def test_torchs_memory_viz_reads_the_snapshot(estimated, kind, tmp_path, monkeypatch, capsys):
    """`python -m torch.cuda._memory_viz KIND FILE`, run in this process (runpy executes the module's command line as
    `-m` does: its own argument parser and pickle reader; a process of its own would cost a torch import)."""
    folder, _data, _stderr = estimated
    out = tmp_path / "out"
    args = [kind, str(folder / "run.pickle")] + (["-o", str(out)] if kind != "stats" else [])
    monkeypatch.setattr(sys, "argv", ["_memory_viz.py", *args])
    with warnings.catch_warnings():  # torch.cuda imports the module: runpy warns that it runs a fresh copy
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module("torch.cuda._memory_viz", run_name="__main__", alter_sys=True)
    stdout = capsys.readouterr().out
    if kind in ("trace_plot", "segment_plot"):
        html = out.read_text()
        assert "add_local_files" in html and '"base64"' in html and len(html) > 10_000
    else:
        assert "segments:" in stdout and "Segment size mismatch" not in stdout


def test_torchs_flame_graph_lines_add_up_to_the_reserved_memory(estimated):
    """`_memory_viz segments` draws one flame-graph line per block (its SVG tool is downloaded: not run here)."""
    from torch.cuda import _memory_viz

    folder, data, _stderr = estimated
    snapshot = pickle.loads((folder / "run.pickle").read_bytes())
    lines = _memory_viz.segments(snapshot, format_flamegraph=lambda text: text).splitlines()
    total = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
    assert total == sum(seg["total_size"] for seg in snapshot["segments"]) > 0
    assert any(";active_allocated;" in line and "Sequential.0.up" in line for line in lines)


def test_category_curves_at_the_peak_are_the_breakdown(kept):
    """The stacked categories of the plot are the estimate's breakdown at its peak (on the type it is given for)."""
    from xmem.gpus import load_catalog
    from xmem.pictures import category_curves, describe_op, gpu_run

    _folder, runs = kept
    result = runs[0].estimate
    gpu = load_catalog()[result.breakdown_gpu]
    run = gpu_run(runs[0].traces, gpu, dict(os.environ))
    assert (run.sim.peak_reserved, run.sim.peak_allocated) == (result.gpus[gpu.name].peak_reserved_bytes,
                                                                result.gpus[gpu.name].peak_allocated_bytes)
    at_peak = {name: int(values[0]) for name, values in category_curves(run, [run.sim.fullest_peak_index]).items()}
    expected = {k: v for k, v in result.breakdown.items() if k not in ("allocator_slack", "overhead")}
    assert {k: v for k, v in at_peak.items() if v} == {k: v for k, v in expected.items() if v}
    assert "iteration" in describe_op(run, run.sim.peak_reserved_index)


def test_a_plot_gpu_that_was_not_estimated_fails_before_tracing(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    run = xmem("estimate", "--gpu", "a100", "--plot-gpu", "t4", "--plot", "x.png", "--", PYTHON, "train.py",
               cwd=tmp_path, timeout=60)
    assert run.returncode == 2
    assert "--plot-gpu t4: T4 is not among the GPU types estimated (a100)" in run.stderr
    assert not (tmp_path / "x.png").exists()


def test_an_unwritable_picture_path_fails_before_tracing(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    run = xmem("estimate", "--json", "--snapshot", "missing/run.pickle", "--", PYTHON, "train.py", cwd=tmp_path,
               timeout=60)
    assert run.returncode == 2
    assert json.loads(run.stdout)["error"] == "bad_option"
    assert "does not exist" in run.stderr


def test_check_draws_the_slice_the_site_picks(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py\n")
    run = xmem("check", "--json", "--config", str(REPO / "etc" / "xmem.toml"), "--plot", "job.png",
               "--snapshot", "job.pickle", "job.sh", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    picked = data["decision"]["gpu_type"]
    assert "wrote job.png" in run.stderr and (tmp_path / "job.png").read_bytes().startswith(PNG_MAGIC)
    snapshot = pickle.loads((tmp_path / "job.pickle").read_bytes())
    check_consistent(snapshot)
    drawn = run.stderr.split("wrote job.png (memory over the run on ")[1].split(")")[0]
    estimate = data["estimates"][0]["estimate"]["gpus"][drawn]
    assert replay_totals(snapshot["device_traces"][0]) == (estimate["peak_allocated_bytes"],
                                                          estimate["peak_reserved_bytes"])
    from xmem.gpus import find_gpu, load_catalog

    parent = {"1g.10gb": "h100"}.get(picked, picked)  # the example site's MIG slice runs as its parent
    assert drawn == find_gpu(parent, load_catalog()).name


def test_a_snapshot_with_expandable_segments_maps_pages_and_adds_up(tmp_path):
    from xmem.estimate import estimate
    from xmem.gpus import find_gpu, load_catalog
    from xmem.memory_snapshot import memory_snapshot
    from xmem.pictures import gpu_run

    (tmp_path / "train.py").write_text(TRAIN)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    traces: dict = {}
    result = estimate([PYTHON, "train.py"], gpus=["a100"], keep_traces=traces, env=env, cwd=tmp_path)
    gpu = find_gpu("a100", load_catalog())
    snapshot = memory_snapshot(gpu_run(traces, gpu, env))
    trace = snapshot["device_traces"][0]
    assert "segment_map" in {e["action"] for e in trace} and "segment_alloc" not in {e["action"] for e in trace}
    assert all(seg["is_expandable"] for seg in snapshot["segments"])
    estimated = result.gpus[gpu.name]
    assert replay_totals(trace) == (estimated.peak_allocated_bytes, estimated.peak_reserved_bytes)
    check_consistent(snapshot)


def test_a_run_out_of_memory_is_drawn_and_its_snapshot_ends_in_the_oom(tmp_path):
    """6.1 GiB of activations for a batch of 200,000 do not fit a T4 beside its 3 GiB input: the replay stops."""
    (tmp_path / "train.py").write_text(TRAIN.replace("Block(512), Block(512)", "Block(4096)")
                                       .replace("randn(384, 512", "randn(200000, 4096"))
    run = xmem("estimate", "--json", "--gpu", "t4", "--plot", "oom.png", "--snapshot", "oom.pickle", "--",
               PYTHON, "train.py", cwd=tmp_path)
    assert run.returncode == 14, run.stderr  # fits none of the GPUs asked (xmem.cli.exit_codes)
    t4 = json.loads(run.stdout)["gpus"]["T4"]
    assert t4["oom"] is not None and (tmp_path / "oom.png").read_bytes().startswith(PNG_MAGIC)
    trace = pickle.loads((tmp_path / "oom.pickle").read_bytes())["device_traces"][0]
    last = trace[-1]
    assert last["action"] == "oom" and last["size"] >= t4["oom"]["requested"]
    assert last["device_free"] == t4["capacity_bytes"] - t4["oom"]["reserved"]
    assert replay_totals(trace)[1] == t4["peak_reserved_bytes"]


# --- what the plot shows, in its pixels (issue 23) ----------------------------------------------------------------

def rendered(fig) -> "object":
    """The figure's pixels (rows from the top), as the PNG holds them."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)


def pixel_of(fig, ax, x: float, y: float) -> tuple[int, int]:
    """(row, column) of data point (x, y) in `rendered(fig)`."""
    px, py = ax.transData.transform((x, y))
    return int(round(fig.bbox.height - py)), int(round(px))


def rgb(colour: str, alpha: float = 1.0) -> tuple[int, ...]:
    """A colour as drawn with `alpha` over white."""
    from matplotlib.colors import to_rgb

    return tuple(round(255 * (alpha * c + 1 - alpha)) for c in to_rgb(colour))


def close_to(pixel, colour: tuple[int, ...], tolerance: int = 6) -> bool:
    return all(abs(int(p) - c) <= tolerance for p, c in zip(pixel, colour))


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """In-process estimates that keep their traces: the training program on T4 then A100 (it fits both), and one
    that runs out of memory on both (a batch of 200,000 rows of 4096)."""
    from xmem.cli.pictures import KeepingEstimator

    folder = tmp_path_factory.mktemp("kept")
    (folder / "train.py").write_text(TRAIN)
    (folder / "oom.py").write_text(TRAIN.replace("Block(512), Block(512)", "Block(4096)")
                                   .replace("randn(384, 512", "randn(200000, 4096"))
    keeper = KeepingEstimator()
    for program in ("train.py", "oom.py"):
        keeper([PYTHON, program], gpus=["t4", "a100"], cwd=folder)
    return folder, keeper.runs


def test_every_category_has_its_own_colour_and_none_is_red_or_green():
    from xmem.estimate import OVERHEAD
    from xmem.report_plots import CATEGORY_COLOURS, FITS_COLOUR, OVER_COLOUR
    from xmem.trace.events import Category

    assert set(CATEGORY_COLOURS) == {*Category, OVERHEAD}
    colours = list(CATEGORY_COLOURS.values())
    assert len(set(colours)) == len(colours)
    assert not {OVER_COLOUR, FITS_COLOUR} & set(colours)


def test_each_category_is_drawn_in_its_colour(kept):
    """Whatever else a run holds, a category's band has the table's colour (tab10 by position made red mean the
    activations in one picture and the temporaries in another)."""
    import numpy as np

    from xmem.gpus import load_catalog
    from xmem.pictures import category_curves, gpu_run
    from xmem.report_plots import CATEGORY_ORDER, category_colour, draw_run
    from xmem.units import GIB

    _folder, runs = kept
    run = gpu_run(runs[0].traces, load_catalog()["T4"], dict(os.environ))
    fig = draw_run(run)
    pixels, ax = rendered(fig), fig.axes[0]
    at = [index for index, _a, _r in run.sim.timeline]
    curves = category_curves(run, at)
    order = [c for c in CATEGORY_ORDER if c in curves and curves[c].any()]
    checked = set()
    for category in order:
        below = run.overhead + sum((curves[c] for c in order[: order.index(category)]), np.zeros(len(at)))
        thickest = int(np.argmax(curves[category][:-1]))
        height = curves[category][thickest]
        row, column = pixel_of(fig, ax, (at[thickest] + at[thickest + 1]) / 2, (below[thickest] + height / 2) / GIB)
        top, _ = pixel_of(fig, ax, 0, (below[thickest] + height) / GIB)
        if row - top < 4:
            continue  # thinner than a few pixels: its edges blur it
        assert close_to(pixels[row, column], rgb(category_colour(category), 0.75)), (category, pixels[row, column])
        checked.add(category)
    assert {"parameter", "gradient", "optimizer_state"} <= checked, checked


def test_the_peak_marker_sits_on_the_reserved_peak_and_names_op_and_module(kept):
    from xmem.gpus import load_catalog
    from xmem.pictures import gpu_run
    from xmem.report_plots import RESERVED_COLOUR, draw_run
    from xmem.units import GIB

    _folder, runs = kept
    run = gpu_run(runs[0].traces, load_catalog()["T4"], dict(os.environ))
    fig = draw_run(run)
    ax = fig.axes[0]
    index = run.sim.peak_reserved_index
    reserved = dict((i, r) for i, _a, r in run.sim.timeline)
    assert reserved[index] == run.sim.peak_reserved and max(reserved.values()) == run.sim.peak_reserved
    peak = (run.sim.peak_reserved + run.overhead) / GIB
    pixels = rendered(fig)
    row, column = pixel_of(fig, ax, index, peak)
    assert close_to(pixels[row - 3, column], rgb(RESERVED_COLOUR), 40)  # the marker's body, above the line
    label = next(t.get_text() for t in ax.texts if t.get_text().startswith("peak reserved"))
    event = run.event_of(index)
    assert f"{peak:.2f} GiB: {event.op}" in label
    assert (f"in {event.module}" if event.module else "outside any module") in label


def test_a_gpu_the_job_does_not_fit_is_drawn_with_what_it_needs(kept, tmp_path):
    """The default type drawn is the one the answer shows: here neither fits, so the larger (A100, not the first
    asked); the title and a red level say what the job needs (the estimate's unlimited_peak_bytes)."""
    from xmem.cli.pictures import write_pictures
    from xmem.report_plots import OVER_COLOUR

    _folder, runs = kept
    run = runs[1]
    a100 = run.estimate.gpus["A100-SXM4-40GB"]
    assert not a100.fits and a100.unlimited_peak_bytes > a100.total_bytes
    assert run.estimate.breakdown_gpu == "A100-SXM4-40GB"
    lines = write_pictures(run, plot=str(tmp_path / "oom.png"), snapshot=None)
    assert lines == [f"wrote {tmp_path / 'oom.png'} (memory over the run on A100-SXM4-40GB)"]
    from matplotlib.image import imread

    pixels = (imread(tmp_path / "oom.png")[..., :3] * 255).round().astype(int)
    red = abs(pixels - rgb(OVER_COLOUR)).max(axis=2) <= 6
    dots = (red[:, 1:] & ~red[:, :-1]).sum(axis=1)  # red runs per row: a dotted level across the chart has ~170;
    assert dots.max() > 100  # the out-of-memory label's row ~40, its box's edge 1


def test_the_needs_level_and_title(kept):
    from xmem.gpus import load_catalog
    from xmem.pictures import gpu_run
    from xmem.report_plots import draw_run
    from xmem.units import GIB

    _folder, runs = kept
    t4 = runs[1].estimate.gpus["T4"]
    fig = draw_run(gpu_run(runs[1].traces, load_catalog()["T4"], dict(os.environ)),
                   needs_bytes=t4.unlimited_peak_bytes)
    assert f"does not fit: the job needs {t4.unlimited_peak_bytes / GIB:.1f} GiB, the T4 has 15.0 GiB" in \
        fig.axes[0].get_title()
    assert fig.axes[0].get_ylim()[1] >= t4.unlimited_peak_bytes / GIB


def test_the_default_type_drawn_is_the_first_asked_that_fits(kept, tmp_path):
    from xmem.cli.pictures import write_pictures

    _folder, runs = kept
    assert runs[0].estimate.breakdown_gpu == "T4"  # asked first, and the job fits it
    assert write_pictures(runs[0], plot=str(tmp_path / "x.png"), snapshot=None)[0].endswith("on T4)")


def test_estimate_with_a_site_config_draws_the_picked_type_and_its_request(tmp_path):
    """estimate --config draws as check does: the type the site picks (the example site: a MIG slice of an H100),
    not the first estimated, with the chosen request named."""
    (tmp_path / "train.py").write_text(TRAIN)
    run = xmem("estimate", "--config", str(REPO / "etc" / "xmem.toml"), "--gpu", "a100", "--gpu", "h100",
               "--plot", "site.png", "--", PYTHON, "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "wrote site.png (memory over the run on H100-SXM5-80GB)" in run.stderr
    assert "picked: MIG 1g.10gb" in run.stdout
    assert "*: H100-SXM5-80GB, the GPU type shown below and drawn by --plot" in run.stdout  # A100 fits first
    assert "At the peak on H100-SXM5-80GB" in run.stdout
    assert (tmp_path / "site.png").read_bytes().startswith(PNG_MAGIC)
