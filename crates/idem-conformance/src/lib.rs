//! The conformance suite: the same behavioural tests, run against every store.
//!
//! A store crate implements [`Subject`] in its tests and expands
//! [`tx_conformance!`] and/or [`lease_conformance!`] with an engine name, which
//! generates one `#[tokio::test]` per behaviour, named
//! `<engine>::<behaviour>` so failures say which engine broke what.
//! A store that passes it is correct by definition.
//!
//! Dead-letter stores implement [`DeadLetterSubject`] and expand
//! [`deadletter_conformance!`] the same way. A store whose lease store is
//! also an operator's view of its keys ([`KeyAdmin`](idem_core::KeyAdmin))
//! expands [`admin_conformance!`] with its lease [`Subject`]. A SQL
//! dead-letter store also runs the migration tests of [`sql_deadletters`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::{
    BoxError, BoxFuture, Call, Classify, Consume, Contention, DeadLetterStore, Error, Fingerprint, IdempotencyKey,
    InFlight, LeaseEngine, LeaseStore, ManualClock, Outcome, PendingMigration, Policy, Retryable, Scope, SharedClock,
    Sweep, SweepOptions, TxBackend, TxEngine,
};
use serde::{Deserialize, Serialize};

pub mod admin_tests;
pub mod deadletter_tests;
pub mod env;
pub mod lease_tests;
pub mod multistep_tests;
mod ports;
pub mod read_first_tests;
mod running;
pub mod sent_tests;
pub mod sql_deadletters;
pub mod steps_tests;
pub mod tx_tests;
pub mod wire;

pub use ports::{free_port, free_port_beside};
pub use read_first_tests::CountingClaims;
pub use running::Running;

/// A store under test.
pub trait Subject: Clone + Send + Sync + 'static {
    /// The transactional backend (use the memory or a SQL store).
    type Backend: TxBackend;
    /// The lease store.
    type Lease: LeaseStore;
    /// The sweeper.
    type Sweeper: Sweep;

    /// A handle on the transactional backend.
    fn backend(&self) -> Self::Backend;
    /// A handle on the lease store.
    fn lease_store(&self) -> Self::Lease;
    /// A handle on the sweeper.
    fn sweeper(&self) -> Self::Sweeper;
    /// Writes the business row `effect_id` inside `tx` (the caller's own write).
    fn write_effect<'c>(
        tx: &'c mut <Self::Backend as TxBackend>::Tx,
        effect_id: String,
    ) -> BoxFuture<'c, Result<(), BoxError>>;
    /// Counts committed business rows named `effect_id`.
    fn count_effects(&self, effect_id: String) -> BoxFuture<'_, Result<u64, BoxError>>;
    /// Another handle on the same data through its own connection pool, so
    /// concurrency tests cross pools as separate processes would.
    fn another(&self) -> BoxFuture<'_, Self>;
    /// A handle on a fresh, empty keys table (for tests that sweep a whole table).
    fn isolated(&self) -> BoxFuture<'_, Self>;
}

/// A dead-letter store under test.
pub trait DeadLetterSubject: Clone + Send + Sync + 'static {
    /// The store.
    type Store: DeadLetterStore;

    /// A handle on the store.
    fn store(&self) -> Self::Store;
    /// Another handle on the same letters through its own connection pool,
    /// so concurrency tests cross pools as separate processes would.
    fn another(&self) -> BoxFuture<'_, Self::Store>;
    /// A subject on a fresh, empty table (for tests that list or purge a
    /// whole table).
    fn isolated(&self) -> BoxFuture<'_, Self>;
    /// Lets at least `ms` pass on the store's clock: advances a manual
    /// clock, or sleeps when the store reads its database's clock.
    fn elapse(&self, ms: u64) -> BoxFuture<'_, ()>;
}

/// The versions of `pending` migrations, in order.
pub fn versions(pending: &[PendingMigration]) -> Vec<i64> {
    pending.iter().map(|m| m.version).collect()
}

/// A value with bytes that must survive storage exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Random per execution: replays must show the same one.
    pub id: String,
    /// Unicode, quotes, escapes and whitespace.
    pub note: String,
    /// A large number.
    pub amount: i64,
}

