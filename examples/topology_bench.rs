//! Latency and throughput of one uncontended locked request on each topology: the figures in
//! `docs/BENCHMARKS.md` ("Topologies"). Starts no server itself; point it at running ones.
//!
//! ```sh
//! # LOCK_STORE, REDIS_URL(S), LOCK_WAIT_REPLICAS as for the other examples (examples/common/store.rs)
//! REDIS_URL=redis://127.0.0.1:7001/ cargo run --release --example topology_bench
//! LOCK_STORE=redis REDIS_URL=redis://127.0.0.1:7001/ LOCK_WAIT_REPLICAS=1 cargo run --release --example topology_bench
//! LOCK_STORE=redlock REDIS_URLS=redis://127.0.0.1:7011/,redis://127.0.0.1:7012/,redis://127.0.0.1:7013/ \
//!     cargo run --release --example topology_bench
//! LOCK_STORE=cluster REDIS_URLS=redis://127.0.0.1:7021/ cargo run --release --features cluster --example topology_bench
//! ```
//!
//! Each request goes through an axum router with the `LockLayer` (keyed on a path parameter, a
//! distinct key per request, so nothing waits) and an empty handler: acquire, release, nothing
//! else. `BENCH_SEQUENTIAL` requests one after the other give the latency percentiles;
//! `BENCH_CONCURRENCY` tasks sending `BENCH_PER_TASK` requests each give the throughput.

use std::{env, error::Error, time::Instant};

use axum::{Router, body::Body, http::Request, routing::post};
use tower::ServiceExt;
use tower_lock::{Key, LockConfig};

#[path = "common/store.rs"]
mod store;

fn env_or(name: &str, default: usize) -> usize {
    env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn one(app: &Router, key: &str) {
    let response = app
        .clone()
        .oneshot(
            Request::post(format!("/items/{key}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "request failed: {}",
        response.status()
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let sequential = env_or("BENCH_SEQUENTIAL", 2000);
    let concurrency = env_or("BENCH_CONCURRENCY", 50);
    let per_task = env_or("BENCH_PER_TASK", 200);
    let chosen = store::from_env().await?;
    let layer = chosen.lock_layer(Key::path_param("id"), LockConfig::default());
    let app = Router::new()
        .route("/items/{id}", post(|| async { "ok" }))
        .route_layer(layer);
    let run = fastrand::u64(..);

    // Warm-up: connections, script cache, native-command detection.
    for i in 0..100 {
        one(&app, &format!("warm-{run}-{i}")).await;
    }
    let mut latencies = Vec::with_capacity(sequential);
    for i in 0..sequential {
        let started = Instant::now();
        one(&app, &format!("seq-{run}-{i}")).await;
        latencies.push(started.elapsed());
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];

    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let app = app.clone();
            tokio::spawn(async move {
                for i in 0..per_task {
                    one(&app, &format!("con-{run}-{t}-{i}")).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let rate = (concurrency * per_task) as f64 / started.elapsed().as_secs_f64();
    println!("{}", chosen.description);
    println!(
        "sequential: p50 {:?}  p99 {:?}  ({sequential} requests)",
        pct(0.50),
        pct(0.99)
    );
    println!("concurrent: {rate:.0} req/s ({concurrency} tasks x {per_task} requests)");
    Ok(())
}
