//! Idempotent payment creation with `Idempotency-Key`: one charge per key, however many times,
//! and however concurrently, a client retries; every retry gets the first answer again.
//!
//! `POST /payments` "charges the card" for `work_ms` milliseconds and records a payment. An
//! [`IdempotencyLayer`] in front of it gives the IETF draft's semantics:
//!
//! - a retry after the first request finished gets the first response again (the same payment
//!   id), marked `Idempotent-Replayed: true`, without charging again;
//! - a duplicate sent while the first is still running gets 409 with `Retry-After`;
//! - the same key with a different amount (or currency) gets 422;
//! - no key, or a key shorter than 16 characters, gets 400.
//!
//! Keys are scoped by account (the `x-account` header, read by a stand-in for authentication),
//! so two accounts using the same key never see each other's payments. Run it with
//! `IDEMPOTENCY=off` to see what the layer prevents: concurrent duplicates both charge.
//!
//! The handler also closes the one window the layer cannot: if the process died after a charge
//! and before the layer stored the response, the retry would run the handler again. So the
//! handler records each payment under its account and idempotency key, and a retry that finds
//! one returns it instead of charging again (in a real service: a unique constraint on
//! `(account, idempotency_key)` in the payments table; see `examples/sql.rs`). The record is
//! read and written through fenced writes ([`tower_lock::fence`]) with the lease's fencing
//! token: a request whose lease was lost, and whose key a retry has taken since, cannot write
//! its payment over the retry's (it answers 409 `#stale-write`, and its charge is not
//! recorded).
//!
//! # Routes
//!
//! | route | answers |
//! |---|---|
//! | `POST /payments?work_ms=N` with `Idempotency-Key: "K"` and `{"amount": 1250, "currency": "EUR"}` | 201 `{"id","amount","currency"}`; a replay of it for a retry (`Idempotent-Replayed: true`); 400 for a missing or short key or a bad body; 409 while the first request with `K` runs; 422 if `K` was used with another amount, currency or route |
//! | `GET /payments` | 200 `{"charges": n, "payments": [{"account","idempotency_key","id","amount","currency","started_at_ms","finished_at_ms"}, ...]}`: every charge made, duplicates included, with when its charge began and ended (Unix milliseconds) |
//!
//! A payment provider allows a few charges per account at once: at most `PROVIDER_CONCURRENCY`
//! charges of one account (`x-account`) run at once, across every instance that shares the
//! Redis (a lease on one of the account's permits, `Acquiring::permits`, around the charge). A
//! charge beyond it waits up to `PROVIDER_WAIT_MS` for a permit, first come first served, then
//! answers 429 with `Retry-After` (`#permits-exhausted`; not stored by the idempotency layer, so
//! a retry with the same key runs). `started_at_ms` and `finished_at_ms` let anyone check the
//! limit from outside.
//!
//! Every error is an `application/problem+json` body `{"type","title","status","detail"}`.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | unset | unset: locks, idempotency records and payments live in this process (`MemoryStore`), so run one instance; set: all three live in Redis, shared by every instance |
//! | `LOCK_STORE`, `REDIS_URLS`, `LOCK_WAIT_REPLICAS` | | other topologies (`redis` with replica acknowledgement, `cluster`; not `redlock`, which cannot keep records atomically with a release): see `examples/common/store.rs` and `docs/TOPOLOGY.md` |
//! | `REDIS_CA_CERT` | unset | for `rediss://` URLs (built with `--features tls`): a PEM file of the CA(s) to trust instead of the system's |
//! | `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | PEM files of a client certificate and its key, for a Redis that requires one (mutual TLS) |
//! | `HOST` | `127.0.0.1` | address to bind |
//! | `PORT` | `3000` | port to bind |
//! | `LOCK_TTL_MS` | `10000` | lease time to live (a crashed request's key frees itself after it) |
//! | `LOCK_WAIT_MS` | `0` | how long a duplicate waits for the first request (then gets its replay) before answering 409; `0` answers 409 at once |
//! | `RETENTION_S` | `86400` | how long a finished request's response is replayed (and a payment is found by its key) |
//! | `FENCE_HORIZON_S` | `86400` | how long a payment's fence is kept after its last read or write ([`FencedData::horizon`]); at least as long as the payment itself; a request paused for longer is refused all the same |
//! | `IDEMPOTENCY` (or `LOCK`) | `on` | `off` serves `POST /payments` without the layer (and writes payments unfenced) |
//! | `PROVIDER_CONCURRENCY` | `4` | the most charges of one account at once, across instances; `0` means no limit |
//! | `PROVIDER_WAIT_MS` | `5000` | how long a charge waits for a permit before answering 429 |
//! | `HEADER_READ_TIMEOUT_MS` | `5000` | how long a client may take to send a request's head before its connection is closed |
//! | `RUST_LOG` | `info` | log filter |
//!
//! Over TLS, with a private CA and a client certificate (mutual TLS):
//!
//! ```sh
//! REDIS_URL=rediss://:secret@redis.internal:6380/ REDIS_CA_CERT=ca.pem \
//!   REDIS_CLIENT_CERT=client.pem REDIS_CLIENT_KEY=client.key \
//!   cargo run --features tls --example payments
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
//! cargo run --example payments
//!
//! pay() { curl -s -i -X POST "localhost:3000/payments?work_ms=${2:-0}" \
//!   -H 'idempotency-key: "pay-2026-11-22-0001"' -H 'content-type: application/json' \
//!   -d "{\"amount\": ${1:-1250}, \"currency\": \"EUR\"}"; echo; }
//!
//! pay 1250 1000 & sleep 0.2; pay 1250   # a concurrent duplicate: 409, Retry-After
//! wait; pay 1250                        # a retry: 201 replayed, the same payment id
//! pay 999                               # the same key, another amount: 422
//! curl -s localhost:3000/payments       # {"charges":1,...}
//! ```
//!
//! With `IDEMPOTENCY=off` the two concurrent requests both answer 201 with different ids, and
//! `GET /payments` counts 2 charges: the customer was charged twice.

