//! The store's transport: one multiplexed connection (by default), a bb8 pool, or a cluster
//! connection; and how Redis's errors become store errors.

#[cfg(feature = "bb8")]
use bb8_redis::{RedisConnectionManager, bb8};
use redis::{
    Cmd, ErrorKind, Pipeline, RedisError, Script, ServerErrorKind, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
};
use std::{borrow::Cow, future::Future, time::Duration};

use super::RedisStore;
use crate::{
    background::OnRuntime,
    store::{StoreError, StoreErrorKind},
};

#[derive(Clone)]
pub(super) enum Transport {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    #[cfg(feature = "bb8")]
    Pool(bb8::Pool<RedisConnectionManager>),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Transport {
    /// See [`RedisStore::query`]. Polled in the crate's runtime context ([`OnRuntime`]): a
    /// connection the call opens or reopens (the first, a reconnection, a pooled one) runs its
    /// I/O task there, whichever runtime the caller is on.
    pub(super) fn query<'a>(
        &'a self,
        request: Request<'a>,
    ) -> OnRuntime<impl Future<Output = Result<Result<Value, RedisError>, StoreError>> + 'a> {
        OnRuntime::new(self.send(request))
    }

    async fn send(&self, request: Request<'_>) -> Result<Result<Value, RedisError>, StoreError> {
        async fn run(
            request: Request<'_>,
            conn: &mut impl ConnectionLike,
        ) -> Result<Value, RedisError> {
            match request {
                Request::Cmd(cmd) => cmd.query_async(conn).await,
                Request::Pipe(pipe) => pipe.query_async(conn).await,
                Request::Load(script) => script
                    .load_async(conn)
                    .await
                    .map(|sha| Value::BulkString(sha.into_bytes())),
            }
        }
        Ok(match (self, request) {
            // A single command straight to the connection: `query_async` would go through
            // `ConnectionLike`, which boxes every command's future (an allocation above the
            // allocator's per-thread cache, per command).
            (Self::Manager(conn), Request::Cmd(cmd)) => conn
                .clone()
                .send_packed_command(cmd)
                .await
                .and_then(Value::extract_error),
            (Self::Multiplexed(conn), Request::Cmd(cmd)) => conn
                .clone()
                .send_packed_command(cmd)
                .await
                .and_then(Value::extract_error),
            (Self::Manager(conn), request) => run(request, &mut conn.clone()).await,
            (Self::Multiplexed(conn), request) => run(request, &mut conn.clone()).await,
            #[cfg(feature = "cluster")]
            (Self::Cluster(conn), request) => run(request, &mut conn.clone()).await,
            #[cfg(feature = "bb8")]
            (Self::Pool(pool), request) => {
                let mut conn = pool.get().await.map_err(|e| match e {
                    bb8::RunError::User(e) => redis_error(e),
                    bb8::RunError::TimedOut => StoreError::msg(
                        StoreErrorKind::Timeout,
                        "timed out waiting for a Redis connection from the pool",
                    ),
                })?;
                run(request, &mut *conn).await
            }
        })
    }
}

/// One request on the store's transport.
pub(super) enum Request<'a> {
    Cmd(&'a Cmd),
    Pipe(&'a Pipeline),
    Load(&'a Script),
}

impl RedisStore {
    /// Sends one request. The outer error is the transport's (no pooled connection); the inner
    /// one is Redis's answer.
    pub(super) async fn query(
        &self,
        request: Request<'_>,
    ) -> Result<Result<Value, RedisError>, StoreError> {
        self.transport.query(request).await
    }

    /// Redis's answer as a store error. Through a cluster client, a redirection that reaches
    /// the caller (`MOVED`, `ASK`) means the client ran out of retries following a slot that
    /// was moving: the command did not run, and a later one finds the slot's new master, so it
    /// is a [`TryAgain`](StoreErrorKind::TryAgain), as `TRYAGAIN` is. Through a plain
    /// connection, one is a misconfiguration (a cluster reached without the cluster client).
    pub(super) fn store_error(&self, e: RedisError) -> StoreError {
        #[cfg(feature = "cluster")]
        if matches!(self.transport, Transport::Cluster(_))
            && matches!(
                e.kind(),
                ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
            )
        {
            return StoreError::new(
                StoreErrorKind::TryAgain,
                "the Redis Cluster slot is moving; try again",
                e,
            );
        }
        redis_error(e)
    }
}

/// The [`RedisStore::connect`] transport's settings.
pub(super) fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}

pub(crate) fn redis_error(e: RedisError) -> StoreError {
    let (kind, cause) = classify(&e);
    let message: Cow<'static, str> = match (kind, cause) {
        // Refused unrun, during a slot migration: see `StoreErrorKind::TryAgain`.
        (StoreErrorKind::TryAgain, _) => {
            "the Redis lock store asked to try again (a slot in migration)".into()
        }
        // The cause says what to fix, and that it is the server's answer.
        (_, Some(cause)) => cause,
        (_, None) => "the Redis lock store failed".into(),
    };
    StoreError::new(kind, message, e)
}

