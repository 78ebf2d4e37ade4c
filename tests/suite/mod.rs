//! The behaviour suite, run against every store (see `tests/memory.rs`, `tests/redis.rs`).
//!
//! Each test builds two separately configured services ("instances") over two handles onto the
//! same store, the way two servers share one Redis.
#![allow(dead_code, unreachable_pub)]

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use axum::http::{StatusCode, header};
use tower_lock::{
    Key, LockConfig, LockLayer, Locker, Wait,
    config::{LockConfigBuilder, OnLeaseLost},
};

pub use crate::support::wait_until;
use crate::support::{
    Backend, Counter, SKU_NAMESPACE, Shop, Tally, assert_problem_type, body_json, counter_app,
    order, purchase, send, shop_app,
};

/// One `#[tokio::test]` per named suite test, each on a fresh backend from `$backend`:
/// `suite::tests!(Memory::new(); exclusion, release_on_drop);`
#[allow(unused_macros)] // not every backend's test file uses it
macro_rules! tests {
    ($backend:expr; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            suite::$name($backend).await;
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use tests;

/// The suite's single-key tests, each on a fresh backend from `$backend`:
/// `suite::single_key_tests!(Memory::new());`
#[allow(unused_macros)]
macro_rules! single_key_tests {
    ($backend:expr) => {
        suite::tests!(
            $backend;
            exclusion,
            renewal_keeps_long_handlers_exclusive,
            without_renewal_the_lease_expires,
            release_on_completion,
            release_on_drop,
            release_on_panic,
            contended_is_409_problem,
            max_hold_bounds_a_request,
            singleton_guard,
            own_token_acquires_again,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use single_key_tests;

/// The suite's key-set tests, each on a fresh backend from `$backend`:
/// `suite::set_tests!(Memory::new());`
#[allow(unused_macros)]
macro_rules! set_tests {
    ($backend:expr) => {
        suite::tests!(
            $backend;
            sets_exclude_each_other_and_single_keys,
            sets_in_opposite_orders_never_deadlock,
            a_set_takes_all_its_keys_or_none,
            a_set_makes_a_single_key_wait,
            a_set_is_not_starved_by_single_keys,
            a_set_is_released_on_drop_and_panic,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use set_tests;

/// One `#[tokio::test]` per named negative control (a suite function without a backend: the
/// same load without the layer, which must lose updates):
/// `suite::controls!(without_the_lock_updates_are_lost);`
#[allow(unused_macros)]
macro_rules! controls {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            suite::$name().await;
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use controls;

/// Every key-set test of the suite, one after the other on the one `backend`: for a topology
/// too slow to start once per test (a cluster, a Sentinel setup).
pub async fn set_tests_in_turn<B: Backend>(backend: B) {
    let backend = Arc::new(backend);
    sets_exclude_each_other_and_single_keys(Arc::clone(&backend)).await;
    sets_in_opposite_orders_never_deadlock(Arc::clone(&backend)).await;
    a_set_takes_all_its_keys_or_none(Arc::clone(&backend)).await;
    a_set_makes_a_single_key_wait(Arc::clone(&backend)).await;
    a_set_is_not_starved_by_single_keys(Arc::clone(&backend)).await;
    a_set_is_released_on_drop_and_panic(backend).await;
}

/// How many concurrent requests the exclusion test sends.
pub const EXCLUSION_REQUESTS: usize = 240;

async fn layer<B: Backend>(backend: &B, config: LockConfig) -> LockLayer {
    LockLayer::with_config(backend.store().await, Key::path_param("sku"), config)
}

fn patient() -> LockConfigBuilder {
    LockConfig::builder().wait(
        Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
            .unwrap()
            .deadline(Duration::from_secs(60)),
    )
}

/// Runs `n` concurrent purchases of `sku` spread over `apps`.
async fn load(apps: &[axum::Router], n: usize, sku: &str, work_ms: u64) -> Tally {
    let mut tasks = Vec::new();
    for i in 0..n {
        let app = apps[i % apps.len()].clone();
        let sku = sku.to_owned();
        tasks.push(tokio::spawn(async move {
            send(&app, purchase(&sku, work_ms)).await.status()
        }));
    }
    let mut tally = Tally::default();
    for task in tasks {
        tally.add(task.await.unwrap());
    }
    tally
}

/// Two instances, many concurrent non-atomic read-modify-writes on one key: no lost update,
/// no overlap, fencing tokens order the writes.
pub async fn exclusion<B: Backend>(backend: B) {
    let counter = Counter::new();
    let apps = [
        counter_app(
            Arc::clone(&counter),
            Some(layer(&backend, patient().build().unwrap()).await),
        ),
        counter_app(
            Arc::clone(&counter),
            Some(layer(&backend, patient().build().unwrap()).await),
        ),
    ];
    let tally = load(&apps, EXCLUSION_REQUESTS, "hot", 1).await;
    assert_eq!(tally.ok, EXCLUSION_REQUESTS, "{tally:?}");
    assert_eq!(
        counter.value.load(Ordering::SeqCst),
        EXCLUSION_REQUESTS as u64,
        "lost updates"
    );
    assert_eq!(
        counter.overlaps.load(Ordering::SeqCst),
        0,
        "two holders at once"
    );
    counter.assert_fenced_in_order();
}

/// The negative control for `exclusion`: the same load without the layer loses updates, so the
/// exclusion test can fail.
pub async fn without_the_lock_updates_are_lost() {
    let counter = Counter::new();
    let apps = [
        counter_app(Arc::clone(&counter), None),
        counter_app(Arc::clone(&counter), None),
    ];
    let tally = load(&apps, EXCLUSION_REQUESTS, "hot", 1).await;
    assert_eq!(tally.ok, EXCLUSION_REQUESTS);
    let value = counter.value.load(Ordering::SeqCst);
    assert!(
        value < EXCLUSION_REQUESTS as u64,
        "no update lost without the lock: {value}"
    );
    assert!(counter.overlaps.load(Ordering::SeqCst) > 0);
}

/// The negative control for `exclusion` through a store reached some other way (over TLS,
/// say): the same load through two layers whose stores do not share their locks (`a` and `b`
/// are two servers, each instance locking in its own) loses updates. So the requests do go
/// through such stores concurrently, and an `exclusion` test through them can fail.
pub async fn unshared_stores_lose_updates<A: Backend, B: Backend>(a: A, b: B) {
    let counter = Counter::new();
    let apps = [
        counter_app(
            Arc::clone(&counter),
            Some(layer(&a, patient().build().unwrap()).await),
        ),
        counter_app(
            Arc::clone(&counter),
            Some(layer(&b, patient().build().unwrap()).await),
        ),
    ];
    let tally = load(&apps, EXCLUSION_REQUESTS, "hot", 1).await;
    assert_eq!(tally.ok, EXCLUSION_REQUESTS, "{tally:?}");
    let value = counter.value.load(Ordering::SeqCst);
    assert!(
        value < EXCLUSION_REQUESTS as u64,
        "no update lost with two unshared stores: {value}"
    );
    assert!(counter.overlaps.load(Ordering::SeqCst) > 0);
}

/// A handler running 5x the TTL keeps its lease: the second request waits until it is done.
pub async fn renewal_keeps_long_handlers_exclusive<B: Backend>(backend: B) {
    let config = patient().ttl(Duration::from_millis(200)).build().unwrap();
    let counter = Counter::new();
    let apps = [
        counter_app(
            Arc::clone(&counter),
            Some(layer(&backend, config.clone()).await),
        ),
        counter_app(Arc::clone(&counter), Some(layer(&backend, config).await)),
    ];
    let tally = load(&apps, 2, "long", 1000).await;
    assert_eq!(tally.ok, 2, "{tally:?}");
    assert_eq!(
        counter.overlaps.load(Ordering::SeqCst),
        0,
        "the lease expired under a running handler"
    );
    assert_eq!(counter.value.load(Ordering::SeqCst), 2);
}

/// The negative control for renewal: without it, a lease of the same TTL expires under a
/// handler that runs 5x as long, and a second holder gets in.
pub async fn without_renewal_the_lease_expires<B: Backend>(backend: B) {
    use tower_lock::store::{Acquire, LockStore, Token};
    let store = backend.store().await;
    let key = tower_lock::key::LockKey::new("tower-lock:", "s", b"k", 64).unwrap();
    let ttl = Duration::from_millis(200);
    let first = store
        .acquire(&key, &Token::generate().unwrap(), ttl)
        .await
        .unwrap();
    assert!(matches!(first, Acquire::Acquired { .. }));
    tokio::time::sleep(ttl * 5).await;
    let second = store
        .acquire(&key, &Token::generate().unwrap(), ttl)
        .await
        .unwrap();
    assert!(matches!(second, Acquire::Acquired { .. }), "{second:?}");
}

/// Release on completion: the next request acquires at once, even failing fast.
pub async fn release_on_completion<B: Backend>(backend: B) {
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let app = counter_app(Counter::new(), Some(layer(&backend, config).await));
    for _ in 0..20 {
        assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    }
}

/// A dropped request (client gone) frees its key within milliseconds, not after the TTL.
pub async fn release_on_drop<B: Backend>(backend: B) {
    let config = LockConfig::builder()
        .wait(Wait::none())
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let counter = Counter::new();
    let app = counter_app(Arc::clone(&counter), Some(layer(&backend, config).await));
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 60_000)).await }
    });
    wait_until(|| counter.inside.load(Ordering::SeqCst) == 1).await;
    assert_eq!(
        send(&app, purchase("k", 0)).await.status(),
        StatusCode::CONFLICT
    );
    running.abort();
    let dropped = Instant::now();
    loop {
        let status = send(&app, purchase("k", 0)).await.status();
        if status == StatusCode::OK {
            break;
        }
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            dropped.elapsed() < Duration::from_secs(2),
            "key still held after the drop"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        dropped.elapsed() < Duration::from_millis(500),
        "freed after {:?}",
        dropped.elapsed()
    );
}

/// A panicking handler releases its key, and the service keeps serving.
pub async fn release_on_panic<B: Backend>(backend: B) {
    let config = LockConfig::builder()
        .wait(Wait::none())
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let layer = layer(&backend, config).await;
    let app = axum::Router::new()
        .route(
            "/items/{sku}/purchase",
            axum::routing::post(
                |axum::extract::Path(sku): axum::extract::Path<String>| async move {
                    if sku == "boom" {
                        panic!("handler panicked on purpose");
                    }
                    "ok"
                },
            ),
        )
        .route_layer(layer)
        .layer(tower_http::catch_panic::CatchPanicLayer::new());
    let r = send(&app, purchase("boom", 0)).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let started = Instant::now();
    loop {
        // The release is spawned from the unwinding future; give it a moment.
        match send(&app, purchase("boom", 0)).await.status() {
            StatusCode::INTERNAL_SERVER_ERROR => break,
            StatusCode::CONFLICT if started.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            other => panic!("key not released after a panic: {other}"),
        }
    }
    assert_eq!(
        send(&app, purchase("fine", 0)).await.status(),
        StatusCode::OK
    );
}

/// Contention answers 409 problem+json with `Retry-After` from the holder's TTL.
pub async fn contended_is_409_problem<B: Backend>(backend: B) {
    let config = LockConfig::builder()
        .wait(Wait::none())
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let counter = Counter::new();
    let app = counter_app(Arc::clone(&counter), Some(layer(&backend, config).await));
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 1500)).await.status() }
    });
    wait_until(|| counter.inside.load(Ordering::SeqCst) == 1).await;
    let r = send(&app, purchase("k", 0)).await;
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(
        r.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let retry: u64 = r.headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&retry), "Retry-After {retry}");
    let body = body_json(r).await;
    assert_eq!(body["status"], 409);
    assert_problem_type(&body, "#lock-contended");
    assert!(body["detail"].as_str().unwrap().contains("retry"));
    assert_eq!(running.await.unwrap(), StatusCode::OK);
}

