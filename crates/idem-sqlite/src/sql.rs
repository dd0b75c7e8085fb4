//! The SQL of the store: the versioned schema migrations and the statements,
//! rendered once per table name.
//!
//! Table names are spliced into the text, which is safe because a
//! [`TableName`] only ever holds `[A-Za-z_][A-Za-z0-9_]*`; they are also
//! quoted so that a name which happens to be an SQL keyword still works.

use std::sync::Arc;

use idem_core::{STATUS_COMPLETED, STATUS_IN_PROGRESS, STATUS_REJECTED, STATUS_SENT, STATUS_UNKNOWN, TableName};
use idem_sql::KeyMigration;

/// Every migration, in order. A new schema version is appended here and
/// never edits an earlier entry, because databases in the field have
/// already run those.
pub(crate) const MIGRATIONS: &[KeyMigration] = &[
    KeyMigration {
        version: 1,
        description: "keys table and expiry index",
        statements: v1_keys_table,
    },
    KeyMigration {
        version: 2,
        description: "status 3: unknown outcomes",
        statements: v2_unknown_status,
    },
    KeyMigration {
        version: 3,
        description: "status 4 and sent_at_ms: sent claims",
        statements: v3_sent_status,
    },
];

/// Version 1: the keys table and the index the sweeper scans.
///
/// The table is an ordinary rowid table rather than `WITHOUT ROWID`: SQLite
/// recommends `WITHOUT ROWID` only for rows smaller than about a twentieth
/// of a page, and a row here carries a recorded response (often kilobytes,
/// up to the policy's record limit), which would spill the primary-key
/// b-tree into overflow pages. The rowid also gives the sweeper a cheap
/// handle on the rows it deletes. Measured on this schema (claim, record and
/// commit, then replay, 3,000 keys, release build), the rowid table was as
/// fast with empty payloads and about a third faster with 2 KiB payloads,
/// and its sweep several times faster. `STRICT` makes SQLite refuse values
/// of the wrong type instead of silently storing them.
fn v1_keys_table(t: &str) -> Vec<String> {
    vec![
        keys_table(t, &[STATUS_IN_PROGRESS, STATUS_COMPLETED, STATUS_REJECTED], Added::None),
        expiry_index(t),
    ]
}

/// Version 2: status 3 (an unknown outcome) is allowed. SQLite cannot
/// change a check constraint in place: the table is rebuilt under the
/// migration's write lock, rows and index included.
fn v2_unknown_status(t: &str) -> Vec<String> {
    rebuilt(
        t,
        "v2",
        &[STATUS_IN_PROGRESS, STATUS_COMPLETED, STATUS_REJECTED, STATUS_UNKNOWN],
        Added::None,
    )
}

/// Version 3: status 4 (a lease-mode claim marked sent) is allowed, and
/// `sent_at_ms` keeps the earliest time its holder marked it. As for
/// version 2, the check constraint needs the table rebuilt under the
/// migration's write lock, rows and index included; the rows copied have
/// never been marked, so their `sent_at_ms` is NULL.
fn v3_sent_status(t: &str) -> Vec<String> {
    rebuilt(
        t,
        "v3",
        &[
            STATUS_IN_PROGRESS,
            STATUS_COMPLETED,
            STATUS_REJECTED,
            STATUS_UNKNOWN,
            STATUS_SENT,
        ],
        Added::SentAtMs,
    )
}

/// The columns a version adds to the keys table after `lease_expires_at_ms`.
#[derive(Clone, Copy)]
enum Added {
    /// None: the columns of version 1.
    None,
    /// `sent_at_ms` (version 3), NULL in the rows copied from before.
    SentAtMs,
}

/// The `CREATE TABLE` of a keys table named `name` whose status is one of
/// `statuses`, with the columns `added`.
fn keys_table(name: &str, statuses: &[i16], added: Added) -> String {
    let statuses = statuses.iter().map(i16::to_string).collect::<Vec<_>>().join(", ");
    let added = match added {
        Added::None => "",
        Added::SentAtMs => "\n    sent_at_ms INTEGER,",
    };
    format!(
        r#"CREATE TABLE "{name}" (
    tenant TEXT NOT NULL,
    operation TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    fingerprint BLOB NOT NULL CHECK (length(fingerprint) = 32),
    status INTEGER NOT NULL CHECK (status IN ({statuses})),
    token INTEGER NOT NULL,
    payload BLOB,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    lease_expires_at_ms INTEGER,{added}
    PRIMARY KEY (tenant, operation, idem_key)
) STRICT"#
    )
}

/// The index the sweeper scans, on the keys table `t`.
fn expiry_index(t: &str) -> String {
    format!(r#"CREATE INDEX "{t}_expires_at_ms_idx" ON "{t}" (expires_at_ms)"#)
}

/// The keys table `t` rebuilt at `version`, as SQLite changes a check
/// constraint: a new table `{t}_{version}` whose status is one of
/// `statuses`, with the columns `added`, gets every row (the columns added
/// NULL), the old table is dropped, the new one takes its name, and its
/// index is made again.
fn rebuilt(t: &str, version: &str, statuses: &[i16], added: Added) -> Vec<String> {
    let (columns, values) = match added {
        Added::None => ("", ""),
        Added::SentAtMs => (", sent_at_ms", ", NULL"),
    };
    vec![
        keys_table(&format!("{t}_{version}"), statuses, added),
        format!(
            r#"INSERT INTO "{t}_{version}" (tenant, operation, idem_key, fingerprint, status, token, payload,
    created_at_ms, expires_at_ms, lease_expires_at_ms{columns})
SELECT tenant, operation, idem_key, fingerprint, status, token, payload,
    created_at_ms, expires_at_ms, lease_expires_at_ms{values} FROM "{t}""#
        ),
        format!(r#"DROP TABLE "{t}""#),
        format!(r#"ALTER TABLE "{t}_{version}" RENAME TO "{t}""#),
        expiry_index(t),
    ]
}

/// The statements of one keys table, rendered once and shared by clones of
/// the store (an `Arc<str>` is what sqlx accepts without copying).
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) create_schema_table: Arc<str>,
    pub(crate) schema_version: Arc<str>,
    pub(crate) insert_schema_version: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) claim_read: Arc<str>,
    pub(crate) record: Arc<str>,
}

