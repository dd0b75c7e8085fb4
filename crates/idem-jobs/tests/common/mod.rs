//! What the jobs tests share: the servers, the stores they open, and the
//! three engines a suite runs on.

#![allow(dead_code, unreachable_pub)]

// Not every test binary that includes this module uses each one.
#[allow(unused_imports)]
pub use idem_conformance::env::{mysql_url, postgres_url};
use idem_core::{Error, StoreErrorKind, TableName};

/// A short unique tag for the tables and files of one test.
pub fn tag() -> String {
    let t = uuid::Uuid::now_v7().simple().to_string();
    t[t.len() - 12..].to_owned()
}

/// A pool on `url`, or a failure saying how to point the tests at
/// `server` (with `var`).
async fn connect<DB: sqlx::Database>(url: &str, server: &str, var: &str) -> sqlx::Pool<DB> {
    sqlx::Pool::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {server} at {url} (set {var}): {e}"))
}

pub async fn open_postgres(_tag: &str, table: TableName) -> (idem_postgres::PgStore, sqlx::PgPool) {
    let pool = connect(&postgres_url(), "PostgreSQL", "IDEM_TEST_POSTGRES_URL").await;
    (idem_postgres::PgStore::new(pool.clone()).with_table(table), pool)
}

pub async fn open_mysql(_tag: &str, table: TableName) -> (idem_mysql::MySqlStore, sqlx::MySqlPool) {
    let pool = connect(&mysql_url(), "MariaDB", "IDEM_TEST_MYSQL_URL").await;
    (idem_mysql::MySqlStore::new(pool.clone()).with_table(table), pool)
}

/// A SQLite store on a file of `tag`'s own (every instance of one test
/// opens the same file).
pub async fn open_sqlite(tag: &str, table: TableName) -> (idem_sqlite::SqliteStore, sqlx::SqlitePool) {
    let path = std::env::temp_dir().join(format!("idem-jobs-{tag}.db"));
    let store = idem_sqlite::SqliteStore::open(&path)
        .await
        .expect("open")
        .with_table(table);
    let pool = store.pool().clone();
    (store, pool)
}

/// One run's writes in its transaction: `run_id` added to the effects
/// table by `insert` (the engine's statement, its table named), then, when
/// `fail`, a failure midway that rolls them back with the claim.
pub async fn insert_run<C>(conn: &mut C, insert: String, run_id: &str, fail: bool) -> Result<(), Error>
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    <C::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<C::Database>,
    for<'q> &'q str: sqlx::Encode<'q, C::Database> + sqlx::Type<C::Database>,
{
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(run_id)
        .execute(conn)
        .await
        .map_err(|e| Error::store(StoreErrorKind::Other, e))?;
    if fail {
        return Err(Error::store(StoreErrorKind::Unavailable, "the run failed midway"));
    }
    Ok(())
}

/// Runs `$suite!` on PostgreSQL, MariaDB and SQLite, each with its store,
/// pool, opener and the SQL of an effects table (create, insert a run id,
/// count a run id's rows).
macro_rules! on_every_engine {
    ($suite:ident) => {
        $suite!(
            postgres,
            idem_postgres::PgStore,
            sqlx::PgPool,
            common::open_postgres,
            "CREATE TABLE {} (run_id TEXT NOT NULL)",
            "INSERT INTO {} (run_id) VALUES ($1)",
            "SELECT COUNT(*) FROM {} WHERE run_id = $1"
        );

        $suite!(
            mysql,
            idem_mysql::MySqlStore,
            sqlx::MySqlPool,
            common::open_mysql,
            "CREATE TABLE {} (run_id VARCHAR(100) NOT NULL)",
            "INSERT INTO {} (run_id) VALUES (?)",
            "SELECT COUNT(*) FROM {} WHERE run_id = ?"
        );

        $suite!(
            sqlite,
            idem_sqlite::SqliteStore,
            sqlx::SqlitePool,
            common::open_sqlite,
            "CREATE TABLE {} (run_id TEXT NOT NULL)",
            "INSERT INTO {} (run_id) VALUES (?1)",
            "SELECT COUNT(*) FROM {} WHERE run_id = ?1"
        );
    };
}
