"""The self-audit of a trace: does the alloc stream hold what the run's own objects say was on the GPU?

Owns the comparison of a trace's `facts` (taken by `xmem.trace.child.facts` from the optimizers, modules and batch of
the run, not from the recorder) with the trace's live storages per device and category at the point each fact
was taken. A fact the trace does not hold (fewer storages, or more than `BYTES_TOLERANCE` of its bytes missing)
gives a reason; an estimate with reasons is `suspect`. Only shortfalls count: a trace holding more than a fact
(an EMA copy, a second model) is not evidence of a missed allocation. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from xmem.trace.events import FACT_OFFLOADED, FACT_STEPPED, Fact, MemEvent, Trace
from xmem.units import MIB

# Facts and trace count the same storages by the same size, so they match exactly when the trace is right; the
# tolerance only keeps a stray small storage (a scalar labelled otherwise) from making an estimate suspect.
BYTES_TOLERANCE = 0.01

Held = dict[tuple[int, str], tuple[int, int]]  # (device, category) -> (storages, bytes) live at one point


def audit(trace: Trace) -> tuple[str, ...]:
    """Why the trace contradicts its run's facts, one reason per fact it does not hold; () when it holds them
    all, and when no facts were taken (a tracer that did not collect them, or gave up)."""
    if trace.facts is None:
        return ()
    reasons = [reason for fact, held in zip(trace.facts, held_at(trace.events, [f.at_event for f in trace.facts]))
               if (reason := shortfall(fact, held))]
    stepped = (FACT_STEPPED, FACT_OFFLOADED)  # a parameter on the GPU, or one a wrapper's offload keeps on the host
    if trace.used_cuda and trace.iterations > 0 and not any(f.what in stepped for f in trace.facts):
        reasons.append("no parameter on the GPU was stepped by an optimizer, although the trace completed "
                       f"{trace.iterations} step(s) on the GPU")
    if trace.forward_only and trace.unstepped_optimizers:
        reasons.append("the program made an optimizer but the trace holds none of its steps (forward passes only): "
                       "its training would need more")
    if trace.forward_only and trace.peak_rising:
        reasons.append("the GPU's peak still rose in the last forward passes when the trace's time limit ended them: "
                       "the job's may be higher")
    return tuple(dict.fromkeys(reasons))


def held_at(events: Sequence[MemEvent], points: Sequence[int]) -> list[Held]:
    """For each point (a number of events from the start), what was live per device and category just after
    those events. One pass over the events, whatever the order of `points`."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    out: list[Held] = [{} for _ in points]
    live: dict[int, MemEvent] = {}
    totals: dict[tuple[int, str], list[int]] = {}
    done = 0
    for i in order:
        for event in events[done:points[i]]:
            _apply(event, live, totals)
        done = max(done, points[i])
        out[i] = {key: (count, nbytes) for key, (count, nbytes) in totals.items() if count}
    return out


def _apply(event: MemEvent, live: dict[int, MemEvent], totals: dict[tuple[int, str], list[int]]) -> None:
    if event.action == "alloc" and event.nbytes > 0:
        live[event.block] = event
        total = totals.setdefault((event.device, event.category), [0, 0])
        total[0] += 1
        total[1] += event.nbytes
    elif event.action == "free" and (born := live.pop(event.block, None)) is not None:
        total = totals[born.device, born.category]
        total[0] -= 1
        total[1] -= born.nbytes


def shortfall(fact: Fact, held: Held) -> str:
    """The reason `held` (the trace's live storages at the fact's point) falls short of `fact`; "" if it does not."""
    if not fact.categories:
        return (f"{fact.what} ({fact.source}): the traced program may have built another model or batch than "
                "the GPU would run")
    count, nbytes = _in_categories(held, fact.device, fact.categories)
    missing_storages = fact.storages and count < fact.storages
    if not missing_storages and nbytes >= fact.nbytes * (1 - BYTES_TOLERANCE):
        return ""
    expected = _amount(fact.storages, fact.nbytes)
    found = _amount(count if fact.storages else 0, nbytes)
    source = f" ({fact.source})" if fact.source else ""
    return (f"{fact.what} on GPU {fact.device}: {expected}{source}, but the trace holds {found} as "
            f"{' or '.join(c.replace('_', ' ') for c in fact.categories)} at that point")


def _in_categories(held: Held, device: int, categories: Iterable[str]) -> tuple[int, int]:
    count = nbytes = 0
    for category in categories:
        c, b = held.get((device, category), (0, 0))
        count, nbytes = count + c, nbytes + b
    return count, nbytes


def _amount(storages: int, nbytes: int) -> str:
    size = next((f"{nbytes / scale:.1f} {unit}" for scale, unit in ((MIB, "MiB"), (1 << 10, "KiB"))
                 if nbytes >= scale), f"{nbytes} B")
    return f"{size} in {storages} storage(s)" if storages else size
