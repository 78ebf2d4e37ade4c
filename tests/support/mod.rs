//! Shared test support: real `redis-server` processes, the backends the behaviour suite runs
//! against, and a small app with a deliberately non-atomic read-modify-write handler.
#![allow(dead_code, unreachable_pub)]

pub mod proxy;
pub mod sentinel;

use std::{
    future::Future,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    body::Body,
    extract::{Path, Query},
    http::{Request, Response, StatusCode},
    routing::post,
};
use serde::Deserialize;
use tower::ServiceExt;
use tower_lock::{LockLayer, LockStore, MemoryStore, RedisStore};

/// A `redis-server` this test started, on a free loopback port; killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// Extra `redis-server` arguments (replication, cluster mode), kept for restarts.
    extra_args: Vec<String>,
}

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

impl RedisServer {
    /// Starts a fresh server. Panics, loudly, if `redis-server` is not installed.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a fresh server with extra `redis-server` arguments.
    pub fn start_with(extra_args: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("cannot create a temp dir for redis-server");
        for _ in 0..5 {
            let mut server = Self {
                child: None,
                port: free_port(),
                dir: dir.clone(),
                extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `redis-server` ({e}). The Redis tests need a real server: \
                     install it (`apt-get install -y redis-server`) or run `scripts/test.sh`, \
                     which does."
                )
            });
        self.child = Some(child);
        let port = self.port;
        if wait_until_up(&mut self.child, "redis-server", port, || ping(port)) {
            return true;
        }
        self.kill();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let start = Instant::now();
        while !self.spawn() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A plain connection for inspecting or tampering with the server.
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("cannot connect to the test redis-server")
    }

    /// Every key under the crate's default prefix.
    pub async fn lock_keys(&self) -> Vec<Vec<u8>> {
        let mut conn = self.client().await;
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg("tower-lock:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.into_iter().filter(|k| !is_fence_counter(k)).collect()
    }
}

/// Whether `key` is one of the fencing counters (one per hash slot, `tower-lock:fence:{<n>}`),
/// the only keys a released lock leaves behind.
pub fn is_fence_counter(key: &[u8]) -> bool {
    key.strip_prefix(b"tower-lock:fence:{")
        .and_then(|rest| rest.strip_suffix(b"}"))
        .is_some_and(|n| !n.is_empty() && n.iter().all(u8::is_ascii_digit))
}

