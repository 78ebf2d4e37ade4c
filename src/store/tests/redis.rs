//! `RedisStore`'s hand-off queue, batched renewal and idempotency records on a real
//! `redis-server` (and on a one-node cluster reached through a plain connection).

use std::{collections::HashSet, time::Duration};

use bytes::Bytes;
use tower_lock_testkit::{RedisServer, errors_of, key_slot, one_node_cluster};

use super::{
    Ops, entry, every_key, get, handoff_subscriptions, is_fence_counter, key, push_entries,
    queue_entries, queue_len, token_text,
};
use crate::{
    RedisStore,
    key::LockKey,
    store::{Acquire, Attempt, LockStore, Signal},
    token::Token,
};

/// `n` stores on `server` (each a process of its own) whose hand-off subscriptions are up
/// (they subscribe in the background at connect).
async fn stores(server: &RedisServer, n: usize) -> Vec<RedisStore> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(RedisStore::connect(server.url()).await.unwrap());
    }
    handoff_subscriptions(server, n).await;
    out
}

/// A store on `server` whose hand-off subscription is up and has had its waiters check again
/// (the [`Signal::Retry`] a subscription sends every registered waiter when it comes up), so
/// that a waiter registered from now on hears only what is meant for it. A waiter that queued
/// while Redis already listed the channel but before the store had sent that signal would take
/// it for its first.
async fn settled_store(server: &RedisServer) -> RedisStore {
    let store = RedisStore::connect(server.url()).await.unwrap();
    // Registered at once, before the subscription (a few round trips away) can be up.
    let probe = Token::generate().unwrap();
    let mut watch = store
        .queue_watch(&key("probe", "settled"), &probe, None)
        .expect("hand-off is on");
    // None within 1 s: the subscription came up before the probe registered, and told its
    // waiters then.
    let _ = tokio::time::timeout(Duration::from_secs(1), watch.signal()).await;
    store
}

/// A queued caller that finds the key free (its holder's lease ran out) with only crashed
/// waiters ahead of it takes the key itself: it is the first live waiter. It is not passed
/// over for a live waiter behind it, nor sent to the back of the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_caller_that_finds_the_key_free_keeps_its_place() {
    let server = RedisServer::start();
    let caller = RedisStore::connect(server.url()).await.unwrap();
    let caller_channel = handoff_subscriptions(&server, 1).await.remove(0);
    let behind = RedisStore::connect(server.url()).await.unwrap();
    let behind_channel = handoff_subscriptions(&server, 2)
        .await
        .into_iter()
        .find(|c| *c != caller_channel)
        .unwrap();
    let k = key("handoff", "hot");
    let (mine, theirs) = (Token::generate().unwrap(), Token::generate().unwrap());
    push_entries(
        &server,
        &k,
        &[
            entry(
                "deaddeaddeaddeaddeaddeaddeaddead",
                "tower-lock:handoff:gone",
            ),
            entry(&token_text(&mine), &caller_channel),
            entry(&token_text(&theirs), &behind_channel),
        ],
    )
    .await;
    // The key is free: the lease of the holder these waiters queued behind ran out.
    let answer = caller
        .enqueue(&k, &mine, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(matches!(answer, Attempt::Acquired { .. }), "{answer:?}");
    assert_eq!(get(&server, &k).await.as_deref(), Some(mine.as_bytes()));
    assert_eq!(
        queue_entries(&server, &k).await,
        [entry(&token_text(&theirs), &behind_channel).into_bytes()]
    );
    drop(behind);
}

