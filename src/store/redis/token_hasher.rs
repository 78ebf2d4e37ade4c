//! The hasher of the map of unsettled acquires (`commit.rs`), keyed by token.

use std::hash::Hasher;

/// A hasher for the map of tokens: tokens are random (128 bits from the OS's CSPRNG, drawn by
/// this process, never from input), so nobody can pick keys that collide, and a
/// multiply-and-rotate fold of their bytes spreads them as well as SipHash would, at a few
/// dozen instructions rather than about 500 per lookup.
#[derive(Default)]
pub(super) struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn write(&mut self, bytes: &[u8]) {
        // The fractional part of the golden ratio, odd: a multiply spreads each word's bits
        // upwards (as rustc's own FxHasher does).
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word)).wrapping_mul(K);
        }
    }

    fn finish(&self) -> u64 {
        // The well-spread high bits down to the low ones, which pick the bucket.
        self.0.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::*;
    use crate::token::Token;

    /// Tokens spread over a table's buckets (the low bits) and its control bytes (the top 7).
    #[test]
    fn the_token_hasher_spreads_tokens() {
        let hasher = BuildHasherDefault::<TokenHasher>::default();
        let hashes: Vec<u64> = (0..8192)
            .map(|_| hasher.hash_one(Token::generate().expect("entropy")))
            .collect();
        let low: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 0xff).collect();
        let top: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert_eq!(low.len(), 256, "every bucket of 256 is used by 8192 tokens");
        assert_eq!(top.len(), 128, "every control byte is used by 8192 tokens");
    }
}
