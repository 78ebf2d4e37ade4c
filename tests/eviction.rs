//! Eviction: every store that connects by itself reads each server's `maxmemory-policy` (`INFO
//! memory`), logs a warning for a server that may evict lock keys and idempotency records, and
//! reports it through its `eviction()` accessor. A `noeviction` server gets no warning.

mod support;

use std::sync::OnceLock;

use support::{Captured, Redlock};
use tower_lock::{
    RedisStore,
    store::{Eviction, RedlockStore},
};
use tower_lock_testkit::RedisServer;

/// Everything the crate logs at debug and above, in this binary: one global subscriber, set by
/// the first test that asks (tests run on threads of their own).
fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("tower_lock=debug")
            .with_ansi(false)
            .with_writer(logs.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        logs
    })
}

/// The lines logged about the server at `addr` (`host:port`).
fn lines_about(addr: &str) -> Vec<String> {
    let logged = String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned();
    let field = format!("server=\"{addr}\"");
    let bare = format!("server={addr}");
    logged
        .lines()
        .filter(|l| l.contains(&field) || l.split_whitespace().any(|w| w == bare))
        .map(str::to_owned)
        .collect()
}

/// The eviction warning for `addr`, naming `policy`; panics if there is none.
fn assert_warned(addr: &str, policy: &str) {
    let lines = lines_about(addr);
    assert!(
        lines.iter().any(|l| l.contains("WARN")
            && l.contains(&format!("maxmemory_policy={policy}"))
            && l.contains("evict")),
        "no eviction warning for {addr} ({policy}): {lines:#?}"
    );
}

fn addr(server: &RedisServer) -> String {
    format!("127.0.0.1:{}", server.port())
}

/// Whether `eviction` is `Possible` with `policy`.
fn is_possible(eviction: &Eviction, policy: &str) -> bool {
    matches!(eviction, Eviction::Possible { policy: p, .. } if p == policy)
}

/// `allkeys-lru` and `volatile-lru` (every key the crate writes has a TTL, so `volatile-*`
/// evicts them too): the accessor reports the policy, and connecting logged a warning naming
/// the server and the policy, without the password the URL carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_may_evict_is_reported_and_warned_about() {
    logs();
    for policy in ["allkeys-lru", "volatile-lru"] {
        let server = RedisServer::start_with(&["--maxmemory-policy", policy]);
        server.cli(&["CONFIG", "SET", "requirepass", "hunter2-eviction"]);
        let url = format!("redis://:hunter2-eviction@127.0.0.1:{}/", server.port());
        let store = RedisStore::connect(url.as_str()).await.unwrap();
        let eviction = store.eviction().await.unwrap();
        assert!(is_possible(&eviction, policy), "{policy}: {eviction:?}");
        assert_warned(&addr(&server), policy);
        let lines = lines_about(&addr(&server));
        assert!(
            lines.iter().all(|l| !l.contains("hunter2")),
            "the password is in the logs: {lines:#?}"
        );
    }
}

/// The negative control: a `noeviction` server (Redis's default) is reported as such, and
/// connecting logs nothing about it. The accessor asks again each time: a policy changed at run
/// time is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_is_reported_without_a_warning() {
    logs();
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    assert_eq!(store.eviction().await.unwrap(), Eviction::Never);
    let lines = lines_about(&addr(&server));
    assert!(
        lines.is_empty(),
        "logged about a noeviction server: {lines:#?}"
    );
    server.cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"]);
    let eviction = store.eviction().await.unwrap();
    assert!(is_possible(&eviction, "volatile-ttl"), "{eviction:?}");
}

/// Redlock: each node is read when it connects; only the node that may evict is warned about,
/// and each node's accessor answers for its server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_warns_about_the_node_that_may_evict() {
    logs();
    let nodes = Redlock(vec![
        RedisServer::start(),
        RedisServer::start_with(&["--maxmemory-policy", "allkeys-lfu"]),
        RedisServer::start(),
    ]);
    let store = RedlockStore::connect(nodes.urls()).await.unwrap();
    assert_warned(&addr(&nodes.0[1]), "allkeys-lfu");
    for i in [0, 2] {
        let lines = lines_about(&addr(&nodes.0[i]));
        assert!(lines.is_empty(), "node {i}: {lines:#?}");
    }
    let mut answers = Vec::new();
    for node in store.nodes() {
        answers.push(node.eviction().await.unwrap());
    }
    assert_eq!(answers[0], Eviction::Never);
    assert!(is_possible(&answers[1], "allkeys-lfu"), "{answers:?}");
    assert_eq!(answers[2], Eviction::Never);
}

/// A cluster: every master is read, and warned about under its own address.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_masters_are_each_read_and_warned_about() {
    logs();
    let cluster = tokio::task::block_in_place(|| {
        tower_lock_testkit::RedisCluster::one_node(&["--maxmemory-policy", "allkeys-random"])
    });
    let store = tower_lock::store::ClusterStore::connect(cluster.urls())
        .await
        .unwrap();
    let node = addr(&cluster.nodes[0]);
    assert_warned(&node, "allkeys-random");
    let answers = store.eviction().await.unwrap();
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].0, node);
    assert!(is_possible(&answers[0].1, "allkeys-random"), "{answers:?}");
}

/// Sentinel: the master the sentinels name is read when the store connects to it.
#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinel_master_is_read_and_warned_about() {
    use std::time::Duration;

    use tower_lock_testkit::sentinel::{MASTER_NAME, SentinelSetup};
    logs();
    let setup = tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_secs(5)));
    setup
        .master
        .cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-random"]);
    let store = tower_lock::store::SentinelStore::connect(setup.sentinel_urls(), MASTER_NAME)
        .await
        .unwrap();
    assert_warned(&addr(&setup.master), "volatile-random");
    let eviction = store.eviction().await.unwrap();
    assert!(is_possible(&eviction, "volatile-random"), "{eviction:?}");
}
