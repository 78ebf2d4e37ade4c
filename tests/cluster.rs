//! `ClusterStore` on a real Redis Cluster on loopback (`redis-server --cluster-enabled yes`,
//! `redis-cli --cluster create`): the exclusion suite, the keys of one route spread over every
//! master, a lease whose slot migrates to another master (ASK, then MOVED), acquires in a slot
//! that migrates under load (TRYAGAIN), and a master killed with its replica promoted. The
//! store's crate-private batched renewal (one script per slot) is tested in the crate,
//! `src/store/tests/cluster.rs`.
#![cfg(feature = "cluster")]

use crate::suite;
use crate::support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, routing::post};
use support::{Backend, Cluster, companion_key, purchase, send};
use tower_lock::{
    Key, LockConfig, LockError, LockLayer, Locker, Wait,
    key::{LockKey, Share},
    store::{Acquire, ClusterStore, LockStore, Token},
};
use tower_lock_testkit::{Proxy, RedisCluster, RedisServer, calls_of, errors_of, key_slot};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion() {
    suite::exclusion(Cluster(RedisCluster::start(3, 0))).await;
}

// The negative controls for `exclusion` and the set exclusion test.
suite::controls!(
    without_the_lock_updates_are_lost,
    without_the_lock_sets_lose_updates
);

/// Leases on several keys, whose keys fall in different slots and on different masters: taken
/// slot by slot, all or none, never in a cycle of waits, and not starved by single keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_of_keys() {
    suite::set_tests_in_turn(Cluster(RedisCluster::start(3, 0))).await;
}

fn key(value: &str) -> LockKey {
    LockKey::new("tower-lock:", "t", value.as_bytes(), 64).unwrap()
}

/// The fencing counter of `slot` (`tower-lock:fence:{<n>}`, one per hash slot, or
/// `tower-lock:fence` in its own slot), as `node` lists the slot's keys.
fn fence_key(node: &RedisServer, slot: u16) -> String {
    let keys = node.cli(&["CLUSTER", "GETKEYSINSLOT", &slot.to_string(), "100"]);
    let fences: Vec<&str> = keys
        .lines()
        .map(str::trim)
        .filter(|k| k.starts_with("tower-lock:fence:{") || *k == "tower-lock:fence")
        .collect();
    assert_eq!(
        fences.len(),
        1,
        "one fencing counter in slot {slot}: {keys}"
    );
    fences[0].to_owned()
}

/// A slot being moved by hand, as `redis-cli --cluster reshard` moves it: `key`'s slot set
/// importing on another master and migrating on its own, its keys moved by `migrate`, the slot
/// given to the target by `hand_over`.
struct Reshard<'a> {
    cluster: &'a RedisCluster,
    slot: u16,
    source: &'a RedisServer,
    target: &'a RedisServer,
}

impl<'a> Reshard<'a> {
    fn start(cluster: &'a RedisCluster, key: &LockKey) -> Self {
        let slot = cluster.slot(key.as_bytes());
        let source = cluster.master_of(slot);
        let target = cluster
            .nodes
            .iter()
            .find(|n| n.port() != source.port() && n.cli(&["ROLE"]).starts_with("master"))
            .unwrap();
        let reshard = Self {
            cluster,
            slot,
            source,
            target,
        };
        let slot_arg = slot.to_string();
        let source_id = Self::id(source);
        target.cli(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id]);
        source.cli(&[
            "CLUSTER",
            "SETSLOT",
            &slot_arg,
            "MIGRATING",
            &Self::id(target),
        ]);
        reshard
    }

    fn id(node: &RedisServer) -> String {
        node.cli(&["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// Moves `keys` from the source to the target (`MIGRATE`).
    fn migrate(&self, keys: &[&str]) {
        let port = self.target.port().to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend_from_slice(keys);
        let migrated = self.source.cli(&args);
        assert!(migrated.contains("OK"), "{migrated}");
    }

    /// Gives the slot to the target on every master.
    fn hand_over(&self) {
        let (slot, target) = (self.slot.to_string(), Self::id(self.target));
        for node in &self.cluster.nodes {
            if node.cli(&["ROLE"]).starts_with("master") {
                node.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &target]);
            }
        }
    }
}

