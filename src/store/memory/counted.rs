//! Keys with a capacity ([`Share`]): each key's holders, with their weights and expiries.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::MemoryStore;
use crate::{
    key::{LockKey, Share},
    store::Acquire,
    token::Token,
};

/// One holder of a key with a capacity.
#[derive(Debug)]
pub(super) struct Holder {
    token: Token,
    weight: u32,
    expires: Instant,
}

impl MemoryStore {
    /// [`acquire`](crate::LockStore::acquire) of a key with a capacity: taken while the live
    /// holders' weights and the caller's sum to at most the capacity (a plain holder of the
    /// same key takes all of it).
    pub(super) fn acquire_share(
        &self,
        key: &LockKey,
        share: Share,
        token: &Token,
        ttl: Duration,
    ) -> Acquire {
        let now = Instant::now();
        if let Some(plain) = self
            .leases()
            .get(key.as_bytes())
            .filter(|e| e.expires > now)
        {
            return Acquire::Contended {
                expires_in: Some(plain.expires - now),
            };
        }
        let mut counted = self.counted();
        let holders = counted
            .entry(Bytes::copy_from_slice(key.as_bytes()))
            .or_default();
        // A dead holder's weight frees itself at its TTL.
        holders.retain(|h| h.expires > now);
        // Held with the caller's own token (the same acquire sent twice): acquired again.
        if let Some(own) = holders.iter_mut().find(|h| h.token == *token) {
            own.expires = now + ttl;
        } else {
            let used: u64 = holders.iter().map(|h| u64::from(h.weight)).sum();
            if used + u64::from(share.weight()) > u64::from(share.capacity()) {
                let expires_in = holders.iter().map(|h| h.expires - now).min();
                return Acquire::Contended { expires_in };
            }
            holders.push(Holder {
                token: token.clone(),
                weight: share.weight(),
                expires: now + ttl,
            });
        }
        drop(counted);
        Acquire::Acquired {
            fencing_token: self.next_fence(),
        }
    }

    /// [`renew`](crate::LockStore::renew) of a key with a capacity: the caller's own entry.
    pub(super) fn renew_share(&self, key: &LockKey, token: &Token, ttl: Duration) -> bool {
        let now = Instant::now();
        let mut counted = self.counted();
        let own = counted
            .get_mut(key.as_bytes())
            .and_then(|holders| holders.iter_mut().find(|h| h.token == *token))
            .filter(|h| h.expires > now);
        match own {
            Some(own) => {
                own.expires = now + ttl;
                true
            }
            None => false,
        }
    }

    /// [`release`](crate::LockStore::release) of a key with a capacity: the caller's own entry.
    pub(super) fn release_share(&self, key: &LockKey, token: &Token) -> bool {
        let now = Instant::now();
        let mut counted = self.counted();
        let Some(holders) = counted.get_mut(key.as_bytes()) else {
            return false;
        };
        let Some(i) = holders.iter().position(|h| h.token == *token) else {
            return false;
        };
        let live = holders.swap_remove(i).expires > now;
        holders.retain(|h| h.expires > now);
        if holders.is_empty() {
            counted.remove(key.as_bytes());
        }
        drop(counted);
        self.inner
            .releases
            .released(Bytes::copy_from_slice(key.as_bytes()));
        live
    }

    /// How many holders a key with a capacity has right now (expired ones not counted).
    pub(super) fn counted_held(&self) -> usize {
        let now = Instant::now();
        self.counted()
            .values()
            .flatten()
            .filter(|h| h.expires > now)
            .count()
    }

    /// Drops expired holders, and keys left without any.
    pub(super) fn sweep_counted(&self, now: Instant) {
        self.counted().retain(|_, holders| {
            holders.retain(|h| h.expires > now);
            !holders.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LockStore;

    fn key(v: &str, share: Share) -> LockKey {
        LockKey::new("t:", "s", v.as_bytes(), 64)
            .unwrap()
            .with_share(share)
    }

    fn acquired(answer: Acquire) -> bool {
        matches!(answer, Acquire::Acquired { .. })
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_the_capacity_and_a_dead_holder_frees_at_its_ttl() {
        let store = MemoryStore::new();
        let permit = key("k", Share::permit(2).unwrap());
        let ttl = Duration::from_millis(100);
        let tokens: Vec<Token> = (0..3).map(|_| Token::generate().unwrap()).collect();
        assert!(acquired(
            store.acquire(&permit, &tokens[0], ttl).await.unwrap()
        ));
        assert!(acquired(
            store.acquire(&permit, &tokens[1], ttl).await.unwrap()
        ));
        assert!(!acquired(
            store.acquire(&permit, &tokens[2], ttl).await.unwrap()
        ));
        assert_eq!(store.held(), 2);
        // Renewed, the first stays; the second dies and its permit frees at its TTL.
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(store.renew(&permit, &tokens[0], ttl).await.unwrap());
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(!store.renew(&permit, &tokens[1], ttl).await.unwrap());
        assert!(acquired(
            store.acquire(&permit, &tokens[2], ttl).await.unwrap()
        ));
        // A writer (the whole capacity) waits for both; released, it gets in.
        let writer = key("k", Share::exclusive(2).unwrap());
        let w = Token::generate().unwrap();
        assert!(!acquired(store.acquire(&writer, &w, ttl).await.unwrap()));
        assert!(store.release(&permit, &tokens[0]).await.unwrap());
        assert!(!store.release(&permit, &tokens[0]).await.unwrap());
        assert!(store.release(&permit, &tokens[2]).await.unwrap());
        assert!(acquired(store.acquire(&writer, &w, ttl).await.unwrap()));
        assert!(!acquired(
            store.acquire(&permit, &tokens[0], ttl).await.unwrap()
        ));
    }
}
