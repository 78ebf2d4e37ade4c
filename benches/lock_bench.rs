//! The benchmark for issue 4: HTTP overhead, uncontended lock cycles, contended hand-off,
//! renewal at scale and memory, each next to a hand-written baseline or the `rslock` peer.
//!
//! `cargo bench --bench lock_bench` (or `scripts/bench.sh`, which installs `wrk` and
//! `redis-server` first) starts its own `redis-server` on a free loopback port, runs every
//! scenario `BENCH_RUNS` times (default 3) and writes `docs/BENCHMARKS.md`. It only uses the
//! crate's public API, so it keeps measuring the same things as the implementation changes.
//!
//! | variable | meaning |
//! |---|---|
//! | `BENCH_RUNS` | runs per scenario (default 3) |
//! | `BENCH_QUICK=1` | shortened durations, for a smoke run |
//! | `BENCH_FULL=1` | the memory flatness run sends 1M requests instead of 100k |
//! | `BENCH_ONLY` | scenario letters to run, e.g. `ac` (default: all of `abcde`) |
//! | `BENCH_NOTE` | a note printed at the top of the report (e.g. "machine was busy") |
//! | `BENCH_OUTPUT` | report path (default `docs/BENCHMARKS.md`) |
//! | `BENCH_RSLOCK_RETRY_MS` | rslock's retry delay in the contended scenario (default 20) |
//!
//! Only 127.0.0.1 is contacted; every process started here is stopped before it exits.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    collections::BTreeMap,
    fmt::Write as _,
    future::Future,
    io::{Read, Write},
    net::{TcpListener as StdListener, TcpStream as StdStream},
    path::{Path as FsPath, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicIsize, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::{Path, State},
    http::{Request, StatusCode},
    routing::post,
};
use futures_util::{StreamExt, stream};
use hdrhistogram::Histogram;
use redis::{Script, aio::MultiplexedConnection};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    runtime::Runtime,
};
use tower::ServiceExt;
use tower_lock::{
    Key, LeaseGuard, LockConfig, LockLayer, Locker, RedisStore, Token, Wait,
    bb8_redis::{RedisConnectionManager, bb8},
};

// ---------------------------------------------------------------------------------------------
// Heap accounting: a global allocator that counts the bytes currently allocated.
// ---------------------------------------------------------------------------------------------

struct CountingAlloc;

static HEAP_BYTES: AtomicIsize = AtomicIsize::new(0);

/// Off until the memory scenario (e) starts, and on from then: one shared counter updated by
/// every allocation would slow the timed scenarios down, allocation-heavy code (the layer, more
/// than the hand-written baselines) the most, as both runtime workers contend for its cache
/// line.
static COUNTING: AtomicBool = AtomicBool::new(false);

// SAFETY: every call is forwarded unchanged to `System`; the wrapper only adds up sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) };
        if COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        new
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn heap_bytes() -> i64 {
    HEAP_BYTES.load(Ordering::SeqCst) as i64
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------

/// The compare-and-delete at the heart of the crate's release (`src/store/scripts/release.lua`), for the
/// baselines and the round-trip measurement. Copied, so the baselines stay what they are while
/// the crate's own scripts change.
const RELEASE_LUA: &str = r"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// One of the crate's own lock scripts, put together as `RedisStore` does (`lock_script` in
/// `src/store/redis.rs`): the fencing function, then `body` with the hand-off functions in place
/// of its `-- @handoff` line. For the "same scripts" baseline, which sends byte for byte the
/// `EVALSHA`s the layer sends.
fn crate_script(body: &str) -> Script {
    let fence = include_str!("../src/store/scripts/fence.lua");
    let handoff = include_str!("../src/store/scripts/handoff.lua");
    assert!(body.contains("-- @handoff\n"));
    Script::new(&format!(
        "{fence}{}",
        body.replacen("-- @handoff\n", handoff, 1)
    ))
}

/// The "same scripts" baseline's acquire and release: the crate's.
fn crate_scripts() -> (Script, Script) {
    (
        crate_script(include_str!("../src/store/scripts/acquire.lua")),
        crate_script(include_str!("../src/store/scripts/release.lua")),
    )
}

/// Lease TTL of the baselines (the crate's default).
const TTL_MS: u64 = 10_000;
/// The "same scripts" baseline's fencing counter: one for all its keys (the crate keeps one per
/// hash slot; on one server the script does the same work either way).
const FENCE_COUNTER: &str = "bench:fence";
/// Fencing counter retention of the "same scripts" baseline (the crate's default).
const FENCE_RETENTION_MS: u64 = 24 * 60 * 60 * 1000;
/// The hand-off's claim window the layer sends (the crate's default), in ms.
const CLAIM_MS: u64 = 1000;
/// Stand-ins for a waiter's stamp and its process's channel, of the lengths the layer sends.
const STAMP: &str = "0000000000000000";
const CHANNEL: &str = "tower-lock:handoff:0123456789abcdef0123456789abcdef";
/// wrk's shape, as in the issue.
const WRK_THREADS: u32 = 2;
const WRK_CONNECTIONS: u32 = 50;
/// Tasks of the uncontended cycle loop.
const CYCLE_TASKS: usize = 16;
/// Waiter counts of the contended scenario.
const WAITER_COUNTS: [usize; 2] = [16, 64];
/// The contended scenario runs its waiters in one process, then split over two.
const PROCESS_COUNTS: [usize; 2] = [1, 2];
/// Critical section of the contended scenario (a busy spin, so it is exactly this long).
const HOLD: Duration = Duration::from_millis(1);
/// Leases held at once by the renewal and memory scenarios.
const LEASES: usize = 10_000;
/// Renewal scenario TTL: renewed every TTL / 3 = 1 s.
const RENEWAL_TTL: Duration = Duration::from_secs(3);

struct Settings {
    runs: usize,
    quick: bool,
    full: bool,
    only: String,
    warmup_s: u64,
    http_s: u64,
    count_s: u64,
    cycles: Duration,
    cycle_count_ops: u64,
    contended: Duration,
    contended_count: Duration,
    renewal_hold: Duration,
    memory_requests: usize,
    rslock_retry: Duration,
    note: Option<String>,
    output: PathBuf,
    command: String,
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
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
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
            &std::env::var("BENCH_COMMAND")
                .unwrap_or_else(|_| "cargo bench --bench lock_bench".to_owned()),
        );
        Self {
            runs: env_num("BENCH_RUNS", 3).max(1) as usize,
            quick,
            full,
            only: std::env::var("BENCH_ONLY")
                .unwrap_or_else(|_| "abcde".to_owned())
                .to_ascii_lowercase(),
            warmup_s: 1,
            http_s: if quick { 2 } else { 5 },
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
            note: std::env::var("BENCH_NOTE")
                .ok()
                .filter(|n| !n.trim().is_empty()),
            output,
            command,
        }
    }

    fn wants(&self, scenario: char) -> bool {
        self.only.contains(scenario)
    }
}

