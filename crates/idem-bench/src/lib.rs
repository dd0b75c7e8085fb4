//! idem's performance suite: each workload measured against its baseline,
//! per engine, in one run.
//!
//! The guide, with examples: `docs/benchmarks.md` in the repository.
//!
//! | workload | baseline | idem |
//! |---|---|---|
//! | micro (one insert) | `BEGIN; INSERT; COMMIT` | `TxEngine::execute` with a new key; replays; the three-commit pattern (`LeaseEngine`) |
//! | transfer (`LedgerTx::transfer`) | the same statements in a plain transaction | `TxEngine::execute`; the three-commit pattern |
//! | http (`POST /v1/transfers`) | the ledger's route without a key (no claim, no record) | with a new key; replays |
//! | steps (a debit, then a payout) | two single-step calls: `TxEngine::execute`, then lease mode | one `idem-steps` operation of two steps |
//!
//! Beside the throughput ratios, the cost meter ([`cost`], [`meter`])
//! counts what one request of each transactional path costs: round trips,
//! rows and log written, server and client CPU.
//!
//! Each comparison runs `--repeat` times with its paths interleaved; the
//! results file holds every figure and each ratio's median and spread, and
//! the README's tables are rendered from it ([`report`]).
//!
//! Run: `cargo run --release -p idem-bench --bin suite -- --seconds 5`
//! (engines from `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, and a
//! temporary SQLite file).

pub mod cost;
pub mod engines;
pub mod http;
pub mod machine;
pub mod measure;
pub mod meter;
pub mod micro;
pub mod report;
pub mod steps;
pub mod suite;
pub mod transfer;
pub mod txpaths;
pub mod wire;
