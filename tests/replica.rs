//! `RedisStore::wait_for_replicas` on a real master and replica on loopback: `WAIT` after acquire
//! and renew, and too few acknowledgements treated as a failed acquire (released, 503).

use crate::suite;
use crate::support;

use std::time::Duration;

use axum::http::StatusCode;
use support::{Backend, Counter, LockKeys, body_json, counter_app, purchase, send, value_of};
use tower_lock::{
    Key, LockConfig, LockLayer, RedisStore, Wait,
    key::LockKey,
    store::{Acquire, LockStore, StoreErrorKind, Token},
};
use tower_lock_testkit::{RedisServer, calls_of};

/// A master with one replica; stores wait for `acks` acknowledgements.
struct Replicated {
    master: RedisServer,
    replica: RedisServer,
    acks: usize,
}

impl Replicated {
    fn new(acks: usize) -> Self {
        let master = RedisServer::start();
        let replica = RedisServer::replica_of(&master);
        Self {
            master,
            replica,
            acks,
        }
    }
}

impl Backend for Replicated {
    type Store = RedisStore;
    const NAME: &'static str = "redis+replica";
    async fn store(&self) -> RedisStore {
        RedisStore::connect(self.master.url())
            .await
            .unwrap()
            .wait_for_replicas(self.acks, Duration::from_millis(500))
            .unwrap()
    }
}

/// The suite's exclusion test with `WAIT 1` on every acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion() {
    suite::exclusion(Replicated::new(1)).await;
}

// The negative control for `exclusion`.
suite::controls!(without_the_lock_updates_are_lost);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_long_handlers_exclusive() {
    suite::renewal_keeps_long_handlers_exclusive(Replicated::new(1)).await;
}

fn key(value: &str) -> LockKey {
    LockKey::new("tower-lock:", "t", value.as_bytes(), 64).unwrap()
}

/// Acquired means on the replica too, as soon as acquire answers; `WAIT` travels in the same
/// round trip as the script (one `wait` per `evalsha`, no extra command), also after the
/// script cache was flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquired_leases_are_on_the_replica() {
    let backend = Replicated::new(1);
    let store = backend.store().await;
    let ttl = Duration::from_secs(5);
    backend.master.cli(&["CONFIG", "RESETSTAT"]);
    for i in 0..20 {
        let k = key(&format!("k{i}"));
        let token = Token::generate().unwrap();
        let answer = store.acquire(&k, &token, ttl).await.unwrap();
        assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
        assert_eq!(
            value_of(&backend.replica, k.as_bytes()).await.as_deref(),
            Some(token.as_bytes()),
            "acquire answered before the replica had the lease"
        );
        assert!(store.renew(&k, &token, ttl).await.unwrap());
        assert!(store.release(&k, &token).await.unwrap());
    }
    let stats = backend.master.cli(&["INFO", "commandstats"]);
    // Successful calls (the first call of each script fails with NOSCRIPT and is retried).
    let calls = |name: &str| {
        let line = stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
            .unwrap_or_default();
        let field = |f: &str| {
            line.split([':', ','])
                .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('=')?.parse::<u64>().ok())
                .unwrap_or(0)
        };
        field("calls") - field("failed_calls")
    };
    // 20 acquires and 20 renewals are followed by WAIT; releases are not. One script carries
    // every operation: the first call met NOSCRIPT and was sent again, WAIT included: 1 more.
    assert_eq!(calls("wait"), 41, "{stats}");
    assert_eq!(calls("evalsha"), 60, "{stats}");

    backend.master.cli(&["SCRIPT", "FLUSH"]);
    let (k, token) = (key("after-flush"), Token::generate().unwrap());
    let answer = store.acquire(&k, &token, ttl).await.unwrap();
    assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
    assert!(store.release(&k, &token).await.unwrap());
}

/// Asking for more acknowledgements than there are replicas: the acquire fails with an
/// `Unavailable` store error that says why, and the key it took on the master is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_acknowledgements_fail_the_acquire_and_release() {
    let backend = Replicated::new(2);
    let store = backend.store().await;
    let k = key("short");
    let error = store
        .acquire(&k, &Token::generate().unwrap(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable);
    let source = std::error::Error::source(&error).unwrap().to_string();
    assert!(source.contains("1 of 2 replicas"), "{source}");
    assert!(backend.master.lock_keys().await.is_empty(), "not released");
}

/// The replica gone: requests answer 503 (not 200 on an unreplicated lease) and leave nothing
/// locked; they succeed again once the replica is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_down_answers_503() {
    let mut backend = Replicated::new(1);
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let layer = LockLayer::with_config(backend.store().await, Key::path_param("sku"), config);
    let counter = Counter::new();
    let app = counter_app(std::sync::Arc::clone(&counter), Some(layer));
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);

    backend.replica.kill();
    let response = send(&app, purchase("k", 0)).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = body_json(response).await;
    support::assert_problem_type(&body, "#lock-store-unavailable");
    assert_eq!(
        counter.finished.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert!(backend.master.lock_keys().await.is_empty(), "not released");

    tokio::task::block_in_place(|| {
        backend.replica.restart();
        backend.replica.wait_for_info("master_link_status:up");
        backend.master.wait_for_replica_acks(1);
    });
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
}

/// A key handed over by a release (which does not wait for replicas) is confirmed, with its
/// `WAIT`, before the waiter runs: the waiter's lease is acknowledged like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_lease_is_acknowledged_before_it_runs() {
    let servers = Replicated::new(1);
    let (one, two) = (servers.store().await, servers.store().await);
    let mut conn = servers.master.client().await;
    support::handoff_subscriptions(&servers.master, 2).await;
    let wait = Wait::constant(Duration::from_secs(5))
        .unwrap()
        .deadline(Duration::from_secs(30));
    let holder = tower_lock::Locker::with_config(
        one,
        LockConfig::builder().wait(wait.clone()).build().unwrap(),
    );
    let waiter =
        tower_lock::Locker::with_config(two, LockConfig::builder().wait(wait).build().unwrap());
    let key = holder.key("replica", "handoff").unwrap();
    let held = holder.acquire(key.clone()).await.unwrap();
    let next = tokio::spawn({
        let key = key.clone();
        async move { waiter.acquire(key).await.unwrap() }
    });
    let queue = support::queue_key(key.as_bytes());
    loop {
        let len: usize = redis::cmd("LLEN")
            .arg(&queue)
            .query_async(&mut conn)
            .await
            .unwrap();
        if len == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let before = calls_of(&servers.master, "wait").await;
    let started = std::time::Instant::now();
    held.release().await.unwrap();
    let guard = next.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "not handed over"
    );
    assert_eq!(
        calls_of(&servers.master, "wait").await - before,
        1,
        "the handed-over lease ran without a replica acknowledgement"
    );
    guard.release().await.unwrap();
}