impl Receipt {
    /// A new receipt with a random id.
    pub fn new(amount: i64) -> Self {
        Self {
            id: uuid::Uuid::new_v4().to_string(),
            note: "crédit “ünïcødé” \\ \" \t\n 🚀".into(),
            amount,
        }
    }
}

/// A business rejection used by the tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decline {
    /// Final: recorded when the policy asks for it.
    InsufficientFunds {
        /// How much was missing.
        short_by: i64,
    },
    /// Transient: never recorded.
    VendorBusy,
}

impl Classify for Decline {
    fn retryable(&self) -> Retryable {
        match self {
            Decline::InsufficientFunds { .. } => Retryable::Fatal,
            Decline::VendorBusy => Retryable::Transient,
        }
    }
}

/// The test's own error type.
#[derive(Debug)]
pub enum TestError {
    /// From idem.
    Idem(Error),
    /// From the work.
    Work(String),
}

impl From<Error> for TestError {
    fn from(e: Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<BoxError> for TestError {
    fn from(e: BoxError) -> Self {
        // A store's own error (a deadlock in the work's statement) keeps its
        // kind, so the engine can tell contention and run the work again.
        match e.downcast::<Error>() {
            Ok(e) => TestError::Idem(*e),
            Err(e) => TestError::Work(e.to_string()),
        }
    }
}

impl Contention for TestError {
    fn is_contention(&self) -> bool {
        matches!(self, TestError::Idem(e) if e.is_contention())
    }
}

/// A unique scope for one test, so tests never see each other's keys.
pub fn unique_scope(operation: &str) -> Scope {
    Scope::parse(&format!("tenant-{}", uuid::Uuid::new_v4()), operation).expect("valid scope")
}

/// A call on a fresh key with `body` fingerprinted as JSON.
pub fn call_for(scope: &Scope, key: &IdempotencyKey, body: &str, policy: Policy) -> Call {
    let fp = Fingerprint::of_json(scope.operation(), body.as_bytes()).expect("valid json");
    Call::new(scope.clone(), key.clone(), fp).with_policy(policy)
}

/// A call of a fresh key in a scope of its own for `operation`, with
/// `body` fingerprinted as JSON.
pub fn fresh_call(operation: &str, body: &str, policy: Policy) -> Call {
    call_for(&unique_scope(operation), &IdempotencyKey::generate(), body, policy)
}

/// A unique effect id.
pub fn effect_id() -> String {
    format!("effect-{}", uuid::Uuid::new_v4())
}

/// A manual clock starting at the current time.
pub fn manual_clock() -> (ManualClock, SharedClock) {
    let clock = ManualClock::starting_now();
    let shared: SharedClock = Arc::new(clock.clone());
    (clock, shared)
}

/// A policy whose twins wait up to `ms`.
pub fn waiting(ms: u64) -> Policy {
    Policy::default().with_in_flight(InFlight::Wait { max_ms: ms })
}

/// A policy whose twins are rejected at once.
pub fn rejecting() -> Policy {
    Policy::default().with_in_flight(InFlight::Reject)
}

/// A policy that records final rejections.
pub fn recording_rejections() -> Policy {
    Policy::default().with_consume(Consume::SuccessOrFinalRejection)
}

/// Counts how many times work ran.
#[derive(Clone, Default, Debug)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    /// Notes one run.
    pub fn hit(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    /// Runs so far.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

pub(crate) fn tx_engine<S: Subject>(s: &S) -> TxEngine<S::Backend> {
    TxEngine::new(s.backend())
}

pub(crate) fn lease_engine<S: Subject>(s: &S) -> LeaseEngine<S::Lease> {
    LeaseEngine::new(s.lease_store())
}

/// Runs `call` on `engine` with work that notes its run in `runs` and
/// answers a receipt of `amount`.
pub(crate) async fn run_counted<L: LeaseStore>(
    engine: &LeaseEngine<L>,
    call: &Call,
    runs: &Runs,
    amount: i64,
) -> Result<Outcome<Receipt>, TestError> {
    let runs = runs.clone();
    engine
        .run(call, move |_lease| async move {
            runs.hit();
            Ok::<_, TestError>(Receipt::new(amount))
        })
        .await
}

/// Starts `n` tasks, task `i` running `task(i)` once all `n` have started,
/// so they contend as closely as they can.
pub(crate) fn spawn_together<T, F>(n: usize, task: impl Fn(usize) -> F) -> Vec<tokio::task::JoinHandle<T>>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    (0..n)
        .map(|i| {
            let (barrier, work) = (barrier.clone(), task(i));
            tokio::spawn(async move {
                barrier.wait().await;
                work.await
            })
        })
        .collect()
}

/// A sweep in batches of `batch_size` with no rest between them, until
/// nothing expired is left.
pub(crate) fn unpaced_sweep(batch_size: u32) -> SweepOptions {
    SweepOptions {
        batch_size,
        pause: std::time::Duration::ZERO,
        busy_percent: 100,
        max_batches: None,
    }
}

/// The start of most lease tests: a lease engine of `s` on a manual clock,
/// and a call of a fresh key in a scope of its own under `policy`.
pub(crate) fn clocked_lease<S: Subject>(s: &S, policy: Policy) -> (ManualClock, LeaseEngine<S::Lease>, Call) {
    let (clock, shared) = manual_clock();
    let engine = lease_engine(s).with_clock(shared);
    (clock, engine, fresh_call("op", "{}", policy))
}

/// One test per case of a scenario: each case is a
/// `#[tokio::test]` on a multi-threaded runtime of `$threads` workers,
/// named as listed and awaiting `$scenario` with the case's arguments. A
/// scenario run on several engines or settings is written once, and its
/// cases read as a table.
///
/// ```text
/// idem_conformance::cases!(two_instances_one_effect, 4 => {
///     two_instances_on_postgres(Engine::Postgres);
///     /// One file, shared by the two processes.
///     two_instances_on_one_sqlite_file(Engine::Sqlite);
/// });
/// ```
#[macro_export]
macro_rules! cases {
    ($scenario:path, $threads:literal => { $( $(#[$attr:meta])* $name:ident($($arg:expr),* $(,)?); )+ }) => {
        $(
            $(#[$attr])*
            #[::tokio::test(flavor = "multi_thread", worker_threads = $threads)]
            async fn $name() {
                $scenario($($arg),*).await;
            }
        )+
    };
}

/// Generates the transactional-mode conformance tests for a store, in a
/// module named `$engine`. `$make` is an async expression producing the
/// [`Subject`].
#[macro_export]
macro_rules! tx_conformance {
    ($engine:ident, $make:expr) => {
        mod $engine {
            #[allow(unused_imports)]
            use super::*;
            $crate::tx_behaviours!([$crate::__suite_test] tx_tests, $make);
            $crate::read_first_behaviours!([$crate::__suite_test] read_first_tests, $make);
        }
    };
}

/// Generates the lease-mode conformance tests for a store, in a module named
/// `$engine`.
#[macro_export]
macro_rules! lease_conformance {
    ($engine:ident, $make:expr) => {
        mod $engine {
            #[allow(unused_imports)]
            use super::*;
            $crate::lease_behaviours!([$crate::__suite_test] lease_tests, $make);
            $crate::unknown_outcome_behaviours!([$crate::__suite_test] lease_tests, $make);
            $crate::sent_behaviours!([$crate::__suite_test] sent_tests, $make);
        }
    };
}

/// Generates the conformance tests of a store of multi-step operations
/// ([`multistep_tests`], and [`steps_tests`]: operations run by
/// `idem_steps::StepsEngine` on it) in a module named `$engine`. `$make` is an async
/// expression producing the [`MultiStepSubject`](multistep_tests::MultiStepSubject).
#[macro_export]
macro_rules! multistep_conformance {
    ($engine:ident, $make:expr) => {
        mod $engine {
            #[allow(unused_imports)]
            use super::*;
            $crate::__suite_test!(multistep_tests, $make;
                multistep_insert_commits_with_the_step,
                multistep_rolled_back_insert_leaves_nothing,
                multistep_twin_insert_is_refused,
                multistep_stale_write_writes_nothing,
                multistep_one_of_concurrent_writers_wins,
                multistep_due_lists_what_a_runner_may_take,
                multistep_list_follows_every_filter,
                multistep_list_pages_by_cursor
            );
            $crate::__suite_test!(steps_tests, $make;
                steps_complete_once_and_replay,
                steps_lost_answer_resends_the_same_key,
                steps_dead_run_is_resumed_after_its_lease,
                steps_declared_failure_is_compensated_once,
                steps_unknown_outcome_is_held,
                steps_twins_run_each_step_once,
                steps_first_step_rejection_leaves_the_key_unused,
                steps_first_step_rejection_is_recorded_when_consumed,
                steps_store_faults_on_a_recorded_refusal,
                steps_refusal_too_large_to_record_is_answered_unrecorded,
                steps_recorded_refusal_answers_as_a_twin_that_started_first,
                steps_completer_finishes_what_the_caller_left,
                steps_completers_race_each_operation_once,
                steps_failure_returned_by_the_operation_is_compensated,
                steps_no_send_starts_after_the_lease,
                steps_run_killed_at_each_boundary_resumes_once,
                steps_unknown_outcome_is_resolved_by_a_verdict,
                steps_store_faults_leave_each_effect_once,
                steps_purge_deletes_only_expired_final_operations
            );
        }
    };
}

/// Generates the operator conformance tests ([`KeyAdmin`](idem_core::KeyAdmin):
/// counts, listings, exact lookups, purges) for a store whose lease store
/// is also its operator's view, in a module named `$engine`.
#[macro_export]
macro_rules! admin_conformance {
    ($engine:ident, $make:expr) => {
        mod $engine {
            #[allow(unused_imports)]
            use super::*;
            $crate::admin_behaviours!([$crate::__suite_test] admin_tests, $make);
        }
    };
}

/// Generates the dead-letter conformance tests for a store, in a module
/// named `$engine`. `$make` is an async expression producing the
/// [`DeadLetterSubject`].
#[macro_export]
macro_rules! deadletter_conformance {
    ($engine:ident, $make:expr) => {
        mod $engine {
            #[allow(unused_imports)]
            use super::*;
            $crate::__suite_test!(deadletter_tests, $make;
                dead_letter_round_trips_every_field,
                recording_twice_updates_one_row,
                recording_again_keeps_the_strictest_send_terms,
                recording_a_held_letter_keeps_its_hold,
                unknown_outcomes_are_held_until_settled,
                first_reach_is_kept_and_a_redrive_replaces_it,
                only_a_letter_known_not_applied_is_cancelled,
                a_held_letter_can_be_pointed_elsewhere,
                keys_are_scoped_and_exact,
                list_filters_and_pages_in_id_order,
                begin_redrive_takes_a_letter_once,
                held_letter_is_not_taken_again,
                expired_hold_is_taken_again_and_fences_the_old_token,
                resolved_letter_is_final,
                failed_redrive_is_dead_again,
                purge_resolved_deletes_only_old_resolved,
                missing_letters_and_bad_holds
            );
        }
    };
}

/// Expands to `callback!(args; names)`, `names` being the transactional
/// behaviours of [`tx_tests`] that [`tx_conformance!`] runs, so a harness of
/// its own (a cluster's, running them on nodes of its choice) runs the same
/// list.
#[macro_export]
macro_rules! tx_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            replay_is_verbatim,
            raw_record_bytes_replay_exactly,
            mismatch_is_an_error_and_runs_nothing,
            rejection_leaves_key_unused,
            error_leaves_key_unused,
            panic_leaves_key_unused,
            dropped_future_leaves_key_unused,
            final_rejection_is_recorded_when_policy_says,
            transient_rejection_is_never_recorded,
            twin_waits_then_replays,
            twin_claims_after_first_rolls_back,
            twin_reported_in_flight,
            tenant_isolation,
            operation_isolation,
            expired_key_executes_anew,
            sweep_deletes_expired_in_batches,
            concurrent_64_tasks_one_key_one_effect,
            concurrent_64_tasks_distinct_keys,
            oversized_record_rolls_back,
            work_contention_runs_again,
            contention_retries_are_bounded,
            tx_commit_refused_or_lost_applies_once
        );
    };
}

/// Expands to `callback!(args; names)`, `names` being the behaviours of
/// [`read_first_tests`] (an engine that reads before it claims), which
/// [`tx_conformance!`] runs beside [`tx_behaviours!`].
#[macro_export]
macro_rules! read_first_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            read_first_replays_without_a_transaction,
            read_first_claims_an_expired_key,
            read_first_twin_waits_then_replays,
            read_first_concurrent_64_tasks_one_key_one_effect,
            read_first_leaves_a_lease_to_the_claim,
            read_first_failed_read_runs_nothing
        );
    };
}

