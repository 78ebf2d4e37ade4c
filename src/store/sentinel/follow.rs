//! Following failovers: the lookups of the master, the thread they run on, and which errors
//! a failover explains.

use std::{
    error::Error as StdError,
    future::Future,
    sync::{Arc, PoisonError, atomic::Ordering},
    time::Instant,
};

use redis::{Client, ErrorKind, RedisError, ServerErrorKind, sentinel::SentinelClient};
use tokio::sync::{mpsc, oneshot};

use super::{
    FOLLOW_WAIT, Inner, LOOKUP_TIMEOUT, MIN_LOOKUP_INTERVAL, Master, POLL_INTERVAL, SentinelStore,
    millis,
};
use crate::store::{
    BoxFuture, Capabilities, Route, StoreError, StoreErrorKind, redis::connect_error,
};

/// A lookup for the follower thread: after a call to `failed` went wrong with `error`, or a
/// background poll (`error` and `reply` `None`).
pub(super) struct Follow {
    pub(super) failed: Arc<Master>,
    pub(super) error: Option<StoreError>,
    pub(super) reply: Option<oneshot::Sender<Option<Arc<Master>>>>,
}

pub(super) struct Lookup {
    pub(super) client: SentinelClient,
    pub(super) last: Option<Instant>,
    /// How messages name the sentinels (their addresses, never their URLs).
    pub(super) target: String,
}

impl Lookup {
    /// Asks the sentinels for the master now.
    pub(super) async fn master(&mut self) -> Result<Client, StoreError> {
        self.last = Some(Instant::now());
        match tokio::time::timeout(LOOKUP_TIMEOUT, self.client.async_get_client()).await {
            Ok(found) => found.map_err(|e| connect_error(&self.target, e)),
            Err(_) => Err(StoreError::msg(
                StoreErrorKind::Timeout,
                format!("the Redis sentinels did not name a master within {LOOKUP_TIMEOUT:?}"),
            )),
        }
    }
}

impl SentinelStore {
    /// Runs `op` on the current master; after a failure that a failover explains, asks the
    /// sentinels again and, if they name another master, runs it there once more.
    pub(super) async fn run<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: Fn(Arc<Master>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        self.poll_if_due();
        let master = self.current();
        let error = match op(Arc::clone(&master)).await {
            Err(error) if after_failover(&error) => error,
            answer => return answer,
        };
        match self.follow(&master, Some(&error)).await {
            Some(next) => op(next).await,
            None => Err(error),
        }
    }

    /// Starts a background lookup when one is due and none is running.
    fn poll_if_due(&self) {
        let inner = &self.inner;
        let now = millis(inner.created.elapsed());
        if now < inner.next_poll.load(Ordering::Relaxed)
            || inner.polling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        inner
            .next_poll
            .store(now + millis(POLL_INTERVAL), Ordering::Relaxed);
        let poll = Follow {
            failed: self.current(),
            error: None,
            reply: None,
        };
        if !self.send_follower(poll) {
            inner.polling.store(false, Ordering::Release);
        }
    }

    /// Asks the sentinels for the master, after a call to `failed` went wrong with `error`; the
    /// new master, if there is one. The lookup runs on the follower thread.
    async fn follow(
        &self,
        failed: &Arc<Master>,
        error: Option<&StoreError>,
    ) -> Option<Arc<Master>> {
        let (reply, answer) = oneshot::channel();
        let request = Follow {
            failed: Arc::clone(failed),
            error: error.cloned(),
            reply: Some(reply),
        };
        if !self.send_follower(request) {
            return None;
        }
        // The lookup and the connection are bounded each; this bounds a queue of them.
        tokio::time::timeout(FOLLOW_WAIT, answer)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    }

