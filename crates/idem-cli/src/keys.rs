//! `idem keys`: the stored keys, listed, shown one at a time, resolved
//! (an unknown outcome) and purged.

use idem_core::{KeyAdmin, LeaseStore, TimeSource};

use crate::output::{Failure, print, print_document, refuse_empty_filters, say};
use crate::store::KeysTable;

/// Which keys a command selects.
#[derive(Debug, clap::Args)]
pub(crate) struct Selection {
    #[command(flatten)]
    at: KeysTable,
    /// Only this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this operation (`POST /v1/payments`).
    #[arg(long)]
    operation: Option<String>,
    /// Only keys starting with this.
    #[arg(long)]
    key_prefix: Option<String>,
    /// Only keys in this state.
    #[arg(long, value_parser = ["in_progress", "sent", "completed", "rejected", "unknown", "expired"])]
    state: Option<String>,
    /// Only keys claimed at least this many seconds ago.
    #[arg(long)]
    older_than_secs: Option<u64>,
    /// At most this many keys.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    limit: u32,
}

impl Selection {
    /// The filter the flags give; an empty value is refused: it would
    /// select nothing meaningful (an empty prefix matches every key).
    fn filter(&self) -> Result<idem_core::KeyFilter, Failure> {
        refuse_empty_filters(&[
            ("--tenant", &self.tenant),
            ("--operation", &self.operation),
            ("--key-prefix", &self.key_prefix),
        ])?;
        Ok(idem_core::KeyFilter {
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            key_prefix: self.key_prefix.clone(),
            state: self.state.as_deref().map(|s| match s {
                "in_progress" => idem_core::KeyState::InProgress,
                "completed" => idem_core::KeyState::Completed,
                "rejected" => idem_core::KeyState::Rejected,
                "unknown" => idem_core::KeyState::Unknown,
                "sent" => idem_core::KeyState::Sent,
                _ => idem_core::KeyState::Expired,
            }),
            older_than_ms: self
                .older_than_secs
                .map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)),
        })
    }
}

/// One key, by its exact value.
#[derive(Debug, clap::Args)]
pub(crate) struct OneKey {
    #[command(flatten)]
    at: KeysTable,
    /// The tenant.
    #[arg(long)]
    tenant: String,
    /// The operation.
    #[arg(long)]
    operation: String,
    /// The key.
    #[arg(long)]
    key: String,
}

impl OneKey {
    /// The key's scope and the key, checked (exit 2 if malformed).
    fn parse(&self) -> Result<(idem_core::Scope, idem_core::IdempotencyKey), Failure> {
        let scope = idem_core::Scope::parse(&self.tenant, &self.operation)
            .map_err(|e| Failure(2, format!("--tenant/--operation: {e}")))?;
        let key = idem_core::IdempotencyKey::new(self.key.as_str()).map_err(|e| Failure(2, format!("--key: {e}")))?;
        Ok((scope, key))
    }
}

/// What `idem keys resolve` records.
#[derive(Debug, clap::Args)]
pub(crate) struct ResolveArgs {
    #[command(flatten)]
    which: OneKey,
    /// The upstream applied the request: record --status (and --body,
    /// --header) as its answer.
    #[arg(
        long,
        conflicts_with = "not_applied",
        required_unless_present = "not_applied",
        requires = "status"
    )]
    applied: bool,
    /// The upstream did not apply the request: release the key.
    #[arg(long)]
    not_applied: bool,
    /// The answer's status (2xx, 3xx or 4xx).
    #[arg(long, requires = "applied")]
    status: Option<u16>,
    /// A file holding the answer's body.
    #[arg(long, requires = "applied")]
    body: Option<std::path::PathBuf>,
    /// An answer header, `Name: value` (repeatable); with a body and no
    /// Content-Type, `application/json`.
    #[arg(long = "header", requires = "applied")]
    headers: Vec<String>,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum KeysCommand {
    /// Keys matching the filters, oldest first.
    List(Selection),
    /// One key, by its exact value, with its recorded outcome.
    Show(OneKey),
    /// Resolves a key whose outcome is unknown (the upstream got the whole
    /// request, then failed or went silent): --applied records what the
    /// upstream did, and retries replay it; --not-applied releases the key,
    /// and the next retry is sent. Any other key is left alone.
    Resolve(ResolveArgs),
    /// Deletes the keys matching the filters (at least one filter; a key
    /// still in progress only with --force: its holder may be working).
    Purge {
        #[command(flatten)]
        selection: Selection,
        /// Also delete keys in progress.
        #[arg(long)]
        force: bool,
    },
}

