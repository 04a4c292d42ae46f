"""PNG figures for people who would rather look than read: an estimate's memory over its traced iterations, and a
site's estimates against what its jobs really used.

Owns the drawing (matplotlib, Agg backend: no display needed): the one colour table of every picture, labels, the
peak's annotation. The data come from `xmem.pictures.GpuRun` and `xmem.slurm.store` records.
Must not: compute estimates or read the store itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xmem.estimate import OVERHEAD
from xmem.pictures import GpuRun, category_curves, describe_op
from xmem.trace.events import Category
from xmem.units import GIB, MIB

# The one colour table of every picture: a category has its colour wherever it is drawn, whatever else the run
# holds; red only ever says "more than there is" (out of memory, what a job that does not fit needs, a job that
# used more than estimated) and green "fits" (the chosen slice, a job within its estimate), so no category is
# either.
OVER_COLOUR, FITS_COLOUR = "#d62728", "#2ca02c"
CATEGORY_COLOURS = {
    OVERHEAD: "#bdbdbd",  # CUDA context + libraries
    Category.PARAMETER: "#1f77b4",
    Category.UNSHARDED_PARAMETER: "#aec7e8",  # FSDP's gathered weights: the parameters' colour, lighter
    Category.BUFFER: "#9edae5",
    Category.GRADIENT: "#ff7f0e",
    Category.OPTIMIZER_STATE: "#bcbd22",
    Category.ACTIVATION: "#9467bd",
    Category.TEMPORARY: "#c5b0d5",  # the activations' colour, lighter
    Category.INPUT: "#e377c2",
    Category.WORKSPACE: "#8c564b",
    Category.OTHER: "#7f7f7f",
}
ALLOCATED_COLOUR, RESERVED_COLOUR, GPU_COLOUR = "#525252", "black", "#08519c"
ALERT_BOX = {"boxstyle": "round", "fc": "white", "ec": OVER_COLOUR}  # what does not fit
PEAK_BOX = {"boxstyle": "round", "fc": "white", "ec": RESERVED_COLOUR}
ZOOM_BELOW = 4  # the y axis stops short of the GPU's memory when the peak is under a quarter of it
# Bottom to top; categories the trace has but this list lacks go on top, in name order.
# Unsharded: FSDP's gathered weights, beside the shards.
CATEGORY_ORDER = (Category.PARAMETER, Category.UNSHARDED_PARAMETER, Category.BUFFER, Category.GRADIENT,
                  Category.OPTIMIZER_STATE, Category.ACTIVATION, Category.TEMPORARY, Category.INPUT,
                  Category.WORKSPACE, Category.OTHER)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: a login node has no display
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: GpuRun, path: str | Path, *, slice_bytes: int | None = None, slice_name: str = "",
             title: str = "", needs_bytes: int | None = None) -> None:
    """Memory over the run on `run.gpu` (see `draw_run`), written to `path`."""
    plt = _pyplot()
    fig = draw_run(run, slice_bytes=slice_bytes, slice_name=slice_name, title=title, needs_bytes=needs_bytes)
    fig.savefig(path)
    plt.close(fig)


def draw_run(run: GpuRun, *, slice_bytes: int | None = None, slice_name: str = "", title: str = "",
             needs_bytes: int | None = None) -> Any:
    """The figure of memory over the run on `run.gpu`, as the GPU would show it (the context and libraries at the
    bottom): the live tensors stacked by category, allocated and reserved as lines, the GPU's memory and the chosen
    slice as levels, the reserved peak marked with the op and module that reached it, and, where the job does not
    fit (`needs_bytes`: what it would need), that need as a level and in the title."""
    plt = _pyplot()
    sim = run.sim
    at = [index for index, _allocated, _reserved in sim.timeline]
    x = np.asarray(at)
    allocated = np.asarray([a for _i, a, _r in sim.timeline]) + run.overhead
    reserved = np.asarray([r for _i, _a, r in sim.timeline]) + run.overhead
    curves = category_curves(run, at)
    # a category that holds nothing in the whole run is left out of the legend; the others keep their colours
    order = [c for c in CATEGORY_ORDER if c in curves] + sorted(set(curves) - set(CATEGORY_ORDER))
    order = [c for c in order if curves[c].any()]
    fig, ax = plt.subplots(figsize=(15, 6.5), dpi=110)
    stacks = [np.full(len(x), run.overhead)] + [curves[c] for c in order]
    names = ["CUDA context + libraries"] + [c.replace("_", " ") for c in order]
    colours = [category_colour(c) for c in (OVERHEAD, *order)]
    ax.stackplot(x, [s / GIB for s in stacks], labels=names, colors=colours, alpha=0.75, step="post")
    ax.step(x, allocated / GIB, where="post", color=ALLOCATED_COLOUR, lw=1.0, label="allocated (memory_allocated)")
    ax.step(x, reserved / GIB, where="post", color=RESERVED_COLOUR, lw=1.6,
            label="reserved + overhead (what NVML shows)")
    peak = sim.peak_reserved + run.overhead
    # a small job on a large GPU: zoom on the job (the curves would be a flat line at the bottom), say so
    top = max(run.gpu.total_bytes, slice_bytes or 0) if run.gpu.total_bytes < ZOOM_BELOW * peak else \
        max(peak * 1.25, min(slice_bytes or 0, ZOOM_BELOW * peak))
    top = max(top, needs_bytes or 0)
    above = " (above the chart)" if run.gpu.total_bytes > top else ""
    ax.axhline(run.gpu.total_bytes / GIB, color=GPU_COLOUR, ls="--", lw=1.4,
               label=f"{run.gpu.name}: {run.gpu.total_bytes / GIB:.1f} GiB{above}")
    if needs_bytes:
        ax.axhline(needs_bytes / GIB, color=OVER_COLOUR, ls=":", lw=1.8,
                   label=f"the job needs {needs_bytes / GIB:.1f} GiB: does not fit")
    if slice_bytes:
        ax.axhline(slice_bytes / GIB, color=FITS_COLOUR, ls="-.", lw=1.6,
                   label=f"chosen: {slice_name} {slice_bytes / GIB:.1f} GiB".replace("  ", " ")
                   + (" (above the chart)" if slice_bytes > top else ""))
    last = sim.oom.index if sim.oom is not None else len(run.ops.ops) - 1  # the replay stops at an OOM
    _mark_iterations(ax, run, last)
    _mark_peak(ax, run, last)
    if sim.oom is not None:
        _mark_oom(ax, run)
    ax.set_xlim(0, max(last, 1))
    ax.set_ylim(0, top / GIB * 1.08)
    ax.set_xlabel("allocator events (alloc/free, in program order)")
    ax.set_ylabel("GPU memory (GiB)")
    title = title or f"Predicted GPU memory on {run.gpu.name}"
    if needs_bytes:
        title += (f"\ndoes not fit: the job needs {needs_bytes / GIB:.1f} GiB, the {run.gpu.name} has "
                  f"{run.gpu.total_bytes / GIB:.1f} GiB")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)  # off the curves
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def category_colour(category: str) -> str:
    """A category's colour in every picture (`CATEGORY_COLOURS`; one the table lacks is drawn as "other")."""
    return CATEGORY_COLOURS.get(category, CATEGORY_COLOURS[Category.OTHER])


