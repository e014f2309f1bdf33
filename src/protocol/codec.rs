//! The one bounds-checked little-endian codec behind every decoder of peer-supplied bytes: frames,
//! geometry fingerprints and RDMA offers. A decoder never indexes past its input, never allocates
//! more than the input holds, and reports any inconsistency as `KVSTAGE_E_PROTOCOL` naming what
//! it was decoding and the field.

use crate::error::{Error, Result, Status};

#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.u32(v as u32)
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A `u32` length, then the bytes.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.raw(v)
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads `buf` front to back; `what` names the structure in error messages.
pub struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Dec<'a> {
        Dec { buf, pos: 0, what }
    }

    /// `KVSTAGE_E_PROTOCOL`: "malformed {what}: {detail}".
    pub fn error(&self, detail: impl std::fmt::Display) -> Error {
        Error::new(Status::KVSTAGE_E_PROTOCOL, format!("malformed {}: {detail}", self.what))
    }

    /// Bytes not read yet.
    pub fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            self.error(format!("{field} needs {n} bytes at offset {} but there are {}", self.pos, self.buf.len()))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
    pub fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }
    pub fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, field)?.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, field)?.try_into().expect("4 bytes")))
    }
    pub fn i32(&mut self, field: &str) -> Result<i32> {
        Ok(self.u32(field)? as i32)
    }
    pub fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, field)?.try_into().expect("8 bytes")))
    }
    /// A `u32` length (at most `max`), then that many bytes.
    pub fn bytes(&mut self, field: &str, max: usize) -> Result<Vec<u8>> {
        let n = self.u32(field)? as usize;
        if n > max {
            return Err(self.error(format!("{field} of {n} bytes exceeds the limit of {max}")));
        }
        Ok(self.take(n, field)?.to_vec())
    }
    pub fn str(&mut self, field: &str, max: usize) -> Result<String> {
        let b = self.bytes(field, max)?;
        String::from_utf8(b).map_err(|_| self.error(format!("{field} is not UTF-8")))
    }
    /// Fails unless every byte was read.
    pub fn finish(&self) -> Result<()> {
        match self.left() {
            0 => Ok(()),
            n => Err(self.error(format!("{n} trailing bytes"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_it_wrote_and_names_the_field_that_does_not_fit() {
        let mut e = Enc::default();
        e.u8(1).u16(2).u32(3).i32(-4).u64(5).str("kv");
        let mut d = Dec::new(&e.0, "sample");
        assert_eq!((d.u8("a").unwrap(), d.u16("b").unwrap(), d.u32("c").unwrap()), (1, 2, 3));
        assert_eq!((d.i32("d").unwrap(), d.u64("e").unwrap()), (-4, 5));
        assert_eq!(d.str("f", 2).unwrap(), "kv");
        d.finish().unwrap();
        let err = Dec::new(&e.0[..3], "sample").u32("count").unwrap_err();
        assert_eq!(err.code(), Status::KVSTAGE_E_PROTOCOL);
        assert_eq!(err.message(), "malformed sample: count needs 4 bytes at offset 0 but there are 3");
        let mut long = Enc::default();
        long.u32(u32::MAX);
        assert!(Dec::new(&long.0, "s").bytes("blob", 10).unwrap_err().message().contains("exceeds the limit of 10"));
    }
}
