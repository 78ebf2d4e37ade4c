//! Scenario h, counts per request: what one request through the bare handler, the hand-written
//! locks and the layer, and one `Locker` and one rslock cycle cost, in figures that do not
//! depend on the machine's load: instructions (valgrind's callgrind), heap allocations and
//! their bytes (the counting allocator), system calls (`strace -c -f`), and Redis commands,
//! client-sent and run by Lua (`MONITOR` and `INFO commandstats`).
//!
//! Each case is the program in `count_child.rs`, on a current-thread runtime, run twice per
//! tool: with [`SHORT`] and with [`LONG`] requests (on one keep-alive connection, sent one after
//! the other by this process) or cycles. A figure per operation is the long run's minus the
//! short run's, divided by the difference: start-up, connecting, loading scripts and shutting
//! down cancel out.

use std::{
    fmt::Write as _,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use tokio::runtime::Runtime;
use tower_lock_testkit::{RedisServer, http::Http, monitor::Monitor, process::require_tool};

use crate::{
    Settings,
    callgrind::{self, ByName},
    common::{control, flushall},
    http::Variant,
    machine::{command_line, cpu_model},
    stats::{f0, f1, f2, median, stat, verdict},
};

/// Requests (or cycles) of the short run.
pub(crate) const SHORT: u64 = 512;
/// Requests (or cycles) of the long run.
pub(crate) const LONG: u64 = 1536;
/// Tasks of the concurrent cycle cases.
const TASKS: usize = 16;

/// One thing counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Case {
    /// `POST /items/<key>/purchase` through scenario a's app `variant`.
    Http(Variant),
    /// Acquire + release cycles on keys of their own, in `tasks` tasks.
    Cycles { rslock: bool, tasks: usize },
}

pub(crate) const CASES: [Case; 8] = [
    Case::Http(Variant::Hello),
    Case::Http(Variant::Baseline),
    Case::Http(Variant::BaselineScripts),
    Case::Http(Variant::Layer),
    Case::Cycles {
        rslock: false,
        tasks: 1,
    },
    Case::Cycles {
        rslock: true,
        tasks: 1,
    },
    Case::Cycles {
        rslock: false,
        tasks: TASKS,
    },
    Case::Cycles {
        rslock: true,
        tasks: TASKS,
    },
];

impl Case {
    pub(crate) fn short(self) -> String {
        match self {
            Self::Http(variant) => variant.short().to_owned(),
            Self::Cycles { rslock, tasks } => {
                let name = if rslock { "rslock" } else { "locker" };
                if tasks == 1 {
                    name.to_owned()
                } else {
                    format!("{name}-{tasks}")
                }
            }
        }
    }

    pub(crate) fn from_short(short: &str) -> Option<Self> {
        CASES.into_iter().find(|c| c.short() == short)
    }

    fn title(self) -> String {
        match self {
            Self::Http(Variant::Hello) => "bare handler".to_owned(),
            Self::Http(Variant::Baseline) => "hand-written lock".to_owned(),
            Self::Http(Variant::BaselineScripts) => "the crate's scripts by hand".to_owned(),
            Self::Http(Variant::Layer) => "`LockLayer`".to_owned(),
            Self::Http(Variant::Bb8Defaults) => "bb8".to_owned(),
            Self::Cycles { rslock, tasks } => format!(
                "{}{}",
                if rslock { "rslock" } else { "`Locker`" },
                if tasks == 1 {
                    String::new()
                } else {
                    format!(", {tasks} tasks")
                }
            ),
        }
    }

    fn is_http(self) -> bool {
        matches!(self, Self::Http(_))
    }
}

/// One run of every tool over one case: each figure per request (or cycle).
pub(crate) struct CountSample {
    pub(crate) instructions: f64,
    /// Of which in the runtime's park: waiting for I/O and timers, and handling what woke it.
    pub(crate) parked: f64,
    pub(crate) allocations: f64,
    pub(crate) bytes: f64,
    pub(crate) syscalls: ByName,
    pub(crate) commands: ByName,
    pub(crate) lua: ByName,
    /// Self instructions by crate (see [`callgrind::bucket`]).
    pub(crate) buckets: ByName,
}

fn total(by: &ByName) -> f64 {
    by.values().sum()
}

/// Where the current-thread runtime parks (and polls the drivers without waiting, every so many
/// tasks): what it costs depends on how often it wakes, as for [`WAKE_UPS`].
const PARK: [&str; 2] = [
    "tokio::runtime::scheduler::current_thread::Context::park",
    "tokio::runtime::scheduler::current_thread::Context::park_yield",
];

