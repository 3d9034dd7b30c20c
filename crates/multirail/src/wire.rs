//! Blocking framed I/O over a `TcpStream`, on top of the sans-IO codec.
//!
//! Sockets carry a short receive/send timeout (a "tick"). Reads and writes retry across ticks
//! and call a `tick` closure each time one passes, which decides whether to keep waiting (the
//! caller's deadline, stall detection and shutdown live there). So nothing blocks forever.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;

use multirail_proto::codec::{HEADER_LEN, MAX_CHUNK};
use multirail_proto::{Body, Header};

/// Why a framed read stopped.
#[derive(Debug)]
pub enum WireError {
    /// The socket failed or closed.
    Io(io::Error),
    /// The peer sent bytes that do not decode.
    Decode(multirail_proto::DecodeError),
    /// The tick closure gave up (deadline, stall, shutdown); carries its reason.
    GaveUp(String),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        WireError::Io(e)
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => write!(f, "connection closed by peer"),
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Decode(e) => write!(f, "{e}"),
            WireError::GaveUp(r) => write!(f, "{r}"),
        }
    }
}

fn is_tick(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Fill `buf` completely. `started` tells the tick closure whether any byte has arrived yet
/// (a peer may idle between frames but not in the middle of one).
pub fn read_full(s: &mut TcpStream, buf: &mut [u8], tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => tick(got > 0).map_err(WireError::GaveUp)?,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Write all of `bufs` (gathered, one syscall when it fits).
pub fn write_full(s: &mut TcpStream, bufs: &[&[u8]], tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut done = 0usize;
    while done < total {
        // Build the slices that remain.
        let mut skip = done;
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len());
        for b in bufs {
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            slices.push(IoSlice::new(&b[skip..]));
            skip = 0;
        }
        match s.write_vectored(&slices) {
            Ok(0) => return Err(WireError::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => tick(true).map_err(WireError::GaveUp)?,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Read one header and its (bounded) body. Bulk data, if the message has any, is left on the
/// socket for the caller to move straight into registered memory.
pub fn read_frame(s: &mut TcpStream, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(Header, Body), WireError> {
    let mut h = [0u8; HEADER_LEN];
    read_full(s, &mut h, tick)?;
    let header = Header::decode(&h).map_err(WireError::Decode)?;
    let mut body = vec![0u8; header.body_len as usize];
    read_full(s, &mut body, &mut |_| tick(true))?;
    let b = Body::decode(header.kind, &body).map_err(WireError::Decode)?;
    Ok((header, b))
}

/// Read and drop `n` bulk bytes (a refused WRITE's payload), keeping the stream in sync
/// without touching registered memory.
pub fn discard(s: &mut TcpStream, mut n: u64, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    debug_assert!(n <= MAX_CHUNK);
    let mut scratch = [0u8; 16 << 10];
    while n > 0 {
        let k = (n as usize).min(scratch.len());
        read_full(s, &mut scratch[..k], &mut |_| tick(true))?;
        n -= k as u64;
    }
    Ok(())
}

pub fn send(s: &mut TcpStream, body: &Body, req_id: u64, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let b = body.encode(req_id);
    write_full(s, &[&b], tick)
}
