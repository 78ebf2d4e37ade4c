//! Scenario d, renewal at scale: 10,000 leases held by one process, renewed in the background,
//! first while `INFO cpu` measures what renewing them costs Redis, then while MONITOR counts
//! the commands that renew them.

use std::time::{Duration, Instant};

use futures_util::{StreamExt, stream};
use tokio::runtime::Runtime;
use tower_lock::{LeaseGuard, LockConfig, LockError, Locker, RedisStore};
use tower_lock_testkit::{RedisServer, monitor::Monitor};

use crate::{
    Settings,
    common::{LEASES, control, cpu_us_per, flushall, redis_cpu, runtime, tag},
};

/// Renewal scenario TTL: renewed every TTL / 3 = 1 s.
pub(crate) const RENEWAL_TTL: Duration = Duration::from_secs(3);

/// Scenario d, `s.runs` times, each on an emptied server and a fresh runtime.
pub(crate) fn run(rt: &Runtime, redis: &RedisServer, s: &Settings) -> Vec<RenewalSample> {
    let url = redis.url();
    let mut runs = Vec::new();
    for run in 0..s.runs {
        rt.block_on(flushall(&url));
        let case = runtime();
        let sample = case.block_on(renewal(redis, s));
        case.shutdown_timeout(Duration::from_secs(2));
        eprintln!(
            "d. run {}: {LEASES} leases, {} lost, {:.0} renewal commands/s, {:.2} leases per command, Redis {:.1} µs per lease renewed",
            run + 1,
            sample.lost,
            sample.commands_per_s,
            sample.leases_per_command,
            sample.redis_us
        );
        runs.push(sample);
    }
    runs
}

pub(crate) struct RenewalSample {
    pub(crate) acquire_s: f64,
    pub(crate) window_s: f64,
    pub(crate) lost: u64,
    pub(crate) release_errors: u64,
    pub(crate) commands_per_s: f64,
    pub(crate) renewals_per_s: f64,
    pub(crate) leases_per_command: f64,
    /// `used_cpu_user + used_cpu_sys` of the server over a window of its own without MONITOR,
    /// per lease renewed in it.
    pub(crate) redis_us: f64,
    pub(crate) breakdown: String,
}

async fn renewal(redis: &RedisServer, s: &Settings) -> RenewalSample {
    let url = redis.url();
    let tag = tag();
    let store = RedisStore::connect(url.as_str()).await.expect("connect");
    let locker = Locker::with_config(
        store,
        LockConfig::builder().ttl(RENEWAL_TTL).build().unwrap(),
    );
    // Warm-up: one lease held until its first renewal, so the one-time work of the first
    // renewal (loading the renew script, asking the server for native commands) is not counted.
    let warm = locker
        .acquire(locker.key("bench-renewal-warm", &tag).expect("key"))
        .await
        .expect("acquire");
    let waiting = Instant::now();
    while warm.renewals() == 0 && waiting.elapsed() < RENEWAL_TTL {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    warm.release().await.expect("release");
    let started = Instant::now();
    let guards: Vec<LeaseGuard> = stream::iter(0..LEASES)
        .map(|i| {
            let locker = locker.clone();
            let value = format!("{tag}-{i}");
            async move {
                let key = locker.key("bench-renewal", value).expect("key");
                locker.acquire(key).await.expect("acquire")
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let acquire_s = started.elapsed().as_secs_f64();
    let renewals =
        |guards: &[LeaseGuard]| -> u64 { guards.iter().map(|g| u64::from(g.renewals())).sum() };
    // Redis's CPU first, in a window without MONITOR (which costs Redis CPU per command,
    // scripts' commands included).
    let (cpu_before, renewed_before) = (redis_cpu(&url).await, renewals(&guards));
    tokio::time::sleep(s.renewal_hold).await;
    let cpu_after = redis_cpu(&url).await;
    let redis_us = cpu_us_per(
        cpu_before,
        cpu_after,
        (renewals(&guards) - renewed_before) as f64,
    );
    let mut ctl = control(&url).await;
    let monitor = Monitor::start(redis.port()).await;
    let before = renewals(&guards);
    let window = Instant::now();
    tokio::time::sleep(s.renewal_hold).await;
    let counts = monitor.finish(&mut ctl).await;
    let window_s = window.elapsed().as_secs_f64();
    let renewed = renewals(&guards) - before;
    let outcomes: Vec<(bool, bool)> = stream::iter(guards)
        .map(|guard| async move {
            let lost = guard.is_lost();
            match guard.release().await {
                Ok(()) => (lost, false),
                Err(LockError::LeaseLost(_)) => (true, false),
                Err(_) => (lost, true),
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let total = counts.total() as f64;
    RenewalSample {
        acquire_s,
        window_s,
        lost: outcomes.iter().filter(|(lost, _)| *lost).count() as u64,
        release_errors: outcomes.iter().filter(|(_, error)| *error).count() as u64,
        commands_per_s: total / window_s,
        renewals_per_s: renewed as f64 / window_s,
        leases_per_command: if total > 0.0 {
            renewed as f64 / total
        } else {
            0.0
        },
        redis_us,
        breakdown: counts.per(window_s),
    }
}
