"""Slurm glue: cluster queries (`cluster`), the sbatch filter, TaskProlog/Epilog helpers and their records.

I/O lives here (Slurm commands, files); decisions come from `xmem.policy`.
"""
