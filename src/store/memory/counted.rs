//! Keys with a capacity ([`Share`]): each key's holders, with their weights and expiries.

use std::{collections::HashMap, sync::atomic::Ordering, time::Duration};

use bytes::Bytes;
use tokio::time::Instant;

use super::{Entry, MemoryStore};
use crate::{
    key::{LockKey, Share},
    store::{Acquire, StoreError, StoreErrorKind},
    token::Token,
};

/// One holder of a key with a capacity.
#[derive(Debug)]
pub(super) struct Holder {
    token: Token,
    weight: u32,
    /// The key's capacity the holder named.
    capacity: u32,
    expires: Instant,
}

/// The holders of every key with a capacity, by key.
pub(super) type Counted = HashMap<Bytes, Vec<Holder>>;

/// A key taken plain while a lease with a share holds it, or the other way round: every user
/// of a key must take it the same way (as Redis answers it, `WRONGTYPE`).
pub(super) fn taken_both_ways() -> StoreError {
    StoreError::msg(
        StoreErrorKind::Misused,
        "the lock key is held both as a plain lease and as one with a share (permits, shared or \
         exclusive): every user of a key must take it the same way",
    )
}

/// A share of `key` naming capacity `asked` while its live holders named `known`: refused, as
/// Redis's scripts refuse it, so that no user's count admits more holders than another's.
fn capacity_mismatch(known: u32, asked: u32) -> StoreError {
    StoreError::msg(
        StoreErrorKind::Misused,
        format!(
            "the lock key's holders took it with a capacity of {known} and this lease names \
             {asked}: every user of a key must name the same number of permits"
        ),
    )
}

/// `Ok` unless `key`'s live holders in `counted` named another capacity than `share`'s.
pub(super) fn same_capacity(
    counted: &Counted,
    key: &LockKey,
    share: Share,
    now: Instant,
) -> Result<(), StoreError> {
    let known = counted
        .get(key.as_bytes())
        .and_then(|holders| holders.iter().find(|h| h.expires > now))
        .map(|h| h.capacity);
    match known {
        Some(known) if known != share.capacity() => Err(capacity_mismatch(known, share.capacity())),
        _ => Ok(()),
    }
}

/// Whether a plain lease on `key` is live in `leases`.
pub(super) fn plain_live(leases: &HashMap<Bytes, Entry>, key: &LockKey, now: Instant) -> bool {
    leases.get(key.as_bytes()).is_some_and(|e| e.expires > now)
}

/// Whether a lease with a share on `key` is live in `counted`.
pub(super) fn counted_live(counted: &Counted, key: &LockKey, now: Instant) -> bool {
    counted
        .get(key.as_bytes())
        .is_some_and(|holders| holders.iter().any(|h| h.expires > now))
}

/// What a key with a capacity answers `token` asking for `share` of it, its dead holders
/// dropped: `Ok` when held with the token (the same acquire sent twice), or free for the share;
/// else how long until the first live lease ends.
pub(super) fn room(
    counted: &mut Counted,
    key: &LockKey,
    share: Share,
    token: &Token,
    now: Instant,
) -> Result<(), Option<Duration>> {
    let Some(holders) = counted.get_mut(key.as_bytes()) else {
        return Ok(());
    };
    // A dead holder's weight frees itself at its TTL.
    holders.retain(|h| h.expires > now);
    if holders.iter().any(|h| h.token == *token) {
        return Ok(());
    }
    let used: u64 = holders.iter().map(|h| u64::from(h.weight)).sum();
    if used + u64::from(share.weight()) > u64::from(share.capacity()) {
        return Err(holders.iter().map(|h| h.expires - now).min());
    }
    Ok(())
}

/// Holds `share` of `key` for `token` until `expires` (after [`room`] said so).
pub(super) fn hold(
    counted: &mut Counted,
    key: &LockKey,
    share: Share,
    token: &Token,
    expires: Instant,
) {
    let holders = counted
        .entry(Bytes::copy_from_slice(key.as_bytes()))
        .or_default();
    match holders.iter_mut().find(|h| h.token == *token) {
        Some(own) => own.expires = expires,
        None => holders.push(Holder {
            token: token.clone(),
            weight: share.weight(),
            capacity: share.capacity(),
            expires,
        }),
    }
}

