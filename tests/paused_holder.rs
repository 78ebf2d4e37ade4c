//! The inventory example under the pause fencing exists for, on real processes: two instances
//! on one Redis (`LOCK_TTL_MS=1000`, `FENCE_HORIZON_S=1`); a purchase on A takes a SKU, reads
//! its stock and works for 400 ms; A is paused (SIGSTOP) at that point, past its lease's TTL,
//! while B sells the SKU three times; A resumes. Repeated a few rounds, the last with A paused
//! until the SKU's fence has expired (past its horizon): A is refused all the same. The
//! payments example the same way: a payment paused past its lease while a retry of it pays,
//! then resumed (the last round past the horizon), is never recorded twice.
//!
//! With fencing (the default), A's stale write is refused (409 `#stale-write`) and in every
//! round the stock went down by exactly the number of 200s; the journal (`WRITE_JOURNAL`) holds
//! exactly the accepted writes, with increasing tokens. With `FENCING=off` (the negative
//! control) A's write, sent the moment it resumes, lands on top of B's sales: updates are lost.

use crate::instances;

use std::time::{Duration, Instant};

use instances::{Instance, get_stock, set_stock};
use tower_lock_testkit::{RedisServer, http::Http};

const ROUNDS: usize = 3;
const SALES: usize = 3;
const STOCK: u64 = 10;

/// What one round came to.
#[derive(Debug)]
struct Round {
    /// A's answer, after its pause.
    paused: (u16, serde_json::Value),
    /// How many purchases answered 200, A's included.
    ok: u64,
    /// How far the stock went down.
    decrease: u64,
}

/// Until a lock key for `sku` exists in `redis` (A holds it).
async fn until_locked(redis: &RedisServer, sku: &str) {
    let mut conn = redis.client().await;
    // The example locks SKUs in the namespace `sku`; the key's name holds the SKU's digest.
    let key = tower_lock::key::LockKey::new("tower-lock:", "sku", sku.as_bytes(), 512).unwrap();
    let what = format!("A never took the lock on {sku}");
    poll_for_10_s(&what, Duration::from_millis(5), async || {
        redis::cmd("EXISTS")
            .arg(key.as_bytes())
            .query_async(&mut conn)
            .await
            .unwrap()
    })
    .await;
}

/// Polls `cond` every `every` until it is true; panics with `what` after 10 s.
async fn poll_for_10_s(what: &str, every: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !cond().await {
        assert!(started.elapsed() < Duration::from_secs(10), "{what}");
        tokio::time::sleep(every).await;
    }
}

/// The keys matching `pattern` on the server behind `conn`.
async fn keys_matching(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Vec<Vec<u8>> {
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(conn)
        .await
        .unwrap()
}

/// Until no fence of fenced data is left in `redis` (they expire a horizon, 1 s here, and a
/// second after their last batch).
async fn until_fences_expired(redis: &RedisServer) {
    let mut conn = redis.client().await;
    poll_for_10_s(
        "fences still there after 10 s",
        Duration::from_millis(50),
        async || keys_matching(&mut conn, "*}data-fence:*").await.is_empty(),
    )
    .await;
}

/// A round; with `past_horizon`, A stays paused until the SKU's fence has expired.
async fn round(
    redis: &RedisServer,
    a: &Instance,
    b: &Instance,
    n: usize,
    past_horizon: bool,
) -> Round {
    let sku = format!("sku-{n}");
    set_stock(b.port, &sku, STOCK).await;
    let purchase = format!("/items/{sku}/purchase?work_ms=400");
    let a_call = {
        let (port, purchase, id) = (a.port, purchase.clone(), format!("a-{n}"));
        tokio::spawn(async move {
            Http::new(port)
                .request_with("POST", &purchase, None, &[("x-request-id", &id)])
                .await
                .expect("A's purchase")
        })
    };
    // The known point: A holds the SKU, and has read the stock (one round trip after taking
    // the lock); it is in its 400 ms of work.
    until_locked(redis, &sku).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.pause();
    // B's first purchase waits for A's lease to run out (1 s), then each sells.
    let mut ok = 0;
    let mut http = Http::new(b.port);
    for i in 0..SALES {
        let id = format!("b-{n}-{i}");
        let reply = http
            .request_with("POST", &purchase, None, &[("x-request-id", &id)])
            .await
            .expect("B's purchase");
        assert_eq!(reply.status, 200, "B: {:?}", reply.json());
        ok += 1;
    }
    if past_horizon {
        until_fences_expired(redis).await;
    }
    a.resume();
    let reply = a_call.await.unwrap();
    ok += u64::from(reply.status == 200);
    let left = get_stock(b.port, &sku).await.expect("the SKU");
    Round {
        paused: (reply.status, reply.json()),
        ok,
        decrease: STOCK - left,
    }
}

fn instances(redis: &RedisServer, fencing: &str) -> (Instance, Instance) {
    let env = |name: &'static str| {
        [
            ("LOCK_TTL_MS", "1000"),
            ("LOCK_WAIT_MS", "5000"),
            ("FENCE_HORIZON_S", "1"),
            ("FENCING", fencing),
            ("WRITE_JOURNAL", "journal"),
            ("INSTANCE", name),
        ]
    };
    (
        Instance::start(&redis.url(), &env("a")),
        Instance::start(&redis.url(), &env("b")),
    )
}

