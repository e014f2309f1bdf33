#!/usr/bin/env bash
# A cluster on one machine (issue 43): one network namespace per node, each joined by a veth pair
# to a bridge in a namespace of its own (addresses only inside them), an optional qdisc on every
# link, then kvstage-cluster runs the nodes' rank processes inside them and plays the fault
# schedule. Everything it creates is removed on exit, also on Ctrl-C or failure; the run is
# bounded (--seconds plus a drain, killed past that).
#
#   scripts/cluster.sh [--seconds S] [--json FILE] [kvstage-cluster flags...]
#       [--delay MS] [--jitter MS] [--loss PCT] [--rate-limit RATE] [--no-netns]
#
# --delay/--jitter/--loss need the kernel's sch_netem; --rate-limit uses netem's rate where
# netem works, else tbf. Without root or without `ip netns` the nodes run on loopback (link faults
# are then skipped and say so). See docs/CLUSTER.md; `kvstage-cluster --help` lists the rest.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
delay="" jitter="" loss="" ratelimit="" use_netns=1
seconds=60 prefill_nodes=2 decode_nodes=2
pass=()
while [ $# -gt 0 ]; do
    case "$1" in
        --delay) delay="$2"; shift 2 ;;
        --jitter) jitter="$2"; shift 2 ;;
        --loss) loss="$2"; shift 2 ;;
        --rate-limit) ratelimit="$2"; shift 2 ;;
        --no-netns) use_netns=0; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        --seconds) seconds="$2"; pass+=("$1" "$2"); shift 2 ;;
        --seconds=*) seconds="${1#*=}"; pass+=("$1"); shift ;;
        --prefill-nodes) prefill_nodes="$2"; pass+=("$1" "$2"); shift 2 ;;
        --prefill-nodes=*) prefill_nodes="${1#*=}"; pass+=("$1"); shift ;;
        --decode-nodes) decode_nodes="$2"; pass+=("$1" "$2"); shift 2 ;;
        --decode-nodes=*) decode_nodes="${1#*=}"; pass+=("$1"); shift ;;
        *) pass+=("$1"); shift ;;
    esac
done
case "$seconds$prefill_nodes$decode_nodes" in *[!0-9.]*) echo "cluster.sh: --seconds and the node counts must be numbers" >&2; exit 2 ;; esac

say() { echo "cluster.sh: $*" >&2; }

# The tool: $KVSTAGE_CLUSTER_BIN, else built here (release, locked).
bin="${KVSTAGE_CLUSTER_BIN:-}"
if [ -z "$bin" ]; then
    say "building kvstage-cluster"
    (cd "$here" && cargo build --release --locked -q -p kvstage-tools --bin kvstage-cluster)
    bin="${CARGO_TARGET_DIR:-$here/target}/release/kvstage-cluster"
    case "$bin" in /*) ;; *) bin="$here/$bin" ;; esac
fi
[ -x "$bin" ] || { say "no executable at $bin"; exit 1; }

prefix="kvc43-$$"
tool_pid=""
created=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [ -n "$tool_pid" ] && kill -0 "$tool_pid" 2>/dev/null; then
        kill -TERM "$tool_pid" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$tool_pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$tool_pid" 2>/dev/null || true
    fi
    # Rank processes die with the tool (PR_SET_PDEATHSIG); any left in our namespaces go too.
    for ns in "${created[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done
    for ns in "${created[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# Namespaces left by an earlier run that was killed outright (its script's pid is gone).
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^kvc43-[0-9]+-' || true); do
        pid="${ns#kvc43-}"; pid="${pid%%-*}"
        kill -0 "$pid" 2>/dev/null || { ip netns del "$ns" 2>/dev/null || true; }
    done
fi

netns_ok=0
if [ "$use_netns" = 1 ]; then
    if [ "$(id -u)" != 0 ]; then
        say "not root: the nodes run on loopback (no namespaces, link faults skipped)"
    elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        say "no ip/tc (iproute2): the nodes run on loopback"
    elif ! ip netns add "$prefix-br" 2>/dev/null; then
        say "ip netns add failed here: the nodes run on loopback"
    else
        created+=("$prefix-br")
        netns_ok=1
    fi
fi

tool_args=()
if [ "$netns_ok" = 1 ]; then
    br="$prefix-br"
    ip -n "$br" link set lo up
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    # Does this kernel have netem? (A probe on the bridge's own loopback-free dummy link.)
    netem=0
    ip -n "$br" link add kvprobe0 type veth peer name kvprobe1
    if tc -n "$br" qdisc add dev kvprobe0 root netem delay 1ms 2>/dev/null; then netem=1; fi
    ip -n "$br" link del kvprobe0
    qdisc=""
    if [ "$netem" = 1 ]; then
        [ -n "$delay" ] && qdisc+=" delay ${delay}ms${jitter:+ ${jitter}ms}"
        [ -n "$loss" ] && qdisc+=" loss ${loss}%"
        [ -n "$ratelimit" ] && qdisc+=" rate $ratelimit"
        [ -n "$qdisc" ] && qdisc="netem$qdisc"
    else
        say "this kernel has no sch_netem: link delay, jitter and loss are not available (tc: 'Specified qdisc kind is unknown'); loss bursts use a tbf squeeze"
        [ -n "$delay$jitter$loss" ] && say "ignoring --delay/--jitter/--loss"
        [ -n "$ratelimit" ] && qdisc="tbf rate $ratelimit burst 256kb latency 50ms"
    fi
    nodes=()
    for i in $(seq 0 $((prefill_nodes - 1))); do nodes+=("p$i:$((11 + i))"); done
    for i in $(seq 0 $((decode_nodes - 1))); do nodes+=("d$i:$((101 + i))"); done
    for n in "${nodes[@]}"; do
        name="${n%%:*}" host="${n#*:}" ns="$prefix-${n%%:*}"
        ip netns add "$ns"
        created+=("$ns")
        ip -n "$ns" link set lo up
        ip -n "$br" link add "v-$name" type veth peer name eth0 netns "$ns"
        ip -n "$br" link set "v-$name" master br0 up
        ip -n "$ns" addr add "10.43.0.$host/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [ -n "$qdisc" ]; then
            # shellcheck disable=SC2086
            tc -n "$ns" qdisc replace dev eth0 root handle 99: $qdisc
            # shellcheck disable=SC2086
            tc -n "$br" qdisc replace dev "v-$name" root handle 99: $qdisc
        fi
    done
    say "namespaces: ${created[*]} (bridge br0 in $br, nodes at 10.43.0.0/24)${qdisc:+, every link: $qdisc}"
    tool_args+=(--netns "$prefix" --subnet 10.43.0)
    [ "$netem" = 1 ] && tool_args+=(--netem)
    [ -n "$qdisc" ] && tool_args+=(--link-qdisc "$qdisc")
fi

# Bounded: arrivals, the drain (deadline + room timeout + 16 s at most, by default), start and
# the leak check; killed 10 s after the bound.
bound=$(awk -v s="$seconds" 'BEGIN { printf "%d", s + 240 }')
timeout -k 10 "$bound" "$bin" "${tool_args[@]}" "${pass[@]}" &
tool_pid=$!
set +e
wait "$tool_pid"
rc=$?
set -e
tool_pid=""
exit "$rc"
