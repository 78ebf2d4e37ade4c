//! Review 25 probes (throwaway): the silent fault paths of issue 25 attacked on real servers.
//! Run one with `cargo test -p tower-lock-suite --all-features --test probe_rv25 NAME -- --nocapture`.

mod support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use support::{LockKeys, handoff_subscriptions};
use tower_lock::{LockConfig, LockError, Locker, RedisStore, Wait, key::LockKey};
use tower_lock_testkit::{Proxy, RedisServer, redis_cli};

/// Shared record of a contended workload: when the key was last freed, the longest time it
/// stayed free while someone waited, the longest single wait, errors.
#[derive(Default)]
struct Book {
    freed_at: Mutex<Option<Instant>>,
    max_gap: Mutex<Duration>,
    max_wait: Mutex<Duration>,
    slow_waits: AtomicU64,
    acquired: AtomicU64,
    errors: AtomicU64,
    contended: AtomicU64,
    holding: AtomicU64,
    overlaps: AtomicU64,
}

fn config() -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_secs(10))
        .wait(Wait::default().deadline(Duration::from_secs(60)))
        .build()
        .unwrap()
}

async fn worker(locker: Locker, key: LockKey, book: Arc<Book>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let asked = Instant::now();
        match locker.acquire(key.clone()).await {
            Ok(guard) => {
                let now = Instant::now();
                if book.holding.fetch_add(1, Ordering::SeqCst) != 0 {
                    book.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                if let Some(freed) = book.freed_at.lock().unwrap().take() {
                    let gap = now - freed;
                    let mut max = book.max_gap.lock().unwrap();
                    if gap > *max {
                        *max = gap;
                    }
                    if gap > Duration::from_millis(600) {
                        tracing::warn!("PROBE GAP {gap:?}");
                        println!("gap {gap:?} before an acquire (waited {:?})", now - asked);
                    }
                }
                let waited = now - asked;
                {
                    let mut max = book.max_wait.lock().unwrap();
                    if waited > *max {
                        *max = waited;
                    }
                }
                if waited > Duration::from_secs(3) {
                    book.slow_waits.fetch_add(1, Ordering::SeqCst);
                    println!("slow wait {waited:?}");
                }
                book.acquired.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                book.holding.fetch_sub(1, Ordering::SeqCst);
                let _ = guard.release().await;
                *book.freed_at.lock().unwrap() = Some(Instant::now());
            }
            Err(LockError::Contended { .. }) => {
                book.contended.fetch_add(1, Ordering::SeqCst);
            }
            Err(error) => {
                book.errors.fetch_add(1, Ordering::SeqCst);
                println!("error after {:?}: {error}", asked.elapsed());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn report(what: &str, book: &Book) {
    println!(
        "{what}: acquired {} contended {} errors {} overlaps {} max wait {:?} max free gap {:?} slow waits {}",
        book.acquired.load(Ordering::SeqCst),
        book.contended.load(Ordering::SeqCst),
        book.errors.load(Ordering::SeqCst),
        book.overlaps.load(Ordering::SeqCst),
        book.max_wait.lock().unwrap(),
        book.max_gap.lock().unwrap(),
        book.slow_waits.load(Ordering::SeqCst),
    );
}

/// Three processes, three workers each, on one key (TTL 10 s, waits up to 60 s); the hand-off
/// subscriptions are killed (`CLIENT KILL TYPE pubsub`) at random moments for 15 s. A waiter
/// that sleeps through its turn shows as a multi-second wait or a free-key gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_pubsub_killed_at_random_under_queued_waiters() {
    if std::env::var("PROBE_TRACE").is_ok() {
        let _ = tracing_subscriber::fmt().with_env_filter("tower_lock=debug").with_writer(std::io::stderr).try_init();
    }
    let server = RedisServer::start();
    let mut lockers = Vec::new();
    for _ in 0..3 {
        lockers.push(Locker::with_config(
            RedisStore::connect(server.url()).await.unwrap(),
            config(),
        ));
    }
    handoff_subscriptions(&server, 3).await;
    let key = lockers[0].key("probe", "hot").unwrap();
    let (book, stop) = (Arc::new(Book::default()), Arc::new(AtomicBool::new(false)));
    let mut tasks = Vec::new();
    for locker in &lockers {
        for _ in 0..3 {
            tasks.push(tokio::spawn(worker(
                locker.clone(),
                key.clone(),
                Arc::clone(&book),
                Arc::clone(&stop),
            )));
        }
    }
    let port = server.port().to_string();
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(50..900))).await;
        tokio::task::block_in_place(|| {
            redis_cli(&["-p", &port, "CLIENT", "KILL", "TYPE", "pubsub"]);
        });
        tracing::warn!("PROBE KILL");
        kills += 1;
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(70), task).await;
    }
    report(&format!("pubsub killed {kills} times"), &book);
}

