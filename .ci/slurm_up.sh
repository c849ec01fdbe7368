#!/usr/bin/env bash
# Start a throwaway single-node Slurm (munged + slurmctld + slurmd as plain daemons, no
# systemd, no cgroups) for tests/slurm. Recipe and timings: docs/platform.md.
#
#   .ci/slurm_up.sh [--install] [STATE_DIR]     (default STATE_DIR: /tmp/megatron-rl-slurm)
#   export SLURM_CONF=STATE_DIR/slurm.conf      (tests/slurm find it there by default)
#   .ci/slurm_down.sh [STATE_DIR]
#
# --install apt-gets Debian's slurmctld/slurmd/slurm-client/munge when they are missing
# (needs root). Exit 0: the node is idle and takes jobs. Exit 3: a Slurm controller already
# runs on this machine (one per machine: the daemons are started as root and the tests
# assume they own the node). Any other non-zero exit: not started, reason on stderr.
# The requeue delay is short on purpose: cred_expire=10 + sched_interval=5 (~11 s).
set -euo pipefail

install=0
if [[ "${1:-}" == "--install" ]]; then install=1; shift; fi
dir="${1:-/tmp/megatron-rl-slurm}"

say() { echo "slurm_up: $*" >&2; }

if [[ $install == 1 ]] && ! command -v slurmctld >/dev/null; then
    if [[ $(id -u) != 0 ]]; then say "not root, cannot apt-get install slurm"; exit 1; fi
    if ! command -v apt-get >/dev/null; then say "no apt-get on this machine"; exit 1; fi
    t0=$(date +%s)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends slurmctld slurmd slurm-client munge; } >"/tmp/slurm_apt.$$.log" 2>&1; then
        tail -5 "/tmp/slurm_apt.$$.log" >&2; say "apt-get install failed"; exit 1
    fi
    rm -f "/tmp/slurm_apt.$$.log"
    say "installed slurm + munge in $(( $(date +%s) - t0 )) s"
fi
for bin in munged slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || { say "$bin not found (run with --install as root)"; exit 1; }
done
if [[ $(id -u) != 0 ]]; then say "the daemons run as root here (SlurmUser=root); run as root"; exit 1; fi

if [[ -f "$dir/slurmctld.pid" ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    say "already running from $dir (slurmctld pid $(cat "$dir/slurmctld.pid")); stop it with .ci/slurm_down.sh $dir"
    exit 3
fi
if other=$(pgrep -x slurmctld); then
    say "another slurmctld runs on this machine (pid ${other//$'\n'/ }); refusing to start a second cluster"
    exit 3
fi

rm -rf "$dir"
mkdir -p "$dir"/{munge,state,spool,log}
chmod 755 "$dir"

# munge: a fresh key, run as user munge (munged refuses keys and dirs others can write;
# the socket's dir must be open to all so that Slurm and job steps reach it).
chown munge:munge "$dir/munge"; chmod 755 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"
install -o munge -g munge -m 600 /dev/null "$dir/munge/munged.log"
runuser -u munge -- munged --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ctld_port=$(free_port); slurmd_port=$(free_port)
while [[ $slurmd_port == "$ctld_port" ]]; do slurmd_port=$(free_port); done
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) / 1024 / 2 ))

cat >"$dir/slurm.conf" <<EOF
# Written by .ci/slurm_up.sh: a throwaway single-node cluster for tests/slurm.
ClusterName=megatron-rl-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd.%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=bf_interval=5,sched_interval=5
MinJobAge=4
KillWait=15
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
# Never runs jobs: lets tests check that exclude lists reach Slurm without losing the real node.
NodeName=mrl-spare NodeAddr=127.0.0.2 CPUs=1 RealMemory=100 State=FUTURE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

export SLURM_CONF="$dir/slurm.conf"
slurmctld
slurmd
for _ in $(seq 1 100); do
    state=$(sinfo -h -n "$host" -o '%T' 2>/dev/null || true)
    if [[ "$state" == idle ]]; then
        say "up: node $host idle, $cpus CPUs, ports $ctld_port/$slurmd_port, SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
say "node $host not idle after 20 s (state '${state:-?}'); logs under $dir/log"
exit 1
