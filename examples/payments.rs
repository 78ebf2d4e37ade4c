//! Idempotent payment creation: one payment per `Idempotency-Key`, however many times, and
//! however concurrently, a client retries.
//!
//! `POST /payments` looks up the payment recorded for the request's `Idempotency-Key` and, if
//! there is none, "charges the card" for `work_ms` milliseconds and records a new one. That
//! check-then-create is deliberately not atomic: two concurrent retries with the same key would
//! both find nothing and both charge. A [`LockLayer`] keyed on the `Idempotency-Key` header runs
//! requests with the same key one at a time, across every instance that shares the lock store,
//! so the second one finds the first one's payment and answers it again. Run it with `LOCK=off`
//! to see the duplicate charge the lock prevents.
//!
//! # Routes
//!
//! | route | answers |
//! |---|---|
//! | `POST /payments?work_ms=N` with `Idempotency-Key: K` and `{"amount": 1250, "currency": "EUR"}` | 201 `{"id","amount","currency"}` for a new payment; 200 with the same body for a repeat of key `K`; 400 for a missing key or a bad body; 422 if `K` was used with a different amount or currency; 409 if the lock stays held (from the layer) |
//! | `GET /payments` | 200 `{"count": n, "payments": [{"idempotency_key","id","amount","currency"}, ...]}`: every payment created, duplicates included |
//!
//! Every error is an `application/problem+json` body `{"type","title","status","detail"}`.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | unset | unset: locks and payments live in this process (`MemoryStore`), so run one instance; set: both live in Redis (payments under `payments:by-key:{key}` and the list `payments:log`), shared by every instance |
//! | `HOST` | `127.0.0.1` | address to bind |
//! | `PORT` | `3000` | port to bind |
//! | `LOCK_TTL_MS` | `10000` | lease time to live |
//! | `LOCK_WAIT_MS` | `2000` | how long a request waits for a held key before answering 409; `0` fails fast |
//! | `LOCK` | `on` | `off` serves `POST /payments` without the lock |
//! | `RUST_LOG` | `info` | log filter |
//!
//! # Try it
//!
//! ```sh
//! cargo run --example payments
//!
//! # A client retries while its first attempt is still running: with the lock, the retry waits
//! # for the first attempt and answers its payment (201 then 200, same id).
//! for i in 1 2; do
//!   curl -s -w ' %{http_code}\n' -X POST 'localhost:3000/payments?work_ms=500' \
//!     -H 'idempotency-key: order-42' -H 'content-type: application/json' \
//!     -d '{"amount": 1250, "currency": "EUR"}' &
//! done; wait
//!
//! curl -s localhost:3000/payments        # {"count":1,"payments":[...]}
//! ```
//!
//! With `LOCK=off` the same two requests both answer 201 with different ids, and
//! `GET /payments` counts 2: the customer was charged twice. With `LOCK_WAIT_MS=0` the retry
//! answers 409 at once instead of waiting.

use std::{
    collections::HashMap,
    env,
    error::Error,
    process::ExitCode,
    str::FromStr,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{
        Query, State,
        rejection::{JsonRejection, QueryRejection},
    },
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use redis::{AsyncCommands, aio::ConnectionManager};
use serde::{Deserialize, Serialize};
use tower_lock::{Key, Lease, LockConfig, LockLayer, MemoryStore, RedisStore, Wait};
use tracing_subscriber::EnvFilter;

/// The header that names a payment attempt.
const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The longest `work_ms` a request accepts.
const MAX_WORK_MS: u64 = 60_000;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let settings = Settings::from_env()?;
    let config = LockConfig::default().ttl(settings.ttl).wait(settings.wait);
    config.validate()?;

    // The layer answers 400 itself when the header is missing, repeated or empty.
    let key = Key::header(IDEMPOTENCY_KEY);
    let (layer, payments) = match &settings.redis_url {
        None => {
            println!(
                "REDIS_URL is not set: running as a single process with the in-memory lock \
                 store and in-memory payments"
            );
            let layer = LockLayer::with_config(MemoryStore::new(), key, config)?;
            (layer, Payments::Memory(Arc::default()))
        }
        Some(url) => {
            let store = RedisStore::connect(url.as_str())
                .await
                .map_err(|e| format!("cannot connect to REDIS_URL={url}: {e}"))?;
            let layer = LockLayer::with_config(store, key, config)?;
            let conn = redis::Client::open(url.as_str())?
                .get_connection_manager()
                .await?;
            println!("locks and payments are shared through Redis at {url}");
            (layer, Payments::Redis(conn))
        }
    };

    // Only creation is locked; `route_layer` on this `MethodRouter` wraps the POST handler
    // alone, and the GET handler is merged in beside it.
    let create = if settings.lock {
        post(create_payment).route_layer(layer)
    } else {
        println!("LOCK=off: payments are created without the lock and can be duplicated");
        post(create_payment)
    };
    let app = Router::new()
        .route("/payments", get(list_payments).merge(create))
        .fallback(|| async { Problem::not_found("no such route") })
        .with_state(payments);

    let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
        .await
        .map_err(|e| format!("cannot bind {}:{}: {e}", settings.host, settings.port))?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    println!("stopped");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Handlers

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Payment {
    id: String,
    amount: i64,
    currency: String,
}

/// A payment as recorded, with the key it was created under.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    idempotency_key: String,
    #[serde(flatten)]
    payment: Payment,
}