/// A key deleted or expired behind the holder's back is noticed at the next renewal: under
/// `Abort` the handler is dropped and the client gets 503; under `Continue` it finishes and sees
/// the loss. `steal` makes the lease go away.
pub async fn lease_loss<B, F, Fut>(backend: B, policy: OnLeaseLost, steal: F)
where
    B: Backend,
    F: FnOnce(B) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let config = patient()
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_secs(60))
        .build()
        .unwrap();
    let counter = Counter::new();
    let layer = layer(&backend, config).await.on_lease_lost(policy);
    let app = counter_app(Arc::clone(&counter), Some(layer));
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 1500)).await }
    });
    wait_until(|| counter.inside.load(Ordering::SeqCst) == 1).await;
    let started = Instant::now();
    let _backend = steal(backend).await;
    let response = running.await.unwrap();
    match policy {
        OnLeaseLost::Abort => {
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert!(
                started.elapsed() < Duration::from_millis(1200),
                "abort came late"
            );
            let body = body_json(response).await;
            assert_problem_type(&body, "#lease-lost");
            assert_eq!(
                counter.finished.load(Ordering::SeqCst),
                0,
                "the handler ran on"
            );
        }
        _ => {
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(body_json(response).await["lost"], true);
            assert_eq!(counter.finished.load(Ordering::SeqCst), 1);
        }
    }
}

