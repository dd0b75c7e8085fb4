//! The conformance suite against MariaDB or MySQL.
//!
//! The server comes from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`); an unreachable server fails every
//! test with a message naming the URL, it never skips them.

mod common;

use common::{EFFECTS_TABLE, connect, isolated_store, shared_store};
use idem_conformance::{Subject, lease_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture};
use idem_mysql::{MySqlStore, MySqlTx};

/// A store under test: a keys table reached through one small pool.
#[derive(Clone)]
struct MySqlSubject {
    store: MySqlStore,
}

impl MySqlSubject {
    async fn shared() -> Self {
        Self {
            store: shared_store(connect().await).await,
        }
    }
}

impl Subject for MySqlSubject {
    type Backend = MySqlStore;
    type Lease = MySqlStore;
    type Sweeper = MySqlStore;

    fn backend(&self) -> MySqlStore {
        self.store.clone()
    }

    fn lease_store(&self) -> MySqlStore {
        self.store.clone()
    }

    fn sweeper(&self) -> MySqlStore {
        self.store.clone()
    }

    fn write_effect<'c>(tx: &'c mut MySqlTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {EFFECTS_TABLE} (effect_id) VALUES (?)"
            )))
            .bind(effect_id)
            .execute(&mut **tx)
            .await?;
            Ok(())
        })
    }

    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM {EFFECTS_TABLE} WHERE effect_id = ?"
            )))
            .bind(effect_id)
            .fetch_one(self.store.pool())
            .await?;
            Ok(u64::try_from(n)?)
        })
    }

    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            Self {
                store: MySqlStore::new(connect().await).with_table(self.store.table().clone()),
            }
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            Self {
                store: isolated_store(self.store.pool().clone()).await,
            }
        })
    }
}

tx_conformance!(mysql_tx, MySqlSubject::shared());
lease_conformance!(mysql_lease, MySqlSubject::shared());
