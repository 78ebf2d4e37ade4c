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
    store::{BoxFuture, Completed, Records, StoreError},
    token::Token,
};

/// Sweep expired records once this many have been written.
const SWEEP_EVERY: u64 = 256;

/// The records of one [`MemoryStore`] (shared by its clones). Expiry follows [`tokio::time`].
#[derive(Debug, Default)]
pub(crate) struct MemoryRecords {
    /// Each record with its lease's fencing token and its expiry.
    map: Mutex<HashMap<Bytes, Stored>>,
    writes: AtomicU64,
}

#[derive(Debug)]
struct Stored {
    record: Bytes,
    fence: u64,
    expires: Instant,
}

impl MemoryRecords {
    fn map(&self) -> MutexGuard<'_, HashMap<Bytes, Stored>> {
        // Every update is a single insert or retain: a poisoned lock is still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `record`, fenced by `fence`, unless a live record with a higher fence is there.
    /// Returns whether it stored it.
    fn insert(&self, key: Bytes, record: Bytes, fence: u64, retention: Duration) -> bool {
        let now = Instant::now();
        let mut map = self.map();
        if self.writes.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            map.retain(|_, stored| stored.expires > now);
        }
        if map
            .get(&key)
            .is_some_and(|stored| stored.expires > now && stored.fence > fence)
        {
            return false;
        }
        let expires = now + retention;
        map.insert(
            key,
            Stored {
                record,
                fence,
                expires,
            },
        );
        true
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
            .filter(|stored| stored.expires > now)
            .map(|stored| stored.record.clone())
    }

    fn complete_now(
        &self,
        key: &LockKey,
        token: &Token,
        fence: u64,
        record: Bytes,
        retention: Duration,
    ) -> Completed {
        // The record is inserted while the lease map is locked, before the lease is removed:
        // an acquire (which needs that lock) sees either the lease or the record. Not while
        // another holder has the key: a newer request runs, and its record is the one to keep.
        let (stored, released) = self.release_with(key, token, |holder| {
            holder != Some(false)
                && self.records().insert(
                    Bytes::copy_from_slice(key.as_bytes()),
                    record,
                    fence,
                    retention,
                )
        });
        Completed { stored, released }
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
        fencing_token: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<Completed, StoreError>> {
        let done = self.complete_now(&key, &token, fencing_token, record, retention);
        Box::pin(std::future::ready(Ok(done)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Acquire, LockStore};

    #[tokio::test(start_paused = true)]
    async fn records_expire() {
        let store = MemoryStore::new();
        let key = LockKey::new("t:", "s", b"k", 64).unwrap();
        let mine = Token::generate().unwrap();
        let retention = Duration::from_secs(60);
        let Acquire::Acquired { fencing_token } = store
            .acquire(&key, &mine, Duration::from_secs(10))
            .await
            .unwrap()
        else {
            panic!("not acquired");
        };
        let record = Bytes::from_static(b"r");
        let done = store.complete_now(&key, &mine, fencing_token, record, retention);
        assert!(done.stored && done.released);
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
                1,
                Duration::from_millis(10),
            );
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        assert!(store.records().len() <= 2, "{} left", store.records().len());
    }
}
