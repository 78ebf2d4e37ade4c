//! Scenario j, shared leases: 90 % readers (`Acquiring::shared`) and 10 % writers
//! (`Acquiring::exclusive`) on one key, against the same operations all taking the plain
//! exclusive lease, side by side in each run.

use std::fmt::Write as _;

use crate::{
    Settings,
    holders::{self, Case, HOLD, HoldersSample, INSTANCES, Plan, by_name, total},
    stats::{f0, f1, f2, stat},
};

/// Waiters of each case.
pub(crate) const WAITERS: usize = 16;
/// (shared leases rather than the plain one, one sample per run)
pub(crate) type SharedRuns = Vec<(bool, Vec<HoldersSample>)>;

/// Scenario j, `s.runs` times: per run, both cases timed, then counted in a pass of their own.
pub(crate) fn run(
    rt: &tokio::runtime::Runtime,
    redis: &tower_lock_testkit::RedisServer,
    s: &Settings,
) -> SharedRuns {
    let mut out: SharedRuns = vec![(true, Vec::new()), (false, Vec::new())];
    for run in 0..s.runs {
        for (shared, samples) in &mut out {
            let case = Case {
                waiters: WAITERS,
                plan: Plan::ReadMostly { shared: *shared },
            };
            let sample = holders::measure(rt, redis, &case, s);
            eprintln!(
                "j. run {}: {:<34} {:>6.0}/s, most {} at once, {} overlaps, p99 readers {:.1} ms, writers {:.1} ms, Redis {:.1} µs and {:.2} commands per acquisition, {} errors",
                run + 1,
                name(*shared),
                sample.rate,
                sample.most_holders,
                sample.overlaps,
                sample.wait_ms[1].1,
                sample.wait_ms[2].1,
                sample.redis_us,
                total(&sample.commands),
                sample.errors,
            );
            samples.push(sample);
        }
    }
    out
}

fn name(shared: bool) -> &'static str {
    if shared {
        "`shared()` readers, `exclusive()` writers"
    } else {
        "plain exclusive lease for all"
    }
}

/// The section of the report.
pub(crate) fn render(w: &mut String, s: &Settings, runs: &SharedRuns) {
    if runs.iter().all(|(_, samples)| samples.is_empty()) {
        return;
    }
    let _ = writeln!(
        w,
        "## j. Shared leases\n\n\
         {WAITERS} waiters on one key, spread over {INSTANCES} instances in the benchmark's \
         process (each its own `RedisStore::connect` and `Locker`, wait policy as in i.), each \
         looping for {} s: acquire, hold for {} ms (a `tokio::time::sleep`), release. Each \
         operation is a read with probability 0.9 and a write otherwise (every waiter draws the \
         same sequence in both cases). **Shared**: a read takes \
         `locker.acquire(key).shared()`, a write `locker.acquire(key).exclusive()`. **Exclusive**: \
         every operation takes the plain lease, `locker.acquire(key)`, as an application without \
         shared leases would. Wait runs from the call to acquire to its return, for reads and \
         writes apart. *Most at once*: the most holders the benchmark saw at once; *overlaps*: \
         acquisitions that found a writer holding, or that were a writer and found anyone (must \
         be 0). Redis CPU per acquisition is measured over the timed pass and commands are \
         counted in a separate {} s pass, both as in i.\n",
        s.holders_window.as_secs(),
        HOLD.as_millis(),
        s.holders_count_window.as_secs(),
    );
    let _ = writeln!(
        w,
        "| lease | acquisitions/s | read wait p50 | read wait p99 | write wait p50 | write wait p99 | most at once | overlaps | Redis CPU µs per acquisition | client commands per acquisition | Lua calls per acquisition | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (shared, samples) in runs {
        if samples.is_empty() {
            continue;
        }
        let get = |f: &dyn Fn(&HoldersSample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
        let last = samples.last().expect("a sample");
        // In the plain case, reads and writes are the draws' roles (both hold alone).
        let (reads, writes) = (1, 2);
        let _ = writeln!(
            w,
            "| {} | {} | {} ms | {} ms | {} ms | {} ms | {} | {} | {} | {} ({}) | {} ({}) | {} |",
            name(*shared),
            stat(&get(&|x| x.rate), f0),
            stat(&get(&|x| x.wait_ms[reads].0), f1),
            stat(&get(&|x| x.wait_ms[reads].1), f1),
            stat(&get(&|x| x.wait_ms[writes].0), f1),
            stat(&get(&|x| x.wait_ms[writes].1), f1),
            stat(&get(&|x| x.most_holders as f64), f0),
            stat(&get(&|x| x.overlaps as f64), f0),
            stat(&get(&|x| x.redis_us), f1),
            stat(&get(&|x| total(&x.commands)), f2),
            by_name(&last.commands),
            stat(&get(&|x| total(&x.lua)), f2),
            by_name(&last.lua),
            stat(&get(&|x| x.errors as f64), f0),
        );
    }
    let of = |shared: bool| {
        runs.iter()
            .find(|(x, _)| *x == shared)
            .map(|(_, samples)| samples.as_slice())
            .unwrap_or_default()
    };
    let ratio = |f: &dyn Fn(&HoldersSample) -> f64| -> Vec<f64> {
        of(true)
            .iter()
            .zip(of(false))
            .map(|(a, b)| f(a) / f(b))
            .collect()
    };
    let _ = writeln!(
        w,
        "\n| ratio (per run, then median) | value |\n|---|---|\n\
         | shared / exclusive, acquisitions/s | {} |\n\
         | shared / exclusive, wait p99 of every acquisition | {} |\n",
        stat(&ratio(&|x| x.rate), f2),
        stat(&ratio(&|x| x.wait_ms[0].1), f2),
    );
}