use problem::{Problem, Refusal};
use std::{
    env,
    error::Error,
    num::NonZeroU32,
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{
        Query, Request, State,
        rejection::{JsonRejection, QueryRejection},
    },
    http::{StatusCode, request::Parts},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tower_lock::{
    IdempotencyLayer, Lease, LockConfig, Locker, MemoryStore, Wait,
    fence::{Batch, FencedData, data_key},
    idempotency::{IdempotencyConfig, IdempotencyKey},
};

#[path = "common/app.rs"]
mod app;
#[path = "common/metrics.rs"]
mod metrics;
#[path = "common/problem.rs"]
mod problem;
#[path = "common/store.rs"]
mod store;

/// The longest `work_ms` a request accepts.
const MAX_WORK_MS: u64 = 60_000;

#[tokio::main]
async fn main() -> ExitCode {
    app::init_logging();
    app::exit_code(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let settings = Settings::from_env()?;
    let config = IdempotencyConfig::builder()
        .retention(settings.retention)
        .lock(
            LockConfig::builder()
                .ttl(settings.ttl)
                .wait(settings.wait)
                .build()?,
        )
        .build()?;

    // LOCK_STORE picks the topology (`examples/common/store.rs`). Idempotency records are
    // written atomically with the release, on one server: memory, redis, cluster or sentinel,
    // not redlock.
    // Keys are scoped by the account that `authenticate` put into the extensions.
    let by_account = |parts: &Parts| {
        let Account(id) = parts.extensions.get::<Account>()?;
        Some(Bytes::from(id.clone()))
    };
    let chosen = store::from_env().await?;
    // The provider's limit: one of the account's permits around each charge, in the same
    // store as the locks (so across every instance).
    let provider_config = LockConfig::builder()
        .ttl(settings.ttl)
        .wait(Wait::constant(Duration::from_millis(50))?.deadline(settings.provider_wait))
        .build()?;
    let locker = match chosen.store.clone() {
        store::Store::Memory => Some(Locker::with_config(MemoryStore::new(), provider_config)),
        store::Store::Redis(store) => Some(Locker::with_config(store, provider_config)),
        #[cfg(feature = "cluster")]
        store::Store::Cluster(store) => Some(Locker::with_config(store, provider_config)),
        #[cfg(feature = "sentinel")]
        store::Store::Sentinel(store) => Some(Locker::with_config(store, provider_config)),
        store::Store::Redlock(_) => None,
    };
    let provider = locker
        .zip(settings.provider_concurrency)
        .map(|(locker, permits)| Provider { locker, permits });
    let layer = match chosen.store.clone() {
        store::Store::Memory => {
            IdempotencyLayer::with_config(MemoryStore::new(), by_account, config)
        }
        store::Store::Redis(store) => IdempotencyLayer::with_config(store, by_account, config),
        #[cfg(feature = "cluster")]
        store::Store::Cluster(store) => IdempotencyLayer::with_config(store, by_account, config),
        #[cfg(feature = "sentinel")]
        store::Store::Sentinel(store) => IdempotencyLayer::with_config(store, by_account, config),
        store::Store::Redlock(_) => {
            return Err(
                "idempotency records need one store: use LOCK_STORE=redis, cluster or sentinel"
                    .into(),
            );
        }
    };
    let payments = match chosen.data {
        Some(data) => {
            println!("{}", chosen.description);
            Payments {
                data: data.fenced.horizon(settings.fence_horizon)?,
                log: Log::Redis(data.conn),
                per_slot: data.per_slot,
                provider,
                retention: settings.retention,
            }
        }
        None => {
            println!(
                "REDIS_URL is not set: running as a single process with the in-memory lock \
                 store and in-memory payments"
            );
            Payments {
                data: FencedData::in_memory().horizon(settings.fence_horizon)?,
                log: Log::Memory(Arc::default()),
                per_slot: false,
                provider,
                retention: settings.retention,
            }
        }
    };
    // Only creation takes keys; `route_layer` on this `MethodRouter` wraps the POST handler
    // alone, and the GET handler is merged in beside it.
    let create = if settings.idempotency {
        post(create_payment).route_layer(layer)
    } else {
        println!("IDEMPOTENCY=off: payments are created without the layer and can be duplicated");
        post(create_payment)
    };
    let app = Router::new()
        .route("/payments", get(list_payments).merge(create))
        .fallback(|| async { Problem::not_found("no such route") })
        // Outside the idempotency layer, so the principal is known when it runs.
        .layer(middleware::from_fn(authenticate))
        // After the authentication layer, so scrapes need no account.
        .merge(metrics::router()?)
        .with_state(payments);

    let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
        .await
        .map_err(|e| format!("cannot bind {}:{}: {e}", settings.host, settings.port))?;
    println!("listening on http://{}", listener.local_addr()?);
    app::serve(listener, app, settings.header_read_timeout).await?;
    println!("stopped");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Authentication (a stand-in) and handlers

/// The authenticated account.
#[derive(Debug, Clone)]
struct Account(String);

/// Stands in for real authentication: the account is the `x-account` header, `acct_demo`
/// without one.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = match request.headers().get("x-account").map(|v| v.to_str()) {
        None => "acct_demo".to_owned(),
        Some(Ok(id)) if !id.is_empty() && id.len() <= 64 => id.to_owned(),
        Some(_) => {
            return Problem::bad_request("x-account must be 1 to 64 visible ASCII characters")
                .into_response();
        }
    };
    request.extensions_mut().insert(Account(account));
    next.run(request).await
}

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

/// A charge as recorded, with who made it under which key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    account: String,
    idempotency_key: String,
    #[serde(flatten)]
    payment: Payment,
    /// When the charge began and ended (Unix milliseconds).
    #[serde(default)]
    started_at_ms: u64,
    #[serde(default)]
    finished_at_ms: u64,
}

