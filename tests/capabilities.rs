//! The capability matrix of `docs/TOPOLOGY.md` ("What each store can do") is true: each row
//! against the store's `capabilities()`, and each *yes* by its behaviour on that store, on real
//! servers. It needs every store, so the cluster and sentinel features.

#![cfg(all(feature = "cluster", feature = "sentinel"))]

use std::{
    collections::HashMap,
    num::NonZeroU32,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, body::Body, http::Request, routing::post};
use tower::ServiceExt;
use tower_lock::{
    IdempotencyLayer, Key, LockConfig, LockLayer, Locker, MemoryStore, RedisStore, Wait,
    idempotency::{IdempotencyStore, SharedKeySpace},
    store::{Capabilities, ClusterStore, LockStore, RedlockStore, SentinelStore},
};
use tower_lock_testkit::{RedisCluster, RedisServer, SentinelSetup, calls_of, key_slot};

/// Two permits (a count is a `NonZeroU32`: 0 does not compile).
const TWO: NonZeroU32 = NonZeroU32::new(2).unwrap();

/// The matrix's columns, in order.
const COLUMNS: [&str; 6] = [
    "group commit",
    "hand-off",
    "release notices",
    "idempotency records",
    "key sets",
    "counts",
];

/// The matrix as `docs/TOPOLOGY.md` has it: each row's store, then yes or no per column.
fn documented() -> HashMap<String, [bool; 6]> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/TOPOLOGY.md"))
        .unwrap();
    let section = doc
        .split("\n## What each store can do\n")
        .nth(1)
        .expect("docs/TOPOLOGY.md has the section");
    let mut lines = section.lines().skip_while(|l| !l.starts_with("| store |"));
    let header: Vec<&str> = cells(lines.next().expect("the table"));
    assert_eq!(header[1..], COLUMNS, "the matrix's columns changed");
    lines
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .map(|line| {
            let cells = cells(line);
            let yes = |i: usize| match cells[i + 1].split(':').next().unwrap().trim() {
                "yes" => true,
                "no" => false,
                other => panic!("{line}: a cell reads {other:?}, not yes or no"),
            };
            (
                cells[0].to_owned(),
                [yes(0), yes(1), yes(2), yes(3), yes(4), yes(5)],
            )
        })
        .collect()
}

fn cells(line: &str) -> Vec<&str> {
    line.trim_matches('|').split('|').map(str::trim).collect()
}

fn flags(caps: &Capabilities) -> [bool; 6] {
    [
        caps.group_commit(),
        caps.hand_off(),
        caps.release_notices(),
        caps.idempotency_records(),
        caps.key_sets(),
        caps.counts(),
    ]
}

/// The documented row of `store` matches what it says of itself.
fn row(store: &str, caps: &Capabilities) -> [bool; 6] {
    let documented = documented();
    let row = *documented
        .get(store)
        .unwrap_or_else(|| panic!("no row for {store} in docs/TOPOLOGY.md"));
    assert_eq!(
        flags(caps),
        row,
        "{store}: capabilities() says {caps:?}, the matrix {row:?}"
    );
    row
}

fn short_leases() -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_millis(600))
        .wait(Wait::none())
        .build()
        .unwrap()
}

