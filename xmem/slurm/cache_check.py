"""What a cached analysis may hold, checked on every read: a cache entry is a file the user's own jobs can write,
so it must not be able to set anything the filter would not set itself.

Owns the shape of a cached `xmem.slurm.contract.Verdict`: the decision's action from the policy's set, the one
rewritten option from the GPU options the filter sets (`--gres`, `--gpus`, `--gpus-per-node`, `--gpus-per-task`),
its value a GPU request that xmem.jobscript parses (no `--chdir`, no spaces, no second option smuggled in), sizes
as non-negative whole numbers, names as plain words. An entry that fails is a miss: the job is estimated again.
A well-formed rewrite is used only if the policy, asked again on the entry's peaks with the cluster's offers of
today, makes the same one (`still_offered`): the policy is the one judge of what a request may be.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from xmem.config import SiteConfig
from xmem.jobscript.directives import GPU_GRES_NAMES, DirectiveError, parse_gpus, parse_gres
from xmem.policy.rules import ACTIONS

if TYPE_CHECKING:
    from xmem.jobscript import JobScript

REWRITE_OPTIONS = frozenset({"gres", "gpus", "gpus-per-node", "gpus-per-task"})
NUMBERS = ("peak_bytes", "needed_bytes", "granted_bytes")
WORD = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
REQUEST = re.compile(r"[A-Za-z0-9_.:,+-]{1,256}")
MAX_TEXT = 4096  # a reason or a comment: one line for the user


def valid_analysis(entry: Mapping[str, Any]) -> bool:
    """True when the cached analysis could have come from the filter itself."""
    decision, peaks, errors = entry.get("decision"), entry.get("peaks", {}), entry.get("errors", [])
    return ((decision is None or _valid_decision(decision))
            and isinstance(peaks, dict) and all(_word(k) and _size(v) for k, v in peaks.items())
            and isinstance(errors, list) and all(_text(e) for e in errors))


def still_offered(verdict: Any, job: JobScript | None, config: SiteConfig, user: str | None = None) -> bool:
    """True when a cached `xmem.slurm.contract.Verdict` may be used for `job` (an xmem.jobscript.JobScript): what
    it does not rewrite changes nothing; a rewrite must be the one `xmem.analyze.decide_on_peaks` makes now (an
    edited entry, or a cluster that no longer offers it, makes a miss)."""
    cached = verdict.decision
    if cached is None or cached.action != "rewrite":
        return True
    if job is None:
        return False
    from xmem.analyze import decide_on_peaks
    from xmem.slurm.cluster import ask_slurm

    now = decide_on_peaks(job, verdict.peaks, config, user=user, cluster=ask_slurm)
    return (now.action, now.option, now.gres, now.gpus) == (cached.action, cached.option, cached.gres, cached.gpus)


def _valid_decision(d: Any) -> bool:
    if not isinstance(d, dict) or d.get("action") not in ACTIONS or not _text(d.get("reason", "")):
        return False
    if not all(d.get(name) is None or _size(d[name]) for name in NUMBERS):
        return False
    if not all(d.get(name) is None or _word(d[name]) for name in ("gpu_type", "kind")):
        return False
    return _valid_request(d)


def _valid_request(d: Mapping[str, Any]) -> bool:
    """The option and value the filter would pass to sbatch: a GPU option, and a GPU request in its syntax."""
    option, gres, gpus = d.get("option"), d.get("gres"), d.get("gpus")
    if option is not None and option not in REWRITE_OPTIONS:
        return False
    try:
        if gres is not None and not (_request(gres) and all(i.name in GPU_GRES_NAMES for i in parse_gres(gres))):
            return False
        if gpus is not None and not (_request(gpus) and parse_gpus(gpus)):
            return False
    except DirectiveError:
        return False
    return True


def _word(value: Any) -> bool:
    return isinstance(value, str) and WORD.fullmatch(value) is not None


def _request(value: Any) -> bool:
    return isinstance(value, str) and REQUEST.fullmatch(value) is not None


def _size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 60


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT
