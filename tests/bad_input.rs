//! Bad input, as property tests: key encoding, header key sources and path parameters fed
//! arbitrary bytes, huge values, invalid UTF-8, control characters and repeated headers, both
//! in-process and through a real HTTP server. Never a panic; what the layer rejects is a 400
//! problem+json that does not echo the value; no key leaves its prefix and scope, and no key
//! name holds the value (its digest stands there).
//!
//! 256 cases per property by default; `PROPTEST_CASES=100000 cargo test --test integration bad_input::` for a
//! longer run.

use std::{
    future::IntoFuture,
    io::{Read, Write},
    net::TcpStream,
    sync::OnceLock,
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    http::{HeaderValue, Request, StatusCode, header},
    routing::post,
};
use proptest::{collection::vec, prelude::*};
use tower::ServiceExt;
use tower_lock::{Key, Lease, LockLayer, MemoryStore, key::LockKey};

const PREFIX: &str = "tower-lock:";
const MAX_KEY_LEN: usize = 512;

/// The digest a key name holds for `value`: the first 128 bits of its SHA-256, in hex.
fn digest(value: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(value)[..16]
        .iter()
        .flat_map(|b| format!("{b:02x}").into_bytes())
        .collect()
}

/// Splits a key, `<prefix>{<tag>}<scope length>:<scope>:<digest>`, back into (scope, digest);
/// `None` if it does not have the layout. The tag must be digits.
fn decode<'a>(key: &'a [u8], prefix: &str) -> Option<(&'a [u8], &'a [u8])> {
    let rest = key.strip_prefix(prefix.as_bytes())?.strip_prefix(b"{")?;
    let close = rest.iter().position(|&b| b == b'}')?;
    if close == 0 || !rest[..close].iter().all(u8::is_ascii_digit) {
        return None;
    }
    let rest = &rest[close + 1..];
    let colon = rest.iter().position(|&b| b == b':')?;
    let len: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
    let rest = &rest[colon + 1..];
    let scope = rest.get(..len)?;
    let value = rest.get(len..)?.strip_prefix(b":")?;
    Some((scope, value))
}

/// The app answers with the full lock key it ran under.
fn app() -> Router {
    let handler = |lease: Lease| async move { Bytes::copy_from_slice(lease.key().as_bytes()) };
    Router::new()
        .route(
            "/pay",
            post(handler).route_layer(
                LockLayer::new(MemoryStore::new(), Key::header("idempotency-key").unwrap())
                    .namespace("pay"),
            ),
        )
        .route(
            "/items/{sku}/purchase",
            post(handler).route_layer(LockLayer::new(MemoryStore::new(), Key::path_param("sku"))),
        )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The app's answer to `request`: its status, its content type and its body.
fn answer(request: Request<Body>) -> (StatusCode, Option<HeaderValue>, Bytes) {
    let response = runtime().block_on(app().oneshot(request)).unwrap();
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let body = runtime()
        .block_on(axum::body::to_bytes(response.into_body(), 1 << 20))
        .unwrap();
    (status, content_type, body)
}

/// A 400 from the layer: problem+json, `#invalid-lock-key`, without the value in it.
fn assert_rejected(
    status: StatusCode,
    content_type: Option<&HeaderValue>,
    body: &[u8],
    value: &[u8],
) {
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(content_type.unwrap(), "application/problem+json");
    let json: serde_json::Value = serde_json::from_slice(body).expect("problem body is JSON");
    assert_eq!(json["status"], 400);
    assert!(
        json["type"]
            .as_str()
            .unwrap()
            .ends_with("#invalid-lock-key"),
        "{json}"
    );
    // Short values may match ordinary words in the detail; long ones must never appear.
    if value.len() >= 16 {
        assert!(
            !body.windows(value.len()).any(|w| w == value),
            "the key's value is echoed"
        );
    }
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Anything, control characters and invalid UTF-8 included.
        4 => vec(any::<u8>(), 0..64),
        // Printable and obs-text bytes that a header can carry, up to past the limit.
        2 => vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..700),
        // Huge.
        1 => vec(any::<u8>(), 4_000..70_000),
    ]
}