/// Operations that reach the store together go in one call: 20 leases acquired at once, and
/// renewed 3 times, cost the `servers` at most a third as many scripts as operations (one by
/// one: 20 and 60). `keys` picks the lease values (all in one hash slot, for a cluster).
async fn group_commit(store: impl LockStore, servers: &[&RedisServer], keys: Vec<String>) {
    let locker = Locker::with_config(store, short_leases());
    let mut start = Vec::new();
    for server in servers {
        start.push(calls_of(server, "evalsha").await);
    }
    // Acquired together, so that their renewals fall due together too. Each server holds
    // scripts for a moment, so that the first call is still in flight when the others are
    // polled, unless this process stalls for longer than the pause: they queue behind it
    // (without the pause, a loaded machine sent 10 scripts for the 20 acquires).
    for server in servers {
        let reply = server.cli(&["CLIENT", "PAUSE", "100", "WRITE"]);
        assert!(reply.contains("OK"), "CLIENT PAUSE: {reply}");
    }
    let guards = futures_util::future::join_all(keys.iter().map(|value| {
        locker
            .acquire(locker.key("caps", value).unwrap())
            .into_future()
    }))
    .await;
    let guards: Vec<_> = guards.into_iter().map(Result::unwrap).collect();
    let mut before = Vec::new();
    for (server, start) in servers.iter().zip(start) {
        let now = calls_of(server, "evalsha").await;
        assert!(
            (now - start) * 3 <= keys.len() as u64,
            "{} scripts for {} acquires on port {}: not batched",
            now - start,
            keys.len(),
            server.port()
        );
        before.push(now);
    }
    // Renewed every 200 ms: wait for three rounds (about 600 ms; far longer allowed on a
    // loaded machine: what is checked is how they were batched, not when they came).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let renewals = loop {
        let renewals: u32 = guards.iter().map(|g| g.renewals()).sum();
        if renewals >= 20 * 3 || tokio::time::Instant::now() >= deadline {
            break renewals;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        renewals >= 20 * 3,
        "only {renewals} renewals for {} leases in 10 s",
        keys.len()
    );
    assert!(guards.iter().all(|g| !g.is_lost()), "a lease was lost");
    for (server, before) in servers.iter().zip(before) {
        let scripts = calls_of(server, "evalsha").await - before;
        assert!(
            scripts * 3 <= u64::from(renewals),
            "{scripts} scripts for {renewals} renewals on port {}: not batched",
            server.port()
        );
    }
    for guard in guards {
        guard.release().await.unwrap();
    }
}

/// A waiter whose retry timer is 10 s gets the key the moment the holder lets go: the store
/// hands it over (or announces the release). `waiter_store` is a store of its own (another
/// process's), or the holder's (this process's waiters).
async fn served_at_release(holder_store: impl LockStore, waiter_store: impl LockStore) {
    let holder = Locker::with_config(holder_store, short_leases());
    let patient = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_secs(10))
                .unwrap()
                .deadline(Duration::from_secs(20)),
        )
        .build()
        .unwrap();
    let waiter = Locker::with_config(waiter_store, patient);
    let held = holder
        .acquire(holder.key("caps", "one").unwrap())
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        let guard = waiter
            .acquire(waiter.key("caps", "one").unwrap())
            .await
            .unwrap();
        let at = Instant::now();
        guard.release().await.unwrap();
        at
    });
    // Queued (or registered for the release) by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    held.release().await.unwrap();
    let served = waiting.await.unwrap();
    let after = served.saturating_duration_since(released);
    assert!(
        after < Duration::from_secs(2),
        "the waiter was served {after:?} after the release: by its timer"
    );
}

/// `store`, counting the calls to its one-key `acquire`; everything else, capabilities
/// included, is the wrapped store's.
struct Counted<S> {
    inner: S,
    acquires: Arc<AtomicUsize>,
}

