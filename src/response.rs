//! The responses the layer answers with when it cannot grant a lock.
//!
//! By default every rejection is an RFC 9457 `application/problem+json` body with a stable
//! `type` URI, a `title`, the `status` and a `detail` naming the cause, plus `Retry-After` where
//! a retry can succeed. No body ever contains the lock token or the key's value.
//!
//! | error | status | `type` ends in | `Retry-After` |
//! |---|---|---|---|
//! | [`LockError::Contended`] | 409 | `#lock-contended` | the holder's remaining TTL, whole seconds, at least 1 (an upper bound: a holder that renews shows about the full TTL, but may finish much sooner) |
//! | [`LockError::Store`] | 503 | `#lock-store-unavailable` | 1 |
//! | [`LockError::Store`], a key taken another way than its holders took it ([`StoreErrorKind::Misused`](crate::store::StoreErrorKind::Misused)) | 500 | `#lock-key-misused` | none |
//! | [`LockError::LeaseLost`] | 503 | `#lease-lost` | 1 |
//! | [`LockError::Key`], client's fault | 400 | `#invalid-lock-key` | none |
//! | [`LockError::Key`], a body larger than a body key source reads | 413 | `#request-body-too-large` | none |
//! | [`LockError::Key`], misconfigured route | 500 | `#lock-key-misconfigured` | none |
//! | [`LockError::Contended`] on a key's permits | 429 | `#permits-exhausted` | the first permit's holder's remaining TTL, as for `#lock-contended` |
//! | [`LockError::Config`] | 500 | `#lock-misconfigured` | none |
//!
//! These statuses are the errors' own ([`LockError::status`]), the same for every layer.
//! [`LockLayer::rejection_response`](crate::LockLayer::rejection_response) is the one place to
//! answer otherwise: a closure that gets the [`Rejection`] (the error, its status, the
//! `Retry-After` the default would send, and the default response itself) and returns the
//! response, so that a custom body keeps the rest, or another status keeps the body:
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, http::{HeaderValue, header}, routing::post};
//! use tower_lock::{Key, LockLayer, MemoryStore};
//!
//! let layer = LockLayer::new(MemoryStore::new(), Key::path_param("sku")).rejection_response(|rejection| {
//!     // The status and `Retry-After` of the default, with a body of the service's own.
//!     let mut response = rejection.with_body(format!(r#"{{"error":"busy","status":{}}}"#, rejection.status().as_u16()));
//!     response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
//!     response
//! });
//! let app: Router = Router::new().route("/items/{sku}/purchase", post(|| async { "sold" }).layer(layer));
//! # }
//! ```
//! The layer inserts the [`LockError`]
//! into the extensions of whatever response is built, for outer layers to inspect. With the
//! `axum` feature a [`LockError`] is itself a response (the same problem, with the same status), so a handler that takes a lease with [`Locker`](crate::Locker) can use
//! `?`.
//!
//! # One contract for every error
//!
//! Every error and rejection the crate returns has `status()` (the status a layer answers it
//! with), `problem()` (its `application/problem+json` response, the types
//! below), `Display` and [`std::error::Error`], and with the `axum` feature answers that problem
//! as an `IntoResponse`: [`LockError`], [`ConfigError`](crate::ConfigError),
//! [`StoreError`](crate::store::StoreError), [`KeyRejection`](crate::key::KeyRejection),
//! [`FenceError`](crate::fence::FenceError),
//! [`IdempotencyError`](crate::idempotency::IdempotencyError),
//! [`PrincipalRejection`](crate::idempotency::PrincipalRejection), and the extractors'
//! rejections `MissingLease`, `MissingIdempotencyKey` and `ProblemRejection` (which is not an
//! `Error`: it converts from every rejection that is one, which would include itself). A key's
//! permits all taken is [`LockError::is_permits_exhausted`].
//!
//! # Extractor rejections
//!
//! axum's own extractors answer a body that does not parse with `text/plain`. Name
//! [`ProblemRejection`] as their rejection type and they answer with a problem too (type
//! `#request-rejected`), so that one route answers in one format: see its docs for the
//! three lines it takes.
//!
//! # Problem types
//!
//! Each problem's `type` is [`PROBLEM_TYPE_BASE`] followed by `#` and one of the names below,
//! so it leads to its own section of this page.
//!
//! ## lock-contended
//!
//! Another request holds the lock on the resource and kept it past the wait policy's deadline.
//! Retry after `Retry-After` seconds.
//!
//! ## lock-store-unavailable
//!
//! The lock store (Redis) could not be reached or did not answer in time. Nothing ran; retry.
//!
//! ## lease-lost
//!
//! The request's lease was lost while its handler ran (its key was deleted, or it ran out before
//! it could be renewed: the store did not answer, or the process was paused), and the request
//! was stopped. Retry.
//!
//! ## invalid-lock-key
//!
//! The request did not name its resource in a way the key source can read (a missing header,
//! an undecodable path, a body without the fields). Fix the request.
//!
//! ## request-body-too-large
//!
//! The body is larger than the layer reads to find the keys (or to fingerprint an idempotent
//! request).
//!
//! ## lock-key-misconfigured
//!
//! The server's key source does not fit the route (a path parameter the route does not have):
//! a server error, for its operators.
//!
//! ## lock-key-misused
//!
//! The resource's lock is held another way than this request takes it: another route (or
//! call) takes the same key plain where this one takes it with a share, or names another number
//! of permits. A server error, for its operators: every user of a key must take it one way.
//!
//! ## permits-exhausted
//!
//! The resource admits a limited number of requests at once (a provider's concurrency limit,
//! say), all of them were taken, and none freed before the wait policy's deadline. Retry after
//! `Retry-After` seconds.
//!
//! ## lock-misconfigured
//!
//! The server asked for a lease that can never be granted (0 permits, a weight above the
//! permits, or permits on a store that cannot count them): a server error, for its operators.
//!
//! ## idempotency-key-missing
//!
//! The operation requires an `Idempotency-Key` header.
//!
//! ## idempotency-key-invalid
//!
//! The `Idempotency-Key` header is not a valid key: empty, sent more than once, shorter or
//! longer than the server accepts (by default at least 16 and at most 255 bytes: a UUID is 36),
//! or not a structured-field string or a bare token of visible ASCII. The `detail` says which.
//!
//! ## idempotency-key-reused
//!
//! The key was already used for a different request (another method, path, query, content type
//! or body, as the server's fingerprint counts them). Use a new key for a new request.
//!
//! ## request-body-unreadable
//!
//! The request body could not be read.
//!
//! ## idempotency-principal-missing
//!
//! The server could not tell whose request this is, so it cannot scope its idempotency key.
//!
//! ## idempotency-principal-unauthorized
//!
//! The request does not say who makes it (or says it in a way not accepted), and its
//! idempotency key is scoped by its caller: authenticate (see the `WWW-Authenticate` header) and
//! send it again.
//!
//! ## idempotency-principal-invalid
//!
//! The request names its caller in a form that cannot be used; the detail says what is wrong.
//!
//! ## request-rejected
//!
//! The request was refused before its handler ran: its body, query or path did not parse as
//! the route expects (a malformed JSON body, a missing `Content-Type`, a field of the wrong
//! type). The `detail` says what; fix the request. Emitted by [`ProblemRejection`], for the
//! extractors of the routes that use it.
//!
//! ## layer-missing
//!
//! A handler extracts what a layer adds (a [`Lease`](crate::Lease), an
//! [`IdempotencyKey`](crate::idempotency::IdempotencyKey)) on a route the layer does not wrap:
//! a server error, for its operators (500; the `detail` says which layer to add).
//!
//! ## stale-write
//!
//! A [fenced write](crate::fence) was refused: the request's lock was lost while it ran, and a
//! newer request has used the resource since. Nothing of this request was written (409, from
//! [`FenceError::Stale`](crate::fence::FenceError::Stale)). Look at the resource again before
//! retrying.
//!
//! ## data-store-unavailable
//!
//! The store of a fenced write failed or did not answer in time: the write may or may not have
//! been applied (503, `Retry-After: 1`, from [`FenceError::Store`](crate::fence::FenceError::Store)).
//!
//! ## fenced-write-invalid
//!
//! The server's fenced write cannot be applied to the data as stored (a key of another type, a
//! counter that is not a number, keys of several cluster slots): a server error, for its
//! operators. Nothing was written (500).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::error::LockError;