/// Instructions outside the runtime's park.
fn unparked(x: &CountSample) -> f64 {
    x.instructions - x.parked
}

/// The system calls that wait or wake: `epoll_wait` (the runtime parks, or polls for I/O) and
/// `write` (the runtime's eventfd, written to wake the driver; every other write of these
/// programs is a `writev`). Their number depends on timing: whether a reply has arrived when
/// the runtime looks, whether a new timer is due before the one the driver sleeps for.
const WAKE_UPS: [&str; 2] = ["epoll_wait", "write"];

fn wake_ups(x: &CountSample) -> f64 {
    WAKE_UPS
        .iter()
        .map(|name| x.syscalls.get(*name).copied().unwrap_or(0.0))
        .sum()
}

/// Every other system call: the I/O itself, `getpid`, `getrandom`.
fn other_syscalls(x: &CountSample) -> f64 {
    total(&x.syscalls) - wake_ups(x)
}

/// What one tool's pair of runs of a case measured, before subtracting.
struct Measured {
    allocations: u64,
    bytes: u64,
    instructions: f64,
    parked: f64,
    syscalls: ByName,
    commands: ByName,
    all_calls: ByName,
    self_costs: ByName,
    inclusive: ByName,
}

/// Where the callgrind and strace outputs go (kept, for `callgrind_annotate`).
pub(crate) fn output_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/lock_bench-counts")
}

/// Scenario h, `s.runs` times: every case in turn per run.
pub(crate) fn run(
    rt: &Runtime,
    redis: &RedisServer,
    s: &Settings,
) -> Vec<Vec<(Case, CountSample)>> {
    require_tool("valgrind", &["--version"], "valgrind");
    require_tool("strace", &["-V"], "strace");
    let dir = output_dir();
    std::fs::create_dir_all(&dir).expect("create the counts' directory");
    let mut runs = Vec::new();
    for run in 0..s.runs {
        let mut samples = Vec::new();
        for case in CASES {
            if !s.wants_variant(&case.short()) {
                continue;
            }
            let started = Instant::now();
            let short = measure(rt, redis, case, SHORT, &dir);
            let long = measure(rt, redis, case, LONG, &dir);
            let ops = (LONG - SHORT) as f64;
            let commands = callgrind::per_op(&long.commands, &short.commands, ops);
            let all = callgrind::per_op(&long.all_calls, &short.all_calls, ops);
            let sample = CountSample {
                instructions: (long.instructions - short.instructions) / ops,
                parked: (long.parked - short.parked) / ops,
                allocations: (long.allocations as f64 - short.allocations as f64) / ops,
                bytes: (long.bytes as f64 - short.bytes as f64) / ops,
                syscalls: significant(callgrind::per_op(&long.syscalls, &short.syscalls, ops)),
                lua: significant(lua_calls(&all, &commands)),
                commands: significant(commands),
                buckets: callgrind::per_op(
                    &callgrind::by_bucket(&long.self_costs),
                    &callgrind::by_bucket(&short.self_costs),
                    ops,
                ),
            };
            write_profile(&dir, case, &long, &short, ops);
            eprintln!(
                "h. run {}: {:<16} {:>8.0} instructions ({:.0} outside the park), {:>5.1} allocations, {:>6.0} bytes, {:>5.2} + {:.2} syscalls, {:.2} commands, {:.2} Lua calls per operation ({:.0} s)",
                run + 1,
                case.short(),
                sample.instructions,
                unparked(&sample),
                sample.allocations,
                sample.bytes,
                other_syscalls(&sample),
                wake_ups(&sample),
                total(&sample.commands),
                total(&sample.lua),
                started.elapsed().as_secs_f64()
            );
            samples.push((case, sample));
        }
        runs.push(samples);
    }
    runs
}

/// The functions that cost most per operation, inclusive (with what they called) and self,
/// into `<dir>/<case>.profile.txt`.
fn write_profile(dir: &Path, case: Case, long: &Measured, short: &Measured, ops: f64) {
    let mut out = format!(
        "{}: instructions per operation by function, (run of {LONG} − run of {SHORT}) ÷ {ops}, \
         from callgrind_annotate\n",
        case.title()
    );
    for (what, long, short) in [
        ("inclusive", &long.inclusive, &short.inclusive),
        ("self", &long.self_costs, &short.self_costs),
    ] {
        let mut rows: Vec<(String, f64)> =
            callgrind::per_op(long, short, ops).into_iter().collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        let _ = writeln!(out, "\n{what}:");
        for (function, ir) in rows.iter().filter(|(_, ir)| ir.abs() >= 20.0).take(300) {
            let _ = writeln!(out, "{ir:>9.0}  {function}");
        }
    }
    let file = dir.join(format!("{}.profile.txt", case.short()));
    std::fs::write(&file, out).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
}

