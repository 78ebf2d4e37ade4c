//! In-process coalescing: requests of one process for the same key wait in a local FIFO queue,
//! are woken by the release (not a timer), and only one of them contends in the store.
//! (Waiters in separate processes, queued in Redis: `tests/handoff.rs`.)

use crate::support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::Path,
    http::Request,
    routing::{MethodRouter, post},
};
use support::send;
use tower_lock::{Key, LockConfig, LockLayer, MemoryStore, RedisStore, Wait, store::LockStore};
use tower_lock_testkit::{RedisServer, calls_of};

/// Runs `scenario` on a store of a Redis server of its own.
async fn on_redis<F: Future>(scenario: impl FnOnce(RedisStore) -> F) -> F::Output {
    let server = RedisServer::start();
    scenario(RedisStore::connect(server.url()).await.unwrap()).await
}

/// A wait policy whose timer would make any timer-woken waiter take seconds.
fn slow_timer() -> Wait {
    Wait::constant(Duration::from_secs(5))
        .unwrap()
        .deadline(Duration::from_secs(30))
}

/// `route` at `path`, behind a lock on the path's `{sku}` taken with `config`.
fn sku_locked(
    path: &str,
    route: MethodRouter,
    store: impl LockStore,
    config: LockConfig,
) -> Router {
    Router::new()
        .route(path, route)
        .route_layer(LockLayer::with_config(
            store,
            Key::path_param("sku"),
            config,
        ))
}

fn app(store: impl LockStore, config: LockConfig, order: Arc<Mutex<Vec<String>>>) -> Router {
    sku_locked(
        "/items/{sku}/{who}",
        post(move |Path((_sku, who)): Path<(String, String)>| {
            let order = Arc::clone(&order);
            async move {
                order.lock().unwrap().push(who);
                tokio::time::sleep(Duration::from_millis(20)).await;
                "ok"
            }
        }),
        store,
        config,
    )
}

fn req(who: usize) -> Request<Body> {
    Request::post(format!("/items/hot/{who}"))
        .body(Body::empty())
        .unwrap()
}

/// Sends `req(who)` for each of `whos` through `app`, each from its own task, 5 ms apart so
/// that each reaches the queue before the next arrives; the tasks answer the statuses.
async fn arrive_in_turn(
    app: &Router,
    whos: std::ops::Range<usize>,
) -> Vec<tokio::task::JoinHandle<axum::http::StatusCode>> {
    let mut tasks = Vec::new();
    for who in whos {
        let app = app.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, req(who)).await.status() },
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tasks
}

/// Waiters run in arrival order, each woken by the previous release.
async fn fifo_without_timers(store: impl LockStore) {
    let order = Arc::new(Mutex::new(Vec::new()));
    let app = app(
        store,
        LockConfig::builder().wait(slow_timer()).build().unwrap(),
        Arc::clone(&order),
    );
    let started = Instant::now();
    let tasks = arrive_in_turn(&app, 0..8).await;
    for task in tasks {
        assert_eq!(task.await.unwrap(), 200);
    }
    let took = started.elapsed();
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order,
        (0..8).map(|i| i.to_string()).collect::<Vec<_>>(),
        "not first come first served"
    );
    // 8 x 20 ms of work; a waiter woken by its 5 s retry timer would blow far past this.
    assert!(
        took < Duration::from_secs(3),
        "waiters were not woken by the release: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_fifo_without_timers() {
    fifo_without_timers(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_fifo_without_timers() {
    on_redis(fifo_without_timers).await;
}

/// Two *separate* lockers (as two processes have) do not share a local queue; the loser waits
/// in the store. Returns how long the second request took.
async fn second_locker_waits(store: impl LockStore + Clone) -> Duration {
    let order = Arc::new(Mutex::new(Vec::new()));
    let config = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_millis(700))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let one = app(store.clone(), config.clone(), Arc::clone(&order));
    let two = app(store, config, Arc::clone(&order));
    let first = tokio::spawn(async move { send(&one, req(0)).await.status() });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let started = Instant::now();
    assert_eq!(send(&two, req(1)).await.status(), 200);
    assert_eq!(first.await.unwrap(), 200);
    started.elapsed()
}

/// Across lockers, a store that announces releases wakes the waiter at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_lockers_are_woken_by_the_release() {
    let took = second_locker_waits(MemoryStore::new()).await;
    assert!(
        took < Duration::from_millis(400),
        "woken by the 700 ms timer: {took:?}"
    );
}

/// The negative control: without release announcements the loser waits for its 700 ms timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_announcements_waiters_use_the_timer() {
    let took = second_locker_waits(support::Tweaked::default()).await;
    assert!(took >= Duration::from_millis(600), "{took:?}");
}

/// Many waiters in one process: only one contends in Redis, so every request costs exactly its
/// two commands, however long it waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_contender_per_process_in_redis() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let config = LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(5))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let app = app(store, config, order);
    assert_eq!(send(&app, req(99)).await.status(), 200); // loads the scripts
    let before = calls_of(&server, "evalsha").await;
    let n = 24;
    let mut tasks = Vec::new();
    for who in 0..n {
        let app = app.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, req(who)).await.status() },
        ));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), 200);
    }
    assert_eq!(
        calls_of(&server, "evalsha").await - before,
        2 * n as u64,
        "waiters polled Redis"
    );
}

