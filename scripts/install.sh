#!/usr/bin/env bash
# Install xmem-slurm into ./.venv (idempotent).
#   XMEM_TORCH=cuda (default): torch 2.14.1 + torchvision 0.29.1, the CUDA build a login node usually has
#                              (it runs without a GPU; torchvision is needed by the CNN benchmark jobs).
#   XMEM_TORCH=cpu:            torch 2.13.0, the small CPU build.
#   XMEM_WITH_CPU_BUILD=1:     also make ./.venv-cpu (CPU build), so the tests trace on both builds.
# The fake-CUDA tracer compiles a small native shim at first use: it needs g++ (Debian: build-essential).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# pip's output without the local-index notices; a failing pip still fails the script (pipefail).
quiet_pip() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

make_venv() {  # make_venv DIR EXTRAS TORCH-REQUIREMENTS...
  local dir=$1 extras=$2; shift 2
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  quiet_pip "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
  # The torch requirements again, so that no extra's dependency can replace the build chosen above.
  quiet_pip "$dir/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]" "$@"
  "$dir/bin/python" -c "import torch, xmem; print('$dir: torch', torch.__version__)"
}

command -v g++ >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; }
case "${XMEM_TORCH:-cuda}" in
  cuda) make_venv .venv test,bench,vision torch==2.14.1 torchvision==0.29.1 ;;
  cpu)  make_venv .venv test,bench torch==2.13.0 ;;
  *) echo "XMEM_TORCH must be cuda or cpu" >&2; exit 2 ;;
esac
if [ "${XMEM_WITH_CPU_BUILD:-0}" = 1 ]; then make_venv .venv-cpu test,bench torch==2.13.0; fi
