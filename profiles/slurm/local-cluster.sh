#!/usr/bin/env bash
# A SLURM cluster on this machine, to try the slurm profile and to test the submitit executor: one node
# on localhost, or a login host and N compute hosts, each compute host a network namespace of its own.
#
#   profiles/slurm/local-cluster.sh up            install (Debian packages) if needed, configure, start one node
#   profiles/slurm/local-cluster.sh up --hosts N  the same, with N compute hosts in place of the one node
#   profiles/slurm/local-cluster.sh down          cancel every job, stop every daemon, remove every host
#   profiles/slurm/local-cluster.sh status        what runs, which hosts exist
#
# Needs root on Debian 12 (SLURM 22.05). There is no systemd here, so the daemons are started by
# hand: munged, mariadb + slurmdbd (submitit reads job states with sacct, which needs accounting),
# slurmctld and `slurmd -N localhost`. Every command is idempotent, and `up` and `up --hosts N` switch
# from one to the other (every job is cancelled when the nodes change). Job ids keep counting across
# down/up (the state directory is kept), so that sacct never mixes an old job with a new one.
# What is known about SLURM on this kind of machine is in DEVELOPERS.md.
#
# A cluster of hosts (--hosts N) shows a study what a real cluster shows it, on one machine:
# - The login host is this machine's own network namespace. munged, mariadb, slurmdbd and slurmctld run
#   there as for one node; it has an address on a Linux bridge (klstudy0, 10.87.0.1, named klstudy-login).
# - Compute host I is a network namespace (klstudy-cnI) with an address on the bridge through a veth
#   pair (10.87.0.(10+I)). Its slurmd runs in it under a UTS namespace whose hostname is cnI, which its
#   jobs inherit, so `hostname` in a job says where it runs. It has no default route: it reaches the login
#   host and the other compute hosts, and every other address is "Network is unreachable". Offline by
#   the network, as many clusters' compute nodes are, rather than by an environment variable.
# - The outside host (namespace klstudy-outside, named klstudy-hub, 10.87.1.2) stands for the internet,
#   where the hub is: a veth pair straight to the login host on a /30 of its own, not on the bridge, so
#   the login host reaches it and the compute hosts cannot. Nothing runs there until a test or a user
#   starts a server in it (`ip netns exec klstudy-outside ...`).
# - Names: each namespace's /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts
#   (and this script for slurmd, start_host_slurmd), so a compute host resolves the login host and the
#   compute hosts, and not the outside host; the login host resolves every name from a block of
#   /etc/hosts between two marker lines, which `down` removes.
# - The file system is shared, as a cluster's is: the repository, the results and munge's socket (a
#   path, so every slurmd reaches the one munged) are the same on every host.
# - Each compute host advertises the machine's CPUs, as a real node advertises its cores (the hosts
#   share them by time, and a job of 2 CPUs fits on any one host), and an equal share of the memory:
#   memory cannot be shared by time, and SLURM then never hands out more than the machine has.
# - slurmctld is `SlurmctldHost=localhost(10.87.0.1)`: it takes `localhost` as its own name (this
#   machine's hostname is not the login host's name), and every client, on the login host or a compute
#   host, reaches it at the bridge's address.
set -euo pipefail

CLUSTER=klstudy
CONF_DIR=/etc/slurm
STATE=/var/lib/slurm
LOGS=/var/log/slurm
RUN=/run/slurm
# GNU nproc answers OMP_NUM_THREADS when it is set, and `make test` sets it to 1: an `up` from inside the suite
# would restart the cluster with one CPU, and every later job that asks for two would pend for ever.
CPUS=${KLSTUDY_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
# Leave 2 GiB to the system; jobs get DefMemPerCPU each unless they ask (without it they run one at a time).
MEMORY_MB=${KLSTUDY_SLURM_MEMORY_MB:-$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048 ))}
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

