//! An engine that reads before it claims, on a store without a read outside
//! a transaction: misconfigured, so every call fails closed.

use std::time::Duration;

use idem_core::{
    Begin, BoxFuture, Call, ClaimRequest, Error, Fingerprint, IdempotencyKey, Record, Result, Scope, TxBackend,
    TxClaim, TxEngine,
};

/// A store that claims every key and keeps nothing, with no
/// `read_committed`.
struct Forgetful;

impl TxBackend for Forgetful {
    type Tx = ();

    fn begin(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn claim<'a>(&'a self, _: &'a mut (), _: &'a ClaimRequest<'a>, _: Duration) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async { Ok(TxClaim::Claimed) })
    }

    fn record<'a>(&'a self, _: &'a mut (), _: &'a ClaimRequest<'a>, _: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn commit(&self, _: ()) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn rollback(&self, _: ()) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }
}

fn call() -> Call {
    let scope = Scope::parse("t", "POST /v1/things").unwrap();
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"{}");
    Call::new(scope, IdempotencyKey::generate(), fingerprint)
}

#[tokio::test]
async fn read_first_on_a_store_without_the_read_fails_closed() {
    let engine = TxEngine::new(Forgetful).with_read_first(true);
    match engine.begin(&call()).await {
        Err(Error::Config(message)) => assert!(message.contains("read"), "{message}"),
        Ok(Begin::Claimed(_)) => panic!("claimed without the read it was configured for"),
        other => panic!("expected a configuration error, got {:?}", other.map(|_| ())),
    }
    let plain = TxEngine::new(Forgetful);
    assert!(!plain.reads_first(), "off by default");
    assert!(matches!(plain.begin(&call()).await, Ok(Begin::Claimed(_))));
}
