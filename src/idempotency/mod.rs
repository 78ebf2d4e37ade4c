//! `Idempotency-Key` semantics: one run per key, the first response replayed to every retry.
//!
//! [`IdempotencyLayer`](crate::IdempotencyLayer) follows the IETF httpapi draft "The Idempotency-Key HTTP Header
//! Field". A client sends a unique key with a non-idempotent request (`POST /payments`) and the
//! same key when it retries; the handler runs once, and every retry gets the first response
//! again, marked `Idempotent-Replayed: true`. A retry that arrives while the first request is
//! still running is refused by the lock the layer takes on the key (409), and a key reused for a
//! different request is refused too (422).
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, body::Bytes, http::{StatusCode, request::Parts}, routing::post};
//! use tower_lock::{IdempotencyLayer, Lease, MemoryStore, idempotency::IdempotencyKey};
//!
//! /// The account a request is made for, put into the extensions by authentication.
//! #[derive(Clone)]
//! struct Account(String);
//!
//! async fn create_payment(
//!     lease: Lease,
//!     key: IdempotencyKey,
//!     body: String,
//! ) -> (StatusCode, String) {
//!     // Make your own write conditional on the key (a unique constraint) and fenced by
//!     // `lease.fencing_token()`: that closes the window the layer cannot (see below).
//!     let _ = (key.as_str(), lease.fencing_token(), body);
//!     (StatusCode::CREATED, r#"{"id":"pay_1"}"#.to_owned())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::body::Body;
//! use http::Request;
//! use tower::ServiceExt;
//!
//! // Keys are scoped by account: one account is never served another's response.
//! let by_account = |parts: &Parts| {
//!     let Account(id) = parts.extensions.get::<Account>()?;
//!     Some(Bytes::from(id.clone()))
//! };
//! let app = Router::new()
//!     .route("/payments", post(create_payment))
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new(), by_account));
//!
//! let request = || {
//!     let mut request = Request::post("/payments")
//!         .header("idempotency-key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
//!         .body(Body::from(r#"{"amount":1250}"#))
//!         .unwrap();
//!     // What an authentication layer outside this one would do.
//!     request.extensions_mut().insert(Account("acct_1".into()));
//!     request
//! };
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! # }
//! ```
//!
//! # The path of one request
//!
//! 1. **Key.** The header is a Structured Field string (`Idempotency-Key: "8e03…"`); a bare
//!    token (`Idempotency-Key: 8e03…`, as Stripe's clients send) is accepted too and is the same
//!    key; a bare key holds only a token's characters (letters, digits, `!#$%&'*+-.^_`|~:/`), so
//!    a comma, semicolon or space, which a proxy could split or join, is a 400 unless quoted.
//!    Missing: 400 (or, with [`required(false)`](IdempotencyConfig::required), the request
//!    passes through untouched). Sent twice, malformed, shorter than
//!    [`min_key_len`](IdempotencyConfig::min_key_len) (16) or longer than
//!    [`max_key_len`](IdempotencyConfig::max_key_len) (255): 400.
//! 2. **Principal.** The key is scoped by the request's [`Principal`] (a tenant or API-key id
//!    from the request extensions) and the [namespace](IdempotencyConfig::namespace), never by
//!    the route: clients cannot see each other's records, and one client's key names one
//!    request whatever the route. The layer is built with its principal; there is no default,
//!    and one key space for every client is a choice made explicitly, with [`SharedKeySpace`]
//!    (the only principal whose requests share one: an empty id from any other is no caller,
//!    500). A principal may refuse the caller as the client's mistake
//!    ([`PrincipalRejection`]: 401 or 400). It is asked before the key is judged: a request
//!    with neither credentials nor a valid key is refused for who it is (401), not for its key;
//!    only a request passed through without a key (`required(false)`) is not asked. So every
//!    request to a route that requires a key asks the principal: one that answers `None` for an
//!    anonymous client makes that a 500 (the server's mistake); answer
//!    [`PrincipalRejection::unauthorized`] for it instead.
//! 3. **Body.** The request body is buffered, up to
//!    [`max_request_body`](IdempotencyConfig::max_request_body) (1 MiB; larger is a 413, checked
//!    against `Content-Length` first), and the [`Fingerprint`] (method, path, query, media type
//!    and body by default) is computed. The handler gets the buffered body.
//! 4. **Lock.** The layer takes the key's lock through its own [`Locker`](crate::Locker), as
//!    [`LockLayer`](crate::LockLayer) would (no need to stack one). Default wait:
//!    [`Wait::none`](crate::Wait::none).
//! 5. **Record.** It looks the key's record up. Found with the same fingerprint: the stored
//!    response is replayed. Found with another: 422. If the lock was contended and there is no
//!    record, the first request is still running: 409 with `Retry-After`.
//! 6. **Handler.** Otherwise the handler runs under the lease (renewed as by `LockLayer`), with
//!    the [`Lease`](crate::Lease) and the [`IdempotencyKey`] in its extensions.
//! 7. **Store and release, atomically.** The response body is read (up to
//!    [`max_response_body`](IdempotencyConfig::max_response_body), 64 KiB), then one store
//!    operation — in Redis one Lua script: if the lock key still holds our token, `SET` the
//!    record with its [retention](IdempotencyConfig::retention) (24 h) and `DEL` the lock — writes
//!    the record and releases the lock together. There is no moment when a retry could find
//!    neither the lock nor the record and run the handler a second time. Each record carries
//!    its lease's fencing token, and never replaces a record with a higher one. If the lease
//!    was lost before the response was ready (a handler that sent a [fenced write](crate::fence)
//!    runs to its end, and [`OnLeaseLost::Continue`](crate::config::OnLeaseLost) lets any run on), the
//!    record is still stored when nobody holds the key, so that a retry replays what the
//!    handler did rather than doing it again; never while a newer request holds the key (its
//!    record is the one to keep), nor over a newer record. If that operation fails (the store
//!    unreachable for a moment, a Redis Cluster slot in migration answering `TRYAGAIN`), the
//!    response is answered all the same, and the operation is sent again in the background,
//!    with growing pauses, for as long as the lease is valid: it only acts while the lock holds
//!    the request's token, so sending it twice is safe. A retry meanwhile gets 409, then the
//!    replay. It is never replaced by a plain release, which would free the key without the
//!    record.
//!
//! # Responses
//!
//! | when | status | problem `type` ends in | `Retry-After` |
//! |---|---|---|---|
//! | key finished before, same fingerprint | the stored status, headers from the allow-list, body; `Idempotent-Replayed: true` | | |
//! | header missing on a route that requires it | 400 | `#idempotency-key-missing` | |
//! | header malformed, repeated, too short or too long | 400 | `#idempotency-key-invalid` | |
//! | key finished before, different fingerprint | 422 | `#idempotency-key-reused` | |
//! | key's first request still running (or still writing its record: see step 7) | 409 | `#lock-contended` | holder's remaining TTL |
//! | the handler ran, and writing its record failed (sent again in the background while the lease is valid) | the handler's response | | |
//! | request body over `max_request_body` | 413 | `#request-body-too-large` | |
//! | request body failed to arrive | 400 | `#request-body-unreadable` | |
//! | no principal for the request (`None`, an empty id, [`PrincipalRejection::missing`]) | 500 | `#idempotency-principal-missing` | |
//! | the principal refused the caller: [`PrincipalRejection::unauthorized`] | 401, with its `WWW-Authenticate` | `#idempotency-principal-unauthorized` | |
//! | the principal refused the caller: [`PrincipalRejection::bad_request`] | 400 | `#idempotency-principal-invalid` | |
//! | store failed, or lease lost while the handler ran | 503 | `#lock-store-unavailable`, `#lease-lost` | 1 |
//!
//! Every `type` is under [`PROBLEM_TYPE_BASE`](crate::response::PROBLEM_TYPE_BASE). The
//! [`IdempotencyError`] is in the response's extensions; replace the bodies with
//! [`IdempotencyLayer::rejection_response`](crate::IdempotencyLayer::rejection_response).
//!
//! # What is not stored
//!
//! - **Responses the [`store_when`](IdempotencyConfig::store_when) predicate refuses**: by
//!   default ([`NotRejected`]) 5xx responses, so a retry after a server error runs the handler
//!   again (the handler must be safe to retry after a failure it reported), and the 4xx that
//!   refuse a request before it runs: 400, 413, 415 and 422 (axum's `Json`, `Form`, `Query`
//!   and `Path` rejections, a validation layer's refusal), 408 and 429. As at Stripe, a request
//!   that failed validation stores nothing, so the client's corrected retry with the same key
//!   runs. Every other 4xx is the key's outcome and replays (a 402 for a declined card, a 404,
//!   a 409). [`NotServerError`] stores every 4xx; an API whose 4xx all ask the client to
//!   correct something and retry with the same key stores only 1xx–3xx with [`NotError`], or
//!   decides per response with a closure (see [`StorePredicate`]). [`Always`] stores 5xx too.
//!   The layer's own answers (400, 409, 413, 422, 503) are never stored.
//! - **Responses over [`max_response_body`](IdempotencyConfig::max_response_body)**: the client
//!   gets the whole response, streamed on after the part that was read, but nothing is stored
//!   and the lock is released: a retry runs the handler again. Raise the cap for handlers whose
//!   large responses must replay.
//! - **Headers outside [`replay_headers`](IdempotencyConfig::replay_headers)** (`Set-Cookie`,
//!   for one) and response trailers.
//! - A response whose body fails mid-stream: the client sees the failure; a retry runs again.
//!
//! Streamed bodies within the cap are stored: the layer reads the whole body before answering
//! (so the client sees the first byte only once the handler's body has ended) and replays it as
//! one chunk.
//!
//! # What the layer cannot close
//!
//! If the process dies after the handler's side effect (the card was charged) and before the
//! record is written, nothing is stored; the lock expires after its TTL and a retry runs the
//! handler again. The same happens if the store loses the record (a Redis without persistence
//! restarting, a failover to a replica that had not received it), if the lease is lost and a
//! newer request takes the key before the record could be written, or if writing it fails
//! every time it is sent while the lease is valid (the store down for longer than what is left
//! of the lease's TTL): a retry after the lock has expired runs the handler again (a retry
//! before that gets 409). No middleware can close this window: the side effect and the record
//! live in different systems. A handler closes it by making its own write conditional on the
//! key: [`IdempotencyKey`] gives it the key (and principal), and the [`Lease`](crate::Lease)
//! its [`key`](crate::Lease::key) and [fencing token](crate::Lease::fencing_token). Record the
//! side effect under a unique constraint on the key (in the same transaction as the write), and
//! on a retry that finds it, return it instead of acting again; pass the fencing token so the
//! storage rejects a stale holder's write ([`crate::fence`], `examples/sql.rs`,
//! `examples/payments.rs`).
//!
//! A request dropped before its response is read (client gone, timeout, panic) stores nothing
//! and releases the lock in a spawned task, so a retry runs at once rather than waiting for the
//! retention or the TTL. One dropped while its record is being written leaves the write (and
//! its retries) to a spawned task, never a plain release.
//!
//! # Stores
//!
//! Records live in the lock's store, next to the lock key (in Redis
//! `<prefix>{<tag>}record:<scope length>:<scope>:<digest>`, the lock key's Redis Cluster slot,
//! a key no lock key can be); see [`IdempotencyStore`]. It is implemented for
//! [`MemoryStore`](crate::MemoryStore) (one process) and [`RedisStore`](crate::RedisStore).
//! A fresh request costs three round trips (acquire, lookup, store-and-release); a replay two
//! or three.
//!
//! # `layer` or `route_layer`
//!
//! As for [`LockLayer`](crate::LockLayer): add it with `route_layer` on the routes that take an
//! idempotency key (or on a `MethodRouter`, to cover only `POST`). Put the layer that sets the
//! principal (authentication) outside it.

mod body;
mod collect;
mod config;
mod error;
mod fingerprint;
mod future;
mod key;
pub(crate) mod layer;
mod predicate;
mod principal;
mod record;
mod response;
mod service;
mod state;
pub(crate) mod store;

pub use body::ResponseBody;
pub use config::{IdempotencyConfig, IdempotencyConfigBuilder};
pub use error::IdempotencyError;
pub use fingerprint::Fingerprint;
pub use future::ResponseFuture;
pub use key::IdempotencyKey;
#[cfg(feature = "axum")]
pub use key::MissingIdempotencyKey;
pub use predicate::{Always, NotError, NotRejected, NotServerError, StorePredicate};
pub use principal::{Principal, PrincipalAnswer, PrincipalRejection, SharedKeySpace, principal_fn};
pub use service::IdempotencyService;
pub use store::IdempotencyStore;