fn acquired(answer: Acquire) -> u64 {
    match answer {
        Acquire::Acquired { fencing_token } => fencing_token,
        other => panic!("not acquired: {other:?}"),
    }
}

/// A held lease whose slot is migrated to another master, by hand as `redis-cli --cluster
/// reshard` does it: while the keys sit on the target and the slot is still migrating, the
/// client follows `ASK`; after the slot is handed over, `MOVED`. The lease, its TTL and its
/// slot's fencing counter move together, so exclusion and fencing hold throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migrates_under_a_held_lease() {
    let cluster = RedisCluster::start(3, 0);
    let backend = Cluster(cluster);
    let (holder, contender) = (backend.store().await, backend.store().await);
    let ttl = Duration::from_secs(30);
    let k = key("migrating");
    let token = Token::generate().unwrap();
    let first = acquired(holder.acquire(&k, &token, ttl).await.unwrap());

    let cluster = &backend.0;
    let reshard = Reshard::start(cluster, &k);
    let (slot, source, target) = (reshard.slot, reshard.source, reshard.target);
    let lock_key = std::str::from_utf8(k.as_bytes()).unwrap().to_owned();
    let fence = fence_key(source, slot);
    reshard.migrate(&[&lock_key, &fence]);

    // Mid-migration: the source answers ASK for the keys it no longer has.
    let other = Token::generate().unwrap();
    let held = contender.acquire(&k, &other, ttl).await.unwrap();
    assert!(matches!(held, Acquire::Contended { .. }), "{held:?}");
    assert!(
        holder.renew(&k, &token, ttl).await.unwrap(),
        "renew via ASK"
    );

    // Hand the slot over: the client is redirected with MOVED from now on.
    reshard.hand_over();
    assert_eq!(cluster.master_of(slot).port(), target.port());
    let held = contender.acquire(&k, &other, ttl).await.unwrap();
    assert!(matches!(held, Acquire::Contended { .. }), "{held:?}");
    assert!(
        holder.renew(&k, &token, ttl).await.unwrap(),
        "renew via MOVED"
    );
    let pttl: i64 = target.cli(&["PTTL", &lock_key]).trim().parse().unwrap();
    assert!(pttl > 20_000, "the lease moved without its TTL: {pttl}");
    assert!(holder.release(&k, &token).await.unwrap());
    let second = acquired(contender.acquire(&k, &other, ttl).await.unwrap());
    assert!(
        second > first,
        "fencing went back after the move: {first} then {second}"
    );
    assert!(contender.release(&k, &other).await.unwrap());
}

