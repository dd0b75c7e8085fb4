//! What is read back of an engine: the keys table's bytes (table and
//! indexes) per key, and the server settings that decide whether it fits in
//! memory.

use idem_core::BoxError;
use serde_json::{Value, json};

use crate::KEYS_TABLE;
use crate::db::{Engine, ScaleDb};

/// Table and index bytes of the keys table.
pub(crate) async fn bytes<D: ScaleDb>(db: &D) -> Result<Value, BoxError> {
    let engine = D::ENGINE;
    let t = engine.quote(KEYS_TABLE);
    let (table, index, total, indexes, note) = match engine {
        Engine::Postgres => {
            db.exec(format!("VACUUM ANALYZE {t}")).await?;
            let table = db.int(format!("SELECT pg_relation_size('{KEYS_TABLE}')")).await?;
            let index = db.int(format!("SELECT pg_indexes_size('{KEYS_TABLE}')")).await?;
            let total = db.int(format!("SELECT pg_total_relation_size('{KEYS_TABLE}')")).await?;
            let indexes = db
                .pairs(format!(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index \
                     WHERE indrelid = '{KEYS_TABLE}'::regclass"
                ))
                .await?;
            (
                table,
                index,
                total,
                indexes,
                "pg_relation_size / pg_indexes_size / pg_total_relation_size after VACUUM ANALYZE",
            )
        }
        Engine::MySql => {
            db.exec(format!("ANALYZE TABLE {t}")).await?;
            let table = db
                .int(format!(
                    "SELECT CAST(DATA_LENGTH AS SIGNED) FROM information_schema.TABLES \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{KEYS_TABLE}'"
                ))
                .await?;
            let index = db
                .int(format!(
                    "SELECT CAST(INDEX_LENGTH AS SIGNED) FROM information_schema.TABLES \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{KEYS_TABLE}'"
                ))
                .await?;
            let indexes = db
                .pairs(format!(
                    "SELECT CAST(index_name AS CHAR), CAST(stat_value * @@innodb_page_size AS SIGNED) \
                     FROM mysql.innodb_index_stats WHERE database_name = DATABASE() \
                     AND table_name = '{KEYS_TABLE}' AND stat_name = 'size'"
                ))
                .await?;
            (
                table,
                index,
                table + index,
                indexes,
                "information_schema.TABLES data_length / index_length after ANALYZE TABLE",
            )
        }
        Engine::Sqlite => {
            let per_btree = db
                .pairs(format!(
                    "SELECT name, SUM(pgsize) FROM dbstat WHERE name IN \
                     (SELECT name FROM sqlite_schema WHERE tbl_name = '{KEYS_TABLE}') GROUP BY name"
                ))
                .await?;
            let table = per_btree
                .iter()
                .filter(|(n, _)| n == KEYS_TABLE)
                .map(|(_, b)| b)
                .sum::<i64>();
            let index = per_btree
                .iter()
                .filter(|(n, _)| n != KEYS_TABLE)
                .map(|(_, b)| b)
                .sum::<i64>();
            let indexes = per_btree.into_iter().filter(|(n, _)| n != KEYS_TABLE).collect();
            (
                table,
                index,
                table + index,
                indexes,
                "dbstat pages of the table and its indexes",
            )
        }
    };
    let rows = db.int(format!("SELECT COUNT(*) FROM {t}")).await?;
    let indexes: serde_json::Map<String, Value> = indexes.into_iter().map(|(n, b)| (n, json!(b))).collect();
    let per_key = total as f64 / rows.max(1) as f64;
    println!(
        "  {:<8} bytes: {rows} rows, table {:.1} MiB, indexes {:.1} MiB, total {:.1} MiB, {per_key:.1} bytes/key",
        engine.name(),
        table as f64 / 1048576.0,
        index as f64 / 1048576.0,
        total as f64 / 1048576.0
    );
    for (name, b) in &indexes {
        println!(
            "           index {name}: {:.1} MiB",
            b.as_i64().unwrap_or(0) as f64 / 1048576.0
        );
    }
    Ok(json!({
        "rows": rows, "table_bytes": table, "index_bytes": index, "total_bytes": total,
        "bytes_per_key": per_key, "indexes": indexes, "source": note,
    }))
}

/// The server settings that decide whether the keys table fits in memory.
pub(crate) async fn server<D: ScaleDb>(db: &D) -> Result<Value, BoxError> {
    let names: &[(&str, &str)] = match D::ENGINE {
        Engine::Postgres => &[
            ("version", "SELECT version()"),
            ("shared_buffers", "SHOW shared_buffers"),
            ("effective_cache_size", "SHOW effective_cache_size"),
            ("work_mem", "SHOW work_mem"),
            ("max_wal_size", "SHOW max_wal_size"),
            ("synchronous_commit", "SHOW synchronous_commit"),
        ],
        Engine::MySql => &[
            ("version", "SELECT CAST(VERSION() AS CHAR)"),
            (
                "innodb_buffer_pool_size",
                "SELECT CAST(@@innodb_buffer_pool_size AS CHAR)",
            ),
            ("innodb_flush_method", "SELECT CAST(@@innodb_flush_method AS CHAR)"),
            (
                "innodb_flush_log_at_trx_commit",
                "SELECT CAST(@@innodb_flush_log_at_trx_commit AS CHAR)",
            ),
            ("innodb_log_file_size", "SELECT CAST(@@innodb_log_file_size AS CHAR)"),
            ("innodb_page_size", "SELECT CAST(@@innodb_page_size AS CHAR)"),
        ],
        Engine::Sqlite => &[
            ("version", "SELECT sqlite_version()"),
            ("page_size", "SELECT CAST(page_size AS TEXT) FROM pragma_page_size"),
            ("cache_size", "SELECT CAST(cache_size AS TEXT) FROM pragma_cache_size"),
            ("journal_mode", "SELECT journal_mode FROM pragma_journal_mode"),
            (
                "synchronous",
                "SELECT CAST(synchronous AS TEXT) FROM pragma_synchronous",
            ),
        ],
    };
    let mut out = serde_json::Map::new();
    for (name, sql) in names {
        let value = db
            .texts((*sql).to_owned())
            .await?
            .into_iter()
            .next()
            .unwrap_or_default();
        out.insert((*name).to_owned(), json!(value));
    }
    println!("  {:<8} server: {}", D::ENGINE.name(), Value::Object(out.clone()));
    Ok(Value::Object(out))
}
