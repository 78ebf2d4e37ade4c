//! Credentials are never printed. Every store (Redis with a password and with an ACL user,
//! over plain TCP and over mutual TLS; Redlock; Cluster and Sentinel, over plain TCP and over
//! mutual TLS) runs locked requests, meets a server that dies, and fails to connect with a
//! wrong password, while everything the crate and the redis crate log is captured at TRACE
//! (the `log` records too), with every `Debug` and `Display` of the stores, their errors and
//! their settings, and every metric label: no password appears in any of them.
//!
//! And the examples: `inventory` and `payments` over `rediss://` with a private CA and mutual
//! TLS serve requests and print the URL as `rediss://:***@...`, at `RUST_LOG=trace`; with a
//! wrong password, an untrusted certificate, a certificate for another host or no server at all
//! they exit with status 1 within seconds, with a message that names the cause.

mod instances;
mod support;

use std::{path::Path, process::Command, time::Duration};

use axum::http::StatusCode;
use instances::example_binary;
use support::{Captured, Counter, counter_app, purchase, send};
use tower_lock::{
    Key, LockConfig, LockLayer, RedisStore, Wait,
    store::{LockStore, RedlockStore},
};
use tower_lock_testkit::{RedisServer, process::Process};

/// In every password here; nowhere else.
const SECRET: &str = "SECRET";
const PASSWORD: &str = "pw-SECRET-1";
const ACL_USER: &str = "locker";
const ACL_PASSWORD: &str = "acl-SECRET-2";
const WRONG_PASSWORD: &str = "wrong-SECRET-3";

/// What the test saw: log lines, `Debug` and `Display` outputs, metric labels.
#[derive(Default)]
struct Seen(Vec<String>);

impl Seen {
    fn debug(&mut self, what: &dyn std::fmt::Debug) {
        self.0.push(format!("{what:?}"));
        self.0.push(format!("{what:#?}"));
    }

    fn error(&mut self, error: &(dyn std::error::Error + 'static)) {
        self.debug(&error);
        let mut source = Some(error);
        while let Some(e) = source {
            self.0.push(e.to_string());
            source = e.source();
        }
    }
}

fn url(user: &str, password: &str, port: u16) -> String {
    format!("redis://{user}:{password}@127.0.0.1:{port}/")
}

/// A few locked requests through `store`, one of them contended (409 after a short wait).
async fn traffic(store: impl LockStore + Clone + std::fmt::Debug, seen: &mut Seen) {
    let config = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_millis(5))
                .unwrap()
                .deadline(Duration::from_millis(50)),
        )
        .build()
        .unwrap();
    let layer = LockLayer::with_config(store.clone(), Key::path_param("sku"), config);
    seen.debug(&layer);
    seen.debug(&store);
    let counter = Counter::new();
    let app = counter_app(counter, Some(layer));
    assert_eq!(send(&app, purchase("a", 0)).await.status(), StatusCode::OK);
    let slow = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("b", 300)).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        send(&app, purchase("b", 0)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(slow.await.unwrap(), StatusCode::OK);
}

