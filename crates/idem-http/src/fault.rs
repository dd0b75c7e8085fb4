//! Named fault points and the idempotency bypass, for reliability harnesses.
//!
//! Compiled only with the `fault-injection` feature; the default build has
//! neither the points nor the switch. A harness installs a hook that decides,
//! at each point, whether to stop the process there (and then kills it from
//! outside), and can switch the claim off to prove its checker catches
//! double applications.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where in a request a fault can strike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Point {
    /// The key is claimed; the handler has not run.
    AfterClaim,
    /// The handler has written and answered; nothing is committed yet.
    BeforeCommit,
    /// Everything is committed; the response has not been sent.
    AfterCommit,
}

impl Point {
    /// Every point.
    pub const ALL: [Point; 3] = [Point::AfterClaim, Point::BeforeCommit, Point::AfterCommit];

    /// The point's name (`after_claim`, `before_commit`, `after_commit`).
    pub fn name(self) -> &'static str {
        match self {
            Point::AfterClaim => "after_claim",
            Point::BeforeCommit => "before_commit",
            Point::AfterCommit => "after_commit",
        }
    }
}

type Hook = Box<dyn Fn(Point) + Send + Sync>;

static HOOK: OnceLock<Hook> = OnceLock::new();
static BYPASS: AtomicBool = AtomicBool::new(false);
static SKIP_SENT_MARK: AtomicBool = AtomicBool::new(false);

/// Installs the hook called at every fault point (once per process).
pub fn set_hook(hook: impl Fn(Point) + Send + Sync + 'static) -> bool {
    HOOK.set(Box::new(hook)).is_ok()
}

/// Switches the idempotency claim off (`true`): keyed requests then run as
/// if they had no key. Only for proving that a checker detects double
/// applications.
pub fn set_bypass(on: bool) {
    BYPASS.store(on, Ordering::SeqCst);
}

/// The environment variable that switches the sent mark off for the
/// process (any value), as [`set_skip_sent_mark`] does: `idem gateway`
/// built with fault injection, under a harness that must see the double
/// sends the mark prevents.
pub const SKIP_SENT_MARK_ENV: &str = "IDEM_FAULT_SKIP_SENT_MARK";

/// Switches the lease-mode sent mark off (`true`): a lease then reaches the
/// handler unmarked, and a holder that dies mid-request leaves a key the
/// next claimer takes over and sends again. Only for proving that a checker
/// detects the double applications the mark prevents.
pub fn set_skip_sent_mark(on: bool) {
    SKIP_SENT_MARK.store(on, Ordering::SeqCst);
}

pub(crate) fn skips_sent_mark() -> bool {
    static FROM_ENV: OnceLock<bool> = OnceLock::new();
    let from_env = *FROM_ENV.get_or_init(|| {
        let set = std::env::var_os(SKIP_SENT_MARK_ENV).is_some();
        if set {
            tracing::warn!("fault injection: the sent mark is off; keys of killed requests are sent again");
        }
        set
    });
    from_env || SKIP_SENT_MARK.load(Ordering::SeqCst)
}

pub(crate) fn hit(point: Point) {
    if let Some(hook) = HOOK.get() {
        hook(point);
    }
}

pub(crate) fn bypassed() -> bool {
    BYPASS.load(Ordering::SeqCst)
}
