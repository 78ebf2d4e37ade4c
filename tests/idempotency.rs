//! `IdempotencyLayer` on `MemoryStore` and on a real `redis-server` (each Redis test starts its
//! own on a free loopback port): every row of the module docs' response table, plus drops,
//! streamed bodies, expiry, principals, and the atomic record-and-release. The stores'
//! crate-private record operations (`complete`, `lookup`) are tested in the crate,
//! `src/store/tests/`.

use crate::support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Extension, Router,
    body::Body,
    extract::Query,
    http::{HeaderMap, Request, Response, StatusCode, header},
    response::IntoResponse,
    routing::post,
};
use bytes::Bytes;
use serde::Deserialize;
use support::{Backend, LockKeys, Memory, Redis, send, wait_until};
use tower_lock::{
    IdempotencyLayer, Lease, LockConfig, Wait,
    idempotency::{
        Always, Fingerprint, IdempotencyConfig, IdempotencyKey, IdempotencyStore, NotError,
        SharedKeySpace,
    },
};

const KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

/// Counts handler runs.
#[derive(Default)]
struct Runs {
    started: AtomicUsize,
    finished: AtomicUsize,
}

#[derive(Deserialize, Default)]
struct Params {
    #[serde(default)]
    wait_ms: u64,
    #[serde(default)]
    fail: bool,
    #[serde(default)]
    size: usize,
    /// Answer 402 (a declined card) on the first this many runs.
    #[serde(default)]
    decline_runs: usize,
}

/// `POST /payments` and `POST /refunds`: a "payment" numbered by run, with headers that are
/// and are not on the replay allow-list. `?wait_ms=N` works that long, `?fail=true` answers
/// 500, `?size=N` answers an N-byte body, `?decline_runs=N` answers 402 on the first N runs.
/// `POST /stream` streams three chunks.
fn make_app(runs: Arc<Runs>, layer: Option<IdempotencyLayer>) -> Router {
    let handler = {
        let runs = Arc::clone(&runs);
        move |lease: Option<Lease>,
              key: Option<Extension<IdempotencyKey>>,
              Query(params): Query<Params>,
              body: Bytes| {
            let runs = Arc::clone(&runs);
            async move {
                let n = runs.started.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(params.wait_ms)).await;
                runs.finished.fetch_add(1, Ordering::SeqCst);
                if params.fail {
                    return (StatusCode::INTERNAL_SERVER_ERROR, "charge failed").into_response();
                }
                if params.size > 0 {
                    return (StatusCode::OK, vec![b'x'; params.size]).into_response();
                }
                if n <= params.decline_runs {
                    return (StatusCode::PAYMENT_REQUIRED, format!("declined (run {n})"))
                        .into_response();
                }
                let json = serde_json::json!({
                    "id": format!("pay_{n}"),
                    "request": String::from_utf8_lossy(&body),
                    "key": key.map(|Extension(k)| k.as_str().to_owned()),
                    "fencing_token": lease.map(|l| l.fencing_token()),
                });
                let mut headers = HeaderMap::new();
                headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
                headers.insert(
                    header::LOCATION,
                    format!("/payments/pay_{n}").parse().unwrap(),
                );
                headers.insert(header::SET_COOKIE, "session=secret".parse().unwrap());
                headers.insert("x-run", n.to_string().parse().unwrap());
                (StatusCode::CREATED, headers, json.to_string()).into_response()
            }
        }
    };
    let stream = {
        let runs = Arc::clone(&runs);
        move || {
            let runs = Arc::clone(&runs);
            async move {
                runs.started.fetch_add(1, Ordering::SeqCst);
                let chunks = futures_util::stream::unfold(1, |i| async move {
                    if i > 3 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    Some((Ok::<_, Infallible>(format!("chunk-{i};")), i + 1))
                });
                Body::from_stream(chunks)
            }
        }
    };
    let router = Router::new()
        .route("/payments", post(handler.clone()))
        .route("/refunds", post(handler))
        .route("/stream", post(stream));
    match layer {
        Some(layer) => router.route_layer(layer),
        None => router,
    }
}

/// The layer over `backend`'s store, scoped by the `x-tenant` header.
async fn layer<B: Backend>(backend: &B, config: IdempotencyConfig) -> IdempotencyLayer
where
    B::Store: IdempotencyStore,
{
    IdempotencyLayer::with_config(backend.store().await, by_tenant, config)
}

/// The principal: the `x-tenant` header (a stand-in for what authentication would set).
fn by_tenant(parts: &axum::http::request::Parts) -> Option<Bytes> {
    let tenant = parts.headers.get("x-tenant")?;
    Some(Bytes::copy_from_slice(tenant.as_bytes()))
}

fn post_to(uri: &str, key: Option<&str>, tenant: Option<&str>, body: &str) -> Request<Body> {
    let mut req = Request::post(uri);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    if let Some(tenant) = tenant {
        req = req.header("x-tenant", tenant);
    }
    req.body(Body::from(body.to_owned())).unwrap()
}

/// `POST /payments` by tenant `t1` with `KEY` as a structured-field string.
fn pay(body: &str) -> Request<Body> {
    post_to("/payments", Some(&format!("\"{KEY}\"")), Some("t1"), body)
}

async fn bytes(response: Response<Body>) -> Bytes {
    axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
}

fn replayed(response: &Response<Body>) -> bool {
    response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Asserts a problem+json response of `status` whose `type` ends in `#kind`.
async fn assert_problem(response: Response<Body>, status: StatusCode, kind: &str) {
    assert_eq!(response.status(), status);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let body: serde_json::Value = serde_json::from_slice(&bytes(response).await).unwrap();
    assert_eq!(body["status"], status.as_u16());
    let kind_uri = body["type"].as_str().unwrap();
    assert!(
        kind_uri.starts_with(tower_lock::response::PROBLEM_TYPE_BASE)
            && kind_uri.ends_with(&format!("#{kind}")),
        "{body}"
    );
    assert!(!body.to_string().contains(KEY), "the key leaks: {body}");
}

// ---------------------------------------------------------------------------------------------
// The suite, run against both stores.

/// Missing key: 400 (or passed through when not required); malformed, repeated, short: 400.
async fn bad_or_missing_key_is_400<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    let r = send(&app, post_to("/payments", None, Some("t1"), "{}")).await;
    assert_problem(r, StatusCode::BAD_REQUEST, "idempotency-key-missing").await;
    for bad in [
        "\"short\"",
        "short-bare",
        "\"unterminated-8e03978e",
        "two words 8e03978e",
    ] {
        let r = send(&app, post_to("/payments", Some(bad), Some("t1"), "{}")).await;
        assert_problem(r, StatusCode::BAD_REQUEST, "idempotency-key-invalid").await;
    }
    let twice = Request::post("/payments")
        .header("idempotency-key", KEY)
        .header("idempotency-key", KEY)
        .header("x-tenant", "t1")
        .body(Body::empty())
        .unwrap();
    assert_problem(
        send(&app, twice).await,
        StatusCode::BAD_REQUEST,
        "idempotency-key-invalid",
    )
    .await;
    assert_eq!(runs.started.load(Ordering::SeqCst), 0);

    let optional = IdempotencyConfig::builder()
        .required(false)
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, optional).await));
    let r = send(&app, post_to("/payments", None, Some("t1"), "{}")).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(!replayed(&r));
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// A retry after the first request finished gets its status, allowed headers and body,
/// marked replayed; the handler ran once. The bare-token spelling is the same key.
async fn finished_key_is_replayed<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    let first = send(&app, pay(r#"{"amount":1250}"#)).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    assert_eq!(first.headers()["x-run"], "1");
    let first_body = bytes(first).await;
    let json: serde_json::Value = serde_json::from_slice(&first_body).unwrap();
    assert_eq!(json["key"], KEY, "the handler sees the key");
    assert!(
        json["fencing_token"].as_u64().unwrap() > 0,
        "the handler has a lease"
    );

    // Bare token this time: the same key.
    let retry = send(
        &app,
        post_to("/payments", Some(KEY), Some("t1"), r#"{"amount":1250}"#),
    )
    .await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(replayed(&retry));
    assert_eq!(retry.headers()[header::CONTENT_TYPE], "application/json");
    assert_eq!(retry.headers()[header::LOCATION], "/payments/pay_1");
    assert!(
        retry.headers().get(header::SET_COOKIE).is_none(),
        "not on the allow-list"
    );
    assert!(
        retry.headers().get("x-run").is_none(),
        "not on the allow-list"
    );
    assert_eq!(bytes(retry).await, first_body);
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);

    // A configured allow-list replays exactly its headers.
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .replay_headers([axum::http::HeaderName::from_static("x-run")])
        .namespace("other")
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    send(&app, pay("{}")).await;
    let retry = send(&app, pay("{}")).await;
    assert!(replayed(&retry));
    assert_eq!(retry.headers()["x-run"], "1");
    assert!(retry.headers().get(header::LOCATION).is_none());
}

/// A duplicate while the first request runs: 409 problem with `Retry-After`, from the lock.
/// With a waiting lock policy the duplicate waits and gets the replay instead.
async fn running_key_is_409<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            let r = send(
                &app,
                post_to("/payments?wait_ms=800", Some(KEY), Some("t1"), "{}"),
            )
            .await;
            (r.status(), bytes(r).await)
        }
    });
    wait_until(|| runs.started.load(Ordering::SeqCst) == 1).await;
    // A duplicate and a retry send what the first sent, its query string included (which the
    // fingerprint counts).
    let same = || post_to("/payments?wait_ms=800", Some(KEY), Some("t1"), "{}");
    let dup = send(&app, same()).await;
    assert_eq!(dup.status(), StatusCode::CONFLICT);
    let retry_after: u64 = dup.headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&retry_after), "Retry-After {retry_after}");
    assert_problem(dup, StatusCode::CONFLICT, "lock-contended").await;
    let (status, first_body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let retry = send(&app, same()).await;
    assert!(replayed(&retry));
    // The same key on another query is another request: refused, not replayed.
    let other = send(&app, pay("{}")).await;
    assert_problem(
        other,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
    )
    .await;
    assert_eq!(bytes(retry).await, first_body);
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);

    // Waiting instead of failing fast: the duplicate waits for the first, then replays it.
    let runs = Arc::new(Runs::default());
    let patient = IdempotencyConfig::builder()
        .namespace("patient")
        .lock(
            LockConfig::builder()
                .wait(
                    Wait::constant(Duration::from_millis(10))
                        .unwrap()
                        .deadline(Duration::from_secs(10)),
                )
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, patient).await));
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            let r = send(
                &app,
                post_to("/payments?wait_ms=300", Some(KEY), Some("t1"), "{}"),
            )
            .await;
            bytes(r).await
        }
    });
    wait_until(|| runs.started.load(Ordering::SeqCst) == 1).await;
    let dup = send(
        &app,
        post_to("/payments?wait_ms=300", Some(KEY), Some("t1"), "{}"),
    )
    .await;
    assert!(replayed(&dup));
    assert_eq!(bytes(dup).await, first.await.unwrap());
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// The same key with another body or on another path: 422. The fingerprint is configurable.
async fn changed_request_is_422<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    assert_eq!(
        send(&app, pay(r#"{"amount":1250}"#)).await.status(),
        StatusCode::CREATED
    );
    let changed = send(&app, pay(r#"{"amount":999}"#)).await;
    assert_problem(
        changed,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
    )
    .await;
    let other_route = send(
        &app,
        post_to("/refunds", Some(KEY), Some("t1"), r#"{"amount":1250}"#),
    )
    .await;
    assert_problem(
        other_route,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
    )
    .await;
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
    // The 422s changed nothing: the original still replays.
    assert!(replayed(&send(&app, pay(r#"{"amount":1250}"#)).await));

    // Without the body in the fingerprint, a changed body replays.
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .namespace("no-body")
        .fingerprint(Fingerprint::default().body(false))
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    send(&app, pay(r#"{"amount":1250}"#)).await;
    assert!(replayed(&send(&app, pay(r#"{"amount":999}"#)).await));
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// 5xx responses are not stored by default (a retry runs again); stored with `Always`.
async fn server_errors_are_not_stored_by_default<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let failing = || post_to("/payments?fail=true", Some(KEY), Some("t1"), "{}");
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    for run in 1..=2 {
        let r = send(&app, failing()).await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!replayed(&r));
        assert_eq!(runs.started.load(Ordering::SeqCst), run);
    }

    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .namespace("store-5xx")
        .store_when(Always)
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    assert_eq!(send(&app, failing()).await.status(), 500);
    let retry = send(&app, failing()).await;
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(replayed(&retry));
    assert_eq!(bytes(retry).await, "charge failed");
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// A response over the cap reaches the client whole but is not stored: a retry runs again.
/// A request body over its cap is a 413, declared or streamed.
async fn size_caps<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .max_response_body(1000)
        .max_request_body(64)
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    let big = || post_to("/payments?size=5000", Some(KEY), Some("t1"), "{}");
    for run in 1..=2 {
        let r = send(&app, big()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(!replayed(&r));
        let body = bytes(r).await;
        assert_eq!(body.len(), 5000);
        assert!(body.iter().all(|b| *b == b'x'));
        assert_eq!(runs.started.load(Ordering::SeqCst), run, "not re-run");
    }
    // Just under the cap is stored.
    let small = || {
        post_to(
            "/payments?size=1000",
            Some(&KEY.replace('8', "9")),
            Some("t1"),
            "{}",
        )
    };
    send(&app, small()).await;
    assert!(replayed(&send(&app, small()).await));

    let declared = post_to("/payments", Some(KEY), Some("t1"), &"y".repeat(65));
    assert_problem(
        send(&app, declared).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "request-body-too-large",
    )
    .await;
    let chunks = futures_util::stream::iter(
        (0..10).map(|_| Ok::<_, Infallible>(Bytes::from_static(b"0123456789"))),
    );
    let streamed = Request::post("/payments")
        .header("idempotency-key", KEY)
        .header("x-tenant", "t1")
        .body(Body::from_stream(chunks))
        .unwrap();
    assert_problem(
        send(&app, streamed).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "request-body-too-large",
    )
    .await;
    assert_eq!(runs.started.load(Ordering::SeqCst), 3);
}

/// A request dropped while its handler runs stores nothing and frees the key at once: a
/// retry runs the handler (not 409 until the TTL, not a replay).
async fn dropped_request_leaves_the_key_usable<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .lock(support::ttl_config(Duration::from_secs(30)))
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    let running = tokio::spawn({
        let app = app.clone();
        async move {
            send(
                &app,
                post_to("/payments?wait_ms=60000", Some(KEY), Some("t1"), "{}"),
            )
            .await
        }
    });
    wait_until(|| runs.started.load(Ordering::SeqCst) == 1).await;
    assert_eq!(send(&app, pay("{}")).await.status(), StatusCode::CONFLICT);
    running.abort();
    let dropped = Instant::now();
    let retry = loop {
        let r = send(&app, pay("{}")).await;
        if r.status() != StatusCode::CONFLICT {
            break r;
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(5),
            "key still locked long after the drop (TTL 30 s)"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(
        !replayed(&retry),
        "a dropped request must not leave a record"
    );
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
    assert_eq!(runs.finished.load(Ordering::SeqCst), 1);
}

/// A streamed response is stored whole and replayed byte for byte.
async fn streamed_body_is_replayed<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    let stream = || post_to("/stream", Some(KEY), Some("t1"), "");
    let first = send(&app, stream()).await;
    assert!(!replayed(&first));
    assert_eq!(bytes(first).await, "chunk-1;chunk-2;chunk-3;");
    let retry = send(&app, stream()).await;
    assert!(replayed(&retry));
    assert_eq!(bytes(retry).await, "chunk-1;chunk-2;chunk-3;");
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// After the retention the record is gone and the key runs anew.
async fn expired_record_frees_the_key<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .retention(Duration::from_millis(300))
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    send(&app, pay("{}")).await;
    assert!(replayed(&send(&app, pay("{}")).await));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after = send(&app, pay("{}")).await;
    assert_eq!(after.status(), StatusCode::CREATED);
    assert!(!replayed(&after));
    assert_eq!(after.headers()["x-run"], "2");
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
}

/// Two principals with the same key value: two runs, each replays only its own response. No
/// principal: 500.
async fn principals_do_not_share_records<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    let as_tenant = |t: &str| post_to("/payments", Some(KEY), Some(t), "{}");
    let a = bytes(send(&app, as_tenant("tenant-a")).await).await;
    let b = send(&app, as_tenant("tenant-b")).await;
    assert!(!replayed(&b), "tenant-b was served tenant-a's response");
    let b = bytes(b).await;
    assert_ne!(a, b);
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
    assert_eq!(bytes(send(&app, as_tenant("tenant-a")).await).await, a);
    assert_eq!(bytes(send(&app, as_tenant("tenant-b")).await).await, b);
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
    let anonymous = send(&app, post_to("/payments", Some(KEY), None, "{}")).await;
    assert_problem(
        anonymous,
        StatusCode::INTERNAL_SERVER_ERROR,
        "idempotency-principal-missing",
    )
    .await;
}

/// A client error is stored by default: a retry with the same key and body gets the 402 again.
/// With `store_when(NotError)` it is not, so the retry (the customer changed cards) runs the
/// handler, and that answer is the one stored. A closure decides per response.
async fn client_errors_are_stored_unless_the_predicate_says_not<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let declined_once = || {
        post_to(
            "/payments?decline_runs=1",
            Some(KEY),
            Some("t1"),
            r#"{"amount":1250}"#,
        )
    };
    // The default: stored, and replayed to the corrected retry.
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    assert_eq!(
        send(&app, declined_once()).await.status(),
        StatusCode::PAYMENT_REQUIRED
    );
    let retry = send(&app, declined_once()).await;
    assert_eq!(retry.status(), StatusCode::PAYMENT_REQUIRED);
    assert!(replayed(&retry));
    assert_eq!(bytes(retry).await, "declined (run 1)");
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);

    // `NotError`: the 402 is not stored; the retry runs and its 201 is what replays.
    let not_error = IdempotencyConfig::builder()
        .namespace("not-error")
        .store_when(NotError)
        .build()
        .unwrap();
    let corrected_retry_runs = |config: IdempotencyConfig| {
        let backend = &backend;
        async move {
            let runs = Arc::new(Runs::default());
            let app = make_app(Arc::clone(&runs), Some(layer(backend, config).await));
            let first = send(&app, declined_once()).await;
            assert_eq!(first.status(), StatusCode::PAYMENT_REQUIRED);
            let retry = send(&app, declined_once()).await;
            assert_eq!(retry.status(), StatusCode::CREATED, "the retry did not run");
            assert!(!replayed(&retry));
            let created = bytes(retry).await;
            let again = send(&app, declined_once()).await;
            assert!(replayed(&again));
            assert_eq!(bytes(again).await, created);
            assert_eq!(runs.started.load(Ordering::SeqCst), 2);
        }
    };
    corrected_retry_runs(not_error).await;
    // The same, decided by a closure on the response head.
    let closure = IdempotencyConfig::builder()
        .namespace("closure")
        .store_when(|head: &axum::http::response::Parts| {
            head.status != StatusCode::PAYMENT_REQUIRED && !head.status.is_server_error()
        })
        .build()
        .unwrap();
    corrected_retry_runs(closure).await;
}

/// Two clients, the same key and the same body: each gets its own run, with a layer built the
/// plain way (`IdempotencyLayer::new(store, principal)`). Built without a principal, as the
/// layer could be before, the second client was served the first client's response.
async fn another_clients_key_and_body_get_their_own_run<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(IdempotencyLayer::new(backend.store().await, by_tenant)),
    );
    let charge = |tenant: &str| post_to("/payments", Some(KEY), Some(tenant), r#"{"amount":1}"#);
    let a = send(&app, charge("tenant-a")).await;
    assert_eq!(a.headers()["x-run"], "1");
    let b = send(&app, charge("tenant-b")).await;
    assert!(
        !replayed(&b),
        "tenant-b was served tenant-a's stored response"
    );
    assert_eq!(b.headers()["x-run"], "2");
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
}

/// A shared key space, chosen explicitly: one record per key whoever sends it, and no
/// principal needed.
async fn shared_key_space_is_one_space_for_everyone<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(IdempotencyLayer::new(backend.store().await, SharedKeySpace)),
    );
    let first = send(
        &app,
        post_to("/payments", Some(KEY), Some("tenant-a"), "{}"),
    )
    .await;
    assert!(!replayed(&first));
    let first = bytes(first).await;
    for tenant in [Some("tenant-b"), None] {
        let other = send(&app, post_to("/payments", Some(KEY), tenant, "{}")).await;
        assert!(
            replayed(&other),
            "{tenant:?} ran again in a shared key space"
        );
        assert_eq!(bytes(other).await, first);
    }
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(Memory::new()).await;
                }
            )*
        }
        mod redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(Redis::new()).await;
                }
            )*
        }
    };
}

suite!(
    bad_or_missing_key_is_400,
    finished_key_is_replayed,
    running_key_is_409,
    changed_request_is_422,
    server_errors_are_not_stored_by_default,
    size_caps,
    dropped_request_leaves_the_key_usable,
    streamed_body_is_replayed,
    expired_record_frees_the_key,
    principals_do_not_share_records,
    client_errors_are_stored_unless_the_predicate_says_not,
    another_clients_key_and_body_get_their_own_run,
    shared_key_space_is_one_space_for_everyone,
    an_empty_principal_is_no_caller,
    a_principal_answers_a_clients_mistake_as_one,
);

/// An empty id is not the shared key space: only `SharedKeySpace` is. The obvious header
/// principal returns empty bytes for an empty `x-tenant:` header; that used to put the request
/// in the shared space, where a second anonymous caller was served the first one's payment.
/// Now it is a request without a caller (500), and the handler never runs.
async fn an_empty_principal_is_no_caller<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    let runs = Arc::new(Runs::default());
    let app = make_app(
        Arc::clone(&runs),
        Some(layer(&backend, IdempotencyConfig::default()).await),
    );
    for _ in 0..2 {
        let anonymous = send(&app, post_to("/payments", Some(KEY), Some(""), "{}")).await;
        assert!(
            !replayed(&anonymous),
            "an anonymous caller got another's payment"
        );
        assert_problem(
            anonymous,
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency-principal-missing",
        )
        .await;
    }
    assert_eq!(runs.started.load(Ordering::SeqCst), 0);
}