async fn scenario(seen: &mut Seen) {
    // One server with a password, an ACL user, and an eviction policy that is warned about.
    let server = RedisServer::options()
        .password(PASSWORD)
        .args(&["--maxmemory-policy", "allkeys-lru"])
        .start();
    let mut admin = server.client().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(ACL_USER)
        .arg("on")
        .arg(format!(">{ACL_PASSWORD}"))
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .query_async(&mut admin)
        .await
        .unwrap();
    let port = server.port();
    for url in [url("", PASSWORD, port), url(ACL_USER, ACL_PASSWORD, port)] {
        let store = RedisStore::connect(url.as_str()).await.unwrap();
        traffic(store, seen).await;
    }
    for url in [
        url("", WRONG_PASSWORD, port),
        url(ACL_USER, WRONG_PASSWORD, port),
        format!("redis://127.0.0.1:{port}/"),
    ] {
        let error = RedisStore::connect(url.as_str()).await.unwrap_err();
        seen.error(&error);
        let error = RedlockStore::connect([url.as_str()]).await.unwrap_err();
        seen.error(&error);
    }

    // Redlock over three such servers.
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::options().password(PASSWORD).start())
        .collect();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    assert!(urls[0].contains(PASSWORD));
    traffic(RedlockStore::connect(urls).await.unwrap(), seen).await;

    // Mutual TLS, with a password.
    #[cfg(feature = "tls")]
    {
        use tower_lock::store::TlsConfig;
        use tower_lock_testkit::{TestCerts, TlsOptions};
        let certs = TestCerts::generate();
        let tls_server = RedisServer::options()
            .tls(TlsOptions::new(&certs).auth_clients(true))
            .password(PASSWORD)
            .start();
        let tls = TlsConfig::new()
            .ca_cert_file(certs.ca())
            .client_cert_files(certs.client_cert(), certs.client_key());
        seen.debug(&tls);
        let store = RedisStore::connect_with_tls(tls_server.url(), &tls)
            .await
            .unwrap();
        traffic(store, seen).await;
        let wrong = tls_server.url().replace(PASSWORD, WRONG_PASSWORD);
        seen.error(
            &RedisStore::connect_with_tls(wrong.as_str(), &tls)
                .await
                .unwrap_err(),
        );
        let untrusted = TlsConfig::new().ca_cert_file(certs.other_ca());
        seen.error(
            &RedisStore::connect_with_tls(tls_server.url(), &untrusted)
                .await
                .unwrap_err(),
        );

        // A cluster and a Sentinel setup over mutual TLS, with a password: their clients are
        // built differently (certificates and credentials given to a builder).
        let tls_options = || {
            RedisServer::options()
                .tls(TlsOptions::new(&certs).auth_clients(true))
                .password(PASSWORD)
        };
        #[cfg(feature = "cluster")]
        {
            let options = tls_options();
            let cluster = tokio::task::block_in_place(|| {
                tower_lock_testkit::RedisCluster::start_with(options, 3, 0)
            });
            assert!(cluster.urls()[0].contains(PASSWORD));
            let store = tower_lock::store::ClusterStore::connect_with_tls(cluster.urls(), &tls)
                .await
                .unwrap();
            traffic(store, seen).await;
            let wrong: Vec<String> = cluster
                .urls()
                .iter()
                .map(|u| u.replace(PASSWORD, WRONG_PASSWORD))
                .collect();
            seen.error(
                &tower_lock::store::ClusterStore::connect_with_tls(wrong, &tls)
                    .await
                    .unwrap_err(),
            );
        }
        #[cfg(feature = "sentinel")]
        {
            use redis::RedisConnectionInfo;
            use tower_lock::store::SentinelStore;
            use tower_lock_testkit::sentinel::{MASTER_NAME, SentinelSetup};
            let options = tls_options();
            let setup = tokio::task::block_in_place(|| {
                SentinelSetup::start_with(options, Duration::from_secs(5))
            });
            let master = |password: &str| RedisConnectionInfo::default().set_password(password);
            let store = SentinelStore::connect_with_tls(
                setup.sentinel_urls(),
                MASTER_NAME,
                master(PASSWORD),
                &tls,
            )
            .await
            .unwrap();
            traffic(store, seen).await;
            let error = SentinelStore::connect_with_tls(
                setup.sentinel_urls(),
                MASTER_NAME,
                master(WRONG_PASSWORD),
                &tls,
            )
            .await
            .unwrap_err();
            seen.error(&error);
        }
    }

    #[cfg(feature = "cluster")]
    {
        let options = RedisServer::options().password(PASSWORD);
        let cluster = tokio::task::block_in_place(|| {
            tower_lock_testkit::RedisCluster::start_with(options, 3, 0)
        });
        let store = tower_lock::store::ClusterStore::connect(cluster.urls())
            .await
            .unwrap();
        traffic(store, seen).await;
        let wrong: Vec<String> = cluster
            .urls()
            .iter()
            .map(|u| u.replace(PASSWORD, WRONG_PASSWORD))
            .collect();
        seen.error(
            &tower_lock::store::ClusterStore::connect(wrong)
                .await
                .unwrap_err(),
        );
    }

    #[cfg(feature = "sentinel")]
    {
        use redis::{RedisConnectionInfo, sentinel::SentinelNodeConnectionInfo};
        use tower_lock::store::SentinelStore;
        use tower_lock_testkit::sentinel::{MASTER_NAME, SentinelSetup};
        let options = RedisServer::options().password(PASSWORD);
        let setup = tokio::task::block_in_place(|| {
            SentinelSetup::start_with(options, Duration::from_secs(5))
        });
        let master = |password: &str| {
            SentinelNodeConnectionInfo::default()
                .set_redis_connection_info(RedisConnectionInfo::default().set_password(password))
        };
        let store =
            SentinelStore::connect_with(setup.sentinel_urls(), MASTER_NAME, master(PASSWORD))
                .await
                .unwrap();
        traffic(store, seen).await;
        let error =
            SentinelStore::connect_with(setup.sentinel_urls(), MASTER_NAME, master(WRONG_PASSWORD))
                .await
                .unwrap_err();
        seen.error(&error);
    }

    // A server that dies under a connected store: 503s, and warnings with their error chains.
    let mut doomed = RedisServer::options().password(PASSWORD).start();
    let store = RedisStore::connect(doomed.url()).await.unwrap();
    let layer = LockLayer::new(store.clone(), Key::path_param("sku"));
    let app = counter_app(Counter::new(), Some(layer));
    doomed.kill();
    assert_eq!(
        send(&app, purchase("c", 0)).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    seen.error(&store.eviction().await.unwrap_err());
    seen.debug(&store);
}

