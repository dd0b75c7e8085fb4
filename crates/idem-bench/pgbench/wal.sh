#!/usr/bin/env bash
# WAL records and bytes per transaction of each option (pg_stat_wal deltas
# over N transactions of one client; cluster-wide, so run it on a quiet
# server or read it as an upper bound).
#
#   bash crates/idem-bench/pgbench/wal.sh [transactions=2000]
set -euo pipefail
cd "$(dirname "$0")"
n=${1:-2000}
source ./prepare.sh
wal() { psql -Atq "$url" -c "SELECT wal_records || ' ' || wal_bytes FROM pg_stat_wal"; }
printf '%-14s %12s %12s\n' option records/tx bytes/tx
for option in bare separate paired store paired-noexp onewrite onewrite-noexp onewrite-brin threecommit; do
    read -r r0 b0 <<<"$(wal)"
    pgbench -n -M prepared -c 1 -t "$n" -f "$scripts/$option.sql" "$url" >/dev/null 2>&1
    sleep 1.2
    read -r r1 b1 <<<"$(wal)"
    printf '%-14s %12.2f %12.1f\n' "$option" "$(echo "($r1 - $r0) / $n" | bc -l)" "$(echo "($b1 - $b0) / $n" | bc -l)"
done
drop_tables
