//! The engines: what the program needs of each store beyond idem's own
//! traits (raw statements, the business write, `migrate()` under one name),
//! and each engine's SQL for the program's own tables.

use idem_core::{BoxError, BoxFuture, Sweep, TxBackend};
use sqlx::AssertSqlSafe;

use crate::{EFFECTS_TABLE, KEYS_TABLE, SEEDS_TABLE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    Postgres,
    MySql,
    Sqlite,
}

/// What the program needs from an engine beyond idem's own traits.
pub(crate) trait ScaleDb: TxBackend + Sweep + MigrateKeys + Clone + Send + Sync + 'static {
    const ENGINE: Engine;
    /// Runs statements without parameters; answers the rows they affected.
    fn exec(&self, sql: String) -> BoxFuture<'_, Result<u64, BoxError>>;
    /// One integer.
    fn int(&self, sql: String) -> BoxFuture<'_, Result<i64, BoxError>>;
    /// A column of text.
    fn texts(&self, sql: String) -> BoxFuture<'_, Result<Vec<String>, BoxError>>;
    /// Pairs of text and integer.
    fn pairs(&self, sql: String) -> BoxFuture<'_, Result<Vec<(String, i64)>, BoxError>>;
    /// The business write inside the claim's transaction.
    fn effect<'c>(tx: &'c mut Self::Tx, id: String) -> BoxFuture<'c, Result<(), BoxError>>;
}

macro_rules! scale_db {
    ($store:ty, $engine:expr, $insert:literal) => {
        impl ScaleDb for $store {
            const ENGINE: Engine = $engine;
            fn exec(&self, sql: String) -> BoxFuture<'_, Result<u64, BoxError>> {
                Box::pin(async move {
                    Ok(sqlx::raw_sql(AssertSqlSafe(sql))
                        .execute(self.pool())
                        .await?
                        .rows_affected())
                })
            }
            fn int(&self, sql: String) -> BoxFuture<'_, Result<i64, BoxError>> {
                Box::pin(async move {
                    Ok(sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                        .fetch_one(self.pool())
                        .await?)
                })
            }
            fn texts(&self, sql: String) -> BoxFuture<'_, Result<Vec<String>, BoxError>> {
                Box::pin(async move {
                    Ok(sqlx::query_scalar::<_, String>(AssertSqlSafe(sql))
                        .fetch_all(self.pool())
                        .await?)
                })
            }
            fn pairs(&self, sql: String) -> BoxFuture<'_, Result<Vec<(String, i64)>, BoxError>> {
                Box::pin(async move {
                    Ok(sqlx::query_as::<_, (String, i64)>(AssertSqlSafe(sql))
                        .fetch_all(self.pool())
                        .await?)
                })
            }
            fn effect<'c>(tx: &'c mut <$store as TxBackend>::Tx, id: String) -> BoxFuture<'c, Result<(), BoxError>> {
                Box::pin(async move {
                    sqlx::query($insert)
                        .bind(id)
                        .bind("payload")
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }
        }
    };
}

scale_db!(
    idem_postgres::PgStore,
    Engine::Postgres,
    "INSERT INTO idem_scale_effects (id, payload) VALUES ($1, $2)"
);
scale_db!(
    idem_mysql::MySqlStore,
    Engine::MySql,
    "INSERT INTO idem_scale_effects (id, payload) VALUES (?, ?)"
);
scale_db!(
    idem_sqlite::SqliteStore,
    Engine::Sqlite,
    "INSERT INTO idem_scale_effects (id, payload) VALUES (?, ?)"
);

