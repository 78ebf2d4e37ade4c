//! Resource hygiene: after many requests (uncontended, contended, dropped mid-handler, renewed)
//! the process has no more alive Tokio tasks than before, Redis has no more connected clients,
//! RSS has not grown past a stated bound, and no lease is left (`SCAN` over the prefix).
//!
//! 5,000 requests by default; `TOWER_LOCK_HYGIENE_REQUESTS=100000` for the long run.

mod support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::http::StatusCode;
use futures_util::{StreamExt, stream};
use support::{Counter, counter_app, purchase, send};
use tower_lock::{Key, LockConfig, LockLayer, RedisStore, Wait};
use tower_lock_testkit::RedisServer;

/// RSS may grow by at most this much between the end of the warm-up and the end of the run
/// (allocator caches, the runtime's worker buffers); a leak of 1 KiB per request would exceed
/// it at 100k requests, and a leak of one renewal task per request at 5k.
const RSS_BOUND: u64 = 24 << 20;

fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

async fn connected_clients(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    support::info(conn, "clients")
        .await
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("connected_clients in INFO clients")
}

/// Lock keys (not fencing counters) under the default prefix, by `SCAN`.
async fn leases(conn: &mut redis::aio::MultiplexedConnection) -> usize {
    let mut cursor = 0u64;
    let mut count = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("tower-lock:*")
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .unwrap();
        count += keys
            .iter()
            .filter(|k| !support::is_fence_counter(k))
            .count();
        if next == 0 {
            return count;
        }
        cursor = next;
    }
}

/// Alive tasks, once they settle to at most `ceiling` (within 3 s).
async fn alive_tasks(ceiling: usize) -> usize {
    let metrics = tokio::runtime::Handle::current().metrics();
    let started = Instant::now();
    loop {
        let alive = metrics.num_alive_tasks();
        if alive <= ceiling || started.elapsed() > Duration::from_secs(3) {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs requests `range` of the mix, 32 at a time; returns the statuses seen.
async fn run(app: &axum::Router, range: std::ops::Range<usize>) -> [usize; 4] {
    let results: Vec<Option<StatusCode>> = stream::iter(range)
        .map(|i| {
            let app = app.clone();
            async move {
                match i % 20 {
                    // Dropped mid-handler (a client gone, a timeout): the release is spawned.
                    0 => {
                        let sent = send(&app, purchase(&format!("drop-{i}"), 50));
                        tokio::time::timeout(Duration::from_millis(5), sent)
                            .await
                            .ok()
                            .map(|r| r.status())
                    }
                    // Longer than a renewal interval: renewed once or twice.
                    1 => Some(
                        send(&app, purchase(&format!("long-{i}"), 120))
                            .await
                            .status(),
                    ),
                    // Contended: one hot key held 10 ms, a 5 ms wait: waits, and 409s.
                    2..=3 => Some(send(&app, purchase("hot", 10)).await.status()),
                    // Uncontended, each its own key.
                    _ => Some(send(&app, purchase(&format!("cold-{i}"), 0)).await.status()),
                }
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let mut seen = [0; 4];
    for r in results {
        match r {
            Some(StatusCode::OK) => seen[0] += 1,
            Some(StatusCode::CONFLICT) => seen[1] += 1,
            None => seen[2] += 1,
            Some(other) => panic!("unexpected status {other}"),
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_growth_after_many_requests() {
    let requests: usize = std::env::var("TOWER_LOCK_HYGIENE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let redis = RedisServer::start();
    let store = RedisStore::connect(redis.url()).await.unwrap();
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(240))
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(2))
                .unwrap()
                .deadline(Duration::from_millis(5)),
        )
        .build()
        .unwrap();
    let layer = LockLayer::with_config(store, Key::path_param("sku"), config);
    let counter = Counter::new();
    let app = counter_app(Arc::clone(&counter), Some(layer));
    let mut conn = redis.client().await;

    let warm_up = (requests / 10).max(500);
    run(&app, 0..warm_up).await;
    let tasks_before = alive_tasks(0).await;
    let clients_before = connected_clients(&mut conn).await;
    let rss_before = rss();
    let started = Instant::now();

    let [ok, conflict, dropped, _] = run(&app, warm_up..warm_up + requests).await;
    let took = started.elapsed();
    let tasks_after = alive_tasks(tasks_before).await;
    let clients_after = connected_clients(&mut conn).await;
    let rss_after = rss();
    // Dropped requests release in spawned tasks; leases from the run are gone once those end.
    let mut left = leases(&mut conn).await;
    let settle = Instant::now();
    while left > 0 && settle.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = leases(&mut conn).await;
    }
    println!(
        "hygiene: {requests} requests in {took:.1?} (200={ok} 409={conflict} dropped={dropped}); \
         alive tasks {tasks_before} -> {tasks_after}; Redis clients {clients_before} -> \
         {clients_after}; RSS {:.1} MiB -> {:.1} MiB; leases left {left}",
        rss_before as f64 / 1048576.0,
        rss_after as f64 / 1048576.0,
    );
    assert!(
        ok > 0 && conflict > 0 && dropped > 0,
        "the mix did not happen"
    );
    assert!(
        tasks_after <= tasks_before,
        "tasks leaked: {tasks_before} -> {tasks_after}"
    );
    assert!(
        clients_after <= clients_before,
        "Redis connections leaked: {clients_before} -> {clients_after}"
    );
    assert!(
        rss_after <= rss_before + RSS_BOUND,
        "RSS grew by {} KiB",
        (rss_after - rss_before) / 1024
    );
    assert_eq!(left, 0, "leases left in Redis");
}
