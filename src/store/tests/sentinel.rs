//! `SentinelStore`'s hand-off queue and batched renewal across a failover, on a real master,
//! replica and three sentinels on loopback. Both capabilities reach the master's store through
//! `Capabilities::routed`.

use std::time::{Duration, Instant};

use tower_lock_testkit::{
    RedisServer, calls_of,
    sentinel::{MASTER_NAME, SentinelSetup},
};

use super::{
    Ops, acquired, get, handoff_subscriptions, is_fence_counter, queue_entries, queue_key,
};
use crate::{
    key::LockKey,
    store::{Attempt, LockStore, SentinelStore, Signal, StoreError},
    token::Token,
};

fn key(value: &str) -> LockKey {
    super::key("t", value)
}

/// Every key under the crate's default prefix but the fencing counters: what a test's leases
/// left behind.
async fn lock_keys(server: &RedisServer) -> Vec<Vec<u8>> {
    let mut conn = server.client().await;
    let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS")
        .arg("tower-lock:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.into_iter().filter(|k| !is_fence_counter(k)).collect()
}

/// The tokens queued for `key` on `server`, in queue order.
async fn queued_tokens(server: &RedisServer, key: &LockKey) -> Vec<Vec<u8>> {
    queue_entries(server, key)
        .await
        .into_iter()
        .map(|e| e[..32].to_vec())
        .collect()
}

/// Calls `enqueue` until it answers that the waiter is queued, through store errors (while
/// there is no master) and "held" answers (while the store's subscription is not up on the new
/// master yet, waiters do not queue), for at most 10 s.
async fn enqueue_until_queued(store: &SentinelStore, key: &LockKey, token: &Token) {
    let started = Instant::now();
    loop {
        let answer = store.enqueue(key, token, Duration::from_secs(30)).await;
        if let Ok(Attempt::Queued { .. }) = answer {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "not queued (master {}): {answer:?}",
            store.master_addr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waiters queued before a failover, registered with their stores' hand-off, queue again on
/// the new master when they check: those whose entries the promoted replica has keep their
/// places, one whose entry it lacks (as if not replicated in time) is queued again at the back,
/// once; the release on the new master hands the key to each in that order, heard by the
/// registrations made before the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_waiters_queue_again_on_the_new_master() {
    let mut setup =
        tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_millis(500)));
    let urls = setup.sentinel_urls();
    let one = SentinelStore::connect(urls.clone(), MASTER_NAME)
        .await
        .unwrap();
    let two = SentinelStore::connect(urls, MASTER_NAME).await.unwrap();
    handoff_subscriptions(&setup.master, 2).await;
    let ttl = Duration::from_secs(30);
    let k = key("queued-across");
    let holder = Token::generate().unwrap();
    acquired(one.acquire(&k, &holder, ttl).await.unwrap());
    let waiters: Vec<(&SentinelStore, Token)> = [&two, &one, &two]
        .into_iter()
        .map(|s| (s, Token::generate().unwrap()))
        .collect();
    let mut watches = Vec::new();
    for (store, token) in &waiters {
        let answer = store.enqueue(&k, token, ttl).await.unwrap();
        assert!(matches!(answer, Attempt::Queued { .. }), "{answer:?}");
        watches.push(store.queue_watch(&k, token, Some(&answer)).unwrap());
    }
    let tokens: Vec<Vec<u8>> = waiters.iter().map(|(_, t)| t.as_bytes().to_vec()).collect();
    // Replicated: the replica has the lease and the queue.
    let started = Instant::now();
    while queued_tokens(&setup.replica, &k).await != tokens {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "queue not replicated"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        get(&setup.replica, &k).await.as_deref(),
        Some(holder.as_bytes())
    );

    setup.master.kill();
    let new = setup.replica.port();
    tokio::task::block_in_place(|| setup.wait_for_master(new, Duration::from_secs(10)));
    // The second waiter's entry did not reach the new master.
    let lost = queue_entries(&setup.replica, &k).await.remove(1);
    let mut conn = setup.replica.client().await;
    let _: () = ::redis::cmd("LREM")
        .arg(queue_key(&k))
        .arg(0)
        .arg(lost)
        .query_async(&mut conn)
        .await
        .unwrap();
    // Each waiter was told to check again (its subscription broke), and does.
    for watch in &mut watches {
        let signal = tokio::time::timeout(Duration::from_secs(5), watch.signal())
            .await
            .expect("a waiter was not told to check again");
        assert_eq!(signal, Signal::Retry);
    }
    for (store, token) in waiters.iter().chain(&waiters) {
        enqueue_until_queued(store, &k, token).await;
    }
    assert_eq!(
        queued_tokens(&setup.replica, &k).await,
        [tokens[0].clone(), tokens[2].clone(), tokens[1].clone()],
        "places not kept, or the lost entry not queued again once"
    );

    assert!(one.release(&k, &holder).await.unwrap());
    for i in [0, 2, 1] {
        let (store, token) = &waiters[i];
        let started = Instant::now();
        loop {
            let signal = tokio::time::timeout(Duration::from_secs(1), watches[i].signal())
                .await
                .unwrap_or_else(|_| panic!("waiter {i} was not handed the key within 1 s"));
            if matches!(signal, Signal::Granted { .. }) {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(1), "{signal:?}");
        }
        acquired(store.enqueue(&k, token, ttl).await.unwrap());
        assert!(store.release(&k, token).await.unwrap());
    }
    assert!(
        lock_keys(&setup.replica).await.is_empty(),
        "keys left behind"
    );
}

/// Renewals are batched on a Sentinel master as on a single one (one script per group), and a
/// batch that meets a killed master is sent again to the promoted replica in the same call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_are_batched_across_a_failover() {
    let mut setup =
        tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_millis(500)));
    let store = SentinelStore::connect(setup.sentinel_urls(), MASTER_NAME)
        .await
        .unwrap();
    // Acquired with the replica's acknowledgement, so that they survive the failover.
    let acked = store
        .clone()
        .wait_for_replicas(1, Duration::from_millis(500))
        .unwrap();
    let ttl = Duration::from_secs(30);
    let mut leases = Vec::new();
    for i in 0..20 {
        let (k, token) = (key(&format!("batch-{i}")), Token::generate().unwrap());
        acquired(acked.acquire(&k, &token, ttl).await.unwrap());
        leases.push((k, token));
    }
    let store = acked.wait_for_replicas(0, Duration::ZERO).unwrap();
    let renewed =
        |answers: Vec<Result<bool, StoreError>>| answers.into_iter().all(|a| matches!(a, Ok(true)));
    // The first batch loads the script (EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA).
    assert!(renewed(store.renew_many(&leases, ttl).await));
    let before = calls_of(&setup.master, "evalsha").await;
    // The master holds scripts for a moment, so that the first renewal is still in flight when
    // the others are polled, however slowly this process runs: they queue behind it.
    setup.master.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    assert!(renewed(store.renew_many(&leases, ttl).await));
    // The twenty in one script (or the first alone, should the store's driver take it before
    // the others came, then the rest together; or the second alone too, should the pause have
    // ended before it was sent).
    let calls = calls_of(&setup.master, "evalsha").await - before;
    assert!(
        (1..=3).contains(&calls),
        "{calls} script calls for 20 renewals"
    );

    setup.master.kill();
    let new = setup.replica.port();
    tokio::task::block_in_place(|| setup.wait_for_master(new, Duration::from_secs(10)));
    // The store is still on the dead master: the batch fails there and goes to the new one.
    assert_ne!(store.master_addr(), format!("127.0.0.1:{new}"));
    let answers = store.renew_many(&leases, ttl).await;
    assert!(renewed(answers.clone()), "{answers:?}");
    assert_eq!(store.master_addr(), format!("127.0.0.1:{new}"));
    let before = calls_of(&setup.replica, "evalsha").await;
    // Held for a moment again, as above, so that the count does not depend on load.
    setup.replica.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    assert!(renewed(store.renew_many(&leases, ttl).await));
    let calls = calls_of(&setup.replica, "evalsha").await - before;
    assert!(
        (1..=3).contains(&calls),
        "{calls} script calls for 20 renewals"
    );
}
