//! The inventory example under the pause fencing exists for, on real processes: two instances
//! on one Redis (`LOCK_TTL_MS=1000`); a purchase on A takes a SKU, reads its stock and works
//! for 400 ms; A is paused (SIGSTOP) at that point, past its lease's TTL, while B sells the SKU
//! three times; A resumes. Repeated a few rounds.
//!
//! With fencing (the default), A's stale write is refused (409 `#stale-write`) and in every
//! round the stock went down by exactly the number of 200s; the journal (`WRITE_JOURNAL`) holds
//! exactly the accepted writes, with increasing tokens. With `FENCING=off` (the negative
//! control) A's write, sent the moment it resumes, lands on top of B's sales: updates are lost.

mod instances;

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
    let started = Instant::now();
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg(key.as_bytes())
            .query_async(&mut conn)
            .await
            .unwrap();
        if exists {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "A never took the lock on {sku}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn round(redis: &RedisServer, a: &Instance, b: &Instance, n: usize) -> Round {
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
        let round = round(&redis, &a, &b, n).await;
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
        let round = round(&redis, &a, &b, n).await;
        println!("unfenced, round {n}: {round:?}");
        lost += usize::from(round.decrease != round.ok);
    }
    assert!(lost > 0, "FENCING=off lost no update in {ROUNDS} rounds");
    // A's write landed: its entry is in the journal.
    let entries = journal(&redis).await;
    assert!(entries.iter().any(|e| e["instance"] == "a"), "{entries:#?}");
}
