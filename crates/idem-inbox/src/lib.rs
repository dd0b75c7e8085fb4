//! The inbox: exactly-once effects for event consumers and webhooks.
//!
//! The guide, with examples: `docs/events.md` in the repository.
//!
//! Brokers and webhook providers deliver at least once. An [`Inbox`] makes
//! the effect exactly-once: the handler applies an event inside a database
//! transaction that also claims the key (handler, event id) and records the
//! handler's outcome, through the same [`TxEngine`] as idempotent HTTP
//! requests. The first delivery applies; any redelivery finds the recorded
//! outcome and runs nothing ([`Delivery::Duplicate`]). The key is
//! handler-specific: two handlers of one event each apply it once.
//!
//! Give the inbox its own table (`with_table` on the store), apart from
//! request keys, and a key TTL longer than the broker's redelivery horizon.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::SqlitePool) -> Result<(), idem_core::Error> {
//! use idem_core::{TableName, TxEngine};
//! use idem_inbox::{Delivery, Inbox};
//! use idem_sqlite::SqliteStore;
//!
//! let store = SqliteStore::new(pool).with_table(TableName::new("idem_inbox")?);
//! store.migrate().await?;
//! let inbox = Inbox::new(TxEngine::new(store));
//! let delivery = inbox
//!     .process("statement-projection", "evt_123", br#"{"amount":5}"#, |tx| {
//!         Box::pin(async move {
//!             sqlx::query("UPDATE statements SET total = total + 5")
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map_err(idem_sqlite::store_error)?;
//!             Ok::<_, idem_core::Error>(())
//!         })
//!     })
//!     .await?;
//! assert!(matches!(delivery, Delivery::Applied(())));
//! # Ok(()) }
//! ```

use idem_core::{
    BoxFuture, Call, Contention, Error, FingerprintBuilder, IdempotencyKey, Operation, Outcome, Policy, Scope, Tenant,
    TxBackend, TxEngine,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery<T> {
    /// The first delivery: the handler ran and its writes committed.
    Applied(T),
    /// A redelivery: the handler did not run; this is its recorded outcome.
    Duplicate(T),
}

impl<T> Delivery<T> {
    /// Whether the handler ran for this delivery.
    pub fn is_applied(&self) -> bool {
        matches!(self, Delivery::Applied(_))
    }

    /// The handler's outcome, whether it ran now or before.
    pub fn into_inner(self) -> T {
        match self {
            Delivery::Applied(v) | Delivery::Duplicate(v) => v,
        }
    }
}

/// The default retention of inbox keys: seven days, longer than the
/// redelivery horizon of common brokers and webhook providers.
pub const DEFAULT_TTL_SECS: u64 = 7 * 86_400;

/// Deduplicates deliveries per (handler, event id) on a transactional store.
#[derive(Debug, Clone)]
pub struct Inbox<B: TxBackend> {
    engine: TxEngine<B>,
    tenant: Tenant,
    policy: Policy,
}

impl<B: TxBackend> Inbox<B> {
    /// An inbox on `engine`, under the tenant `inbox`, keeping keys for
    /// [`DEFAULT_TTL_SECS`].
    pub fn new(engine: TxEngine<B>) -> Self {
        Self {
            engine,
            tenant: Tenant::new("inbox").expect("a valid tenant"),
            policy: Policy::default().with_ttl_secs(DEFAULT_TTL_SECS),
        }
    }

    /// Scopes the inbox's keys to `tenant` (one inbox per tenant or source).
    pub fn with_tenant(mut self, tenant: Tenant) -> Self {
        self.tenant = tenant;
        self
    }

    /// Replaces the policy (TTL, how a concurrent redelivery waits).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The tenant the inbox's keys are scoped to.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// How long event ids are kept, in seconds.
    pub fn ttl_secs(&self) -> u64 {
        self.policy.ttl_secs()
    }

    /// The call for one delivery: scope (tenant, handler), key = event id,
    /// fingerprint over the payload's bytes.
    pub fn call(&self, handler: &str, event_id: &str, payload: &[u8]) -> Result<Call, Error> {
        self.call_in(&self.tenant, handler, event_id, payload)
    }

    /// [`call`](Self::call) under another tenant.
    pub fn call_in(&self, tenant: &Tenant, handler: &str, event_id: &str, payload: &[u8]) -> Result<Call, Error> {
        let operation = Operation::new(handler)?;
        let fingerprint = FingerprintBuilder::new(&operation).bytes(payload).finish();
        Ok(Call::new(
            Scope::new(tenant.clone(), operation),
            IdempotencyKey::new(event_id)?,
            fingerprint,
        )
        .with_policy(self.policy))
    }

    /// Applies `payload` with `work` once per (handler, event id).
    ///
    /// `work` gets the open transaction; its writes, the claim and the
    /// recorded outcome commit together. A redelivery returns the recorded
    /// outcome without running `work`. A redelivery with a different payload
    /// under the same id is [`Error::Mismatch`] (a producer bug: keep it as a
    /// dead letter). Contention re-runs `work`, a bounded number of times.
    pub async fn process<T, E, F>(
        &self,
        handler: &str,
        event_id: &str,
        payload: &[u8],
        work: F,
    ) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Contention,
    {
        self.process_call(&self.call(handler, event_id, payload)?, work).await
    }

    /// [`process`](Self::process) for a call built by [`call`](Self::call)
    /// or [`call_in`](Self::call_in): under another tenant (the same event
    /// id from two tenants is two events, and neither ever sees the other's
    /// recorded outcome), or with another policy (`call(..)?.with_policy`,
    /// a TTL of its own, for example).
    pub async fn process_call<T, E, F>(&self, call: &Call, work: F) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Contention,
    {
        Ok(match self.engine.execute(call, work).await? {
            Outcome::Executed(v) => Delivery::Applied(v),
            Outcome::Replayed(v) => Delivery::Duplicate(v),
        })
    }
}