#[derive(Deserialize)]
struct WorkParams {
    #[serde(default)]
    work_ms: u64,
}

/// Check, charge, record. The layer runs one request per key at a time and replays finished
/// ones; the check here only matters when the layer could not store a response (the process
/// died in between, or the record expired).
async fn create_payment(
    State(payments): State<Payments>,
    Extension(Account(account)): Extension<Account>,
    // `None` when the route is served without the layer (`IDEMPOTENCY=off`).
    lease: Option<Lease>,
    key: Option<Extension<IdempotencyKey>>,
    headers: axum::http::HeaderMap,
    params: Result<Query<WorkParams>, QueryRejection>,
    body: Result<Json<NewPayment>, JsonRejection>,
) -> Result<(StatusCode, Json<Payment>), Refusal> {
    let key = match key {
        Some(Extension(key)) => key.as_str().to_owned(),
        // Without the layer, read the header here.
        None => headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(|v| v.trim_matches('"').to_owned())
            .ok_or_else(|| Problem::bad_request("the `idempotency-key` header is required"))?,
    };
    let lease = lease.as_ref();
    let Query(params) = params.map_err(|e| Problem::bad_request(e.body_text()))?;
    if params.work_ms > MAX_WORK_MS {
        return Err(Problem::bad_request(format!("work_ms must be at most {MAX_WORK_MS}")).into());
    }
    let Json(new) = body.map_err(Problem::bad_json)?;
    let (amount, currency) = validate(new)?;

    // 1. Check: a payment already made under this key (the layer could not store its response).
    if let Some(existing) = payments.get(lease, &account, &key).await? {
        if existing.amount != amount || existing.currency != currency {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused",
                "this idempotency key was used for a different payment; use a new key",
            )
            .into());
        }
        tracing::info!(
            key,
            id = existing.id,
            "payment found by key; not charged again"
        );
        return Ok((StatusCode::CREATED, Json(existing)));
    }
    // 2. Charge the card, holding one of the account's permits at the provider (429 when none
    //    frees in time). Without the layer a concurrent duplicate is in step 1 meanwhile, finds
    //    nothing, and charges again.
    let permit = match &payments.provider {
        Some(provider) => Some(provider.permit(&account).await?),
        None => None,
    };
    let started_at_ms = unix_ms();
    tokio::time::sleep(Duration::from_millis(params.work_ms)).await;
    let finished_at_ms = unix_ms();
    if let Some(permit) = permit {
        // A failed release is logged by the crate; the permit frees itself at its TTL.
        let _ = permit.release().await;
    }
    // 3. Record, fenced by the lease's token: refused (409, nothing recorded) if a newer holder
    //    of this key has been here since. A real service writes this in one transaction with a
    //    unique constraint on (account, key), and the token in the row (`examples/sql.rs`).
    let payment = Payment {
        id: format!("pay_{:016x}", fastrand::u64(..)),
        amount,
        currency,
    };
    let charge = Charge {
        started_at_ms,
        finished_at_ms,
    };
    payments
        .create(lease, &account, &key, &payment, charge)
        .await?;
    let fencing_token = lease.map(Lease::fencing_token);
    // Never the account: it stands for a caller's credential (an API key) here.
    tracing::info!(key, id = payment.id, fencing_token, "payment created");
    Ok((StatusCode::CREATED, Json(payment)))
}

