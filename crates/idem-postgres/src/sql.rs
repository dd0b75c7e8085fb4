//! The SQL text of every statement, built once per table and strategy.
//!
//! Table names are validated [`TableName`]s, so splicing them into SQL is
//! safe. Every time is a bound parameter taken from the engine's clock; no
//! statement reads the database's own clock.

use std::sync::Arc;

use idem_core::TableName;

use crate::ClaimStrategy;

/// PostgreSQL truncates identifiers to 63 bytes.
const MAX_IDENTIFIER_LEN: usize = 63;

/// The columns a stored row is decoded from, in the order
/// [`StoredRow::from_columns`](idem_core::StoredRow::from_columns) takes them.
const ROW_COLUMNS: &str = "fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms";

/// The placeholder custom setting that keeps the caller's `lock_timeout`
/// while a claim bounds its own wait.
const SAVED_LOCK_TIMEOUT: &str = "idem.saved_lock_timeout";

/// The statements of one store configuration.
#[derive(Debug)]
pub(crate) struct Statements {
    /// The transactional claim (with the advisory lock under that strategy),
    /// which also answers the key's visible row. Under
    /// [`ClaimStrategy::InsertOnConflict`] a transaction that begins with a
    /// claim sends [`first`](Self::first) instead and this one only where
    /// that cannot answer.
    pub(crate) claim_tx: Prepared,
    /// Under [`ClaimStrategy::InsertOnConflict`], the claim a transaction
    /// begins with: two plain statements sent together; `None` under the
    /// other strategies.
    pub(crate) first: Option<FirstStatements>,
    /// Records the outcome on the row claimed in the same transaction and
    /// divides by the number of rows it updated, so it fails unless that is
    /// exactly one. Parameters: `$1` status, `$2` payload, `$3` tenant, `$4`
    /// operation, `$5` key.
    pub(crate) record_tx: Prepared,
    /// The lease-mode claim: an upsert without an advisory lock.
    pub(crate) claim_lease: Arc<str>,
    /// Reads a row.
    pub(crate) select_row: Arc<str>,
    /// Records an outcome on the row claimed in the same transaction.
    pub(crate) record: Arc<str>,
    /// Under [`ClaimStrategy::OneWrite`], the statements that take the
    /// advisory lock before the claim and insert the completed row at
    /// commit; `None` under the other strategies.
    pub(crate) one_write: Option<OneWriteStatements>,
}

/// The statements only [`ClaimStrategy::OneWrite`] sends.
#[derive(Debug)]
pub(crate) struct OneWriteStatements {
    /// Takes the key's transaction-scoped advisory lock unless a live row is
    /// visible (see [`one_write_lock`]).
    pub(crate) lock: Prepared,
    /// The record: one plain `INSERT` of the completed row. Parameters: `$1`
    /// tenant, `$2` operation, `$3` key, `$4` fingerprint, `$5` status, `$6`
    /// token, `$7` payload, `$8` claim time, `$9` expiry.
    pub(crate) insert: Prepared,
}

/// The claim a transaction begins with under
/// [`ClaimStrategy::InsertOnConflict`], sent as `EXECUTE insert(…); EXECUTE
/// look(…)` right after `BEGIN`, all in one round trip.
///
/// - `insert` ([`first_insert`]) inserts the key's placeholder with `ON
///   CONFLICT DO NOTHING`, under the claim's own lock-wait bound: a fresh
///   key is claimed by this one plain insert.
/// - `look` ([`first_look`]) puts the caller's `lock_timeout` back and reads
///   the key's row in a snapshot taken after the insert, answering
///   [`CLAIM_COLUMNS`] (the token always NULL, then whether the row is live
///   and the row). A replay is answered by it: a held key is neither
///   written nor locked (`DO NOTHING` locks no row), and a twin's row
///   committed while the insert waited for it is seen, at READ COMMITTED.
///
/// `look` reads only if the insert wrote nothing (the transaction has no
/// transaction id yet), so a fresh claim reads nothing: under SERIALIZABLE a
/// read of the key's index page would take a predicate lock there and make
/// unrelated fresh claims fail each other's commits. A held key is read, as
/// the general claim reads it. Where neither answers (a stale row to take
/// over, a row released or swept between the two, an insert that met a
/// twin's row only when it wrote its index entry), the general [`tx_claim`]
/// runs in the same transaction.
#[derive(Debug)]
pub(crate) struct FirstStatements {
    /// The insert: [`tx_claim`]'s nine parameters.
    pub(crate) insert: Prepared,
    /// The read: `$1` tenant, `$2` operation, `$3` key, `$4` now.
    pub(crate) look: Prepared,
}