/// How many times `command` ran on `server`, by clients or inside scripts (`INFO
/// commandstats`; `command` as Redis names it there, e.g. `evalsha`, `wait`).
pub async fn calls_of(server: &RedisServer, command: &str) -> u64 {
    let mut conn = server.client().await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Waits until `n` stores' hand-off subscriptions (opened by `RedisStore::connect`) are up;
/// answers their channels.
pub async fn handoff_subscriptions(server: &RedisServer, n: usize) -> Vec<String> {
    let mut conn = server.client().await;
    let started = std::time::Instant::now();
    loop {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg("tower-lock:handoff:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        if channels.len() >= n {
            return channels;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "hand-off subscriptions not up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A store backend for the behaviour suite: every call to `store` is a new handle onto the same
/// shared leases, as a separate server instance would open.
pub trait Backend: Send + Sync + 'static {
    type Store: LockStore + Clone;
    fn store(&self) -> impl Future<Output = Self::Store> + Send;
    /// Whether two handles exclude each other across processes (false for memory).
    const NAME: &'static str;
}

pub struct Memory(MemoryStore);

impl Memory {
    pub fn new() -> Self {
        Self(MemoryStore::new())
    }
}

impl Backend for Memory {
    type Store = MemoryStore;
    const NAME: &'static str = "memory";
    async fn store(&self) -> MemoryStore {
        self.0.clone()
    }
}

pub struct Redis(pub RedisServer);

impl Redis {
    pub fn new() -> Self {
        Self(RedisServer::start())
    }
}

impl Backend for Redis {
    type Store = RedisStore;
    const NAME: &'static str = "redis";
    async fn store(&self) -> RedisStore {
        RedisStore::connect(self.0.url())
            .await
            .expect("connect to the test redis-server")
    }
}

/// Shared state of the test app: a counter updated by a non-atomic read-modify-write, a log of
/// (fencing token, value written), and an overlap detector for the critical section.
#[derive(Default)]
pub struct Counter {
    pub value: AtomicU64,
    pub writes: Mutex<Vec<(u64, u64)>>,
    pub inside: AtomicUsize,
    pub overlaps: AtomicUsize,
    pub finished: AtomicUsize,
}

impl Counter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Asserts that every successful write was fenced and that fencing tokens order them.
    pub fn assert_fenced_in_order(&self) {
        let mut writes = self.writes.lock().unwrap().clone();
        writes.sort();
        for pair in writes.windows(2) {
            assert!(pair[0].0 < pair[1].0, "fencing token repeated: {pair:?}");
            assert!(
                pair[0].1 < pair[1].1,
                "a later fencing token wrote an older value: {pair:?}"
            );
        }
    }
}

#[derive(Deserialize)]
struct Work {
    #[serde(default)]
    work_ms: u64,
}

/// `POST /items/{sku}/purchase?work_ms=N`: read, sleep, write +1, with an overlap detector.
pub fn counter_app(counter: Arc<Counter>, layer: Option<LockLayer>) -> Router {
    let route = post(
        move |lease: Option<tower_lock::Lease>,
              Path(_sku): Path<String>,
              Query(work): Query<Work>| {
            let counter = Arc::clone(&counter);
            async move {
                if counter.inside.fetch_add(1, Ordering::SeqCst) > 0 {
                    counter.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let read = counter.value.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(work.work_ms)).await;
                counter.value.store(read + 1, Ordering::SeqCst);
                let fence = lease.as_ref().map(|l| l.fencing_token());
                if let Some(fence) = fence {
                    counter.writes.lock().unwrap().push((fence, read + 1));
                }
                counter.inside.fetch_sub(1, Ordering::SeqCst);
                counter.finished.fetch_add(1, Ordering::SeqCst);
                let lost = lease.as_ref().is_some_and(|l| l.is_lost());
                Json(serde_json::json!({ "value": read + 1, "fencing_token": fence, "lost": lost }))
            }
        },
    );
    let router = Router::new().route("/items/{sku}/purchase", route);
    match layer {
        Some(layer) => router.route_layer(layer),
        None => router,
    }
}

/// Sends one request through `app` (no network).
pub async fn send(app: &Router, req: Request<Body>) -> Response<Body> {
    app.clone().oneshot(req).await.unwrap()
}

pub fn purchase(sku: &str, work_ms: u64) -> Request<Body> {
    Request::post(format!("/items/{sku}/purchase?work_ms={work_ms}"))
        .body(Body::empty())
        .unwrap()
}

pub async fn body_json(response: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes)))
}

/// Status counts of a batch of responses.
#[derive(Debug, Default)]
pub struct Tally {
    pub ok: usize,
    pub conflict: usize,
    pub unavailable: usize,
    pub other: Vec<StatusCode>,
}

impl Tally {
    pub fn add(&mut self, status: StatusCode) {
        match status {
            StatusCode::OK => self.ok += 1,
            StatusCode::CONFLICT => self.conflict += 1,
            StatusCode::SERVICE_UNAVAILABLE => self.unavailable += 1,
            other => self.other.push(other),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Topologies: a master with replicas, independent masters (Redlock), a cluster.

/// Runs `redis-cli` with `args`; panics, loudly, if it is missing or fails.
pub fn redis_cli(args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `redis-cli` ({e}). The cluster tests need it: install it \
                 (`apt-get install -y redis-tools`) or run `scripts/test.sh`, which does."
            )
        });
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "redis-cli {args:?} failed: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    text
}