/// Requests longer than `max_hold` lose their lease (abort: 503).
pub async fn max_hold_bounds_a_request<B: Backend>(backend: B) {
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_millis(400))
        .build()
        .unwrap();
    let counter = Counter::new();
    let app = counter_app(Arc::clone(&counter), Some(layer(&backend, config).await));
    let started = Instant::now();
    let response = send(&app, purchase("k", 5000)).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(counter.finished.load(Ordering::SeqCst), 0);
    // The key was released on abort: the next request gets it at once.
    let quick = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let app2 = counter_app(Counter::new(), Some(layer(&backend, quick).await));
    assert_eq!(send(&app2, purchase("k", 0)).await.status(), StatusCode::OK);
}

/// The singleton guard: exactly one holder among several tasks; when the holder is dropped, or
/// "dies" without releasing, another takes over (at once, or after the TTL).
pub async fn singleton_guard<B: Backend>(backend: B) {
    use tower_lock::Locker;
    let ttl = Duration::from_millis(400);
    let config = LockConfig::builder()
        .ttl(ttl)
        .wait(Wait::constant(Duration::from_millis(20)).unwrap().forever())
        .build()
        .unwrap();
    let holders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let overlaps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let locker = Locker::with_config(backend.store().await, config.clone());
        let (holders, overlaps) = (Arc::clone(&holders), Arc::clone(&overlaps));
        tasks.push(tokio::spawn(async move {
            let key = locker.key("jobs", "report").unwrap();
            let guard = locker.acquire(key).await.unwrap();
            if holders.fetch_add(1, Ordering::SeqCst) > 0 {
                overlaps.fetch_add(1, Ordering::SeqCst);
            }
            // Hold for longer than the TTL, so renewal must keep the others out.
            tokio::time::sleep(ttl * 2).await;
            assert!(!guard.is_lost());
            holders.fetch_sub(1, Ordering::SeqCst);
            guard.fencing_token()
            // The guard is dropped here: the next task takes over.
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(task.await.unwrap());
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two singletons at once");
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 4);

    // A holder whose renewals stop without a release, as when its process dies: here its
    // guard is leaked and a longest hold shorter than the first renewal stops them (renewals
    // run on the crate's own runtime, so the holder's runtime stopping would not). Another
    // takes over after the TTL, not before.
    let store = backend.store().await;
    let dead_config = config.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let locker = Locker::with_config(store, dead_config);
            let guard = locker
                .acquire(locker.key("jobs", "report").unwrap())
                .max_hold(ttl / 4)
                .unwrap()
                .await
                .unwrap();
            std::mem::forget(guard);
        });
        drop(rt);
    })
    .join()
    .unwrap();
    let died = Instant::now();
    let locker = Locker::with_config(backend.store().await, config);
    let guard = locker
        .acquire(locker.key("jobs", "report").unwrap())
        .await
        .unwrap();
    let took = died.elapsed();
    assert!(
        took >= ttl / 2,
        "took over after {took:?}, before the dead holder's TTL ran out"
    );
    assert!(took < ttl * 4, "took over only after {took:?}");
    guard.release().await.unwrap();
}