proptest! {
    /// The encoding is injective (it decodes back to its parts) and always inside the prefix,
    /// whatever the scope and value; values that imitate the layout of another scope do not
    /// collide with it.
    #[test]
    fn lock_keys_decode_back_and_stay_in_their_prefix(
        prefix in "[a-z:-]{0,12}",
        scope in any::<String>(),
        value in vec(any::<u8>(), 0..600),
        split in any::<prop::sample::Index>(),
    ) {
        match LockKey::new(&prefix, &scope, &value, MAX_KEY_LEN) {
            Ok(key) => {
                prop_assert!(!value.is_empty() && value.len() <= MAX_KEY_LEN);
                let (s, v) = decode(key.as_bytes(), &prefix).expect("key layout");
                prop_assert_eq!(s, scope.as_bytes());
                prop_assert_eq!(v, &digest(&value)[..]);
                prop_assert_eq!(key.scope(), scope.as_str());
                prop_assert_eq!(key.value(), &value[..]);
                // Move part of the value into the scope: a different key, always.
                let cut = split.index(value.len());
                let forged_scope = format!("{scope}:{}", String::from_utf8_lossy(&value[..cut]));
                if let Ok(forged) = LockKey::new(&prefix, &forged_scope, &value[cut..], MAX_KEY_LEN) {
                    prop_assert_ne!(forged.as_bytes(), key.as_bytes());
                }
            }
            Err(rejection) => {
                prop_assert!(value.is_empty() || value.len() > MAX_KEY_LEN);
                prop_assert!(rejection.is_client_error());
            }
        }
    }

    /// `Key::header`: any set of `Idempotency-Key` values. One usable value locks on exactly
    /// those bytes in the `pay` namespace; none, several, an empty or an over-long one is a 400
    /// problem+json.
    #[test]
    fn header_keys_never_panic_and_never_escape(
        values in prop_oneof![
            3 => vec(header_value(), 0..4),
            1 => vec(vec(any::<u8>(), 0..8), 0..300),
        ],
    ) {
        let mut request = Request::post("/pay");
        let mut sent = Vec::new();
        for v in &values {
            // What `HeaderValue` refuses (most control characters) cannot reach a service;
            // `tcp_garbage_never_panics` sends those over the wire instead.
            if let Ok(hv) = HeaderValue::from_bytes(v) {
                request = request.header("idempotency-key", hv);
                sent.push(v.clone());
            }
        }
        let request = request.body(Body::empty()).unwrap();
        let (status, content_type, body) = answer(request);
        match &sent[..] {
            [v] if !v.is_empty() && v.len() <= MAX_KEY_LEN => {
                prop_assert_eq!(status, StatusCode::OK);
                let (scope, value) = decode(&body, PREFIX).expect("key layout");
                prop_assert_eq!(scope, b"pay");
                prop_assert_eq!(value, &digest(v)[..]);
            }
            _ => assert_rejected(
                status,
                content_type.as_ref(),
                &body,
                sent.first().map_or(&[][..], |v| &v[..]),
            ),
        }
    }

    /// `Key::path_param`: any bytes, percent-encoded into the path. Valid UTF-8 of a usable
    /// length locks on exactly those bytes in the route's scope; invalid UTF-8 and over-long
    /// values are 400 problem+json.
    #[test]
    fn path_params_never_panic_and_never_escape(raw in prop_oneof![
        4 => vec(any::<u8>(), 1..64),
        1 => vec(any::<u8>(), 400..2000),
    ]) {
        let encoded: String = raw.iter().map(|b| format!("%{b:02X}")).collect();
        let request = Request::post(format!("/items/{encoded}/purchase"))
            .body(Body::empty())
            .unwrap();
        let (status, content_type, body) = answer(request);
        if std::str::from_utf8(&raw).is_ok() && raw.len() <= MAX_KEY_LEN {
            prop_assert_eq!(status, StatusCode::OK);
            let (scope, value) = decode(&body, PREFIX).expect("key layout");
            prop_assert_eq!(scope, b"/items/{sku}");
            prop_assert_eq!(value, &digest(&raw)[..]);
        } else {
            assert_rejected(status, content_type.as_ref(), &body, &raw);
        }
    }

    /// Garbage header bytes over a real connection (CR, LF, NUL, huge, hundreds of repeats):
    /// hyper refuses what is not HTTP, the layer refuses what is not a usable key, and the
    /// server keeps answering.
    #[test]
    fn tcp_garbage_never_panics(
        values in prop_oneof![
            3 => vec(vec(any::<u8>(), 0..40), 0..4),
            1 => vec(vec(0x21u8..0x7f, 1..8), 90..400),
            1 => vec(vec(0x20u8..0x7f, 10_000..20_000), 1..2),
        ],
    ) {
        let port = server();
        let mut head = b"POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n".to_vec();
        for v in &values {
            head.extend_from_slice(b"idempotency-key: ");
            head.extend_from_slice(v);
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"connection: close\r\n\r\n");
        let status = raw_request(port, &head);
        // 400 from hyper (bad syntax) or from the layer, 431 (too many or too large headers),
        // 200 for a usable key; or hyper closed the connection on garbage (`None`).
        prop_assert!(
            matches!(status, None | Some(200 | 400 | 431)),
            "status {:?}",
            status
        );
        let ok = raw_request(
            port,
            b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: fine\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        );
        prop_assert_eq!(ok, Some(200), "the server stopped serving");
    }
}

