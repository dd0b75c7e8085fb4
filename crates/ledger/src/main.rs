//! The `ledger` binary: parses flags and runs [`ledger::run`].

use clap::Parser;

/// idem's reference service: a credits ledger with exactly-once mutations.
#[derive(Debug, Parser)]
#[command(name = "ledger", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Database: postgres://…, mysql://… (MariaDB too), or a SQLite file path.
    #[arg(long, env = "DATABASE_URL", default_value = "./ledger.db")]
    database_url: String,
    /// How long idempotency keys are kept, in seconds.
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=315_360_000))]
    key_ttl_secs: u64,
    /// The bearer tokens accepted (repeat the flag, or a comma-separated
    /// LEDGER_TOKENS). None: demo mode, every token is its own tenant.
    #[arg(long = "token", env = "LEDGER_TOKENS", value_delimiter = ',')]
    tokens: Vec<String>,
    /// Database connections at most.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_connections: u32,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Colour only for a terminal: logs written to a file or a pipe stay
    // plain text. NO_COLOR (https://no-color.org) turns colour off anywhere.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_ansi(ansi)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let args = Args::parse();
    let options = ledger::Options {
        key_ttl_secs: args.key_ttl_secs,
        tokens: std::sync::Arc::new(args.tokens.into_iter().filter(|t| !t.is_empty()).collect()),
    };
    match ledger::run(&args.listen, &args.database_url, args.max_connections, options).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ledger: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