/// Expands to `callback!(args; names)`, `names` being the lease-mode
/// behaviours of unknown outcomes in [`lease_tests`] (held, resolved either
/// way, resolved once under concurrency), which [`lease_conformance!`] runs
/// beside [`lease_behaviours!`].
#[macro_export]
macro_rules! unknown_outcome_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            lease_unknown_outcome_is_held,
            lease_unknown_outcome_resolved_applied,
            lease_unknown_outcome_resolved_not_applied,
            lease_unknown_outcome_resolved_once_under_concurrency
        );
    };
}

/// Expands to `callback!(args; names)`, `names` being the lease-mode
/// behaviours of [`lease_tests`] that every lease store passes, on one
/// server or a cluster (all but those of unknown outcomes), so a harness
/// of its own runs the same list as [`lease_conformance!`].
#[macro_export]
macro_rules! lease_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            lease_claim_complete_replay,
            lease_mismatch,
            lease_release_leaves_key_unused,
            lease_error_releases_and_panic_holds_the_key,
            lease_live_claim_is_in_flight,
            lease_twin_waits_then_replays,
            lease_takeover_after_expiry,
            lease_stale_holder_is_fenced,
            lease_extend_keeps_the_claim,
            lease_extend_outlives_the_key_ttl,
            lease_final_rejection_recorded_when_policy_says,
            lease_tenant_and_operation_isolation,
            lease_expired_key_executes_anew,
            lease_sweep_deletes_expired,
            lease_concurrent_64_tasks_one_key_one_effect,
            lease_heartbeat_keeps_a_slow_holder,
            lease_lost_heartbeat_is_reported,
            lease_outcome_recorded_after_a_drop,
            lease_skewed_host_cannot_take_over,
            lease_abandoned_claim_is_released
        );
    };
}

