//! TLS on real `redis-server`s that speak TLS only (`--port 0 --tls-port <port>`), with a CA
//! and certificates the test makes (`tower_lock_testkit::TestCerts`, by `openssl`): every
//! store (`RedisStore` over its default transport and over a bb8 pool, `RedlockStore`,
//! `ClusterStore` with `--tls-cluster yes`, `SentinelStore` with TLS sentinels and
//! `--tls-replication yes`), with and without client certificates (`--tls-auth-clients yes`),
//! running the exclusion test, with its negative controls (no layer; a layer whose instances
//! lock in two TLS servers that do not share their locks); and every failure at start-up, each
//! a typed error that names its cause, within seconds.
#![cfg(feature = "tls")]

use crate::suite;
use crate::support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bb8_redis::RedisConnectionManager;
use support::Backend;
use tower_lock::{
    LockConfig, Locker, RedisStore, Wait,
    store::{LockStore, RedlockStore, StoreError, StoreErrorKind, TlsConfig},
};
use tower_lock_testkit::{ClosedPort, RedisServer, TestCerts, TlsOptions, calls_of};

/// The settings a client of the test servers uses: their CA, and the client certificate when
/// `client` (which servers that do not ask for one ignore).
fn tls_config(certs: &TestCerts, client: bool) -> TlsConfig {
    let tls = TlsConfig::new().ca_cert_file(certs.ca());
    if client {
        tls.client_cert_files(certs.client_cert(), certs.client_key())
    } else {
        tls
    }
}

/// A server that speaks TLS only; requires client certificates when `mutual`.
fn tls_server(certs: &Arc<TestCerts>, mutual: bool) -> RedisServer {
    RedisServer::options()
        .tls(TlsOptions::new(certs).auth_clients(mutual))
        .start()
}

struct Redis {
    server: RedisServer,
    tls: TlsConfig,
}

impl Backend for Redis {
    type Store = RedisStore;
    const NAME: &'static str = "redis over TLS";
    async fn store(&self) -> RedisStore {
        RedisStore::connect_with_tls(self.server.url(), &self.tls)
            .await
            .expect("connect to the TLS redis-server")
    }
}

/// `RedisStore` over a bb8 pool whose manager has the TLS settings.
struct Pooled {
    server: RedisServer,
    tls: TlsConfig,
}

impl Backend for Pooled {
    type Store = RedisStore;
    const NAME: &'static str = "redis over TLS, pooled";
    async fn store(&self) -> RedisStore {
        let info = self.tls.connection_info(self.server.url()).unwrap();
        let manager = RedisConnectionManager::new(info).unwrap();
        let pool = RedisStore::pool_builder()
            .max_size(8)
            .build(manager)
            .await
            .unwrap();
        RedisStore::from_pool(pool)
    }
}

struct Redlock {
    servers: Vec<RedisServer>,
    tls: TlsConfig,
}

impl Backend for Redlock {
    type Store = RedlockStore;
    const NAME: &'static str = "redlock over TLS";
    async fn store(&self) -> RedlockStore {
        RedlockStore::connect_with_tls(self.servers.iter().map(RedisServer::url), &self.tls)
            .await
            .expect("connect to the TLS redis-servers")
            .node_timeout(Duration::from_millis(250))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_excludes_over_tls() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, false);
    let tls = tls_config(&certs, false);
    suite::exclusion(Redis { server, tls }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_excludes_over_mutual_tls() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, true);
    let tls = tls_config(&certs, true);
    suite::exclusion(Redis { server, tls }).await;
}

