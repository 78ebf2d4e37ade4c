//! Real processes of `examples/inventory.rs`, and the purchase load that `tests/load.rs` and
//! `tests/faults.rs` run against them. Starting, capturing and killing processes, and the HTTP
//! client, are the test kit's (`tower_lock_testkit::process`, `tower_lock_testkit::http`).
//!
//! Every process started here is SIGKILLed and reaped when its guard drops, panics included.
#![allow(dead_code, unreachable_pub)]

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc, OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use tower_lock_testkit::{free_port, http::Http, process::Process};

/// Scales the load and hygiene runs: `TOWER_LOCK_LOAD_SCALE=20` sends 20x the default requests.
pub fn scale() -> usize {
    std::env::var("TOWER_LOCK_LOAD_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&s| s >= 1)
        .unwrap_or(1)
}

/// The `inventory` example's binary, built once per test binary with the feature set
/// `scripts/test.sh` uses (so under `cargo test --all-features` it is already up to date).
pub fn inventory_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| example_binary("inventory")).clone()
}

/// The example `name`'s binary, as `cargo test --workspace --all-features` builds it (what
/// `scripts/test.sh` runs): `cargo test --no-run` with the same arguments finds everything up to
/// date within a run of the suite, and builds the same artifacts in a run of one test binary.
/// (A `cargo build --tests --example` built every test target again in the `dev` profile,
/// about 75 s per run.)
pub fn example_binary(name: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    // Without the variables cargo sets for a test process (`CARGO_MANIFEST_DIR`,
    // `CARGO_PKG_NAME`, ...): build scripts that declare them (`ring`'s does) would see them
    // changed from the shell that built the suite, run again, and rebuild everything above them
    // (ring, rustls, redis, the crate, the suite: about 100 s of a 2-core machine, per run).
    for (var, _) in std::env::vars_os() {
        let var = var.to_string_lossy();
        let set_by_cargo_for_tests = var.starts_with("CARGO_PKG_")
            || var.starts_with("CARGO_BIN_EXE_")
            || matches!(
                &*var,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            );
        if set_by_cargo_for_tests {
            build.env_remove(&*var);
        }
    }
    let output = build
        .args([
            "test",
            "--workspace",
            "--all-features",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run `cargo test --no-run` for the {name} example: {e}"));
    assert!(
        output.status.success(),
        "`cargo test --no-run` (building the {name} example) failed"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        // The example, not a test target of the same name (`tests/sql.rs` beside
        // `examples/sql.rs`).
        .filter(|msg| {
            msg["target"]["name"] == name
                && msg["target"]["kind"]
                    .as_array()
                    .is_some_and(|kinds| kinds.iter().any(|k| k == "example"))
        })
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo did not report the {name} executable"))
}

/// One `inventory` process on a free loopback port; SIGKILLed on drop.
pub struct Instance {
    process: Process,
    pub port: u16,
}

impl Instance {
    /// Starts an instance with `REDIS_URL=redis_url` and `env`, and waits for "listening on".
    pub fn start(redis_url: &str, env: &[(&str, &str)]) -> Self {
        Self::start_binary(inventory_binary(), redis_url, env)
    }

    /// Starts an instance with `env` alone (no `REDIS_URL` unless `env` sets it: the in-memory
    /// store), and waits for "listening on".
    pub fn start_env(env: &[(&str, &str)]) -> Self {
        Self::start_binary_env(inventory_binary(), env)
    }

    /// Like [`start`](Self::start), for the example at `binary` (one that prints "listening on"
    /// once it serves: `inventory`, `payments`).
    pub fn start_binary(binary: PathBuf, redis_url: &str, env: &[(&str, &str)]) -> Self {
        let mut all = vec![("REDIS_URL", redis_url)];
        all.extend_from_slice(env);
        Self::start_binary_env(binary, &all)
    }

    /// The example at `binary` with `env` alone.
    pub fn start_binary_env(binary: PathBuf, env: &[(&str, &str)]) -> Self {
        for _ in 0..5 {
            let port = free_port();
            let mut command = Command::new(&binary);
            command
                .env_clear()
                .env("PORT", port.to_string())
                .env("HOST", "127.0.0.1")
                .env("RUST_LOG", "warn")
                .envs(env.iter().copied());
            let what = format!("{} on port {port}", binary.display());
            if let Some(process) =
                Process::start(command, &what, "listening on", Duration::from_secs(30))
            {
                return Self { process, port };
            }
        }
        panic!("{} did not start on any of 5 free ports", binary.display());
    }

    /// `kill -9`: the process dies without releasing anything.
    pub fn kill9(&mut self) {
        self.process.kill();
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        self.process.output()
    }

    /// SIGSTOP: the whole process stops (its timers and renewals with it), as in a long pause.
    pub fn pause(&self) {
        self.process.signal("STOP");
    }

    /// SIGCONT, after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.process.signal("CONT");
    }

    /// Panics if the process printed a panic message.
    pub fn assert_no_panic(&self) {
        let output = self.output();
        assert!(
            !output.contains("panicked"),
            "instance on port {} panicked:\n{output}",
            self.port
        );
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }
}

/// Sets `sku`'s stock through `port`, retrying while the instance answers 503 (Redis coming
/// back), for at most 10 s.
pub async fn set_stock(port: u16, sku: &str, stock: u64) {
    let mut http = Http::new(port);
    let started = Instant::now();
    loop {
        let body = format!("{{\"stock\":{stock}}}");
        match http
            .request("PUT", &format!("/items/{sku}"), Some(&body))
            .await
        {
            Ok(reply) if reply.status == 200 => return,
            other => assert!(
                started.elapsed() < Duration::from_secs(10),
                "cannot set the stock of {sku}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `sku`'s stock (`None` for an unknown SKU). A read takes a shared lease on the SKU, so it
/// waits for a purchase or an order of it (or a dead holder's lease) to end: one that gives up
/// (409) is sent again, for up to 30 s.
pub async fn get_stock(port: u16, sku: &str) -> Option<u64> {
    let started = Instant::now();
    loop {
        let reply = Http::new(port)
            .request("GET", &format!("/items/{sku}"), None)
            .await
            .expect("GET stock");
        match reply.status {
            200 => return reply.json()["stock"].as_u64(),
            404 => return None,
            409 if started.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("GET /items/{sku}: {other}"),
        }
    }
}

/// The SKUs of a load: a few hot ones (most requests), many cold ones.
#[derive(Debug, Clone)]
pub struct Plan {
    /// (sku, initial stock, work_ms per purchase)
    pub skus: Vec<(String, u64, u64)>,
    pub hot: usize,
    /// Share of requests (in percent) that go to the hot SKUs.
    pub hot_percent: u32,
    pub requests: usize,
    pub concurrency: usize,
    /// A request that takes longer than this is a hang: the load fails.
    pub request_timeout: Duration,
}

impl Plan {
    /// `requests` purchases: 3 hot SKUs with `hot_stock` items each, `cold` SKUs with 1..=3
    /// items each (so some run out: 422s), `prefix` names them.
    pub fn new(prefix: &str, requests: usize, hot_stock: u64, cold: usize) -> Self {
        let mut skus = Vec::new();
        for i in 0..3 {
            skus.push((format!("{prefix}-hot-{i}"), hot_stock, 2));
        }
        for i in 0..cold {
            skus.push((format!("{prefix}-cold-{i}"), 1 + (i as u64 % 3), 1));
        }
        Self {
            skus,
            hot: 3,
            hot_percent: 70,
            requests,
            concurrency: 24,
            request_timeout: Duration::from_secs(10),
        }
    }

    pub async fn seed(&self, port: u16) {
        for (sku, stock, _) in &self.skus {
            set_stock(port, sku, *stock).await;
        }
    }

    fn pick(&self, n: usize) -> usize {
        // Deterministic spread: request n goes hot with `hot_percent` probability.
        let r = fastrand_like(n as u64);
        if (r % 100) < u64::from(self.hot_percent) {
            (r / 100) as usize % self.hot
        } else {
            self.hot + (r / 100) as usize % (self.skus.len() - self.hot)
        }
    }
}

/// splitmix64: a fixed pseudo-random sequence, so a failing run can be replayed.
fn fastrand_like(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One purchase's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub sku: usize,
    /// `None`: no answer (connection failed or the request timed out).
    pub status: Option<u16>,
    pub stock: Option<u64>,
    pub fencing_token: Option<u64>,
    pub problem_type: Option<String>,
    pub latency: Duration,
}

/// Runs `plan.requests` purchases over `ports` (round robin) with `plan.concurrency` clients,
/// until done or `stop` is set.
pub async fn run_load(plan: &Plan, ports: &[u16], stop: Option<Arc<AtomicUsize>>) -> Vec<Outcome> {
    let plan = Arc::new(plan.clone());
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..plan.concurrency {
        let (plan, next, stop) = (Arc::clone(&plan), Arc::clone(&next), stop.clone());
        let port = ports[w % ports.len()];
        workers.push(tokio::spawn(async move {
            let mut http = Http::new(port);
            let mut out = Vec::new();
            loop {
                if stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst) > 0) {
                    break;
                }
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n >= plan.requests {
                    break;
                }
                let sku = plan.pick(n);
                let (name, _, work_ms) = &plan.skus[sku];
                let path = format!("/items/{name}/purchase?work_ms={work_ms}");
                let started = Instant::now();
                let reply =
                    tokio::time::timeout(plan.request_timeout, http.request("POST", &path, None))
                        .await;
                let latency = started.elapsed();
                let (status, json) = match reply {
                    Ok(Ok(reply)) => (Some(reply.status), reply.json()),
                    Ok(Err(_)) => (None, serde_json::Value::Null),
                    Err(_) => {
                        // Timed out: the connection is in an unknown state.
                        http = Http::new(port);
                        (None, serde_json::Value::Null)
                    }
                };
                out.push(Outcome {
                    sku,
                    status,
                    stock: json["stock"].as_u64(),
                    fencing_token: json["fencing_token"].as_u64(),
                    problem_type: json["type"].as_str().map(str::to_owned),
                    latency,
                });
            }
            out
        }));
    }
    let mut outcomes = Vec::new();
    for worker in workers {
        outcomes.extend(worker.await.expect("load worker panicked"));
    }
    outcomes
}

/// Counts of a load, by status.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub requests: usize,
    pub by_status: BTreeMap<u16, usize>,
    pub no_answer: usize,
    pub max_latency: Duration,
}

impl Counts {
    pub fn of(outcomes: &[Outcome]) -> Self {
        let mut counts = Self {
            requests: outcomes.len(),
            ..Self::default()
        };
        for o in outcomes {
            match o.status {
                Some(s) => *counts.by_status.entry(s).or_default() += 1,
                None => counts.no_answer += 1,
            }
            counts.max_latency = counts.max_latency.max(o.latency);
        }
        counts
    }

    pub fn get(&self, status: u16) -> usize {
        self.by_status.get(&status).copied().unwrap_or(0)
    }
}

/// What the exclusion check found, per SKU and in total.
#[derive(Debug, Default)]
pub struct Audit {
    /// Purchases answered 200 but missing from the final stock, summed over SKUs.
    pub lost_updates: u64,
    /// SKUs whose 200s outnumber their initial stock.
    pub oversold: Vec<String>,
    /// 200s whose reported stock did not strictly decrease in fencing-token order.
    pub fencing_violations: Vec<String>,
}

/// Compares each SKU's final stock with its 200s, and orders the 200s by fencing token.
pub async fn audit(plan: &Plan, outcomes: &[Outcome], port: u16, fenced: bool) -> Audit {
    let mut audit = Audit::default();
    let mut by_sku: HashMap<usize, Vec<&Outcome>> = HashMap::new();
    for o in outcomes.iter().filter(|o| o.status == Some(200)) {
        by_sku.entry(o.sku).or_default().push(o);
    }
    for (i, (name, initial, _)) in plan.skus.iter().enumerate() {
        let sold = by_sku.get(&i).map_or(0, Vec::len) as u64;
        let fin = get_stock(port, name).await.expect("stock vanished");
        let taken = initial
            .checked_sub(fin)
            .unwrap_or_else(|| panic!("{name}: stock rose from {initial} to {fin}"));
        if sold > *initial {
            audit
                .oversold
                .push(format!("{name}: {sold} sold of {initial}"));
        }
        audit.lost_updates += sold.saturating_sub(taken);
        assert!(
            taken <= sold,
            "{name}: stock fell by {taken} but only {sold} purchases succeeded"
        );
        if fenced && let Some(oks) = by_sku.get_mut(&i) {
            oks.sort_by_key(|o| o.fencing_token);
            for pair in oks.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                let ordered = a.fencing_token.is_some()
                    && a.fencing_token < b.fencing_token
                    && a.stock > b.stock;
                if !ordered {
                    audit.fencing_violations.push(format!(
                        "{name}: token {:?} left {:?}, then token {:?} left {:?}",
                        a.fencing_token, a.stock, b.fencing_token, b.stock
                    ));
                }
            }
        }
    }
    audit
}
