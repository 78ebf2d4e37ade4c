//! [`MemoryStore`]: leases (and idempotency records) in this process's memory.

mod counted;
mod notices;
mod records;
mod set;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use tokio::time::Instant;

use self::{notices::ReleaseAnnouncer, records::MemoryRecords};
use super::{Acquire, Capabilities, LockStore, StoreError};
use crate::{key::LockKey, store::StoreId, token::Token};

/// Sweep expired entries once this many acquisitions have gone by.
const SWEEP_EVERY: u64 = 1024;

/// Leases held in this process's memory.
///
/// The embedded default when no Redis is configured: same semantics as [`RedisStore`](super::RedisStore)
/// (time to live, token-checked renew and release, fencing tokens), but it excludes only requests
/// served by *this* process. Use it for a single instance, for demos and for tests of the layer's
/// own behaviour; never for instances that must exclude each other.
///
/// Clones share the same leases. Expiry follows [`tokio::time`], so paused-time tests work: a
/// request's renewals follow the test's clock too, since they are timed where the request is
/// polled. A [`LeaseGuard`](crate::LeaseGuard)'s renewals (and a lease kept while a response
/// body streams) run on the crate's own runtime, whose clock a test's `start_paused` does not
/// pause: on a paused clock, hold a guard for less than its TTL of paused time.
/// Fencing tokens come from one counter per store, so they increase strictly for every key, and
/// follow the system clock in µs as Redis's follow the server's (`max(last + 1, now)`).
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    leases: Mutex<HashMap<Bytes, Entry>>,
    /// The holders of keys with a capacity (leases with counts), apart from the plain leases.
    counted: Mutex<counted::Counted>,
    /// Whether a lease with a share was ever asked for: until then, a plain acquire need not
    /// look for one on its key.
    any_counted: AtomicBool,
    fence: AtomicU64,
    ops: AtomicU64,
    /// Idempotency records, written atomically with a release.
    records: MemoryRecords,
    /// Wakes waiters (of any locker on this store) when a key is released.
    releases: ReleaseAnnouncer,
}