impl<S: LockStore> LockStore for Counted<S> {
    async fn acquire(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::store::Token,
        ttl: Duration,
    ) -> Result<tower_lock::store::Acquire, tower_lock::store::StoreError> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::store::Token,
        ttl: Duration,
    ) -> Result<bool, tower_lock::store::StoreError> {
        self.inner.renew(key, token, ttl).await
    }

    async fn release(
        &self,
        key: &tower_lock::key::LockKey,
        token: &tower_lock::store::Token,
    ) -> Result<bool, tower_lock::store::StoreError> {
        self.inner.release(key, token).await
    }

    fn validity(&self, ttl: Duration) -> Duration {
        self.inner.validity(ttl)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// A set of three keys (`values`) is taken in one step: no call to the store's one-key
/// `acquire` (which a store without key sets gets three of), a fencing token per key, and on
/// the `servers` (every node, or the master of the keys' one slot) one script each; a set one
/// of whose keys is held takes none of them.
async fn key_sets(store: impl LockStore + Clone, servers: &[&RedisServer], values: [&str; 3]) {
    let acquires = Arc::new(AtomicUsize::new(0));
    let counted = Counted {
        inner: store.clone(),
        acquires: Arc::clone(&acquires),
    };
    let locker = Locker::with_config(counted, short_leases());
    let keys: Vec<_> = values
        .iter()
        .map(|v| locker.key("caps", v).unwrap())
        .collect();
    // Once first, so that the script is loaded (a first `EVALSHA` meets `NOSCRIPT`).
    locker
        .acquire(keys.clone())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let mut before = Vec::new();
    for server in servers {
        before.push(calls_of(server, "evalsha").await);
    }
    let guard = locker.acquire(keys.clone()).await.unwrap();
    for (server, before) in servers.iter().zip(before) {
        let scripts = calls_of(server, "evalsha").await - before;
        assert_eq!(
            scripts,
            1,
            "{scripts} scripts for one set on port {}",
            server.port()
        );
    }
    assert_eq!(acquires.load(Ordering::SeqCst), 0, "taken key by key");
    assert_eq!(guard.fencing_tokens().len(), 3);
    guard.release().await.unwrap();
    // All or none.
    let other = Locker::with_config(store, short_leases());
    let held = other.acquire(keys[1].clone()).await.unwrap();
    assert!(locker.try_acquire(keys.clone()).await.unwrap().is_none());
    let free = [keys[0].clone(), keys[2].clone()];
    let both = other.try_acquire(free).await.unwrap();
    assert!(both.is_some(), "a key of the refused set stayed taken");
    both.unwrap().release().await.unwrap();
    held.release().await.unwrap();
    assert_eq!(acquires.load(Ordering::SeqCst), 0, "taken key by key");
}

/// `IdempotencyLayer` runs on the store: a retry gets the recorded response, the handler runs
/// once.
async fn records(store: impl IdempotencyStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/pay",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (axum::http::StatusCode::CREATED, "paid")
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(store, SharedKeySpace));
    let request = || {
        Request::post("/pay")
            .header("idempotency-key", "caps-0123456789abcdef")
            .body(Body::from("{}"))
            .unwrap()
    };
    let first = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), 201);
    let retry = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran again");
}

/// Counts: two holders of a key's two permits at once, a third refused until one releases.
async fn two_permits(store: impl LockStore) {
    let locker = Locker::with_config(store, short_leases());
    let key = locker.key("caps", "permits").unwrap();
    let first = locker
        .acquire(key.clone())
        .permits(TWO)
        .unwrap()
        .await
        .unwrap();
    let second = locker
        .acquire(key.clone())
        .permits(TWO)
        .unwrap()
        .await
        .unwrap();
    assert!(second.fencing_token() > first.fencing_token());
    let third = locker
        .acquire(key.clone())
        .permits(TWO)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(third.is_none(), "a third holder of two permits");
    first.release().await.unwrap();
    let third = locker
        .acquire(key)
        .permits(TWO)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(third.is_some(), "a released permit was not free");
    drop((second, third));
}

