//! `fake-vendor`: a Stripe-like payout API with switchable faults.

use std::sync::Arc;

use clap::Parser;

/// A fake payout vendor: deduplicates by Idempotency-Key, keeps a ledger,
/// and fails on request (PUT /_faults).
#[derive(Debug, Parser)]
#[command(name = "fake-vendor", about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9100")]
    listen: std::net::SocketAddr,
    /// How long a key is remembered, in seconds (past it, the same request
    /// pays again).
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=31_622_400))]
    key_horizon_secs: u64,
    /// No idempotency at all: the key header is ignored, every request pays.
    #[arg(long)]
    no_idempotency: bool,
    /// Serve https with this certificate chain (PEM; with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let args = Args::parse();
    // One rustls provider for the process: ring.
    idem_tls::install_default_provider();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match idem_tls::server_config(cert, key) {
            Ok(config) => Some(config),
            Err(e) => {
                eprintln!("fake-vendor: {e}");
                return std::process::ExitCode::from(2);
            }
        },
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    println!("fake vendor on {scheme}://{}", args.listen);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let vendor = fake_vendor::Vendor::new(fake_vendor::Options {
        key_horizon: std::time::Duration::from_secs(args.key_horizon_secs),
        idempotency: !args.no_idempotency,
    });
    match fake_vendor::serve_with_tls(args.listen, Arc::new(vendor), tls, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-vendor: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
