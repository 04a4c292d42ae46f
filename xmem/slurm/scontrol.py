"""`scontrol`'s text, read in one place: one `scontrol show job|node|partition -o` record as a dict, and a job's
fields asked of slurmctld.

Slurm 22.05 has no `scontrol --json`, so its one-line records are parsed here; xmem.slurm.cluster (nodes,
partitions), xmem.slurm.node (the TaskProlog's comment) and xmem.slurm.deferred (a held job's request) use it.
Owns no decisions: callers say what a missing job or a refused call means to them.
"""

from __future__ import annotations

import re
import subprocess

# What scontrol (22.05) says when it never reached slurmctld, as opposed to the controller's own answer: no
# slurm.conf and no DNS SRV record, a controller name that does not resolve, nobody listening, no reply.
# A configuration file it cannot read (SLURM_CONF naming no file) is the same: no controller was asked.
UNREACHABLE = re.compile(r"Could not establish a configuration source|Unable to establish control machine address"
                         r"|Unable to process configuration file"
                         r"|Unable to contact slurm controller|Unable to resolve|Communication connection failure"
                         r"|Connection refused|Socket timed out|Zero Bytes were transmitted", re.IGNORECASE)


class SlurmUnreachable(LookupError):
    """scontrol could not reach slurmctld: nothing is known of the job. A LookupError, as every failed `scontrol
    show job` was before this one was told apart."""


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol show job|node|partition -o` line as {field: value}. Slurm's field names start with a capital
    (`MCS_label`, `TRES`); a value runs to the next ` Name=`, so a comment or a node's OS may hold spaces."""
    return dict(p.split("=", 1) for p in re.split(r"\s+(?=[A-Z][\w/:.]*=)", line.strip()) if "=" in p)


def scontrol_show_job(job_id: str, timeout_s: float = 30.0) -> dict[str, str]:
    """The job's fields as slurmctld has them; LookupError when it does not know the job, SlurmUnreachable when
    scontrol never reached slurmctld."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    if out.returncode != 0:
        unreachable = UNREACHABLE.search(out.stderr)
        if unreachable:
            raise SlurmUnreachable(f"scontrol: {unreachable.group(0)}")
        said = [line for line in out.stderr.splitlines() if line.strip()]  # scontrol's last word is its reason
        raise LookupError(said[-1].split(" error: ", 1)[-1].strip() if said else f"no job {job_id}")
    return parse_scontrol_record(out.stdout)
