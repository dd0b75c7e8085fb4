//! The conformance suite against the SQLite store, one database file per test.

mod common;

use common::TempDb;

use std::sync::Arc;

use idem_conformance::multistep_tests::MultiStepSubject;
use idem_conformance::{Subject, admin_conformance, lease_conformance, multistep_conformance, tx_conformance};
use idem_core::{BoxError, BoxFuture, TableName};
use idem_sqlite::{SqliteMultiSteps, SqliteStore, SqliteTx};

/// The business table of the suite: no unique constraint, so a double write
/// would be counted rather than refused.
const EFFECTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_conformance_effects (effect_id TEXT NOT NULL)";

#[derive(Clone)]
struct Sqlite {
    store: SqliteStore,
    db: Arc<TempDb>,
}

impl Sqlite {
    async fn new() -> Self {
        let db = Arc::new(TempDb::new("conformance"));
        let store = db.open().await;
        store.migrate().await.expect("migrate the keys table");
        sqlx::query(EFFECTS_TABLE)
            .execute(store.pool())
            .await
            .expect("create the effects table");
        Self { store, db }
    }
}

impl Subject for Sqlite {
    idem_conformance::one_store_subject!(SqliteStore);

    fn write_effect<'c>(tx: &'c mut SqliteTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO idem_conformance_effects (effect_id) VALUES (?1)")
                .bind(effect_id)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_conformance_effects WHERE effect_id = ?1")
                .bind(effect_id)
                .fetch_one(self.store.pool())
                .await?;
            Ok(u64::try_from(n)?)
        })
    }
    fn another(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            // A second pool on the same file; it joins the file's
            // process-wide key registry.
            let store = self.db.open().await.with_table(self.store.table().clone());
            Self {
                store,
                db: self.db.clone(),
            }
        })
    }
    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let table = TableName::new(format!("keys_{}", uuid::Uuid::new_v4().simple())).expect("valid table name");
            let store = self.store.clone().with_table(table);
            store.migrate().await.expect("migrate the isolated keys table");
            Self {
                store,
                db: self.db.clone(),
            }
        })
    }
}

impl Sqlite {
    /// A subject whose operations table is migrated.
    async fn with_steps() -> Self {
        let subject = Self::new().await;
        subject.steps().migrate().await.expect("migrate the operations table");
        subject
    }
}

impl MultiStepSubject for Sqlite {
    type Steps = SqliteMultiSteps;

    fn steps(&self) -> SqliteMultiSteps {
        SqliteMultiSteps::new(self.store.pool().clone())
    }

    fn isolated_steps(&self) -> BoxFuture<'_, SqliteMultiSteps> {
        Box::pin(async move {
            let table = TableName::new(format!("ops_{}", uuid::Uuid::new_v4().simple())).expect("valid table name");
            let steps = SqliteMultiSteps::with_table(self.store.pool().clone(), table);
            steps.migrate().await.expect("migrate an isolated operations table");
            steps
        })
    }
}

multistep_conformance!(sqlite_multistep, Sqlite::with_steps());
tx_conformance!(sqlite_tx, Sqlite::new());
lease_conformance!(sqlite_lease, Sqlite::new());
admin_conformance!(sqlite_admin, Sqlite::new());

/// A read-first replay on a store whose claims queue in a local registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_first_replay_takes_no_registry_place() {
    idem_conformance::read_first_tests::read_first_replay_takes_no_registry_place(Sqlite::new().await).await;
}
