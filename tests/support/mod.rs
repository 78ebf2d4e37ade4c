//! Shared test support, the tower-lock side of it: the backends the behaviour suite runs
//! against, a small app with a deliberately non-atomic read-modify-write handler, a
//! `MemoryStore` with knobs, and what the tests know of the crate's key and channel names.
//!
//! The processes (`redis-server`, clusters, sentinels, the fault proxy, free ports) are the test
//! kit's, `tower_lock_testkit`, shared with the benchmark.
#![allow(dead_code, unreachable_pub)]

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
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
use tower_lock::{LockLayer, MemoryStore, RedisStore, store::LockStore};
use tower_lock_testkit::RedisServer;

/// Every key under the crate's default prefix but the fencing counters and the fences of data
/// written through `tower_lock::fence`: what a test's leases left behind.
pub trait LockKeys {
    fn lock_keys(&self) -> impl Future<Output = Vec<Vec<u8>>> + Send;
}

impl LockKeys for RedisServer {
    async fn lock_keys(&self) -> Vec<Vec<u8>> {
        let mut conn = self.client().await;
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg("tower-lock:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.into_iter().filter(|k| is_lease_state(k)).collect()
    }
}

/// A key the store keeps next to a lock key, `<prefix>{<tag>}<role>:<rest of the lock key>`:
/// the hand-off queue (`queue`) or the idempotency record (`record`).
pub fn companion_key(key: &[u8], role: &str) -> Vec<u8> {
    let tag_end = key
        .iter()
        .position(|&b| b == b'}')
        .expect("a lock key has a hash tag")
        + 1;
    [&key[..tag_end], role.as_bytes(), b":", &key[tag_end..]].concat()
}

/// The hand-off queue of the lock key `key`.
pub fn queue_key(key: &[u8]) -> Vec<u8> {
    companion_key(key, "queue")
}

/// Whether `key` is an idempotency record (`<prefix>{<tag>}record:...`).
pub fn is_record_key(key: &[u8]) -> bool {
    has_role(key, b"record:")
}

/// Whether `key` is a hand-off queue (`<prefix>{<tag>}queue:...`).
pub fn is_queue_key(key: &[u8]) -> bool {
    has_role(key, b"queue:")
}

/// Whether `key`'s companion role (after its hash tag) is `role`.
fn has_role(key: &[u8], role: &[u8]) -> bool {
    key.iter()
        .position(|&b| b == b'}')
        .is_some_and(|end| key[end + 1..].starts_with(role))
}

/// Whether `key` is a lease's (a lock key, its queue or its record): not a fencing counter, and
/// not the fence of data written through `tower_lock::fence` (`<prefix>{<tag>}data-fence:...`),
/// which lives as long as the data.
pub fn is_lease_state(key: &[u8]) -> bool {
    let data_fence = key
        .iter()
        .position(|&b| b == b'}')
        .is_some_and(|end| key[end + 1..].starts_with(b"data-fence:"));
    !is_fence_counter(key) && !data_fence
}

/// Whether `key` is a lock key itself (`<prefix>{<tag>}` and then a digit, its scope's length),
/// not a companion (its queue, record, or a counted key's running sum, `weight:`).
pub fn is_lock_key(key: &[u8]) -> bool {
    is_lease_state(key)
        && key
            .iter()
            .position(|&b| b == b'}')
            .is_some_and(|end| key.get(end + 1).is_some_and(u8::is_ascii_digit))
}

/// Whether `key` is one of the fencing counters (`tower-lock:fence` on a server that does not
/// hash keys to slots, else one per hash slot, `tower-lock:fence:{<n>}`), the only keys a
/// released lock leaves behind.
pub fn is_fence_counter(key: &[u8]) -> bool {
    key == b"tower-lock:fence"
        || key
            .strip_prefix(b"tower-lock:fence:{")
            .and_then(|rest| rest.strip_suffix(b"}"))
            .is_some_and(|n| !n.is_empty() && n.iter().all(u8::is_ascii_digit))
}

/// The value of `key` on `server` (`None`: missing).
pub async fn value_of(server: &RedisServer, key: &[u8]) -> Option<Vec<u8>> {
    let mut conn = server.client().await;
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The names of the keys on `server` that match `pattern` (Redis's `KEYS`).
pub async fn keys_matching(server: &RedisServer, pattern: &str) -> Vec<String> {
    let mut conn = server.client().await;
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The default lock config but for its TTL.
pub fn ttl_config(ttl: Duration) -> tower_lock::LockConfig {
    tower_lock::LockConfig::builder().ttl(ttl).build().unwrap()
}

/// The `INFO section` text of the server behind `conn`.
pub async fn info(conn: &mut redis::aio::MultiplexedConnection, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .unwrap()
}

/// Deletes `key` on `server` behind its holder's back (as an expiry or an eviction would).
pub async fn delete_key(server: &RedisServer, key: &[u8]) {
    let mut conn = server.client().await;
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Deletes the one lock key `server` holds behind its holder's back; panics if there is not
/// exactly one.
pub async fn delete_the_held_key(server: &RedisServer) {
    let keys = server.lock_keys().await;
    assert_eq!(keys.len(), 1, "expected the one held key");
    delete_key(server, &keys[0]).await;
}

/// Sets `key` on `server` to another holder's token for 10 s, as a holder that took it after
/// an expiry would.
pub async fn give_key_to_someone_else(server: &RedisServer, key: &[u8]) {
    let mut conn = server.client().await;
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("someone-else")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Waits until `key`'s hand-off queue on `server` holds `n` waiters; panics after 5 s, naming
/// `who` as the waiter that never queued.
pub async fn wait_until_queued(server: &RedisServer, key: &[u8], n: usize, who: &str) {
    let queue = queue_key(key);
    let started = std::time::Instant::now();
    loop {
        let mut conn = server.client().await;
        let len: usize = redis::cmd("LLEN")
            .arg(&queue)
            .query_async(&mut conn)
            .await
            .unwrap();
        if len == n {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{who} never queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `n` lockers over stores standing for separate processes on `server`, their hand-off
/// subscriptions up, each waiting up to 30 s (retrying every 2 s when not handed the key).
pub async fn processes(server: &RedisServer, n: usize) -> Vec<tower_lock::Locker> {
    let mut stores = Vec::new();
    for _ in 0..n {
        stores.push(RedisStore::connect(server.url()).await.unwrap());
    }
    handoff_subscriptions(server, n).await;
    let config = tower_lock::LockConfig::builder()
        .wait(
            tower_lock::Wait::constant(Duration::from_secs(2))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    stores
        .into_iter()
        .map(|store| tower_lock::Locker::with_config(store, config.clone()))
        .collect()
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

/// A store backend for the behaviour suite: every call to `store` is a new handle onto the same
/// shared leases, as a separate server instance would open.
pub trait Backend: Send + Sync + 'static {
    type Store: LockStore + Clone;
    fn store(&self) -> impl Future<Output = Self::Store> + Send;
    /// Whether two handles exclude each other across processes (false for memory).
    const NAME: &'static str;
}

/// Several suite tests, one after the other, on one backend: every handle is the shared
/// backend's.
impl<B: Backend> Backend for Arc<B> {
    type Store = B::Store;
    const NAME: &'static str = B::NAME;
    async fn store(&self) -> B::Store {
        B::store(self).await
    }
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

/// A `RedisStore` on the test server `server`, configured as `RedisStore::connect` leaves it.
pub async fn connect(server: &RedisServer) -> RedisStore {
    RedisStore::connect(server.url())
        .await
        .unwrap_or_else(|e| panic!("connect to the test server at {}: {e}", server.url()))
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
        connect(&self.0).await
    }
}

/// `RedisStore` without hand-off on the test server (Redis or Valkey): its acquire script takes
/// another path for a held key, and on Valkey it releases and renews with the native compare
/// commands.
pub struct NoHandoff(pub RedisServer);

impl Backend for NoHandoff {
    type Store = RedisStore;
    const NAME: &'static str = "without hand-off";
    async fn store(&self) -> RedisStore {
        connect(&self.0).await.handoff(false).unwrap()
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

/// Asserts that the problem+json `body` is of the problem type whose URI ends in `suffix`
/// (`"#lock-store-unavailable"`, say); the message shows the body.
pub fn assert_problem_type(body: &serde_json::Value, suffix: &str) {
    let type_uri = body["type"].as_str().unwrap();
    assert!(type_uri.ends_with(suffix), "not {suffix}: {body}");
}

/// Asserts that `app`, a [`counter_app`] over `counter` that does not wait, lets one request
/// at a time hold the key `k`: while one purchase works 500 ms another gets 409, and once it
/// is done the next gets 200.
pub async fn assert_one_holder_at_a_time(app: &Router, counter: &Counter) {
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 500)).await.status() }
    });
    wait_until(|| counter.inside.load(Ordering::SeqCst) == 1).await;
    assert_eq!(
        send(app, purchase("k", 0)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(running.await.unwrap(), StatusCode::OK);
    assert_eq!(send(app, purchase("k", 0)).await.status(), StatusCode::OK);
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
// Backends on topologies the kit starts: independent masters (Redlock), a cluster.

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
    type Store = tower_lock::store::RedlockStore;
    const NAME: &'static str = "redlock";
    async fn store(&self) -> tower_lock::store::RedlockStore {
        tower_lock::store::RedlockStore::connect(self.urls())
            .await
            .expect("connect to the test redis-servers")
            // Generous, so that a loaded CI machine does not turn slow answers into failures.
            .node_timeout(Duration::from_millis(250))
    }
}

#[cfg(feature = "cluster")]
pub struct Cluster(pub tower_lock_testkit::RedisCluster);

#[cfg(feature = "cluster")]
impl Backend for Cluster {
    type Store = tower_lock::store::ClusterStore;
    const NAME: &'static str = "cluster";
    async fn store(&self) -> tower_lock::store::ClusterStore {
        tower_lock::store::ClusterStore::connect(self.0.urls())
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
        token: &tower_lock::store::Token,
        ttl: Duration,
    ) -> Result<tower_lock::store::Acquire, tower_lock::store::StoreError> {
        tokio::time::sleep(self.acquire_delay).await;
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::store::Token,
        ttl: Duration,
    ) -> Result<bool, tower_lock::store::StoreError> {
        tokio::time::sleep(self.renew_delay).await;
        self.inner.renew(key, token, ttl).await
    }

    async fn release(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::store::Token,
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

// ---------------------------------------------------------------------------------------------
// A shop: single purchases and orders of several SKUs, over the same locks.

/// The namespace both of the shop's layers lock SKUs in, so that an order and a single
/// purchase of one SKU take the same lock.
pub const SKU_NAMESPACE: &str = "sku";

/// One [`Counter`] per SKU: a purchase adds one to its SKU's, an order one to each of its SKUs'.
pub struct Shop {
    pub skus: HashMap<String, Arc<Counter>>,
}

impl Shop {
    pub fn new<'a>(skus: impl IntoIterator<Item = &'a str>) -> Arc<Self> {
        Arc::new(Self {
            skus: skus
                .into_iter()
                .map(|s| (s.to_owned(), Counter::new()))
                .collect(),
        })
    }

    /// Sum over the SKUs of how many overlaps each saw.
    pub fn overlaps(&self) -> usize {
        self.skus
            .values()
            .map(|c| c.overlaps.load(Ordering::SeqCst))
            .sum()
    }
}

#[derive(Deserialize)]
struct OrderBody {
    items: Vec<OrderLine>,
}

#[derive(Deserialize)]
struct OrderLine {
    sku: String,
}

/// `POST /items/{sku}/purchase?work_ms=N` and `POST /orders?work_ms=N` with
/// `{"items": [{"sku": ..}, ..]}`: read each SKU's counter, sleep, write each +1, with an
/// overlap detector per SKU, and each write recorded with its key's fencing token. Locked by
/// `locker` (both routes, in [`SKU_NAMESPACE`]) unless `None`.
pub fn shop_app(shop: Arc<Shop>, locker: Option<tower_lock::Locker>) -> Router {
    async fn run(
        shop: &Shop,
        lease: Option<&tower_lock::Lease>,
        skus: &[String],
        work_ms: u64,
    ) -> Result<Json<serde_json::Value>, StatusCode> {
        let mut skus: Vec<&String> = skus.iter().collect();
        skus.sort();
        skus.dedup();
        let counters = skus
            .iter()
            .map(|s| shop.skus.get(*s).ok_or(StatusCode::NOT_FOUND))
            .collect::<Result<Vec<_>, _>>()?;
        for counter in &counters {
            if counter.inside.fetch_add(1, Ordering::SeqCst) > 0 {
                counter.overlaps.fetch_add(1, Ordering::SeqCst);
            }
        }
        let read: Vec<u64> = counters
            .iter()
            .map(|c| c.value.load(Ordering::SeqCst))
            .collect();
        tokio::time::sleep(Duration::from_millis(work_ms)).await;
        let mut tokens = serde_json::Map::new();
        for ((sku, counter), read) in skus.iter().zip(&counters).zip(read) {
            counter.value.store(read + 1, Ordering::SeqCst);
            let fence = lease.and_then(|lease| {
                lease
                    .fencing_tokens()
                    .find(|(key, _)| key.value() == sku.as_bytes())
                    .map(|(_, token)| token)
            });
            if let Some(fence) = fence {
                counter.writes.lock().unwrap().push((fence, read + 1));
                tokens.insert((*sku).clone(), fence.into());
            }
            counter.inside.fetch_sub(1, Ordering::SeqCst);
            counter.finished.fetch_add(1, Ordering::SeqCst);
        }
        Ok(Json(serde_json::json!({ "fencing_tokens": tokens })))
    }

    let purchase = {
        let shop = Arc::clone(&shop);
        post(
            move |lease: Option<tower_lock::Lease>,
                  Path(sku): Path<String>,
                  Query(work): Query<Work>| {
                let shop = Arc::clone(&shop);
                async move { run(&shop, lease.as_ref(), &[sku], work.work_ms).await }
            },
        )
    };
    let order = {
        let shop = Arc::clone(&shop);
        post(
            move |lease: Option<tower_lock::Lease>,
                  Query(work): Query<Work>,
                  Json(order): Json<OrderBody>| {
                let shop = Arc::clone(&shop);
                async move {
                    let skus: Vec<String> = order.items.into_iter().map(|l| l.sku).collect();
                    run(&shop, lease.as_ref(), &skus, work.work_ms).await
                }
            },
        )
    };
    let (purchase, order) = match locker {
        Some(locker) => (
            purchase.route_layer(
                LockLayer::from_locker(locker.clone(), tower_lock::Key::path_param("sku"))
                    .namespace(SKU_NAMESPACE),
            ),
            order.route_layer(
                LockLayer::from_locker(locker, tower_lock::Key::json("/items/*/sku").unwrap())
                    .namespace(SKU_NAMESPACE),
            ),
        ),
        None => (purchase, order),
    };
    Router::new()
        .route("/items/{sku}/purchase", purchase)
        .route("/orders", order)
}

/// `POST /orders?work_ms=N` for `skus`.
pub fn order(skus: &[&str], work_ms: u64) -> Request<Body> {
    let items: Vec<serde_json::Value> = skus
        .iter()
        .map(|s| serde_json::json!({ "sku": s, "qty": 1 }))
        .collect();
    Request::post(format!("/orders?work_ms={work_ms}"))
        .header("content-type", "application/json")
        .body(Body::from(
            serde_json::json!({ "items": items }).to_string(),
        ))
        .unwrap()
}

/// Sends `purchase(sku, work_ms)` through `app` from a spawned task and returns once its handler
/// runs (the request holds `sku`'s key); the task answers the request's status.
pub async fn purchase_in_flight(
    app: &Router,
    counter: &Counter,
    sku: &str,
    work_ms: u64,
) -> tokio::task::JoinHandle<StatusCode> {
    let running = tokio::spawn({
        let (app, request) = (app.clone(), purchase(sku, work_ms));
        async move { send(&app, request).await.status() }
    });
    wait_until(|| counter.inside.load(Ordering::SeqCst) > 0).await;
    running
}

/// Polls `cond` until true, for at most 5 s.
pub async fn wait_until(cond: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "condition not reached"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A `MakeWriter` that keeps everything logged, to search it: every writer it makes appends to
/// the one buffer.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl tracing_subscriber::fmt::MakeWriter<'_> for Captured {
    type Writer = Self;
    fn make_writer(&self) -> Self {
        self.clone()
    }
}
