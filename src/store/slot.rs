//! Redis Cluster hash slots, for the one key a store keeps per slot (the fencing counter): it
//! must live in the slot of every lock key whose script touches it, so that every script stays
//! single-slot, in a cluster or behind anything that routes by slot.

use std::sync::OnceLock;

use crate::key::decimal;

/// Hash slots in a Redis Cluster.
const SLOTS: usize = 16384;

/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with, one byte at a time.
const CRC_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// The hash slot of `key`, by Redis's rule: only the part between the first `{` and the first
/// `}` after it counts, if that part is not empty.
pub(crate) fn of(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS as u16
}

/// A number whose decimal form hashes to `slot`: a key with `{<tag>}` in it lives in that slot.
/// The table (64 KiB) is built once per process, on first use (a few milliseconds): the first
/// number that reaches each slot.
pub(crate) fn tag(slot: u16) -> u32 {
    static TAGS: OnceLock<Box<[u32]>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; SLOTS].into_boxed_slice();
        let mut left = SLOTS;
        let mut n = 0u32;
        let mut digits = [0u8; 20];
        // About 170,000 numbers (a coupon collector's count); deterministic.
        while left > 0 {
            let found =
                &mut tags[usize::from(crc16(decimal(u64::from(n), &mut digits)) % SLOTS as u16)];
            if *found == u32::MAX {
                *found = n;
                left -= 1;
            }
            n += 1;
        }
        tags
    });
    tags[usize::from(slot) % SLOTS]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis() {
        // The check value of CRC16-CCITT (XMODEM), as in the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        // Hash tags, from the specification's examples.
        assert_eq!(of(b"{user1000}.following"), of(b"{user1000}.followers"));
        assert_eq!(of(b"{user1000}.following"), of(b"user1000"));
        assert_eq!(of(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(of(b"foo{{bar}}zap"), of(b"{bar"));
        assert_eq!(of(b"foo{bar}{zap}"), of(b"bar"));
        // Values `CLUSTER KEYSLOT` gives.
        assert_eq!(of(b"foo"), 12182);
        assert_eq!(of(b"somekey"), 11058);
    }

    #[test]
    fn decimals() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(907, &mut buf), b"907");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
    }

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        for slot in 0..SLOTS as u16 {
            let key = format!("p:fence:{{{}}}", tag(slot));
            assert_eq!(of(key.as_bytes()), slot);
        }
    }
}