/// The journal's entries, in order.
async fn journal(redis: &RedisServer) -> Vec<serde_json::Value> {
    let mut conn = redis.client().await;
    let entries: Vec<String> = redis::cmd("LRANGE")
        .arg("journal")
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    entries
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_never_loses_an_update() {
    let redis = RedisServer::start();
    let (a, b) = instances(&redis, "on");
    for n in 0..ROUNDS {
        // The last round: A comes back after the SKU's fence has expired.
        let round = round(&redis, &a, &b, n, n == ROUNDS - 1).await;
        println!("fenced, round {n}: {round:?}");
        assert_eq!(round.decrease, round.ok, "round {n}: {round:?}");
        let (status, body) = &round.paused;
        assert_eq!(*status, 409, "round {n}: {round:?}");
        assert!(
            body["type"].as_str().unwrap().ends_with("#stale-write"),
            "{body}"
        );
    }
    // The journal: the resets and exactly the accepted writes (B's), each leaving the stock
    // before it minus one, with increasing tokens per SKU; none of A's.
    let entries = journal(&redis).await;
    assert_eq!(entries.len(), ROUNDS * (1 + SALES), "{entries:#?}");
    let mut last: Option<(String, u64, u64)> = None;
    for entry in &entries {
        let (sku, token, stock) = (
            entry["sku"].as_str().unwrap().to_owned(),
            entry["token"].as_u64().unwrap(),
            entry["stock"].as_u64().unwrap(),
        );
        if entry["reset"] == true {
            assert_eq!((token, stock), (0, STOCK), "{entry}");
        } else {
            let (last_sku, last_token, last_stock) = last.clone().unwrap();
            assert_eq!(sku, last_sku, "{entry}");
            assert!(token > last_token, "tokens not increasing: {entries:#?}");
            assert_eq!(stock, last_stock - 1, "{entry}");
            assert_eq!(entry["instance"], "b", "{entry}");
            assert!(entry["request"].as_str().unwrap().starts_with("b-"));
        }
        last = Some((sku, token, stock));
    }
    // A logged each refusal, with the SKU, its token and the request id.
    let output = a.output();
    for n in 0..ROUNDS {
        assert!(
            output
                .lines()
                .any(|l| l.contains("stock write not accepted") && l.contains(&format!("a-{n}"))),
            "A did not log its refused write of round {n}:\n{output}"
        );
    }
    a.assert_no_panic();
    b.assert_no_panic();
}

/// The negative control: the same rounds with `FENCING=off` lose updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_paused_holder_loses_updates() {
    let redis = RedisServer::start();
    let (a, b) = instances(&redis, "off");
    let mut lost = 0;
    for n in 0..ROUNDS {
        let round = round(&redis, &a, &b, n, false).await;
        println!("unfenced, round {n}: {round:?}");
        lost += usize::from(round.decrease != round.ok);
    }
    assert!(lost > 0, "FENCING=off lost no update in {ROUNDS} rounds");
    // A's write landed: its entry is in the journal.
    let entries = journal(&redis).await;
    assert!(entries.iter().any(|e| e["instance"] == "a"), "{entries:#?}");
}