/// A principal can say the request is the client's mistake: 401 with its challenge, or 400,
/// as problem+json, before the handler runs, and before the idempotency key is looked at.
async fn a_principal_answers_a_clients_mistake_as_one<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    use tower_lock::idempotency::PrincipalRejection;
    let principal = |parts: &axum::http::request::Parts| match parts.headers.get("x-tenant") {
        None => Err(PrincipalRejection::unauthorized(
            axum::http::HeaderValue::from_static("ApiKey realm=\"payments\""),
        )),
        Some(tenant) if !tenant.as_bytes().iter().all(u8::is_ascii_alphanumeric) => Err(
            PrincipalRejection::bad_request("`x-tenant` is not an account id"),
        ),
        Some(tenant) => Ok(Bytes::copy_from_slice(tenant.as_bytes())),
    };
    let runs = Arc::new(Runs::default());
    let layer = IdempotencyLayer::new(backend.store().await, principal);
    let app = make_app(Arc::clone(&runs), Some(layer));
    let anonymous = send(&app, post_to("/payments", Some(KEY), None, "{}")).await;
    assert_eq!(
        anonymous.headers()[header::WWW_AUTHENTICATE],
        "ApiKey realm=\"payments\""
    );
    assert_problem(
        anonymous,
        StatusCode::UNAUTHORIZED,
        "idempotency-principal-unauthorized",
    )
    .await;
    // Who asks is checked before which key: neither credentials nor a key (or a bad key) is a
    // 401 too, not a 400 for the key.
    for key in [None, Some("short")] {
        let nobody = send(&app, post_to("/payments", key, None, "{}")).await;
        assert_problem(
            nobody,
            StatusCode::UNAUTHORIZED,
            "idempotency-principal-unauthorized",
        )
        .await;
    }
    let malformed = send(&app, post_to("/payments", Some(KEY), Some("t 1"), "{}")).await;
    assert_problem(
        malformed,
        StatusCode::BAD_REQUEST,
        "idempotency-principal-invalid",
    )
    .await;
    assert_eq!(runs.started.load(Ordering::SeqCst), 0);
    let known = send(&app, post_to("/payments", Some(KEY), Some("t1"), "{}")).await;
    assert_eq!(known.status(), StatusCode::CREATED);
}

