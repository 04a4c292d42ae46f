"""`--plot FILE.png`, `--plot-gpu TYPE` and `--snapshot FILE.pickle` of `estimate` and `check`: the options' I/O.

Owns checking the output paths before the (long) trace, keeping each estimate's traces (`KeepingEstimator`),
choosing the GPU type to draw, and writing the files. The replay is `xmem.pictures`, the drawing
`xmem.report_plots`, the snapshot `xmem.memory_snapshot`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmem.cli.common import shown_gpu
from xmem.gpus import GpuType, UnknownGpuError, find_gpu, load_catalog
from xmem.text import one_line

TITLE_COMMAND_MAX_CHARS = 110  # the command under the plot's title fits the figure's width


class PictureError(ValueError):
    """A picture option that cannot be honoured (unwritable path, a GPU type that was not estimated)."""


def check_outputs(plot: str | None, snapshot: str | None = None) -> None:
    """Fail before tracing when a picture could not be written: its folder is missing or not writable, or --plot
    without matplotlib (an optional dependency: `xmem-slurm[bench]`), which would fail only after the whole trace."""
    if plot is not None:
        try:
            import matplotlib  # noqa: F401 - what xmem.report_plots draws with
        except ImportError as e:
            raise PictureError(f"--plot needs matplotlib, which {sys.executable} cannot import ({e}): install it "
                               f"(pip install matplotlib, or xmem-slurm[bench]), or leave --plot out") from None
    for path in (plot, snapshot):
        if path is None:
            continue
        folder = Path(path).resolve().parent
        if not folder.is_dir():
            raise PictureError(f"cannot write {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise PictureError(f"cannot write {path}: folder {folder} is not writable")


def check_plot_gpu(name: str | None, estimated: Sequence[str] | None, catalog: Mapping[str, GpuType]) -> None:
    """Fail before tracing when `--plot-gpu` names an unknown type or one outside `estimated` (None: all)."""
    if name is None:
        return
    try:
        gpu = find_gpu(name, catalog)
    except UnknownGpuError as e:
        raise PictureError(f"--plot-gpu: {e}") from None
    if estimated and gpu.name not in {find_gpu(n, catalog).name for n in estimated}:
        raise PictureError(f"--plot-gpu {name}: {gpu.name} is not among the GPU types estimated "
                           f"({', '.join(estimated)})")


@dataclass
class KeptRun:
    command: Sequence[str]
    estimate: Any  # xmem.estimate.Estimate
    traces: dict
    env: Mapping[str, str]
    catalog: Mapping[str, GpuType] | None


@dataclass
class KeepingEstimator:
    """`xmem.estimate.estimate` that also keeps each command's traces, for the pictures after the analysis."""

    runs: list[KeptRun] = field(default_factory=list)

    def __call__(self, command: Sequence[str], **settings: Any) -> Any:
        from xmem.estimate import estimate

        traces: dict = {}
        result = estimate(command, **settings, keep_traces=traces)
        env = settings.get("env")
        site = settings.get("settings")
        self.runs.append(KeptRun(command, result, traces, dict(os.environ if env is None else env),
                                 site.catalog if site is not None else None))
        return result


def write_pictures(run: KeptRun, *, plot: str | None, snapshot: str | None, gpu_name: str | None = None,
                   chosen: Any = None, catalog_overrides: Mapping[str, Any] | None = None) -> list[str]:
    """Replay `run` on the GPU type to draw and write the files asked for; lines for people saying what was written.

    `chosen`: the site's pick (`xmem.policy.options.OptionRow`: gpu_type, request, usable_bytes), drawn as a level
    when it is on the GPU type drawn. The type drawn is `gpu_name`, else the one the answer shows
    (`xmem.cli.common.shown_gpu`: the pick's, else the estimate's breakdown type). Where the job does not fit it,
    the picture says what the job needs (`GpuEstimate.unlimited_peak_bytes`).
    """
    from xmem.memory_snapshot import write_snapshot
    from xmem.pictures import gpu_run

    if not run.estimate.used_cuda:
        raise PictureError("no picture: the program never used CUDA")
    catalog = run.catalog if run.catalog is not None else load_catalog(catalog_overrides)
    gpu = _gpu_to_draw(run, gpu_name or shown_gpu(run.estimate, chosen.gpu_type if chosen is not None else None,
                                                  catalog), catalog)
    estimated = run.estimate.gpus[gpu.name]
    on_drawn = chosen is not None and find_gpu(chosen.gpu_type, catalog).name == gpu.name
    replay = gpu_run(run.traces, gpu, run.env)
    written = []
    if plot:
        from xmem.report_plots import plot_run

        plot_run(replay, plot, slice_bytes=chosen.usable_bytes if on_drawn else None,
                 slice_name=chosen.request if on_drawn else "",
                 needs_bytes=None if estimated.fits else estimated.unlimited_peak_bytes or estimated.peak_bytes,
                 title=f"Predicted GPU memory on {gpu.name}\n"
                       f"{one_line(' '.join(run.command), TITLE_COMMAND_MAX_CHARS)}")
        written.append(f"wrote {plot} (memory over the run on {gpu.name})")
    if snapshot:
        write_snapshot(replay, snapshot)
        written.append(f"wrote {snapshot} (memory snapshot on {gpu.name}: python -m torch.cuda._memory_viz "
                       f"trace_plot {snapshot} -o trace.html, or open it at https://pytorch.org/memory_viz)")
    return written


def _gpu_to_draw(run: KeptRun, name: str, catalog: Mapping[str, GpuType]) -> GpuType:
    estimated = list(run.estimate.gpus)
    try:
        gpu = find_gpu(name, catalog)
    except UnknownGpuError as e:
        raise PictureError(str(e)) from None
    if gpu.name not in run.estimate.gpus:
        raise PictureError(f"--plot-gpu {name}: {gpu.name} was not estimated (estimated: {', '.join(estimated)})")
    return gpu


__all__ = ["KeepingEstimator", "KeptRun", "PictureError", "check_outputs", "check_plot_gpu", "write_pictures"]
