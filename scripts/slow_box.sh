#!/usr/bin/env bash
# Run a command on a slower box made of this one: under a CPU quota of PERCENT of one core
# (200 = two cores' worth), in a cgroup of its own that every child inherits (a Ray head started
# inside it, its raylet and workers included). Developers rarely get a slow machine; the plan the
# job makes for its box (box_plan) is checked here.
#
#   scripts/slow_box.sh 66 scripts/run_local.sh run_name=slow     # ~3x slower than 2 free cores
#
# Needs root (or a delegated cgroup): cgroup v2's cpu.max, else v1's cpu.cfs_quota_us, else
# `systemd-run --scope -p CPUQuota=` where systemd runs the machine. Stop any Ray head first:
# a head started outside the quota runs the job's actors outside it.
set -euo pipefail
PERCENT=${1:?usage: scripts/slow_box.sh PERCENT command [args...]}
shift
PERIOD=100000
QUOTA=$((PERCENT * PERIOD / 100))
NAME=dspark-slow-$$
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then
    DIR=/sys/fs/cgroup/$NAME
    mkdir "$DIR" && echo "$QUOTA $PERIOD" > "$DIR/cpu.max"
elif [ -d /sys/fs/cgroup/cpu ]; then
    DIR=/sys/fs/cgroup/cpu/$NAME
    mkdir "$DIR" && echo "$PERIOD" > "$DIR/cpu.cfs_period_us" && echo "$QUOTA" > "$DIR/cpu.cfs_quota_us"
elif command -v systemd-run >/dev/null && [ -d /run/systemd/system ]; then
    exec systemd-run --scope --quiet -p CPUQuota="$PERCENT%" "$@"
else
    echo "slow_box: no cgroup CPU controller to write and no systemd here" >&2
    exit 2
fi
echo "[slow_box] $* under a CPU quota of $PERCENT% of a core ($DIR)" >&2
echo $$ > "$DIR/cgroup.procs"
rc=0
"$@" || rc=$?
# out of it again, and the cgroup removed unless something started inside still runs there (a
# Ray head: `ray stop` first, then rmdir the directory named above)
echo $$ > "$(dirname "$DIR")/cgroup.procs"
rmdir "$DIR" 2>/dev/null || echo "[slow_box] $DIR stays: processes started in it still run" >&2
exit $rc
