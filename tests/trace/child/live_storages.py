"""The storages a trace holds live as it goes, for the tests that pin what is held at a moment of a step (the
sharding and modern-path modules): one walk over the events, and the moments they ask about."""

from typing import Callable, Iterator

from xmem.trace.events import MemEvent


def walk(result) -> Iterator[tuple[MemEvent, dict[int, MemEvent]]]:
    """Each event, with the storages live (block -> its alloc) just after it."""
    live: dict[int, MemEvent] = {}
    for e in result.events:
        _apply(live, e)
        yield e, live


def live_before(result, moment: Callable[[MemEvent], bool]) -> dict[int, MemEvent]:
    """The storages live just before the first event for which `moment` holds (at the end if none does)."""
    live: dict[int, MemEvent] = {}
    for e in result.events:
        if moment(e):
            break
        _apply(live, e)
    return live


def _apply(live: dict[int, MemEvent], e: MemEvent) -> None:
    if e.action == "alloc":
        live[e.block] = e
    elif e.action == "free":
        live.pop(e.block, None)


def by_category(live: dict[int, MemEvent]) -> dict[str, list[int]]:
    """The sizes of `live`'s storages per category, each list sorted."""
    held: dict[str, list[int]] = {}
    for alloc in live.values():
        held.setdefault(alloc.category, []).append(alloc.nbytes)
    return {category: sorted(nbytes) for category, nbytes in held.items()}


def peak_live_bytes(result) -> int:
    """The most bytes the trace's storages held live at once (requested sizes, before the allocator's rounding)."""
    return max((sum(e.nbytes for e in live.values()) for _, live in walk(result)), default=0)