/// The negative control for `running_key_is_409` and `finished_key_is_replayed`: without the
/// layer, concurrent duplicates both run, and so does a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layer_duplicates_run_again() {
    let runs = Arc::new(Runs::default());
    let app = make_app(Arc::clone(&runs), None);
    let slow = || post_to("/payments?wait_ms=200", Some(KEY), Some("t1"), "{}");
    let (a, b) = tokio::join!(send(&app, slow()), send(&app, slow()));
    assert_eq!(
        (a.status(), b.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(bytes(a).await, bytes(b).await, "two different payments");
    assert!(!replayed(&send(&app, pay("{}")).await));
    assert_eq!(runs.started.load(Ordering::SeqCst), 3);
}

/// In Redis, a finished request leaves its record (with the retention as TTL) and no lock key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keeps_the_record_next_to_a_released_lock() {
    let backend = Redis::new();
    let runs = Arc::new(Runs::default());
    let config = IdempotencyConfig::builder()
        .retention(Duration::from_secs(3600))
        .build()
        .unwrap();
    let app = make_app(Arc::clone(&runs), Some(layer(&backend, config).await));
    assert_eq!(send(&app, pay("{}")).await.status(), StatusCode::CREATED);
    let mut conn = backend.0.client().await;
    let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS")
        .arg("tower-lock:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let records: Vec<_> = keys.iter().filter(|k| support::is_record_key(k)).collect();
    assert_eq!(records.len(), 1, "{keys:?}");
    assert!(
        backend
            .0
            .lock_keys()
            .await
            .iter()
            .all(|k| support::is_record_key(k)),
        "a lock key is left: {keys:?}"
    );
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(records[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 3_500_000 && ttl <= 3_600_000, "record TTL {ttl} ms");
    // Neither the client's key nor the principal is in any key name: their digest is (the
    // client's key is not in any value Redis returns to other principals either, checked by
    // `principals_do_not_share_records`).
    for key in &keys {
        assert!(!String::from_utf8_lossy(key).contains(KEY), "{keys:?}");
    }
}

/// The record written with the release fails (the store's connections dropped 150 ms into a
/// 400 ms handler: the first call after that fails, then the connection comes back): it is
/// sent again while the lease is valid, and stored. Before, the armed drop guard sent a plain
/// release, which freed the key without the record: the client had its 201, and its retry ran
/// the handler again ("charged" twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_write_that_fails_is_sent_again_not_replaced_by_a_release() {
    let server = tower_lock_testkit::RedisServer::start();
    let proxy = tower_lock_testkit::Proxy::start(server.port());
    let store = tower_lock::RedisStore::connect(proxy.url()).await.unwrap();
    let layer = IdempotencyLayer::with_config(store, by_tenant, IdempotencyConfig::default());
    let runs = Arc::new(Runs::default());
    let app = make_app(Arc::clone(&runs), Some(layer));
    let key = format!("\"{KEY}\"");
    let pay_slowly = move || post_to("/payments?wait_ms=400", Some(&key), Some("t1"), "{}");
    let first = tokio::spawn({
        let (app, request) = (app.clone(), pay_slowly());
        async move { send(&app, request).await }
    });
    wait_until(|| runs.started.load(Ordering::SeqCst) == 1).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.drop_all();
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // The client retries once the lock is gone (with the record, or without it).
    let started = Instant::now();
    while !server
        .lock_keys()
        .await
        .iter()
        .all(|k| support::is_record_key(k))
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the lock stayed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = send(&app, pay_slowly()).await;
    assert!(
        replayed(&retry),
        "the retry ran again: {:?}",
        retry.status()
    );
    assert_eq!(runs.started.load(Ordering::SeqCst), 1, "charged twice");
}

/// Tower contracts: the future is `Send`, the error type is the inner one, and a plain tower
/// stack (no axum) replays too.
#[tokio::test]
async fn futures_are_send_and_plain_tower_stacks_work() {
    use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
    fn assert_send<T: Send>(_: &T) {}
    let runs = Arc::new(AtomicUsize::new(0));
    let mut svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(
            tower_lock::MemoryStore::new(),
            SharedKeySpace,
        ))
        .service(service_fn({
            let runs = Arc::clone(&runs);
            move |_req: Request<Body>| {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                async move { Ok::<_, Infallible>(Response::new(Body::from(format!("run {n}")))) }
            }
        }));
    for expect_replay in [false, true] {
        let req = Request::post("/")
            .header("idempotency-key", KEY)
            .body(Body::empty())
            .unwrap();
        let fut = svc.ready().await.unwrap().call(req);
        assert_send(&fut);
        let response: Response<_> = fut.await.unwrap();
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            expect_replay
        );
        let body = axum::body::to_bytes(Body::new(response.into_body()), 100)
            .await
            .unwrap();
        assert_eq!(body, "run 1");
    }
}

