#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine (Debian's slurmctld + slurmd + munge, with job accounting in
# slurmdbd + MariaDB so that `sacct` works: submitit reads job states with it), for `make test-cluster`.
# Needs root. Idempotent: installs what is missing, writes the config for this host (its real CPUs and memory),
# starts the daemons that are not running (no systemd), and waits until the node accepts jobs.
# Stop everything with scripts/slurm-down.sh. Logs: /var/log/slurm/.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "slurm-up: needs root (it installs Debian packages and starts daemons)" >&2; exit 2; }

PARTITION=${SLURM_PARTITION:-debug}
CONF=/etc/slurm/slurm.conf
export DEBIAN_FRONTEND=noninteractive

PACKAGES="slurmctld slurmd slurmdbd slurm-client munge mariadb-server"
installed=$(dpkg-query -W -f='${Status}\n' $PACKAGES 2>/dev/null | grep -c "install ok installed" || true)
if [ "$installed" != "$(echo $PACKAGES | wc -w)" ]; then
  echo "slurm-up: installing $PACKAGES from Debian"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
fi
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# munge: one key shared by the controller and the node daemon (same machine).
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || { echo "slurm-up: munged did not start (see /var/log/munge/munged.log)" >&2; exit 1; }
fi

# MariaDB (for slurmdbd's accounting database), started without systemd.
install -d -o mysql -g mysql -m 0755 /run/mysqld
if ! mariadb-admin --silent ping >/dev/null 2>&1; then
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  setsid mariadbd-safe --user=mysql --skip-networking --pid-file=/run/mysqld/mysqld.pid >/dev/null 2>&1 < /dev/null &
  for _ in $(seq 60); do mariadb-admin --silent ping >/dev/null 2>&1 && break; sleep 0.5; done
  mariadb-admin --silent ping >/dev/null 2>&1 || { echo "slurm-up: MariaDB did not start" >&2; exit 1; }
fi
DBPASS_FILE=/etc/slurm/.tfmoe-dbpass
install -d -m 0755 /etc/slurm
[ -s "$DBPASS_FILE" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$DBPASS_FILE")
DBPASS=$(cat "$DBPASS_FILE")
mariadb <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL
(umask 077; cat > /etc/slurm/slurmdbd.conf <<CONF
# Written by scripts/slurm-up.sh: job accounting for the single-node test cluster.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DBPASS
CONF
)
install -d -m 0755 /var/log/slurm

# slurm.conf for this host: `slurmd -C` reports its real CPUs, sockets, cores, threads and memory.
HOST=$(hostname -s)
NODE_LINE=$(slurmd -C | head -n1)
install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > "$CONF.new" <<CONF
# Written by scripts/slurm-up.sh for a single-node test cluster on $HOST.
ClusterName=tfmoe
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# no cgroups and no systemd in a container: track processes by parent id, bind no tasks
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# a job at its time limit gets SIGTERM, then SIGKILL after KillWait seconds
KillWait=30
OverTimeLimit=0
InactiveLimit=0
MinJobAge=600
$NODE_LINE State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
changed=1
if [ -f "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then changed=0; fi
mv "$CONF.new" "$CONF"

# slurmdbd first (slurmctld registers with it), then the cluster in the accounting database
if ! running /run/slurmdbd.pid; then
  slurmdbd
  for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
fi
sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw tfmoe || sacctmgr -i add cluster tfmoe >/dev/null


if running /run/slurmctld.pid; then
  [ "$changed" = 1 ] && scontrol reconfigure
else
  slurmctld
fi
running /run/slurmd.pid || slurmd

for _ in $(seq 60); do
  state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) break ;; down*|drain*) scontrol update nodename="$HOST" state=resume || true ;; esac
  sleep 1
done
state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
case "$state" in
  idle*|mix*|alloc*) echo "slurm-up: node $HOST is $state in partition $PARTITION ($NODE_LINE)" ;;
  *) echo "slurm-up: node $HOST is '$state', not accepting jobs; see /var/log/slurm/" >&2; exit 1 ;;
esac
