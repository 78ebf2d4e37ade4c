//! Scenario c, contended hand-off: waiters looping on one key with a 1 ms critical section,
//! in this process or split over child processes of the benchmark's own binary
//! (`--contended-child`), tower-lock's `Locker` next to rslock's `LockManager`.

use std::{
    fmt::Write as _,
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use redis::Script;
use tokio::runtime::Runtime;
use tower_lock::{LockConfig, Locker, RedisStore, Wait};
use tower_lock_testkit::{
    RedisServer,
    monitor::{CommandCounts, Monitor},
    process::Children,
};

use crate::{
    Settings,
    common::{Peer, RELEASE_LUA, TTL_MS, control, cpu_us_per, flushall, redis_cpu, runtime, tag},
};

/// Waiter counts of the contended scenario.
pub(crate) const WAITER_COUNTS: [usize; 2] = [16, 64];
/// The contended scenario runs its waiters in one process, then split over two.
pub(crate) const PROCESS_COUNTS: [usize; 2] = [1, 2];
/// Critical section of the contended scenario (a busy spin, so it is exactly this long).
pub(crate) const HOLD: Duration = Duration::from_millis(1);

/// Scenario c, `s.runs` times: per run, the round trip the ideal rate is computed from, then
/// every case (waiters x processes x implementation), each timed and then counted.
pub(crate) fn run(rt: &Runtime, redis: &RedisServer, s: &Settings) -> ContendedRuns {
    let url = redis.url();
    let mut cases = Vec::new();
    let (mut rtt_us, mut tight_rtt_us) = (Vec::new(), Vec::new());
    for waiters in WAITER_COUNTS {
        for procs in PROCESS_COUNTS {
            for peer in [Peer::TowerLock, Peer::Rslock] {
                cases.push((waiters, procs, peer, Vec::new()));
            }
        }
    }
    for run in 0..s.runs {
        rt.block_on(flushall(&url));
        // From a task on the runtime's workers, where the waiters run: `block_on`'s own
        // thread would add a cross-thread wake-up to every reply.
        let rtt = rt.block_on({
            let url = url.clone();
            async move { tokio::spawn(async move { eval_rtt(&url).await }).await }
        });
        let Rtt {
            back_to_back,
            after_hold: rtt,
        } = rtt.expect("round-trip task");
        rtt_us.push(rtt.as_secs_f64() * 1e6);
        tight_rtt_us.push(back_to_back.as_secs_f64() * 1e6);
        eprintln!(
            "c. run {}: median EVALSHA round trip {rtt:?} after a {HOLD:?} spin, {back_to_back:?} back to back",
            run + 1
        );
        for (waiters, procs, peer, samples) in &mut cases {
            let pass = |window: Duration, count: bool| {
                if *procs == 1 {
                    // A fresh runtime per case: no waiter of one case lingers into the next.
                    let case = runtime();
                    let sample =
                        case.block_on(contended(*peer, *waiters, redis, s, rtt, (window, count)));
                    case.shutdown_timeout(Duration::from_secs(2));
                    sample
                } else {
                    contended_processes(*peer, (*waiters, *procs), redis, s, rtt, (window, count))
                }
            };
            // Timed without MONITOR (it costs Redis and the reader CPU per command, scripts'
            // commands included), Redis's CPU with it, then the commands counted in a pass of
            // their own.
            let mut sample = pass(s.contended, false);
            let counted = pass(s.contended_count, true);
            sample.commands = counted.commands;
            sample.breakdown = counted.breakdown;
            eprintln!(
                "c. run {}: {waiters} waiters in {procs} process(es), {:<22} {:>6.0}/s (ideal {:.0}), per waiter {}..{}, p99 {:.1} ms, Redis {:.1} µs/acquisition, {:.2} commands/acquisition",
                run + 1,
                peer.name(),
                sample.rate,
                sample.ideal,
                sample.per_min,
                sample.per_max,
                sample.p99_ms,
                sample.redis_us,
                sample.commands
            );
            samples.push(sample);
        }
    }
    ContendedRuns {
        cases,
        rtt_us,
        tight_rtt_us,
    }
}

/// Every run of scenario c.
pub(crate) struct ContendedRuns {
    /// (waiters, processes, implementation, one sample per run)
    pub(crate) cases: Vec<(usize, usize, Peer, Vec<ContendedSample>)>,
    /// Round trips sent right after a `HOLD` spin (the ideal's), and back to back, per run.
    pub(crate) rtt_us: Vec<f64>,
    pub(crate) tight_rtt_us: Vec<f64>,
}

/// Median `EVALSHA` round trips (a compare-and-delete on a missing key): 2,000 back to back, and
/// 1,000 each sent right after a busy spin of `HOLD`, as a holder sends its release.
async fn eval_rtt(url: &str) -> Rtt {
    let mut conn = control(url).await;
    let script = Script::new(RELEASE_LUA);
    let mut median = async |n: usize, after_hold: bool| {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n + 100 {
            if after_hold {
                spin(HOLD);
            }
            let started = Instant::now();
            let _: i64 = script
                .key("bench:rtt")
                .arg("token")
                .invoke_async(&mut conn)
                .await
                .expect("EVALSHA");
            if i >= 100 {
                samples.push(started.elapsed());
            }
        }
        samples.sort();
        samples[samples.len() / 2]
    };
    let back_to_back = median(2_000, false).await;
    let after_hold = median(1_000, true).await;
    Rtt {
        back_to_back,
        after_hold,
    }
}

/// The round trips of [`eval_rtt`].
struct Rtt {
    back_to_back: Duration,
    after_hold: Duration,
}

fn spin(hold: Duration) {
    let until = Instant::now() + hold;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

#[derive(Default)]
struct WaiterStats {
    acquisitions: u64,
    errors: u64,
    held: Duration,
    waits: Option<Histogram<u64>>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram")
}

async fn tower_waiter(locker: Locker, value: String, end: Instant) -> WaiterStats {
    let mut stats = WaiterStats {
        waits: Some(histogram()),
        ..WaiterStats::default()
    };
    let deadline = tokio::time::Instant::from_std(end);
    while Instant::now() < end {
        let key = locker.key("bench-contended", &value).expect("key");
        let first_attempt = Instant::now();
        match tokio::time::timeout_at(deadline, locker.acquire(key)).await {
            Err(_) => break,
            Ok(Err(_)) => stats.errors += 1,
            Ok(Ok(guard)) => {
                record(&mut stats, first_attempt);
                let held = Instant::now();
                spin(HOLD);
                stats.held += held.elapsed();
                if guard.release().await.is_err() {
                    stats.errors += 1;
                }
            }
        }
    }
    stats
}

async fn rslock_waiter(
    manager: rslock::LockManager,
    resource: String,
    end: Instant,
) -> WaiterStats {
    let mut stats = WaiterStats {
        waits: Some(histogram()),
        ..WaiterStats::default()
    };
    let deadline = tokio::time::Instant::from_std(end);
    let ttl = Duration::from_millis(TTL_MS);
    while Instant::now() < end {
        let first_attempt = Instant::now();
        // `acquire_no_guard` is rslock's own "retry until acquired" loop.
        match tokio::time::timeout_at(deadline, manager.acquire_no_guard(resource.as_bytes(), ttl))
            .await
        {
            Err(_) => break,
            Ok(Err(_)) => stats.errors += 1,
            Ok(Ok(lock)) => {
                record(&mut stats, first_attempt);
                let held = Instant::now();
                spin(HOLD);
                stats.held += held.elapsed();
                manager.unlock(&lock).await;
            }
        }
    }
    stats
}

fn record(stats: &mut WaiterStats, first_attempt: Instant) {
    stats.acquisitions += 1;
    let waited = first_attempt.elapsed().as_micros().max(1) as u64;
    if let Some(h) = stats.waits.as_mut() {
        let _ = h.record(waited);
    }
}

pub(crate) struct ContendedSample {
    pub(crate) rate: f64,
    pub(crate) ideal: f64,
    pub(crate) per_min: u64,
    pub(crate) per_max: u64,
    pub(crate) max_dev_pct: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// `used_cpu_user + used_cpu_sys` of the server over the window, per acquisition; NaN in
    /// a counted pass (MONITOR slows Redis down, and would count the `INFO` calls).
    pub(crate) redis_us: f64,
    pub(crate) commands: f64,
    pub(crate) breakdown: String,
    pub(crate) errors: u64,
    pub(crate) mean_hold_us: f64,
}

pub(crate) fn contended_config() -> LockConfig {
    LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap()
}

/// A waiter, connected and warmed up.
enum Waiter {
    Tower(Locker),
    Rslock(rslock::LockManager),
}

/// Connects `n` waiters, each with its own connection, and has each take one warm-up lease on a
/// key of its own (script load, server detection), outside any counted window.
async fn connect_waiters(
    peer: Peer,
    n: usize,
    url: &str,
    warm_prefix: &str,
    rslock_retry: Duration,
) -> Vec<Waiter> {
    let mut ready = Vec::with_capacity(n);
    for i in 0..n {
        match peer {
            Peer::TowerLock => {
                let store = RedisStore::connect(url).await.expect("connect");
                let locker = Locker::with_config(store, contended_config());
                let key = locker
                    .key("bench-warm", format!("{warm_prefix}-{i}"))
                    .expect("key");
                let guard = locker.acquire(key).await.expect("warm-up acquire");
                guard.release().await.expect("warm-up release");
                ready.push(Waiter::Tower(locker));
            }
            Peer::Rslock => {
                let mut manager = rslock::LockManager::new(vec![url.to_owned()]);
                manager.set_retry(3, rslock_retry);
                let resource = format!("rslock-warm:{warm_prefix}-{i}");
                let lock = manager
                    .lock(resource.as_bytes(), Duration::from_millis(TTL_MS))
                    .await
                    .expect("warm-up rslock lock");
                manager.unlock(&lock).await;
                ready.push(Waiter::Rslock(manager));
            }
        }
    }
    ready
}

/// Starts every waiter on the one key named by `tag`, until `end`.
fn spawn_waiters(
    ready: Vec<Waiter>,
    tag: &str,
    end: Instant,
) -> Vec<tokio::task::JoinHandle<WaiterStats>> {
    ready
        .into_iter()
        .map(|waiter| match waiter {
            Waiter::Tower(locker) => tokio::spawn(tower_waiter(locker, tag.to_owned(), end)),
            Waiter::Rslock(manager) => tokio::spawn(rslock_waiter(
                manager,
                format!("rslock-contended:{tag}"),
                end,
            )),
        })
        .collect()
}

/// All waiters in this process, for `window`; with `count`, MONITOR counts the commands.
async fn contended(
    peer: Peer,
    waiters: usize,
    redis: &RedisServer,
    s: &Settings,
    rtt: Duration,
    (window, count): (Duration, bool),
) -> ContendedSample {
    let url = redis.url();
    let tag = tag();
    let ready = connect_waiters(peer, waiters, &url, &tag, s.rslock_retry).await;
    let mut ctl = control(&url).await;
    let monitor = if count {
        Some(Monitor::start(redis.port()).await)
    } else {
        None
    };
    let cpu_before = if count {
        None
    } else {
        Some(redis_cpu(&url).await)
    };
    let end = Instant::now() + window;
    let handles = spawn_waiters(ready, &tag, end);
    // Commands sent after the window closes (the last releases) are not counted, nor is
    // Redis's CPU for them.
    tokio::time::sleep_until(tokio::time::Instant::from_std(end)).await;
    let cpu = match cpu_before {
        Some(before) => Some((before, redis_cpu(&url).await)),
        None => None,
    };
    let counts = match monitor {
        Some(monitor) => monitor.finish(&mut ctl).await,
        None => CommandCounts::default(),
    };
    let mut all = Vec::with_capacity(waiters);
    let mut waits = histogram();
    for handle in handles {
        let mut stats = handle.await.expect("waiter panicked");
        if let Some(h) = stats.waits.take() {
            waits.add(&h).expect("merge histograms");
        }
        all.push(stats);
    }
    summarize(&all, &waits, (&counts, cpu), window, rtt)
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
}

/// The local `Instant` of a wall-clock time (processes on one machine share the clock).
fn instant_at(unix_us: u64) -> Instant {
    let (now_us, now) = (unix_micros(), Instant::now());
    if unix_us >= now_us {
        now + Duration::from_micros(unix_us - now_us)
    } else {
        now.checked_sub(Duration::from_micros(now_us - unix_us))
            .unwrap_or(now)
    }
}

/// The waiters split over `procs` child processes (this benchmark's own binary, started with
/// `--contended-child`), which all start and stop at the same wall-clock times.
fn contended_processes(
    peer: Peer,
    (waiters, procs): (usize, usize),
    redis: &RedisServer,
    s: &Settings,
    rtt: Duration,
    (window, count): (Duration, bool),
) -> ContendedSample {
    use std::io::BufRead as _;
    let url = redis.url();
    let tag = tag();
    let exe = std::env::current_exe().expect("the benchmark's own path");
    let mut children = Children(Vec::with_capacity(procs));
    let mut readers = Vec::with_capacity(procs);
    for p in 0..procs {
        let n = waiters / procs + usize::from(p < waiters % procs);
        let mut child = Command::new(&exe)
            .arg("--contended-child")
            .arg(match peer {
                Peer::TowerLock => "tower",
                Peer::Rslock => "rslock",
            })
            .args([&url, &tag, &format!("{tag}-p{p}")])
            .arg(n.to_string())
            .arg(s.rslock_retry.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a child process of the benchmark");
        let mut reader = std::io::BufReader::new(child.stdout.take().expect("child stdout"));
        children.0.push(child);
        let mut line = String::new();
        reader.read_line(&mut line).expect("child's READY");
        assert_eq!(line.trim(), "READY", "the child process did not start");
        readers.push(reader);
    }
    let rt = runtime();
    let (mut ctl, monitor, cpu_before) = rt.block_on(async {
        let ctl = control(&url).await;
        let monitor = if count {
            Some(Monitor::start(redis.port()).await)
        } else {
            None
        };
        let cpu_before = if count {
            None
        } else {
            Some(redis_cpu(&url).await)
        };
        (ctl, monitor, cpu_before)
    });
    let start_us = unix_micros() + 20_000;
    let end_us = start_us + window.as_micros() as u64;
    for child in &mut children.0 {
        let stdin = child.stdin.as_mut().expect("child stdin");
        writeln!(stdin, "GO {start_us} {end_us}").expect("tell the child to go");
        stdin.flush().expect("flush");
    }
    let end = instant_at(end_us);
    std::thread::sleep(end.saturating_duration_since(Instant::now()));
    let cpu = cpu_before.map(|before| (before, rt.block_on(redis_cpu(&url))));
    let counts = match monitor {
        Some(monitor) => rt.block_on(monitor.finish(&mut ctl)),
        None => CommandCounts::default(),
    };
    rt.shutdown_timeout(Duration::from_secs(1));
    let mut all = Vec::with_capacity(waiters);
    let mut waits = histogram();
    for reader in readers {
        for line in reader.lines() {
            let line = line.expect("child output");
            let mut fields = line.split_whitespace().skip(1);
            let mut num = || -> u64 {
                fields
                    .next()
                    .and_then(|f| f.parse().ok())
                    .unwrap_or_else(|| panic!("bad child line {line:?}"))
            };
            if line.starts_with("W ") {
                all.push(WaiterStats {
                    acquisitions: num(),
                    errors: num(),
                    held: Duration::from_nanos(num()),
                    waits: None,
                });
            } else if line.starts_with("T ") {
                let (value, count) = (num(), num());
                waits.record_n(value, count).expect("record wait");
            }
        }
    }
    for child in &mut children.0 {
        let status = child.wait().expect("child exit");
        assert!(status.success(), "a child process failed: {status}");
    }
    assert_eq!(
        all.len(),
        waiters,
        "child processes reported too few waiters"
    );
    summarize(&all, &waits, (&counts, cpu), window, rtt)
}

/// `--contended-child <tower|rslock> <url> <key tag> <warm-up prefix> <waiters> <rslock retry ms>`:
/// connects, prints `READY`, waits for `GO <start µs> <end µs>` (Unix time) on stdin, runs its
/// waiters over that window, and prints `W acquisitions errors held_ns` per waiter and
/// `T wait_us count` per wait-time bucket.
pub(crate) fn child_main(args: &[String]) {
    let [peer, url, tag, warm, waiters, retry] = args else {
        panic!("--contended-child takes 6 arguments, got {args:?}");
    };
    let peer = if peer == "tower" {
        Peer::TowerLock
    } else {
        Peer::Rslock
    };
    let waiters: usize = waiters.parse().expect("waiters");
    let retry = Duration::from_millis(retry.parse().expect("retry ms"));
    let rt = runtime();
    rt.block_on(async {
        let ready = connect_waiters(peer, waiters, url, warm, retry).await;
        println!("READY");
        let go = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await
        .expect("stdin reader")
        .expect("read GO");
        let times: Vec<u64> = go
            .split_whitespace()
            .skip(1)
            .map(|t| t.parse().expect("GO time"))
            .collect();
        let [start_us, end_us] = times[..] else {
            panic!("expected `GO <start> <end>`, got {go:?}");
        };
        tokio::time::sleep_until(tokio::time::Instant::from_std(instant_at(start_us))).await;
        let handles = spawn_waiters(ready, tag, instant_at(end_us));
        let mut out = String::new();
        for handle in handles {
            let stats = handle.await.expect("waiter panicked");
            let _ = writeln!(
                out,
                "W {} {} {}",
                stats.acquisitions,
                stats.errors,
                stats.held.as_nanos()
            );
            if let Some(h) = &stats.waits {
                for v in h.iter_recorded() {
                    let _ = writeln!(out, "T {} {}", v.value_iterated_to(), v.count_at_value());
                }
            }
        }
        print!("{out}");
    });
    rt.shutdown_timeout(Duration::from_secs(1));
}

/// A case's figures from its waiters' stats, the commands counted over its window and
/// Redis's CPU seconds ([`redis_cpu`]) at the window's start and end (in a timed pass).
fn summarize(
    all: &[WaiterStats],
    waits: &Histogram<u64>,
    (counts, cpu): (&CommandCounts, Option<(f64, f64)>),
    window: Duration,
    rtt: Duration,
) -> ContendedSample {
    let waiters = all.len().max(1);
    let total: u64 = all.iter().map(|w| w.acquisitions).sum();
    let held: Duration = all.iter().map(|w| w.held).sum();
    let mean_hold = if total > 0 {
        held.as_secs_f64() / total as f64
    } else {
        HOLD.as_secs_f64()
    };
    let mean = total as f64 / waiters as f64;
    let per_min = all.iter().map(|w| w.acquisitions).min().unwrap_or(0);
    let per_max = all.iter().map(|w| w.acquisitions).max().unwrap_or(0);
    let max_dev_pct = if mean > 0.0 {
        all.iter()
            .map(|w| (w.acquisitions as f64 - mean).abs() / mean * 100.0)
            .fold(0.0, f64::max)
    } else {
        0.0
    };
    let n = total.max(1) as f64;
    ContendedSample {
        rate: total as f64 / window.as_secs_f64(),
        ideal: 1.0 / (mean_hold + rtt.as_secs_f64()),
        per_min,
        per_max,
        max_dev_pct,
        p50_ms: waits.value_at_quantile(0.50) as f64 / 1000.0,
        p99_ms: waits.value_at_quantile(0.99) as f64 / 1000.0,
        redis_us: cpu.map_or(f64::NAN, |(before, after)| {
            cpu_us_per(before, after, total as f64)
        }),
        commands: counts.total() as f64 / n,
        breakdown: counts.per(n),
        errors: all.iter().map(|w| w.errors).sum(),
        mean_hold_us: mean_hold * 1e6,
    }
}
