"""sbatch within a wait (issue 35 item 5): an estimate that is not ready within the site's `[filter] wait_s` is
handed to deferred estimation (xmem.slurm.deferred: the job held, estimated on the CPU partition, then released with
the rewritten request), or without a CPU partition goes on detached, the job's start put off (fail-open) or the
job held (fail-closed; xmem.slurm.putoff), instead of holding sbatch for up to `[estimate] timeout_s`.

Owns the race between the inline estimate and the wait. The estimate runs in a thread of its own; exactly one of the
two answers the submission. Ready within the wait: the inline answer, as before. Not ready: the job's snapshot for
deferral is made first, then the handoff is claimed under a lock, so an estimate that finishes after that moment is
never used inline (when it succeeded it is in the cache all the same: the estimation job and a later identical
submission find it there); the estimate is cancelled (its trace stopped, its wait for a slot ended) and sbatch goes
on. An estimate that won the race while the snapshot was made is used, and the snapshot removed.

Under a burst (measured with scripts/bench_filter.py --burst 30 --mode handoff, 2 users): every process of a
submission waits for the CPUs, and the wait is counted from sbatch's own start (the filter's caller passes it), not
from the filter's, which may start seconds later. An estimate that would first have to wait for one of the user's
`[estimate] max_concurrent` slots is not waited for at all: the job is handed off at once, its line says why
(admission: a slot's estimate takes seconds, and more estimates started would slow every submission's own start).

Where the site names no CPU partition (`hands_off` is false) there is nowhere to hand a job to that Slurm watches
over. Considered: (1) the job held while the estimate goes on on the login node, detached: a login-node process that
dies (the OOM killer, a reboot, the user's session limits) would leave the job held for good, with nothing Slurm runs
to release it; rejected. (2) the job's start put off instead of held: Slurm itself then starts a job nothing came
back for, unchanged, so it is fail-open by construction. Built as (2), xmem.slurm.putoff, which this race serves the
same way (the filter picks which reply a handoff makes): `begin` past the estimate's deadline, the user's own later
`--begin` kept, the detached estimate cancelled by the job's scancel and reporting through the job's comment. A
fail-closed site's put-off job would run unestimated: there the job is held as in (1), by the same module, and the
site's rule makes (1)'s flaw its choice: an estimate that fails or passes its deadline cancels the job (the refusal
inline), and one that dies leaves it held, blocked but not lost (`xmem-slurm status JOBID` says it is pending; the
hold is the user's to release, and the job then runs as submitted). So "sbatch returns within the wait, always"
holds wherever `[filter] put_off` is on (the default) or a CPU partition is configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from xmem.cache import NoSlotFree
from xmem.config import SiteConfig
from xmem.slurm.contract import FilterReply, FilterRequest, Verdict
from xmem.slurm.inline import sigterm_exits

# After a handoff, how long sbatch waits for the cancelled estimate to clean up (its trace stopped, its progress
# line ended) before going on; what is left then ends with the filter (PR_SET_PDEATHSIG) and its scratch is swept.
STOP_WAIT_S = 2.0


def hands_off(config: SiteConfig, request: FilterRequest) -> bool:
    """Whether an estimate not ready within `[filter] wait_s` is handed to the CPU partition: inline mode where the
    site names a `[deferred] cpu_partition`, for a submission that can be deferred at all."""
    from xmem.slurm.deferred import cannot_defer

    deferred = config.deferred
    return deferred.mode == "inline" and bool(deferred.cpu_partition) and cannot_defer(request) is None


class InlineEstimate:
    """The inline estimate in a thread of its own, so that the wait for it can end. `analyze(cancel)` returns the
    Verdict; `cancel` is set once the answer is no longer wanted."""

    def __init__(self, analyze: Callable[[threading.Event], Verdict]) -> None:
        self.cancel = threading.Event()
        self._analyze = analyze
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._handed_off = False
        self._outcome: Verdict | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="xmem-inline-estimate", daemon=True)

    def start(self) -> InlineEstimate:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            outcome: Verdict | BaseException = self._analyze(self.cancel)
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread by result()
            outcome = e
        with self._lock:
            if not self._handed_off:  # after the handoff nothing of this estimate answers the submission
                self._outcome = outcome
                self._done.set()

    def wait(self, until: float | None) -> bool:
        """Whether the estimate is done by `until` (time.monotonic(); None: however long it takes). A SIGTERM
        (sbatch gone, the Lua side's timeout) meanwhile cancels the estimate and waits for its cleanup first."""
        restore = sigterm_exits()
        try:
            while not self._done.wait(_step(until)):  # in steps: a signal reaches this thread between them
                if until is not None and time.monotonic() >= until:
                    return False
            return True
        except BaseException:
            self.stop()
            raise
        finally:
            restore()

    @property
    def no_slot(self) -> NoSlotFree | None:
        """The estimate's NoSlotFree, when it ended so: it never started (the user's slots are all taken)."""
        return self._outcome if isinstance(self._outcome, NoSlotFree) else None

    def claim_handoff(self) -> bool:
        """Hand the job off, unless the estimate was done first: True when handed off (and the estimate is being
        cancelled), False when its answer is to be used after all (`result`). One that found no slot is no answer."""
        with self._lock:
            if self._done.is_set() and self.no_slot is None:
                return False
            self._handed_off = True
        self.stop()
        return True

    def result(self) -> Verdict:
        """The estimate's answer, once `wait` said it is done; its exception is raised here."""
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        self.cancel.set()
        self._thread.join(wait_s)


def _step(until: float | None) -> float:
    return 0.2 if until is None else max(0.0, min(0.2, until - time.monotonic()))


def inline_or_handed_off(analyze: Callable[[threading.Event], Verdict], until: float,
                         hand_off: Callable[[str], tuple[FilterReply, Callable[[], None]]], *,
                         waited_s: float) -> Verdict | FilterReply:
    """The inline estimate's Verdict when it is ready by `until`; else the reply of `hand_off(why)`, which makes the
    deferral's snapshot and returns the reply with a function that removes the snapshot again. `analyze` raises
    NoSlotFree when the user's estimate slots are all taken: the job is handed off at once (why: the slots), with no
    wait. A snapshot that cannot be made (an OSError: the spool cannot be written) leaves the submission inline,
    waiting as before. `waited_s`: the wait `until` stands for, as the user's line says it."""
    estimate = InlineEstimate(analyze).start()
    if estimate.wait(until) and estimate.no_slot is None:
        return estimate.result()
    why = f"not started ({estimate.no_slot})" if estimate.no_slot else f"not ready within {waited_s:g} s"
    try:
        reply, undo = hand_off(why)
    except OSError:
        estimate.wait(None)
        return estimate.result()
    if estimate.claim_handoff():
        return reply
    undo()  # the estimate was done while the snapshot was made: it answers, the snapshot goes
    return estimate.result()