#[cfg(feature = "axum")]
mod extractor;
#[cfg(feature = "axum")]
pub use extractor::ProblemRejection;

/// The base of every problem `type` URI this crate emits.
pub const PROBLEM_TYPE_BASE: &str = "https://docs.rs/tower-lock/latest/tower_lock/response/";

/// A request a layer refused, as its rejection hook sees it
/// ([`LockLayer::rejection_response`](crate::LockLayer::rejection_response),
/// [`IdempotencyLayer::rejection_response`](crate::IdempotencyLayer::rejection_response)): the
/// error, its status (the error's own), the `Retry-After` the default response
/// sends, and that default response, so that a hook changes what it means to change and keeps
/// the rest. `E` is [`LockError`] for the lock layer and
/// [`IdempotencyError`](crate::idempotency::IdempotencyError) for the idempotency layer.
#[derive(Debug)]
pub struct Rejection<'a, E = LockError> {
    error: &'a E,
    status: StatusCode,
}

impl<'a, E> Rejection<'a, E> {
    pub(crate) fn new(error: &'a E, status: StatusCode) -> Self {
        Self { error, status }
    }

    /// What went wrong.
    pub fn error(&self) -> &'a E {
        self.error
    }

    /// The error's status (its `status()`): what the default response answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// This rejection answered with `status` instead: its `problem()` (whose `status` member
    /// says it too) and `with_body` use it. A layer's one way to answer with other statuses than
    /// the errors' own. Choose a 4xx or 5xx: the handler did not run, and the response goes out
    /// with whatever status the hook gives it.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_lock::{Key, LockError, LockLayer, MemoryStore};
    ///
    /// // 423 Locked rather than 409 for a held key; every other rejection as it is.
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path()).rejection_response(
    ///     |rejection| match rejection.error() {
    ///         LockError::Contended { .. } => rejection.with_status(StatusCode::LOCKED).problem(),
    ///         _ => rejection.problem(),
    ///     },
    /// );
    /// ```
    pub fn with_status(&self, status: StatusCode) -> Self {
        Self {
            error: self.error,
            status,
        }
    }
}

