//! Faults, each with its invariant: Redis killed mid-load, Redis stalled behind the proxy and
//! with `CLIENT PAUSE` (also through a default-built bb8 pool), connections dropped and refused,
//! latency beyond a third of the TTL, an app instance `kill -9`'d while holding keys, clients
//! that disconnect mid-request, handlers that panic on a real server, and Redis restarted empty
//! under many holders.
//!
//! Network faults go through the test kit's `Proxy`; server faults are `redis-server` kills and
//! `CLIENT PAUSE`; app faults are real `examples/inventory.rs` processes.

use crate::instances;
use crate::support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    extract::{Path, Query},
    http::StatusCode,
    routing::post,
};
use bb8_redis::{RedisConnectionManager, bb8};
use instances::{Counts, Instance, Plan, audit, run_load};
use serde::Deserialize;
use support::{LockKeys, body_json, purchase, send};
use tower_lock::{
    Key, Lease, LockConfig, LockLayer, RedisStore, Wait, config::OnLeaseLost, store::LockStore,
};
use tower_lock_testkit::{Proxy, RedisServer, calls_of, http::Http};

// -------------------------------------------------------------------------------------------
// An in-process app whose handler fences its writes and detects overlapping holders.

/// The protected resource: a value written with a fencing token (a write with a token lower
/// than the last accepted one is refused), and an overlap detector around the critical section
/// that survives the handler being dropped mid-way (abort on lease loss).
#[derive(Default)]
struct Books {
    inside: AtomicUsize,
    overlaps: AtomicUsize,
    entered: AtomicUsize,
    /// (last accepted fencing token, value)
    value: Mutex<(u64, u64)>,
    accepted: AtomicUsize,
    rejected: AtomicUsize,
}

struct Inside<'a>(&'a Books);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Books {
    fn enter(&self) -> Inside<'_> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        if self.inside.fetch_add(1, Ordering::SeqCst) > 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Inside(self)
    }

    fn write(&self, token: u64, value: u64) -> bool {
        let mut v = self.value.lock().unwrap();
        if token > v.0 {
            *v = (token, value);
            self.accepted.fetch_add(1, Ordering::SeqCst);
            true
        } else {
            self.rejected.fetch_add(1, Ordering::SeqCst);
            false
        }
    }
}

#[derive(Deserialize)]
struct Params {
    #[serde(default)]
    work_ms: u64,
    #[serde(default)]
    panic: bool,
}

fn books_app(books: Arc<Books>, layer: LockLayer) -> Router {
    let handler = move |lease: Lease, Path(_sku): Path<String>, Query(p): Query<Params>| {
        let books = Arc::clone(&books);
        async move {
            assert!(!p.panic, "handler panicked on purpose");
            let _inside = books.enter();
            let read = books.value.lock().unwrap().1;
            tokio::time::sleep(Duration::from_millis(p.work_ms)).await;
            let accepted = books.write(lease.fencing_token(), read + 1);
            Json(serde_json::json!({
                "accepted": accepted,
                "fencing_token": lease.fencing_token(),
                "lost": lease.is_lost(),
            }))
        }
    };
    Router::new()
        .route("/items/{sku}/purchase", post(handler))
        .route_layer(layer)
}

fn layer(store: impl LockStore, config: LockConfig) -> LockLayer {
    LockLayer::with_config(store, Key::path_param("sku"), config)
}

async fn connect(url: &str) -> RedisStore {
    RedisStore::connect(url).await.expect("connect to redis")
}

/// Serves `app` on a free loopback port in this runtime.
async fn serve(app: Router) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    port
}

/// Lock keys (not their companions, fencing counters, nor the stock's fences) in `redis`, over
/// one connection.
async fn held(conn: &mut redis::aio::MultiplexedConnection) -> usize {
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("tower-lock:*")
        .query_async(conn)
        .await
        .unwrap();
    keys.iter().filter(|k| support::is_lock_key(k)).count()
}

async fn wait_for(what: &str, limit: Duration, mut cond: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !cond().await {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    started.elapsed()
}

/// Sends one purchase and checks it is a 503 store-unavailable within `bound`.
async fn assert_503_within(app: &Router, sku: &str, bound: Duration) -> Duration {
    let started = Instant::now();
    let response = send(app, purchase(sku, 0)).await;
    let took = started.elapsed();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{sku}");
    let body = body_json(response).await;
    support::assert_problem_type(&body, "#lock-store-unavailable");
    assert!(took < bound, "503 after {took:?}, bound {bound:?}");
    took
}

async fn recovers(app: &Router, sku: &str) -> Duration {
    let started = Instant::now();
    loop {
        let status = send(app, purchase(sku, 0)).await.status();
        if status == StatusCode::OK {
            return started.elapsed();
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "no recovery within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// -------------------------------------------------------------------------------------------
// Stalls

const DEADLINE: Duration = Duration::from_millis(500);
/// The layer's default store timeout, the least an acquire attempt gets.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);
const MARGIN: Duration = Duration::from_millis(700);

fn bounded() -> LockConfig {
    LockConfig::builder()
        .wait(Wait::default().deadline(DEADLINE))
        .build()
        .unwrap()
}

/// A stalled network (the proxy accepts and reads, never answers): every request is a 503
/// within the wait deadline plus the store timeout, on the open connection and on fresh ones
/// whose handshake never completes. Acquires that were stuck in the stall and reach Redis
/// after it heals are released (the guard armed before each attempt), so no key is left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_stall_answers_503_within_the_deadline() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let app = books_app(
        Arc::default(),
        layer(connect(&proxy.url()).await, bounded()),
    );
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    let bound = DEADLINE.max(STORE_TIMEOUT) + MARGIN;

    // 1. The open connection stalls.
    proxy.stall();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { assert_503_within(&app, &format!("s{i}"), bound).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // The held bytes flow: late acquires, then their releases, on the same connection.
    proxy.heal();
    let mut conn = redis.client().await;
    wait_for(
        "keys taken during the stall released",
        Duration::from_secs(3),
        async || held(&mut conn).await == 0,
    )
    .await;
    recovers(&app, "k").await;

    // 2. Every connection dropped while stalled: the reconnect's handshake never answers.
    proxy.stall();
    proxy.drop_all();
    for i in 0..3 {
        assert_503_within(&app, &format!("d{i}"), bound).await;
    }
    proxy.heal();
    let took = recovers(&app, "k").await;
    println!("stall: recovered {took:?} after healing");
    assert_eq!(held(&mut conn).await, 0);
}

/// `RedisStore::from_pool` with a bb8 pool built with bb8's defaults (30 s connection timeout,
/// a `PING` on every checkout): the layer's deadline still bounds every request, behind a
/// stalled proxy, under `CLIENT PAUSE`, and while connections are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_bb8_pool_is_bounded_by_the_layer() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let manager = RedisConnectionManager::new(proxy.url()).unwrap();
    let pool = bb8::Pool::builder().build(manager).await.unwrap();
    assert_eq!(pool.state().connections, pool.state().idle_connections);
    let app = books_app(
        Arc::default(),
        layer(RedisStore::from_pool(pool), bounded()),
    );
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    let bound = DEADLINE.max(STORE_TIMEOUT) + MARGIN;

    proxy.stall();
    for i in 0..3 {
        assert_503_within(&app, &format!("s{i}"), bound).await;
    }
    proxy.heal();
    recovers(&app, "k").await;

    let mut conn = redis.client().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .query_async(&mut conn)
        .await
        .unwrap();
    for i in 0..2 {
        assert_503_within(&app, &format!("p{i}"), bound).await;
    }
    recovers(&app, "k").await;

    proxy.refuse();
    proxy.drop_all();
    for i in 0..3 {
        assert_503_within(&app, &format!("r{i}"), bound).await;
    }
    proxy.heal();
    let took = recovers(&app, "k").await;
    println!("bb8 defaults: recovered {took:?} after connections were accepted again");
}

/// A release that fails (the store's connections dropped and refused as the handler ends)
/// is sent again while the lease is valid: the key is free soon after the store is back, not
/// locked until its TTL (10 s) with the process alive. Before, it was never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_fails_is_sent_again_while_the_lease_is_valid() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(10))
        .wait(Wait::default().deadline(DEADLINE))
        .build()
        .unwrap();
    let books = Arc::new(Books::default());
    let app = books_app(
        Arc::clone(&books),
        layer(connect(&proxy.url()).await, config),
    );
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 300)).await.status() }
    });
    let mut conn = redis.client().await;
    wait_for("the holder runs", Duration::from_secs(3), async || {
        books.entered.load(Ordering::SeqCst) == 1
    })
    .await;
    // Refused first, then dropped once the proxy no longer listens, so that the connection
    // manager's reconnect cannot slip in between (the handler runs 300 ms).
    proxy.refuse();
    tokio::time::sleep(Duration::from_millis(50)).await;
    proxy.drop_all();
    assert_eq!(running.await.unwrap(), StatusCode::OK);
    assert_eq!(
        held(&mut conn).await,
        1,
        "the release could not reach Redis"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.heal();
    let took = wait_for(
        "the key freed by the release sent again",
        Duration::from_secs(4),
        async || held(&mut conn).await == 0,
    )
    .await;
    println!("freed {took:?} after the store came back");
}

