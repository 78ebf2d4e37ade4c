//! Scenario i, permits: a key with N permits (`Acquiring::permits`) against the usual
//! hand-written sorted-set semaphore (`ZREMRANGEBYSCORE`, `ZCARD`, `ZADD` in one script, `ZREM`
//! to release, a short sleep between attempts when full), at N = 1, 4 and 16, side by side in
//! each run.

use std::fmt::Write as _;

use crate::{
    Settings,
    holders::{self, Ask, Case, HOLD, HoldersSample, INSTANCES, Plan, by_name, total},
    stats::{f0, f1, f2, stat},
};

/// The permits of the key, per case.
pub(crate) const PERMITS: [u32; 3] = [1, 4, 16];

/// Waiters for `permits`: twice the permits, at least two per instance, so that every permit
/// is wanted all the time.
pub(crate) fn waiters(permits: u32) -> usize {
    (2 * permits as usize).max(2 * INSTANCES)
}

fn case(permits: u32, zset: bool) -> Case {
    Case {
        waiters: waiters(permits),
        plan: Plan::Always(if zset {
            Ask::Zset(permits)
        } else {
            Ask::Permits(permits)
        }),
    }
}

/// (permits, the zset semaphore rather than the crate, one sample per run)
pub(crate) type PermitRuns = Vec<(u32, bool, Vec<HoldersSample>)>;

/// Scenario i, `s.runs` times: per run, every case timed, then counted in a pass of its own.
pub(crate) fn run(
    rt: &tokio::runtime::Runtime,
    redis: &tower_lock_testkit::RedisServer,
    s: &Settings,
) -> PermitRuns {
    let mut out: PermitRuns = PERMITS
        .iter()
        .flat_map(|&n| [(n, false, Vec::new()), (n, true, Vec::new())])
        .collect();
    for run in 0..s.runs {
        for (permits, zset, samples) in &mut out {
            let case = case(*permits, *zset);
            let sample = holders::measure(rt, redis, &case, s);
            eprintln!(
                "i. run {}: {permits:>2} permits, {:<24} {:>6.0}/s, most {} at once, shares {:.1}..{:.1} %, Jain {:.3}, p99 {:.1} ms, Redis {:.1} µs, {:.2} commands + {:.2} Lua calls per acquisition, {} errors",
                run + 1,
                name(*zset),
                sample.rate,
                sample.most_holders,
                sample.share_min * 100.0,
                sample.share_max * 100.0,
                sample.jain_instances,
                sample.wait_ms[0].1,
                sample.redis_us,
                total(&sample.commands),
                total(&sample.lua),
                sample.errors,
            );
            samples.push(sample);
        }
    }
    out
}

fn name(zset: bool) -> &'static str {
    if zset {
        "sorted-set semaphore"
    } else {
        "tower-lock `permits(N)`"
    }
}

