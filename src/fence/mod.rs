//! Fenced writes: the data behind a lock, written only by its newest holder.
//!
//! A lease can always be lost while its holder still runs: a stop-the-world pause, a stalled
//! runtime, a partition longer than the TTL. Then a second holder takes the key, and the first
//! one's writes, when it resumes, would land on top of the second's. Every lease carries a
//! *fencing token* per key, strictly increasing per key ([`Lease::fencing_token`]); a write
//! that carries it can be refused by the data when a newer holder has been there. This module
//! makes that the easy way to write the data kept next to the lock, in Redis or in memory.
//!
//! ```no_run
//! # #[cfg(feature = "axum")] {
//! use axum::{Json, Router, extract::{Path, State}, routing::post};
//! use tower_lock::{Key, Lease, LockLayer, RedisStore, fence::{FenceError, FencedData, data_key}};
//!
//! async fn purchase(
//!     State(data): State<FencedData>,
//!     lease: Lease,
//!     Path(sku): Path<String>,
//! ) -> Result<Json<u64>, FenceError> {
//!     // The stock lives in the lock key's hash slot, under the lease's token for that key.
//!     let stock = data_key("stock:", lease.key());
//!     let read = data.batch(&lease).get(&stock).apply().await?;
//!     let left = read
//!         .data(0)
//!         .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
//!         .unwrap_or(0)
//!         .saturating_sub(1);
//!     // ... take the payment ...
//!     // Refused (409, nothing written) if a newer holder of this SKU read or wrote it since.
//!     data.batch(&lease)
//!         .set(&stock, left.to_string())
//!         .rpush("journal", format!("{sku} sold, {left} left"))
//!         .apply()
//!         .await?;
//!     Ok(Json(left))
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1/").await?;
//! // The data may live on another server: connect a store to it and use that here.
//! let data = FencedData::new(store.clone());
//! let app: Router = Router::new()
//!     .route("/items/{sku}/purchase", post(purchase))
//!     .route_layer(LockLayer::new(store, Key::path_param("sku")))
//!     .with_state(data);
//! # let _ = app; Ok(()) }
//! # }
//! ```
//!
//! # What a fence checks
//!
//! Each resource (a lock key of the lease) has a *fence* next to the data: the highest
//! fencing token that touched it through this module, kept under `<prefix>{<tag>}data-fence:<rest of the lock key>` (in the lock key's slot, and no
//! key a client can spell as a lock key). A
//! [`Batch`] (reads and writes) fenced by a lease is applied, in one atomic step, only if the
//! lease's token for each of its resources is at least that resource's fence; then each fence
//! is raised to the token. Otherwise nothing is applied and the batch fails with
//! [`FenceError::Stale`].
//!
//! Reads raise the fence too (when the resource has one, or the read found a value): a
//! read-modify-write is only safe if a holder that read *before* a newer holder cannot write
//! *after* it. A batch that only reads what does not exist leaves nothing behind, so that
//! requests naming resources that do not exist add no keys. Tokens only ever grow, so a stale
//! holder stays refused for good, whatever it retries (and after its resource's fence has
//! expired too: see [Fences expire](#fences-expire)).
//!
//! A batch's keys are data. One that names the lock's own keys (a lock key, its hand-off
//! queue, idempotency record or fence, a fencing counter of its prefix) is refused with
//! [`FenceError::Invalid`] before it is sent: written, it would clobber a lease (a lock key set
//! without a TTL stays locked for good), lower a fence, or send tokens back. [`data_key`] names
//! keys outside them, unless its `name` is the lock keys' prefix. A counter that `incr_by` would
//! not read as `INCRBY` does (a sign but `-`, a leading zero, `-0`, beyond `i64`) is refused the
//! same way, before anything is written.
//!
//! # Fences expire
//!
//! A fence is not kept forever: a service that fences a million resources a day would keep a
//! million more keys a day, for good. A fence expires a *horizon* after the last batch that
//! touched it ([`FencedData::horizon`], 24 h by default, the idempotency records' default
//! retention; one second more for the store's expiry to run late), and never before the
//! longest-lived value a batch set with [`Batch::set_with_ttl`]: no value outlives its fence.
//!
//! What keeps that safe: a token also says when it was issued (it follows the lock server's
//! clock, in µs; see "Tokens across restarts and failovers" below), and a batch on a resource
//! **without** a fence refuses, as [`FenceError::Stale`], any token older than now less the
//! horizon. A fence that expired was last raised a horizon ago or more, by a token issued
//! before that; every token below it is older still, so it stays refused. So:
//!
//! | the holder | its batch |
//! |---|---|
//! | holds the newest token; its resource has a fence | applied (the fence is at most its token) |
//! | stale (a newer holder touched the resource), fence still there | refused: below the fence |
//! | stale, paused past the horizon, fence expired | refused: older than the horizon |
//! | holds a lease longer than the horizon, and nobody touched its resource for a whole horizon | refused: older than the horizon (write at least once a horizon, or raise it) |
//!
//! A stale holder is never applied, whichever way it comes back. The price is the last row: a
//! lease held for longer than the horizon whose resource went untouched that long is refused
//! as if it were stale, so keep the horizon above the longest a lease is held between two
//! batches on one resource. Every instance that writes the data must use the same horizon
//! (like the key prefix): one with a longer horizon than the instance that raised a fence
//! admits, once that fence expired, tokens up to the difference older than the rule allows.
//!
//! The rule assumes the clocks of the servers that issue tokens and keep the data agree to
//! within the second of slack (they are one server in most deployments). In memory
//! ([`FencedData::in_memory`]) the rule is exact rather than clock-bound: a resource without a
//! fence refuses any token below the highest of the fences that have expired in the process.
//!
//! A fence written by an earlier version of this crate, without an expiry, gets one the first
//! time a batch touches it; `CHANGELOG.md` shows how to give the others one at once.
//!
//! Fencing orders the writes; it does not make a lost lease exclusive again. A holder whose
//! lease ran out, with no newer holder yet, still writes (its token is still the highest): from
//! the data's point of view its work came first, and the next holder reads its result.
//!
//! A fence admits one holder at a time: it is for exclusive leases (a plain lease, or a writer
//! of a key that readers share). Holders that run together by design (permits, readers of a
//! shared lease) each have a token of their own, and each batch raises the fence to its token,
//! so once a newer one has read or written, an older one's next batch is refused as
//! [`FenceError::Stale`] though its lease is held. Fence what writers change; readers of a
//! shared lease read the data directly.
//!
//! # The answer tells the truth
//!
//! A handler must answer from what the data did: 200 only when its writes were applied; 409
//! ([`FenceError::Stale`], `?` in a handler) when they were refused, and nothing was written;
//! 503 ([`FenceError::Store`]) when the store did not answer, and the write may or may not
//! have landed.
//!
//! The layers keep to the same rule. By default ([`OnLeaseLost::Abort`](crate::config::OnLeaseLost))
//! a handler whose lease is lost is stopped and answered 503 `#lease-lost`; that is only true
//! while the handler has written nothing. So **once a handler has sent a fenced batch that
//! writes, a lost lease no longer stops it**: it runs to its end, its later batches are checked
//! by the fence like the first, and its own answer (200, 409 or 503) goes to the client. Until
//! then (fenced reads included: they change nothing a client sees) a lost lease stops it as
//! before, and the 503 is true: nothing was written. The same holds for
//! [`Locker::run`](crate::Locker::run), whose work is not dropped after its first fenced write.
//! [`Lease::has_fenced_writes`] tells whether one was sent. Writes made some other way (an
//! unfenced batch, another database) are not seen: a handler that makes them gets the old rule.
//!
//! With the [`IdempotencyLayer`](crate::IdempotencyLayer), the record of a response finished
//! after its lease was lost is still stored, so that a retry replays it rather than running
//! the handler again, unless a newer request holds the key or has stored its own record: a
//! record is fenced by the lease's token too, and never replaces a newer one.
//!
//! # Keys, slots and topologies
//!
//! A batch is one Lua script in Redis (one critical section in memory), so it is atomic
//! wherever one script can reach all of its keys:
//!
//! | data kept in | atomic | |
//! |---|---|---|
//! | one Redis server ([`RedisStore`](crate::RedisStore)) | yes | any keys |
//! | the master of a Sentinel set (`SentinelStore`) | yes | a batch is not sent again after a failover, since it may have landed |
//! | a Redis Cluster (`ClusterStore`) | within one hash slot | every key of a batch in one slot: name data keys with [`data_key`]; resources of other slots go in batches of their own |
//! | Redlock's independent masters | no | no step is atomic across them; not a [`FencedStore`]: keep the data on one Redis (or a Sentinel or cluster) and fence it with the Redlock lease's tokens |
//! | this process ([`FencedData::in_memory`]) | yes | one instance only |
//!
//! On a cluster, a batch whose keys are in several slots fails with [`FenceError::Invalid`]
//! before it is sent. The redis crate's cluster client sends a command again when its reply
//! was lost on a broken connection: a batch may then run twice, which is harmless for `set`,
//! `hset` and `del`, but counts an `incr_by` or an `rpush` twice.
//!
//! With [`RedisStore::wait_for_replicas`](crate::RedisStore::wait_for_replicas), every fenced
//! batch waits for the replicas, reads included: a read may raise a fence, and a fence that a
//! failover loses lets an older holder write between a newer holder's read and its write.
//!
//! # Tokens across restarts and failovers
//!
//! A token is `max(last + 1, the lock server's clock in µs)`. A lock Redis restarted without
//! persistence forgets `last`, but its clock goes on: tokens stay above every fence the data
//! holds, unless the clock stepped back (or tokens were handed out faster than one per
//! microsecond just before). After a failover to a server whose clock lags, before the counter
//! was replicated, tokens can be below a fence for up to that lag; so can a Redlock lease's
//! (the largest of its quorum's: [`RedlockStore`](crate::store::RedlockStore)) when the masters'
//! clocks disagree. Then the *newer* holder is refused (409) until its tokens pass the fence:
//! a fence never lets a lower token write after a higher one, whoever holds the lock.
//!
//! A batch on a lease of several keys ([`FencedData::batch`]) is guarded by every key's own
//! token: the resource a token guards is always its lock key. For a batch that touches some of
//! them, [`FencedData::batch_on`] names the keys.
//!
//! # SQL databases
//!
//! A SQL row is fenced the same way, in the statement that writes it: keep the token that last
//! wrote the row in a column, and write only when yours is not lower.
//!
//! ```sql
//! UPDATE items SET stock = stock - 1, fence = $token
//!  WHERE sku = $sku AND fence <= $token AND stock > 0;
//! -- 1 row: applied. 0 rows: out of stock, or a newer holder wrote the row (read `fence` to
//! -- tell which): answer 409, not 200.
//! ```
//!
//! A read that a later write depends on fences the row too (`UPDATE items SET fence = $token
//! WHERE sku = $sku AND fence <= $token RETURNING stock`), or the write compares what it read.
//! An insert-once write (a payment per idempotency key) needs no column: a unique constraint
//! on the key refuses the second. `examples/sql.rs` runs both against SQLite.
//!
//! [`Lease::fencing_token`]: crate::Lease::fencing_token
//! [`Lease::has_fenced_writes`]: crate::Lease::has_fenced_writes

