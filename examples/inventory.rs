//! An inventory service whose purchase and order endpoints cannot oversell, even though their
//! read-modify-writes of the stock are deliberately not atomic.
//!
//! `POST /items/{sku}/purchase` reads the stock, "works" for `work_ms` milliseconds, then writes
//! the stock minus one: three separate steps, so two concurrent purchases of the last item would
//! both succeed. A [`LockLayer`] keyed on the `sku` path parameter serializes purchases of the
//! same SKU across every instance that shares the lock store; purchases of different SKUs still
//! run in parallel. Run it with `LOCK=off` to see the oversell the lock prevents.
//!
//! `POST /orders` sells several SKUs at once, the same way: it locks every SKU of the order,
//! reads every stock, works, writes every stock. Its layer reads the SKUs from the JSON body
//! ([`Key::json`]) and takes them as one lease: all of them or none, in an order every instance
//! agrees on, so two orders that name the same SKUs in opposite orders never deadlock. It locks
//! each SKU with the same lock a purchase of that SKU takes (both layers share one [`Locker`]
//! and lock in the namespace `sku`), so orders and purchases exclude each other too.
//!
//! # Routes
//!
//! | route | body | answers |
//! |---|---|---|
//! | `PUT /items/{sku}` | `{"stock": N}` | 200 `{"sku","stock"}`; 400 on a bad body |
//! | `GET /items/{sku}` | | 200 `{"sku","stock"}`; 404 for an unknown SKU |
//! | `POST /items/{sku}/purchase?work_ms=N` | | 200 `{"sku","stock","fencing_token"}`; 404 unknown SKU; 422 out of stock; 409 lock held (from the layer) |
//! | `POST /orders?work_ms=N` | `{"items": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 1}]}` | 200 `{"items": [{"sku","stock"}, ...], "fencing_tokens": {"<sku>": N, ...}}`; 400 bad body; 404 unknown SKU; 422 a SKU short of its quantity; 409 locks held (from the layer); 413 body too large |
//!
//! Every error is an `application/problem+json` body `{"type","title","status","detail"}`.
//!
//! # Orders
//!
//! - **Locks.** Every SKU of the order, as one lease, with the lock `POST /items/{sku}/purchase`
//!   takes for that SKU. When they cannot all be had within `LOCK_WAIT_MS`, the answer is 409
//!   (from the layer, with `Retry-After`) and none of them is kept.
//! - **All or nothing.** Every stock is read first; if any SKU has less than its quantity, the
//!   answer is 422 naming the SKUs short, and no stock changes. Otherwise every stock is written.
//! - **The answer.** 200 with each SKU's stock left, in the order the body first names them, and
//!   each SKU's fencing token (`{}` when the route runs without the lock, `LOCK=off`).
//! - **Lines.** The same SKU twice counts as one line with the quantities added. A quantity is
//!   a whole number from 1. At most 64 SKUs per order (the lock's `max_keys`).
//! - **Bad bodies** are 400: not JSON, no `items` or none in it, an item without a `sku` (these
//!   from the layer, which reads the SKUs before the handler runs: `#invalid-lock-key`), a SKU
//!   that is not a string, a quantity missing or below 1 (`invalid-body` or `bad-request`, from
//!   the handler, once the locks are taken). A body larger than 64 KiB is 413, a missing
//!   `content-type: application/json` 415. An unknown SKU is 404, and nothing is sold.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | unset | unset: locks and stock live in this process (`MemoryStore`), so run one instance; set (e.g. `redis://127.0.0.1:6379/`): both live in Redis, so any number of instances can share them |
//! | `LOCK_STORE`, `REDIS_URLS`, `LOCK_WAIT_REPLICAS` | | other topologies: Redlock over several masters, Redis Cluster, replica acknowledgement; see `examples/common/store.rs` and `docs/TOPOLOGY.md` (the stock stays on `REDIS_URL` or the first of `REDIS_URLS`, or in the cluster) |
//! | `REDIS_CA_CERT` | unset | for `rediss://` URLs (built with `--features tls`): a PEM file of the CA(s) to trust instead of the system's |
//! | `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | PEM files of a client certificate and its key, for a Redis that requires one (mutual TLS) |
//! | `HOST` | `127.0.0.1` | address to bind |
//! | `PORT` | `3000` | port to bind |
//! | `LOCK_TTL_MS` | `10000` | lease time to live; renewed every third of it while a purchase or order runs |
//! | `LOCK_WAIT_MS` | `2000` | how long a purchase or order waits for held locks before answering 409; `0` fails fast |
//! | `LOCK` | `on` | `off` serves the purchase and order routes without the lock |
//! | `RUST_LOG` | `info` | log filter |
//!
//! Over TLS, with a private CA and a client certificate (mutual TLS):
//!
//! ```sh
//! REDIS_URL=rediss://:secret@redis.internal:6380/ REDIS_CA_CERT=ca.pem \
//!   REDIS_CLIENT_CERT=client.pem REDIS_CLIENT_KEY=client.key \
//!   cargo run --features tls --example inventory
//! ```
//!
//! The banner shows the URL as `rediss://:***@redis.internal:6380/`: no password is printed or
//! logged. A connection that fails at start-up (a wrong password, an untrusted certificate or
//! one for another host, a server that does not answer) ends the process at once with status 1
//! and a message that names the cause.
//!
//! Built with `--features metrics`, it also serves `GET /metrics` (Prometheus text format; every
//! metric is listed in `docs/OBSERVABILITY.md`).
//!
//! # Try it
//!
//! ```sh
//! LOCK_WAIT_MS=0 cargo run --example inventory
//!
//! curl -i -X PUT localhost:3000/items/apple -H 'content-type: application/json' -d '{"stock": 5}'
//!
//! # Two purchases at once: one gets the lock (200), the other finds it held (409).
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300' &
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300'; wait
//!
//! curl -s localhost:3000/items/apple          # {"sku":"apple","stock":4}
//! ```
//!
//! With the default `LOCK_WAIT_MS=2000` the second purchase waits for the first instead, and both
//! succeed one after the other. With `LOCK=off`, set the stock to 1 and run the two purchases
//! again: both answer 200 with `"stock":0`, and two items were sold from a stock of one.
//!
//! Then an order of two apples and a pear, and one the stock cannot serve:
//!
//! ```sh
//! curl -s -X PUT localhost:3000/items/pear -H 'content-type: application/json' -d '{"stock": 1}'
//! curl -s -X POST localhost:3000/orders -H 'content-type: application/json' \
//!   -d '{"items": [{"sku": "apple", "qty": 2}, {"sku": "pear", "qty": 1}]}'
//! # {"items":[{"sku":"apple","stock":2},{"sku":"pear","stock":0}],"fencing_tokens":{"apple":2,"pear":1}}
//! curl -s -X POST localhost:3000/orders -H 'content-type: application/json' \
//!   -d '{"items": [{"sku": "apple", "qty": 1}, {"sku": "pear", "qty": 1}]}'
//! # 422: not enough stock of `pear`; nothing was sold (apple's stock stays 2)
//! ```
//!
//! An order that names a SKU a purchase (or another order) holds waits for it, or answers 409
//! with `LOCK_WAIT_MS=0`, as a second purchase does.
//!
//! To share the lock and the stock between instances, start Redis and two instances:
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3000 cargo run --example inventory
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3001 cargo run --example inventory
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300' &
//! curl -s -X POST 'localhost:3001/items/apple/purchase?work_ms=300'; wait
//! ```

