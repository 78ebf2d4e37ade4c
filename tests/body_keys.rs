//! Key sources that read the request body ([`Key::json`], [`Key::body`]): the layer buffers the
//! body up to its limit (413 above it), derives the keys (400 when it cannot), and hands the
//! handler the same bytes. Runs on `MemoryStore`, without a network.

use crate::support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::Request,
    http::{StatusCode, header},
    routing::post,
};
use bytes::Bytes;
use support::body_json;
use tower::ServiceExt;
use tower_lock::{
    Key, Lease, LockConfig, LockLayer, Locker, MemoryStore, Wait,
    key::{KeyRejection, KeyValues},
};

/// The limit the tests' layers read up to.
const LIMIT: usize = 256;

/// What the handler saw: the body's bytes, and the values of its lease's keys (`None`: no
/// lease, the request passed through unlocked).
#[derive(Debug, Default)]
struct Seen {
    calls: AtomicUsize,
    last: std::sync::Mutex<Option<(Bytes, Option<Vec<String>>)>>,
}

/// `POST /orders` behind a layer with `source`, on `locker`, reading at most `LIMIT` bytes.
fn app(locker: &Locker, source: tower_lock::key::JsonKeys, seen: Arc<Seen>) -> Router {
    let layer = LockLayer::from_locker(locker.clone(), source)
        .namespace("sku")
        .max_request_body(LIMIT);
    Router::new().route("/orders", post(handler(seen)).route_layer(layer))
}

fn handler(
    seen: Arc<Seen>,
) -> impl Fn(Option<Lease>, Bytes) -> std::future::Ready<&'static str> + Clone + Send + Sync + 'static
{
    move |lease: Option<Lease>, body: Bytes| {
        seen.calls.fetch_add(1, Ordering::SeqCst);
        let keys = lease.map(|lease| {
            lease
                .keys()
                .iter()
                .map(|k| String::from_utf8_lossy(k.value()).into_owned())
                .collect()
        });
        *seen.last.lock().unwrap() = Some((body, keys));
        std::future::ready("ok")
    }
}

/// A locker whose leases hold at most two keys.
fn at_most_two_keys() -> Locker {
    Locker::with_config(
        MemoryStore::new(),
        LockConfig::builder()
            .wait(Wait::none())
            .max_keys(2)
            .build()
            .unwrap(),
    )
}

fn locker() -> Locker {
    Locker::with_config(
        MemoryStore::new(),
        LockConfig::builder().wait(Wait::none()).build().unwrap(),
    )
}

fn post_body(body: Body) -> Request {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap()
}

/// A body sent in `chunks`, without a `Content-Length` (as a chunked upload arrives).
fn streamed(chunks: Vec<&'static str>) -> Body {
    Body::from_stream(futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|c| Ok::<_, Infallible>(Bytes::from_static(c.as_bytes()))),
    ))
}

async fn status_and_json(app: &Router, request: Request) -> (StatusCode, serde_json::Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    if status != StatusCode::OK {
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json",
            "{status}"
        );
    }
    if status == StatusCode::OK {
        return (status, serde_json::Value::Null);
    }
    (status, body_json(response).await)
}

/// The handler gets the very bytes the client sent, whether they came in one piece with a
/// length or in several without, and its lease holds one key per SKU, each once.
#[tokio::test]
async fn the_handler_gets_the_same_body() {
    let seen = Arc::new(Seen::default());
    let locker = locker();
    let app = app(
        &locker,
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );
    let text =
        r#"{"items": [{"sku": "b", "qty": 1}, {"sku": "a", "qty": 2}, {"sku": "b", "qty": 3}]}"#;
    for body in [
        Body::from(text),
        streamed(vec![
            r#"{"items": [{"sku": "b", "#,
            r#""qty": 1}, {"sku": "a", "qty": 2}, "#,
            "",
            r#"{"sku": "b", "qty": 3}]}"#,
        ]),
    ] {
        let (status, _) = status_and_json(&app, post_body(body)).await;
        assert_eq!(status, StatusCode::OK);
        let (body, keys) = seen.last.lock().unwrap().take().unwrap();
        assert_eq!(body, text.as_bytes(), "the handler got other bytes");
        let mut keys = keys.expect("the request was locked");
        keys.sort();
        assert_eq!(keys, ["a", "b"]);
    }
    // Released: taken again at once.
    let both = [
        locker.key("sku", "a").unwrap(),
        locker.key("sku", "b").unwrap(),
    ];
    assert!(locker.try_acquire(both).await.unwrap().is_some());
}