/// The hand-off's own (RESP3, pub/sub) connection goes over TLS too: a waiter is handed the
/// key (and the server counts the store's subscription).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_hands_off_over_mutual_tls() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, true);
    let tls = tls_config(&certs, true);
    let backend = Redis { server, tls };
    let config = || {
        LockConfig::builder()
            .wait(
                Wait::constant(Duration::from_secs(5))
                    .unwrap()
                    .deadline(Duration::from_secs(10)),
            )
            .build()
            .unwrap()
    };
    let a = Locker::with_config(backend.store().await, config());
    let b = Locker::with_config(backend.store().await, config());
    // The server has no plain port: these subscriptions are TLS connections.
    support::handoff_subscriptions(&backend.server, 2).await;
    let held = a.acquire(a.key("t", "k").unwrap()).await.unwrap();
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let guard = b.acquire(b.key("t", "k").unwrap()).await.unwrap();
        (started.elapsed(), guard)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await.unwrap();
    let (waited, guard) = waiter.await.unwrap();
    // Its timer would have fired after 5 s: the hand-off's message woke it.
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    assert!(calls_of(&backend.server, "publish").await >= 1);
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_redis_excludes_over_mutual_tls() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, true);
    let tls = tls_config(&certs, true);
    suite::exclusion(Pooled { server, tls }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_excludes_over_tls() {
    let certs = TestCerts::generate();
    let servers = (0..3).map(|_| tls_server(&certs, false)).collect();
    let tls = tls_config(&certs, false);
    suite::exclusion(Redlock { servers, tls }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_excludes_over_mutual_tls() {
    let certs = TestCerts::generate();
    let servers = (0..3).map(|_| tls_server(&certs, true)).collect();
    let tls = tls_config(&certs, true);
    suite::exclusion(Redlock { servers, tls }).await;
}

// The negative control for every `exclusion` here: the same load without the layer loses
// updates.
suite::controls!(without_the_lock_updates_are_lost);

/// The negative control over TLS: the same load, through the layer and over mutual TLS, but
/// with each instance locking in a TLS server of its own, loses updates. The exclusion the
/// tests above see comes from the one server the instances share, not from the TLS round
/// trips spacing the requests out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_in_two_unshared_tls_servers_lose_updates() {
    let certs = TestCerts::generate();
    let tls = tls_config(&certs, true);
    let a = Redis {
        server: tls_server(&certs, true),
        tls: tls.clone(),
    };
    let b = Redis {
        server: tls_server(&certs, true),
        tls,
    };
    suite::unshared_stores_lose_updates(a, b).await;
}

#[cfg(feature = "cluster")]
mod cluster {
    use super::*;
    use tower_lock::store::ClusterStore;
    use tower_lock_testkit::RedisCluster;

    struct Cluster {
        cluster: RedisCluster,
        tls: TlsConfig,
    }

    impl Backend for Cluster {
        type Store = ClusterStore;
        const NAME: &'static str = "cluster over TLS";
        async fn store(&self) -> ClusterStore {
            ClusterStore::connect_with_tls(self.cluster.urls(), &self.tls)
                .await
                .expect("connect to the TLS cluster")
        }
    }

    fn start(certs: &Arc<TestCerts>, mutual: bool) -> RedisCluster {
        let options = RedisServer::options().tls(TlsOptions::new(certs).auth_clients(mutual));
        tokio::task::block_in_place(|| RedisCluster::start_with(options, 3, 0))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster_excludes_over_tls() {
        let certs = TestCerts::generate();
        let cluster = start(&certs, false);
        let tls = tls_config(&certs, false);
        suite::exclusion(Cluster { cluster, tls }).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster_excludes_over_mutual_tls() {
        let certs = TestCerts::generate();
        let cluster = start(&certs, true);
        let tls = tls_config(&certs, true);
        suite::exclusion(Cluster { cluster, tls }).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_cluster_is_unavailable() {
        let certs = TestCerts::generate();
        let closed = ClosedPort::new();
        let seed = format!("rediss://127.0.0.1:{}/", closed.port());
        let error = timed(ClusterStore::connect_with_tls(
            [seed.as_str()],
            &tls_config(&certs, false),
        ))
        .await;
        assert_cause(&error, StoreErrorKind::Unavailable, "Redis Cluster");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_untrusted_cluster_is_a_tls_error() {
        let certs = TestCerts::generate();
        let cluster = start(&certs, false);
        let wrong = TlsConfig::new().ca_cert_file(certs.other_ca());
        let error = timed(ClusterStore::connect_with_tls(cluster.urls(), &wrong)).await;
        assert_cause(&error, StoreErrorKind::Tls, "not signed by a trusted CA");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_cluster_password_is_an_authentication_error() {
        let certs = TestCerts::generate();
        let options = RedisServer::options()
            .tls(TlsOptions::new(&certs))
            .password("right-password");
        let cluster = tokio::task::block_in_place(|| RedisCluster::start_with(options, 3, 0));
        let seeds: Vec<String> = cluster
            .urls()
            .iter()
            .map(|url| url.replace("right-password", "wrong-password"))
            .collect();
        let error = timed(ClusterStore::connect_with_tls(
            seeds,
            &tls_config(&certs, false),
        ))
        .await;
        assert_cause(
            &error,
            StoreErrorKind::Authentication,
            "user name or password",
        );
        assert!(
            !format!("{error:?}").contains("wrong-password"),
            "{error:?}"
        );
    }
}

#[cfg(feature = "sentinel")]
mod sentinel {
    use super::*;
    use redis::RedisConnectionInfo;
    use tower_lock::store::SentinelStore;
    use tower_lock_testkit::sentinel::{MASTER_NAME, SentinelSetup};

    struct Sentinel {
        setup: SentinelSetup,
        tls: TlsConfig,
    }

    impl Backend for Sentinel {
        type Store = SentinelStore;
        const NAME: &'static str = "sentinel over TLS";
        async fn store(&self) -> SentinelStore {
            SentinelStore::connect_with_tls(
                self.setup.sentinel_urls(),
                MASTER_NAME,
                RedisConnectionInfo::default(),
                &self.tls,
            )
            .await
            .expect("connect through the TLS sentinels")
        }
    }

    fn start(certs: &Arc<TestCerts>, mutual: bool) -> SentinelSetup {
        let options = RedisServer::options().tls(TlsOptions::new(certs).auth_clients(mutual));
        // Down after 5 s: no failover from a slow answer on a loaded machine.
        tokio::task::block_in_place(|| SentinelSetup::start_with(options, Duration::from_secs(5)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sentinel_excludes_over_tls() {
        let certs = TestCerts::generate();
        let setup = start(&certs, false);
        assert!(setup.sentinel_urls()[0].starts_with("rediss://"));
        let tls = tls_config(&certs, false);
        suite::exclusion(Sentinel { setup, tls }).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sentinel_excludes_over_mutual_tls() {
        let certs = TestCerts::generate();
        let setup = start(&certs, true);
        let tls = tls_config(&certs, true);
        suite::exclusion(Sentinel { setup, tls }).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_sentinels_are_unavailable() {
        let certs = TestCerts::generate();
        let closed = ClosedPort::new();
        let sentinel = format!("rediss://127.0.0.1:{}/", closed.port());
        let error = timed(SentinelStore::connect_with_tls(
            [sentinel.as_str()],
            MASTER_NAME,
            RedisConnectionInfo::default(),
            &tls_config(&certs, false),
        ))
        .await;
        assert_cause(&error, StoreErrorKind::Unavailable, "sentinels");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn untrusted_sentinels_are_a_tls_error() {
        let certs = TestCerts::generate();
        let setup = start(&certs, false);
        let wrong = TlsConfig::new().ca_cert_file(certs.other_ca());
        let error = timed(SentinelStore::connect_with_tls(
            setup.sentinel_urls(),
            MASTER_NAME,
            RedisConnectionInfo::default(),
            &wrong,
        ))
        .await;
        assert_cause(&error, StoreErrorKind::Tls, "not signed by a trusted CA");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_master_password_is_an_authentication_error() {
        let certs = TestCerts::generate();
        let options = RedisServer::options()
            .tls(TlsOptions::new(&certs))
            .password("right-password");
        let setup = tokio::task::block_in_place(|| {
            SentinelSetup::start_with(options, Duration::from_secs(5))
        });
        let error = timed(SentinelStore::connect_with_tls(
            setup.sentinel_urls(),
            MASTER_NAME,
            RedisConnectionInfo::default().set_password("wrong-password"),
            &tls_config(&certs, false),
        ))
        .await;
        assert_cause(
            &error,
            StoreErrorKind::Authentication,
            "user name or password",
        );
        assert!(
            !format!("{error:?}").contains("wrong-password"),
            "{error:?}"
        );
        // The control: the right one connects.
        SentinelStore::connect_with_tls(
            setup.sentinel_urls(),
            MASTER_NAME,
            RedisConnectionInfo::default().set_password("right-password"),
            &tls_config(&certs, false),
        )
        .await
        .unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Failures at start-up: a typed error that names the cause, within seconds, never a panic.

/// The error `connect` ends in, which must come within 5 s.
async fn timed<T: std::fmt::Debug>(
    connect: impl std::future::Future<Output = Result<T, StoreError>>,
) -> StoreError {
    let started = Instant::now();
    let error = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("connecting did not end within 10 s")
        .expect_err("connecting succeeded");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the error took {:?}: {error}",
        started.elapsed()
    );
    error
}

/// `error` is of `kind` and its message (its own, not only its sources') says `cause`.
fn assert_cause(error: &StoreError, kind: StoreErrorKind, cause: &str) {
    assert_eq!(error.kind(), kind, "{error}: {error:?}");
    assert!(
        error.to_string().contains(cause),
        "{error:?} does not say {cause:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_a_tls_error() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, false);
    // No CA bundle: the operating system's CA store, which does not know the test CA.
    for tls in [
        TlsConfig::new().ca_cert_file(certs.other_ca()),
        TlsConfig::new(),
    ] {
        let error = timed(RedisStore::connect_with_tls(server.url(), &tls)).await;
        assert_cause(&error, StoreErrorKind::Tls, "not signed by a trusted CA");
        assert!(
            error.to_string().contains(&server.port().to_string()),
            "{error}"
        );
    }
    // A plain `connect` of a `rediss://` URL is the same as an empty `TlsConfig`.
    let error = timed(RedisStore::connect(server.url())).await;
    assert_cause(&error, StoreErrorKind::Tls, "not signed by a trusted CA");
    let error = timed(RedlockStore::connect_with_tls(
        [server.url()],
        &TlsConfig::new().ca_cert_file(certs.other_ca()),
    ))
    .await;
    assert_cause(&error, StoreErrorKind::Tls, "not signed by a trusted CA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_is_a_tls_error() {
    let certs = TestCerts::generate();
    let server = RedisServer::options()
        .tls(TlsOptions::new(&certs).wrong_host())
        .start();
    let error = timed(RedisStore::connect_with_tls(
        server.url(),
        &tls_config(&certs, false),
    ))
    .await;
    assert_cause(&error, StoreErrorKind::Tls, "for another host");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_without_a_trusted_client_certificate_is_a_tls_error() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, true);
    let error = timed(RedisStore::connect_with_tls(
        server.url(),
        &tls_config(&certs, false),
    ))
    .await;
    assert_cause(&error, StoreErrorKind::Tls, "requires a client certificate");
    let untrusted = TlsConfig::new()
        .ca_cert_file(certs.ca())
        .client_cert_files(certs.untrusted_client_cert(), certs.untrusted_client_key());
    let error = timed(RedisStore::connect_with_tls(server.url(), &untrusted)).await;
    assert_cause(
        &error,
        StoreErrorKind::Tls,
        "refused the client certificate",
    );
    // The control: the CA's client certificate connects.
    RedisStore::connect_with_tls(server.url(), &tls_config(&certs, true))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_settings_are_errors_that_name_the_file() {
    let certs = TestCerts::generate();
    let server = tls_server(&certs, false);
    let missing = TlsConfig::new().ca_cert_file(certs.dir().join("missing.pem"));
    let error = timed(RedisStore::connect_with_tls(server.url(), &missing)).await;
    assert_cause(&error, StoreErrorKind::Tls, "missing.pem");
    // A key that is not the certificate's.
    let mismatched = TlsConfig::new()
        .ca_cert_file(certs.ca())
        .client_cert_files(certs.client_cert(), certs.server_key());
    let error = timed(RedisStore::connect_with_tls(server.url(), &mismatched)).await;
    assert_cause(
        &error,
        StoreErrorKind::Tls,
        "does not go with the client certificate",
    );
    // TLS settings for a `redis://` URL, which would not use them.
    let plain = server.url().replace("rediss://", "redis://");
    let error = timed(RedisStore::connect_with_tls(
        plain.as_str(),
        &tls_config(&certs, false),
    ))
    .await;
    assert_cause(&error, StoreErrorKind::Config, "rediss://");
    // Certificates are always verified: `#insecure` is refused.
    let insecure = format!("{}#insecure", server.url());
    let error = timed(RedisStore::connect(insecure.as_str())).await;
    assert_cause(&error, StoreErrorKind::Config, "#insecure");
    // And a `redis://` URL on a TLS-only port: the server hangs up.
    let error = timed(RedisStore::connect(plain.as_str())).await;
    assert_cause(&error, StoreErrorKind::Unavailable, "rediss://");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_password_is_an_authentication_error() {
    let certs = TestCerts::generate();
    let server = RedisServer::options()
        .tls(TlsOptions::new(&certs))
        .password("right-password")
        .start();
    let tls = tls_config(&certs, false);
    let url = |auth: &str| format!("rediss://{auth}127.0.0.1:{}/", server.port());
    let error = timed(RedisStore::connect_with_tls(url(":wrong-password@"), &tls)).await;
    assert_cause(
        &error,
        StoreErrorKind::Authentication,
        "user name or password",
    );
    assert!(
        !format!("{error:?}").contains("wrong-password"),
        "{error:?}"
    );
    let error = timed(RedisStore::connect_with_tls(url(""), &tls)).await;
    assert_cause(
        &error,
        StoreErrorKind::Authentication,
        "requires a password",
    );
    let error = timed(RedlockStore::connect_with_tls(
        [url(":wrong-password@")],
        &tls,
    ))
    .await;
    assert_cause(
        &error,
        StoreErrorKind::Authentication,
        "user name or password",
    );
    // The control: the right one connects.
    let store = RedisStore::connect_with_tls(url(":right-password@"), &tls)
        .await
        .unwrap();
    let key = tower_lock::key::LockKey::new("tower-lock:", "t", b"k", 64).unwrap();
    let token = tower_lock::store::Token::generate().unwrap();
    store
        .acquire(&key, &token, Duration::from_secs(5))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_unavailable() {
    let closed = ClosedPort::new();
    let port = closed.port();
    let url = format!("redis://127.0.0.1:{port}/");
    let error = timed(RedisStore::connect(url.as_str())).await;
    assert_cause(&error, StoreErrorKind::Unavailable, "nothing listens there");
    let error = timed(RedlockStore::connect([url.as_str()])).await;
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    let tls_url = format!("rediss://127.0.0.1:{port}/");
    let certs = TestCerts::generate();
    let error = timed(RedisStore::connect_with_tls(
        tls_url.as_str(),
        &tls_config(&certs, false),
    ))
    .await;
    assert_cause(&error, StoreErrorKind::Unavailable, "nothing listens there");
    assert!(
        error
            .to_string()
            .contains(&format!("127.0.0.1:{port} (TLS)")),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_port_reached_over_tls_asks_whether_it_is_a_tls_port() {
    let certs = TestCerts::generate();
    let server = RedisServer::start();
    let url = format!("rediss://127.0.0.1:{}/", server.port());
    let error = timed(RedisStore::connect_with_tls(
        url.as_str(),
        &tls_config(&certs, false),
    ))
    .await;
    // redis-server takes the handshake for an inline command and waits for its end of line,
    // unless the handshake's random bytes hold one: then it answers with an error, which is no
    // TLS. Either way the message asks the question.
    assert!(
        matches!(error.kind(), StoreErrorKind::Tls | StoreErrorKind::Timeout),
        "{error:?}"
    );
    assert!(error.to_string().contains("is it a TLS port?"), "{error}");
}
