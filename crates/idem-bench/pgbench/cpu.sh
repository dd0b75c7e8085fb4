#!/usr/bin/env bash
# Server CPU per transaction of each option: one pgbench client runs N
# transactions; the server's CPU is the postmaster's children's (cutime +
# cstime in /proc/<postmaster>/stat), which the backend adds to when it exits.
# Needs the server on this host and read access to its data directory's
# postmaster.pid. Prints figures only.
#
#   bash crates/idem-bench/pgbench/cpu.sh [transactions=4000] [rounds=2] [options...]
set -euo pipefail
cd "$(dirname "$0")"
n=${1:-4000}
rounds=${2:-2}
shift 2 2>/dev/null || shift $#
options=("$@")
[ ${#options[@]} -gt 0 ] || options=(bare paired store store-general store-nolt store-plainrecord store-plainclaim onewrite-brin)
source ./prepare.sh
pm=$(head -1 "$(psql -Atq "$url" -c 'SHOW data_directory')/postmaster.pid")
tck=$(getconf CLK_TCK)
children_cpu() { awk '{print $16 + $17}' "/proc/$pm/stat"; }
printf '%-18s %10s %16s\n' option latency_ms server_cpu_us/tx
for round in $(seq "$rounds"); do
    for option in "${options[@]}"; do
        before=$(children_cpu)
        latency=$(pgbench -n -M prepared -c 1 -t "$n" -f "$scripts/$option.sql" "$url" 2>/dev/null |
            awk '/^latency average/ {print $4}')
        sleep 0.3 # the backend's exit reaches the postmaster
        after=$(children_cpu)
        printf '%-18s %10s %16.0f\n' "$option" "$latency" "$(echo "($after - $before) * 1000000 / $tck / $n" | bc -l)"
    done
done
drop_tables
