#!/usr/bin/env bash
# A one-node Slurm cluster for tests: tests/slurm/cluster.sh start|stop DIR
# start: installs Debian's slurmctld, slurmd, slurm-client and munge (skipped when present), writes
# DIR/slurm.conf (this host, 2 CPUs, no cgroups; a requeued job is eligible again after cred_expire + 1 =
# 31 s, not Slurm's default 121 s (cred_expire also bounds a job step's launch, so not much shorter on a
# loaded 2-core host), and the scheduler passes over the queue every 2 s, not 60 s: the
# requeue test would otherwise wait ~3 minutes idle), starts munged, slurmctld and slurmd as root without
# systemd, and waits until the node is idle. Clients need SLURM_CONF=DIR/slurm.conf.
# stop: ends the daemons this script started, by the PIDs it recorded in DIR.
set -euo pipefail
action=${1:?usage: cluster.sh start|stop DIR}; dir=${2:?usage: cluster.sh start|stop DIR}
mkdir -p "$dir"; dir=$(cd "$dir" && pwd)

stop() {
  for daemon in slurmd slurmctld munged; do
    [ -s "$dir/$daemon.pid" ] || continue
    pid=$(cat "$dir/$daemon.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$dir/$daemon.pid"
  done
  [ -s "$dir/munge.path" ] && rm -rf "$(cat "$dir/munge.path")" "$dir/munge.path"
  return 0
}

if [ "$action" = stop ]; then stop; exit 0; fi
[ "$action" = start ] || { echo "usage: cluster.sh start|stop DIR" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >"$dir/apt.log" 2>&1 || { tail -20 "$dir/apt.log" >&2; exit 1; }
fi

host=$(hostname -s)
mkdir -p "$dir/ctld" "$dir/slurmd"
munge_dir=$(mktemp -d /tmp/temoe-munge.XXXXXX)  # munged runs as munge: outside DIR, which may be private
echo "$munge_dir" >"$dir/munge.path"
chmod 0755 "$munge_dir"
trap stop EXIT  # a failed start leaves nothing running
cat >"$dir/slurm.conf" <<CONF
ClusterName=temoe-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$munge_dir/munge.socket,cred_expire=30
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/slurmd
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

key=/etc/munge/munge.key
if [ ! -s "$key" ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
fi
chown munge:munge "$key" /etc/munge "$munge_dir"
chmod 0400 "$key"
runuser -u munge -- munged --socket="$munge_dir/munge.socket" --pid-file="$munge_dir/munged.pid" \
  --log-file="$munge_dir/munged.log" --seed-file="$munge_dir/munged.seed"
cp "$munge_dir/munged.pid" "$dir/munged.pid"

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 150); do
  state=$(sinfo -h -N -o %t 2>/dev/null || true)
  [ "$state" = idle ] && { trap - EXIT; echo "slurm: node $host idle"; exit 0; }
  sleep 0.2
done
echo "slurm: node $host did not become idle (state: ${state:-none}); logs in $dir" >&2
tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
