//! TLS on the ledger's connections, each against a server of the test's
//! own with certificates made for it: a payout paid at an https fake
//! vendor; PostgreSQL (`sslmode`, `sslrootcert`); MariaDB (`ssl-mode`,
//! `ssl-ca`); NATS (`tls://`, the CA file). Each: the verified connection
//! works, a wrong CA is refused naming the server and the reason, and a
//! plain connection to the TLS-only server is refused.

mod common;
mod servers;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use idem_tls::test_pki::TestPki;
use ledger::payouts::PayoutConfig;

/// The fake vendor serving https with `pki`'s certificate.
async fn https_vendor(pki: &TestPki) -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(fake_vendor::Options::default(), Some(pki.server_config()))
        .await
        .unwrap()
}

fn outbound(ca: Option<&TestPki>) -> idem_outbound::OutboundClient {
    idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
        retry_delays: vec![Duration::from_millis(10)],
        jitter: idem_outbound::Jitter::None,
        ca_file: ca.map(TestPki::ca_file),
        ..Default::default()
    })
    .expect("a valid configuration")
}

/// Why the ledger's store cannot connect to `url`; `expect` says that it
/// must not.
async fn refused(url: &str, expect: &str) -> String {
    ledger::Store::connect(url, 2)
        .await
        .map(|_| ())
        .expect_err(expect)
        .to_string()
}

/// The refusal of the database at `url` whose certificate another CA issued.
fn unknown_issuer(url: &str) -> String {
    format!("database {url}: TLS handshake failed: invalid peer certificate: UnknownIssuer")
}

/// A payout requested at the ledger is paid once at an https vendor verified against the CA file, and marked paid; a worker that does not trust the vendor pays nothing and dead-letters it with the handshake's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payout_is_paid_at_an_https_vendor() {
    let pki = TestPki::new("ledger-vendor");
    let (url, vendor) = https_vendor(&pki).await;
    let l = Ledger::start(Engine::Sqlite, Transport::InProcess).await;
    let (t, a) = l.funded(100).await;
    let config = PayoutConfig::new(&url, ledger::events::Namespace::default());

    let untrusted = l.payout(&t, &a, 10).await;
    assert_eq!(untrusted.status, 201);
    let report = ledger::payouts::pass(&l.store, l.clock.clone(), outbound(None), config.clone())
        .await
        .unwrap();
    assert_eq!((report.paid, report.dead_lettered), (0, 1), "{report:?}");
    assert_eq!(vendor.paid(), 0);

    let r = l.payout(&t, &a, 30).await;
    assert_eq!(r.status, 201);
    let id = r.json()["id"].as_str().unwrap().to_owned();
    let report = ledger::payouts::pass(&l.store, l.clock.clone(), outbound(Some(&pki)), config)
        .await
        .unwrap();
    assert_eq!(report.paid, 1, "{report:?}");
    assert_eq!(vendor.paid(), 1);
    assert_eq!(l.get(&format!("/v1/payouts/{id}"), &t).await.json()["status"], "paid");
    l.stop().await;
}

/// PostgreSQL of the test's own, TLS only: verify-full with the CA works (and the session is encrypted); another CA is refused naming the database and the reason; sslmode=disable is refused by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls() {
    let pki = TestPki::new("ledger-pg");
    let other = TestPki::new("ledger-pg-other");
    let pg = servers::TlsPostgres::start(&pki);
    let ca = pki.ca_file().display().to_string();
    for mode in ["require", "verify-ca", "verify-full"] {
        let url = pg.url(&format!("sslmode={mode}&sslrootcert={ca}"));
        let store = ledger::Store::connect(&url, 2)
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        drop(store);
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(ssl, "{mode}: the session is encrypted");
        pool.close().await;
    }
    let wrong = pg.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        other.ca_file().display()
    ));
    let e = refused(&wrong, "a wrong CA is refused").await;
    let expected = unknown_issuer(&format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port));
    assert_eq!(e, expected);
    let plain = pg.url("sslmode=disable");
    let e = refused(&plain, "plain is refused").await;
    assert!(e.contains("pg_hba.conf") && e.contains("no encryption"), "{e}");
}

/// MariaDB of the test's own, requiring TLS: ssl-mode=VERIFY_IDENTITY with the CA works; another CA is refused naming the database and the reason; ssl-mode=DISABLED is refused by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_over_tls() {
    let pki = TestPki::new("ledger-maria");
    let other = TestPki::new("ledger-maria-other");
    let maria = servers::tls_mariadb(&pki);
    let url = |params: &str| format!("mysql://root@127.0.0.1:{}/mysql?{params}", maria.port);
    let ca = pki.ca_file().display().to_string();
    for mode in ["REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY"] {
        let u = url(&format!("ssl-mode={mode}&ssl-ca={ca}"));
        let pool = sqlx::MySqlPool::connect(&u)
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(!cipher.is_empty(), "{mode}: the session is encrypted");
        pool.close().await;
    }
    let wrong = url(&format!(
        "ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        other.ca_file().display()
    ));
    let e = refused(&wrong, "a wrong CA is refused").await;
    let expected = unknown_issuer(&format!("mysql://root@127.0.0.1:{}/mysql", maria.port));
    assert_eq!(e, expected);
    let e = sqlx::MySqlPool::connect(&url("ssl-mode=DISABLED"))
        .await
        .map(|_| ())
        .expect_err("plain is refused")
        .to_string();
    // The server requires TLS: a plain session never gets in (MariaDB
    // answers it as a failed login, 1045).
    assert!(e.contains("1045") || e.contains("secure transport"), "{e}");
}

/// NATS with JetStream, TLS only: tls:// with the CA file connects and creates the streams; another CA, or the platform's roots, is refused at once naming the server and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls() {
    let pki = TestPki::new("ledger-nats");
    let other = TestPki::new("ledger-nats-other");
    let nats = servers::tls_nats(&pki);
    let ns =
        ledger::events::Namespace::new(&format!("tls{}", &uuid::Uuid::now_v7().simple().to_string()[20..])).unwrap();
    let url = format!("tls://127.0.0.1:{}", nats.port);
    let ca = pki.ca_file();
    let js = ledger::events::connect(&url, Some(&ca), &ns).await.unwrap();
    assert!(js.get_stream(ns.stream()).await.is_ok());
    for (url, ca) in [
        (url.clone(), Some(other.ca_file())),
        (format!("nats://127.0.0.1:{}", nats.port), None),
    ] {
        let e = tokio::time::timeout(
            Duration::from_secs(20),
            ledger::events::connect(&url, ca.as_deref(), &ns),
        )
        .await
        .expect("refused at once, not retried")
        .map(|_| ())
        .expect_err("refused")
        .to_string();
        assert_eq!(
            e,
            format!("NATS {url}: TLS handshake failed: invalid peer certificate: UnknownIssuer")
        );
    }
}