/// The same enqueue sent twice (a request re-sent after its reply was lost) while the key is
/// held: both answer `Queued`; the release hands the key to the waiter, its claim answers
/// `Acquired` and takes its token out of the queue entirely, so after its own release the key
/// is free for others (not handed to the waiter's token a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_enqueue_is_handed_the_key_once() {
    let server = RedisServer::start();
    let all = stores(&server, 3).await;
    let (holder, waiter, other) = (&all[0], &all[1], &all[2]);
    let k = key("handoff", "hot");
    let ttl = Duration::from_secs(10);
    let (h, w, o) = (
        Token::generate().unwrap(),
        Token::generate().unwrap(),
        Token::generate().unwrap(),
    );
    assert!(matches!(
        holder.acquire(&k, &h, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    for _ in 0..2 {
        let answer = waiter.enqueue(&k, &w, ttl).await.unwrap();
        assert!(matches!(answer, Attempt::Queued { .. }), "{answer:?}");
    }
    assert!(holder.release(&k, &h).await.unwrap());
    let answer = waiter.enqueue(&k, &w, ttl).await.unwrap();
    assert!(matches!(answer, Attempt::Acquired { .. }), "{answer:?}");
    assert_eq!(queue_len(&server, &k).await, 0);
    assert!(waiter.release(&k, &w).await.unwrap());
    let answer = other.acquire(&k, &o, ttl).await.unwrap();
    assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
}

/// Distinct keys, some of them contended (queued, then handed over to the waiter, whose claim
/// gets a greater fencing token): nothing is left per key once they are released, only the
/// fencing counters of the slots they fell in. The uncontended half of the store's semantics
/// is `tests/redis.rs`, `store_semantics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_keys_leave_only_the_fencing_counters() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let ttl = Duration::from_secs(5);
    let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
    handoff_subscriptions(&server, 1).await;
    for i in 0..50 {
        let key = LockKey::new("tower-lock:", "t", format!("k{i}").as_bytes(), 64).unwrap();
        let Acquire::Acquired { fencing_token } = store.acquire(&key, &a, ttl).await.unwrap()
        else {
            panic!("not acquired")
        };
        let last = fencing_token;
        if i % 5 == 0 {
            let queued = store.enqueue(&key, &b, ttl).await.unwrap();
            assert!(matches!(queued, Attempt::Queued { .. }), "{queued:?}");
            assert!(store.release(&key, &a).await.unwrap());
            let Attempt::Acquired { fencing_token } = store.enqueue(&key, &b, ttl).await.unwrap()
            else {
                panic!("the hand-off was not claimed")
            };
            assert!(fencing_token > last, "{fencing_token} after {last}");
            assert!(store.release(&key, &b).await.unwrap());
        } else {
            assert!(store.release(&key, &a).await.unwrap());
        }
    }
    let keys = every_key(&server).await;
    assert!(
        keys.iter().all(|k| is_fence_counter(k)),
        "left behind: {keys:?}"
    );
}

/// A cluster-mode server reached through a plain connection (a managed "cluster mode, one
/// shard" Redis, one node owning every slot) refuses a script over keys of several slots
/// (CROSSSLOT). A store made from a connection did not ask the server at connect (as
/// `connect` does): its first batch is refused, and from then on batches go one script per
/// slot, with each slot's fencing counter, each lease answered for itself. (Through a locker:
/// `tests/redis.rs`, `batched_renewals_on_a_cluster_mode_server`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_renewals_on_a_cluster_mode_server_answer_each_lease() {
    let server = one_node_cluster();
    let manager =
        ::redis::aio::ConnectionManager::new(::redis::Client::open(server.url()).unwrap())
            .await
            .unwrap();
    let store = RedisStore::from_connection_manager(manager);
    let ttl = Duration::from_secs(30);
    let mut leases = Vec::new();
    for i in 0..40 {
        let key = LockKey::new("tower-lock:", "t", format!("k{i}").as_bytes(), 64).unwrap();
        let token = Token::generate().unwrap();
        let answer = store.acquire(&key, &token, ttl).await.unwrap();
        assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
        leases.push((key, token));
    }
    let slots: HashSet<u16> = leases
        .iter()
        .map(|(key, _)| key_slot(key.as_bytes()))
        .collect();
    assert!(slots.len() > 30, "the leases share slots: {}", slots.len());
    // One lease is not ours (any more): its own answer says so.
    leases[7].1 = Token::generate().unwrap();
    let renewed = store.renew_many(&leases, Duration::from_secs(60)).await;
    for (i, answer) in renewed.iter().enumerate() {
        assert_eq!(
            answer.as_ref().ok(),
            Some(&(i != 7)),
            "lease {i}: {answer:?}"
        );
    }
    // The server did refuse the first script (its fencing counter in another slot), once.
    assert_eq!(errors_of(&server, "CROSSSLOT"), 1);
    let mut conn = server.client().await;
    let pttl: i64 = ::redis::cmd("PTTL")
        .arg(leases[0].0.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 40_000, "not renewed: {pttl}");
}