/// The same acquire sent twice with one token, as a client re-sends a request whose reply was
/// lost (the cluster client after a dropped connection, `SentinelStore` on the new master): the
/// second answers `Acquired` too, with a larger fencing token and the TTL it asked for, so the
/// caller holds the key and releases it, rather than taking its own lease for another holder's
/// and leaving the key locked for a TTL. Another token is still refused (the negative control).
pub async fn own_token_acquires_again<B: Backend>(backend: B) {
    use tower_lock::store::{Acquire, LockStore, Token};
    let store = backend.store().await;
    let key = tower_lock::key::LockKey::new("tower-lock:", "resent", b"k", 64).unwrap();
    let (mine, other) = (Token::generate().unwrap(), Token::generate().unwrap());
    let fence = |answer: Acquire| match answer {
        Acquire::Acquired { fencing_token } => fencing_token,
        other => panic!(
            "{}: the caller's own token not acquired: {other:?}",
            B::NAME
        ),
    };
    let first = fence(
        store
            .acquire(&key, &mine, Duration::from_secs(2))
            .await
            .unwrap(),
    );
    let again = fence(
        store
            .acquire(&key, &mine, Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert!(
        again > first,
        "{}: fencing token {again} after {first}",
        B::NAME
    );
    // The second call set the TTL it asked for.
    match store
        .acquire(&key, &other, Duration::from_secs(2))
        .await
        .unwrap()
    {
        Acquire::Contended {
            expires_in: Some(left),
        } => assert!(left > Duration::from_secs(30), "{}: {left:?} left", B::NAME),
        answer => panic!("{}: another token got {answer:?}", B::NAME),
    }
    assert!(store.release(&key, &mine).await.unwrap(), "{}", B::NAME);
    fence(
        store
            .acquire(&key, &other, Duration::from_secs(2))
            .await
            .unwrap(),
    );
    assert!(store.release(&key, &other).await.unwrap());
}

// ---------------------------------------------------------------------------------------------
// Leases on several keys: orders of several SKUs and single purchases, over the same locks.

/// The SKUs of the shop the set tests sell from.
const SKUS: [&str; 4] = ["a", "b", "c", "d"];

/// A locker for one instance of the shop, on its own handle onto the store.
async fn shop_locker<B: Backend>(backend: &B, config: LockConfig) -> Locker {
    Locker::with_config(backend.store().await, config)
}

/// `n` requests spread over `apps`: random orders of 2 or 3 of the SKUs, each naming them in a
/// random order, and single purchases, all at once. Answers the tally, and how many requests
/// wrote each SKU.
async fn shop_load(apps: &[axum::Router], n: usize, seed: u64) -> (Tally, Vec<(String, u64)>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut writes = std::collections::HashMap::<String, u64>::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let app = apps[i % apps.len()].clone();
        let mut skus = SKUS.to_vec();
        rng.shuffle(&mut skus);
        let request = if rng.u8(0..3) == 0 {
            skus.truncate(1);
            purchase(skus[0], rng.u64(0..3))
        } else {
            skus.truncate(rng.usize(2..=3));
            order(&skus, rng.u64(0..3))
        };
        for sku in &skus {
            *writes.entry((*sku).to_owned()).or_default() += 1;
        }
        tasks.push(tokio::spawn(
            async move { send(&app, request).await.status() },
        ));
    }
    let mut tally = Tally::default();
    for task in tasks {
        tally.add(task.await.unwrap());
    }
    let mut writes: Vec<(String, u64)> = writes.into_iter().collect();
    writes.sort();
    (tally, writes)
}

/// How many requests the set exclusion test sends.
pub const SET_REQUESTS: usize = 150;

/// Two instances, orders of several SKUs (each naming them in its own random order) and single
/// purchases, all at once: on every SKU no overlap and no lost update, and fencing tokens
/// order its writes, whether an order or a purchase made them.
pub async fn sets_exclude_each_other_and_single_keys<B: Backend>(backend: B) {
    let shop = Shop::new(SKUS);
    let apps = [
        shop_app(
            Arc::clone(&shop),
            Some(shop_locker(&backend, patient().build().unwrap()).await),
        ),
        shop_app(
            Arc::clone(&shop),
            Some(shop_locker(&backend, patient().build().unwrap()).await),
        ),
    ];
    let (tally, writes) = shop_load(&apps, SET_REQUESTS, 7).await;
    assert_eq!(tally.ok, SET_REQUESTS, "{}: {tally:?}", B::NAME);
    assert_eq!(
        shop.overlaps(),
        0,
        "{}: two holders of a SKU at once",
        B::NAME
    );
    for (sku, n) in writes {
        let counter = &shop.skus[&sku];
        assert_eq!(
            counter.value.load(Ordering::SeqCst),
            n,
            "{}: lost updates on {sku}",
            B::NAME
        );
        counter.assert_fenced_in_order();
    }
}

/// The negative control for `sets_exclude_each_other_and_single_keys`: the same load without
/// the locks overlaps and loses updates, so that test can fail.
pub async fn without_the_lock_sets_lose_updates() {
    let shop = Shop::new(SKUS);
    let apps = [
        shop_app(Arc::clone(&shop), None),
        shop_app(Arc::clone(&shop), None),
    ];
    let (tally, writes) = shop_load(&apps, SET_REQUESTS, 7).await;
    assert_eq!(tally.ok, SET_REQUESTS, "{tally:?}");
    assert!(shop.overlaps() > 0, "no overlap without the lock");
    let lost = writes
        .iter()
        .any(|(sku, n)| shop.skus[sku].value.load(Ordering::SeqCst) < *n);
    assert!(lost, "no update lost without the lock");
}

/// Two orders naming the same SKUs in opposite orders, sent together again and again from two
/// instances, each holding its locks for 300 ms: never a deadlock, and each answers 200 within
/// about the time the other holds, far inside the 60 s wait deadline.
///
/// Where a waiting set keeps what it has (its turns at keys in one process; its place, and the
/// keys before the one it waits for, in a store's hand-off queue), a third instance sells the
/// middle SKU, `b`, back to back meanwhile, so that each order waits for `b` with the SKUs it
/// has kept for it: taken in the order each order names them, one would keep `a` and the other
/// `c`, a cycle (with the sort taken out of `KeySet::new`, the first round runs into the
/// deadline). In memory, the three instances share one locker, whose turns are what a set
/// keeps there.
pub async fn sets_in_opposite_orders_never_deadlock<B: Backend>(backend: B) {
    let shared = B::NAME == "memory";
    let keeps =
        shared || tower_lock::store::LockStore::capabilities(&backend.store().await).hand_off();
    let config = || patient().build().unwrap();
    let one = shop_locker(&backend, config()).await;
    let locker = || {
        let one = one.clone();
        let backend = &backend;
        async move {
            if shared {
                one
            } else {
                shop_locker(backend, config()).await
            }
        }
    };
    let shop = Shop::new(SKUS);
    let apps = [
        shop_app(Arc::clone(&shop), Some(locker().await)),
        shop_app(Arc::clone(&shop), Some(locker().await)),
    ];
    let stream = shop_app(Arc::clone(&shop), Some(locker().await));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut sellers = Vec::new();
    for _ in 0..if keeps { 2 } else { 0 } {
        let (stream, stop) = (stream.clone(), Arc::clone(&stop));
        sellers.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            while !stop.load(Ordering::SeqCst) {
                tally.add(send(&stream, purchase("b", 30)).await.status());
            }
            tally
        }));
    }
    for round in 0..4 {
        let started = Instant::now();
        let forth = tokio::spawn({
            let app = apps[0].clone();
            async move { send(&app, order(&["a", "b", "c"], 300)).await.status() }
        });
        let back = tokio::spawn({
            let app = apps[1].clone();
            async move { send(&app, order(&["c", "b", "a"], 300)).await.status() }
        });
        assert_eq!(forth.await.unwrap(), StatusCode::OK, "{}", B::NAME);
        assert_eq!(back.await.unwrap(), StatusCode::OK, "{}", B::NAME);
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{}: round {round} took {took:?} for two orders of 300 ms",
            B::NAME
        );
    }
    stop.store(true, Ordering::SeqCst);
    let mut sold = 0;
    for seller in sellers {
        let tally = seller.await.unwrap();
        assert!(
            tally.conflict == 0 && tally.unavailable == 0 && tally.other.is_empty(),
            "{}: {tally:?}",
            B::NAME
        );
        sold += tally.ok as u64;
    }
    assert_eq!(shop.overlaps(), 0);
    assert_eq!(shop.skus["a"].value.load(Ordering::SeqCst), 8);
    assert_eq!(shop.skus["b"].value.load(Ordering::SeqCst), 8 + sold);
}

