#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the cluster lane (`make test-cluster`).
#
#   tests/cluster/slurm.sh install      Debian's slurmctld / slurmd / slurm-client and munge (root)
#   tests/cluster/slurm.sh up DIR       write /etc/slurm/{slurm,gres}.conf, start munged, slurmctld,
#                                       slurmd (state, spool, logs and PID files under DIR)
#   tests/cluster/slurm.sh down DIR     stop the daemons `up` started, by the PIDs it recorded
#
# The configuration goes where every SLURM client looks by default, /etc/slurm/slurm.conf: the
# Snakemake SLURM plugin's job step deletes every SLURM_* variable (SLURM_CONF too) before it calls
# `srun` inside a job, so a configuration elsewhere would not be found there. A slurm.conf that
# this script did not write is never overwritten (a real cluster's). The node has two partitions,
# `cpu` (the default) and `gpu`, and one fake GPU (GRES backed by /dev/null) so that `--gpus=1`
# requests are accepted and scheduled like on a real GPU node. No systemd here: the daemons are
# started by hand and stopped by PID.
set -euo pipefail

cmd=${1:?usage: slurm.sh install | up DIR | down DIR}
CONF=/etc/slurm/slurm.conf
MARK="# palu test cluster"

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        echo "slurm.sh: SLURM and munge are already installed"
        return
    fi
    [ "$(id -u)" = 0 ] || { echo "slurm.sh: installing SLURM needs root (apt-get)" >&2; exit 1; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
}

wait_for() {   # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
    local limit=$1 what=$2; shift 2
    for _ in $(seq "$limit"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "slurm.sh: $what did not come up within ${limit}s" >&2
    return 1
}

up() {
    local dir host cpus mem
    dir=$(realpath -m "${1:?usage: slurm.sh up DIR}")
    [ "$(id -u)" = 0 ] || { echo "slurm.sh: the daemons run as root here" >&2; exit 1; }
    if [ -f "$CONF" ] && ! grep -q "^$MARK" "$CONF"; then
        echo "slurm.sh: $CONF exists and is not the test cluster's: refusing to replace it" >&2
        exit 1
    fi
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    host=$(hostname -s)
    cpus=$(nproc)
    # leave ~2 GB to the OS; the lane's jobs ask for far less
    mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048 ))
    mkdir -p "$(dirname "$CONF")"
    cat > "$CONF" <<EOF
$MARK (tests/cluster/slurm.sh; state under $dir)
ClusterName=palu-ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# squeue must still see a finished job when Snakemake asks (the plugin's squeue status command)
MinJobAge=300
ReturnToService=2
SchedulerType=sched/backfill
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:1 State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$host MaxTime=INFINITE State=UP
EOF
    echo "NodeName=$host Name=gpu File=/dev/null" > "$(dirname "$CONF")/gres.conf"
    chown munge:munge "$dir/munge"
    # munged as the munge user, on a socket of its own (a system munged may run beside it)
    runuser -u munge -- /usr/sbin/munged --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    wait_for 10 munged test -S "$dir/munge/munge.socket"
    /usr/sbin/slurmctld -i
    wait_for 30 slurmctld scontrol ping
    /usr/sbin/slurmd
    wait_for 30 "the node" sh -c "sinfo -h -N -o %T | grep -qE '^(idle|mixed|allocated)'"
    echo "slurm.sh: cluster up (node $host, $cpus CPUs, ${mem} MB, partitions cpu* and gpu; $CONF)" >&2
}

stop_pid() {   # stop_pid FILE NAME: TERM the daemon whose PID FILE holds, KILL it after 10 s
    local file=$1 name=$2 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 10); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        echo "slurm.sh: stopped $name (pid $pid)" >&2
    fi
    rm -f "$file"
}

down() {
    local dir
    dir=$(realpath -m "${1:?usage: slurm.sh down DIR}")
    stop_pid "$dir/slurmd.pid" slurmd
    stop_pid "$dir/slurmctld.pid" slurmctld
    stop_pid "$dir/munge/munged.pid" munged
    if [ -f "$CONF" ] && grep -q "^$MARK" "$CONF"; then
        rm -f "$CONF" "$(dirname "$CONF")/gres.conf"
    fi
}

case "$cmd" in
    install) install ;;
    up) up "${2:-}" ;;
    down) down "${2:-}" ;;
    *) echo "usage: slurm.sh install | up DIR | down DIR" >&2; exit 2 ;;
esac
