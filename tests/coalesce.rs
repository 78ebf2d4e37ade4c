//! In-process coalescing: requests of one process for the same key wait in a local FIFO queue,
//! are woken by the release (not a timer), and only one of them contends in the store.
//! (Waiters in separate processes, queued in Redis: `tests/handoff.rs`.)

mod support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{Router, body::Body, extract::Path, http::Request, routing::post};
use support::{RedisServer, send};
use tower_lock::{Key, LockConfig, LockLayer, LockStore, MemoryStore, RedisStore, Wait};

/// A wait policy whose timer would make any timer-woken waiter take seconds.
fn slow_timer() -> Wait {
    Wait::constant(Duration::from_secs(5)).deadline(Duration::from_secs(30))
}

fn app(store: impl LockStore, config: LockConfig, order: Arc<Mutex<Vec<String>>>) -> Router {
    Router::new()
        .route(
            "/items/{sku}/{who}",
            post(move |Path((_sku, who)): Path<(String, String)>| {
                let order = Arc::clone(&order);
                async move {
                    order.lock().unwrap().push(who);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    "ok"
                }
            }),
        )
        .route_layer(LockLayer::with_config(store, Key::path_param("sku"), config).unwrap())
}

fn req(who: usize) -> Request<Body> {
    Request::post(format!("/items/hot/{who}"))
        .body(Body::empty())
        .unwrap()
}

/// Waiters run in arrival order, each woken by the previous release.
async fn fifo_without_timers(store: impl LockStore) {
    let order = Arc::new(Mutex::new(Vec::new()));
    let app = app(
        store,
        LockConfig::default().wait(slow_timer()),
        Arc::clone(&order),
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for who in 0..8 {
        let app = app.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, req(who)).await.status() },
        ));
        // Let each request reach the queue before the next arrives.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
    let server = RedisServer::start();
    fifo_without_timers(RedisStore::connect(server.url()).await.unwrap()).await;
}

/// Two *separate* lockers (as two processes have) do not share a local queue; the loser waits
/// in the store. Returns how long the second request took.
async fn second_locker_waits(store: impl LockStore + Clone) -> Duration {
    let order = Arc::new(Mutex::new(Vec::new()));
    let config = LockConfig::default()
        .wait(Wait::constant(Duration::from_millis(700)).deadline(Duration::from_secs(30)));
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
    let config = LockConfig::default().wait(
        Wait::exponential(Duration::from_millis(1), Duration::from_millis(5))
            .deadline(Duration::from_secs(30)),
    );
    let app = app(store, config, order);
    assert_eq!(send(&app, req(99)).await.status(), 200); // loads the scripts
    let before = support::calls_of(&server, "evalsha").await;
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
        support::calls_of(&server, "evalsha").await - before,
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
        LockConfig::default().wait(slow_timer()),
        Arc::clone(&order),
    );
    let mut tasks = Vec::new();
    for who in 0..3 {
        let app = patient.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, req(who)).await.status() },
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A request dropped while queued (client gone) is a departing waiter too.
    let app = patient.clone();
    let departing = tokio::spawn(async move { send(&app, req(50)).await.status() });
    tokio::time::sleep(Duration::from_millis(5)).await;
    for who in 3..5 {
        let app = patient.clone();
        tasks.push(tokio::spawn(
            async move { send(&app, req(who)).await.status() },
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
