//! Redlock: one lease held on a majority of independent Redis masters.

mod set;

use std::{fmt, sync::Arc, time::Duration};

use futures_util::future::join_all;
use redis::IntoConnectionInfo;
use tokio::time::Instant;

use super::{
    Acquire, Capabilities, LockStore, RedisStore, StoreError, StoreErrorKind, redis::redis_error,
};
use crate::{
    background::{bounded, timeout},
    error::ConfigError,
    key::LockKey,
    store::StoreId,
    token::Token,
};

/// Leases held on a majority of N independent Redis masters: the
/// [Redlock](https://redis.io/docs/latest/develop/clients/patterns/distributed-locks/)
/// algorithm, so that losing a minority of the masters loses no lease and blocks no request.
///
/// Each node is a [`RedisStore`] of its own (its own connection, its own scripts), usually
/// connected with [`connect`](Self::connect):
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_lock::{Key, LockLayer, store::RedlockStore};
///
/// let store = RedlockStore::connect([
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .await?;
/// let layer = LockLayer::new(store, Key::header("idempotency-key")?);
/// # let _ = layer; Ok(()) }
/// ```
///
/// # The algorithm
///
/// - **Acquire** sends the single-node acquire (`SET NX PX` plus a fencing token, one
///   `EVALSHA`) to every node at once, each bounded by the [node timeout](Self::node_timeout)
///   (a tenth of the TTL, at most 500 ms, by default), and succeeds when a quorum of `N / 2 + 1`
///   nodes granted it within the *validity time* `ttl - elapsed - drift`, where the drift
///   allowance is `ttl x 1% + 2 ms` ([`drift`](Self::drift)). Otherwise it releases on every
///   node that granted it or did not answer, at once, and reports the key as held (when enough
///   nodes answered, some of them for another holder: 409 after the wait) or the store as
///   unavailable (too few nodes answered: 503 at once).
/// - **Renew** extends the lease on every node and succeeds when a quorum did so within the
///   validity time. When so many nodes deny it that no quorum is possible the lease is lost;
///   when nodes fail to answer, the renewal is an error, retried while the lease is valid.
/// - **Release** goes to every node.
/// - The [`Lease`](crate::Lease) reports the validity, not the TTL: [`time_left`] counts
///   `ttl - drift` from when the acquire (or renewal) was sent, which is `ttl - elapsed - drift`
///   from when it answered.
///
/// # Fencing tokens: the quorum maximum, not a total order
///
/// Each node hands out its own fencing token, increasing per key on that node
/// (`max(last + 1, that server's time in µs)`). A Redlock lease's
/// [`fencing_token`](crate::Lease::fencing_token) is the **largest token among the nodes of its
/// quorum**. Any two quorums share a node, and on that node the later holder's token is larger
/// than the earlier one's; but the maximum may come from another node. So the quorum maximum is
/// larger than the previous holder's token when the masters' clocks agree to within the time
/// between the two acquisitions (the usual case: tokens are microsecond timestamps), and not
/// otherwise: a master whose clock runs ahead can give an earlier holder a larger maximum.
/// Independent masters cannot agree on a total order; that takes consensus (ZooKeeper's zxid,
/// etcd's revision). Treat it as a best-effort fence that catches a holder stalled for longer
/// than the clock skew, not as a proof of order.
///
/// # Failures and restarts
///
/// - A minority of nodes down: leases are still granted, renewed and released (each call waits
///   at most the node timeout for the dead ones).
/// - A majority down: acquire fails with a [`StoreError`] (503 at once), renewals fail and the
///   lease is lost when it runs out.
/// - **A node restarted without persistence** forgets the leases it held. One such node is
///   harmless: the other members of each quorum still hold them, and each renewal that a
///   quorum grants puts the lease back on the nodes that answered that they do not hold it or
///   whose connection broke (`SET PX` with the holder's token, for what is left of the TTL,
///   over any key a contender's failed attempt left there), within two renewal intervals (two
///   thirds of the TTL) of the node's return: the first renewal after it may still meet the
///   broken connection. Another node restarted after that is harmless too. Two nodes of a
///   quorum restarted empty *together* (the second before the first has a lease back: within
///   two renewal intervals of the first's return, or while it is down) let another client win
///   a quorum while the first holder still holds the key; the
///   first holder hears of it at its next renewal (the renewal cannot reach a quorum: the
///   lease is lost). Redlock's remedy is a *delayed restart*: keep a crashed node out for at
///   least the longest TTL in use (then it returns with nothing to forget), one node at a
///   time, or run the nodes with `appendonly yes` and `appendfsync always`.
/// - Clock jumps on a node (an NTP step, not a slew) shorten its leases beyond the drift
///   allowance; run the nodes with slewed time.
///
/// [`time_left`]: crate::Lease::time_left
#[derive(Clone)]
pub struct RedlockStore {
    nodes: Arc<[RedisStore]>,
    drift_factor: f64,
    drift_fixed: Duration,
    node_timeout: Option<Duration>,
}