#[derive(Deserialize)]
struct WorkParams {
    #[serde(default)]
    work_ms: u64,
}

/// Check, work, create: three separate steps. Nothing here is atomic; the lock on the
/// idempotency key is what keeps two attempts with the same key from interleaving.
async fn create_payment(
    State(payments): State<Payments>,
    // `None` when the route is served without the layer (`LOCK=off`).
    lease: Option<Lease>,
    headers: HeaderMap,
    params: Result<Query<WorkParams>, QueryRejection>,
    body: Result<Json<NewPayment>, JsonRejection>,
) -> Result<(StatusCode, Json<Payment>), Problem> {
    // The layer has already checked the header when it is on; without it, check it here.
    let key = idempotency_key(&headers)?;
    let Query(params) = params.map_err(|e| Problem::bad_request(e.body_text()))?;
    if params.work_ms > MAX_WORK_MS {
        return Err(Problem::bad_request(format!(
            "work_ms must be at most {MAX_WORK_MS}"
        )));
    }
    let Json(new) = body.map_err(Problem::bad_json)?;
    let (amount, currency) = validate(new)?;

    // 1. Check: a repeat of a request that already succeeded gets the same payment back.
    if let Some(existing) = payments.get(&key).await? {
        if existing.amount != amount || existing.currency != currency {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused",
                format!(
                    "this idempotency key was used for a payment of {} {}; use a new key for \
                     a different payment",
                    existing.amount, existing.currency
                ),
            ));
        }
        tracing::info!(key, id = existing.id, "repeat of an existing payment");
        return Ok((StatusCode::OK, Json(existing)));
    }
    // 2. Work: charge the card. Without the lock a concurrent retry is in step 1 meanwhile,
    //    finds nothing, and charges again.
    tokio::time::sleep(Duration::from_millis(params.work_ms)).await;
    // 3. Create.
    let payment = Payment {
        id: format!("pay_{:016x}", fastrand::u64(..)),
        amount,
        currency,
    };
    payments.create(&key, &payment).await?;
    let fencing_token = lease.as_ref().map(Lease::fencing_token);
    tracing::info!(key, id = payment.id, fencing_token, "payment created");
    Ok((StatusCode::CREATED, Json(payment)))
}

#[derive(Serialize)]
struct PaymentList {
    count: usize,
    payments: Vec<Record>,
}

async fn list_payments(State(payments): State<Payments>) -> Result<Json<PaymentList>, Problem> {
    let payments = payments.list().await?;
    Ok(Json(PaymentList {
        count: payments.len(),
        payments,
    }))
}

fn idempotency_key(headers: &HeaderMap) -> Result<String, Problem> {
    let value = headers.get(IDEMPOTENCY_KEY).ok_or_else(|| {
        Problem::bad_request(format!("the `{IDEMPOTENCY_KEY}` header is required"))
    })?;
    match value.to_str() {
        Ok(key) if !key.is_empty() => Ok(key.to_owned()),
        _ => Err(Problem::bad_request(format!(
            "the `{IDEMPOTENCY_KEY}` header must be non-empty visible ASCII"
        ))),
    }
}

/// A positive amount and an ISO 4217-shaped currency code, upper-cased.
fn validate(new: NewPayment) -> Result<(i64, String), Problem> {
    if new.amount <= 0 {
        return Err(Problem::bad_request(
            "amount must be a positive whole number of minor units",
        ));
    }
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(Problem::bad_request(
            "currency must be a three-letter code such as EUR",
        ));
    }
    Ok((new.amount, new.currency.to_ascii_uppercase()))
}

// ---------------------------------------------------------------------------------------------
// Payment storage: plain reads and writes, with no atomicity of their own.

#[derive(Clone)]
enum Payments {
    /// One process only.
    Memory(Arc<Mutex<MemoryPayments>>),
    /// Shared by every instance.
    Redis(ConnectionManager),
}

#[derive(Default)]
struct MemoryPayments {
    by_key: HashMap<String, Payment>,
    log: Vec<Record>,
}

/// Every payment created, in order, as JSON records.
const LOG_KEY: &str = "payments:log";

fn by_key(key: &str) -> String {
    format!("payments:by-key:{key}")
}

