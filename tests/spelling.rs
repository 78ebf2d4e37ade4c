//! One resource, one lock, whatever its spelling. axum matches routes on the raw path and
//! percent-decodes what it captures; `Key::path()` must lock on what the router resolves, so a
//! client cannot take a second lock on one resource by spelling its path another way, and two
//! resources never share a lock because one of them was spelled with `%2F`.
//!
//! The property test builds a real router (static segments, `{param}`, a parameter with a
//! static prefix, `{*catch_all}`, trailing slashes) and compares what the router did with each
//! spelling (which route, which parameters) with the key the layer took. 256 cases by default;
//! `PROPTEST_CASES=20000 cargo test --test integration spelling::` for a longer run.

use std::{sync::Arc, time::Duration};

use axum::{
    Json, Router,
    body::Body,
    extract::{MatchedPath, RawPathParams},
    http::{Request, StatusCode},
    routing::{any as any_method, post},
};
use proptest::{collection::vec, prelude::*, sample::select};
use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;
use tower_lock::{Key, Lease, LockConfig, LockLayer, MemoryStore, Wait};

const ROUTES: &[&str] = &[
    "/accounts/{id}/withdraw",
    "/items/special",
    "/items/{sku}",
    "/files/{*path}",
    "/x/{a}/{*rest}",
    "/p/img-{id}",
    "/w/x{*rest}",
    "/t",
    "/t/",
];

/// What the router did with a request, and the lock the layer took for it.
async fn report(route: MatchedPath, params: RawPathParams, lease: Lease) -> Json<Value> {
    let params: Vec<(&str, &str)> = params.iter().collect();
    Json(json!({
        "route": route.as_str(),
        "params": params,
        "scope": lease.key().scope(),
        "value": lease.key().value(),
    }))
}

/// Every route answers with `report`, under a `Key::path()` layer over the whole router (so
/// unmatched paths reach the layer too, and the fallback answers 404).
fn app(namespace: Option<&str>) -> Router {
    let mut layer = LockLayer::new(MemoryStore::new(), Key::path());
    if let Some(namespace) = namespace {
        layer = layer.namespace(namespace.to_owned());
    }
    ROUTES
        .iter()
        .fold(Router::new(), |router, route| {
            router.route(route, any_method(report))
        })
        .layer(layer)
}

/// `(route, params)` and `(scope, value)` for a request the router sent to a route, `None` for
/// a 404 (or a URI that does not parse); a 400 only for a parameter that is not UTF-8.
async fn outcome(app: &Router, path: &str) -> Option<(Value, Value)> {
    let request = Request::post(path).body(Body::empty()).ok()?;
    let response = app.clone().oneshot(request).await.unwrap();
    match response.status() {
        StatusCode::OK => {}
        StatusCode::NOT_FOUND => return None,
        StatusCode::BAD_REQUEST => {
            let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                .await
                .unwrap();
            let body = String::from_utf8_lossy(&body);
            assert!(body.contains("UTF-8"), "{path}: {body}");
            return None;
        }
        other => panic!("{path}: {other}"),
    }
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    Some((
        json!([v["route"], v["params"]]),
        json!([v["scope"], v["value"]]),
    ))
}

/// A path as parts: static text, and text where the routes have parameters.
type Parts = Vec<(String, bool)>;

/// One way to write a path in a URI: each byte literal (where a path may hold it) or
/// percent-encoded in upper or lower case, as `choices` say; parameters' bytes are encoded one
/// time in three, static text's one time in twenty. A literal `%` is kept as it is: it may
/// start a malformed escape (`%zz`, which axum leaves alone) or a real one.
fn spell(parts: &Parts, choices: &[u8]) -> String {
    let mut out = String::new();
    let mut choices = choices.iter().cycle();
    for (text, param) in parts {
        for &b in text.as_bytes() {
            let literal_ok = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/%".contains(&b);
            let choice = choices.next().unwrap() % 60;
            let encode = if *param { choice < 20 } else { choice < 3 };
            match (encode || !literal_ok, choice % 2) {
                (false, _) => out.push(b as char),
                (true, 0) => out.push_str(&format!("%{b:02x}")),
                (true, _) => out.push_str(&format!("%{b:02X}")),
            }
        }
    }
    out
}

/// Text for a parameter: the characters whose spelling matters (`/`, `%`, `.`, non-ASCII,
/// malformed escapes) and words the routes use.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        select(vec![
            "special", "withdraw", "img-", "x", "1", "a", "b", "/", "//", ".", "..", "%", "%zz",
            "%4", "%2F", "é", " ", "{", "+", "~",
        ])
        .prop_map(str::to_owned),
        "[ab1/%.é]{1,4}",
    ];
    vec(piece, 1..4).prop_map(|pieces| pieces.concat())
}

