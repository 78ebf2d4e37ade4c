//! A per-request distributed lock for [tower] and [axum](https://docs.rs/axum): at most one
//! request per key runs at a time, across every server instance that shares the lock store.
//!
//! Put [`LockLayer`] in front of the routes that must not run concurrently for the same
//! resource (a payment with an `Idempotency-Key`, a purchase of one SKU):
//!
//! ```no_run
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, extract::Path, routing::post};
//! use tower_lock::{Key, Lease, LockLayer, RedisStore};
//!
//! async fn purchase(lease: Lease, Path(sku): Path<String>) -> String {
//!     format!("bought {sku} under fencing token {}", lease.fencing_token())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1/").await?;
//! let app: Router = Router::new()
//!     .route("/items/{sku}/purchase", post(purchase))
//!     .route_layer(LockLayer::new(store, Key::path_param("sku")));
//! # let _ = app; Ok(()) }
//! # }
//! ```
//!
//! # The path of one request
//!
//! ```text
//! request ─► KeySource ─► LockKey ─► acquire (wait policy) ─► inner service ─► release ─► response
//!              │ no key: pass through   │ still held at deadline: 409  ▲ renew every ttl/3  │ dropped early:
//!              │ bad key: 400           │ store error/timeout: 503     │ lost: 503 (abort)  │ spawned release
//! ```
//!
//! 1. The [`KeySource`](key::KeySource) trait derives a value from the request head: a header
//!    ([`Key::header`]), a path parameter ([`Key::path_param`]), the path, or any closure
//!    ([`Key::from_fn`]). It may answer "no key" (the request passes through unlocked) or
//!    reject the request (400). The value is scoped by the route (or a
//!    [namespace](LockLayer::namespace)) and prefixed; see [`key`] for the layout and limits. A
//!    source may also name several keys ([`key::KeyValues`]) or read them from the body
//!    ([`Key::json`], [`Key::body`]): see [below](#several-resources-per-request).
//! 2. The [`Locker`] tries `acquire` on the [`LockStore`](store::LockStore): in Redis, `SET key token NX PX ttl`
//!    with a fresh 128-bit token, plus a fencing token, in one round trip. If the key is held it
//!    retries by the [`Wait`] policy until its deadline, then answers 409 with `Retry-After`. If
//!    the store fails or does not answer in time it answers 503.
//! 3. The inner service runs with a [`Lease`] in the request extensions (an axum extractor). While
//!    it runs, the response future renews the lease every `ttl / 3`; a renewal that finds the
//!    lease gone aborts the request with 503 (or, with [`OnLeaseLost::Continue`](config::OnLeaseLost::Continue), lets it finish
//!    and reports the loss through the `Lease`).
//! 4. When the inner future completes, the lease is released (a token-checked delete) *before*
//!    the response is handed on, so a client that retries at once never meets its own lock. If
//!    the future is dropped early (client gone, timeout, panic), a release is spawned instead.
//!
//! # Defaults
//!
//! TTL 10 s, renewal every 3.3 s, wait exponential 10..200 ms with jitter for 2 s at most,
//! max hold 5 min, store timeout 1 s, key prefix `tower-lock:`, key values up to 512 bytes.
//! See [`LockConfig`].
//!
//! # `layer` or `route_layer`
//!
//! Either runs after routing; what differs is what else they wrap (the fallback, every route
//! of the router, the 405 fallback). The [`lock`] module says what each does with the key
//! sources, and where to order the layer among others.
//!
//! # Beyond HTTP
//!
//! [`Locker::acquire`] gives background work the same machinery: a [`LeaseGuard`] renewed by
//! the locker's background task (one task per locker, however many leases),
//! released on drop, reporting loss through [`Lease::lost`]. Each call may set its own wait, TTL and longest hold
//! ([`Acquiring`](lease::Acquiring)); [`Locker::try_acquire`] does not wait; [`Locker::run`] runs a future under
//! a lease and drops it if the lease is lost. See `examples/singleton.rs` for a job that runs on
//! exactly one instance.
//!
//! # Several resources per request
//!
//! A checkout takes every SKU of its cart, a transfer both accounts. One lease then holds all
//! their keys (a [`KeySet`](key::KeySet)): taken together, all of them or none on each attempt, in *lock
//! order*, one order that every process computes alike, so that two requests naming the same
//! keys in different orders never deadlock; each key with a fencing token of its own
//! ([`Lease::fencing_tokens`]); renewed, lost and released together. A checkout whose SKUs are
//! in its JSON body, locked with the lock a single purchase of each SKU takes:
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, extract::Path, routing::post};
//! use tower_lock::{Key, Lease, LockLayer, Locker, MemoryStore};
//!
//! async fn checkout(lease: Lease) -> String {
//!     format!("{} SKUs locked", lease.keys().len())
//! }
//!
//! // One locker and one namespace for both routes: an order and a purchase of a SKU exclude
//! // each other.
//! let locker = Locker::new(MemoryStore::new());
//! let purchase = LockLayer::from_locker(locker.clone(), Key::path_param("sku")).namespace("sku");
//! // `{"items": [{"sku": "a", "qty": 2}, ...]}`: every `sku` of `items`. The layer reads the
//! // body (at most `max_request_body`: larger is a 413), and the handler gets the same bytes.
//! let cart = LockLayer::from_locker(locker, Key::json("/items/*/sku")?).namespace("sku");
//! let app: Router = Router::new()
//!     .route(
//!         "/items/{sku}/purchase",
//!         post(|Path(sku): Path<String>| async move { sku }).route_layer(purchase),
//!     )
//!     .route("/checkout", post(checkout).route_layer(cart));
//! # }
//! # Ok::<(), tower_lock::ConfigError>(())
//! ```
//!
//! Background work takes a set with [`Locker`] the same way. A transfer, under a lease on both
//! accounts, which a transfer the other way round never waits for in a cycle:
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{Locker, MemoryStore, Wait};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let locker = Locker::new(MemoryStore::new());
//! let (from, to) = (locker.key("accounts", "alice")?, locker.key("accounts", "bob")?);
//! let moved = locker
//!     .acquire([from, to])
//!     .wait(Wait::constant(Duration::from_millis(20))?.deadline(Duration::from_secs(5)))
//!     // Dropped at once if the lease is lost: nothing runs on without the lock.
//!     .run(async {
//!         // Debit `from`, credit `to`.
//!         5
//!     })
//!     .await?;
//! assert_eq!(moved, 5);
//! # Ok(()) }
//! ```
//!
//! Waiting for a set neither deadlocks nor starves: in one process it takes its turn at each
//! key in lock order; in a store that hands off, it waits in the queue of the first key it
//! cannot have, keeping the keys before it. `docs/DECISIONS.md` ("Sets of keys, and waiting for
//! them") says what each store does.
//!
//! # What the lock guarantees
//!
//! Mutual exclusion holds while the store keeps its keys and the holder renews in time. A
//! holder that stalls longer than the TTL (a long GC pause, a partition) can still be running
//! when its lease expires and a second holder starts; that is why every lease carries a
//! [fencing token](Lease::fencing_token), strictly increasing per key, for the storage behind
//! the handler to reject stale writes. The [`fence`] module makes that the easy way to write:
//! a [`FencedData`](fence::FencedData) batch (in Redis, or in memory) is applied only if no
//! newer holder of its keys has touched them, and a refusal is a 409 a handler can `?`; a
//! handler that has sent one is never answered 503 for a write that landed. A single Redis
//! without persistence that restarts loses every lease (the layer notices at the next
//! renewal); a failover to a replica may too.
//!
//! # Feature flags
//!
//! - `axum` (default): the [`Lease`] extractor, [`Key::path_param`], and route-template scopes.
//! - `redis` (default): `RedisStore` and `RedlockStore`, and idempotency records and fenced
//!   writes on Redis. Without it the crate has [`MemoryStore`] only and compiles no Redis
//!   client. Its constructors take URLs as strings; the few that take a connection of your own
//!   (`RedisStore::from_connection_manager`, `from_multiplexed`) take the `redis` crate's
//!   types, of the version this crate depends on (1.x).
//! - `bb8` (implies `redis`): `RedisStore::from_pool` and `RedisStore::pool_builder`, over a
//!   bb8-redis pool (0.26).
//! - `serde`: [`LockConfig`] and [`Wait`] deserialize from any serde format.
//! - `cluster` (implies `redis`): `ClusterStore`, for Redis Cluster.
//! - `sentinel` (implies `redis`): `SentinelStore`, for a master monitored by Redis Sentinel
//!   (follows failovers).
//! - `tls` (implies `redis`): TLS to Redis for every store (`rediss://` URLs), through rustls with the *ring*
//!   crypto provider, and `TlsConfig` for a private CA bundle and a client certificate (mutual
//!   TLS): each store's `connect_with_tls`. See `docs/SECURITY.md`.
//! - `metrics`: counters, histograms and a gauge for every lease through the
//!   [`metrics`](https://docs.rs/metrics) facade (see `docs/OBSERVABILITY.md`).
//! - `test-util`: [`Token::generate`](store::Token) and [`LockKey::new`](key::LockKey) public,
//!   for a test that drives a [`LockStore`](store::LockStore) by hand; an application never
//!   needs them (the engine draws tokens, [`Locker::key`] builds keys).
//!
//! # Where the types are
//!
//! The crate root holds the types an application names: [`LockLayer`] and [`Key`],
//! [`IdempotencyLayer`], [`Locker`] with its [`LeaseGuard`], the [`Lease`] a handler receives,
//! [`LockConfig`], [`Wait`], the errors [`LockError`] and [`ConfigError`], and the stores
//! [`MemoryStore`] and `RedisStore`. Everything else lives in one module, and only there:
//! [`key`] (key sources, [`KeySet`](key::KeySet)), [`lock`] (the layer's service, future and
//! body), [`idempotency`], [`fence`], [`lease`] (the acquire builder, why a lease was lost),
//! [`config`] (the config builder and its enums), [`response`] (rejections and problem
//! bodies), [`store`] (the store trait and the other stores).
//!
//! The crate re-exports neither `redis` nor `bb8_redis`: code that builds its own connection
//! or pool depends on them itself, at the versions above.
//!
//! # Observability
//!
//! Every locked request runs in a `lock` span (`INFO`) with its scope, a hashed key (see
//! [`KeyDisplay`](config::KeyDisplay)), the fencing token, attempts, wait and hold times, renewals and the outcome.
//! Contention and retries log at `DEBUG`; 409s, 503s, lost leases and renewal or release
//! failures at `WARN`, with the error's whole source chain. The lock token is never logged.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Declares a function public with the `test-util` feature and crate-private without it: what
/// a test of a store needs (a token, a key built by hand) and an application never does.
macro_rules! pub_with_test_util {
    ($(#[$attr:meta])* fn $($item:tt)*) => {
        #[cfg(feature = "test-util")]
        #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
        $(#[$attr])*
        pub fn $($item)*

        #[cfg(not(feature = "test-util"))]
        $(#[$attr])*
        pub(crate) fn $($item)*
    };
}

mod background;
mod concat;
pub mod config;
mod engine;
mod error;
pub mod fence;
pub mod idempotency;
pub mod key;
pub mod lease;
pub mod lock;
pub mod response;
#[cfg(feature = "serde")]
mod serde_ms;
mod slot;
pub mod store;
mod telemetry;
#[cfg(test)]
mod testing;
mod token;
mod wait;

// The headline types, here and nowhere else; every other public type lives in its module.
pub use config::settings::LockConfig;
pub use engine::{LeaseGuard, Locker};
pub use error::{ConfigError, LockError};
pub use idempotency::layer::IdempotencyLayer;
pub use key::build::Key;
pub use lease::handle::Lease;
pub use lock::layer::LockLayer;
pub use store::memory::MemoryStore;
#[cfg(feature = "redis")]
pub use store::redis::RedisStore;
pub use wait::Wait;

#[cfg(all(doctest, feature = "axum"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(all(doctest, feature = "axum"))]
#[doc = include_str!("../docs/GUIDE.md")]
struct GuideDoctests;
