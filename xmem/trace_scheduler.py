"""The traces of the other capability classes, run beside the first (`xmem.estimate.trace_per_capability_class`):
each in a thread of its own once the first trace reports a GPU-dependent choice, until all are in or one is
cancelled. Knows nothing of tracing: it runs the `trace` callable it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from xmem.gpus import GpuType
from xmem.trace.events import Trace
from xmem.trace.runner import sigterm_raises


class TracesBeside:
    """The other capability classes' traces, each run in a thread of its own once `start` is called (by the first
    trace's progress), until `results` has them all or `cancel` stops them."""

    def __init__(self, gpus: dict[str, GpuType], trace: Callable[..., Trace],
                 on_progress: Callable[[str], None] | None) -> None:
        self.gpus, self.trace, self.on_progress = gpus, trace, on_progress
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}
        self.outcomes: dict[str, Trace | BaseException] = {}

    def start(self) -> None:
        with self.lock:
            if self.threads or self.cancelled.is_set():
                return
            for cls in self.gpus:
                self.threads[cls] = threading.Thread(target=self._run, args=(cls,), daemon=True,
                                                     name=f"xmem trace {cls}")
                self.threads[cls].start()

    def results(self) -> dict[str, Trace]:
        self.start()
        try:
            with sigterm_raises():  # as while the first trace ran: the cleanup below runs
                for thread in self.threads.values():
                    while thread.is_alive():  # in steps: a signal (Ctrl-C, SIGTERM) still reaches this thread
                        thread.join(0.2)
        except BaseException:
            self.cancel()
            raise
        for cls in self.gpus:
            if isinstance(self.outcomes[cls], BaseException):
                raise self.outcomes[cls]
        return dict(self.outcomes)  # type: ignore[arg-type]

    def cancel(self) -> None:
        with self.lock:
            self.cancelled.set()
        for thread in self.threads.values():
            thread.join()

    def _run(self, cls: str) -> None:
        progress = (lambda line: self.on_progress(f"{cls}: {line}")) if self.on_progress is not None else None
        try:
            self.outcomes[cls] = self.trace(self.gpus[cls], progress, self.cancelled)
        except BaseException as error:  # noqa: BLE001 - given to the caller by results()
            self.outcomes[cls] = error
