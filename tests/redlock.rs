//! `RedlockStore` over 3 and 5 independent `redis-server` masters: the behaviour suite with the
//! same overlap detector as the single-node tests, then faults (masters killed, a master
//! restarted empty under a held lease), validity and fencing.

use crate::suite;
use crate::support;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use support::{
    Backend, Counter, LockKeys, Redlock, body_json, counter_app, purchase, send, value_of,
};
use tower_lock::{
    Key, LockConfig, LockLayer, Locker, RedisStore, Wait,
    config::OnLeaseLost,
    key::LockKey,
    store::{Acquire, LockStore, RedlockStore, Token},
};

suite::tests!(
    Redlock::new(3);
    exclusion,
    renewal_keeps_long_handlers_exclusive,
    without_renewal_the_lease_expires,
    release_on_completion,
    release_on_drop,
    contended_is_409_problem,
    singleton_guard,
    own_token_acquires_again,
);
suite::set_tests!(Redlock::new(3));

// The negative controls for the exclusion tests: the same loads without the layer lose updates.
suite::controls!(
    without_the_lock_updates_are_lost,
    without_the_lock_sets_lose_updates
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_over_five_masters() {
    suite::exclusion(Redlock::new(5)).await;
}

/// Deleting the lease on a majority of the masters behind the holder's back: the renewal finds
/// no quorum and the handler is aborted (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_on_a_majority_aborts() {
    suite::lease_loss(
        Redlock::new(3),
        OnLeaseLost::Abort,
        |backend: Redlock| async move {
            for server in &backend.0[..2] {
                support::delete_the_held_key(server).await;
            }
            backend
        },
    )
    .await;
}

fn key(value: &str) -> LockKey {
    LockKey::new("tower-lock:", "t", value.as_bytes(), 64).unwrap()
}