impl FirstStatements {
    fn new(t: &str) -> Self {
        Self {
            insert: Prepared::new("idem_first", CLAIM_PARAM_TYPES, first_insert(t)),
            look: Prepared::new("idem_look", "text, text, text, bigint", first_look(t)),
        }
    }
}

/// [`FirstStatements::insert`]. `saved` keeps the caller's `lock_timeout` in
/// a transaction-local setting before `bounded` sets the claim's (each a
/// subquery of its own, kept apart by `OFFSET 0`, so `saved` is evaluated
/// first); the insert's wait for an uncommitted twin is bounded by it.
fn first_insert(t: &str) -> String {
    format!(
        "INSERT INTO {t} AS k ({INSERT_COLUMNS}) \
         SELECT $1, $2, $3, $4, 0, $5, $6, $7, $8 FROM (\
             SELECT set_config('lock_timeout', $9, true) AS bounded FROM (\
                 SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true) AS saved OFFSET 0\
             ) AS saved OFFSET 0\
         ) AS bounded \
         ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING k.token"
    )
}

/// [`FirstStatements::look`]: the caller's `lock_timeout` restored (`restored`
/// is a subquery with a volatile function, so it is evaluated although
/// nothing above reads it but the last column), then [`CLAIM_COLUMNS`]. The
/// read's gate is a constant of the statement (a stable function), so the
/// scan does not run when it is false.
fn first_look(t: &str) -> String {
    format!(
        "SELECT NULL::bigint, COALESCE({live}, false), \
                e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms, \
                r.restored \
         FROM (SELECT set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true) AS restored) AS r \
         LEFT JOIN (SELECT {ROW_COLUMNS} FROM {t} WHERE tenant = $1 AND operation = $2 AND idem_key = $3 \
                    AND txid_current_if_assigned() IS NULL) AS e ON true",
        live = LIVE.replace("$6", "$4"),
    )
}

/// A statement a connection prepares (with `PREPARE`) before it is sent by
/// name.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// The statement.
    pub(crate) text: Arc<str>,
    /// The name it is prepared under on a connection, unique to its text.
    pub(crate) name: Arc<str>,
    /// `PREPARE {name} (…) AS {text}`.
    pub(crate) prepare: Arc<str>,
}

impl Prepared {
    /// `text`, whose parameters are of `types`, prepared under `prefix`
    /// and a hash of the text.
    fn new(prefix: &str, types: &str, text: String) -> Self {
        let name = format!("{prefix}_{:016x}", fnv1a(&[text.as_bytes()]));
        Self {
            prepare: format!("PREPARE {name} ({types}) AS {text}").into(),
            name: name.into(),
            text: text.into(),
        }
    }
}

impl OneWriteStatements {
    fn new(t: &str) -> Self {
        let insert = format!(
            "INSERT INTO {t} (tenant, operation, idem_key, fingerprint, status, token, payload, \
             created_at_ms, expires_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
        );
        Self {
            lock: Prepared::new("idem_lock", "text, text, text, bigint, text, bigint", one_write_lock(t)),
            insert: Prepared::new(
                "idem_insert",
                "text, text, text, bytea, smallint, bigint, bytea, bigint, bigint",
                insert,
            ),
        }
    }
}