/// All or none: an order one of whose SKUs another instance holds takes none of them (without
/// waiting, 409), so a purchase of another of its SKUs goes through at once; once the SKU is
/// free, the order goes through.
pub async fn a_set_takes_all_its_keys_or_none<B: Backend>(backend: B) {
    let holder = shop_locker(&backend, patient().build().unwrap()).await;
    let key = |sku: &str| holder.key(SKU_NAMESPACE, sku).unwrap();
    let guard = holder.acquire(key("b")).await.unwrap();
    let shop = Shop::new(SKUS);
    let now = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let app = shop_app(
        Arc::clone(&shop),
        Some(shop_locker(&backend, now.clone()).await),
    );
    for _ in 0..3 {
        let r = send(&app, order(&["a", "b", "c"], 0)).await;
        assert_eq!(r.status(), StatusCode::CONFLICT, "{}", B::NAME);
        // a and c were not kept: free at once, here and for another instance.
        assert_eq!(send(&app, purchase("a", 0)).await.status(), StatusCode::OK);
        let other = shop_locker(&backend, now.clone()).await;
        let both = [key("c"), key("a")];
        let got = other.try_acquire(both).await.unwrap();
        assert!(got.is_some(), "{}: a key of the set stayed taken", B::NAME);
        got.unwrap().release().await.unwrap();
    }
    assert!(
        holder
            .try_acquire([key("a"), key("b")])
            .await
            .unwrap()
            .is_none()
    );
    guard.release().await.unwrap();
    assert_eq!(
        send(&app, order(&["a", "b", "c"], 0)).await.status(),
        StatusCode::OK,
        "{}",
        B::NAME
    );
    assert_eq!(shop.skus["b"].value.load(Ordering::SeqCst), 1);
}

