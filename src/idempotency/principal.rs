//! The principal that scopes idempotency keys: named when the layer is built.

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{HeaderValue, StatusCode, request::Parts};

/// Who a request is made for: the scope of its idempotency keys.
///
/// Two principals using the same key value never see each other's records, so one client cannot
/// be served another's response by sending its key (and body). Return a tenant or API-key id
/// that an authenticating layer put into the request extensions.
///
/// Every [`IdempotencyLayer`](crate::IdempotencyLayer) is built with one; there is no default.
/// A service whose clients may share one key space says so with [`SharedKeySpace`], the only
/// principal whose requests share one: an empty id from any other principal is a request without
/// a caller, never the shared space.
///
/// | the principal answers | the layer |
/// |---|---|
/// | an id (any bytes, not empty) | scopes the key by it |
/// | `None`, an empty id, or [`PrincipalRejection::missing`] | 500 (`#idempotency-principal-missing`): the request reached the layer without a caller, an ordering misconfiguration; the detail given with [`with_detail`](PrincipalRejection::with_detail), if any, is the client's |
/// | [`PrincipalRejection::unauthorized`] | 401 (`#idempotency-principal-unauthorized`), with its `WWW-Authenticate` challenge |
/// | [`PrincipalRejection::bad_request`] | 400 (`#idempotency-principal-invalid`) |
///
/// Implemented for closures `Fn(&Parts) -> Option<Bytes>` (`None`: no caller, a
/// misconfiguration) and `Fn(&Parts) -> Result<Bytes, PrincipalRejection>` (the caller's
/// mistake is the caller's answer):
///
/// ```
/// use bytes::Bytes;
/// use http::{HeaderValue, request::Parts};
/// use tower_lock::{IdempotencyLayer, MemoryStore, idempotency::PrincipalRejection};
///
/// #[derive(Clone)]
/// struct AccountId(String);
///
/// // What authentication put into the extensions: its absence is the server's mistake (500).
/// let layer = IdempotencyLayer::new(MemoryStore::new(), |parts: &Parts| {
///     let AccountId(id) = parts.extensions.get::<AccountId>()?;
///     Some(Bytes::from(id.clone()))
/// });
///
/// // A gateway's header: its absence is the client's (401); an empty one is no caller either.
/// let from_header = IdempotencyLayer::new(MemoryStore::new(), |parts: &Parts| {
///     match parts.headers.get("x-account") {
///         Some(id) if !id.is_empty() => Ok(Bytes::copy_from_slice(id.as_bytes())),
///         _ => Err(PrincipalRejection::unauthorized(HeaderValue::from_static("ApiKey"))),
///     }
/// });
/// # let _ = (layer, from_header);
/// ```
pub trait Principal: Send + Sync + 'static {
    /// The principal's id (any bytes but none at all), or why the request has none.
    fn principal(&self, parts: &Parts) -> Result<Bytes, PrincipalRejection>;
}

impl<F, R> Principal for F
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: PrincipalAnswer,
{
    fn principal(&self, parts: &Parts) -> Result<Bytes, PrincipalRejection> {
        self(parts).into_principal()
    }
}

/// A principal computed by a closure from the request head, with the closure's argument and
/// answer types inferred (a closure passed straight to
/// [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) needs `|parts: &Parts|` written,
/// since any [`Principal`] fits there). This only pins down the closure's type; any such closure
/// is a [`Principal`] already.
///
/// ```
/// use bytes::Bytes;
/// use http::HeaderValue;
/// use tower_lock::{
///     IdempotencyLayer, MemoryStore,
///     idempotency::{PrincipalRejection, principal_fn},
/// };
///
/// #[derive(Clone)]
/// struct AccountId(String);
///
/// // Scoped by what authentication put into the extensions; a request without it is the
/// // client's mistake here: 401 with a challenge.
/// let layer = IdempotencyLayer::new(
///     MemoryStore::new(),
///     principal_fn(|parts| match parts.extensions.get::<AccountId>() {
///         Some(AccountId(id)) => Ok(Bytes::from(id.clone())),
///         None => Err(PrincipalRejection::unauthorized(HeaderValue::from_static("Bearer"))),
///     }),
/// );
/// # let _ = layer;
/// ```
pub fn principal_fn<F, R>(f: F) -> F
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: PrincipalAnswer,
{
    f
}

/// What a [`Principal`] closure may return: `Option<Bytes>` (`None`: no caller, 500) or
/// `Result<Bytes, PrincipalRejection>`. Sealed.
pub trait PrincipalAnswer: sealed::Sealed {
    /// The answer as the layer reads it.
    fn into_principal(self) -> Result<Bytes, PrincipalRejection>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for Option<bytes::Bytes> {}
    impl Sealed for Result<bytes::Bytes, super::PrincipalRejection> {}
}

