"""The inline path: one submission's analysis (parse, estimate, policy) in sbatch's own time, cached.

Owns running the real analysis (xmem.analyze: torch loads only on a cache miss), the analysis cache of the site
(xmem.cache, the user's private part), the host's estimate slots, and storing only what the files the trace
read still hash to. The deferred estimation job (xmem.slurm.deferred) runs the same cached analysis on a CPU
node; what the reply says is xmem.slurm.contract's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmem.cache import SHARED_SLOTS_DIR, AnalysisCache, estimate_slot, file_digest, user_cache_dir
from xmem.config import SiteConfig
from xmem.slurm.cache_check import valid_analysis
from xmem.slurm.contract import FilterRequest, Verdict, key_for
from xmem.text import ascii_whole_number

if TYPE_CHECKING:
    from xmem.analyze import JobAnalysis


def verdict_of(job_analysis: JobAnalysis) -> Verdict:
    """What the filter keeps of a job's analysis: its decision as it is, the peaks, the errors as text."""
    return Verdict(decision=job_analysis.decision, peaks={k: int(v) for k, v in job_analysis.peaks.items()},
                   errors=tuple(_error_text(e) for e in job_analysis.errors))


def _error_text(error: Any) -> str:
    kind, message = getattr(error, "kind", None), getattr(error, "message", None)
    if kind and message:
        return f"{kind}: {message}"
    return str(error)


def analyze_submission(script: str, request: FilterRequest, config: SiteConfig, *,
                       deadline: float | None = None, cancel: threading.Event | None = None) -> Verdict:
    """Run the real analysis (parse, estimate, policy), done by `deadline` (time.monotonic(); default: the site's
    estimate timeout from now). `cancel`, once set, stops its traces: the answer is no longer wanted (the filter
    handed the job off). Imported here: torch loads only on a cache miss."""
    from xmem.analyze import analyze_job
    from xmem.slurm.cluster import ask_slurm

    try:
        job_analysis = analyze_job(script, script_args=request.script_args, cli_options=request.cli_options(),
                                   config=config, env=dict(request.env) or None, user=request.user,
                                   submit_cwd=request.cwd, deadline=deadline, cluster=ask_slurm,
                                   estimator=guarded_estimator(request.options, script, cancel))
    except Exception as e:  # an estimator fault of any kind: the failure mode decides what happens
        return Verdict(decision=None, errors=(_error_text(e),))
    kept = kept_decision(job_analysis.errors)  # a user's program is never traced as root
    return Verdict(decision=kept) if kept else verdict_of(job_analysis)


def guarded_estimator(options: Mapping[str, str], script: str | None,
                      cancel: threading.Event | None = None) -> Callable[..., Any] | None:
    """None for an ordinary user with nothing to cancel (the analysis uses the real estimator); else the real
    estimator given `cancel` and, as root, behind xmem.trace.privileges' check (whose job it is), which refuses
    before anything starts."""
    from xmem.trace import privileges

    root = privileges.as_root()
    if not root and cancel is None:
        return None

    def estimate(command: Sequence[str], **kw: Any) -> Any:
        who = privileges.foreign_owner(options, script, command, kw.get("cwd")) if root else None
        if who:
            raise privileges.RootTraceRefused(privileges.notice(who))
        if cancel is not None and cancel.is_set():  # an array's next task: its first one was cancelled already
            from xmem.trace import TraceCancelled

            raise TraceCancelled()
        from xmem.estimate import estimate as real

        return real(list(command), cancel=cancel, **kw)
    return estimate


def kept_decision(errors: Sequence[Any]) -> Any:
    """The policy's "keep" Decision when a trace was refused as root (its notice is the reason), else None."""
    from xmem.policy import Decision
    from xmem.trace.privileges import KIND

    refused = [e for e in errors if getattr(e, "kind", None) == KIND]
    return Decision(action="keep", reason=refused[0].message) if refused else None