/// Expands to `callback!(args; names)`, `names` being the behaviours of
/// sent claims in [`sent_tests`].
#[macro_export]
macro_rules! sent_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            sent_claim_is_never_taken_over,
            sent_mark_keeps_the_earliest_time,
            sent_mark_of_a_new_claim_starts_afresh,
            sent_claim_resolved_like_unknown,
            sent_claim_holder_extends_and_releases,
            sent_dropped_run_is_held_not_taken_over,
            sent_refused_completion_is_retried,
            sent_refused_release_is_retried,
            sent_refused_mark_runs_nothing
        );
    };
}

/// Expands to `callback!(args; names)`, `names` being the operator
/// behaviours of [`admin_tests`].
#[macro_export]
macro_rules! admin_behaviours {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*!($($args)*;
            purge_spares_keys_claimed_during_the_purge,
            find_key_is_exact,
            stats_count_keys_by_state,
            list_and_purge_follow_every_filter
        );
    };
}

/// Expands, inside `impl Subject for …`, to the associated types and
/// getters of a subject whose field `store`, of type `$store`, is at once
/// its backend, its lease store and its sweeper.
#[macro_export]
macro_rules! one_store_subject {
    ($store:ty) => {
        type Backend = $store;
        type Lease = $store;
        type Sweeper = $store;

        fn backend(&self) -> $store {
            self.store.clone()
        }

        fn lease_store(&self) -> $store {
            self.store.clone()
        }

        fn sweeper(&self) -> $store {
            self.store.clone()
        }
    };
}

/// One `#[tokio::test]` a name, each running `$module::$name` on the
/// subject `$make` gives.
#[doc(hidden)]
#[macro_export]
macro_rules! __suite_test {
    ($module:ident, $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let subject = $make.await;
                $crate::$module::$name(subject).await;
            }
        )*
    };
}