/// The same workload, with Redis restarted empty (no persistence) three times, 3 s apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_redis_restarted_empty_under_queued_waiters() {
    let mut server = RedisServer::start();
    let mut lockers = Vec::new();
    for _ in 0..3 {
        lockers.push(Locker::with_config(
            RedisStore::connect(server.url()).await.unwrap(),
            config(),
        ));
    }
    handoff_subscriptions(&server, 3).await;
    let key = lockers[0].key("probe", "hot").unwrap();
    let (book, stop) = (Arc::new(Book::default()), Arc::new(AtomicBool::new(false)));
    let mut tasks = Vec::new();
    for locker in &lockers {
        for _ in 0..3 {
            tasks.push(tokio::spawn(worker(
                locker.clone(),
                key.clone(),
                Arc::clone(&book),
                Arc::clone(&stop),
            )));
        }
    }
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = book.acquired.load(Ordering::SeqCst);
        tokio::task::block_in_place(|| server.restart());
        println!("restarted empty ({before} acquired before)");
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(70), task).await;
    }
    report("redis restarted empty 3 times", &book);
}

/// A release that fails (the store stalled), retried until the lease ends, with every send
/// held in the stalled connection; the lease expires; another process takes the key (and a
/// third queues behind it); then the stalled sends all reach Redis. The new holder must keep
/// its key, and the queued waiter must not be handed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_stale_release_retries_after_the_lease_passed_on() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let short = LockConfig::builder()
        .ttl(Duration::from_millis(1200))
        .store_timeout(Duration::from_millis(150))
        .wait(Wait::none())
        .build()
        .unwrap();
    let a = Locker::with_config(RedisStore::connect(proxy.url()).await.unwrap(), short);
    let b = Locker::with_config(
        RedisStore::connect(server.url()).await.unwrap(),
        LockConfig::builder()
            .ttl(Duration::from_secs(10))
            .wait(Wait::none())
            .build()
            .unwrap(),
    );
    let c = Locker::with_config(
        RedisStore::connect(server.url()).await.unwrap(),
        LockConfig::builder()
            .ttl(Duration::from_secs(10))
            .wait(Wait::constant(Duration::from_secs(20)).deadline(Duration::from_secs(20)))
            .build()
            .unwrap(),
    );
    handoff_subscriptions(&server, 3).await;
    let key = a.key("probe", "k").unwrap();
    let held = a.acquire(key.clone()).await.unwrap();
    proxy.stall();
    let released = held.release().await;
    println!("A's release: {released:?}");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let b_guard = b.acquire(key.clone()).await.expect("B takes the expired key");
    let c_task = tokio::spawn({
        let key = key.clone();
        async move {
            let at = Instant::now();
            let guard = c.acquire(key).await;
            (at.elapsed(), guard.map(|g| g.lease().fencing_token()))
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!c_task.is_finished(), "C was handed B's key by A's stale release");
    let mut conn = server.client().await;
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    println!("keys after heal: {:?}", keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>());
    assert!(!b_guard.lease().is_lost());
    assert_eq!(b_guard.release().await.unwrap(), true, "B's key was touched");
    let (waited, got) = c_task.await.unwrap();
    println!("C acquired after B's release: waited {waited:?}, {got:?}");
}

/// Requests queued in one process behind a head whose store call stalls (the store SIGSTOP'd,
/// as the proxy's stall): do any of them answer past their deadline by more than one store
/// timeout, or with 409? Single keys and sets over the same key, deadlines 0 to 800 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_queued_behind_a_stalled_store_never_hang() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let store_timeout = Duration::from_millis(700);
    let locker = Locker::with_config(
        RedisStore::connect(proxy.url()).await.unwrap(),
        LockConfig::builder()
            .store_timeout(store_timeout)
            .wait(Wait::default().deadline(Duration::from_millis(300)))
            .build()
            .unwrap(),
    );
    let (a, b) = (locker.key("probe", "a").unwrap(), locker.key("probe", "b").unwrap());
    // Warm the scripts.
    locker.acquire(vec![a.clone(), b.clone()]).await.unwrap().release().await.unwrap();
    locker.acquire(a.clone()).await.unwrap().release().await.unwrap();
    proxy.stall();
    let mut tasks = Vec::new();
    for i in 0..12u64 {
        let locker = locker.clone();
        let keys: Vec<LockKey> = if i % 3 == 2 { vec![b.clone(), a.clone()] } else { vec![a.clone()] };
        let deadline = Duration::from_millis((i * 70) % 800);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 40)).await;
            let at = Instant::now();
            let answer = locker
                .acquire(keys)
                .wait(Wait::default().deadline(deadline))
                .await;
            let took = at.elapsed();
            let kind = match &answer {
                Ok(_) => "acquired".to_owned(),
                Err(LockError::Contended { .. }) => "409".to_owned(),
                Err(LockError::Store(e)) => format!("503 {:?}", e.kind()),
                Err(e) => format!("other {e}"),
            };
            (i, deadline, took, kind)
        }));
    }
    for task in tasks {
        let (i, deadline, took, kind) = task.await.unwrap();
        let over = took.saturating_sub(deadline);
        println!("#{i}: deadline {deadline:?} answered after {took:?} (over by {over:?}): {kind}");
    }
    proxy.heal();
}

