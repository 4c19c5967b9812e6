#!/usr/bin/env bash
# A private Slurm cluster on this one machine for the tests: two nodes (two slurmd, Slurm's multiple-slurmd
# layout), its own munge key and socket, config, state, spool, logs and ports, all under one folder;
# daemons stopped by the pids they wrote.
#
#   tests/slurm/cluster.sh start DIR   # writes DIR/slurm.conf, starts munged, slurmctld, slurmd; waits
#                                      # until both nodes are idle; prints `export SLURM_CONF=DIR/slurm.conf`
#   tests/slurm/cluster.sh stop DIR    # stops the daemons started in DIR (and any job they still run)
#
# Needs root (slurmd runs jobs as their submitting user) and the Debian packages slurmctld, slurmd,
# slurm-client and munge. The nodes are named `localhost` and this host's name, two names that resolve here,
# so a two-node job's rendezvous address works. Each offers half the machine's CPUs (at least one), half its
# memory and 8 GPUs that are empty files (no driver), so the scripts' `#SBATCH --gpus-per-node=8` is accepted
# as a user types it. Job credentials expire after 10 s (Slurm's default 120 s is also how long a requeued job
# waits before it may start again on the node that revoked its old credential), and the scheduler looks at
# pending jobs every 2 s (default 60): a requeued job starts again about 20 s after it stopped.
set -euo pipefail

die() { echo "error: cluster.sh: $*" >&2 && exit 1; }
[[ $# == 2 && ($1 == start || $1 == stop) ]] || die "usage: cluster.sh start|stop DIR"
action=$1
dir=$(realpath -m -- "$2")

stop() {
    # the slurmd first (they kill their job steps), then the controller, then munge
    for pidfile in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -f $pidfile ]] || continue
        local pid
        pid=$(<"$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

if [[ $action == stop ]]; then
    stop
    exit 0
fi

for bin in munged slurmctld slurmd sbatch scontrol; do
    command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] || die "$bin not found: apt-get install slurmctld slurmd slurm-client munge"
done
((EUID == 0)) || die "the daemons need root (slurmd starts jobs as their user)"
mkdir -p "$dir"/{state,spool,munge}
chmod 700 "$dir" "$dir/munge"

# Free ports below the kernel's ephemeral range: one that bind(0) could hand to another process before the daemon
# binds it would race (tests run beside this cluster); one below the range is never handed out, so it stays free.
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
found = []
for port in range(min(20000, low - 1000), low):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            continue
    found.append(port)
    if len(found) == int(sys.argv[1]):
        break
print(*found)
PY
}
read -r ctld_port node_port_1 node_port_2 <<<"$(free_ports 3)"
[[ -n $node_port_2 ]] || die "no three free ports below the ephemeral range"
node_ports=("$node_port_1" "$node_port_2")
host=$(hostname -s)
nodes=("$host" "$host-2")
cpus=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 - 512))

dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
/usr/sbin/munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"

mkdir -p "$dir/dev"
for node in "${nodes[@]}"; do
    mkdir -p "$dir/spool/$node"
    touch "$dir/dev/$node-gpu"{0..7} # stand-ins for /dev/nvidia*: Slurm only hands out a file per GPU
    echo "NodeName=$node Name=gpu File=$dir/dev/$node-gpu[0-7]"
done >"$dir/gres.conf"
sed -i '1i AutoDetect=off' "$dir/gres.conf"
cat >"$dir/slurm.conf" <<CONF
ClusterName=dapotest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=3600
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
CONF
for i in "${!nodes[@]}"; do
    echo "NodeName=${nodes[i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${node_ports[i]} CPUs=$cpus RealMemory=$mem_mb Gres=gpu:8 State=UNKNOWN"
done >>"$dir/slurm.conf"
echo "PartitionName=debug Nodes=$(
    IFS=,
    echo "${nodes[*]}"
) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$dir/slurm.conf"
export SLURM_CONF=$dir/slurm.conf
/usr/sbin/slurmctld -i -f "$SLURM_CONF"
for node in "${nodes[@]}"; do /usr/sbin/slurmd -f "$SLURM_CONF" -N "$node"; done
for _ in $(seq 150); do
    states=$(sinfo -h -N -o %T 2>/dev/null | sort -u | paste -sd, || true)
    [[ $states == idle ]] && break
    sleep 0.2
done
[[ ${states:-} == idle ]] || {
    tail -n 20 "$dir"/slurm*.log >&2 || true
    stop
    die "the nodes did not come up idle (states: ${states:-unknown}); logs above"
}
echo "export SLURM_CONF=$SLURM_CONF"
