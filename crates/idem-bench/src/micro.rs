//! The micro-benchmark's work: one insert of a business row.

use std::marker::PhantomData;

use idem_core::BoxFuture;
use ledger::db::DbError;

use crate::engines::BenchDb;
use crate::txpaths::Work;

/// Inserts one row with a new id into `bench_effects`.
#[derive(Debug)]
pub struct Insert<D>(PhantomData<fn() -> D>);

impl<D> Insert<D> {
    /// The work.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<D> Default for Insert<D> {
    fn default() -> Self {
        Self::new()
    }
}

impl<D> Clone for Insert<D> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<D: BenchDb> Work<D> for Insert<D> {
    fn run<'c>(&self, tx: &'c mut D::Tx, _worker: usize, _n: u64) -> BoxFuture<'c, Result<(), DbError>> {
        D::insert(tx, uuid::Uuid::now_v7().to_string())
    }
}