/// A proxy whose `cut()` closes the server side of every connection that subscribed, and keeps
/// the client side open and silent: a half-open subscription, as a load balancer's or NAT's
/// idle timeout, or a proxy restarted behind a virtual IP, leaves it.
struct HalfOpen {
    port: u16,
    cut: tokio::sync::watch::Sender<bool>,
}

impl HalfOpen {
    async fn start(upstream: u16) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let server = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await.unwrap();
                    let (mut crd, mut cwr) = client.into_split();
                    let (srd, swr) = server.into_split();
                    let (mut srd, mut swr) = (Some(srd), Some(swr));
                    let (mut b1, mut b2) = (vec![0u8; 65536], vec![0u8; 65536]);
                    let mut subscriber = false;
                    loop {
                        tokio::select! {
                            n = crd.read(&mut b1) => {
                                let Ok(n) = n else { return };
                                if n == 0 { return; }
                                if b1[..n].windows(9).any(|w| w.eq_ignore_ascii_case(b"SUBSCRIBE")) {
                                    subscriber = true;
                                }
                                if let Some(w) = swr.as_mut() {
                                    if w.write_all(&b1[..n]).await.is_err() { return; }
                                }
                            }
                            n = async { srd.as_mut().unwrap().read(&mut b2).await }, if srd.is_some() => {
                                let Ok(n) = n else { return };
                                if n == 0 { return; }
                                if cwr.write_all(&b2[..n]).await.is_err() { return; }
                            }
                            _ = cut_rx.changed(), if subscriber && srd.is_some() => {
                                // Server side closed; the client hears nothing.
                                srd = None;
                                swr = None;
                            }
                        }
                    }
                });
            }
        });
        Self { port, cut }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn cut(&self) {
        self.cut.send_modify(|c| *c = !*c);
    }
}