/// An outage is not contention: with the store stalled and a 500 ms wait, six concurrent
/// purchases of one SKU all get 503 `#lock-store-unavailable` (the first after its store
/// timeout; the five queued behind it in this process when it fails), none 409 "held by
/// another holder" with `Retry-After` as if someone held the lock. Before, those five got 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_store_that_does_not_answer_get_503() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let app = books_app(
        Arc::default(),
        layer(connect(&proxy.url()).await, bounded()),
    );
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    proxy.stall();
    let bound = DEADLINE.max(STORE_TIMEOUT) + MARGIN;
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { assert_503_within(&app, "k", bound).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    proxy.heal();
    let mut conn = redis.client().await;
    wait_for(
        "keys taken during the stall released",
        Duration::from_secs(3),
        async || held(&mut conn).await == 0,
    )
    .await;
}

/// Connections dropped under a running holder: the renewal fails, is retried while the lease
/// is valid, the connection comes back, and the lease is kept (a store error is not a loss);
/// nobody else gets in meanwhile. Refused connections answer 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_keep_the_lease_refused_ones_answer_503() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let books = Arc::new(Books::default());
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(900))
        .wait(Wait::none())
        .build()
        .unwrap();
    let holder = books_app(
        Arc::clone(&books),
        layer(connect(&proxy.url()).await, config.clone()),
    );
    let other = books_app(
        Arc::clone(&books),
        layer(connect(&redis.url()).await, config.clone()),
    );
    let running = tokio::spawn({
        let holder = holder.clone();
        async move { send(&holder, purchase("k", 2000)).await }
    });
    wait_for("holder entered", Duration::from_secs(5), async || {
        books.entered.load(Ordering::SeqCst) == 1
    })
    .await;
    let mut contended = 0;
    for round in 0..15 {
        if round % 3 == 0 {
            proxy.drop_all();
        }
        let status = send(&other, purchase("k", 0)).await.status();
        assert_eq!(status, StatusCode::CONFLICT, "got in under a live holder");
        contended += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let response = running.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = body_json(response).await;
    assert_eq!(body["lost"], false, "{body}");
    assert_eq!(body["accepted"], true);
    assert_eq!(books.overlaps.load(Ordering::SeqCst), 0);
    println!(
        "drop_all every 300 ms under a 2 s holder: lease kept, {contended} contenders got 409"
    );

    // Refused: the store connected through the proxy cannot reconnect.
    proxy.refuse();
    proxy.drop_all();
    let bound = DEADLINE.max(STORE_TIMEOUT) + MARGIN;
    let mut slowest = Duration::ZERO;
    for i in 0..5 {
        slowest = slowest.max(assert_503_within(&holder, &format!("r{i}"), bound).await);
    }
    proxy.heal();
    let took = recovers(&holder, "k").await;
    println!("refused: slowest 503 {slowest:?}; recovered {took:?} after healing");
}

