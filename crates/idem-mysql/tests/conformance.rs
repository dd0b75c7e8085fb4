//! The conformance suite against MariaDB or MySQL, in transactional mode on
//! connections that default to each isolation level under each claim
//! strategy, and in lease mode.
//!
//! The server comes from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`); an unreachable server fails every
//! test with a message naming the URL, it never skips them.

mod common;

use common::{Isolation, connect_at, isolated_store, shared_store_on, try_effects, try_write_effect};
use idem_conformance::multistep_tests::MultiStepSubject;
use idem_conformance::{Subject, admin_conformance, lease_conformance, multistep_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture, TableName};
use idem_mysql::{ClaimStrategy, MySqlMultiSteps, MySqlStore, MySqlTx};

/// A store under test: a keys table reached through one small pool.
#[derive(Clone)]
struct MySqlSubject {
    store: MySqlStore,
    isolation: Isolation,
}

impl MySqlSubject {
    /// A subject claiming with `strategy`, whose connections default to
    /// `isolation`, on the keys table `table`: each module has a table of
    /// its own unless it runs on the same settings as another, so that the
    /// modules of each level never share keys.
    async fn shared(strategy: ClaimStrategy, isolation: Isolation, table: &str) -> Self {
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
            try_write_effect(tx, &effect_id)
                .await
                .map_err(idem_mysql::store_error)?;
            Ok(())
        })
    }

    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let n = try_effects(self.store.pool(), &effect_id).await?;
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

impl MultiStepSubject for MySqlSubject {
    type Steps = MySqlMultiSteps;

    fn steps(&self) -> MySqlMultiSteps {
        MySqlMultiSteps::with_table(
            self.store.pool().clone(),
            TableName::new("idem_conformance_operations").unwrap(),
        )
    }

    fn isolated_steps(&self) -> BoxFuture<'_, MySqlMultiSteps> {
        Box::pin(async move {
            // Named as the isolated keys tables are, so old ones are dropped with them.
            let table = TableName::new(format!("idem_iso_ops_{}", uuid::Uuid::new_v4().simple())).unwrap();
            let steps = MySqlMultiSteps::with_table(self.store.pool().clone(), table);
            steps.migrate().await.expect("migrate an isolated operations table");
            steps
        })
    }
}

/// The multi-step operations suite's subject, its operations table migrated.
async fn with_steps() -> MySqlSubject {
    let subject = MySqlSubject::shared(
        ClaimStrategy::Placeholder,
        Isolation::ReadCommitted,
        "idem_conformance_keys_rc",
    )
    .await;
    subject
        .steps()
        .migrate()
        .await
        .expect("migrate the shared operations table");
    subject
}

multistep_conformance!(mysql_multistep, with_steps());

/// Expands each suite into its module, on a subject with the claim
/// strategy, the isolation level and the keys table listed.
macro_rules! suites {
    ($($suite:ident $module:ident: $strategy:ident, $isolation:ident, $table:literal;)*) => {
        $($suite!($module, MySqlSubject::shared(ClaimStrategy::$strategy, Isolation::$isolation, $table));)*
    };
}

suites! {
    tx_conformance mysql_tx: Placeholder, RepeatableRead, "idem_conformance_keys";
    tx_conformance mysql_tx_read_committed: Placeholder, ReadCommitted, "idem_conformance_keys_rc";
    tx_conformance mysql_tx_serializable: Placeholder, Serializable, "idem_conformance_keys_ser";
    tx_conformance mysql_tx_named_lock: NamedLock, RepeatableRead, "idem_conformance_keys_nl";
    tx_conformance mysql_tx_named_lock_read_committed: NamedLock, ReadCommitted, "idem_conformance_keys_nl_rc";
    tx_conformance mysql_tx_named_lock_serializable: NamedLock, Serializable, "idem_conformance_keys_nl_ser";
    lease_conformance mysql_lease_named_lock: NamedLock, RepeatableRead, "idem_conformance_keys_nl";
    lease_conformance mysql_lease: Placeholder, RepeatableRead, "idem_conformance_keys";
    admin_conformance mysql_admin: Placeholder, RepeatableRead, "idem_conformance_keys";
}
