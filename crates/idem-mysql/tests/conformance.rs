//! The conformance suite against MariaDB or MySQL, in transactional mode on
//! connections that default to each isolation level under each claim
//! strategy, and in lease mode.
//!
//! The server comes from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`); an unreachable server fails every
//! test with a message naming the URL, it never skips them.

mod common;

use common::{EFFECTS_TABLE, Isolation, connect_at, isolated_store, shared_store_on};
use idem_conformance::{Subject, admin_conformance, lease_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture};
use idem_mysql::{ClaimStrategy, MySqlStore, MySqlTx};

/// A store under test: a keys table reached through one small pool.
#[derive(Clone)]
struct MySqlSubject {
    store: MySqlStore,
    isolation: Isolation,
}

impl MySqlSubject {
    /// A subject whose connections default to `isolation`, on a keys table
    /// of its own, so that the modules of each level never share keys.
    async fn shared(isolation: Isolation, table: &str) -> Self {
        Self::shared_with(ClaimStrategy::Placeholder, isolation, table).await
    }

    /// The same with the claim strategy `strategy`.
    async fn shared_with(strategy: ClaimStrategy, isolation: Isolation, table: &str) -> Self {
        Self {
            store: shared_store_on(connect_at(isolation).await, table)
                .await
                .with_claim_strategy(strategy),
            isolation,
        }
    }
}

impl Subject for MySqlSubject {
    idem_conformance::one_store_subject!(MySqlStore);

    fn write_effect<'c>(tx: &'c mut MySqlTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {EFFECTS_TABLE} (effect_id) VALUES (?)"
            )))
            .bind(effect_id)
            .execute(&mut **tx)
            .await
            .map_err(idem_mysql::store_error)?;
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
                store: MySqlStore::new(connect_at(self.isolation).await)
                    .with_table(self.store.table().clone())
                    .with_claim_strategy(self.store.claim_strategy()),
                isolation: self.isolation,
            }
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            Self {
                store: isolated_store(self.store.pool().clone())
                    .await
                    .with_claim_strategy(self.store.claim_strategy()),
                isolation: self.isolation,
            }
        })
    }
}

tx_conformance!(
    mysql_tx,
    MySqlSubject::shared(Isolation::RepeatableRead, "idem_conformance_keys")
);
tx_conformance!(
    mysql_tx_read_committed,
    MySqlSubject::shared(Isolation::ReadCommitted, "idem_conformance_keys_rc")
);
tx_conformance!(
    mysql_tx_serializable,
    MySqlSubject::shared(Isolation::Serializable, "idem_conformance_keys_ser")
);
tx_conformance!(
    mysql_tx_named_lock,
    MySqlSubject::shared_with(
        ClaimStrategy::NamedLock,
        Isolation::RepeatableRead,
        "idem_conformance_keys_nl"
    )
);
tx_conformance!(
    mysql_tx_named_lock_read_committed,
    MySqlSubject::shared_with(
        ClaimStrategy::NamedLock,
        Isolation::ReadCommitted,
        "idem_conformance_keys_nl_rc"
    )
);
tx_conformance!(
    mysql_tx_named_lock_serializable,
    MySqlSubject::shared_with(
        ClaimStrategy::NamedLock,
        Isolation::Serializable,
        "idem_conformance_keys_nl_ser"
    )
);
lease_conformance!(
    mysql_lease_named_lock,
    MySqlSubject::shared_with(
        ClaimStrategy::NamedLock,
        Isolation::RepeatableRead,
        "idem_conformance_keys_nl"
    )
);
lease_conformance!(
    mysql_lease,
    MySqlSubject::shared(Isolation::RepeatableRead, "idem_conformance_keys")
);
admin_conformance!(
    mysql_admin,
    MySqlSubject::shared(Isolation::RepeatableRead, "idem_conformance_keys")
);
