//! `idem events`: the dead letters that JetStream inbox consumers kept,
//! listed and redriven.
//!
//! A redrive publishes each selected dead letter again to its event's
//! subject, for the handler that kept it alone; that handler's consumer
//! runs it once through its inbox (an event the inbox records as applied is
//! not run again), and the dead letter leaves its stream once the copy is
//! stored. Capped (`--max`) and paced (`--per-second`) like `idem dlq
//! redrive`.

use std::time::Duration;

use clap::Subcommand;
use idem_jetstream::{ConsumerError, DeadLetterFilter, RedriveOptions, StoredDeadLetter};

use crate::output::{Failure, print, refuse_empty_filters, say};

/// The NATS server, the dead-letter stream and which letters to select.
#[derive(Debug, clap::Args)]
pub(crate) struct Selection {
    /// The NATS server.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// The dead-letter stream (the ledger's: LEDGER_DEAD).
    #[arg(long)]
    stream: String,
    /// Only those kept by this handler.
    #[arg(long)]
    handler: Option<String>,
    /// Only this event.
    #[arg(long)]
    event_id: Option<String>,
    /// Only sequences greater than this (the last of the previous page).
    #[arg(long)]
    after_seq: Option<u64>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum EventsCommand {
    /// Dead letters in a dead-letter stream, oldest first.
    DeadLetters {
        #[command(flatten)]
        selection: Selection,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
    /// Publishes dead letters again for the handler that kept them, which
    /// runs each once; each redriven letter leaves the stream.
    Redrive {
        #[command(flatten)]
        selection: Selection,
        /// At most this many dead letters redriven.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        max: u32,
        /// At most this many copies published per second.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000))]
        per_second: u32,
    },
}

impl Selection {
    fn filter(&self, limit: u32) -> Result<DeadLetterFilter, Failure> {
        refuse_empty_filters(&[("--handler", &self.handler), ("--event-id", &self.event_id)])?;
        Ok(DeadLetterFilter {
            handler: self.handler.clone(),
            event_id: self.event_id.clone(),
            after_seq: self.after_seq,
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
        })
    }

    async fn connect(&self) -> Result<idem_jetstream::async_nats::jetstream::Context, Failure> {
        let url = idem_core::redact_credentials(&self.nats_url);
        let client = idem_jetstream::async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(&self.nats_url)
            .await
            .map_err(|e| Failure(3, format!("cannot connect to NATS at {url}: {e}")))?;
        Ok(idem_jetstream::async_nats::jetstream::new(client))
    }
}

fn failure(e: ConsumerError) -> Failure {
    match e {
        ConsumerError::Config(m) => Failure(2, m),
        other => Failure(3, other.to_string()),
    }
}

fn letter_json(l: &StoredDeadLetter) -> serde_json::Value {
    serde_json::json!({
        "seq": l.seq,
        "handler": l.handler,
        "event_id": l.event_id,
        "subject": l.subject,
        "deliveries": l.deliveries,
        "error": l.error,
        "redriven_before": l.redriven,
        "stored_at_ms": l.stored_at_ms,
        "payload_bytes": l.payload.len(),
    })
}

pub(crate) async fn run(command: EventsCommand, json: bool) -> Result<(), Failure> {
    match command {
        EventsCommand::DeadLetters { selection, limit } => {
            let filter = selection.filter(limit)?;
            let js = selection.connect().await?;
            let letters = idem_jetstream::dead_letters(&js, &selection.stream, &filter)
                .await
                .map_err(failure)?;
            if json {
                let items: Vec<_> = letters.iter().map(letter_json).collect();
                say!(
                    "{}",
                    serde_json::json!({ "stream": selection.stream, "dead_letters": items })
                );
            } else {
                for l in &letters {
                    say!(
                        "{} {} {} {} after {} deliveries{}: {}",
                        l.seq,
                        l.handler.as_deref().unwrap_or("-"),
                        l.event_id.as_deref().unwrap_or("-"),
                        l.subject.as_deref().unwrap_or("-"),
                        l.deliveries.map_or_else(|| "?".into(), |d| d.to_string()),
                        if l.redriven { " (redriven before)" } else { "" },
                        l.error
                    );
                }
                say!("{}: {} dead letter(s)", selection.stream, letters.len());
            }
        }
        EventsCommand::Redrive {
            selection,
            max,
            per_second,
        } => {
            let filter = selection.filter(max)?;
            let js = selection.connect().await?;
            let options = RedriveOptions {
                max: usize::try_from(max).unwrap_or(usize::MAX),
                per_second,
            };
            let report = idem_jetstream::redrive(&js, &selection.stream, &filter, options)
                .await
                .map_err(failure)?;
            let failed: Vec<_> = report
                .failed
                .iter()
                .map(|(seq, why)| serde_json::json!({ "seq": seq, "error": why }))
                .collect();
            print(
                json,
                serde_json::json!({ "stream": selection.stream, "redriven": report.redriven, "failed": failed }),
                format!(
                    "{}: {} redriven {:?}, {} left{}",
                    selection.stream,
                    report.redriven.len(),
                    report.redriven,
                    report.failed.len(),
                    report
                        .failed
                        .iter()
                        .map(|(seq, why)| format!("\n  {seq}: {why}"))
                        .collect::<String>()
                ),
            );
            if !report.failed.is_empty() {
                return Err(Failure(
                    1,
                    format!("{} dead letter(s) not redriven", report.failed.len()),
                ));
            }
        }
    }
    Ok(())
}
