//! Scenario e, memory: heap per held lease and per in-flight request (a counting global
//! allocator, `alloc`), and RSS, tasks and heap before and after many requests.

use std::{
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, routing::post};
use futures_util::{StreamExt, stream};
use tokio::runtime::Runtime;
use tower::ServiceExt;
use tower_lock::{Key, LeaseGuard, LockLayer, Locker, RedisStore};
use tower_lock_testkit::RedisServer;

use crate::{
    Settings,
    alloc::{COUNTING, heap_bytes},
    common::{LEASES, ROUTE, flushall, purchase, runtime, tag},
    stats::mib,
};

/// Scenario e, `s.runs` times, each on an emptied server and a fresh runtime. Turns heap
/// counting on for the rest of the process.
pub(crate) fn run(rt: &Runtime, redis: &RedisServer, s: &Settings) -> Vec<MemorySample> {
    let url = redis.url();
    let page = page_size();
    let mut runs = Vec::new();
    // Heap figures are differences taken within this scenario, which counts from here on.
    COUNTING.store(true, Ordering::SeqCst);
    for run in 0..s.runs {
        rt.block_on(flushall(&url));
        let case = runtime();
        let sample = case.block_on(memory(redis, s, page));
        case.shutdown_timeout(Duration::from_secs(2));
        eprintln!(
            "e. run {}: {:.0} B heap per lease, RSS {} -> {}, tasks {} -> {}",
            run + 1,
            sample.per_lease,
            mib(sample.rss_before),
            mib(sample.rss_after),
            sample.tasks_before,
            sample.tasks_after
        );
        runs.push(sample);
    }
    runs
}

pub(crate) struct MemorySample {
    pub(crate) per_lease: f64,
    pub(crate) per_lease_after_release: f64,
    pub(crate) per_lease_growth: f64,
    pub(crate) per_request_plain: f64,
    pub(crate) per_request_layer: f64,
    pub(crate) rss_before: f64,
    pub(crate) rss_after: f64,
    pub(crate) tasks_before: f64,
    pub(crate) tasks_after: f64,
    pub(crate) heap_before: f64,
    pub(crate) heap_after: f64,
    pub(crate) failed: u64,
}

fn page_size() -> u64 {
    Command::new("getconf")
        .arg("PAGESIZE")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(4096)
}

