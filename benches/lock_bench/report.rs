//! The report, `docs/BENCHMARKS.md`: how it was run, the machine and versions, the summary
//! against the targets (`targets`), how commands are counted, one section per scenario, and
//! what is not covered. The sections of the report it replaces that are written by hand
//! (`## Topologies`, `## Counts across commits`, `## Designs compared`) are kept; a run of some
//! scenarios only (`BENCH_ONLY`) replaces their sections in it and keeps the rest.

use std::{fmt::Write as _, time::Duration};

use tower_lock::LeaseGuard;

use crate::{
    Settings,
    common::{LEASES, Peer},
    contended::{ContendedSample, HOLD},
    cycles::{CYCLE_TASKS, CycleSample},
    http::{HttpSample, VARIANTS, Variant, WRK},
    machine::{command_line, cpu_model, git_revision, locked_versions, memory_total},
    memory::MemorySample,
    renewal::{RENEWAL_TTL, RenewalSample},
    sets::{self, SetSample},
    stats::{f0, f1, f2, kib, mib, stat},
    targets,
};

/// Every sample of every scenario run.
#[derive(Default)]
pub(crate) struct Results {
    pub(crate) http: Vec<Vec<(Variant, HttpSample)>>,
    pub(crate) cycles: Vec<Vec<(Peer, CycleSample)>>,
    /// Round trips sent right after a `HOLD` spin (the ideal's), and back to back.
    pub(crate) rtt_us: Vec<f64>,
    pub(crate) tight_rtt_us: Vec<f64>,
    /// (waiters, processes, implementation, one sample per run)
    pub(crate) contended: Vec<(usize, usize, Peer, Vec<ContendedSample>)>,
    pub(crate) renewal: Vec<RenewalSample>,
    pub(crate) memory: Vec<MemorySample>,
    pub(crate) group: crate::group::GroupResults,
    pub(crate) sets: Vec<Vec<(sets::Variant, SetSample)>>,
    pub(crate) counts: Vec<Vec<(crate::counts::Case, crate::counts::CountSample)>>,
    pub(crate) permits: crate::permits::PermitRuns,
    pub(crate) shared: crate::shared::SharedRuns,
    pub(crate) readers: crate::readers::ReadersRuns,
}

pub(crate) struct Meta {
    pub(crate) date: String,
    pub(crate) wrk_version: String,
    pub(crate) redis_version: String,
    pub(crate) load_start: String,
    pub(crate) load_end: String,
    pub(crate) elapsed: Duration,
}

