//! Re-entry on real Redis: a handler behind `LockLayer` whose code takes `Locker::acquire` on
//! the key its request holds gets a lease on the same hold at once (same fencing token), and
//! releasing it does not end the request's lease; a spawned task is another holder; a shared
//! holder re-enters shared, not exclusive.

mod support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::Path,
    http::{Method, Request, StatusCode},
    routing::get,
};
use support::{body_json, handoff_subscriptions, send};
use tower_lock::{Key, Lease, LockConfig, LockError, LockLayer, Locker, RedisStore, Wait};
use tower_lock_testkit::RedisServer;

async fn locker(server: &RedisServer) -> Locker {
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(server, 1).await;
    Locker::new(store)
}

fn half_a_second() -> Wait {
    Wait::constant(Duration::from_millis(50)).deadline(Duration::from_millis(500))
}

/// What a nested acquire found: how long it took, its fencing token, or its error.
type Nested = Result<(Duration, u64), String>;

/// The scenario: `/items/{sku}` behind the layer; the handler calls a function that
/// takes the SKU's key with a 500 ms deadline. It returns at once with the request's fencing
/// token; released, the request still holds the key (another process cannot take it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_acquire_in_the_handler_re_enters_the_requests_lease() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let other = Locker::new(RedisStore::connect(server.url()).await.unwrap());
    let seen: Arc<Mutex<Option<(Nested, bool)>>> = Arc::default();
    let app = Router::new()
        .route(
            "/items/{sku}",
            get({
                let (locker, other, seen) = (locker.clone(), other.clone(), Arc::clone(&seen));
                move |Path(sku): Path<String>, lease: Lease| async move {
                    let started = Instant::now();
                    let key = locker.key("items", &sku).unwrap();
                    let nested = match locker.acquire(key.clone()).wait(half_a_second()).await {
                        Ok(guard) => {
                            let found = (started.elapsed(), guard.fencing_token());
                            guard.release().await.unwrap();
                            Ok(found)
                        }
                        Err(error) => Err(error.to_string()),
                    };
                    // Released, the nested lease leaves the request's lease held: another
                    // process (here, another task: this one would re-enter) cannot take it.
                    let taken = tokio::spawn(async move {
                        other.acquire(key).try_acquire().await.unwrap().is_some()
                    })
                    .await
                    .unwrap();
                    *seen.lock().unwrap() = Some((nested, taken));
                    assert!(!lease.is_lost());
                    lease.fencing_token().to_string()
                }
            }),
        )
        .route_layer(LockLayer::from_locker(locker, Key::path_param("sku")).namespace("items"));
    let response = send(
        &app,
        Request::get("/items/sku-1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let outer: u64 = String::from_utf8(
        axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap()
    .parse()
    .unwrap();
    let (nested, taken) = seen.lock().unwrap().take().unwrap();
    let (took, token) = nested.expect("the nested acquire failed");
    assert!(
        took < Duration::from_millis(200),
        "waited {took:?} for itself"
    );
    assert_eq!(token, outer, "another fencing token: not the same hold");
    assert!(!taken, "the nested release ended the request's lease");
}

/// A task the handler spawns is another task: it does not hold the request's lease, and waits
/// for it like any other holder (here, until its deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_task_does_not_re_enter() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let app = Router::new()
        .route(
            "/items/{sku}",
            get({
                let locker = locker.clone();
                move |Path(sku): Path<String>| async move {
                    let key = locker.key("items", &sku).unwrap();
                    let spawned = tokio::spawn({
                        let locker = locker.clone();
                        async move { locker.acquire(key).wait(half_a_second()).await.map(drop) }
                    });
                    match spawned.await.unwrap() {
                        Err(LockError::Contended { .. }) => "contended",
                        Err(_) => "failed",
                        Ok(()) => "acquired",
                    }
                }
            }),
        )
        .route_layer(LockLayer::from_locker(locker, Key::path_param("sku")).namespace("items"));
    let response = send(
        &app,
        Request::get("/items/sku-1").body(Body::empty()).unwrap(),
    )
    .await;
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"contended");
}

/// A request that holds its key shared re-enters it shared at once; an exclusive acquire of
/// the same key is no re-entry (a reader cannot become the writer) and waits, here until its
/// deadline. `Locker::run` re-enters the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_holder_re_enters_shared_only() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let app = Router::new()
        .route(
            "/items/{sku}",
            get({
                let locker = locker.clone();
                move |Path(sku): Path<String>| async move {
                    let key = locker.key("items", &sku).unwrap();
                    let started = Instant::now();
                    let shared = locker
                        .acquire(key.clone())
                        .shared()
                        .wait(half_a_second())
                        .await;
                    let shared_took = started.elapsed();
                    let exclusive = locker.acquire(key).exclusive().wait(half_a_second()).await;
                    serde_json::json!({
                        "shared": shared.is_ok(),
                        "shared_ms": shared_took.as_millis() as u64,
                        "exclusive_contended":
                            matches!(exclusive, Err(LockError::Contended { .. })),
                    })
                    .to_string()
                }
            }),
        )
        .route_layer(
            LockLayer::from_locker(locker.clone(), Key::path_param("sku"))
                .namespace("items")
                .shared_when(|parts| parts.method == Method::GET),
        );
    let response = send(
        &app,
        Request::get("/items/sku-1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = body_json(response).await;
    assert_eq!(body["shared"], true, "{body}");
    assert!(body["shared_ms"].as_u64().unwrap() < 200, "{body}");
    assert_eq!(body["exclusive_contended"], true, "{body}");

    // `Locker::run`'s work re-enters its own lease.
    let config = LockConfig::builder().wait(half_a_second()).build().unwrap();
    let locker = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), config);
    let key = locker.key("jobs", "nightly").unwrap();
    let inner = locker
        .run(key.clone(), {
            let (locker, key) = (locker.clone(), key.clone());
            async move {
                let started = Instant::now();
                let guard = locker.acquire(key).await.unwrap();
                assert!(started.elapsed() < Duration::from_millis(200));
                guard.fencing_token()
            }
        })
        .await
        .unwrap();
    assert!(inner > 0);
    // Released by the run's end, not by the nested guard's.
    assert!(locker.try_acquire(key).await.unwrap().is_some());
}
