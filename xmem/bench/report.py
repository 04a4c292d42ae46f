"""The benchmark report: our estimates and the recorded estimators' side by side, per model and overall.

Owns the per-record result line (`BenchResult`), grouping, the summary dictionary, the printed table and the
picture. Pure except `write_picture` (matplotlib, Agg backend) and `print_table` (the console).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from xmem.bench.metrics import Outcome, Scores, score
from xmem.bench.records import ESTIMATORS, Reference
from xmem.units import GIB

OURS = "xmem-slurm"
TARGETS = {"mre": 0.03, "p90": 0.08, "under_share": 0.05, "oom_recall": 0.95, "median_seconds": 5.0}


@dataclass(frozen=True)
class BenchResult:
    """Our estimate of one record; `error` says why there is none (job not re-creatable, estimate failed)."""

    path: str
    estimate_bytes: int | None = None
    oom: bool | None = None
    seconds: float | None = None
    error: str | None = None
    details: dict = field(default_factory=dict)  # reserved, allocated, overhead, libraries, command...

    def to_json(self) -> dict:
        line = {"path": self.path, "estimate_bytes": self.estimate_bytes, "oom": self.oom, "seconds": self.seconds}
        if self.error:
            line["error"] = self.error
        return {**line, **self.details}

    @classmethod
    def from_json(cls, d: dict) -> "BenchResult":
        known = {"path", "estimate_bytes", "oom", "seconds", "error"}
        return cls(d["path"], d.get("estimate_bytes"), d.get("oom"), d.get("seconds"), d.get("error"),
                   {k: v for k, v in d.items() if k not in known})


def our_outcome(ref: Reference, result: BenchResult) -> Outcome | None:
    """Our estimate against the record, on the record's terms: where its peak leaves the CUDA context out, so does
    the figure compared (the OOM prediction keeps it: the real run had the context on the GPU)."""
    if result.estimate_bytes is None or result.oom is None:
        return None
    compared = result.estimate_bytes - (0 if ref.ground_has_context else result.details.get("context_bytes", 0))
    return Outcome(compared, result.oom, ref.ground_bytes, ref.real_oom, ref.capacity_bytes, result.seconds)


def recorded_outcome(ref: Reference, estimator: str) -> Outcome | None:
    run = ref.estimators.get(estimator)
    if run is None:
        return None
    return Outcome(run.memory, run.oom, ref.ground_bytes, ref.real_oom, ref.capacity_bytes, run.seconds,
                   run.capped_oom)


def outcomes_by_estimator(refs: list[Reference],
                          results: dict[str, BenchResult]) -> dict[str, list[tuple[Reference, Outcome]]]:
    """For each estimator (ours first), the (record, outcome) pairs it answered."""
    table: dict[str, list[tuple[Reference, Outcome]]] = {OURS: []}
    table.update({label: [] for label in ESTIMATORS.values()})
    for ref in refs:
        ours = our_outcome(ref, results[ref.path]) if ref.path in results else None
        if ours is not None:
            table[OURS].append((ref, ours))
        for key, label in ESTIMATORS.items():
            recorded = recorded_outcome(ref, key)
            if recorded is not None:
                table[label].append((ref, recorded))
    return table


def group_scores(pairs: Iterable[tuple[Reference, Outcome]], by=lambda ref: ref.model,
                 needed: Callable[[int], int] | None = None) -> dict[str, Scores]:
    """Scores per group (default: per model), and "overall"; `needed` as in `metrics.score`."""
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for ref, outcome in pairs:
        groups[by(ref)].append(outcome)
        groups["overall"].append(outcome)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] == "overall", kv[0]))
    return {name: score(outs, needed) for name, outs in ordered}


def targets_met(overall: Scores) -> dict[str, bool | None]:
    met: dict[str, bool | None] = {}
    for name, limit in TARGETS.items():
        value = getattr(overall, name)
        met[name] = None if value is None else (value >= limit if name == "oom_recall" else value <= limit)
    return met


def summary(refs: list[Reference], results: dict[str, BenchResult], meta: dict,
            needed: Callable[[int], int] | None = None) -> dict:
    """`needed`: estimate -> bytes the site policy would request (its margin), for the short-request share."""
    per_estimator = outcomes_by_estimator(refs, results)
    scores = {est: group_scores(pairs, needed=needed) for est, pairs in per_estimator.items()}
    missing = [{"path": r.path, "reason": results[r.path].error if r.path in results else "not estimated"}
               for r in refs if r.path not in results or results[r.path].estimate_bytes is None]
    ours_overall = scores[OURS].get("overall")
    return {
        **meta,
        "records": len(refs),
        "estimated": len(per_estimator[OURS]),
        "not_estimated": missing,
        "targets": TARGETS,
        "targets_met": targets_met(ours_overall) if ours_overall else {},
        "scores": {est: {group: s.to_json() for group, s in groups.items()} for est, groups in scores.items()},
        # where our misses come from: the same figures for us per optimizer and per (model, optimizer)
        "ours_by_optimizer": {g: s.to_json() for g, s in group_scores(per_estimator[OURS],
                                                                      lambda r: r.optimizer, needed).items()},
        "ours_by_model_optimizer": {g: s.to_json() for g, s in group_scores(
            per_estimator[OURS], lambda r: f"{r.model} / {r.optimizer}", needed).items()},
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(summary_dict: dict) -> list[list[str]]:
    """One row per (group, estimator), the columns of TABLE_HEADER."""
    rows = []
    groups = list(summary_dict["scores"][OURS]) or ["overall"]
    for group in groups:
        for est, by_group in summary_dict["scores"].items():
            s = by_group.get(group)
            if s is None:
                continue
            rows.append([group, est, str(s["runs"]), _pct(s["mre"]), _pct(s["p90"]), _pct(s["bias"]),
                         _pct(s["under_share"]), _pct(s.get("short_request_share")),
                         _pct(s["oom_recall"]), _pct(s["pef"]), _num(s["mcp_gib"]), _num(s["median_seconds"], 1)])
    return rows


TABLE_HEADER = ["model", "estimator", "runs", "MRE %", "p90 %", "bias %", "under %", "short %", "OOM hit %",
                "PEF %", "MCP GiB", "median s"]


def print_table(summary_dict: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Accuracy on {summary_dict.get('data', 'the data')} "
                        f"({summary_dict['estimated']}/{summary_dict['records']} records estimated)")
    for name in TABLE_HEADER:
        table.add_column(name, justify="left" if name in ("model", "estimator") else "right")
    previous = None
    for row in table_rows(summary_dict):
        if previous is not None and row[0] != previous:
            table.add_section()
        previous = row[0]
        table.add_row(*row, style="bold" if row[1] == OURS else None)
    Console(width=150).print(table)
    met = summary_dict.get("targets_met", {})
    if met:
        Console().print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED' if v is False else 'n/a'}"
                                                for k, v in met.items()))


def write_picture(refs: list[Reference], results: dict[str, BenchResult], path) -> None:
    """Estimated vs measured peak per estimator (left), signed error distribution per estimator (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_estimator = outcomes_by_estimator(refs, results)
    fig, (scatter, box) = plt.subplots(1, 2, figsize=(13, 5.5))
    names, errors = [], []
    for est, pairs in per_estimator.items():
        fits = [o for _, o in pairs if not o.real_oom and not o.oom]
        if not fits:
            continue
        scatter.scatter([o.ground / GIB for o in fits], [o.estimate / GIB for o in fits], s=12, alpha=0.7,
                        label=est, marker="o" if est == OURS else "x")
        names.append(est)
        errors.append([100 * (o.estimate - o.ground) / o.ground for o in fits])
    top = max((o.ground / GIB for pairs in per_estimator.values() for _, o in pairs), default=1)
    scatter.plot([0, top], [0, top], color="grey", linewidth=1)
    scatter.set(xlabel="measured NVML peak (GiB)", ylabel="estimated peak (GiB)",
                title="estimated vs measured (runs without OOM)")
    scatter.legend()
    box.boxplot(errors, showfliers=True)
    box.set_xticks(range(1, len(names) + 1), names)
    box.axhline(0, color="grey", linewidth=1)
    box.set(ylabel="(estimate - measured) / measured, %", title="signed error per estimator")
    box.set_ylim(-100, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
