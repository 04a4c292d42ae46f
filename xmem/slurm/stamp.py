"""The job stamp: the estimate behind a job's GPU request, as the filter leaves it on the job and the node reads it.

Owns its two written forms, one format each: `XMEM_*` variables in the job's environment (what the TaskProlog
sees) and one `xmem:peak=...;need=...;type=...;req=...;act=...` token in the job's comment (what the Epilog and
`xmem-slurm status` see), followed by `why=` (the user's line at sbatch, also `XMEM_WHY`) and `was=` (the GPU
request as submitted) for every job the filter decided on, and deferred mode's `state=` and `fix=`. Each value is
written by `xmem.text.comment_value` and read back by `xmem.text.comment_text`. Pure text: no Slurm calls here.

The grammar is ours alone, whatever the user's own comment holds: the filter's token is the comment's last word that
starts with `xmem:` (`add_to_comment` puts it after the user's text, and its values hold no whitespace), only our
keys are read from it, and every number in it (or in the `XMEM_*` variables, which the user can set too) must be
ASCII digits (`xmem.text.ascii_whole_number`): a malformed value reads as absent, never as an error, so the node
still gives the job its measure file and the Epilog its record.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from xmem.text import ascii_whole_number, comment_text, comment_value

COMMENT_TAG = "xmem:"
# Every key the token may hold: the stamp's, then what contract.recorded and deferred mode add.
TOKEN_KEYS = ("peak", "need", "type", "req", "act", "state", "why", "was", "fix")
# A word starting `xmem:`: at the comment's start or after whitespace, up to the next whitespace.
_TOKEN = re.compile(r"(?:^|(?<=\s))xmem:(\S*)")
# What `add_to_comment` removes from the user's text: an older token of ours (or the user's copy of one).
_OURS = re.compile(r"\s*xmem:(?:" + "|".join(TOKEN_KEYS) + r")=\S*")
# The one line the user saw at sbatch, in the job's environment (its comment's `why=`): what `status` shows.
WHY_ENV = "XMEM_WHY"
# -- issue 32: how the filter hands that line to the job through --export (percent-encoded, as in the comment); the
# TaskProlog exports it decoded as XMEM_WHY. Under a name of its own, so that no task decodes a decoded line again
# (a job step inherits the batch script's XMEM_WHY).
WHY_ENCODED_ENV = "XMEM_WHY_ENCODED"


@dataclass(frozen=True)
class JobStamp:
    """The estimate behind a job's request, as the filter left it on the job."""

    peak_bytes: int | None = None  # predicted peak on gpu_type, no margin
    needed_bytes: int | None = None  # peak plus the site's margin: what the request was sized for
    gpu_type: str | None = None
    request: str | None = None  # the GRES (or --gpus) request the job went in with, e.g. "mps:40"
    action: str | None = None  # the policy's action: rewrite, keep, ...

    _ENV = {"peak_bytes": "XMEM_PEAK_BYTES", "needed_bytes": "XMEM_NEEDED_BYTES", "gpu_type": "XMEM_GPU_TYPE",
            "request": "XMEM_REQUEST", "action": "XMEM_ACTION"}
    _COMMENT = {"peak_bytes": "peak", "needed_bytes": "need", "gpu_type": "type", "request": "req",
                "action": "act"}

    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in self._ENV)

    def env(self) -> dict[str, str]:
        """`XMEM_*` variables. Values never hold commas (sbatch's --export splits on them) or quotes."""
        return {var: comment_value(getattr(self, f)) for f, var in self._ENV.items()
                if getattr(self, f) is not None}

    def comment(self) -> str:
        """One token: `xmem:peak=...;need=...;type=...;req=...;act=...`."""
        parts = [f"{key}={comment_value(getattr(self, f))}" for f, key in self._COMMENT.items()
                 if getattr(self, f) is not None]
        return COMMENT_TAG + ";".join(parts)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobStamp:
        return cls._build({f: env.get(var) for f, var in cls._ENV.items()})

    @classmethod
    def from_comment(cls, comment: str | None) -> JobStamp:
        """The stamp in a job comment's token (`comment_fields`: after whatever the user wrote)."""
        pairs = comment_fields(comment)
        return cls._build({f: pairs.get(key) for f, key in cls._COMMENT.items()})

    @classmethod
    def _build(cls, raw: Mapping[str, str | None]) -> JobStamp:
        as_int = ascii_whole_number  # `peak=²` or 5000 digits: no number, the rest of the stamp stands
        text = {f: comment_text(raw.get(f) or "") or None for f in ("gpu_type", "request", "action")}
        return cls(peak_bytes=as_int(raw.get("peak_bytes")), needed_bytes=as_int(raw.get("needed_bytes")), **text)


def add_to_comment(user_comment: str | None, stamp: JobStamp, state: str = "") -> str:
    """The job comment with the stamp in it: the user's comment kept, an older `xmem:` token replaced.
    `state` (deferred mode's `state=...;was=...` pairs) goes in the same token, after the stamp's."""
    token = stamp.comment()
    if state:
        token += (";" if not stamp.is_empty() else "") + state
    # Only a token of ours is replaced: the user's own words (even `xmem:`) pass unchanged.
    kept = _OURS.sub("", user_comment or "")
    return f"{kept} {token}" if kept.strip() else token


def comment_fields(comment: str | None) -> dict[str, str]:
    """Every `key=value` of the filter's token (the stamp's, and state, was, why, fix): the comment's last `xmem:`
    word, as `add_to_comment` leaves it after the user's own text (which may hold `xmem:` words too). Keys that
    are not TOKEN_KEYS are left out; empty when the comment has no token of ours."""
    tokens = _TOKEN.findall(comment or "")
    pairs = (p.split("=", 1) for p in tokens[-1].split(";") if "=" in p) if tokens else ()
    return {key: value for key, value in pairs if key in TOKEN_KEYS}


def has_token(comment: str | None) -> bool:
    """Whether the filter left its token on the job (a user's own `xmem:` word is not one)."""
    return bool(comment_fields(comment))