impl RedlockStore {
    /// A Redlock store over `nodes`, independent masters (not replicas of one another).
    ///
    /// Use an odd number, 3 or 5: 4 nodes survive no more failures than 3.
    pub fn new(nodes: impl IntoIterator<Item = RedisStore>) -> Result<Self, ConfigError> {
        let nodes: Arc<[RedisStore]> = nodes.into_iter().collect();
        if nodes.is_empty() {
            return Err(ConfigError::new("redlock.nodes", "needs at least one node"));
        }
        Ok(Self {
            nodes,
            drift_factor: 0.01,
            drift_fixed: Duration::from_millis(2),
            node_timeout: None,
        })
    }

    /// Connects to every master at once, each with [`RedisStore::connect`]'s transport.
    ///
    /// Succeeds when a quorum is reachable now; the others are connected at their first use
    /// and reconnect by themselves. A node that answers but refuses the connection for a reason
    /// that time does not fix (its credentials, its TLS certificate, an invalid URL: a
    /// [`StoreError`] of kind `Authentication`, `Tls` or `Config`) fails the whole connect,
    /// quorum or not: it would never take part.
    pub async fn connect<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
    ) -> Result<Self, StoreError> {
        let infos = urls
            .into_iter()
            .map(|url| url.as_ref().into_connection_info().map_err(redis_error))
            .collect::<Result<Vec<_>, _>>()?;
        Self::connect_infos(infos).await
    }

    /// Like [`connect`](Self::connect), over TLS with `tls`'s CA bundle and client certificate
    /// for every node (the `tls` feature); the URLs are `rediss://` URLs.
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
        tls: &super::TlsConfig,
    ) -> Result<Self, StoreError> {
        let infos = urls
            .into_iter()
            .map(|url| tls.connection_info(url))
            .collect::<Result<Vec<_>, _>>()?;
        Self::connect_infos(infos).await
    }

    async fn connect_infos(infos: Vec<redis::ConnectionInfo>) -> Result<Self, StoreError> {
        if infos.is_empty() {
            return Err(StoreError::msg(
                StoreErrorKind::Config,
                "a Redlock store needs at least one Redis URL",
            ));
        }
        let quorum = infos.len() / 2 + 1;
        let connected = join_all(infos.iter().cloned().map(RedisStore::connect_plain)).await;
        let reachable = connected.iter().filter(|c| c.is_ok()).count();
        let mut nodes = Vec::with_capacity(infos.len());
        let mut first_error = None;
        for (info, node) in infos.into_iter().zip(connected) {
            match node {
                Ok(node) => nodes.push(node),
                Err(error) if settled(&error) => return Err(error),
                Err(error) => {
                    nodes.push(RedisStore::connect_lazy(info)?);
                    first_error.get_or_insert(error);
                }
            }
        }
        if reachable < quorum {
            let error = first_error.expect("an unreachable node has an error");
            return Err(StoreError::new(
                error.kind(),
                format!(
                    "only {reachable} of {} Redlock nodes are reachable; a quorum is {quorum}",
                    nodes.len()
                ),
                error,
            ));
        }
        Ok(Self::new(nodes).expect("at least one node"))
    }

    /// The clock drift allowance: `ttl x factor + fixed` (default `ttl x 0.01 + 2 ms`), taken
    /// off every lease's validity. `factor` must be in `0.0..1.0`.
    pub fn drift(mut self, factor: f64, fixed: Duration) -> Result<Self, ConfigError> {
        if !(0.0..1.0).contains(&factor) {
            return Err(ConfigError::new(
                "redlock.drift",
                "the drift factor must be at least 0 and less than 1",
            ));
        }
        crate::config::at_most_a_year("redlock.drift", fixed)?;
        self.drift_factor = factor;
        self.drift_fixed = fixed;
        Ok(self)
    }

    /// How long each node may take to answer one call (default: a tenth of the TTL, between
    /// 10 ms and 500 ms). A node that does not answer in time counts as failed for that call,
    /// so a dead or stalled node costs each call at most this much.
    #[must_use]
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout.max(Duration::from_millis(1)));
        self
    }

    /// How many nodes must agree: `N / 2 + 1`.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The nodes, in the order given.
    pub fn nodes(&self) -> &[RedisStore] {
        &self.nodes
    }

    fn drift_for(&self, ttl: Duration) -> Duration {
        ttl.mul_f64(self.drift_factor) + self.drift_fixed
    }

    fn timeout_for(&self, ttl: Duration) -> Duration {
        self.node_timeout.unwrap_or_else(|| {
            (ttl / 10).clamp(Duration::from_millis(10), Duration::from_millis(500))
        })
    }

    /// What is left of a lease of `ttl` for a call that started at `start`.
    fn validity_since(&self, start: Instant, ttl: Duration) -> Duration {
        ttl.saturating_sub(start.elapsed() + self.drift_for(ttl))
    }

    /// Runs `op` on every node at once, each bounded by the node timeout.
    async fn on_all<'a, T, F, Fut>(&'a self, ttl: Duration, op: F) -> Vec<Result<T, StoreError>>
    where
        F: Fn(&'a RedisStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + 'a,
    {
        let limit = self.timeout_for(ttl);
        join_all(self.nodes.iter().map(|node| bounded(limit, op(node)))).await
    }

    /// Puts a lease that a quorum has just renewed back on the nodes at `indices`, which
    /// answered that they do not hold it (restarted empty, most likely) or whose connection
    /// broke (by the restart, most likely), for what is left of `ttl`: `SET PX`
    /// with the holder's token. So a lease renewed past a restart lives on every node again,
    /// not on a bare quorum for as long as it is held. Failures are left to the next renewal.
    ///
    /// It overwrites another token's key: while a quorum holds this lease, that key can only be
    /// what a contender's failed attempt left (two quorums share a node, and each node of this
    /// one holds this lease); and were it to arrive after this lease ended, it takes one node
    /// from a later holder, whose other nodes still leave no quorum for anyone else. Only
    /// when two nodes lose their data within one renewal (what Redlock's delayed restart
    /// forbids) can it land on a contender's lease that did win a quorum: then the contender,
    /// not the holder, finds no quorum at its next renewal, and the two overlap until then, as
    /// they would the other way round. With
    /// `SET NX`, a contender retrying every few milliseconds kept the lease off the node for
    /// several renewals.
    async fn put_back(&self, indices: &[usize], key: &LockKey, token: &Token, ttl: Duration) {
        if ttl.is_zero() {
            return;
        }
        let limit = self.timeout_for(ttl);
        join_all(indices.iter().map(|&i| {
            let node = &self.nodes[i];
            async move {
                match timeout(limit, node.put_back(key, token, ttl)).await {
                    Ok(Ok(())) => tracing::debug!(
                        node = i,
                        "a Redlock node did not renew a held lease (restarted empty?); put it back"
                    ),
                    Ok(Err(error)) => tracing::debug!(
                        node = i,
                        error = &error as &dyn std::error::Error,
                        "putting a lease back on a Redlock node failed"
                    ),
                    Err(_) => {}
                }
            }
        }))
        .await;
    }

    /// Releases on the nodes at `indices`, at once; failures are left to the TTL.
    async fn release_on(&self, indices: &[usize], key: &LockKey, token: &Token, ttl: Duration) {
        let limit = self.timeout_for(ttl);
        join_all(indices.iter().map(|&i| {
            let node = &self.nodes[i];
            async move {
                let _ = timeout(limit, node.release(key, token)).await;
            }
        }))
        .await;
    }
}

