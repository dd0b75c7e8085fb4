//! The conformance suite's business table on PostgreSQL: the effect a
//! claimed transaction writes, and the count of how often it was written.
//!
//! Shared by source: the deployments' replica test includes this file with
//! `#[path]`, so the suite runs against one definition of the effect.

use idem_core::{BoxError, BoxFuture};
use idem_postgres::PgTx;
use sqlx::postgres::PgPool;

/// Creates the business table once; concurrent test processes take turns on
/// an advisory lock. It has no unique constraint, so a double write is
/// counted, not refused.
pub(crate) async fn create_table(pool: &PgPool) {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('idem_conformance_effects', 0))")
        .execute(&mut *tx)
        .await
        .expect("lock");
    for sql in [
        "CREATE TABLE IF NOT EXISTS idem_conformance_effects (effect_id TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS idem_conformance_effects_id_idx ON idem_conformance_effects (effect_id)",
    ] {
        sqlx::query(sql).execute(&mut *tx).await.expect(sql);
    }
    tx.commit().await.expect("commit");
}

/// Writes the effect `effect_id` in the claimed transaction `tx`.
pub(crate) fn write<'c>(tx: &'c mut PgTx, effect_id: String) -> BoxFuture<'c, Result<(), BoxError>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO idem_conformance_effects (effect_id) VALUES ($1)")
            .bind(effect_id)
            .execute(&mut **tx)
            .await
            .map_err(idem_postgres::store_error)?;
        Ok(())
    })
}

/// How many times the effect `effect_id` was written, read on `pool`.
pub(crate) fn count(pool: &PgPool, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>> {
    Box::pin(async move {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_conformance_effects WHERE effect_id = $1")
            .bind(effect_id)
            .fetch_one(pool)
            .await?;
        Ok(u64::try_from(count)?)
    })
}