use problem::Problem;
use std::{
    collections::{BTreeMap, HashMap},
    env,
    error::Error,
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{
        Path, Query, State,
        rejection::{JsonRejection, QueryRejection},
    },
    http::StatusCode,
    routing::{post, put},
};
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tower_lock::{Key, Lease, LockConfig, LockLayer, Locker, Wait};

#[path = "common/app.rs"]
mod app;
#[path = "common/metrics.rs"]
mod metrics;
#[path = "common/problem.rs"]
mod problem;
#[path = "common/store.rs"]
mod store;

/// The longest `work_ms` a purchase or order accepts.
const MAX_WORK_MS: u64 = 60_000;

/// The largest order body the lock layer reads for the order's SKUs (larger: 413).
const MAX_ORDER_BODY: usize = 64 * 1024;

/// The namespace purchases and orders lock SKUs in: one lock per SKU, whichever route takes it.
const SKU_LOCKS: &str = "sku";

#[tokio::main]
async fn main() -> ExitCode {
    app::init_logging();
    app::exit_code(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let settings = Settings::from_env()?;

    // Built (and so checked) before anything connects: a bad LOCK_TTL_MS is reported first.
    let config = LockConfig::builder()
        .ttl(settings.ttl)
        .wait(settings.wait)
        .build()?;
    // The lock layer and the stock are backed by the same kind of storage: in-process without
    // REDIS_URL, Redis with it (LOCK_STORE picks another topology: `examples/common/store.rs`).
    let chosen = store::from_env().await?;
    // One locker for both locked routes, and one namespace: a purchase and an order lock a SKU
    // with the same lock (and take their turns at it in this process in one queue).
    let locker: Locker = chosen.locker(config);
    let purchase_lock =
        LockLayer::from_locker(locker.clone(), Key::path_param("sku")).namespace(SKU_LOCKS);
    let order_lock = LockLayer::from_locker(locker, Key::json("/items/*/sku"))
        .namespace(SKU_LOCKS)
        .max_request_body(MAX_ORDER_BODY);
    let stock = match chosen.data {
        Some(conn) => {
            println!("{}", chosen.description);
            Stock::Redis(conn)
        }
        None => {
            println!(
                "REDIS_URL is not set: running as a single process with the in-memory lock \
                 store and in-memory stock"
            );
            Stock::Memory(Arc::default())
        }
    };

    // Only the purchase and order routes are locked; reading and restocking are not.
    let (purchase_route, order_route) = if settings.lock {
        (
            post(purchase).route_layer(purchase_lock),
            post(order).route_layer(order_lock),
        )
    } else {
        println!("LOCK=off: purchases and orders run without the lock and can oversell");
        (post(purchase), post(order))
    };
    let app = Router::new()
        .route("/items/{sku}", put(set_stock).get(get_stock))
        .route("/items/{sku}/purchase", purchase_route)
        .route("/orders", order_route)
        .merge(metrics::router()?)
        .fallback(|| async { Problem::not_found("no such route") })
        .with_state(stock);

    let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
        .await
        .map_err(|e| format!("cannot bind {}:{}: {e}", settings.host, settings.port))?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(app::shutdown_signal())
        .await?;
    println!("stopped");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Handlers

#[derive(Serialize)]
struct Item {
    sku: String,
    stock: u64,
}

#[derive(Deserialize)]
struct SetStock {
    stock: u64,
}

async fn set_stock(
    State(stock): State<Stock>,
    Path(sku): Path<String>,
    body: Result<Json<SetStock>, JsonRejection>,
) -> Result<Json<Item>, Problem> {
    let Json(SetStock { stock: n }) = body.map_err(Problem::bad_json)?;
    stock.set(&sku, n).await?;
    tracing::info!(sku, stock = n, "stock set");
    Ok(Json(Item { sku, stock: n }))
}

async fn get_stock(
    State(stock): State<Stock>,
    Path(sku): Path<String>,
) -> Result<Json<Item>, Problem> {
    let n = stock.get(&sku).await?.ok_or_else(|| unknown_sku(&sku))?;
    Ok(Json(Item { sku, stock: n }))
}

#[derive(Deserialize)]
struct PurchaseParams {
    #[serde(default)]
    work_ms: u64,
}

#[derive(Serialize)]
struct Purchased {
    sku: String,
    /// The stock left after this purchase.
    stock: u64,
    /// The lease's fencing token; `null` when the route runs without the lock.
    fencing_token: Option<u64>,
}

/// Sells one item: read, work, write, as three separate steps. Nothing here is atomic; the
/// lock is what keeps two purchases of the same SKU from interleaving.
async fn purchase(
    State(stock): State<Stock>,
    // `Option<Lease>`: `None` when the route is served without the layer (`LOCK=off`).
    lease: Option<Lease>,
    Path(sku): Path<String>,
    params: Result<Query<PurchaseParams>, QueryRejection>,
) -> Result<Json<Purchased>, Problem> {
    let Query(params) = params.map_err(|e| Problem::bad_request(e.body_text()))?;
    if params.work_ms > MAX_WORK_MS {
        return Err(Problem::bad_request(format!(
            "work_ms must be at most {MAX_WORK_MS}"
        )));
    }

    // 1. Read.
    let available = stock.get(&sku).await?.ok_or_else(|| unknown_sku(&sku))?;
    if available == 0 {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "out-of-stock",
            "Out of stock",
            format!("`{sku}` is out of stock"),
        ));
    }
    // 2. Work (payment, reservation, ...). Without the lock, another purchase reads the same
    //    stock meanwhile.
    tokio::time::sleep(Duration::from_millis(params.work_ms)).await;
    // 3. Write. A store that records the fencing token with the value could also refuse a write
    //    from a holder that stalled past its lease; see `Lease::fencing_token`.
    let left = available - 1;
    stock.set(&sku, left).await?;

    let fencing_token = lease.as_ref().map(Lease::fencing_token);
    tracing::info!(sku, stock = left, fencing_token, "sold one");
    Ok(Json(Purchased {
        sku,
        stock: left,
        fencing_token,
    }))
}