#[test]
fn no_password_in_logs_debug_errors_or_metrics() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(logs.clone())
        .finish();
    // The global default, and the `log` records (the redis crate's) as events.
    tracing_subscriber::util::SubscriberInitExt::try_init(subscriber).unwrap();
    let mut seen = Seen::default();
    #[cfg(feature = "metrics")]
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let run = |seen: &mut Seen| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(scenario(seen));
    };
    #[cfg(feature = "metrics")]
    metrics::with_local_recorder(&recorder, || run(&mut seen));
    #[cfg(not(feature = "metrics"))]
    run(&mut seen);
    #[cfg(feature = "metrics")]
    for (key, _, _, _) in recorder.snapshotter().snapshot().into_vec() {
        seen.debug(&key);
    }
    // A control: a field that held a password would be seen.
    tracing::info!(control = "control-line", "the capture works");

    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logged.contains("control-line"), "nothing captured");
    // What the crate logs, at the levels that matter, is there to be searched.
    assert!(
        logged.contains("maxmemory-policy"),
        "no eviction warning:\n{logged}"
    );
    assert!(logged.contains(" WARN "), "no warning at all:\n{logged}");
    assert!(
        logged.contains("TRACE") || logged.contains("DEBUG"),
        "{logged}"
    );
    for (n, line) in logged.lines().enumerate() {
        assert!(
            !line.contains(SECRET),
            "log line {n} has a password: {line}"
        );
    }
    assert!(seen.0.iter().any(|s| s.contains("Authentication")));
    for text in &seen.0 {
        assert!(!text.contains(SECRET), "a password in: {text}");
    }
}

// ---------------------------------------------------------------------------------------------
// The examples.

/// An example that must fail at start-up: its status and output.
fn fails(binary: &Path, env: &[(&str, &str)]) -> String {
    let mut command = Command::new(binary);
    command
        .env_clear()
        .env("PORT", tower_lock_testkit::free_port().to_string())
        .env("HOST", "127.0.0.1")
        .env("RUST_LOG", "trace")
        .envs(env.iter().copied());
    let finished = Process::run(
        command,
        "an example that must fail",
        Duration::from_secs(30),
    );
    let output = finished.output;
    let status = finished
        .status
        .unwrap_or_else(|| panic!("still running after 30 s:\n{output}"));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        finished.took < Duration::from_secs(10),
        "took {:?}:\n{output}",
        finished.took
    );
    assert!(!output.contains("panicked"), "{output}");
    assert!(!output.contains(SECRET), "a password in:\n{output}");
    output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn examples_fail_at_start_up_with_the_cause() {
    let binary = example_binary("inventory");
    let server = RedisServer::options().password(PASSWORD).start();
    let out = fails(
        &binary,
        &[("REDIS_URL", &url("", WRONG_PASSWORD, server.port()))],
    );
    assert!(out.contains("refused the user name or password"), "{out}");
    assert!(out.contains(":***@"), "{out}");
    let out = fails(
        &binary,
        &[(
            "REDIS_URL",
            &format!("redis://127.0.0.1:{}/", server.port()),
        )],
    );
    assert!(out.contains("requires a password"), "{out}");
    let closed = tower_lock_testkit::ClosedPort::new();
    let nowhere = format!("redis://127.0.0.1:{}/", closed.port());
    let out = fails(&binary, &[("REDIS_URL", &nowhere)]);
    assert!(out.contains("nothing listens there"), "{out}");
    let out = fails(
        &example_binary("payments"),
        &[("REDIS_URL", &url("", WRONG_PASSWORD, server.port()))],
    );
    assert!(out.contains("refused the user name or password"), "{out}");

    #[cfg(feature = "tls")]
    {
        use tower_lock_testkit::{TestCerts, TlsOptions};
        let certs = TestCerts::generate();
        let path = |p: std::path::PathBuf| p.display().to_string();
        let tls_server = RedisServer::options()
            .tls(TlsOptions::new(&certs))
            .password(PASSWORD)
            .start();
        let other = path(certs.other_ca());
        let out = fails(
            &binary,
            &[("REDIS_URL", &tls_server.url()), ("REDIS_CA_CERT", &other)],
        );
        assert!(out.contains("not signed by a trusted CA"), "{out}");
        let wrong_host = RedisServer::options()
            .tls(TlsOptions::new(&certs).wrong_host())
            .start();
        let ca = path(certs.ca());
        let out = fails(
            &binary,
            &[("REDIS_URL", &wrong_host.url()), ("REDIS_CA_CERT", &ca)],
        );
        assert!(out.contains("for another host"), "{out}");
        let mutual = RedisServer::options()
            .tls(TlsOptions::new(&certs).auth_clients(true))
            .start();
        let out = fails(
            &binary,
            &[("REDIS_URL", &mutual.url()), ("REDIS_CA_CERT", &ca)],
        );
        assert!(out.contains("requires a client certificate"), "{out}");
        let out = fails(
            &example_binary("payments"),
            &[("REDIS_URL", &tls_server.url()), ("REDIS_CA_CERT", &other)],
        );
        assert!(out.contains("not signed by a trusted CA"), "{out}");

        // A cluster over TLS (`LOCK_STORE=cluster`), with a wrong password.
        #[cfg(feature = "cluster")]
        {
            let options = RedisServer::options()
                .tls(TlsOptions::new(&certs))
                .password(PASSWORD);
            let cluster = tokio::task::block_in_place(|| {
                tower_lock_testkit::RedisCluster::start_with(options, 3, 0)
            });
            let wrong = cluster.urls().join(",").replace(PASSWORD, WRONG_PASSWORD);
            let out = fails(
                &binary,
                &[
                    ("LOCK_STORE", "cluster"),
                    ("REDIS_URLS", &wrong),
                    ("REDIS_CA_CERT", &ca),
                ],
            );
            assert!(out.contains("refused the user name or password"), "{out}");
            assert!(out.contains("Redis Cluster through"), "{out}");
        }
    }
}