/// Resident set size from `/proc/self/statm`, in bytes.
fn rss_bytes(page: u64) -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * page
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Heap per `LeaseGuard` held, and what is left per lease after all are released.
async fn heap_per_lease(url: &str) -> HeapPerLease {
    let tag = tag();
    let locker = Locker::new(RedisStore::connect(url).await.expect("connect"));
    for i in 0..100 {
        let key = locker
            .key("bench-memory-warm", format!("{tag}-{i}"))
            .expect("key");
        locker
            .acquire(key)
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    let mut guards = Vec::with_capacity(LEASES);
    settle().await;
    let before = heap_bytes();
    for i in 0..LEASES {
        let key = locker
            .key("bench-memory", format!("{tag}-{i}"))
            .expect("key");
        guards.push(locker.acquire(key).await.expect("acquire"));
    }
    settle().await;
    let held = heap_bytes();
    let released: Vec<_> = stream::iter(guards.drain(..))
        .map(LeaseGuard::release)
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(released.iter().all(Result::is_ok));
    drop(released);
    settle().await;
    let after = heap_bytes();
    // A second round of as many leases: what it leaves behind is growth, not retained capacity.
    let again: Vec<_> = stream::iter(0..LEASES)
        .map(|i| {
            let locker = locker.clone();
            let value = format!("{tag}-again-{i}");
            async move {
                let key = locker.key("bench-memory", value).expect("key");
                locker.acquire(key).await.expect("acquire").release().await
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(again.iter().all(Result::is_ok));
    drop(again);
    settle().await;
    let after_again = heap_bytes();
    HeapPerLease {
        held: (held - before) as f64 / LEASES as f64,
        left: (after - before) as f64 / LEASES as f64,
        growth: (after_again - after) as f64 / LEASES as f64,
    }
}

struct HeapPerLease {
    held: f64,
    left: f64,
    growth: f64,
}

/// Heap per in-flight HTTP request (in process, through the `Router`), with or without the
/// layer: `LEASES` requests parked in their handler at once.
async fn heap_per_inflight_request(url: &str, with_layer: bool) -> f64 {
    let tag = tag();
    let (open, gate) = tokio::sync::watch::channel(true);
    let entered = Arc::new(AtomicUsize::new(0));
    let handler = {
        let entered = Arc::clone(&entered);
        move || {
            let mut gate = gate.clone();
            let entered = Arc::clone(&entered);
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                let _ = gate.wait_for(|open| *open).await;
                "ok"
            }
        }
    };
    let mut router = Router::new().route(ROUTE, post(handler));
    if with_layer {
        let store = RedisStore::connect(url).await.expect("connect");
        router = router.route_layer(LockLayer::new(store, Key::path_param("sku")));
    }
    for i in 0..100 {
        let response = router
            .clone()
            .oneshot(purchase(&format!("warm-{tag}-{i}")))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
    }
    open.send_replace(false);
    entered.store(0, Ordering::SeqCst);
    let mut handles = Vec::with_capacity(LEASES);
    settle().await;
    let before = heap_bytes();
    for i in 0..LEASES {
        let router = router.clone();
        let request = purchase(&format!("{tag}-{i}"));
        handles.push(tokio::spawn(async move {
            router.oneshot(request).await.expect("infallible").status()
        }));
    }
    let waiting = Instant::now();
    while entered.load(Ordering::SeqCst) < LEASES {
        assert!(
            waiting.elapsed() < Duration::from_secs(60),
            "in-flight requests did not all reach the handler"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    settle().await;
    let during = heap_bytes();
    open.send_replace(true);
    for handle in handles {
        assert_eq!(handle.await.expect("request task"), StatusCode::OK);
    }
    (during - before) as f64 / LEASES as f64
}

async fn memory(redis: &RedisServer, s: &Settings, page: u64) -> MemorySample {
    let url = redis.url();
    let leases = heap_per_lease(&url).await;
    let per_request_plain = heap_per_inflight_request(&url, false).await;
    let per_request_layer = heap_per_inflight_request(&url, true).await;

    // Flatness: RSS, live tasks and heap before and after N requests through the layer.
    let tag = tag();
    let store = RedisStore::connect(url.as_str()).await.expect("connect");
    let router = Router::new()
        .route(ROUTE, post(|| async { "ok" }))
        .route_layer(LockLayer::new(store, Key::path_param("sku")));
    let send = |n: usize, prefix: String| {
        let router = router.clone();
        async move {
            stream::iter(0..n)
                .map(|i| router.clone().oneshot(purchase(&format!("{prefix}-{i}"))))
                .buffer_unordered(64)
                .fold(0u64, |failed, response| async move {
                    failed + u64::from(response.map_or(true, |r| r.status() != StatusCode::OK))
                })
                .await
        }
    };
    let mut failed = send(2_000, format!("{tag}-warm")).await;
    settle().await;
    let (rss_before, tasks_before, heap_before) = (rss_bytes(page), alive_tasks(), heap_bytes());
    failed += send(s.memory_requests, tag).await;
    settle().await;
    let (rss_after, tasks_after, heap_after) = (rss_bytes(page), alive_tasks(), heap_bytes());
    MemorySample {
        per_lease: leases.held,
        per_lease_after_release: leases.left,
        per_lease_growth: leases.growth,
        per_request_plain,
        per_request_layer,
        rss_before: rss_before as f64,
        rss_after: rss_after as f64,
        tasks_before: tasks_before as f64,
        tasks_after: tasks_after as f64,
        heap_before: heap_before as f64,
        heap_after: heap_after as f64,
        failed,
    }
}
