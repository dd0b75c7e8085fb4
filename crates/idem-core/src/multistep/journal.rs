//! The journal: each finished step's recorded outcome, in the order the
//! steps ran. Its length is the operation's recovery point.

use serde::{Deserialize, Serialize};

use super::{MAX_JOURNAL_BYTES, MAX_STEP_OUTPUT, MAX_STEPS, check_step_name};
use crate::error::{Error, Result};

/// How a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// In the caller's database transaction, committed with its output.
    Local,
    /// A call to another system, through the outbound client.
    External,
}

/// What a finished step gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcome {
    /// Its output (JSON), replayed on resume.
    Output(serde_json::Value),
    /// A declared failure (JSON): the operation compensates.
    Failed(serde_json::Value),
}

/// One finished step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// The step's name, unique within its direction (forward or
    /// compensation) of the operation.
    pub name: String,
    /// How it ran.
    pub kind: StepKind,
    /// Whether it is a compensation step.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub undo: bool,
    /// What it gave.
    pub outcome: StepOutcome,
    /// When it was recorded (ms since the epoch, the store's clock).
    pub at_ms: i64,
}

impl JournalEntry {
    fn check(&self) -> Result<()> {
        check_step_name(&self.name)?;
        let size = match &self.outcome {
            StepOutcome::Output(v) | StepOutcome::Failed(v) => serde_json::to_vec(v).map_or(usize::MAX, |b| b.len()),
        };
        if size > MAX_STEP_OUTPUT {
            return Err(Error::RecordTooLarge {
                size,
                limit: MAX_STEP_OUTPUT,
            });
        }
        Ok(())
    }
}

/// The steps an operation finished, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    entries: Vec<JournalEntry>,
    /// The JSON bytes of the entries, summed: the stored size, kept as the
    /// journal grows rather than encoded again for every step.
    entries_bytes: usize,
}

/// The JSON bytes of one entry, as the journal stores it.
fn entry_bytes(entry: &JournalEntry) -> usize {
    serde_json::to_vec(entry).map_or(usize::MAX, |b| b.len())
}

/// The first byte of an encoded journal: its format.
const FORMAT_V1: u8 = 0x01;

impl Journal {
    /// An empty journal.
    pub fn new() -> Self {
        Self::default()
    }

    /// The entries, in the order the steps finished.
    pub fn entries(&self) -> &[JournalEntry] {
        &self.entries
    }

    /// How many steps finished: the recovery point.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no step finished.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of the `index`-th finished step.
    pub fn get(&self, index: usize) -> Option<&JournalEntry> {
        self.entries.get(index)
    }

    /// The entry of the step named `name` in the given direction.
    pub fn find(&self, name: &str, undo: bool) -> Option<&JournalEntry> {
        self.entries.iter().find(|e| e.name == name && e.undo == undo)
    }

    /// Appends a finished step. Refuses a bad name, an output over
    /// [`MAX_STEP_OUTPUT`], a name already recorded in the same direction,
    /// a journal already holding [`MAX_STEPS`] steps, and one that would
    /// grow past [`MAX_JOURNAL_BYTES`].
    pub fn push(&mut self, entry: JournalEntry) -> Result<()> {
        entry.check()?;
        if self.find(&entry.name, entry.undo).is_some() {
            return Err(Error::InvalidRequest(format!(
                "step {:?} is already recorded",
                entry.name
            )));
        }
        if self.entries.len() >= MAX_STEPS {
            return Err(Error::InvalidRequest(format!(
                "an operation records at most {MAX_STEPS} steps"
            )));
        }
        let added = entry_bytes(&entry);
        // The format byte, the brackets, the entries and a comma between two.
        let size = (3 + self.entries.len())
            .saturating_add(self.entries_bytes)
            .saturating_add(added);
        if size > MAX_JOURNAL_BYTES {
            return Err(Error::RecordTooLarge {
                size,
                limit: MAX_JOURNAL_BYTES,
            });
        }
        self.entries.push(entry);
        self.entries_bytes += added;
        Ok(())
    }

    /// The stored form: a format byte, then JSON.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_V1];
        serde_json::to_writer(&mut out, &self.entries).expect("journal entries always serialise");
        out
    }

    /// Reads [`encode`](Self::encode)'s form; an empty column is an empty
    /// journal.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        match bytes.split_first() {
            None => Ok(Self::new()),
            Some((&FORMAT_V1, json)) => {
                let entries: Vec<JournalEntry> =
                    serde_json::from_slice(json).map_err(|e| Error::Corrupt(format!("journal: {e}")))?;
                let entries_bytes = entries.iter().map(entry_bytes).sum();
                Ok(Self { entries, entries_bytes })
            }
            Some((format, _)) => Err(Error::Corrupt(format!("journal of unknown format {format:#04x}"))),
        }
    }
}