/// An acquire that Redis ran, whose reply was lost with its connection, on the default
/// transport (a `ConnectionManager`, which reconnects but does not send a request again): the
/// attempt fails (503), and the release its armed guard sends once the connection is back
/// deletes the key it took after all, so the next client gets the key at once, not a TTL (20 s)
/// later. With and without hand-off (their release scripts differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_reply_is_lost_is_released_not_left_for_the_ttl() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let mut conn = redis.client().await;
    let ttl = Duration::from_secs(20);
    for handoff in [true, false] {
        let config = LockConfig::builder()
            .ttl(ttl)
            .wait(Wait::none())
            .build()
            .unwrap();
        let lossy = books_app(
            Arc::default(),
            layer(
                connect(&proxy.url()).await.handoff(handoff).unwrap(),
                config,
            ),
        );
        let patient = LockConfig::builder()
            .ttl(ttl)
            .wait(
                Wait::constant(Duration::from_millis(20))
                    .unwrap()
                    .deadline(Duration::from_secs(5)),
            )
            .build()
            .unwrap();
        let direct = books_app(
            Arc::default(),
            layer(
                connect(&redis.url()).await.handoff(handoff).unwrap(),
                patient,
            ),
        );
        // Loads the scripts, so that the dropped call is one Redis runs (not a NOSCRIPT).
        assert_eq!(
            send(&lossy, purchase("warm", 0)).await.status(),
            StatusCode::OK
        );
        let (before, dropped) = (calls_of(&redis, "evalsha").await, proxy.replies_dropped());
        proxy.drop_reply_to(b"EVALSHA");
        let status = send(&lossy, purchase("k", 0)).await.status();
        assert_eq!(proxy.replies_dropped(), dropped + 1, "no reply was dropped");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "handoff {handoff}");
        let freed = wait_for("the key freed", Duration::from_secs(5), async || {
            held(&mut conn).await == 0
        })
        .await;
        // The acquire, and its release sent after the reconnect: nothing was sent twice.
        assert_eq!(
            calls_of(&redis, "evalsha").await - before,
            2,
            "handoff {handoff}"
        );
        let started = Instant::now();
        let status = send(&direct, purchase("k", 0)).await.status();
        let waited = started.elapsed();
        assert_eq!(
            status,
            StatusCode::OK,
            "handoff {handoff}: the key stayed locked"
        );
        assert!(
            waited < Duration::from_secs(1),
            "handoff {handoff}: waited {waited:?}"
        );
        println!("handoff {handoff}: acquire reply lost, key freed after {freed:?}");
    }
}

// -------------------------------------------------------------------------------------------
// Latency

/// What one holder (through the slow proxy) and a contender (direct, polling) saw.
struct LatencyRun {
    holder_status: StatusCode,
    holder_body: serde_json::Value,
    contender_ok: usize,
    contender_conflict: usize,
    books: Arc<Books>,
}

