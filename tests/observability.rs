//! Metrics and spans: a scenario with contention, a lost lease and a store outage on a real
//! `redis-server`, then the recorded values, exactly (a test recorder, not log scraping).
#![cfg(feature = "metrics")]

mod support;

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::http::StatusCode;
use metrics_util::{
    CompositeKey, MetricKind,
    debugging::{DebugValue, DebuggingRecorder},
};
use support::{Captured, Counter, LockKeys, counter_app, purchase, send};
use tower_lock::{Key, LockConfig, LockLayer, RedisStore, Wait};
use tower_lock_testkit::RedisServer;

const SCOPE: &str = "/items/{sku}";

/// Through the `IdempotencyLayer`: a request that is stored, its retry (replayed), and the same
/// key with another body (422).
async fn idempotency_scenario() {
    use axum::{Router, body::Body, routing::post};
    use tower::ServiceExt;
    let app = Router::new()
        .route("/pay", post(|| async { "paid" }))
        .layer(tower_lock::IdempotencyLayer::new(
            tower_lock::MemoryStore::new(),
            tower_lock::idempotency::SharedKeySpace,
        ));
    for (body, status) in [
        ("a", StatusCode::OK),
        ("a", StatusCode::OK),
        ("b", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let request = axum::http::Request::post("/pay")
            .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
            .body(Body::from(body))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), status);
    }
}

async fn scenario(server: &mut RedisServer) {
    // TTL 600 ms: renewals every 200 ms, so a 100 ms handler is never renewed.
    let config = LockConfig::builder()
        .wait(Wait::none())
        .ttl(Duration::from_millis(600))
        .store_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let counter = Counter::new();
    let layer = LockLayer::with_config(store, Key::path_param("sku"), config);
    let app = counter_app(Arc::clone(&counter), Some(layer));

    // Contention: A holds "a" for 100 ms, B finds it held.
    let a = support::purchase_in_flight(&app, &counter, "a", 100).await;
    assert_eq!(
        send(&app, purchase("a", 0)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(a.await.unwrap(), StatusCode::OK);

    // A lost lease: C's key is deleted before its first renewal, which finds it gone.
    let c = support::purchase_in_flight(&app, &counter, "c", 2000).await;
    let keys = server.lock_keys().await;
    support::delete_key(server, &keys[0]).await;
    assert_eq!(c.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    // C's release is spawned (its lease was lost); let it land before the outage, or it would
    // fail and count as a release error.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // An outage: D's acquire fails, and the release its armed guard spawns (in case the acquire
    // ran after all) fails too: a store error, not a release error (D never held the key).
    server.kill();
    assert_eq!(
        send(&app, purchase("d", 0)).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

type Metrics = HashMap<(String, Vec<(String, String)>), DebugValue>;

fn collect(recorder: &DebuggingRecorder) -> Metrics {
    collect_from(&recorder.snapshotter())
}

fn collect_from(snapshotter: &metrics_util::debugging::Snapshotter) -> Metrics {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value): (CompositeKey, _, _, _)| {
            let (_kind, key): (MetricKind, _) = key.into_parts();
            let (name, labels) = key.into_parts();
            let mut labels: Vec<_> = labels
                .into_iter()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            ((name.as_str().to_owned(), labels), value)
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.sort();
    v
}

fn counter(metrics: &Metrics, name: &str, pairs: &[(&str, &str)]) -> u64 {
    match metrics.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        other => panic!("{name} is not a counter: {other:?}"),
    }
}

fn samples(metrics: &Metrics, name: &str, pairs: &[(&str, &str)]) -> usize {
    match metrics.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Histogram(v)) => v.len(),
        None => 0,
        other => panic!("{name} is not a histogram: {other:?}"),
    }
}

/// The two tests that run the purchase scenario (its metrics carry one scope) take turns:
/// the exact counts read the global recorder, which the other's releases on the crate's thread
/// would reach too.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes `ALONE` for the test's length (a test that panicked holding it leaves nothing to undo).
fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn metrics_count_every_outcome_exactly() {
    let _alone = alone();
    // The global recorder: releases on drop run on the crate's own thread, which a recorder
    // local to this thread would not see. (The only test here that installs one; the others'
    // metrics carry other scopes.)
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only global recorder of this test binary");
    let mut server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(scenario(&mut server));
    // Let releases on drop finish: D's fails within the store timeout (1 s).
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(1500)).await });
    let m = collect_from(&snapshotter);
    let scope = [("scope", SCOPE)];
    assert_eq!(
        counter(&m, "tower_lock_acquired_total", &scope),
        2,
        "{m:#?}"
    );
    assert_eq!(counter(&m, "tower_lock_contended_total", &scope), 1);
    // The counters with a label besides the scope: name, label, value, count.
    for (name, label, value, count) in [
        ("tower_lock_store_errors_total", "operation", "acquire", 1),
        ("tower_lock_store_errors_total", "operation", "release", 1),
        ("tower_lock_leases_lost_total", "reason", "not_held", 1),
        ("tower_lock_renewals_total", "result", "ok", 0),
        ("tower_lock_renewals_total", "result", "failed", 1),
    ] {
        assert_eq!(
            counter(&m, name, &[("scope", SCOPE), (label, value)]),
            count,
            "{name} {label}={value}"
        );
    }
    // A's release deleted its key; C's found it gone (not counted as released, nor an error).
    assert_eq!(counter(&m, "tower_lock_released_total", &scope), 1);
    assert_eq!(counter(&m, "tower_lock_release_errors_total", &scope), 0);
    match m.get(&("tower_lock_leases_held".to_owned(), labels(&scope))) {
        Some(DebugValue::Gauge(g)) => assert_eq!(g.into_inner(), 0.0),
        other => panic!("leases_held gauge: {other:?}"),
    }
    let wait = |outcome| {
        samples(
            &m,
            "tower_lock_wait_seconds",
            &[("scope", SCOPE), ("outcome", outcome)],
        )
    };
    assert_eq!((wait("acquired"), wait("contended")), (2, 1));
    assert_eq!(samples(&m, "tower_lock_hold_seconds", &scope), 2);
    let rtt = |op| {
        samples(
            &m,
            "tower_lock_store_round_trip_seconds",
            &[("operation", op)],
        )
    };
    // B found "a" taken by A in this very process: it never asked the store. Releases: A's,
    // C's and D's.
    assert_eq!((rtt("acquire"), rtt("renew"), rtt("release")), (3, 1, 3));
    // Labels are bounded: no metric carries a key value.
    for (name, labels) in m.keys() {
        for (k, v) in labels {
            assert!(
                !["a", "c", "d"].contains(&v.as_str()),
                "{name} has a key label {k}={v}"
            );
        }
    }
}

