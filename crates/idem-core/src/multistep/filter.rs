//! Which operations an operator's listing selects, and where a page of it
//! ends.

use crate::error::{Error, Result};

use super::{MultiStep, MultiStepState, check_step_name};

/// The most operations one listing answers.
pub const MAX_MULTISTEP_PAGE: u32 = 1000;

/// Where an operation stands in a listing's order: the longest unchanged
/// first (`updated_at_ms`), then by id. The last operation of a page is
/// where the next page starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MultiStepCursor {
    /// When it last changed.
    pub updated_at_ms: i64,
    /// Its id.
    pub id: i64,
}

impl MultiStepCursor {
    /// Where `op` stands.
    pub fn of(op: &MultiStep) -> Self {
        Self {
            updated_at_ms: op.updated_at_ms,
            id: op.id,
        }
    }
}

/// Which operations a listing selects ([`MultiStepStore::list`]), and the
/// page it answers. Every filter given must hold; an empty `states` is any
/// state.
///
/// [`MultiStepStore::list`]: super::MultiStepStore::list
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiStepFilter {
    /// Only in one of these states (any, when empty).
    pub states: Vec<MultiStepState>,
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only this operation's (the scope's operation, `POST /v1/withdrawals`).
    pub operation: Option<String>,
    /// Only those at this recovery point: this many steps recorded.
    pub recovery_point: Option<u32>,
    /// Only those whose send of this external step is open: sent, and not
    /// answered yet (an operation held on an unknown outcome stands there).
    pub open_step: Option<String>,
    /// Only those unchanged since this time: `updated_at_ms` at most this.
    pub unchanged_since_ms: Option<i64>,
    /// Only those after this one in the listing's order (the last one of
    /// the previous page).
    pub after: Option<MultiStepCursor>,
    /// At most this many (1 to [`MAX_MULTISTEP_PAGE`]).
    pub limit: u32,
}

impl Default for MultiStepFilter {
    fn default() -> Self {
        Self {
            states: Vec::new(),
            tenant: None,
            operation: None,
            recovery_point: None,
            open_step: None,
            unchanged_since_ms: None,
            after: None,
            limit: 100,
        }
    }
}

impl MultiStepFilter {
    /// Refuses a page of no operations or of more than
    /// [`MAX_MULTISTEP_PAGE`], an empty tenant or operation (it would match
    /// nothing anyone meant), and an open step that is no step's name.
    pub fn check(&self) -> Result<()> {
        if self.limit == 0 || self.limit > MAX_MULTISTEP_PAGE {
            return Err(Error::InvalidRequest(format!(
                "a page of operations holds 1 to {MAX_MULTISTEP_PAGE} operations, not {}",
                self.limit
            )));
        }
        for (what, value) in [("tenant", &self.tenant), ("operation", &self.operation)] {
            if value.as_deref().is_some_and(str::is_empty) {
                return Err(Error::InvalidRequest(format!(
                    "an empty {what} matches no operation: give one, or leave the filter out"
                )));
            }
        }
        if let Some(step) = &self.open_step {
            check_step_name(step)?;
        }
        Ok(())
    }

    /// The states a store scans for this filter: those asked for (every
    /// one, when none is), less the final ones when an open step is asked
    /// for (an operation ends only with every send answered). Empty: no
    /// operation can match.
    pub fn scanned_states(&self) -> Vec<MultiStepState> {
        const ALL: [MultiStepState; 5] = [
            MultiStepState::Running,
            MultiStepState::Held,
            MultiStepState::Compensating,
            MultiStepState::Completed,
            MultiStepState::Compensated,
        ];
        ALL.into_iter()
            .filter(|s| self.states.is_empty() || self.states.contains(s))
            .filter(|s| self.open_step.is_none() || !s.is_final())
            .collect()
    }

    /// Whether `op` matches every filter, the page's start included.
    pub fn matches(&self, op: &MultiStep) -> bool {
        (self.states.is_empty() || self.states.contains(&op.state))
            && self.tenant.as_deref().is_none_or(|t| op.scope.tenant().as_str() == t)
            && self
                .operation
                .as_deref()
                .is_none_or(|o| op.scope.operation().as_str() == o)
            && self.recovery_point.is_none_or(|n| op.journal.len() == n as usize)
            && self
                .open_step
                .as_deref()
                .is_none_or(|s| op.open.as_ref().is_some_and(|open| open.step == s))
            && self.unchanged_since_ms.is_none_or(|t| op.updated_at_ms <= t)
            && self.after.is_none_or(|after| MultiStepCursor::of(op) > after)
    }
}
