//! Where records live: next to the locks, in the same store.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;

use crate::{
    key::LockKey,
    store::{BoxFuture, LockStore, StoreError},
    token::Token,
};

/// Suffix of a record's key, next to its lock key.
const RECORD_SUFFIX: &[u8] = b":record";

/// The key of the record kept for `lock`: `<lock key>:record`.
///
/// It starts with the whole lock key, so it shares the lock key's Redis Cluster hash tag (and
/// slot), and a script can touch both.
pub fn record_key(lock: &LockKey) -> Vec<u8> {
    let mut key = Vec::with_capacity(lock.as_bytes().len() + RECORD_SUFFIX.len());
    key.extend_from_slice(lock.as_bytes());
    key.extend_from_slice(RECORD_SUFFIX);
    key
}

/// A [`LockStore`] that also keeps idempotency records.
///
/// Records are opaque bytes (the layer encodes them). Both operations must be atomic:
///
/// - `lookup`: the record stored for `key` (at [`record_key`]), if it has not expired.
/// - `complete`: **if `key` holds `token`**, store `record` for `retention` and delete `key`, as
///   one step, and return `true`; otherwise change nothing and return `false`. No other request
///   may ever see the lock gone and the record missing, or it would run the handler again.
///
/// Implemented for [`MemoryStore`](crate::MemoryStore) and [`RedisStore`](crate::RedisStore)
/// (one Lua script). Implementations write `async fn`; the futures must be `Send`.
pub trait IdempotencyStore: LockStore {
    /// The record stored for `key`.
    fn lookup(
        &self,
        key: &LockKey,
    ) -> impl Future<Output = Result<Option<Bytes>, StoreError>> + Send;

    /// Stores `record` for `retention` and releases `key`, if `key` holds `token`.
    fn complete(
        &self,
        key: &LockKey,
        token: &Token,
        record: Bytes,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// The object-safe form the layer holds.
pub(crate) trait DynRecords: Send + Sync + 'static {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>>;
    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<bool, StoreError>>;
}

impl<S: IdempotencyStore> DynRecords for S {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        Box::pin(async move { IdempotencyStore::lookup(&*self, &key).await })
    }

    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move {
            IdempotencyStore::complete(&*self, &key, &token, record, retention).await
        })
    }
}