/// An order holding SKU a makes a single purchase of a wait for it (or answer 409 when it
/// does not wait), while purchases of SKUs it does not hold go through at once.
pub async fn a_set_makes_a_single_key_wait<B: Backend>(backend: B) {
    let shop = Shop::new(SKUS);
    let orders = shop_app(
        Arc::clone(&shop),
        Some(shop_locker(&backend, patient().build().unwrap()).await),
    );
    let now = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let impatient = shop_app(Arc::clone(&shop), Some(shop_locker(&backend, now).await));
    let waiting = shop_app(
        Arc::clone(&shop),
        Some(shop_locker(&backend, patient().build().unwrap()).await),
    );
    let held = tokio::spawn({
        let orders = orders.clone();
        async move { send(&orders, order(&["b", "a"], 700)).await.status() }
    });
    let a = Arc::clone(&shop.skus["a"]);
    wait_until(|| a.inside.load(Ordering::SeqCst) == 1).await;
    let r = send(&impatient, purchase("a", 0)).await;
    assert_eq!(r.status(), StatusCode::CONFLICT, "{}", B::NAME);
    assert_eq!(
        send(&impatient, purchase("c", 0)).await.status(),
        StatusCode::OK
    );
    let started = Instant::now();
    assert_eq!(
        send(&waiting, purchase("a", 0)).await.status(),
        StatusCode::OK
    );
    assert!(
        a.finished.load(Ordering::SeqCst) == 2,
        "{}: the purchase did not wait for the order",
        B::NAME
    );
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(held.await.unwrap(), StatusCode::OK);
    assert_eq!(shop.overlaps(), 0);
}