/// A key with a capacity whose slot is resharded key by key, its running sum (`weight:`, a key
/// the scripts derive rather than declare) moved before its set: a release sent then is refused
/// whole (Redis refuses the undeclared key, and the script has written nothing yet), and sent
/// again once the slot has moved, releases; the sum still matches the holders, so the freed
/// permit is granted. (Before the scripts read the sum first, the release took the holder out of
/// the set and left the sum at 2: the key admitted one holder of 2 for as long as it was held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counted_key_resharded_sum_first_is_released_whole() {
    let cluster = RedisCluster::start(3, 0);
    let backend = Cluster(cluster);
    let store = backend.store().await;
    let ttl = Duration::from_secs(30);
    let k = key("resharded-permits").with_share(Share::permit(2).unwrap());
    let (first, second) = (Token::generate().unwrap(), Token::generate().unwrap());
    acquired(store.acquire(&k, &first, ttl).await.unwrap());
    acquired(store.acquire(&k, &second, ttl).await.unwrap());

    let cluster = &backend.0;
    let reshard = Reshard::start(cluster, &k);
    let (slot, source, target) = (reshard.slot, reshard.source, reshard.target);
    let lock_key = String::from_utf8(k.as_bytes().to_vec()).unwrap();
    let sum_key = String::from_utf8(companion_key(k.as_bytes(), "weight")).unwrap();
    let fence = fence_key(source, slot);
    reshard.migrate(&[&sum_key]);

    // The sum has moved, the set has not: refused, and nothing written.
    assert!(store.release(&k, &first).await.is_err());
    let holders = source.cli(&["ZCARD", &lock_key]);
    assert_eq!(
        holders.trim(),
        "2",
        "the set was written by a refused release"
    );

    reshard.migrate(&[&lock_key, &fence]);
    reshard.hand_over();
    assert!(
        store.release(&k, &first).await.unwrap(),
        "released once moved"
    );
    assert_eq!(target.cli(&["HGET", &sum_key, "u"]).trim(), "1");
    let third = Token::generate().unwrap();
    acquired(store.acquire(&k, &third, ttl).await.unwrap());
    assert_eq!(target.cli(&["HGET", &sum_key, "u"]).trim(), "2");
    assert!(store.release(&k, &second).await.unwrap());
    assert!(store.release(&k, &third).await.unwrap());
    assert_eq!(target.cli(&["EXISTS", &lock_key, &sum_key]).trim(), "0");
}

