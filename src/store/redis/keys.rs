//! The keys a script touches next to a lock key: the fencing counter its tokens come from, its
//! hand-off queue and its idempotency record; and durations as Redis takes them.
//!
//! # The layout, and why no lock key can be one of these
//!
//! A lock key is `<prefix>{<tag>}<scope length>:<scope>:<digest>` (see [`crate::key`]: the
//! digest of the value, never the value): the
//! prefix has no braces, so the first `{` ends it, and the tag is digits up to the first `}`.
//! After that brace a lock key goes on with a digit, the scope's length. Its companions keep the
//! same prefix and tag (the same hash slot) and put a role name there instead:
//!
//! ```text
//! lock key  <prefix>{<tag>}<scope length>:<scope>:<digest>
//! queue     <prefix>{<tag>}queue:<scope length>:<scope>:<digest>
//! record    <prefix>{<tag>}record:<scope length>:<scope>:<digest>
//! fence     <prefix>{<tag>}data-fence:<scope length>:<scope>:<digest>   (`crate::fence`)
//! sum       <prefix>{<tag>}weight:<scope length>:<scope>:<digest>       (a key with a capacity)
//! counters  <prefix>fence:{<tag>}   <prefix>fence
//! ```
//!
//! Read any of these keys from its first byte: the bytes up to the first `{` are the prefix
//! (none: a shared counter); the tag runs to the first `}`; then a digit means a lock key, a
//! letter its role, and nothing at all a slot's counter (a lock key or companion never ends
//! there: its digest is not empty). So a key names one role, one prefix and one lock, whatever
//! bytes a client puts in a value and whatever prefix or scope a layer is configured with: no
//! lock key is a companion of another, and no two companions of different locks are one key.
//! The counters are `<prefix>fence…`, the other keys `<prefix>{…`: a counter of one prefix is
//! never a lock or companion key of another (its braces come after `fence:`, and nothing
//! follows them). Property-tested below over hostile values, scopes and prefixes.

use std::time::Duration;

use crate::{concat::Concat, key::LockKey, slot};

/// Name of the per-slot fencing counters' keys, after the lock keys' prefix: one counter per
/// hash slot, `<prefix>fence:{<tag>}`, with the hash tag of the lock keys it counts for.
const FENCE_COUNTER: &[u8] = b"fence:";

/// Name of the one fencing counter of a server that does not hash keys to slots, after the lock
/// keys' prefix: `<prefix>fence`. A batch of acquires then reads and writes one counter, not one
/// per slot. Where keys hash to slots it is the counter of its own slot's keys.
const SHARED_FENCE_COUNTER: &[u8] = b"fence";

/// Role of the hand-off queue's key, after the lock key's hash tag.
const QUEUE_ROLE: &[u8] = b"queue:";

/// Role of the idempotency record's key, after the lock key's hash tag.
const RECORD_ROLE: &[u8] = b"record:";

/// Role of the running sum of a key with a capacity (a hash: its holders' weights' sum, `u`, and
/// the capacity they named, `c`): the `counted` scripts
/// derive that key from the lock key themselves (`counted_sum_key` in `scripts/counted.lua`),
/// `<prefix>{<tag>}weight:<rest of the lock key>`; `weight_key` spells it for the tests.
#[cfg(test)]
const WEIGHT_ROLE: &[u8] = b"weight:";

/// The key of the running sum of `lock`'s holders' weights, as `counted.lua` derives it.
#[cfg(test)]
fn weight_key(lock: &LockKey) -> Vec<u8> {
    let (head, rest) = split(lock);
    [head, WEIGHT_ROLE, rest].concat()
}

/// The key of the idempotency record kept for `lock`: `<prefix>{<tag>}record:<rest of the lock
/// key>`, in the lock key's hash slot (a script can touch both).
pub(super) fn record_key(lock: &LockKey) -> Vec<u8> {
    let (head, rest) = split(lock);
    [head, RECORD_ROLE, rest].concat()
}

/// A lock key cut after its hash tag: `<prefix>{<tag>}` and the rest.
fn split(lock: &LockKey) -> (&[u8], &[u8]) {
    lock.as_bytes()
        .split_at(lock.prefix().len() + lock.hash_tag().len())
}