/// One holder behind `one_way` latency each way runs `work`; a contender on a direct
/// connection tries the same key every 20 ms meanwhile, until someone writes.
async fn latency_run(policy: OnLeaseLost, one_way: Duration, work: u64) -> LatencyRun {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let books = Arc::new(Books::default());
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(900))
        .wait(Wait::none())
        .build()
        .unwrap();
    let store = connect(&proxy.url()).await;
    // Steady state: the scripts are loaded (a first EVALSHA on a fresh server costs three
    // round trips: NOSCRIPT, SCRIPT LOAD, EVALSHA), for each of acquire, renew and release.
    let warm = tower_lock::key::LockKey::new("tower-lock:", "warm", b"up", 8).unwrap();
    let token = tower_lock::store::Token::generate().unwrap();
    store
        .acquire(&warm, &token, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(
        store
            .renew(&warm, &token, Duration::from_secs(1))
            .await
            .unwrap()
    );
    assert!(store.release(&warm, &token).await.unwrap());
    let holder = books_app(
        Arc::clone(&books),
        layer(store, config.clone()).on_lease_lost(policy),
    );
    let contender = books_app(
        Arc::clone(&books),
        layer(connect(&redis.url()).await, config),
    );
    proxy.latency(one_way);
    let running = tokio::spawn({
        let holder = holder.clone();
        async move { send(&holder, purchase("k", work)).await }
    });
    // The contender starts once the holder runs (its acquire is slowed down by the latency).
    wait_for("the holder running", Duration::from_secs(5), async || {
        books.entered.load(Ordering::SeqCst) == 1 || running.is_finished()
    })
    .await;
    let (mut ok, mut conflict) = (0, 0);
    // Until the first write: the holder's, or the contender's once the key passes on (an
    // aborted holder answers 503 at once, before its key has expired in Redis).
    let written = || books.accepted.load(Ordering::SeqCst) + books.rejected.load(Ordering::SeqCst);
    let started = std::time::Instant::now();
    while written() == 0 && started.elapsed() < Duration::from_secs(10) {
        match send(&contender, purchase("k", 10)).await.status() {
            StatusCode::OK => ok += 1,
            StatusCode::CONFLICT => conflict += 1,
            other => panic!("contender got {other}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let response = running.await.unwrap();
    let holder_status = response.status();
    let holder_body = body_json(response).await;
    // Everything lands before the books are read: in-flight releases through the proxy.
    proxy.heal();
    let mut conn = redis.client().await;
    wait_for("all released", Duration::from_secs(3), async || {
        held(&mut conn).await == 0
    })
    .await;
    LatencyRun {
        holder_status,
        holder_body,
        contender_ok: ok,
        contender_conflict: conflict,
        books,
    }
}

/// Round trips longer than a third of the TTL (350 ms against a 900 ms TTL, renewal every
/// 300 ms): the renewals still keep the lease, and the contender never gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_over_a_third_of_the_ttl_renewals_keep_the_lease() {
    let run = latency_run(OnLeaseLost::Abort, Duration::from_millis(175), 2500).await;
    println!(
        "RTT +350 ms, TTL 900 ms: holder {} {}; contender 200={} 409={}",
        run.holder_status, run.holder_body, run.contender_ok, run.contender_conflict
    );
    assert_eq!(run.books.overlaps.load(Ordering::SeqCst), 0, "two holders");
    assert_eq!(run.holder_status, StatusCode::OK, "{}", run.holder_body);
    assert_eq!(run.holder_body["lost"], false);
    assert_eq!(
        run.contender_ok, 0,
        "the contender got in under a live lease"
    );
    assert!(run.contender_conflict > 10);
    assert_eq!(run.books.rejected.load(Ordering::SeqCst), 0);
}

/// Round trips of 600 ms against a 900 ms TTL: a renewal cannot come back while the lease is
/// valid, so the lease is declared lost and `Abort` drops the handler (503 lease-lost) before the
/// key can pass to anyone else: never two holders; the contender gets the key afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_beyond_the_lease_aborts_before_anyone_else_gets_in() {
    let run = latency_run(OnLeaseLost::Abort, Duration::from_millis(300), 3000).await;
    println!(
        "RTT +600 ms, TTL 900 ms, Abort: holder {} {}; contender 200={} 409={}",
        run.holder_status, run.holder_body, run.contender_ok, run.contender_conflict
    );
    assert_eq!(run.books.overlaps.load(Ordering::SeqCst), 0, "two holders");
    assert_eq!(run.holder_status, StatusCode::SERVICE_UNAVAILABLE);
    support::assert_problem_type(&run.holder_body, "#lease-lost");
    assert_eq!(run.books.rejected.load(Ordering::SeqCst), 0);
    assert!(run.contender_ok > 0, "the key never passed on");
}

/// The negative control for the two tests above: the same latency with `OnLeaseLost::Continue`
/// lets the holder run on without its lease, and the overlap detector sees two holders at once.
/// Only the fencing token keeps the stale write out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_with_continue_shows_two_holders_and_fencing_catches_it() {
    let run = latency_run(OnLeaseLost::Continue, Duration::from_millis(300), 3000).await;
    println!(
        "RTT +600 ms, TTL 900 ms, Continue: holder {} {}; contender 200={} 409={}; overlaps {}, \
         stale writes refused {}",
        run.holder_status,
        run.holder_body,
        run.contender_ok,
        run.contender_conflict,
        run.books.overlaps.load(Ordering::SeqCst),
        run.books.rejected.load(Ordering::SeqCst),
    );
    assert_eq!(run.holder_status, StatusCode::OK);
    assert_eq!(run.holder_body["lost"], true);
    assert!(
        run.books.overlaps.load(Ordering::SeqCst) > 0,
        "no overlap seen"
    );
    assert_eq!(run.holder_body["accepted"], false, "the stale write got in");
    assert_eq!(run.books.rejected.load(Ordering::SeqCst), 1);
    let (_, value) = *run.books.value.lock().unwrap();
    assert_eq!(value as usize, run.books.accepted.load(Ordering::SeqCst));
}

// -------------------------------------------------------------------------------------------
// Clients and handlers

