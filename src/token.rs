//! Lock tokens: the secret that proves who holds a lease.

use std::fmt;

/// The random secret stored as the value of a held lock key.
///
/// Every acquisition draws a fresh token of 128 bits from the operating system's CSPRNG (through
/// [`getrandom`]), hex-encoded to 32 ASCII bytes. Only the holder of the token can renew or release
/// the lease, because the store compares it atomically before acting.
///
/// A token never leaves the process except as an argument to the store: its `Debug` output is
/// redacted, it has no `Display`, and it never appears in a response, a log line or a span.
#[derive(Clone, PartialEq, Eq)]
pub struct Token([u8; 32]);

impl Token {
    /// Draws a new random token.
    ///
    /// Fails only when the operating system cannot provide randomness; the caller reports that as
    /// a store error (503) rather than falling back to a weaker source.
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut raw = [0u8; 16];
        getrandom::fill(&mut raw)?;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, byte) in raw.iter().enumerate() {
            out[2 * i] = HEX[usize::from(byte >> 4)];
            out[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
        }
        Ok(Self(out))
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
}