impl Statements {
    pub(crate) fn new(table: &TableName, strategy: ClaimStrategy) -> Self {
        let t = table.as_str();
        let key = "tenant = $1 AND operation = $2 AND idem_key = $3";
        let types = match strategy {
            ClaimStrategy::InsertOnConflict | ClaimStrategy::OneWrite => CLAIM_PARAM_TYPES.to_owned(),
            ClaimStrategy::AdvisoryLock => format!("{CLAIM_PARAM_TYPES}, bigint"),
        };
        let record_tx = format!(
            "WITH done AS (UPDATE {t} SET status = $1, payload = $2, lease_expires_at_ms = NULL \
             WHERE tenant = $3 AND operation = $4 AND idem_key = $5 AND status = 0 RETURNING 1) \
             SELECT 1 / count(*)::int FROM done"
        );
        Self {
            claim_tx: Prepared::new("idem_claim", &types, tx_claim(t, strategy)),
            first: (strategy == ClaimStrategy::InsertOnConflict).then(|| FirstStatements::new(t)),
            record_tx: Prepared::new("idem_record", "smallint, bytea, text, text, text", record_tx),
            claim_lease: lease_claim(t).into(),
            select_row: format!("SELECT {ROW_COLUMNS} FROM {t} WHERE {key}").into(),
            // Only columns outside every index change here, so PostgreSQL can
            // make this a heap-only (HOT) update on the claim's own page.
            record: format!(
                "UPDATE {t} SET status = $4, payload = $5, lease_expires_at_ms = NULL \
                 WHERE {key} AND status = 0"
            )
            .into(),
            one_write: (strategy == ClaimStrategy::OneWrite).then(|| OneWriteStatements::new(t)),
        }
    }
}

/// Deletes at most `$2` rows expired at `$1`. SKIP LOCKED leaves rows that a
/// claim is taking over right now to that claim, so the sweeper never waits
/// on live traffic. The rows the subquery locked still qualify (PostgreSQL
/// rechecks the filter on the newest row version when it locks it) and
/// cannot change before the delete, so the outer statement needs no filter
/// of its own; without one the planner looks the batch up by primary key.
pub(crate) fn sweep(table: &TableName) -> String {
    let t = table.as_str();
    format!(
        "DELETE FROM {t} WHERE (tenant, operation, idem_key) IN (\
         SELECT tenant, operation, idem_key FROM {t} WHERE expires_at_ms <= $1 \
         LIMIT $2 FOR UPDATE SKIP LOCKED)"
    )
}

/// The parameter types of the transactional claim, in order (the advisory
/// strategy adds a tenth, the lock key).
const CLAIM_PARAM_TYPES: &str = "text, text, text, bytea, bigint, bigint, bigint, bigint, text";

/// The columns the transactional claim answers, in this order: the claimed
/// token (NULL unless this statement claimed the key), whether the row it
/// saw is live, then the row it saw (all NULL if it saw none) in
/// [`ROW_COLUMNS`] order.
pub(crate) const CLAIM_COLUMNS: usize = 8;

/// The conflict arm of both claims: a conflicting row is taken over only if
/// it is stale (expired, or an in-progress lease whose lease ran out), with a
/// token larger than its old one; the claimed token is returned. A sent
/// lease (status 4) is never stale before the key expires: its lease's end
/// makes it an unknown outcome, answered as the row it is.
const TAKEOVER: &str = "ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET \
     fingerprint = EXCLUDED.fingerprint, status = 0, token = GREATEST(k.token + 1, EXCLUDED.token), \
     payload = NULL, created_at_ms = EXCLUDED.created_at_ms, expires_at_ms = EXCLUDED.expires_at_ms, \
     lease_expires_at_ms = EXCLUDED.lease_expires_at_ms, sent_at_ms = NULL \
     WHERE k.expires_at_ms <= $6 OR (k.status = 0 AND k.lease_expires_at_ms <= $6) \
     RETURNING k.token";