fn render(s: &Settings, meta: &Meta, r: &Results) -> String {
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "# Benchmarks\n");
    if let Some(note) = &s.note {
        let _ = writeln!(w, "> **Note:** {note}\n");
    }
    if s.quick {
        let _ = writeln!(
            w,
            "> **Quick smoke run** (`BENCH_QUICK=1`): shortened durations ({} s per wrk run, {} s \
             contended, {} requests for memory flatness). It shows that the benchmark works end to \
             end, not what the crate can do; rerun without `BENCH_QUICK` on a quiet machine for the \
             numbers to compare.\n",
            s.http_s,
            s.contended.as_secs(),
            s.memory_requests
        );
    }
    let _ = writeln!(
        w,
        "Written by `benches/lock_bench/` on {}, in {:.0} s. Each figure is the median \
         of {} run(s), with the minimum and maximum across runs in parentheses. The load generator \
         (wrk or the bench's own tasks), the server under test and `redis-server` share the \
         machine, over loopback; `redis-server` runs in a session of its own (`setsid`), as a \
         system service would, so that the kernel's autogroup scheduling gives it a CPU share of \
         its own rather than a part of the benchmark's. The program uses the crate's public API only, so it measures \
         whatever the crate implements at the commit below (hand-off, coalescing and batched \
         renewal included, as they land).\n",
        meta.date,
        meta.elapsed.as_secs_f64(),
        s.runs
    );
    let _ = writeln!(w, "Reproduce with:\n\n```sh\n{}\n```\n", s.command);

    let _ = writeln!(w, "## Machine\n\n| | |\n|---|---|");
    let _ = writeln!(w, "| CPUs (`nproc`) | {} |", command_line("nproc", &[]));
    let _ = writeln!(w, "| CPU model | {} |", cpu_model());
    let _ = writeln!(w, "| memory | {} |", memory_total());
    let _ = writeln!(w, "| kernel | {} |", command_line("uname", &["-sr"]));
    let _ = writeln!(
        w,
        "| load average (1, 5, 15 min) at start / end | {} / {} |\n",
        meta.load_start, meta.load_end
    );

    let _ = writeln!(w, "## Versions\n\n| | |\n|---|---|");
    let _ = writeln!(w, "| rustc | {} |", command_line("rustc", &["--version"]));
    let _ = writeln!(w, "| redis-server | {} |", meta.redis_version);
    let _ = writeln!(w, "| wrk | {} |", meta.wrk_version);
    let _ = writeln!(
        w,
        "| tower-lock | {} (git {}) |",
        env!("CARGO_PKG_VERSION"),
        git_revision()
    );
    for (name, version) in
        locked_versions(&["axum", "redis", "bb8-redis", "rslock", "tokio", "hyper"])
    {
        let _ = writeln!(w, "| {name} | {version} |");
    }
    let _ = writeln!(w);

    targets::render(w, r);
    render_counting(w);
    render_http(w, s, r);
    render_cycles(w, s, r);
    render_contended(w, s, r);
    render_renewal(w, s, r);
    render_memory(w, s, r);
    crate::group::render(w, s, &r.group);
    render_sets(w, s, r);
    crate::counts::render(w, s, &r.counts);
    crate::permits::render(w, s, &r.permits);
    crate::shared::render(w, s, &r.shared);
    crate::readers::render(w, s, &r.readers);

    let _ = writeln!(w, "## Not covered\n");
    let _ = writeln!(
        w,
        "- **More than 2 processes.** The contended scenario runs its waiters in 1 process and \
         split over 2; 3 or more processes, or processes on separate machines, are not \
         measured. Scenarios i and j spread their waiters over instances in one process, each \
         with its own connection.\n\
         - **Round trips.** MONITOR sees commands, not round trips: a pipeline of N commands \
         counts N. \"Leases per command\" in the renewal scenario is therefore a lower bound on \
         leases per round trip.\n\
         - **HTTP for memory.** The in-flight and flatness measurements drive the axum `Router` \
         in process (`tower::ServiceExt::oneshot`), without sockets; the HTTP overhead scenario \
         uses wrk over loopback.\n\
         - **The counting allocator** (needed for heap per lease) counts only in the memory \
         scenario (e); before it, each allocation pays one relaxed load of a flag.\n\
         - **CPU shares.** On this machine the kernel's autogroup scheduling is on: each \
         session gets an equal share of the CPU. `redis-server` runs in its own session; the \
         benchmark, its children and wrk share one. With `redis-server` in the benchmark's \
         session instead (until the 727daa5 run), the locked route measured 37–40k req/s and \
         the fenced baseline of then 50–54k; a probe with the same server and wrk measured 40–41k with \
         Redis in the same session as the server and 44–45k with Redis in its own.\n"
    );
    o
}

