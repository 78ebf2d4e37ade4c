//! Records in Redis, next to the locks, written by the same script that releases the lock.

use std::{sync::LazyLock, time::Duration};

use bytes::Bytes;
use redis::Script;

use super::store::{IdempotencyStore, record_key};
use crate::{
    key::LockKey,
    store::{RedisStore, StoreError, lock_script},
    token::Token,
};

/// Built once: `redis::Script` hashes its source, and the store reloads it on `NOSCRIPT`.
static LOOKUP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/lookup.lua")));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| lock_script(COMPLETE_LUA));

/// Stores a record and releases the lock in one step; a lock script (see `lock_script`).
pub(crate) const COMPLETE_LUA: &str = include_str!("scripts/complete.lua");

fn ms(d: Duration) -> Vec<u8> {
    d.as_millis().max(1).to_string().into_bytes()
}

impl IdempotencyStore for RedisStore {
    async fn lookup(&self, key: &LockKey) -> Result<Option<Bytes>, StoreError> {
        let (record, _): (Option<Vec<u8>>, _) = self
            .invoke(&LOOKUP, &[&record_key(key)], &[], false)
            .await?;
        Ok(record.map(Bytes::from))
    }

    async fn complete(
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
        let extra = self.handoff_keys(key);
        let extra_args = self.handoff_args();
        if let Some(next_to) = &extra {
            keys.extend([next_to.fence(), next_to.queue()]);
            args.extend([&extra_args[0][..], &extra_args[1][..]]);
        }
        let (done, _): (i64, _) = self.invoke(&COMPLETE, &keys, &args, false).await?;
        Ok(done == 1)
    }
}

#[cfg(test)]
mod tests {
    use redis::Script;

    use super::COMPLETE;

    /// The protocol model runs `__private::script_source("complete")`: what this module loads.
    #[test]
    fn the_complete_script_source_is_what_is_loaded() {
        let source = crate::__private::script_source("complete").unwrap();
        assert_eq!(Script::new(&source).get_hash(), COMPLETE.get_hash());
    }
}