mod batch;
mod data;
mod error;
mod memory;

use bytes::Bytes;

pub use self::batch::{Batch, Replies};
pub use self::data::{FencedData, FencedStore};
pub use self::error::FenceError;
use crate::key::LockKey;
pub use crate::store::fenced::Reply;

/// Role of a resource's fence key, after the lock key's hash tag (as the store's companion keys
/// put theirs: see `store/redis/keys.rs`).
const FENCE_ROLE: &[u8] = b"data-fence:";

/// The key of `resource`'s fence: `<prefix>{<tag>}data-fence:<rest of the lock key>`, in the
/// lock key's hash slot. A lock key goes on after its tag with a digit (its scope's length), so
/// no lock key a client can spell is a fence, and no fence is another resource's.
pub(crate) fn fence_key(resource: &LockKey) -> Bytes {
    let bytes = resource.as_bytes();
    let (head, rest) = bytes.split_at(resource.prefix().len() + resource.hash_tag().len());
    Bytes::from([head, FENCE_ROLE, rest].concat())
}

/// Whether `key` is one of the crate's own keys under `resource`'s prefix: a lock key, one of
/// its companions (`<prefix>{<tag>}…`: queue, idempotency record, fence) or a fencing counter
/// (`<prefix>fence`, `<prefix>fence:{<tag>}`). A fenced batch that wrote one could clobber a
/// lease (a lock key set without a TTL stays locked for good), lower a fence, or send tokens
/// backwards; none is data.
pub(crate) fn is_lock_namespace(key: &[u8], resource: &LockKey) -> bool {
    let Some(rest) = key.strip_prefix(resource.prefix()) else {
        return false;
    };
    if rest == b"fence" || rest.starts_with(b"fence:{") {
        return true;
    }
    let Some(tagged) = rest.strip_prefix(b"{") else {
        return false;
    };
    tagged
        .iter()
        .position(|&b| b == b'}')
        .is_some_and(|end| end > 0 && tagged[..end].iter().all(u8::is_ascii_digit))
}