fn render_sets(w: &mut String, s: &Settings, r: &Results) {
    if r.sets.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## g. Orders of several keys\n\n\
         `wrk -t{} -c{} -d{}s` after a {} s warm-up, against one app that serves single \
         purchases (`POST /items/<sku>/purchase`, `Key::path_param(\"sku\")`) and orders \
         (`POST /orders`, the SKUs of a JSON body through `Key::json(\"/items/*/sku\")`), both \
         locking SKUs in one namespace through one `Locker` on `RedisStore::connect` with the \
         default config, with trivial handlers: the inventory example's shape. An order of n \
         SKUs holds one lease on n keys. *SKUs of its own*: every request names SKUs no other \
         request names, so nothing waits, and the ratios are what a lease on several keys costs \
         (reading the body included: compare order-1 with purchase). *Drawn from {}*: the SKUs \
         of each request are drawn at random (distinct within a request) from one pool of {}, \
         so requests overlap and wait for each other (the default wait policy, 2 s at most). \
         A fresh app, runtime and port per variant; the variants alternate within each run, so \
         each ratio compares numbers taken seconds apart on the same machine. Redis CPU is \
         `used_cpu_user + used_cpu_sys` from `INFO cpu` before and after the timed wrk run, \
         divided by the requests served (req/s × seconds), as in scenario a. Client commands \
         are counted in a separate 1 s pass, as in scenario a.\n",
        WRK.threads,
        WRK.connections,
        s.http_s,
        s.warmup_s,
        sets::POOL,
        sets::POOL
    );
    let _ = writeln!(
        w,
        "| variant | req/s | errors (non-2xx + socket) | Redis CPU µs per request | client commands per request |\n|---|---|---|---|---|"
    );
    for variant in sets::VARIANTS {
        let samples: Vec<&SetSample> = r
            .sets
            .iter()
            .flat_map(|run| run.iter())
            .filter(|(v, _)| *v == variant)
            .map(|(_, s)| s)
            .collect();
        let rps: Vec<f64> = samples.iter().map(|x| x.rps).collect();
        let errors: Vec<f64> = samples.iter().map(|x| x.errors as f64).collect();
        let cpu: Vec<f64> = samples.iter().map(|x| x.redis_us).collect();
        let cmds: Vec<f64> = samples.iter().map(|x| x.commands.0).collect();
        let breakdown = samples
            .last()
            .map(|x| format!(" ({})", x.commands.1))
            .unwrap_or_default();
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {}{breakdown} |",
            variant.describe(),
            stat(&rps, f0),
            stat(&errors, f0),
            stat(&cpu, f1),
            stat(&cmds, f2),
        );
    }
    let pair = |skus, pooled| sets::Variant { skus, pooled };
    let ratios = [
        (pair(1, false), pair(0, false)),
        (pair(2, false), pair(0, false)),
        (pair(3, false), pair(0, false)),
        (pair(2, false), pair(1, false)),
        (pair(3, false), pair(1, false)),
        (pair(2, true), pair(0, true)),
        (pair(3, true), pair(0, true)),
    ];
    let _ = writeln!(
        w,
        "\n| ratio of req/s (per run, then the median, with the range over runs) | value |\n|---|---|"
    );
    for (num, den) in ratios {
        let values: Vec<f64> = r
            .sets
            .iter()
            .filter_map(|run| {
                let get = |v| run.iter().find(|(x, _)| *x == v).map(|(_, s)| s.rps);
                Some(get(num)? / get(den)?)
            })
            .collect();
        let _ = writeln!(
            w,
            "| {} / {} | {} |",
            num.short(),
            den.short(),
            stat(&values, f2)
        );
    }
    let _ = writeln!(
        w,
        "\nAn order is one `acquire_set.lua` and one `release_set.lua` whatever its size (checked \
         with `MONITOR` before the runs: an order of 3 SKUs sends 2 client commands); the scripts \
         do a key's work per SKU in Redis, and the layer reads and parses the body.\n"
    );
}

fn render_counting(w: &mut String) {
    let _ = writeln!(
        w,
        "## How Redis commands are counted\n\n\
         `INFO commandstats` cannot tell a client's commands from a script's: Redis 7 counts the \
         `SET`, `GET`, `DEL`, `TIME`, `PTTL` that a Lua script runs under their own names, next to \
         the same commands sent by clients. So the benchmark opens a `MONITOR` connection and \
         counts every line whose source is a client (`[0 127.0.0.1:port]`), not a script \
         (`[0 lua]`), until it sees a marker (`ECHO <unique>`) that it sends itself once the \
         measured operations are done. That counts every command any client sends, pub/sub \
         (`SUBSCRIBE`, `PUBLISH`) and `SCRIPT LOAD` included, and nothing a script runs. MONITOR \
         costs Redis some CPU per command, so for the high-rate scenarios (HTTP, uncontended \
         cycles) the commands are counted in a separate pass right after the timed one (a 1 s \
         wrk run; 2,000 cycles; a 2 s contended pass), and for the renewal scenario during the timed \
         window itself. Commands per operation = commands counted ÷ operations in the same \
         window; for HTTP, requests are counted as they reach the server (before the lock), and \
         the count waits 300 ms after wrk stops for the releases of cut-off requests.\n"
    );
}