impl RedisServer {
    /// Starts a replica of `master` and waits until its replication link is up.
    pub fn replica_of(master: &RedisServer) -> Self {
        // Diskless sync waits 5 s by default for more replicas to join; no need here.
        master.cli(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        let port = master.port().to_string();
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &port]);
        replica.wait_for_info("master_link_status:up");
        master.wait_for_replica_acks(1);
        replica
    }

    /// Waits until `n` replicas acknowledge a write (after a sync, the master counts a replica
    /// only once it has sent its first `REPLCONF ACK`, up to a second later).
    pub fn wait_for_replica_acks(&self, n: usize) {
        let start = Instant::now();
        let probe = format!("INCR replication-probe\r\nWAIT {n} 100\r\n");
        loop {
            let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            stream.write_all(probe.as_bytes()).unwrap();
            let mut reply = Vec::new();
            let mut buf = [0u8; 64];
            // Two integer replies: ":<counter>\r\n:<acks>\r\n".
            while reply.iter().filter(|&&b| b == b'\n').count() < 2 {
                let read = stream.read(&mut buf).unwrap();
                assert!(read > 0, "port {}: connection closed", self.port);
                reply.extend_from_slice(&buf[..read]);
            }
            let text = String::from_utf8_lossy(&reply);
            let acks: usize = text
                .lines()
                .nth(1)
                .and_then(|l| l.trim().strip_prefix(':')?.parse().ok())
                .unwrap_or(0);
            if acks >= n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {}: {n} replicas never acknowledged: {text}",
                self.port
            );
        }
    }

    /// `redis-cli -p <port> <args>` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let port = self.port.to_string();
        let mut all = vec!["-p", &port];
        all.extend_from_slice(args);
        redis_cli(&all)
    }

    /// Polls `INFO` until it contains `needle`, for at most 10 s.
    pub fn wait_for_info(&self, needle: &str) {
        let start = Instant::now();
        while !self.cli(&["INFO"]).contains(needle) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {}: INFO never showed {needle:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Independent masters for a Redlock store.
pub struct Redlock(pub Vec<RedisServer>);

impl Redlock {
    pub fn new(n: usize) -> Self {
        Self((0..n).map(|_| RedisServer::start()).collect())
    }

    pub fn urls(&self) -> Vec<String> {
        self.0.iter().map(RedisServer::url).collect()
    }
}

impl Backend for Redlock {
    type Store = tower_lock::RedlockStore;
    const NAME: &'static str = "redlock";
    async fn store(&self) -> tower_lock::RedlockStore {
        tower_lock::RedlockStore::connect(self.urls())
            .await
            .expect("connect to the test redis-servers")
            // Generous, so that a loaded CI machine does not turn slow answers into failures.
            .node_timeout(Duration::from_millis(250))
    }
}

/// A Redis Cluster node started alone, owning every slot (`CLUSTER ADDSLOTSRANGE 0 16383`): a
/// "cluster mode, one shard" server, as managed services offer, to reach through a plain
/// connection. Refuses a script whose keys hash to several slots (`CROSSSLOT`).
pub fn one_node_cluster() -> RedisServer {
    let server = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    server.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
    let start = Instant::now();
    while !server
        .cli(&["CLUSTER", "INFO"])
        .contains("cluster_state:ok")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the one-node cluster never reached cluster_state:ok"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// The hash slot of `key`, by the Redis Cluster specification's rule (CRC16/XMODEM of the part
/// between the first `{` and the next `}`, if not empty, else of the whole key, modulo 16384),
/// written independently of the crate's own.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    let crc = hashed.iter().fold(0u16, |mut crc, &b| {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
        crc
    });
    crc % 16384
}

/// How many errors starting with `code` (`TRYAGAIN`, `CROSSSLOT`) `server` answered, from
/// `INFO errorstats`.
pub fn errors_of(server: &RedisServer, code: &str) -> u64 {
    let prefix = format!("errorstat_{code}:count=");
    server
        .cli(&["INFO", "errorstats"])
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str())?.parse().ok())
        .unwrap_or(0)
}