impl Payments {
    async fn get(&self, key: &str) -> Result<Option<Payment>, Problem> {
        match self {
            Self::Memory(state) => Ok(state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .by_key
                .get(key)
                .cloned()),
            Self::Redis(conn) => {
                let json: Option<String> = conn
                    .clone()
                    .get(by_key(key))
                    .await
                    .map_err(Problem::storage)?;
                json.map(|json| serde_json::from_str(&json).map_err(Problem::corrupt))
                    .transpose()
            }
        }
    }

    async fn create(&self, key: &str, payment: &Payment) -> Result<(), Problem> {
        let record = Record {
            idempotency_key: key.to_owned(),
            payment: payment.clone(),
        };
        match self {
            Self::Memory(state) => {
                let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
                state.by_key.insert(key.to_owned(), payment.clone());
                state.log.push(record);
                Ok(())
            }
            Self::Redis(conn) => {
                let payment = serde_json::to_string(payment).map_err(Problem::corrupt)?;
                let record = serde_json::to_string(&record).map_err(Problem::corrupt)?;
                let mut conn = conn.clone();
                let () = conn
                    .set(by_key(key), payment)
                    .await
                    .map_err(Problem::storage)?;
                let _: usize = conn
                    .rpush(LOG_KEY, record)
                    .await
                    .map_err(Problem::storage)?;
                Ok(())
            }
        }
    }

    async fn list(&self) -> Result<Vec<Record>, Problem> {
        match self {
            Self::Memory(state) => Ok(state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .log
                .clone()),
            Self::Redis(conn) => {
                let records: Vec<String> = conn
                    .clone()
                    .lrange(LOG_KEY, 0, -1)
                    .await
                    .map_err(Problem::storage)?;
                records
                    .iter()
                    .map(|json| serde_json::from_str(json).map_err(Problem::corrupt))
                    .collect()
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Problem details (RFC 9457), the same shape the lock layer answers with.

#[derive(Debug, Serialize)]
struct Problem {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u16,
    detail: String,
}

impl Problem {
    fn new(status: StatusCode, slug: &str, title: &'static str, detail: impl Into<String>) -> Self {
        Self {
            // A real service would point this at its own documentation.
            kind: format!("https://example.com/problems/{slug}"),
            title,
            status: status.as_u16(),
            detail: detail.into(),
        }
    }

    fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            detail,
        )
    }

    fn bad_json(rejection: JsonRejection) -> Self {
        // axum answers 415 for a missing content type and 422 for well-formed JSON of the wrong
        // shape; this API calls every unusable body a 400, except the content type.
        let status = match rejection {
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(
            status,
            "invalid-body",
            "Invalid request body",
            rejection.body_text(),
        )
    }

    fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    fn storage(error: redis::RedisError) -> Self {
        tracing::error!(%error, "payment storage failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage-unavailable",
            "Storage unavailable",
            "the payments could not be read or written; retry later",
        )
    }

    fn corrupt(error: serde_json::Error) -> Self {
        tracing::error!(%error, "a stored payment is not valid JSON");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "storage-corrupt",
            "Storage corrupt",
            "a stored payment could not be read",
        )
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            Json(self),
        )
            .into_response()
    }
}

// ---------------------------------------------------------------------------------------------
// Settings and shutdown

struct Settings {
    redis_url: Option<String>,
    host: String,
    port: u16,
    ttl: Duration,
    wait: Wait,
    lock: bool,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let wait_ms: u64 = env_or("LOCK_WAIT_MS", 2000)?;
        let lock = match env::var("LOCK").as_deref() {
            Err(env::VarError::NotPresent) | Ok("on") => true,
            Ok("off") => false,
            Ok(other) => return Err(format!("LOCK={other:?} is invalid: use `on` or `off`")),
            Err(env::VarError::NotUnicode(_)) => return Err("LOCK is not valid UTF-8".into()),
        };
        Ok(Self {
            redis_url: env::var("REDIS_URL").ok().filter(|url| !url.is_empty()),
            host: env::var("HOST").unwrap_or_else(|_| "127.0.0.1".into()),
            port: env_or("PORT", 3000)?,
            ttl: Duration::from_millis(env_or("LOCK_TTL_MS", 10_000)?),
            wait: if wait_ms == 0 {
                Wait::none()
            } else {
                Wait::default().deadline(Duration::from_millis(wait_ms))
            },
            lock,
        })
    }
}

/// The variable parsed as a `T`, or `default` when it is unset.
fn env_or<T: FromStr>(name: &str, default: T) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match env::var(name) {
        Err(env::VarError::NotPresent) => Ok(default),
        Err(env::VarError::NotUnicode(_)) => Err(format!("{name} is not valid UTF-8")),
        Ok(value) => value
            .parse()
            .map_err(|e| format!("{name}={value:?} is invalid: {e}")),
    }
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    println!("shutting down");
}
