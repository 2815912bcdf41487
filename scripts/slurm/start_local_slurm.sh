#!/usr/bin/env bash
# Start a real single-node Slurm (Debian's 22.05 packages) on localhost: munged, MariaDB + slurmdbd (accounting, so
# submitit's sacct sees cancelled and killed tasks), slurmctld and `slurmd -N localhost`. No systemd, no cgroups.
# Everything lives under $SLURM_LOCAL_PREFIX; clients need `source $SLURM_LOCAL_PREFIX/env.sh` (exports SLURM_CONF).
#
# Idempotent: packages are installed only when missing, files rewritten only when their content changes (then only
# the affected daemons restart), and a daemon starts only when its pid file does not name a live process.
#
#   SLURM_LOCAL_PREFIX=/tmp/kvbench-slurm   where configs, state, logs and the database live
#   SLURM_LOCAL_ACCOUNTING=1                0: no MariaDB/slurmdbd (then a killed task makes submitit wait forever)
#   SLURM_LOCAL_INSTALL=1                   0: never run apt-get (fail if a package is missing)
#   SLURM_LOCAL_CPUS=<nproc>                CPUs the node advertises (more than the cores oversubscribes)
#   SLURM_LOCAL_READY_TIMEOUT=90            seconds to wait for the node and the accounting database
#   SLURM_LOCAL_{CTLD,SLURMD,DBD,DB}_PORT   6817 / 6818 / 6819 / 3307
#
# Facts behind the settings (each found on this kind of machine): munged needs its socket directory at mode 755;
# slurmd must be told `-N localhost` (the host name is not "localhost"); slurmdbd has no -f flag and reads
# slurmdbd.conf (mode 0600) next to $SLURM_CONF; with a non-default munge socket, slurmctld and sacct need
# AccountingStoragePass=<socket> to reach slurmdbd; submitit ignores SIGTERM, so KillWait=5 makes a cancelled task
# die 5 s after scancel instead of 30.
set -euo pipefail

PREFIX=${SLURM_LOCAL_PREFIX:-/tmp/kvbench-slurm}
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
INSTALL=${SLURM_LOCAL_INSTALL:-1}
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
READY_TIMEOUT=${SLURM_LOCAL_READY_TIMEOUT:-90}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
DBD_PORT=${SLURM_LOCAL_DBD_PORT:-6819}
DB_PORT=${SLURM_LOCAL_DB_PORT:-3307}

ETC=$PREFIX/etc RUN=$PREFIX/run LOG=$PREFIX/log
MUNGE_SOCKET=$RUN/munge/munge.socket
DB_SOCKET=$RUN/mysqld.sock
T0=$(date +%s%N)

say() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[start_local_slurm %d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*"; }
die() { echo "start_local_slurm: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (slurmd runs jobs as SlurmUser=root; apt-get installs packages)"

# ---- packages ---------------------------------------------------------------------------------------------------
packages=(munge slurmctld slurmd slurm-client)
[ "$ACCOUNTING" = 1 ] && packages+=(slurmdbd mariadb-server)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || die "missing packages: ${missing[*]} (SLURM_LOCAL_INSTALL=0)"
  say "installing ${missing[*]}"
  # Packages must not start the *system* daemons (default sockets and ports): a policy-rc.d that forbids it.
  created_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && created_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=120 update -qq
  apt-get -o DPkg::Lock::Timeout=120 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi

mkdir -p "$ETC" "$RUN/munge" "$LOG" "$PREFIX/lib/munge" "$PREFIX/state" "$PREFIX/spool/slurmd"
chmod 755 "$RUN/munge"          # munged refuses a socket directory without execute permission for all
chmod 700 "$PREFIX/lib/munge"

# ---- helpers ------------------------------------------------------------------------------------------------------
alive() {  # alive <pidfile> <comm>: the pid file names a live, non-zombie process called <comm>
  local pid state
  [ -s "$1" ] || return 1
  pid=$({ tr -dc '0-9' < "$1"; } 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  state=$(sed "s/^.*) //" "/proc/$pid/stat" 2>/dev/null | cut -d" " -f1)
  [ "$state" != Z ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}
stop_pidfile() {  # stop_pidfile <pidfile> <comm>
  alive "$1" "$2" || return 0
  local pid; pid=$({ tr -dc '0-9' < "$1"; } 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$1" "$2" || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
write_if_changed() {  # write_if_changed <path> <mode>  (content on stdin); exit status 0 when the file changed
  local tmp; tmp=$(mktemp "$1.XXXX")
  cat > "$tmp"; chmod "$2" "$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
  mv -f "$tmp" "$1"; return 0
}
wait_for() {  # wait_for <what> <command...>
  local what=$1; shift
  local deadline=$(( $(date +%s) + READY_TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "start_local_slurm: timed out waiting for $what; log tails:" >&2
      for f in "$LOG"/*.log; do echo "== $f" >&2; tail -n 15 "$f" >&2 || true; done
      exit 1
    fi
    sleep 0.2
  done
}

# ---- munge --------------------------------------------------------------------------------------------------------
[ -s "$ETC/munge.key" ] || { mungekey --create --keyfile="$ETC/munge.key" --force; chmod 400 "$ETC/munge.key"; }
if ! alive "$RUN/munge/munged.pid" munged; then
  say "starting munged"
  munged --socket="$MUNGE_SOCKET" --key-file="$ETC/munge.key" --log-file="$LOG/munged.log" \
         --pid-file="$RUN/munge/munged.pid" --seed-file="$PREFIX/lib/munge/munged.seed" --force
fi
wait_for "munged" sh -c "munge -n --socket='$MUNGE_SOCKET' | unmunge --socket='$MUNGE_SOCKET'"

# ---- MariaDB + slurmdbd (accounting) ------------------------------------------------------------------------------
DB_PASS=kvbench-local-slurm
if [ "$ACCOUNTING" = 1 ]; then
  if [ ! -d "$PREFIX/mysql/mysql" ]; then
    say "initialising the MariaDB data directory"
    mariadb-install-db --no-defaults --user=root --datadir="$PREFIX/mysql" --skip-test-db > "$LOG/mariadb-install.log" 2>&1
  fi
  if ! alive "$RUN/mysqld.pid" mariadbd; then
    say "starting mariadbd"
    setsid -f mariadbd --no-defaults --user=root --datadir="$PREFIX/mysql" --socket="$DB_SOCKET" \
      --pid-file="$RUN/mysqld.pid" --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
      --innodb-buffer-pool-size=1024M --innodb-lock-wait-timeout=900 --log-error="$LOG/mariadbd.log" \
      < /dev/null > /dev/null 2>&1
  fi
  wait_for "mariadbd" mariadb-admin --no-defaults --socket="$DB_SOCKET" -uroot ping
  mariadb --no-defaults --socket="$DB_SOCKET" -uroot -e \
    "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
     GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  dbd_changed=0
  write_if_changed "$ETC/slurmdbd.conf" 600 <<EOF && dbd_changed=1
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
EOF
  [ "$dbd_changed" = 1 ] && stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
  accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
JobAcctGatherType=jobacct_gather/linux"
else
  accounting="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

# ---- slurm.conf ---------------------------------------------------------------------------------------------------
real_memory=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
real_memory=$(( real_memory * 95 / 100 ))   # above what slurmd detects, the node drains ("Low RealMemory")
conf_changed=0
write_if_changed "$ETC/slurm.conf" 644 <<EOF && conf_changed=1
ClusterName=kvbenchlocal
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$PREFIX/state
SlurmdSpoolDir=$PREFIX/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$accounting
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName=localhost CPUs=$CPUS RealMemory=$real_memory State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
printf 'export SLURM_CONF=%s\n' "$ETC/slurm.conf" > "$PREFIX/env.sh"
export SLURM_CONF=$ETC/slurm.conf
if [ "$conf_changed" = 1 ]; then
  stop_pidfile "$RUN/slurmd.pid" slurmd
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
fi

# ---- daemons ------------------------------------------------------------------------------------------------------
if [ "$ACCOUNTING" = 1 ] && ! alive "$RUN/slurmdbd.pid" slurmdbd; then
  say "starting slurmdbd"
  slurmdbd   # reads slurmdbd.conf next to $SLURM_CONF (it has no -f option)
  wait_for "slurmdbd" bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
fi
if ! alive "$RUN/slurmctld.pid" slurmctld; then
  say "starting slurmctld"
  slurmctld
fi
wait_for "slurmctld" scontrol ping
if ! alive "$RUN/slurmd.pid" slurmd; then
  say "starting slurmd"
  slurmd -N localhost
fi

node_idle() {
  local state; state=$(sinfo -h -n localhost -o %T 2>/dev/null | head -n1)
  case "$state" in
    idle|mixed|allocated) return 0 ;;
    drain*|down*|fail*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true; return 1 ;;
    *) return 1 ;;
  esac
}
wait_for "the node to be idle" node_idle
if [ "$ACCOUNTING" = 1 ]; then
  wait_for "the cluster to register with slurmdbd" sh -c "sacctmgr -n -P list cluster format=cluster | grep -qx kvbenchlocal"
  wait_for "sacct" sacct -n -X -S now
fi
say "ready: source $PREFIX/env.sh  (SLURM_CONF=$SLURM_CONF)"
