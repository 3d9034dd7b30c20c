//! Fuzz one serving connection of an in-process agent (issue 33, "Tests that would have found
//! these"): the real listener, handshake and dispatcher (`server::Conn`), over loopback TCP.
//!
//! One agent per process (made on the first input) exports host regions (read-write, read-only,
//! and a local one it does not export) and GPU regions on the stand-in device (two on GPU 0,
//! one on GPU 1), with bounce pools of 2 x 4 KiB so that requests span several buffers. Each
//! input is one connection: a `Hello` (role and version from the input), then a script of frames
//! that the harness sends pipelined (`Push` and `Sync` ops choose where it waits), reading the
//! answers as they come:
//! single and vectored (strided) READs and WRITEs with zero lengths, bounds around the region's
//! end and past 2^64, wrong keys, unknown and local regions; `Ping`, `Notif`, `NotifSeq`,
//! `MetaGet`, `MetaPut` (valid, naming another agent, garbage), `Fence` (unknown, a connection of
//! an earlier input, itself), `IpcReq`; and, ending the script, frames that are not requests,
//! bodies that do not decode, and raw bytes.
//!
//! Asserted, with `BOUND` (10 s, `MR_FUZZ_BOUND_S`) as the longest the server may go without
//! progress:
//! - every request is answered, in order, with its own request id, or the connection is closed:
//!   a wait of `BOUND` with neither is a crash (the wedge of issue 33: a zero-length GPU WRITE
//!   left the fence lock taken and the next host WRITE was never answered);
//! - the connection is closed only after a frame that may close it (a self-fence, a frame that
//!   is not a request, one that does not decode); before that, every request is answered;
//! - statuses agree with the regions: accepted exactly when the region is exported, the key is
//!   right, every byte is inside it and a WRITE's region is read-write; refusals carry a refusal
//!   status; a vectored WRITE into a GPU region whose entries overlap is refused (one batched copy
//!   lands them in no order); READs return what earlier WRITEs of the connection left (a shadow
//!   copy);
//! - after the connection, its serving thread ends within `BOUND` (none left behind), and the
//!   memory of every region, and 64 guard bytes either side, holds exactly what the answered
//!   WRITEs put there (refused requests touched nothing, the local region nothing at all).
#![no_main]

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use multirail::{Agent, Config};
use multirail_gpu::{Device, Gpu, GpuKind, PoolConfig};
use multirail_proto::codec::{Role, HEADER_LEN, MAX_CHUNK};
use multirail_proto::{Access, AgentMeta, Body, Header, Kind, MemType, RailInfo, RegionKey, Status};

/// Guard bytes either side of every region (inside its allocation, never exported).
const GUARD: usize = 64;
/// Most ops of one input.
const MAX_OPS: usize = 64;
const AGENT: &str = "fuzz-target";

/// The longest the server may go without progress while the harness waits on it.
fn bound() -> Duration {
    static B: OnceLock<Duration> = OnceLock::new();
    *B.get_or_init(|| {
        let s = std::env::var("MR_FUZZ_BOUND_S").ok().and_then(|v| v.parse::<f64>().ok()).filter(|s| *s > 0.0).unwrap_or(10.0);
        Duration::from_secs_f64(s)
    })
}

/// One region of the fixture: where it lives and how it was registered.
struct Reg {
    id: u64,
    key: RegionKey,
    /// Address of the allocation (the region starts `GUARD` bytes in).
    alloc: usize,
    len: u64,
    gpu: bool,
    access: Access,
}

impl Reg {
    fn size(&self) -> usize {
        self.len as usize + 2 * GUARD
    }

    /// The allocation's bytes, guards included.
    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `size()` bytes, alive for the process (never freed); the
        // harness reads it only while no connection is served.
        unsafe { std::slice::from_raw_parts(self.alloc as *const u8, self.size()) }
    }

    /// Overwrites the allocation, guards included, with `from`.
    fn fill(&self, from: &[u8]) {
        assert_eq!(from.len(), self.size());
        // SAFETY: as `bytes`; `from` is the fixture's own buffer, never this allocation.
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), self.alloc as *mut u8, from.len()) }
    }
}

struct Fixture {
    agent: Agent,
    regs: Vec<Reg>,
    /// Per region, its bytes (guards included) at the start of every input.
    patterns: Vec<Vec<u8>>,
    /// The `Hello` nonce of the previous input's connection (a fence may name it).
    last_nonce: Mutex<[u8; 16]>,
    seq: Mutex<u64>,
}