fn render_http(w: &mut String, s: &Settings, r: &Results) {
    if r.http.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## a. HTTP overhead\n\n\
         `wrk -t{} -c{} -d{}s` after a {} s warm-up, `POST \
         /items/<key>/purchase` with a distinct key per request (a wrk Lua script numbers the \
         paths). Each variant is served in process by axum on a fresh multi-thread tokio runtime \
         with 2 workers, on a free loopback port, and torn down before the next; the variants \
         alternate within each run, so every ratio below compares numbers taken minutes apart \
         at most. Redis CPU is `used_cpu_user + used_cpu_sys` from `INFO cpu` before and after \
         the timed wrk run, divided by the requests served (req/s × seconds); for the hello \
         world it is what an idle `redis-server` spends over that time.\n",
        WRK.threads, WRK.connections, s.http_s, s.warmup_s
    );
    let _ = writeln!(
        w,
        "| variant | req/s | errors (non-2xx + socket) | Redis CPU µs per request | client commands per request |\n|---|---|---|---|---|"
    );
    for variant in VARIANTS {
        let samples: Vec<&HttpSample> = r
            .http
            .iter()
            .flat_map(|run| run.iter())
            .filter(|(v, _)| *v == variant)
            .map(|(_, s)| s)
            .collect();
        let rps: Vec<f64> = samples.iter().map(|x| x.rps).collect();
        let errors: u64 = samples.iter().map(|x| x.errors).sum();
        let cpu: Vec<f64> = samples.iter().map(|x| x.redis_us).collect();
        let cmds: Vec<f64> = samples
            .iter()
            .filter_map(|x| x.commands.as_ref().map(|c| c.0))
            .collect();
        let breakdown = samples
            .last()
            .and_then(|x| x.commands.as_ref())
            .map(|c| format!(" ({})", c.1))
            .unwrap_or_default();
        let _ = writeln!(
            w,
            "| {} | {} | {errors} | {} | {}{breakdown} |",
            variant.describe(),
            stat(&rps, f0),
            stat(&cpu, f1),
            if cmds.is_empty() {
                "–".to_owned()
            } else {
                stat(&cmds, f2)
            }
        );
    }
    let ratios = [
        (Variant::Layer, Variant::Baseline, "≥ 0.95"),
        (Variant::Layer, Variant::BaselineScripts, ""),
        (Variant::BaselineScripts, Variant::Baseline, ""),
        (Variant::Layer, Variant::Bb8Defaults, "≥ 3"),
        (Variant::Baseline, Variant::Bb8Defaults, ""),
        (Variant::Layer, Variant::Hello, ""),
    ];
    let _ = writeln!(
        w,
        "\n| ratio (per run, then median) | value | target |\n|---|---|---|"
    );
    for (num, den, target) in ratios {
        let ratio = |f: fn(&HttpSample) -> f64| -> Vec<f64> {
            r.http
                .iter()
                .filter_map(|run| {
                    let get = |v| run.iter().find(|(x, _)| *x == v).map(|(_, s)| f(s));
                    Some(get(num)? / get(den)?)
                })
                .collect()
        };
        let _ = writeln!(
            w,
            "| {} / {} | {} | {} |",
            num.short(),
            den.short(),
            stat(&ratio(|x| x.rps), f2),
            if target.is_empty() { "–" } else { target }
        );
        // The hello world's Redis serves no request: a ratio to it would mean nothing.
        if den != Variant::Hello {
            let _ = writeln!(
                w,
                "| {} / {}, Redis CPU per request | {} | – |",
                num.short(),
                den.short(),
                stat(&ratio(|x| x.redis_us), f2),
            );
        }
    }
    let _ = writeln!(
        w,
        "\nThe layer's acquire is an `EVALSHA` that also hands out the fencing token (`SET NX \
         PX`, then `TIME`, `GET` and `SET` of the key's slot's fencing counter) and checks the \
         hand-off queue \
         (`LLEN`); its release checks the queue too. Both are heavier for Redis than the \
         baseline's plain `SET NX PX` and compare-and-delete. `baseline-scripts` sends the \
         crate's own two scripts by hand, with the same keys and arguments, so layer / \
         baseline-scripts is the cost of the middleware alone, and baseline-scripts / baseline \
         the cost of what the scripts do in Redis.\n"
    );
}