// ---------------------------------------------------------------------------------------------
// Processes: redis-server (killed on drop) and wrk
// ---------------------------------------------------------------------------------------------

fn free_port() -> u16 {
    loop {
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free loopback port");
        if port != 6379 {
            return port;
        }
    }
}

/// The `redis-server` this benchmark started, on a free loopback port; killed on drop.
struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl RedisServer {
    fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("tower-lock-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create a temp dir for redis-server");
        for _ in 0..5 {
            let port = free_port();
            // In a session of its own (`setsid` execs it in place, so `child` is redis-server
            // itself), as a system service would be: with the kernel's autogroup scheduling
            // on, a child in the benchmark's session shares one CPU share with the benchmark
            // and wrk, and under load Redis, the bottleneck, got a fraction of a core.
            let mut child = Command::new("setsid")
                .arg("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("cannot run redis-server (through setsid)");
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                if ping(port) {
                    return Self { child, port, dir };
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start on any of 5 free loopback ports");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = StdStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut buf).is_ok()
        && &buf == b"+PONG\r\n"
}

/// The first line a tool prints for `args`, or a clear exit if it is not installed.
fn require_tool(name: &str, args: &[&str]) -> String {
    match Command::new(name).args(args).output() {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            text.lines().next().unwrap_or("").trim().to_owned()
        }
        Err(e) => {
            eprintln!(
                "error: `{name}` is required by this benchmark but could not be run ({e}).\n\
                 Install it (Debian: `apt-get install -y {pkg}`) or run `scripts/bench.sh`, \
                 which installs it.",
                pkg = if name == "wrk" { "wrk" } else { "redis-server" }
            );
            std::process::exit(1);
        }
    }
}

/// A wrk script that sends each request to a path of its own (`/items/<key>/purchase`), so
/// every request locks a distinct key.
const WRK_SCRIPT: &str = r#"-- Written by benches/lock_bench.rs: one distinct key per request.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local prefix = ""
local n = 0
function init(args)
  math.randomseed(os.time() * 1000 + (tid or 0))
  prefix = tostring(tid or 0) .. "-" .. tostring(math.random(1, 2147483647)) .. "-"
end
function request()
  n = n + 1
  return wrk.format("POST", "/items/" .. prefix .. n .. "/purchase")
end
"#;

struct WrkOut {
    rps: f64,
    /// Non-2xx answers plus socket errors.
    errors: u64,
}

fn wrk(port: u16, secs: u64, script: &FsPath) -> WrkOut {
    let out = Command::new("wrk")
        .arg(format!("-t{WRK_THREADS}"))
        .arg(format!("-c{WRK_CONNECTIONS}"))
        .arg(format!("-d{secs}s"))
        .args(["--timeout", "5s", "-s"])
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}/"))
        .stdin(Stdio::null())
        .output()
        .expect("cannot run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut rps = None;
    let mut errors = 0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            errors += v
                .split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    WrkOut {
        rps: rps.unwrap_or_else(|| panic!("no Requests/sec in wrk's output:\n{text}")),
        errors,
    }
}

// ---------------------------------------------------------------------------------------------
// Counting client-issued Redis commands with MONITOR
// ---------------------------------------------------------------------------------------------

/// Client-issued commands by name.
#[derive(Debug, Default, Clone)]
struct Counts(BTreeMap<String, u64>);

impl Counts {
    fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// `EVALSHA 2.00, SET 1.00` per operation.
    fn per(&self, ops: f64) -> String {
        if self.0.is_empty() {
            return "none".to_owned();
        }
        self.0
            .iter()
            .map(|(name, n)| format!("{name} {:.2}", *n as f64 / ops))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

static NEXT_TAG: AtomicU64 = AtomicU64::new(0);

/// A fresh tag for key values and markers, unique within this process.
fn tag() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        NEXT_TAG.fetch_add(1, Ordering::Relaxed)
    )
}

/// A `MONITOR` connection counting every command a client sends, and none that a script runs
/// (MONITOR shows those as `[db lua]`), until it sees its marker.
struct Monitor {
    reader: tokio::task::JoinHandle<std::io::Result<Counts>>,
    marker: String,
}

impl Monitor {
    async fn start(port: u16) -> Self {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect MONITOR");
        stream.write_all(b"MONITOR\r\n").await.expect("MONITOR");
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        reader.read_until(b'\n', &mut line).await.expect("MONITOR");
        assert!(line.starts_with(b"+OK"), "MONITOR answered {line:?}");
        let marker = format!("tower-lock-bench-marker-{}", tag());
        let needle = marker.clone();
        let reader = tokio::spawn(async move {
            let mut counts = Counts::default();
            let mut line = Vec::with_capacity(512);
            loop {
                line.clear();
                if reader.read_until(b'\n', &mut line).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                let text = String::from_utf8_lossy(&line);
                if text.contains(&needle) {
                    return Ok(counts);
                }
                if let Some(name) = client_command(&text) {
                    *counts.0.entry(name).or_insert(0) += 1;
                }
            }
        });
        Self { reader, marker }
    }

    /// Sends the marker on `ctl` and returns what clients sent before it.
    async fn finish(self, ctl: &mut MultiplexedConnection) -> Counts {
        let _: String = redis::cmd("ECHO")
            .arg(&self.marker)
            .query_async(ctl)
            .await
            .expect("ECHO marker");
        tokio::time::timeout(Duration::from_secs(60), self.reader)
            .await
            .expect("the MONITOR reader did not reach its marker in 60 s")
            .expect("MONITOR reader panicked")
            .expect("MONITOR stream failed")
    }
}

/// `+1700000000.123456 [0 127.0.0.1:50828] "SET" "b" "1"`: the command's name, unless a script
/// ran it (`[0 lua]`).
fn client_command(line: &str) -> Option<String> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let client = line[open + 1..close].split_whitespace().nth(1)?;
    if client == "lua" {
        return None;
    }
    let rest = line[close + 1..].trim_start().strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_ascii_uppercase())
}