/// The transactional claim: one statement that claims the key or answers
/// the committed row that holds it.
///
/// Parameters: `$1` tenant, `$2` operation, `$3` key, `$4` fingerprint,
/// `$5` fresh token, `$6` now, `$7` expiry, `$8` lease expiry (NULL in
/// transactional mode), `$9` the `lock_timeout` in milliseconds as text, and
/// under the advisory strategy `$10` the advisory lock key.
///
/// - `existing` reads the key's row in the statement's snapshot. A live row
///   (unexpired, and completed, sent, or a lease still running: `status <> 0`
///   covers every settled or sent row) holds the key: the insert is skipped,
///   so a replay writes nothing, locks nothing and takes no advisory lock,
///   and the row is answered.
/// - Otherwise the insert claims the key. A concurrent uncommitted claim of
///   the same key makes it wait for that transaction; if that one commits, the
///   conflict arm locks the committed row and takes it over only if it is
///   stale (expired, or an in-progress lease whose lease ran out). A live row
///   committed after the snapshot answers neither a token nor a live row: the
///   caller reads it again in a new snapshot.
/// - Under SERIALIZABLE a read of a key nobody holds would take a predicate
///   lock on its index page and make unrelated fresh claims fail each
///   other's commits, so `inserted` tries the key first with `ON CONFLICT DO
///   NOTHING`, which locks no row and reads nothing; only if the key is held
///   does `existing` read it (the gate is a constant of the statement, so
///   the scan does not run otherwise), and `claimed` takes the row over only
///   if it is stale. A replay still locks nothing. A conflicting row committed
///   after the snapshot fails the statement with a serialisation failure,
///   which the engine retries in a new transaction.
/// - The statement bounds its own lock wait, so no round trip is spent on
///   `SET LOCAL`: `saved` keeps the caller's `lock_timeout`, `bounded` sets
///   the claim's, and `restored`, which runs after the insert finished, puts
///   the caller's back, so the caller's own writes later in the transaction
///   keep their usual lock behaviour. The CTEs that call volatile functions
///   are materialised and evaluated at most once, `saved` before `bounded`.
fn tx_claim(t: &str, strategy: ClaimStrategy) -> String {
    let (lock_cte, source) = match strategy {
        ClaimStrategy::OneWrite => return one_write_claim(t),
        ClaimStrategy::InsertOnConflict => (String::new(), "bounded"),
        ClaimStrategy::AdvisoryLock => (
            ", locked AS MATERIALIZED (SELECT pg_advisory_xact_lock($10) AS locked FROM bounded)".to_owned(),
            "locked",
        ),
    };
    format!(
        "{head}, claimed AS (\
             INSERT INTO {t} AS k ({INSERT_COLUMNS}) \
             SELECT $1, $2, $3, $4, 0, $5, $6, $7, $8 FROM {source} \
             WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE {live}) \
             AND (NOT {SERIALIZABLE} OR EXISTS (SELECT 1 FROM existing)) \
             {TAKEOVER}\
         ), restored AS MATERIALIZED (\
             SELECT set_config('lock_timeout', saved.saved, true) AS restored \
             FROM saved, (SELECT count(*) FROM claimed) AS done, (SELECT count(*) FROM inserted) AS first\
         ) \
         SELECT COALESCE(c.token, i.token), COALESCE({live}, false), \
                e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms \
         FROM restored LEFT JOIN claimed c ON true LEFT JOIN inserted i ON true LEFT JOIN existing e ON true",
        head = claim_ctes(t, &lock_cte, source),
        live = LIVE,
    )
}

/// The columns the one-write claim answers after [`CLAIM_COLUMNS`]: whether
/// it wrote nothing (the one-write path: the record inserts the row), and
/// the token of a stale row it deleted.
pub(crate) const ONE_WRITE_COLUMNS: usize = CLAIM_COLUMNS + 2;

/// The lock statement of [`ClaimStrategy::OneWrite`], sent before its claim
/// as a statement of its own, so that at READ COMMITTED the claim reads the
/// key in a snapshot taken after the lock was granted.
///
/// Parameters: `$1` tenant, `$2` operation, `$3` key, `$4` now, `$5` the
/// `lock_timeout` in milliseconds as text, `$6` the advisory lock key.
///
/// - A live row visible now (a replay) is answered without taking the lock,
///   so replays of one key never queue behind each other. Under SERIALIZABLE
///   the read is skipped (it would take a predicate lock on the key's index
///   page) and the lock is always taken.
/// - Otherwise `pg_try_advisory_xact_lock` takes the lock if it is free, and
///   `pg_advisory_xact_lock` waits for it (bounded by `$5`, then `55P03`)
///   if a twin holds it.
///
/// Answers the lock's state (0 taken at once, 1 taken after a wait, 2 not
/// taken: a live row was visible) and whether the transaction's snapshot is
/// held across statements (REPEATABLE READ, SERIALIZABLE): then a wait means
/// the claim's read may not see what the twin committed.
fn one_write_lock(t: &str) -> String {
    format!(
        "WITH live AS MATERIALIZED (\
             SELECT EXISTS (SELECT 1 FROM {t} WHERE tenant = $1 AND operation = $2 AND idem_key = $3 \
             AND expires_at_ms > $4 AND (status <> 0 OR lease_expires_at_ms > $4) AND NOT {SERIALIZABLE}) AS live\
         ), saved AS MATERIALIZED (\
             SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true) AS saved \
             FROM live WHERE NOT live.live\
         ), bounded AS MATERIALIZED (\
             SELECT set_config('lock_timeout', $5, true) AS bounded FROM saved\
         ), tried AS MATERIALIZED (\
             SELECT pg_try_advisory_xact_lock($6) AS free FROM bounded\
         ), waited AS MATERIALIZED (\
             SELECT pg_advisory_xact_lock($6) AS waited FROM tried WHERE NOT tried.free\
         ), restored AS MATERIALIZED (\
             SELECT set_config('lock_timeout', saved.saved, true) AS restored \
             FROM saved, (SELECT count(*) FROM waited) AS w\
         ) \
         SELECT (CASE WHEN live.live THEN 2 WHEN tried.free THEN 0 ELSE 1 END)::int4, \
                current_setting('transaction_isolation') <> 'read committed' \
         FROM live LEFT JOIN tried ON true, (SELECT count(*) FROM restored) AS r"
    )
}