/// A body over the limit is a 413 whether its `Content-Length` says so (then it is not read at
/// all) or it arrives without one; the handler never runs and nothing stays locked. A body of
/// exactly the limit is read.
#[tokio::test]
async fn a_body_over_the_limit_is_413_declared_or_streamed() {
    let seen = Arc::new(Seen::default());
    let locker = locker();
    let app = app(
        &locker,
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );

    // Declared: refused before a byte is read.
    let polled = Arc::new(AtomicBool::new(false));
    let body = {
        let polled = Arc::clone(&polled);
        Body::from_stream(futures_util::stream::poll_fn(move |_| {
            polled.store(true, Ordering::SeqCst);
            std::task::Poll::Ready(Some(Ok::<_, Infallible>(Bytes::from_static(b"{}"))))
        }))
    };
    let request = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, (LIMIT + 1).to_string())
        .body(body)
        .unwrap();
    let (status, problem) = status_and_json(&app, request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{problem}");
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("#request-body-too-large"),
        "{problem}"
    );
    assert!(
        !polled.load(Ordering::SeqCst),
        "a body declared too large was read"
    );

    // Streamed, one byte too many over several chunks (the last one crosses the limit).
    let padding: &'static str = Box::leak(" ".repeat(LIMIT - 30).into_boxed_str());
    let over = streamed(vec![r#"{"items": [{"sku": "a"}]}"#, padding, "      "]);
    let (status, problem) = status_and_json(&app, post_body(over)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{problem}");

    // Exactly the limit, in pieces: read, locked, handed on.
    let exact = r#"{"items": [{"sku": "a"}]}"#;
    let fill: &'static str = Box::leak(" ".repeat(LIMIT - exact.len()).into_boxed_str());
    let (status, _) = status_and_json(&app, post_body(streamed(vec![exact, fill]))).await;
    assert_eq!(status, StatusCode::OK);
    let (body, _) = seen.last.lock().unwrap().take().unwrap();
    assert_eq!(body.len(), LIMIT);
    assert_eq!(
        seen.calls.load(Ordering::SeqCst),
        1,
        "the handler ran for a 413"
    );
    assert!(
        locker
            .try_acquire(locker.key("sku", "a").unwrap())
            .await
            .unwrap()
            .is_some(),
        "a key stayed locked"
    );
}

/// A body the keys cannot be read from is a 400 problem that names the field, never the body's
/// values; the handler never runs and nothing stays locked.
#[tokio::test]
async fn keys_that_cannot_be_read_are_400() {
    let seen = Arc::new(Seen::default());
    let locker = locker();
    let app = app(
        &locker,
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );
    for (body, says) in [
        ("", "not JSON"),
        ("not json secret-value", "not JSON"),
        (r#"{"items": [{"sku": "a"}"#, "not JSON"),
        (r#"{"other": 1}"#, "`/items`"),
        (r#"{"items": []}"#, "`/items/*`"),
        (r#"{"items": [{"sku": "a"}, {"qty": 1}]}"#, "`/items/1/sku`"),
        (
            r#"{"items": [{"sku": {"secret-value": 1}}]}"#,
            "not a string or a number",
        ),
        (r#"{"items": [{"sku": ""}]}"#, "empty"),
    ] {
        let (status, problem) = status_and_json(&app, post_body(Body::from(body))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{body}: {detail}");
        assert!(!detail.contains("secret"), "{body}: {detail}");
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("#invalid-lock-key"),
            "{problem}"
        );
    }
    assert_eq!(seen.calls.load(Ordering::SeqCst), 0, "the handler ran");
    assert!(
        locker
            .try_acquire(locker.key("sku", "a").unwrap())
            .await
            .unwrap()
            .is_some(),
        "a key stayed locked"
    );
}

/// A body that fails while it is read (the client's upload broke) is a 400; the error's text
/// is not in the answer.
#[tokio::test]
async fn a_body_that_cannot_be_read_is_400() {
    let seen = Arc::new(Seen::default());
    let app = app(
        &locker(),
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );
    let broken = Body::from_stream(futures_util::stream::iter([
        Ok(Bytes::from_static(br#"{"items": "#)),
        Err(std::io::Error::other("secret-reason")),
    ]));
    let (status, problem) = status_and_json(&app, post_body(broken)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("could not be read"),
        "{problem}"
    );
    assert!(!problem.to_string().contains("secret"), "{problem}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 0);
}

/// A source made optional lets a JSON body without its fields through unlocked (with the body
/// intact); one with them is locked.
#[tokio::test]
async fn an_optional_source_passes_a_body_without_its_fields_through() {
    let seen = Arc::new(Seen::default());
    let app = app(
        &locker(),
        Key::json("/from").unwrap().and("/to").unwrap().optional(),
        Arc::clone(&seen),
    );
    let (status, _) = status_and_json(&app, post_body(Body::from(r#"{"note": 1}"#))).await;
    assert_eq!(status, StatusCode::OK);
    let (body, keys) = seen.last.lock().unwrap().take().unwrap();
    assert_eq!((&body[..], keys), (&br#"{"note": 1}"#[..], None));
    let transfer = r#"{"from": "alice", "to": "bob", "amount": 5}"#;
    let (status, _) = status_and_json(&app, post_body(Body::from(transfer))).await;
    assert_eq!(status, StatusCode::OK);
    let (_, keys) = seen.last.lock().unwrap().take().unwrap();
    assert_eq!(keys.unwrap().len(), 2);
    // Not JSON is still a 400.
    let (status, _) = status_and_json(&app, post_body(Body::from("nope"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// `max_keys` counts distinct keys: the same SKU named three times is one key, three SKUs are
/// one too many for a limit of two.
#[tokio::test]
async fn max_keys_counts_each_key_once() {
    let seen = Arc::new(Seen::default());
    let locker = at_most_two_keys();
    let app = app(
        &locker,
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );
    let same = r#"{"items": [{"sku": "a"}, {"sku": "a"}, {"sku": "b"}, {"sku": "a"}]}"#;
    let (status, problem) = status_and_json(&app, post_body(Body::from(same))).await;
    assert_eq!(status, StatusCode::OK, "{problem}");
    let three = r#"{"items": [{"sku": "a"}, {"sku": "b"}, {"sku": "c"}]}"#;
    let (status, problem) = status_and_json(&app, post_body(Body::from(three))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("limit is 2"),
        "{problem}"
    );
}

/// `Key::body` with a closure: keys from the head and the body together; the body is the
/// handler's afterwards, and the request waits for a key another holds.
#[tokio::test]
async fn a_closure_reads_the_body_and_the_head() {
    let locker = Locker::with_config(
        MemoryStore::new(),
        LockConfig::builder()
            .wait(
                Wait::constant(Duration::from_millis(5))
                    .unwrap()
                    .deadline(Duration::from_secs(5)),
            )
            .build()
            .unwrap(),
    );
    // One SKU per line of a plain-text body, under the tenant the header names; the closure's
    // argument and answer types are inferred.
    let source = Key::body(|parts, body| {
        let tenant = parts
            .headers
            .get("x-tenant")
            .ok_or_else(|| KeyRejection::missing("`x-tenant` header"))?
            .as_bytes()
            .to_vec();
        let text =
            std::str::from_utf8(body).map_err(|_| KeyRejection::invalid("the body is not text"))?;
        Ok(Some(
            text.lines()
                .map(|sku| Bytes::from([&tenant[..], b"/", sku.trim().as_bytes()].concat()))
                .collect::<KeyValues>(),
        ))
    });
    let layer = LockLayer::from_locker(locker.clone(), source).namespace("sku");
    let app = Router::new().route(
        "/restock",
        post(|lease: Lease, body: String| async move {
            format!("{} keys for {body:?}", lease.keys().len())
        })
        .route_layer(layer),
    );
    let held = locker
        .acquire(locker.key("sku", "t1/b").unwrap())
        .await
        .unwrap();
    let request = || {
        Request::post("/restock")
            .header("x-tenant", "t1")
            .body(Body::from("a\nb\n"))
            .unwrap()
    };
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(request()).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "it did not wait for t1/b");
    held.release().await.unwrap();
    let response = waiting.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let text = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(text, "2 keys for \"a\\nb\\n\"");
    let no_tenant = Request::post("/restock").body(Body::from("a")).unwrap();
    let response = app.clone().oneshot(no_tenant).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}

/// A limit applied while reading, not after: the layer stops at the first value past
/// `max_keys` distinct ones. What follows it is never read, so it does not matter that it is
/// not even JSON (the answer says why the keys were refused, not that the body is malformed);
/// and a body naming thousands of SKUs costs what the first few cost.
#[tokio::test]
async fn max_keys_stops_reading_the_body() {
    let locker = at_most_two_keys();
    let seen = Arc::new(Seen::default());
    let layer =
        LockLayer::from_locker(locker.clone(), Key::json("/items/*/sku").unwrap()).namespace("sku");
    let app = Router::new().route(
        "/orders",
        post(handler(Arc::clone(&seen))).route_layer(layer),
    );
    let body = format!(
        r#"{{"items": [{{"sku": "a"}}, {{"sku": "a"}}, {{"sku": "b"}}, {{"sku": "c"}}, {}"#,
        "this is not JSON, ".repeat(1000)
    );
    let (status, problem) = status_and_json(&app, post_body(Body::from(body))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("limit is 2"), "{problem}");
    assert_eq!(seen.calls.load(Ordering::SeqCst), 0);
}

/// The same bound for values a source gave all at once: keys are made up to the first value
/// past `max_keys` distinct ones (the empty value after it, which would fail to become a key,
/// is never reached).
#[tokio::test]
async fn max_keys_bounds_the_keys_made_from_a_sources_values() {
    let locker = at_most_two_keys();
    let many = Key::from_fn(|_| {
        let mut values: Vec<Bytes> = ["a", "a", "b", "c"].into_iter().map(Bytes::from).collect();
        values.push(Bytes::new());
        values.extend((0..10_000).map(|n| Bytes::from(format!("sku-{n}"))));
        Ok(Some(values))
    });
    let layer = LockLayer::from_locker(locker, many).namespace("sku");
    let app = Router::new().route("/orders", post(|| async { "ok" }).route_layer(layer));
    let (status, problem) = status_and_json(&app, post_body(Body::empty())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("limit is 2"),
        "{problem}"
    );
}

/// A field on a key's path named twice in one object (`{"sku": "a", "sku": "b"}`) is a 400:
/// the layer would lock one while a first-wins parser in the handler acts on the other. Twice
/// elsewhere in the body is the handler's business.
#[tokio::test]
async fn a_key_field_named_twice_is_a_bad_request() {
    let seen = Arc::new(Seen::default());
    let sku = app(&locker(), Key::json("/sku").unwrap(), Arc::clone(&seen));
    for body in [
        r#"{"sku": "a", "sku": "b"}"#,
        r#"{"sku": "a", "note": 1, "sku": "a"}"#,
    ] {
        let (status, problem) = status_and_json(&sku, post_body(Body::from(body))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("`/sku` twice"),
            "{problem}"
        );
    }
    let cart = app(
        &locker(),
        Key::json("/items/*/sku").unwrap(),
        Arc::clone(&seen),
    );
    for (body, twice) in [
        (
            r#"{"items": [{"sku": "a"}, {"sku": "b", "sku": "c"}]}"#,
            "/items/1/sku",
        ),
        (
            r#"{"items": [{"sku": "a"}], "items": [{"sku": "b"}]}"#,
            "/items",
        ),
    ] {
        let (status, problem) = status_and_json(&cart, post_body(Body::from(body))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {problem}");
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains(&format!("`{twice}` twice")),
            "{problem}"
        );
    }
    assert_eq!(seen.calls.load(Ordering::SeqCst), 0);
    let (status, problem) = status_and_json(
        &cart,
        post_body(Body::from(
            r#"{"note": 1, "note": 2, "items": [{"sku": "a", "qty": 1, "qty": 2}]}"#,
        )),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{problem}");
}
