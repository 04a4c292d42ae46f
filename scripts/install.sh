#!/usr/bin/env bash
# Install xmem-slurm (idempotent).
#
#   scripts/install.sh                      a developer's install into ./.venv
#   scripts/install.sh --prefix DIR [--packages-from VENV]
#                                           a site install every user of a login node can run (see below)
#
#   XMEM_TORCH=cuda (default): torch 2.14.1 + torchvision 0.29.1, the CUDA build a login node usually has
#                              (it runs without a GPU; torchvision is needed by the CNN benchmark jobs).
#   XMEM_TORCH=cpu:            torch 2.13.0, the small CPU build.
#   XMEM_WITH_CPU_BUILD=1:     also make ./.venv-cpu (CPU build), so the tests trace on both builds.
# Every other package is installed at the version in constraints.txt (and, for the CUDA build, constraints-cuda.txt:
# Triton and NVIDIA's libraries): what the tests passed on, not whatever was released since
# (scripts/freeze_constraints.py writes them; scripts/check_newest.sh tries the newest releases instead).
# The fake-CUDA tracer compiles a small native shim at first use: it needs g++ (Debian: build-essential).
#
# Site install (--prefix DIR, run as root): sbatch runs the filter as the submitting user, so its Python must be
# usable by everyone. A venv made from an interpreter under a private home (pyenv's /root/.pyenv, mode 700) is
# not: its python links there, and every other user's sbatch would get "xmem-slurm filter gave no answer".
#   DIR/venv          its own interpreter (`venv --copies` of one every user can run: $PYTHON if it is, else the
#                     system's python3), the packages, xmem-slurm; world-readable, nothing linking elsewhere
#   DIR/var/cache     a shared estimate.cache_dir: sticky and world-writable like /tmp; each user's entries go to
#                     a 0700 subdirectory they make themselves (xmem.cache.user_cache_dir)
#   DIR/var/measure   the jobs' measure files (XMEM_MEASURE_FILE): root's, 0755; the root Prolog makes each job's
#                     file in its user's own 0700 subdirectory, the Epilog reads only the job user's regular file
#   DIR/var/lib       the Epilog's record store (root's, 0755): XMEM_STORE=DIR/var/lib/records.jsonl
#   the estimate slots' directory (xmem.cache.SHARED_SLOTS_DIR, under /tmp): 1777, a 0700 subdirectory per user
# --packages-from VENV: reuse the packages installed in VENV (torch...) and this working tree's xmem (editable)
# through a .pth file instead of installing them again (the dev cluster and the tests: a few seconds); VENV's
# site-packages and the working tree must be readable by every user.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
PREFIX=
PACKAGES_FROM=
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) PREFIX=$2; shift 2 ;;
    --packages-from) PACKAGES_FROM=$2; shift 2 ;;
    *) echo "install.sh: unknown argument $1 (use: [--prefix DIR [--packages-from VENV]])" >&2; exit 2 ;;
  esac
done

# pip's output without the local-index notices; a failing pip still fails the script (pipefail).
quiet_pip() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

torch_requirements() {  # the build, its extras and its torch pins
  case "${XMEM_TORCH:-cuda}" in
    cuda) echo "cuda test,bench,vision torch==2.14.1 torchvision==0.29.1" ;;
    cpu)  echo "cpu test,bench torch==2.13.0" ;;
    *) echo "XMEM_TORCH must be cuda or cpu" >&2; exit 2 ;;
  esac
}

# constraint_args BUILD: pip's (and uv's) arguments that hold every package to the version the tests passed on.
constraint_args() {
  echo "-c $REPO/constraints.txt"
  if [ "$1" = cuda ]; then echo "-c $REPO/constraints-cuda.txt"; fi
}