/// Requests with extension methods (and a lower-case `get`, another method to HTTP), through
/// an `any` route under `Router::layer` and through a layer outside axum: the method is no part
/// of a lock's scope, so every method takes the resource's one lock and one label, and a
/// client cannot mint series.
async fn extension_methods_scenario() -> Vec<String> {
    use axum::{
        Router,
        body::Body,
        http::{Method, Request},
        routing::any,
    };
    use tower::{ServiceBuilder, ServiceExt, service_fn};
    use tower_lock::{Lease, MemoryStore};

    let scope_of = |lease: Lease| async move { lease.key().scope().to_owned() };
    let routed = Router::new()
        .route("/x/{id}", any(scope_of))
        .layer(LockLayer::new(MemoryStore::new(), Key::path_param("id")));
    let outside = ServiceBuilder::new()
        .layer(LockLayer::new(MemoryStore::new(), Key::path()))
        .service(service_fn(|req: Request<Body>| async move {
            let scope = req
                .extensions()
                .get::<Lease>()
                .unwrap()
                .key()
                .scope()
                .to_owned();
            Ok::<_, std::convert::Infallible>(axum::http::Response::new(Body::from(scope)))
        }));
    let mut scopes = Vec::new();
    for method in ["FOO", "BAR", "get", "POST", "QUERY"] {
        let request = || {
            Request::builder()
                .method(Method::from_bytes(method.as_bytes()).unwrap())
                .uri("/x/1")
                .body(Body::empty())
                .unwrap()
        };
        let response = routed.clone().oneshot(request()).await.unwrap();
        let body = axum::body::to_bytes(response.into_body(), 1000)
            .await
            .unwrap();
        scopes.push(String::from_utf8(body.to_vec()).unwrap());
        let response = outside.clone().oneshot(request()).await.unwrap();
        let body = axum::body::to_bytes(Body::new(response.into_body()), 1000)
            .await
            .unwrap();
        scopes.push(String::from_utf8(body.to_vec()).unwrap());
    }
    scopes
}