/// A handler takes the key the layer read as an extractor; on a route without the layer the
/// extractor answers 500 (a server bug), and `Option<IdempotencyKey>` is `None`.
#[tokio::test]
async fn the_idempotency_key_is_an_extractor() {
    use tower::ServiceExt;
    use tower_lock::MemoryStore;
    let app = Router::new()
        .route(
            "/pay",
            post(|key: IdempotencyKey| async move { key.as_str().to_owned() }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace))
        .route(
            "/bare",
            post(|key: IdempotencyKey| async move { key.as_str().to_owned() }),
        )
        .route(
            "/optional",
            post(|key: Option<IdempotencyKey>| async move { format!("{}", key.is_some()) }),
        );
    let request = |path: &str| {
        Request::post(path)
            .header("idempotency-key", "key-0123456789abcdef")
            .body(Body::from("{}"))
            .unwrap()
    };
    let response = app.clone().oneshot(request("/pay")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"key-0123456789abcdef");
    let response = app.clone().oneshot(request("/bare")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let response = app.oneshot(request("/optional")).await.unwrap();
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"false");
}

/// A request refused before its handler ran (axum's `Json` answering 415 for a missing
/// content type, 422 for a missing field) stores nothing under the default rule: the client's
/// corrected retry with the same key runs, and is then stored and replayed.
async fn a_request_refused_before_it_ran_is_not_stored<B: Backend>(backend: B)
where
    B::Store: IdempotencyStore,
{
    #[derive(Deserialize)]
    struct Payment {
        amount: u64,
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/pay",
            post(move |axum::Json(payment): axum::Json<Payment>| {
                let runs = Arc::clone(&counted);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, format!("paid {}", payment.amount))
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(backend.store().await, SharedKeySpace));
    let pay = |key: &str, content_type: Option<&str>, body: &'static str| {
        let mut request = Request::post("/pay").header("idempotency-key", key);
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        request.body(Body::from(body)).unwrap()
    };
    let json = Some("application/json");
    for (key, first, first_status) in [
        (
            KEY,
            pay(KEY, json, r#"{"amont":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "4f6a1c2e-58b1-4d7e-9a0b-2d1f3c4e5a6b",
            pay(
                "4f6a1c2e-58b1-4d7e-9a0b-2d1f3c4e5a6b",
                None,
                r#"{"amount":1}"#,
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
    ] {
        let refused = send(&app, first).await;
        assert_eq!(refused.status(), first_status, "{key}");
        let corrected = send(&app, pay(key, json, r#"{"amount":1}"#)).await;
        assert_eq!(
            corrected.status(),
            StatusCode::CREATED,
            "{key}: the retry did not run"
        );
        let replayed = send(&app, pay(key, json, r#"{"amount":1}"#)).await;
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_request_refused_before_it_ran_is_not_stored_memory() {
    a_request_refused_before_it_ran_is_not_stored(Memory::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_before_it_ran_is_not_stored_redis() {
    a_request_refused_before_it_ran_is_not_stored(Redis::new()).await;
}

/// A layer built on a `Locker` takes its locks and records through that locker's store, with
/// its lock settings, and a background lease of the locker on the request's key excludes the
/// request.
#[tokio::test]
async fn a_layer_from_a_locker_shares_its_store() {
    let locker = tower_lock::Locker::new(tower_lock::MemoryStore::new());
    let layer = IdempotencyLayer::from_locker(locker.clone(), by_tenant).unwrap();
    assert_eq!(layer.config().lock(), locker.config());
    let runs = Arc::new(Runs::default());
    let app = make_app(Arc::clone(&runs), Some(layer));
    let first = send(&app, pay("{}")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let replayed = send(&app, pay("{}")).await;
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(bytes(first).await, bytes(replayed).await);
    assert_eq!(
        runs.started.load(Ordering::SeqCst),
        1,
        "the retry ran again"
    );
}

/// A locker whose store keeps no records cannot back the layer: refused when it is built,
/// with an error that names the store.
#[test]
fn a_layer_from_a_locker_without_records_is_refused() {
    let server = tower_lock_testkit::RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let node = runtime
        .block_on(tower_lock::RedisStore::connect(server.url()))
        .unwrap();
    let redlock = tower_lock::store::RedlockStore::new([node]).unwrap();
    let refused = IdempotencyLayer::from_locker(tower_lock::Locker::new(redlock), SharedKeySpace)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(refused.field(), "store");
    assert!(
        refused.to_string().contains("keeps no idempotency records"),
        "{refused}"
    );
}
