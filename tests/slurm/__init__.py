"""Tests of xmem.slurm, one file per module (test_<module>.py)."""