/// Whether a lock key's tokens come from its prefix's shared counter, `<prefix>fence`: always
/// where keys do not hash to slots; where they do (`slot_bound`), for the keys of the shared
/// counter's own slot, so that each key has one counter whenever its store learns which it is.
fn shares_counter(key: &LockKey, slot_bound: bool) -> bool {
    !slot_bound || {
        let shared = slot::Crc16::default()
            .update(key.prefix())
            .update(SHARED_FENCE_COUNTER)
            .slot();
        shared == key.slot()
    }
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
/// usual length): the fencing counter its tokens come from (`<prefix>fence`, or
/// `<prefix>fence:{<tag>}` where keys hash to slots and the shared counter is in another slot,
/// so that every script stays single-slot, whatever the transport), and its hand-off queue.
pub(super) struct CompanionKeys {
    buf: Concat<COMPANIONS_INLINE>,
    split: usize,
}

/// Room for a prefix, a counter's name and a lock key of about 150 bytes.
pub(super) const COMPANIONS_INLINE: usize = 224;

impl CompanionKeys {
    /// `key`'s companions on a server that hashes keys to slots (`slot_bound`) or not.
    pub(super) fn new(key: &LockKey, slot_bound: bool) -> Self {
        let (prefix, tag) = (key.prefix(), key.hash_tag());
        let (head, rest) = split(key);
        let shared = shares_counter(key, slot_bound);
        let fence_len = prefix.len()
            + if shared {
                SHARED_FENCE_COUNTER.len()
            } else {
                FENCE_COUNTER.len() + tag.len()
            };
        let mut buf = Concat::with_capacity(fence_len + head.len() + QUEUE_ROLE.len() + rest.len());
        buf.push(prefix);
        let split = if shared {
            buf.push(SHARED_FENCE_COUNTER)
        } else {
            buf.push(FENCE_COUNTER);
            buf.push(tag)
        };
        buf.push(head);
        buf.push(QUEUE_ROLE);
        buf.push(rest);
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

    #[test]
    fn companions_share_the_lock_keys_slot() {
        // The last one is too long for the stack buffer.
        let long = vec![b'x'; COMPANIONS_INLINE];
        for (prefix, scope, value) in [
            ("tower-lock:", "POST /items/{sku}/purchase", &b"sku-1"[..]),
            ("", "s", b"}{\x00"),
            ("p:", "0123456789", b"v"),
            ("tower-lock:", "s", &long),
        ] {
            let key = LockKey::new(prefix, scope, value, 512).unwrap();
            let tag = std::str::from_utf8(key.hash_tag()).unwrap();
            let rest = &key.as_bytes()[prefix.len() + tag.len()..];
            for slot_bound in [false, true] {
                let next = CompanionKeys::new(&key, slot_bound);
                assert_eq!(
                    next.queue(),
                    [prefix.as_bytes(), tag.as_bytes(), b"queue:", rest].concat()
                );
                assert_eq!(slot::of(next.queue()), key.slot());
                if slot_bound {
                    assert_eq!(slot::of(next.fence()), key.slot());
                } else {
                    assert_eq!(next.fence(), format!("{prefix}fence").as_bytes());
                }
            }
            let record = record_key(&key);
            assert_eq!(
                record,
                [prefix.as_bytes(), tag.as_bytes(), b"record:", rest].concat()
            );
            assert_eq!(slot::of(&record), key.slot());
            assert_eq!(slot::of(key.as_bytes()), key.slot());
        }
        // The layout pinned: a change to it is a change of every deployment's keys.
        // The value is its digest (see `crate::key`): SHA-256("sku-685")'s first 128 bits.
        let key = LockKey::new("tower-lock:", "audit", b"sku-685", 512).unwrap();
        let tag = std::str::from_utf8(key.hash_tag()).unwrap();
        let digest = "a743bd0b7a9eec81acce38b0813027b8";
        assert_eq!(
            key.as_bytes(),
            format!("tower-lock:{tag}5:audit:{digest}").as_bytes()
        );
        assert_eq!(
            CompanionKeys::new(&key, false).queue(),
            format!("tower-lock:{tag}queue:5:audit:{digest}").as_bytes()
        );
        assert_eq!(
            record_key(&key),
            format!("tower-lock:{tag}record:5:audit:{digest}").as_bytes()
        );
    }

    /// A key's counter is one whatever its store believes of the server: where keys hash to
    /// slots, the keys of the shared counter's own slot keep the shared counter (a store that has
    /// not learnt it yet uses that one, and is refused for no other key), and the others get
    /// their slot's.
    #[test]
    fn the_keys_of_the_shared_counters_slot_keep_it_where_keys_hash_to_slots() {
        let shared_slot = slot::of(b"tower-lock:fence");
        let mut found = 0;
        for n in 0..200_000 {
            let key =
                LockKey::new("tower-lock:", "audit", format!("sku-{n}").as_bytes(), 512).unwrap();
            let bound = CompanionKeys::new(&key, true);
            let plain = CompanionKeys::new(&key, false);
            assert_eq!(plain.fence(), b"tower-lock:fence");
            if key.slot() == shared_slot {
                found += 1;
                assert_eq!(bound.fence(), b"tower-lock:fence");
            } else {
                let tag = std::str::from_utf8(key.hash_tag()).unwrap();
                assert_eq!(bound.fence(), format!("tower-lock:fence:{tag}").as_bytes());
            }
        }
        assert!(
            found > 0,
            "no key in the shared counter's slot: the test checks nothing"
        );
    }

    /// What a key is, read from its bytes alone (the reading the module docs describe).
    #[derive(Debug, PartialEq, Eq)]
    enum Role {
        Lock(Vec<u8>),
        Queue(Vec<u8>),
        Record(Vec<u8>),
        Weight(Vec<u8>),
        SlotCounter { prefix: Vec<u8>, tag: Vec<u8> },
        SharedCounter { prefix: Vec<u8> },
    }

    fn decode(key: &[u8]) -> Role {
        let Some(open) = key.iter().position(|&b| b == b'{') else {
            let prefix = key.strip_suffix(b"fence").expect("a shared counter");
            return Role::SharedCounter {
                prefix: prefix.to_vec(),
            };
        };
        let close = open + key[open..].iter().position(|&b| b == b'}').expect("a tag");
        let (head, rest) = key.split_at(close + 1);
        let lock = |role: &[u8]| [head, &rest[role.len()..]].concat();
        match rest.first() {
            None => Role::SlotCounter {
                prefix: key[..open]
                    .strip_suffix(b"fence:")
                    .expect("a counter")
                    .to_vec(),
                tag: key[open..].to_vec(),
            },
            Some(b'0'..=b'9') => Role::Lock(key.to_vec()),
            Some(_) if rest.starts_with(QUEUE_ROLE) => Role::Queue(lock(QUEUE_ROLE)),
            Some(_) if rest.starts_with(RECORD_ROLE) => Role::Record(lock(RECORD_ROLE)),
            Some(_) if rest.starts_with(WEIGHT_ROLE) => Role::Weight(lock(WEIGHT_ROLE)),
            Some(_) => panic!("a key of no role: {key:?}"),
        }
    }

    /// Hostile inputs, drawn from a fixed seed so that a failure reproduces: prefixes that end
    /// like the roles and counters do (or are empty), scopes with braces, and values that spell
    /// roles, braces, digits and counters among any bytes.
    struct Hostile(fastrand::Rng);

    impl Hostile {
        const CASES: usize = 2048;

        fn new() -> Self {
            Self(fastrand::Rng::with_seed(0x7017_e5ca_9e11))
        }

        fn text(&mut self, alphabet: &[u8], max: usize) -> String {
            let len = self.0.usize(..=max);
            (0..len)
                .map(|_| char::from(alphabet[self.0.usize(..alphabet.len())]))
                .collect()
        }

        fn prefix(&mut self) -> String {
            match self.0.u8(..7) {
                0 => String::new(),
                1 => "tower-lock:".to_owned(),
                2 => "fence:".to_owned(),
                3 => "a:fence:".to_owned(),
                4 => "queue:".to_owned(),
                5 => self.text(b"abcdefghijklmnopqrstuvwxyz:0123456789", 8),
                _ => self.text(b"az:09 -_\\/|~", 6),
            }
        }

        fn scope(&mut self) -> String {
            match self.0.u8(..4) {
                0 => String::new(),
                1 => "audit".to_owned(),
                2 => "POST /items/{sku}".to_owned(),
                _ => self.text(b"az:09{} /-", 12),
            }
        }

        fn value(&mut self) -> Vec<u8> {
            let pieces = self.0.usize(1..5);
            let mut value = Vec::new();
            for _ in 0..pieces {
                match self.0.u8(..10) {
                    0 => value.extend_from_slice(b":queue"),
                    1 => value.extend_from_slice(b"queue:"),
                    2 => value.extend_from_slice(b":record"),
                    3 => value.extend_from_slice(b"record:"),
                    4 => value.extend_from_slice(b"fence"),
                    5 => value.extend_from_slice(b"fence:{1}"),
                    6 => value.extend_from_slice(b"}{"),
                    7 => value.extend_from_slice(b"5:audit:"),
                    8 => value.extend(self.text(b"0123456789", 3).into_bytes()),
                    _ => value.extend((0..self.0.usize(1..6)).map(|_| self.0.u8(..))),
                }
            }
            if value.is_empty() {
                value.push(self.0.u8(..));
            }
            value
        }

        fn key(&mut self) -> (String, LockKey) {
            let (p, s, v) = (self.prefix(), self.scope(), self.value());
            let key = LockKey::new(&p, &s, &v, 4096).unwrap();
            (p, key)
        }
    }

    /// Every key the store derives reads back as its role and its lock (or its counter's prefix
    /// and tag), from its bytes alone: two keys of different roles, or of one role for different
    /// locks, are never one key, whatever a client puts in a value and whatever prefix and scope
    /// the layers use.
    #[test]
    fn every_key_reads_back_as_its_role_and_lock() {
        let mut hostile = Hostile::new();
        for _ in 0..Hostile::CASES {
            let (p, key) = hostile.key();
            let lock = key.as_bytes().to_vec();
            assert_eq!(decode(&lock), Role::Lock(lock.clone()));
            assert_eq!(decode(&record_key(&key)), Role::Record(lock.clone()));
            assert_eq!(decode(&weight_key(&key)), Role::Weight(lock.clone()));
            for slot_bound in [false, true] {
                let next = CompanionKeys::new(&key, slot_bound);
                assert_eq!(decode(next.queue()), Role::Queue(lock.clone()));
                let counter = decode(next.fence());
                let shared = Role::SharedCounter {
                    prefix: p.clone().into_bytes(),
                };
                let per_slot = Role::SlotCounter {
                    prefix: p.clone().into_bytes(),
                    tag: key.hash_tag().to_vec(),
                };
                assert!(counter == shared || counter == per_slot, "{counter:?}");
                if slot_bound {
                    assert_eq!(slot::of(next.fence()), key.slot());
                }
            }
        }
    }

    /// The same, pairwise: a lock key of one (prefix, scope, value) is never a companion or
    /// counter of another's, and companions are one key only for one lock.
    #[test]
    fn no_lock_key_is_another_locks_companion() {
        let derived = |key: &LockKey| {
            let bound = CompanionKeys::new(key, true);
            let plain = CompanionKeys::new(key, false);
            [
                record_key(key),
                weight_key(key),
                bound.queue().to_vec(),
                bound.fence().to_vec(),
                plain.fence().to_vec(),
            ]
        };
        let mut hostile = Hostile::new();
        for _ in 0..Hostile::CASES {
            let (_, a) = hostile.key();
            let (_, b) = hostile.key();
            for companion in derived(&a) {
                assert_ne!(&companion[..], b.as_bytes());
            }
            for companion in derived(&b) {
                assert_ne!(&companion[..], a.as_bytes());
            }
            if a != b {
                let (da, db) = (derived(&a), derived(&b));
                assert_ne!(&da[0], &db[0]);
                assert_ne!(&da[1], &db[1]);
                assert_ne!(&da[2], &db[2]);
            }
        }
    }

    /// The values a review's reproduction used: `sku-685` and `sku-685:queue` under `audit` once
    /// shared a hash tag, so under an earlier layout (`<lock key>:queue`) the second's lock key
    /// was the first's queue. A value that spells a companion's layout reaches none.
    #[test]
    fn a_value_that_spells_a_companion_is_its_own_lock_key() {
        let victim = LockKey::new("tower-lock:", "audit", b"sku-685", 512).unwrap();
        let spelled = LockKey::new("tower-lock:", "audit", b"sku-685:queue", 512).unwrap();
        let queue = CompanionKeys::new(&victim, false).queue().to_vec();
        let record = record_key(&victim);
        let spelled_record = LockKey::new("tower-lock:", "audit", b"sku-685:record", 512).unwrap();
        assert_ne!(spelled_record.as_bytes(), &record[..]);
        assert_ne!(spelled.as_bytes(), &queue[..]);
    }
}
