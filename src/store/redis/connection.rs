//! The store's transport: one multiplexed connection (by default), a bb8 pool, or a cluster
//! connection; and how Redis's errors become store errors.

use bb8_redis::{RedisConnectionManager, bb8};
use redis::{
    Cmd, ErrorKind, Pipeline, RedisError, Script, ServerErrorKind, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
};
use std::time::Duration;

use super::RedisStore;
use crate::store::{StoreError, StoreErrorKind};

#[derive(Clone)]
pub(super) enum Transport {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Pool(bb8::Pool<RedisConnectionManager>),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Transport {
    /// See [`RedisStore::query`].
    pub(super) async fn query(
        &self,
        request: Request<'_>,
    ) -> Result<Result<Value, RedisError>, StoreError> {
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
    let kind = if e.kind() == ErrorKind::Server(ServerErrorKind::TryAgain) {
        // Refused unrun, during a slot migration: see `StoreErrorKind::TryAgain`. Redis's other
        // "not now" answers (`LOADING`, `CLUSTERDOWN`, `MASTERDOWN`) mean an outage: 503 at once.
        StoreErrorKind::TryAgain
    } else if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Backend
    };
    let message = match kind {
        StoreErrorKind::TryAgain => "the Redis lock store asked to try again (a slot in migration)",
        _ => "the Redis lock store failed",
    };
    StoreError::new(kind, message, e)
}
