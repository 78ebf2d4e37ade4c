//! The crate's own runtime: one thread, started at first use and kept for the life of the
//! process, running a current-thread Tokio runtime. It drives the work that no caller's future
//! polls, so that none of it depends on a runtime of the application being driven (a
//! current-thread runtime whose `block_on` returned, one made per request and dropped after
//! it): the Redis connections' I/O tasks ([`OnRuntime`]), background renewals, releases on drop,
//! the retries of failed releases and completions, and shared script loads ([`spawn`]).
//!
//! It lives for the process rather than with what uses it: a release on drop, or its retry,
//! may still be running when the last store, locker and guard are gone, and must finish; and an
//! idle current-thread runtime costs one parked thread. See `docs/DECISIONS.md`, "Work nobody
//! polls runs on the crate's own runtime".

use std::{
    future::{Future, IntoFuture},
    pin::Pin,
    sync::OnceLock,
    task::{Context, Poll},
    time::Duration,
};

use pin_project_lite::pin_project;
use tokio::{
    runtime::{Builder, Handle},
    time::{Instant, Sleep, Timeout},
};

use crate::{store::StoreError, telemetry::Chain};

/// The crate's runtime, or `None` if its thread or runtime could not be started (then the
/// current runtime is used, as a last resort).
pub(crate) fn handle() -> Option<&'static Handle> {
    static RUNTIME: OnceLock<Option<Handle>> = OnceLock::new();
    RUNTIME.get_or_init(start).as_ref()
}

fn start() -> Option<Handle> {
    let (sender, started) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("tower-lock".to_owned())
        .spawn(move || {
            // Built and dropped on its own thread (a runtime may not be dropped inside another).
            match Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => {
                    let _ = sender.send(Some(runtime.handle().clone()));
                    runtime.block_on(std::future::pending::<()>());
                }
                Err(error) => {
                    tracing::error!(
                        error = %Chain(&error),
                        "cannot start tower-lock's runtime; its background work runs on the \
                         caller's runtime"
                    );
                    let _ = sender.send(None);
                }
            }
        });
    match thread {
        Ok(_) => started.recv().ok().flatten(),
        Err(error) => {
            tracing::error!(
                error = %Chain(&error),
                "cannot start tower-lock's thread; its background work runs on the caller's \
                 runtime"
            );
            None
        }
    }
}

/// Runs `task` to completion on the crate's runtime (else on the current one); `false` if
/// there is neither.
pub(crate) fn spawn<F>(task: F) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    // The library's unit tests drive time by hand (a paused clock), which only their own
    // runtime has: there, background work stays on it.
    #[cfg(test)]
    let crate_runtime = Handle::try_current().ok();
    #[cfg(test)]
    let crate_runtime = crate_runtime.as_ref();
    #[cfg(not(test))]
    let crate_runtime = handle();
    match crate_runtime {
        Some(runtime) => {
            runtime.spawn(task);
            true
        }
        None => match Handle::try_current() {
            Ok(current) => {
                current.spawn(task);
                true
            }
            Err(_) => false,
        },
    }
}

pin_project! {
    /// `inner`, polled inside the crate's runtime context: whatever it spawns (a connection's
    /// I/O task, a reconnection) and whatever I/O resource it opens runs on the crate's runtime,
    /// never on the runtime of the caller that happened to poll it. Timers it creates are the
    /// crate runtime's too.
    pub(crate) struct OnRuntime<F> {
        #[pin]
        inner: F,
    }
}

impl<F> OnRuntime<F> {
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    pub(crate) fn new(inner: F) -> Self {
        Self { inner }
    }
}

impl<F: Future> Future for OnRuntime<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _entered = handle().map(Handle::enter);
        self.project().inner.poll(cx)
    }
}

/// `make`, run where Tokio's timers can be made: in the current runtime's context, or outside
/// any runtime (a future polled by another executor, or by a plain `block_on`) in the crate
/// runtime's, whose thread then fires them. A timer works wherever it is polled while the
/// runtime it was made in is up; only making it needs a runtime's context, and without one Tokio
/// panics ("there is no reactor running"). (A runtime built without timers panics here too:
/// Tokio has no way to ask.)
fn with_timers<T>(make: impl FnOnce() -> T) -> T {
    if Handle::try_current().is_ok() {
        return make();
    }
    let _entered = handle().map(Handle::enter);
    make()
}

/// [`tokio::time::timeout`], made where a timer can be (see [`with_timers`]): for the calls of
/// the futures callers poll, on whatever executor they run.
pub(crate) fn timeout<F: IntoFuture>(limit: Duration, future: F) -> Timeout<F::IntoFuture> {
    with_timers(|| tokio::time::timeout(limit, future))
}

/// [`tokio::time::timeout_at`], made where a timer can be (see [`with_timers`]).
pub(crate) fn timeout_at<F: IntoFuture>(deadline: Instant, future: F) -> Timeout<F::IntoFuture> {
    with_timers(|| tokio::time::timeout_at(deadline, future))
}

/// [`tokio::time::sleep_until`], made where a timer can be (see [`with_timers`]).
pub(crate) fn sleep_until(at: Instant) -> Sleep {
    with_timers(|| tokio::time::sleep_until(at))
}

/// [`tokio::time::sleep`], made where a timer can be (see [`with_timers`]).
pub(crate) fn sleep(pause: Duration) -> Sleep {
    with_timers(|| tokio::time::sleep(pause))
}

/// A store call bounded by `limit` (a [`timeout`], made where a timer can be): its answer, or a
/// [`StoreError::timeout`] once `limit` has passed.
pub(crate) async fn bounded<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(StoreError::timeout(limit)))
}
