//! `idem gateway`: the reverse proxy that gives the API behind it the
//! Idempotency-Key contract, until SIGINT or SIGTERM.

use std::path::PathBuf;

use crate::output::Failure;

/// The flags of `idem gateway` (a file's settings, overridden by them).
#[derive(Debug, clap::Args)]
pub(crate) struct GatewayArgs {
    /// The API behind the gateway.
    #[arg(long, env = "IDEM_UPSTREAM")]
    upstream: Option<String>,
    /// The CA certificates (PEM) an https upstream must be signed by, in
    /// place of the platform's roots (overrides the file's
    /// upstream_ca_file).
    #[arg(long, env = "IDEM_UPSTREAM_CA_FILE")]
    upstream_ca_file: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// The store: a SQLite path (default ./idem-gateway.db), postgres://,
    /// mysql://, redis:// or redis+sentinel://HOST:PORT,…/SERVICE (shared
    /// by several gateway instances).
    #[arg(long, env = "IDEM_STORE")]
    store: Option<String>,
    /// A TOML file with routes and policies (see the README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Who the caller is (keys are scoped by it; overrides the file's
    /// [tenant]): credentials separated by commas (authorization,
    /// header:NAME, cookie:NAME), trusted-header:NAME, or anonymous.
    #[arg(long, env = "IDEM_TENANT")]
    tenant: Option<String>,
    /// Serve /_idem/healthz and /_idem/metrics on this address instead
    /// of the proxy's (overrides the file's admin_listen).
    #[arg(long)]
    admin_listen: Option<String>,
}

/// Serves until a signal; the global `--redis-prefix` and
/// `--skip-redis-checks` override the file's Redis settings when given.
pub(crate) async fn run(
    args: GatewayArgs,
    redis_prefix: Option<String>,
    skip_redis_checks: bool,
) -> Result<(), Failure> {
    let mut cfg = match &args.config {
        Some(path) => idem_gateway::Config::from_file(path).map_err(|e| Failure(2, e.to_string()))?,
        None => idem_gateway::Config::default(),
    };
    if args.upstream.is_some() {
        cfg.upstream = args.upstream;
    }
    if args.upstream_ca_file.is_some() {
        cfg.upstream_ca_file = args.upstream_ca_file;
    }
    if args.store.is_some() {
        cfg.store = args.store;
    }
    if let Some(spec) = args.tenant {
        cfg.tenant = Some(idem_gateway::TenantConfig::from_flag(&spec).map_err(|e| Failure(2, e.to_string()))?);
    }
    if args.admin_listen.is_some() {
        cfg.admin_listen = args.admin_listen;
    }
    if let Some(prefix) = redis_prefix {
        cfg.redis.prefix = prefix;
    }
    if skip_redis_checks {
        cfg.redis.skip_deployment_checks = true;
    }
    cfg.validate().map_err(|e| Failure(2, e.to_string()))?;
    let listen = args.listen;
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| Failure(2, format!("cannot listen on {listen}: {e}")))?;
    idem_gateway::serve(&cfg, listener, shutdown()).await?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM: the gateway then drains its in-flight
/// requests.
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("idem gateway: draining in-flight requests");
}