/// (length, GPU device or None for host memory, access).
const REGIONS: [(u64, Option<u32>, Access); 6] = [
    (8192, None, Access::ReadWrite),
    (512, None, Access::ReadOnly),
    (16384, Some(0), Access::ReadWrite),
    (1024, Some(0), Access::ReadWrite),
    (4096, Some(1), Access::ReadWrite),
    (256, None, Access::Local),
];
/// A region id no agent registers (ids count up from 1).
const UNKNOWN_REGION: u64 = 1 << 40;

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // libFuzzer's main does not set SIGPIPE aside as Rust's does: a write to a socket the
        // server reset must fail with EPIPE, not end the process.
        // SAFETY: setting a signal's disposition to ignore.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let mut cfg = Config::default();
        cfg.staging.gpu = GpuKind::StandIn;
        cfg.staging.pool = PoolConfig { buffers: 2, buffer_size: 4096 };
        cfg.timeout = Duration::from_secs(5);
        cfg.accept_metaput = true;
        cfg.max_peers = 8;
        cfg.serve_spin = Duration::from_micros(20);
        let agent = Agent::new(AGENT, cfg).expect("start the agent");
        let mut regs = Vec::new();
        for (len, dev, access) in REGIONS {
            let size = len as usize + 2 * GUARD;
            let alloc = match dev {
                Some(d) => Gpu::open(GpuKind::StandIn, d as i32).and_then(|g| g.alloc(size)).expect("stand-in allocation").0 as usize,
                None => Box::leak(vec![0u8; size].into_boxed_slice()).as_mut_ptr() as usize,
            };
            let mem = if dev.is_some() { MemType::Vram } else { MemType::Dram };
            let r = agent.register((alloc + GUARD) as u64, len, dev.unwrap_or(0), mem, access).expect("register a region");
            regs.push(Reg { id: r.id, key: r.key, alloc, len, gpu: dev.is_some(), access });
        }
        let patterns = regs.iter().enumerate().map(|(i, r)| (0..r.len as usize + 2 * GUARD).map(|k| pattern(i, k)).collect()).collect();
        Fixture { agent, regs, patterns, last_nonce: Mutex::new([0; 16]), seq: Mutex::new(0) }
    })
}

/// Reads the input; zeros once it is spent.
struct Cur<'a>(&'a [u8]);

impl Cur<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

/// The memory a request names: a fixture region by index, or an unknown one.
#[derive(Clone, Copy)]
struct Target {
    reg: Option<usize>,
    id: u64,
    key: RegionKey,
    key_ok: bool,
    len: u64,
}

/// What the answer to a request must be.
enum Want {
    /// A READ: accepted or not, and if so the (region, offset, len) pieces it returns in order.
    Read { ok: bool, reg: Option<usize>, ranges: Vec<(u64, u64)>, total: u64 },
    /// A WRITE: accepted or not; when accepted, its pieces and payload (applied to the shadow
    /// when the answer comes). `gpu`: bytes two pieces both write are not known after it.
    Write { ok: bool, reg: Option<usize>, ranges: Vec<(u64, u64)>, data: Vec<u8>, gpu: bool },
    /// `Resp` Ok.
    Ok,
    /// `Resp` Ok, or Busy (the inbox is full).
    OkOrBusy,
    /// `Resp` with exactly this acceptance (`MetaPut`).
    Accepted(bool),
    /// `Resp` with any status (`MetaPut` of garbage).
    AnyResp,
    /// `Meta`, this agent's metadata.
    Meta,
    /// `IpcHandles`, or a `Resp`.
    Ipc,
}

struct Expect {
    req: u64,
    want: Want,
    /// The answer may never come (a self-fence aborts the connection before it answers).
    optional: bool,
}

