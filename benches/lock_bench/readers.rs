//! Scenario k, many readers: what one more reader costs Redis beside n live readers of one key,
//! and what releasing them all costs while a writer waits in the queue. The readers are held
//! through the store (`LockStore::acquire` with `Share::new(1, Share::READERS)`, one token
//! each, as n processes would hold them); the writer is a `Locker`'s `exclusive()` lease on
//! another connection, queued before the readers go.

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use tower_lock::{
    Locker, RedisStore, Wait,
    key::Share,
    store::{Acquire, LockStore, Token},
};
use tower_lock_testkit::RedisServer;

use crate::{
    Settings,
    common::{control, flushall, tag},
    stats::{f0, f1, f2, stat},
};

/// How many readers hold the key while it is measured.
pub(crate) const READERS: [usize; 3] = [3, 1_000, 5_000];
/// Reader acquire-and-release cycles measured beside them.
const CYCLES: usize = 200;
/// The readers' and the measured reader's TTL: longer than a case runs.
const TTL: Duration = Duration::from_secs(60);

/// One case of one run.
pub(crate) struct ReadersSample {
    /// Redis's time in scripts per reader acquire and release beside the others (µs).
    pub(crate) cycle_us: f64,
    /// From the first release of the readers to the queued writer's lease (ms).
    pub(crate) drain_ms: f64,
    /// Redis's time in scripts over that drain (ms).
    pub(crate) drain_redis_ms: f64,
}

/// (readers, one sample per run)
pub(crate) type ReadersRuns = Vec<(usize, Vec<ReadersSample>)>;

/// Scenario k, `s.runs` times.
pub(crate) fn run(rt: &tokio::runtime::Runtime, redis: &RedisServer, s: &Settings) -> ReadersRuns {
    let mut out: ReadersRuns = READERS.iter().map(|&n| (n, Vec::new())).collect();
    for run in 0..s.runs {
        for (n, samples) in &mut out {
            let sample = rt.block_on(measure(redis, *n));
            eprintln!(
                "k. run {}: {n:>5} readers: {:.1} µs of Redis per reader cycle, writer in {:.0} ms after the first release, {:.1} ms of Redis to drain",
                run + 1,
                sample.cycle_us,
                sample.drain_ms,
                sample.drain_redis_ms,
            );
            samples.push(sample);
        }
    }
    out
}

/// Microseconds Redis has spent in `EVALSHA` (the scripts, the commands they run included).
async fn script_us(ctl: &mut MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(ctl)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("usec=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<f64>()
                .ok()
        })
        .sum()
}

async fn measure(redis: &RedisServer, n: usize) -> ReadersSample {
    let url = redis.url();
    flushall(&url).await;
    let mut ctl = control(&url).await;
    let holders = RedisStore::connect(&url).await.expect("connect");
    let visitor = RedisStore::connect(&url).await.expect("connect");
    let locker = Locker::new(RedisStore::connect(&url).await.expect("connect"));
    let key = locker.key("readers", tag()).expect("key");
    let reader = key
        .clone()
        .with_share(Share::new(1, Share::READERS).expect("share"));
    let tokens: Vec<Token> = (0..n).map(|_| Token::generate().expect("token")).collect();
    for chunk in tokens.chunks(256) {
        for answer in join_all(chunk.iter().map(|t| holders.acquire(&reader, t, TTL))).await {
            assert!(
                matches!(answer.expect("reader"), Acquire::Acquired { .. }),
                "a reader was refused"
            );
        }
    }

    // One more reader, again and again, beside the n.
    let before = script_us(&mut ctl).await;
    for _ in 0..CYCLES {
        let token = Token::generate().expect("token");
        let answer = visitor.acquire(&reader, &token, TTL).await.expect("reader");
        assert!(matches!(answer, Acquire::Acquired { .. }));
        assert!(visitor.release(&reader, &token).await.expect("release"));
    }
    let cycle_us = (script_us(&mut ctl).await - before) / CYCLES as f64;

    // A writer queues; then every reader goes, and the last one hands the key to it.
    let writer = tokio::spawn({
        let locker = locker.clone();
        let key = key.clone();
        async move {
            let wait = Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
                .unwrap()
                .deadline(Duration::from_secs(120));
            let guard = locker
                .acquire(key)
                .exclusive()
                .unwrap()
                .wait(wait)
                .await
                .expect("writer");
            let at = Instant::now();
            guard.release().await.expect("writer's release");
            at
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = script_us(&mut ctl).await;
    let started = Instant::now();
    for chunk in tokens.chunks(256) {
        for released in join_all(chunk.iter().map(|t| holders.release(&reader, t))).await {
            assert!(released.expect("release"), "a reader's lease was lost");
        }
    }
    let writer_in = writer.await.expect("writer task");
    let drain_ms = writer_in.duration_since(started).as_secs_f64() * 1e3;
    let drain_redis_ms = (script_us(&mut ctl).await - before) / 1e3;
    ReadersSample {
        cycle_us,
        drain_ms,
        drain_redis_ms,
    }
}

/// The section of the report.
pub(crate) fn render(w: &mut String, s: &Settings, runs: &ReadersRuns) {
    if runs.iter().all(|(_, samples)| samples.is_empty()) {
        return;
    }
    let _ = writeln!(
        w,
        "## k. Many readers\n\n\
         One key held by n readers (each `LockStore::acquire` with `Share::new(1, \
         Share::READERS)` and a token of its own, as n processes would hold them, TTL 60 s). \
         *Reader cycle*: {CYCLES} more readers, one after the other on another connection, each \
         acquired and released beside the n; Redis's time in scripts (`INFO commandstats`, \
         `cmdstat_evalsha` usec, which includes the commands the scripts run) per acquire and \
         release. *Drain*: a `Locker`'s `exclusive()` writer queues (200 ms before), then all n \
         readers are released, 256 at a time; the time from the first release to the writer's \
         lease, and Redis's time in scripts meanwhile. {} run(s); median, with the range.\n",
        s.runs,
    );
    let _ = writeln!(
        w,
        "| readers | Redis µs per reader cycle | drain: writer in after (ms) | Redis ms to drain |\n\
         |---:|---:|---:|---:|"
    );
    for (n, samples) in runs {
        let get = |f: fn(&ReadersSample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
        let _ = writeln!(
            w,
            "| {n} | {} | {} | {} |",
            stat(&get(|x| x.cycle_us), f1),
            stat(&get(|x| x.drain_ms), f0),
            stat(&get(|x| x.drain_redis_ms), f2),
        );
    }
    let _ = writeln!(w);
}