/// A hand-off subscription that dies silently (half-open): is it ever noticed, and how long do
/// the waiters of that process wait for a key released 300 ms after they queued?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_half_open_subscription() {
    let server = RedisServer::start();
    let proxy = HalfOpen::start(server.port()).await;
    let cfg = LockConfig::builder()
        .ttl(Duration::from_secs(8))
        .wait(Wait::default().deadline(Duration::from_secs(30)))
        .build()
        .unwrap();
    let holder = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), cfg.clone());
    let waiter = Locker::with_config(RedisStore::connect(proxy.url()).await.unwrap(), cfg);
    handoff_subscriptions(&server, 2).await;
    let key = holder.key("probe", "half-open").unwrap();
    for round in 0..4 {
        if round == 1 {
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut conn = server.client().await;
            let n: Vec<String> = redis::cmd("PUBSUB").arg("CHANNELS").arg("tower-lock:handoff:*")
                .query_async(&mut conn).await.unwrap();
            println!("subscriptions the server sees after the cut: {}", n.len());
        }
        let held = holder.acquire(key.clone()).await.unwrap();
        let w = waiter.clone();
        let k = key.clone();
        let task = tokio::spawn(async move {
            let g = w.acquire(k).await;
            let at = Instant::now();
            if let Ok(g) = g { let _ = g.release().await; }
            at
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.release().await.unwrap();
        let released = Instant::now();
        let acquired = task.await.unwrap();
        println!("round {round}: the waiter took the key {:?} after its release", acquired.saturating_duration_since(released));
    }
}

/// Issue 25's item 5 for key sets: the store stalls under a head asking for `a`; a set {a, b}
/// takes its turn at the key before in lock order and waits in this process for the other; a
/// single-key request for the key the set's turn blocks gives up. Nobody holds anything: it
/// should get 503, as the requests queued directly behind the stalled head do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_behind_a_set_that_waits_behind_a_stalled_head() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let locker = Locker::with_config(
        RedisStore::connect(proxy.url()).await.unwrap(),
        LockConfig::builder()
            .store_timeout(Duration::from_millis(700))
            .wait(Wait::default().deadline(Duration::from_millis(300)))
            .build()
            .unwrap(),
    );
    let (a, b) = (locker.key("probe", "a").unwrap(), locker.key("probe", "b").unwrap());
    locker.acquire(vec![a.clone(), b.clone()]).await.unwrap().release().await.unwrap();
    for (head_key, other) in [(a.clone(), b.clone()), (b.clone(), a.clone())] {
        proxy.stall();
        let spawn = |keys: Vec<LockKey>, after: u64, name: &'static str| {
            let locker = locker.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                let at = Instant::now();
                let answer = locker.acquire(keys).await;
                let kind = match &answer {
                    Ok(_) => "acquired".to_owned(),
                    Err(LockError::Contended { expires_in, .. }) => format!("409 (Retry-After {expires_in:?})"),
                    Err(LockError::Store(e)) => format!("503 {:?}", e.kind()),
                    Err(e) => format!("other {e}"),
                };
                println!("  {name}: {kind} after {:?}", at.elapsed());
            })
        };
        println!("head on {:?}:", String::from_utf8_lossy(head_key.as_bytes()));
        let h = spawn(vec![head_key.clone()], 0, "head (single key)");
        let s = spawn(vec![a.clone(), b.clone()], 20, "set {a, b}");
        let t = spawn(vec![other.clone()], 40, "single key, the other one");
        let _ = tokio::join!(h, s, t);
        proxy.heal();
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
}

fn tenant(_: &axum::http::request::Parts) -> Option<bytes::Bytes> {
    Some(bytes::Bytes::from_static(b"t1"))
}

