//! Byte strings put together on the stack: keys and key names built per request without an
//! allocation, unless they are unusually long; and numbers written into them.

/// A byte string of up to `N` bytes held inline, longer ones on the heap.
pub(crate) struct Concat<const N: usize> {
    inline: [u8; N],
    heap: Vec<u8>,
    len: usize,
}

impl<const N: usize> Concat<N> {
    /// An empty string with room for `len` bytes (on the heap if more than `N`).
    pub(crate) fn with_capacity(len: usize) -> Self {
        Self {
            inline: [0; N],
            heap: if len > N {
                Vec::with_capacity(len)
            } else {
                Vec::new()
            },
            len: 0,
        }
    }

    /// Appends `bytes`; returns the length so far (where the next piece starts).
    pub(crate) fn push(&mut self, bytes: &[u8]) -> usize {
        let end = self.len + bytes.len();
        if self.heap.is_empty() && end <= N {
            self.inline[self.len..end].copy_from_slice(bytes);
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&self.inline[..self.len]);
            }
            self.heap.extend_from_slice(bytes);
        }
        self.len = end;
        end
    }

    /// The bytes so far.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        if self.heap.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.heap
        }
    }
}

/// `n` in decimal, written at the end of `out` (the key's scope length, a slot's tag).
pub(crate) fn decimal(mut n: u64, out: &mut [u8; 20]) -> &[u8] {
    let mut start = out.len();
    loop {
        start -= 1;
        out[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &out[start..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_then_heap() {
        let mut s = Concat::<4>::with_capacity(0);
        assert_eq!(s.push(b"ab"), 2);
        assert_eq!(s.push(b""), 2);
        assert_eq!(s.push(b"cd"), 4);
        assert_eq!(s.as_bytes(), b"abcd");
        assert_eq!(s.push(b"e"), 5);
        assert_eq!(s.push(b"fg"), 7);
        assert_eq!(s.as_bytes(), b"abcdefg");
        let mut s = Concat::<4>::with_capacity(6);
        s.push(b"abc");
        s.push(b"def");
        assert_eq!(s.as_bytes(), b"abcdef");
    }
}
