"""Policy: a job's peak GPU memory per GPU type + the site config -> the Slurm request to make, and why.

Pure (see `decide.py`): no I/O, no Slurm, no torch.
"""

from xmem.policy.decide import (ACTIONS, Decision, Offer, considered_offers, decide, describe_offer, eligible_types,
                                estimate_types, gres_capacity, job_partitions, peak_for, screen, site_offers)

__all__ = ["ACTIONS", "Decision", "Offer", "considered_offers", "decide", "describe_offer", "eligible_types",
           "estimate_types", "gres_capacity", "job_partitions", "peak_for", "screen", "site_offers"]