/// The section of the report.
pub(crate) fn render(w: &mut String, s: &Settings, runs: &PermitRuns) {
    if runs.iter().all(|(_, _, samples)| samples.is_empty()) {
        return;
    }
    let _ = writeln!(
        w,
        "## i. Permits\n\n\
         One key with N permits, contended by 2N waiters (at least {min}), spread over {INSTANCES} \
         instances in the benchmark's process; each waiter loops for {} s: acquire, hold for \
         {} ms (a `tokio::time::sleep`, so that holders run together), release. \
         **tower-lock**: each instance is its own `RedisStore::connect` and `Locker` (wait \
         policy `Wait::exponential(1 ms, 20 ms).unwrap().deadline(30 s)`, which only paces checks when no \
         hand-off can be heard), acquiring with `locker.acquire(key).permits(N)`: waiters queue \
         in Redis and a release hands its permit to the head of the queue. **Sorted-set \
         semaphore**, the usual hand-written one: each instance is one multiplexed connection; \
         an acquire is one script (`ZREMRANGEBYSCORE key -inf <now>`, then if `ZCARD key < N`, \
         `ZADD key <now + TTL> <token>`), retried after a {} ms sleep while the set is full; a \
         release is `ZREM key <token>`. TTL {} s for both. *Share per instance*: each \
         instance's part of the acquisitions (even is {:.0} %); *Jain's index*: \
         (Σx)² ÷ (n·Σx²) over the instances' acquisitions, and over the waiters' (1 is \
         perfectly even). *Most at once*: the most holders the benchmark saw at once (never \
         more than N). Wait runs from the call to acquire to its return. Redis CPU is \
         `used_cpu_user + used_cpu_sys` from `INFO cpu` before the waiters start and after the \
         last has released, in the timed pass, divided by its acquisitions. Commands are counted \
         in a separate {} s pass of the same case right after the timed one: the commands \
         clients sent with `MONITOR`, and those Lua scripts ran as `INFO commandstats` (which \
         counts both) less those, divided by the acquisitions of the pass.\n",
        s.holders_window.as_secs(),
        HOLD.as_millis(),
        s.zset_retry.as_millis(),
        crate::common::TTL_MS / 1000,
        100.0 / INSTANCES as f64,
        s.holders_count_window.as_secs(),
        min = 2 * INSTANCES,
    );
    let _ = writeln!(
        w,
        "| N | waiters | implementation | acquisitions/s | share per instance, min–max | Jain's index, instances / waiters | wait p50 | wait p99 | most at once | Redis CPU µs per acquisition | client commands per acquisition | Lua calls per acquisition | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (permits, zset, samples) in runs {
        if samples.is_empty() {
            continue;
        }
        let get = |f: &dyn Fn(&HoldersSample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
        let last = samples.last().expect("a sample");
        let pct = |x: f64| format!("{:.1} %", x * 100.0);
        let _ = writeln!(
            w,
            "| {permits} | {} | {} | {} | {} – {} | {} / {} | {} ms | {} ms | {} | {} | {} ({}) | {} ({}) | {} |",
            waiters(*permits),
            name(*zset),
            stat(&get(&|x| x.rate), f0),
            stat(&get(&|x| x.share_min), pct),
            stat(&get(&|x| x.share_max), pct),
            stat(&get(&|x| x.jain_instances), |x| format!("{x:.3}")),
            stat(&get(&|x| x.jain_waiters), |x| format!("{x:.3}")),
            stat(&get(&|x| x.wait_ms[0].0), f1),
            stat(&get(&|x| x.wait_ms[0].1), f1),
            stat(&get(&|x| x.most_holders as f64), f0),
            stat(&get(&|x| x.redis_us), f1),
            stat(&get(&|x| total(&x.commands)), f2),
            by_name(&last.commands),
            stat(&get(&|x| total(&x.lua)), f2),
            by_name(&last.lua),
            stat(&get(&|x| x.errors as f64), f0),
        );
    }
    let _ = writeln!(w, "\n| ratio (per run, then median) | value |\n|---|---|");
    for permits in PERMITS {
        let of = |zset: bool| {
            runs.iter()
                .find(|(n, z, _)| *n == permits && *z == zset)
                .map(|(_, _, samples)| samples.as_slice())
                .unwrap_or_default()
        };
        let ratios: Vec<f64> = of(false)
            .iter()
            .zip(of(true))
            .map(|(tower, zset)| tower.rate / zset.rate)
            .collect();
        let cpu: Vec<f64> = of(false)
            .iter()
            .zip(of(true))
            .map(|(tower, zset)| tower.redis_us / zset.redis_us)
            .collect();
        let commands: Vec<f64> = of(false)
            .iter()
            .zip(of(true))
            .map(|(tower, zset)| total(&tower.commands) / total(&zset.commands))
            .collect();
        let _ = writeln!(
            w,
            "| N = {permits}: tower-lock / sorted-set semaphore, acquisitions/s | {} |\n\
             | N = {permits}: tower-lock / sorted-set semaphore, Redis CPU per acquisition | {} |\n\
             | N = {permits}: tower-lock / sorted-set semaphore, client commands per acquisition | {} |",
            stat(&ratios, f2),
            stat(&cpu, f2),
            stat(&commands, f2),
        );
    }
    let _ = writeln!(w);
}
