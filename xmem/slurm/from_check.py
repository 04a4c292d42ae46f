"""`xmem-slurm check job.sh`'s analysis, filed where the filter looks for it: `check job.sh` then `sbatch job.sh` of
the same job estimates once (it estimated twice, 49 s + 38 s).

Owns only the submission `check` stands for: what cli_filter.lua would send for `sbatch [options] job.sh args` from
this shell (`check_request`). The cache, its key and what a cached verdict holds are the filter's
(xmem.slurm.inline, xmem.slurm.contract): the same functions make both keys, so they agree where the job is the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xmem.config import SiteConfig
from xmem.slurm.contract import FilterRequest, key_for
from xmem.slurm.inline import analysis_cache, command_files, config_digest, parse_job, verdict_of

if TYPE_CHECKING:
    from xmem.analyze import JobAnalysis


def check_request(script: str, args: Sequence[str], cli_options: Mapping[str, str] | None,
                  env: Mapping[str, str], cwd: str) -> FilterRequest:
    """The submission `sbatch [cli_options] script args` from `cwd` with `env` would hand the filter."""
    return FilterRequest(script=os.path.abspath(script), argv=(script, *args), options=dict(cli_options or {}),
                         user=env.get("USER"), env=dict(env), cwd=cwd)


@dataclass(frozen=True)
class SharedAnalysis:
    """One check's entry in the filter's cache: its key taken before the analysis (the files its commands run
    hashed then), and the entry written after it only if they still hash the same, as the filter's own entries."""

    script: str
    request: FilterRequest
    site: SiteConfig
    key: str

    @classmethod
    def start(cls, script: str, request: FilterRequest, site: SiteConfig) -> SharedAnalysis | None:
        """Before the analysis; None when the job cannot be keyed (a script that cannot be read: the analysis
        says why)."""
        try:
            return cls(script, request, site, cls._key(script, request, site))
        except OSError:
            return None

    @staticmethod
    def _key(script: str, request: FilterRequest, site: SiteConfig) -> str:
        job = parse_job(script, request)
        return key_for(script, request, config_digest(site), command_files(job, request, script), job)

    def file(self, analysis: JobAnalysis) -> bool:
        """Write the analysis's verdict under the key, if it decided (failures are tried again, as the filter's
        are) and nothing it read changed meanwhile. True when written."""
        verdict = verdict_of(analysis)
        if verdict.decision is None or verdict.errors:
            return False
        try:
            if self._key(self.script, self.request, self.site) != self.key:
                return False
        except OSError:
            return False
        return analysis_cache(self.site).put(self.key, verdict.to_json())
