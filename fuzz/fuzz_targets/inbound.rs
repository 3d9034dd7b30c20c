//! Fuzz the framing layer of a served or client connection, `multirail::wire::Inbound`, over a
//! real loopback TCP socket, against a reference parser of the same bytes.
//!
//! Input: one byte `n`, then `n` script bytes, then the stream. The script interleaves writes
//! of the stream in segments of its choosing (so headers and bodies arrive split anywhere) with
//! the reader's operations: `fill_now`, `read_frame`, `peek_frame` + `consume`,
//! `read_response_into`, `read_into`, `read_into_spans`, `discard`. Every frame or byte the
//! reader returns must be what a flat parse of the stream (`Header::decode` + `Body::decode`
//! at the same position) gives; an error must be one the flat parse also meets (bytes that do
//! not decode, or the end of the stream); nothing may block once every byte is written and the
//! write side closed (a read that waits 2 s then is a hang, reported as a crash).
#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use multirail::wire::{Inbound, WireError};
use multirail_proto::codec::HEADER_LEN;
use multirail_proto::{Body, Header, Status};

/// One listener per process; a fresh connection per input.
fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("bind a loopback listener"))
}

/// What a flat parse finds at a position of the stream.
enum Flat {
    /// A whole frame: header, body, bytes it takes.
    Frame(Header, Body, usize),
    /// Bytes that do not decode (the reader must refuse them), with the bytes the reader
    /// needs to see that (the header, or header and body).
    Bad(usize),
    /// The stream ends first: `need` bytes from the position would be needed.
    Short(usize),
}

fn flat(stream: &[u8], at: usize) -> Flat {
    let rest = &stream[at.min(stream.len())..];
    let Some(h) = rest.get(..HEADER_LEN) else { return Flat::Short(HEADER_LEN) };
    let Ok(header) = Header::decode(h.try_into().expect("16 bytes")) else { return Flat::Bad(HEADER_LEN) };
    let end = HEADER_LEN + header.body_len as usize;
    let Some(body) = rest.get(HEADER_LEN..end) else { return Flat::Short(end) };
    match Body::decode(header.kind, body) {
        Ok(b) => Flat::Frame(header, b, end),
        Err(_) => Flat::Bad(end),
    }
}

struct Run<'a> {
    stream: &'a [u8],
    /// Bytes written to the socket so far, and whether the write side is closed.
    sent: usize,
    closed: bool,
    /// Bytes the reader has consumed (its position in the flat parse).
    at: usize,
    w: TcpStream,
    r: TcpStream,
    inb: Inbound,
}

/// Why an input stops early.
enum Stop {
    /// The reader failed as the flat parse says it must (or the harness cannot go on).
    Done,
}

