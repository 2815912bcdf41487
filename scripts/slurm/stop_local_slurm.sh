#!/usr/bin/env bash
# Stop the single-node Slurm started by start_local_slurm.sh: cancel every job and wait until none is left (so no
# job process or slurmstepd outlives slurmd), then TERM (KILL after 10 s) the daemons named by their pid files, in
# the order slurmd, slurmctld, slurmdbd, mariadbd, munged. Only those pids are signalled. Idempotent.
#
#   SLURM_LOCAL_PREFIX=/tmp/kvbench-slurm   the prefix the start script used
#   SLURM_LOCAL_PURGE=1                     also delete the prefix (configs, state, logs, database)
set -euo pipefail

PREFIX=${SLURM_LOCAL_PREFIX:-/tmp/kvbench-slurm}
RUN=$PREFIX/run

alive() {  # alive <pidfile> <comm>: the pid file names a live, non-zombie process called <comm>
  local pid state
  [ -s "$1" ] || return 1
  pid=$({ tr -dc '0-9' < "$1"; } 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  state=$(sed "s/^.*) //" "/proc/$pid/stat" 2>/dev/null | cut -d" " -f1)
  [ "$state" != Z ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop() {  # stop <pidfile> <comm>
  if ! alive "$1" "$2"; then echo "stop_local_slurm: $2 not running"; return 0; fi
  local pid; pid=$({ tr -dc '0-9' < "$1"; } 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    if ! alive "$1" "$2"; then echo "stop_local_slurm: stopped $2 ($pid)"; return 0; fi
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  echo "stop_local_slurm: killed $2 ($pid)"
}

if [ -f "$PREFIX/etc/slurm.conf" ] && alive "$RUN/slurmctld.pid" slurmctld; then
  export SLURM_CONF=$PREFIX/etc/slurm.conf
  if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
    echo "stop_local_slurm: cancelling all jobs"
    scancel --full --quiet "$(squeue -h -o %i | sort -u)" 2>/dev/null || scancel --user=root --quiet || true
    for _ in $(seq 300); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi

stop "$RUN/slurmd.pid" slurmd
stop "$RUN/slurmctld.pid" slurmctld
stop "$RUN/slurmdbd.pid" slurmdbd
stop "$RUN/mysqld.pid" mariadbd
stop "$RUN/munge/munged.pid" munged

if [ "${SLURM_LOCAL_PURGE:-0}" = 1 ]; then
  rm -rf "$PREFIX"
  echo "stop_local_slurm: removed $PREFIX"
fi