fn twenty() -> Vec<String> {
    (0..20).map(|i| format!("k{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store() {
    let store = MemoryStore::new();
    let [batched, hand_off, notices, keeps, sets, counts] =
        row("`MemoryStore`", &store.capabilities());
    assert!(!batched && !hand_off && notices && keeps && sets && counts);
    two_permits(store.clone()).await;
    served_at_release(store.clone(), store.clone()).await;
    key_sets(store.clone(), &[], ["a", "b", "c"]).await;
    records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_connected() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let [batched, hand_off, notices, keeps, sets, counts] =
        row("`RedisStore::connect`", &store.capabilities());
    assert!(batched && hand_off && !notices && keeps && sets && counts);
    two_permits(store.clone()).await;
    group_commit(store.clone(), &[&server], twenty()).await;
    key_sets(store.clone(), &[&server], ["a", "b", "c"]).await;
    let other = RedisStore::connect(server.url()).await.unwrap();
    wait_for_subscriptions(&server, 2).await;
    served_at_release(store.clone(), other).await;
    records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_from_a_connection() {
    let server = RedisServer::start();
    let manager = redis::aio::ConnectionManager::new(redis::Client::open(server.url()).unwrap())
        .await
        .unwrap();
    let store = RedisStore::from_connection_manager(manager);
    let [batched, hand_off, notices, keeps, sets, counts] = row(
        "`RedisStore` from a connection, manager or pool",
        &store.capabilities(),
    );
    assert!(batched && !hand_off && !notices && keeps && sets && counts);
    two_permits(store.clone()).await;
    group_commit(store.clone(), &[&server], twenty()).await;
    key_sets(store.clone(), &[&server], ["a", "b", "c"]).await;
    records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_store() {
    let nodes = [
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start(),
    ];
    // A node timeout longer than the 100 ms `group_commit` holds each node's scripts for (by
    // default a tenth of its 600 ms leases).
    let store = RedlockStore::connect(nodes.iter().map(RedisServer::url))
        .await
        .unwrap()
        .node_timeout(Duration::from_millis(400));
    let [batched, hand_off, notices, keeps, sets, counts] =
        row("`RedlockStore`", &store.capabilities());
    assert!(batched && !hand_off && !notices && !keeps && sets && !counts);
    let locker = Locker::new(store.clone());
    // A call that could only fail is refused before anything is sent.
    let acquire = || locker.acquire(locker.key("caps", "p").unwrap());
    let refused = acquire().permits(TWO).unwrap_err();
    assert_eq!(refused.field(), "permits", "{refused}");
    assert!(refused.to_string().contains("cannot count"), "{refused}");
    assert_eq!(acquire().shared().unwrap_err().field(), "shared");
    assert_eq!(acquire().exclusive().unwrap_err().field(), "exclusive");
    // A layer that could only refuse is refused when built, not at request time.
    let layer = || LockLayer::from_locker(locker.clone(), Key::header("x-merchant-id").unwrap());
    let refused = layer().permits(TWO).unwrap_err();
    assert_eq!(refused.field(), "permits", "{refused}");
    assert!(refused.to_string().contains("cannot count"), "{refused}");
    let refused = layer().shared_when(|_| true).unwrap_err();
    assert_eq!(refused.field(), "shared_when", "{refused}");
    let nodes: Vec<&RedisServer> = nodes.iter().collect();
    group_commit(store.clone(), &nodes, twenty()).await;
    key_sets(store, &nodes, ["a", "b", "c"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 0));
    let store = ClusterStore::connect(cluster.urls()).await.unwrap();
    let [batched, hand_off, notices, keys, sets, counts] =
        row("`ClusterStore`", &store.capabilities());
    assert!(batched && !hand_off && !notices && keys && sets && counts);
    two_permits(store.clone()).await;
    // Twenty keys of one hash slot: a batch per slot, so one script per round.
    let locker = Locker::new(MemoryStore::new());
    let slot_of = |value: &str| key_slot(locker.key("caps", value).unwrap().as_bytes());
    let slot = slot_of("k0");
    let values: Vec<String> = (0..)
        .map(|i| format!("k{i}"))
        .filter(|v| slot_of(v) == slot)
        .take(20)
        .collect();
    let master = cluster.master_of(slot);
    // Three keys of that slot: one script, on its master.
    let three = [&*values[0], &*values[1], &*values[2]];
    key_sets(store.clone(), &[master], three).await;
    group_commit(store.clone(), &[master], values).await;
    records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_store() {
    let setup = tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_secs(5)));
    let connect = || {
        SentinelStore::connect(
            setup.sentinel_urls(),
            tower_lock_testkit::sentinel::MASTER_NAME,
        )
    };
    let store = connect().await.unwrap();
    let [batched, hand_off, notices, keeps, sets, counts] =
        row("`SentinelStore`", &store.capabilities());
    assert!(batched && hand_off && !notices && keeps && sets && counts);
    two_permits(store.clone()).await;
    group_commit(store.clone(), &[&setup.master], twenty()).await;
    key_sets(store.clone(), &[&setup.master], ["a", "b", "c"]).await;
    let other = connect().await.unwrap();
    wait_for_subscriptions(&setup.master, 2).await;
    served_at_release(store.clone(), other).await;
    records(store).await;
}

/// Until `n` stores' hand-off subscriptions are up on `server`.
async fn wait_for_subscriptions(server: &RedisServer, n: usize) {
    let started = Instant::now();
    loop {
        let channels = server.cli(&["PUBSUB", "CHANNELS", "tower-lock:handoff:*"]);
        if channels.lines().filter(|l| !l.is_empty()).count() >= n {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "hand-off subscriptions not up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