#[derive(Deserialize)]
struct Order {
    items: Vec<OrderLine>,
}

#[derive(Deserialize)]
struct OrderLine {
    sku: String,
    qty: u64,
}

#[derive(Serialize)]
struct Ordered {
    /// The stock left of each SKU, in the order the body first names them.
    items: Vec<Item>,
    /// Each SKU's fencing token; empty when the route runs without the lock.
    fencing_tokens: BTreeMap<String, u64>,
}

/// Sells every line of an order, or none: read every stock, work, write every stock, as
/// separate steps. Nothing here is atomic; the lease on every SKU of the order is what keeps
/// other orders and purchases of those SKUs from interleaving.
async fn order(
    State(stock): State<Stock>,
    lease: Option<Lease>,
    params: Result<Query<PurchaseParams>, QueryRejection>,
    body: Result<Json<Order>, JsonRejection>,
) -> Result<Json<Ordered>, Problem> {
    let Query(params) = params.map_err(|e| Problem::bad_request(e.body_text()))?;
    if params.work_ms > MAX_WORK_MS {
        return Err(Problem::bad_request(format!(
            "work_ms must be at most {MAX_WORK_MS}"
        )));
    }
    let Json(order) = body.map_err(Problem::bad_json)?;
    let lines = order_lines(order)?;

    // 1. Read every stock; refuse the whole order if one SKU falls short.
    let mut available = Vec::with_capacity(lines.len());
    for (sku, _) in &lines {
        available.push(stock.get(sku).await?.ok_or_else(|| unknown_sku(sku))?);
    }
    let short: Vec<String> = lines
        .iter()
        .zip(&available)
        .filter(|((_, qty), left)| *left < qty)
        .map(|((sku, qty), left)| format!("`{sku}` ({qty} ordered, {left} in stock)"))
        .collect();
    if !short.is_empty() {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "out-of-stock",
            "Out of stock",
            format!("not enough stock of {}; nothing was sold", short.join(", ")),
        ));
    }
    // 2. Work.
    tokio::time::sleep(Duration::from_millis(params.work_ms)).await;
    // 3. Write every stock.
    let mut items = Vec::with_capacity(lines.len());
    for ((sku, qty), available) in lines.into_iter().zip(available) {
        let left = available - qty;
        stock.set(&sku, left).await?;
        items.push(Item { sku, stock: left });
    }

    // Each SKU's token: the lease holds one key per SKU, its value the SKU.
    let fencing_tokens: BTreeMap<String, u64> = lease
        .iter()
        .flat_map(Lease::fencing_tokens)
        .filter_map(|(key, token)| Some((String::from_utf8(key.value().to_vec()).ok()?, token)))
        .collect();
    tracing::info!(skus = items.len(), ?fencing_tokens, "order sold");
    Ok(Json(Ordered {
        items,
        fencing_tokens,
    }))
}

