"""Submissions and decisions as the filter receives them, shared by the tests of xmem.slurm's filter modules."""

from xmem.policy import Decision
from xmem.slurm.contract import FilterRequest

GIB = 1 << 30


def request(**options):
    return FilterRequest(script="/home/ann/job.sh", argv=("/home/ann/job.sh", "--lr", "1"), options=options,
                         user="ann", env={"PWD": "/home/ann"})


def decision(**fields):
    """A real policy decision, as the filter receives it."""
    d = dict(action="rewrite", reason="needs 8.0 GiB with margin: MPS 40 % of an a100 is the smallest fit",
             gres="mps:a100:40", option="gres", kind="mps", gpu_type="a100", peak_bytes=7 * GIB,
             needed_bytes=8 * GIB, granted_bytes=16 * GIB)
    d.update(fields)
    return Decision(**d)


PEAKS = {"a100": 7 * GIB, "h100": 7 * GIB + 5}