/// A path to spell: mostly one of the routes with its parameters filled in by `text`, or a
/// route's first segment followed by `text`.
fn decoded_path() -> impl Strategy<Value = Parts> {
    let filled = (select(ROUTES.to_vec()), vec(text(), 2)).prop_map(|(route, texts)| {
        let mut texts = texts.into_iter();
        route
            .split(['{', '}'])
            .enumerate()
            .map(|(i, part)| match i % 2 {
                0 => (part.to_owned(), false),
                _ => (texts.next().unwrap(), true),
            })
            .collect()
    });
    let loose = (
        select(vec!["/accounts/", "/items/", "/files/", "/x/", "/t", "/"]),
        text(),
    )
        .prop_map(|(head, text)| vec![(head.to_owned(), false), (text, true)]);
    prop_oneof![3 => filled, 1 => loose]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    /// Spellings of two paths (each spelled four ways): wherever the router sent two of them to
    /// the same route with the same parameters, the keys are equal; wherever it did not, they
    /// differ. Under a namespace (no route in the scope), the same route with the same
    /// parameters still means the same key, and the same route with other parameters another.
    #[test]
    fn the_key_follows_what_the_router_resolved(
        paths in vec(decoded_path(), 2),
        choices in vec(vec(any::<u8>(), 64), 8),
    ) {
        let rt = runtime();
        let scoped = app(None);
        let namespaced = app(Some("ns"));
        let mut seen = Vec::new();
        for (i, choice) in choices.iter().enumerate() {
            let path = spell(&paths[i % 2], choice);
            let scoped = rt.block_on(outcome(&scoped, &path));
            let namespaced = rt.block_on(outcome(&namespaced, &path));
            // The layer does not change where a request goes.
            prop_assert_eq!(
                scoped.as_ref().map(|o| &o.0),
                namespaced.as_ref().map(|o| &o.0),
                "{}", path
            );
            if let (Some(scoped), Some(namespaced)) = (scoped, namespaced) {
                seen.push((path, scoped.0, scoped.1, namespaced.1));
            }
        }
        for (a, (path_a, routed_a, key_a, ns_a)) in seen.iter().enumerate() {
            for (path_b, routed_b, key_b, ns_b) in &seen[a + 1..] {
                prop_assert_eq!(
                    routed_a == routed_b,
                    key_a == key_b,
                    "{} routed {} with key {}; {} routed {} with key {}",
                    path_a, routed_a, key_a, path_b, routed_b, key_b
                );
                if routed_a == routed_b {
                    prop_assert_eq!(ns_a, ns_b, "{} and {}", path_a, path_b);
                } else if routed_a[0] == routed_b[0] {
                    prop_assert_ne!(ns_a, ns_b, "{} and {}", path_a, path_b);
                }
            }
        }
    }
}

/// The cases the property test finds by chance, spelled out.
#[tokio::test]
async fn spellings_that_route_alike_lock_alike() {
    let app = app(None);
    let key = |path: &'static str| {
        let app = app.clone();
        async move { outcome(&app, path).await.expect(path).1 }
    };
    // A parameter, escaped or not; a malformed escape and its escaped `%`.
    assert_eq!(
        key("/accounts/1/withdraw").await,
        key("/accounts/%31/withdraw").await
    );
    assert_eq!(key("/items/%zz").await, key("/items/%25zz").await);
    // `%2F` in a parameter is part of one segment: not the two-segment path.
    assert_ne!(key("/x/a%2Fb/c").await, key("/x/a/b%2Fc").await);
    // A catch-all captures `a%2Fb/c` and `a/b/c` alike: one resource.
    assert_eq!(key("/files/a%2Fb/c").await, key("/files/a/b/c").await);
    // A static segment spelled with an escape is another route to the router (matchit matches
    // the raw path): `{sku}` = "special", not the static route; another key.
    assert_ne!(key("/items/special").await, key("/items/sp%65cial").await);
    assert_eq!(key("/items/sp%65cial").await, key("/items/%73pecial").await);
    // A trailing slash is another route.
    assert_ne!(key("/t").await, key("/t/").await);
    // The value is the canonical path: readable, `%` and `/` escaped inside a segment.
    assert_eq!(
        key("/accounts/%31%2f2%25/withdraw").await[1],
        json!(b"/accounts/1%2F2%25/withdraw")
    );
}

/// Two spellings of one account, at the same time: the second finds the lock held (409), as
/// the same spelling would; another account (the negative control) runs.
#[tokio::test]
async fn two_spellings_of_one_resource_exclude_each_other() {
    let entered = Arc::new(Notify::new());
    let leave = Arc::new(Semaphore::new(0));
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let layer = LockLayer::with_config(MemoryStore::new(), Key::path(), config);
    let app = Router::new()
        .route(
            "/accounts/{id}/withdraw",
            post({
                let (entered, leave) = (entered.clone(), leave.clone());
                move || async move {
                    entered.notify_one();
                    leave.acquire().await.unwrap().forget();
                    "withdrawn"
                }
            }),
        )
        .layer(layer);
    let send = |path: &str| {
        app.clone()
            .oneshot(Request::post(path).body(Body::empty()).unwrap())
    };
    let first = tokio::spawn(send("/accounts/1/withdraw"));
    entered.notified().await;
    for spelling in ["/accounts/%31/withdraw", "/accounts/1/withdraw"] {
        // Without the lock it would enter the handler and wait there.
        let r = tokio::time::timeout(Duration::from_secs(5), send(spelling))
            .await
            .unwrap_or_else(|_| panic!("{spelling} ran beside the holder"))
            .unwrap();
        assert_eq!(r.status(), StatusCode::CONFLICT, "{spelling}");
    }
    // The negative control: another account is not held.
    let other = tokio::spawn(send("/accounts/2/withdraw"));
    entered.notified().await;
    leave.add_permits(2);
    let (first, other) = tokio::time::timeout(Duration::from_secs(5), async {
        (first.await.unwrap().unwrap(), other.await.unwrap().unwrap())
    })
    .await
    .expect("the handlers finish");
    assert_eq!(
        (first.status(), other.status()),
        (StatusCode::OK, StatusCode::OK)
    );
}