/// The order's lines, the same SKU's merged (quantities added), in the order the body first
/// names them; 400 for an order without lines or a quantity below 1.
fn order_lines(order: Order) -> Result<Vec<(String, u64)>, Problem> {
    if order.items.is_empty() {
        return Err(Problem::bad_request("an order needs at least one item"));
    }
    let mut lines: Vec<(String, u64)> = Vec::with_capacity(order.items.len());
    for OrderLine { sku, qty } in order.items {
        if qty < 1 {
            return Err(Problem::bad_request(format!(
                "the quantity of `{sku}` must be at least 1"
            )));
        }
        match lines.iter_mut().find(|(s, _)| *s == sku) {
            Some((_, total)) => {
                *total = total.checked_add(qty).ok_or_else(|| {
                    Problem::bad_request(format!("the quantities of `{sku}` add up to too many"))
                })?;
            }
            None => lines.push((sku, qty)),
        }
    }
    Ok(lines)
}

fn unknown_sku(sku: &str) -> Problem {
    Problem::not_found(format!(
        "no item with SKU `{sku}`; create it with PUT /items/{sku}"
    ))
}

// ---------------------------------------------------------------------------------------------
// Stock storage: plain GET and SET, with no atomicity of their own.

#[derive(Clone)]
enum Stock {
    /// One process only.
    Memory(Arc<Mutex<HashMap<String, u64>>>),
    /// Shared by every instance, under `inventory:stock:{sku}`.
    Redis(store::DataConnection),
}