impl Rejection<'_, LockError> {
    /// The `Retry-After` the default response sends, in whole seconds (at least 1), or `None`
    /// where retrying the same request cannot succeed (a bad key).
    pub fn retry_after(&self) -> Option<Duration> {
        describe(self.error).3.map(Duration::from_secs)
    }

    /// The default response: the `application/problem+json` body of the [module docs](self),
    /// with the status and `Retry-After`.
    pub fn problem(&self) -> Response<Bytes> {
        lock_problem(self.error, self.status)
    }

    /// A response with this status and `Retry-After` (as the default sends it), and `body`; add
    /// a `Content-Type` for it.
    pub fn with_body(&self, body: impl Into<Bytes>) -> Response<Bytes> {
        with_body(self.status, self.retry_after(), body.into())
    }
}

/// A response with `status`, `Retry-After` and `body`.
pub(crate) fn with_body(
    status: StatusCode,
    retry_after: Option<Duration>,
    body: Bytes,
) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Some(after) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(after.as_secs()));
    }
    response
}

/// A layer's rejection hook: builds the response for a refused request.
pub(crate) type Respond<E> = dyn Fn(&Rejection<'_, E>) -> Response<Bytes> + Send + Sync;

/// The default response for a lock error: problem+json, with `Retry-After` where it helps.
pub(crate) fn lock_problem(error: &LockError, status: StatusCode) -> Response<Bytes> {
    let (kind, title, detail, retry_after) = describe(error);
    let mut response = problem(status, kind, title, &detail);
    if let Some(secs) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// An `application/problem+json` response whose `type` is `kind` under [`PROBLEM_TYPE_BASE`].
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
) -> Response<Bytes> {
    // Members in RFC 9457's order; serde_json escapes the strings.
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let body = format!(
        r#"{{"type":{},"title":{},"status":{},"detail":{}}}"#,
        quote(&format!("{PROBLEM_TYPE_BASE}#{kind}")),
        quote(title),
        status.as_u16(),
        quote(detail),
    );
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// The problem of an extractor whose layer is not on the route (`#layer-missing`, 500).
#[cfg(feature = "axum")]
pub(crate) fn layer_missing(detail: &str) -> Response<Bytes> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "layer-missing",
        "Layer missing",
        detail,
    )
}

