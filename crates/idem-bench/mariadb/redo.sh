#!/usr/bin/env bash
# Rows written and redo log written per transaction of each way to claim a
# key on MariaDB, statement by statement, in one session: the session's
# Handler_write + Handler_update + Handler_delete and the server's
# Innodb_os_log_written (server-wide, so run it on a quiet server or read
# it as an upper bound), over N transactions of each option.
#
#   bash crates/idem-bench/mariadb/redo.sh [transactions=2000]
#
# Options:
#   bare         BEGIN; the caller's INSERT; COMMIT
#   placeholder  what idem-mysql sends: the placeholder INSERT, the caller's
#                INSERT, the record UPDATE, COMMIT
#   get-lock     GET_LOCK on the key, a read of the key, the caller's
#                INSERT, one INSERT of the completed row, COMMIT, RELEASE_LOCK
set -euo pipefail
n=${1:-2000}
. "$(dirname "$0")/tables.sh"
fresh_tables redo_bench_keys redo_bench_effects
fp="REPEAT(X'ab', 32)"
tx() { # option, i
    local k="'$1-$2'"
    case $1 in
    bare) echo "BEGIN; INSERT INTO redo_bench_effects VALUES ($k, 'payload'); COMMIT;" ;;
    placeholder) echo "BEGIN; INSERT INTO redo_bench_keys (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms) VALUES ('t', 'POST /bench', $k, $fp, 0, 1, 1, 9000000000000000); INSERT INTO redo_bench_effects VALUES ($k, 'payload'); UPDATE redo_bench_keys SET status = 1, payload = X'7b226f6b223a747275657d', lease_expires_at_ms = NULL WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = $k AND status = 0; COMMIT;" ;;
    get-lock) echo "DO GET_LOCK(CONCAT('idem:', $k), 5); BEGIN; SELECT status FROM redo_bench_keys WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = $k; INSERT INTO redo_bench_effects VALUES ($k, 'payload'); INSERT INTO redo_bench_keys (tenant, operation, idem_key, fingerprint, status, token, payload, created_at_ms, expires_at_ms) VALUES ('t', 'POST /bench', $k, $fp, 1, 1, X'7b226f6b223a747275657d', 1, 9000000000000000); COMMIT; DO RELEASE_LOCK(CONCAT('idem:', $k));" ;;
    esac
}
status="SELECT (SELECT SUM(VARIABLE_VALUE) FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME IN ('HANDLER_WRITE', 'HANDLER_UPDATE', 'HANDLER_DELETE')) AS rows_written, (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'INNODB_OS_LOG_WRITTEN') AS redo;"
printf '%-12s %12s %14s\n' option rows/tx redo-bytes/tx
for option in bare placeholder get-lock; do
    out=$({
        echo "$status"
        for i in $(seq 1 "$n"); do tx "$option" "$i"; done
        echo "$status"
    } | mysql_ -N -B | grep -E '^[0-9]+\s+[0-9]+$')
    read -r w0 r0 <<<"$(sed -n 1p <<<"$out")"
    read -r w1 r1 <<<"$(sed -n 2p <<<"$out")"
    # The status query itself writes no rows; its own reads are not counted.
    printf '%-12s %12.2f %14.1f\n' "$option" "$(echo "($w1 - $w0) / $n" | bc -l)" "$(echo "($r1 - $r0) / $n" | bc -l)"
done
mysql_ -e "DROP TABLE IF EXISTS redo_bench_keys, redo_bench_effects"