/// A stream of single purchases of SKU a from three instances keeps a busy without a gap;
/// an order of a and b from a fourth instance gets its turn well within its wait deadline,
/// and the stream goes on.
pub async fn a_set_is_not_starved_by_single_keys<B: Backend>(backend: B) {
    let shop = Shop::new(SKUS);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut stream = Vec::new();
    for _ in 0..3 {
        let app = shop_app(
            Arc::clone(&shop),
            Some(shop_locker(&backend, patient().build().unwrap()).await),
        );
        let stop = Arc::clone(&stop);
        stream.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            while !stop.load(Ordering::SeqCst) {
                tally.add(send(&app, purchase("a", 20)).await.status());
            }
            tally
        }));
    }
    let a = Arc::clone(&shop.skus["a"]);
    wait_until(|| a.finished.load(Ordering::SeqCst) >= 10).await;
    let deadline = Duration::from_secs(10);
    let config = LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
                .unwrap()
                .deadline(deadline),
        )
        .build()
        .unwrap();
    let app = shop_app(Arc::clone(&shop), Some(shop_locker(&backend, config).await));
    let started = Instant::now();
    let status = send(&app, order(&["b", "a"], 0)).await.status();
    let waited = started.elapsed();
    let during = a.finished.load(Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let mut tally = Tally::default();
    for task in stream {
        let t = task.await.unwrap();
        tally.ok += t.ok;
        tally.conflict += t.conflict;
    }
    assert_eq!(
        status,
        StatusCode::OK,
        "{}: starved for {waited:?}",
        B::NAME
    );
    assert!(waited < deadline / 2, "{}: waited {waited:?}", B::NAME);
    assert_eq!(tally.conflict, 0, "{}: {tally:?}", B::NAME);
    assert!(during >= 10, "the stream stopped");
    assert_eq!(shop.overlaps(), 0);
}

