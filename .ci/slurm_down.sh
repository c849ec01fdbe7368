#!/usr/bin/env bash
# Stop the cluster .ci/slurm_up.sh started: each daemon by its pid file (never by name),
# then remove the state dir.   .ci/slurm_down.sh [STATE_DIR]
set -uo pipefail
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
scancel --full --quiet --partition=debug 2>/dev/null || true
stop "$dir/slurmd.pid" slurmd
stop "$dir/slurmctld.pid" slurmctld
stop "$dir/munge/munged.pid" munged
rm -rf "$dir"
