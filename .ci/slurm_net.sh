# Sourced by slurm_up.sh and slurm_down.sh: the private network of the namespace nodes.
#
#   root namespace: bridge mrlbr0 10.77.0.254/24 (slurmctld is reached there)
#     ├─ veth mrlv1 ── netns mrl-n1: eth0 10.77.0.1/24, lo   (hostname mrl-n1 in its own UTS namespace)
#     ├─ veth mrlv2 ── netns mrl-n2: eth0 10.77.0.2/24, lo
#     └─ veth mrlv3 ── netns mrl-n3: eth0 10.77.0.3/24, lo
#
# No default route inside the namespaces: they reach 10.77.0.0/24 and nothing else.
# /etc/netns/mrl-nK/hosts names the nodes and the controller: slurm_up.sh bind-mounts it over
# /etc/hosts for the node's slurmd (and so its jobs); `ip netns exec mrl-nK CMD` does the same.
# Drills: `ip link set mrlvK down` cuts node K off the bridge.

NET_PREFIX=10.77.0
NET_BRIDGE=mrlbr0
NET_CTLD_ADDR=$NET_PREFIX.254
NET_NODES=(mrl-n1 mrl-n2 mrl-n3)

net_addr() { echo "$NET_PREFIX.${1#mrl-n}"; }   # mrl-n2 -> 10.77.0.2
net_veth() { echo "mrlv${1#mrl-n}"; }           # mrl-n2 -> mrlv2 (root-side end)

# net_busy: names of the node namespaces that still hold a process (empty: none).
net_busy() {
    local n
    for n in "${NET_NODES[@]}"; do
        [[ -e /run/netns/$n && -n $(ip netns pids "$n" 2>/dev/null) ]] && echo "$n"
    done
    return 0
}

# net_down: remove namespaces, veths, bridge and hosts files; safe on a half-built network.
net_down() {
    local n
    for n in "${NET_NODES[@]}"; do
        ip link del "$(net_veth "$n")" 2>/dev/null || true  # deletes both ends of the pair
        ip netns del "$n" 2>/dev/null || true
        rm -rf "/etc/netns/$n"
    done
    ip link del "$NET_BRIDGE" 2>/dev/null || true
    rmdir /etc/netns 2>/dev/null || true  # only when no other namespace has files there
    return 0
}

# net_up CTLD_HOST: build the bridge and one namespace per node.
net_up() {
    local ctld_host=$1 n veth hosts
    hosts="127.0.0.1 localhost"$'\n'"$NET_CTLD_ADDR $ctld_host"
    for n in "${NET_NODES[@]}"; do hosts+=$'\n'"$(net_addr "$n") $n"; done
    ip link add "$NET_BRIDGE" type bridge
    ip addr add "$NET_CTLD_ADDR/24" dev "$NET_BRIDGE"
    ip link set "$NET_BRIDGE" up
    for n in "${NET_NODES[@]}"; do
        veth=$(net_veth "$n")
        mkdir -p "/etc/netns/$n"
        echo "$hosts" >"/etc/netns/$n/hosts"
        ip netns add "$n"
        ip link add "$veth" type veth peer name eth0 netns "$n"
        ip link set "$veth" master "$NET_BRIDGE" up
        ip -n "$n" addr add "$(net_addr "$n")/24" dev eth0
        ip -n "$n" link set eth0 up
        ip -n "$n" link set lo up
    done
}
