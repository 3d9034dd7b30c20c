//! The byte wire the staged path sends bounce buffers over: one small trait, a TCP socket, and
//! an in-memory pair rate-limited to a chosen speed (tests and the stand-in bench).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::time::{Duration, Instant};

/// An ordered, reliable byte stream between the two sides of a transfer.
pub trait Wire {
    /// Sends all of `buf`. On return the wire no longer needs `buf`.
    fn send(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Fills all of `buf` with the next bytes of the stream.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<()>;
}

impl Wire for TcpStream {
    fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all(buf)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.read_exact(buf)
    }
}

/// One end of an in-memory wire ([`mem_pair`]).
#[derive(Debug)]
pub struct MemWire {
    tx: SyncSender<Vec<u8>>,
    rx: Receiver<Vec<u8>>,
    rate: Option<f64>,
    /// When the (virtual) link is free again: sends are paced back to back from here.
    free_at: Instant,
    pending: Vec<u8>,
    pos: usize,
}

/// Messages queued in one direction (a socket buffer's worth of chunks).
const QUEUE: usize = 4;

/// Two connected ends; each direction runs at `rate` bytes/s (`None`: unlimited).
pub fn mem_pair(rate: Option<f64>) -> (MemWire, MemWire) {
    let (atx, brx) = mpsc::sync_channel(QUEUE);
    let (btx, arx) = mpsc::sync_channel(QUEUE);
    let now = Instant::now();
    let end = |tx, rx| MemWire { tx, rx, rate, free_at: now, pending: Vec::new(), pos: 0 };
    (end(atx, arx), end(btx, brx))
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the other end of the in-memory wire is gone")
}

impl Wire for MemWire {
    fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        if let Some(rate) = self.rate {
            // The bytes occupy the link for len/rate after it is free; the sender blocks for
            // that long, like a socket write on a full link.
            let start = self.free_at.max(Instant::now());
            self.free_at = start + Duration::from_secs_f64(buf.len() as f64 / rate);
            let now = Instant::now();
            if self.free_at > now {
                std::thread::sleep(self.free_at - now);
            }
        }
        self.tx.send(buf.to_vec()).map_err(|_| closed())
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            if self.pos == self.pending.len() {
                self.pending = self.rx.recv().map_err(|_| closed())?;
                self.pos = 0;
            }
            let n = (buf.len() - got).min(self.pending.len() - self.pos);
            buf[got..got + n].copy_from_slice(&self.pending[self.pos..self.pos + n]);
            got += n;
            self.pos += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_wire_is_a_byte_stream() {
        let (mut a, mut b) = mem_pair(None);
        a.send(b"hello ").unwrap();
        a.send(b"world").unwrap();
        let mut buf = [0u8; 3];
        b.recv(&mut buf).unwrap();
        assert_eq!(&buf, b"hel");
        let mut rest = [0u8; 8];
        b.recv(&mut rest).unwrap();
        assert_eq!(&rest, b"lo world");
        drop(a);
        assert_eq!(b.recv(&mut buf).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}
