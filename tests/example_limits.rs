//! Limits of the examples' servers, on real processes: a client that sends half a request head
//! is cut off (both examples); the inventory refuses a SKU its lock cannot take, and bounds its
//! in-memory stock; every error it answers is problem+json.

use crate::instances;

use std::time::{Duration, Instant};

use instances::{Instance, example_binary, inventory_binary};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tower_lock_testkit::http::{Http, Reply};

/// The header-read timeout the instances run with.
const HEADER_READ_TIMEOUT: Duration = Duration::from_millis(300);

/// Opens a connection to `port`, sends half a request head, and returns how long the server kept
/// the connection open (`None`: still open after 10 s).
async fn half_a_head(port: u16) -> Option<Duration> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    conn.write_all(b"GET /items/apple HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        // A 408 may come first; the connection ends either way.
        while let Ok(n @ 1..) = conn.read(&mut buf).await {
            let _ = n;
        }
    })
    .await;
    closed.ok().map(|()| started.elapsed())
}

/// `PUT /items/{sku}` with `stock` units: stocks (or restocks) the inventory's SKU.
async fn put_stock(http: &mut Http, sku: &str, stock: u32) -> Reply {
    let body = format!(r#"{{"stock": {stock}}}"#);
    http.request("PUT", &format!("/items/{sku}"), Some(&body))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_a_request_head_is_cut_off() {
    let timeout = HEADER_READ_TIMEOUT.as_millis().to_string();
    let env = [("HEADER_READ_TIMEOUT_MS", timeout.as_str())];
    for binary in [inventory_binary(), example_binary("payments")] {
        let instance = Instance::start_binary_env(binary.clone(), &env);
        let open = half_a_head(instance.port).await;
        let open = open.unwrap_or_else(|| {
            panic!(
                "{}: a connection that sent half a request head was still open after 10 s",
                binary.display()
            )
        });
        assert!(
            open >= HEADER_READ_TIMEOUT - Duration::from_millis(50),
            "{open:?}"
        );
        // Whole requests are served as before.
        let reply = Http::new(instance.port)
            .request("GET", "/no-such-route", None)
            .await
            .unwrap();
        assert_eq!(reply.status, 404);
        instance.assert_no_panic();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sku_the_lock_cannot_take_is_refused() {
    let instance = Instance::start_env(&[]);
    let mut http = Http::new(instance.port);
    let long = "x".repeat(513);
    let reply = put_stock(&mut http, &long, 5).await;
    assert_eq!(reply.status, 400, "{:?}", reply.json());
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    let reply = http
        .request("GET", &format!("/items/{long}"), None)
        .await
        .unwrap();
    assert_eq!(reply.status, 404);
    let reply = http
        .request("POST", &format!("/items/{long}/purchase"), None)
        .await
        .unwrap();
    assert_eq!(reply.status, 400);
    // The longest SKU the lock takes is stocked and sold.
    let longest = "x".repeat(512);
    let reply = put_stock(&mut http, &longest, 5).await;
    assert_eq!(reply.status, 200);
    let reply = http
        .request("POST", &format!("/items/{longest}/purchase"), None)
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{:?}", reply.json());
    instance.assert_no_panic();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_memory_stock_is_bounded() {
    let instance = Instance::start_env(&[("MAX_SKUS", "3")]);
    let mut http = Http::new(instance.port);
    for sku in ["a", "b", "c", "a"] {
        let reply = put_stock(&mut http, sku, 1).await;
        assert_eq!(reply.status, 200, "{sku}");
    }
    let reply = put_stock(&mut http, "d", 1).await;
    assert_eq!(reply.status, 507, "{:?}", reply.json());
    // Restocking a known SKU still works, and nothing was stored for the refused one.
    let reply = put_stock(&mut http, "c", 9).await;
    assert_eq!(reply.status, 200);
    let refused = http.request("GET", "/items/d", None).await.unwrap();
    assert_eq!(refused.status, 404, "the refused SKU was stored");
    instance.assert_no_panic();
}

/// A path that is not UTF-8 once decoded, and a method a route does not take: problem+json, as
/// every other error of the example (before, axum's own `text/plain` and an empty 405).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_problem_json() {
    let instance = Instance::start_env(&[]);
    let mut http = Http::new(instance.port);
    for (method, path, status) in [
        ("GET", "/items/%FF", 400),
        ("PUT", "/items/%FF", 400),
        ("DELETE", "/items/apple", 405),
        ("GET", "/nowhere", 404),
    ] {
        let body = (method == "PUT").then_some(r#"{"stock": 5}"#);
        let reply = http.request(method, path, body).await.unwrap();
        assert_eq!(reply.status, status, "{method} {path}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{method} {path}"
        );
        assert_eq!(reply.json()["status"], status, "{method} {path}");
    }
    instance.assert_no_panic();
}
