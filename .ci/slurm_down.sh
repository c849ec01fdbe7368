#!/usr/bin/env bash
# Stop the cluster .ci/slurm_up.sh started: each daemon by its pid file (never by name),
# then whatever still runs in the namespace nodes, the network (.ci/slurm_net.sh) and the
# state dir. Safe on a half-started cluster and when run twice.   .ci/slurm_down.sh [STATE_DIR]
set -uo pipefail
here=$(dirname "$0")
source "$here/slurm_net.sh"
dir="${1:-/tmp/megatron-rl-slurm}"
[[ -f "$dir/slurm.conf" ]] || { echo "slurm_down: no cluster in $dir" >&2; exit 0; }

stop() {  # stop PIDFILE NAME: TERM, then KILL after 10 s
    local pidfile=$1 name=$2 pid
    [[ -f "$pidfile" ]] || return 0
    pid=$(cat "$pidfile")
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || { echo "slurm_down: stopped $name ($pid)" >&2; return 0; }; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null; echo "slurm_down: killed $name ($pid)" >&2
}
export SLURM_CONF="$dir/slurm.conf"
# Jobs first, so that no step outlives its slurmd.
for part in debug nodes; do scancel --full --quiet --partition="$part" 2>/dev/null || true; done
for pidfile in "$dir"/slurmd.*.pid; do
    [[ -e $pidfile ]] && stop "$pidfile" "$(basename "$pidfile" .pid)"
done
stop "$dir/slurmctld.pid" slurmctld
stop "$dir/munge/munged.pid" munged
# A step whose slurmd died before it (a drill) would keep its namespace alive.
for n in "${NET_NODES[@]}"; do
    pids=$(ip netns pids "$n" 2>/dev/null | xargs)
    if [[ -n $pids ]]; then echo "slurm_down: killing what still runs on $n: $pids" >&2; kill -9 $pids 2>/dev/null; fi
done
net_down
rm -rf "$dir"