/// The harness's side of one connection: the socket (non-blocking), bytes queued to send,
/// bytes received not yet parsed, and the model of what must come back.
struct Run<'f> {
    fx: &'f Fixture,
    s: TcpStream,
    out: Vec<u8>,
    sent: usize,
    inb: Vec<u8>,
    eof: bool,
    /// The server reset or shut the connection: what is still queued cannot go.
    wdead: bool,
    expect: VecDeque<Expect>,
    /// A frame that may close the connection was queued (from then on a close is no failure).
    may_close: bool,
    /// Raw bytes were sent: frames after the expected answers are tolerated (the bytes may
    /// hold requests of their own).
    raw: bool,
    /// Per region, what its bytes must be (-1: not known).
    shadow: Vec<Vec<i16>>,
    role: Role,
    name: &'static str,
    nonce: [u8; 16],
    next_req: u64,
    what: Vec<String>,
    /// Answers checked, and whether the server closed before the harness half-closed.
    answered: usize,
    eof_first: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Until {
    Sent,
    Answered,
    Eof,
}

fn pattern(reg: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (reg * 7 + 1)) as u8
}

fn payload(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| seed.wrapping_add((i as u8).wrapping_mul(13)).wrapping_add((i >> 8) as u8)).collect()
}

fn is_refusal(s: Status) -> bool {
    matches!(s, Status::UnknownRegion | Status::BadKey | Status::OutOfBounds | Status::ReadOnly)
}

impl<'f> Run<'f> {
    fn log(&mut self, s: String) {
        self.what.push(s);
    }

    fn script(&self) -> String {
        self.what.join("\n  ")
    }

    fn fail(&self, why: &str) -> ! {
        panic!("{why}\nconnection: role {:?}, name {}\nscript sent:\n  {}", self.role, self.name, self.script());
    }