/// Every script keeps to one hash slot, so a cluster-mode server behind a plain connection runs
/// them all: a key of a route template with braces is taken, queued for, handed over on release,
/// claimed, renewed, and released with its idempotency record; none is refused as CROSSSLOT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_stays_in_one_slot_on_a_cluster_mode_server() {
    let server = one_node_cluster();
    let a = RedisStore::connect(server.url()).await.unwrap();
    let b = settled_store(&server).await;
    handoff_subscriptions(&server, 2).await;
    let key = LockKey::new("tower-lock:", "POST /items/{sku}/purchase", b"sku-1", 64).unwrap();
    let ttl = Duration::from_secs(10);
    let (holder, waiter) = (Token::generate().unwrap(), Token::generate().unwrap());
    let answer = a.acquire(&key, &holder, ttl).await.unwrap();
    assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
    let answer = b.enqueue(&key, &waiter, ttl).await.unwrap();
    assert!(matches!(answer, Attempt::Queued { .. }), "{answer:?}");
    let mut watch = b
        .queue_watch(&key, &waiter, Some(&answer))
        .expect("hand-off is on");
    assert!(a.release(&key, &holder).await.unwrap());
    let signal = tokio::time::timeout(Duration::from_secs(2), watch.signal())
        .await
        .expect("no hand-off");
    assert!(matches!(signal, Signal::Granted { .. }), "{signal:?}");
    let answer = b.enqueue(&key, &waiter, ttl).await.unwrap();
    let Attempt::Acquired { fencing_token } = answer else {
        panic!("not acquired: {answer:?}");
    };
    assert!(b.renew(&key, &waiter, ttl).await.unwrap());
    let record = Bytes::from_static(b"the response");
    let answer = b.complete(
        &key,
        &waiter,
        fencing_token,
        record.clone(),
        Duration::from_secs(60),
    );
    assert!(answer.await.unwrap().released);
    assert_eq!(b.lookup(&key).await.unwrap(), Some(record));
    assert_eq!(errors_of(&server, "CROSSSLOT"), 0);
}

/// `complete` on `RedisStore`: only the holder writes the record, which appears exactly as the
/// lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_is_one_step_for_the_holder() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    super::complete_is_one_step_for_the_holder(store).await;
}

/// An idempotency record is not a key a client can lock. Under the earlier layout
/// (`<lock key>:record`), the lock key of `sku-27712:record` under `audit` was the record key of
/// `sku-27712` (the two values share a hash tag): completing `sku-27712` overwrote that lock
/// with the record, and the lock's holder lost it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_is_not_a_lock_key_a_client_can_spell() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let ttl = Duration::from_secs(10);
    let (spelled, victim) = (key("audit", "sku-27712:record"), key("audit", "sku-27712"));
    let (holder, owner) = (Token::generate().unwrap(), Token::generate().unwrap());
    assert!(matches!(
        store.acquire(&spelled, &holder, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    let Acquire::Acquired { fencing_token } = store.acquire(&victim, &owner, ttl).await.unwrap()
    else {
        panic!("the victim's key is free");
    };
    let record = Bytes::from_static(b"the stored response");
    let completed = store
        .complete(&victim, &owner, fencing_token, record.clone(), ttl)
        .await
        .unwrap();
    assert!(completed.stored && completed.released);
    assert_eq!(store.lookup(&victim).await.unwrap(), Some(record));
    assert_eq!(
        get(&server, &spelled).await.as_deref(),
        Some(holder.as_bytes()),
        "the record overwrote another lock"
    );
    assert!(store.release(&spelled, &holder).await.unwrap());
}