/// What marks a TLS address in the names of servers (`target`s): "the Redis server at
/// host:port (TLS)".
pub(crate) const TLS_MARK: &str = " (TLS)";

/// A failed attempt to connect to `target` ("the Redis server at host:port"), with a message
/// that names the cause: the credentials, the TLS certificate (whose, and what is wrong with
/// it), an address that does not answer. The URL is never in it: `target` is an address.
pub(crate) fn connect_error(target: &str, e: RedisError) -> StoreError {
    let (kind, cause) = classify(&e);
    let cause = cause.unwrap_or(match kind {
        // A Redis port that does not speak TLS takes the handshake for the start of a command
        // and waits for the rest of it.
        StoreErrorKind::Timeout if target.contains(TLS_MARK) => {
            "it did not answer in time (over TLS: a port that does not speak TLS does not \
             answer the handshake; is it a TLS port?)"
                .into()
        }
        StoreErrorKind::Timeout => "it did not answer in time".into(),
        StoreErrorKind::Unavailable if e.is_connection_refusal() => {
            "nothing listens there (connection refused)".into()
        }
        StoreErrorKind::Unavailable if e.is_connection_dropped() => {
            // What a TLS-only port does to a client that does not speak TLS.
            "it closed the connection (a TLS port reached with `redis://` instead of \
             `rediss://` does that)"
                .into()
        }
        StoreErrorKind::Unavailable => "it cannot be reached".into(),
        _ => "it answered with an error".into(),
    });
    StoreError::new(kind, format!("cannot connect to {target}: {cause}"), e)
}

/// The kind of a Redis error, and for the kinds that say what to fix (credentials, TLS,
/// settings) a cause that names it.
fn classify(e: &RedisError) -> (StoreErrorKind, Option<Cow<'static, str>>) {
    if e.kind() == ErrorKind::Server(ServerErrorKind::TryAgain) {
        // Redis's other "not now" answers (`LOADING`, `CLUSTERDOWN`, `MASTERDOWN`) mean an
        // outage: 503 at once.
        return (StoreErrorKind::TryAgain, None);
    }
    #[cfg(feature = "tls")]
    if let Some(cause) = tls_cause(e) {
        return (StoreErrorKind::Tls, Some(cause));
    }
    let auth = match (e.kind(), e.code()) {
        (_, Some("NOAUTH")) => Some("the server requires a password, and none was given (NOAUTH)"),
        (_, Some("WRONGPASS")) => Some(
            "the server refused the user name or password, or the user is disabled (WRONGPASS)",
        ),
        (ErrorKind::AuthenticationFailed, _) => {
            Some("the server refused the user name or password, or the user is disabled")
        }
        // Where the redis crate kept only the text of the cause (a cluster's first
        // connections).
        _ => e.detail().and_then(|text| {
            if text.contains("NOAUTH") {
                Some("the server requires a password, and none was given (NOAUTH)")
            } else if text.contains("WRONGPASS") || text.contains("uthentication failed") {
                Some("the server refused the user name or password, or the user is disabled")
            } else {
                None
            }
        }),
    };
    if let Some(cause) = auth {
        return (StoreErrorKind::Authentication, Some(cause.into()));
    }
    // A key set's script refusing a key taken the other way (`counted_wrong` in the scripts):
    // worded as the batched operations' refusal is (`wire.rs` `answer_of`), without the script's name.
    if e.code() == Some("WRONGTYPE")
        && let Some(detail) = e.detail().filter(|d| d.starts_with("tower-lock:"))
    {
        let detail = detail.split(" script:").next().unwrap_or(detail).trim_end();
        return (
            StoreErrorKind::Misused,
            Some(format!("Redis refused the lock operation: WRONGTYPE {detail}").into()),
        );
    }
    // Redis refusing a script's command on a key of another type: a lock key that holds
    // another kind of lease (plain against one with a share), or no lock.
    if e.code() == Some("WRONGTYPE") {
        return (
            StoreErrorKind::Misused,
            Some(
                "a lock key holds another kind of lease, or no lock: every user of a key must \
                 take it the same way"
                    .into(),
            ),
        );
    }
    if e.kind() == ErrorKind::InvalidClientConfig {
        let cause = match e.detail() {
            // The redis crate's details name a setting, never its value.
            Some(detail) => format!("invalid connection settings: {detail}").into(),
            None => "invalid connection settings".into(),
        };
        return (StoreErrorKind::Config, Some(cause));
    }
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Backend
    };
    (kind, None)
}

