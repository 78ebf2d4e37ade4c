//! The project's benchmark: HTTP overhead, uncontended lock cycles, contended hand-off,
//! renewal at scale, memory and group commit, each next to a hand-written baseline or the
//! `rslock` peer; orders of several keys against single purchases; counts per request that
//! do not depend on the machine's load (instructions, allocations, system calls, Redis
//! commands); and leases with counts: permits against a hand-written sorted-set semaphore,
//! shared leases against the exclusive lease, and what a reader costs beside thousands.
//!
//! `cargo bench -p tower-lock-suite --bench lock_bench` (or `scripts/bench.sh`, which installs `wrk` and
//! `redis-server` first) starts its own `redis-server` on a free loopback port, runs every
//! scenario `BENCH_RUNS` times (default 3) and writes `docs/BENCHMARKS.md`. It only uses the
//! crate's public API, so it keeps measuring the same things as the implementation changes; its
//! "same scripts" baseline sends the crate's own scripts (`RedisStore::lua_scripts()`), checked
//! against what the layer sends before scenario a runs (`protocol`).
//!
//! | file | what |
//! |---|---|
//! | `main.rs` | settings, the order of the scenarios |
//! | `http.rs` | a. HTTP overhead (wrk): the layer against hand-written baselines |
//! | `cycles.rs` | b. uncontended lock cycles, against rslock |
//! | `contended.rs` | c. contended hand-off, in one process and over child processes |
//! | `renewal.rs` | d. renewal of 10,000 leases |
//! | `memory.rs`, `alloc.rs` | e. memory, with a counting global allocator |
//! | `group.rs` | f. group commit: 1, 50 and 256 connections, latency, Redis CPU, `WAIT` |
//! | `sets.rs` | g. orders of 1, 2 and 3 keys against single purchases (wrk) |
//! | `permits.rs` | i. a key with N permits against a hand-written sorted-set semaphore |
//! | `shared.rs` | j. shared leases with 90 % readers against the plain exclusive lease |
//! | `readers.rs` | k. one more reader beside 3, 1,000 and 5,000 readers, and releasing them all with a writer queued |
//! | `holders.rs` | what i and j share: instances of waiters on one key, the sorted-set semaphore, fairness and commands per acquisition |
//! | `counts.rs`, `count_child.rs`, `callgrind.rs` | h. counts per request and per cycle: callgrind, the counting allocator, `strace -c`, `MONITOR` and `INFO commandstats`, over a program of its own on a current-thread runtime |
//! | `protocol.rs` | the crate's scripts as the "same scripts" baseline sends them, and the drift check |
//! | `report.rs`, `targets.rs`, `stats.rs`, `machine.rs` | the Markdown report |
//! | `common.rs` | what several scenarios share |
//!
//! The processes (`redis-server`, in a session of its own; wrk; the child processes; the
//! MONITOR command counter) come from the test kit, `tower_lock_testkit`, shared with the
//! tests.
//!
//! | variable | meaning |
//! |---|---|
//! | `BENCH_RUNS` | runs per scenario (default 3) |
//! | `BENCH_QUICK=1` | shortened durations, for a smoke run |
//! | `BENCH_FULL=1` | the memory flatness run sends 1M requests instead of 100k |
//! | `BENCH_ONLY` | scenario letters to run, e.g. `ac` (default: all of `abcdefghijk`), or scenario names, comma-separated: `permits` (i), `shared` (j), `readers` (k), `counts` (h); the report keeps the sections of the others from the report it replaces |
//! | `BENCH_NOTE` | a note printed at the top of the report (e.g. "machine was busy") |
//! | `BENCH_OUTPUT` | report path (default `docs/BENCHMARKS.md`) |
//! | `BENCH_VARIANTS` | HTTP variants (scenario a) or counted cases (h: `hello`, `baseline`, `baseline-scripts`, `layer`, `locker`, `rslock`, `locker-16`, `rslock-16`) to run, e.g. `layer,baseline` (for profiling; the report needs all) |
//! | `BENCH_HTTP_S` | seconds each HTTP variant is measured (default 5, quick 2) |
//! | `BENCH_RSLOCK_RETRY_MS` | rslock's retry delay in the contended scenario (default 20) |
//! | `BENCH_ZSET_RETRY_MS` | the sorted-set semaphore's sleep between attempts when full, scenario i (default 2) |
//!
//! Only 127.0.0.1 is contacted; every process started here is stopped before it exits.