async fn control(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the benchmark's redis-server")
}

async fn flushall(url: &str) {
    let mut ctl = control(url).await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut ctl)
        .await
        .expect("FLUSHALL");
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

// ---------------------------------------------------------------------------------------------
// a. HTTP overhead
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Hello,
    Baseline,
    BaselineScripts,
    Bb8Defaults,
    Layer,
}

const VARIANTS: [Variant; 5] = [
    Variant::Hello,
    Variant::Baseline,
    Variant::BaselineScripts,
    Variant::Bb8Defaults,
    Variant::Layer,
];

impl Variant {
    fn describe(self) -> &'static str {
        match self {
            Self::Hello => "axum hello world (no Redis)",
            Self::Baseline => {
                "baseline: `SET NX PX` + `EVALSHA` compare-and-delete, one shared multiplexed connection"
            }
            Self::BaselineScripts => {
                "baseline, same scripts: `EVALSHA` of the crate's own acquire and release scripts (fencing token, hand-off queue check), with the keys and arguments the layer sends, one shared multiplexed connection"
            }
            Self::Bb8Defaults => {
                "bb8-redis 0.26 with its defaults (`PING` on checkout, 10 connections), one checkout per command, same 2 commands as the baseline"
            }
            Self::Layer => {
                "`LockLayer` (`RedisStore::connect`, `Key::path_param(\"sku\")`, default config), trivial handler"
            }
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::Hello => "hello",
            Self::Baseline => "baseline",
            Self::BaselineScripts => "baseline-scripts",
            Self::Bb8Defaults => "bb8-defaults",
            Self::Layer => "layer",
        }
    }
}

const ROUTE: &str = "/items/{sku}/purchase";

struct Direct {
    conn: MultiplexedConnection,
    /// `Some`: the crate's own acquire and release scripts, with the keys and arguments the
    /// layer sends, instead of a plain `SET NX PX` and `RELEASE_LUA`.
    scripts: Option<(Script, Script)>,
    release: Script,
}

fn lock_key(sku: &str) -> String {
    format!("bench:{{{sku}}}")
}

async fn direct_handler(
    State(state): State<Arc<Direct>>,
    Path(sku): Path<String>,
) -> Result<&'static str, StatusCode> {
    let token = Token::generate().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let key = lock_key(&sku);
    let mut conn = state.conn.clone();
    let acquired = match &state.scripts {
        None => redis::cmd("SET")
            .arg(&key)
            .arg(token.as_bytes())
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async::<Option<String>>(&mut conn)
            .await
            .map(|reply| reply.is_some()),
        Some((acquire, _)) => acquire
            .key(&key)
            .key(FENCE_COUNTER)
            .key(format!("{key}:queue"))
            .arg(token.as_bytes())
            .arg(TTL_MS)
            .arg(FENCE_RETENTION_MS)
            .arg(CLAIM_MS)
            .arg(STAMP)
            .arg(CHANNEL)
            .arg("0")
            .invoke_async::<(i64, i64)>(&mut conn)
            .await
            .map(|(acquired, _)| acquired == 1),
    }
    .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    if !acquired {
        return Err(StatusCode::CONFLICT);
    }
    let released = match &state.scripts {
        None => {
            state
                .release
                .key(&key)
                .arg(token.as_bytes())
                .invoke_async::<i64>(&mut conn)
                .await
        }
        Some((_, release)) => {
            release
                .key(&key)
                .key(FENCE_COUNTER)
                .key(format!("{key}:queue"))
                .arg(token.as_bytes())
                .arg(CLAIM_MS)
                .arg(FENCE_RETENTION_MS)
                .invoke_async::<i64>(&mut conn)
                .await
        }
    };
    released.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok("ok")
}

struct Pooled {
    pool: bb8::Pool<RedisConnectionManager>,
    release: Script,
}

async fn pooled_handler(
    State(state): State<Arc<Pooled>>,
    Path(sku): Path<String>,
) -> Result<&'static str, StatusCode> {
    let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
    let token = Token::generate().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let key = lock_key(&sku);
    let acquired = {
        let mut conn = state.pool.get().await.map_err(|_| unavailable(()))?;
        redis::cmd("SET")
            .arg(&key)
            .arg(token.as_bytes())
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async::<Option<String>>(&mut *conn)
            .await
            .map_err(|_| unavailable(()))?
            .is_some()
    };
    if !acquired {
        return Err(StatusCode::CONFLICT);
    }
    let mut conn = state.pool.get().await.map_err(|_| unavailable(()))?;
    state
        .release
        .key(&key)
        .arg(token.as_bytes())
        .invoke_async::<i64>(&mut *conn)
        .await
        .map_err(|_| unavailable(()))?;
    Ok("ok")
}