/// The payments example: A's payment is paused (SIGSTOP) in its charge, past its 1 s lease; a
/// retry of it on B waits for the key, finds no payment, pays and records it (201); A resumes
/// (in the last round, after the payment, its record and its fence have expired). A is refused
/// at the data (409 `#stale-write`) or stopped by its lost lease (503 `#lease-lost`), never
/// 201; a retry replays B's payment, and the key has exactly one charge recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_payment_is_never_recorded_twice() {
    let redis = RedisServer::start();
    let env = [
        ("LOCK_TTL_MS", "1000"),
        ("LOCK_WAIT_MS", "5000"),
        ("FENCE_HORIZON_S", "1"),
        // A payment is found by its key (and its fence kept) for 3 s: the last round waits
        // that long for the fence to expire.
        ("RETENTION_S", "3"),
        ("PROVIDER_CONCURRENCY", "0"),
    ];
    let binary = instances::example_binary("payments");
    let a = Instance::start_binary(binary.clone(), &redis.url(), &env);
    let b = Instance::start_binary(binary, &redis.url(), &env);
    let body = r#"{"amount": 1250, "currency": "EUR"}"#;
    let mut conn = redis.client().await;
    for n in 0..ROUNDS {
        let key = format!("paused-payment-{n}-0123456789abcdef");
        let headers = [
            ("x-account", "acct_paused"),
            ("idempotency-key", key.as_str()),
        ];
        let a_call = {
            let (port, key) = (a.port, key.clone());
            tokio::spawn(async move {
                let headers = [
                    ("x-account", "acct_paused"),
                    ("idempotency-key", key.as_str()),
                ];
                Http::new(port)
                    .request_with("POST", "/payments?work_ms=400", Some(body), &headers)
                    .await
                    .expect("A's payment")
            })
        };
        // A holds the key (a lock key: a digit after the hash tag) and is in its charge.
        let started = Instant::now();
        loop {
            if !keys_matching(&mut conn, "tower-lock:{*}[0-9]*")
                .await
                .is_empty()
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "A never took the key"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.pause();
        let mut http = Http::new(b.port);
        let paid = http
            .request_with("POST", "/payments", Some(body), &headers)
            .await
            .expect("B's payment");
        assert_eq!(paid.status, 201, "round {n}, B: {:?}", paid.json());
        let replay = http
            .request_with("POST", "/payments", Some(body), &headers)
            .await
            .expect("a retry");
        assert_eq!(replay.status, 201, "round {n}: {:?}", replay.json());
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.json()["id"], paid.json()["id"], "round {n}");
        if n == ROUNDS - 1 {
            // The payment, its record and its fence expire: A's token alone is left to judge.
            until_fences_expired(&redis).await;
        }
        a.resume();
        let stale = a_call.await.unwrap();
        let kind = stale.json()["type"].as_str().unwrap_or_default().to_owned();
        assert!(
            (stale.status == 409 && kind.ends_with("#stale-write"))
                || (stale.status == 503 && kind.ends_with("#lease-lost")),
            "round {n}, A: {} {:?}",
            stale.status,
            stale.json()
        );
        let listed = http.request("GET", "/payments", None).await.unwrap().json();
        let charges = listed["payments"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["idempotency_key"] == key.as_str())
            .count();
        assert_eq!(charges, 1, "round {n}: {listed:#}");
    }
    a.assert_no_panic();
    b.assert_no_panic();
}