# The cluster of hosts (up --hosts N); HOSTS=0 is the one node on localhost.
HOSTS=0
MAX_HOSTS=20              # a veth's name has 15 characters at most: "klstudy-cn20-in"
BRIDGE=klstudy0
LOGIN_ADDR=10.87.0.1
LOGIN_NAME=klstudy-login
COMPUTE=klstudy-cn        # compute host I: namespace and veth klstudy-cnI, hostname cnI, 10.87.0.(10+I)
OUTSIDE=klstudy-outside   # the outside host's namespace
OUTSIDE_LINK=klstudy-out  # the login host's end of the veth pair to it
OUTSIDE_NAME=klstudy-hub
OUTSIDE_LOGIN_ADDR=10.87.1.1
OUTSIDE_ADDR=10.87.1.2
HOSTS_BEGIN="# klstudy local cluster: begin (profiles/slurm/local-cluster.sh up --hosts; down removes it)"
HOSTS_END="# klstudy local cluster: end"

log() { echo "local-cluster: $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 5))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    log "timed out after ${seconds}s waiting for ${what}"
    return 1
}

running() { pgrep -x "$1" >/dev/null 2>&1; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    if ((${#missing[@]})); then
        log "installing ${PACKAGES[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
    fi
}

# What differs between the one node on localhost and a cluster of hosts: slurmctld's address, one
# slurmd per host (its pid file, spool directory and log named after its node: %n), and the nodes.
slurm_conf() {
    local title=" a one-node cluster on localhost." controller=localhost slurmd=slurmd slurmd_timeout=300
    if ((HOSTS)); then
        title=" a login host and $HOSTS compute hosts (up --hosts $HOSTS)."
        controller="localhost($LOGIN_ADDR)"
        slurmd="slurmd-%n"
        slurmd_timeout=30
    fi
    cat <<EOF
# Written by profiles/slurm/local-cluster.sh:$title
ClusterName=$CLUSTER
SlurmctldHost=$controller
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it starts again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/$slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/$slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/$slurmd.log
# No cgroups in a container: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# Look for work every 5 s (defaults: 60 s and 30 s), so that a requeued job starts again soon.
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
JobRequeue=1
ReturnToService=2
# A node whose slurmd has not answered for this long is DOWN, and its batch jobs are requeued on another
# (SLURM's default, 300 s, kept for the one node; a compute host that dies is noticed within 30-40 s,
# and a slurmd slow to answer on a busy machine is not taken for dead).
SlurmdTimeout=$slurmd_timeout
KillWait=10
MinJobAge=300
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
    node_lines
}

node_lines() {  # slurm.conf's nodes and partition
    if ((HOSTS == 0)); then
        echo "NodeName=localhost CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN"
        echo "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP"
        return
    fi
    local i
    for i in $(seq "$HOSTS"); do
        echo "NodeName=$(host_name "$i") NodeAddr=$(host_addr "$i") CPUs=$CPUS RealMemory=$((MEMORY_MB / HOSTS)) State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP"
}

node_names() {  # the nodes of slurm.conf, one a line
    if ((HOSTS)); then seq -f 'cn%g' "$HOSTS"; else echo localhost; fi
}

write_config() {
    mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS" "$RUN"
    local before
    before=$(cat "$CONF_DIR/slurm.conf" 2>/dev/null || true)
    slurm_conf > "$CONF_DIR/slurm.conf"
    cat > "$CONF_DIR/slurmdbd.conf" <<EOF
# Written by profiles/slurm/local-cluster.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$CONF_DIR/slurmdbd.conf"
    if [[ "$before" != "$(cat "$CONF_DIR/slurm.conf")" ]] && { running slurmctld || running slurmd; }; then
        if [[ "$(grep '^NodeName' <<<"$before")" != "$(node_lines | grep '^NodeName')" ]] && running slurmctld; then
            log "the nodes change: cancelling every job (its nodes would be gone)"
            cancel_jobs
        fi
        log "slurm.conf changed: restarting slurmctld and slurmd"  # reconfigure misses some settings
        stop_slurmd
        stop slurmctld "$RUN/slurmctld.pid"
    fi
}

# The hosts of `up --hosts N`.

host_name() { echo "cn$1"; }
host_namespace() { echo "$COMPUTE$1"; }
host_addr() { echo "10.87.0.$((10 + $1))"; }

namespace_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
link_exists() { ip link show "$1" >/dev/null 2>&1; }

compute_hosts() {  # the numbers of the compute hosts that exist (a namespace, a veth or names left), one a line
    { ip netns list 2>/dev/null | awk '{print $1}'
      ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//'
      ls /etc/netns 2>/dev/null || true; } | sed -n "s/^$COMPUTE\([0-9]\+\)$/\1/p" | sort -nu
}

make_namespace() {  # make_namespace NAMESPACE LINK ADDRESS/PREFIX: a namespace whose eth0 is LINK's veth peer
    local namespace=$1 link=$2 address=$3
    ip netns add "$namespace"
    ip link add "$link" type veth peer name "$link-in"
    ip link set "$link-in" netns "$namespace"
    ip -n "$namespace" link set "$link-in" name eth0
    ip -n "$namespace" addr add "$address" dev eth0
    ip -n "$namespace" link set lo up
    ip -n "$namespace" link set eth0 up
    ip link set "$link" up
}

make_bridge() {  # the login host's address on the bridge that joins the compute hosts
    if ! link_exists "$BRIDGE"; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$LOGIN_ADDR/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
}

make_compute_host() {  # make_compute_host I: on the bridge, and no route beyond it (no default route)
    local namespace
    namespace=$(host_namespace "$1")
    if namespace_exists "$namespace" && link_exists "$namespace"; then return; fi
    remove_namespace "$namespace" "$namespace"
    make_namespace "$namespace" "$namespace" "$(host_addr "$1")/24"
    ip link set "$namespace" master "$BRIDGE"
}

make_outside_host() {  # a /30 of its own with the login host: no compute host has a route to it
    if namespace_exists "$OUTSIDE" && link_exists "$OUTSIDE_LINK"; then return; fi
    remove_namespace "$OUTSIDE" "$OUTSIDE_LINK"
    make_namespace "$OUTSIDE" "$OUTSIDE_LINK" "$OUTSIDE_ADDR/30"
    ip addr add "$OUTSIDE_LOGIN_ADDR/30" dev "$OUTSIDE_LINK"
}

namespace_empty() { [[ -z "$(ip netns pids "$1")" ]]; }

remove_namespace() {  # remove_namespace NAMESPACE LINK: its processes (jobs left by slurmd), its veth pair, its names
    local namespace=$1 link=$2
    if namespace_exists "$namespace" && ! namespace_empty "$namespace"; then
        # shellcheck disable=SC2046  # one pid a word
        kill $(ip netns pids "$namespace") 2>/dev/null || true
        wait_for 15 "the processes of $namespace to end" namespace_empty "$namespace" ||
            kill -9 $(ip netns pids "$namespace") 2>/dev/null || true
    fi
    # The pair first: deleting the namespace deletes it too, but a moment later, under a later `ip link delete`.
    if link_exists "$link"; then ip link delete "$link"; fi
    if namespace_exists "$namespace"; then ip netns delete "$namespace"; fi
    rm -rf "/etc/netns/$namespace"
}

host_lines() {  # host_lines N: the /etc/hosts lines of the login host and N compute hosts
    local i
    echo "$LOGIN_ADDR $LOGIN_NAME"
    for i in $(seq "$1"); do echo "$(host_addr "$i") $(host_name "$i")"; done
}

remove_hosts_block() {  # written in place, not replaced: in a container /etc/hosts is often a mount point
    grep -qxF "$HOSTS_BEGIN" /etc/hosts || return 0
    local kept
    kept=$(awk -v begin="$HOSTS_BEGIN" -v end="$HOSTS_END" '$0 == begin {skip = 1} !skip {print} $0 == end {skip = 0}' /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
}

write_names() {  # each namespace's /etc/hosts, and the login host's block of /etc/hosts (every name)
    local i namespace
    for i in $(seq "$HOSTS"); do
        namespace=$(host_namespace "$i")
        mkdir -p "/etc/netns/$namespace"
        { echo "127.0.0.1 localhost"; host_lines "$HOSTS"; } > "/etc/netns/$namespace/hosts"
    done
    mkdir -p "/etc/netns/$OUTSIDE"
    printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "$OUTSIDE_ADDR" "$OUTSIDE_NAME" "$OUTSIDE_LOGIN_ADDR" "$LOGIN_NAME" \
        > "/etc/netns/$OUTSIDE/hosts"
    remove_hosts_block
    { echo "$HOSTS_BEGIN"; host_lines "$HOSTS"; echo "$OUTSIDE_ADDR $OUTSIDE_NAME"; echo "$HOSTS_END"; } >> /etc/hosts
}

make_hosts() {  # the bridge, HOSTS compute hosts (no more), the outside host, their names
    local i
    for i in $(compute_hosts); do
        if ((i > HOSTS)); then remove_namespace "$(host_namespace "$i")" "$(host_namespace "$i")"; fi
    done
    make_bridge
    for i in $(seq "$HOSTS"); do make_compute_host "$i"; done
    make_outside_host
    write_names
}

remove_hosts() {  # everything make_hosts made
    local i
    for i in $(compute_hosts); do remove_namespace "$(host_namespace "$i")" "$(host_namespace "$i")"; done
    remove_namespace "$OUTSIDE" "$OUTSIDE_LINK"
    if link_exists "$BRIDGE"; then ip link delete "$BRIDGE"; fi
    remove_hosts_block
    if [[ -d /etc/netns ]]; then rmdir --ignore-fail-on-non-empty /etc/netns; fi
}

start_munge() {
    if running munged; then return; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --force
        chown munge:munge /etc/munge/munge.key
    fi
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    wait_for 10 munge munge -n
}

start_mariadb() {
    if ! running mariadbd; then
        mkdir -p /run/mysqld
        chown mysql:mysql /run/mysqld
        if [[ ! -d /var/lib/mysql/mysql ]]; then
            mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
        fi
        (mariadbd --user=mysql --skip-networking=0 --bind-address=127.0.0.1 >/var/log/mysql-klstudy.log 2>&1 &)
        wait_for 30 mariadb mariadb -e "select 1"
    fi
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

start_slurm() {
    if ! running slurmdbd; then
        rm -f "$RUN/slurmdbd.pid"
        slurmdbd
        wait_for 30 slurmdbd sacctmgr -n list cluster
    fi
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if ! running slurmctld; then
        rm -f "$RUN/slurmctld.pid"
        slurmctld
        wait_for 30 slurmctld scontrol ping
    fi
    start_slurmd
    wait_for 30 "the nodes to be idle" nodes_ready || {
        scontrol update nodename="$(node_names | paste -sd,)" state=resume || true
        wait_for 30 "the nodes to be idle" nodes_ready
    }
}

start_slurmd() {  # the one node's, or one in each compute host
    if ((HOSTS)); then
        local i
        for i in $(seq "$HOSTS"); do start_host_slurmd "$i"; done
    elif ! running slurmd; then
        rm -f "$RUN/slurmd.pid"
        slurmd -N localhost
    fi
}

alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }  # alive PIDFILE

# Not under `ip netns exec`: it mounts a fresh /sys, without the cgroup hierarchies that slurmd 22.05
# looks for as it starts ("No filesystem mounted on /sys/fs/cgroup": "slurmd initialization failed").
# slurmd gets a mount namespace of its own instead, where the host's names are mounted over /etc/hosts
# as `ip netns exec` mounts them, a UTS namespace with the host's hostname, and the host's network
# namespace (nsenter). Its jobs inherit all three.
start_host_slurmd() {  # start_host_slurmd I
    local name namespace
    name=$(host_name "$1")
    namespace=$(host_namespace "$1")
    if alive "$RUN/slurmd-$name.pid"; then return; fi
    rm -f "$RUN/slurmd-$name.pid"
    mkdir -p "$STATE/slurmd-$name"
    unshare --mount --propagation slave --uts sh -c "mount --bind /etc/netns/$namespace/hosts /etc/hosts &&
        hostname $name && exec nsenter --net=/run/netns/$namespace slurmd -N $name"
}

nodes_ready() {  # whether every node can run jobs
    local states
    states=$(sinfo -h -N -o %t) && [[ -n "$states" ]] && ! grep -Evqx 'idle|mix|alloc' <<<"$states"
}

up() {
    install_packages
    write_config
    if ((HOSTS)); then make_hosts; else remove_hosts; fi
    start_munge
    start_mariadb
    start_slurm
    log "up: $(sinfo -h -o '%P %D %t %c CPUs %m MB' | paste -sd';')"
}

stop() {  # stop NAME PIDFILE
    local name=$1 pidfile=$2
    if running "$name"; then
        pkill -x "$name" || true
        wait_for 30 "$name to stop" bash -c "! pgrep -x $name" || pkill -9 -x "$name" || true
    fi
    rm -f "$pidfile"
}

stop_slurmd() {  # the one node's and every compute host's
    stop slurmd "$RUN/slurmd.pid"
    rm -f "$RUN"/slurmd-*.pid
}

cancel_jobs() {
    scancel --full --quiet --user=root 2>/dev/null || true
    scancel --quiet --state=PENDING 2>/dev/null || true
}

down() {
    if running slurmctld; then cancel_jobs; fi
    stop_slurmd
    remove_hosts
    stop slurmctld "$RUN/slurmctld.pid"
    stop slurmdbd "$RUN/slurmdbd.pid"
    if running mariadbd; then
        mariadb-admin shutdown 2>/dev/null || pkill -x mariadbd || true
        wait_for 30 "mariadb to stop" bash -c "! pgrep -x mariadbd"
    fi
    rm -f /run/mysqld/mysqld.pid
    stop munged /run/munge/munged.pid
    log "down"
}

hosts_status() {
    local i hosts
    hosts=$(compute_hosts)
    if [[ -z "$hosts" ]] && ! link_exists "$BRIDGE" && ! namespace_exists "$OUTSIDE"; then
        echo "hosts: none (one node, localhost)"
        return
    fi
    echo "hosts:"
    if link_exists "$BRIDGE"; then echo "  login: this machine, $LOGIN_NAME $LOGIN_ADDR (bridge $BRIDGE)"; fi
    for i in $hosts; do
        local state=stopped
        if alive "$RUN/slurmd-$(host_name "$i").pid"; then state=running; fi
        echo "  compute: $(host_name "$i") $(host_addr "$i") (namespace $(host_namespace "$i")), slurmd $state"
    done
    if namespace_exists "$OUTSIDE"; then
        echo "  outside: $OUTSIDE_NAME $OUTSIDE_ADDR (namespace $OUTSIDE), reached from the login host only"
    fi
}

status() {
    for daemon in munged mariadbd slurmdbd slurmctld slurmd; do
        if running "$daemon"; then echo "$daemon: running"; else echo "$daemon: stopped"; fi
    done
    hosts_status
    if running slurmctld; then sinfo; squeue; fi
}

usage() {
    echo "usage: $0 up|down|status (up --hosts N: a login host and N compute hosts, N from 1 to $MAX_HOSTS)" >&2
    exit 2
}

read_up_options() {  # up [--hosts N]: sets HOSTS
    while (($#)); do
        case "$1" in
            --hosts)
                if ! [[ "${2:-}" =~ ^[0-9]+$ ]] || ((10#$2 < 1 || 10#$2 > MAX_HOSTS)); then
                    echo "local-cluster: --hosts takes a number of compute hosts from 1 to $MAX_HOSTS, not '${2:-}'" >&2
                    exit 2
                fi
                HOSTS=$((10#$2))
                shift 2 ;;
            *) usage ;;
        esac
    done
}

case "${1:-}" in
    up) shift; read_up_options "$@"; up ;;
    down) down ;;
    status) status ;;
    *) usage ;;
esac