#[test]
fn every_method_takes_the_resources_one_lock_and_label() {
    let recorder = DebuggingRecorder::new();
    let scopes = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(extension_methods_scenario())
    });
    // One lock per resource, whatever the method.
    let expected: Vec<&str> = (0..5).flat_map(|_| ["/x/{id}", "path"]).collect();
    assert_eq!(scopes, expected);
    let m = collect(&recorder);
    let acquired = |scope| counter(&m, "tower_lock_acquired_total", &[("scope", scope)]);
    assert_eq!((acquired("/x/{id}"), acquired("path")), (5, 5), "{m:#?}");
    for (name, labels) in m.keys() {
        for (k, v) in labels {
            assert!(
                !["FOO", "BAR", "get"]
                    .iter()
                    .any(|method| v.contains(method)),
                "{name} has a client-chosen label {k}={v}"
            );
        }
    }
}

#[test]
fn spans_carry_outcomes_and_hashed_keys_never_tokens() {
    let _alone = alone();
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(logs.clone())
        .finish();
    // The global default, not a scoped one: callsites first hit by another test's thread must
    // still see this subscriber.
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let mut server = RedisServer::start();
    let mut tokens = Vec::new();
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Capture a live token while A holds its lease, then run the whole scenario.
            let store = RedisStore::connect(server.url()).await.unwrap();
            let layer = LockLayer::new(store, Key::path_param("sku"));
            let counter = Counter::new();
            let app = counter_app(Arc::clone(&counter), Some(layer));
            let held = support::purchase_in_flight(&app, &counter, "secret-sku", 50).await;
            let keys = server.lock_keys().await;
            let mut conn = server.client().await;
            let token: Vec<u8> = redis::cmd("GET")
                .arg(&keys[0])
                .query_async(&mut conn)
                .await
                .unwrap();
            tokens.push(token);
            assert_eq!(held.await.unwrap(), StatusCode::OK);
            scenario(&mut server).await;
            idempotency_scenario().await;
            extension_methods_scenario().await;
            // Releases on drop finish on the crate's thread before the other test may start.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        });
    }
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    for outcome in ["completed", "contended", "lease_lost", "store_error"] {
        assert!(
            logged.contains(&format!("outcome=\"{outcome}\""))
                || logged.contains(&format!("outcome={outcome}")),
            "no span closed with outcome {outcome}:\n{logged}"
        );
    }
    // The idempotency layer's requests end their span with its own outcomes, and the lease's
    // hold time and renewals on those that ran the handler.
    for outcome in ["stored", "replayed", "key_reused"] {
        assert!(
            logged.contains(&format!("outcome=\"{outcome}\""))
                || logged.contains(&format!("outcome={outcome}")),
            "no span closed with outcome {outcome}:\n{logged}"
        );
    }
    let stored = logged
        .lines()
        .find(|line| line.contains("outcome=stored") || line.contains("outcome=\"stored\""))
        .unwrap();
    assert!(
        stored.contains("hold_ms=") && stored.contains("renewals="),
        "{stored}"
    );
    assert!(logged.contains("fencing_token="), "{logged}");
    assert!(
        logged.contains("lease lost"),
        "lost lease not logged at warn"
    );
    // Extension methods: the scope field is the resource's.
    assert!(
        !logged.contains("scope=\"FOO") && !logged.contains("scope=FOO"),
        "an extension method in a scope field:\n{logged}"
    );
    assert!(
        !logged.contains("secret-sku"),
        "a key value is in the logs:\n{logged}"
    );
    for token in tokens {
        assert_eq!(token.len(), 32);
        assert!(
            !logged.contains(std::str::from_utf8(&token).unwrap()),
            "the token is in the logs"
        );
    }
}
