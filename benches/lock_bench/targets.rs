//! The report's summary: each target the benchmark was built to check, its measured median
//! and range, and whether it is met.

use std::fmt::Write as _;

use crate::{
    common::{LEASES, Peer},
    contended::HOLD,
    http::Variant,
    report::Results,
    stats::{f0, f1, f2, median, stat, verdict},
};

/// The summary table: each target, measured, met or not.
pub(crate) fn render(w: &mut String, r: &Results) {
    let _ = writeln!(
        w,
        "## Targets\n\n| target | measured (median, min–max) | status |\n|---|---|---|"
    );
    if !r.http.is_empty() {
        let ratio = |num: Variant, den: Variant| -> Vec<f64> {
            r.http
                .iter()
                .filter_map(|run| {
                    let get = |v| run.iter().find(|(x, _)| *x == v).map(|(_, s)| s.rps);
                    Some(get(num)? / get(den)?)
                })
                .collect()
        };
        let base = ratio(Variant::Layer, Variant::Baseline);
        let bb8 = ratio(Variant::Layer, Variant::Bb8Defaults);
        let _ = writeln!(
            w,
            "| overhead: layer ≥ 0.95 × baseline (same 2 commands, one multiplexed connection) | {} | {} |",
            stat(&base, f2),
            verdict(median(&base) >= 0.95)
        );
        let _ = writeln!(
            w,
            "| overhead: layer ≥ 3 × bb8-redis defaults | {} | {} |",
            stat(&bb8, f2),
            verdict(median(&bb8) >= 3.0)
        );
        let cmds: Vec<f64> = r
            .http
            .iter()
            .flat_map(|run| run.iter())
            .filter(|(v, _)| *v == Variant::Layer)
            .filter_map(|(_, s)| s.commands.as_ref().map(|c| c.0))
            .collect();
        let _ = writeln!(
            w,
            "| client commands per request under load (50 connections), well below 2 | {} | {} |",
            stat(&cmds, f2),
            verdict(median(&cmds) < 1.0)
        );
    }
    for (waiters, procs, peer, samples) in &r.contended {
        if *peer != Peer::TowerLock || samples.is_empty() {
            continue;
        }
        let bound = 2.0 * *waiters as f64 * HOLD.as_secs_f64() * 1000.0;
        let waiters = format!(
            "{waiters} waiters in {procs} process{}",
            if *procs == 1 { "" } else { "es" }
        );
        let eff: Vec<f64> = samples.iter().map(|x| x.rate / x.ideal * 100.0).collect();
        let dev: Vec<f64> = samples.iter().map(|x| x.max_dev_pct).collect();
        let p99: Vec<f64> = samples.iter().map(|x| x.p99_ms).collect();
        let cmds: Vec<f64> = samples.iter().map(|x| x.commands).collect();
        // The same rate against the back-to-back round trip of the same run.
        let eff_tight: Vec<f64> = samples
            .iter()
            .zip(&r.tight_rtt_us)
            .map(|(x, rtt)| x.rate * (x.mean_hold_us + rtt) / 1e6 * 100.0)
            .collect();
        let _ = writeln!(
            w,
            "| hand-off, {waiters}: ≥ 95% of the ideal 1/(hold + RTT), RTT after a {} ms spin (see c.) | {} % (against the back-to-back RTT: {} %) | {} |",
            HOLD.as_millis(),
            stat(&eff, f1),
            stat(&eff_tight, f1),
            verdict(median(&eff) >= 95.0)
        );
        let _ = writeln!(
            w,
            "| hand-off, {waiters}: every waiter within ±25% of the mean | max deviation {} % | {} |",
            stat(&dev, f1),
            verdict(median(&dev) <= 25.0)
        );
        let _ = writeln!(
            w,
            "| hand-off, {waiters}: p99 wait ≤ 2 × waiters × hold = {bound:.0} ms | {} ms | {} |",
            stat(&p99, f1),
            verdict(median(&p99) <= bound)
        );
        let _ = writeln!(
            w,
            "| hand-off, {waiters}: ≤ 3 client commands per acquisition | {} | {} |",
            stat(&cmds, f2),
            verdict(median(&cmds) <= 3.0)
        );
    }
    if !r.renewal.is_empty() {
        let per: Vec<f64> = r.renewal.iter().map(|x| x.leases_per_command).collect();
        let lost: Vec<f64> = r.renewal.iter().map(|x| x.lost as f64).collect();
        let _ = writeln!(
            w,
            "| renewal: {LEASES} leases, none lost | lost {} | {} |",
            stat(&lost, f0),
            verdict(lost.iter().all(|l| *l == 0.0))
        );
        let _ = writeln!(
            w,
            "| renewal: ≥ 100 leases per round trip | {} leases per command | {} |",
            stat(&per, f2),
            verdict(median(&per) >= 100.0)
        );
    }
    crate::group::render_targets(w, &r.group);
    if !r.memory.is_empty() {
        let per: Vec<f64> = r.memory.iter().map(|x| x.per_lease).collect();
        let _ = writeln!(
            w,
            "| memory: heap per in-flight lease ≤ 2 KiB | {} B per `LeaseGuard` | {} |",
            stat(&per, f0),
            verdict(median(&per) <= 2048.0)
        );
        let tasks: Vec<f64> = r
            .memory
            .iter()
            .map(|x| x.tasks_after - x.tasks_before)
            .collect();
        let rss: Vec<f64> = r
            .memory
            .iter()
            .map(|x| x.rss_after - x.rss_before)
            .collect();
        let _ = writeln!(
            w,
            "| memory: RSS and tasks flat over many requests | RSS {}, tasks {:+} | see e. |",
            stat(&rss, |x| format!("{:+.1} MiB", x / (1024.0 * 1024.0))),
            median(&tasks)
        );
    }
    if !r.cycles.is_empty() {
        let ratio: Vec<f64> = r
            .cycles
            .iter()
            .filter_map(|run| {
                let get = |p| run.iter().find(|(x, _)| *x == p).map(|(_, s)| s.rate);
                Some(get(Peer::TowerLock)? / get(Peer::Rslock)?)
            })
            .collect();
        let _ = writeln!(
            w,
            "| peers: uncontended cycles, tower-lock / rslock | {} | (reported) |",
            stat(&ratio, f2)
        );
    }
    crate::counts::render_targets(w, &r.counts);
    let _ = writeln!(w);
}
