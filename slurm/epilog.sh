#!/bin/bash
# xmem-slurm Epilog: runs as root on the node when the job ends. Appends one JSON line (estimate, GRES, exit
# code, measured peak if there is one) to the site's store, which `xmem-slurm report` summarises.
# A failing Epilog drains the node, so this wrapper always exits 0; errors go to the slurmd log via stderr.
# @...@ settings are filled in at install time (scripts/slurm-dev-cluster.sh shows how).
export XMEM_CONFIG="@XMEM_CONFIG@"
timeout 30 "@XMEM_SLURM@" epilog --store "@XMEM_STORE@" --measure-dir "@XMEM_MEASURE_DIR@" || true
exit 0