impl PrincipalAnswer for Option<Bytes> {
    fn into_principal(self) -> Result<Bytes, PrincipalRejection> {
        self.ok_or_else(PrincipalRejection::missing)
    }
}

impl PrincipalAnswer for Result<Bytes, PrincipalRejection> {
    fn into_principal(self) -> Result<Bytes, PrincipalRejection> {
        self
    }
}

/// Why a [`Principal`] found no caller for a request: the client's mistake (401, 400), or the
/// server's (500). The layer answers problem+json (see the [module docs](super#responses)).
#[derive(Clone, PartialEq, Eq)]
pub struct PrincipalRejection {
    kind: Kind,
    detail: Option<Arc<str>>,
}

#[derive(Clone, PartialEq, Eq)]
enum Kind {
    Missing,
    Unauthorized(HeaderValue),
    BadRequest,
}

impl PrincipalRejection {
    /// No caller, and that is the server's mistake: the layer that identifies callers did not
    /// run before this one (500, `#idempotency-principal-missing`). What `None` and an empty id
    /// mean.
    pub fn missing() -> Self {
        Self {
            kind: Kind::Missing,
            detail: None,
        }
    }

    /// The request does not say who makes it, or says it in a way that is not accepted: 401
    /// (`#idempotency-principal-unauthorized`), with `challenge` as its `WWW-Authenticate`
    /// header (a 401 must carry one: `Bearer`, `Basic realm="api"`, your API key's scheme).
    pub fn unauthorized(challenge: HeaderValue) -> Self {
        Self {
            kind: Kind::Unauthorized(challenge),
            detail: None,
        }
    }

    /// The request names its caller in a form that cannot be used (a malformed id): 400
    /// (`#idempotency-principal-invalid`). `detail` is sent to the client: say what is wrong,
    /// never echo a secret.
    pub fn bad_request(detail: impl Into<Arc<str>>) -> Self {
        Self {
            kind: Kind::BadRequest,
            detail: Some(detail.into()),
        }
    }

    /// Replaces the detail the client is sent (the default for each kind says what happened in
    /// general terms).
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<Arc<str>>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The status the layer answers with: 500, 401 or 400.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            Kind::Missing => StatusCode::INTERNAL_SERVER_ERROR,
            Kind::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Kind::BadRequest => StatusCode::BAD_REQUEST,
        }
    }

    /// The `application/problem+json` response the layer answers with (with the
    /// `WWW-Authenticate` challenge of a 401), for a handler or middleware that identifies
    /// callers itself.
    pub fn problem(&self) -> http::Response<Bytes> {
        super::response::idempotency_problem(
            &super::IdempotencyError::PrincipalRejected(self.clone()),
            self.status(),
        )
    }

    /// Whether it is the client's mistake (401, 400) rather than the server's.
    pub fn is_client_error(&self) -> bool {
        !matches!(self.kind, Kind::Missing)
    }

    /// The `WWW-Authenticate` challenge of a 401.
    pub fn challenge(&self) -> Option<&HeaderValue> {
        match &self.kind {
            Kind::Unauthorized(challenge) => Some(challenge),
            _ => None,
        }
    }

    /// What the client is told.
    pub fn detail(&self) -> &str {
        match (&self.detail, &self.kind) {
            (Some(detail), _) => detail,
            (None, Kind::Missing) => {
                "the server could not tell who this request is for, so it cannot scope its \
                 idempotency key"
            }
            (None, Kind::Unauthorized(_)) => {
                "this request does not say who makes it, and its idempotency key is scoped by \
                 its caller; authenticate and send it again"
            }
            (None, Kind::BadRequest) => "this request names its caller in a form not accepted",
        }
    }
}

impl fmt::Debug for PrincipalRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrincipalRejection")
            .field("status", &self.status().as_u16())
            .field("detail", &self.detail())
            .finish()
    }
}

impl fmt::Display for PrincipalRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.detail())
    }
}

impl std::error::Error for PrincipalRejection {}

/// The [`Principal`] that puts every request in one key space: any client that sends another
/// client's key, with the same method, path and body, is served that client's stored response.
/// The only principal whose requests share one key space.
///
/// Choose it only where that cannot matter: a service with a single client, or an internal
/// caller that is the only one to see its keys. A service with several clients names the one a
/// request is made for instead (a closure over what authentication put into the extensions; see
/// [`Principal`]).
///
/// ```
/// use tower_lock::{IdempotencyLayer, MemoryStore, idempotency::SharedKeySpace};
///
/// // One caller only: the batch importer.
/// let layer = IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace);
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedKeySpace;

impl Principal for SharedKeySpace {
    fn principal(&self, _parts: &Parts) -> Result<Bytes, PrincipalRejection> {
        Ok(Bytes::new())
    }
}