/// A Redis Cluster on loopback: `masters` masters, each with `replicas` replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let replicas = replicas.to_string();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        redis_cli(&args);
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        cluster
    }

    /// A cluster of one master that owns every slot (`CLUSTER ADDSLOTSRANGE`), with extra
    /// `redis-server` arguments.
    pub fn one_node(extra_args: &[&str]) -> Self {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ];
        args.extend_from_slice(extra_args);
        let node = RedisServer::start_with(&args);
        node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
        let cluster = Self { nodes: vec![node] };
        cluster.wait_until_ok();
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok` and agrees on the masters.
    pub fn wait_until_ok(&self) {
        let start = Instant::now();
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.child.is_some())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            if ok {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the cluster never reached cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node serving `slot` as master, from a running node's `CLUSTER NODES`.
    pub fn master_of(&self, slot: u16) -> &RedisServer {
        self.try_master_of(slot)
            .unwrap_or_else(|| panic!("no healthy master serves slot {slot}"))
    }

    /// The healthy node serving `slot` as master, if any (none mid-failover).
    pub fn try_master_of(&self, slot: u16) -> Option<&RedisServer> {
        let asker = self.nodes.iter().find(|n| n.child.is_some()).unwrap();
        let nodes = asker.cli(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| {
                let mut ends = range.split('-').map(|p| p.parse::<u16>());
                match (ends.next(), ends.next()) {
                    (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
                    (Some(Ok(a)), None) => a == slot,
                    _ => false,
                }
            });
            if serves {
                let port: u16 = fields[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                return self.nodes.iter().find(|n| n.port() == port);
            }
        }
        None
    }

    /// The running masters.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some() && n.cli(&["ROLE"]).starts_with("master"))
            .collect()
    }

    /// The key's hash slot.
    pub fn slot(&self, key: &[u8]) -> u16 {
        let asker = self.nodes.iter().find(|n| n.child.is_some()).unwrap();
        asker
            .cli(&["CLUSTER", "KEYSLOT", std::str::from_utf8(key).unwrap()])
            .trim()
            .parse()
            .unwrap()
    }
}

#[cfg(feature = "cluster")]
pub struct Cluster(pub RedisCluster);

#[cfg(feature = "cluster")]
impl Backend for Cluster {
    type Store = tower_lock::ClusterStore;
    const NAME: &'static str = "cluster";
    async fn store(&self) -> tower_lock::ClusterStore {
        tower_lock::ClusterStore::connect(self.0.urls())
            .await
            .expect("connect to the test cluster")
    }
}

/// A `MemoryStore` with knobs, for the layer's own behaviour: a slow release or renewal, or no
/// release announcements (the trait's default `watch`).
#[derive(Clone, Default)]
pub struct Tweaked {
    pub inner: MemoryStore,
    /// How long each release waits before it reaches the store.
    pub release_delay: Duration,
    /// How long each release's answer takes after the store released.
    pub release_answer_delay: Duration,
    /// How long each renewal waits before it reaches the store.
    pub renew_delay: Duration,
    /// Whether waiters are told about releases (as `MemoryStore` does).
    pub announce: bool,
    /// How long each acquire waits before it reaches the store.
    pub acquire_delay: Duration,
}

impl LockStore for Tweaked {
    async fn acquire(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::Token,
        ttl: Duration,
    ) -> Result<tower_lock::store::Acquire, tower_lock::store::StoreError> {
        tokio::time::sleep(self.acquire_delay).await;
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::Token,
        ttl: Duration,
    ) -> Result<bool, tower_lock::store::StoreError> {
        tokio::time::sleep(self.renew_delay).await;
        self.inner.renew(key, token, ttl).await
    }

    async fn release(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::Token,
    ) -> Result<bool, tower_lock::store::StoreError> {
        tokio::time::sleep(self.release_delay).await;
        let released = self.inner.release(key, token).await;
        tokio::time::sleep(self.release_answer_delay).await;
        released
    }

    /// The inner store's (its release notices), when `announce`; none otherwise.
    fn capabilities(&self) -> tower_lock::store::Capabilities {
        if self.announce {
            self.inner.capabilities()
        } else {
            tower_lock::store::Capabilities::none()
        }
    }
}

/// Whether a server on `port` answers `PING` with `PONG`.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut buf).is_ok()
        && &buf == b"+PONG\r\n"
}

/// Waits up to 10 s for `up` to hold of the server `child` runs on `port`; `false` (and the child
/// forgotten) if it exits first.
pub fn wait_until_up(
    child: &mut Option<Child>,
    what: &str,
    port: u16,
    mut up: impl FnMut() -> bool,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Some(status) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            eprintln!("{what} on port {port} exited early: {status}");
            *child = None;
            return false;
        }
        if up() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}