make_venv() {  # make_venv DIR BUILD EXTRAS TORCH-REQUIREMENTS...
  local dir=$1 build=$2 extras=$3; shift 3
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  # shellcheck disable=SC2207
  local constraints=($(constraint_args "$build"))
  # One pip run: the torch requirements beside the extras, so that no extra's dependency can pick another build.
  # Skipped when DIR holds what its last run here installed, for the same arguments, pyproject.toml and constraints
  # files: pip would change nothing, and its resolver and the editable build cost 15-20 s of CPU per environment.
  local stamp=$dir/.xmem-install
  if [ "$(cat "$stamp" 2>/dev/null)" != "$(install_key "$dir" "$extras" "${constraints[@]}" "$@")" ]; then
    # A word before the long wait: pip is quiet here, and a first install downloads and unpacks gigabytes.
    echo "installing into $dir: xmem-slurm [$extras] $* (a first install downloads up to about 3 GiB and" \
         "takes several minutes; README.md, Quick start)..."
    local started=$SECONDS
    fast_install "$dir" "${constraints[@]}" -e ".[$extras]" "$@" \
      || quiet_pip "$dir/bin/python" -m pip install -q --disable-pip-version-check "${constraints[@]}" \
           -e ".[$extras]" "$@"
    install_key "$dir" "$extras" "${constraints[@]}" "$@" > "$stamp"
    echo "installed into $dir in $((SECONDS - started)) s"
  fi
  "$dir/bin/python" -c "import torch, xmem; print('$dir: torch', torch.__version__)"
}