impl MemoryStore {
    /// [`acquire`](crate::store::LockStore::acquire) of a key with a capacity: taken while the live
    /// holders' weights and the caller's sum to at most the capacity. A live plain lease of the
    /// same key is an error ([`taken_both_ways`]).
    pub(super) fn acquire_share(
        &self,
        key: &LockKey,
        share: Share,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        let now = Instant::now();
        // Before a plain acquire can look: it checks the holders only once one was taken.
        self.inner.any_counted.store(true, Ordering::Relaxed);
        let leases = self.leases();
        if plain_live(&leases, key, now) {
            return Err(taken_both_ways());
        }
        let mut counted = self.counted();
        drop(leases);
        same_capacity(&counted, key, share, now)?;
        if let Err(expires_in) = room(&mut counted, key, share, token, now) {
            return Ok(Acquire::Contended { expires_in });
        }
        hold(&mut counted, key, share, token, now + ttl);
        drop(counted);
        Ok(Acquire::Acquired {
            fencing_token: self.next_fence(),
        })
    }

    /// [`renew`](crate::store::LockStore::renew) of a key with a capacity: the caller's own entry.
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

    /// [`release`](crate::store::LockStore::release) of a key with a capacity: the caller's own entry.
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

    /// A key taken plain while a lease with a share holds it, or the other way round, is an
    /// error, alone or in a set: not a wait, and not a second holder beside the first.
    #[tokio::test(start_paused = true)]
    async fn a_key_taken_both_ways_is_an_error() {
        let store = MemoryStore::new();
        let ttl = Duration::from_millis(100);
        let plain = LockKey::new("t:", "s", b"k", 64).unwrap();
        let reader = key("k", Share::new(1, Share::READERS).unwrap());
        let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
        assert!(acquired(store.acquire(&reader, &a, ttl).await.unwrap()));
        let error = store.acquire(&plain, &b, ttl).await.unwrap_err();
        assert!(error.to_string().contains("the same way"), "{error}");
        let set = crate::key::KeySet::from([plain.clone(), key("j", Share::permit(2).unwrap())]);
        assert!(store.acquire_set_now(&set, &b, ttl).is_err());
        assert!(store.release(&reader, &a).await.unwrap());
        assert!(acquired(store.acquire(&plain, &b, ttl).await.unwrap()));
        let error = store.acquire(&reader, &a, ttl).await.unwrap_err();
        assert!(error.to_string().contains("the same way"), "{error}");
        // Expired, the other way's lease is no obstacle.
        tokio::time::advance(ttl * 2).await;
        assert!(acquired(store.acquire(&reader, &a, ttl).await.unwrap()));
    }

    /// A set of keys with a capacity takes every key or none, each within its capacity.
    #[tokio::test(start_paused = true)]
    async fn a_counted_set_takes_all_or_none_within_each_capacity() {
        let store = MemoryStore::new();
        let ttl = Duration::from_millis(100);
        let permit = |v: &str| key(v, Share::permit(2).unwrap());
        let set = crate::key::KeySet::from([permit("x"), permit("y")]);
        let tokens: Vec<Token> = (0..3).map(|_| Token::generate().unwrap()).collect();
        assert!(acquired(
            store.acquire(&permit("y"), &tokens[0], ttl).await.unwrap()
        ));
        assert!(matches!(
            store.acquire_set_now(&set, &tokens[1], ttl).unwrap(),
            crate::store::SetAttempt::Acquired { .. }
        ));
        // `y` is full now: the next set takes none of its keys, `x` included.
        let crate::store::SetAttempt::Contended { blocked, .. } =
            store.acquire_set_now(&set, &tokens[2], ttl).unwrap()
        else {
            panic!("a full key did not block the set")
        };
        assert_eq!(set.as_slice()[blocked], permit("y"));
        assert_eq!(store.held(), 3);
        assert!(store.release_set_now(&set, &tokens[1]));
        assert_eq!(store.held(), 1);
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