async fn http_app(variant: Variant, url: &str, requests: Arc<AtomicU64>) -> Router {
    let router = match variant {
        Variant::Hello => Router::new().route(ROUTE, post(|| async { "ok" })),
        Variant::Baseline | Variant::BaselineScripts => {
            let state = Arc::new(Direct {
                conn: control(url).await,
                scripts: (variant == Variant::BaselineScripts).then(crate_scripts),
                release: Script::new(RELEASE_LUA),
            });
            Router::new()
                .route(ROUTE, post(direct_handler))
                .with_state(state)
        }
        Variant::Bb8Defaults => {
            let manager = RedisConnectionManager::new(url).expect("bb8 manager");
            let pool = bb8::Pool::builder().build(manager).await.expect("bb8 pool");
            let state = Arc::new(Pooled {
                pool,
                release: Script::new(RELEASE_LUA),
            });
            Router::new()
                .route(ROUTE, post(pooled_handler))
                .with_state(state)
        }
        Variant::Layer => {
            let store = RedisStore::connect(url).await.expect("RedisStore::connect");
            Router::new()
                .route(ROUTE, post(|| async { "ok" }))
                .route_layer(LockLayer::new(store, Key::path_param("sku")))
        }
    };
    // Counts requests as they arrive (before the lock), for commands per request.
    router.layer(tower::util::MapRequestLayer::new(
        move |request: Request<Body>| {
            requests.fetch_add(1, Ordering::Relaxed);
            request
        },
    ))
}

struct HttpSample {
    rps: f64,
    errors: u64,
    /// Client-issued Redis commands per request, from a separate counting pass.
    commands: Option<(f64, String)>,
}

fn http_run(variant: Variant, redis: &RedisServer, s: &Settings, script: &FsPath) -> HttpSample {
    let url = redis.url();
    let rt = runtime();
    let requests = Arc::new(AtomicU64::new(0));
    let app = rt.block_on(http_app(variant, &url, Arc::clone(&requests)));
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind a loopback port");
    let port = listener.local_addr().expect("local addr").port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = rt.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
    });
    let _ = wrk(port, s.warmup_s, script);
    let measured = wrk(port, s.http_s, script);
    let commands = (variant != Variant::Hello).then(|| {
        let (mut ctl, monitor) = rt.block_on(async {
            let ctl = control(&url).await;
            (ctl, Monitor::start(redis.port).await)
        });
        let before = requests.load(Ordering::SeqCst);
        let _ = wrk(port, s.count_s, script);
        // Requests cut off when wrk stopped still release (in spawned tasks): let them land.
        std::thread::sleep(Duration::from_millis(300));
        let counts = rt.block_on(monitor.finish(&mut ctl));
        let n = (requests.load(Ordering::SeqCst) - before).max(1) as f64;
        (counts.total() as f64 / n, counts.per(n))
    });
    let _ = stop.send(());
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(3), serving).await });
    rt.shutdown_timeout(Duration::from_secs(2));
    HttpSample {
        rps: measured.rps,
        errors: measured.errors,
        commands,
    }
}

// ---------------------------------------------------------------------------------------------
// b. Uncontended lock cycles
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    TowerLock,
    Rslock,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Self::TowerLock => "tower-lock `Locker`",
            Self::Rslock => "rslock `LockManager`",
        }
    }
}

enum Stop {
    At(Instant),
    After(u64),
}

/// Runs `op(task, n)` in `tasks` spawned tasks until `stop`; returns the operations done.
async fn drive<F, Fut>(tasks: usize, stop: Stop, op: F) -> u64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let stop = Arc::new(stop);
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let op = op.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut n = 0;
                loop {
                    match *stop {
                        Stop::At(end) if Instant::now() >= end => break,
                        Stop::After(count) if n >= count => break,
                        _ => {}
                    }
                    op(task, n).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for handle in handles {
        total += handle.await.expect("cycle task panicked");
    }
    total
}

struct CycleSample {
    rate: f64,
    commands: f64,
    breakdown: String,
}

async fn cycles(peer: Peer, redis: &RedisServer, s: &Settings) -> CycleSample {
    let url = redis.url();
    let tag = tag();
    match peer {
        Peer::TowerLock => {
            let locker = Locker::new(RedisStore::connect(url.as_str()).await.expect("connect"));
            let op = move |task: usize, n: u64| {
                let locker = locker.clone();
                let value = format!("{tag}-{task}-{n}");
                async move {
                    let key = locker.key("bench-cycles", value).expect("key");
                    let guard = locker.acquire(key).await.expect("uncontended acquire");
                    guard.release().await.expect("release");
                }
            };
            measure_cycles(&url, redis.port, s, op).await
        }
        Peer::Rslock => {
            let manager = rslock::LockManager::new(vec![url.clone()]);
            let op = move |task: usize, n: u64| {
                let manager = manager.clone();
                let resource = format!("rslock-cycles:{tag}-{task}-{n}");
                async move {
                    let lock = manager
                        .lock(resource.as_bytes(), Duration::from_millis(TTL_MS))
                        .await
                        .expect("uncontended rslock lock");
                    manager.unlock(&lock).await;
                }
            };
            measure_cycles(&url, redis.port, s, op).await
        }
    }
}

async fn measure_cycles<F, Fut>(url: &str, port: u16, s: &Settings, op: F) -> CycleSample
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    // Counting pass first (it also warms the connection and loads the scripts).
    let mut ctl = control(url).await;
    let per_task = s.cycle_count_ops / CYCLE_TASKS as u64;
    let warm = drive(CYCLE_TASKS, Stop::After(10), op.clone()).await;
    assert!(warm > 0);
    let monitor = Monitor::start(port).await;
    let counted = drive(CYCLE_TASKS, Stop::After(per_task), op.clone()).await;
    let counts = monitor.finish(&mut ctl).await;
    let start = Instant::now();
    let done = drive(CYCLE_TASKS, Stop::At(start + s.cycles), op).await;
    let elapsed = start.elapsed().as_secs_f64();
    CycleSample {
        rate: done as f64 / elapsed,
        commands: counts.total() as f64 / counted as f64,
        breakdown: counts.per(counted as f64),
    }
}

// ---------------------------------------------------------------------------------------------
// c. Contended hand-off
// ---------------------------------------------------------------------------------------------

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

struct ContendedSample {
    rate: f64,
    ideal: f64,
    per_min: u64,
    per_max: u64,
    max_dev_pct: f64,
    p50_ms: f64,
    p99_ms: f64,
    commands: f64,
    breakdown: String,
    errors: u64,
    mean_hold_us: f64,
}

