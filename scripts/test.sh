#!/usr/bin/env bash
# The project's test command: installs what the tests need (both torch builds, Slurm from Debian's packages),
# then runs the whole suite, integration tests on a real local Slurm included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Slurm's packages download while pip installs (a minute saved on a fresh machine); apt waits for the other's lock
# should install.sh need g++ meanwhile.
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  slurm_log=$(mktemp)
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=600 slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge; } >"$slurm_log" 2>&1 &
  slurm_pid=$!
fi
XMEM_WITH_CPU_BUILD=1 bash scripts/install.sh
if [ -n "${slurm_pid:-}" ]; then
  wait "$slurm_pid" || { echo "installing Slurm failed:" >&2; cat "$slurm_log" >&2; exit 1; }
fi
export XMEM_TEST_CPU_PYTHON="$PWD/.venv-cpu/bin/python"
set +e
# Two workers (pytest-xdist), one per core of the CI machine: most of a test's time is its traced program, one
# single-threaded process. Not `-n auto`: in a container it may count the host's cores, and each worker holds torch
# and its traces (2-3 GB). tests/conftest.py keeps the Slurm tests, and those sharing a module's fixture, each
# on one worker. A later -n wins: `bash scripts/test.sh -n 0` runs the tests in one process.
.venv/bin/python -m pytest -ra --durations=25 -n 2 --dist loadgroup "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected" (e.g. a -k filter that matches nothing): not a failure of the code.
if [ "$rc" = 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
