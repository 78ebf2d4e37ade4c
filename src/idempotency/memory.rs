//! Records in a [`MemoryStore`], next to its leases.

use std::{
    collections::HashMap,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use tokio::time::Instant;

use super::store::{IdempotencyStore, record_key};
use crate::{
    key::LockKey,
    store::{MemoryStore, StoreError},
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

impl IdempotencyStore for MemoryStore {
    async fn lookup(&self, key: &LockKey) -> Result<Option<Bytes>, StoreError> {
        let now = Instant::now();
        Ok(self
            .records()
            .map()
            .get(record_key(key).as_slice())
            .filter(|(_, expires)| *expires > now)
            .map(|(record, _)| record.clone()))
    }

    async fn complete(
        &self,
        key: &LockKey,
        token: &Token,
        record: Bytes,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        // The record is inserted while the lease map is locked, before the lease is removed:
        // an acquire (which needs that lock) sees either the lease or the record.
        Ok(self.release_with(key, token, || {
            self.records()
                .insert(Bytes::from(record_key(key)), record, retention)
        }))
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
        assert!(
            !store
                .complete(&key, &other, record.clone(), retention)
                .await
                .unwrap()
        );
        assert_eq!(store.lookup(&key).await.unwrap(), None);
        assert_eq!(store.held(), 1, "a stranger's complete released the lease");
        assert!(
            store
                .complete(&key, &mine, record, retention)
                .await
                .unwrap()
        );
        assert_eq!(store.held(), 0);
        assert_eq!(store.lookup(&key).await.unwrap().unwrap(), "r");
        tokio::time::advance(retention).await;
        assert_eq!(store.lookup(&key).await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_swept() {
        let store = MemoryStore::new();
        for i in 0..SWEEP_EVERY {
            let key = LockKey::new("t:", "s", i.to_string().as_bytes(), 64).unwrap();
            store.records().insert(
                Bytes::from(record_key(&key)),
                Bytes::new(),
                Duration::from_millis(10),
            );
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        assert!(store.records().len() <= 2, "{} left", store.records().len());
    }
}
