//! The conformance suite against PostgreSQL, with each claim strategy and in lease mode,
//! and in transactional mode on connections that default to each isolation level, and on a
//! database whose default is SERIALIZABLE (`ALTER DATABASE … SET default_transaction_isolation`).
//!
//! The database comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); the tests fail, never skip, when
//! it is unreachable.

mod common;
mod effects;

use common::{Isolation, database_url, isolated_table, open_pool, open_pool_at, serializable_database_url};
use idem_conformance::multistep_tests::MultiStepSubject;
use idem_conformance::{Subject, admin_conformance, lease_conformance, multistep_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture, TableName};
use idem_postgres::{ClaimStrategy, ExpiryIndex, PgMultiSteps, PgStore, PgTx};

/// The keys table shared by every test; tests use unique tenants, so they never see each other's keys.
const SHARED_TABLE: &str = "idem_conformance_keys";

#[derive(Clone)]
struct Postgres {
    store: PgStore,
    url: String,
    isolation: Isolation,
}

impl Postgres {
    async fn connect(strategy: ClaimStrategy) -> Self {
        Self::connect_at(strategy, Isolation::ReadCommitted, SHARED_TABLE).await
    }

    /// A subject whose connections default to `isolation`, on a keys table
    /// of its own, so that the modules of each level never share keys.
    async fn connect_at(strategy: ClaimStrategy, isolation: Isolation, table: &str) -> Self {
        Self::connect_on(database_url(), strategy, isolation, table).await
    }

    /// The same on the database at `url`.
    async fn connect_on(url: String, strategy: ClaimStrategy, isolation: Isolation, table: &str) -> Self {
        Self::connect_with(url, strategy, ExpiryIndex::default(), isolation, table).await
    }

    /// The same with the keys table's expiry index `expiry`.
    async fn connect_with(
        url: String,
        strategy: ClaimStrategy,
        expiry: ExpiryIndex,
        isolation: Isolation,
        table: &str,
    ) -> Self {
        effects::create_table(&open_pool(&url).await).await;
        let pool = open_pool_at(&url, isolation).await;
        let store = PgStore::new(pool)
            .with_table(TableName::new(table).unwrap())
            .with_claim_strategy(strategy)
            .with_expiry_index(expiry);
        // Every test of a module migrates the same table at once, at the
        // module's isolation level.
        store.migrate().await.expect("migrate the shared keys table");
        Self { store, url, isolation }
    }
}

impl Subject for Postgres {
    idem_conformance::one_store_subject!(PgStore);

    fn write_effect<'c>(tx: &'c mut PgTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        effects::write(tx, effect_id)
    }

    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        effects::count(self.store.pool(), effect_id)
    }

    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let pool = open_pool_at(&self.url, self.isolation).await;
            let store = PgStore::new(pool)
                .with_table(self.store.table().clone())
                .with_claim_strategy(self.store.claim_strategy())
                .with_expiry_index(self.store.expiry_index());
            Self {
                store,
                url: self.url.clone(),
                isolation: self.isolation,
            }
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let table = isolated_table(self.store.pool()).await;
            let store = PgStore::new(self.store.pool().clone())
                .with_table(table)
                .with_claim_strategy(self.store.claim_strategy())
                .with_expiry_index(self.store.expiry_index());
            store.migrate().await.expect("migrate an isolated keys table");
            Self {
                store,
                url: self.url.clone(),
                isolation: self.isolation,
            }
        })
    }
}

/// The operations table every multi-step test shares.
const SHARED_STEPS_TABLE: &str = "idem_conformance_operations";

impl Postgres {
    /// A subject whose operations table is migrated.
    async fn with_steps() -> Self {
        let subject = Self::connect(ClaimStrategy::InsertOnConflict).await;
        subject
            .steps()
            .migrate()
            .await
            .expect("migrate the shared operations table");
        subject
    }
}

impl MultiStepSubject for Postgres {
    type Steps = PgMultiSteps;

    fn steps(&self) -> PgMultiSteps {
        PgMultiSteps::with_table(self.store.pool().clone(), TableName::new(SHARED_STEPS_TABLE).unwrap())
    }

    fn isolated_steps(&self) -> BoxFuture<'_, PgMultiSteps> {
        Box::pin(async move {
            let steps = PgMultiSteps::with_table(self.store.pool().clone(), isolated_table(self.store.pool()).await);
            steps.migrate().await.expect("migrate an isolated operations table");
            steps
        })
    }
}

multistep_conformance!(postgres_multistep, Postgres::with_steps());
tx_conformance!(postgres_tx, Postgres::connect(ClaimStrategy::InsertOnConflict));
tx_conformance!(postgres_tx_advisory, Postgres::connect(ClaimStrategy::AdvisoryLock));
tx_conformance!(postgres_tx_one_write, Postgres::connect(ClaimStrategy::OneWrite));
tx_conformance!(
    postgres_tx_one_write_repeatable_read,
    Postgres::connect_at(
        ClaimStrategy::OneWrite,
        Isolation::RepeatableRead,
        "idem_conformance_keys_rr_one"
    )
);
tx_conformance!(
    postgres_tx_one_write_serializable,
    Postgres::connect_at(
        ClaimStrategy::OneWrite,
        Isolation::Serializable,
        "idem_conformance_keys_ser_one"
    )
);
tx_conformance!(
    postgres_tx_one_write_serializable_database,
    Postgres::connect_on(
        serializable_database_url().await,
        ClaimStrategy::OneWrite,
        Isolation::DatabaseDefault,
        "idem_conformance_keys_one"
    )
);
tx_conformance!(
    postgres_tx_one_write_brin,
    Postgres::connect_with(
        database_url(),
        ClaimStrategy::OneWrite,
        ExpiryIndex::Brin,
        Isolation::ReadCommitted,
        "idem_conformance_keys_brin"
    )
);
tx_conformance!(
    postgres_tx_no_expiry_index,
    Postgres::connect_with(
        database_url(),
        ClaimStrategy::InsertOnConflict,
        ExpiryIndex::None,
        Isolation::ReadCommitted,
        "idem_conformance_keys_noexp"
    )
);
lease_conformance!(postgres_lease, Postgres::connect(ClaimStrategy::InsertOnConflict));
admin_conformance!(postgres_admin, Postgres::connect(ClaimStrategy::InsertOnConflict));
tx_conformance!(
    postgres_tx_repeatable_read,
    Postgres::connect_at(
        ClaimStrategy::InsertOnConflict,
        Isolation::RepeatableRead,
        "idem_conformance_keys_rr"
    )
);
tx_conformance!(
    postgres_tx_serializable,
    Postgres::connect_at(
        ClaimStrategy::InsertOnConflict,
        Isolation::Serializable,
        "idem_conformance_keys_ser"
    )
);
tx_conformance!(
    postgres_tx_advisory_serializable,
    Postgres::connect_at(
        ClaimStrategy::AdvisoryLock,
        Isolation::Serializable,
        "idem_conformance_keys_ser_adv"
    )
);
tx_conformance!(
    postgres_tx_serializable_database,
    Postgres::connect_on(
        serializable_database_url().await,
        ClaimStrategy::InsertOnConflict,
        Isolation::DatabaseDefault,
        "idem_conformance_keys"
    )
);
tx_conformance!(
    postgres_tx_advisory_serializable_database,
    Postgres::connect_on(
        serializable_database_url().await,
        ClaimStrategy::AdvisoryLock,
        Isolation::DatabaseDefault,
        "idem_conformance_keys_adv"
    )
);