/// `POST /orders` (SKUs from the body, in [`SKU_NAMESPACE`]) that works `work_ms`, and panics
/// for an order of the SKU `boom`; panics become 500s.
fn orders_app(locker: Locker) -> axum::Router {
    let layer =
        LockLayer::from_locker(locker, Key::json("/items/*/sku").unwrap()).namespace(SKU_NAMESPACE);
    axum::Router::new()
        .route(
            "/orders",
            axum::routing::post(
                |axum::extract::Query(work): axum::extract::Query<
                    std::collections::HashMap<String, u64>,
                >,
                 body: String| async move {
                    if body.contains("\"boom\"") {
                        panic!("handler panicked on purpose");
                    }
                    let work_ms = work.get("work_ms").copied().unwrap_or(0);
                    tokio::time::sleep(Duration::from_millis(work_ms)).await;
                    "ok"
                },
            ),
        )
        .route_layer(layer)
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
}

/// Waits until `probe` can take every key of `skus` at once, for at most 2 s; answers how long.
async fn freed(probe: &Locker, skus: &[&str]) -> Duration {
    let keys: Vec<_> = skus
        .iter()
        .map(|s| probe.key(SKU_NAMESPACE, s).unwrap())
        .collect();
    let started = Instant::now();
    loop {
        if let Some(guard) = probe.try_acquire(keys.clone()).await.unwrap() {
            guard.release().await.unwrap();
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "keys of {skus:?} still held"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An order's every key is freed within milliseconds, not after the 30 s TTL, when its request
/// is dropped (client gone) and when its handler panics; the service keeps serving.
pub async fn a_set_is_released_on_drop_and_panic<B: Backend>(backend: B) {
    let config = || {
        LockConfig::builder()
            .wait(Wait::none())
            .ttl(Duration::from_secs(30))
            .build()
            .unwrap()
    };
    // The order waits (briefly) for a key the probe below holds for a moment: without a wait,
    // its one attempt could meet the probe's and give up, and the order would never run.
    let patient = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_millis(5))
                .unwrap()
                .deadline(Duration::from_secs(1)),
        )
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let app = orders_app(shop_locker(&backend, patient).await);
    let probe = shop_locker(&backend, config()).await;
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, order(&["c", "a", "b"], 60_000)).await }
    });
    let key = probe.key(SKU_NAMESPACE, "b").unwrap();
    let started = Instant::now();
    while let Some(guard) = probe.try_acquire(key.clone()).await.unwrap() {
        // Not taken yet.
        guard.release().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the order never ran"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    running.abort();
    let took = freed(&probe, &["a", "b", "c"]).await;
    assert!(
        took < Duration::from_millis(500),
        "{}: freed after {took:?}",
        B::NAME
    );

    let r = send(&app, order(&["boom", "a", "d"], 0)).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{}", B::NAME);
    let took = freed(&probe, &["boom", "a", "d"]).await;
    assert!(
        took < Duration::from_millis(500),
        "{}: freed after {took:?}",
        B::NAME
    );
    assert_eq!(
        send(&app, order(&["a", "d"], 0)).await.status(),
        StatusCode::OK,
        "{}",
        B::NAME
    );
}