fn render_cycles(w: &mut String, s: &Settings, r: &Results) {
    if r.cycles.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## b. Uncontended lock cycles\n\n\
         {CYCLE_TASKS} tasks on one multiplexed connection (one `RedisStore::connect` behind one \
         `Locker`; one `rslock::LockManager` shared by clones), each looping acquire + release on \
         a key of its own for {} s, no HTTP. tower-lock: `Locker::acquire` (which also starts the \
         lease's renewal task) then `LeaseGuard::release`; rslock: `lock` then `unlock`. TTL \
         10 s. Redis CPU is `used_cpu_user + used_cpu_sys` from `INFO cpu` before and after the \
         timed loop, divided by the cycles done. Commands per cycle from a separate pass of {} \
         cycles.\n",
        s.cycles.as_secs(),
        s.cycle_count_ops
    );
    let _ = writeln!(
        w,
        "| implementation | cycles/s | Redis CPU µs per cycle | client commands per cycle |\n|---|---|---|---|"
    );
    for peer in [Peer::TowerLock, Peer::Rslock] {
        let samples: Vec<&CycleSample> = r
            .cycles
            .iter()
            .flat_map(|run| run.iter())
            .filter(|(p, _)| *p == peer)
            .map(|(_, s)| s)
            .collect();
        let rate: Vec<f64> = samples.iter().map(|x| x.rate).collect();
        let cpu: Vec<f64> = samples.iter().map(|x| x.redis_us).collect();
        let cmds: Vec<f64> = samples.iter().map(|x| x.commands).collect();
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} ({}) |",
            peer.name(),
            stat(&rate, f0),
            stat(&cpu, f1),
            stat(&cmds, f2),
            samples.last().map(|x| x.breakdown.as_str()).unwrap_or("")
        );
    }
    let ratio = |f: fn(&CycleSample) -> f64| -> Vec<f64> {
        r.cycles
            .iter()
            .filter_map(|run| {
                let get = |p| run.iter().find(|(x, _)| *x == p).map(|(_, s)| f(s));
                Some(get(Peer::TowerLock)? / get(Peer::Rslock)?)
            })
            .collect()
    };
    let _ = writeln!(
        w,
        "\n| ratio (per run, then median) | value |\n|---|---|\n\
         | tower-lock / rslock, cycles/s | {} |\n\
         | tower-lock / rslock, Redis CPU per cycle | {} |\n",
        stat(&ratio(|x| x.rate), f2),
        stat(&ratio(|x| x.redis_us), f2),
    );
}

