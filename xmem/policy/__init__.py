"""Policy: a job's peak GPU memory per GPU type + the site config -> the Slurm request to make, and why.

- `rules`: the offers a partition makes (whole GPUs, MIG slices, MPS shares, shards), the margin, the pick in the
  site's order of preference, the rules for requests the user wrote; the `Decision`.
- `options`: every offer side by side for people (`check`, `estimate --config`), the pick and the nearest miss.

Pure: no I/O, no Slurm, no torch.
"""

from xmem.policy.rules import (ACTIONS, Decision, Offer, considered_offers, decide, describe_offer, eligible_types,
                               estimate_types, gpu_options, gpus_per_node, gres_memory_bytes, job_offers,
                               job_partitions, job_peak, peak_for, screen, site_offers)

__all__ = ["ACTIONS", "Decision", "Offer", "considered_offers", "decide", "describe_offer", "eligible_types",
           "estimate_types", "gpu_options", "gpus_per_node", "gres_memory_bytes", "job_offers", "job_partitions",
           "job_peak", "peak_for", "screen", "site_offers"]