/// What went wrong with TLS, if `e` is a TLS failure: rustls's error, found in the chain of
/// sources (the redis crate keeps the I/O error of the handshake, which wraps it), or, where
/// the redis crate kept only its text (a cluster's first connections), read from that.
#[cfg(feature = "tls")]
fn tls_cause(e: &RedisError) -> Option<Cow<'static, str>> {
    use std::{error::Error, sync::Arc};

    /// rustls's error in `error`, unwrapping the layers that `source()` passes over (an `Arc`
    /// the redis crate shares its cause in, an `io::Error` that wraps another).
    fn rustls_error<'a>(error: &'a (dyn Error + 'static)) -> Option<&'a rustls::Error> {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(arc) = error.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
            return rustls_error(&**arc);
        }
        let inner = error.downcast_ref::<std::io::Error>()?.get_ref()?;
        rustls_error(inner)
    }

    let mut next: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(error) = next {
        match rustls_error(error) {
            Some(rustls::Error::InvalidCertificate(cert)) => {
                return Some(certificate_cause(&format!("{cert:?}")));
            }
            Some(rustls::Error::AlertReceived(alert)) => {
                return Some(alert_cause(&format!("{alert:?}")));
            }
            Some(
                rustls::Error::InvalidMessage(_)
                | rustls::Error::InappropriateMessage { .. }
                | rustls::Error::InappropriateHandshakeMessage { .. },
            ) => {
                return Some(
                    "the TLS handshake failed (the answer is not TLS: is it a TLS port?)".into(),
                );
            }
            Some(other) => return Some(format!("TLS failed ({other})").into()),
            None => {}
        }
        if error.is::<rustls::pki_types::InvalidDnsNameError>() {
            return Some("the host is not a valid TLS server name".into());
        }
        next = error.source();
    }
    // rustls's `Display` of the two errors that matter most.
    let text = e.detail()?;
    let name = |prefix: &str| {
        let rest = &text[text.find(prefix)? + prefix.len()..];
        Some(
            rest.split(|c: char| !c.is_ascii_alphanumeric())
                .next()?
                .to_owned(),
        )
    };
    if let Some(cert) = name("invalid peer certificate: ") {
        return Some(certificate_cause(&cert));
    }
    name("received fatal alert: ").map(|alert| alert_cause(&alert))
}

/// What is wrong with the server's certificate, by the name of rustls's `CertificateError`.
#[cfg(feature = "tls")]
fn certificate_cause(name: &str) -> Cow<'static, str> {
    match name {
        "UnknownIssuer" | "BadSignature" => "the server's TLS certificate is not signed by a \
                                             trusted CA (is the CA bundle the one that signed it?)"
            .into(),
        n if n.starts_with("NotValidForName") => {
            "the server's TLS certificate is for another host name or address".into()
        }
        n if n.starts_with("Expired") || n.starts_with("NotValidYet") => {
            "the server's TLS certificate has expired or is not valid yet".into()
        }
        other => format!("the server's TLS certificate is invalid ({other})").into(),
    }
}

/// What the server's TLS alert means, by the name of rustls's `AlertDescription`.
#[cfg(feature = "tls")]
fn alert_cause(name: &str) -> Cow<'static, str> {
    match name {
        "CertificateRequired" => {
            "the server requires a client certificate (mutual TLS), and none was given".into()
        }
        "UnknownCA"
        | "BadCertificate"
        | "CertificateUnknown"
        | "CertificateRevoked"
        | "CertificateExpired"
        | "UnsupportedCertificate"
        | "AccessDenied" => "the server refused the client certificate (mutual TLS)".into(),
        other => format!("the server ended the TLS handshake ({other})").into(),
    }
}