impl Run<'_> {
    fn write(&mut self, n: usize) {
        let k = n.min(self.stream.len() - self.sent);
        if k > 0 {
            self.w.write_all(&self.stream[self.sent..self.sent + k]).expect("loopback write");
            self.sent += k;
        }
    }

    /// Make sure `need` bytes past the reader's position are written, else write everything
    /// and close the write side (the reader then meets the end of the stream, never a wait).
    fn ensure(&mut self, need: usize) {
        if self.at + need <= self.sent || self.closed {
            return;
        }
        self.write(usize::MAX);
        if self.at + need > self.sent {
            let _ = self.w.shutdown(Shutdown::Write);
            self.closed = true;
        }
    }

    /// A read that waits more than 2 s after the stream is complete and closed is a hang.
    fn tick(closed: bool) -> impl FnMut(bool) -> Result<(), String> {
        let start = Instant::now();
        move |_| {
            if !closed {
                return Err("starved".into());
            }
            assert!(start.elapsed() < Duration::from_secs(2), "Inbound read hung on a complete, closed stream");
            Ok(())
        }
    }

    /// An error from the reader: it must match what the flat parse meets at `at` (or the
    /// stream's end), else the reader desynchronised.
    fn failed(&self, e: WireError, expect_short: bool) -> Stop {
        match e {
            WireError::Decode(_) => assert!(
                matches!(flat(self.stream, self.at), Flat::Bad(_)),
                "reader refused bytes the flat parse decodes at {}: {e}",
                self.at
            ),
            WireError::Io(_) => assert!(expect_short || self.closed, "io error before the stream ended: {e}"),
            WireError::GaveUp(_) => assert!(!self.closed, "gave up on a closed stream"),
        }
        Stop::Done
    }

    fn frame(&mut self, got: Result<(Header, Body), WireError>) -> Result<(), Stop> {
        let want = flat(self.stream, self.at);
        match got {
            Ok((h, b)) => {
                let Flat::Frame(h2, b2, n) = want else { panic!("reader returned a frame the flat parse does not have at {}", self.at) };
                assert_eq!((h.kind, h.body_len, h.req_id), (h2.kind, h2.body_len, h2.req_id));
                assert_eq!(b, b2);
                self.at += n;
                Ok(())
            }
            Err(e) => Err(self.failed(e, matches!(want, Flat::Short(_)))),
        }
    }

    fn read_frame(&mut self) -> Result<(), Stop> {
        let need = match flat(self.stream, self.at) {
            Flat::Frame(_, _, n) | Flat::Bad(n) | Flat::Short(n) => n,
        };
        self.ensure(need);
        let got = self.inb.read_frame(&mut self.r, &mut Self::tick(self.closed));
        self.frame(got)
    }

    fn peek(&mut self) -> Result<(), Stop> {
        if let Some((h, b, n)) = self.inb.peek_frame() {
            let Flat::Frame(h2, b2, n2) = flat(self.stream, self.at) else { panic!("peek found a frame the flat parse does not") };
            assert_eq!((h.kind, h.req_id, &b, n), (h2.kind, h2.req_id, &b2, n2));
            self.inb.consume(n);
            self.at += n;
        }
        Ok(())
    }

    fn response_into(&mut self, len: usize) -> Result<(), Stop> {
        let want = flat(self.stream, self.at);
        let payload = match &want {
            Flat::Frame(_, Body::Resp { status: Status::Ok, bulk_len, .. }, _) if *bulk_len == len as u64 => len,
            _ => 0,
        };
        // The scatter read takes a 28-byte head whatever the frame; a payload follows its frame.
        let need = match &want {
            Flat::Frame(_, _, n) | Flat::Bad(n) | Flat::Short(n) => (*n + payload).max(HEADER_LEN + 12),
        };
        self.ensure(need);
        let mut dst = vec![0u8; len];
        let got = self.inb.read_response_into(&mut self.r, Some(&mut dst), &mut Self::tick(self.closed));
        match got {
            Ok((h, b, filled)) => {
                self.frame(Ok((h, b)))?;
                // Filled only for the payload asked for (a reply with that payload may still
                // come back unfilled, its bytes left on the stream, on the slow path).
                assert!(!filled || payload == len, "filled dst for a frame that carries no such payload");
                if filled {
                    assert_eq!(&dst[..], &self.stream[self.at..self.at + len], "payload landed wrong");
                    self.at += len;
                }
                Ok(())
            }
            Err(e) => Err(self.failed(e, true)),
        }
    }

    fn bulk(&mut self, n: usize, how: u8) -> Result<(), Stop> {
        self.ensure(n);
        let short = self.at + n > self.stream.len();
        let mut tick = Self::tick(self.closed);
        let mut buf = vec![0u8; n];
        let r = match how % 3 {
            0 => self.inb.read_into(&mut self.r, &mut buf, &mut tick),
            1 => self.inb.discard(&mut self.r, n as u64, &mut tick),
            _ => {
                // Up to four spans (zero-length ones included) covering the buffer in order.
                let cuts = [0, n / 3 * (how as usize % 2), n / 2, n / 2 + (how as usize >> 4).min(n - n / 2), n];
                let base = buf.as_mut_ptr();
                // SAFETY: every span lies inside `buf` (cuts are ordered and <= n), spans are
                // disjoint, and nothing else touches `buf` while this runs.
                let spans: Vec<(*mut u8, usize)> = cuts.windows(2).map(|w| (unsafe { base.add(w[0]) }, w[1] - w[0])).collect();
                unsafe { self.inb.read_into_spans(&mut self.r, &spans, &mut tick) }
            }
        };
        match r {
            Ok(()) => {
                assert!(!short, "read {n} bytes past the end of the stream");
                if how % 3 != 1 {
                    assert_eq!(&buf[..], &self.stream[self.at..self.at + n], "bulk bytes differ");
                }
                self.at += n;
                Ok(())
            }
            Err(e) => Err(self.failed(e, short)),
        }
    }

    fn step(&mut self, op: u8, arg: u8) -> Result<(), Stop> {
        match op % 8 {
            0 | 7 => {
                self.write(arg as usize + 1);
                Ok(())
            }
            1 => {
                if !self.inb.fill_now(std::os::fd::AsRawFd::as_raw_fd(&self.r)) && !self.closed {
                    // An error or the end of the stream: only possible once it is closed.
                    panic!("fill_now failed on an open stream");
                }
                Ok(())
            }
            2 => self.read_frame(),
            3 => self.peek(),
            4 => self.response_into(arg as usize * 8),
            _ => self.bulk(arg as usize * 4, op >> 3),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else { return };
    let n = (n as usize).min(rest.len());
    let (script, stream) = rest.split_at(n);
    let l = listener();
    let w = TcpStream::connect(l.local_addr().expect("listener address")).expect("connect");
    let (r, _) = l.accept().expect("accept");
    let _ = w.set_nodelay(true);
    r.set_read_timeout(Some(Duration::from_millis(20))).expect("read timeout");
    let mut run = Run { stream, sent: 0, closed: false, at: 0, w, r, inb: Inbound::new() };
    for op in script.chunks(2) {
        if run.step(op[0], op.get(1).copied().unwrap_or(0)).is_err() {
            return;
        }
    }
    // Then the rest, frame by frame, to the end of the stream.
    while run.at < stream.len() {
        if run.read_frame().is_err() {
            return;
        }
    }
});