/// The claim of [`ClaimStrategy::OneWrite`], sent after [`one_write_lock`]
/// with [`tx_claim`]'s parameters (no lock key: the lock is held already).
///
/// Below SERIALIZABLE it writes nothing on the common path: `existing`
/// reads the key's row; a stale row (expired, or an in-progress lease whose
/// lease ran out, never a sent one) is deleted by `gone`, so the record can
/// insert the completed row with one plain `INSERT` at commit. It answers
/// [`CLAIM_COLUMNS`] (the token always NULL) and then `true` and the deleted
/// row's token.
///
/// Under SERIALIZABLE a read of a key nobody holds would take a predicate
/// lock on its index page, and unrelated fresh claims would fail each
/// other's commits; so there the statement is [`tx_claim`]'s insert-first
/// claim (a placeholder row, updated by the record) and answers `false` in
/// the ninth column. Each arm is gated on the isolation level, a constant of
/// the statement, so the other arm's scans and writes do not run.
fn one_write_claim(t: &str) -> String {
    format!(
        "{head}, claimed AS (\
             INSERT INTO {t} AS k ({INSERT_COLUMNS}) \
             SELECT $1, $2, $3, $4, 0, $5, $6, $7, $8 FROM bounded \
             WHERE {SERIALIZABLE} AND NOT EXISTS (SELECT 1 FROM existing e WHERE {live}) \
             AND EXISTS (SELECT 1 FROM existing) \
             {TAKEOVER}\
         ), gone AS (\
             DELETE FROM {t} AS k WHERE tenant = $1 AND operation = $2 AND idem_key = $3 \
             AND NOT {SERIALIZABLE} AND EXISTS (SELECT 1 FROM existing e WHERE NOT ({live})) \
             AND (k.expires_at_ms <= $6 OR (k.status = 0 AND k.lease_expires_at_ms <= $6)) \
             RETURNING k.token\
         ), restored AS MATERIALIZED (\
             SELECT set_config('lock_timeout', saved.saved, true) AS restored \
             FROM saved, (SELECT count(*) FROM claimed) AS done, (SELECT count(*) FROM inserted) AS first, \
             (SELECT count(*) FROM gone) AS swept\
         ) \
         SELECT COALESCE(c.token, i.token), COALESCE({live}, false), \
                e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms, \
                NOT {SERIALIZABLE}, g.token \
         FROM restored LEFT JOIN claimed c ON true LEFT JOIN inserted i ON true LEFT JOIN existing e ON true \
         LEFT JOIN gone g ON true",
        head = claim_ctes(t, "", "bounded"),
        live = LIVE,
    )
}

/// Whether the row `e` a claim saw holds the key at `$6`: unexpired, and
/// completed, sent, or a lease still running (`status <> 0` covers every
/// settled or sent row).
const LIVE: &str = "e.expires_at_ms > $6 AND (e.status <> 0 OR e.lease_expires_at_ms > $6)";