def _mark_iterations(ax, run: GpuRun, last: int) -> None:
    for iteration, start in sorted(run.ops.iteration_starts.items()):
        if start >= last > 0:
            break  # an iteration that starts where the drawing ends: its label would be cut at the edge
        ax.axvline(start, color="grey", ls=":", lw=0.8)
        ax.annotate(f"iteration {iteration}", (start, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8, color="grey")


def _mark_peak(ax, run: GpuRun, last: int) -> None:
    """The marker on the reserved line where it first reaches its peak (what NVML would show), named by the op
    whose request took it there and that op's module."""
    index = run.sim.peak_reserved_index
    peak = (run.sim.peak_reserved + run.overhead) / GIB
    ax.plot([index], [peak], marker="v", color=RESERVED_COLOUR, ms=9, ls="none", label="_peak")
    right = index > 0.6 * last  # the label goes where there is room
    module = "" if (event := run.event_of(index)) is None or event.module else ", outside any module"
    ax.annotate(f"peak reserved {peak:.2f} GiB: {describe_op(run, index)}{module}", (index, peak),
                xytext=(-10 if right else 10, 14), textcoords="offset points", ha="right" if right else "left",
                fontsize=9, bbox=PEAK_BOX)


def _mark_oom(ax, run: GpuRun) -> None:
    oom = run.sim.oom
    ax.axvline(oom.index, color=OVER_COLOUR, lw=2)
    ax.annotate(f"out of memory: {describe_op(run, oom.index)} asked for {oom.requested / GIB:.2f} GiB",
                (oom.index, 0.5), xycoords=("data", "axes fraction"), xytext=(-8, 0), textcoords="offset points",
                ha="right", fontsize=9, annotation_clip=False, color=OVER_COLOUR,
                bbox=ALERT_BOX)


def plot_store(points: dict[str, Sequence[tuple[int, int]]], path: str | Path, title: str = "") -> None:
    """Estimate (x) against measured (y) peak per GPU type, one panel each, with the line where they are equal:
    a point above it is a job that used more than estimated."""
    plt = _pyplot()
    types = sorted(points)
    columns = min(len(types), 3) or 1
    rows = -(-len(types) // columns) or 1
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 4.4 * rows), dpi=110, squeeze=False)
    for ax, gpu_type in zip(axes.flat, types):
        estimated = np.asarray([e for e, _m in points[gpu_type]]) / GIB
        measured = np.asarray([m for _e, m in points[gpu_type]]) / GIB
        under = measured > estimated
        top = max(estimated.max(), measured.max()) * 1.1
        ax.plot([0, top], [0, top], color="grey", ls="--", lw=1, label="measured = estimate")
        ax.scatter(estimated[~under], measured[~under], color=FITS_COLOUR, s=22, label="within the estimate")
        ax.scatter(estimated[under], measured[under], color=OVER_COLOUR, s=22, label="used more than estimated")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        median = float(np.median(measured - estimated)) * GIB / MIB
        ax.set_title(f"{gpu_type}: {len(estimated)} job(s), {int(under.sum())} above\n"
                     f"median measured - estimate: {median:+.0f} MiB", fontsize=10)
        ax.set_xlabel("estimated peak (GiB)")
        ax.set_ylabel("measured peak (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(types):]:
        ax.set_visible(False)
    fig.suptitle(title or "Estimate against measured peak GPU memory, per GPU type")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["CATEGORY_COLOURS", "category_colour", "draw_run", "plot_run", "plot_store"]
