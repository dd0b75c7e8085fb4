//! Named fault points of a run and the recovery-point switch, for
//! reliability harnesses (feature `fault-injection`; the default build has
//! neither).
//!
//! A harness installs a hook that decides, at each point, whether to stop
//! the process there (and then kills it from outside), and can switch the
//! recovery points off to prove its checker catches the effects they
//! prevent from running twice.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where in a run a fault can strike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Point {
    /// A local step's work is done in its transaction; nothing of it is
    /// committed.
    BeforeStepCommit,
    /// A step's output is recorded (with a local step's writes); the next
    /// step has not started.
    AfterStepCommit,
    /// An external step is marked sent; nothing is sent yet.
    AfterSentMark,
    /// An external step's send was answered; the answer is not recorded.
    AfterAnswer,
}

impl Point {
    /// Every point.
    pub const ALL: [Point; 4] = [
        Point::BeforeStepCommit,
        Point::AfterStepCommit,
        Point::AfterSentMark,
        Point::AfterAnswer,
    ];

    /// The point's name (`before_step_commit`, `after_step_commit`,
    /// `after_sent_mark`, `after_answer`).
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeStepCommit => "before_step_commit",
            Point::AfterStepCommit => "after_step_commit",
            Point::AfterSentMark => "after_sent_mark",
            Point::AfterAnswer => "after_answer",
        }
    }

    /// The point named `name`.
    pub fn parse(name: &str) -> Option<Point> {
        Point::ALL.into_iter().find(|p| p.name() == name)
    }
}

type Hook = Box<dyn Fn(Point, &str) + Send + Sync>;

static HOOK: OnceLock<Hook> = OnceLock::new();
static SKIP_RECOVERY_POINTS: AtomicBool = AtomicBool::new(false);

/// Installs the hook called at every fault point with the step's name
/// (once per process; `false` if one was installed already).
pub fn set_hook(hook: impl Fn(Point, &str) + Send + Sync + 'static) -> bool {
    HOOK.set(Box::new(hook)).is_ok()
}

/// Switches the recovery points off (`true`): a run that takes an
/// operation over forgets its journal and its sent mark and runs it from
/// the first step. Only for proving that a checker detects the effects
/// that then run twice.
pub fn set_skip_recovery_points(on: bool) {
    SKIP_RECOVERY_POINTS.store(on, Ordering::SeqCst);
}

pub(crate) fn skips_recovery_points() -> bool {
    SKIP_RECOVERY_POINTS.load(Ordering::SeqCst)
}

pub(crate) fn hit(point: Point, step: &str) {
    if let Some(hook) = HOOK.get() {
        hook(point, step);
    }
}