mod alloc;
mod callgrind;
mod common;
mod contended;
mod count_child;
mod counts;
mod cycles;
mod group;
mod holders;
mod http;
mod machine;
mod memory;
mod permits;
mod protocol;
mod readers;
mod renewal;
mod report;
mod sets;
mod shared;
mod stats;
mod targets;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use tower_lock_testkit::{RedisServer, process::require_tool};

use crate::{
    common::{flushall, runtime},
    machine::{command_line, load_average},
    report::{Meta, Results},
};

/// The run's settings, from the `BENCH_*` variables above.
pub(crate) struct Settings {
    pub(crate) runs: usize,
    pub(crate) quick: bool,
    pub(crate) full: bool,
    pub(crate) only: String,
    /// `BENCH_VARIANTS`: the HTTP variants to run (short names, comma-separated), for profiling.
    pub(crate) variants: Option<Vec<String>>,
    pub(crate) warmup_s: u64,
    pub(crate) http_s: u64,
    pub(crate) count_s: u64,
    pub(crate) cycles: Duration,
    pub(crate) cycle_count_ops: u64,
    pub(crate) contended: Duration,
    pub(crate) contended_count: Duration,
    pub(crate) renewal_hold: Duration,
    pub(crate) memory_requests: usize,
    pub(crate) rslock_retry: Duration,
    /// Scenarios i and j: how long each case is timed, and counted.
    pub(crate) holders_window: Duration,
    pub(crate) holders_count_window: Duration,
    pub(crate) zset_retry: Duration,
    pub(crate) note: Option<String>,
    pub(crate) output: PathBuf,
    pub(crate) command: String,
}

fn env_flag(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref(),
        Ok("1" | "true" | "yes" | "on")
    )
}

fn env_num(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        _ => default,
    }
}

impl Settings {
    fn from_env() -> Self {
        let quick = env_flag("BENCH_QUICK");
        let full = env_flag("BENCH_FULL");
        let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let output = std::env::var("BENCH_OUTPUT")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root.join("docs/BENCHMARKS.md"));
        let mut vars: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| {
                k.starts_with("BENCH_") && !matches!(k.as_str(), "BENCH_COMMAND" | "BENCH_NOTE")
            })
            .collect();
        vars.sort();
        let mut command: String = vars.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        command.push_str(
            &std::env::var("BENCH_COMMAND").unwrap_or_else(|_| {
                "cargo bench -p tower-lock-suite --bench lock_bench".to_owned()
            }),
        );
        Self {
            runs: env_num("BENCH_RUNS", 3).max(1) as usize,
            quick,
            full,
            only: scenario_letters(
                &std::env::var("BENCH_ONLY").unwrap_or_else(|_| "abcdefghijk".to_owned()),
            ),
            variants: std::env::var("BENCH_VARIANTS")
                .ok()
                .filter(|v| !v.trim().is_empty())
                .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect()),
            warmup_s: 1,
            http_s: env_num("BENCH_HTTP_S", if quick { 2 } else { 5 }),
            count_s: 1,
            cycles: Duration::from_secs(if quick { 2 } else { 5 }),
            cycle_count_ops: 2_000,
            contended: Duration::from_secs(if quick { 2 } else { 5 }),
            contended_count: Duration::from_secs(2),
            renewal_hold: Duration::from_millis(if quick { 3_500 } else { 5_000 }),
            memory_requests: if full {
                1_000_000
            } else if quick {
                20_000
            } else {
                100_000
            },
            rslock_retry: Duration::from_millis(env_num("BENCH_RSLOCK_RETRY_MS", 20).max(1)),
            holders_window: Duration::from_secs(if quick { 2 } else { 4 }),
            holders_count_window: Duration::from_secs(2),
            zset_retry: Duration::from_millis(env_num("BENCH_ZSET_RETRY_MS", 2).max(1)),
            note: std::env::var("BENCH_NOTE")
                .ok()
                .filter(|n| !n.trim().is_empty()),
            output,
            command,
        }
    }

    pub(crate) fn wants(&self, scenario: char) -> bool {
        self.only.contains(scenario)
    }

    pub(crate) fn wants_variant(&self, short: &str) -> bool {
        self.variants
            .as_ref()
            .is_none_or(|v| v.iter().any(|name| name == short))
    }
}

