#!/usr/bin/env bash
# A real single-node Slurm on this machine, for the cluster tests: scripts/slurm.sh up|down|status.
#   up      installs Debian's slurm-wlm and munge if missing (root, apt-get), writes a one-node
#           config (this host, CPUs from nproc), starts munged, slurmctld and slurmd, and waits
#           until `srun hostname` answers. Idempotent: returns at once when Slurm already answers
#           with this config.
#   down    stops the three daemons (config and packages stay).
#   status  prints sinfo/squeue, exits 0 if `srun hostname` answers.
# No systemd needed (containers): the daemons are started directly. Slurm tracks processes with
# proctrack/linuxproc and binds no tasks (task/none), so no cgroups are needed either. The one
# partition forces oversubscription (FORCE:2): a rollout job and a trainer job of one core each,
# plus a replacement for a cancelled job, run at once on a 2-CPU machine.
#   SLURM_REAL_MEMORY_MB   the node's RealMemory (default 4096)
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
STATE=/var/lib/slurm
LOGS=/var/log/slurm
NODE=$(hostname -s)
CPUS=$(nproc)
MEM=${SLURM_REAL_MEMORY_MB:-4096}

say() { echo "slurm.sh: $*"; }

need_root() {
  if [ "$(id -u)" != "0" ]; then
    say "needs root (apt-get and the Slurm daemons); run it as root or with sudo" >&2
    exit 2
  fi
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || { say "no apt-get: install slurm-wlm and munge yourself" >&2; exit 2; }
  say "installing slurm-wlm and munge (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

write_conf() {
  mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS" /run/slurm
  local want
  want=$(cat <<EOF
# written by grpo-kit scripts/slurm.sh: one node, one partition, no cgroups
ClusterName=grpokit
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
EOF
)
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$want" ]; then
    return 1  # unchanged
  fi
  echo "$want" > "$CONF"
  return 0
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --force >/dev/null 2>&1 || true; fi
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0700 /etc/munge /var/log/munge /var/lib/munge
  chmod 0400 /etc/munge/munge.key
  chmod 0755 /run/munge
  runuser -u munge -- munged
  for _ in $(seq 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    sleep 0.2
  done
  say "munged did not come up" >&2
  exit 1
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemons() {
  for d in slurmd slurmctld; do
    if pid_alive /run/slurm/$d.pid; then
      kill "$(cat /run/slurm/$d.pid)" 2>/dev/null || true
      for _ in $(seq 50); do pid_alive /run/slurm/$d.pid || break; sleep 0.2; done
    fi
    rm -f /run/slurm/$d.pid
  done
}

srun_ok() { timeout 20 srun -N1 -n1 --immediate=10 hostname >/dev/null 2>&1; }

up() {
  if [ "$(id -u)" != "0" ] && command -v srun >/dev/null && srun_ok; then
    say "up (already running; not root, config left as it is)"
    return 0
  fi
  need_root
  local t0=$SECONDS changed=0
  install
  if write_conf; then changed=1; fi
  start_munge
  if [ "$changed" = "1" ]; then stop_daemons; fi
  pid_alive /run/slurm/slurmctld.pid || slurmctld
  pid_alive /run/slurm/slurmd.pid || slurmd
  for _ in $(seq 60); do
    if srun_ok; then
      say "up: node $NODE, $CPUS CPUs, partition debug ($((SECONDS - t0)) s)"
      return 0
    fi
    # a node left DOWN by an earlier unclean stop comes back here
    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  say "srun hostname did not answer within 60 s; see $LOGS/slurmctld.log and $LOGS/slurmd.log" >&2
  sinfo -N -l >&2 || true
  exit 1
}

down() {
  need_root
  stop_daemons
  say "down (munged left running)"
}

status() {
  sinfo -N -l 2>/dev/null || { say "slurmctld not answering"; exit 1; }
  squeue 2>/dev/null || true
  srun_ok && say "srun hostname: ok"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