/// A data key for `resource`, in its hash slot: `name` followed by the lock key without its
/// prefix (`<name>{<tag>}<scope length>:<scope>:<digest>`: the resource's digest, never its value),
/// so one name gives each resource a key
/// of its own.
///
/// The key holds `resource`'s scope, so one resource gives one data key only where its locks
/// share a scope. A [`LockLayer`](crate::LockLayer) scopes a key by the resource its source names
/// (see [`key`](crate::key#scoping)): `Key::path_param("id")` on `POST /accounts/{id}` and on
/// `POST /accounts/{id}/withdraw` gives both `/accounts/{id}`, one balance per account. Keys of
/// one resource from two kinds of source (the path on one route, a JSON field or a header on
/// another) differ unless their layers share a [`namespace`](crate::LockLayer::namespace)
/// (`.namespace("account")`), which is also what the [`Locker::key`](crate::Locker::key) calls of
/// work outside requests must name (`locker.key("account", id)`) to reach the same data.
///
/// On a cluster every key of a batch must share one hash slot; keys made here share the slot
/// of `resource`'s lock key and fence. `name` must not contain `{` or `}` (the hash tag must
/// be the key's first): such a key lands in another slot, and a batch on a cluster refuses it.
/// On one server or in memory any key will do; this one is still unique per resource.
/// `name` must not be the lock keys' prefix either: the key would be the lock key itself,
/// which a fenced batch refuses to touch (the crate's own keys are not data).
///
/// ```
/// use tower_lock::{Locker, MemoryStore, fence::data_key};
///
/// let locker = Locker::new(MemoryStore::new());
/// let apple = locker.key("sku", "apple")?;
/// let key = data_key("stock:", &apple);
/// assert!(key.starts_with(b"stock:{"));
/// assert!(key.ends_with(b"3:sku:3a7bd3e2360a3d29eea436fcfb7e44c7")); // apple's digest
/// # Ok::<(), tower_lock::key::KeyRejection>(())
/// ```
pub fn data_key(name: &str, resource: &LockKey) -> Vec<u8> {
    let unprefixed = &resource.as_bytes()[resource.prefix().len()..];
    [name.as_bytes(), unprefixed].concat()
}

#[cfg(test)]
mod tests;
