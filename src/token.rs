//! Lock tokens: the secret that proves who holds a lease.

use std::{cell::RefCell, fmt};

use crate::store::error::StoreError;

/// Random bytes fetched from the OS per refill: 32 tokens' worth, one system call.
const POOL_LEN: usize = 512;

/// Random bytes drawn from the OS in bulk, per thread, each handed out once. Refilled from the
/// OS when used up, and in a forked child (the pid changed), so no two processes share bytes.
struct Pool {
    bytes: [u8; POOL_LEN],
    used: usize,
    pid: u32,
}

thread_local! {
    static POOL: RefCell<Pool> = const {
        RefCell::new(Pool {
            bytes: [0; POOL_LEN],
            used: POOL_LEN,
            pid: 0,
        })
    };
}

/// Fills `out` with bytes from the operating system's CSPRNG.
fn fill(out: &mut [u8; 16]) -> Result<(), getrandom::Error> {
    // During thread teardown the pool is gone: straight from the OS.
    POOL.try_with(|pool| fill_from(&mut pool.borrow_mut(), out))
        .unwrap_or_else(|_| getrandom::fill(out))
}

fn fill_from(pool: &mut Pool, out: &mut [u8; 16]) -> Result<(), getrandom::Error> {
    {
        let pid = std::process::id();
        if pool.used + out.len() > POOL_LEN || pool.pid != pid {
            getrandom::fill(&mut pool.bytes)?;
            pool.used = 0;
            pool.pid = pid;
        }
        let taken = &mut pool.bytes[pool.used..pool.used + out.len()];
        out.copy_from_slice(taken);
        // Handed out once: nothing left in memory to tell a holder's token.
        taken.fill(0);
        pool.used += out.len();
        Ok(())
    }
}

/// The random secret stored as the value of a held lock key.
///
/// Every acquisition draws a fresh token of 128 bits from the operating system's CSPRNG (through
/// [`getrandom`], fetched 512 bytes at a time per thread and each byte used once), hex-encoded to
/// 32 ASCII bytes. Only the holder of the token can renew or release
/// the lease, because the store compares it atomically before acting.
///
/// A token never leaves the process except as an argument to the store: its `Debug` output is
/// redacted, it has no `Display`, and it never appears in a response, a log line or a span.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

impl Token {
    pub_with_test_util! {
        /// Draws a new random token.
        ///
        /// Fails only when the operating system cannot provide randomness (a [`StoreError`] of kind
        /// [`Entropy`](crate::store::StoreErrorKind::Entropy): the layer answers 503) rather than falling back to
        /// a weaker source.
        ///
        /// The engine draws one per lease; a test of a [`LockStore`](crate::store::LockStore) that
        /// calls it directly needs this (feature `test-util`).
        fn generate() -> Result<Self, StoreError> {
            let mut raw = [0u8; 16];
            fill(&mut raw).map_err(StoreError::entropy)?;
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let mut out = [0u8; 32];
            for (i, byte) in raw.iter().enumerate() {
                out[2 * i] = HEX[usize::from(byte >> 4)];
                out[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
            }
            Ok(Self(out))
        }
    }

    /// The token's bytes, as a store should write them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tokens_are_fresh_hex_and_redacted() {
        let mut seen = HashSet::new();
        for _ in 0..10_000 {
            let token = Token::generate().unwrap();
            assert_eq!(token.as_bytes().len(), 32);
            assert!(token.as_bytes().iter().all(|b| b.is_ascii_hexdigit()));
            assert!(seen.insert(token.as_bytes().to_vec()), "token repeated");
        }
        let token = Token::generate().unwrap();
        let shown = format!("{token:?}");
        assert_eq!(shown, "Token(<redacted>)");
        assert!(!shown.contains(std::str::from_utf8(token.as_bytes()).unwrap()));
    }

    #[test]
    fn threads_draw_distinct_tokens() {
        let draws: Vec<Vec<Vec<u8>>> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..1_000)
                        .map(|_| Token::generate().unwrap().as_bytes().to_vec())
                        .collect()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let all: HashSet<Vec<u8>> = draws.into_iter().flatten().collect();
        assert_eq!(all.len(), 4_000, "a token repeated across threads");
    }
}