    /// Hands `request` to the follower thread, started if it is not running (the first time,
    /// or after it failed). Whether it took it.
    fn send_follower(&self, request: Follow) -> bool {
        let mut follower = self
            .inner
            .follower
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let request = match follower.as_ref() {
            Some(tx) => match tx.send(request) {
                Ok(()) => return true,
                // The thread ended (it could not build its runtime): another one.
                Err(mpsc::error::SendError(request)) => request,
            },
            None => request,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(request);
        let inner = Arc::downgrade(&self.inner);
        let started = std::thread::Builder::new()
            .name("tower-lock-sentinel".to_owned())
            .spawn(move || follower_thread(inner, rx));
        match started {
            Ok(_) => {
                *follower = Some(tx);
                true
            }
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn StdError,
                    "cannot start the Sentinel store's lookup thread; failovers are not followed"
                );
                false
            }
        }
    }

    /// Asks the sentinels for the master, after a call to `failed` went wrong with `error` or
    /// for a background poll (`None`); the new master, if there is one. Runs on the follower
    /// thread only.
    async fn follow_now(
        &self,
        failed: &Arc<Master>,
        error: Option<&StoreError>,
    ) -> Option<Arc<Master>> {
        let mut lookup = self.inner.lookup.lock().await;
        let current = self.current();
        if !Arc::ptr_eq(&current, failed) {
            // Another call has moved on while this one waited.
            return Some(current);
        }
        if lookup
            .last
            .is_some_and(|last| last.elapsed() < MIN_LOOKUP_INTERVAL)
        {
            return None;
        }
        let found = match lookup.master().await {
            Ok(client) => client,
            Err(lookup_error) => {
                tracing::debug!(
                    master_name = %self.inner.master_name,
                    error = &lookup_error as &dyn StdError,
                    "the Redis sentinels did not name a reachable master"
                );
                return None;
            }
        };
        if found.get_connection_info().addr().to_string() == current.addr {
            return None;
        }
        let next = match Master::connect(&found).await {
            Ok(next) => next,
            Err(connect_error) => {
                tracing::debug!(
                    master_name = %self.inner.master_name,
                    error = &connect_error as &dyn StdError,
                    "cannot connect to the master the Redis sentinels named"
                );
                return None;
            }
        };
        tracing::warn!(
            master_name = %self.inner.master_name,
            from = %current.addr,
            to = %next.addr,
            error = error.map(|e| e as &(dyn StdError + 'static)),
            "Redis Sentinel failover: the lock store follows the new master"
        );
        // The settings as they are now (locked until the new master is current, so that a
        // change made meanwhile is not lost).
        let settings = self
            .inner
            .settings
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let next = Arc::new(next.with(&settings));
        if let Some(handoff) = &settings.handoff {
            // Before the new master is current: from now until the subscription is up there,
            // waiters do not queue; then every waiter checks again on the new master.
            handoff.retarget(next.client.clone());
        }
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::clone(&next);
        drop(settings);
        Some(next)
    }
}

/// The follower thread: looks the master up and connects to it, one request after the other,
/// on a current-thread runtime of its own, so that the lookups (and the connection to each new
/// master) never depend on a runtime that uses the store, which may shut down or no longer be
/// driven (a lookup left on such a runtime would hold the sentinels' client, and with it every
/// later failover, for good). Ends with the store.
fn follower_thread(inner: std::sync::Weak<Inner>, mut requests: mpsc::UnboundedReceiver<Follow>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn StdError,
                "cannot start the Sentinel store's lookup runtime; failovers are not followed"
            );
            return;
        }
    };
    runtime.block_on(async move {
        while let Some(request) = requests.recv().await {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let store = SentinelStore { inner };
            let next = store
                .follow_now(&request.failed, request.error.as_ref())
                .await;
            match request.reply {
                Some(reply) => {
                    let _ = reply.send(next);
                }
                None => store.inner.polling.store(false, Ordering::Release),
            }
        }
    });
}

/// Whether `error` is what a call to a master that failed or was demoted gets.
fn after_failover(error: &StoreError) -> bool {
    match error.kind() {
        StoreErrorKind::Unavailable | StoreErrorKind::Timeout => true,
        StoreErrorKind::Backend => StdError::source(error)
            .and_then(|source| source.downcast_ref::<RedisError>())
            .is_some_and(|e| {
                matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                ) || {
                    // A write refused inside a script may come back as a script error.
                    let text = e.to_string();
                    text.contains("READONLY") || text.contains("MASTERDOWN")
                }
            }),
        _ => false,
    }
}

/// Calls go to the current master; after an error that a failover explains, once more to the
/// master the sentinels name then.
impl Route for SentinelStore {
    type Target = Arc<Master>;

    fn current(&self) -> Arc<Master> {
        self.poll_if_due();
        SentinelStore::current(self)
    }

    fn capabilities(master: &Arc<Master>) -> &Capabilities {
        &master.caps
    }

    fn after(&self, failed: &Arc<Master>, error: &StoreError) -> BoxFuture<Option<Arc<Master>>> {
        if !after_failover(error) {
            return Box::pin(std::future::ready(None));
        }
        let (this, failed, error) = (self.clone(), Arc::clone(failed), error.clone());
        Box::pin(async move { this.follow(&failed, Some(&error)).await })
    }
}