/// Both examples over `rediss://` with a private CA and mutual TLS: they serve, the lock and
/// the data in Redis, and never print the password, at `RUST_LOG=trace`.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn examples_work_over_mutual_tls_and_hide_the_password() {
    use instances::Instance;
    use tower_lock_testkit::{TestCerts, TlsOptions, http::Http};
    let certs = TestCerts::generate();
    let server = RedisServer::options()
        .tls(TlsOptions::new(&certs).auth_clients(true))
        .password(PASSWORD)
        .start();
    let path = |p: std::path::PathBuf| p.display().to_string();
    let (ca, cert, key) = (
        path(certs.ca()),
        path(certs.client_cert()),
        path(certs.client_key()),
    );
    let env = [
        ("REDIS_CA_CERT", ca.as_str()),
        ("REDIS_CLIENT_CERT", cert.as_str()),
        ("REDIS_CLIENT_KEY", key.as_str()),
        ("RUST_LOG", "trace"),
    ];
    assert!(server.url().starts_with("rediss://:pw-SECRET-1@"));

    let inventory = Instance::start(&server.url(), &env);
    instances::set_stock(inventory.port, "apple", 3).await;
    let mut http = Http::new(inventory.port);
    let bought = http
        .request("POST", "/items/apple/purchase", None)
        .await
        .unwrap();
    assert_eq!(bought.status, 200, "{:?}", bought.json());
    assert_eq!(bought.json()["stock"], 2);

    let payments = Instance::start_binary(example_binary("payments"), &server.url(), &env);
    let mut http = Http::new(payments.port);
    let listed = http.request("GET", "/payments", None).await.unwrap();
    assert_eq!(listed.status, 200, "{:?}", listed.json());

    // And on a cluster over mutual TLS (`LOCK_STORE=cluster`): locks and stock in the cluster.
    #[cfg(feature = "cluster")]
    let clustered = {
        let options = RedisServer::options()
            .tls(TlsOptions::new(&certs).auth_clients(true))
            .password(PASSWORD);
        let cluster = tokio::task::block_in_place(|| {
            tower_lock_testkit::RedisCluster::start_with(options, 3, 0)
        });
        let seeds = cluster.urls().join(",");
        let mut env = env.to_vec();
        env.extend([("LOCK_STORE", "cluster"), ("REDIS_URLS", seeds.as_str())]);
        let instance = Instance::start("", &env);
        instances::set_stock(instance.port, "pear", 3).await;
        let mut http = Http::new(instance.port);
        let bought = http
            .request("POST", "/items/pear/purchase", None)
            .await
            .unwrap();
        assert_eq!(bought.status, 200, "{:?}", bought.json());
        assert_eq!(bought.json()["stock"], 2);
        let output = instance.output();
        assert!(
            output.contains("Redis Cluster seeded by rediss://:***@"),
            "{output}"
        );
        (cluster, instance)
    };
    #[cfg(feature = "cluster")]
    {
        let output = clustered.1.output();
        assert!(!output.contains(SECRET), "a password in:\n{output}");
        clustered.1.assert_no_panic();
    }
    for instance in [&inventory, &payments] {
        let output = instance.output();
        assert!(
            output.contains(&format!("rediss://:***@127.0.0.1:{}/", server.port())),
            "{output}"
        );
        assert!(!output.contains(SECRET), "a password in:\n{output}");
        instance.assert_no_panic();
    }
}
