//! Latency of one background lease (`Locker`): acquire and release one after the other, the
//! same after the process sat idle, and a hand-off from one store (process) to another. The
//! figures quoted in docs/DECISIONS.md ("A lease being released sends no renewal, and a late
//! \"not held\" is not a loss"). Starts no server itself; point it at a running Redis 6 or later:
//!
//! ```sh
//! redis-server --port 7001 --save '' --appendonly no --daemonize yes
//! REDIS_URL=redis://127.0.0.1:7001/ cargo run --release --example locker_latency
//! redis-cli -p 7001 shutdown nosave
//! ```
//!
//! Everything runs in a task on a 2-worker runtime, as a server's handlers would. "After idle"
//! sleeps 2 ms and then busy-works 200 µs before each timed call, so that the other worker and
//! Redis have gone to sleep, as they do between the requests of a quiet service. The hand-off
//! times from the holder's call to `release` to the moment the waiter (another store, queued
//! in Redis) has its guard.
//!
//! A `rediss://` URL (with `--features tls`) takes `REDIS_CA_CERT`, `REDIS_CLIENT_CERT` and
//! `REDIS_CLIENT_KEY` as the other examples do (`examples/common/store.rs`).

#[path = "common/store.rs"]
mod store;

use std::{
    env,
    error::Error,
    time::{Duration, Instant},
};

use tower_lock::{LockConfig, Locker, Wait};

const ROUNDS: usize = 2_000;

fn busy(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

fn percentiles(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{name:<28} p10 {:>9.1?}  p50 {:>9.1?}  p90 {:>9.1?}",
        at(0.1),
        at(0.5),
        at(0.9)
    );
}

async fn idle() {
    tokio::time::sleep(Duration::from_millis(2)).await;
    busy(Duration::from_micros(200));
}

async fn run(url: String) -> Result<(), Box<dyn Error + Send + Sync>> {
    let config = LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))?
                .deadline(Duration::from_secs(30)),
        )
        .build()?;
    let config = || config.clone();
    let tls = store::Tls::from_env()?;
    let connect = || async {
        tls.redis_store(&url)
            .await
            .map_err(|e| format!("REDIS_URL {}: {}", store::redacted(&url), store::chain(&e)))
    };
    let a = Locker::with_config(connect().await?, config());
    let b = Locker::with_config(connect().await?, config());
    // Warm-up: scripts loaded, server detected.
    for locker in [&a, &b] {
        locker
            .acquire(locker.key("latency-warm", "x")?)
            .await?
            .release()
            .await?;
    }

    for after_idle in [false, true] {
        let (mut acquire, mut release) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            if after_idle {
                idle().await;
            }
            let started = Instant::now();
            let guard = a.acquire(a.key("latency", "uncontended")?).await?;
            acquire.push(started.elapsed());
            if after_idle {
                idle().await;
            }
            let started = Instant::now();
            guard.release().await?;
            release.push(started.elapsed());
        }
        let when = if after_idle {
            "after idle"
        } else {
            "back to back"
        };
        percentiles(&format!("acquire, {when}"), acquire);
        percentiles(&format!("release, {when}"), release);
    }

    let mut handoff = Vec::new();
    let (mut holder, mut waiter) = (a, b);
    let mut guard = holder.acquire(holder.key("latency", "handoff")?).await?;
    for _ in 0..ROUNDS {
        let next = waiter.clone();
        let queued = tokio::spawn(async move {
            let guard = next.acquire(next.key("latency", "handoff")?).await?;
            Ok::<_, Box<dyn Error + Send + Sync>>((Instant::now(), guard))
        });
        // Long enough for the waiter to be queued in Redis.
        idle().await;
        let started = Instant::now();
        guard.release().await?;
        let (took, next_guard) = queued.await??;
        handoff.push(took - started);
        guard = next_guard;
        std::mem::swap(&mut holder, &mut waiter);
    }
    guard.release().await?;
    percentiles("hand-off to another store", handoff);
    Ok(())
}

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let url = env::var("REDIS_URL")
        .map_err(|_| "set REDIS_URL to a running Redis 6+, e.g. redis://127.0.0.1:7001/")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move { tokio::spawn(run(url)).await? })
}