/// `BENCH_ONLY`'s scenarios as letters: names (`permits`, `shared`, `counts`) become theirs,
/// anything else is taken as letters.
fn scenario_letters(only: &str) -> String {
    only.to_ascii_lowercase()
        .split(',')
        .map(|word| match word.trim() {
            "counts" => "h",
            "permits" => "i",
            "shared" => "j",
            "readers" => "k",
            letters => letters,
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--contended-child") {
        contended::child_main(&args[i + 1..]);
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--count-child") {
        count_child::child_main(&args[i + 1..]);
        return;
    }
    // `cargo test --all-targets` runs bench targets without `--bench`: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "lock_bench: run it with `cargo bench -p tower-lock-suite --bench lock_bench` (or scripts/bench.sh)"
        );
        return;
    }
    let s = Settings::from_env();
    // wrk drives the HTTP scenarios only.
    let wrk_version = if "afg".chars().any(|c| s.wants(c)) {
        require_tool("wrk", &["-v"], "wrk")
    } else {
        "not used".to_owned()
    };
    let redis_version = require_tool("redis-server", &["--version"], "redis-server");
    let load_start = load_average();
    let started = Instant::now();
    let date = command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);

    let redis = RedisServer::options().own_session(true).start();
    eprintln!(
        "lock_bench: redis-server on 127.0.0.1:{}, {} run(s){}",
        redis.port(),
        s.runs,
        if s.quick { ", quick mode" } else { "" }
    );
    let url = redis.url();
    let mut results = Results::default();

    if s.wants('a') {
        results.http = http::run(&redis, &s);
    }
    let rt = runtime();
    if s.wants('b') {
        results.cycles = cycles::run(&rt, &redis, &s);
    }
    if s.wants('c') {
        let runs = contended::run(&rt, &redis, &s);
        results.contended = runs.cases;
        results.rtt_us = runs.rtt_us;
        results.tight_rtt_us = runs.tight_rtt_us;
    }
    if s.wants('d') {
        results.renewal = renewal::run(&rt, &redis, &s);
    }
    if s.wants('e') {
        results.memory = memory::run(&rt, &redis, &s);
    }
    if s.wants('f') {
        results.group = group::run(&redis, &s);
    }
    if s.wants('g') {
        results.sets = sets::run(&redis, &s);
    }
    if s.wants('h') {
        results.counts = counts::run(&rt, &redis, &s);
    }
    if s.wants('i') {
        results.permits = permits::run(&rt, &redis, &s);
    }
    if s.wants('j') {
        results.shared = shared::run(&rt, &redis, &s);
    }
    if s.wants('k') {
        results.readers = readers::run(&rt, &redis, &s);
    }
    rt.block_on(flushall(&url));
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(redis);

    let meta = Meta {
        date,
        wrk_version,
        redis_version,
        load_start,
        load_end: load_average(),
        elapsed: started.elapsed(),
    };
    report::write(&s, &meta, &results);
    eprintln!(
        "lock_bench: wrote {} in {:.0} s",
        s.output.display(),
        meta.elapsed.as_secs_f64()
    );
}