/// Whether the key's row in table `t` is stale at the time bound to the
/// parameter `now` (such as `?4`): expired, or an in-progress lease that ran
/// out. A claim may take over a stale row; any other row answers the claim.
/// A sent claim (status 4) is stale only once the key expires: its lease's
/// end makes it an unknown outcome, never a row to take over.
fn stale(t: &str, now: &str) -> String {
    format!(
        r#"("{t}".expires_at_ms <= {now} OR ("{t}".status = {STATUS_IN_PROGRESS} AND "{t}".lease_expires_at_ms <= {now}))"#
    )
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Self {
        let t = table.as_str();
        let key = "tenant = ?1 AND operation = ?2 AND idem_key = ?3";
        let stale_at_4 = stale(t, "?4");
        let stale_at_6 = stale(t, "?6");
        let stale_at_8 = stale(t, "?8");
        Self {
            create_schema_table: format!(
                r#"CREATE TABLE IF NOT EXISTS "{t}_schema" (
    version INTEGER PRIMARY KEY NOT NULL,
    description TEXT NOT NULL,
    applied_at_ms INTEGER NOT NULL
) STRICT"#
            )
            .into(),
            schema_version: format!(r#"SELECT COALESCE(MAX(version), 0) FROM "{t}_schema""#).into(),
            insert_schema_version: format!(
                r#"INSERT INTO "{t}_schema" (version, description, applied_at_ms) VALUES (?1, ?2, ?3)"#
            )
            .into(),
            // The lease-mode claim: one statement claims a free key, takes
            // over a stale one, or does nothing. ?6 is the engine's
            // `now_ms`. A takeover's token is the larger of the fresh token
            // and the old one plus one (the CASE keeps that addition from
            // overflowing into a REAL). A takeover starts a new claim, so
            // the old row's sent mark (`sent_at_ms`) goes with it.
            claim: format!(
                r#"INSERT INTO "{t}" (tenant, operation, idem_key, fingerprint, status, token, payload,
    created_at_ms, expires_at_ms, lease_expires_at_ms)
VALUES (?1, ?2, ?3, ?4, {STATUS_IN_PROGRESS}, ?5, NULL, ?6, ?7, ?8)
ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    status = {STATUS_IN_PROGRESS},
    token = max(CASE WHEN "{t}".token < 9223372036854775807 THEN "{t}".token + 1 ELSE "{t}".token END, excluded.token),
    payload = NULL,
    created_at_ms = excluded.created_at_ms,
    expires_at_ms = excluded.expires_at_ms,
    lease_expires_at_ms = excluded.lease_expires_at_ms,
    sent_at_ms = NULL
WHERE {stale_at_6}
RETURNING token"#
            )
            .into(),
            // The transactional claim reads the key's row and writes
            // nothing: ?4 is the engine's `now_ms`, and the last column says
            // whether the row is stale (expired, or a lease that ran out),
            // so that the claim may take it over.
            claim_read: format!(
                r#"SELECT fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms,
    CASE WHEN {stale_at_4} THEN 1 ELSE 0 END
FROM "{t}" WHERE {key}"#
            )
            .into(),
            // The transactional record writes the completed row in one
            // statement: an insert where the claim found no row, or, where
            // it found a stale one, the replacement of that row, matched by
            // its token (?10) and staleness (?8 is the claim's `now_ms`).
            // Where the claim found no row ?10 is NULL, which matches no
            // row: a row the insert meets was written inside the claiming
            // transaction, and the record changes nothing. A replaced row's
            // sent mark belonged to an earlier claim and is cleared.
            record: format!(
                r#"INSERT INTO "{t}" (tenant, operation, idem_key, fingerprint, status, token, payload,
    created_at_ms, expires_at_ms, lease_expires_at_ms)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, NULL)
ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    status = excluded.status,
    token = excluded.token,
    payload = excluded.payload,
    created_at_ms = excluded.created_at_ms,
    expires_at_ms = excluded.expires_at_ms,
    lease_expires_at_ms = NULL,
    sent_at_ms = NULL
WHERE "{t}".token = ?10 AND {stale_at_8}"#
            )
            .into(),
        }
    }
}

/// Deletes at most `?2` rows expired at `?1`: the oldest first, through the
/// expiry index; the subquery bounds the batch because SQLite's
/// `DELETE … LIMIT` needs a compile-time option the bundled library lacks.
pub(crate) fn sweep(table: &TableName) -> String {
    format!(
        r#"DELETE FROM "{table}" WHERE rowid IN (
    SELECT rowid FROM "{table}" WHERE expires_at_ms <= ?1 ORDER BY expires_at_ms LIMIT ?2
)"#
    )
}
