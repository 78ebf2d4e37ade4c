//! The stores' crate-private operations (hand-off, batched renewal, idempotency records) on
//! real servers: what `tests/` checked of them before they left the public trait. Each test
//! starts its own `redis-server` processes (or cluster, or Sentinel setup) from the test kit,
//! `tower_lock_testkit`, on free loopback ports; the public behaviour stays in `tests/`.
//!
//! The operations are called as the engine calls them, through the store's
//! [`capabilities`](LockStore::capabilities) ([`Ops`]), so a wrapper store is tested through
//! the mechanism that forwards them. The helpers below know the crate's Redis layout (queue
//! keys, queue entries, hand-off channels, fencing counters) on their own, as the integration
//! tests' do: a change to it shows up here.

mod memory;
mod redis;

#[cfg(feature = "cluster")]
mod cluster;
#[cfg(feature = "sentinel")]
mod sentinel;

use std::time::{Duration, Instant};

use bytes::Bytes;
use tower_lock_testkit::RedisServer;

use super::{Acquire, Attempt, BoxFuture, Completed, Epoch, LockStore, QueueWatch, StoreError};
use crate::{key::LockKey, token::Token};

/// The crate-private operations of a store, reached through its capabilities as the engine
/// reaches them (`store::Backend`). Each panics if the store lacks the capability.
pub(super) trait Ops: LockStore {
    /// The hand-off queue's attempt ([`HandOff::enqueue`](super::HandOff::enqueue)).
    fn enqueue(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Attempt, StoreError>> {
        let hand_off = self.capabilities().hand_off.expect("the store hands off");
        hand_off.enqueue(key.clone(), token.clone(), ttl)
    }

    /// The registration for `token`'s hand-off of `key`, after an attempt answered `queued`
    /// (`None`: registered with no attempt, as of the store's first epoch).
    fn queue_watch(
        &self,
        key: &LockKey,
        token: &Token,
        queued: Option<&Attempt>,
    ) -> Option<QueueWatch> {
        let since = match queued {
            Some(Attempt::Queued { since, .. }) => *since,
            _ => Epoch::default(),
        };
        let hand_off = self.capabilities().hand_off.expect("the store hands off");
        hand_off.queue_watch(key, token, since)
    }

    /// Renewals of `leases` sent at once, one answer per lease: with group commit, the first
    /// goes out alone and the others together, in calls of one script each.
    async fn renew_many(
        &self,
        leases: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Vec<Result<bool, StoreError>>
    where
        Self: Sync,
    {
        assert!(
            self.capabilities().group_commit,
            "the store commits in groups"
        );
        futures_util::future::join_all(
            leases
                .iter()
                .map(|(key, token)| self.renew(key, token, ttl)),
        )
        .await
    }

    /// The idempotency record of `key`.
    fn lookup(&self, key: &LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        let records = self
            .capabilities()
            .records
            .expect("the store keeps records");
        records.lookup(key.clone())
    }

    /// The record written with the release (see `Records::complete`), fenced by `fence`.
    fn complete(
        &self,
        key: &LockKey,
        token: &Token,
        fence: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<Completed, StoreError>> {
        let records = self
            .capabilities()
            .records
            .expect("the store keeps records");
        records.complete(key.clone(), token.clone(), fence, record, retention)
    }
}

impl<S: LockStore> Ops for S {}

/// The fencing token of an answer that acquired; panics on any other.
pub(super) fn acquired(answer: impl Into<Attempt>) -> u64 {
    match answer.into() {
        Attempt::Acquired { fencing_token } => fencing_token,
        other => panic!("not acquired: {other:?}"),
    }
}

/// A lock key under the crate's default prefix.
pub(super) fn key(namespace: &str, value: &str) -> LockKey {
    LockKey::new("tower-lock:", namespace, value.as_bytes(), 64).unwrap()
}

/// The hand-off queue of `key`: `<prefix>{<tag>}queue:<rest of the key>`.
pub(super) fn queue_key(key: &LockKey) -> Vec<u8> {
    let tag_end = key
        .as_bytes()
        .iter()
        .position(|&b| b == b'}')
        .expect("a hash tag")
        + 1;
    let (head, rest) = key.as_bytes().split_at(tag_end);
    [head, b"queue:", rest].concat()
}

/// A queue entry, as a waiter of another process would leave it: a token, a stamp, a channel.
pub(super) fn entry(token: &str, channel: &str) -> String {
    format!("{token}0000000000000000{channel}")
}

/// A token as the text of a queue entry.
pub(super) fn token_text(token: &Token) -> String {
    String::from_utf8(token.as_bytes().to_vec()).unwrap()
}

/// Appends `entries` to `key`'s queue on `server`.
pub(super) async fn push_entries(server: &RedisServer, key: &LockKey, entries: &[String]) {
    let mut conn = server.client().await;
    for e in entries {
        let _: () = ::redis::cmd("RPUSH")
            .arg(queue_key(key))
            .arg(e)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// The entries of `key`'s queue on `server`, in queue order.
pub(super) async fn queue_entries(server: &RedisServer, key: &LockKey) -> Vec<Vec<u8>> {
    let mut conn = server.client().await;
    ::redis::cmd("LRANGE")
        .arg(queue_key(key))
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// How many waiters are queued for `key` on `server`.
pub(super) async fn queue_len(server: &RedisServer, key: &LockKey) -> usize {
    queue_entries(server, key).await.len()
}

/// The value of `key` on `server`: the holder's token, if held.
pub(super) async fn get(server: &RedisServer, key: &LockKey) -> Option<Vec<u8>> {
    let mut conn = server.client().await;
    ::redis::cmd("GET")
        .arg(key.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Waits until `n` stores' hand-off subscriptions (opened by `RedisStore::connect`) are up on
/// `server`, for at most 5 s; answers their channels.
pub(super) async fn handoff_subscriptions(server: &RedisServer, n: usize) -> Vec<String> {
    let mut conn = server.client().await;
    let started = Instant::now();
    loop {
        let channels: Vec<String> = ::redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg("tower-lock:handoff:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        if channels.len() >= n {
            return channels;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "hand-off subscriptions not up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `key` is one of the fencing counters (`tower-lock:fence` on a server that does not
/// hash keys to slots, else one per hash slot, `tower-lock:fence:{<n>}`), the only keys a
/// released lock leaves behind.
pub(super) fn is_fence_counter(key: &[u8]) -> bool {
    key == b"tower-lock:fence"
        || key
            .strip_prefix(b"tower-lock:fence:{")
            .and_then(|rest| rest.strip_suffix(b"}"))
            .is_some_and(|n| !n.is_empty() && n.iter().all(u8::is_ascii_digit))
}

/// Every key on `server`, whatever its prefix.
pub(super) async fn every_key(server: &RedisServer) -> Vec<Vec<u8>> {
    let mut conn = server.client().await;
    ::redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The store's `complete`: the holder writes the record and releases the lock in one step; a
/// stranger changes nothing; a lease lost with nobody after it still stores its record; a lease
/// lost to a newer holder never stores over it, nor while it runs. Run on every store that keeps
/// records.
pub(super) async fn complete_is_one_step_for_the_holder(store: impl LockStore) {
    let ttl = Duration::from_secs(10);
    let retention = Duration::from_secs(60);
    let (mine, other) = (Token::generate().unwrap(), Token::generate().unwrap());
    let (stored_and_released, refused) = (
        Completed {
            stored: true,
            released: true,
        },
        Completed {
            stored: false,
            released: false,
        },
    );
    let acquire = async |key: &LockKey, token: &Token, ttl: Duration| {
        acquired(store.acquire(key, token, ttl).await.unwrap())
    };
    let key = LockKey::new("tower-lock:", "idempotency", b"k", 64).unwrap();
    let fence = acquire(&key, &mine, ttl).await;
    let record = Bytes::from_static(b"record");
    let answer = store.complete(&key, &other, fence + 1, record.clone(), retention);
    assert_eq!(
        answer.await.unwrap(),
        refused,
        "a stranger's complete while it is held"
    );
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        None,
        "a stranger wrote the record"
    );
    assert!(
        matches!(
            store.acquire(&key, &other, ttl).await.unwrap(),
            Acquire::Contended { .. }
        ),
        "a stranger released the lock"
    );
    let answer = store.complete(&key, &mine, fence, record.clone(), retention);
    assert_eq!(answer.await.unwrap(), stored_and_released);
    assert_eq!(store.lookup(&key).await.unwrap(), Some(record.clone()));
    let answer = store.complete(&key, &mine, fence, record.clone(), retention);
    assert_eq!(
        answer.await.unwrap(),
        Completed {
            stored: true,
            released: false
        },
        "the same completion sent again stores the same record, and releases nothing"
    );
    let next = acquire(&key, &other, ttl).await;
    assert!(next > fence, "the lock was not released");
    complete_after_the_lease_was_lost(&store).await;
}

/// The second half of [`complete_is_one_step_for_the_holder`]: a completion whose lease expired
/// is stored when nobody came after it, and never while, or over what, a newer holder writes.
async fn complete_after_the_lease_was_lost(store: &impl LockStore) {
    let (ttl, retention) = (Duration::from_secs(10), Duration::from_secs(60));
    let (mine, other) = (Token::generate().unwrap(), Token::generate().unwrap());
    let refused = Completed {
        stored: false,
        released: false,
    };
    let acquire = async |key: &LockKey, token: &Token, ttl: Duration| {
        acquired(store.acquire(key, token, ttl).await.unwrap())
    }; // A lease lost (expired) with nobody after it: its record is stored all the same, so that a
    // retry replays it.
    let short = Duration::from_millis(100);
    let lost = LockKey::new("tower-lock:", "idempotency", b"lost", 64).unwrap();
    let stale = acquire(&lost, &mine, short).await;
    tokio::time::sleep(short * 3).await;
    let answer = store.complete(&lost, &mine, stale, Bytes::from_static(b"late"), retention);
    assert_eq!(
        answer.await.unwrap(),
        Completed {
            stored: true,
            released: false
        }
    );
    assert_eq!(store.lookup(&lost).await.unwrap().unwrap(), "late");

    // Lost to a newer holder: nothing while it runs, and never over its record.
    let taken = LockKey::new("tower-lock:", "idempotency", b"taken", 64).unwrap();
    let stale = acquire(&taken, &mine, short).await;
    tokio::time::sleep(short * 3).await;
    let newer = acquire(&taken, &other, ttl).await;
    assert!(newer > stale);
    let answer = store.complete(
        &taken,
        &mine,
        stale,
        Bytes::from_static(b"stale"),
        retention,
    );
    assert_eq!(
        answer.await.unwrap(),
        refused,
        "stored while a newer holder runs"
    );
    assert_eq!(store.lookup(&taken).await.unwrap(), None);
    let answer = store.complete(
        &taken,
        &other,
        newer,
        Bytes::from_static(b"newer"),
        retention,
    );
    assert_eq!(
        answer.await.unwrap(),
        Completed {
            stored: true,
            released: true
        }
    );
    let answer = store.complete(
        &taken,
        &mine,
        stale,
        Bytes::from_static(b"stale"),
        retention,
    );
    assert_eq!(
        answer.await.unwrap(),
        refused,
        "a stale completion replaced a newer record"
    );
    assert_eq!(store.lookup(&taken).await.unwrap().unwrap(), "newer");
}
