//! Connecting the tests to the local MariaDB (or MySQL) server.

#![allow(dead_code, unreachable_pub)]

use idem_core::TableName;
use idem_mysql::MySqlStore;
use sqlx::MySqlPool;
use sqlx::mysql::MySqlPoolOptions;

/// The variable that names the test server.
pub const URL_VAR: &str = "IDEM_TEST_MYSQL_URL";
/// The keys table every conformance test shares; tests use unique scopes,
/// so they never see each other's keys.
pub const SHARED_TABLE: &str = "idem_conformance_keys";
/// The caller's business rows. It has no unique constraint, so a double
/// write would be counted rather than refused.
pub const EFFECTS_TABLE: &str = "idem_conformance_effects";
/// Isolated keys tables are named with this prefix and a random suffix.
pub const ISOLATED_PREFIX: &str = "idem_iso_";

/// The test server's URL.
pub fn url() -> String {
    idem_conformance::env::mysql_url()
}

/// A small pool of its own: sqlx pools belong to the runtime that created
/// them, and every `#[tokio::test]` has its own runtime.
pub async fn connect() -> MySqlPool {
    connect_at(Isolation::RepeatableRead).await
}

/// A default transaction isolation level, set on every connection of a pool
/// as a team would set it for its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Statement-level snapshots.
    ReadCommitted,
    /// InnoDB's default.
    RepeatableRead,
    /// Every plain read takes shared locks.
    Serializable,
}

impl Isolation {
    /// The SQL name of the level.
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A small pool whose connections default to `isolation`
/// (`SET SESSION TRANSACTION ISOLATION LEVEL …`).
pub async fn connect_at(isolation: Isolation) -> MySqlPool {
    let url = url();
    let set = format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", isolation.sql());
    let options = MySqlPoolOptions::new()
        .max_connections(8)
        .after_connect(move |conn, _meta| {
            let set = set.clone();
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, sqlx::AssertSqlSafe(set)).await?;
                Ok(())
            })
        });
    match options.connect(&url).await {
        Ok(pool) => pool,
        Err(e) => {
            panic!("cannot reach the MySQL/MariaDB test server at {url} ({e}); start it, or point {URL_VAR} at one")
        }
    }
}

/// The store on the shared keys table, migrated, with the effects table in
/// place.
pub async fn shared_store(pool: MySqlPool) -> MySqlStore {
    shared_store_on(pool, SHARED_TABLE).await
}

/// The store on the keys table `table` (shared by the tests of one module),
/// migrated, with the effects table in place.
pub async fn shared_store_on(pool: MySqlPool, table: &str) -> MySqlStore {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
            effect_id VARCHAR(255) NOT NULL,
            KEY effect_id_idx (effect_id)
        ) ENGINE=InnoDB"
    )))
    .execute(&pool)
    .await
    .expect("create the effects table");
    let store = MySqlStore::new(pool).with_table(TableName::new(table).unwrap());
    store.migrate().await.expect("migrate the shared keys table");
    store
}

/// A store on a fresh, migrated keys table of its own.
pub async fn isolated_store(pool: MySqlPool) -> MySqlStore {
    drop_old_isolated_tables(&pool).await;
    let name = format!("{ISOLATED_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let store = MySqlStore::new(pool).with_table(TableName::new(name).unwrap());
    store.migrate().await.expect("migrate an isolated keys table");
    store
}

/// Isolated tables are left behind by finished tests; the ones older than
/// an hour cannot belong to a test that is still running, so they are
/// dropped to keep the database tidy.
async fn drop_old_isolated_tables(pool: &MySqlPool) {
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name LIKE 'idem\\_iso\\_%'
         AND create_time < NOW() - INTERVAL 1 HOUR",
    )
    .fetch_all(pool)
    .await
    .expect("list old isolated tables");
    for table in old {
        // The names come from the server's catalogue and match the prefix
        // above, so quoting them with backticks is enough.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{table}`")))
            .execute(pool)
            .await
            .expect("drop an old isolated table");
    }
}

/// The wall clock in milliseconds, as the stores read it.
pub fn now_ms() -> i64 {
    idem_core::Clock::now_ms(&idem_core::SystemClock)
}

/// A transactional claim request for `call` at `now`: a key kept a minute,
/// a fresh token, no lease.
pub fn request_at(call: &idem_core::Call, now: i64) -> idem_core::ClaimRequest<'_> {
    idem_core::ClaimRequest {
        scope: call.scope(),
        key: call.key(),
        fingerprint: call.fingerprint(),
        now_ms: now,
        expires_at_ms: now + 60_000,
        fresh_token: idem_core::Token::fresh(now),
        lease_expires_at_ms: None,
    }
}

/// Writes the business row `id` on `conn` (a claimed transaction's, or a
/// transaction nested in it).
pub async fn write_effect(conn: &mut sqlx::MySqlConnection, id: &str) {
    try_write_effect(conn, id).await.unwrap();
}

/// Writes the business row `id` on `conn`, or says why not.
pub async fn try_write_effect(conn: &mut sqlx::MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {EFFECTS_TABLE} (effect_id) VALUES (?)"
    )))
    .bind(id)
    .execute(conn)
    .await
    .map(drop)
}

/// How many committed business rows are named `id`.
pub async fn effects(pool: &MySqlPool, id: &str) -> i64 {
    try_effects(pool, id).await.unwrap()
}

/// How many committed business rows are named `id`, or why they could
/// not be counted.
pub async fn try_effects(pool: &MySqlPool, id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {EFFECTS_TABLE} WHERE effect_id = ?"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
}

/// A pool of one connection to the test server through a
/// [`HoldingProxy`](idem_conformance::wire::HoldingProxy) that holds the
/// answer to a flight containing `needle` while armed.
pub async fn one_connection_through_proxy(needle: &'static [u8]) -> (idem_conformance::wire::HoldingProxy, MySqlPool) {
    let options: sqlx::mysql::MySqlConnectOptions = url().parse().expect("a MySQL URL");
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = idem_conformance::wire::HoldingProxy::start(upstream, needle).await;
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(
            options
                .host(&proxy.addr().ip().to_string())
                .port(proxy.addr().port())
                // In clear text, so the proxy sees each statement.
                .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled),
        )
        .await
        .expect("a pool through the proxy");
    (proxy, pool)
}
