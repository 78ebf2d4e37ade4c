//! What scenarios i (permits) and j (shared leases) share: instances of waiters contending for
//! one key, each operation held for a fixed sleep; the hand-written sorted-set semaphore they
//! are compared with; and a case's figures (rate, fairness across instances, wait times, the
//! most holders seen at once, Redis's CPU per acquisition from `INFO cpu`, commands per
//! acquisition from `MONITOR` and `INFO commandstats`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use hdrhistogram::Histogram;
use redis::{Script, aio::MultiplexedConnection};
use tower_lock::{LeaseGuard, Locker, RedisStore};
use tower_lock_testkit::{RedisServer, monitor::Monitor};

use tokio::runtime::Runtime;

use crate::{
    Settings,
    callgrind::ByName,
    common::{TTL_MS, control, cpu_us_per, flushall, redis_cpu, tag},
    contended::contended_config,
    counts::{finish_counting, lua_calls},
};

/// Instances (each its own connection and `Locker`, or its own connection for the semaphore)
/// the waiters are spread over.
pub(crate) const INSTANCES: usize = 4;
/// How long each operation holds what it acquired: a sleep, so that holders that may run
/// together do (a busy spin would be bounded by the machine's 2 cores).
pub(crate) const HOLD: Duration = Duration::from_millis(1);

/// The usual sorted-set semaphore's acquire: drop the holders whose expiry has passed, then
/// add this one if fewer than the permits remain. Its release is `ZREM key token`.
const ZSET_ACQUIRE: &str = r"redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  return 1
end
return 0";

/// What one acquisition asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// The plain lease: the key alone.
    Plain,
    /// One of the key's permits (`Acquiring::permits`).
    Permits(u32),
    /// A reader (`Acquiring::shared`).
    Shared,
    /// A writer of a key readers share (`Acquiring::exclusive`).
    Exclusive,
    /// One of the hand-written sorted-set semaphore's permits.
    Zset(u32),
}

impl Ask {
    /// Whether no other holder may hold with this one.
    fn alone(self) -> bool {
        matches!(self, Self::Plain | Self::Exclusive)
    }
}

/// One instance: what its waiters acquire through.
#[derive(Clone)]
enum Instance {
    Tower(Locker),
    Zset(Arc<Zset>),
}

/// The hand-written semaphore of one instance: its connection and scripts.
struct Zset {
    conn: MultiplexedConnection,
    acquire: Script,
    retry: Duration,
}

/// What a waiter holds. Held on the waiter's stack, as an application holds its guard: boxing
/// the guard would add an allocation to one side of the comparison only.
#[allow(clippy::large_enum_variant)]
enum Held {
    Tower(LeaseGuard),
    Zset(String),
}

impl Instance {
    async fn connect(url: &str, zset: bool, retry: Duration) -> Self {
        if zset {
            Self::Zset(Arc::new(Zset {
                conn: control(url).await,
                acquire: Script::new(ZSET_ACQUIRE),
                retry,
            }))
        } else {
            let store = RedisStore::connect(url).await.expect("connect");
            Self::Tower(Locker::with_config(store, contended_config()))
        }
    }

