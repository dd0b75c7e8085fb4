//! The inbox on PostgreSQL, MariaDB and SQLite: a redelivered event is a
//! no-op, two handlers of one event each apply it once, concurrent
//! redeliveries apply once, and an id reused with another payload is refused.

use idem_conformance::env::{mysql_url, postgres_url};
use idem_core::{Error, TableName, TxEngine};
use idem_inbox::{Delivery, Inbox};

/// Unique table names for one test.
fn tables() -> (TableName, String) {
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let tag = &tag[tag.len() - 12..];
    (
        TableName::new(format!("idem_inbox_{tag}")).expect("a valid table name"),
        format!("inbox_effects_{tag}"),
    )
}

macro_rules! inbox_suite {
    ($engine:ident, $store:ty, $open:expr, $create:literal, $insert:literal, $count:literal) => {
        mod $engine {
            use super::*;

            struct Subject {
                inbox: Inbox<$store>,
                pool: <$store as Pool>::Pool,
                effects: String,
            }

            async fn subject() -> Subject {
                let (inbox_table, effects) = tables();
                let (store, pool): ($store, _) = $open(inbox_table).await;
                store.migrate().await.expect("migrate the inbox table");
                sqlx::query(sqlx::AssertSqlSafe(format!($create, effects)))
                    .execute(&pool)
                    .await
                    .expect("create the effects table");
                Subject {
                    inbox: Inbox::new(TxEngine::new(store)),
                    pool,
                    effects,
                }
            }

            impl Subject {
                async fn deliver(
                    &self,
                    handler: &str,
                    event_id: &str,
                    payload: &str,
                ) -> Result<Delivery<String>, Error> {
                    let insert = format!($insert, self.effects);
                    let (handler_name, event) = (handler.to_owned(), event_id.to_owned());
                    self.inbox
                        .process(handler, event_id, payload.as_bytes(), move |tx| {
                            let (insert, handler_name, event) = (insert.clone(), handler_name.clone(), event.clone());
                            Box::pin(async move {
                                sqlx::query(sqlx::AssertSqlSafe(insert))
                                    .bind(&handler_name)
                                    .bind(&event)
                                    .execute(&mut **tx)
                                    .await
                                    .map_err(|e| Error::store(idem_core::StoreErrorKind::Other, e))?;
                                Ok::<_, Error>(format!("{handler_name} applied {event}"))
                            })
                        })
                        .await
                }

                async fn effects(&self, handler: &str, event_id: &str) -> i64 {
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, self.effects)))
                        .bind(handler)
                        .bind(event_id)
                        .fetch_one(&self.pool)
                        .await
                        .expect("count effects")
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn redelivery_is_a_no_op() {
                let s = subject().await;
                let first = s.deliver("projection", "evt-1", r#"{"amount":5}"#).await.unwrap();
                assert_eq!(first, Delivery::Applied("projection applied evt-1".into()));
                for _ in 0..3 {
                    let again = s.deliver("projection", "evt-1", r#"{"amount":5}"#).await.unwrap();
                    assert_eq!(again, Delivery::Duplicate("projection applied evt-1".into()));
                }
                assert_eq!(s.effects("projection", "evt-1").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn two_handlers_each_apply_once() {
                let s = subject().await;
                for handler in ["projection", "notifier"] {
                    for _ in 0..2 {
                        s.deliver(handler, "evt-2", "{}").await.unwrap();
                    }
                    assert_eq!(s.effects(handler, "evt-2").await, 1, "{handler}");
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_redeliveries_apply_once() {
                let s = std::sync::Arc::new(subject().await);
                let deliveries = (0..16).map(|_| {
                    let s = s.clone();
                    tokio::spawn(async move { s.deliver("projection", "evt-3", "{}").await })
                });
                let mut applied = 0;
                for d in deliveries {
                    if d.await.unwrap().unwrap().is_applied() {
                        applied += 1;
                    }
                }
                assert_eq!(applied, 1, "one delivery ran the handler");
                assert_eq!(s.effects("projection", "evt-3").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn an_id_reused_with_another_payload_is_refused() {
                let s = subject().await;
                s.deliver("projection", "evt-4", r#"{"amount":5}"#).await.unwrap();
                let other = s.deliver("projection", "evt-4", r#"{"amount":6}"#).await;
                assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
                assert_eq!(s.effects("projection", "evt-4").await, 1);
            }
        }
    };
}

/// The pool type of each store's tests.
trait Pool {
    type Pool;
}
impl Pool for idem_postgres::PgStore {
    type Pool = sqlx::PgPool;
}
impl Pool for idem_mysql::MySqlStore {
    type Pool = sqlx::MySqlPool;
}
impl Pool for idem_sqlite::SqliteStore {
    type Pool = sqlx::SqlitePool;
}

/// A pool on `url`, or a failure saying how to point the tests at
/// `server` (with `var`).
async fn connect<DB: sqlx::Database>(url: &str, server: &str, var: &str) -> sqlx::Pool<DB> {
    sqlx::Pool::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {server} at {url} (set {var}): {e}"))
}

async fn open_postgres(table: TableName) -> (idem_postgres::PgStore, sqlx::PgPool) {
    let pool = connect(&postgres_url(), "PostgreSQL", "IDEM_TEST_POSTGRES_URL").await;
    (idem_postgres::PgStore::new(pool.clone()).with_table(table), pool)
}

async fn open_mysql(table: TableName) -> (idem_mysql::MySqlStore, sqlx::MySqlPool) {
    let pool = connect(&mysql_url(), "MariaDB", "IDEM_TEST_MYSQL_URL").await;
    (idem_mysql::MySqlStore::new(pool.clone()).with_table(table), pool)
}

async fn open_sqlite(table: TableName) -> (idem_sqlite::SqliteStore, sqlx::SqlitePool) {
    let path = std::env::temp_dir().join(format!("idem-inbox-{}.db", uuid::Uuid::now_v7()));
    let store = idem_sqlite::SqliteStore::open(&path)
        .await
        .expect("open the SQLite file")
        .with_table(table);
    let pool = store.pool().clone();
    (store, pool)
}

inbox_suite!(
    postgres,
    idem_postgres::PgStore,
    open_postgres,
    "CREATE TABLE {} (handler TEXT NOT NULL, event_id TEXT NOT NULL)",
    "INSERT INTO {} (handler, event_id) VALUES ($1, $2)",
    "SELECT COUNT(*) FROM {} WHERE handler = $1 AND event_id = $2"
);

inbox_suite!(
    mysql,
    idem_mysql::MySqlStore,
    open_mysql,
    "CREATE TABLE {} (handler VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL)",
    "INSERT INTO {} (handler, event_id) VALUES (?, ?)",
    "SELECT COUNT(*) FROM {} WHERE handler = ? AND event_id = ?"
);

inbox_suite!(
    sqlite,
    idem_sqlite::SqliteStore,
    open_sqlite,
    "CREATE TABLE {} (handler TEXT NOT NULL, event_id TEXT NOT NULL)",
    "INSERT INTO {} (handler, event_id) VALUES (?1, ?2)",
    "SELECT COUNT(*) FROM {} WHERE handler = ?1 AND event_id = ?2"
);
