//! The micro-benchmark alone: the suite's `micro` workload (a bare
//! `BEGIN; INSERT; COMMIT` against the same insert through idem with fresh
//! keys, replays and the three-commit pattern), with the suite's options.
//!
//! Run: `cargo run --release -p idem-bench --bin idem-bench -- --seconds 5`
//! (the package's default binary is the whole suite, `suite`).

use clap::Parser;

#[tokio::main]
async fn main() -> Result<(), idem_core::BoxError> {
    let mut argv = std::env::args_os();
    let program = argv.next().unwrap_or_default();
    let micro = ["--workloads".into(), "micro".into()];
    let args = idem_bench::suite::Args::parse_from(std::iter::once(program).chain(micro).chain(argv));
    idem_bench::suite::run(args).await
}