/// Whether a node's connection failed for a reason that waiting does not fix.
fn settled(error: &StoreError) -> bool {
    matches!(
        error.kind(),
        StoreErrorKind::Authentication | StoreErrorKind::Tls | StoreErrorKind::Config
    )
}

/// The first error, wrapped in one that says how many nodes answered.
fn no_quorum(errors: Vec<StoreError>, answered: usize, nodes: usize, quorum: usize) -> StoreError {
    let message = format!(
        "the Redlock store reached no quorum: {answered} of {nodes} nodes answered, {quorum} needed"
    );
    match errors.into_iter().next() {
        Some(first) => StoreError::new(first.kind(), message, first),
        None => StoreError::msg(StoreErrorKind::Unavailable, message),
    }
}

fn too_slow(ttl: Duration) -> StoreError {
    StoreError::msg(
        StoreErrorKind::Timeout,
        format!(
            "the Redlock quorum answered after the lease's validity ({ttl:?} less drift) ran out"
        ),
    )
}

impl LockStore for RedlockStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        let start = Instant::now();
        let answers = self.on_all(ttl, |node| node.acquire(key, token, ttl)).await;
        let validity = self.validity_since(start, ttl);
        let (mut fences, mut held, mut errors, mut undo) = (vec![], vec![], vec![], vec![]);
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(Acquire::Acquired { fencing_token }) => {
                    fences.push(fencing_token);
                    undo.push(i);
                }
                Ok(Acquire::Contended { expires_in }) => {
                    held.push(expires_in);
                }
                // A timed-out or failed call may still have set the key.
                Err(error) => {
                    errors.push(error);
                    undo.push(i);
                }
            }
        }
        let quorum = self.quorum();
        if fences.len() >= quorum && !validity.is_zero() {
            let fencing_token = fences.into_iter().max().unwrap_or(0);
            return Ok(Acquire::Acquired { fencing_token });
        }
        self.release_on(&undo, key, token, ttl).await;
        if fences.len() >= quorum {
            return Err(too_slow(ttl));
        }
        if !held.is_empty() && fences.len() + held.len() >= quorum {
            // Enough nodes answered, and some of them for another holder: contention.
            let expires_in = held.into_iter().flatten().max();
            return Ok(Acquire::Contended { expires_in });
        }
        let answered = fences.len() + held.len();
        Err(no_quorum(errors, answered, self.nodes.len(), quorum))
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        let start = Instant::now();
        let answers = self.on_all(ttl, |node| node.renew(key, token, ttl)).await;
        // Not held there, or the connection broke (a restart): put back. A node that did not
        // answer in time is not waited for twice.
        let missing: Vec<usize> = (answers.iter().enumerate())
            .filter_map(|(i, answer)| match answer {
                Ok(false) => Some(i),
                Err(error) if error.kind() == StoreErrorKind::Unavailable => Some(i),
                _ => None,
            })
            .collect();
        let renewed = self.renewal_quorum(answers, start, ttl)?;
        if renewed && !missing.is_empty() {
            self.put_back(&missing, key, token, ttl.saturating_sub(start.elapsed()))
                .await;
        }
        Ok(renewed)
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        // Releases are bounded by the node timeout of a 10 s lease (500 ms at most), and by the
        // caller's store timeout.
        let answers = self
            .on_all(Duration::from_secs(10), |node| node.release(key, token))
            .await;
        let (mut released, mut errors) = (false, vec![]);
        for answer in answers {
            match answer {
                Ok(deleted) => released |= deleted,
                Err(error) => errors.push(error),
            }
        }
        if released || errors.is_empty() {
            return Ok(released);
        }
        let answered = self.nodes.len() - errors.len();
        Err(no_quorum(errors, answered, self.nodes.len(), self.quorum()))
    }

    fn validity(&self, ttl: Duration) -> Duration {
        ttl.saturating_sub(self.drift_for(ttl))
    }

    /// Group commit, on each node: the calls of many requests that reach a node together go
    /// to it in one script call (each node is a [`RedisStore`]). Key sets: the set in one
    /// script per node, and a quorum on the set.
    fn capabilities(&self) -> Capabilities {
        let this = Arc::new(self.clone());
        Capabilities {
            group_commit: true,
            key_sets: Some(this),
            identity: Some(StoreId::of(&self.nodes)),
            ..Capabilities::none()
        }
    }
}

