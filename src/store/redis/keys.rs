//! The keys a script touches next to a lock key: the fencing counter of its hash slot, its
//! hand-off queue and its idempotency record; and durations as Redis takes them.

use std::time::Duration;

use crate::{concat::Concat, key::LockKey};

/// Name of the fencing counters' keys, after the lock keys' prefix: one counter per hash slot,
/// `<prefix>fence:{<tag>}`, with the hash tag of the lock keys it counts for.
const FENCE_COUNTER: &[u8] = b"fence:";

/// Name of the one fencing counter of a server that does not hash keys to slots, after the lock
/// keys' prefix: `<prefix>fence`. A batch of acquires then reads and writes one counter, not one
/// per slot.
const SHARED_FENCE_COUNTER: &[u8] = b"fence";

/// The shared fencing counter of the lock keys with `prefix` (see [`SHARED_FENCE_COUNTER`]).
pub(super) fn shared_fence(prefix: &[u8]) -> Vec<u8> {
    [prefix, SHARED_FENCE_COUNTER].concat()
}

/// Suffix of the hand-off queue's key, next to the lock key (same hash slot).
const QUEUE_SUFFIX: &[u8] = b":queue";

/// Suffix of the idempotency record's key, next to the lock key (same hash slot).
const RECORD_SUFFIX: &[u8] = b":record";

/// The key of the idempotency record kept for `lock`: `<lock key>:record`. It starts with the
/// whole lock key, so it shares its hash tag (and slot), and a script can touch both.
pub(super) fn record_key(lock: &LockKey) -> Vec<u8> {
    [lock.as_bytes(), RECORD_SUFFIX].concat()
}

/// A duration in whole milliseconds, as decimal text on the stack (no allocation per command).
pub(super) struct Ms {
    digits: [u8; 20],
    start: usize,
}

impl std::ops::Deref for Ms {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.digits[self.start..]
    }
}

pub(super) fn ms(d: Duration) -> Ms {
    // Redis takes whole milliseconds; never round a non-zero duration down to 0.
    let mut n = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
    let mut out = Ms {
        digits: [0; 20],
        start: 20,
    };
    while n > 0 {
        out.start -= 1;
        out.digits[out.start] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out
}

/// The keys a lock script touches next to a lock key, in one buffer (on the stack for keys of
/// usual length): the fencing counter of the key's hash slot, `<prefix>fence:{<tag>}` (so that
/// every script stays single-slot, whatever the transport), and the key's hand-off queue.
pub(super) struct CompanionKeys {
    buf: Concat<COMPANIONS_INLINE>,
    split: usize,
}

/// Room for a prefix, a counter's name and a lock key of about 150 bytes.
pub(super) const COMPANIONS_INLINE: usize = 224;

impl CompanionKeys {
    pub(super) fn new(key: &LockKey) -> Self {
        let (prefix, tag, key) = (key.prefix(), key.hash_tag(), key.as_bytes());
        let fence_len = prefix.len() + FENCE_COUNTER.len() + tag.len();
        let mut buf = Concat::with_capacity(fence_len + key.len() + QUEUE_SUFFIX.len());
        buf.push(prefix);
        buf.push(FENCE_COUNTER);
        let split = buf.push(tag);
        buf.push(key);
        buf.push(QUEUE_SUFFIX);
        Self { buf, split }
    }

    pub(super) fn fence(&self) -> &[u8] {
        &self.buf.as_bytes()[..self.split]
    }

    pub(super) fn queue(&self) -> &[u8] {
        &self.buf.as_bytes()[self.split..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot;

    #[test]
    fn the_fencing_counter_shares_the_lock_keys_slot() {
        // The last one is too long for the stack buffer.
        let long = vec![b'x'; COMPANIONS_INLINE];
        for (prefix, scope, value) in [
            ("tower-lock:", "POST /items/{sku}/purchase", &b"sku-1"[..]),
            ("", "s", b"}{\x00"),
            ("p:", "0123456789", b"v"),
            ("tower-lock:", "s", &long),
        ] {
            let key = LockKey::new(prefix, scope, value, 512).unwrap();
            let next = CompanionKeys::new(&key);
            assert_eq!(slot::of(next.fence()), slot::of(key.as_bytes()));
            assert_eq!(slot::of(next.queue()), slot::of(key.as_bytes()));
            let record = record_key(&key);
            assert_eq!(slot::of(&record), slot::of(key.as_bytes()));
            assert_eq!(slot::of(key.as_bytes()), key.slot());
            let tag = std::str::from_utf8(key.hash_tag()).unwrap();
            assert_eq!(next.fence(), format!("{prefix}fence:{tag}").as_bytes());
            assert_eq!(next.queue(), [key.as_bytes(), b":queue"].concat());
        }
    }
}
