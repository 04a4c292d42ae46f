#!/usr/bin/env bash
# A real single-node Slurm 22.05 cluster on this machine, for development and the integration tests, with
# xmem-slurm's cli_filter, TaskProlog and Epilog installed from the project's slurm/ files.
#
#   scripts/slurm-dev-cluster.sh up   [--lab DIR] [--port N] [--mode inline|partition|handoff]
#                                      start (idempotent); prints the `export SLURM_CONF=...` line. partition:
#                                      also a `cpu` partition, and the config's deferred mode (issue 5); handoff:
#                                      the `cpu` partition in inline mode: an estimate not ready within
#                                      [filter] wait_s goes there (issue 35 item 5)
#   scripts/slurm-dev-cluster.sh down [--lab DIR]              cancel jobs, stop slurmd and slurmctld by PID
#
# DIR defaults to /tmp/xmem-slurm-lab; N (slurmctld's port, slurmd uses N+1) to 6817. Run as root; jobs run as their
# submitter. For users other than root to submit, DIR and the xmem-slurm install must be theirs to read: a site
# install (scripts/install.sh --prefix) does it; $LAB/cache and $LAB/measure are 1777.
# Fake GPUs: gpu:a100:2, gpu:h100:1 and a MIG-style gpu:1g.10gb:1 (symlinks to /dev/null named nvidiaN), and
# mps:100 on each a100. Why MPS and no shard: with both configured, Slurm 22.05 unsets CUDA_VISIBLE_DEVICES for
# MPS jobs (slurm-local.md §6.3); MPS alone gives every job a correct environment, and MPS is what the TaskProlog's
# CUDA_MPS_PINNED_DEVICE_MEM_LIMIT protects. The cluster's config ($LAB/etc/xmem.toml, also $XMEM_CONFIG for the
# filter) is the project's etc/xmem.toml with shard switched off to match. The xmem-slurm executable is
# $XMEM_SLURM, else <repo>/.venv/bin/xmem-slurm; the filter runs on the python beside it (or $XMEM_PYTHON).
# Layout: slurm-local.md §3; every client call runs under `timeout`.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-}; shift || true
LAB=/tmp/xmem-slurm-lab
PORT=6817
MODE=inline
while [ $# -gt 0 ]; do
  case $1 in
    --lab) LAB=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    *) echo "slurm-dev-cluster: unknown argument $1 (use: up|down [--lab DIR] [--port N] [--mode inline|partition|handoff])" >&2
       exit 2 ;;
  esac
done
mkdir -p "$LAB"; LAB=$(cd "$LAB" && pwd)
export SLURM_CONF=$LAB/etc/slurm.conf
XMEM_SLURM=${XMEM_SLURM:-$REPO/.venv/bin/xmem-slurm}
XMEM_PYTHON=${XMEM_PYTHON:-$(dirname "$XMEM_SLURM")/python}  # the filter runs as `python -I -m xmem.slurm.filter`

alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null || true); [ -n "$st" ] && [ "${st:0:1}" != Z ]; }
pid_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }
ctld_up() { timeout 3 scontrol ping 2>/dev/null | grep -q 'is UP'; }
port_taken() { timeout 3 ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return 0
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge >/dev/null
}