/// Runs one `idem keys` command.
pub(crate) async fn run(command: KeysCommand, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    match command {
        KeysCommand::List(sel) => list(&sel, redis, json).await,
        KeysCommand::Show(which) => show(&which, redis, json).await,
        KeysCommand::Resolve(args) => resolve(&args, redis, json).await,
        KeysCommand::Purge { selection, force } => purge(&selection, force, redis, json).await,
    }
}

async fn list(sel: &Selection, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let filter = sel.filter()?;
    let s = sel.at.open(redis).await?;
    let now = s.source_now_ms().await?;
    let keys = s.list_keys(&filter, now, sel.limit).await?;
    if json {
        say!("{}", serde_json::Value::Array(keys.iter().map(key_json).collect()));
    } else {
        for k in &keys {
            say!(
                "{}\t{}\t{}\t{}\t{} bytes",
                k.tenant,
                k.operation,
                k.key,
                k.state.name(),
                k.payload.len()
            );
        }
        eprintln!("{} key(s)", keys.len());
    }
    Ok(())
}

async fn show(which: &OneKey, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let (scope, key) = which.parse()?;
    let s = which.at.open(redis).await?;
    let now = s.source_now_ms().await?;
    let Some(k) = s.find_key(&scope, &key, now).await? else {
        return Err(Failure(
            1,
            format!(
                "no key {:?} for tenant {:?} and operation {:?}",
                key.as_str(),
                which.tenant,
                which.operation
            ),
        ));
    };
    let mut v = key_json(&k);
    match idem_http::RecordedResponse::decode(&k.payload) {
        Ok(r) if !k.payload.is_empty() => {
            v["response"] = serde_json::json!({
                "status": r.status.as_u16(),
                "body": String::from_utf8_lossy(&r.body).chars().take(4096).collect::<String>(),
            });
        }
        _ => {
            v["payload"] = String::from_utf8_lossy(&k.payload)
                .chars()
                .take(4096)
                .collect::<String>()
                .into()
        }
    }
    print_document(json, &v);
    Ok(())
}

/// Records the answer of a key whose outcome is unknown (`--applied`), or
/// releases it (`--not-applied`).
async fn resolve(args: &ResolveArgs, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let which = &args.which;
    let (scope, key) = which.parse()?;
    let record = if args.applied {
        Some(resolved_answer(args.status, args.body.as_deref(), &args.headers)?)
    } else {
        None
    };
    let s = which.at.open_to_write(redis).await?;
    // The store's clock, as the gateway's keys are timed by it.
    let now = s.source_now_ms().await?;
    let req = idem_core::Resolution {
        scope: &scope,
        key: &key,
        now_ms: now,
        record: record.as_ref(),
    };
    let resolved = s.resolve_unknown(&req).await?;
    if !resolved {
        let state = s
            .find_key(&scope, &key, now)
            .await?
            .map_or("no such key", |k| k.state.name());
        return Err(Failure(
            1,
            format!(
                "key {:?} of tenant {:?} and operation {:?} holds no unknown outcome ({state}); nothing was changed",
                key.as_str(),
                which.tenant,
                which.operation
            ),
        ));
    }
    let (what, text) = if args.applied {
        ("applied", "the answer is recorded; retries replay it")
    } else {
        ("not_applied", "the key is released; the next retry is sent")
    };
    print(
        json,
        serde_json::json!({ "store": s.kind(), "resolved": what, "key": key.as_str() }),
        format!("{}: {text}", s.kind()),
    );
    Ok(())
}

