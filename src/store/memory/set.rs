//! Key sets in memory: every key of a set taken under the lease maps' locks (the plain
//! leases', then the counted holders'), its keys with a capacity as `counted.rs` takes one.

use std::{sync::Arc, sync::atomic::Ordering, time::Duration};

use bytes::Bytes;
use tokio::time::Instant;

use super::{Entry, MemoryStore, counted};
use crate::{
    key::KeySet,
    store::{AcquireSet, BoxFuture, SetAttempt, StoreError},
    token::Token,
};

impl MemoryStore {
    /// Takes every key of `keys` for `token`, or none; see [`AcquireSet::acquire_set`]. A key
    /// taken plain and with a share at once is an error ([`counted::taken_both_ways`]).
    pub(crate) fn acquire_set_now(
        &self,
        keys: &KeySet,
        token: &Token,
        ttl: Duration,
    ) -> Result<SetAttempt, StoreError> {
        let now = Instant::now();
        let any_share = keys.iter().any(|key| key.share().is_some());
        if any_share {
            self.inner.any_counted.store(true, Ordering::Relaxed);
        }
        let mut leases = self.leases();
        // Lock order: the plain leases, then the holders of keys with a capacity.
        let mut holders =
            (any_share || self.inner.any_counted.load(Ordering::Relaxed)).then(|| self.counted());
        for (blocked, key) in keys.iter().enumerate() {
            let expires_in = match (key.share(), holders.as_deref_mut()) {
                (Some(share), Some(holders)) => {
                    if counted::plain_live(&leases, key, now) {
                        return Err(counted::taken_both_ways());
                    }
                    counted::same_capacity(holders, key, share, now)?;
                    match counted::room(holders, key, share, token, now) {
                        Ok(()) => continue,
                        Err(expires_in) => expires_in,
                    }
                }
                (_, holders) => {
                    if holders.is_some_and(|h| counted::counted_live(h, key, now)) {
                        return Err(counted::taken_both_ways());
                    }
                    match leases
                        .get(key.as_bytes())
                        .filter(|e| e.expires > now && e.token != *token)
                    {
                        Some(entry) => Some(entry.expires - now),
                        None => continue,
                    }
                }
            };
            return Ok(SetAttempt::Contended {
                expires_in,
                blocked,
            });
        }
        let fencing_tokens = keys
            .iter()
            .map(|key| {
                match (key.share(), holders.as_deref_mut()) {
                    (Some(share), Some(holders)) => {
                        counted::hold(holders, key, share, token, now + ttl);
                    }
                    _ => {
                        leases.insert(
                            Bytes::copy_from_slice(key.as_bytes()),
                            Entry {
                                token: token.clone(),
                                expires: now + ttl,
                            },
                        );
                    }
                }
                self.next_fence()
            })
            .collect();
        Ok(SetAttempt::Acquired { fencing_tokens })
    }

    /// Releases every key of `keys` held with `token`; whether every one was (and was live).
    pub(crate) fn release_set_now(&self, keys: &KeySet, token: &Token) -> bool {
        let now = Instant::now();
        let mut all = true;
        for key in keys {
            if key.share().is_some() {
                all &= self.release_share(key, token);
                continue;
            }
            let mut leases = self.leases();
            match leases.get(key.as_bytes()) {
                Some(entry) if entry.token == *token => {
                    all &= entry.expires > now;
                    leases.remove(key.as_bytes());
                    self.inner
                        .releases
                        .released(Bytes::copy_from_slice(key.as_bytes()));
                }
                _ => all = false,
            }
        }
        all
    }
}

impl AcquireSet for MemoryStore {
    fn acquire_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        _wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>> {
        let answer = self.acquire_set_now(&keys, &token, ttl);
        Box::pin(async move { answer })
    }

    fn release_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>> {
        let released = self.release_set_now(&keys, &token);
        Box::pin(async move { Ok(released) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{key::LockKey, store::LockStore};

    fn key(v: &str) -> LockKey {
        LockKey::new("t:", "s", v.as_bytes(), 64).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn all_or_none_with_a_fencing_token_each() {
        let store = MemoryStore::new();
        let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
        let ttl = Duration::from_secs(1);
        let set = KeySet::from([key("x"), key("y"), key("z")]);
        // One key of the set held elsewhere: nothing is taken.
        let held = KeySet::from(key("y"));
        assert!(matches!(
            store.acquire_set_now(&held, &b, ttl).unwrap(),
            SetAttempt::Acquired { .. }
        ));
        let SetAttempt::Contended { blocked, .. } = store.acquire_set_now(&set, &a, ttl).unwrap()
        else {
            panic!("a held key did not block the set")
        };
        assert_eq!(set.as_slice()[blocked], key("y"));
        assert_eq!(store.held(), 1, "the set took some keys");
        assert!(store.release_set_now(&held, &b));
        let SetAttempt::Acquired { fencing_tokens } = store.acquire_set_now(&set, &a, ttl).unwrap()
        else {
            panic!("a free set not taken")
        };
        assert_eq!(fencing_tokens.len(), 3);
        assert!(fencing_tokens.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(store.held(), 3);
        assert!(!store.renew(&key("x"), &b, ttl).await.unwrap());
        // Released together; a key released behind the holder's back makes it answer false.
        assert!(store.release(&key("z"), &a).await.unwrap());
        assert!(!store.release_set_now(&set, &a));
        assert_eq!(store.held(), 0);
    }
}
