"""Slurm glue. I/O lives here (Slurm commands, files); decisions come from `xmem.policy`.

- `filter`: `xmem-slurm filter` (`python -m xmem.slurm.filter`, run by slurm/cli_filter.lua): which path a
  submission takes. `contract`: the JSON it exchanges with the Lua side, the cache key, the reply.
  `inline`: the cached analysis in sbatch's time. `deferred`: the held job estimated as a CPU job.
  `cache_check`: what a cached analysis may hold.
- `stamp`: the estimate left on the job (its `XMEM_*` variables and its comment's `xmem:` token).
- `node`: the TaskProlog's exports, the Epilog's record and the node's settings (read when a command runs);
  `store`, `store_fit`: the records, their summary and the overhead fit's samples.
- `cluster`: what the cluster offers (partitions, nodes, GRES); `scontrol`: scontrol's records, parsed once.
"""