fn render_contended(w: &mut String, s: &Settings, r: &Results) {
    if r.contended.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## c. Contended hand-off\n\n\
         N waiters, each with its own connection (its own `RedisStore::connect` and `Locker`; \
         its own `rslock::LockManager`), loop on one key for {} s: \
         acquire, hold for {} ms as a **busy spin** (exact, and it occupies a runtime worker as \
         real work would), release. tower-lock's stores hand off (`RedisStore::connect`'s \
         default): a waiter queues in Redis and the holder's release hands it the key and tells \
         it on pub/sub; its wait policy, `Wait::exponential(1 ms, 20 ms).unwrap().deadline(30 s)`, only \
         paces checks when no hand-off can be heard; rslock retries with \
         `set_retry(3, {} ms)` (a random delay in 0..{} ms between attempts) inside its \
         `acquire_no_guard` loop. Wait time runs from the call to acquire to its return. The \
         ideal rate is 1 / (mean measured hold + median `EVALSHA` round trip), the round trip \
         measured before each run on one connection, from a task on the runtime's workers like \
         the waiters, each call sent right after a {} ms busy spin, as a holder sends its \
         release: {} µs. That is the round trip a hand-off pays: after the spin, the other CPU \
         (where Redis and the waiters run) has gone idle and must wake. Back to back, with both \
         CPUs kept busy, the same call takes {} µs; against that, every percentage below would \
         be lower. *Time per hand-off* is 1 / rate − mean hold: what each hand-off actually \
         took. Every waiter \
         connects and takes one warm-up lease on a key of its own before the window opens. \
         Redis CPU is `used_cpu_user + used_cpu_sys` from `INFO cpu` when the timed window \
         opens and when it closes, divided by the acquisitions in it. \
         Commands are counted in a separate {} s pass of the same case right after the timed \
         one, with MONITOR running (MONITOR slows Redis and the benchmark's reader down per \
         command, scripts' own commands included, so the timed window runs without it). \
         **1 process**: every \
         waiter is a task in the benchmark's process (one tokio runtime, 2 workers). **2 \
         processes**: the benchmark starts its own binary twice (`--contended-child`), each child \
         runs half the waiters on its own 2-worker runtime, and both start and stop at the same \
         wall-clock instants; they report per-waiter counts and wait-time histograms on stdout.\n",
        s.contended.as_secs(),
        HOLD.as_millis(),
        s.rslock_retry.as_millis(),
        s.rslock_retry.as_millis(),
        HOLD.as_millis(),
        stat(&r.rtt_us, f0),
        stat(&r.tight_rtt_us, f0),
        s.contended_count.as_secs()
    );
    let _ = writeln!(
        w,
        "| waiters | processes | implementation | acquisitions/s | ideal/s | % of ideal | time per hand-off | per-waiter min | per-waiter max | max deviation from mean | wait p50 | wait p99 | Redis CPU µs per acquisition | client commands per acquisition | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (waiters, procs, peer, samples) in &r.contended {
        let get =
            |f: &dyn Fn(&ContendedSample) -> f64| -> Vec<f64> { samples.iter().map(f).collect() };
        let _ = writeln!(
            w,
            "| {waiters} | {procs} | {} | {} | {} | {} % | {} µs | {} | {} | {} % | {} ms | {} ms | {} | {} ({}) | {} |",
            peer.name(),
            stat(&get(&|x| x.rate), f0),
            stat(&get(&|x| x.ideal), f0),
            stat(&get(&|x| x.rate / x.ideal * 100.0), f1),
            stat(&get(&|x| 1e6 / x.rate.max(1e-9) - x.mean_hold_us), f0),
            stat(&get(&|x| x.per_min as f64), f0),
            stat(&get(&|x| x.per_max as f64), f0),
            stat(&get(&|x| x.max_dev_pct), f1),
            stat(&get(&|x| x.p50_ms), f1),
            stat(&get(&|x| x.p99_ms), f1),
            stat(&get(&|x| x.redis_us), f1),
            stat(&get(&|x| x.commands), f2),
            samples.last().map(|x| x.breakdown.as_str()).unwrap_or(""),
            samples.iter().map(|x| x.errors).sum::<u64>()
        );
    }
    let holds: Vec<f64> = r
        .contended
        .iter()
        .flat_map(|(_, _, _, s)| s.iter().map(|x| x.mean_hold_us))
        .collect();
    let _ = writeln!(
        w,
        "\nMeasured mean hold over all cases: {} µs.\n",
        stat(&holds, f0)
    );
}

fn render_renewal(w: &mut String, s: &Settings, r: &Results) {
    if r.renewal.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## d. Renewal at scale\n\n\
         One process takes {LEASES} leases with `Locker::acquire` (TTL {} s, so each is renewed \
         every {} s by its own background task; 256 acquisitions in flight at a time, one \
         `RedisStore::connect`, after one warm-up lease held until its first renewal), then \
         holds them all for {:.1} s while `INFO cpu` measures Redis's CPU (`used_cpu_user + \
         used_cpu_sys` before and after, divided by the leases renewed in between), then for as \
         long again while MONITOR counts the client commands, then releases them. A lease counts as lost if its `Lease::is_lost()` is set \
         at the end of the window or its release finds it no longer held. Leases per command = \
         successful renewals in the window (`Lease::renewals()` deltas) ÷ client commands in the \
         window.\n",
        RENEWAL_TTL.as_secs(),
        RENEWAL_TTL.as_secs_f64() / 3.0,
        s.renewal_hold.as_secs_f64()
    );
    let get = |f: &dyn Fn(&RenewalSample) -> f64| -> Vec<f64> { r.renewal.iter().map(f).collect() };
    let _ = writeln!(w, "| measure | value |\n|---|---|");
    let _ = writeln!(
        w,
        "| time to acquire {LEASES} leases | {} s |",
        stat(&get(&|x| x.acquire_s), f2)
    );
    let _ = writeln!(w, "| window | {} s |", stat(&get(&|x| x.window_s), f2));
    let _ = writeln!(
        w,
        "| leases lost | {} |",
        stat(&get(&|x| x.lost as f64), f0)
    );
    let _ = writeln!(
        w,
        "| release errors | {} |",
        stat(&get(&|x| x.release_errors as f64), f0)
    );
    let _ = writeln!(
        w,
        "| renewal commands/s (client-issued) | {} ({}) |",
        stat(&get(&|x| x.commands_per_s), f0),
        r.renewal.last().map(|x| x.breakdown.as_str()).unwrap_or("")
    );
    let _ = writeln!(
        w,
        "| renewals/s | {} |",
        stat(&get(&|x| x.renewals_per_s), f0)
    );
    let _ = writeln!(
        w,
        "| leases renewed per command | {} |",
        stat(&get(&|x| x.leases_per_command), f2)
    );
    let _ = writeln!(
        w,
        "| Redis CPU per lease renewed | {} µs |\n",
        stat(&get(&|x| x.redis_us), f2)
    );
}

