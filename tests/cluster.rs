//! `ClusterStore` on a real Redis Cluster on loopback (`redis-server --cluster-enabled yes`,
//! `redis-cli --cluster create`): the exclusion suite, a lease whose slot migrates to another
//! master (ASK, then MOVED), and a master killed with its replica promoted.
#![cfg(feature = "cluster")]

mod suite;
mod support;

use std::time::{Duration, Instant};

use support::{Backend, Cluster, RedisCluster, RedisServer, proxy::Proxy};
use tower_lock::{
    ClusterStore, LockConfig, LockError, LockStore, Locker, Token, Wait, key::LockKey,
    store::Acquire,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion() {
    suite::exclusion(Cluster(RedisCluster::start(3, 0))).await;
}

/// The negative control for `exclusion`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_updates_are_lost() {
    suite::without_the_lock_updates_are_lost().await;
}

fn key(value: &str) -> LockKey {
    LockKey::new("tower-lock:", "t", value.as_bytes(), 64).unwrap()
}

/// The fencing counter of `slot` (`tower-lock:fence:{<n>}`, one per hash slot), as `node` lists
/// the slot's keys.
fn fence_key(node: &support::RedisServer, slot: u16) -> String {
    let keys = node.cli(&["CLUSTER", "GETKEYSINSLOT", &slot.to_string(), "100"]);
    let fences: Vec<&str> = keys
        .lines()
        .map(str::trim)
        .filter(|k| k.starts_with("tower-lock:fence:{"))
        .collect();
    assert_eq!(
        fences.len(),
        1,
        "one fencing counter in slot {slot}: {keys}"
    );
    fences[0].to_owned()
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
    let slot = cluster.slot(k.as_bytes());
    let source = cluster.master_of(slot);
    let target = cluster
        .nodes
        .iter()
        .find(|n| n.port() != source.port() && n.cli(&["ROLE"]).starts_with("master"))
        .unwrap();
    let id = |n: &support::RedisServer| n.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let (source_id, target_id) = (id(source), id(target));
    let slot_arg = slot.to_string();
    target.cli(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id]);
    source.cli(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target_id]);
    let lock_key = std::str::from_utf8(k.as_bytes()).unwrap().to_owned();
    let fence = fence_key(source, slot);
    let target_port = target.port().to_string();
    let migrated = source.cli(&[
        "MIGRATE",
        "127.0.0.1",
        &target_port,
        "",
        "0",
        "5000",
        "KEYS",
        &lock_key,
        &fence,
    ]);
    assert!(migrated.contains("OK"), "{migrated}");

    // Mid-migration: the source answers ASK for the keys it no longer has.
    let other = Token::generate().unwrap();
    let held = contender.acquire(&k, &other, ttl).await.unwrap();
    assert!(matches!(held, Acquire::Contended { .. }), "{held:?}");
    assert!(
        holder.renew(&k, &token, ttl).await.unwrap(),
        "renew via ASK"
    );

    // Hand the slot over: the client is redirected with MOVED from now on.
    for node in &cluster.nodes {
        if node.cli(&["ROLE"]).starts_with("master") {
            node.cli(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target_id]);
        }
    }
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
        .wait(Wait::constant(Duration::from_millis(50)).deadline(Duration::from_secs(5)))
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

    let before = support::calls_of(cluster.node(), "evalsha").await;
    cluster.proxy.drop_reply_to(b"EVALSHA");
    let key = a.key("t", "resent").unwrap();
    let answer = a.acquire(key.clone()).await;
    assert_eq!(cluster.proxy.replies_dropped(), 1, "no reply was dropped");
    assert_eq!(
        support::calls_of(cluster.node(), "evalsha").await - before,
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
    assert!(guard.release().await.unwrap());
    let started = Instant::now();
    let next = b.acquire(key).await.expect("the key stayed locked");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    assert!(next.release().await.unwrap());
}
