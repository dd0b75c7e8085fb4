//! The ledger on a PostgreSQL database whose default isolation level is
//! SERIALIZABLE, as many teams set it: contention between concurrent
//! requests is retried inside the service and never reaches the client.

mod common;

use std::sync::Arc;

use common::{Ledger, Transport, postgres_url, token};
use ledger::Options;

/// The test database's URL, with every connection defaulting to SERIALIZABLE.
fn serializable_url() -> String {
    let url = postgres_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20default_transaction_isolation%3Dserializable")
}

/// At SERIALIZABLE, 24 concurrent top-ups of one account under distinct keys all succeed once: every serialisation failure is retried, none reaches the client as a 503, and the balance is the sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_top_ups_at_serializable_all_succeed() {
    let ledger = Arc::new(
        Ledger::start_with(
            &serializable_url(),
            Transport::InProcess,
            Arc::new(idem_core::SystemClock),
            Options::default(),
        )
        .await,
    );
    let t = token();
    let account = ledger.account(&t, "hot").await;
    let barrier = Arc::new(tokio::sync::Barrier::new(24));
    let tasks: Vec<_> = (0..24)
        .map(|_| {
            let (ledger, t, account, barrier) = (ledger.clone(), t.clone(), account.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                ledger.top_up(&t, &account, 10).await
            })
        })
        .collect();
    for task in tasks {
        let r = task.await.unwrap();
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        assert!(!r.replayed());
    }
    assert_eq!(
        ledger.balance(&t, &account).await,
        240,
        "each top-up applied exactly once"
    );
}
