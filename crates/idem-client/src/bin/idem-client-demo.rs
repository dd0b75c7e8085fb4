//! `idem-client-demo`: one ledger top-up as a logical operation, with its
//! pending file, to show (and test) that a client killed mid-call resumes
//! with the same key.
//!
//! ```text
//! idem-client-demo --pending FILE --token TOKEN top-up --ledger URL --account ID --amount N
//! idem-client-demo --pending FILE --token TOKEN resume
//! ```
//!
//! `top-up` first resumes what the file holds, then sends a new top-up.
//! Each answer is one line on stdout: `answer key=… status=… replayed=… body=…`,
//! `rejected key=… status=… problem=…` or `pending key=… error=…`.
//! Exit codes: 0 every operation got a final success, 2 bad arguments,
//! 3 a rejection, 4 an operation still pending, 1 anything else.

use std::process::ExitCode;
use std::time::Duration;

use idem_client::{Client, Error, Operation, Response, SqlitePending};

struct Args {
    pending: String,
    token: String,
    deadline_secs: u64,
    command: Command,
}

enum Command {
    TopUp {
        ledger: String,
        account: String,
        amount: i64,
    },
    Resume,
}

const USAGE: &str = "usage: idem-client-demo --pending FILE --token TOKEN [--deadline-secs N] \
                     (top-up --ledger URL --account ID --amount N | resume)";

fn parse(args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut pending = None;
    let mut token = None;
    let mut deadline_secs = 60;
    let mut ledger = None;
    let mut account = None;
    let mut amount = None;
    let mut command = None;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--pending" => pending = Some(value("--pending")?),
            "--token" => token = Some(value("--token")?),
            "--deadline-secs" => {
                deadline_secs = value("--deadline-secs")?
                    .parse()
                    .map_err(|_| "--deadline-secs must be a whole number".to_owned())?;
            }
            "--ledger" => ledger = Some(value("--ledger")?),
            "--account" => account = Some(value("--account")?),
            "--amount" => {
                amount = Some(
                    value("--amount")?
                        .parse::<i64>()
                        .map_err(|_| "--amount must be a whole number".to_owned())?,
                );
            }
            "top-up" | "resume" if command.is_none() => command = Some(arg),
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    let command = match command.as_deref() {
        Some("top-up") => Command::TopUp {
            ledger: ledger.ok_or("top-up needs --ledger")?,
            account: account.ok_or("top-up needs --account")?,
            amount: amount.ok_or("top-up needs --amount")?,
        },
        Some(_) => Command::Resume,
        None => return Err("name a command: top-up or resume".into()),
    };
    Ok(Args {
        pending: pending.ok_or("--pending is required")?,
        token: token.ok_or("--token is required")?,
        deadline_secs,
        command,
    })
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("idem-client-demo: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem-client-demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem-client-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, Error> {
    let client = Client::builder()
        .store(SqlitePending::open(&args.pending).await?)
        .bearer(&args.token)
        .deadline(Duration::from_secs(args.deadline_secs))
        .build()?;
    let mut worst = 0u8;
    for resumed in client.resume().await? {
        worst = worst.max(report(resumed.operation.key().as_str(), resumed.result));
    }
    if let Command::TopUp {
        ledger,
        account,
        amount,
    } = args.command
    {
        let op = Operation::post(&format!("{}/v1/top-ups", ledger.trim_end_matches('/')))
            .json(&serde_json::json!({ "account_id": account, "amount": amount }))
            .build()?;
        println!("sending key={}", op.key());
        let result = client.send(&op).await;
        worst = worst.max(report(op.key().as_str(), result));
    }
    Ok(ExitCode::from(worst))
}

/// Prints one answer; the exit code it calls for.
fn report(key: &str, result: Result<Response, Error>) -> u8 {
    match result {
        Ok(r) => {
            println!(
                "answer key={key} status={} replayed={} body={}",
                r.status().as_u16(),
                r.replayed(),
                r.text()
            );
            0
        }
        Err(Error::Rejected(r)) => {
            println!(
                "rejected key={key} status={} problem={}",
                r.status().as_u16(),
                r.problem().map(|p| p.type_uri.as_str()).unwrap_or("-")
            );
            3
        }
        Err(e) if e.is_outcome_unknown() => {
            println!("pending key={key} error={e}");
            4
        }
        Err(e) => {
            println!("failed key={key} error={e}");
            1
        }
    }
}
