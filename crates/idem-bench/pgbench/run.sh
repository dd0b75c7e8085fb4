#!/usr/bin/env bash
# Statement-level comparison of the PostgreSQL options for idem's transactional
# path, with pgbench (prepared statements; pipelines where a script pairs
# statements in one round trip). Each option runs against the bare
# transaction in the same run, interleaved, ROUNDS times; prints tps and the
# ratio to bare. Prints figures only.
#
#   bash crates/idem-bench/pgbench/run.sh [seconds=15] [clients=16] [rounds=2]
#
# OPTIONS (space-separated script names, e.g. "paired store store-general")
# runs those options instead of the default list.
#
# The database comes from IDEM_TEST_POSTGRES_URL (default
# postgres://postgres@127.0.0.1:5432/test).
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-15}
clients=${2:-16}
rounds=${3:-2}
source ./prepare.sh
read -r -a options <<<"${OPTIONS:-separate paired store store-general store-plainrecord store-nolt paired-noexp onewrite onewrite-noexp onewrite-brin threecommit}"
tps() {
    [ -f "$scripts/$1.sql" ] || { echo "run.sh: no script $1 (scripts.sh writes: $(cd "$scripts" && ls | sed 's/\.sql$//' | tr '\n' ' '))" >&2; exit 1; }
    local out
    out=$(pgbench -n -M prepared -c "$clients" -j 2 -T "$seconds" -f "$scripts/$1.sql" "$url" 2>&1) ||
        { echo "run.sh: pgbench failed on $1:" >&2; echo "$out" | tail -5 >&2; exit 1; }
    echo "$out" | awk '/^tps/ {print int($3)}'
}
printf '%-14s %8s %8s %7s\n' option tps bare ratio
for round in $(seq "$rounds"); do
    for option in "${options[@]}"; do
        bare=$(tps bare)
        t=$(tps "$option")
        printf '%-14s %8s %8s %7.3f\n' "$option" "$t" "$bare" "$(echo "$t / $bare" | bc -l)"
    done
done
drop_tables
