//! Idempotency records in Redis, next to the locks, written by the same script that releases
//! the lock.

use std::{
    sync::{Arc, LazyLock},
    time::Duration,
};

use bytes::Bytes;
use redis::Script;

use super::{RedisStore, commit::Op, keys::record_key, scripts::lua};
use crate::{
    key::LockKey,
    store::{BoxFuture, Records, StoreError},
    token::Token,
};

/// Built once: `redis::Script` hashes its source, and the store reloads it on `NOSCRIPT`. A
/// record is written with the release, by the batch script (`Op::Complete`).
static LOOKUP: LazyLock<Script> = LazyLock::new(|| Script::new(lua("record_lookup")));

impl RedisStore {
    async fn lookup_now(&self, key: &LockKey) -> Result<Option<Bytes>, StoreError> {
        let (record, _): (Option<Vec<u8>>, _) = self
            .invoke(&LOOKUP, &[&record_key(key)], &[], false)
            .await?;
        Ok(record.map(Bytes::from))
    }

    async fn complete_now(
        &self,
        key: &LockKey,
        token: &Token,
        record: Bytes,
        keep: Duration,
    ) -> Result<bool, StoreError> {
        let op = Op::Complete {
            key: key.clone(),
            token: token.clone(),
            record,
            keep,
        };
        Ok(self.submit(op).await?.code == 1)
    }
}

impl Records for RedisStore {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        Box::pin(async move { self.lookup_now(&key).await })
    }

    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move { self.complete_now(&key, &token, record, retention).await })
    }
}
