//! The performance suite (see the `idem_bench` crate's docs).
//!
//! Run: `cargo run --release -p idem-bench --bin suite -- --seconds 5 --readme README.md`

use clap::Parser;

#[tokio::main]
async fn main() -> Result<(), idem_core::BoxError> {
    idem_bench::suite::run(idem_bench::suite::Args::parse()).await
}
