//! The gateway sweeps its store in the background: keys with a short TTL
//! go away after they expire — on Redis the rows Redis expired by their TTL
//! leave no entry behind in the expiry index, on SQLite and PostgreSQL the
//! expired rows are deleted — with no operator command run.

#[path = "../../idem-redis/tests/support/servers.rs"]
mod servers;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;

async fn start_upstream() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new().route(
        "/v1/orders",
        post(move || {
            let counted = counted.clone();
            async move {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                (axum::http::StatusCode::CREATED, format!(r#"{{"order":{n}}}"#))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), calls)
}

struct Gateway {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A gateway whose keys live two seconds (longer than its lease and its
/// upstream timeout) and whose sweeper runs every second.
async fn start_gateway(upstream: &str, store: &str) -> Gateway {
    let toml = format!(
        "upstream = {upstream:?}\nstore = {store:?}\nupstream_timeout_secs = 1\n\
         [tenant]\nsource = \"anonymous\"\n\
         [defaults]\nttl_secs = 2\nlease_ms = 1000\n\
         [sweeper]\ninterval_secs = 1\nbatch = 50\npause_ms = 0\n"
    );
    let config = idem_gateway::Config::from_toml(&toml).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        idem_gateway::serve(&config, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap_or_else(|e| panic!("the gateway failed: {e}"));
    });
    support::wait_healthy(&base).await;
    Gateway { base, stop: Some(stop) }
}

/// Sends `n` requests with fresh keys, 16 at a time.
async fn send_fresh(base: &str, n: usize) {
    let client = idem_tls::test_pki::http_client();
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (client, base) = (client.clone(), base.to_owned());
            tokio::spawn(async move {
                for _ in (t..n).step_by(16) {
                    let r = client
                        .post(format!("{base}/v1/orders"))
                        .bearer_auth("sweeper-test")
                        .header("idempotency-key", format!("\"{}\"", uuid::Uuid::now_v7()))
                        .header("content-type", "application/json")
                        .body("{}")
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 201);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// Polls `count` until it is `want`, for at most 30 s.
async fn eventually<F, Fut>(what: &str, want: u64, mut count: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = count().await;
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {n}, never {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts a gateway on `store`, sends it 100 requests with fresh keys, waits
/// until `pool` (the same database) has no row left in the keys table, and
/// closes `pool`.
async fn swept<DB: sqlx::Database>(store: &str, pool: sqlx::Pool<DB>)
where
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let (upstream, _) = start_upstream().await;
    let g = start_gateway(&upstream, store).await;
    send_fresh(&g.base, 100).await;
    let rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM idem_keys")
            .fetch_one(&pool)
            .await
            .unwrap() as u64
    };
    eventually("rows in idem_keys", 0, rows).await;
    pool.close().await;
}

/// On Redis, the expiry index first holds every claim, then, once Redis has
/// expired the rows by their TTL, the gateway's sweeper empties it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_redis_expiry_index_returns_to_zero() {
    let server = servers::RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    let (upstream, calls) = start_upstream().await;
    let g = start_gateway(&upstream, &server.url()).await;
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    send_fresh(&g.base, 300).await;
    assert_eq!(calls.load(Ordering::SeqCst), 300);
    let zcard = |mut conn: redis::aio::MultiplexedConnection| async move {
        redis::cmd("ZCARD")
            .arg("idem:expiry")
            .query_async::<u64>(&mut conn)
            .await
            .unwrap()
    };
    let peak = zcard(conn.clone()).await;
    assert!(peak > 0, "the claims were indexed");
    eventually("entries in the expiry index", 0, || zcard(conn.clone())).await;
    let rows: Vec<String> = redis::cmd("KEYS").arg("idem:*:r").query_async(&mut conn).await.unwrap();
    assert!(rows.is_empty(), "{rows:?}");
    let metrics = idem_tls::test_pki::get(format!("{}/_idem/metrics", g.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("idem_sweep_runs_total"), "{metrics}");
}

/// On SQLite, the gateway's sweeper deletes the expired rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sqlite_keys_table_is_swept() {
    let path = std::env::temp_dir().join(format!("idem-gateway-sweeper-{}.db", uuid::Uuid::now_v7().simple()));
    let store = path.display().to_string();
    // Connected at its first query, once the gateway has made the file.
    let pool = sqlx::SqlitePool::connect_lazy(&format!("sqlite://{store}")).unwrap();
    swept(&store, pool).await;
    for suffix in ["", "-wal", "-shm", "-idem.lock"] {
        let _ = std::fs::remove_file(format!("{store}{suffix}"));
    }
}

/// On PostgreSQL (a database of the test's own), the gateway's sweeper
/// deletes the expired rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_postgres_keys_table_is_swept() {
    let admin_url = support::postgres_url();
    let admin = sqlx::PgPool::connect(&admin_url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {admin_url}: {e}"));
    let db = format!("idem_gw_sweep_{}", &uuid::Uuid::now_v7().simple().to_string()[20..]);
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    let (base, _) = admin_url.rsplit_once('/').unwrap();
    let url = format!("{base}/{db}");
    swept(&url, sqlx::PgPool::connect(&url).await.unwrap()).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {db} WITH (FORCE)")))
        .execute(&admin)
        .await
        .unwrap();
}