impl Engine {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Engine::Postgres => "postgres",
            Engine::MySql => "mysql",
            Engine::Sqlite => "sqlite",
        }
    }

    pub(crate) fn quote(self, ident: &str) -> String {
        match self {
            Engine::MySql => format!("`{ident}`"),
            Engine::Postgres | Engine::Sqlite => format!("\"{ident}\""),
        }
    }

    pub(crate) fn concat(self, parts: &[&str]) -> String {
        match self {
            Engine::MySql => format!("CONCAT({})", parts.join(", ")),
            Engine::Postgres | Engine::Sqlite => parts.join(" || "),
        }
    }

    pub(crate) fn create_effects(self) -> String {
        match self {
            Engine::Postgres => {
                format!("CREATE TABLE {EFFECTS_TABLE} (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL)")
            }
            Engine::MySql => format!(
                "CREATE TABLE {EFFECTS_TABLE} (id VARCHAR(64) PRIMARY KEY, payload VARCHAR(200) NOT NULL) \
                 ENGINE=InnoDB"
            ),
            Engine::Sqlite => format!("CREATE TABLE {EFFECTS_TABLE} (id TEXT PRIMARY KEY, payload TEXT NOT NULL)"),
        }
    }

    pub(crate) fn drop_tables(self) -> Vec<String> {
        [
            KEYS_TABLE.to_owned(),
            format!("{KEYS_TABLE}_schema"),
            SEEDS_TABLE.to_owned(),
            EFFECTS_TABLE.to_owned(),
        ]
        .iter()
        .map(|t| format!("DROP TABLE IF EXISTS {}", self.quote(t)))
        .collect()
    }

    pub(crate) fn columns(self) -> String {
        match self {
            Engine::Postgres => format!(
                "SELECT column_name::text FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = '{KEYS_TABLE}' ORDER BY ordinal_position"
            ),
            Engine::MySql => format!(
                "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{KEYS_TABLE}' ORDER BY ORDINAL_POSITION"
            ),
            Engine::Sqlite => format!("SELECT name FROM pragma_table_info('{KEYS_TABLE}') ORDER BY cid"),
        }
    }

    pub(crate) fn copy_seeds(self) -> String {
        let cast = match self {
            Engine::MySql => "SIGNED",
            Engine::Postgres => "INTEGER",
            Engine::Sqlite => "INTEGER",
        };
        format!(
            "CREATE TABLE {SEEDS_TABLE} AS SELECT CAST(SUBSTR(k.idem_key, 6) AS {cast}) AS seed_no, k.* \
             FROM {} k WHERE k.idem_key LIKE 'seed-%'",
            self.quote(KEYS_TABLE)
        )
    }
}

pub(crate) async fn fresh_effects<D: ScaleDb>(db: &D) -> Result<(), BoxError> {
    let q = D::ENGINE.quote(EFFECTS_TABLE);
    db.exec(format!("DELETE FROM {q}")).await?;
    Ok(())
}

/// Writes a load's pages out (a checkpoint), so that measurements after it
/// do not pay for the load's writes, as a table filled over time would not.
pub(crate) async fn settle<D: ScaleDb>(db: &D) -> Result<(), BoxError> {
    let t = D::ENGINE.quote(KEYS_TABLE);
    db.exec(match D::ENGINE {
        Engine::Postgres => "CHECKPOINT".to_owned(),
        Engine::MySql => format!("FLUSH TABLES {t} FOR EXPORT; UNLOCK TABLES"),
        Engine::Sqlite => "PRAGMA wal_checkpoint(TRUNCATE)".to_owned(),
    })
    .await?;
    Ok(())
}

pub(crate) async fn drop_all<D: ScaleDb>(db: &D) -> Result<(), BoxError> {
    for sql in D::ENGINE.drop_tables() {
        db.exec(sql).await?;
    }
    Ok(())
}

/// `migrate()` under one name for the three stores.
pub(crate) trait MigrateKeys {
    fn migrate_keys(&self) -> BoxFuture<'_, Result<(), BoxError>>;
}

macro_rules! migrate_keys {
    ($store:ty) => {
        impl MigrateKeys for $store {
            fn migrate_keys(&self) -> BoxFuture<'_, Result<(), BoxError>> {
                Box::pin(async move { Ok(self.migrate().await?) })
            }
        }
    };
}
migrate_keys!(idem_postgres::PgStore);
migrate_keys!(idem_mysql::MySqlStore);
migrate_keys!(idem_sqlite::SqliteStore);
