#!/usr/bin/env bash
# Stop the single-node SLURM cluster of scripts/slurm-up.sh: cancel its jobs, stop slurmd, slurmctld, slurmdbd,
# MariaDB and munged,
# and wait until none of them is left running. Idempotent; the packages and the config stay installed.
set -uo pipefail
[ "$(id -u)" = 0 ] || { echo "slurm-down: needs root" >&2; exit 2; }

if command -v scancel >/dev/null && [ -f /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null; then
  scancel --full --quiet --user=root 2>/dev/null || true
  for _ in $(seq 30); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 1; done
fi

stop() {  # stop the daemon whose pid file is $1, waiting for it to exit
  local pidfile=$1 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$pidfile"
}
stop /run/slurmd.pid
stop /run/slurmctld.pid
stop /run/slurmdbd.pid
if command -v mariadb-admin >/dev/null && mariadb-admin --silent ping >/dev/null 2>&1; then
  mariadb-admin shutdown || true
  for _ in $(seq 100); do mariadb-admin --silent ping >/dev/null 2>&1 || break; sleep 0.1; done
fi
stop /run/munge/munged.pid

left=$(ps -eo pid=,comm= | awk '$2 ~ /^(slurmctld|slurmd|slurmdbd|slurmstepd|munged|mariadbd|mysqld|mariadbd-safe|mysqld_safe)$/')
if [ -n "$left" ]; then
  echo "slurm-down: still running:" >&2; echo "$left" >&2; exit 1
fi
echo "slurm-down: slurmctld, slurmd, slurmdbd, MariaDB and munged stopped"
