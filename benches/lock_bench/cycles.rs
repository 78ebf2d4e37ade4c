//! Scenario b, uncontended lock cycles: tasks looping acquire + release on keys of their own,
//! no HTTP, tower-lock's `Locker` next to rslock's `LockManager`.

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::runtime::Runtime;
use tower_lock::{Locker, RedisStore};
use tower_lock_testkit::{RedisServer, monitor::Monitor};

use crate::{
    Settings,
    common::{Peer, TTL_MS, control, cpu_us_per, flushall, redis_cpu, tag},
};

/// Tasks of the uncontended cycle loop.
pub(crate) const CYCLE_TASKS: usize = 16;

/// Scenario b, `s.runs` times: each implementation in turn per run, on an emptied server.
pub(crate) fn run(
    rt: &Runtime,
    redis: &RedisServer,
    s: &Settings,
) -> Vec<Vec<(Peer, CycleSample)>> {
    let url = redis.url();
    let mut runs = Vec::new();
    for run in 0..s.runs {
        let mut samples = Vec::new();
        for peer in [Peer::TowerLock, Peer::Rslock] {
            rt.block_on(flushall(&url));
            let sample = rt.block_on(cycles(peer, redis, s));
            eprintln!(
                "b. run {}: {:<22} {:>9.0} cycles/s, Redis {:.1} µs/cycle, {:.2} commands/cycle",
                run + 1,
                peer.name(),
                sample.rate,
                sample.redis_us,
                sample.commands
            );
            samples.push((peer, sample));
        }
        runs.push(samples);
    }
    runs
}

enum Stop {
    At(Instant),
    After(u64),
}

/// Runs `op(task, n)` in `tasks` spawned tasks until `stop`; returns the operations done.
async fn drive<F, Fut>(tasks: usize, stop: Stop, op: F) -> u64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let stop = Arc::new(stop);
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let op = op.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut n = 0;
                loop {
                    match *stop {
                        Stop::At(end) if Instant::now() >= end => break,
                        Stop::After(count) if n >= count => break,
                        _ => {}
                    }
                    op(task, n).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for handle in handles {
        total += handle.await.expect("cycle task panicked");
    }
    total
}

pub(crate) struct CycleSample {
    pub(crate) rate: f64,
    /// `used_cpu_user + used_cpu_sys` of the server over the timed loop, per cycle done.
    pub(crate) redis_us: f64,
    pub(crate) commands: f64,
    pub(crate) breakdown: String,
}

async fn cycles(peer: Peer, redis: &RedisServer, s: &Settings) -> CycleSample {
    let url = redis.url();
    let tag = tag();
    match peer {
        Peer::TowerLock => {
            let locker = Locker::new(RedisStore::connect(url.as_str()).await.expect("connect"));
            let op = move |task: usize, n: u64| {
                let locker = locker.clone();
                let value = format!("{tag}-{task}-{n}");
                async move {
                    let key = locker.key("bench-cycles", value).expect("key");
                    let guard = locker.acquire(key).await.expect("uncontended acquire");
                    guard.release().await.expect("release");
                }
            };
            measure_cycles(&url, redis.port(), s, op).await
        }
        Peer::Rslock => {
            let manager = rslock::LockManager::new(vec![url.clone()]);
            let op = move |task: usize, n: u64| {
                let manager = manager.clone();
                let resource = format!("rslock-cycles:{tag}-{task}-{n}");
                async move {
                    let lock = manager
                        .lock(resource.as_bytes(), Duration::from_millis(TTL_MS))
                        .await
                        .expect("uncontended rslock lock");
                    manager.unlock(&lock).await;
                }
            };
            measure_cycles(&url, redis.port(), s, op).await
        }
    }
}

async fn measure_cycles<F, Fut>(url: &str, port: u16, s: &Settings, op: F) -> CycleSample
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    // Counting pass first (it also warms the connection and loads the scripts).
    let mut ctl = control(url).await;
    let per_task = s.cycle_count_ops / CYCLE_TASKS as u64;
    let warm = drive(CYCLE_TASKS, Stop::After(10), op.clone()).await;
    assert!(warm > 0);
    let monitor = Monitor::start(port).await;
    let counted = drive(CYCLE_TASKS, Stop::After(per_task), op.clone()).await;
    let counts = monitor.finish(&mut ctl).await;
    let cpu_before = redis_cpu(url).await;
    let start = Instant::now();
    let done = drive(CYCLE_TASKS, Stop::At(start + s.cycles), op).await;
    let elapsed = start.elapsed().as_secs_f64();
    let cpu_after = redis_cpu(url).await;
    CycleSample {
        rate: done as f64 / elapsed,
        redis_us: cpu_us_per(cpu_before, cpu_after, done as f64),
        commands: counts.total() as f64 / counted as f64,
        breakdown: counts.per(counted as f64),
    }
}
