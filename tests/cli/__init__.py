"""Tests of xmem.cli, one file per module (test_<module>.py): the commands as a user runs them."""
