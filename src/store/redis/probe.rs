//! What connecting asks the server besides the lock operations: its eviction policy (`INFO
//! memory`, [`RedisStore::eviction`]) and whether it hashes keys to slots (`INFO cluster`).

use redis::{ErrorKind, Value};

use super::{EVICTION_CHECK_TIMEOUT, RedisStore, Request, info_text, redis_error};
use crate::store::{
    StoreError, StoreErrorKind,
    eviction::{Eviction, ServerEviction},
};

impl RedisStore {
    /// Asks the server now for its eviction policy (`maxmemory-policy`, from `INFO memory`):
    /// whether Redis may delete held leases and idempotency records before they expire when it
    /// runs short of memory. Anything but [`Eviction::Never`] risks two holders at once (an
    /// evicted lease) and handlers run twice (an evicted record); see [`Eviction`].
    ///
    /// [`connect`](Self::connect) asks once and logs a warning; stores built from your own
    /// connection, manager or pool are not asked unless you call this. A server that refuses
    /// `INFO` answers [`Eviction::Unknown`]; the error is for a server that cannot be reached.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::{RedisStore, store::Eviction};
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1/").await?;
    /// if let Eviction::Possible { policy, .. } = store.eviction().await? {
    ///     return Err(format!("Redis may evict held locks (maxmemory-policy {policy})").into());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn eviction(&self) -> Result<Eviction, StoreError> {
        let servers = self.evictions().await?;
        Ok(Eviction::riskiest(servers.into_iter().map(|s| s.eviction)))
    }

    /// `INFO memory`, read: one answer for the server of a plain connection, one per master
    /// (with its address) on a cluster.
    pub(crate) async fn evictions(&self) -> Result<Vec<ServerEviction>, StoreError> {
        let mut info = redis::cmd("INFO");
        info.arg("memory");
        Ok(match self.query(Request::Cmd(&info)).await? {
            // A cluster: each master's answer (or refusal) under its address.
            Ok(Value::Map(servers)) => servers
                .into_iter()
                .map(|(addr, answer)| {
                    let addr = redis::from_redis_value::<String>(addr).ok();
                    match answer {
                        Value::ServerError(_) => ServerEviction {
                            addr,
                            eviction: Eviction::Unknown,
                            maxmemory: None,
                        },
                        answer => ServerEviction::from_info(addr, &info_text(answer)),
                    }
                })
                .collect(),
            Ok(answer) => vec![ServerEviction::from_info(None, &info_text(answer))],
            // Refused for want of credentials: the store cannot work at all.
            Err(e) if redis_error(e.clone()).kind() == StoreErrorKind::Authentication => {
                return Err(redis_error(e));
            }
            // Refused (an ACL without `+info`, a proxy that filters it): unknown.
            Err(e) if e.kind() != ErrorKind::Io && !e.is_timeout() => vec![ServerEviction {
                addr: None,
                eviction: Eviction::Unknown,
                maxmemory: None,
            }],
            Err(e) => return Err(redis_error(e)),
        })
    }

    /// Reads the eviction policy of the server(s) and logs a warning for each that may evict;
    /// gives up after a second (a server that does not answer is logged at debug), so that
    /// connecting takes at most that much longer. Fails only when the server refuses for want
    /// of credentials (`NOAUTH`: a connection made without a password succeeds, and nothing
    /// is sent before the first command), which would fail every request.
    pub(crate) async fn check_eviction(&self) -> Result<(), StoreError> {
        let addr = self
            .client
            .as_ref()
            .map(|c| c.get_connection_info().addr().to_string());
        let asked = crate::background::bounded(EVICTION_CHECK_TIMEOUT, self.evictions()).await;
        match asked {
            Ok(servers) => {
                for server in servers {
                    server.log(addr.as_deref());
                }
            }
            Err(error) if error.kind() == StoreErrorKind::Authentication => {
                return Err(error);
            }
            Err(error) => tracing::debug!(
                server = addr.as_deref().unwrap_or("?"),
                error = &error as &dyn std::error::Error,
                "could not ask the Redis server for its maxmemory-policy"
            ),
        }
        Ok(())
    }

    /// Asks the server whether it hashes keys to slots (`cluster_enabled:1` in `INFO cluster`: a
    /// cluster-mode server behind a plain connection), so that the first batch is sent one
    /// script per slot with each slot's fencing counter rather than refused as `CROSSSLOT`. A
    /// server that does not answer within a second is found out by its first refusal instead.
    pub(crate) async fn check_slots(&self) {
        let mut info = redis::cmd("INFO");
        info.arg("cluster");
        let asked =
            crate::background::timeout(EVICTION_CHECK_TIMEOUT, self.query(Request::Cmd(&info)))
                .await;
        if let Ok(Ok(Ok(answer))) = asked
            && info_text(answer)
                .lines()
                .any(|line| line.trim() == "cluster_enabled:1")
        {
            self.slot_bound
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