/// One server for every case, on its own runtime thread (lives as long as the test binary).
fn server() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            runtime().block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap().port()).unwrap();
                axum::serve(listener, app()).await.unwrap();
            })
        });
        rx.recv().unwrap()
    })
}

/// Sends `head` and returns the status, or `None` if the server closed without one.
fn raw_request(port: u16, head: &[u8]) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // The server may answer and close before reading everything (431): ignore write errors.
    let _ = stream.write_all(head);
    let mut reply = Vec::new();
    match stream.read_to_end(&mut reply) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("no answer within 5 s: {e}"),
    }
    let line = reply.split(|&b| b == b'\n').next()?;
    std::str::from_utf8(line)
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}

/// Durations past what a clock can count (`Duration::MAX`, a natural "for ever") are refused
/// when built, or read as "no limit" where that is what they say: never a panic later, in a
/// request or a destructor.
#[tokio::test]
async fn durations_past_the_clock_are_refused_or_read_as_no_limit() {
    use tower_lock::{LockConfig, Locker, Wait, fence::FencedData, idempotency::IdempotencyConfig};
    let forever = Duration::MAX;
    let refused = |built: Result<LockConfig, tower_lock::ConfigError>| built.unwrap_err().field();
    assert_eq!(refused(LockConfig::builder().ttl(forever).build()), "ttl");
    assert_eq!(
        refused(LockConfig::builder().max_hold(forever).build()),
        "max_hold"
    );
    assert_eq!(
        refused(LockConfig::builder().store_timeout(forever).build()),
        "store_timeout"
    );
    let retention = IdempotencyConfig::builder().retention(forever).build();
    assert_eq!(retention.unwrap_err().field(), "retention");

    let locker = Locker::new(MemoryStore::new());
    let key = locker.key("bad", "durations").unwrap();
    // A call's TTL and longest hold are refused when set, before anything is sent.
    assert_eq!(
        locker
            .acquire(key.clone())
            .ttl(forever)
            .unwrap_err()
            .field(),
        "ttl"
    );
    let zero = Duration::ZERO;
    assert_eq!(
        locker.acquire(key.clone()).ttl(zero).unwrap_err().field(),
        "ttl"
    );
    for hold in [forever, zero] {
        let refused = locker.acquire(key.clone()).max_hold(hold).unwrap_err();
        assert_eq!(refused.field(), "max_hold");
    }
    // Delays past a year are refused when the policy is made (a jittered `Duration::MAX`
    // panicked in the first contended acquire); a deadline past the clock is no deadline.
    assert!(Wait::fixed([forever]).is_err());
    assert!(Wait::constant(forever).is_err());
    let held = locker.acquire(key.clone()).await.unwrap();
    let year = Duration::from_secs(365 * 24 * 3600);
    for wait in [
        Wait::constant(Duration::from_millis(5))
            .unwrap()
            .deadline(forever),
        Wait::fixed([year, year]).unwrap().jitter(true),
        Wait::constant(year).unwrap().jitter(true),
        Wait::exponential(year, year).unwrap(),
    ] {
        let waiting = locker.acquire(key.clone()).wait(wait.clone()).into_future();
        let waited = tokio::time::timeout(Duration::from_millis(50), waiting).await;
        assert!(waited.is_err(), "{wait:?}: {waited:?}");
    }
    // Fenced writes in memory: a horizon is a year at most, a value's TTL "for ever" counts a
    // year.
    assert_eq!(
        FencedData::in_memory()
            .horizon(forever)
            .unwrap_err()
            .field(),
        "horizon"
    );
    assert!(FencedData::in_memory().horizon(Duration::ZERO).is_err());
    let data = FencedData::in_memory().horizon(year).unwrap();
    let batch = data
        .batch(held.lease())
        .set_with_ttl("stock:apple", "1", forever);
    batch.apply().await.unwrap();
    held.release().await.unwrap();
}