impl Stock {
    async fn get(&self, sku: &str) -> Result<Option<u64>, Problem> {
        match self {
            Self::Memory(map) => Ok(map
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(sku)
                .copied()),
            Self::Redis(conn) => conn
                .clone()
                .get(stock_key(sku))
                .await
                .map_err(Problem::storage),
        }
    }

    async fn set(&self, sku: &str, stock: u64) -> Result<(), Problem> {
        match self {
            Self::Memory(map) => {
                map.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(sku.to_owned(), stock);
                Ok(())
            }
            Self::Redis(conn) => conn
                .clone()
                .set(stock_key(sku), stock)
                .await
                .map_err(Problem::storage),
        }
    }
}

fn stock_key(sku: &str) -> String {
    format!("inventory:stock:{sku}")
}

// ---------------------------------------------------------------------------------------------
// Problem details (RFC 9457), the same shape the lock layer answers with.

impl Problem {
    fn storage(error: redis::RedisError) -> Self {
        tracing::error!(%error, "stock storage failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage-unavailable",
            "Storage unavailable",
            "the stock could not be read or written; retry later",
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Settings and shutdown

struct Settings {
    host: String,
    port: u16,
    ttl: Duration,
    wait: Wait,
    lock: bool,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let wait_ms: u64 = app::env_or("LOCK_WAIT_MS", 2000)?;
        let lock = match env::var("LOCK").as_deref() {
            Err(env::VarError::NotPresent) | Ok("on") => true,
            Ok("off") => false,
            Ok(other) => return Err(format!("LOCK={other:?} is invalid: use `on` or `off`")),
            Err(env::VarError::NotUnicode(_)) => return Err("LOCK is not valid UTF-8".into()),
        };
        Ok(Self {
            host: env::var("HOST").unwrap_or_else(|_| "127.0.0.1".into()),
            port: app::env_or("PORT", 3000)?,
            ttl: Duration::from_millis(app::env_or("LOCK_TTL_MS", 10_000)?),
            wait: if wait_ms == 0 {
                Wait::none()
            } else {
                Wait::default().deadline(Duration::from_millis(wait_ms))
            },
            lock,
        })
    }
}
