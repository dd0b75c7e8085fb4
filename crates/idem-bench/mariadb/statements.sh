#!/usr/bin/env bash
# What a fresh call's statements cost a local MariaDB under concurrency:
# mariadb-slap runs each option's statement sequence from 16 clients (each
# statement one round trip in the text protocol, a fresh key per sequence)
# and prints sequences per second, alternating the options.
#
#   bash crates/idem-bench/mariadb/statements.sh [sequences-per-run=9000] [runs=2]
#
# Options (the caller's own write is one INSERT; `SET @k = UUID()` picks the
# key and is counted in both):
#   placeholder  BEGIN; the placeholder INSERT; the caller's INSERT; the
#                record UPDATE; COMMIT                    (6 statements)
#   named-lock   the lock's SET; the read of the key; BEGIN; the caller's
#                INSERT; the INSERT of the completed row; COMMIT;
#                DO RELEASE_LOCK                           (8 statements)
set -euo pipefail
sequences=${1:-9000}
runs=${2:-2}
. "$(dirname "$0")/tables.sh"
fresh_tables statements_bench_keys statements_bench_effects
fp="REPEAT(X'ab', 32)"
keys=statements_bench_keys
where="tenant = 't' AND operation = 'op' AND idem_key = @k"
placeholder="SET @k = UUID();BEGIN;INSERT INTO $keys (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms) VALUES ('t', 'op', @k, $fp, 0, 1, 1, 9000000000000000);INSERT INTO statements_bench_effects VALUES (@k, 'x');UPDATE $keys SET status = 1, payload = 'done', lease_expires_at_ms = NULL WHERE $where AND status = 0;COMMIT"
named_lock="SET @k = UUID();SET @l = IF(@@tx_isolation = 'SERIALIZABLE', -1, GET_LOCK(CONCAT('idem:', @k), 1.000));SELECT CAST(@l AS SIGNED), k.status, IF(@l = 1 AND k.status IS NOT NULL, RELEASE_LOCK(CONCAT('idem:', @k)), NULL) FROM (SELECT 1) AS one LEFT JOIN $keys AS k ON k.tenant = 't' AND k.operation = 'op' AND k.idem_key = @k;BEGIN;INSERT INTO statements_bench_effects VALUES (@k, 'x');INSERT INTO $keys (tenant, operation, idem_key, fingerprint, status, token, payload, created_at_ms, expires_at_ms) VALUES ('t', 'op', @k, $fp, 1, 1, 'done', 1, 9000000000000000);COMMIT;DO RELEASE_LOCK(CONCAT('idem:', @k))"
printf '%-12s %4s %12s %14s\n' option run statements sequences/s
for run in $(seq 1 "$runs"); do
    for option in placeholder named_lock; do
        sql=${!option}
        count=$(awk -F';' '{print NF}' <<<"$sql")
        secs=$(mariadb-slap -uroot -h127.0.0.1 -P3306 --create-schema="$db" --concurrency=16 --iterations=1 \
            --number-of-queries=$((sequences * count)) --query="$sql" --delimiter=";" 2>&1 |
            awk '/Average number of seconds/ {print $(NF-1)}')
        printf '%-12s %4s %12s %14.0f\n' "${option/_/-}" "$run" "$count" "$(echo "$sequences / $secs" | bc -l)"
    done
done
mysql_ -e "DROP TABLE statements_bench_keys, statements_bench_effects;"