/// Three masters with a replica each; the master holding a (replicated) lease is killed and its
/// replica promoted. Once the cluster has failed over, the lease is still there (the contender
/// is refused, the holder renews and releases it), and new leases are granted in that slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_replica_promoted() {
    let cluster = RedisCluster::start(3, 1);
    let backend = Cluster(cluster);
    let (holder, contender) = (backend.store().await, backend.store().await);
    let ttl = Duration::from_secs(30);
    let k = key("failover");
    let token = Token::generate().unwrap();
    let first = acquired(holder.acquire(&k, &token, ttl).await.unwrap());

    let mut cluster = backend.0;
    let slot = cluster.slot(k.as_bytes());
    let port = cluster.master_of(slot).port();
    let master = cluster.nodes.iter().find(|n| n.port() == port).unwrap();
    // Replication is asynchronous: wait until the replica has caught up (what
    // `wait_for_replicas` would do for a single master), so the lease survives the failover.
    master.cli(&["WAIT", "1", "2000"]);
    let offsets = || {
        let info = master.cli(&["INFO", "replication"]);
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        (field("master_repl_offset:"), field("slave0:"))
    };
    let started = Instant::now();
    loop {
        let (offset, replica) = offsets();
        if replica.contains(&format!("offset={offset},")) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "replica never caught up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let killed_at = Instant::now();
    let index = cluster.nodes.iter().position(|n| n.port() == port).unwrap();
    cluster.nodes[index].kill();
    tokio::task::block_in_place(|| {
        let start = Instant::now();
        while cluster
            .try_master_of(slot)
            .is_none_or(|master| master.port() == port)
        {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no replica promoted"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster.wait_until_ok();
    });
    eprintln!("failed over after {:?}", killed_at.elapsed());

    // The client learns the new master through its slot refresh; give it a few tries.
    let other = Token::generate().unwrap();
    let started = Instant::now();
    let held = loop {
        match contender.acquire(&k, &other, ttl).await {
            Ok(answer) => break answer,
            Err(error) => {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "the store did not recover after the failover: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(
        matches!(held, Acquire::Contended { .. }),
        "lease lost in failover: {held:?}"
    );
    assert!(holder.renew(&k, &token, ttl).await.unwrap());
    assert!(holder.release(&k, &token).await.unwrap());
    let second = acquired(contender.acquire(&k, &other, ttl).await.unwrap());
    assert!(
        second > first,
        "fencing went back after failover: {first} then {second}"
    );
    assert!(contender.release(&k, &other).await.unwrap());
}

/// A cluster of one node, owning every slot, that the cluster client reaches only through a
/// fault proxy: the node announces the proxy's port (`cluster-announce-port`), so every
/// connection the client opens to it, after the seed too, goes through the proxy.
struct Proxied {
    cluster: RedisCluster,
    proxy: Proxy,
}

impl Proxied {
    fn start() -> Self {
        let cluster = RedisCluster::one_node(&[]);
        let proxy = Proxy::start(cluster.nodes[0].port());
        let port = proxy.port().to_string();
        cluster.nodes[0].cli(&["CONFIG", "SET", "cluster-announce-ip", "127.0.0.1"]);
        cluster.nodes[0].cli(&["CONFIG", "SET", "cluster-announce-port", &port]);
        Self { cluster, proxy }
    }

    fn node(&self) -> &RedisServer {
        &self.cluster.nodes[0]
    }
}

impl Backend for Proxied {
    type Store = ClusterStore;
    const NAME: &'static str = "cluster";
    async fn store(&self) -> ClusterStore {
        ClusterStore::connect([self.proxy.url()])
            .await
            .expect("connect to the test cluster through its proxy")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_token_acquires_again() {
    let cluster = tokio::task::block_in_place(Proxied::start);
    suite::own_token_acquires_again(cluster).await;
}

/// The cluster client re-sends a request whose connection dropped (it reconnects and sends it
/// again): here an acquire that Redis ran, whose reply the proxy dropped. The re-sent acquire
/// finds the key held with the caller's own token and answers `Acquired`, so the caller holds
/// it and releases it; another client gets the key as soon as it is released, not a TTL later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_resent_after_its_reply_was_lost_holds_the_key() {
    let cluster = tokio::task::block_in_place(Proxied::start);
    let ttl = Duration::from_secs(20);
    let once = LockConfig::builder()
        .ttl(ttl)
        .wait(Wait::none())
        .build()
        .unwrap();
    let a = Locker::with_config(cluster.store().await, once);
    let patient = LockConfig::builder()
        .ttl(ttl)
        .wait(
            Wait::constant(Duration::from_millis(50))
                .unwrap()
                .deadline(Duration::from_secs(5)),
        )
        .build()
        .unwrap();
    let b = Locker::with_config(cluster.store().await, patient);
    // Loads the script first, so that the dropped call is one Redis runs (not a NOSCRIPT).
    a.acquire(a.key("t", "warm").unwrap())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    let before = calls_of(cluster.node(), "evalsha").await;
    cluster.proxy.drop_reply_to(b"EVALSHA");
    let key = a.key("t", "resent").unwrap();
    let answer = a.acquire(key.clone()).await;
    assert_eq!(cluster.proxy.replies_dropped(), 1, "no reply was dropped");
    assert_eq!(
        calls_of(cluster.node(), "evalsha").await - before,
        2,
        "the cluster client did not run the acquire twice"
    );
    let guard = match answer {
        Ok(guard) => guard,
        Err(LockError::Contended { .. }) => {
            panic!("the re-sent acquire took the caller's own lease for another holder's")
        }
        Err(error) => panic!("{error}"),
    };
    guard.release().await.unwrap();
    let started = Instant::now();
    let next = b.acquire(key).await.expect("the key stayed locked");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    next.release().await.unwrap();
}

/// The scope the layer gives `POST /items/{sku}/purchase`: the resource, `/items/{sku}`.
const ROUTE: &str = "/items/{sku}";

/// The lock key the layer builds for `sku` on [`ROUTE`].
fn route_key(sku: &str) -> LockKey {
    LockKey::new("tower-lock:", ROUTE, sku.as_bytes(), 64).unwrap()
}

/// `POST /items/{sku}/purchase`, locked on the SKU, answering after `work`.
fn route_app(store: tower_lock::store::ClusterStore, config: LockConfig, work: Duration) -> Router {
    let layer = LockLayer::with_config(store, Key::path_param("sku"), config);
    Router::new()
        .route(
            "/items/{sku}/purchase",
            post(move || async move {
                tokio::time::sleep(work).await;
                "ok"
            }),
        )
        .route_layer(layer)
}

/// The lock keys (fencing counters left out) that `node` holds.
fn lock_keys_on(node: &RedisServer) -> Vec<String> {
    node.cli(&["KEYS", "tower-lock:*"])
        .lines()
        .filter(|k| !k.is_empty() && !support::is_fence_counter(k.as_bytes()))
        .map(str::to_owned)
        .collect()
}

/// The keys of one route, held at once, sit on every master: the route template's braces no
/// longer end the keys' hash tag early (which put every key of a route, and its fencing
/// counter, in one slot), and each key's fencing counter sits on its key's master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_one_route_spread_over_every_master() {
    let backend = Cluster(RedisCluster::start(3, 0));
    let app = route_app(
        backend.store().await,
        LockConfig::default(),
        Duration::from_millis(1500),
    );
    let skus: Vec<String> = (0..12).map(|i| format!("sku-{i}")).collect();
    let requests: Vec<_> = skus
        .iter()
        .map(|sku| {
            let (app, request) = (app.clone(), purchase(sku, 0));
            tokio::spawn(async move { send(&app, request).await.status() })
        })
        .collect();
    let masters = backend.0.masters();
    assert_eq!(masters.len(), 3);
    let started = Instant::now();
    let held = loop {
        let held: Vec<Vec<String>> = masters.iter().map(|m| lock_keys_on(m)).collect();
        if held.iter().map(Vec::len).sum::<usize>() == skus.len() {
            break held;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the keys were never all held: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for (master, keys) in masters.iter().zip(&held) {
        assert!(
            !keys.is_empty(),
            "master {} holds none of the route's keys: {held:?}",
            master.port()
        );
    }
    for (master, keys) in masters.iter().zip(&held) {
        for key in keys {
            let tag = &key[key.find('{').unwrap()..=key.find('}').unwrap()];
            let fence = if key_slot(key.as_bytes()) == key_slot(b"tower-lock:fence") {
                "tower-lock:fence".to_owned()
            } else {
                format!("tower-lock:fence:{tag}")
            };
            assert_eq!(
                master.cli(&["EXISTS", &fence]).trim(),
                "1",
                "{fence} is not on the master of {key}"
            );
        }
    }
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
}

/// Values on [`ROUTE`] whose keys share a hash slot with `first`'s: `n` of them, `first` included.
fn skus_in_one_slot(first: &str, n: usize) -> (u16, Vec<String>) {
    let slot = key_slot(route_key(first).as_bytes());
    let mut skus = vec![first.to_owned()];
    let mut i = 0u64;
    while skus.len() < n {
        let sku = format!("{first}-{i}");
        if key_slot(route_key(&sku).as_bytes()) == slot {
            skus.push(sku);
        }
        i += 1;
    }
    (slot, skus)
}

/// Acquires in a slot that migrates under load: while the slot is migrating, every acquire of a
/// free key in it is refused with TRYAGAIN (its script's keys, the missing lock key and the
/// slot's fencing counter, are not all on one side); the locker waits that out within its wait
/// deadline instead of answering 503, and the refused scripts leave nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrating_under_load_delays_acquires_without_failing_them() {
    let cluster = RedisCluster::start(3, 0);
    let backend = Cluster(cluster);
    let config = LockConfig::builder()
        .wait(
            Wait::exponential(Duration::from_millis(10), Duration::from_millis(200))
                .unwrap()
                .deadline(Duration::from_secs(10)),
        )
        .build()
        .unwrap();
    let app = route_app(backend.store().await, config, Duration::from_millis(10));
    let (slot, skus) = skus_in_one_slot("moving", 8);

    // Load: four clients, two SKUs each (so they do not contend with one another), until told
    // to stop; each request's status and when it was sent and answered.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = skus
        .chunks(2)
        .map(|mine| {
            let (app, stop, mine) = (app.clone(), Arc::clone(&stop), mine.to_vec());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    for sku in &mine {
                        let sent = Instant::now();
                        let response = send(&app, purchase(sku, 0)).await;
                        let error = response
                            .extensions()
                            .get::<tower_lock::LockError>()
                            .map(|e| format!("{e:?}"));
                        answers.push((response.status(), error, sent, Instant::now()));
                    }
                }
                answers
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Migrate the slot by hand, as `redis-cli --cluster reshard` does, slowly: 2.5 s between
    // marking it and moving its keys (longer than the cluster client's own retries).
    let cluster = &backend.0;
    let source = cluster.master_of(slot);
    let target = *cluster
        .masters()
        .iter()
        .find(|n| n.port() != source.port())
        .unwrap();
    let id = |n: &RedisServer| n.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let (source_id, target_id) = (id(source), id(target));
    let slot_arg = slot.to_string();
    let tries_before: u64 = cluster
        .masters()
        .iter()
        .map(|m| errors_of(m, "TRYAGAIN"))
        .sum();
    let migration_started = Instant::now();
    target.cli(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id]);
    source.cli(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target_id]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let keys: Vec<String> = source
        .cli(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "1000"])
        .lines()
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    assert!(
        keys.iter().any(|k| support::is_fence_counter(k.as_bytes())),
        "the slot's fencing counter is in use: {keys:?}"
    );
    let target_port = target.port().to_string();
    let mut migrate = vec![
        "MIGRATE",
        "127.0.0.1",
        &target_port,
        "",
        "0",
        "5000",
        "KEYS",
    ];
    migrate.extend(keys.iter().map(String::as_str));
    let migrated = source.cli(&migrate);
    assert!(
        migrated.contains("OK") || migrated.contains("NOKEY"),
        "{migrated}"
    );
    // The target first, then the source, then the others, as the Redis documentation orders
    // it: the other way round, the two would send clients back and forth with MOVED meanwhile.
    let mut masters = cluster.masters();
    masters.sort_by_key(|n| (n.port() != target.port(), n.port() != source.port()));
    for node in masters {
        node.cli(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target_id]);
    }
    let migration_ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(client.await.unwrap());
    }

    let tries: u64 = cluster
        .masters()
        .iter()
        .map(|m| errors_of(m, "TRYAGAIN"))
        .sum();
    assert!(
        tries > tries_before,
        "no acquire met TRYAGAIN: the migration was not exercised"
    );
    let failed: Vec<_> = answers
        .iter()
        .filter(|(status, ..)| *status != StatusCode::OK)
        .collect();
    assert!(
        failed.is_empty(),
        "requests failed during the migration: {failed:?}"
    );
    // Requests sent while the slot was migrating waited for its end, and then ran.
    let waited = answers
        .iter()
        .filter(|(_, _, sent, answered)| {
            *sent > migration_started + Duration::from_millis(100) && *answered >= migration_ended
        })
        .count();
    assert!(
        waited >= 1,
        "no request waited out the migration: {answers:?}"
    );
    eprintln!(
        "{} requests, {waited} of them waited out the migration ({:?}); TRYAGAIN answered {} times",
        answers.len(),
        migration_ended - migration_started,
        tries - tries_before
    );
    // Nothing left behind: the slot holds only its fencing counter, on its new master.
    let left = target.cli(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "1000"]);
    let left: Vec<&str> = left.lines().filter(|k| !k.is_empty()).collect();
    assert!(
        left.len() == 1 && support::is_fence_counter(left[0].as_bytes()),
        "keys left in the slot: {left:?}"
    );
    assert_eq!(
        source
            .cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot_arg])
            .trim(),
        "0"
    );
}