    fn queue(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    fn req(&mut self) -> u64 {
        self.next_req += 1;
        self.next_req
    }

    /// Sends what is queued and reads what comes until `until`; a wait of `bound()` without
    /// progress in either direction is a wedged server.
    fn pump(&mut self, until: Until) {
        let mut last = Instant::now();
        let mut buf = [0u8; 64 * 1024];
        loop {
            let done = match until {
                Until::Sent => self.sent == self.out.len() || self.wdead,
                Until::Answered => (self.sent == self.out.len() || self.wdead) && self.expect.iter().all(|e| e.optional),
                Until::Eof => self.eof,
            };
            if done || self.eof {
                return;
            }
            let mut progressed = false;
            if self.sent < self.out.len() && !self.wdead {
                match self.s.write(&self.out[self.sent..]) {
                    Ok(n) => {
                        self.sent += n;
                        progressed |= n > 0;
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(_) => self.wdead = true,
                }
            }
            loop {
                match self.s.read(&mut buf) {
                    Ok(0) => {
                        self.eof = true;
                        break;
                    }
                    Ok(n) => {
                        self.inb.extend_from_slice(&buf[..n]);
                        progressed = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => {
                        self.eof = true;
                        break;
                    }
                }
            }
            self.parse();
            if self.eof {
                self.closed();
                return;
            }
            if progressed {
                last = Instant::now();
                continue;
            }
            if last.elapsed() > bound() {
                let first = self.expect.front().map(|e| e.req);
                self.fail(&format!(
                    "wedged: no answer and no close within {:?} (waiting for {until:?}; {} of {} bytes sent; first unanswered request: {first:?})",
                    bound(),
                    self.sent,
                    self.out.len()
                ));
            }
            let mut events = libc::POLLIN;
            if self.sent < self.out.len() && !self.wdead {
                events |= libc::POLLOUT;
            }
            let mut p = libc::pollfd { fd: self.s.as_raw_fd(), events, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 50) };
        }
    }

    /// The connection closed: allowed only after a frame that may close it. WRITEs accepted
    /// but not answered leave their bytes unknown.
    fn closed(&mut self) {
        if !self.may_close {
            if let Some(e) = self.expect.iter().find(|e| !e.optional) {
                let req = e.req;
                self.fail(&format!("the server closed the connection with request {req} unanswered, after well-formed requests only"));
            }
        }
        let pending: Vec<Expect> = self.expect.drain(..).collect();
        for e in pending {
            if let Want::Write { ok: true, reg: Some(r), ranges, .. } = e.want {
                for (off, len) in ranges {
                    self.shadow[r][off as usize..(off + len) as usize].fill(-1);
                }
            }
        }
    }

    /// Parses the complete frames received, checking each against what it must be.
    fn parse(&mut self) {
        loop {
            let Some(h) = self.inb.get(..HEADER_LEN) else { return };
            let header = match Header::decode(h.try_into().expect("16 bytes")) {
                Ok(h) => h,
                Err(e) => self.fail(&format!("the server sent a header that does not decode: {e}")),
            };
            let end = HEADER_LEN + header.body_len as usize;
            if self.inb.len() < end {
                return;
            }
            let body = match Body::decode(header.kind, &self.inb[HEADER_LEN..end]) {
                Ok(b) => b,
                Err(e) => self.fail(&format!("the server sent a {:?} body that does not decode: {e}", header.kind)),
            };
            let bulk = match &body {
                Body::Resp { bulk_len, .. } => *bulk_len as usize,
                _ => 0,
            };
            if self.inb.len() < end + bulk {
                return;
            }
            let data: Vec<u8> = self.inb[end..end + bulk].to_vec();
            self.inb.drain(..end + bulk);
            self.answer(header.req_id, body, &data);
        }
    }

    fn answer(&mut self, req: u64, body: Body, data: &[u8]) {
        if let Body::Error { status, msg } = &body {
            if !self.may_close {
                self.fail(&format!("the server refused the connection after well-formed requests only: {status:?}: {msg}"));
            }
            return;
        }
        let Some(e) = self.expect.pop_front() else {
            if self.raw {
                return; // raw bytes may have held requests of their own
            }
            self.fail(&format!("an answer nobody asked for: {:?} to request {req}", body.kind()));
        };
        self.answered += 1;
        if e.req != req {
            self.fail(&format!("answers out of order: got one to request {req}, expected request {} first", e.req));
        }
        let ctx = |what: &str| format!("request {req}: {what}, got {body:?}");
        match (e.want, &body) {
            (Want::Read { ok, reg, ranges, total }, Body::Resp { status, bulk_len, msg }) => {
                if ok {
                    if *status != Status::Ok || *bulk_len != total {
                        self.fail(&ctx(&format!("READ of {total} bytes must be served ({msg})")));
                    }
                    let r = reg.expect("an accepted READ names a region");
                    let mut at = 0;
                    for (off, len) in ranges {
                        for k in 0..len as usize {
                            let want = self.shadow[r][off as usize + k];
                            if want >= 0 && want as u8 != data[at] {
                                self.fail(&format!(
                                    "request {req}: READ byte {at} (region {r} offset {}) is {:#04x}, earlier WRITEs left {want:#04x}",
                                    off as usize + k,
                                    data[at]
                                ));
                            }
                            at += 1;
                        }
                    }
                } else if !is_refusal(*status) || *bulk_len != 0 {
                    self.fail(&ctx("READ must be refused (unknown region, key, bounds)"));
                }
            }
            (Want::Write { ok, reg, ranges, data: bytes, gpu }, Body::Resp { status, bulk_len: 0, msg }) => {
                if ok {
                    if *status != Status::Ok {
                        self.fail(&ctx(&format!("WRITE must be applied ({msg})")));
                    }
                    let r = reg.expect("an accepted WRITE names a region");
                    let mut touched = vec![0u8; self.shadow[r].len()];
                    let mut at = 0;
                    for (off, len) in ranges {
                        for k in 0..len as usize {
                            let i = off as usize + k;
                            self.shadow[r][i] = bytes[at] as i16;
                            touched[i] = touched[i].saturating_add(1);
                            at += 1;
                        }
                    }
                    if gpu {
                        for (s, t) in self.shadow[r].iter_mut().zip(&touched) {
                            if *t > 1 {
                                *s = -1;
                            }
                        }
                    }
                } else if !(is_refusal(*status) || (gpu && *status == Status::Malformed)) {
                    // A vectored WRITE into GPU memory may be refused for overlapping entries
                    // before its other checks (server.rs), as Malformed.
                    self.fail(&ctx("WRITE must be refused (unknown region, key, bounds, read-only; overlap into GPU memory)"));
                }
            }
            (Want::Ok, Body::Resp { status: Status::Ok, bulk_len: 0, .. }) => {}
            (Want::OkOrBusy, Body::Resp { status: Status::Ok | Status::Busy, bulk_len: 0, .. }) => {}
            (Want::Accepted(ok), Body::Resp { status, bulk_len: 0, .. }) => {
                if (*status == Status::Ok) != ok {
                    self.fail(&ctx(if ok { "MetaPut must be accepted" } else { "MetaPut must be refused" }));
                }
            }
            (Want::AnyResp, Body::Resp { bulk_len: 0, .. }) => {}
            (Want::Meta, Body::Meta(blob)) => match AgentMeta::decode(blob) {
                Ok(m) if m.name == AGENT => {}
                other => self.fail(&format!("request {req}: MetaGet answered with {other:?}")),
            },
            (Want::Ipc, Body::IpcHandles(_) | Body::Resp { bulk_len: 0, .. }) => {}
            _ => self.fail(&ctx("wrong kind of answer")),
        }
    }

    fn target(&mut self, c: &mut Cur<'_>) -> Target {
        let sel = c.u8();
        let i = (sel & 0x3f) as usize % (REGIONS.len() + 1);
        let mut t = match self.fx.regs.get(i) {
            Some(r) => Target { reg: Some(i), id: r.id, key: r.key, key_ok: true, len: r.len },
            None => Target { reg: None, id: UNKNOWN_REGION, key: RegionKey([7; 16]), key_ok: false, len: 4096 },
        };
        if sel & 0xc0 == 0xc0 {
            t.key.0[(sel as usize >> 3) & 15] ^= 1 + (sel & 7);
            t.key_ok = false;
        }
        t
    }

    /// Whether the model accepts the request on `t` (the registry's checks, restated).
    fn accepts(&self, t: &Target, key: RegionKey, write: bool, ends: &[Option<u64>]) -> bool {
        let Some(r) = t.reg.map(|i| &self.fx.regs[i]) else { return false };
        r.access != Access::Local
            && r.key == key
            && (!write || r.access == Access::ReadWrite)
            && ends.iter().all(|e| e.is_some_and(|e| e <= r.len))
    }

    fn offset(c: &mut Cur<'_>, len: u64) -> u64 {
        let v = c.u16() as u64;
        if v & 0x8000 != 0 && v & 0x4000 != 0 {
            u64::MAX - (v & 0xff)
        } else {
            v % (len + 64)
        }
    }

    fn single(&mut self, c: &mut Cur<'_>, write: bool) {
        let t = self.target(c);
        let mode = c.u8();
        let off = Self::offset(c, t.len);
        let l = c.u16() as u64;
        let len = match mode & 3 {
            0 => 0,
            1 => l % 64,
            2 => l % (t.len + 64),
            _ if !write && mode & 0x1c == 0x1c => MAX_CHUNK + 1 + l, // over the decode bound: refused, closed
            _ => l,
        };
        let req = self.req();
        let key = t.key;
        let op = multirail_proto::codec::RemoteOp { region: t.id, key, offset: off, len };
        let ok = self.accepts(&t, key, write, &[off.checked_add(len)]);
        let body = if write { Body::WriteReq(op) } else { Body::ReadReq(op) };
        self.log(format!(
            "{req}: {} region {:?} off {off} len {len} key_ok {} -> {ok}",
            if write { "WRITE" } else { "READ" },
            t.reg,
            t.key_ok
        ));
        let frame = body.encode(req);
        if len > MAX_CHUNK {
            self.queue(&frame);
            self.may_close = true;
            return;
        }
        let gpu = t.reg.is_some_and(|i| self.fx.regs[i].gpu);
        let ranges = if len > 0 { vec![(off, len)] } else { Vec::new() };
        self.queue(&frame);
        if write {
            let data = payload(mode, len as usize);
            self.queue(&data);
            self.expect.push_back(Expect { req, want: Want::Write { ok, reg: t.reg, ranges, data, gpu }, optional: false });
        } else {
            self.expect.push_back(Expect { req, want: Want::Read { ok, reg: t.reg, ranges, total: len }, optional: false });
        }
    }

    /// A vectored request, encoded by hand so that malformed entries (no entries, zero lengths
    /// or counts, overlapping strides) go out too; those do not decode and close the connection.
    fn vectored(&mut self, c: &mut Cur<'_>, write: bool) {
        let t = self.target(c);
        // Malformed entries now and then (no entries, a zero length or count, overlapping strides).
        let nb = c.u8();
        let n = if nb == 0xff { 0 } else { 1 + nb as usize % 5 };
        let mut body = Vec::new();
        body.extend_from_slice(&t.id.to_le_bytes());
        body.extend_from_slice(&t.key.0);
        body.extend_from_slice(&(n as u32).to_le_bytes());
        for _ in 0..n {
            let off = Self::offset(c, t.len);
            let m = c.u8();
            let bad = c.u8() % 32;
            let mut len = if m & 0x80 != 0 { c.u16() as u64 % 4200 + 1 } else { c.u16() as u64 % 256 + 1 };
            let mut count = u64::from(m & 3) + 1;
            let mut stride = len + u64::from(c.u8());
            match bad {
                0 => len = 0,
                1 => count = 0,
                2 if count > 1 => stride = len - 1,
                _ => {}
            }
            body.extend_from_slice(&off.to_le_bytes());
            body.extend_from_slice(&(len as u32).to_le_bytes());
            body.extend_from_slice(&(count as u32).to_le_bytes());
            if count != 1 {
                body.extend_from_slice(&stride.to_le_bytes());
            }
        }
        let req = self.req();
        let kind = if write { Kind::WriteVReq } else { Kind::ReadVReq };
        let mut frame = Header { kind, body_len: body.len() as u32, req_id: req }.encode().to_vec();
        frame.extend_from_slice(&body);
        let op = match Body::decode(kind, &body) {
            Ok(Body::ReadVReq(op) | Body::WriteVReq(op)) => op,
            _ => {
                self.log(format!("{req}: {kind:?} region {:?} malformed ({n} entries) -> closes", t.reg));
                self.queue(&frame);
                self.may_close = true;
                return;
            }
        };
        let ends: Vec<Option<u64>> = op.pieces.iter().map(|p| p.end()).collect();
        let ranges: Vec<(u64, u64)> =
            op.pieces.iter().flat_map(|p| (0..p.count).map(move |k| (p.offset.wrapping_add(k.wrapping_mul(p.stride)), p.len))).collect();
        let gpu = t.reg.is_some_and(|i| self.fx.regs[i].gpu);
        let ok = self.accepts(&t, op.key, write, &ends) && !(write && gpu && overlap(&ranges));
        let total = op.total();
        self.log(format!(
            "{req}: {kind:?} region {:?} pieces {:?} -> {ok}",
            t.reg,
            op.pieces.iter().map(|p| (p.offset, p.len, p.count, p.stride)).collect::<Vec<_>>()
        ));
        self.queue(&frame);
        let ranges = if ok { ranges } else { Vec::new() };
        if write {
            let data = payload(n as u8 ^ 0x5a, total as usize);
            self.queue(&data);
            self.expect.push_back(Expect { req, want: Want::Write { ok, reg: t.reg, ranges, data, gpu }, optional: false });
        } else {
            self.expect.push_back(Expect { req, want: Want::Read { ok, reg: t.reg, ranges, total }, optional: false });
        }
    }

    fn meta_blob(&self, name: &str, inc: u8) -> Vec<u8> {
        let rail = RailInfo {
            name: "r0".into(),
            addr: "127.0.0.1".into(),
            prefix_len: 8,
            port: 9,
            speed_mbps: 0,
            mtu: 0,
            numa: -1,
            rdma_dev: String::new(),
        };
        AgentMeta { name: name.into(), incarnation: u64::from(inc) + 1, rails: vec![rail], regions: Vec::new() }.encode()
    }

    /// One op of the script; false when it ended the script (a frame that closes the connection).
    fn op(&mut self, c: &mut Cur<'_>, terminal_sync: bool) -> bool {
        let b = c.u8();
        match b % 16 {
            0 | 1 => self.single(c, true),
            2 => self.single(c, false),
            3 | 4 => self.vectored(c, true),
            5 => self.vectored(c, false),
            6 => {
                let req = self.req();
                self.log(format!("{req}: Ping"));
                self.queue(&Body::Ping.encode(req));
                self.expect.push_back(Expect { req, want: Want::Ok, optional: false });
            }
            7 => {
                let req = self.req();
                let m = c.u8();
                let msg = payload(m, m as usize % 64);
                let body = if m & 1 == 0 {
                    Body::Notif(msg)
                } else {
                    Body::NotifSeq { incarnation: u64::from(m >> 6), seq: u64::from(c.u8() % 8), msg }
                };
                self.log(format!("{req}: {:?}", body.kind()));
                self.queue(&body.encode(req));
                self.expect.push_back(Expect { req, want: Want::OkOrBusy, optional: false });
            }
            8 => {
                let req = self.req();
                self.log(format!("{req}: MetaGet"));
                self.queue(&Body::MetaGet.encode(req));
                self.expect.push_back(Expect { req, want: Want::Meta, optional: false });
            }
            9 => {
                let req = self.req();
                let m = c.u8();
                let (blob, want) = match m % 4 {
                    0 => (self.meta_blob(self.name, m), Want::Accepted(self.role == Role::Control)),
                    1 => (self.meta_blob(if self.name == "fz0" { "fz1" } else { "fz0" }, m), Want::Accepted(false)),
                    2 => (self.meta_blob(AGENT, m), Want::Accepted(false)),
                    _ => (payload(m, c.u8() as usize), Want::AnyResp),
                };
                self.log(format!("{req}: MetaPut kind {}", m % 4));
                self.queue(&Body::MetaPut(blob).encode(req));
                self.expect.push_back(Expect { req, want, optional: false });
            }
            10 => {
                let req = self.req();
                let m = c.u8();
                let last = *self.fx.last_nonce.lock().expect("nonce lock");
                let unknown = [m | 1; 16];
                let ids: Vec<[u8; 16]> = match m % 5 {
                    0 => vec![self.nonce],
                    1 => vec![unknown],
                    2 => vec![last],
                    3 => Vec::new(),
                    _ => vec![unknown, last, self.nonce],
                };
                let own = ids.contains(&self.nonce);
                if own && terminal_sync {
                    self.pump(Until::Answered);
                }
                self.log(format!("{req}: Fence {} ids{}", ids.len(), if own { ", itself" } else { "" }));
                self.queue(&Body::Fence(ids).encode(req));
                self.expect.push_back(Expect { req, want: Want::Ok, optional: own });
                if own {
                    self.may_close = true;
                    return false;
                }
            }
            11 => {
                let req = self.req();
                let t = self.target(c);
                self.log(format!("{req}: IpcReq region {:?}", t.reg));
                self.queue(&Body::IpcReq { host: [c.u8(); 16], watch: [c.u8(); 16], regions: vec![(t.id, t.key)] }.encode(req));
                self.expect.push_back(Expect { req, want: Want::Ipc, optional: false });
            }
            12 => {
                self.log("sync".into());
                self.pump(Until::Answered);
            }
            13 => {
                self.log("push".into());
                self.pump(Until::Sent);
            }
            14 => {
                if terminal_sync {
                    self.pump(Until::Answered);
                }
                let n = c.u8() as usize % 48;
                let mut raw: Vec<u8> = (0..n).map(|_| c.u8()).collect();
                if b & 0x10 != 0 && raw.len() >= 4 {
                    raw[..3].copy_from_slice(b"MR\x01");
                }
                self.log(format!("raw {raw:02x?}"));
                self.queue(&raw);
                self.may_close = true;
                self.raw = true;
                return false;
            }
            _ => {
                if terminal_sync {
                    self.pump(Until::Answered);
                }
                let req = self.req();
                let body = match c.u8() % 6 {
                    0 => Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() },
                    1 => Body::Welcome { mac: [0; 32] },
                    2 => Body::Hello { version: 1, role: Role::Data, incarnation: 1, name: "x".into(), nonce: [3; 16] },
                    3 => Body::Meta(vec![1, 2, 3]),
                    4 => Body::IpcReleased(vec![u64::MAX]),
                    _ => Body::Error { status: Status::Busy, msg: "no".into() },
                };
                self.log(format!("{req}: {:?} (not a request)", body.kind()));
                self.queue(&body.encode(req));
                self.may_close = true;
                return false;
            }
        }
        true
    }
}

/// Opens a connection and completes an unauthenticated handshake (blocking, bounded).
fn connect(port: u16, role: Role, version: u16, name: &str, nonce: [u8; 16]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the agent");
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(bound())).expect("read timeout");
    s.set_write_timeout(Some(bound())).expect("write timeout");
    let hello = Body::Hello { version, role, incarnation: 1, name: name.into(), nonce };
    // Auth goes right behind Hello (without a secret its proof is zeros whatever the nonce):
    // one round trip less per input.
    let mut first = hello.encode(0);
    first.extend_from_slice(&Body::Auth { mac: [0; 32] }.encode(0));
    s.write_all(&first).expect("send Hello and Auth");
    let read = |s: &mut TcpStream, want: Kind| {
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h).unwrap_or_else(|e| panic!("handshake: no {want:?} within {:?}: {e}", bound()));
        let h = Header::decode(&h).expect("handshake header");
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).expect("handshake body");
        assert_eq!(h.kind, want, "handshake: {:?}", Body::decode(h.kind, &body));
    };
    read(&mut s, Kind::Challenge);
    read(&mut s, Kind::Welcome);
    s.set_nonblocking(true).expect("non-blocking");
    s
}

