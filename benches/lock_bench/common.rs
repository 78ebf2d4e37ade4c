//! What several scenarios share: the baselines' lease settings and compare-and-delete, the
//! implementations compared, key tags, the control connection, Redis's CPU time and the
//! runtime shape.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::{body::Body, http::Request};
use redis::aio::MultiplexedConnection;
use tokio::runtime::Runtime;

/// The compare-and-delete at the heart of the crate's release (`src/store/scripts/release.lua`),
/// for the baselines and the round-trip measurement. Copied, so the baselines stay what they are
/// while the crate's own scripts change.
pub(crate) const RELEASE_LUA: &str = r"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// Lease TTL of the baselines (the crate's default; `protocol::check` holds the layer to it).
pub(crate) const TTL_MS: u64 = 10_000;
/// Leases held at once by the renewal and memory scenarios.
pub(crate) const LEASES: usize = 10_000;
/// The route every HTTP variant serves.
pub(crate) const ROUTE: &str = "/items/{sku}/purchase";

/// The implementations compared in the lock-cycle scenarios (b and c).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Peer {
    TowerLock,
    Rslock,
}

impl Peer {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::TowerLock => "tower-lock `Locker`",
            Self::Rslock => "rslock `LockManager`",
        }
    }
}

static NEXT_TAG: AtomicU64 = AtomicU64::new(0);

/// A fresh tag for key values, unique within this process.
pub(crate) fn tag() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        NEXT_TAG.fetch_add(1, Ordering::Relaxed)
    )
}

/// A connection of the benchmark's own to its server (not one under test).
pub(crate) async fn control(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the benchmark's redis-server")
}

/// Empties the benchmark's server between cases.
pub(crate) async fn flushall(url: &str) {
    let mut ctl = control(url).await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut ctl)
        .await
        .expect("FLUSHALL");
}

/// `used_cpu_user + used_cpu_sys` of the server at `url` (`INFO cpu`), in seconds.
pub(crate) async fn redis_cpu(url: &str) -> f64 {
    let mut ctl = control(url).await;
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut ctl)
        .await
        .expect("INFO cpu");
    info.lines()
        .filter_map(|line| {
            let (name, value) = line.trim().split_once(':')?;
            matches!(name, "used_cpu_user" | "used_cpu_sys")
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// Redis's CPU per operation, in µs: the CPU seconds between two [`redis_cpu`] readings,
/// divided by the operations served between them (at least 1).
pub(crate) fn cpu_us_per(before: f64, after: f64, operations: f64) -> f64 {
    (after - before) / operations.max(1.0) * 1e6
}

/// The runtime every case runs on: multi-thread, 2 workers.
pub(crate) fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `POST /items/<value>/purchase`, for the in-process HTTP measurements.
pub(crate) fn purchase(value: &str) -> Request<Body> {
    Request::post(format!("/items/{value}/purchase"))
        .body(Body::empty())
        .expect("request")
}