/// A store setter given a value Redis cannot use, or one the store cannot honour, is a
/// `ConfigError` naming the setting when called: before, `Duration::MAX` was accepted and every
/// acquire then failed with Redis's "not an integer", small values were raised silently, and
/// `handoff(true)` on a store made from a connection manager did nothing. The store keeps
/// working with what it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_setters_refuse_what_redis_cannot_use() {
    use crate::support::LockKeys;
    use tower_lock::{Locker, RedisStore};
    let server = tower_lock_testkit::RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let field = |result: Result<RedisStore, tower_lock::ConfigError>| result.unwrap_err().field();
    let forever = Duration::MAX;
    assert_eq!(field(store.clone().claim_window(forever)), "claim_window");
    assert_eq!(
        field(store.clone().claim_window(Duration::from_millis(5))),
        "claim_window"
    );
    assert_eq!(
        field(store.clone().fence_retention(forever)),
        "fence_retention"
    );
    assert_eq!(
        field(store.clone().fence_retention(Duration::ZERO)),
        "fence_retention"
    );
    let second = Duration::from_secs(1);
    assert_eq!(
        field(store.clone().wait_for_replicas(usize::MAX, second)),
        "wait_for_replicas"
    );
    // `WAIT 1 0` would wait for ever.
    assert_eq!(
        field(store.clone().wait_for_replicas(1, Duration::ZERO)),
        "wait_for_replicas"
    );
    let message = store.clone().claim_window(forever).unwrap_err().to_string();
    assert!(message.contains("365 days"), "{message}");
    // Accepted: the bounds themselves, and 0 replicas (no wait, whatever the timeout).
    let store = store
        .claim_window(Duration::from_millis(10))
        .unwrap()
        .fence_retention(Duration::from_millis(1))
        .unwrap()
        .wait_for_replicas(0, Duration::ZERO)
        .unwrap();
    let locker = Locker::new(store.clone());
    let guard = locker
        .acquire(locker.key("bad", "setters").unwrap())
        .await
        .unwrap();
    guard.release().await.unwrap();
    // Hand-off already on (as `connect` leaves it): asked again, the same subscription, not a
    // second one.
    let pubsub = || async {
        let list = server.cli(&["CLIENT", "LIST", "TYPE", "pubsub"]);
        list.lines().filter(|l| l.contains("cmd=")).count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while pubsub().await == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = pubsub().await;
    assert_eq!(before, 1, "the store's hand-off subscription");
    let again = Locker::new(store.handoff(true).unwrap());
    let guard = again
        .acquire(again.key("bad", "again").unwrap())
        .await
        .unwrap();
    guard.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pubsub().await, before, "a second hand-off subscription");

    // Hand-off needs a connection of the store's own: refused on one made from a manager.
    let client = redis::Client::open(server.url()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let managed = RedisStore::from_connection_manager(manager);
    assert_eq!(field(managed.clone().handoff(true)), "handoff");
    let managed = managed.handoff(false).unwrap();
    let locker = Locker::new(managed);
    let guard = locker
        .acquire(locker.key("bad", "managed").unwrap())
        .await
        .unwrap();
    guard.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "a key left behind");
}
