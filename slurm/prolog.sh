#!/bin/bash
# xmem-slurm Prolog: runs as root on the node before the job. Makes the job's measure file for its user (in
# @XMEM_MEASURE_DIR@/<uid>/, a directory only that user and root reach) and, for an MPS job where the node runs the
# MPS control daemon, caps each client's GPU memory at the share Slurm allocated (nvidia-cuda-mps-control).
# A failing Prolog drains the node, so this wrapper always exits 0; errors go to the slurmd log via stderr.
# @...@ settings are filled in at install time (scripts/slurm-dev-cluster.sh shows how).
export PATH="/usr/local/bin:/usr/bin:/bin:$PATH"
timeout 30 "@XMEM_SLURM@" root-prolog --measure-dir "@XMEM_MEASURE_DIR@" || true
exit 0