/// Alive tasks in this runtime, once they settle to at most `baseline` (within 2 s).
async fn tasks_settle(baseline: usize) -> usize {
    let metrics = tokio::runtime::Handle::current().metrics();
    let started = Instant::now();
    loop {
        let alive = metrics.num_alive_tasks();
        if alive <= baseline || started.elapsed() > Duration::from_secs(2) {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client that disconnects mid-request, over a real HTTP server: hyper drops the request,
/// the key is free within 100 ms (not after the 30 s TTL), and no task is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_the_key_within_100ms() {
    let redis = RedisServer::start();
    let books = Arc::new(Books::default());
    // A short wait: a round's request may arrive between the key's release in Redis and this
    // process passing the key's local turn on (when the release's answer is read).
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(
            Wait::constant(Duration::from_millis(10))
                .unwrap()
                .deadline(Duration::from_secs(2)),
        )
        .build()
        .unwrap();
    let port = serve(books_app(
        Arc::clone(&books),
        layer(connect(&redis.url()).await, config),
    ))
    .await;
    let mut conn = redis.client().await;
    // Warm up (the server's first connection, the store's scripts), then count tasks.
    let reply = Http::new(port)
        .request("POST", "/items/k/purchase", None)
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    let baseline = tasks_settle(0).await;

    let mut freed = Vec::new();
    for round in 0..5 {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut stream,
            b"POST /items/k/purchase?work_ms=60000 HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
        wait_for("the handler running", Duration::from_secs(5), async || {
            books.inside.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(held(&mut conn).await, 1);
        drop(stream);
        let took = wait_for("the key freed", Duration::from_secs(2), async || {
            held(&mut conn).await == 0
        })
        .await;
        assert!(
            took < Duration::from_millis(100),
            "round {round}: key freed {took:?} after the disconnect"
        );
        assert_eq!(
            books.inside.load(Ordering::SeqCst),
            0,
            "handler still running"
        );
        freed.push(took);
    }
    let alive = tasks_settle(baseline).await;
    println!("disconnects: key freed after {freed:?}; tasks {baseline} -> {alive}");
    assert!(
        alive <= baseline,
        "tasks leaked: {baseline} before, {alive} after"
    );
    assert_eq!(
        books.accepted.load(Ordering::SeqCst),
        1,
        "a dropped handler wrote"
    );
}

/// A handler that panics on a real server (no catch-panic layer): the connection dies, the key
/// is released (not left to its 30 s TTL), and the server keeps serving, that key included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panic_on_a_real_server_releases_and_keeps_serving() {
    let redis = RedisServer::start();
    // A short wait: the next round's request may arrive between the key's release in Redis and
    // this process passing the key's local turn on (when the release's answer is read).
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(
            Wait::constant(Duration::from_millis(10))
                .unwrap()
                .deadline(Duration::from_secs(2)),
        )
        .build()
        .unwrap();
    let port = serve(books_app(
        Arc::default(),
        layer(connect(&redis.url()).await, config),
    ))
    .await;
    let mut conn = redis.client().await;
    for round in 0..3 {
        let reply = Http::new(port)
            .request("POST", "/items/k/purchase?panic=true", None)
            .await;
        assert!(reply.is_err(), "round {round}: {reply:?}");
        let took = wait_for("the key released", Duration::from_secs(2), async || {
            held(&mut conn).await == 0
        })
        .await;
        assert!(took < Duration::from_millis(500), "released after {took:?}");
        let reply = Http::new(port)
            .request("POST", "/items/k/purchase", None)
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "round {round}");
    }
}

// -------------------------------------------------------------------------------------------
// Process faults

/// Redis `kill -9`'d mid-load under three instances, then restarted: meanwhile every request is
/// answered (503s, never a hang past the wait deadline plus the store timeout and a margin),
/// nothing panics, and once Redis is back a fresh load keeps every invariant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_mid_load() {
    let mut redis = RedisServer::start();
    let (wait_ms, ttl_ms) = (1000, 3000);
    let apps: Vec<Instance> = (0..3)
        .map(|_| {
            Instance::start(
                &redis.url(),
                &[
                    ("LOCK_WAIT_MS", &wait_ms.to_string()),
                    ("LOCK_TTL_MS", &ttl_ms.to_string()),
                ],
            )
        })
        .collect();
    let ports: Vec<u16> = apps.iter().map(|a| a.port).collect();

    let mut during = Plan::new("during", 1_000_000, 1_000_000, 50);
    during.concurrency = 12;
    during.seed(ports[0]).await;
    let stop = Arc::new(AtomicUsize::new(0));
    let load = tokio::spawn({
        let (during, ports, stop) = (during.clone(), ports.clone(), Arc::clone(&stop));
        async move { run_load(&during, &ports, Some(stop)).await }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(1, Ordering::SeqCst);
    let outcomes = load.await.unwrap();
    let outage_secs = killed.elapsed().as_secs_f64();
    let counts = Counts::of(&outcomes);
    println!("Redis killed mid-load ({outage_secs:.1} s): {counts:?}");
    assert_eq!(counts.no_answer, 0, "requests left without an answer");
    let known: usize = [200, 409, 422, 503].iter().map(|&s| counts.get(s)).sum();
    assert_eq!(known, counts.requests, "unexpected statuses: {counts:?}");
    assert!(counts.get(200) > 0 && counts.get(503) > 0, "{counts:?}");
    // The layer's own answers to the acquire (409, 503 store-unavailable): within the wait
    // deadline plus one store timeout plus a margin. A 503 lease-lost comes from a request that
    // held its lease when Redis died: its renewals fail until the lease runs out, so it is
    // bounded by the TTL instead. Other 503s come from the example's stock storage, a separate
    // redis-rs `ConnectionManager` with its default reconnect backoff (about 3 s): no hang (the
    // client's 10 s limit), but not the layer's bound.
    let is_lost = |o: &&instances::Outcome| {
        o.problem_type
            .as_deref()
            .is_some_and(|t| t.ends_with("#lease-lost"))
    };
    let from_acquire = |o: &&instances::Outcome| {
        o.status == Some(409)
            || o.problem_type
                .as_deref()
                .is_some_and(|t| t.ends_with("#lock-store-unavailable"))
    };
    let slowest = |pick: &dyn Fn(&&instances::Outcome) -> bool| {
        let mut picked = outcomes.iter().filter(|o| pick(o)).map(|o| o.latency);
        let count = picked.clone().count();
        (count, picked.by_ref().max().unwrap_or_default())
    };
    let (acquire_answers, acquire_max) = slowest(&from_acquire);
    let (lost_answers, lost_max) = slowest(&is_lost);
    println!(
        "  answered by the layer: {acquire_answers} at acquire (slowest {acquire_max:?}), \
         {lost_answers} lease-lost (slowest {lost_max:?}); slowest of all {:?}",
        counts.max_latency
    );
    assert!(
        acquire_answers + lost_answers > 0,
        "the layer never saw the outage"
    );
    // The margin covers scheduling on a busy 2-core machine (three instances, Redis, the load).
    let margin = Duration::from_secs(1);
    let bound = Duration::from_millis(wait_ms) + STORE_TIMEOUT + margin;
    assert!(
        acquire_max < bound,
        "the layer answered an acquire after {acquire_max:?} (bound {bound:?})"
    );
    let lost_bound = Duration::from_millis(ttl_ms) + STORE_TIMEOUT + margin;
    assert!(
        lost_max < lost_bound,
        "a lost lease was answered after {lost_max:?} (bound {lost_bound:?})"
    );

    redis.restart();
    let after = Plan::new("after", 1_500, 250, 100);
    // The stock lived in the Redis that died; seeding retries until the instances reconnect.
    after.seed(ports[0]).await;
    // Every instance's lock and stock connections are back: a purchase of an unknown SKU gets
    // the lock and reads the stock (404).
    for &port in &ports {
        let mut http = Http::new(port);
        let started = Instant::now();
        loop {
            let reply = http
                .request("POST", "/items/probe/purchase", None)
                .await
                .unwrap();
            if reply.status == 404 {
                break;
            }
            assert_eq!(reply.status, 503);
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "instance {port} did not recover"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let outcomes = run_load(&after, &ports, None).await;
    let counts = Counts::of(&outcomes);
    let audit = audit(&after, &outcomes, ports[0], true).await;
    println!("after the restart: {counts:?}; {audit:?}");
    assert_eq!(counts.no_answer, 0);
    assert_eq!(
        counts.get(200) + counts.get(409) + counts.get(422),
        counts.requests,
        "{counts:?}"
    );
    assert_eq!(audit.lost_updates, 0);
    assert!(
        audit.oversold.is_empty() && audit.fencing_violations.is_empty(),
        "{audit:?}"
    );
    for app in &apps {
        app.assert_no_panic();
    }
}

/// An instance `kill -9`'d while holding keys: another instance gets each key once its TTL
/// runs out (as Redis last set it), not before, and not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_instance_keys_pass_on_after_the_ttl() {
    let redis = RedisServer::start();
    let ttl = Duration::from_millis(2000);
    let env = [("LOCK_WAIT_MS", "0"), ("LOCK_TTL_MS", "2000")];
    let mut doomed = Instance::start(&redis.url(), &env);
    let other = Instance::start(&redis.url(), &env);
    let skus = ["a", "b", "c", "d"];
    for sku in skus {
        instances::set_stock(other.port, sku, 10).await;
    }
    let mut clients = Vec::new();
    for sku in skus {
        let port = doomed.port;
        clients.push(tokio::spawn(async move {
            Http::new(port)
                .request(
                    "POST",
                    &format!("/items/{sku}/purchase?work_ms=30000"),
                    None,
                )
                .await
        }));
    }
    let mut conn = redis.client().await;
    wait_for("all keys held", Duration::from_secs(5), async || {
        held(&mut conn).await == skus.len()
    })
    .await;
    // Let a renewal or two happen, then kill.
    tokio::time::sleep(Duration::from_millis(900)).await;
    doomed.kill9();
    let killed = Instant::now();
    let mut expiry = Vec::new();
    for sku in skus {
        // The example locks SKUs in the namespace `sku`; a key's name holds the SKU's digest.
        let name =
            tower_lock::key::LockKey::new("tower-lock:", "sku", sku.as_bytes(), 512).unwrap();
        let key = redis
            .lock_keys()
            .await
            .into_iter()
            .find(|k| k[..] == *name.as_bytes())
            .expect("the key of a held SKU");
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(pttl > 0, "a key without expiry: {pttl}");
        // Read after the kill: the key expires no sooner than this after the kill.
        expiry.push(killed.elapsed() + Duration::from_millis(pttl as u64));
    }
    for client in clients {
        assert!(
            client.await.unwrap().is_err(),
            "the killed instance answered"
        );
    }

    let mut http = Http::new(other.port);
    let mut passed = Vec::new();
    for sku in skus {
        loop {
            let reply = http
                .request("POST", &format!("/items/{sku}/purchase"), None)
                .await
                .unwrap();
            let at = killed.elapsed();
            match reply.status {
                200 => {
                    passed.push(at);
                    break;
                }
                409 => assert!(
                    at < ttl + Duration::from_secs(1),
                    "{sku} still held at {at:?}"
                ),
                other => panic!("{sku}: {other}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    println!("kill -9: keys expired in {expiry:?} (PTTL at kill); passed on at {passed:?}");
    for ((sku, at), expires) in skus.iter().zip(&passed).zip(&expiry) {
        // Not before its TTL ran out (5 ms for PTTL's rounding), not long after.
        assert!(
            *at + Duration::from_millis(5) >= *expires,
            "{sku} passed on at {at:?}, before its expiry at {expires:?}"
        );
        assert!(
            *at < ttl + Duration::from_secs(1),
            "{sku} passed on only at {at:?}"
        );
    }
    for sku in skus {
        // The killed holders never wrote; the other instance sold one each.
        assert_eq!(instances::get_stock(other.port, sku).await, Some(9));
    }
    other.assert_no_panic();
}

/// Redis restarted empty (no persistence) under five running purchases: each holder notices at
/// its next renewal and aborts with 503 lease-lost, long before its work would end, and none of
/// them writes to the store afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_under_many_holders_is_noticed() {
    let mut redis = RedisServer::start();
    let app = Instance::start(
        &redis.url(),
        &[("LOCK_TTL_MS", "1500"), ("LOCK_WAIT_MS", "0")],
    );
    let skus: Vec<String> = (0..5).map(|i| format!("sku-{i}")).collect();
    for sku in &skus {
        instances::set_stock(app.port, sku, 3).await;
    }
    let mut clients = Vec::new();
    for sku in &skus {
        let (port, sku) = (app.port, sku.clone());
        clients.push(tokio::spawn(async move {
            Http::new(port)
                .request("POST", &format!("/items/{sku}/purchase?work_ms=8000"), None)
                .await
        }));
    }
    let mut conn = redis.client().await;
    wait_for("all keys held", Duration::from_secs(5), async || {
        held(&mut conn).await == skus.len()
    })
    .await;
    drop(conn);
    // Each handler reads its stock right after taking its lock: let the last ones get past that
    // read, so that the restart meets them working (a read after it is a storage 503 instead).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let redis = tokio::task::spawn_blocking(move || {
        redis.restart();
        redis
    })
    .await
    .unwrap();
    let restarted = Instant::now();
    for client in clients {
        let reply = client.await.unwrap().expect("no answer");
        let took = restarted.elapsed();
        assert_eq!(
            reply.status,
            503,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(
            reply.json()["type"]
                .as_str()
                .unwrap()
                .ends_with("#lease-lost"),
            "{:?}",
            reply.json()
        );
        // Renewal every 500 ms, plus a reconnect: far sooner than the 8 s of work.
        assert!(
            took < Duration::from_secs(3),
            "noticed {took:?} after the restart"
        );
    }
    println!("restart noticed within {:?}", restarted.elapsed());
    let stock = support::keys_matching(&redis, "inventory:stock:*").await;
    assert!(
        stock.is_empty(),
        "an aborted holder wrote after losing its lease: {stock:?}"
    );
    app.assert_no_panic();
}