/// The CTEs both transactional claims open with ([`tx_claim`],
/// [`one_write_claim`]): `saved` and `bounded` (the claim's own lock wait),
/// then `lock_cte` (empty, or a lock taken from `bounded`), `inserted` (the
/// insert-first try under SERIALIZABLE, selected from `source`, `bounded`
/// or the lock) and `existing` (the key's row in the statement's snapshot).
fn claim_ctes(t: &str, lock_cte: &str, source: &str) -> String {
    format!(
        "WITH saved AS MATERIALIZED (\
             SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true) AS saved\
         ), bounded AS MATERIALIZED (\
             SELECT set_config('lock_timeout', $9, true) AS bounded FROM saved\
         ){lock_cte}, inserted AS (\
             INSERT INTO {t} AS k ({INSERT_COLUMNS}) \
             SELECT $1, $2, $3, $4, 0, $5, $6, $7, $8 FROM {source} WHERE {SERIALIZABLE} \
             ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING k.token\
         ), existing AS MATERIALIZED (\
             SELECT {ROW_COLUMNS} FROM {t} WHERE tenant = $1 AND operation = $2 AND idem_key = $3 \
             AND (NOT {SERIALIZABLE} OR NOT EXISTS (SELECT 1 FROM inserted))\
         )"
    )
}

/// The columns both claims insert.
const INSERT_COLUMNS: &str =
    "tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms";

/// Whether the transaction is SERIALIZABLE (a constant of the statement, so
/// the planner gates a scan on it without running the scan).
const SERIALIZABLE: &str = "(current_setting('transaction_isolation') = 'serializable')";

/// The lease-mode claim upsert, committed on its own.
///
/// Parameters as [`tx_claim`]'s first nine. Answers the token if it claimed
/// the key, nothing otherwise.
fn lease_claim(t: &str) -> String {
    format!(
        "WITH saved AS (\
             SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true) AS saved\
         ), bounded AS (\
             SELECT set_config('lock_timeout', $9, true) AS bounded FROM saved\
         ) \
         INSERT INTO {t} AS k (tenant, operation, idem_key, fingerprint, status, token, \
                               created_at_ms, expires_at_ms, lease_expires_at_ms) \
         SELECT $1, $2, $3, $4, 0, $5, $6, $7, $8 FROM bounded \
         {TAKEOVER}"
    )
}

/// A name derived from the table's, such as `{table}_schema`. If it would
/// exceed PostgreSQL's identifier limit (and be silently truncated, possibly
/// onto another table's derived name), the table part is shortened and a
/// hash of the full table name keeps it unique.
pub(crate) fn derived_name(table: &TableName, suffix: &str) -> String {
    let t = table.as_str();
    let plain = format!("{t}_{suffix}");
    if plain.len() <= MAX_IDENTIFIER_LEN {
        return plain;
    }
    let hash = format!("{:016x}", fnv1a(&[t.as_bytes()]));
    let keep = MAX_IDENTIFIER_LEN - suffix.len() - hash.len() - 2;
    // Table names are ASCII, so any byte index is a character boundary.
    format!("{}_{hash}_{suffix}", &t[..keep])
}

/// A 64-bit FNV-1a hash over length-prefixed parts: stable across processes,
/// platforms and compiler versions (advisory lock keys must agree between
/// every process that uses the table), and no two different sequences of
/// parts are hashed from the same bytes.
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for part in parts {
        let len = (part.len() as u64).to_le_bytes();
        for byte in len.iter().chain(part.iter()) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_names_fit_postgres_identifiers() {
        let short = TableName::new("idem_keys").unwrap();
        assert_eq!(derived_name(&short, "schema"), "idem_keys_schema");
        let a = TableName::new(format!("{}a", "x".repeat(62))).unwrap();
        let b = TableName::new(format!("{}b", "x".repeat(62))).unwrap();
        let (na, nb) = (derived_name(&a, "schema"), derived_name(&b, "schema"));
        assert!(na.len() <= MAX_IDENTIFIER_LEN && nb.len() <= MAX_IDENTIFIER_LEN);
        assert_ne!(
            na, nb,
            "long names that share a prefix still get distinct derived names"
        );
        assert!(TableName::new(na).is_ok());
    }

    #[test]
    fn fnv1a_is_stable_and_length_prefixed() {
        // Known values pin the hash: every process, whatever it was built
        // with, must compute the same advisory lock keys.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[b"idem"]), 0xc433_1a86_8445_cdea);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