# fast_install DIR REQUIREMENTS...: pip's install done by uv (from PyPI, into DIR itself): the same packages, from
# the same indexes and links, in about a third of pip's time (it unpacks and byte-compiles on every core; measured:
# the CUDA environment 69 s against 205 s). Fails (and pip runs instead) where uv cannot be had.
fast_install() {
  local dir=$1; shift
  local links=${PIP_FIND_LINKS:-$("$dir/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
  local link_args=() link
  for link in $links; do link_args+=(--find-links "$link"); done
  [ -x "$dir/bin/uv" ] || quiet_pip "$dir/bin/python" -m pip install -q --disable-pip-version-check \
    -c "$REPO/constraints.txt" uv || return 1
  "$dir/bin/uv" pip install -q --python "$dir/bin/python" --compile-bytecode "${link_args[@]}" "$@"
}

# install_key DIR EXTRAS REQUIREMENTS...: what make_venv asked for, pyproject.toml and the constraints files (a
# change to either reinstalls), and the distributions DIR holds (any pip run into DIR since, one that upgrades or
# removes a package, changes it).
install_key() {
  local dir=$1; shift
  printf '%s\n' "$REPO" "$@" "$(sha256sum < pyproject.toml)" "$(cat constraints.txt constraints-cuda.txt | sha256sum)"
  ls "$dir"/lib/python*/site-packages | grep '\.dist-info$'
}

# world_usable PATH: every directory above PATH lets others in, and PATH lets them read (and run) it.
world_usable() {
  local p; p=$(readlink -f "$1") || return 1
  [ -r "$p" ] && [ "$(( 0$(stat -c %a "$p") & 05 ))" != 0 ] || return 1
  while [ "$p" != / ]; do
    p=$(dirname "$p")
    [ "$(( 0$(stat -c %a "$p") & 01 ))" != 0 ] || return 1
  done
}

# An interpreter every user can run: the binary and its standard library (and libpython, if it links one).
usable_interpreter() {
  local py=$1 exe stdlib lib
  exe=$(command -v "$py") || return 1
  read -r exe stdlib < <("$exe" -c 'import sys, sysconfig; print(sys.executable, sysconfig.get_paths()["stdlib"])')
  world_usable "$exe" && world_usable "$stdlib" || return 1
  for lib in $(ldd "$exe" 2>/dev/null | awk '/libpython/ {print $3}'); do world_usable "$lib" || return 1; done
  echo "$exe"
}

site_install() {
  [ "$(id -u)" = 0 ] || { echo "install.sh --prefix: run as root (it makes directories for every user)" >&2; exit 2; }
  local base
  base=$(usable_interpreter "$PY" || usable_interpreter /usr/bin/python3) || {
    echo "install.sh: no Python every user can run ($PY lives under a private directory); give PYTHON=..." >&2
    exit 2; }
  mkdir -p "$PREFIX"; PREFIX=$(cd "$PREFIX" && pwd)
  [ -x "$PREFIX/venv/bin/python" ] || "$base" -m venv --copies ${PACKAGES_FROM:+--without-pip} "$PREFIX/venv"
  local py=$PREFIX/venv/bin/python
  if [ -n "$PACKAGES_FROM" ]; then
    local shared
    shared=$("$PACKAGES_FROM/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    world_usable "$shared" || { echo "install.sh: $shared is not readable by every user" >&2; exit 2; }
    # The working tree first (xmem, editable), then VENV's packages; the entry point pip would have written.
    local purelib; purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\n' "$REPO" "$shared" > "$purelib/xmem-shared-packages.pth"
    printf '#!%s\nimport sys\nfrom xmem.cli import main\nsys.exit(main())\n' "$py" > "$PREFIX/venv/bin/xmem-slurm"
    chmod 755 "$PREFIX/venv/bin/xmem-slurm"
  else
    read -r build extras reqs <<< "$(torch_requirements)"
    # shellcheck disable=SC2046,SC2086
    quiet_pip "$py" -m pip install -q --disable-pip-version-check $(constraint_args "$build") $reqs "$REPO[$extras]"
  fi
  chmod -R a+rX "$PREFIX/venv"
  install -d -m 0755 "$PREFIX/var" "$PREFIX/var/lib" "$PREFIX/var/measure"
  install -d -m 1777 "$PREFIX/var/cache"
  chmod 1777 "$PREFIX/var/cache"; chmod 0755 "$PREFIX/var/measure"  # also when they existed with another mode
  local slots; slots=$("$py" -c 'from xmem.cache import SHARED_SLOTS_DIR; print(SHARED_SLOTS_DIR)')
  # Root's, or made again: one squatted by a user (or a symlink) would send everyone to their home's slots.
  if [ -L "$slots" ] || { [ -e "$slots" ] && [ "$(stat -c %u "$slots")" != 0 ]; }; then rm -rf "$slots"; fi
  install -d -m 1777 "$slots"; chmod 1777 "$slots"
  # Proof, as nobody: the filter's interpreter starts and imports xmem and torch.
  setpriv --reuid=65534 --regid=65534 --clear-groups -- "$py" -I -c "import torch, xmem.slurm.filter" \
    || { echo "install.sh: $py does not run as an ordinary user" >&2; exit 1; }
  echo "site install in $PREFIX: XMEM_PYTHON=$py, xmem-slurm at $PREFIX/venv/bin/xmem-slurm," \
       "estimate.cache_dir = \"$PREFIX/var/cache\", XMEM_MEASURE_DIR=$PREFIX/var/measure," \
       "XMEM_STORE=$PREFIX/var/lib/records.jsonl"
}

command -v g++ >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 g++ >/dev/null; }
if [ -n "$PREFIX" ]; then
  site_install
  exit 0
fi
read -r build extras reqs <<< "$(torch_requirements)"
# shellcheck disable=SC2086
if [ "${XMEM_WITH_CPU_BUILD:-0}" = 1 ]; then
  # Both environments at once: pip installs (and byte-compiles) on one core, so two runs take little more than the
  # larger one. `wait PID` returns that run's status, so a failing pip still fails the script.
  make_venv .venv "$build" "$extras" $reqs & main_pid=$!
  make_venv .venv-cpu cpu test,bench torch==2.13.0 & cpu_pid=$!
  wait "$main_pid"; wait "$cpu_pid"
else
  make_venv .venv "$build" "$extras" $reqs
fi
