//! Multi-step operations: the row that carries an operation's recovery
//! point ([`MultiStep`]), and its transitions.
//!
//! An operation is a sequence of named steps run under one idempotency key:
//! *local* steps commit in the caller's database transaction together with
//! the step's recorded output, *external* steps call another system (a
//! vendor) through the outbound client with a key derived from the
//! operation's key and the step's name ([`step_key`]). Each step's output is
//! recorded in the operation's [`Journal`] and replayed on resume, never
//! recomputed; the journal's length is the recovery point. Declared failures
//! start the operation's compensation, whose steps are journalled the same
//! way.
//!
//! Before an external step sends anything, the row is marked **sent**
//! ([`MultiStep::mark_sent`]) and that mark commits: from then on the call
//! may have reached the vendor. A runner that resumes such an operation
//! sends again with the same key while the vendor still remembers it and
//! asks the vendor past that; what cannot be established holds the
//! operation ([`MultiStepState::Held`], [`HoldKind::Unknown`]) for an operator's
//! verdict, and an operation whose send may have been applied is never
//! cancelled.
//!
//! # States
//!
//! ```text
//!              take (lease ran out)           finish
//!   (new) ──► running ─────────────────────────────────► completed
//!               │  ▲ ╲ fail (declared failure, cancel)
//!          hold │  │  ╲──────────► compensating ─────────► compensated
//!               ▼  │ resume / settle    │   ▲    finish
//!              held ◄───────────────────┘   │
//!                  └────────────────────────┘
//! ```
//!
//! Every runner write names the token it holds: a runner whose lease ran
//! out and was taken over ([`MultiStep::take`]) changes nothing
//! ([`Error::Fenced`]). An operator's action takes a new token, so it fences
//! any runner too. The transitions are methods of [`MultiStep`], pure
//! functions of the row and the store's clock, so every store makes the
//! same decisions.

mod filter;
mod journal;
mod op;
mod row;
mod store;
#[cfg(test)]
mod tests;

pub use filter::{MAX_MULTISTEP_PAGE, MultiStepCursor, MultiStepFilter};
pub use journal::{Journal, JournalEntry, StepKind, StepOutcome};
pub use op::{Hold, MultiStep, NewMultiStep, OpenSend, SendVerdict};
pub use row::MultiStepRow;
pub use store::MultiStepStore;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::scope::Scope;

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MultiStepState {
    /// Its forward steps run (or wait for a runner to take them).
    Running,
    /// Stopped at a step until an operator (or a verdict) lets it go on:
    /// see its [`Hold`].
    Held,
    /// A declared failure or a cancellation started its compensation, whose
    /// steps run (or wait for a runner).
    Compensating,
    /// Done: its response is recorded and replayed.
    Completed,
    /// Compensated after a declared failure: its response is recorded and
    /// replayed.
    Compensated,
}

impl MultiStepState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Held => "held",
            Self::Compensating => "compensating",
            Self::Completed => "completed",
            Self::Compensated => "compensated",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "running" => Self::Running,
            "held" => Self::Held,
            "compensating" => Self::Compensating,
            "completed" => Self::Completed,
            "compensated" => Self::Compensated,
            other => return Err(Error::Corrupt(format!("unknown operation state {other:?}"))),
        })
    }

    /// Whether it is final (completed or compensated).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Compensated)
    }

    /// Whether a runner may work on it (running or compensating).
    pub fn is_runnable(self) -> bool {
        matches!(self, Self::Running | Self::Compensating)
    }
}

/// Why an operation is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldKind {
    /// An external step's send may have reached the vendor and whether it
    /// was applied cannot be established: an operator's verdict settles it.
    Unknown,
    /// A step kept failing in a way worth retrying, past the operation's
    /// bound on runs.
    Exhausted,
    /// A step failed in a way no retry fixes (a broken contract, a
    /// compensation that failed).
    Failed,
    /// A resumed run did not ask for the step the journal recorded next, or
    /// a recorded output no longer decodes: the definition changed under a
    /// running operation.
    Nondeterministic,
    /// An operator held it.
    Operator,
}

impl HoldKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Exhausted => "exhausted",
            Self::Failed => "failed",
            Self::Nondeterministic => "nondeterministic",
            Self::Operator => "operator",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "unknown" => Self::Unknown,
            "exhausted" => Self::Exhausted,
            "failed" => Self::Failed,
            "nondeterministic" => Self::Nondeterministic,
            "operator" => Self::Operator,
            other => return Err(Error::Corrupt(format!("unknown hold kind {other:?}"))),
        })
    }
}

/// The longest step name.
pub const MAX_STEP_NAME: usize = 100;

/// The most bytes one step's recorded output (or a declared failure) may
/// take.
pub const MAX_STEP_OUTPUT: usize = 64 * 1024;

/// The most steps (forward and compensating) one operation may record.
pub const MAX_STEPS: usize = 256;

/// The most bytes an operation's whole journal may take, stored: with its
/// input and response, an operation's row stays well within what every
/// engine sends in one statement (MariaDB's default packet is 16 MiB).
pub const MAX_JOURNAL_BYTES: usize = 4 * 1024 * 1024;

/// The most bytes of an operation's recorded response.
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The most bytes of an operation's input.
pub const MAX_OPERATION_INPUT: usize = 64 * 1024;

/// Checks a step's name: 1 to [`MAX_STEP_NAME`] bytes of visible ASCII
/// other than `:` (which keys of compensation steps use).
pub fn check_step_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_STEP_NAME || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Err(Error::InvalidRequest(format!(
            "a step name is 1 to {MAX_STEP_NAME} visible ASCII characters other than ':', not {name:?}"
        )));
    }
    Ok(())
}

/// The idempotency key an external step sends to its vendor: derived from
/// the operation's scope and key and the step's name, so every attempt of
/// the step (by any runner, after any crash) carries the same key, two steps
/// never share one, and two tenants' operations never collide. It reveals
/// nothing of the key it is derived from: `idem-` and 40 hex digits of a
/// SHA-256 over the length-prefixed parts.
pub fn step_key(scope: &Scope, key: &IdempotencyKey, step: &str) -> IdempotencyKey {
    let mut h = Sha256::new();
    for part in [scope.tenant().as_str(), scope.operation().as_str(), key.as_str(), step] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = hex::encode(h.finalize());
    IdempotencyKey::new(format!("idem-{}", &digest[..40])).expect("a derived key is always valid")
}