/// The idempotency layer's record written with the release, while the lock key's slot
/// migrates: Redis refuses it with `TRYAGAIN` (its record key is on neither side yet) until the
/// migration ends, longer than the cluster client tries. It is sent again while the lease is
/// valid and stored once the slot has moved, and the client's retry after the migration gets
/// the replay. Before, the client's refusal ended it: the armed guard's plain release freed the
/// key without the record, and the retry ran the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_written_while_its_slot_migrates_is_stored_after_the_migration() {
    use std::sync::atomic::AtomicUsize;
    use tower_lock::{IdempotencyLayer, idempotency::SharedKeySpace};

    let backend = Cluster(RedisCluster::start(3, 0));
    let runs = Arc::new(AtomicUsize::new(0));
    // The first run ends only once the slot migrates (the test adds the permit), whatever the
    // machine's load.
    let migrating = Arc::new(tokio::sync::Semaphore::new(0));
    let layer = IdempotencyLayer::new(backend.store().await, SharedKeySpace);
    let app = Router::new()
        .route(
            "/payments",
            post({
                let (runs, migrating) = (Arc::clone(&runs), Arc::clone(&migrating));
                move || async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 1 {
                        let _ = migrating.acquire().await;
                    }
                    (StatusCode::CREATED, format!("charged, run {n}"))
                }
            }),
        )
        .route_layer(layer);
    let pay = || {
        axum::http::Request::post("/payments")
            .header("idempotency-key", "5f0b6c1e-9d0a-4d8e-9a55-1f6f1c2b7a01")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let first = tokio::spawn({
        let (app, request) = (app.clone(), pay());
        async move { send(&app, request).await }
    });
    // The handler runs: its lock key is on one master.
    let cluster = &backend.0;
    let started = Instant::now();
    let (source, lock_key) = loop {
        let found = cluster.masters().into_iter().find_map(|node| {
            let keys = lock_keys_on(node);
            keys.into_iter().next().map(|k| (node, k))
        });
        if let Some(found) = found {
            break found;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "no lock key");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let slot = key_slot(lock_key.as_bytes());
    let target = *cluster
        .masters()
        .iter()
        .find(|n| n.port() != source.port())
        .unwrap();
    let id = |n: &RedisServer| n.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let (source_id, target_id) = (id(source), id(target));
    let slot_arg = slot.to_string();
    let tries_before = errors_of(source, "TRYAGAIN");
    target.cli(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id]);
    source.cli(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target_id]);
    // The handler ends; its record is refused for as long as the slot migrates.
    migrating.add_permits(1);
    let started = Instant::now();
    while errors_of(source, "TRYAGAIN") == tries_before
        && started.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And keeps being refused for a while (the client's own retries end; the crate's go on).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        errors_of(source, "TRYAGAIN") > tries_before,
        "the record write met no TRYAGAIN: the migration was not exercised ({lock_key} in slot \
         {slot}; {:?}; first answered: {})",
        source.cli(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "1000"]),
        first.is_finished()
    );
    let keys: Vec<String> = source
        .cli(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "1000"])
        .lines()
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    let target_port = target.port().to_string();
    let mut migrate = vec![
        "MIGRATE",
        "127.0.0.1",
        &target_port,
        "",
        "0",
        "5000",
        "KEYS",
    ];
    migrate.extend(keys.iter().map(String::as_str));
    let migrated = source.cli(&migrate);
    assert!(
        migrated.contains("OK") || migrated.contains("NOKEY"),
        "{migrated}"
    );
    let mut masters = cluster.masters();
    masters.sort_by_key(|n| (n.port() != target.port(), n.port() != source.port()));
    for node in masters {
        node.cli(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target_id]);
    }
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // The client retries after the migration, once the lock is gone.
    let started = Instant::now();
    while !lock_keys_on(target)
        .iter()
        .all(|k| support::is_record_key(k.as_bytes()))
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the lock stayed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = send(&app, pay()).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(
        retry
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "the retry ran the handler again"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "charged twice");
}
