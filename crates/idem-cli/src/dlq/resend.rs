//! [`ResendArgs`]: how `idem dlq redrive` sends, and what it takes as the
//! vendor's answer.

use std::time::Duration;

use idem_core::DeadLetterStore;

use crate::output::Failure;

/// The longest key horizon `--key-horizon-secs` takes (366 days).
const MAX_HORIZON_SECS: u64 = 31_622_400;

/// How `dlq redrive` sends: the target, the vendor's key horizon, the
/// operator's override and the secret headers.
#[derive(Debug, clap::Args)]
pub(crate) struct ResendArgs {
    /// Send to this URL instead of each letter's own (a vendor URL fixed
    /// since), and keep it in each letter sent.
    #[arg(long)]
    url: Option<String>,
    /// How long the vendor remembers idempotency keys, in seconds (0: it
    /// has none). By default each letter's own: the horizon its sends were
    /// made under, kept with it; a letter that does not say is refused, not
    /// sent. Given, the shorter of this and the letter's applies. A letter
    /// whose first send may have reached the vendor longer ago is held as
    /// unknown, not sent.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_HORIZON_SECS))]
    key_horizon_secs: Option<u64>,
    /// Kept from the horizon, in seconds (default the letter's; with
    /// `--key-horizon-secs`, an hour, at most a tenth of a horizon shorter
    /// than ten hours). The longer of this and the letter's applies.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_HORIZON_SECS))]
    horizon_margin_secs: Option<u64>,
    /// How long after a send started the vendor's "not found" is trusted,
    /// in seconds (default the attempt timeout plus 5 s). The longer of
    /// this and the letter's applies.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    settle_secs: Option<u64>,
    /// Send letters past the horizon anyway: you have checked the vendor
    /// (a letter held as unknown still needs `idem dlq resolve`).
    #[arg(long)]
    past_horizon: bool,
    /// How long each letter is held against other redrives once taken, in
    /// seconds (default: the deadline plus 30 s). A redrive that dies
    /// leaves its letters `redriving` until their hold runs out; no send is
    /// started with less than a third of the hold left.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    hold_secs: Option<u64>,
    /// A field the vendor's 2xx answer must hold as a non-empty string, as
    /// its contract promises (`id`). Repeatable. An answer without it holds the
    /// letter as unknown, for `idem dlq resolve`, instead of resolving it.
    #[arg(long = "answer-field", value_name = "NAME")]
    answer_fields: Vec<String>,
    /// A field of the request's JSON body the 2xx answer must repeat with
    /// the same value (`amount`, `reference`). Repeatable; as
    /// `--answer-field`, an answer that does not holds the letter as unknown.
    #[arg(long = "answer-echo", value_name = "NAME")]
    answer_echoes: Vec<String>,
    /// A header to send with every redrive but never store (the vendor's
    /// credentials), as NAME:ENV_VAR: the value is read from that
    /// environment variable, never from the command line. Repeatable.
    #[arg(long = "secret-header")]
    secret_headers: Vec<String>,
    /// The CA certificates (PEM) an https vendor must be signed by, in
    /// place of the platform's roots.
    #[arg(long)]
    ca_file: Option<std::path::PathBuf>,
}

impl ResendArgs {
    /// `--hold-secs`, if given.
    pub(crate) fn hold_secs(&self) -> Option<u64> {
        self.hold_secs
    }

    /// Whether `--url` sends the letters to another target.
    pub(crate) fn retargets(&self) -> bool {
        self.url.is_some()
    }