/// Each region (guards included) back to its pattern; the shadow of what it must hold.
fn reset(fx: &Fixture) -> Vec<Vec<i16>> {
    fx.regs
        .iter()
        .zip(&fx.patterns)
        .map(|(r, p)| {
            r.fill(p);
            p[GUARD..GUARD + r.len as usize].iter().map(|&b| i16::from(b)).collect()
        })
        .collect()
}

/// Waits for the agent's serving threads to end: none may be left behind across inputs.
fn wait_served(run: &Run<'_>) {
    let shared = run.fx.agent.shared();
    let t0 = Instant::now();
    while shared.open_conns.load(Ordering::SeqCst) > 0 {
        if t0.elapsed() > bound() {
            let n = shared.open_conns.load(Ordering::SeqCst);
            run.fail(&format!("{n} serving thread(s) still running {:?} after their connection closed", bound()));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Every region holds what the answered WRITEs left (refused ones touched nothing), its guards
/// their pattern.
/// Whether two of these byte ranges (offset, len) share a byte.
fn overlap(ranges: &[(u64, u64)]) -> bool {
    let mut r = ranges.to_vec();
    r.sort_unstable();
    r.windows(2).any(|w| w[1].0 < w[0].0.saturating_add(w[0].1))
}

fn check_memory(run: &Run<'_>) {
    for (i, (r, p)) in run.fx.regs.iter().zip(&run.fx.patterns).enumerate() {
        let mem = r.bytes();
        let mut want = p.clone();
        for (k, &v) in run.shadow[i].iter().enumerate() {
            want[GUARD + k] = if v >= 0 { v as u8 } else { mem[GUARD + k] };
        }
        if *mem != want[..] {
            let k = mem.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            run.fail(&format!(
                "region {i} ({} bytes, {}): byte {} is {:#04x}, must be {:#04x}",
                r.len,
                if r.gpu { "GPU" } else { "host" },
                k as i64 - GUARD as i64,
                mem[k],
                want[k]
            ));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let fx = fixture();
    let mut c = Cur(data);
    let setup = c.u8();
    let role = if setup & 1 == 0 { Role::Control } else { Role::Data };
    let version = 1 + u16::from((setup >> 1) & 7) % 5;
    let name: &'static str = if setup & 0x10 == 0 { "fz0" } else { "fz1" };
    let terminal_sync = setup & 0x20 != 0;
    let shadow = reset(fx);
    let _ = fx.agent.take_notifs();
    let nonce = {
        let mut g = fx.seq.lock().expect("seq lock");
        *g += 1;
        let mut n = [0xa5u8; 16];
        n[..8].copy_from_slice(&g.to_le_bytes());
        n
    };
    let s = connect(fx.agent.port(), role, version, name, nonce);
    let mut run = Run {
        fx,
        s,
        out: Vec::new(),
        sent: 0,
        inb: Vec::new(),
        eof: false,
        wdead: false,
        expect: VecDeque::new(),
        may_close: false,
        raw: false,
        shadow,
        role,
        name,
        nonce,
        next_req: 0,
        what: Vec::new(),
        answered: 0,
        eof_first: false,
    };
    let mut ops = 0;
    while !c.done() && ops < MAX_OPS && !run.eof {
        ops += 1;
        if !run.op(&mut c, terminal_sync) {
            break;
        }
    }
    // Every answer (or the close), then half-close: the server must hang up in turn.
    run.pump(Until::Answered);
    run.eof_first = run.eof;
    if !run.eof {
        let _ = run.s.shutdown(Shutdown::Write);
        run.wdead = true;
        run.pump(Until::Eof);
    }
    if let Some(e) = run.expect.iter().find(|e| !e.optional) {
        let req = e.req;
        run.fail(&format!("request {req} unanswered at the end"));
    }
    let _ = run.s.shutdown(Shutdown::Both);
    *fx.last_nonce.lock().expect("nonce lock") = nonce;
    wait_served(&run);
    if std::env::var_os("MR_FUZZ_VERBOSE").is_some() {
        eprintln!(
            "serve: role {role:?} v{version} {name}: {} answers checked, closed by the server: {}\n  {}",
            run.answered,
            run.eof_first,
            run.script()
        );
    }
    check_memory(&run);
});