fn render_memory(w: &mut String, s: &Settings, r: &Results) {
    if r.memory.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## e. Memory\n\n\
         Heap bytes come from a counting `#[global_allocator]` in the benchmark (it wraps \
         `System` and keeps the bytes currently allocated; it counts only from the start of this \
         scenario, so that its shared counter does not slow the timed scenarios down). **Per lease**: {LEASES} \
         `LeaseGuard`s taken one after the other with `Locker::acquire` (default config) and held; \
         (heap after − heap before) ÷ {LEASES}, measured 300 ms after the last acquisition (the \
         vector holding the guards is allocated beforehand and not counted; a `LeaseGuard` is \
         itself {} bytes inline). **Per in-flight request**: {LEASES} requests parked in their \
         handler at once, through the axum `Router` in process, with and without the layer. \
         **Flatness**: RSS (`/proc/self/statm`), tokio's alive tasks and heap, 300 ms after a \
         warm-up of 2,000 requests and again 300 ms after {} more requests through the layer (64 \
         in flight, distinct keys){}.\n",
        std::mem::size_of::<LeaseGuard>(),
        s.memory_requests,
        if s.full {
            ""
        } else {
            "; `BENCH_FULL=1` sends 1,000,000"
        }
    );
    let get = |f: &dyn Fn(&MemorySample) -> f64| -> Vec<f64> { r.memory.iter().map(f).collect() };
    let _ = writeln!(w, "| measure | value |\n|---|---|");
    let _ = writeln!(
        w,
        "| heap per held `LeaseGuard` (target ≤ 2048 B) | {} B |",
        stat(&get(&|x| x.per_lease), f0)
    );
    let _ = writeln!(
        w,
        "| heap per lease left after releasing them all | {} B |",
        stat(&get(&|x| x.per_lease_after_release), f0)
    );
    let _ = writeln!(
        w,
        "| heap growth per lease over a second round of {LEASES} acquire + release | {} B |",
        stat(&get(&|x| x.per_lease_growth), f0)
    );
    let _ = writeln!(
        w,
        "| heap per in-flight request, no layer | {} B |",
        stat(&get(&|x| x.per_request_plain), f0)
    );
    let _ = writeln!(
        w,
        "| heap per in-flight request, with the layer | {} B |",
        stat(&get(&|x| x.per_request_layer), f0)
    );
    let _ = writeln!(
        w,
        "| the layer's share per in-flight request | {} B |",
        stat(&get(&|x| x.per_request_layer - x.per_request_plain), f0)
    );
    let _ = writeln!(
        w,
        "| RSS before → after {} requests | {} → {} |",
        s.memory_requests,
        stat(&get(&|x| x.rss_before), mib),
        stat(&get(&|x| x.rss_after), mib)
    );
    let _ = writeln!(
        w,
        "| heap before → after | {} → {} |",
        stat(&get(&|x| x.heap_before), kib),
        stat(&get(&|x| x.heap_after), kib)
    );
    let _ = writeln!(
        w,
        "| tokio alive tasks before → after | {} → {} |",
        stat(&get(&|x| x.tasks_before), f0),
        stat(&get(&|x| x.tasks_after), f0)
    );
    let _ = writeln!(
        w,
        "| failed requests | {} |\n",
        stat(&get(&|x| x.failed as f64), f0)
    );
}

