#!/usr/bin/env bash
# Writes every pgbench script into the folder OUT: this folder's scripts as
# they are, and the variants, each a base script with one part changed, so a
# variant follows its base as the store's statements change
# (tests/pgbench.rs holds store.sql to the statements the store sends).
#
#   bash crates/idem-bench/pgbench/scripts.sh OUT
#
# prepare.sh (which run.sh, cpu.sh and wal.sh source) calls it with a
# temporary folder.
set -euo pipefail
cd "$(dirname "$0")"
out=$1
mkdir -p "$out"
cp bare.sql separate.sql threecommit.sql store.sql paired.sql onewrite.sql "$out"/

# The one line of script $1 that starts with $2.
line() {
    local found
    found=$(grep -c "^$2" "$1")
    [ "$found" = 1 ] || { echo "scripts.sh: $found lines of $1 start with $2" >&2; exit 1; }
    grep "^$2" "$1"
}

# variant NAME BASE COMMENT FROM TO [FROM TO]: BASE's statements (from its
# first \set on) with the line FROM replaced by TO (left out if TO is empty),
# under the comment COMMENT.
variant() {
    {
        printf -- '-- %s\n' "$3"
        FROM=$4 TO=$5 FROM2=${6-} TO2=${7-} awk '
            go || /^\\set/ {
                go = 1
                if ($0 == ENVIRON["FROM"]) { if (ENVIRON["TO"] != "") print ENVIRON["TO"] }
                else if (ENVIRON["FROM2"] != "" && $0 == ENVIRON["FROM2"]) { if (ENVIRON["TO2"] != "") print ENVIRON["TO2"] }
                else print
            }' "$2"
    } >"$out/$1.sql"
}

# on NAME BASE TABLE: BASE on the keys table TABLE of setup.sql.
on() {
    {
        printf -- '-- %s.sql on the keys table %s (setup.sql).\n' "${2%.sql}" "$3"
        awk 'go || /^\\set/ {go = 1; print}' "$2" | sed "s/pgb_keys /$3 /g"
    } >"$out/$1.sql"
}

first=$(line store.sql "INSERT INTO pgb_keys")
look=$(line store.sql "SELECT NULL::bigint")
record=$(line store.sql "WITH done")

variant store-plainrecord store.sql \
    "store.sql with the record as a plain UPDATE (no check that it updated exactly one row)." \
    "$record" "$(line paired.sql "UPDATE pgb_keys")"
variant store-plainclaim store.sql \
    "store.sql with paired.sql's plain upsert as the claim (no look, no wait bound)." \
    "$first" "$(line paired.sql "INSERT INTO pgb_keys")" "$look" ""

# Without the wait bound: the subqueries that save and set lock_timeout go,
# the one that restores it becomes a constant, and nothing else changes.
save_and_set=" FROM (SELECT set_config('lock_timeout', '5000', true) AS bounded FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved OFFSET 0) AS saved OFFSET 0) AS bounded"
restore="(SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS restored)"
unbounded_first=${first/"$save_and_set"/}
unbounded_look=${look/"$restore"/"(SELECT '' AS restored)"}
[ "$unbounded_first" != "$first" ] && [ "$unbounded_look" != "$look" ] ||
    { echo "scripts.sh: store.sql's claim has no lock-wait bound to take out" >&2; exit 1; }
variant store-nolt store.sql \
    "store.sql without the claim's lock-wait bound (no saving, setting and restoring lock_timeout)." \
    "$first" "$unbounded_first" "$look" "$unbounded_look"

# The general claim, written by hand: the one statement the store sends where
# the first insert and its look cannot answer (a stale row to take over,
# SERIALIZABLE), and its claim at every isolation level before the first
# insert: the read first, the upsert, the lock-wait bound and the isolation
# gates in one statement.
general=$(cat <<'EOF'
WITH saved AS MATERIALIZED (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved), bounded AS MATERIALIZED (SELECT set_config('lock_timeout', '5000', true) AS bounded FROM saved), inserted AS (INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) SELECT 't', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab'::bytea, 0, 1::bigint, 1::bigint, 9000000000000000::bigint, NULL::bigint FROM bounded WHERE (current_setting('transaction_isolation') = 'serializable') ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING k.token), existing AS MATERIALIZED (SELECT fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms FROM pgb_keys WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b AND (NOT (current_setting('transaction_isolation') = 'serializable') OR NOT EXISTS (SELECT 1 FROM inserted))), claimed AS (INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) SELECT 't', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab'::bytea, 0, 1::bigint, 1::bigint, 9000000000000000::bigint, NULL::bigint FROM bounded WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.expires_at_ms > 1::bigint AND (e.status <> 0 OR e.lease_expires_at_ms > 1::bigint)) AND (NOT (current_setting('transaction_isolation') = 'serializable') OR EXISTS (SELECT 1 FROM existing)) ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, status = 0, token = GREATEST(k.token + 1, EXCLUDED.token), payload = NULL, created_at_ms = EXCLUDED.created_at_ms, expires_at_ms = EXCLUDED.expires_at_ms, lease_expires_at_ms = EXCLUDED.lease_expires_at_ms, sent_at_ms = NULL WHERE k.expires_at_ms <= 1::bigint OR (k.status = 0 AND k.lease_expires_at_ms <= 1::bigint) RETURNING k.token), restored AS MATERIALIZED (SELECT set_config('lock_timeout', saved.saved, true) AS restored FROM saved, (SELECT count(*) FROM claimed) AS done, (SELECT count(*) FROM inserted) AS first) SELECT COALESCE(c.token, i.token), COALESCE(e.expires_at_ms > 1::bigint AND (e.status <> 0 OR e.lease_expires_at_ms > 1::bigint), false), e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms FROM restored LEFT JOIN claimed c ON true LEFT JOIN inserted i ON true LEFT JOIN existing e ON true;
EOF
)
variant store-general store.sql \
    "store.sql with the general claim (one statement for every isolation level) in place of the first insert and its look." \
    "$first" "$general" "$look" ""

on paired-noexp paired.sql pgb_keys_noexp
on onewrite-noexp onewrite.sql pgb_keys_noexp
on onewrite-brin onewrite.sql pgb_keys_brin