#[derive(Serialize)]
struct PaymentList {
    charges: usize,
    payments: Vec<Record>,
}

async fn list_payments(State(payments): State<Payments>) -> Result<Json<PaymentList>, Problem> {
    let payments = payments.list().await?;
    Ok(Json(PaymentList {
        charges: payments.len(),
        payments,
    }))
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
// Payment storage: each payment under its account and key, read and written through fenced
// batches (`tower_lock::fence`), and a log of every charge.

/// When a charge ran.
#[derive(Clone, Copy)]
struct Charge {
    started_at_ms: u64,
    finished_at_ms: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The payment provider's limit: at most `permits` charges of one account at once.
#[derive(Clone)]
struct Provider {
    locker: Locker,
    permits: NonZeroU32,
}

impl Provider {
    /// One of `account`'s permits, waited for first come first served.
    async fn permit(&self, account: &str) -> Result<tower_lock::LeaseGuard, Refusal> {
        let key = self
            .locker
            .key("provider", account)
            .map_err(|e| Problem::bad_request(e.to_string()))?;
        Ok(self.locker.acquire(key).permits(self.permits)?.await?)
    }
}

#[derive(Clone)]
struct Payments {
    data: FencedData,
    /// The provider's per-account limit (`None`: `PROVIDER_CONCURRENCY=0`).
    provider: Option<Provider>,
    /// Where the log of charges is read from.
    log: Log,
    /// The data is on a cluster: the log (one key) is in another slot than a payment, so it is
    /// appended after the payment's fenced write rather than with it.
    per_slot: bool,
    /// How long a payment is found by its key: as long as the layer replays its response. After
    /// that the key is a new request, and the payment's key (and its fence) expire.
    retention: Duration,
}

#[derive(Clone)]
enum Log {
    /// One process only.
    Memory(Arc<Mutex<Vec<Record>>>),
    /// Shared by every instance, under `LOG_KEY`.
    Redis(store::DataConnection),
}

/// Every charge made, in order, as JSON records.
const LOG_KEY: &str = "payments:log";

/// A payment's key: in its lease's hash slot (the lease's key holds a digest of the account and
/// the idempotency key, never either), or, served without the layer, by account and key.
fn payment_key(lease: Option<&Lease>, account: &str, key: &str) -> Vec<u8> {
    match lease {
        Some(lease) => data_key("payments:by-key:", lease.key()),
        None => format!("payments:by-key:{}:{account}:{key}", account.len()).into_bytes(),
    }
}

impl Payments {
    /// A batch fenced by `lease`, or unfenced without the layer.
    fn batch(&self, lease: Option<&Lease>) -> Batch {
        match lease {
            Some(lease) => self.data.batch(lease),
            None => self.data.unfenced_batch(),
        }
    }

    async fn get(
        &self,
        lease: Option<&Lease>,
        account: &str,
        key: &str,
    ) -> Result<Option<Payment>, Refusal> {
        let found = self
            .batch(lease)
            .get(payment_key(lease, account, key))
            .apply()
            .await?;
        found
            .data(0)
            .map(|json| serde_json::from_slice(json).map_err(|e| Problem::corrupt(&e).into()))
            .transpose()
    }

    async fn create(
        &self,
        lease: Option<&Lease>,
        account: &str,
        key: &str,
        payment: &Payment,
        charge: Charge,
    ) -> Result<(), Refusal> {
        let record = Record {
            account: account.to_owned(),
            idempotency_key: key.to_owned(),
            payment: payment.clone(),
            started_at_ms: charge.started_at_ms,
            finished_at_ms: charge.finished_at_ms,
        };
        let json = serde_json::to_string(payment).map_err(|e| Problem::corrupt(&e))?;
        let logged = serde_json::to_string(&record).map_err(|e| Problem::corrupt(&e))?;
        let mut batch =
            self.batch(lease)
                .set_with_ttl(payment_key(lease, account, key), json, self.retention);
        let with_log = matches!(self.log, Log::Redis(_)) && !self.per_slot;
        if with_log {
            batch = batch.rpush(LOG_KEY, &logged);
        }
        if let Err(error) = batch.apply().await {
            tracing::warn!(key, error = &error as &dyn Error, "payment not recorded");
            return Err(error.into());
        }
        match &self.log {
            Log::Memory(log) => log
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(record),
            Log::Redis(_) if !with_log => {
                self.data
                    .unfenced_batch()
                    .rpush(LOG_KEY, &logged)
                    .apply()
                    .await?;
            }
            Log::Redis(_) => {}
        }
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Record>, Problem> {
        match &self.log {
            Log::Memory(log) => Ok(log.lock().unwrap_or_else(PoisonError::into_inner).clone()),
            Log::Redis(conn) => {
                let records: Vec<String> = conn
                    .clone()
                    .lrange(LOG_KEY, 0, -1)
                    .await
                    .map_err(Problem::storage)?;
                records
                    .iter()
                    .map(|json| serde_json::from_str(json).map_err(|e| Problem::corrupt(&e)))
                    .collect()
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Problem details (RFC 9457), the same shape the lock layer answers with.

impl Problem {
    fn storage(error: redis::RedisError) -> Self {
        tracing::error!(%error, "payment storage failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage-unavailable",
            "Storage unavailable",
            "the payments could not be read or written; retry later",
        )
    }

    fn corrupt(error: &serde_json::Error) -> Self {
        tracing::error!(%error, "a stored payment is not valid JSON");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "storage-corrupt",
            "Storage corrupt",
            "a stored payment could not be read",
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
    retention: Duration,
    idempotency: bool,
    /// `PROVIDER_CONCURRENCY`, 0 for no limit.
    provider_concurrency: Option<NonZeroU32>,
    provider_wait: Duration,
    header_read_timeout: Duration,
    /// How long a payment's fence outlives its last read or write (`FencedData::horizon`).
    fence_horizon: Duration,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let wait_ms: u64 = app::env_or("LOCK_WAIT_MS", 0)?;
        // `LOCK=off` (the name the other examples use) means the same as `IDEMPOTENCY=off`.
        let mut idempotency = true;
        for name in ["IDEMPOTENCY", "LOCK"] {
            match env::var(name).as_deref() {
                Err(env::VarError::NotPresent) | Ok("on") => {}
                Ok("off") => idempotency = false,
                Ok(other) => {
                    return Err(format!("{name}={other:?} is invalid: use `on` or `off`"));
                }
                Err(env::VarError::NotUnicode(_)) => {
                    return Err(format!("{name} is not valid UTF-8"));
                }
            }
        }
        Ok(Self {
            host: env::var("HOST").unwrap_or_else(|_| "127.0.0.1".into()),
            port: app::env_or("PORT", 3000)?,
            ttl: Duration::from_millis(app::env_or("LOCK_TTL_MS", 10_000)?),
            wait: if wait_ms == 0 {
                Wait::none()
            } else {
                Wait::default().deadline(Duration::from_millis(wait_ms))
            },
            retention: Duration::from_secs(app::env_or("RETENTION_S", 86_400)?),
            idempotency,
            provider_concurrency: NonZeroU32::new(app::env_or("PROVIDER_CONCURRENCY", 4)?),
            provider_wait: Duration::from_millis(app::env_or("PROVIDER_WAIT_MS", 5000)?),
            header_read_timeout: app::header_read_timeout()?,
            fence_horizon: Duration::from_secs(app::env_or("FENCE_HORIZON_S", 86_400)?),
        })
    }
}
