#!/usr/bin/env bash
# Run COMMAND at a low CPU priority in a session of its own (one `kill -- -PID` ends all of it), such that the
# priority holds against every other process on the machine, not only against its own session's.
#   bash scripts/low_priority.sh COMMAND [ARG...]      # nice 10
#   NICE=19 bash scripts/low_priority.sh COMMAND ...
# Why not `setsid nice -n 10 COMMAND`: where the kernel schedules by session (autogroup:
# /proc/sys/kernel/sched_autogroup_enabled is 1, the default of most distributions' kernels and so on this
# workplace's 2-core boxes), a new session is a new scheduling group, and the groups share the CPU by the
# group's own nice value, not by their processes' (sched(7), "The autogroup feature"). So the group's nice
# value is set as well, in /proc/self/autogroup, before COMMAND starts. Where that file is absent (a kernel
# without autogroup) or the processes live in a cgroup of their own (autogroup then does not apply), the
# process's nice value is what counts.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bash scripts/low_priority.sh COMMAND [ARG...]" >&2; exit 2; }
exec setsid bash -c '
  # The kernel takes one autogroup change every 100 ms, machine-wide (EAGAIN otherwise).
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    { echo "$0" > /proc/self/autogroup; } 2>/dev/null && break
    [ -w /proc/self/autogroup ] || break
    sleep 0.1
  done
  exec nice -n "$0" "$@"' "${NICE:-10}" "$@"