    /// `base` with the horizon, the settle time and the secret headers.
    /// Without `--key-horizon-secs` the client has no horizon of its own
    /// (the longest there is, no margin): each letter's terms apply, as the
    /// strictest of both always does.
    pub(crate) fn config(
        &self,
        base: idem_outbound::OutboundConfig,
    ) -> std::result::Result<idem_outbound::OutboundConfig, Failure> {
        let bad = |why: String| Failure(2, why);
        let key_horizon = match self.key_horizon_secs {
            Some(secs) => {
                let horizon = Duration::from_secs(secs);
                let margin = self
                    .horizon_margin_secs
                    .map(Duration::from_secs)
                    .unwrap_or_else(|| Duration::from_secs(3600).min(horizon / 10));
                idem_outbound::KeyHorizon::new(horizon, margin)
            }
            None => idem_outbound::KeyHorizon::new(
                Duration::from_secs(MAX_HORIZON_SECS),
                Duration::from_secs(self.horizon_margin_secs.unwrap_or(0)),
            ),
        };
        let mut config = idem_outbound::OutboundConfig {
            key_horizon,
            reconcile_settle: self.settle_secs.map(Duration::from_secs),
            ca_file: self.ca_file.clone(),
            ..base
        };
        for spec in &self.secret_headers {
            let Some((name, var)) = spec.split_once(':') else {
                return Err(bad(format!("--secret-header {spec:?}: expected NAME:ENV_VAR")));
            };
            let value = std::env::var(var).map_err(|_| {
                bad(format!(
                    "--secret-header {name}: the environment variable {var} is not set"
                ))
            })?;
            config = config
                .with_secret_header(name, &value)
                .map_err(|e| bad(format!("--secret-header {name}: {e}")))?;
        }
        config.validate().map_err(|e| bad(e.to_string()))?;
        Ok(config)
    }

    /// The redriver, with the target override checked.
    pub(crate) fn redriver<S: DeadLetterStore>(
        &self,
        client: idem_outbound::OutboundClient,
        store: S,
    ) -> std::result::Result<idem_outbound::Redriver<S>, Failure> {
        let mut redriver = idem_outbound::Redriver::new(client, store)
            .with_past_horizon_override(self.past_horizon)
            .with_terms_required(self.key_horizon_secs.is_none());
        if let Some(secs) = self.hold_secs {
            redriver = redriver.with_hold(Duration::from_secs(secs));
        }
        if !self.answer_fields.is_empty() || !self.answer_echoes.is_empty() {
            let (fields, echoes) = (self.answer_fields.clone(), self.answer_echoes.clone());
            redriver = redriver.with_answer_check(std::sync::Arc::new(move |request, body| {
                check_answer(&fields, &echoes, request.body(), body)
            }));
        }
        match &self.url {
            Some(url) => redriver.with_target(url).map_err(|e| Failure(2, format!("--url: {e}"))),
            None => Ok(redriver),
        }
    }
}

/// Whether a 2xx `answer` holds each of `fields` (non-null, non-empty) and
/// repeats each of `echoes` of the `sent` JSON body.
fn check_answer(fields: &[String], echoes: &[String], sent: &[u8], answer: &[u8]) -> std::result::Result<(), String> {
    let answer: serde_json::Value =
        serde_json::from_slice(answer).map_err(|e| format!("the answer is not JSON ({e})"))?;
    if !answer.is_object() {
        return Err("the answer is not a JSON object".into());
    }
    for field in fields {
        // An identifier: a non-empty string, as a service storing it
        // expects (a number or an object is not one).
        match answer.get(field) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => {}
            None | Some(serde_json::Value::Null) => return Err(format!("the answer has no {field:?}")),
            Some(other) => return Err(format!("the answer's {field:?} is {other}, not a non-empty string")),
        }
    }
    if !echoes.is_empty() {
        let sent: serde_json::Value =
            serde_json::from_slice(sent).map_err(|e| format!("the request is not JSON ({e})"))?;
        for field in echoes {
            if sent.get(field).is_none() || answer.get(field) != sent.get(field) {
                return Err(format!(
                    "the answer's {field:?} is {}, the request's {}",
                    answer.get(field).unwrap_or(&serde_json::Value::Null),
                    sent.get(field).unwrap_or(&serde_json::Value::Null)
                ));
            }
        }
    }
    Ok(())
}
