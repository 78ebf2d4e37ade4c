//! What a Redis server may evict: its `maxmemory-policy`, read from `INFO memory`.

/// What a Redis server does with keys when it reaches its memory limit: its `maxmemory-policy`,
/// as `INFO memory` reports it (which works where `CONFIG` is disabled, as on most managed
/// services).
///
/// Lock keys, hand-off queues, fencing counters and idempotency records all carry a TTL. Under
/// any policy but `noeviction`, Redis may delete them before they expire when it runs short of
/// memory: a held lease (another client then takes the key while its holder still runs: two
/// holders at once), or an idempotency record (a retry then runs the handler again). The
/// `volatile-*` policies evict them too, since they pick among keys with a TTL. Run the servers
/// that hold locks with `maxmemory-policy noeviction`; see `docs/TOPOLOGY.md`, "Eviction".
///
/// The stores that connect by themselves read it once when they connect and log a warning for
/// a server that may evict; [`RedisStore::eviction`](super::RedisStore::eviction) (and its
/// counterparts on the other stores) asks again.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Eviction {
    /// `noeviction`: at its memory limit Redis refuses writes (an acquire then fails: 503) and
    /// never deletes a key before it expires.
    Never,
    /// Any other policy: Redis may evict lock keys and idempotency records at its memory limit.
    /// With `maxmemory 0` (no limit, the default outside managed services) nothing is evicted
    /// until a limit is set, which `CONFIG SET maxmemory` does at run time.
    #[non_exhaustive]
    Possible {
        /// The policy, as Redis names it (`allkeys-lru`, `volatile-ttl`, ...).
        policy: String,
    },
    /// The server did not say: it refused `INFO` (a user without `+info`), or its answer had no
    /// `maxmemory_policy`.
    Unknown,
}

impl Eviction {
    /// Reads `maxmemory_policy` from the text of `INFO memory`.
    pub(crate) fn from_info(info: &str) -> Self {
        match field(info, "maxmemory_policy") {
            Some("noeviction") => Self::Never,
            Some(policy) if !policy.is_empty() => Self::Possible {
                policy: policy.to_owned(),
            },
            _ => Self::Unknown,
        }
    }

    /// The riskiest of several servers' answers: `Possible` before `Unknown` before `Never`
    /// (`Never` for none).
    pub(crate) fn riskiest(all: impl IntoIterator<Item = Self>) -> Self {
        all.into_iter()
            .max_by_key(|e| match e {
                Self::Never => 0,
                Self::Unknown => 1,
                Self::Possible { .. } => 2,
            })
            .unwrap_or(Self::Never)
    }
}

/// One server's answer to `INFO memory`: the address it was read from (on a cluster, each
/// master's; `None` for the one server of a plain connection) and what it said.
#[derive(Debug)]
pub(crate) struct ServerEviction {
    pub(crate) addr: Option<String>,
    pub(crate) eviction: Eviction,
    /// `maxmemory` in bytes (0: no limit), when reported.
    pub(crate) maxmemory: Option<u64>,
}

impl ServerEviction {
    pub(crate) fn from_info(addr: Option<String>, info: &str) -> Self {
        Self {
            addr,
            eviction: Eviction::from_info(info),
            maxmemory: field(info, "maxmemory").and_then(|v| v.parse().ok()),
        }
    }

    /// Logs a warning for a server that may evict (a debug line for one that did not say).
    /// `fallback` names the server when the answer does not (a plain connection's address).
    pub(crate) fn log(&self, fallback: Option<&str>) {
        let server = self.addr.as_deref().or(fallback).unwrap_or("?");
        match &self.eviction {
            Eviction::Possible { policy } => tracing::warn!(
                server = %server,
                maxmemory_policy = %policy,
                maxmemory = self.maxmemory,
                "this Redis server may evict lock keys and idempotency records under memory \
                 pressure (maxmemory-policy is not noeviction): an evicted lease lets a second \
                 holder in, an evicted record runs a handler twice; set maxmemory-policy \
                 noeviction (see docs/TOPOLOGY.md, Eviction)"
            ),
            Eviction::Unknown => tracing::debug!(
                server = %server,
                "this Redis server did not report its maxmemory-policy (INFO refused?); \
                 eviction risk unknown"
            ),
            Eviction::Never => {}
        }
    }
}

/// The value of `name:value` in an `INFO` text.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_from_info_memory() {
        let info =
            |policy: &str| format!("# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:{policy}\r\n");
        assert_eq!(Eviction::from_info(&info("noeviction")), Eviction::Never);
        for policy in [
            "allkeys-lru",
            "volatile-lru",
            "volatile-ttl",
            "allkeys-random",
        ] {
            assert_eq!(
                Eviction::from_info(&info(policy)),
                Eviction::Possible {
                    policy: policy.to_owned()
                }
            );
        }
        assert_eq!(Eviction::from_info("garbage"), Eviction::Unknown);
        assert_eq!(
            Eviction::from_info("maxmemory_policy:\r\n"),
            Eviction::Unknown
        );
        // `maxmemory_human` and `maxmemory_policy` share a prefix with `maxmemory`.
        let server = ServerEviction::from_info(
            None,
            "maxmemory_human:1.00M\r\nmaxmemory:1048576\r\nmaxmemory_policy:noeviction\r\n",
        );
        assert_eq!(server.maxmemory, Some(1 << 20));
        assert_eq!(server.eviction, Eviction::Never);
    }

    #[test]
    fn the_riskiest_answer_wins() {
        let possible = Eviction::Possible {
            policy: "volatile-lru".to_owned(),
        };
        assert_eq!(Eviction::riskiest([]), Eviction::Never);
        assert_eq!(
            Eviction::riskiest([Eviction::Never, Eviction::Unknown]),
            Eviction::Unknown
        );
        assert_eq!(
            Eviction::riskiest([Eviction::Never, possible.clone(), Eviction::Unknown]),
            possible
        );
    }
}
