//! Work that outlives the request that started it, counted so that a
//! graceful shutdown can wait for it.
//!
//! In lease mode, once a holder may have acted, its outcome is recorded in a
//! task of its own, so that a caller who goes away does not leave the key in
//! progress. A server that stops when its last connection closes would drop
//! such a task half-way — the effect done, its outcome never recorded — and
//! the caller's retry would run the effect again. Every such task is spawned
//! through a [`Detached`], and a server waits for [`Detached::idle`]
//! (bounded) before its runtime stops.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// A count of running detached tasks; clones share it.
#[derive(Clone, Default)]
pub struct Detached {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    running: AtomicUsize,
    idle: Notify,
}

impl std::fmt::Debug for Detached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached").field("running", &self.running()).finish()
    }
}

/// Counts one task while it lives: dropped when the task ends, is aborted,
/// or is dropped unpolled with its runtime.
struct Running(Arc<Inner>);

impl Running {
    fn new(inner: &Arc<Inner>) -> Self {
        inner.running.fetch_add(1, Ordering::SeqCst);
        Self(inner.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Detached {
    /// A new, empty count.
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns `work` on the current runtime, counted until it ends.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, as `tokio::spawn` does.
    pub fn spawn<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let running = Running::new(&self.inner);
        tokio::spawn(async move {
            let _running = running;
            work.await
        })
    }

    /// Spawns `work` on `runtime`, counted until it ends (for code that runs
    /// outside a task, such as a destructor).
    pub fn spawn_on<F>(&self, runtime: &tokio::runtime::Handle, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let running = Running::new(&self.inner);
        runtime.spawn(async move {
            let _running = running;
            work.await
        })
    }

    /// How many tasks are running.
    pub fn running(&self) -> usize {
        self.inner.running.load(Ordering::SeqCst)
    }

    /// Waits until no task is running. Tasks spawned meanwhile are waited
    /// for too.
    pub async fn idle(&self) {
        loop {
            let notified = self.inner.idle.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the count is read, so a task ending in
            // between still wakes this waiter.
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `idle` waits for every task, those spawned while it waits included, and a task that panics still counts down.
    #[tokio::test(start_paused = true)]
    async fn idle_waits_for_every_task() {
        let d = Detached::new();
        assert_eq!(d.running(), 0);
        d.idle().await;
        let inner = d.clone();
        d.spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            inner.spawn(async { tokio::time::sleep(Duration::from_secs(5)).await });
        });
        d.spawn(async { panic!("a detached task that fails") });
        let started = tokio::time::Instant::now();
        d.idle().await;
        assert_eq!(d.running(), 0);
        assert!(started.elapsed() >= Duration::from_secs(6), "{:?}", started.elapsed());
    }

    /// An aborted task is no longer counted.
    #[tokio::test(start_paused = true)]
    async fn an_aborted_task_counts_down() {
        let d = Detached::new();
        let task = d.spawn(std::future::pending::<()>());
        assert_eq!(d.running(), 1);
        task.abort();
        d.idle().await;
        assert_eq!(d.running(), 0);
    }
}
