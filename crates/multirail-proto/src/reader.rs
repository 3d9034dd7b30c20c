//! A bounds-checked little-endian reader over a byte slice. Every accessor returns
//! [`DecodeError::Truncated`] instead of panicking, so decoders built on it cannot be made to
//! read past the input or allocate from an unchecked length.

use crate::codec::DecodeError;

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated { need: n, have: self.remaining() });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    pub fn str16(&mut self, what: &'static str, max: usize) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(DecodeError::TooMany { what, n: n as u64, max: max as u64 });
        }
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Malformed("string is not UTF-8"))
    }

    /// A u32 count of items each at least `min_item` bytes long, bounded by `max` and by the
    /// bytes actually left, so a forged count cannot make the caller pre-allocate.
    pub fn count(&mut self, what: &'static str, max: usize, min_item: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(DecodeError::TooMany { what, n: n as u64, max: max as u64 });
        }
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(DecodeError::Truncated { need: n.saturating_mul(min_item), have: self.remaining() });
        }
        Ok(n)
    }

    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.remaining() != 0 {
            return Err(DecodeError::Malformed("trailing bytes"));
        }
        Ok(())
    }
}

pub fn put_str16(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    let n = b.len().min(u16::MAX as usize);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&b[..n]);
}
