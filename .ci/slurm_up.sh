#!/usr/bin/env bash
# Start a throwaway Slurm for tests/slurm (munged + slurmctld + slurmds as plain daemons, no
# systemd, no cgroups). Recipe and timings: docs/platform.md. Two partitions:
#   debug (default): this machine's own node (NodeAddr 127.0.0.1) and the FUTURE node mrl-spare;
#   nodes: mrl-n1..mrl-n3, each a slurmd in its own network + UTS namespace (.ci/slurm_net.sh),
#          so that a job's processes there see their own hostname and address.
#
#   .ci/slurm_up.sh [--install] [STATE_DIR]     (default STATE_DIR: /tmp/megatron-rl-slurm)
#   export SLURM_CONF=STATE_DIR/slurm.conf      (tests/slurm find it there by default)
#   .ci/slurm_down.sh [STATE_DIR]
#
# --install apt-gets Debian's slurmctld/slurmd/slurm-client/munge and iproute2 when missing
# (needs root). Exit 0: every node is idle and takes jobs. Exit 3: a Slurm controller already
# runs on this machine, or the namespace nodes are in use (one per machine: the daemons are
# started as root, the tests assume they own the nodes, the network names are fixed).
# Any other non-zero exit: not started (whatever was started is stopped), reason on stderr.
# The requeue delay is short on purpose: cred_expire=10 + sched_interval=5 (~11 s).
set -euo pipefail
here=$(dirname "$0")
source "$here/slurm_net.sh"

install=0
if [[ "${1:-}" == "--install" ]]; then install=1; shift; fi
dir="${1:-/tmp/megatron-rl-slurm}"

say() { echo "slurm_up: $*" >&2; }

if [[ $install == 1 ]] && ! { command -v slurmctld && command -v ip; } >/dev/null; then
    if [[ $(id -u) != 0 ]]; then say "not root, cannot apt-get install slurm"; exit 1; fi
    if ! command -v apt-get >/dev/null; then say "no apt-get on this machine"; exit 1; fi
    t0=$(date +%s)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends slurmctld slurmd slurm-client munge iproute2; } >"/tmp/slurm_apt.$$.log" 2>&1; then
        tail -5 "/tmp/slurm_apt.$$.log" >&2; say "apt-get install failed"; exit 1
    fi
    rm -f "/tmp/slurm_apt.$$.log"
    say "installed slurm + munge in $(( $(date +%s) - t0 )) s"
fi
for bin in munged slurmctld slurmd sinfo ip nsenter unshare; do
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
if busy=$(net_busy) && [[ -n $busy ]]; then
    say "processes still run in the namespace nodes ${busy//$'\n'/ }; refusing to start a second cluster"
    exit 3
fi
net_down  # what a crashed run may have left: nothing runs in it

# From here on a failure stops whatever was started (slurm_down.sh is safe on a half-built cluster).
set -o errtrace
trap 'say "failed: $BASH_COMMAND"' ERR
on_exit() {
    local rc=$? f
    if [[ $rc != 0 ]]; then
        for f in "$dir"/log/*.log; do [[ -s $f ]] && { say "last lines of $f:"; tail -5 "$f" >&2; }; done
        "$here/slurm_down.sh" "$dir"
    fi
    exit $rc
}
trap on_exit EXIT
rm -rf "$dir"
mkdir -p "$dir"/{munge,state,spool,log}
chmod 755 "$dir"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ctld_port=$(free_port); slurmd_port=$(free_port)
while [[ $slurmd_port == "$ctld_port" ]]; do slurmd_port=$(free_port); done
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) / 1024 / 2 ))
node_mem_mb=$(( mem_mb / 4 ))  # each namespace slurmd sees the whole machine: declare less

# The configuration first: slurm_down.sh stops only the cluster of a directory holding one.
cat >"$dir/slurm.conf" <<EOF
# Written by .ci/slurm_up.sh: a throwaway cluster for tests/slurm.
ClusterName=megatron-rl-ci
# The bridge address: reached from this namespace and from the node namespaces.
SlurmctldHost=$host($NET_CTLD_ADDR)
SlurmctldPort=$ctld_port
# One port for every slurmd: each namespace has its own.
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd.%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
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
# The namespace nodes share this machine's CPUs: oversubscribed on purpose.
$(for n in "${NET_NODES[@]}"; do
    echo "NodeName=$n NodeAddr=$(net_addr "$n") CPUs=$cpus RealMemory=$node_mem_mb State=UNKNOWN"
done)
PartitionName=debug Nodes=$host,mrl-spare Default=YES MaxTime=INFINITE State=UP
PartitionName=nodes Nodes=$(IFS=,; echo "${NET_NODES[*]}") MaxTime=INFINITE State=UP
EOF

# munge: a fresh key, run as user munge (munged refuses keys and dirs others can write;
# the socket's dir must be open to all so that Slurm and job steps reach it).
chown munge:munge "$dir/munge"; chmod 755 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"
install -o munge -g munge -m 600 /dev/null "$dir/munge/munged.log"
runuser -u munge -- munged --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

net_up "$host"
export SLURM_CONF="$dir/slurm.conf"
slurmctld
slurmd
for n in "${NET_NODES[@]}"; do
    # Not `ip netns exec`: it mounts a fresh /sys, hiding the cgroup mounts slurmd needs
    # ("No filesystem mounted on /sys/fs/cgroup", slurmd exits). So: the node's network
    # namespace, plus a UTS namespace for its hostname (jobs there see it in
    # socket.gethostname()) and a mount namespace for its /etc/hosts.
    nsenter --net="/run/netns/$n" unshare --uts --mount --propagation slave sh -c \
        'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$1" && exec slurmd -N "$1"' _ "$n"
done
nodes="$host ${NET_NODES[*]}"
for _ in $(seq 1 100); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    idle=$(awk '$2 == "idle" {print $1}' <<<"$states" | sort | xargs)
    if [[ "$idle" == "$(tr ' ' '\n' <<<"$nodes" | sort | xargs)" ]]; then
        say "up: nodes $nodes idle, $cpus CPUs each, ports $ctld_port/$slurmd_port, SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
say "nodes not all idle after 20 s: ${states//$'\n'/, }"
exit 1
