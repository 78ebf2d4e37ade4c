//! Idempotency records in Redis, next to the locks, written by the same script that releases
//! the lock.

use std::{
    sync::{Arc, LazyLock},
    time::Duration,
};

use bytes::Bytes;
use redis::Script;

use super::{
    RedisStore,
    keys::{ms, record_key},
    scripts::lua,
};
use crate::{
    key::LockKey,
    store::{BoxFuture, Records, StoreError},
    token::Token,
};

/// Built once: `redis::Script` hashes its source, and the store reloads it on `NOSCRIPT`.
static LOOKUP: LazyLock<Script> = LazyLock::new(|| Script::new(lua("record_lookup")));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(lua("record_complete")));

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
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let record_key = record_key(key);
        let mut keys: Vec<&[u8]> = vec![key.as_bytes(), &record_key];
        let retention = ms(retention);
        let mut args: Vec<&[u8]> = vec![token.as_bytes(), &record, &retention];
        // The lock's fencing counter and queue, and their arguments, with hand-off on.
        let companions = self.handoff_keys(key);
        let handoff_args = self.handoff_args();
        if let Some(companions) = &companions {
            keys.extend([companions.fence(), companions.queue()]);
            args.extend([&handoff_args[0][..], &handoff_args[1][..]]);
        }
        let (done, _): (i64, _) = self.invoke(&COMPLETE, &keys, &args, false).await?;
        Ok(done == 1)
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
