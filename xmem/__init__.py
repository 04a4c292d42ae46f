"""xmem-slurm: CPU-only prediction of a PyTorch training job's peak GPU memory, and the Slurm glue that acts on it.

Pipeline (one subpackage per stage, data flows one way):
    jobscript -> trace -> orchestrate -> simulate -> gpus -> policy -> slurm
`xmem.estimate` wires trace..gpus together; `xmem.cli` is the command line.
"""

__version__ = "0.1.0"
