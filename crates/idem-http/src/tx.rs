//! Lending the open transaction to the handler (transactional mode).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use axum_core::extract::FromRequestParts;
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use idem_core::TxBackend;

use crate::problem::{DEFAULT_PROBLEM_BASE, Problem, slugs};

enum Slot<T> {
    /// No transaction yet: the handler's extractor opens one on demand.
    Lazy,
    /// A transaction waits for the handler.
    Ready(T),
    /// The handler holds the transaction.
    Lent,
}

/// The request-scoped home of the transaction: the layer puts the claimed
/// transaction here, the [`Tx`] extractor borrows it, and the layer takes it
/// back to record the response and commit.
pub struct TxCell<B: TxBackend> {
    inner: Arc<CellInner<B>>,
}

struct CellInner<B: TxBackend> {
    backend: B,
    slot: Mutex<Slot<B::Tx>>,
}

impl<B: TxBackend> Clone for TxCell<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<B: TxBackend> fmt::Debug for TxCell<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxCell").finish_non_exhaustive()
    }
}

pub(crate) enum Taken<T> {
    /// The transaction is back from the handler.
    Tx(T),
    /// The handler never asked for a transaction.
    Unused,
    /// The handler still holds it (it moved the extractor somewhere that
    /// outlived the response).
    StillLent,
}

impl<B: TxBackend + Clone> TxCell<B> {
    pub(crate) fn holding(backend: B, tx: B::Tx) -> Self {
        Self {
            inner: Arc::new(CellInner {
                backend,
                slot: Mutex::new(Slot::Ready(tx)),
            }),
        }
    }

    pub(crate) fn lazy(backend: B) -> Self {
        Self {
            inner: Arc::new(CellInner {
                backend,
                slot: Mutex::new(Slot::Lazy),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slot<B::Tx>> {
        self.inner.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn take(&self) -> Taken<B::Tx> {
        let mut slot = self.lock();
        match std::mem::replace(&mut *slot, Slot::Lazy) {
            Slot::Ready(tx) => Taken::Tx(tx),
            Slot::Lazy => Taken::Unused,
            Slot::Lent => {
                *slot = Slot::Lent;
                Taken::StillLent
            }
        }
    }

    fn give_back(&self, tx: B::Tx) {
        *self.lock() = Slot::Ready(tx);
    }
}

/// The open transaction of the current request, for handlers behind a
/// transactional [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// On a request with a key, it is the transaction that holds the key's claim:
/// the handler's writes through it commit together with the claim and the
/// recorded response, or not at all. On a request without a key, it is a
/// fresh transaction that commits if the response is a success. Dereferences
/// to the backend's transaction type, which for the SQL stores dereferences
/// to the connection (`PgTx`, `MySqlTx`, `SqliteTx`), so `&mut **tx` is the
/// connection.
pub struct Tx<B: TxBackend + Clone> {
    tx: Option<B::Tx>,
    cell: TxCell<B>,
}

impl<B: TxBackend + Clone> fmt::Debug for Tx<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl<B: TxBackend + Clone> Deref for Tx<B> {
    type Target = B::Tx;
    fn deref(&self) -> &B::Tx {
        self.tx.as_ref().expect("a Tx holds its transaction until dropped")
    }
}

impl<B: TxBackend + Clone> DerefMut for Tx<B> {
    fn deref_mut(&mut self) -> &mut B::Tx {
        self.tx.as_mut().expect("a Tx holds its transaction until dropped")
    }
}

impl<B: TxBackend + Clone> Drop for Tx<B> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.cell.give_back(tx);
        }
    }
}

/// Why a [`Tx`] could not be extracted.
#[derive(Debug)]
pub struct TxRejection(&'static str);

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            slugs::TRANSACTION_UNAVAILABLE,
            "Transaction unavailable",
        )
        .with_detail(self.0)
        .into_response(DEFAULT_PROBLEM_BASE)
    }
}

impl<S, B> FromRequestParts<S> for Tx<B>
where
    S: Send + Sync,
    B: TxBackend + Clone,
{
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let cell = parts
            .extensions
            .get::<TxCell<B>>()
            .cloned()
            .ok_or(TxRejection("no transactional IdempotencyLayer wraps this route"))?;
        let taken = {
            let mut slot = cell.lock();
            match std::mem::replace(&mut *slot, Slot::Lent) {
                Slot::Ready(tx) => Some(tx),
                Slot::Lazy => None,
                Slot::Lent => return Err(TxRejection("the transaction is already held by another extractor")),
            }
        };
        let tx = match taken {
            Some(tx) => tx,
            None => match cell.inner.backend.begin().await {
                Ok(tx) => tx,
                Err(e) => {
                    *cell.lock() = Slot::Lazy;
                    tracing::warn!(error = %e, "could not open a transaction for the handler");
                    return Err(TxRejection("the database could not open a transaction"));
                }
            },
        };
        Ok(Tx { tx: Some(tx), cell })
    }
}
