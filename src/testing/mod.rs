//! A store for the crate's own unit tests of the engine and the layers: a [`MemoryStore`] that
//! records every call and can be told to fail, to forget its leases, or to answer slowly. It
//! claims nothing about Redis; Redis behaviour is tested on a real `redis-server`.

#[cfg(feature = "axum")]
mod lifecycle;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use tokio::time::Instant;

use crate::{
    MemoryStore,
    key::LockKey,
    store::{Acquire, BoxFuture, Capabilities, LockStore, Records, StoreError, StoreErrorKind},
    token::Token,
};

/// One call the store received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    Acquire,
    Renew,
    Release,
}

/// A scripted [`MemoryStore`]; clones share everything.
#[derive(Clone, Default)]
pub(crate) struct Scripted {
    pub(crate) inner: MemoryStore,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    calls: Mutex<Vec<(Instant, Call)>>,
    /// Every call fails (the store is down).
    down: AtomicBool,
    /// Renewals answer "not ours" (the lease was deleted behind the holder).
    forget: AtomicBool,
    /// Records are offered (for the idempotency layer).
    records: AtomicBool,
    /// Releases answer after this many milliseconds.
    release_delay_ms: AtomicUsize,
}

impl Scripted {
    pub(crate) fn new() -> Self {
        let store = Self::default();
        store.state.records.store(true, Ordering::Relaxed);
        store
    }

    pub(crate) fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::Relaxed);
    }

    pub(crate) fn set_forget(&self, forget: bool) {
        self.state.forget.store(forget, Ordering::Relaxed);
    }

    pub(crate) fn set_release_delay(&self, delay: Duration) {
        self.state
            .release_delay_ms
            .store(delay.as_millis() as usize, Ordering::Relaxed);
    }

    /// Every call so far, with when it was made.
    pub(crate) fn calls(&self) -> Vec<(Instant, Call)> {
        self.state.calls.lock().unwrap().clone()
    }

    /// How many calls of `kind` were made.
    pub(crate) fn count(&self, kind: fn(&Call) -> bool) -> usize {
        self.calls().iter().filter(|(_, c)| kind(c)).count()
    }

    /// With `forget` set, deletes the lease behind its holder (as a Redis restarted empty
    /// would): its renewal, release or record write then finds it gone.
    async fn forget_if_told(&self, key: &LockKey, token: &Token) {
        if self.state.forget.load(Ordering::Relaxed) {
            let _ = self.inner.release(key, token).await;
        }
    }

    fn record(&self, call: Call) -> Result<(), StoreError> {
        self.state
            .calls
            .lock()
            .unwrap()
            .push((Instant::now(), call));
        if self.state.down.load(Ordering::Relaxed) {
            return Err(StoreError::msg(
                StoreErrorKind::Unavailable,
                "the store is down",
            ));
        }
        Ok(())
    }
}

impl LockStore for Scripted {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.record(Call::Acquire)?;
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        self.record(Call::Renew)?;
        self.forget_if_told(key, token).await;
        self.inner.renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        let delay = self.state.release_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay as u64)).await;
        }
        self.record(Call::Release)?;
        self.inner.release(key, token).await
    }

    fn capabilities(&self) -> Capabilities {
        let this = Arc::new(self.clone());
        Capabilities {
            records: self
                .state
                .records
                .load(Ordering::Relaxed)
                .then_some(this as _),
            ..Capabilities::none()
        }
    }
}

impl Records for Scripted {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        let records = self
            .inner
            .capabilities()
            .records
            .expect("a memory store keeps records");
        Box::pin(async move {
            if self.state.down.load(Ordering::Relaxed) {
                return Err(StoreError::msg(StoreErrorKind::Unavailable, "down"));
            }
            records.lookup(key).await
        })
    }

    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        fencing_token: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<crate::store::Completed, StoreError>> {
        let records = self
            .inner
            .capabilities()
            .records
            .expect("a memory store keeps records");
        Box::pin(async move {
            let delay = self.state.release_delay_ms.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay as u64)).await;
            }
            self.record(Call::Release)?;
            records
                .complete(key, token, fencing_token, record, retention)
                .await
        })
    }
}

impl crate::idempotency::store::sealed::Sealed for Scripted {}
impl crate::idempotency::IdempotencyStore for Scripted {}
