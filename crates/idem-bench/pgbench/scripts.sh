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

# variant NAME BASE COMMENT FROM TO: BASE's statements (from its first \set
# on) with the line FROM replaced by TO, under the comment COMMENT.
variant() {
    {
        printf -- '-- %s\n' "$3"
        FROM=$4 TO=$5 awk 'go || /^\\set/ {go = 1; print ($0 == ENVIRON["FROM"] ? ENVIRON["TO"] : $0)}' "$2"
    } >"$out/$1.sql"
}

# on NAME BASE TABLE: BASE on the keys table TABLE of setup.sql.
on() {
    {
        printf -- '-- %s.sql on the keys table %s (setup.sql).\n' "${2%.sql}" "$3"
        awk 'go || /^\\set/ {go = 1; print}' "$2" | sed "s/pgb_keys /$3 /g"
    } >"$out/$1.sql"
}

claim=$(line store.sql "WITH saved")
record=$(line store.sql "WITH done")

variant store-plainrecord store.sql \
    "store.sql with the record as a plain UPDATE (no check that it updated exactly one row)." \
    "$record" "$(line paired.sql "UPDATE pgb_keys")"
variant store-plainclaim store.sql \
    "store.sql with paired.sql's plain upsert as the claim (no read first, no wait bound, no gates)." \
    "$claim" "$(line paired.sql "INSERT INTO pgb_keys")"

# Without the wait bound: the CTEs that save, set and restore lock_timeout
# become constants, and nothing else changes.
save_and_set="WITH saved AS MATERIALIZED (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved), bounded AS MATERIALIZED (SELECT set_config('lock_timeout', '5000', true) AS bounded FROM saved), "
restore="restored AS MATERIALIZED (SELECT set_config('lock_timeout', saved.saved, true) AS restored FROM saved, (SELECT count(*) FROM claimed) AS done, (SELECT count(*) FROM inserted) AS first)"
unbounded=${claim/"$save_and_set"/"WITH bounded AS MATERIALIZED (SELECT 1 AS bounded), "}
unbounded=${unbounded/"$restore"/"restored AS MATERIALIZED (SELECT 1 FROM (SELECT count(*) FROM claimed) AS done, (SELECT count(*) FROM inserted) AS first)"}
[ "$unbounded" != "$claim" ] || { echo "scripts.sh: store.sql's claim has no lock-wait bound to take out" >&2; exit 1; }
variant store-nolt store.sql \
    "store.sql without the claim's lock-wait bound (no saving, setting and restoring lock_timeout)." \
    "$claim" "$unbounded"

# The lean claim is written by hand: the read first and the upsert as one
# plain statement for READ COMMITTED, without the isolation gates, the
# lock-wait bound and the arm used under SERIALIZABLE.
lean=$(cat <<'EOF'
WITH existing AS MATERIALIZED (SELECT fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms FROM pgb_keys WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b), claimed AS (INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) SELECT 't', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab'::bytea, 0, 1::bigint, 1::bigint, 9000000000000000::bigint, NULL::bigint WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.expires_at_ms > 1 AND (e.status <> 0 OR e.lease_expires_at_ms > 1)) ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, status = 0, token = GREATEST(k.token + 1, EXCLUDED.token), payload = NULL, created_at_ms = EXCLUDED.created_at_ms, expires_at_ms = EXCLUDED.expires_at_ms, lease_expires_at_ms = EXCLUDED.lease_expires_at_ms, sent_at_ms = NULL WHERE k.expires_at_ms <= 1 OR (k.status = 0 AND k.lease_expires_at_ms <= 1) RETURNING k.token) SELECT c.token, COALESCE(e.expires_at_ms > 1 AND (e.status <> 0 OR e.lease_expires_at_ms > 1), false), e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms FROM (SELECT 1) AS one LEFT JOIN claimed c ON true LEFT JOIN existing e ON true;
EOF
)
variant store-lean store.sql \
    "store.sql's claim as one plain statement for READ COMMITTED (no isolation gates, wait bound or SERIALIZABLE arm)." \
    "$claim" "$lean"

on paired-noexp paired.sql pgb_keys_noexp
on onewrite-noexp onewrite.sql pgb_keys_noexp
on onewrite-brin onewrite.sql pgb_keys_brin
