//! Shared test support: real `redis-server` processes, the backends the behaviour suite runs
//! against, and a small app with a deliberately non-atomic read-modify-write handler.
#![allow(dead_code, unreachable_pub)]

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
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                eprintln!("redis-server on port {} exited early: {status}", self.port);
                self.child = None;
                return false;
            }
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    fn ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = [0u8; 7];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut buf).is_ok()
            && &buf == b"+PONG\r\n"
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
        keys.into_iter()
            .filter(|k| !k.ends_with(b":fence"))
            .collect()
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
