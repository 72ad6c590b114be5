#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, to try the slurm profile and to test the submitit executor.
#
#   profiles/slurm/local-cluster.sh up      install (Debian packages) if needed, configure, start
#   profiles/slurm/local-cluster.sh down    cancel every job, stop every daemon, remove pid files
#   profiles/slurm/local-cluster.sh status  what runs
#
# Needs root on Debian 12 (SLURM 22.05). There is no systemd here, so the daemons are started by
# hand: munged, mariadb + slurmdbd (submitit reads job states with sacct, which needs accounting),
# slurmctld and `slurmd -N localhost`. Both commands are idempotent. Job ids keep counting across
# down/up (the state directory is kept), so that sacct never mixes an old job with a new one.
# What is known about SLURM on this kind of machine is in DEVELOPERS.md.
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

write_config() {
    mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS" "$RUN"
    local before
    before=$(cat "$CONF_DIR/slurm.conf" 2>/dev/null || true)
    cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by profiles/slurm/local-cluster.sh: a one-node cluster on localhost.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it starts again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
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
KillWait=10
MinJobAge=300
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
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
    if [[ "$before" != "$(cat "$CONF_DIR/slurm.conf")" ]] && running slurmctld; then
        log "slurm.conf changed: restarting slurmctld and slurmd"  # reconfigure misses some settings
        stop slurmd "$RUN/slurmd.pid"
        stop slurmctld "$RUN/slurmctld.pid"
    fi
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
    if ! running slurmd; then
        rm -f "$RUN/slurmd.pid"
        slurmd -N localhost
    fi
    wait_for 30 "the node to be idle" bash -c "sinfo -h -n localhost -o %t | grep -Eq '^(idle|mix|alloc)'" || {
        scontrol update nodename=localhost state=resume || true
        wait_for 30 "the node to be idle" bash -c "sinfo -h -n localhost -o %t | grep -Eq '^(idle|mix|alloc)'"
    }
}

up() {
    install_packages
    write_config
    start_munge
    start_mariadb
    start_slurm
    log "up: $(sinfo -h -o '%P %D %t %c CPUs %m MB')"
}

stop() {  # stop NAME PIDFILE
    local name=$1 pidfile=$2
    if running "$name"; then
        pkill -x "$name" || true
        wait_for 30 "$name to stop" bash -c "! pgrep -x $name" || pkill -9 -x "$name" || true
    fi
    rm -f "$pidfile"
}

down() {
    if running slurmctld; then
        scancel --full --quiet --user=root 2>/dev/null || true
        scancel --quiet --state=PENDING 2>/dev/null || true
    fi
    stop slurmd "$RUN/slurmd.pid"
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

status() {
    for daemon in munged mariadbd slurmdbd slurmctld slurmd; do
        if running "$daemon"; then echo "$daemon: running"; else echo "$daemon: stopped"; fi
    done
    if running slurmctld; then sinfo; squeue; fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
