//! Idempotency records in Redis, next to the locks, written by the same script that releases
//! the lock.
//!
//! A record is stored as `F`, its lease's fencing token in 20 decimal digits (so that the
//! script compares two by comparing their bytes), then the encoded record; records stored
//! before records were fenced have no such prefix and count as fenced by 0.

use std::{
    sync::{Arc, LazyLock},
    time::Duration,
};

use bytes::Bytes;
use redis::Script;

use super::{RedisStore, keys::record_key, scripts::lua, wire::Op};
use crate::{
    key::LockKey,
    store::{BoxFuture, Completed, Records, StoreError, StoreErrorKind},
    token::Token,
};

/// Built once: `redis::Script` hashes its source, and the store reloads it on `NOSCRIPT`. A
/// record is written with the release, by the batch script (`Op::Complete`).
static LOOKUP: LazyLock<Script> = LazyLock::new(|| Script::new(lua("record_lookup")));

/// The length of the fence before a stored record: `F` and 20 digits.
const FENCE_LEN: usize = 21;

/// `record` as stored: fenced by `fencing_token`.
fn fenced(fencing_token: u64, record: &[u8]) -> Bytes {
    let mut stored = Vec::with_capacity(FENCE_LEN + record.len());
    stored.extend_from_slice(format!("F{fencing_token:020}").as_bytes());
    stored.extend_from_slice(record);
    Bytes::from(stored)
}

/// The record in what is stored (without its fence).
fn unfenced(stored: Vec<u8>) -> Bytes {
    let stored = Bytes::from(stored);
    match stored.first() {
        Some(b'F') if stored.len() >= FENCE_LEN => stored.slice(FENCE_LEN..),
        _ => stored,
    }
}

impl RedisStore {
    async fn lookup_now(&self, key: &LockKey) -> Result<Option<Bytes>, StoreError> {
        let (record, _): (Option<Vec<u8>>, _) = self
            .invoke(&LOOKUP, &[&record_key(key)], &[], false)
            .await?;
        Ok(record.map(unfenced))
    }

    async fn complete_now(
        &self,
        key: &LockKey,
        token: &Token,
        fencing_token: u64,
        record: &[u8],
        keep: Duration,
    ) -> Result<Completed, StoreError> {
        let op = Op::Complete {
            key: key.clone(),
            token: token.clone(),
            record: fenced(fencing_token, record),
            keep,
        };
        let (stored, released) = match self.submit(op).await?.code {
            0 => (false, false),
            1 => (true, true),
            2 => (true, false),
            3 => (false, true),
            code => {
                return Err(StoreError::msg(
                    StoreErrorKind::Backend,
                    format!("the record script answered {code}, which no version of it does"),
                ));
            }
        };
        Ok(Completed { stored, released })
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
        fencing_token: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<Completed, StoreError>> {
        Box::pin(async move {
            self.complete_now(&key, &token, fencing_token, &record, retention)
                .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_records_compare_by_their_bytes() {
        let low = fenced(9, b"TLI1a");
        let high = fenced(1_700_000_000_000_000, b"TLI1b");
        assert!(high[..FENCE_LEN] > low[..FENCE_LEN]);
        assert_eq!(unfenced(low.to_vec()), "TLI1a");
        assert_eq!(unfenced(high.to_vec()), "TLI1b");
        assert_eq!(
            unfenced(b"TLI1old".to_vec()),
            "TLI1old",
            "a record stored before fences"
        );
        assert_eq!(fenced(u64::MAX, b"").len(), FENCE_LEN);
    }
}
