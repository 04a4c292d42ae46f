#!/bin/bash
# xmem-slurm TaskProlog: runs as the job's user before each task, with the task's environment. Slurm applies
# the `export NAME=value` lines it prints (the estimate, the MPS memory limit, where to leave a measurement).
# It must never fail the task: xmem-slurm prolog exits 0 whatever happens, and so does this wrapper.
# @...@ settings are filled in at install time (scripts/slurm-dev-cluster.sh shows how).
export XMEM_CONFIG="${XMEM_CONFIG:-@XMEM_CONFIG@}"
export XMEM_MEASURE_DIR="@XMEM_MEASURE_DIR@"
timeout 20 "@XMEM_SLURM@" prolog 2>/dev/null
exit 0
