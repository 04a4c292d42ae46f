#!/usr/bin/env python3
"""Figures of the client corpus (tests/corpus/programs.py): per program, whether its estimate succeeded and the
seconds the trace took (wall clock of `run_trace`, child start to Trace, on this machine as loaded now).

    .venv/bin/python scripts/corpus_figures.py [NAME ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "corpus"))
from programs import ITERATIONS, PROGRAMS  # noqa: E402

from xmem.trace import TraceError, run_trace  # noqa: E402


def estimate(name: str) -> tuple[str, float, str]:
    """(outcome, seconds, what went wrong) of one program's trace."""
    program = PROGRAMS[name]
    start = time.monotonic()
    try:
        trace = run_trace(program.command(), iterations=ITERATIONS, timeout=600, **program.options)
    except TraceError as error:
        return "failed", time.monotonic() - start, f"{error.kind}: {str(error).splitlines()[0][:90]}"
    outcome = "ok" if trace.iterations == ITERATIONS else "short"
    return outcome, time.monotonic() - start, f"{trace.iterations} iterations"


def main(names: list[str]) -> int:
    print(f"{'program':<20} {'result':<7} {'seconds':>8}  detail")
    succeeded = 0
    for name in names or sorted(PROGRAMS):
        outcome, seconds, detail = estimate(name)
        succeeded += outcome == "ok"
        print(f"{name:<20} {outcome:<7} {seconds:8.1f}  {detail}", flush=True)
    print(f"{succeeded}/{len(names or PROGRAMS)} succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
