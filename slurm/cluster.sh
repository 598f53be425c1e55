#!/usr/bin/env bash
# A real Slurm cluster on this host for the tests and CI: munged, MariaDB, slurmdbd, slurmctld and two
# slurmd processes (emulated nodes n1, n2). Installs Debian's packages when they are missing.
#   slurm/cluster.sh start    # exit 0 when every node is idle; exit 3 when it cannot run here (not root)
#   slurm/cluster.sh stop     # SIGTERM by PID in reverse order, SIGKILL after 10 s; never by name
set -euo pipefail
STATE=${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
DAEMONS=(munged mariadb slurmdbd slurmctld slurmd-n1 slurmd-n2)
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

log() { echo "cluster: $*" >&2; }

wait_for() {  # wait_for DESCRIPTION SECONDS COMMAND...
    local what=$1 seconds=$2; shift 2
    for _ in $(seq $((seconds * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    log "timed out waiting for $what"; return 1
}

start_daemon() {  # start_daemon NAME COMMAND...: in the background, its PID kept in $STATE
    local name=$1; shift
    "$@" >"$STATE/$name.log" 2>&1 &
    echo $! >"$STATE/$name.pid"
}

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

stop() {
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        local file="$STATE/${DAEMONS[i]}.pid"
        [ -f "$file" ] || continue
        local pid; pid=$(cat "$file")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$file"
    done
}

start() {
    [ "$(id -u)" -eq 0 ] || { log "needs root (the daemons run as root or munge)"; exit 3; }
    command -v apt-get >/dev/null || { log "needs Debian's packages (apt-get)"; exit 3; }
    install_packages
    mkdir -p "$STATE"
    stop  # a cluster left by an earlier start of ours
    local host; host=$(hostname -s)
    # the nodes' address: not loopback where the host has another (a real node's never is), else 127.0.0.1
    local addr; addr=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -m1 -E '^[0-9]+(\.[0-9]+){3}$' || true)

    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge; chmod 0700 /var/lib/munge /var/log/munge
    start_daemon munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F
    wait_for munge 20 bash -c 'munge -n | unmunge'

    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    start_daemon mariadb /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql \
        --socket=/run/mysqld/mysqld.sock --bind-address=127.0.0.1
    wait_for mariadb 60 mariadb -e 'select 1'
    # a fresh cluster numbers jobs from 1 again: drop the accounting of earlier clusters with it
    mariadb -e "DROP DATABASE IF EXISTS slurm_acct_db;
                CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

    mkdir -p /etc/slurm /run/slurm /var/log/slurm
    sed -e "s/@HOST@/$host/g" -e "s/@ADDR@/${addr:-127.0.0.1}/g" "$HERE/slurm.conf.in" >/etc/slurm/slurm.conf
    install -m 600 "$HERE/slurmdbd.conf.in" /etc/slurm/slurmdbd.conf
    rm -rf /var/spool/slurmctld /var/spool/slurmd  # a fresh cluster: no jobs from earlier runs
    mkdir -p /var/spool/slurmctld /var/spool/slurmd && chmod 0700 /var/spool/slurmctld
    start_daemon slurmdbd slurmdbd -D
    wait_for slurmdbd 30 sacctmgr -n list cluster
    sacctmgr -i add cluster launcher >/dev/null 2>&1 || true
    start_daemon slurmctld slurmctld -D -c -i
    wait_for slurmctld 30 scontrol ping
    start_daemon slurmd-n1 slurmd -D -N n1
    start_daemon slurmd-n2 slurmd -D -N n2
    wait_for "idle nodes" 30 bash -c '[ "$(sinfo -h -N -o %T | sort -u)" = idle ]'
    log "up: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')at ${addr:-127.0.0.1}"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
