//! The layer's own behaviour, independent of the store: tower contracts, key sources, bad input,
//! responses, the extractor, body holding. Runs on `MemoryStore`, without a network.

use crate::support;

use std::{convert::Infallible, sync::Arc, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::Request,
    http::{HeaderValue, StatusCode, header},
    routing::{get, post},
};
use bytes::Bytes;
use support::{Counter, body_json, counter_app, purchase, send};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_lock::{
    Key, Lease, LockConfig, LockError, LockLayer, MemoryStore, Wait,
    key::{KeyRejection, KeySource},
    lock::LockService,
};

fn assert_send<T: Send>(_: &T) {}

#[tokio::test]
async fn infallible_stays_infallible_and_futures_are_send() {
    let svc = ServiceBuilder::new()
        .layer(LockLayer::new(MemoryStore::new(), Key::path()))
        .service(service_fn(|_req: Request| async {
            Ok::<_, Infallible>(axum::http::Response::new(Body::from("hi")))
        }));
    fn infallible<S: Service<Request, Error = Infallible>>(_: &S) {}
    infallible(&svc);
    let mut svc = svc;
    let fut = svc.ready().await.unwrap().call(Request::new(Body::empty()));
    assert_send(&fut);
    let response = fut.await.unwrap();
    assert_eq!(response.status(), 200);
    let bytes = axum::body::to_bytes(Body::new(response.into_body()), 100)
        .await
        .unwrap();
    assert_eq!(bytes, "hi");
}

#[tokio::test]
async fn poll_ready_passes_through() {
    // A service that is never ready stays not ready behind the layer.
    let inner = tower::service_fn(|_req: Request| async {
        Ok::<_, Infallible>(axum::http::Response::new(Body::empty()))
    });
    let (limited, _) = (tower::limit::ConcurrencyLimit::new(inner, 0), ());
    let mut svc = LockService::new(limited, MemoryStore::new(), Key::path());
    let ready = futures_util::FutureExt::now_or_never(svc.ready());
    assert!(ready.is_none(), "poll_ready did not pass through");
    assert!(svc.get_ref().get_ref() as *const _ as usize != 0);
}