#[derive(Debug)]
struct Entry {
    token: Token,
    expires: Instant,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many leases are held right now (expired ones not counted).
    pub fn held(&self) -> usize {
        let now = Instant::now();
        self.leases().values().filter(|e| e.expires > now).count() + self.counted_held()
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<Bytes, Entry>> {
        // A panic while the lock was held cannot leave the map half-updated (every update is a
        // single insert or remove), so a poisoned lock is still safe to use.
        self.inner.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counted(&self) -> MutexGuard<'_, counted::Counted> {
        self.inner.counted.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next fencing token, from the store's one counter: `max(last + 1, the system clock in
    /// µs)`, as Redis hands them out, so that a token also says when it was issued (what a
    /// fence's horizon relies on, `crate::fence`, with the data in Redis or in memory).
    fn next_fence(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let next = |last: u64| Some(last.saturating_add(1).max(now));
        match self
            .inner
            .fence
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, next)
        {
            Ok(last) | Err(last) => last.saturating_add(1).max(now),
        }
    }

    fn key(key: &LockKey) -> Bytes {
        Bytes::copy_from_slice(key.as_bytes())
    }

    /// [`release`](LockStore::release), running `then` under the lease map's lock just before
    /// the delete, so that what `then` writes (an idempotency record) appears atomically with
    /// the release. `then` learns who holds `key`: `token` (`Some(true)`), another holder
    /// (`Some(false)`) or nobody (`None`). Returns what `then` answered, and whether it
    /// released the lease.
    pub(crate) fn release_with<T>(
        &self,
        key: &LockKey,
        token: &Token,
        then: impl FnOnce(Option<bool>) -> T,
    ) -> (T, bool) {
        let now = Instant::now();
        let mut leases = self.leases();
        let holder = leases
            .get(key.as_bytes())
            .map(|entry| (entry.token == *token, entry.expires > now));
        match holder {
            Some((true, live)) => {
                let answer = then(live.then_some(true));
                leases.remove(key.as_bytes());
                self.inner
                    .releases
                    .released(Bytes::copy_from_slice(key.as_bytes()));
                (answer, live)
            }
            Some((false, true)) => (then(Some(false)), false),
            _ => (then(None), false),
        }
    }
}

impl LockStore for MemoryStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        let now = Instant::now();
        if let Some(share) = key.share() {
            if self.inner.ops.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
                self.sweep_counted(now);
            }
            return self.acquire_share(key, share, token, ttl);
        }
        let mut leases = self.leases();
        if self.inner.ops.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            leases.retain(|_, e| e.expires > now);
        }
        // Lock order: the plain leases, then the holders of keys with a capacity.
        if self.inner.any_counted.load(Ordering::Relaxed)
            && counted::counted_live(&self.counted(), key, now)
        {
            return Err(counted::taken_both_ways());
        }
        let k = Self::key(key);
        // Held with the caller's own token (the same acquire sent twice): acquired again, with
        // the new TTL and a new fencing token, as in Redis.
        if let Some(entry) = leases
            .get(&k)
            .filter(|e| e.expires > now && e.token != *token)
        {
            return Ok(Acquire::Contended {
                expires_in: Some(entry.expires - now),
            });
        }
        leases.insert(
            k,
            Entry {
                token: token.clone(),
                expires: now + ttl,
            },
        );
        let fencing_token = self.next_fence();
        Ok(Acquire::Acquired { fencing_token })
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        if key.share().is_some() {
            return Ok(self.renew_share(key, token, ttl));
        }
        let now = Instant::now();
        let mut leases = self.leases();
        match leases.get_mut(key.as_bytes()) {
            Some(entry) if entry.expires > now && entry.token == *token => {
                entry.expires = now + ttl;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        if key.share().is_some() {
            return Ok(self.release_share(key, token));
        }
        let now = Instant::now();
        let mut leases = self.leases();
        match leases.get(key.as_bytes()) {
            Some(entry) if entry.token == *token => {
                let live = entry.expires > now;
                leases.remove(key.as_bytes());
                self.inner
                    .releases
                    .released(Bytes::copy_from_slice(key.as_bytes()));
                Ok(live)
            }
            _ => Ok(false),
        }
    }

    /// Release notices (waiters of this process, of any locker on this store, wake at a
    /// release), idempotency records, key sets (under one lock), and keys with a capacity.
    fn capabilities(&self) -> Capabilities {
        let this = Arc::new(self.clone());
        Capabilities {
            counts: true,
            release_notices: Some(this.clone()),
            records: Some(this.clone()),
            key_sets: Some(this),
            identity: Some(StoreId::of(&self.inner)),
            ..Capabilities::none()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &str) -> LockKey {
        LockKey::new("t:", "s", v.as_bytes(), 64).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn acquire_renew_release_expire() {
        let store = MemoryStore::new();
        let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
        let ttl = Duration::from_millis(100);
        let Acquire::Acquired { fencing_token: f1 } =
            store.acquire(&key("k"), &a, ttl).await.unwrap()
        else {
            panic!("free key not acquired")
        };
        assert!(matches!(
            store.acquire(&key("k"), &b, ttl).await.unwrap(),
            Acquire::Contended { expires_in: Some(d) } if d <= ttl
        ));
        assert!(
            !store.renew(&key("k"), &b, ttl).await.unwrap(),
            "other token renewed"
        );
        assert!(
            !store.release(&key("k"), &b).await.unwrap(),
            "other token released"
        );
        tokio::time::advance(Duration::from_millis(80)).await;
        assert!(store.renew(&key("k"), &a, ttl).await.unwrap());
        tokio::time::advance(Duration::from_millis(80)).await;
        assert_eq!(store.held(), 1, "renewed lease expired early");
        tokio::time::advance(Duration::from_millis(30)).await;
        assert_eq!(store.held(), 0);
        assert!(
            !store.renew(&key("k"), &a, ttl).await.unwrap(),
            "expired lease renewed"
        );
        let Acquire::Acquired { fencing_token: f2 } =
            store.acquire(&key("k"), &b, ttl).await.unwrap()
        else {
            panic!("expired key not acquired")
        };
        assert!(f2 > f1);
        assert!(store.release(&key("k"), &b).await.unwrap());
        assert_eq!(store.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_are_swept() {
        let store = MemoryStore::new();
        let ttl = Duration::from_millis(10);
        for i in 0..SWEEP_EVERY - 1 {
            let t = Token::generate().unwrap();
            store.acquire(&key(&i.to_string()), &t, ttl).await.unwrap();
        }
        tokio::time::advance(Duration::from_millis(20)).await;
        let t = Token::generate().unwrap();
        store.acquire(&key("last"), &t, ttl).await.unwrap();
        assert!(
            store.leases().len() <= 2,
            "{} entries left",
            store.leases().len()
        );
    }
}