def parse_job(script: str, request: FilterRequest) -> Any:
    """The batch script as xmem.jobscript reads it, in the submitter's environment and directory; None when it
    is not understood here (the analysis then says why, in its own words)."""
    from xmem.jobscript import parse_jobscript

    try:
        return parse_jobscript(Path(script).read_text(errors="replace"), path=script,
                               script_args=list(request.script_args), submit_cwd=request.cwd,
                               cli_options=request.cli_options(), env=dict(request.env) or None)
    except Exception:
        return None


def command_files(job: Any, request: FilterRequest, script: str) -> list[str]:
    """Files the job's training commands name (train.py, a config...): their bytes belong in the cache key."""
    files = []
    for command in getattr(job, "commands", ()):
        cwd = command.cwd or request.cwd or os.path.dirname(script)
        for arg in command.argv[1:]:
            path = os.path.join(cwd, arg)
            if os.path.isfile(path):
                files.append(os.path.realpath(path))
    return files



def analysis_cache(config: SiteConfig) -> AnalysisCache:
    """The site's analysis cache: the user's private part of the cache directory, entries checked on read."""
    return AnalysisCache(user_cache_dir(config.estimate.cache_dir) / "analyses", validate=valid_analysis)


def config_digest(config: SiteConfig) -> str:
    """The site config's part of the cache key: its bytes, not its name."""
    return file_digest(config.source) if config.source else ""


def estimate_slots(config: SiteConfig, cancel: threading.Event | None = None,
                   wait_s: float | None = None) -> contextlib.AbstractContextManager:
    """One of the host's estimate slots, waiting at most `wait_s` (default: the site's estimate timeout), or until
    `cancel` is set; NoSlotFree when none is had by then."""
    return estimate_slot(SHARED_SLOTS_DIR, config.estimate.max_concurrent,
                         wait_s=config.estimate.timeout_s if wait_s is None else wait_s, cancel=cancel)


def cached_analysis(script: str, request: FilterRequest, config: SiteConfig, *, cache: AnalysisCache,
                    config_digest: str, files: Sequence[str] = (),
                    analyzer: Callable[[str, FilterRequest, Any], Verdict] = analyze_submission,
                    slots: Callable[[], contextlib.AbstractContextManager] | None = None,
                    key: str | None = None, usable: Callable[[Verdict], bool] | None = None,
                    progress_limit_s: float | None = None) -> Verdict:
    """The analysis from the cache, else computed (holding an estimate slot) and cached if it succeeded.
    Failures are not cached: the next submission tries again (the cause may have been transient). `key`: the
    cache key when the caller has it already (key_for reads and hashes the script and its files).

    The key hashes the files before the trace reads them: the result is stored only if they hash the same
    afterwards (an edit during the estimate would otherwise file the edited program's estimate under the
    original's key). The answer itself stands: it is of the files the job will run. `usable`: whether a cached
    verdict still holds (cache_check.still_offered); one that does not is a miss. `progress_limit_s`: the "at most"
    of the progress line (default: the estimate timeout)."""
    key = key or key_for(script, request, config_digest, list(files))
    hit = cache_hit(cache, key, usable)
    if hit is not None:
        return hit
    with estimate_progress(script, request, config, progress_limit_s), \
            slots() if slots else contextlib.nullcontext():
        hit = cache_hit(cache, key, usable)  # a burst of the same job: the first slot holder's result serves the others
        if hit is not None:
            return hit
        analysis = analyzer(script, request, config)
    if analysis.decision is not None and not analysis.errors and _same_files(key, script, request, config_digest,
                                                                             files):
        with contextlib.suppress(OSError):  # a cache that cannot be written never costs the answer
            cache.put(key, analysis.to_json())
    return analysis


def cache_hit(cache: AnalysisCache, key: str, usable: Callable[[Verdict], bool] | None = None) -> Verdict | None:
    """A cache hit, or None: a damaged entry, or one `usable` turns down, counts as a miss, so it is computed (and
    written) again."""
    hit = cache.get(key)
    if hit is None:
        return None
    try:
        verdict = Verdict.from_json(hit, cached=True)
    except (ValueError, TypeError, AttributeError):
        return None
    return verdict if usable is None or usable(verdict) else None


def _same_files(key: str, script: str, request: FilterRequest, config_digest: str, files: Sequence[str]) -> bool:
    try:
        return key_for(script, request, config_digest, list(files)) == key
    except OSError:
        return False