impl RedlockStore {
    /// A renewal's answer from the nodes' answers: renewed on a quorum within the validity
    /// time; lost when so many nodes deny it that no quorum can renew it; else an error (too
    /// few nodes answered), retried while the lease is valid.
    fn renewal_quorum(
        &self,
        answers: Vec<Result<bool, StoreError>>,
        start: Instant,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let validity = self.validity_since(start, ttl);
        let (mut renewed, mut denied, mut errors) = (0, 0, vec![]);
        for answer in answers {
            match answer {
                Ok(true) => renewed += 1,
                Ok(false) => denied += 1,
                Err(error) => errors.push(error),
            }
        }
        let quorum = self.quorum();
        if renewed >= quorum {
            return if validity.is_zero() {
                Err(too_slow(ttl))
            } else {
                Ok(true)
            };
        }
        if denied > self.nodes.len() - quorum {
            // No quorum can renew it any more: the lease is gone.
            return Ok(false);
        }
        Err(no_quorum(
            errors,
            renewed + denied,
            self.nodes.len(),
            quorum,
        ))
    }
}

impl fmt::Debug for RedlockStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockStore")
            .field("nodes", &self.nodes)
            .field("quorum", &self.quorum())
            .field("drift_factor", &self.drift_factor)
            .field("drift_fixed", &self.drift_fixed)
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(n: usize) -> RedlockStore {
        let nodes = (0..n)
            .map(|i| RedisStore::connect_lazy(format!("redis://127.0.0.1:{}/", 1 + i)).unwrap());
        RedlockStore::new(nodes.collect::<Vec<_>>()).unwrap()
    }

    #[tokio::test]
    async fn quorum_validity_and_config() {
        assert_eq!(store(1).quorum(), 1);
        assert_eq!(store(3).quorum(), 2);
        assert_eq!(store(4).quorum(), 3);
        assert_eq!(store(5).quorum(), 3);
        let s = store(3);
        let ttl = Duration::from_secs(10);
        assert_eq!(LockStore::validity(&s, ttl), Duration::from_millis(9898));
        assert_eq!(s.timeout_for(ttl), Duration::from_millis(500));
        assert_eq!(
            s.timeout_for(Duration::from_millis(300)),
            Duration::from_millis(30)
        );
        assert_eq!(
            s.timeout_for(Duration::from_millis(50)),
            Duration::from_millis(10)
        );
        assert!(RedlockStore::new(Vec::new()).is_err());
        assert!(store(3).drift(1.0, Duration::ZERO).is_err());
        assert!(store(3).drift(f64::NAN, Duration::ZERO).is_err());
        let s = store(3).drift(0.0, Duration::ZERO).unwrap();
        assert_eq!(LockStore::validity(&s, ttl), ttl);
    }
}