/// Whole seconds, rounded up, at least 1.
fn retry_secs(d: Duration) -> u64 {
    (d.as_millis().div_ceil(1000) as u64).max(1)
}

fn describe(error: &LockError) -> (&'static str, &'static str, String, Option<u64>) {
    match error {
        LockError::Contended {
            expires_in,
            permits: Some(permits),
            ..
        } => {
            let secs = expires_in.map_or(1, retry_secs);
            (
                "permits-exhausted",
                "Too many concurrent requests",
                format!("all {permits} permits of this resource are taken; retry in {secs} s"),
                Some(secs),
            )
        }
        LockError::Contended { expires_in, .. } => {
            let secs = expires_in.map_or(1, retry_secs);
            (
                "lock-contended",
                "Resource locked",
                format!("another request holds the lock on this resource; retry in {secs} s"),
                Some(secs),
            )
        }
        LockError::Store(error) if error.kind() == crate::store::StoreErrorKind::Misused => (
            "lock-key-misused",
            "Lock key misused",
            "this resource's lock is taken another way elsewhere (plain against shared or \
             permits, or another number of permits): a server error, for its operators"
                .into(),
            None,
        ),
        LockError::Store(_) => (
            "lock-store-unavailable",
            "Lock store unavailable",
            "the lock store could not be reached or did not answer in time; retry later".into(),
            Some(1),
        ),
        LockError::LeaseLost(reason) => (
            "lease-lost",
            "Lock lost",
            format!("the request was stopped because its lock was lost: {reason}; retry later"),
            Some(1),
        ),
        LockError::Key(rejection) if rejection.is_body_too_large() => (
            "request-body-too-large",
            "Request body too large",
            rejection.detail().to_owned(),
            None,
        ),
        LockError::Key(rejection) if rejection.is_client_error() => (
            "invalid-lock-key",
            "Invalid lock key",
            rejection.detail().to_owned(),
            None,
        ),
        LockError::Key(rejection) => (
            "lock-key-misconfigured",
            "Lock key misconfigured",
            rejection.detail().to_owned(),
            None,
        ),
        LockError::Config(error) => (
            "lock-misconfigured",
            "Lock misconfigured",
            error.to_string(),
            None,
        ),
    }
}

/// The problem the layer answers with, with the error's [`status`](LockError::status) (409 for
/// [`LockError::Contended`], 429 for a key's permits, 503 when the store failed or the lease
/// was lost, 400, 413 or 500 for a key; never a layer's rejection hook, which this error does
/// not know of), so that a handler that takes a lease itself can return the error with `?`:
///
/// ```
/// use axum::{extract::State, response::IntoResponse};
/// use tower_lock::{LockError, Locker, MemoryStore};
///
/// async fn transfer(State(locker): State<Locker>) -> Result<&'static str, LockError> {
///     let key = locker.key("account", "acc-1")?;
///     let lease = locker.acquire(key).await?;
///     // ... move the money under the lease ...
///     lease.release().await?;
///     Ok("done")
/// }
/// # let _ = transfer;
/// ```
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for LockError {
    fn into_response(self) -> axum::response::Response {
        self.problem().map(axum::body::Body::from)
    }
}

/// Implements axum's `IntoResponse` for error types with a `problem()`: their problem, as is.
#[cfg(feature = "axum")]
macro_rules! problem_into_response {
    ($($ty:ty),+ $(,)?) => {$(
        impl axum::response::IntoResponse for $ty {
            fn into_response(self) -> axum::response::Response {
                self.problem().map(axum::body::Body::from)
            }
        }
    )+};
}
#[cfg(feature = "axum")]
pub(crate) use problem_into_response;

#[cfg(feature = "axum")]
problem_into_response!(
    crate::error::ConfigError,
    crate::store::StoreError,
    crate::key::KeyRejection,
);

#[cfg(test)]
mod tests;
