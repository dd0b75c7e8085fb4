//! `idem`: the gateway that gives any HTTP API the Idempotency-Key contract.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// idem's command line.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A reverse proxy in front of --upstream: retried requests with one
    /// Idempotency-Key reach the upstream once (lease mode).
    Gateway {
        /// The API behind the gateway.
        #[arg(long, env = "IDEM_UPSTREAM")]
        upstream: Option<String>,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: String,
        /// The store: a SQLite path (default ./idem-gateway.db), postgres://,
        /// mysql:// or redis:// (shared by several gateway instances).
        #[arg(long, env = "IDEM_STORE")]
        store: Option<String>,
        /// A TOML file with routes and policies (see the README).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let Command::Gateway {
        upstream,
        listen,
        store,
        config,
    } = Args::parse().command;
    let result = async {
        let mut cfg = match &config {
            Some(path) => idem_gateway::Config::from_file(path)?,
            None => idem_gateway::Config::default(),
        };
        if upstream.is_some() {
            cfg.upstream = upstream;
        }
        if store.is_some() {
            cfg.store = store;
        }
        cfg.upstream()?;
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        idem_gateway::serve(&cfg, listener, shutdown()).await
    }
    .await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem gateway: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

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
