"""Policy: a job's peak GPU memory per GPU type + the site config -> the Slurm request to make, and why.

Pure (see `decide.py`): no I/O, no Slurm, no torch.
"""

from xmem.policy.decide import (ACTIONS, Decision, Offer, considered_offers, decide, describe_offer, eligible_types,
                                estimate_types, gpu_options, gpus_per_node, gres_capacity, job_partitions, job_peak,
                                peak_for, screen, site_offers)

__all__ = ["ACTIONS", "Decision", "Offer", "considered_offers", "decide", "describe_offer", "eligible_types",
           "estimate_types", "gpu_options", "gpus_per_node", "gres_capacity", "job_partitions", "job_peak", "peak_for",
           "screen", "site_offers"]