write_slurm_conf() {
  cat > "$LAB/etc/slurm.conf" <<EOF
# Written by scripts/slurm-dev-cluster.sh; see slurm/slurm.conf.example for what xmem-slurm itself needs.
ClusterName=xmemdev
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=5
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
SlurmdParameters=config_overrides
GresTypes=gpu,mps
CliFilterPlugins=cli_filter/lua
Prolog=$LAB/etc/prolog.sh
TaskProlog=$LAB/etc/task_prolog.sh
Epilog=$LAB/etc/epilog.sh
NodeName=localhost CPUs=16 Sockets=1 CoresPerSocket=16 ThreadsPerCore=1 RealMemory=8000 Gres=gpu:a100:2,gpu:h100:1,gpu:1g.10gb:1,mps:200 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # Deferred mode: estimation jobs run on a CPU partition (the same node here).
  if [ "$MODE" = partition ] || [ "$MODE" = handoff ]; then
    echo "PartitionName=cpu Nodes=ALL MaxTime=INFINITE State=UP" >> "$LAB/etc/slurm.conf"
  fi
  cat > "$LAB/etc/gres.conf" <<EOF
AutoDetect=off
Name=gpu Type=a100 File=$LAB/dev/nvidia0
Name=gpu Type=a100 File=$LAB/dev/nvidia1
Name=gpu Type=h100 File=$LAB/dev/nvidia2
Name=gpu Type=1g.10gb File=$LAB/dev/nvidia3
Name=mps Count=100 File=$LAB/dev/nvidia0
Name=mps Count=100 File=$LAB/dev/nvidia1
EOF
}

# The site config: etc/xmem.toml with shard support off (no shard GRES here), store and cache inside the LAB.
write_xmem_config() {
  local src=$REPO/etc/xmem.toml
  if [ -f "$src" ]; then
    python3 - "$src" "$LAB" "$MODE" > "$LAB/etc/xmem.toml" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
if sys.argv[3] == "partition":  # deferred mode, estimates on the `cpu` partition
    text = re.sub(r'(?m)^mode = "inline"', 'mode = "partition"', text, count=1)
if sys.argv[3] == "inline":  # the inline tests see inline answers however slow the machine: no put-off starts
    text = re.sub(r'(?m)^put_off = true', 'put_off = false', text, count=1)
if sys.argv[3] in ("partition", "handoff"):  # handoff: inline, slow estimates handed to the `cpu` partition
    text = re.sub(r'(?m)^cpu_partition = ""', 'cpu_partition = "cpu"', text, count=1)
    text = re.sub(r'(?m)^mem = "16G"', 'mem = "2G"', text, count=1)  # the node declares 8000 MB
# In the [shard] table, `enabled = true` becomes false: this cluster has no shard GRES (see the header).
def off(m): return re.sub(r"(?m)^(\s*enabled\s*=\s*)true", r"\1false", m.group(0), count=1)
text = re.sub(r"(?ms)^\[shard\].*?(?=^\[|\Z)", off, text, count=1)
text = re.sub(r'(?m)^(\s*cache_dir\s*=\s*).*$', r'\1"%s/cache"' % sys.argv[2], text, count=1)
sys.stdout.write(text)
EOF
  else
    : > "$LAB/etc/xmem.toml"  # built-in defaults until etc/xmem.toml exists
  fi
}

# slurm/ files -> $LAB/etc, with the install-time settings filled in. cli_filter.lua must sit next to slurm.conf.
install_xmem_files() {
  # The Lua side's outer limit: the config's estimate timeout (which bounds slot wait + estimate) plus startup.
  local timeout_s
  timeout_s=$("$XMEM_PYTHON" -c "from xmem.config import load_site_config as l; \
print(int(l('$LAB/etc/xmem.toml').estimate.timeout_s) + 30)" 2>/dev/null || echo 330)
  sed -e "s|@XMEM_PYTHON@|$XMEM_PYTHON|g" -e "s|@TIMEOUT_S@|$timeout_s|g" -e "s|@FAILURE@|open|g" \
      -e "s|@XMEM_CONFIG@|$LAB/etc/xmem.toml|g" "$REPO/slurm/cli_filter.lua" > "$LAB/etc/cli_filter.lua"
  for f in prolog.sh task_prolog.sh epilog.sh; do
    sed -e "s|@XMEM_SLURM@|$XMEM_SLURM|g" -e "s|@XMEM_CONFIG@|$LAB/etc/xmem.toml|g" \
        -e "s|@XMEM_STORE@|$LAB/records.jsonl|g" -e "s|@XMEM_MEASURE_DIR@|$LAB/measure|g" \
        "$REPO/slurm/$f" > "$LAB/etc/$f"
    chmod 755 "$LAB/etc/$f"
  done
  # The cache is shared by every user, like /tmp: each user's entries go to a 0700 subdirectory of their own.
  # The measure directory is root's: the Prolog makes each job's file in its user's 0700 subdirectory.
  mkdir -p "$LAB/measure" "$LAB/cache"; chmod 1777 "$LAB/cache"; chmod 755 "$LAB/measure"
}

