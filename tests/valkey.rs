//! The behaviour suite on a real `valkey-server` (9.x), with hand-off and without, and what
//! Valkey has that Redis 7.0 has not: the native compare commands (`SET ... IFEQ` renews,
//! `DELIFEQ` releases), detected when the store connects. Each test starts its own server on a
//! free loopback port.
//!
//! The rest of what runs on Valkey (hand-off, group commit, key sets, idempotency records, the
//! protocol model's check against a real server) is the Redis tests themselves, run again by
//! `scripts/test.sh` with `TOWER_LOCK_TEST_SERVER=valkey`.

use crate::suite;
use crate::support;

use std::time::Duration;

use support::{Backend, LockKeys};
use tower_lock::{LeaseGuard, LockConfig, LockError, Locker, RedisStore, Wait};
use tower_lock_testkit::{Flavor, RedisServer, monitor::Monitor};

fn valkey() -> RedisServer {
    RedisServer::options().flavor(Flavor::Valkey).start()
}

/// `RedisStore::connect` on Valkey: hand-off on, so releases stay on the script.
struct Valkey(RedisServer);

impl Backend for Valkey {
    type Store = RedisStore;
    const NAME: &'static str = "valkey";
    async fn store(&self) -> RedisStore {
        support::connect(&self.0).await
    }
}

suite::single_key_tests!(Valkey(valkey()));
suite::set_tests!(Valkey(valkey()));

/// The suite's single-key tests again, on the native commands: without hand-off, releases are
/// `DELIFEQ`, renewals `SET ... IFEQ`.
mod native {
    use super::{suite, valkey};
    use crate::support::NoHandoff;

    suite::single_key_tests!(NoHandoff(valkey()));
}

/// A store on `server` without hand-off: its releases and renewals can use the native commands.
async fn without_handoff(server: &RedisServer) -> RedisStore {
    RedisStore::connect(server.url())
        .await
        .unwrap()
        .handoff(false)
        .unwrap()
}

/// A locker whose leases renew every 100 ms and fail fast.
fn locker(store: RedisStore) -> Locker {
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(300))
        .wait(Wait::none())
        .build()
        .unwrap();
    Locker::with_config(store, config)
}

/// A lease on `valkey:a` through `locker(store)`, once it has renewed at least `renewals` times.
async fn renewed_lease(store: RedisStore, renewals: u32) -> LeaseGuard {
    let locker = locker(store);
    let guard = locker
        .acquire(locker.key("valkey", "a").unwrap())
        .await
        .unwrap();
    while guard.lease().renewals() < renewals {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    guard
}

/// What clients sent while a lease was taken, renewed at least twice and released, on a store
/// connected (without hand-off) just before.
async fn one_lease(server: &RedisServer) -> (tower_lock_testkit::monitor::CommandCounts, u32) {
    // As `SentinelStore` builds a master's store: connected, then configured.
    let store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .native_commands(true)
        .handoff(false)
        .unwrap();
    let mut ctl = server.client().await;
    let monitor = Monitor::start(server.port()).await;
    let guard = renewed_lease(store, 2).await;
    let renewals = guard.lease().renewals();
    guard.release().await.expect("the release found its key");
    (monitor.finish(&mut ctl).await, renewals)
}

/// Valkey 9's compare commands, from the first renewal and release: the store asked for them
/// when it connected (no `INFO` afterwards), renews with `SET ... IFEQ` and releases with
/// `DELIFEQ`; only the acquire is a script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_renews_and_releases_with_its_compare_commands() {
    let server = valkey();
    let (sent, renewals) = one_lease(&server).await;
    assert_eq!(
        sent.get("INFO"),
        0,
        "asked again after connecting: {sent:?}"
    );
    assert_eq!(
        sent.get("SET"),
        u64::from(renewals),
        "renewals not SET IFEQ: {sent:?}"
    );
    assert_eq!(sent.get("DELIFEQ"), 1, "release not DELIFEQ: {sent:?}");
    assert_eq!(server.lock_keys().await, Vec::<Vec<u8>>::new());
}

/// The control: Redis 7.0 has neither command, and the same lease renews and releases with the
/// script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_7_0_renews_and_releases_with_the_script() {
    let server = RedisServer::options().flavor(Flavor::Redis).start();
    let (sent, renewals) = one_lease(&server).await;
    assert_eq!(sent.get("SET") + sent.get("DELIFEQ") + sent.get("DELEX"), 0);
    assert!(
        sent.get("EVALSHA") > u64::from(renewals),
        "renewals and the release not scripts: {sent:?}"
    );
}

/// With hand-off, a release must pass the key on, which `DELIFEQ` cannot: it stays the script
/// (and renewals are still `SET ... IFEQ`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_handoff_valkey_releases_with_the_script() {
    let server = valkey();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let mut ctl = server.client().await;
    let monitor = Monitor::start(server.port()).await;
    let guard = renewed_lease(store, 1).await;
    guard.release().await.unwrap();
    let sent = monitor.finish(&mut ctl).await;
    assert_eq!(sent.get("DELIFEQ"), 0, "{sent:?}");
    assert!(sent.get("SET") >= 1, "renewal not SET IFEQ: {sent:?}");
}

/// The native commands check the token as the scripts do: a lease whose key another holder took
/// (as after an expiry) is not renewed over it (the lease is lost), and its release leaves the
/// other holder's key alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkeys_compare_commands_touch_only_the_holders_key() {
    let server = valkey();
    let store = without_handoff(&server).await;
    let guard = renewed_lease(store, 0).await;
    let key = server.lock_keys().await.pop().expect("the held key");
    support::give_key_to_someone_else(&server, &key).await;
    let started = std::time::Instant::now();
    while !guard.lease().is_lost() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the renewal did not notice"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        matches!(guard.release().await, Err(LockError::LeaseLost(_))),
        "released another's key"
    );
    assert_eq!(
        support::value_of(&server, &key).await.as_deref(),
        Some(&b"someone-else"[..])
    );
}

/// A copy with native commands turned off (or on) keeps to its own setting, whatever the store it
/// was copied from sent first: each copy's operations go through a queue of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_with_native_commands_off_keeps_to_it() {
    use tower_lock::{
        key::LockKey,
        store::{LockStore, Token},
    };
    let server = valkey();
    let store = without_handoff(&server).await;
    let lua_only = store.clone().native_commands(false);
    let ttl = Duration::from_secs(30);
    let key = |v: &str| LockKey::new("tower-lock:", "native", v.as_bytes(), 128).unwrap();
    let mut ctl = server.client().await;
    for (store, name, natively) in [(&store, "a", 1), (&lua_only, "b", 0), (&store, "c", 1)] {
        let monitor = Monitor::start(server.port()).await;
        let (k, token) = (key(name), Token::generate().unwrap());
        store.acquire(&k, &token, ttl).await.unwrap();
        assert!(store.release(&k, &token).await.unwrap());
        let sent = monitor.finish(&mut ctl).await;
        assert_eq!(sent.get("DELIFEQ"), natively, "release of {name}: {sent:?}");
    }
    assert_eq!(server.lock_keys().await, Vec::<Vec<u8>>::new());
}