/// Renders the report, keeps the sections of the report it replaces that are written by hand
/// (`## Topologies`, `## Counts across commits`, `## Designs compared`), writes it to
/// `s.output` and prints it.
pub(crate) fn write(s: &Settings, meta: &Meta, results: &Results) {
    let existing = std::fs::read_to_string(&s.output).unwrap_or_default();
    let partial = SCENARIOS.chars().any(|c| !s.wants(c));
    let report = if partial && !existing.is_empty() {
        splice(&existing, &render(s, meta, results), s, meta)
    } else {
        let mut report = render(s, meta, results);
        if let Some(section) = hand_written_sections(&existing) {
            report.push('\n');
            report.push_str(&section);
        }
        report
    };
    if let Some(dir) = s.output.parent() {
        std::fs::create_dir_all(dir).expect("create the report's directory");
    }
    std::fs::write(&s.output, &report).expect("write the report");
    println!("{report}");
}

/// Every scenario's letter.
const SCENARIOS: &str = "abcdefghijk";

/// A report's `## ` sections, in order, each with its heading line; what comes before the first
/// heading is a section with an empty heading.
fn sections(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![(String::new(), String::new())];
    for line in text.split_inclusive('\n') {
        if line.starts_with("## ") {
            out.push((line.trim_end().to_owned(), String::new()));
        }
        out.last_mut()
            .expect("one section at least")
            .1
            .push_str(line);
    }
    out
}

/// The scenario letter of a section heading (`## g. Orders of several keys`: `g`).
fn scenario_of(heading: &str) -> Option<char> {
    let rest = heading.strip_prefix("## ")?;
    let mut chars = rest.chars();
    let letter = chars.next()?;
    (SCENARIOS.contains(letter) && chars.next() == Some('.')).then_some(letter)
}

/// A run of some scenarios only: `existing` with the sections of the scenarios that ran
/// replaced by their sections from `fresh` (or added before "Not covered"), each saying when
/// and how it was measured; everything else as it was.
fn splice(existing: &str, fresh: &str, s: &Settings, meta: &Meta) -> String {
    let mut kept = sections(existing);
    for (heading, body) in sections(fresh) {
        let Some(letter) = scenario_of(&heading) else {
            continue;
        };
        let (first, rest) = body.split_once('\n').unwrap_or((&body, ""));
        let body = format!(
            "{first}\n\n> Measured on {}, at {}, in a run of this scenario alone (`{}`), in {:.0} \
             s; load average (1, 5, 15 min) {} at the start, {} at the end. The rest of this \
             report comes from the run its top describes.\n{rest}",
            meta.date,
            git_revision(),
            s.command,
            meta.elapsed.as_secs_f64(),
            meta.load_start,
            meta.load_end,
        );
        match kept
            .iter()
            .position(|(h, _)| scenario_of(h) == Some(letter))
        {
            Some(i) => kept[i].1 = body,
            None => {
                let at = kept
                    .iter()
                    .position(|(h, _)| h == "## Not covered")
                    .unwrap_or(kept.len());
                kept.insert(at, (heading, body));
            }
        }
    }
    kept.into_iter().map(|(_, body)| body).collect()
}

/// The sections of a report written by hand, which a full run keeps from the report it
/// replaces, after its own.
const HAND_WRITTEN: [&str; 3] = [
    "## Topologies",
    "## Counts across commits",
    "## Designs compared",
];

/// The hand-written sections ([`HAND_WRITTEN`]) of an existing report, verbatim, each up to
/// the next `## ` heading.
fn hand_written_sections(existing: &str) -> Option<String> {
    let out: String = sections(existing)
        .into_iter()
        .filter(|(heading, _)| HAND_WRITTEN.contains(&heading.as_str()))
        .map(|(_, body)| body)
        .collect::<Vec<_>>()
        .join("\n");
    (!out.is_empty()).then_some(out)
}
