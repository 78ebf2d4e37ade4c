//! Redis Cluster hash slots: a lock key's hash tag names the slot of its whole scoped value
//! (see [`crate::key`]), and the one key a store keeps per slot (the fencing counter) carries
//! the same tag, so that every script stays single-slot, in a cluster or behind anything that
//! routes by slot.

use std::sync::OnceLock;

use crate::concat::decimal;

/// Hash slots in a Redis Cluster.
pub(crate) const SLOTS: usize = 16384;

/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with, eight bytes at a time
/// ("slicing by 8"): `CRC_TABLES[j][b]` is the checksum of byte `b` followed by `j` zero bytes,
/// so the eight bytes' lookups are independent of one another (4 KiB of tables). A key is
/// hashed once, when it is built.
const CRC_TABLES: [[u16; 256]; 8] = {
    let mut tables = [[0u16; 256]; 8];
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
        tables[0][i] = crc;
        i += 1;
    }
    let mut j = 1;
    while j < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = tables[j - 1][i];
            tables[j][i] = (prev << 8) ^ tables[0][(prev >> 8) as usize];
            i += 1;
        }
        j += 1;
    }
    tables
};

#[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
fn crc16(data: &[u8]) -> u16 {
    Crc16::default().update(data).0
}

/// A CRC16 computed over several pieces, as if they were one byte string.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Crc16(u16);

impl Crc16 {
    /// Adds `data` to the checksum.
    pub(crate) fn update(self, data: &[u8]) -> Self {
        let t = &CRC_TABLES;
        let mut chunks = data.chunks_exact(8);
        let mut crc = self.0;
        for c in &mut chunks {
            // The register's two bytes fold into the chunk's first two.
            let [hi, lo] = crc.to_be_bytes();
            crc = t[7][usize::from(hi ^ c[0])]
                ^ t[6][usize::from(lo ^ c[1])]
                ^ t[5][usize::from(c[2])]
                ^ t[4][usize::from(c[3])]
                ^ t[3][usize::from(c[4])]
                ^ t[2][usize::from(c[5])]
                ^ t[1][usize::from(c[6])]
                ^ t[0][usize::from(c[7])];
        }
        for &b in chunks.remainder() {
            crc = (crc << 8) ^ t[0][usize::from((crc >> 8) as u8 ^ b)];
        }
        Self(crc)
    }

    /// The checksum of everything added.
    #[cfg(test)]
    pub(crate) fn finish(self) -> u16 {
        self.0
    }

    /// The hash slot of a key whose hash tag is everything added.
    pub(crate) fn slot(self) -> u16 {
        self.0 % SLOTS as u16
    }
}

/// The hash slot of `key`, by Redis's rule: only the part between the first `{` and the first
/// `}` after it counts, if that part is not empty.
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
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
/// The table (64 KiB) is built once per process, by the first [`Locker`](crate::Locker) (see
/// [`warm`]) or the first key built (0.4 ms in a release build): the first number that
/// reaches each slot.
pub(crate) fn tag(slot: u16) -> u32 {
    tags()[usize::from(slot) % SLOTS]
}

/// Builds the table of [`tag`] now, if not yet: a locker does when it is made, so that no
/// request pays for it.
pub(crate) fn warm() {
    tags();
}

fn tags() -> &'static [u32] {
    static TAGS: OnceLock<Box<[u32]>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; SLOTS].into_boxed_slice();
        let mut left = SLOTS;
        let mut found = |n: u32, crc: Crc16| {
            let tag = &mut tags[usize::from(crc.slot())];
            if *tag == u32::MAX {
                *tag = n;
                left -= 1;
            }
            left == 0
        };
        // In increasing order, about 170,000 numbers (a coupon collector's count), each
        // hashed as its prefix's checksum (`n / 10`, hashed once for ten numbers) and a digit.
        let mut digits = [0u8; 20];
        let mut prefix = 0u32;
        loop {
            let base = match prefix {
                0 => Crc16::default(),
                _ => Crc16::default().update(decimal(u64::from(prefix), &mut digits)),
            };
            let first = if prefix == 0 { 0 } else { prefix * 10 };
            for digit in 0..10u8 {
                if found(first + u32::from(digit), base.update(&[b'0' + digit])) {
                    return tags;
                }
            }
            prefix += 1;
        }
    })
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
        // Eight bytes at a time, as one at a time, for every length and split.
        let bitwise = |data: &[u8]| {
            data.iter().fold(0u16, |mut crc, &b| {
                crc ^= u16::from(b) << 8;
                for _ in 0..8 {
                    crc = if crc & 0x8000 != 0 {
                        (crc << 1) ^ 0x1021
                    } else {
                        crc << 1
                    };
                }
                crc
            })
        };
        let data: Vec<u8> = (0u32..100)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in 0..data.len() {
            for split in [0, len / 3, len] {
                let (a, b) = data[..len].split_at(split);
                let crc = Crc16::default().update(a).update(b).finish();
                assert_eq!(crc, bitwise(&data[..len]), "len {len}, split {split}");
            }
        }
        // In pieces, as one.
        let crc = Crc16::default()
            .update(b"1234")
            .update(b"")
            .update(b"56789");
        assert_eq!(crc.finish(), 0x31c3);
        assert_eq!(Crc16::default().update(b"somekey").slot(), 11058);
    }

    #[test]
    fn decimals() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(907, &mut buf), b"907");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
    }

    #[test]
    fn tags_are_the_first_numbers_that_reach_each_slot() {
        // The fencing counters' names depend on them: they must never change.
        let mut first = vec![None; SLOTS];
        let mut digits = [0u8; 20];
        let mut left = SLOTS;
        let mut n = 0u32;
        while left > 0 {
            let slot = usize::from(crc16(decimal(u64::from(n), &mut digits)) % SLOTS as u16);
            if first[slot].is_none() {
                first[slot] = Some(n);
                left -= 1;
            }
            n += 1;
        }
        for (slot, n) in first.into_iter().enumerate() {
            assert_eq!(Some(tag(slot as u16)), n, "slot {slot}");
        }
        assert_eq!(tag(0), 3560);
        assert_eq!(tag(16383), 39296);
    }

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        for slot in 0..SLOTS as u16 {
            let key = format!("p:fence:{{{}}}", tag(slot));
            assert_eq!(of(key.as_bytes()), slot);
        }
    }
}
