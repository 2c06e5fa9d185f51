#!/usr/bin/env bash
# A real SLURM cluster on this one machine: munged, one slurmctld and two slurmd daemons that
# emulate the nodes n1 and n2, all on loopback, all state in one directory. It is how tessera's
# tests prove the SLURM path, and how you can try `tessera slurm ... --submit` without a cluster.
#
#   slurm/local_cluster.sh start [DIR]   start it (DIR: a new temp dir if omitted); prints the
#                                        `export SLURM_CONF=...` line that points sbatch/srun at it
#   slurm/local_cluster.sh status DIR    show its nodes and jobs
#   slurm/local_cluster.sh stop DIR      cancel its jobs and stop its daemons (DIR is kept: logs)
#
# Needs Debian's `slurm-wlm` and `munge` packages (apt-get install -y slurm-wlm munge) and is
# meant to run as root (jobs run as the user that started it). Environment knobs: NODES (default
# 2), CPUS per node (default 4; advertised, not checked against the hardware).
set -euo pipefail

usage() {
    sed -n '2,16p' "$0" >&2
    exit 2
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Wait up to $1 seconds for "$2..." to succeed.
wait_for() {
    local seconds=$1
    shift
    for _ in $(seq $((seconds * 5))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    return 1
}

write_conf() {
    local dir=$1 nodes=$2 cpus=$3 socket=$4 user
    user=$(id -un)
    local names=()
    {
        echo "# Local tessera test cluster (slurm/local_cluster.sh); state in $dir"
        echo "ClusterName=tessera-local"
        echo "SlurmctldHost=localhost(127.0.0.1)"
        echo "SlurmctldPort=$(free_port)"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # cred_expire is also how long a requeued job waits before it may start again (default 120 s).
        echo "AuthInfo=socket=$socket,cred_expire=5"
        echo "SlurmUser=$user"
        echo "SlurmdUser=$user"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/slurmctld.pid"
        echo "SlurmdPidFile=$dir/slurmd.%n.pid"
        echo "SlurmctldLogFile=$dir/slurmctld.log"
        echo "SlurmdLogFile=$dir/slurmd.%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SchedulerType=sched/builtin"
        echo "SchedulerParameters=sched_interval=2"
        echo "MpiDefault=none"
        echo "MailProg=/bin/true"
        echo "ReturnToService=2"
        echo "SlurmdParameters=config_overrides"
        echo "MinJobAge=600"
        echo "KillWait=30"
        for i in $(seq "$nodes"); do
            echo "NodeName=n$i NodeAddr=127.0.0.1 NodeHostname=localhost Port=$(free_port) CPUs=$cpus RealMemory=1000 State=UNKNOWN"
            names+=("n$i")
        done
        local IFS=,
        echo "PartitionName=debug Nodes=${names[*]} Default=YES MaxTime=INFINITE State=UP"
    } >"$dir/slurm.conf"
}

all_idle() {
    local states
    states=$(sinfo -h -N -o %T) || return 1
    [[ -n "$states" ]] && ! grep -qv '^idle$' <<<"$states"
}

start() {
    local dir=${1:-}
    local nodes=${NODES:-2} cpus=${CPUS:-4}
    for tool in munged mungekey slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || { echo "local_cluster: '$tool' not found; apt-get install -y slurm-wlm munge" >&2; exit 1; }
    done
    if [[ -z "$dir" ]]; then dir=$(mktemp -d /tmp/tessera-slurm.XXXXXX); fi
    mkdir -p "$dir/state"
    dir=$(cd "$dir" && pwd)
    for i in $(seq "$nodes"); do mkdir -p "$dir/spool/n$i"; done

    # munged wants every directory above its socket to be searchable by everyone, which DIR's
    # parents need not be (mktemp -d makes 0700 directories): the socket lives in its own
    # directory under /tmp instead (also short enough for a unix socket path).
    local sockdir
    sockdir=$(mktemp -d /tmp/tessera-munge.XXXXXX)
    chmod 755 "$sockdir"
    echo "$sockdir" >"$dir/munge.sockdir"
    mungekey --create --force --keyfile="$dir/munge.key"
    chmod 600 "$dir/munge.key"
    munged --key-file="$dir/munge.key" --socket="$sockdir/munge.sock" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" ||
        { echo "local_cluster: munged did not start; see $dir/munged.log" >&2; exit 1; }

    write_conf "$dir" "$nodes" "$cpus" "$sockdir/munge.sock"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" -c
    wait_for 20 scontrol ping || { echo "local_cluster: slurmctld did not answer; see $dir/slurmctld.log" >&2; exit 1; }
    for i in $(seq "$nodes"); do slurmd -f "$SLURM_CONF" -N "n$i"; done
    wait_for 30 all_idle || { echo "local_cluster: nodes did not come up; see $dir/slurmd.*.log" >&2; exit 1; }
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pid() {
    local pidfile=$1 pid
    [[ -f "$pidfile" ]] || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || return 0
    wait_for 10 bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
}

stop() {
    local dir=${1:?stop needs the cluster directory}
    export SLURM_CONF=$dir/slurm.conf
    if [[ -f "$dir/slurmctld.pid" ]] && scontrol ping >/dev/null 2>&1; then
        scancel --user "$(id -un)" 2>/dev/null || true
        wait_for 40 bash -c '[[ -z "$(squeue -h -o %i -t PD,R,CG,S,CF)" ]]' || echo "local_cluster: jobs still ending; stopping anyway" >&2
    fi
    for pidfile in "$dir"/slurmd.*.pid; do stop_pid "$pidfile"; done
    stop_pid "$dir/slurmctld.pid"
    stop_pid "$dir/munged.pid"
    rm -f "$dir"/*.pid
    if [[ -f "$dir/munge.sockdir" ]]; then rm -rf "$(cat "$dir/munge.sockdir")" "$dir/munge.sockdir"; fi
    echo "local_cluster: stopped (logs in $dir)"
}

status() {
    local dir=${1:?status needs the cluster directory}
    export SLURM_CONF=$dir/slurm.conf
    sinfo -N
    squeue
}

case "${1:-}" in
start) start "${2:-}" ;;
stop) stop "${2:-}" ;;
status) status "${2:-}" ;;
*) usage ;;
esac