fn contended_config() -> LockConfig {
    LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
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
        Some(Monitor::start(redis.port).await)
    } else {
        None
    };
    let end = Instant::now() + window;
    let handles = spawn_waiters(ready, &tag, end);
    // Commands sent after the window closes (the last releases) are not counted.
    tokio::time::sleep_until(tokio::time::Instant::from_std(end)).await;
    let counts = match monitor {
        Some(monitor) => monitor.finish(&mut ctl).await,
        None => Counts::default(),
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
    summarize(&all, &waits, &counts, window, rtt)
}

/// Child processes of this benchmark, killed if still running when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
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
    let (mut ctl, monitor) = rt.block_on(async {
        let ctl = control(&url).await;
        let monitor = if count {
            Some(Monitor::start(redis.port).await)
        } else {
            None
        };
        (ctl, monitor)
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
    let counts = match monitor {
        Some(monitor) => rt.block_on(monitor.finish(&mut ctl)),
        None => Counts::default(),
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
    summarize(&all, &waits, &counts, window, rtt)
}

/// `--contended-child <tower|rslock> <url> <key tag> <warm-up prefix> <waiters> <rslock retry ms>`:
/// connects, prints `READY`, waits for `GO <start µs> <end µs>` (Unix time) on stdin, runs its
/// waiters over that window, and prints `W acquisitions errors held_ns` per waiter and
/// `T wait_us count` per wait-time bucket.
fn child_main(args: &[String]) {
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

fn summarize(
    all: &[WaiterStats],
    waits: &Histogram<u64>,
    counts: &Counts,
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
        commands: counts.total() as f64 / n,
        breakdown: counts.per(n),
        errors: all.iter().map(|w| w.errors).sum(),
        mean_hold_us: mean_hold * 1e6,
    }
}

// ---------------------------------------------------------------------------------------------
// d. Renewal at scale
// ---------------------------------------------------------------------------------------------

struct RenewalSample {
    acquire_s: f64,
    window_s: f64,
    lost: u64,
    release_errors: u64,
    commands_per_s: f64,
    renewals_per_s: f64,
    leases_per_command: f64,
    breakdown: String,
}

async fn renewal(redis: &RedisServer, s: &Settings) -> RenewalSample {
    let url = redis.url();
    let tag = tag();
    let store = RedisStore::connect(url.as_str()).await.expect("connect");
    let locker = Locker::with_config(
        store,
        LockConfig::builder().ttl(RENEWAL_TTL).build().unwrap(),
    );
    // Warm-up: one lease held until its first renewal, so the one-time work of the first
    // renewal (loading the renew script, asking the server for native commands) is not counted.
    let warm = locker
        .acquire(locker.key("bench-renewal-warm", &tag).expect("key"))
        .await
        .expect("acquire");
    let waiting = Instant::now();
    while warm.renewals() == 0 && waiting.elapsed() < RENEWAL_TTL {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    warm.release().await.expect("release");
    let started = Instant::now();
    let guards: Vec<LeaseGuard> = stream::iter(0..LEASES)
        .map(|i| {
            let locker = locker.clone();
            let value = format!("{tag}-{i}");
            async move {
                let key = locker.key("bench-renewal", value).expect("key");
                locker.acquire(key).await.expect("acquire")
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let acquire_s = started.elapsed().as_secs_f64();
    let renewals =
        |guards: &[LeaseGuard]| -> u64 { guards.iter().map(|g| u64::from(g.renewals())).sum() };
    let mut ctl = control(&url).await;
    let monitor = Monitor::start(redis.port).await;
    let before = renewals(&guards);
    let window = Instant::now();
    tokio::time::sleep(s.renewal_hold).await;
    let counts = monitor.finish(&mut ctl).await;
    let window_s = window.elapsed().as_secs_f64();
    let renewed = renewals(&guards) - before;
    let outcomes: Vec<(bool, bool)> = stream::iter(guards)
        .map(|guard| async move {
            let lost = guard.is_lost();
            match guard.release().await {
                Ok(released) => (lost || !released, false),
                Err(_) => (lost, true),
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let total = counts.total() as f64;
    RenewalSample {
        acquire_s,
        window_s,
        lost: outcomes.iter().filter(|(lost, _)| *lost).count() as u64,
        release_errors: outcomes.iter().filter(|(_, error)| *error).count() as u64,
        commands_per_s: total / window_s,
        renewals_per_s: renewed as f64 / window_s,
        leases_per_command: if total > 0.0 {
            renewed as f64 / total
        } else {
            0.0
        },
        breakdown: counts.per(window_s),
    }
}

// ---------------------------------------------------------------------------------------------
// e. Memory
// ---------------------------------------------------------------------------------------------

struct MemorySample {
    per_lease: f64,
    per_lease_after_release: f64,
    per_lease_growth: f64,
    per_request_plain: f64,
    per_request_layer: f64,
    rss_before: f64,
    rss_after: f64,
    tasks_before: f64,
    tasks_after: f64,
    heap_before: f64,
    heap_after: f64,
    failed: u64,
}

fn page_size() -> u64 {
    Command::new("getconf")
        .arg("PAGESIZE")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(4096)
}

/// Resident set size from `/proc/self/statm`, in bytes.
fn rss_bytes(page: u64) -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * page
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

fn purchase(value: &str) -> Request<Body> {
    Request::post(format!("/items/{value}/purchase"))
        .body(Body::empty())
        .expect("request")
}

/// Heap per `LeaseGuard` held, and what is left per lease after all are released.
async fn heap_per_lease(url: &str) -> HeapPerLease {
    let tag = tag();
    let locker = Locker::new(RedisStore::connect(url).await.expect("connect"));
    for i in 0..100 {
        let key = locker
            .key("bench-memory-warm", format!("{tag}-{i}"))
            .expect("key");
        locker
            .acquire(key)
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    let mut guards = Vec::with_capacity(LEASES);
    settle().await;
    let before = heap_bytes();
    for i in 0..LEASES {
        let key = locker
            .key("bench-memory", format!("{tag}-{i}"))
            .expect("key");
        guards.push(locker.acquire(key).await.expect("acquire"));
    }
    settle().await;
    let held = heap_bytes();
    let released: Vec<_> = stream::iter(guards.drain(..))
        .map(LeaseGuard::release)
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(released.iter().all(|r| matches!(r, Ok(true))));
    drop(released);
    settle().await;
    let after = heap_bytes();
    // A second round of as many leases: what it leaves behind is growth, not retained capacity.
    let again: Vec<_> = stream::iter(0..LEASES)
        .map(|i| {
            let locker = locker.clone();
            let value = format!("{tag}-again-{i}");
            async move {
                let key = locker.key("bench-memory", value).expect("key");
                locker.acquire(key).await.expect("acquire").release().await
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(again.iter().all(|r| matches!(r, Ok(true))));
    drop(again);
    settle().await;
    let after_again = heap_bytes();
    HeapPerLease {
        held: (held - before) as f64 / LEASES as f64,
        left: (after - before) as f64 / LEASES as f64,
        growth: (after_again - after) as f64 / LEASES as f64,
    }
}

struct HeapPerLease {
    held: f64,
    left: f64,
    growth: f64,
}

/// Heap per in-flight HTTP request (in process, through the `Router`), with or without the
/// layer: `LEASES` requests parked in their handler at once.
async fn heap_per_inflight_request(url: &str, with_layer: bool) -> f64 {
    let tag = tag();
    let (open, gate) = tokio::sync::watch::channel(true);
    let entered = Arc::new(AtomicUsize::new(0));
    let handler = {
        let entered = Arc::clone(&entered);
        move || {
            let mut gate = gate.clone();
            let entered = Arc::clone(&entered);
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                let _ = gate.wait_for(|open| *open).await;
                "ok"
            }
        }
    };
    let mut router = Router::new().route(ROUTE, post(handler));
    if with_layer {
        let store = RedisStore::connect(url).await.expect("connect");
        router = router.route_layer(LockLayer::new(store, Key::path_param("sku")));
    }
    for i in 0..100 {
        let response = router
            .clone()
            .oneshot(purchase(&format!("warm-{tag}-{i}")))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
    }
    open.send_replace(false);
    entered.store(0, Ordering::SeqCst);
    let mut handles = Vec::with_capacity(LEASES);
    settle().await;
    let before = heap_bytes();
    for i in 0..LEASES {
        let router = router.clone();
        let request = purchase(&format!("{tag}-{i}"));
        handles.push(tokio::spawn(async move {
            router.oneshot(request).await.expect("infallible").status()
        }));
    }
    let waiting = Instant::now();
    while entered.load(Ordering::SeqCst) < LEASES {
        assert!(
            waiting.elapsed() < Duration::from_secs(60),
            "in-flight requests did not all reach the handler"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    settle().await;
    let during = heap_bytes();
    open.send_replace(true);
    for handle in handles {
        assert_eq!(handle.await.expect("request task"), StatusCode::OK);
    }
    (during - before) as f64 / LEASES as f64
}

async fn memory(redis: &RedisServer, s: &Settings, page: u64) -> MemorySample {
    let url = redis.url();
    let leases = heap_per_lease(&url).await;
    let per_request_plain = heap_per_inflight_request(&url, false).await;
    let per_request_layer = heap_per_inflight_request(&url, true).await;

    // Flatness: RSS, live tasks and heap before and after N requests through the layer.
    let tag = tag();
    let store = RedisStore::connect(url.as_str()).await.expect("connect");
    let router = Router::new()
        .route(ROUTE, post(|| async { "ok" }))
        .route_layer(LockLayer::new(store, Key::path_param("sku")));
    let send = |n: usize, prefix: String| {
        let router = router.clone();
        async move {
            stream::iter(0..n)
                .map(|i| router.clone().oneshot(purchase(&format!("{prefix}-{i}"))))
                .buffer_unordered(64)
                .fold(0u64, |failed, response| async move {
                    failed + u64::from(response.map_or(true, |r| r.status() != StatusCode::OK))
                })
                .await
        }
    };
    let mut failed = send(2_000, format!("{tag}-warm")).await;
    settle().await;
    let (rss_before, tasks_before, heap_before) = (rss_bytes(page), alive_tasks(), heap_bytes());
    failed += send(s.memory_requests, tag).await;
    settle().await;
    let (rss_after, tasks_after, heap_after) = (rss_bytes(page), alive_tasks(), heap_bytes());
    MemorySample {
        per_lease: leases.held,
        per_lease_after_release: leases.left,
        per_lease_growth: leases.growth,
        per_request_plain,
        per_request_layer,
        rss_before: rss_before as f64,
        rss_after: rss_after as f64,
        tasks_before: tasks_before as f64,
        tasks_after: tasks_after as f64,
        heap_before: heap_before as f64,
        heap_after: heap_after as f64,
        failed,
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics and formatting
// ---------------------------------------------------------------------------------------------

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `median (min–max)`, or just the value for a single run.
fn stat(values: &[f64], fmt: impl Fn(f64) -> String) -> String {
    if values.is_empty() {
        return "–".to_owned();
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.len() == 1 || (max - min).abs() < f64::EPSILON {
        fmt(median(values))
    } else {
        format!("{} ({}–{})", fmt(median(values)), fmt(min), fmt(max))
    }
}

fn f0(x: f64) -> String {
    format!("{x:.0}")
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

fn f2(x: f64) -> String {
    format!("{x:.2}")
}

fn mib(x: f64) -> String {
    format!("{:.1} MiB", x / (1024.0 * 1024.0))
}

fn kib(x: f64) -> String {
    format!("{:.0} KiB", x / 1024.0)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**not met**" }
}

// ---------------------------------------------------------------------------------------------
// Machine and versions
// ---------------------------------------------------------------------------------------------

fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn memory_total() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let kb: f64 = s
                .lines()
                .find(|l| l.starts_with("MemTotal:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(format!("{:.1} GiB", kb / (1024.0 * 1024.0)))
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Versions of `names` in the crate's `Cargo.lock`.
fn locked_versions(names: &[&str]) -> Vec<(String, String)> {
    let lock = std::fs::read_to_string(FsPath::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock"))
        .unwrap_or_default();
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_owned());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take())
            && names.contains(&n.as_str())
        {
            found
                .entry(n)
                .or_default()
                .push(v.trim_matches('"').to_owned());
        }
    }
    names
        .iter()
        .map(|n| {
            let v = found
                .get(*n)
                .map(|v| v.join(", "))
                .unwrap_or_else(|| "not in Cargo.lock".to_owned());
            ((*n).to_owned(), v)
        })
        .collect()
}

fn git_revision() -> String {
    let dir = env!("CARGO_MANIFEST_DIR");
    let head = command_line("git", &["-C", dir, "rev-parse", "--short", "HEAD"]);
    let dirty = Command::new("git")
        .args(["-C", dir, "status", "--porcelain"])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    if dirty {
        format!("{head}, with uncommitted changes")
    } else {
        head
    }
}

/// The `## Topologies` section of an existing report, verbatim, up to the next `## ` heading.
fn topologies_section(existing: &str) -> Option<String> {
    let mut out = String::new();
    let mut inside = false;
    for line in existing.split_inclusive('\n') {
        let heading = line.trim_end();
        if heading.starts_with("## ") {
            if inside {
                break;
            }
            inside = heading == "## Topologies";
        }
        if inside {
            out.push_str(line);
        }
    }
    (!out.is_empty()).then_some(out)
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Results {
    http: Vec<Vec<(Variant, HttpSample)>>,
    cycles: Vec<Vec<(Peer, CycleSample)>>,
    /// Round trips sent right after a `HOLD` spin (the ideal's), and back to back.
    rtt_us: Vec<f64>,
    tight_rtt_us: Vec<f64>,
    /// (waiters, processes, implementation, one sample per run)
    contended: Vec<(usize, usize, Peer, Vec<ContendedSample>)>,
    renewal: Vec<RenewalSample>,
    memory: Vec<MemorySample>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--contended-child") {
        child_main(&args[i + 1..]);
        return;
    }
    // `cargo test --all-targets` runs bench targets without `--bench`: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("lock_bench: run it with `cargo bench --bench lock_bench` (or scripts/bench.sh)");
        return;
    }
    let s = Settings::from_env();
    let wrk_version = require_tool("wrk", &["-v"]);
    let redis_version = require_tool("redis-server", &["--version"]);
    let load_start = load_average();
    let started = Instant::now();
    let date = command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);

    let redis = RedisServer::start();
    eprintln!(
        "lock_bench: redis-server on 127.0.0.1:{}, {} run(s){}",
        redis.port,
        s.runs,
        if s.quick { ", quick mode" } else { "" }
    );
    let script = redis.dir.join("distinct-keys.lua");
    std::fs::write(&script, WRK_SCRIPT).expect("write the wrk script");
    let url = redis.url();
    let page = page_size();
    let mut results = Results::default();

    if s.wants('a') {
        for run in 0..s.runs {
            let mut samples = Vec::new();
            for variant in VARIANTS {
                runtime().block_on(flushall(&url));
                let sample = http_run(variant, &redis, &s, &script);
                eprintln!(
                    "a. run {}: {:<16} {:>9.0} req/s, {} errors, commands/request {:?}",
                    run + 1,
                    variant.short(),
                    sample.rps,
                    sample.errors,
                    sample.commands.as_ref().map(|c| c.0)
                );
                samples.push((variant, sample));
            }
            results.http.push(samples);
        }
    }

    let rt = runtime();
    if s.wants('b') {
        for run in 0..s.runs {
            let mut samples = Vec::new();
            for peer in [Peer::TowerLock, Peer::Rslock] {
                rt.block_on(flushall(&url));
                let sample = rt.block_on(cycles(peer, &redis, &s));
                eprintln!(
                    "b. run {}: {:<22} {:>9.0} cycles/s, {:.2} commands/cycle",
                    run + 1,
                    peer.name(),
                    sample.rate,
                    sample.commands
                );
                samples.push((peer, sample));
            }
            results.cycles.push(samples);
        }
    }

    if s.wants('c') {
        for waiters in WAITER_COUNTS {
            for procs in PROCESS_COUNTS {
                for peer in [Peer::TowerLock, Peer::Rslock] {
                    results.contended.push((waiters, procs, peer, Vec::new()));
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
            results.rtt_us.push(rtt.as_secs_f64() * 1e6);
            results.tight_rtt_us.push(back_to_back.as_secs_f64() * 1e6);
            eprintln!(
                "c. run {}: median EVALSHA round trip {rtt:?} after a {HOLD:?} spin, {back_to_back:?} back to back",
                run + 1
            );
            for (waiters, procs, peer, samples) in &mut results.contended {
                let pass = |window: Duration, count: bool| {
                    if *procs == 1 {
                        // A fresh runtime per case: no waiter of one case lingers into the next.
                        let case = runtime();
                        let sample = case.block_on(contended(
                            *peer,
                            *waiters,
                            &redis,
                            &s,
                            rtt,
                            (window, count),
                        ));
                        case.shutdown_timeout(Duration::from_secs(2));
                        sample
                    } else {
                        contended_processes(
                            *peer,
                            (*waiters, *procs),
                            &redis,
                            &s,
                            rtt,
                            (window, count),
                        )
                    }
                };
                // Timed without MONITOR (it costs Redis and the reader CPU per command, scripts'
                // commands included), then the commands counted in a pass of their own.
                let mut sample = pass(s.contended, false);
                let counted = pass(s.contended_count, true);
                sample.commands = counted.commands;
                sample.breakdown = counted.breakdown;
                eprintln!(
                    "c. run {}: {waiters} waiters in {procs} process(es), {:<22} {:>6.0}/s (ideal {:.0}), per waiter {}..{}, p99 {:.1} ms, {:.2} commands/acquisition",
                    run + 1,
                    peer.name(),
                    sample.rate,
                    sample.ideal,
                    sample.per_min,
                    sample.per_max,
                    sample.p99_ms,
                    sample.commands
                );
                samples.push(sample);
            }
        }
    }

    if s.wants('d') {
        for run in 0..s.runs {
            rt.block_on(flushall(&url));
            let case = runtime();
            let sample = case.block_on(renewal(&redis, &s));
            case.shutdown_timeout(Duration::from_secs(2));
            eprintln!(
                "d. run {}: {LEASES} leases, {} lost, {:.0} renewal commands/s, {:.2} leases per command",
                run + 1,
                sample.lost,
                sample.commands_per_s,
                sample.leases_per_command
            );
            results.renewal.push(sample);
        }
    }

    if s.wants('e') {
        // Heap figures are differences taken within this scenario, which counts from here on.
        COUNTING.store(true, Ordering::SeqCst);
        for run in 0..s.runs {
            rt.block_on(flushall(&url));
            let case = runtime();
            let sample = case.block_on(memory(&redis, &s, page));
            case.shutdown_timeout(Duration::from_secs(2));
            eprintln!(
                "e. run {}: {:.0} B heap per lease, RSS {} -> {}, tasks {} -> {}",
                run + 1,
                sample.per_lease,
                mib(sample.rss_before),
                mib(sample.rss_after),
                sample.tasks_before,
                sample.tasks_after
            );
            results.memory.push(sample);
        }
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
    let existing = std::fs::read_to_string(&s.output).unwrap_or_default();
    let mut report = render(&s, &meta, &results);
    if let Some(section) = topologies_section(&existing) {
        report.push('\n');
        report.push_str(&section);
    }
    if let Some(dir) = s.output.parent() {
        std::fs::create_dir_all(dir).expect("create the report's directory");
    }
    std::fs::write(&s.output, &report).expect("write the report");
    println!("{report}");
    eprintln!(
        "lock_bench: wrote {} in {:.0} s",
        s.output.display(),
        meta.elapsed.as_secs_f64()
    );
}

struct Meta {
    date: String,
    wrk_version: String,
    redis_version: String,
    load_start: String,
    load_end: String,
    elapsed: Duration,
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
        "Written by `benches/lock_bench.rs` (issue 4) on {}, in {:.0} s. Each figure is the median \
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

    render_summary(w, r);
    render_counting(w);
    render_http(w, s, r);
    render_cycles(w, s, r);
    render_contended(w, s, r);
    render_renewal(w, s, r);
    render_memory(w, s, r);

    let _ = writeln!(w, "## Not covered\n");
    let _ = writeln!(
        w,
        "- **More than 2 processes.** The contended scenario runs its waiters in 1 process and \
         split over 2; 3 or more processes, or processes on separate machines, are not \
         measured.\n\
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

fn render_summary(w: &mut String, r: &Results) {
    let _ = writeln!(
        w,
        "## Against issue 4's targets\n\n| target | measured (median, min–max) | status |\n|---|---|---|"
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
            "| exactly 2 client commands per uncontended request | {} | {} |",
            stat(&cmds, f2),
            verdict((median(&cmds) - 2.0).abs() < 0.02)
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
    let _ = writeln!(w);
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
         `wrk -t{WRK_THREADS} -c{WRK_CONNECTIONS} -d{}s` after a {} s warm-up, `POST \
         /items/<key>/purchase` with a distinct key per request (a wrk Lua script numbers the \
         paths). Each variant is served in process by axum on a fresh multi-thread tokio runtime \
         with 2 workers, on a free loopback port, and torn down before the next; the variants \
         alternate within each run, so every ratio below compares numbers taken minutes apart \
         at most.\n",
        s.http_s, s.warmup_s
    );
    let _ = writeln!(
        w,
        "| variant | req/s | errors (non-2xx + socket) | client commands per request |\n|---|---|---|---|"
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
            "| {} | {} | {errors} | {}{breakdown} |",
            variant.describe(),
            stat(&rps, f0),
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
        let values: Vec<f64> = r
            .http
            .iter()
            .filter_map(|run| {
                let get = |v| run.iter().find(|(x, _)| *x == v).map(|(_, s)| s.rps);
                Some(get(num)? / get(den)?)
            })
            .collect();
        let _ = writeln!(
            w,
            "| {} / {} | {} | {} |",
            num.short(),
            den.short(),
            stat(&values, f2),
            if target.is_empty() { "–" } else { target }
        );
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
         10 s. Commands per cycle from a separate pass of {} cycles.\n",
        s.cycles.as_secs(),
        s.cycle_count_ops
    );
    let _ = writeln!(
        w,
        "| implementation | cycles/s | client commands per cycle |\n|---|---|---|"
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
        let cmds: Vec<f64> = samples.iter().map(|x| x.commands).collect();
        let _ = writeln!(
            w,
            "| {} | {} | {} ({}) |",
            peer.name(),
            stat(&rate, f0),
            stat(&cmds, f2),
            samples.last().map(|x| x.breakdown.as_str()).unwrap_or("")
        );
    }
    let _ = writeln!(w);
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
         it on pub/sub; its wait policy, `Wait::exponential(1 ms, 20 ms).deadline(30 s)`, only \
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
        "| waiters | processes | implementation | acquisitions/s | ideal/s | % of ideal | time per hand-off | per-waiter min | per-waiter max | max deviation from mean | wait p50 | wait p99 | client commands per acquisition | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (waiters, procs, peer, samples) in &r.contended {
        let get =
            |f: &dyn Fn(&ContendedSample) -> f64| -> Vec<f64> { samples.iter().map(f).collect() };
        let _ = writeln!(
            w,
            "| {waiters} | {procs} | {} | {} | {} | {} % | {} µs | {} | {} | {} % | {} ms | {} ms | {} ({}) | {} |",
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
         holds them all for {:.1} s while MONITOR counts the client \
         commands, then releases them. A lease counts as lost if its `Lease::is_lost()` is set \
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
        "| leases renewed per command | {} |\n",
        stat(&get(&|x| x.leases_per_command), f2)
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