/// A waiter that leaves mid-queue (its client hung up) does not hold up the ones behind it.
/// (A waiter whose wait deadline passes leaves the same way: `src/local.rs` unit tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departing_waiter_leaves_the_queue() {
    let store = MemoryStore::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let patient = app(
        store.clone(),
        LockConfig::builder().wait(slow_timer()).build().unwrap(),
        Arc::clone(&order),
    );
    let mut tasks = arrive_in_turn(&patient, 0..3).await;
    // A request dropped while queued (client gone) is a departing waiter too.
    let app = patient.clone();
    let departing = tokio::spawn(async move { send(&app, req(50)).await.status() });
    tokio::time::sleep(Duration::from_millis(5)).await;
    tasks.extend(arrive_in_turn(&patient, 3..5).await);
    departing.abort();
    let started = Instant::now();
    for task in tasks {
        assert_eq!(task.await.unwrap(), 200);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the queue stalled behind a departed waiter"
    );
    let order = order.lock().unwrap().clone();
    assert_eq!(order, ["0", "1", "2", "3", "4"]);
    assert_eq!(store.held(), 0);
}

/// A request to `holding_app` that holds the lease for `ms`.
fn hold(ms: u64) -> Request<Body> {
    Request::post(format!("/items/hot/hold?ms={ms}"))
        .body(Body::empty())
        .unwrap()
}

/// A purchase route that holds its lease for `?ms=N` and says when it started.
fn holding_app(
    store: impl LockStore,
    config: LockConfig,
    started: Arc<tokio::sync::Notify>,
) -> Router {
    sku_locked(
        "/items/{sku}/hold",
        post(
            move |axum::extract::Query(q): axum::extract::Query<
                std::collections::HashMap<String, u64>,
            >| {
                let started = Arc::clone(&started);
                async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_millis(q["ms"])).await;
                    "held"
                }
            },
        ),
        store,
        config,
    )
}

/// A 409's `Retry-After`, in seconds.
fn retry_after(response: &axum::http::Response<Body>) -> u64 {
    assert_eq!(response.status(), 409);
    response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// One rule for `Retry-After`, wherever the waiter queued: a request that gives up in this
/// process's queue, behind a holder of this process, answers the holder's remaining lease
/// rounded up (TTL 10 s: 10; TTL 4 s: 4), as a request of another process that gave up in the
/// store does. Failing fast (`Wait::none`) or after a bounded wait.
async fn gave_up_locally_answers_the_holders_lease(store: impl LockStore + Clone) {
    for (ttl, wait) in [
        (10, Wait::none()),
        (
            10,
            Wait::constant(Duration::from_millis(50))
                .unwrap()
                .deadline(Duration::from_millis(300)),
        ),
        (4, Wait::none()),
    ] {
        let config = LockConfig::builder()
            .ttl(Duration::from_secs(ttl))
            .wait(wait)
            .build()
            .unwrap();
        let started = Arc::new(tokio::sync::Notify::new());
        let here = holding_app(store.clone(), config.clone(), Arc::clone(&started));
        // A separately built layer: another process, as far as the local queue knows.
        let elsewhere = holding_app(store.clone(), config, Arc::new(tokio::sync::Notify::new()));
        let holder = tokio::spawn({
            let here = here.clone();
            async move { send(&here, hold(1500)).await.status() }
        });
        started.notified().await;
        let local = send(&here, hold(0)).await;
        let remote = send(&elsewhere, hold(0)).await;
        assert_eq!(
            (retry_after(&local), retry_after(&remote)),
            (ttl, ttl),
            "Retry-After (queued in this process, queued in the store) with a {ttl} s TTL"
        );
        assert_eq!(holder.await.unwrap(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_gave_up_locally_answers_the_holders_lease() {
    gave_up_locally_answers_the_holders_lease(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_gave_up_locally_answers_the_holders_lease() {
    on_redis(gave_up_locally_answers_the_holders_lease).await;
}

/// The head of the local queue has not heard from the store yet (its acquire is in flight): a
/// request that gives up behind it waits for that answer (at most a store timeout after it was
/// sent), and answers with the head's lease: the TTL. (Had the store failed it, 503.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gave_up_behind_a_head_still_acquiring_answers_the_ttl() {
    let store = support::Tweaked {
        acquire_delay: Duration::from_millis(300),
        announce: true,
        ..Default::default()
    };
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(7))
        .wait(Wait::none())
        .build()
        .unwrap();
    let app = holding_app(store, config, Arc::new(tokio::sync::Notify::new()));
    let head = tokio::spawn({
        let app = app.clone();
        async move { send(&app, hold(0)).await.status() }
    });
    // Within the head's 300 ms acquire.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(retry_after(&send(&app, hold(0)).await), 7);
    assert_eq!(head.await.unwrap(), 200);
}