fn pay_app(runs: Arc<AtomicU64>, layer: tower_lock::IdempotencyLayer, work: Duration) -> axum::Router {
    use axum::{http::StatusCode, response::IntoResponse, routing::post};
    let handler = move || {
        let runs = Arc::clone(&runs);
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(work).await;
            (StatusCode::CREATED, format!("run {n}")).into_response()
        }
    };
    axum::Router::new().route("/pay", post(handler)).route_layer(layer)
}

fn pay_request() -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/pay")
        .header("idempotency-key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
        .body(axum::body::Body::from("{}"))
        .unwrap()
}

async fn answer(app: &axum::Router) -> (u16, String, bool) {
    let response = support::send(app, pay_request()).await;
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, String::from_utf8_lossy(&body).into_owned(), replayed)
}

/// The record-and-release of process A fails (its store stalls as the handler ends) and is sent
/// again until A's lease ends, every send held in the stalled connection. Then (a) another
/// process runs the retry and stores its record before A's sends arrive, or (b) A's sends
/// arrive first. Can a stale record overwrite a newer one; does the handler run twice in (b)?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_idempotency_completion_retried_after_the_lease() {
    use tower_lock::{IdempotencyConfig, IdempotencyLayer};
    for heal_first in [false, true] {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port());
        let lock = |ttl| {
            LockConfig::builder()
                .ttl(ttl)
                .store_timeout(Duration::from_millis(150))
                .wait(Wait::none())
                .build()
                .unwrap()
        };
        let cfg = |ttl| IdempotencyConfig::builder().lock(lock(ttl)).build().unwrap();
        let runs = Arc::new(AtomicU64::new(0));
        let a = pay_app(
            Arc::clone(&runs),
            IdempotencyLayer::with_config(RedisStore::connect(proxy.url()).await.unwrap(), tenant, cfg(Duration::from_millis(1200))),
            Duration::from_millis(300),
        );
        let b = pay_app(
            Arc::clone(&runs),
            IdempotencyLayer::with_config(RedisStore::connect(server.url()).await.unwrap(), tenant, cfg(Duration::from_secs(10))),
            Duration::from_millis(50),
        );
        let first = tokio::spawn({
            let a = a.clone();
            async move { answer(&a).await }
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        proxy.stall();
        println!("heal_first={heal_first}: A answered {:?}", first.await.unwrap());
        tokio::time::sleep(Duration::from_millis(1700)).await;
        if heal_first {
            proxy.heal();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!("  retry on B: {:?}", answer(&b).await);
        if !heal_first {
            proxy.heal();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!("  retry on B again: {:?}", answer(&b).await);
        println!("  handler runs: {}", runs.load(Ordering::SeqCst));
    }
}

/// Redlock, TTL 600 ms (renewals every 200 ms): master 0 restarted empty, then master 1 `gap`
/// later, while a contender tries every 20 ms. Is the key ever held by two?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_redlock_restarts_a_gap_apart() {
    for gap in [250u64, 400, 800] {
        let mut backend = support::Redlock::new(3);
        let ttl = Duration::from_millis(600);
        let config = LockConfig::builder().ttl(ttl).wait(Wait::none()).build().unwrap();
        let store = || async {
            tower_lock::RedlockStore::connect(backend.urls()).await.unwrap().node_timeout(Duration::from_millis(250))
        };
        let holder = Locker::with_config(store().await, config.clone());
        let contender = Locker::with_config(store().await, config.clone());
        let key = holder.key("t", "k").unwrap();
        let guard = holder.acquire(key.clone()).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stolen = Arc::new(AtomicU64::new(0));
        let hammer = tokio::spawn({
            let (stop, stolen, key, guard_lost) = (Arc::clone(&stop), Arc::clone(&stolen), key.clone(), guard.lease().clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(g)) = contender.acquire(key.clone()).try_once().await {
                        if !guard_lost.is_lost() {
                            stolen.fetch_add(1, Ordering::SeqCst);
                        }
                        let _ = g.release().await;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        tokio::task::block_in_place(|| backend.0[0].restart());
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let on0 = backend.0[0].lock_keys().await.len();
        tokio::task::block_in_place(|| backend.0[1].restart());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::SeqCst);
        hammer.await.unwrap();
        println!(
            "gap {gap} ms: key back on master 0 before the 2nd restart: {on0}; taken by the contender while the holder held: {}; holder lost: {}",
            stolen.load(Ordering::SeqCst),
            guard.lease().is_lost()
        );
    }
}

/// How long after a Redlock master restarted empty (TTL 600 ms, renewals every 200 ms) the held
/// lease is back on it, with and without a contender trying every 20 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_redlock_put_back_delay() {
    if std::env::var("PROBE_TRACE").is_ok() {
        let _ = tracing_subscriber::fmt().with_env_filter("tower_lock=debug,probe_rv25=debug").with_writer(std::io::stderr).try_init();
    }
    for with_contender in [false, true] {
        let mut backend = support::Redlock::new(3);
        let config = LockConfig::builder().ttl(Duration::from_millis(600)).wait(Wait::none()).build().unwrap();
        let urls = backend.urls();
        let store = || {
            let urls = urls.clone();
            async move { tower_lock::RedlockStore::connect(urls).await.unwrap().node_timeout(Duration::from_millis(250)) }
        };
        let holder = Locker::with_config(store().await, config.clone());
        let contender = Locker::with_config(store().await, config.clone());
        let key = holder.key("t", "k").unwrap();
        let guard = holder.acquire(key.clone()).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let hammer = tokio::spawn({
            let (stop, key) = (Arc::clone(&stop), key.clone());
            async move {
                while with_contender && !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(g)) = contender.acquire(key.clone()).try_once().await {
                        let _ = g.release().await;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        let mut delays = Vec::new();
        for round in 0..6 {
            let i = round % 3;
            tokio::task::block_in_place(|| backend.0[i].restart());
            tracing::warn!("PROBE restarted master {i}");
            let back = Instant::now();
            while backend.0[i].lock_keys().await.is_empty() {
                if back.elapsed() > Duration::from_secs(3) { break; }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            delays.push(back.elapsed().as_millis());
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        stop.store(true, Ordering::SeqCst);
        hammer.await.unwrap();
        println!("contender {with_contender}: ms from restart to lease back on the node: {delays:?}; holder lost: {}", guard.lease().is_lost());
    }
}

/// One waiter process queued behind a holder process; the subscriptions are killed; the holder
/// releases `after` ms later. How long after the release does the waiter get the key?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_kill_then_release() {
    if std::env::var("PROBE_TRACE").is_ok() {
        let _ = tracing_subscriber::fmt().with_env_filter("tower_lock=debug,probe_rv25=debug").with_writer(std::io::stderr).try_init();
    }
    let server = RedisServer::start();
    let holder = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), config());
    let waiter = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), config());
    let port = server.port().to_string();
    let key = holder.key("probe", "kr").unwrap();
    let mut results = Vec::new();
    for round in 0..16u64 {
        handoff_subscriptions(&server, 2).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let held = holder.acquire(key.clone()).await.unwrap();
        let (w, k) = (waiter.clone(), key.clone());
        let task = tokio::spawn(async move {
            let g = w.acquire(k).await.unwrap();
            let at = Instant::now();
            g.release().await.unwrap();
            at
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        tokio::task::block_in_place(|| redis_cli(&["-p", &port, "CLIENT", "KILL", "TYPE", "pubsub"]));
        tracing::warn!("PROBE killed (round {round})");
        let after = [0, 1, 3, 10][round as usize % 4];
        tokio::time::sleep(Duration::from_millis(after)).await;
        held.release().await.unwrap();
        tracing::warn!("PROBE released (round {round})");
        let released = Instant::now();
        let got = task.await.unwrap();
        results.push((after, got.saturating_duration_since(released).as_millis()));
    }
    println!("(ms from kill to release, ms from release to the waiter's acquire): {results:?}");
}