/// Commands Lua ran: every call `INFO commandstats` counted, less those clients sent.
pub(crate) fn lua_calls(all: &ByName, client: &ByName) -> ByName {
    all.iter()
        .filter(|(name, _)| !name.contains('|'))
        .map(|(name, n)| {
            let sent = client
                .get(&name.to_ascii_uppercase())
                .copied()
                .unwrap_or(0.0);
            (name.to_ascii_uppercase(), n - sent)
        })
        .collect()
}

/// Leaves out what rounds to nothing per operation.
fn significant(by: ByName) -> ByName {
    by.into_iter().filter(|(_, n)| n.abs() >= 0.005).collect()
}

/// One case with `n` operations, once per tool: as it is (allocations, Redis), under `strace`,
/// under callgrind.
fn measure(rt: &Runtime, redis: &RedisServer, case: Case, n: u64, dir: &Path) -> Measured {
    let url = redis.url();
    let name = format!("{}-{n}", case.short());

    rt.block_on(async {
        flushall(&url).await;
        let mut ctl = control(&url).await;
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut ctl)
            .await
            .expect("CONFIG RESETSTAT");
    });
    let monitor = rt.block_on(Monitor::start(redis.port()));
    let (allocations, bytes) = run_child(rt, &[], case, &url, n, true);
    let (commands, all_calls) = rt.block_on(async {
        let mut ctl = control(&url).await;
        finish_counting(monitor, &mut ctl).await
    });

    rt.block_on(flushall(&url));
    let strace_out = dir.join(format!("{name}.strace"));
    let strace = [
        "strace".to_owned(),
        "-f".to_owned(),
        "-c".to_owned(),
        "-U".to_owned(),
        "name,calls".to_owned(),
        "-o".to_owned(),
        strace_out.display().to_string(),
    ];
    run_child(rt, &strace, case, &url, n, false);
    let syscalls = callgrind::syscalls(&strace_out);

    rt.block_on(flushall(&url));
    let callgrind_out = dir.join(format!("{name}.callgrind"));
    let valgrind = [
        "valgrind".to_owned(),
        "-q".to_owned(),
        "--tool=callgrind".to_owned(),
        format!("--callgrind-out-file={}", callgrind_out.display()),
    ];
    run_child(rt, &valgrind, case, &url, n, false);
    let instructions = callgrind::total_instructions(&callgrind_out);
    let self_costs = callgrind::by_function(&callgrind_out, false);
    let inclusive = callgrind::by_function(&callgrind_out, true);
    let parked = PARK.iter().filter_map(|name| inclusive.get(*name)).sum();

    Measured {
        allocations,
        bytes,
        instructions,
        parked,
        syscalls,
        commands,
        all_calls,
        self_costs,
        inclusive,
    }
}

/// Stops `monitor` and reads `INFO commandstats`: the commands clients sent (upper case), and
/// every call Redis counted, scripts' included (lower case), by name.
pub(crate) async fn finish_counting(
    monitor: Monitor,
    ctl: &mut redis::aio::MultiplexedConnection,
) -> (ByName, ByName) {
    let counts = monitor.finish(ctl).await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(ctl)
        .await
        .expect("INFO commandstats");
    (command_counts(&counts), commandstats(&info))
}

fn command_counts(counts: &tower_lock_testkit::monitor::CommandCounts) -> ByName {
    counts
        .iter()
        .map(|(name, n)| (name.to_owned(), n as f64))
        .collect()
}

