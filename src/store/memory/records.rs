//! Idempotency records in a [`MemoryStore`], next to its leases.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use tokio::time::Instant;

use super::MemoryStore;
use crate::{
    key::LockKey,
    store::{BoxFuture, Records, StoreError},
    token::Token,
};

/// Sweep expired records once this many have been written.
const SWEEP_EVERY: u64 = 256;

/// The records of one [`MemoryStore`] (shared by its clones). Expiry follows [`tokio::time`].
#[derive(Debug, Default)]
pub(crate) struct MemoryRecords {
    map: Mutex<HashMap<Bytes, (Bytes, Instant)>>,
    writes: AtomicU64,
}

impl MemoryRecords {
    fn map(&self) -> MutexGuard<'_, HashMap<Bytes, (Bytes, Instant)>> {
        // Every update is a single insert or retain: a poisoned lock is still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, key: Bytes, record: Bytes, retention: Duration) {
        let now = Instant::now();
        let mut map = self.map();
        if self.writes.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            map.retain(|_, (_, expires)| *expires > now);
        }
        map.insert(key, (record, now + retention));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map().len()
    }
}

impl MemoryStore {
    fn records(&self) -> &MemoryRecords {
        &self.inner.records
    }

    fn lookup_now(&self, key: &LockKey) -> Option<Bytes> {
        let now = Instant::now();
        self.records()
            .map()
            .get(key.as_bytes())
            .filter(|(_, expires)| *expires > now)
            .map(|(record, _)| record.clone())
    }

    fn complete_now(
        &self,
        key: &LockKey,
        token: &Token,
        record: Bytes,
        retention: Duration,
    ) -> bool {
        // The record is inserted while the lease map is locked, before the lease is removed:
        // an acquire (which needs that lock) sees either the lease or the record.
        self.release_with(key, token, || {
            self.records()
                .insert(Bytes::copy_from_slice(key.as_bytes()), record, retention)
        })
    }
}

/// Records keyed by their lock key, in a map of their own.
impl Records for MemoryStore {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        let found = self.lookup_now(&key);
        Box::pin(std::future::ready(Ok(found)))
    }

    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        let done = self.complete_now(&key, &token, record, retention);
        Box::pin(std::future::ready(Ok(done)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Acquire, LockStore};

    #[tokio::test(start_paused = true)]
    async fn complete_needs_the_token_and_records_expire() {
        let store = MemoryStore::new();
        let key = LockKey::new("t:", "s", b"k", 64).unwrap();
        let (mine, other) = (Token::generate().unwrap(), Token::generate().unwrap());
        let ttl = Duration::from_secs(10);
        let retention = Duration::from_secs(60);
        assert!(matches!(
            store.acquire(&key, &mine, ttl).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        let record = Bytes::from_static(b"r");
        assert!(!store.complete_now(&key, &other, record.clone(), retention));
        assert_eq!(store.lookup_now(&key), None);
        assert_eq!(store.held(), 1, "a stranger's complete released the lease");
        assert!(store.complete_now(&key, &mine, record, retention));
        assert_eq!(store.held(), 0);
        assert_eq!(store.lookup_now(&key).unwrap(), "r");
        tokio::time::advance(retention).await;
        assert_eq!(store.lookup_now(&key), None);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_swept() {
        let store = MemoryStore::new();
        for i in 0..SWEEP_EVERY {
            let key = LockKey::new("t:", "s", i.to_string().as_bytes(), 64).unwrap();
            store.records().insert(
                Bytes::copy_from_slice(key.as_bytes()),
                Bytes::new(),
                Duration::from_millis(10),
            );
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        assert!(store.records().len() <= 2, "{} left", store.records().len());
    }
}