async fn purge(sel: &Selection, force: bool, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let filter = sel.filter()?;
    if filter == idem_core::KeyFilter::default() {
        return Err(Failure(
            2,
            "purge needs at least one filter (--tenant, --operation, --key-prefix, --state, --older-than-secs)".into(),
        ));
    }
    if !force
        && filter.state != Some(idem_core::KeyState::Expired)
        && filter.state != Some(idem_core::KeyState::Completed)
        && filter.state != Some(idem_core::KeyState::Rejected)
    {
        return Err(Failure(
            2,
            "keys in progress may have a holder at work: pass --state (completed, rejected or expired), or --force"
                .into(),
        ));
    }
    let s = sel.at.open_to_write(redis).await?;
    let now = s.source_now_ms().await?;
    let mut deleted = 0u64;
    // Batches of 500 until one deletes nothing: a batch may delete
    // fewer than it selected (a key claimed again meanwhile stays),
    // and the next one looks again.
    while deleted < u64::from(sel.limit) {
        let batch = (u64::from(sel.limit) - deleted).min(500) as u32;
        let n = s.purge_keys(&filter, now, batch).await?;
        deleted += n;
        if n == 0 {
            break;
        }
    }
    print(
        json,
        serde_json::json!({ "store": s.kind(), "deleted": deleted }),
        format!("{}: {deleted} key(s) deleted", s.kind()),
    );
    Ok(())
}

/// The recorded answer an operator gives for an applied request; a 5xx is
/// no answer (the request's outcome would still be unknown).
fn resolved_answer(
    status: Option<u16>,
    body: Option<&std::path::Path>,
    headers: &[String],
) -> Result<idem_core::Record, Failure> {
    let status = status.ok_or_else(|| Failure(2, "--applied needs --status".into()))?;
    let status = http::StatusCode::from_u16(status)
        .ok()
        .filter(|s| s.is_success() || s.is_redirection() || s.is_client_error())
        .ok_or_else(|| {
            Failure(
                2,
                format!("--status {status}: give the 2xx, 3xx or 4xx the upstream answered (a 5xx is no outcome)"),
            )
        })?;
    let mut map = http::HeaderMap::new();
    for h in headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| Failure(2, format!("--header {h:?}: write `Name: value`")))?;
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|e| Failure(2, format!("--header {h:?}: {e}")))?;
        let value =
            http::HeaderValue::from_str(value.trim()).map_err(|e| Failure(2, format!("--header {h:?}: {e}")))?;
        // What the layer never records, an operator does not record either:
        // a private header would be replayed to every retry, a hop-by-hop
        // one describes a connection that is gone.
        if name == http::header::SET_COOKIE || idem_http::is_hop_by_hop(&name) {
            return Err(Failure(
                2,
                format!(
                    "--header {name}: never recorded (a private or hop-by-hop header would be replayed to every \
                     retry); leave it out"
                ),
            ));
        }
        map.append(name, value);
    }
    let body = match body {
        Some(path) => std::fs::read(path).map_err(|e| Failure(2, format!("--body {}: {e}", path.display())))?,
        None => Vec::new(),
    };
    if !body.is_empty() && !map.contains_key(http::header::CONTENT_TYPE) {
        map.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
    }
    let encoded = idem_http::RecordedResponse {
        status,
        headers: map,
        body: body.into(),
        trailers: http::HeaderMap::new(),
    }
    .encode();
    Ok(if status.is_client_error() {
        idem_core::Record::rejected(encoded)
    } else {
        idem_core::Record::completed(encoded)
    })
}

/// A key as JSON, without its payload.
fn key_json(k: &idem_core::KeyInfo) -> serde_json::Value {
    serde_json::json!({
        "tenant": k.tenant,
        "operation": k.operation,
        "key": k.key,
        "state": k.state.name(),
        "created_at_ms": k.created_at_ms,
        "expires_at_ms": k.expires_at_ms,
        "payload_bytes": k.payload.len(),
    })
}
