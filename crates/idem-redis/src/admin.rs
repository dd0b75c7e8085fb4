//! The operator's view ([`KeyAdmin`]): the expiry index lists the keys a
//! store holds; each row is read for what it is now. An index entry whose
//! row is gone (Redis expired it by its TTL) is no key: it is skipped here,
//! and removed by the next sweep.

use futures_util::{StreamExt, TryStreamExt};
use idem_core::{BoxFuture, IdempotencyKey, KeyAdmin, KeyFilter, KeyInfo, KeyState, KeyStats, Result, Scope};
use redis::aio::ConnectionLike;

use crate::{CONCURRENCY, RedisStore, store_error};

/// Index entries read per page.
const PAGE: isize = 1_000;

/// The row fields an operator sees, in this order.
const FIELDS: [&str; 7] = ["tn", "op", "k", "st", "cr", "exp", "pl"];

type Fields = Vec<Option<Vec<u8>>>;

/// Which matching keys a selection keeps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// The oldest, by creation time (a listing).
    Oldest,
    /// The first found (a purge).
    Any,
}

/// A row's fields as a key, at `now_ms`; `None` if the row is gone or is
/// not a key row.
fn key_info(fields: &Fields, now_ms: i64) -> Option<KeyInfo> {
    let text = |i: usize| {
        fields
            .get(i)
            .cloned()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    };
    let (tenant, operation, key) = (text(0)?, text(1)?, text(2)?);
    let status: i16 = text(3)?.parse().ok()?;
    let created_at_ms: i64 = text(4)?.parse().ok()?;
    let expires_at_ms: i64 = text(5)?.parse().ok()?;
    Some(KeyInfo {
        tenant,
        operation,
        key,
        state: KeyState::of(status, expires_at_ms, now_ms),
        created_at_ms,
        expires_at_ms,
        payload: fields.get(6).cloned().flatten().unwrap_or_default(),
    })
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    /// Walks the index a page at a time, reading `fields` of each page's
    /// rows (several in flight), and hands each page's (tag, fields) to
    /// `each`, until the index ends or `each` answers false. Entries added
    /// or removed meanwhile may be seen or missed: an operator's view, not a
    /// snapshot.
    async fn walk(&self, fields: &[&str], mut each: impl FnMut(Vec<(String, Fields)>) -> bool) -> Result<()> {
        self.index.flush().await;
        let mut conn = self.conn.clone();
        let mut start: isize = 0;
        loop {
            let tags: Vec<String> = redis::cmd("ZRANGE")
                .arg(self.expiry_key())
                .arg(start)
                .arg(start + PAGE - 1)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            let n = tags.len() as isize;
            let rows = self.read_rows(&tags, fields).await?;
            if !each(tags.into_iter().zip(rows).collect()) || n < PAGE {
                return Ok(());
            }
            start += PAGE;
        }
    }

    /// `fields` of the rows of `tags`, in order: on one server in one
    /// pipeline (one round trip), on a cluster row by row, several in flight.
    async fn read_rows(&self, tags: &[String], fields: &[&str]) -> Result<Vec<Fields>> {
        if tags.is_empty() {
            return Ok(Vec::new());
        }
        if self.pipelines {
            let mut pipe = redis::pipe();
            for tag in tags {
                pipe.cmd("HMGET").arg(self.row_key(tag)).arg(fields);
            }
            let mut conn = self.conn.clone();
            return pipe.query_async(&mut conn).await.map_err(store_error);
        }
        let reads: Vec<_> = tags
            .iter()
            .map(|tag| {
                let mut conn = self.conn.clone();
                let mut cmd = redis::cmd("HMGET");
                cmd.arg(self.row_key(tag)).arg(fields);
                async move { cmd.query_async::<Fields>(&mut conn).await.map_err(store_error) }
            })
            .collect();
        futures_util::stream::iter(reads)
            .buffered(CONCURRENCY)
            .try_collect()
            .await
    }

    /// The keys matching `filter` with their tags. `Order::Oldest`: the
    /// oldest `limit` of them (the whole index is read); `Order::Any`: the
    /// first `limit` found (the walk stops there).
    async fn matching(
        &self,
        filter: &KeyFilter,
        now_ms: i64,
        limit: u32,
        order: Order,
    ) -> Result<Vec<(String, KeyInfo)>> {
        let mut out = Vec::new();
        self.walk(&FIELDS, |page| {
            for (tag, fields) in page {
                if let Some(info) = key_info(&fields, now_ms)
                    && filter.matches(&info, now_ms)
                {
                    out.push((tag, info));
                }
            }
            order == Order::Oldest || out.len() < limit as usize
        })
        .await?;
        if order == Order::Oldest {
            out.sort_by_key(|(_, i)| i.created_at_ms);
        }
        out.truncate(limit as usize);
        Ok(out)
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> KeyAdmin for RedisStore<C> {
    /// Reads each indexed row's status and expiry; an entry whose row is
    /// gone counts for nothing.
    fn stats(&self, now_ms: i64) -> BoxFuture<'_, Result<KeyStats>> {
        Box::pin(async move {
            let mut stats = KeyStats::default();
            self.walk(&["st", "exp"], |page| {
                for (_, fields) in page {
                    let text = |i: usize| fields.get(i).cloned().flatten().and_then(|b| String::from_utf8(b).ok());
                    let (Some(status), Some(expires)) = (text(0), text(1)) else {
                        continue;
                    };
                    let (Ok(status), Ok(expires)) = (status.parse::<i16>(), expires.parse::<i64>()) else {
                        continue;
                    };
                    match KeyState::of(status, expires, now_ms) {
                        KeyState::InProgress => stats.in_progress += 1,
                        KeyState::Completed => stats.completed += 1,
                        KeyState::Rejected => stats.rejected += 1,
                        KeyState::Unknown => stats.unknown += 1,
                        KeyState::Sent => stats.sent += 1,
                        KeyState::Expired => stats.expired += 1,
                    }
                }
                true
            })
            .await?;
            Ok(stats)
        })
    }

    fn list_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<Vec<KeyInfo>>> {
        Box::pin(async move {
            Ok(self
                .matching(filter, now_ms, limit, Order::Oldest)
                .await?
                .into_iter()
                .map(|(_, info)| info)
                .collect())
        })
    }

    /// Reads the key's own row (indexed or not).
    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let fields: Fields = redis::cmd("HMGET")
                .arg(self.row_key(&Self::tag(scope, key)))
                .arg(&FIELDS)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(key_info(&fields, now_ms))
        })
    }

    /// Selects through the index, then deletes each row with a script that
    /// checks the filter again on the row as it is at that moment: a key
    /// claimed again since it was read (an expired key taken over) no longer
    /// matches, and stays.
    fn purge_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<u64>> {
        Box::pin(async move {
            // Any `limit` matching keys will do, so the walk stops once it
            // has them: a purge in batches reads about what it deletes.
            let candidates = self.matching(filter, now_ms, limit, Order::Any).await?;
            let flag = |v: &Option<String>| if v.is_some() { "1" } else { "0" };
            let state = filter.state.map(KeyState::name).unwrap_or("");
            let cutoff = filter.older_than_ms.map(|age| now_ms.saturating_sub(age));
            let (now, cutoff_ms) = (now_ms.to_string(), cutoff.unwrap_or(0).to_string());
            // The script's arguments after the row's key, the same for every row.
            let args: Vec<&[u8]> = vec![
                now.as_bytes(),
                flag(&filter.tenant).as_bytes(),
                filter.tenant.as_deref().unwrap_or("").as_bytes(),
                flag(&filter.operation).as_bytes(),
                filter.operation.as_deref().unwrap_or("").as_bytes(),
                flag(&filter.key_prefix).as_bytes(),
                filter.key_prefix.as_deref().unwrap_or("").as_bytes(),
                state.as_bytes(),
                if cutoff.is_some() { b"1" } else { b"0" },
                cutoff_ms.as_bytes(),
            ];
            let deleted: Vec<Option<String>> = if candidates.is_empty() {
                Vec::new()
            } else if self.pipelines {
                // One round trip for the batch: the script is loaded first (a
                // pipeline cannot load it on a NOSCRIPT answer), then run on
                // each row by its hash.
                let mut conn = self.conn.clone();
                let sha = self
                    .scripts
                    .purge_one
                    .load_async(&mut conn)
                    .await
                    .map_err(store_error)?;
                let mut pipe = redis::pipe();
                for (tag, _) in &candidates {
                    let cmd = pipe.cmd("EVALSHA").arg(&sha).arg(1).arg(self.row_key(tag));
                    for a in &args {
                        cmd.arg(*a);
                    }
                }
                pipe.query_async(&mut conn).await.map_err(store_error)?
            } else {
                let deletes: Vec<_> = candidates
                    .iter()
                    .map(|(tag, _)| {
                        let mut conn = self.conn.clone();
                        let mut invocation = self.scripts.purge_one.key(self.row_key(tag));
                        for a in &args {
                            invocation.arg(*a);
                        }
                        async move {
                            invocation
                                .invoke_async::<Option<String>>(&mut conn)
                                .await
                                .map_err(store_error)
                        }
                    })
                    .collect();
                futures_util::stream::iter(deletes)
                    .buffered(CONCURRENCY)
                    .try_collect()
                    .await?
            };
            // Only the entries of deleted rows, and only while they still
            // point at the deleted row's expiry or earlier: a claim made
            // since has indexed its own, later expiry.
            let settle: Vec<(&str, &str, String)> = candidates
                .iter()
                .zip(&deleted)
                .filter_map(|((tag, _), expires)| Some(("r", tag.as_str(), expires.clone()?)))
                .collect();
            self.settle_index(&settle).await?;
            Ok(settle.len() as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use redis::{Cmd, Pipeline, RedisFuture, Value};

    use super::*;

    const ROWS: usize = 100;

    /// One server holding `ROWS` indexed rows, counting the round trips
    /// made to it (a command alone or a whole pipeline).
    #[derive(Clone, Default)]
    struct Server {
        round_trips: Arc<AtomicUsize>,
    }

    fn answer(cmd: &Cmd) -> Value {
        let args = crate::index::tests::command_args(cmd);
        match args[0].as_slice() {
            b"ZRANGE" if args[2] == b"0" => Value::Array(
                (0..ROWS)
                    .map(|i| Value::BulkString(format!("tag{i}").into_bytes()))
                    .collect(),
            ),
            b"ZRANGE" => Value::Array(Vec::new()),
            b"HMGET" => Value::Array(
                [b"1".as_slice(), b"9000000000000"]
                    .iter()
                    .map(|v| Value::BulkString(v.to_vec()))
                    .collect(),
            ),
            _ => Value::Nil,
        }
    }

    impl ConnectionLike for Server {
        fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
            self.round_trips.fetch_add(1, Ordering::SeqCst);
            let value = answer(cmd);
            Box::pin(async move { Ok(value) })
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            pipe: &'a Pipeline,
            offset: usize,
            count: usize,
        ) -> RedisFuture<'a, Vec<Value>> {
            self.round_trips.fetch_add(1, Ordering::SeqCst);
            let values: Vec<Value> = pipe.cmd_iter().map(answer).skip(offset).take(count).collect();
            Box::pin(async move { Ok(values) })
        }

        fn get_db(&self) -> i64 {
            0
        }
    }

    /// On one server the rows of an index page are read in one pipeline,
    /// not one round trip per row.
    #[tokio::test]
    async fn stats_read_a_page_of_rows_in_one_round_trip() {
        let server = Server::default();
        let store = RedisStore::new(server.clone());
        let stats = store.stats(0).await.unwrap();
        assert_eq!(
            stats.in_progress + stats.completed + stats.rejected + stats.unknown + stats.sent + stats.expired,
            ROWS as u64
        );
        let round_trips = server.round_trips.load(Ordering::SeqCst);
        assert!(round_trips <= 2, "{ROWS} rows cost {round_trips} round trips");
    }
}