#[tokio::test]
async fn works_with_layer_and_route_layer() {
    let store = MemoryStore::new();
    let with_layer = Router::new()
        .route("/a", get(|| async { "a" }))
        .layer(LockLayer::new(store.clone(), Key::path()));
    let with_route_layer = Router::new()
        .route("/b/{id}", get(|| async { "b" }))
        .route_layer(LockLayer::new(store.clone(), Key::path_param("id")));
    let r = send(&with_layer, Request::get("/a").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), 200);
    let r = send(
        &with_route_layer,
        Request::get("/b/1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(store.held(), 0);
}

#[tokio::test]
async fn path_param_outside_routing_is_a_500_that_says_why() {
    // Wrapping the whole router from outside: no request has params yet.
    let router = Router::new().route("/items/{sku}", get(|| async { "x" }));
    let outside = ServiceBuilder::new()
        .layer(LockLayer::new(
            MemoryStore::new(),
            Key::path_param("sku").optional(),
        ))
        .service(router);
    let r = outside
        .oneshot(Request::get("/items/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = body_json(r.map(Body::new)).await;
    assert!(
        body["detail"].as_str().unwrap().contains("route_layer"),
        "{body}"
    );

    // A parameter the route does not have: a typo, unless the source is optional.
    let app = Router::new()
        .route("/items/{sku}", get(|| async { "x" }))
        .route_layer(LockLayer::new(MemoryStore::new(), Key::path_param("id")));
    let r = send(&app, Request::get("/items/1").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let detail = body_json(r).await["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("`id`") && detail.contains("optional"),
        "{detail}"
    );
}

/// `/items/{sku}` (POST, reports whether it ran locked), `/health` (GET), and whatever else the
/// caller adds; `Router::layer`, `route_layer` or `MethodRouter::layer` with a `sku` key.
fn sku_app(how: &str, key: tower_lock::key::PathParamKey, store: &MemoryStore) -> Router {
    let layer = LockLayer::new(store.clone(), key);
    let item = post(|lease: Option<Lease>| async move {
        if lease.is_some() {
            "locked"
        } else {
            "unlocked"
        }
    });
    let health = get(|lease: Option<Lease>| async move {
        if lease.is_some() { "locked" } else { "healthy" }
    });
    match how {
        "Router::layer" => Router::new()
            .route("/items/{sku}", item)
            .route("/health", health)
            .layer(layer),
        "route_layer" => Router::new()
            .route("/items/{sku}", item)
            .route("/health", health)
            .route_layer(layer),
        "MethodRouter::layer" => Router::new()
            .route("/items/{sku}", item.layer(layer.clone()))
            .route("/health", health.layer(layer)),
        other => unreachable!("{other}"),
    }
}

async fn status_and_text(app: &Router, req: Request) -> (StatusCode, String) {
    let r = send(app, req).await;
    let status = r.status();
    let body = axum::body::to_bytes(r.into_body(), 10_000).await.unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn unmatched_requests_keep_the_routers_404_and_405() {
    for how in ["Router::layer", "route_layer", "MethodRouter::layer"] {
        let store = MemoryStore::new();
        for key in [Key::path_param("sku"), Key::path_param("sku").optional()] {
            let app = sku_app(how, key, &store);
            let req = |method: &str, path: &str| {
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap()
            };
            let (status, text) = status_and_text(&app, req("POST", "/items/a")).await;
            assert_eq!((status, &*text), (StatusCode::OK, "locked"), "{how}");
            // No route: the router's 404, whatever the layer.
            for path in ["/nowhere", "/items/a/b", "/items/"] {
                let (status, _) = status_and_text(&app, req("POST", path)).await;
                assert_eq!(status, StatusCode::NOT_FOUND, "{how} {path}");
            }
            // No path at all (`CONNECT host:port`): axum's catch-all fallback, no parameters.
            if how == "Router::layer" {
                let (status, _) = status_and_text(&app, req("CONNECT", "example.com:443")).await;
                assert_eq!(status, StatusCode::NOT_FOUND, "{how} CONNECT");
            }
            // A route without that method: the router's 405 and its `Allow`.
            let r = send(&app, req("DELETE", "/items/a")).await;
            assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED, "{how}");
            assert_eq!(r.headers()[header::ALLOW], "POST", "{how}");
        }
        assert_eq!(store.held(), 0, "{how}");
    }
}

#[tokio::test]
async fn a_route_without_the_parameter_is_a_500_unless_optional() {
    for how in ["Router::layer", "route_layer", "MethodRouter::layer"] {
        let store = MemoryStore::new();
        let app = sku_app(how, Key::path_param("sku"), &store);
        let r = send(&app, Request::get("/health").body(Body::empty()).unwrap()).await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{how}");
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let detail = body_json(r).await["detail"].as_str().unwrap().to_owned();
        assert!(
            detail.contains("`sku`") && detail.contains("optional"),
            "{detail}"
        );

        let app = sku_app(how, Key::path_param("sku").optional(), &store);
        let (status, text) =
            status_and_text(&app, Request::get("/health").body(Body::empty()).unwrap()).await;
        assert_eq!((status, &*text), (StatusCode::OK, "healthy"), "{how}");
        // Routes with the parameter still lock.
        let (status, text) =
            status_and_text(&app, Request::post("/items/a").body(Body::empty()).unwrap()).await;
        assert_eq!((status, &*text), (StatusCode::OK, "locked"), "{how}");
    }
}

#[tokio::test]
async fn router_layer_over_fallbacks_and_nested_routers() {
    let store = MemoryStore::new();
    let item = || post(|lease: Option<Lease>| async move { format!("{}", lease.is_some()) });
    let app = Router::new()
        .route("/items/{sku}", item())
        .nest("/api", Router::new().route("/items/{sku}", item()))
        .nest_service(
            "/legacy",
            service_fn(|req: Request| async move {
                let locked = req.extensions().get::<Lease>().is_some();
                Ok::<_, Infallible>(axum::response::IntoResponse::into_response(format!(
                    "legacy {locked}"
                )))
            }),
        )
        .fallback(|| async { (StatusCode::IM_A_TEAPOT, "custom fallback") })
        .layer(LockLayer::new(store.clone(), Key::path_param("sku")));
    for (path, want) in [
        ("/items/a", (StatusCode::OK, "true")),
        ("/api/items/a", (StatusCode::OK, "true")),
        ("/nowhere", (StatusCode::IM_A_TEAPOT, "custom fallback")),
        ("/api/nowhere", (StatusCode::IM_A_TEAPOT, "custom fallback")),
        // axum gives a nested service no route template either.
        ("/legacy/items/a", (StatusCode::OK, "legacy false")),
    ] {
        let (status, text) =
            status_and_text(&app, Request::post(path).body(Body::empty()).unwrap()).await;
        assert_eq!((status, &*text), (want.0, want.1), "{path}");
    }
    assert_eq!(store.held(), 0);
}

/// axum gives a layer no sign that a request is headed for the 405 fallback: under
/// `Router::layer`, `route_layer` and `MethodRouter::layer` it is keyed and locked like any
/// other, in the resource's scope (`/items/{sku}`, as the route's POSTs);
/// `MethodRouter::route_layer` leaves the fallback out.
#[tokio::test]
async fn a_405_is_locked_as_the_resource_unless_the_method_routers_route_layer_is_used() {
    let not_allowed = |lease: Option<Lease>| async move {
        let scope = lease.map(|l| l.key().scope().to_owned());
        (StatusCode::METHOD_NOT_ALLOWED, format!("{scope:?}"))
    };
    let item = || post(|| async { "ok" });
    for (how, want) in [
        ("Router::layer", "Some(\"/items/{sku}\")"),
        ("route_layer", "Some(\"/items/{sku}\")"),
        ("MethodRouter::layer", "Some(\"/items/{sku}\")"),
        ("MethodRouter::route_layer", "None"),
    ] {
        let layer = LockLayer::new(MemoryStore::new(), Key::path_param("sku"));
        let app = match how {
            "Router::layer" => Router::new()
                .route("/items/{sku}", item())
                .method_not_allowed_fallback(not_allowed)
                .layer(layer),
            "route_layer" => Router::new()
                .route("/items/{sku}", item())
                .method_not_allowed_fallback(not_allowed)
                .route_layer(layer),
            "MethodRouter::layer" => {
                Router::new().route("/items/{sku}", item().fallback(not_allowed).layer(layer))
            }
            _ => Router::new().route(
                "/items/{sku}",
                item().fallback(not_allowed).route_layer(layer),
            ),
        };
        let (status, text) = status_and_text(
            &app,
            Request::delete("/items/a").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(
            (status, &*text),
            (StatusCode::METHOD_NOT_ALLOWED, want),
            "{how}"
        );
    }
}

fn header_app(store: MemoryStore, config: LockConfig, optional: bool) -> Router {
    let key = if optional {
        Key::header("idempotency-key").unwrap().optional()
    } else {
        Key::header("idempotency-key").unwrap()
    };
    Router::new()
        .route(
            "/pay",
            post(|lease: Option<Lease>| async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if lease.is_some() {
                    "locked"
                } else {
                    "unlocked"
                }
            }),
        )
        .route_layer(LockLayer::with_config(store, key, config))
}

fn pay(key: Option<&[u8]>) -> Request {
    let mut req = Request::post("/pay");
    if let Some(key) = key {
        req = req.header("idempotency-key", HeaderValue::from_bytes(key).unwrap());
    }
    req.body(Body::empty()).unwrap()
}

async fn assert_400(app: &Router, req: Request, needle: &str) {
    let r = send(app, req).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        r.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let body = body_json(r).await;
    assert_eq!(body["status"], 400);
    support::assert_problem_type(&body, "#invalid-lock-key");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains(needle), "{detail:?} lacks {needle:?}");
}

#[tokio::test]
async fn bad_keys_are_400_problems_and_leave_nothing_locked() {
    let store = MemoryStore::new();
    let app = header_app(
        store.clone(),
        LockConfig::builder().max_key_len(16).build().unwrap(),
        false,
    );
    assert_400(&app, pay(None), "idempotency-key").await;
    assert_400(&app, pay(Some(b"")), "empty").await;
    assert_400(&app, pay(Some(&[b'a'; 17])), "limit is 16").await;
    let twice = Request::post("/pay")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::empty())
        .unwrap();
    assert_400(&app, twice, "more than once").await;
    assert_eq!(store.held(), 0);
    // Opaque bytes are a fine key, and the body never echoes a key.
    let r = send(&app, pay(Some(b"\xff\x80 secret\t"))).await;
    assert_eq!(r.status(), 200);
    let r = send(&app, pay(Some(&[b'z'; 17]))).await;
    let text = String::from_utf8(
        axum::body::to_bytes(r.into_body(), 1000)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(
        !text.contains("zzzz"),
        "the key's value leaked into the body: {text}"
    );
}

#[tokio::test]
async fn optional_header_passes_through_unlocked() {
    let app = header_app(MemoryStore::new(), LockConfig::default(), true);
    let body = axum::body::to_bytes(send(&app, pay(None)).await.into_body(), 100)
        .await
        .unwrap();
    assert_eq!(body, "unlocked");
    let body = axum::body::to_bytes(send(&app, pay(Some(b"k"))).await.into_body(), 100)
        .await
        .unwrap();
    assert_eq!(body, "locked");
}

#[tokio::test]
async fn same_value_on_two_routes_does_not_collide_unless_namespaced() {
    let store = MemoryStore::new();
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let slow = || async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        "ok"
    };
    let app = |namespace: Option<&str>| {
        let layer = |ns: Option<&str>| {
            let l = LockLayer::with_config(store.clone(), Key::path_param("id"), config.clone());
            match ns {
                Some(ns) => l.namespace(ns.to_owned()),
                None => l,
            }
        };
        Router::new()
            .route("/a/{id}", post(slow).route_layer(layer(namespace)))
            .route("/b/{id}", post(slow).route_layer(layer(namespace)))
    };
    for (namespace, second) in [
        (None, StatusCode::OK),
        (Some("items"), StatusCode::CONFLICT),
    ] {
        let app = app(namespace);
        let first = tokio::spawn({
            let app = app.clone();
            async move {
                send(&app, Request::post("/a/1").body(Body::empty()).unwrap())
                    .await
                    .status()
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let other = send(&app, Request::post("/b/1").body(Body::empty()).unwrap())
            .await
            .status();
        assert_eq!(other, second, "namespace {namespace:?}");
        assert_eq!(first.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test]
async fn extractor_without_the_layer_is_a_500_naming_the_layer() {
    let app = Router::new()
        .route("/x", get(|_lease: Lease| async { "never" }))
        .route(
            "/y",
            get(|lease: Option<Lease>| async move { format!("{}", lease.is_none()) }),
        );
    let r = send(&app, Request::get("/x").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let text = axum::body::to_bytes(r.into_body(), 10_000).await.unwrap();
    assert!(String::from_utf8_lossy(&text).contains("LockLayer"));
    let r = send(&app, Request::get("/y").body(Body::empty()).unwrap()).await;
    assert_eq!(
        axum::body::to_bytes(r.into_body(), 100).await.unwrap(),
        "true"
    );
}

#[tokio::test]
async fn lease_shows_key_token_and_time() {
    let app = Router::new()
        .route(
            "/items/{sku}",
            post(|lease: Lease| async move {
                serde_json::json!({
                    "scope": lease.key().scope(),
                    "value": String::from_utf8_lossy(lease.key().value()),
                    "fence": lease.fencing_token(),
                    "left_ms": lease.time_left().as_millis() as u64,
                    "lost": lease.is_lost(),
                })
                .to_string()
            }),
        )
        .route_layer(LockLayer::new(MemoryStore::new(), Key::path_param("sku")));
    let mut fences = Vec::new();
    for _ in 0..3 {
        let r = send(
            &app,
            Request::post("/items/ab%20c").body(Body::empty()).unwrap(),
        )
        .await;
        let body = body_json(r).await;
        assert_eq!(body["scope"], "/items/{sku}");
        assert_eq!(body["value"], "ab c");
        assert!(body["left_ms"].as_u64().unwrap() > 9_000);
        assert_eq!(body["lost"], false);
        fences.push(body["fence"].as_u64().unwrap());
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
}

#[tokio::test]
async fn custom_rejections_and_statuses() {
    let counter = Counter::new();
    let layer = LockLayer::new(MemoryStore::new(), Key::path_param("sku"))
        .wait(Wait::none())
        .rejection_response(|rejection| {
            assert!(matches!(rejection.error(), LockError::Contended { .. }));
            // Another status; a body of its own; the `Retry-After` of the default.
            let rejection = rejection.with_status(StatusCode::LOCKED);
            rejection.with_body(format!("custom {}", rejection.status()))
        });
    let app = counter_app(Arc::clone(&counter), Some(layer));
    let running = support::purchase_in_flight(&app, &counter, "k", 300).await;
    let r = send(&app, purchase("k", 0)).await;
    assert_eq!(r.status(), StatusCode::LOCKED);
    assert!(r.headers().contains_key(axum::http::header::RETRY_AFTER));
    assert!(matches!(
        r.extensions().get::<LockError>(),
        Some(LockError::Contended { .. })
    ));
    assert_eq!(
        axum::body::to_bytes(r.into_body(), 100).await.unwrap(),
        "custom 423 Locked"
    );
    assert_eq!(running.await.unwrap(), StatusCode::OK);
}

#[tokio::test]
async fn closure_key_sources_can_reject() {
    let source = Key::from_fn(|parts| match parts.headers.get("x-tenant") {
        Some(v) if v.as_bytes().iter().all(u8::is_ascii_digit) => {
            Ok(Some(Bytes::copy_from_slice(v.as_bytes())))
        }
        Some(_) => Err(KeyRejection::invalid("x-tenant must be digits")),
        None => Ok(None),
    });
    let app = Router::new()
        .route("/t", post(|| async { "ok" }))
        .route_layer(LockLayer::new(MemoryStore::new(), source));
    let req = |v: Option<&str>| {
        let mut r = Request::post("/t");
        if let Some(v) = v {
            r = r.header("x-tenant", v);
        }
        r.body(Body::empty()).unwrap()
    };
    assert_eq!(send(&app, req(None)).await.status(), 200);
    assert_eq!(send(&app, req(Some("42"))).await.status(), 200);
    assert_400(&app, req(Some("4x")), "digits").await;
}

/// `/items/{sku}`, `/transfers/{from}/{to}`, `/files/{*rest}` and `/health` under `layer`
/// (`Router::layer`), each answering the values of its lease's keys (joined by `,`), or
/// `unlocked`.
fn routed_app(layer: LockLayer) -> Router {
    let values = |lease: Option<Lease>| async move {
        match lease {
            Some(lease) => lease
                .keys()
                .iter()
                .map(|key| String::from_utf8_lossy(key.value()).into_owned())
                .collect::<Vec<_>>()
                .join(","),
            None => "unlocked".to_owned(),
        }
    };
    Router::new()
        .route("/items/{sku}", post(values))
        .route("/transfers/{from}/{to}", post(values))
        .route("/files/{*rest}", post(values))
        .route("/health", get(|| async { "healthy" }))
        .layer(layer)
}

/// `routed_app` twice: with a layer built with `source` itself, and with one built with a
/// closure that calls it.
fn layer_and_closure<K: KeySource + Clone>(store: &MemoryStore, source: K) -> [(&str, Router); 2] {
    let own = routed_app(LockLayer::new(store.clone(), source.clone()));
    let closure = Key::from_fn(move |parts| source.keys(parts));
    [
        ("the layer's own", own),
        (
            "in a closure",
            routed_app(LockLayer::new(store.clone(), closure)),
        ),
    ]
}

/// The path-parameter sources answer alike whether the layer is built with one (it reads the
/// parameters in place) or a source of the user's calls one (`KeySource::keys` on `&Parts`,
/// which reads them from a copy of the extensions): decoded values, 400 for a value not UTF-8
/// once decoded, 500 for a route without the parameter and for a layer outside the router.
#[tokio::test]
async fn path_parameter_sources_answer_alike_in_a_layer_and_in_a_closure() {
    let store = MemoryStore::new();
    for (how, app) in &layer_and_closure(&store, Key::path_param("sku")) {
        for (path, want) in [
            ("/items/ab%20c", (StatusCode::OK, "ab c")),
            ("/items/caf%C3%A9", (StatusCode::OK, "café")),
            ("/nowhere", (StatusCode::NOT_FOUND, "")),
        ] {
            let (status, text) =
                status_and_text(app, Request::post(path).body(Body::empty()).unwrap()).await;
            assert_eq!((status, &*text), want, "{how} {path}");
        }
        let bad = Request::post("/items/%FF").body(Body::empty()).unwrap();
        assert_400(app, bad, "UTF-8").await;
        let r = send(app, Request::get("/health").body(Body::empty()).unwrap()).await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{how}");
        let detail = body_json(r).await["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("`sku`"), "{how}: {detail}");
    }

    for (how, app) in &layer_and_closure(&store, Key::path_params(["from", "to"])) {
        let req = Request::post("/transfers/al%20ice/bob");
        let (status, text) = status_and_text(app, req.body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK, "{how}");
        let mut values: Vec<&str> = text.split(',').collect();
        values.sort_unstable();
        assert_eq!(values, ["al ice", "bob"], "{how}");
        let bad = Request::post("/transfers/%FF/bob")
            .body(Body::empty())
            .unwrap();
        assert_400(app, bad, "UTF-8").await;
    }

    for (how, app) in &layer_and_closure(&store, Key::path()) {
        // A catch-all captures `%2F` and `/` alike: one resource, one value.
        for uri in ["/files/a%2Fb/c", "/files/a/b/c"] {
            let req = Request::post(uri).body(Body::empty()).unwrap();
            let (status, text) = status_and_text(app, req).await;
            assert_eq!(
                (status, &*text),
                (StatusCode::OK, "/files/a/b/c"),
                "{how} {uri}"
            );
        }
    }

    // Outside the router: no parameters, a 500 either way.
    let sku = Key::path_param("sku");
    let outside = [
        ServiceBuilder::new()
            .layer(LockLayer::new(store.clone(), sku.clone()))
            .service(routed_app(LockLayer::new(store.clone(), Key::path())))
            .boxed_clone(),
        ServiceBuilder::new()
            .layer(LockLayer::new(
                store.clone(),
                Key::from_fn(move |parts| sku.keys(parts)),
            ))
            .service(routed_app(LockLayer::new(store.clone(), Key::path())))
            .boxed_clone(),
    ];
    for app in outside {
        let r = app
            .oneshot(Request::post("/items/a").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let detail = body_json(r.map(Body::new)).await["detail"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(detail.contains("route_layer"), "{detail}");
    }
    assert_eq!(store.held(), 0);
}

/// Under `Router::nest`, inner routes see the path without the prefix while the matched
/// template has it: every spelling of one path still takes one lock (a `%`-spelled path used to
/// lock on the template with the prefix, a plain one on the path without it: two locks for one
/// resource), whether the layer holds the source or a closure calls it.
#[tokio::test]
async fn a_nested_path_takes_one_lock_whatever_its_spelling() {
    let store = MemoryStore::new();
    for (how, inner) in layer_and_closure(&store, Key::path()) {
        let app = Router::new().nest("/api", inner);
        let mut values = Vec::new();
        for uri in [
            "/api/items/1",
            "/api/items/%31",
            "/api/files/a%2Fb/c",
            "/api/files/a/b/c",
        ] {
            let req = Request::post(uri).body(Body::empty()).unwrap();
            let (status, text) = status_and_text(&app, req).await;
            assert_eq!(status, StatusCode::OK, "{how} {uri}");
            values.push(text);
        }
        assert_eq!(
            values,
            [
                "/api/items/1",
                "/api/items/1",
                "/api/files/a/b/c",
                "/api/files/a/b/c"
            ],
            "{how}"
        );
    }
    assert_eq!(store.held(), 0);
}

#[tokio::test]
async fn invalid_config_fails_at_build_time() {
    let err = LockConfig::builder()
        .ttl(Duration::from_secs(1))
        .renew_interval(Duration::from_secs(2))
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "renew_interval");
    assert!(err.to_string().contains("shorter than the TTL"));
}

#[tokio::test]
async fn dropped_waiter_leaves_nothing_behind() {
    let store = MemoryStore::new();
    let config = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_millis(5))
                .unwrap()
                .deadline(Duration::from_secs(10)),
        )
        .build()
        .unwrap();
    let counter = Counter::new();
    let layer = LockLayer::with_config(store.clone(), Key::path_param("sku"), config);
    let app = counter_app(Arc::clone(&counter), Some(layer));
    let holder = support::purchase_in_flight(&app, &counter, "k", 200).await;
    let waiter = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 0)).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    waiter.abort();
    assert_eq!(holder.await.unwrap(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(store.held(), 0);
    assert_eq!(
        counter.finished.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the waiter ran"
    );
}

/// With `hold_until_body_end`, the lease lasts until the streamed body ends.
#[tokio::test]
async fn lease_held_until_body_end() {
    let store = MemoryStore::new();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(1);
    let rx = Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let app = Router::new()
        .route(
            "/stream/{id}",
            get(move || {
                let rx = Arc::clone(&rx);
                async move {
                    match rx.lock().await.take() {
                        Some(rx) => Body::from_stream(tokio_stream_from(rx)),
                        None => Body::from("second"),
                    }
                }
            }),
        )
        .route_layer(
            LockLayer::new(store.clone(), Key::path_param("id"))
                .wait(Wait::none())
                .hold_until_body_end(true),
        );
    let first = send(&app, Request::get("/stream/1").body(Body::empty()).unwrap()).await;
    assert_eq!(first.status(), 200);
    assert_eq!(store.held(), 1, "released before the body was streamed");
    let second = send(&app, Request::get("/stream/1").body(Body::empty()).unwrap()).await;
    assert_eq!(second.status(), StatusCode::CONFLICT);
    tx.send(Ok(Bytes::from("part"))).await.unwrap();
    drop(tx);
    let body = axum::body::to_bytes(first.into_body(), 100).await.unwrap();
    assert_eq!(body, "part");
    assert_eq!(store.held(), 0, "not released at the end of the body");
    let third = send(&app, Request::get("/stream/1").body(Body::empty()).unwrap()).await;
    assert_eq!(third.status(), 200);
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, Infallible>>,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[test]
fn release_without_a_runtime_does_not_panic() {
    // Acquire on a runtime, then drop the future outside any runtime: the key is left to its TTL.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let locker = tower_lock::Locker::new(store.clone());
    let guard = rt
        .block_on(locker.acquire(locker.key("n", "k").unwrap()).into_future())
        .unwrap();
    drop(rt);
    drop(guard);
}

/// A test of an app on a paused clock (`start_paused`), with a handler that sleeps for several
/// TTLs: the request's renewals follow that clock (their timers are made where the request is
/// polled), so the key is held throughout and the request succeeds.
#[tokio::test(start_paused = true)]
async fn a_handler_outliving_its_ttl_on_a_paused_clock_keeps_its_lease() {
    let memory = MemoryStore::new();
    let layer = LockLayer::with_config(
        memory.clone(),
        Key::path(),
        support::ttl_config(Duration::from_millis(300)),
    );
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|_req: Request| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<_, Infallible>(axum::http::Response::new(Body::empty()))
        }));
    let request = Request::post("/slow").body(Body::empty()).unwrap();
    let watch = async {
        let mut held = Vec::new();
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            held.push(memory.held());
        }
        held
    };
    let (response, held) = tokio::join!(service.oneshot(request), watch);
    assert_eq!(
        held,
        [1, 1, 1, 1],
        "the key was not held throughout the handler"
    );
    assert_eq!(response.unwrap().status(), StatusCode::OK);
    assert_eq!(memory.held(), 0);
}

/// Dropped while releasing (the client hung up just as the handler finished): the release is
/// sent again from a spawned task, so the key does not wait for its TTL.
#[tokio::test]
async fn dropped_while_releasing_still_releases() {
    let memory = MemoryStore::new();
    let config = support::ttl_config(Duration::from_secs(30));
    let layer = LockLayer::with_config(
        support::Tweaked {
            inner: memory.clone(),
            release_delay: Duration::from_millis(100),
            announce: true,
            ..Default::default()
        },
        Key::path_param("sku"),
        config,
    );
    let counter = Counter::new();
    let app = counter_app(Arc::clone(&counter), Some(layer));
    let request = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 0)).await }
    });
    while counter.finished.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The handler is done; the response future is now waiting on the slow release.
    request.abort();
    assert_eq!(memory.held(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(memory.held(), 0, "the dropped release was not sent again");
}