/// `cmdstat_set:calls=3,usec=…`: calls by command name (lower case, `client|setinfo` for a
/// subcommand).
fn commandstats(info: &str) -> ByName {
    info.lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("cmdstat_")?;
            let (name, fields) = rest.split_once(':')?;
            let calls = fields
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Stops the child when dropped, if it still runs.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// How long one child may take, valgrind included.
const CHILD_LIMIT: Duration = Duration::from_secs(600);

/// Runs `case` with `n` operations under `wrapper` (a command line to prefix, or none): for an
/// HTTP case, sends its requests once it listens, then `POST /stop`. Returns the allocations
/// and bytes it counted (zero unless `count_allocations`).
fn run_child(
    rt: &Runtime,
    wrapper: &[String],
    case: Case,
    url: &str,
    n: u64,
    count_allocations: bool,
) -> (u64, u64) {
    let exe = std::env::current_exe().expect("the benchmark's own binary");
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    let cycles = if case.is_http() { 0 } else { n };
    command
        .args(["--count-child", &case.short(), url, &cycles.to_string()])
        .arg(if count_allocations { "1" } else { "0" })
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = Guard(
        command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {wrapper:?} {}: {e}", exe.display())),
    );
    let started = Instant::now();
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    if case.is_http() {
        let port = read_until(&mut lines, "listening on ")
            .trim()
            .parse::<u16>()
            .expect("the child's port");
        rt.block_on(async {
            let mut http = Http::new(port);
            for i in 0..n {
                let reply = http
                    .request("POST", &format!("/items/{i:06}/purchase"), None)
                    .await
                    .expect("a counted request");
                assert_eq!(
                    reply.status, 200,
                    "{case:?}: request {i} answered {reply:?}"
                );
            }
            let reply = http.request("POST", "/stop", None).await.expect("/stop");
            assert_eq!(reply.status, 200);
        });
    }
    let counted = read_until(&mut lines, "counted ");
    let mut parts = counted
        .split_whitespace()
        .map(|v| v.parse::<u64>().expect("a count"));
    let (Some(allocations), Some(bytes)) = (parts.next(), parts.next()) else {
        panic!("the child printed `counted {counted}`");
    };
    loop {
        match child.0.try_wait().expect("wait for the child") {
            Some(status) => {
                assert!(status.success(), "{case:?} with {n} ended with {status}");
                break;
            }
            None if started.elapsed() > CHILD_LIMIT => {
                panic!("{case:?} with {n} did not end within {CHILD_LIMIT:?}")
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    (allocations, bytes)
}

/// The rest of the first line of the child's output that starts with `prefix`.
fn read_until(lines: &mut std::io::Lines<BufReader<ChildStdout>>, prefix: &str) -> String {
    for line in lines.by_ref() {
        let line = line.expect("the child's output");
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.to_owned();
        }
    }
    panic!("the child ended without printing {prefix:?}");
}

/// The figures of `case` over every run.
fn samples(r: &[Vec<(Case, CountSample)>], case: Case) -> Vec<&CountSample> {
    r.iter()
        .flat_map(|run| run.iter())
        .filter(|(c, _)| *c == case)
        .map(|(_, s)| s)
        .collect()
}

/// The largest spread over runs, (max − min) / median, of `figures` of every case, in %.
fn largest_spread(r: &[Vec<(Case, CountSample)>], figures: &[&dyn Fn(&CountSample) -> f64]) -> f64 {
    let mut worst: f64 = 0.0;
    for case in CASES {
        let all = samples(r, case);
        if all.len() < 2 {
            continue;
        }
        for f in figures {
            let v: Vec<f64> = all.iter().map(|x| f(x)).collect();
            let m = median(&v);
            if m.abs() < 1.0 {
                continue;
            }
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            worst = worst.max((max - min) / m.abs() * 100.0);
        }
    }
    worst
}

/// A figure of the report: its name, how it is read from a sample, how it is shown.
type Figure<'a> = (&'a str, &'a dyn Fn(&CountSample) -> f64, fn(f64) -> String);

/// The summary's rows: per request, the layer's instructions and allocations over the bare
/// handler at most the hand-written lock's.
pub(crate) fn render_targets(w: &mut String, r: &[Vec<(Case, CountSample)>]) {
    let (hello, layer, lock) = (
        Case::Http(Variant::Hello),
        Case::Http(Variant::Layer),
        Case::Http(Variant::Baseline),
    );
    let figures: [Figure<'_>; 2] = [
        ("instructions outside the runtime's park", &unparked, f0),
        ("heap allocations", &|x| x.allocations, f1),
    ];
    for (name, get, fmt) in figures {
        let over = |c| paired(r, c, hello, |a, b| get(a) - get(b));
        let (layer, lock) = (over(layer), over(lock));
        if layer.is_empty() || lock.is_empty() {
            return;
        }
        let _ = writeln!(
            w,
            "| counts (h.): {name} per request over the bare handler, layer ≤ hand-written lock | {} against {} | {} |",
            stat(&layer, fmt),
            stat(&lock, fmt),
            verdict(median(&layer) <= median(&lock))
        );
    }
}

pub(crate) fn render(w: &mut String, s: &Settings, r: &[Vec<(Case, CountSample)>]) {
    if r.is_empty() {
        return;
    }
    let cases: Vec<Case> = CASES
        .into_iter()
        .filter(|c| !samples(r, *c).is_empty())
        .collect();
    let _ = writeln!(
        w,
        "## h. Counts per request\n\n\
         Figures that do not depend on the machine's load, for one request and one lock cycle. \
         Each case is a small program (`benches/lock_bench/count_child.rs`, the benchmark's own \
         binary with `--count-child`) on a **current-thread** tokio runtime: the HTTP cases serve \
         scenario a's apps on a loopback port, and the benchmark sends them `POST \
         /items/<key>/purchase` one after the other on **one keep-alive connection**, a fresh key \
         each; the cycle cases run acquire + release cycles on keys of their own, one after the \
         other (or in {TASKS} tasks). Every case runs twice per tool, with {SHORT} and with {LONG} \
         requests or cycles, and a figure is (long − short) ÷ {}: start-up, connecting, loading \
         scripts and shutting down cancel out. **Instructions**: valgrind's callgrind, the whole \
         process (`valgrind --tool=callgrind`), client side only (Redis is another process). \
         **Allocations** and their **bytes**: the benchmark's counting `#[global_allocator]` \
         (`alloc.rs`; a `realloc` counts as one allocation of its new size), in a run without \
         valgrind. **System calls**: `strace -f -c` of a third run; the *wake-ups* among them \
         (`epoll_wait`, and `write`, which these programs only use on the runtime's eventfd, to wake \
         its driver when a timer is set that falls due before the one it sleeps for) depend on \
         timing, whether a reply has arrived when the runtime looks, so they are counted apart. \
         **Redis**: client commands counted with `MONITOR`, and commands run inside Lua scripts \
         (`redis.call`) as `INFO commandstats` (which counts both) less those, on an emptied \
         server (`FLUSHALL`, `CONFIG RESETSTAT`). Each figure is the median of {} run(s) of the \
         whole scenario, with the range. The largest spread across runs, (max − min) ÷ median, \
         was {:.2} % for instructions outside the runtime's park, {:.2} % for instructions (the \
         park's, how the runtime waits and wakes, vary with the wake-ups), {:.2} % for \
         allocations, bytes, system calls but wake-ups and Redis commands, and {:.2} % for \
         wake-ups. The callgrind outputs are kept in \
         `target/lock_bench-counts/`, with each case's functions by instructions per operation \
         (`<case>.profile.txt`, inclusive and self). Tools: {}, {}, on {} ({} CPUs), \
         redis-server {}.\n",
        LONG - SHORT,
        s.runs,
        largest_spread(r, &[&unparked]),
        largest_spread(r, &[&|x| x.instructions]),
        largest_spread(
            r,
            &[
                &|x| x.allocations,
                &|x| x.bytes,
                &other_syscalls,
                &|x| total(&x.commands),
                &|x| total(&x.lua),
            ]
        ),
        largest_spread(r, &[&wake_ups]),
        command_line("valgrind", &["--version"]),
        command_line("strace", &["-V"]),
        cpu_model(),
        command_line("nproc", &[]),
        command_line("redis-server", &["--version"])
            .split_whitespace()
            .nth(2)
            .unwrap_or("unknown"),
    );
    let figures: [Figure<'_>; 9] = [
        ("instructions outside the runtime's park", &unparked, f0),
        ("instructions in the runtime's park", &|x| x.parked, f0),
        ("instructions in all", &|x| x.instructions, f0),
        ("heap allocations", &|x| x.allocations, f1),
        ("heap bytes allocated", &|x| x.bytes, f0),
        ("system calls but wake-ups", &other_syscalls, f2),
        ("wake-ups (`epoll_wait`, eventfd `write`)", &wake_ups, f2),
        ("Redis commands sent", &|x| total(&x.commands), f2),
        ("Redis commands run by Lua", &|x| total(&x.lua), f2),
    ];
    let header: String = cases.iter().map(|c| format!(" {} |", c.title())).collect();
    let rule: String = cases.iter().map(|_| "---|").collect();
    let _ = writeln!(w, "| per request or cycle |{header}\n|---|{rule}");
    for (name, get, fmt) in &figures {
        let cells: String = cases
            .iter()
            .map(|c| {
                let v: Vec<f64> = samples(r, *c).iter().map(|x| nought(get(x))).collect();
                format!(" {} |", stat(&v, fmt))
            })
            .collect();
        let _ = writeln!(w, "| {name} |{cells}");
    }

    // Over the bare handler.
    let hello = Case::Http(Variant::Hello);
    let over: Vec<Case> = cases
        .iter()
        .copied()
        .filter(|c| c.is_http() && *c != hello)
        .collect();
    if !samples(r, hello).is_empty() && !over.is_empty() {
        let header: String = over.iter().map(|c| format!(" {} |", c.title())).collect();
        let rule: String = over.iter().map(|_| "---|").collect();
        let _ = writeln!(
            w,
            "\nOver the bare handler (each run's figure less the same run's bare handler):\n\n\
             | per request, over the bare handler |{header}\n|---|{rule}"
        );
        for (name, get, fmt) in &figures {
            let cells: String = over
                .iter()
                .map(|c| {
                    let v = paired(r, *c, hello, |a, b| nought(get(a) - get(b)));
                    format!(" {} |", stat(&v, fmt))
                })
                .collect();
            let _ = writeln!(w, "| {name} |{cells}");
        }
    }

    let _ = writeln!(
        w,
        "\nBy name (the last run): system calls; Redis commands sent; commands run by Lua.\n\n\
         | case | system calls | sent | run by Lua |\n|---|---|---|---|"
    );
    for case in &cases {
        let Some(last) = samples(r, *case).last().copied() else {
            continue;
        };
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} |",
            case.title(),
            listed(&last.syscalls),
            listed(&last.commands),
            listed(&last.lua)
        );
    }

    // Where the instructions go, by crate, for the pairs compared.
    let pairs = [
        (Case::Http(Variant::Layer), Case::Http(Variant::Baseline)),
        (CASES[4], CASES[5]),
        (CASES[6], CASES[7]),
    ];
    for (a, b) in pairs {
        let (Some(sa), Some(sb)) = (samples(r, a).last().copied(), samples(r, b).last().copied())
        else {
            continue;
        };
        let mut rows: Vec<(String, f64, f64)> = sa
            .buckets
            .keys()
            .chain(sb.buckets.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|k| {
                (
                    k.clone(),
                    sa.buckets.get(k).copied().unwrap_or(0.0),
                    sb.buckets.get(k).copied().unwrap_or(0.0),
                )
            })
            .filter(|(_, x, y)| x.abs() >= 50.0 || y.abs() >= 50.0)
            .collect();
        rows.sort_by(|x, y| (y.1 - y.2).total_cmp(&(x.1 - x.2)));
        let _ = writeln!(
            w,
            "\nWhere the instructions go, {} against {} (the last run; each function's own \
             instructions, summed by crate: generic code of `core`, `alloc` and `std` counts to \
             the first other crate its name mentions; 50 or more per operation):\n\n\
             | crate | {} | {} | difference |\n|---|---|---|---|",
            a.title(),
            b.title(),
            a.title(),
            b.title()
        );
        for (k, x, y) in rows {
            let _ = writeln!(w, "| {k} | {x:.0} | {y:.0} | {:+.0} |", x - y);
        }
    }
    let _ = writeln!(w);
}

/// `x`, with what rounds to nothing shown as 0 rather than -0.00.
fn nought(x: f64) -> f64 {
    if x.abs() < 0.005 { 0.0 } else { x }
}

/// `f(a, b)` per run, for the runs that have both cases.
fn paired(
    r: &[Vec<(Case, CountSample)>],
    a: Case,
    b: Case,
    f: impl Fn(&CountSample, &CountSample) -> f64,
) -> Vec<f64> {
    r.iter()
        .filter_map(|run| {
            let get = |c| run.iter().find(|(x, _)| *x == c).map(|(_, s)| s);
            Some(f(get(a)?, get(b)?))
        })
        .collect()
}

/// `epoll_wait 2.00, sendto 1.00`, largest first, or `none`.
fn listed(by: &ByName) -> String {
    let mut v: Vec<(&String, &f64)> = by.iter().collect();
    if v.is_empty() {
        return "none".to_owned();
    }
    v.sort_by(|a, b| b.1.total_cmp(a.1).then(a.0.cmp(b.0)));
    v.iter()
        .map(|(name, n)| format!("{name} {n:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}
