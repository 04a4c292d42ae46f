#!/bin/bash
# xmem-slurm Prolog: runs as root on the node before the job. Makes the job's measure file for its user (in
# @XMEM_MEASURE_DIR@/<uid>/, a directory only that user and root reach) and, for an MPS job where the node runs the
# MPS control daemon, caps each client's GPU memory at the share Slurm allocated (nvidia-cuda-mps-control).
# A failing Prolog drains the node, so this wrapper always exits 0; errors go to the slurmd log via stderr.
# @...@ settings are filled in at install time (scripts/slurm-dev-cluster.sh shows how).
# bin/ beside this file comes first: where a site puts a wrapper of nvidia-cuda-mps-control that sets its daemon's
# CUDA_MPS_PIPE_DIRECTORY (a daemon per GPU), or a recording stand-in in the dev cluster's tests.
export PATH="$(dirname "$(readlink -f "$0")")/bin:/usr/local/bin:/usr/bin:/bin:$PATH"
timeout 30 "@XMEM_SLURM@" root-prolog --measure-dir "@XMEM_MEASURE_DIR@" || true
exit 0