    async fn acquire(&self, key: &str, ask: Ask) -> Result<Held, String> {
        match (self, ask) {
            (Self::Tower(locker), ask) => {
                let key = locker
                    .key("bench-holders", key)
                    .map_err(|e| e.to_string())?;
                let acquiring = locker.acquire(key);
                let acquiring = match ask {
                    Ask::Plain => acquiring,
                    Ask::Permits(n) => acquiring
                        .permits(std::num::NonZeroU32::new(n).expect("a scenario has permits"))
                        .unwrap(),
                    Ask::Shared => acquiring.shared().unwrap(),
                    Ask::Exclusive => acquiring.exclusive().unwrap(),
                    Ask::Zset(_) => return Err("a Locker cannot take the zset's permits".into()),
                };
                acquiring.await.map(Held::Tower).map_err(|e| e.to_string())
            }
            (Self::Zset(zset), Ask::Zset(permits)) => {
                let token = format!("{:032x}", fastrand::u128(..));
                let key = format!("bench-zset:{key}");
                let mut conn = zset.conn.clone();
                loop {
                    let now = unix_ms();
                    let got: i64 = zset
                        .acquire
                        .key(&key)
                        .arg(now)
                        .arg(permits)
                        .arg(now + TTL_MS)
                        .arg(&token)
                        .invoke_async(&mut conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    if got == 1 {
                        return Ok(Held::Zset(token));
                    }
                    tokio::time::sleep(zset.retry).await;
                }
            }
            (Self::Zset(_), ask) => Err(format!("the zset semaphore cannot take {ask:?}")),
        }
    }

    async fn release(&self, key: &str, held: Held) -> Result<(), String> {
        match (self, held) {
            (Self::Tower(_), Held::Tower(guard)) => {
                guard.release().await.map_err(|error| error.to_string())
            }
            (Self::Zset(zset), Held::Zset(token)) => {
                let mut conn = zset.conn.clone();
                let _: i64 = redis::cmd("ZREM")
                    .arg(format!("bench-zset:{key}"))
                    .arg(token)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            }
            _ => Err("released through another kind of instance".into()),
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// Who holds the key now, as this process sees it: the most holders at once, and how often a
/// holder that must be alone was not.
#[derive(Default)]
struct Watch {
    holders: AtomicUsize,
    alone: AtomicUsize,
    most: AtomicUsize,
    overlaps: AtomicU64,
}

impl Watch {
    fn enter(&self, ask: Ask) {
        let now = self.holders.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let alone = self.alone.load(Ordering::SeqCst);
        if alone > 0 || (ask.alone() && now > 1) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        if ask.alone() {
            self.alone.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn leave(&self, ask: Ask) {
        if ask.alone() {
            self.alone.fetch_sub(1, Ordering::SeqCst);
        }
        self.holders.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a case's acquisitions ask for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Plan {
    /// The same every time.
    Always(Ask),
    /// A read (`Ask::Shared`) 9 times in 10, else a write (`Ask::Exclusive`); or, with
    /// `shared: false`, the same draws each taking the plain lease.
    ReadMostly { shared: bool },
}

impl Plan {
    /// The next acquisition's ask, and whether it is a read (an ask that may share, or one
    /// drawn as a read), from the waiter's own generator (seeded by its index, so that a
    /// waiter draws the same sequence in every case).
    fn next(self, rng: &mut fastrand::Rng) -> (Ask, bool) {
        match self {
            Self::Always(ask) => (ask, !ask.alone()),
            Self::ReadMostly { shared } => {
                let read = rng.u32(0..10) < 9;
                let ask = match (shared, read) {
                    (false, _) => Ask::Plain,
                    (true, true) => Ask::Shared,
                    (true, false) => Ask::Exclusive,
                };
                (ask, read)
            }
        }
    }
}

/// One case: `waiters` tasks spread over [`INSTANCES`] instances, each looping acquire, hold
/// [`HOLD`], release on one key, asking as `plan` says.
pub(crate) struct Case {
    pub(crate) waiters: usize,
    pub(crate) plan: Plan,
}

impl Case {
    fn zset(&self) -> bool {
        matches!(self.plan, Plan::Always(Ask::Zset(_)))
    }
}

/// Per waiter.
struct WaiterStats {
    instance: usize,
    acquisitions: u64,
    errors: u64,
    /// Waits of reads (`0`: acquisitions that may share, or drawn as reads) and of the
    /// others (`1`), in µs.
    waits: [Histogram<u64>; 2],
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram")
}

async fn waiter(
    instance: Instance,
    index: (usize, usize),
    key: Arc<str>,
    plan: Plan,
    watch: Arc<Watch>,
    end: Instant,
) -> WaiterStats {
    let (instance_index, waiter_index) = index;
    let mut rng = fastrand::Rng::with_seed(waiter_index as u64 + 1);
    let mut stats = WaiterStats {
        instance: instance_index,
        acquisitions: 0,
        errors: 0,
        waits: [histogram(), histogram()],
    };
    let deadline = tokio::time::Instant::from_std(end);
    while Instant::now() < end {
        let (ask, read) = plan.next(&mut rng);
        let started = Instant::now();
        match tokio::time::timeout_at(deadline, instance.acquire(&key, ask)).await {
            Err(_) => break,
            Ok(Err(_)) => stats.errors += 1,
            Ok(Ok(held)) => {
                let waited = started.elapsed().as_micros().max(1) as u64;
                let _ = stats.waits[usize::from(!read)].record(waited);
                stats.acquisitions += 1;
                watch.enter(ask);
                tokio::time::sleep(HOLD).await;
                watch.leave(ask);
                if instance.release(&key, held).await.is_err() {
                    stats.errors += 1;
                }
            }
        }
    }
    stats
}

/// A case's figures from one run.
#[derive(Clone)]
pub(crate) struct HoldersSample {
    pub(crate) rate: f64,
    /// Each instance's share of the acquisitions, the smallest and the largest.
    pub(crate) share_min: f64,
    pub(crate) share_max: f64,
    /// Jain's fairness index over the instances' acquisitions (1 = equal).
    pub(crate) jain_instances: f64,
    /// The same over the waiters.
    pub(crate) jain_waiters: f64,
    /// Wait p50 and p99 in ms, of every acquisition, of the reads, of the others.
    pub(crate) wait_ms: [(f64, f64); 3],
    pub(crate) most_holders: usize,
    pub(crate) overlaps: u64,
    pub(crate) errors: u64,
    /// `used_cpu_user + used_cpu_sys` of the server over the timed pass (the waiters' last
    /// releases included), per acquisition; NaN in a counted pass, which MONITOR slows.
    pub(crate) redis_us: f64,
    pub(crate) commands: ByName,
    pub(crate) lua: ByName,
}

fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        0.0
    } else {
        sum * sum / (xs.len() as f64 * squares)
    }
}

/// Connects the instances and warms each up (one acquisition on a key of its own).
async fn instances(url: &str, case: &Case, retry: Duration) -> Vec<Instance> {
    let (warm_ask, _) = case.plan.next(&mut fastrand::Rng::with_seed(1));
    let mut out = Vec::with_capacity(INSTANCES);
    for i in 0..INSTANCES {
        let instance = Instance::connect(url, case.zset(), retry).await;
        let key = format!("warm-{}-{i}", tag());
        let held = instance.acquire(&key, warm_ask).await.expect("warm-up");
        instance.release(&key, held).await.expect("warm-up release");
        out.push(instance);
    }
    out
}

/// One run of `case`: timed for `s.holders_window` (Redis's CPU with it), then its commands
/// counted in a pass of `s.holders_count_window` of its own.
pub(crate) fn measure(
    rt: &Runtime,
    redis: &RedisServer,
    case: &Case,
    s: &Settings,
) -> HoldersSample {
    let mut sample = rt.block_on(run_case(redis, case, s.zset_retry, s.holders_window, false));
    let counted = rt.block_on(run_case(
        redis,
        case,
        s.zset_retry,
        s.holders_count_window,
        true,
    ));
    sample.commands = counted.commands;
    sample.lua = counted.lua;
    sample
}

/// Runs `case` for `window` on an emptied server; with `count`, `MONITOR` and
/// `INFO commandstats` count the commands of every acquisition it made (the waiters' last
/// releases included), and without, `INFO cpu` measures Redis's CPU over the same span.
async fn run_case(
    redis: &RedisServer,
    case: &Case,
    retry: Duration,
    window: Duration,
    count: bool,
) -> HoldersSample {
    let url = redis.url();
    flushall(&url).await;
    let instances = instances(&url, case, retry).await;
    let mut ctl = control(&url).await;
    let monitor = if count {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut ctl)
            .await
            .expect("CONFIG RESETSTAT");
        Some(Monitor::start(redis.port()).await)
    } else {
        None
    };
    let cpu_before = if count {
        None
    } else {
        Some(redis_cpu(&url).await)
    };
    let key: Arc<str> = tag().into();
    let watch = Arc::new(Watch::default());
    let end = Instant::now() + window;
    let handles: Vec<_> = (0..case.waiters)
        .map(|w| {
            let i = w % INSTANCES;
            tokio::spawn(waiter(
                instances[i].clone(),
                (i, w),
                Arc::clone(&key),
                case.plan,
                Arc::clone(&watch),
                end,
            ))
        })
        .collect();
    let mut all = Vec::with_capacity(case.waiters);
    for handle in handles {
        all.push(handle.await.expect("waiter panicked"));
    }
    let cpu = match cpu_before {
        Some(before) => Some((before, redis_cpu(&url).await)),
        None => None,
    };
    let (commands, lua) = match monitor {
        Some(monitor) => {
            let (client, all) = finish_counting(monitor, &mut ctl).await;
            let lua = lua_calls(&all, &client);
            (client, lua)
        }
        None => (ByName::new(), ByName::new()),
    };
    summarize(&all, &watch, window, cpu, (commands, lua))
}

/// The benchmark's own commands around a counted window, left out of the counts.
const OWN: [&str; 6] = ["CONFIG", "ECHO", "FLUSHALL", "INFO", "MONITOR", "SELECT"];

fn per_acquisition(by: ByName, acquisitions: f64) -> ByName {
    by.into_iter()
        .filter(|(name, _)| !OWN.contains(&name.as_str()))
        .map(|(name, n)| (name, n / acquisitions))
        .filter(|(_, n)| n.abs() >= 0.005)
        .collect()
}

/// A case's figures from its waiters' stats, Redis's CPU seconds ([`redis_cpu`]) before and
/// after its timed pass, and the commands of its counted pass.
fn summarize(
    all: &[WaiterStats],
    watch: &Watch,
    window: Duration,
    cpu: Option<(f64, f64)>,
    (commands, lua): (ByName, ByName),
) -> HoldersSample {
    let total: u64 = all.iter().map(|w| w.acquisitions).sum();
    let mut per_instance = [0.0; INSTANCES];
    for w in all {
        per_instance[w.instance] += w.acquisitions as f64;
    }
    let shares: Vec<f64> = per_instance
        .iter()
        .map(|n| n / total.max(1) as f64)
        .collect();
    let per_waiter: Vec<f64> = all.iter().map(|w| w.acquisitions as f64).collect();
    let mut merged = [histogram(), histogram(), histogram()];
    for w in all {
        for (kind, h) in w.waits.iter().enumerate() {
            merged[0].add(h).expect("merge histograms");
            merged[kind + 1].add(h).expect("merge histograms");
        }
    }
    let quantiles = |h: &Histogram<u64>| {
        if h.is_empty() {
            (f64::NAN, f64::NAN)
        } else {
            (
                h.value_at_quantile(0.50) as f64 / 1000.0,
                h.value_at_quantile(0.99) as f64 / 1000.0,
            )
        }
    };
    let n = total.max(1) as f64;
    HoldersSample {
        rate: total as f64 / window.as_secs_f64(),
        share_min: shares.iter().copied().fold(f64::INFINITY, f64::min),
        share_max: shares.iter().copied().fold(0.0, f64::max),
        jain_instances: jain(&per_instance),
        jain_waiters: jain(&per_waiter),
        wait_ms: [
            quantiles(&merged[0]),
            quantiles(&merged[1]),
            quantiles(&merged[2]),
        ],
        most_holders: watch.most.load(Ordering::SeqCst),
        overlaps: watch.overlaps.load(Ordering::SeqCst),
        errors: all.iter().map(|w| w.errors).sum(),
        redis_us: cpu.map_or(f64::NAN, |(before, after)| {
            cpu_us_per(before, after, total as f64)
        }),
        commands: per_acquisition(commands, n),
        lua: per_acquisition(lua, n),
    }
}

/// `EVALSHA 2.00, ZREM 1.00`, or `none`.
pub(crate) fn by_name(by: &ByName) -> String {
    if by.is_empty() {
        return "none".to_owned();
    }
    by.iter()
        .map(|(name, n)| format!("{name} {n:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The sum of a case's counts.
pub(crate) fn total(by: &ByName) -> f64 {
    by.values().sum()
}