# --- the wait, on the submitter's terminal ------------------------------------------------------------------------

# Set by cli_filter.lua to the descriptor that holds sbatch's own stderr, only when that is a terminal (the filter's
# stderr is /dev/null: nothing it prints by accident reaches the user or the job).
PROGRESS_FD_ENV = "XMEM_PROGRESS_FD"
TICK_S = 1.0


@contextlib.contextmanager
def estimate_progress(script: str, request: FilterRequest, config: SiteConfig,
                      limit_s: float | None = None) -> Iterator[None]:
    """While a submission waits for an estimate (a cache miss: an estimate slot, then the trace), one line on
    sbatch's terminal, its seconds counted in place and ended with a newline before sbatch goes on (the line stays:
    it says why this sbatch took long). Nothing when sbatch's stderr is not a terminal, under `sbatch --quiet`, or
    outside cli_filter.lua. Every write is the ticker thread's, which blocks SIGTTOU (a background write to a
    `stty tostop` terminal would otherwise stop the filter): a terminal that does not take the text (paused,
    gone) costs the submission at most `TICK_S`, never the estimate."""
    fd = _progress_terminal(request)
    if fd is None:
        yield
        return
    name = "the --wrap command" if request.script is None else os.path.basename(script)
    ticker = _Ticker(fd, name, limit_s or getattr(getattr(config, "estimate", None), "timeout_s", None))
    restore = sigterm_exits()  # a `timeout` kill ends the line too (the Lua side's notice then starts a new one)
    ticker.start()
    try:
        yield
    finally:
        ticker.stop()
        restore()


def _progress_terminal(request: FilterRequest) -> int | None:
    """A private (close-on-exec) copy of the descriptor cli_filter.lua passed, if it is a terminal and progress is
    wanted; the passed one is closed, so no process this filter starts holds the user's terminal."""
    passed = ascii_whole_number(os.environ.pop(PROGRESS_FD_ENV, ""))
    if passed is None:
        return None
    try:
        if request.options.get("quiet") in (None, "", "0") and os.isatty(passed):  # "0": no --quiet
            return os.dup(passed)
        return None
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.close(passed)


def sigterm_exits() -> Callable[[], None]:
    """SIGTERM raises SystemExit until the returned function is called (what xmem.trace.runner.sigterm_raises does
    during a trace, here also during the wait for a slot), so that the line is ended. Only where it is ours to change:
    the main thread, SIGTERM's default action."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def exit_on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, previous)


class _Ticker:
    """The progress line's thread: `\r` and the line with the seconds so far, once a second, then a newline."""

    def __init__(self, fd: int, name: str, limit_s: float | None) -> None:
        self.fd, self.name, self.limit_s = fd, name, limit_s
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="xmem-progress", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(TICK_S)

    def line(self) -> str:
        """The line now, never wider than the terminal (`\r` returns to the start of the last row only): the
        script's name is shortened, then left out, before the seconds are."""
        try:
            width = os.get_terminal_size(self.fd).columns or 80
        except OSError:
            width = 80
        seconds = int(time.monotonic() - self.started)
        limit = f", at most {self.limit_s:.0f} s" if self.limit_s else ""
        tail = f" (not cached{limit})... {seconds} s"
        room = width - 1 - len("xmem-slurm: estimating GPU memory of ") - len(tail)
        name = self.name if len(self.name) <= room else "..." + self.name[len(self.name) - room + 3:]
        short = f"xmem-slurm: estimating... {seconds} s"
        lines = [f"xmem-slurm: estimating GPU memory of {name}{tail}"] if room >= 8 or name == self.name else []
        lines += [f"xmem-slurm: estimating GPU memory{tail}", short]
        return next((line for line in lines if len(line) < width), short[:width - 1])

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        try:
            while True:
                self._write("\r" + self.line())
                if self.done.wait(TICK_S):
                    break
            self._write("\r" + self.line() + "\n")
        except OSError:
            pass  # the terminal is gone: the submission goes on without the line
        finally:
            os.close(self.fd)

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]

