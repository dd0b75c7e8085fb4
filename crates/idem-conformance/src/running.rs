//! A task running in the background until a test stops it: a consumer, a
//! relay, a sweeper, handed the future that completes on [`Running::stop`].

use idem_core::BoxFuture;

/// A task running in the background until [`stop`](Self::stop)ped.
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Runs `task` in the background; it is handed the future that
    /// completes when [`Running::stop`] is called.
    pub fn spawn<F, Fut>(task: F) -> Self
    where
        F: FnOnce(BoxFuture<'static, ()>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(task(Box::pin(async move {
            let _ = rx.await;
        })));
        Self { stop, task }
    }

    /// Signals the task to stop and waits for it; a task that panicked
    /// fails the test here.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("background task");
    }
}
