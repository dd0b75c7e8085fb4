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
//!
//! Such work need not start in a task of its own: [`Detached::finish`] runs
//! it in the caller's task, counted the same way, and only if the caller
//! goes away before it ends is the rest of it moved into a task. A request
//! whose caller stays costs no hand-off between tasks.

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

    /// Runs `work` in the task that polls the returned future, counted
    /// like a spawned task while it runs. If that future is dropped before
    /// `work` has finished (the caller went away), the rest of `work` is
    /// spawned on the current runtime and runs to its end, still counted.
    ///
    /// The rest runs on the runtime and in the tracing span current when
    /// `finish` was called (work started outside any runtime is dropped
    /// with its future, and a warning says so).
    ///
    /// While its caller keeps the future, the work makes progress only when
    /// the caller polls it: a caller that holds it without polling (a branch
    /// of a `select!` loop that is not taken) stalls it. Task-local values
    /// of the caller's task are seen by the work only while it runs there.
    pub fn finish<F>(&self, work: F) -> Finish<F>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Finish {
            work: Some(Box::pin(work)),
            abandoned: None,
            running: Some(Running::new(&self.inner)),
            runtime: tokio::runtime::Handle::try_current().ok(),
            span: tracing::Span::current(),
            polling: false,
        }
    }

    /// As [`finish`](Self::finish), and if the caller went away, `abandoned`
    /// gets the output of `work` once it is there: whatever the caller would
    /// have done with it (such as giving back a claim it will never use).
    pub fn finish_then<F, A>(&self, work: F, abandoned: A) -> Finish<F>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
        A: FnOnce(F::Output) -> crate::BoxFuture<'static, ()> + Send + 'static,
    {
        let mut finish = self.finish(work);
        finish.abandoned = Some(Box::new(abandoned));
        finish
    }

    /// How many tasks are running, work running in its caller's task
    /// through [`finish`](Self::finish) included.
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

/// What an abandoned [`Finish`] does with its work's output.
type Abandoned<T> = Box<dyn FnOnce(T) -> crate::BoxFuture<'static, ()> + Send>;

/// Work running in its caller's task that moves into a task of its own if
/// the caller goes away first: see [`Detached::finish`].
#[must_use = "the work runs only while the future is polled, or once it is dropped"]
pub struct Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    work: Option<std::pin::Pin<Box<F>>>,
    abandoned: Option<Abandoned<F::Output>>,
    running: Option<Running>,
    /// The runtime and span the work was started in: the rest runs there,
    /// wherever the caller's future is dropped.
    runtime: Option<tokio::runtime::Handle>,
    span: tracing::Span,
    /// Set while `work` is polled: still set when dropped, the work
    /// panicked, and what is left of it can never run.
    polling: bool,
}

impl<F> std::fmt::Debug for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finish")
            .field("finished", &self.work.is_none())
            .finish_non_exhaustive()
    }
}

// The work is boxed: moving a `Finish` never moves the work itself.
impl<F> Unpin for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
}

impl<F> Future for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let this = &mut *self;
        let work = this.work.as_mut().expect("a finished work is not polled again");
        this.polling = true;
        let polled = work.as_mut().poll(cx);
        this.polling = false;
        let out = std::task::ready!(polled);
        self.work = None;
        self.abandoned = None;
        self.running = None;
        std::task::Poll::Ready(out)
    }
}

impl<F> Drop for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let (Some(work), Some(running)) = (self.work.take(), self.running.take()) else {
            return;
        };
        if self.polling {
            // Unwinding from a panic inside the work: a future that panicked
            // cannot be polled again. Whatever guards it held have run.
            return;
        }
        let abandoned = self.abandoned.take();
        let rest = tracing::Instrument::instrument(
            async move {
                let _running = running;
                let out = work.await;
                if let Some(abandoned) = abandoned {
                    abandoned(out).await;
                }
            },
            self.span.clone(),
        );
        match self
            .runtime
            .take()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        {
            Some(runtime) => {
                runtime.spawn(rest);
            }
            None => tracing::warn!("work started outside a runtime cannot finish; it is dropped unfinished"),
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

    /// Work its caller polls to the end runs in the caller's task: no task
    /// is spawned, it is counted while it runs, and nothing is abandoned.
    #[tokio::test(start_paused = true)]
    async fn finished_work_runs_in_the_callers_task() {
        let d = Detached::new();
        let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
        let (seen, saw) = tokio::sync::oneshot::channel();
        let counted = d.clone();
        let mut work = d.finish_then(
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                counted.running()
            },
            move |_| {
                Box::pin(async move {
                    let _ = seen.send(());
                })
            },
        );
        assert_eq!(d.running(), 1, "counted before it is polled");
        assert!(futures_poll_once(&mut work).is_none());
        assert_eq!(tokio::runtime::Handle::current().metrics().num_alive_tasks(), tasks);
        assert_eq!((&mut work).await, 1, "counted while it ran");
        drop(work);
        assert_eq!(d.running(), 0);
        assert!(saw.await.is_err(), "work its caller finished is not abandoned");
    }

    /// Work whose caller went away finishes in a task of its own, counted,
    /// and its output goes to `abandoned`.
    #[tokio::test(start_paused = true)]
    async fn abandoned_work_finishes_in_a_task() {
        let d = Detached::new();
        let (step, stepped) = tokio::sync::oneshot::channel::<()>();
        let (seen, saw) = tokio::sync::oneshot::channel();
        let mut work = d.finish_then(
            async move {
                stepped.await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
                7
            },
            move |out| {
                Box::pin(async move {
                    let _ = seen.send(out);
                })
            },
        );
        assert!(futures_poll_once(&mut work).is_none());
        drop(work);
        assert_eq!(d.running(), 1, "the rest runs on, counted");
        step.send(()).unwrap();
        d.idle().await;
        assert_eq!(saw.await.unwrap(), 7);

        // Without a handler the output is dropped, and the work still ends.
        let (done, ended) = tokio::sync::oneshot::channel();
        let work = d.finish(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = done.send(());
        });
        drop(work);
        ended.await.unwrap();
        d.idle().await;
        assert_eq!(d.running(), 0);
    }

    /// Work that panics while its caller polls it is not moved anywhere:
    /// the panic reaches the caller, nothing is spawned, and the count ends.
    #[tokio::test(flavor = "current_thread")]
    async fn work_that_panics_is_not_spawned() {
        let d = Detached::new();
        let mut work = d.finish(async { panic!("the work fails") });
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| futures_poll_once(&mut work)));
        assert!(caught.is_err(), "the panic reaches the caller");
        drop(work);
        // Checked before anything else runs: a spawned rest would be counted.
        assert_eq!(d.running(), 0);
        assert_eq!(tokio::runtime::Handle::current().metrics().num_alive_tasks(), 0);
    }

    /// Polls `f` once with a waker that does nothing.
    fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
        match std::pin::Pin::new(f).poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }
}
