"""Tests of xmem.policy, one file per module (test_<module>.py)."""