/// Masters killed: with a minority down, locks are still granted and exclusive; with a
/// majority down, requests get 503 within the wait deadline (plus the store timeout floor).
async fn kill_masters(n: usize) {
    let mut backend = Redlock::new(n);
    let deadline = Duration::from_millis(500);
    let store = backend.store().await;
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let counter = Counter::new();
    let app = counter_app(
        std::sync::Arc::clone(&counter),
        Some(LockLayer::with_config(
            store.clone(),
            Key::path_param("sku"),
            config,
        )),
    );
    let minority = n - (n / 2 + 1);
    for server in &mut backend.0[..minority] {
        server.kill();
    }
    // Still granted, still exclusive.
    support::assert_one_holder_at_a_time(&app, &counter).await;

    // One more down: no quorum.
    backend.0[minority].kill();
    let config = LockConfig::builder()
        .wait(Wait::default().deadline(deadline))
        .build()
        .unwrap();
    let app = counter_app(
        Counter::new(),
        Some(LockLayer::with_config(
            store,
            Key::path_param("sku"),
            config,
        )),
    );
    for i in 0..3 {
        let started = Instant::now();
        let response = send(&app, purchase(&format!("k{i}"), 0)).await;
        let took = started.elapsed();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = body_json(response).await;
        support::assert_problem_type(&body, "#lock-store-unavailable");
        assert!(
            took < deadline + Duration::from_millis(1500),
            "503 after {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_masters_one_killed_then_two() {
    kill_masters(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_masters_two_killed_then_three() {
    kill_masters(5).await;
}

/// `connect` needs a quorum reachable now, and names how many were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_needs_a_reachable_quorum() {
    let mut backend = Redlock::new(3);
    backend.0[0].kill();
    let store = RedlockStore::connect(backend.urls()).await.unwrap();
    assert_eq!(store.quorum(), 2);
    backend.0[1].kill();
    let error = RedlockStore::connect(backend.urls()).await.unwrap_err();
    assert!(error.to_string().contains("only 1 of 3"), "{error}");
    assert!(std::error::Error::source(&error).is_some());
}

/// Three masters, a lease on `t`/`k` held on them for `ttl` (renewed every third of it), and
/// the config (no wait) for contenders.
async fn held_on_three_masters(ttl: Duration) -> (Redlock, LockConfig, tower_lock::LeaseGuard) {
    let backend = Redlock::new(3);
    let config = LockConfig::builder()
        .ttl(ttl)
        .wait(Wait::none())
        .build()
        .unwrap();
    let holder = Locker::with_config(backend.store().await, config.clone());
    let guard = holder.acquire(holder.key("t", "k").unwrap()).await.unwrap();
    (backend, config, guard)
}

/// Masters restarted empty one after the other while a lease is held:
/// - one restart is harmless: the rest of the quorum still holds the lease, a contender is
///   refused, and the holder's next renewal, renewed by the quorum, puts the key back on the
///   restarted master (same token, `SET NX PX`): it is on all three again;
/// - so a second master restarted later is harmless too. Before the renewal put keys back,
///   the lease lived on two masters for as long as it was held, and this second restart let a
///   contender win a quorum while the holder ran (two holders);
/// - two masters restarted empty together (within one renewal interval: what Redlock's
///   delayed restart forbids) still let a contender in, and one of the two learns it at its
///   next renewal (the holder, unless its put-back lands on the contender's fresh key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_restarted_empty_one_after_the_other_under_a_held_lease() {
    let ttl = Duration::from_millis(600);
    let (mut backend, config, guard) = held_on_three_masters(ttl).await;

    for restarted in [0, 1, 2, 0] {
        let node = &mut backend.0[restarted];
        // Restarted empty (the holder's next renewal may have put the lease back already).
        tokio::task::block_in_place(|| node.restart());
        // A fresh contender, so that no stale connection of its own gets in the way.
        let contender = Locker::with_config(backend.store().await, config.clone());
        let refused = contender.acquire(contender.key("t", "k").unwrap()).await;
        assert!(
            matches!(refused, Err(tower_lock::LockError::Contended { .. })),
            "master {restarted} restarted: {refused:?}"
        );
        // Renewals (every ttl / 3) keep it, and put it back on the restarted master.
        tokio::time::sleep(ttl * 2).await;
        assert!(!guard.is_lost());
    }
    for (i, node) in backend.0.iter().enumerate() {
        assert_eq!(node.lock_keys().await.len(), 1, "not on master {i}");
    }

    // Breaking the delayed-restart rule: two masters restart empty together.
    tokio::task::block_in_place(|| {
        backend.0[0].kill();
        backend.0[1].kill();
        backend.0[0].restart();
        backend.0[1].restart();
    });
    let contender = Locker::with_config(backend.store().await, config);
    let stolen = contender
        .acquire(contender.key("t", "k").unwrap())
        .await
        .expect("two empty masters make a quorum for the contender");
    // One of the two learns it at its next renewal. Usually the holder (two masters deny it);
    // but a renewal in flight when the first master went down may have been granted by the
    // two that were still up, and its put-back then overwrites the contender's fresh key on the
    // first master restarted: the holder keeps a quorum and the contender is the one that
    // finds none.
    let lost = tokio::time::timeout(ttl, async {
        tokio::select! {
            reason = guard.lost() => ("holder", reason),
            reason = stolen.lost() => ("contender", reason),
        }
    })
    .await;
    assert!(
        lost.is_ok(),
        "neither the holder nor the contender noticed at its next renewal"
    );
    let _ = stolen.release().await;
}

/// A master restarted empty under a held lease, where a contender's failed attempt then left
/// its key (written here by hand, with a long TTL: a contender retrying every few milliseconds
/// keeps one there): the holder's renewals, granted by the other two masters, put the lease
/// back over it within two renewal intervals (the documented bound; allowed four here), so
/// restarting a second master after that leaves the holder its quorum. Before, the put-back
/// was `SET NX`: the contender's key stayed, the lease lived on a bare quorum, and the second
/// restart let the contender in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_put_back_over_a_failed_attempts_key() {
    let ttl = Duration::from_millis(600);
    let (mut backend, config, guard) = held_on_three_masters(ttl).await;
    let key = backend.0[1].lock_keys().await.remove(0);
    let token = value_of(&backend.0[1], &key)
        .await
        .expect("held on master 1");
    tokio::task::block_in_place(|| backend.0[0].restart());
    let mut conn = backend.0[0].client().await;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("a contender's token")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let back = Instant::now();
    while value_of(&backend.0[0], &key).await.as_ref() != Some(&token) {
        assert!(
            back.elapsed() < ttl * 4 / 3,
            "the lease is not back on the restarted master: {:?}",
            value_of(&backend.0[0], &key).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::task::block_in_place(|| backend.0[1].restart());
    let contender = Locker::with_config(backend.store().await, config);
    let refused = contender.acquire(contender.key("t", "k").unwrap()).await;
    assert!(
        matches!(refused, Err(tower_lock::LockError::Contended { .. })),
        "the second restart let the contender in: {refused:?}"
    );
    tokio::time::sleep(ttl).await;
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}

/// A failed acquire releases what it took: one node held by someone else, one dead, the third
/// granted to us; no quorum, so the third is released at once, and the answer is "held" (409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_acquire_releases_on_every_node() {
    let mut backend = Redlock::new(3);
    let store = backend.store().await;
    let k = key("partial");
    let ttl = Duration::from_secs(5);
    let other = RedisStore::connect(backend.0[0].url()).await.unwrap();
    let taken = other
        .acquire(&k, &Token::generate().unwrap(), ttl)
        .await
        .unwrap();
    assert!(matches!(taken, Acquire::Acquired { .. }));
    backend.0[1].kill();
    let answer = store
        .acquire(&k, &Token::generate().unwrap(), ttl)
        .await
        .unwrap();
    assert!(
        matches!(
            answer,
            Acquire::Contended {
                expires_in: Some(_)
            }
        ),
        "{answer:?}"
    );
    assert!(
        backend.0[2].lock_keys().await.is_empty(),
        "the partial acquisition was not released"
    );
}

/// The lease reports Redlock's validity (`ttl` less the drift allowance), and its fencing token
/// is the largest of the quorum's per-node tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_and_quorum_max_fencing_token() {
    let backend = Redlock::new(3);
    let ttl = Duration::from_secs(10);
    let store = backend.store().await;
    assert_eq!(store.validity(ttl), Duration::from_millis(9898));
    let locker = Locker::with_config(store, LockConfig::builder().ttl(ttl).build().unwrap());
    let k = locker.key("t", "v").unwrap();
    let guard = locker.acquire(k.clone()).await.unwrap();
    let left = guard.time_left();
    assert!(
        left <= Duration::from_millis(9898) && left > Duration::from_secs(9),
        "{left:?}"
    );
    let mut fences = Vec::new();
    for server in &backend.0 {
        let mut conn = server.client().await;
        // The server's fencing counter (one per server that does not hash keys to slots).
        let counters = support::keys_matching(server, "tower-lock:fence*").await;
        assert_eq!(counters.len(), 1, "{counters:?}");
        let fence_key = &counters[0];
        let fence: u64 = redis::cmd("GET")
            .arg(fence_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        fences.push(fence);
    }
    assert_eq!(guard.fencing_token(), *fences.iter().max().unwrap());
    // A later holder's token is larger (the nodes share one clock here).
    guard.release().await.unwrap();
    // A node's tokens follow its clock, even from a counter far behind it: the masters' tokens
    // stay comparable.
    let mut conn = backend.0[0].client().await;
    let counters = support::keys_matching(&backend.0[0], "tower-lock:fence*").await;
    let _: () = redis::cmd("SET")
        .arg(&counters[0])
        .arg(5)
        .query_async(&mut conn)
        .await
        .unwrap();
    let next = locker.acquire(k).await.unwrap();
    assert!(next.fencing_token() > *fences.iter().max().unwrap());
    let fence: u64 = redis::cmd("GET")
        .arg(&counters[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        fence > fences[0],
        "node 0 handed out {fence} after {}",
        fences[0]
    );
    next.release().await.unwrap();
}