# sbatch runs the filter (and the TaskProlog runs xmem-slurm) as the submitting user: say so when only root can.
check_other_users() {
  setpriv --reuid=65534 --regid=65534 --clear-groups -- "$XMEM_PYTHON" -I -c "import xmem.slurm.filter" \
    >/dev/null 2>&1 && return 0
  echo "slurm-dev-cluster: only root can submit here: $XMEM_PYTHON cannot run as another user; make a site" \
       "install (scripts/install.sh --prefix DIR --packages-from .venv) and set XMEM_SLURM=DIR/venv/bin/xmem-slurm" >&2
}

start_munge() {
  munge -n </dev/null >/dev/null 2>&1 && return 0
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey -c 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "slurm-dev-cluster: munged did not start" >&2; return 1
}

up() {
  install_packages
  mkdir -p "$LAB"/{etc,state,spool,log,run,dev}
  for i in 0 1 2 3; do ln -sfn /dev/null "$LAB/dev/nvidia$i"; done
  write_slurm_conf; write_xmem_config; install_xmem_files; check_other_users
  local t0; t0=$(date +%s.%N)
  start_munge
  if ! pid_alive "$LAB/run/slurmctld.pid"; then
    if port_taken "$PORT"; then
      echo "slurm-dev-cluster: port $PORT is taken (another cluster's slurmctld?); use --port" >&2; return 1
    fi
    slurmctld
  fi
  for _ in $(seq 100); do ctld_up && break; sleep 0.1; done
  if ! ctld_up; then
    echo "slurm-dev-cluster: slurmctld not UP; last log lines:" >&2; tail -5 "$LAB/log/slurmctld.log" >&2; return 1
  fi
  if pid_alive "$LAB/run/slurmd.pid"; then
    timeout 10 scontrol reconfigure >/dev/null
  else
    # A slurmd of another LAB on our port would register as this node and run our jobs with its own prolog
    # and epilog paths: refuse rather than test the wrong files.
    if port_taken $((PORT + 1)); then
      echo "slurm-dev-cluster: port $((PORT + 1)) is taken (another cluster's slurmd?); use --port" >&2; return 1
    fi
    slurmd
  fi
  local state=
  for _ in $(seq 150); do
    state=$(timeout 3 sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
    [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ] && break
    sleep 0.2
  done
  echo "slurm-dev-cluster: node $state after $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" >&2
  if ! pid_alive "$LAB/run/slurmd.pid"; then state="down (slurmd exited)"; fi
  case $state in idle|mixed|allocated) ;; *) tail -5 "$LAB/log/slurmd.log" >&2; return 1 ;; esac
  echo "export SLURM_CONF=$SLURM_CONF XMEM_CONFIG=$LAB/etc/xmem.toml"
}

stop_pid() {
  [ -f "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then echo "slurm-dev-cluster: SIGKILL $pid ($1)" >&2; kill -9 "$pid" 2>/dev/null || true; fi
  rm -f "$1"
}

down() {
  if pid_alive "$LAB/run/slurmctld.pid" && ctld_up; then
    local ids; ids=$(timeout 5 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then  # a job's slurmstepd outlives slurmd: cancel first
      timeout 5 scancel $ids || true
      for _ in $(seq 100); do [ -z "$(timeout 3 squeue -h -t PD,R,CG -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  stop_pid "$LAB/run/slurmd.pid"
  stop_pid "$LAB/run/slurmctld.pid"
  echo "slurm-dev-cluster: stopped ($LAB)" >&2
}

case $cmd in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down [--lab DIR] [--port N]" >&2; exit 2 ;;
esac
