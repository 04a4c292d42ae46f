"""xmem-slurm: CPU-only prediction of a PyTorch training job's peak GPU memory, and the Slurm glue that acts on it.

Pipeline (one subpackage or module per stage, data flows one way):
    jobscript -> trace -> orchestrate -> simulate -> gpus -> policy -> slurm
`xmem.estimate` wires trace..gpus together; `xmem.cli` is the command line. Beside the stages, `xmem.units` owns
the byte units and how sizes are written, `xmem.text` what text leaving xmem may hold (a line for people, a value
in the job comment).
"""

__version__ = "0.1.0"
