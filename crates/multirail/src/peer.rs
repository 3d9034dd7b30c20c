//! A remote agent as seen from here, and the connections (a [`Link`]) that carry transfers to it.
//!
//! Threads per connection: a sender that pulls chunks from the link's planner while it has
//! window room and writes requests (and WRITE payloads, straight from registered memory), and
//! a receiver that reads responses in order, lands READ payloads straight in registered memory
//! and reports completions. The reading half of a connection (`Rx`) belongs to whoever reads:
//! the receiver, or a caller waiting for one of its transfers (`Link::drive`, caller-driven
//! completion). A dead rail's connections that carried WRITEs are fenced on the target
//! (`Fence`) before their chunks are reissued. Lock order: `sched` before nothing else; socket writes and reads
//! never happen under `sched`.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use multirail_proto::codec::{RemoteOp, Role, Status};
use multirail_proto::planner::{pair_rows, pair_segments, RailStats};
use multirail_proto::{AgentMeta, Body, Chunk, Event, Pair, Planner, RailInfo, RegionKey, RegionMeta, XferId};

use crate::agent::{Ctx, ResolvedLocal};
use crate::auth;
use crate::config::Progress;
use crate::error::{Error, Result};
use crate::registry::{random_bytes, Region};
use crate::wire::{self, poll_in, WireError};
use crate::xfer::{Desc, Op, XferHandle, XferShared, XferState};

/// Socket timeout granularity: how often blocked reads/writes re-check deadlines and shutdown.
const TICK: Duration = Duration::from_millis(50);
/// Longest a fence may take on one rail (connect, handshake, answer) before the next is tried.
const FENCE_TIMEOUT: Duration = Duration::from_secs(2);

/// A peer: its metadata and, once used, its link.
pub struct Peer {
    pub name: String,
    pub meta: AgentMeta,
    /// Exported regions sorted by base, for resolving remote descriptors.
    regions: Vec<RegionMeta>,
    keys: HashMap<u64, RegionKey>,
    /// The address its metadata was fetched from; stands in for unspecified rail addresses.
    addr_hint: Option<IpAddr>,
    ctx: Arc<Ctx>,
    link: Mutex<Option<Arc<Link>>>,
    /// Ids of dead connections that carried WRITEs and that the peer has not yet confirmed
    /// fenced. Kept across links: no WRITE goes to the peer again before they are fenced.
    unfenced: Arc<Mutex<Vec<[u8; 16]>>>,
    /// Counters per rail (by the link's rail index), kept across reconnections.
    io: Mutex<Vec<Arc<RailIo>>>,
    /// Counters of the peer as a whole.
    pub counters: Arc<PeerCounters>,
}

/// What went over one rail to a peer, for metrics; kept across links (reconnections).
#[derive(Debug, Default)]
pub struct RailIo {
    /// Payload bytes and chunks landed here by READs.
    pub bytes_read: AtomicU64,
    pub chunks_read: AtomicU64,
    /// Payload bytes and chunks the peer acknowledged for WRITEs.
    pub bytes_written: AtomicU64,
    pub chunks_written: AtomicU64,
    /// Times the rail was readmitted after being down.
    pub readmissions: AtomicU64,
    /// Connections of the rail declared stalled (no byte for `stall_timeout`).
    pub stalls: AtomicU64,
}

/// Counters of a peer as a whole, for metrics.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// Transfers (posts) that ended DONE / in ERROR.
    pub transfers_done: AtomicU64,
    pub transfers_failed: AtomicU64,
    /// Dead connections of ours the peer confirmed fenced.
    pub fenced_connections: AtomicU64,
}

/// A plain copy of [`RailIo`].
#[derive(Debug, Clone, Default)]
pub struct RailIoSnapshot {
    pub bytes_read: u64,
    pub chunks_read: u64,
    pub bytes_written: u64,
    pub chunks_written: u64,
    pub readmissions: u64,
    pub stalls: u64,
}

impl RailIo {
    fn snapshot(&self) -> RailIoSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RailIoSnapshot {
            bytes_read: g(&self.bytes_read),
            chunks_read: g(&self.chunks_read),
            bytes_written: g(&self.bytes_written),
            chunks_written: g(&self.chunks_written),
            readmissions: g(&self.readmissions),
            stalls: g(&self.stalls),
        }
    }
}

impl Peer {
    pub fn new(meta: AgentMeta, addr_hint: Option<IpAddr>, ctx: Arc<Ctx>) -> Peer {
        let mut regions = meta.regions.clone();
        regions.sort_by_key(|r| (r.base, std::cmp::Reverse(r.len)));
        let keys = regions.iter().map(|r| (r.id, r.key)).collect();
        Peer {
            name: meta.name.clone(),
            meta,
            regions,
            keys,
            addr_hint,
            ctx,
            link: Mutex::new(None),
            unfenced: Arc::new(Mutex::new(Vec::new())),
            io: Mutex::new(Vec::new()),
            counters: Arc::new(PeerCounters::default()),
        }
    }

    /// Resolve remote (addr, len) descriptors into (region, offset, len) against the peer's
    /// exported regions.
    pub fn resolve<D: Desc>(&self, descs: &[D]) -> Result<Vec<(u64, u64, u64)>> {
        let mut out = Vec::with_capacity(descs.len());
        let mut look = Lookup::new();
        for (i, d) in descs.iter().enumerate() {
            let (addr, len) = d.span();
            let (k, _) = look.find(&self.regions, addr, len, |r| (r.base, r.len)).ok_or(Error::OutOfBounds {
                peer: self.name.clone(),
                index: i,
                addr,
                len,
            })?;
            out.push((self.regions[k].id, addr - look.base, len));
        }
        Ok(out)
    }

    pub fn pair(&self, local: &[(u64, u64)], remote: &[(u64, u64, u64)]) -> Result<Vec<Pair>> {
        pair_segments(local, remote).map_err(|(l, r)| Error::LengthMismatch { local: l, remote: r })
    }

    /// The live link, connecting first if needed.
    pub fn link(self: &Arc<Self>) -> Result<Arc<Link>> {
        let mut g = self.link.lock().expect("peer lock");
        // Checked under the lock that `close` takes: a link is never opened after the agent's
        // close has passed this peer.
        if self.ctx.closed.load(Ordering::SeqCst) {
            return Err(Error::PeerLost { peer: self.name.clone(), reason: "agent closed".into() });
        }
        if let Some(l) = g.as_ref() {
            if l.usable() {
                let l = l.clone();
                drop(g);
                l.revive()?;
                return Ok(l);
            }
            if let Some(e) = l.fatal.lock().expect("link lock").clone() {
                return Err(e);
            }
            l.close();
        }
        let l = Link::connect(self)?;
        *g = Some(l.clone());
        Ok(l)
    }

    /// The counters of rails 0..n (created as needed).
    fn rail_io(&self, n: usize) -> Vec<Arc<RailIo>> {
        let mut g = self.io.lock().expect("peer lock");
        while g.len() < n {
            g.push(Arc::new(RailIo::default()));
        }
        g[..n].to_vec()
    }

    pub fn connected(&self) -> bool {
        self.link.lock().expect("peer lock").as_ref().is_some_and(|l| l.usable())
    }

    /// Post `x`. `will_drive`: the caller waits for it next (`post_wait`) and reads its own
    /// responses; otherwise a parked receiver is kicked to read them.
    pub(crate) fn submit(self: &Arc<Self>, x: Arc<XferShared>, will_drive: bool) -> Result<()> {
        let link = self.link()?;
        link.submit(x, will_drive)
    }

    /// See [`Link::drive`]; false when there is no link.
    pub(crate) fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        let link = self.link.lock().expect("peer lock").clone();
        link.is_some_and(|l| l.drive(x, deadline, poll_only))
    }

    pub(crate) fn cancel(&self, x: &Arc<XferShared>) {
        if let Some(l) = self.link.lock().expect("peer lock").as_ref() {
            l.cancel(x);
        }
    }

    pub fn send_notif(self: &Arc<Self>, msg: &[u8]) -> Result<()> {
        self.link()?.control_request(Body::Notif(msg.to_vec()))
    }

    /// The agent's progress mode and spin budget (for waiting callers).
    pub(crate) fn progress(&self) -> (Progress, Duration) {
        (self.ctx.cfg.progress, self.ctx.cfg.spin)
    }

    pub fn rail_stats(&self) -> Vec<RailReport> {
        match self.link.lock().expect("peer lock").as_ref() {
            Some(l) => l.rail_reports(),
            None => Vec::new(),
        }
    }

    pub fn close(&self) {
        if let Some(l) = self.link.lock().expect("peer lock").take() {
            l.close();
        }
    }

    /// Create a transfer handle: resolve, validate and pair all descriptors now, so posting is
    /// cheap. `local_regions` is this agent's registry (`Registry::snapshot`, sorted by base).
    ///
    /// One pass over both lists resolves each row (binary search, skipped while rows stay in
    /// the region last found) and writes the pairs, a contiguous run (adjacent on both sides,
    /// one region each) merged into one pair. When anything is wrong, the checks run again one
    /// at a time (`prepare_checked`) so that the error is the first of, in this order:
    /// a local row not registered, the notification too large, a remote row outside the
    /// peer's regions, a WRITE to a read-only region, unequal totals.
    pub fn prepare<D: Desc>(
        self: &Arc<Self>,
        op: Op,
        local: &[D],
        local_regions: &[Arc<Region>],
        remote: &[D],
        notif: Vec<u8>,
    ) -> Result<XferHandle> {
        if notif.len() > multirail_proto::codec::MAX_NOTIF {
            return self.prepare_checked(op, local, local_regions, remote, notif);
        }
        let mut hold: Vec<Arc<Region>> = Vec::new();
        let (mut llook, mut rlook) = (Lookup::new(), Lookup::new());
        let mut region = 0;
        let write = op == Op::Write;
        let pairs = pair_rows(
            local.len(),
            |i| {
                let (addr, len) = local[i].span();
                let (k, fresh) = llook.find(local_regions, addr, len, |r| (r.base, r.len))?;
                if fresh && !hold.iter().any(|h| h.id == local_regions[k].id) {
                    hold.push(local_regions[k].clone());
                }
                Some((k as u64, addr, len))
            },
            remote.len(),
            |j| {
                let (addr, len) = remote[j].span();
                let (k, fresh) = rlook.find(&self.regions, addr, len, |r| (r.base, r.len))?;
                if fresh {
                    let r = &self.regions[k];
                    if write && r.access != multirail_proto::Access::ReadWrite {
                        return None;
                    }
                    region = r.id;
                }
                Some((region, addr - rlook.base, len))
            },
        );
        let Some(pairs) = pairs else {
            return self.prepare_checked(op, local, local_regions, remote, notif);
        };
        // Connect now, so unreachable peers fail here rather than on the first post.
        self.link()?;
        Ok(XferHandle(XferShared::new(op, self.clone(), pairs, notif, hold)))
    }

    /// `prepare` one check at a time, each over all rows, pairing without merging: the
    /// error (if any) is the first in the order `prepare` documents.
    fn prepare_checked<D: Desc>(
        self: &Arc<Self>,
        op: Op,
        local: &[D],
        local_regions: &[Arc<Region>],
        remote: &[D],
        notif: Vec<u8>,
    ) -> Result<XferHandle> {
        let (local, hold) = resolve_in(local_regions, local)?;
        if notif.len() > multirail_proto::codec::MAX_NOTIF {
            return Err(Error::InvalidArgument(format!(
                "notification of {} bytes exceeds {}",
                notif.len(),
                multirail_proto::codec::MAX_NOTIF
            )));
        }
        let remote = self.resolve(remote)?;
        if op == Op::Write {
            for &(region, _, _) in &remote {
                if let Some(r) = self.regions.iter().find(|r| r.id == region) {
                    if r.access != multirail_proto::Access::ReadWrite {
                        return Err(Error::Remote {
                            peer: self.name.clone(),
                            status: Status::ReadOnly,
                            msg: format!("region {region} is exported read-only"),
                        });
                    }
                }
            }
        }
        let pairs = self.pair(&local, &remote)?;
        self.link()?;
        Ok(XferHandle(XferShared::new(op, self.clone(), pairs, notif, hold)))
    }
}

/// Binary search for a region containing [addr, addr+len), falling back to a scan when
/// regions overlap. Returns its index in `sorted`.
pub(crate) fn find_region<T>(sorted: &[T], addr: u64, len: u64, span: impl Fn(&T) -> (u64, u64)) -> Option<usize> {
    let end = addr.checked_add(len)?;
    let idx = sorted.partition_point(|r| span(r).0 <= addr);
    if idx > 0 {
        let (b, l) = span(&sorted[idx - 1]);
        if end <= b.saturating_add(l) {
            return Some(idx - 1);
        }
    }
    sorted[..idx].iter().rposition(|r| {
        let (b, l) = span(r);
        end <= b.saturating_add(l)
    })
}

/// [`find_region`] for runs of rows: the search is skipped while rows stay inside the region
/// last found and below the next region's base (where `find_region` would find it too).
pub(crate) struct Lookup {
    /// The region last found: index, base, end, and the base of the one after it.
    idx: usize,
    pub base: u64,
    end: u64,
    next: u64,
}

impl Lookup {
    pub fn new() -> Lookup {
        Lookup { idx: 0, base: u64::MAX, end: 0, next: 0 }
    }

    /// `find_region`'s answer, and whether it was searched for (the region changed) rather
    /// than the last one's again. `base` is the found region's base.
    #[inline]
    pub fn find<T>(&mut self, sorted: &[T], addr: u64, len: u64, span: impl Fn(&T) -> (u64, u64)) -> Option<(usize, bool)> {
        let end = addr.checked_add(len)?;
        if self.base <= addr && end <= self.end && addr < self.next {
            return Some((self.idx, false));
        }
        let k = find_region(sorted, addr, len, &span)?;
        let (b, l) = span(&sorted[k]);
        let next = sorted.get(k + 1).map_or(u64::MAX, |r| span(r).0);
        *self = Lookup { idx: k, base: b, end: b.saturating_add(l), next };
        Some((k, true))
    }
}

/// Resolve local descriptors against `regions` (sorted by base): every one must lie inside a
/// registered region. Returns the (addr, len) list and the regions to hold.
pub(crate) fn resolve_in<D: Desc>(regions: &[Arc<Region>], descs: &[D]) -> Result<ResolvedLocal> {
    let mut hold: Vec<Arc<Region>> = Vec::new();
    let mut out = Vec::with_capacity(descs.len());
    let mut look = Lookup::new();
    for (i, d) in descs.iter().enumerate() {
        let (addr, len) = d.span();
        let (k, fresh) = look.find(regions, addr, len, |r| (r.base, r.len)).ok_or(Error::NotRegistered { index: i, addr, len })?;
        if fresh && !hold.iter().any(|h| h.id == regions[k].id) {
            hold.push(regions[k].clone());
        }
        out.push((addr, len));
    }
    Ok((out, hold))
}

/// One rail's state and counters as reported to the caller.
#[derive(Debug, Clone)]
pub struct RailReport {
    pub name: String,
    pub local_addr: String,
    pub remote_addr: String,
    pub connections: usize,
    pub stats: RailStats,
    pub io: RailIoSnapshot,
}

struct Sent {
    req_id: u64,
    chunk: Chunk,
    xfer: Arc<XferShared>,
}

/// Who is reading a connection's responses (`Conn::owner`).
const OWNER_NONE: u8 = 0;
const OWNER_RECEIVER: u8 = 1;
const OWNER_CALLER: u8 = 2;
/// How long the receiver stays away while a caller drives its connection.
const CALLER_YIELD: Duration = Duration::from_micros(200);
/// For this long after a caller last drove a connection, the receiver leaves its responses to
/// callers ("parked"): it watches the socket for hang-up and its kick eventfd only, so a
/// response does not wake it too (on a busy host that wake-up preempts the very threads of the
/// round trip: measured, it was the whole 4 KiB p99). An asynchronous post, or a caller that
/// stops driving with requests still outstanding, kicks it back to reading.
const CALLER_GRACE: Duration = Duration::from_millis(50);

/// Wait up to `timeout` for `fd` to hang up or fail, or for `kick` to be written (data arriving
/// on `fd` does not end the wait). Returns (hung up, kicked).
fn park(fd: std::os::fd::RawFd, kick: std::os::fd::RawFd, timeout: Duration) -> (bool, bool) {
    let mut p = [libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 }, libc::pollfd { fd: kick, events: libc::POLLIN, revents: 0 }];
    // SAFETY: two valid pollfds.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, timeout.as_millis().clamp(1, i32::MAX as u128) as i32) };
    if r <= 0 {
        return (false, false);
    }
    let hup = p[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0;
    (hup, p[1].revents & libc::POLLIN != 0)
}

/// A non-blocking eventfd (a receiver's kick).
fn eventfd() -> Result<std::os::fd::OwnedFd> {
    // SAFETY: plain syscall; a valid fd it returns is owned by nobody else.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io("eventfd", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Why a reader stopped.
enum Stop {
    /// The link is shutting down.
    Shutdown,
    /// The connection failed: the reason.
    Failed(String),
    /// (Caller) nothing is outstanding on the connection.
    Idle,
    /// (Caller) its deadline passed.
    CallerTimeout,
}

/// Stall bookkeeping, shared by whoever reads the connection.
struct Clock {
    /// Last response (or idle moment).
    last: Instant,
    last_link_check: Instant,
}

/// The reading half of a connection: owned by the receiver thread or by a waiting caller.
struct Rx {
    s: TcpStream,
    inb: wire::Inbound,
    clock: Clock,
}

/// One TCP connection on one rail.
struct Conn {
    rail: usize,
    /// The socket's fd (for poll and TCP_INFO); owned by `rx.s`.
    fd: std::os::fd::RawFd,
    rx: Mutex<Rx>,
    /// OWNER_*: who may lock `rx` and read.
    owner: AtomicU8,
    /// When a caller last drove this connection (µs since `Link::epoch`).
    caller_at: AtomicU64,
    /// When the connection last went from no request outstanding to one (µs since `Link::epoch`).
    busy_at: AtomicU64,
    /// The reader that last let go of `rx` left bytes in its read-ahead (`wire::Inbound`):
    /// whole responses may be waiting there that no socket readiness will announce.
    stashed: AtomicBool,
    /// Callers' busy-poll budget on this connection (`Progress::Adaptive`).
    spin: wire::SpinBudget,
    /// Wakes a parked receiver (see `CALLER_GRACE`); `kicks` counts requests to, `parked` says
    /// whether the receiver sleeps on it (store-then-load on both sides, SeqCst).
    kick: std::os::fd::OwnedFd,
    kicks: AtomicU64,
    parked: AtomicBool,
    /// The nonce of this connection's `Hello`: the target knows it by this id (for `Fence`).
    id: [u8; 16],
    /// Carried a WRITE: must be fenced on the target if it dies.
    wrote: AtomicBool,
    writer: Mutex<TcpStream>,
    inflight: Mutex<VecDeque<Sent>>,
    inflight_n: AtomicUsize,
    next_req: AtomicU64,
    dead: AtomicBool,
}

impl Conn {
    /// Have the receiver read responses again (it may be parked, leaving them to callers).
    fn kick(&self) {
        self.kicks.fetch_add(1, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: an 8-byte write to our own eventfd; EAGAIN (counter full) is harmless.
            unsafe {
                libc::write(std::os::fd::AsRawFd::as_raw_fd(&self.kick), &one as *const u64 as *const libc::c_void, 8);
            }
        }
    }

    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        if let Ok(s) = self.writer.try_lock() {
            abort_socket(&s);
        }
    }
}

/// How long a busy connection may be quiet before its local link's carrier is checked.
const LINK_CHECK: Duration = Duration::from_millis(100);

/// Milliseconds since the kernel last received data on `fd` (TCP_INFO), if it can say.
fn ms_since_data(fd: std::os::fd::RawFd) -> Option<u32> {
    // SAFETY: `tcp_info` is plain old data; getsockopt writes at most `len` bytes into it.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let r = libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info as *mut libc::tcp_info as *mut libc::c_void, &mut len);
        (r == 0 && len as usize >= std::mem::size_of::<libc::tcp_info>()).then_some(info.tcpi_last_data_recv)
    }
}

/// Why the local interface `dev` cannot carry traffic (admin down or no carrier), if it cannot.
/// Interfaces without a carrier notion (loopback: operstate "unknown") always pass.
pub(crate) fn link_down(dev: &str) -> Option<String> {
    if dev.contains('/') || dev.starts_with('.') {
        return None;
    }
    let base = format!("/sys/class/net/{dev}");
    let oper = std::fs::read_to_string(format!("{base}/operstate")).ok()?;
    let oper = oper.trim();
    if oper == "down" || oper == "lowerlayerdown" || oper == "notpresent" {
        return Some(format!("link down: {dev} is {oper}"));
    }
    match std::fs::read_to_string(format!("{base}/carrier")) {
        Ok(c) if c.trim() == "0" => Some(format!("link down: {dev} has no carrier")),
        _ => None,
    }
}

/// Abort a connection now: discard what is still queued to send and reset it.
///
/// A plain shutdown keeps the send queue and appends a FIN, so after a link failure the kernel
/// would go on retransmitting queued WRITE requests and, once the link returned, the target
/// could apply a stale chunk after its reissue on another rail had already landed newer data.
/// `connect(AF_UNSPEC)` on a TCP socket is Linux's `tcp_disconnect`: it purges the queues and
/// sends a RST, for every handle that shares the socket.
pub(crate) fn abort_socket(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    let unspec = libc::sockaddr { sa_family: libc::AF_UNSPEC as libc::sa_family_t, sa_data: [0; 14] };
    // SAFETY: plain syscalls on a file descriptor we own, with correctly sized arguments.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
        libc::connect(fd, &unspec, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t);
    }
    let _ = s.shutdown(Shutdown::Both);
}

struct RailLink {
    local: Option<(String, IpAddr)>,
    remote: SocketAddr,
    remote_name: String,
    conns: RwLock<Vec<Arc<Conn>>>,
    live_receivers: AtomicUsize,
    /// Raw fds of the current connections, so a failure can shut all of them at once.
    fds: Mutex<Vec<TcpStream>>,
    probing: AtomicBool,
    /// Serialises readmission (the probe thread and a caller reviving a dead link).
    readmit: Mutex<()>,
    /// This rail's counters (shared with the `Peer`, so they outlive the link).
    io: Arc<RailIo>,
    /// First failure cause since the rail was last opened.
    failure: Mutex<Option<String>>,
}

struct Sched {
    planner: Planner,
    xfers: HashMap<XferId, Arc<XferShared>>,
    next_xfer: u64,
}

/// The live connections to one peer and the planner that stripes over them.
pub struct Link {
    peer_name: String,
    incarnation: u64,
    ctx: Arc<Ctx>,
    keys: HashMap<u64, RegionKey>,
    rails: Vec<RailLink>,
    sched: Mutex<Sched>,
    cond: Condvar,
    control: Mutex<Option<TcpStream>>,
    notify_tx: Mutex<Option<mpsc::Sender<Arc<XferShared>>>>,
    shutdown: AtomicBool,
    /// Set when the peer is known gone for good (restarted: stale metadata).
    fatal: Mutex<Option<Error>>,
    /// Shared with the [`Peer`]; see `Peer::unfenced`.
    unfenced: Arc<Mutex<Vec<[u8; 16]>>>,
    /// Shared with the [`Peer`].
    counters: Arc<PeerCounters>,
    /// Time base of `Conn::caller_at`.
    epoch: Instant,
    /// Threads that may touch registered memory through this link right now (senders,
    /// receivers, callers posting or driving a transfer); `close` waits until none is left.
    active: AtomicUsize,
}

/// One thread counted in `Link::active` (see [`Link::enter`]).
struct Active<'a>(&'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn rail_pairs(ctx: &Ctx, remote: &[RailInfo]) -> Vec<(usize, usize)> {
    if !ctx.cfg.rail_map.is_empty() {
        return ctx.cfg.rail_map.iter().copied().filter(|&(l, r)| l < ctx.rails.len() && r < remote.len()).collect();
    }
    let mut pairs = Vec::new();
    let mut used = vec![false; remote.len()];
    for (li, l) in ctx.rails.iter().enumerate() {
        let Some(la) = l.addr else { continue };
        let found = remote
            .iter()
            .enumerate()
            .find(|(ri, r)| !used[*ri] && r.addr.parse::<IpAddr>().is_ok_and(|ra| same_subnet(la, ra, l.prefix_len)));
        if let Some((ri, _)) = found {
            used[ri] = true;
            pairs.push((li, ri));
        }
    }
    if pairs.is_empty() && !remote.is_empty() {
        // No shared subnet (loopback default, routed fabric): pair by index.
        let n = ctx.rails.len().max(1).min(remote.len().max(ctx.rails.len()));
        for i in 0..n {
            pairs.push((i % ctx.rails.len().max(1), i % remote.len()));
        }
        pairs.dedup();
    }
    pairs
}

fn same_subnet(a: IpAddr, b: IpAddr, prefix: u8) -> bool {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) if prefix > 0 && prefix <= 32 => {
            let m = u32::MAX.checked_shl(32 - prefix as u32).unwrap_or(0);
            u32::from(a) & m == u32::from(b) & m
        }
        (IpAddr::V6(a), IpAddr::V6(b)) if prefix > 0 && prefix <= 128 => {
            let m = u128::MAX.checked_shl(128 - prefix as u32).unwrap_or(0);
            u128::from(a) & m == u128::from(b) & m
        }
        _ => false,
    }
}

/// Open one authenticated connection and check the peer is the life we have metadata for.
pub(crate) fn dial(
    ctx: &Ctx,
    local: Option<&(String, IpAddr)>,
    remote: SocketAddr,
    role: Role,
    expect: Option<(&str, u64)>,
) -> Result<TcpStream> {
    dial_id(ctx, local, remote, role, expect, ctx.cfg.timeout).map(|(s, _)| s)
}

/// [`dial`] with its own connect/handshake timeout; also returns the connection's id (the
/// nonce its `Hello` carried).
pub(crate) fn dial_id(
    ctx: &Ctx,
    local: Option<&(String, IpAddr)>,
    remote: SocketAddr,
    role: Role,
    expect: Option<(&str, u64)>,
    timeout: Duration,
) -> Result<(TcpStream, [u8; 16])> {
    let who = format!("{remote}");
    let domain = socket2::Domain::for_address(remote);
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP)).map_err(|e| Error::io("socket", e))?;
    if let Some((dev, addr)) = local {
        if ctx.bind_devices && !dev.is_empty() {
            // Needs CAP_NET_RAW; without it the source-address binding below still steers
            // traffic through per-rail policy routing.
            let _ = sock.bind_device(Some(dev.as_bytes()));
        }
        sock.bind(&SocketAddr::new(*addr, 0).into()).map_err(|e| Error::io(format!("bind to rail address {addr}"), e))?;
    }
    sock.connect_timeout(&remote.into(), timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => Error::PeerLost {
            peer: expect.map(|e| e.0.to_string()).unwrap_or(who.clone()),
            reason: format!("connection to {remote} refused"),
        },
        _ => Error::io(format!("connect to {remote}"), e),
    })?;
    let mut s: TcpStream = sock.into();
    s.set_nodelay(true).map_err(|e| Error::io("nodelay", e))?;
    s.set_read_timeout(Some(TICK)).map_err(|e| Error::io("timeout", e))?;
    s.set_write_timeout(Some(TICK)).map_err(|e| Error::io("timeout", e))?;
    let deadline = Instant::now() + timeout;
    let mut tick = |_: bool| if Instant::now() > deadline { Err(format!("handshake with {remote} timed out")) } else { Ok(()) };
    let nonce: [u8; 16] = random_bytes();
    let wire_err = |e: WireError| match e {
        WireError::Decode(source) => Error::Decode { who: who.clone(), source },
        WireError::GaveUp(m) => Error::Timeout(m),
        WireError::Io(e) => Error::PeerLost { peer: who.clone(), reason: format!("handshake: {e}") },
    };
    wire::send(&mut s, &Body::Hello { role, incarnation: ctx.incarnation, name: ctx.name.clone(), nonce }, 0, &mut tick)
        .map_err(wire_err)?;
    let (_, b) = wire::read_frame(&mut s, &mut tick).map_err(wire_err)?;
    let (auth_required, incarnation, server_nonce, server_name) = match b {
        Body::Challenge { auth_required, incarnation, nonce, name } => (auth_required, incarnation, nonce, name),
        Body::Error { status, msg } => return Err(status_error(&who, status, msg)),
        other => return Err(Error::Protocol { who, msg: format!("expected Challenge, got {:?}", other.kind()) }),
    };
    if let Some((name, inc)) = expect {
        if server_name != name {
            return Err(Error::Metadata(format!("{remote} is agent {server_name:?}, not {name:?}")));
        }
        if incarnation != inc {
            return Err(Error::StaleMetadata { peer: name.to_string(), cached: inc, current: incarnation });
        }
    }
    let mac = match (&ctx.cfg.secret, auth_required) {
        (Some(secret), true) => auth::client_proof(secret, &server_nonce, &nonce, &ctx.name),
        (None, true) => return Err(Error::Auth { who, msg: "peer requires a shared secret and none is configured".into() }),
        (Some(_), false) => {
            return Err(Error::Auth { who, msg: "peer does not authenticate but a shared secret is configured here".into() })
        }
        (None, false) => [0u8; 32],
    };
    wire::send(&mut s, &Body::Auth { mac }, 0, &mut tick).map_err(wire_err)?;
    let (_, b) = wire::read_frame(&mut s, &mut tick).map_err(wire_err)?;
    match b {
        Body::Welcome { mac } => {
            if let Some(secret) = &ctx.cfg.secret {
                if !auth::proofs_equal(&mac, &auth::server_proof(secret, &nonce, &server_nonce, &server_name)) {
                    return Err(Error::Auth { who, msg: "peer failed to prove the shared secret".into() });
                }
            }
        }
        Body::Error { status, msg } => return Err(status_error(&who, status, msg)),
        other => return Err(Error::Protocol { who, msg: format!("expected Welcome, got {:?}", other.kind()) }),
    }
    Ok((s, nonce))
}

pub(crate) fn status_error(who: &str, status: Status, msg: String) -> Error {
    match status {
        Status::AuthFailed => Error::Auth { who: who.into(), msg },
        Status::VersionMismatch => Error::Decode {
            who: who.into(),
            source: multirail_proto::DecodeError::VersionMismatch { got: 0, want: multirail_proto::codec::VERSION },
        },
        _ => Error::Remote { peer: who.into(), status, msg },
    }
}

impl Link {
    fn connect(peer: &Arc<Peer>) -> Result<Arc<Link>> {
        let ctx = peer.ctx.clone();
        let pairs = rail_pairs(&ctx, &peer.meta.rails);
        if pairs.is_empty() {
            return Err(Error::Metadata(format!("peer {:?} publishes no rail this agent can reach", peer.name)));
        }
        let mut planner = Planner::new(ctx.cfg.planner.clone());
        let now = Instant::now();
        let io = peer.rail_io(pairs.len());
        let mut rails = Vec::new();
        for &(li, ri) in &pairs {
            let l = &ctx.rails[li];
            let r = &peer.meta.rails[ri];
            let mut ip: IpAddr = r.addr.parse().map_err(|_| Error::Metadata(format!("bad rail address {:?}", r.addr)))?;
            if ip.is_unspecified() {
                ip = peer.addr_hint.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            }
            let speeds: Vec<u64> = [l.speed_mbps, r.speed_mbps].into_iter().filter(|s| *s > 0).collect();
            let hint = speeds.iter().min().map(|m| *m as f64 * 1e6 / 8.0);
            planner.add_rail(hint, now);
            rails.push(RailLink {
                local: l.addr.filter(|a| !a.is_unspecified()).map(|a| (l.device.clone(), a)),
                remote: SocketAddr::new(ip, r.port),
                remote_name: r.name.clone(),
                conns: RwLock::new(Vec::new()),
                live_receivers: AtomicUsize::new(0),
                fds: Mutex::new(Vec::new()),
                probing: AtomicBool::new(false),
                readmit: Mutex::new(()),
                io: io[rails.len()].clone(),
                failure: Mutex::new(None),
            });
        }
        let link = Arc::new(Link {
            peer_name: peer.name.clone(),
            incarnation: peer.meta.incarnation,
            ctx: ctx.clone(),
            keys: peer.keys.clone(),
            rails,
            sched: Mutex::new(Sched { planner, xfers: HashMap::new(), next_xfer: 1 }),
            cond: Condvar::new(),
            control: Mutex::new(None),
            notify_tx: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            fatal: Mutex::new(None),
            unfenced: peer.unfenced.clone(),
            counters: peer.counters.clone(),
            active: AtomicUsize::new(0),
            epoch: Instant::now(),
        });
        let mut first_err = None;
        let mut any = false;
        for ri in 0..link.rails.len() {
            match link.open_rail(ri, ctx.cfg.timeout) {
                Ok(()) => any = true,
                Err(e) => {
                    if matches!(e, Error::StaleMetadata { .. } | Error::Auth { .. } | Error::Metadata(_) | Error::Decode { .. }) {
                        link.close();
                        return Err(e);
                    }
                    let mut g = link.sched.lock().expect("sched lock");
                    g.planner.handle_rail_down(ri, format!("connect failed: {e}"), Instant::now());
                    drop(g);
                    link.start_probe(ri);
                    first_err.get_or_insert(e);
                }
            }
        }
        if !any {
            link.close();
            return Err(first_err.unwrap_or_else(|| Error::PeerLost { peer: peer.name.clone(), reason: "no rail could connect".into() }));
        }
        // Connections of an earlier link that died with WRITEs aboard must be fenced before
        // anything is written through this one.
        let live: Vec<usize> = (0..link.rails.len()).filter(|&r| link.rails[r].live_receivers.load(Ordering::Acquire) > 0).collect();
        if let Err(e) = link.fence_pending(&live) {
            link.close();
            return Err(e);
        }
        // Drain the RailDown events of rails that failed to connect.
        link.sched.lock().expect("sched lock").planner.poll_event();
        let (tx, rx) = mpsc::channel::<Arc<XferShared>>();
        *link.notify_tx.lock().expect("link lock") = Some(tx);
        let l2 = link.clone();
        std::thread::Builder::new()
            .name(format!("mr-notify-{}", peer.name))
            .spawn(move || {
                while let Ok(x) = rx.recv() {
                    let msg = x.notif.lock().expect("xfer lock").clone();
                    let r = l2.control_request(Body::Notif(msg));
                    x.finish(r);
                }
            })
            .map_err(|e| Error::io("spawn", e))?;
        Ok(link)
    }

    fn usable(&self) -> bool {
        !self.shutdown.load(Ordering::Acquire) && self.fatal.lock().expect("link lock").is_none()
    }

    /// Count the calling thread as one that may touch registered memory through this link;
    /// None once the link is shutting down. With `close` (which sets `shutdown`, then waits for
    /// `active` to reach zero) this is a store-then-load handshake on both sides (SeqCst):
    /// either `close` sees the count or the thread sees the shutdown.
    fn enter(&self) -> Option<Active<'_>> {
        self.active.fetch_add(1, Ordering::SeqCst);
        if self.shutdown.load(Ordering::SeqCst) {
            self.active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Active(&self.active))
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// True when no rail of the link has a live connection.
    fn all_down(&self) -> bool {
        self.rails.iter().all(|r| r.live_receivers.load(Ordering::Acquire) == 0)
    }

    /// A link whose every rail is down is probed now, from the caller's thread, rather than
    /// left to the background probe's backoff: a peer that restarted is found out (its new
    /// incarnation fails the handshake) and reported as stale at once, and one that came back
    /// is readmitted before the caller's transfer fails for want of a rail. One dial per rail,
    /// each bounded by `stall_timeout` (at least 200 ms, at most `timeout`).
    fn revive(self: &Arc<Self>) -> Result<()> {
        if !self.all_down() {
            return Ok(());
        }
        let per_try = self.ctx.cfg.planner.stall_timeout.max(Duration::from_millis(200)).min(self.ctx.cfg.timeout);
        for ri in 0..self.rails.len() {
            match self.readmit(ri, per_try) {
                Ok(_) => {}
                Err(e @ Error::StaleMetadata { .. }) => {
                    self.ctx.log(&format!("peer {}: {e}", self.peer_name));
                    *self.fatal.lock().expect("link lock") = Some(e.clone());
                    return Err(e);
                }
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Reconnect rail `ri` (fencing pending connections first) and readmit it. Ok(false) when
    /// it was already up. Serialised per rail, so the probe and a reviving caller never open
    /// a rail twice.
    fn readmit(self: &Arc<Self>, ri: usize, dial_timeout: Duration) -> Result<bool> {
        let _one = self.rails[ri].readmit.lock().expect("rail lock");
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Error::PeerLost { peer: self.peer_name.clone(), reason: "link closed".into() });
        }
        if self.rails[ri].live_receivers.load(Ordering::Acquire) > 0 {
            return Ok(false);
        }
        // Fence first: a rail is not readmitted while dead connections are unfenced.
        let mut via: Vec<usize> =
            (0..self.rails.len()).filter(|&r| r != ri && self.rails[r].live_receivers.load(Ordering::Acquire) > 0).collect();
        via.push(ri);
        self.fence_pending(&via)?;
        self.open_rail(ri, dial_timeout)?;
        self.rails[ri].io.readmissions.fetch_add(1, Ordering::Relaxed);
        let mut g = self.sched.lock().expect("sched lock");
        g.planner.handle_rail_up(ri, Instant::now());
        let done = self.drain_events(&mut g);
        drop(g);
        self.complete(done);
        self.cond.notify_all();
        Ok(true)
    }

    /// Open the configured number of connections on rail `ri` and start their threads.
    fn open_rail(self: &Arc<Self>, ri: usize, timeout: Duration) -> Result<()> {
        let rail = &self.rails[ri];
        let mut streams = Vec::new();
        for _ in 0..self.ctx.cfg.connections.max(1) {
            let expect = Some((self.peer_name.as_str(), self.incarnation));
            streams.push(dial_id(&self.ctx, rail.local.as_ref(), rail.remote, Role::Data, expect, timeout)?);
        }
        let mut conns = Vec::new();
        let mut fds = Vec::new();
        for (s, id) in streams {
            let reader = s.try_clone().map_err(|e| Error::io("clone socket", e))?;
            fds.push(s.try_clone().map_err(|e| Error::io("clone socket", e))?);
            let c = Arc::new(Conn {
                rail: ri,
                fd: std::os::fd::AsRawFd::as_raw_fd(&reader),
                rx: Mutex::new(Rx {
                    s: reader,
                    inb: wire::Inbound::new(),
                    clock: Clock { last: Instant::now(), last_link_check: Instant::now() },
                }),
                owner: AtomicU8::new(OWNER_NONE),
                caller_at: AtomicU64::new(0),
                busy_at: AtomicU64::new(0),
                stashed: AtomicBool::new(false),
                spin: wire::SpinBudget::new(self.ctx.cfg.spin),
                kick: eventfd()?,
                kicks: AtomicU64::new(0),
                parked: AtomicBool::new(false),
                id,
                wrote: AtomicBool::new(false),
                writer: Mutex::new(s),
                inflight: Mutex::new(VecDeque::new()),
                inflight_n: AtomicUsize::new(0),
                next_req: AtomicU64::new(1),
                dead: AtomicBool::new(false),
            });
            rail.live_receivers.fetch_add(1, Ordering::AcqRel);
            let (l1, c1) = (self.clone(), c.clone());
            std::thread::Builder::new().name(format!("mr-recv-{ri}")).spawn(move || l1.receiver(c1)).map_err(|e| Error::io("spawn", e))?;
            let (l2, c2) = (self.clone(), c.clone());
            std::thread::Builder::new().name(format!("mr-send-{ri}")).spawn(move || l2.sender(c2)).map_err(|e| Error::io("spawn", e))?;
            conns.push(c);
        }
        *rail.fds.lock().expect("rail lock") = fds;
        *rail.conns.write().expect("rail lock") = conns;
        Ok(())
    }

    fn submit(self: &Arc<Self>, x: Arc<XferShared>, will_drive: bool) -> Result<()> {
        if !self.usable() {
            return Err(Error::PeerLost { peer: self.peer_name.clone(), reason: "link closed".into() });
        }
        let mut g = self.sched.lock().expect("sched lock");
        let id = XferId(g.next_xfer);
        g.next_xfer += 1;
        x.current.store(id.0, Ordering::Release);
        g.xfers.insert(id, x.clone());
        g.planner.submit(id, x.pairs.as_ref().clone(), Instant::now());
        let done = self.drain_events(&mut g);
        drop(g);
        self.complete(done);
        // Post the first chunks from this thread: saves a wakeup on the latency path. The
        // senders are woken only if some connection ran out of window with work left.
        let Some(_active) = self.enter() else { return Ok(()) };
        let mut need_senders = false;
        for rail in &self.rails {
            let conns = rail.conns.read().expect("rail lock").clone();
            for c in conns {
                need_senders |= self.pump(&c);
                if !will_drive && c.inflight_n.load(Ordering::Acquire) > 0 {
                    c.kick();
                }
            }
        }
        if need_senders {
            self.cond.notify_all();
        }
        Ok(())
    }

    fn cancel(&self, x: &Arc<XferShared>) {
        let id = XferId(x.current.load(Ordering::Acquire));
        let mut g = self.sched.lock().expect("sched lock");
        g.planner.cancel(id);
        g.xfers.remove(&id);
        drop(g);
        // Wait until no connection still holds a chunk of this transfer.
        let deadline = Instant::now() + self.ctx.cfg.planner.stall_timeout + Duration::from_secs(1);
        while Instant::now() < deadline {
            let busy = self.rails.iter().any(|r| {
                r.conns
                    .read()
                    .expect("rail lock")
                    .iter()
                    .any(|c| c.inflight.lock().expect("conn lock").iter().any(|s| Arc::ptr_eq(&s.xfer, x)))
            });
            if !busy {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Planner events -> transfer outcomes (applied by `complete` outside the lock).
    fn drain_events(&self, g: &mut Sched) -> Vec<(Arc<XferShared>, Result<()>)> {
        let mut out = Vec::new();
        while let Some(ev) = g.planner.poll_event() {
            match ev {
                Event::XferDone(id) => {
                    if let Some(x) = g.xfers.remove(&id) {
                        out.push((x, Ok(())));
                    }
                }
                Event::XferFailed { xfer, reason } => {
                    if let Some(x) = g.xfers.remove(&xfer) {
                        out.push((x, Err(Error::PeerLost { peer: self.peer_name.clone(), reason })));
                    }
                }
                Event::RailDown { rail, reason } => {
                    self.ctx.log(&format!("peer {}: rail {rail} down: {reason}", self.peer_name));
                }
                Event::RailUp(rail) => self.ctx.log(&format!("peer {}: rail {rail} up again", self.peer_name)),
            }
        }
        out
    }

    fn complete(&self, done: Vec<(Arc<XferShared>, Result<()>)>) {
        for (x, r) in done {
            let has_notif = r.is_ok() && !x.notif.lock().expect("xfer lock").is_empty();
            if has_notif {
                if let Some(tx) = self.notify_tx.lock().expect("link lock").as_ref() {
                    if tx.send(x.clone()).is_ok() {
                        continue;
                    }
                }
                x.finish(Err(Error::PeerLost {
                    peer: self.peer_name.clone(),
                    reason: "link closed before the notification was sent".into(),
                }));
            } else {
                x.finish(r);
            }
        }
    }

    /// Send chunks on `c` while the planner has work for its rail and the connection has room.
    /// Returns true when it stopped with work possibly left (window full, planner refused).
    fn pump(&self, c: &Arc<Conn>) -> bool {
        loop {
            if c.dead.load(Ordering::Acquire) {
                return false;
            }
            if c.inflight_n.load(Ordering::Acquire) >= self.ctx.cfg.conn_window {
                return true;
            }
            let mut g = self.sched.lock().expect("sched lock");
            let Some(chunk) = g.planner.poll_work(c.rail, Instant::now()) else {
                // Nothing for this rail now (or its rail window is full): completions wake the
                // senders when that changes.
                return false;
            };
            let Some(x) = g.xfers.get(&chunk.xfer).cloned() else {
                // Cannot happen: the planner only hands out chunks of transfers in `xfers`.
                g.planner.cancel(chunk.xfer);
                return false;
            };
            drop(g);
            self.send_chunk(c, chunk, x);
        }
    }

    fn send_chunk(&self, c: &Arc<Conn>, chunk: Chunk, x: Arc<XferShared>) {
        let key = self.keys.get(&chunk.piece.region).copied().unwrap_or(RegionKey([0; 16]));
        let op = RemoteOp { region: chunk.piece.region, key, offset: chunk.piece.offset, len: chunk.piece.len };
        let write = x.op == Op::Write;
        let body = if write { Body::WriteReq(op) } else { Body::ReadReq(op) };
        let mut w = c.writer.lock().expect("conn lock");
        if write && !c.wrote.load(Ordering::Relaxed) {
            // Before the first byte: from now on this connection's death needs a fence.
            c.wrote.store(true, Ordering::Release);
        }
        let req_id = c.next_req.fetch_add(1, Ordering::Relaxed);
        c.inflight.lock().expect("conn lock").push_back(Sent { req_id, chunk, xfer: x });
        if c.inflight_n.fetch_add(1, Ordering::AcqRel) == 0 {
            // Idle until now: the stall clock starts here, however long ago a reader last
            // looked (a parked receiver does not keep `Clock::last` fresh while idle).
            c.busy_at.store(self.now_us(), Ordering::Release);
        }
        let hdr = body.encode(req_id);
        let stall = self.ctx.cfg.planner.stall_timeout;
        let t0 = Instant::now();
        let mut tick = |_: bool| {
            if self.shutdown.load(Ordering::Acquire) || c.dead.load(Ordering::Acquire) {
                Err("connection closed".to_string())
            } else if t0.elapsed() > stall {
                Err(format!("send stalled for {stall:?}"))
            } else {
                Ok(())
            }
        };
        let r = if write {
            // SAFETY: the pair lies inside a local region registered with this agent (checked
            // when the handle was made) and held by the transfer (`hold`) until it is released.
            let payload = unsafe { std::slice::from_raw_parts(chunk.piece.local as *const u8, chunk.piece.len as usize) };
            wire::write_full(&mut w, &[&hdr, payload], &mut tick)
        } else {
            wire::write_full(&mut w, &[&hdr], &mut tick)
        };
        if let Err(e) = r {
            // Record why (the first cause names the rail's failure), shut the rail's
            // connections; the receivers notice and run the rail-down path.
            let was_dead = c.dead.swap(true, Ordering::AcqRel);
            abort_socket(&w);
            drop(w);
            if !was_dead && !self.shutdown.load(Ordering::Acquire) {
                self.rail_failed(c.rail, format!("send failed: {e}"));
            }
        }
    }

    fn sender(self: Arc<Self>, c: Arc<Conn>) {
        let Some(_active) = self.enter() else { return };
        let mut g = self.sched.lock().expect("sched lock");
        loop {
            if self.shutdown.load(Ordering::Acquire) || c.dead.load(Ordering::Acquire) {
                return;
            }
            if c.inflight_n.load(Ordering::Acquire) < self.ctx.cfg.conn_window {
                if let Some(chunk) = g.planner.poll_work(c.rail, Instant::now()) {
                    let x = g.xfers.get(&chunk.xfer).cloned();
                    drop(g);
                    if let Some(x) = x {
                        self.send_chunk(&c, chunk, x);
                        if c.owner.load(Ordering::Acquire) != OWNER_CALLER {
                            // No caller is reading this connection now (one that leaves with
                            // requests outstanding kicks on its way out): a parked receiver
                            // must read this chunk's response.
                            c.kick();
                        }
                    }
                    g = self.sched.lock().expect("sched lock");
                    continue;
                }
            }
            // Polling and sleeping under one lock hold: no wakeup is lost in between.
            g = self.cond.wait_timeout(g, Duration::from_millis(100)).expect("sched lock").0;
        }
    }

    fn receiver(self: Arc<Self>, c: Arc<Conn>) {
        let reason = match self.enter() {
            Some(_active) => self.receive_loop(&c),
            None => None,
        };
        c.dead.store(true, Ordering::Release);
        {
            // Waits for a caller that is still reading this connection (it sees `dead`).
            let rx = c.rx.lock().expect("rx lock");
            if reason.is_some() {
                abort_socket(&rx.s);
            } else {
                let _ = rx.s.shutdown(Shutdown::Both);
            }
        }
        if let Some(reason) = reason {
            self.rail_failed(c.rail, reason);
        }
        let rail = &self.rails[c.rail];
        // Under the readmit lock: a rail is never readmitted between its last receiver stopping
        // and the planner learning that it is down.
        let _one = rail.readmit.lock().expect("rail lock");
        if rail.live_receivers.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Last receiver of this rail: nothing on it touches local memory any more. Its
            // chunks can be reissued elsewhere once the target has fenced the connections that
            // carried WRITEs (frames still queued in the dead path must never land after the
            // reissue).
            let shutting = self.shutdown.load(Ordering::Acquire);
            let reason = if shutting { "link closed".to_string() } else { "connections lost".to_string() };
            let reason = rail.failure.lock().expect("rail lock").take().unwrap_or(reason);
            if !shutting {
                let ids: Vec<[u8; 16]> =
                    rail.conns.read().expect("rail lock").iter().filter(|c| c.wrote.load(Ordering::Acquire)).map(|c| c.id).collect();
                self.unfenced.lock().expect("fence lock").extend(ids);
                let others: Vec<usize> =
                    (0..self.rails.len()).filter(|&r| r != c.rail && self.rails[r].live_receivers.load(Ordering::Acquire) > 0).collect();
                if let Err(e) = self.fence_pending(&others) {
                    if !others.is_empty() {
                        // Other rails are carrying data, and the target might still apply this
                        // rail's stale WRITEs over what they write: stop everything. The next
                        // link fences first.
                        let why = format!("rail {} failed ({reason}) and its connections could not be fenced: {e}", c.rail);
                        self.ctx.log(&format!("peer {}: {why}", self.peer_name));
                        self.close_with(&why);
                        return;
                    }
                    // No rail left: the transfers fail below, and nothing is written again
                    // before a probe has fenced (see `start_probe`).
                }
            }
            let mut g = self.sched.lock().expect("sched lock");
            g.planner.handle_rail_down(c.rail, reason, Instant::now());
            let done = self.drain_events(&mut g);
            drop(g);
            self.complete(done);
            self.cond.notify_all();
            if !self.shutdown.load(Ordering::Acquire) {
                self.start_probe(c.rail);
            }
        }
    }

    /// The receiver thread: waits for the socket to become readable without holding the
    /// connection's reader, then reads responses while requests are outstanding. A caller
    /// blocked in `wait` on a transfer of this connection may own the reader instead
    /// (caller-driven completion, see `drive`); the receiver then stays out of its way.
    /// Returns the failure reason, or None on orderly shutdown.
    fn receive_loop(&self, c: &Arc<Conn>) -> Option<String> {
        let fd = c.fd;
        let kick_fd = std::os::fd::AsRawFd::as_raw_fd(&c.kick);
        let mut seen_kicks = 0u64;
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return None;
            }
            if c.dead.load(Ordering::Acquire) {
                return Some("connection shut".into());
            }
            if c.owner.load(Ordering::Acquire) == OWNER_CALLER {
                // A caller is reading; look again shortly (no handoff signal on its path).
                std::thread::sleep(CALLER_YIELD);
                continue;
            }
            let since_caller = self.now_us().saturating_sub(c.caller_at.load(Ordering::Acquire));
            if since_caller < CALLER_GRACE.as_micros() as u64 {
                // Callers are driving this connection round trip after round trip: stay out of
                // their way until kicked, the socket hangs up (read below, which sees the
                // failure), or the grace period ends.
                c.parked.store(true, Ordering::SeqCst);
                let (hup, kicked) = if c.kicks.load(Ordering::SeqCst) != seen_kicks {
                    (false, true)
                } else {
                    park(fd, kick_fd, CALLER_GRACE.saturating_sub(Duration::from_micros(since_caller)))
                };
                c.parked.store(false, Ordering::SeqCst);
                if kicked {
                    seen_kicks = c.kicks.load(Ordering::SeqCst);
                    let mut buf = 0u64;
                    // SAFETY: an 8-byte read from our own non-blocking eventfd (drains it).
                    unsafe {
                        libc::read(kick_fd, &mut buf as *mut u64 as *mut libc::c_void, 8);
                    }
                } else if !hup {
                    continue;
                }
            }
            // Responses a caller read ahead but left unprocessed are as readable as the socket.
            let readable = c.stashed.load(Ordering::Acquire) || poll_in(fd, TICK);
            if c.owner.compare_exchange(OWNER_NONE, OWNER_RECEIVER, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue;
            }
            let mut rx = c.rx.lock().expect("rx lock");
            // A caller may have read what woke us: only read what is still there (a read with
            // nothing to come would hold the reader from the next waiting caller).
            let r = if rx.inb.unread() > 0 || (readable && poll_in(fd, Duration::ZERO)) {
                // Read while requests are outstanding; hand the reader back when idle so a
                // waiting caller can drive the next round trip itself.
                loop {
                    match self.read_one(c, &mut rx, None) {
                        Ok(()) if c.inflight_n.load(Ordering::Acquire) > 0 => {}
                        Ok(()) => break Ok(()),
                        Err(e) => break Err(e),
                    }
                }
            } else {
                self.quiet_checks(c, &mut rx.clock, false)
            };
            c.stashed.store(rx.inb.unread() > 0, Ordering::Release);
            drop(rx);
            c.owner.store(OWNER_NONE, Ordering::Release);
            match r {
                Ok(()) => {}
                Err(Stop::Shutdown) => return None,
                Err(Stop::Failed(e)) => return Some(e),
                Err(Stop::Idle) | Err(Stop::CallerTimeout) => {}
            }
        }
    }

    /// Deadline, stall and link checks for a reader with nothing to read right now.
    fn quiet_checks(&self, c: &Conn, clock: &mut Clock, started: bool) -> Result<(), Stop> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Stop::Shutdown);
        }
        if c.dead.load(Ordering::Acquire) {
            return Err(Stop::Failed("connection shut".into()));
        }
        let busy = started || c.inflight_n.load(Ordering::Acquire) > 0;
        if !busy {
            clock.last = Instant::now();
            return Ok(());
        }
        // Quiet since the last response, or since the connection last became busy if later.
        let busy_for = Duration::from_micros(self.now_us().saturating_sub(c.busy_at.load(Ordering::Acquire)));
        let quiet = clock.last.elapsed().min(busy_for);
        // A local link that lost carrier is dead now; no need to wait for the stall.
        if quiet > LINK_CHECK && clock.last_link_check.elapsed() > LINK_CHECK {
            clock.last_link_check = Instant::now();
            if let Some(why) = self.rails[c.rail].local.as_ref().map(|l| l.0.as_str()).filter(|d| !d.is_empty()).and_then(link_down) {
                return Err(Stop::Failed(why));
            }
        }
        // Stalled = no byte received (not merely no whole response: a large chunk on a slow
        // rail is progress) for `stall_timeout` with requests outstanding.
        let stall = self.ctx.cfg.planner.stall_timeout;
        if quiet > stall && ms_since_data(c.fd).is_none_or(|ms| Duration::from_millis(ms as u64) >= stall) {
            self.rails[c.rail].io.stalls.fetch_add(1, Ordering::Relaxed);
            return Err(Stop::Failed(format!("stalled: no data for {stall:?}")));
        }
        Ok(())
    }

    /// Read and complete one response on `c`. `caller`: a waiting caller's deadline; such a
    /// reader also stops (between frames only) when nothing is outstanding or time is up.
    fn read_one(&self, c: &Arc<Conn>, rx: &mut Rx, caller: Option<Option<Instant>>) -> Result<(), Stop> {
        let Rx { s, inb, clock } = rx;
        let mut stop: Option<Stop> = None;
        // Runs every TICK while the socket has nothing to read.
        let mut tick = |started: bool| -> Result<(), String> {
            let r = match caller {
                Some(_) if !started && c.inflight_n.load(Ordering::Acquire) == 0 => Err(Stop::Idle),
                Some(Some(d)) if !started && Instant::now() >= d => Err(Stop::CallerTimeout),
                _ => self.quiet_checks(c, clock, started),
            };
            r.map_err(|e| {
                stop = Some(e);
                String::new()
            })
        };
        // The response answers the oldest request (TCP keeps order). When a READ is already
        // queued (pipelined bulk), land header and payload with one scatter read; on an idle
        // connection the read-ahead takes the response whole and the payload lands after.
        let front = c.inflight.lock().expect("conn lock").front().map(|f| (f.chunk.piece, f.xfer.op));
        let dst = match front {
            // SAFETY: registered local memory held by the transfer (see `send_chunk`).
            Some((p, Op::Read)) => Some(unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) }),
            _ => None,
        };
        let failed = |e: WireError, stop: &mut Option<Stop>| stop.take().unwrap_or_else(|| Stop::Failed(e.to_string()));
        let (h, body, mut landed) = match inb.read_response_into(s, dst, &mut tick) {
            Ok(f) => f,
            Err(e) => return Err(failed(e, &mut stop)),
        };
        if front.is_none() {
            let late = c.inflight.lock().expect("conn lock").front().map(|f| (f.chunk.piece, f.xfer.op));
            if let (Some((p, Op::Read)), Body::Resp { status: Status::Ok, bulk_len, .. }) = (late, &body) {
                if *bulk_len == p.len {
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) };
                    if let Err(e) = inb.read_into(s, dst, &mut tick) {
                        return Err(failed(e, &mut stop));
                    }
                    landed = true;
                }
            }
        }
        clock.last = Instant::now();
        let proto = |m: String| Err(Stop::Failed(m));
        let (status, bulk_len, msg) = match body {
            Body::Resp { status, bulk_len, msg } => (status, bulk_len, msg),
            Body::Error { status, msg } => return proto(format!("peer closed the connection: {status:?}: {msg}")),
            other => return proto(format!("protocol error: unexpected {:?} on a data connection", other.kind())),
        };
        let Some(sent) = c.inflight.lock().expect("conn lock").pop_front() else {
            return proto("protocol error: response with no request outstanding".into());
        };
        if sent.req_id != h.req_id {
            return proto(format!("protocol error: response to request {} while {} was next", h.req_id, sent.req_id));
        }
        let ok = status == Status::Ok;
        if ok && sent.xfer.op == Op::Read && !landed {
            return proto(format!("protocol error: READ of {} bytes answered with {bulk_len}", sent.chunk.piece.len));
        } else if (!ok || sent.xfer.op == Op::Write) && bulk_len != 0 {
            return proto("protocol error: bulk data on a refused or WRITE response".into());
        }
        c.inflight_n.fetch_sub(1, Ordering::AcqRel);
        let now = Instant::now();
        let mut g = self.sched.lock().expect("sched lock");
        if ok {
            let io = &self.rails[c.rail].io;
            let (bytes, chunks) = match sent.xfer.op {
                Op::Read => (&io.bytes_read, &io.chunks_read),
                Op::Write => (&io.bytes_written, &io.chunks_written),
            };
            bytes.fetch_add(sent.chunk.piece.len, Ordering::Relaxed);
            chunks.fetch_add(1, Ordering::Relaxed);
            g.planner.handle_done(sent.chunk.id, now);
        } else {
            sent.xfer.set_cause(Error::Remote { peer: self.peer_name.clone(), status, msg: msg.clone() });
            g.planner.handle_failed(sent.chunk.id, msg, now);
        }
        let done = self.drain_events(&mut g);
        // Wake the senders only when there is work left; an idle completion (the common case
        // for small transfers) costs no extra thread wakeups.
        let more = !g.planner.is_idle();
        drop(g);
        self.complete(done);
        if more {
            self.cond.notify_all();
        }
        Ok(())
    }

    /// Caller-driven completion: the thread waiting for `x` reads its responses itself, as a
    /// ping-pong client would, instead of being woken by the receiver thread (one thread
    /// wakeup per round trip instead of two). Only when `x` has a chunk in flight on a
    /// connection whose reader is free; returns whether `x` is finished. `poll_only`: read only
    /// what has already arrived (progress from `check_xfer_state`), never block for more.
    pub(crate) fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        let Some(_active) = self.enter() else { return false };
        for rail in &self.rails {
            let conns = rail.conns.read().expect("rail lock");
            let Some(c) = conns.iter().find(|c| {
                !c.dead.load(Ordering::Acquire)
                    && c.inflight_n.load(Ordering::Acquire) > 0
                    && c.inflight.lock().expect("conn lock").iter().any(|s| std::ptr::eq(Arc::as_ptr(&s.xfer), x))
            }) else {
                continue;
            };
            let c = c.clone();
            drop(conns);
            if c.owner.compare_exchange(OWNER_NONE, OWNER_CALLER, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return false;
            }
            let Ok(mut rx) = c.rx.try_lock() else {
                c.owner.store(OWNER_NONE, Ordering::Release);
                return false;
            };
            c.caller_at.store(self.now_us(), Ordering::Release);
            let mut failure = None;
            let mine = |c: &Conn| c.inflight.lock().expect("conn lock").iter().any(|s| std::ptr::eq(Arc::as_ptr(&s.xfer), x));
            while x.state() == XferState::InProgress {
                // Read-ahead may already hold the next responses: they count as arrived.
                if poll_only && rx.inb.unread() == 0 && !poll_in(c.fd, Duration::ZERO) {
                    break;
                }
                if !poll_only && !mine(&c) {
                    // The rest of `x` is on other connections: their readers finish it.
                    break;
                }
                if !poll_only && rx.inb.unread() == 0 {
                    if let Err(e) = self.spin_for_response(&c, &mut rx.clock, deadline) {
                        if let Stop::Failed(e) = e {
                            failure = Some(e);
                        }
                        break;
                    }
                }
                match self.read_one(&c, &mut rx, Some(deadline)) {
                    Ok(()) => {}
                    Err(Stop::Failed(e)) => {
                        failure = Some(e);
                        break;
                    }
                    Err(_) => break,
                }
            }
            if failure.is_some() {
                c.dead.store(true, Ordering::Release);
                abort_socket(&rx.s);
            }
            // Responses read ahead for other transfers are left in the stash: the receiver (kicked
            // below, as requests are outstanding) must not wait for the socket to get them.
            c.stashed.store(rx.inb.unread() > 0, Ordering::Release);
            drop(rx);
            c.caller_at.store(self.now_us(), Ordering::Release);
            c.owner.store(OWNER_NONE, Ordering::Release);
            if c.inflight_n.load(Ordering::Acquire) > 0 {
                // Responses are still due and this caller is leaving: the receiver reads them.
                c.kick();
            }
            if let Some(e) = failure {
                // The receiver sees the connection dead and runs the rail-down path.
                self.rail_failed(c.rail, e);
            }
            return x.state() != XferState::InProgress;
        }
        false
    }

    /// Busy-poll `c` for the next response before the read that would sleep in the kernel, as
    /// `Config::progress` says: not at all (`Block`), up to `spin` (`Adaptive`), or until the
    /// caller's deadline (`Poll`). The stall, link and shutdown checks keep running meanwhile;
    /// the spin ends early when nothing is outstanding on `c`.
    fn spin_for_response(&self, c: &Conn, clock: &mut Clock, deadline: Option<Instant>) -> Result<(), Stop> {
        let cfg = &self.ctx.cfg;
        let budget = match cfg.progress {
            Progress::Block => return Ok(()),
            Progress::Adaptive => c.spin.get(),
            Progress::Poll => deadline.map_or(Duration::from_secs(3600), |d| d.saturating_duration_since(Instant::now())),
        };
        let how = wire::spin_readable(c.fd, budget, || {
            if c.inflight_n.load(Ordering::Acquire) == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            self.quiet_checks(c, clock, false).map(|_| true)
        })?;
        c.spin.record(how);
        Ok(())
    }

    /// Shut every connection of a rail so all its receivers stop.
    fn rail_failed(&self, ri: usize, reason: String) {
        let rail = &self.rails[ri];
        self.ctx.log(&format!("peer {}: rail {ri} ({}) failed: {reason}", self.peer_name, rail.remote));
        // Dead connections take no new chunks; chunks in flight are requeued when the last
        // receiver of the rail has stopped (see `receiver`).
        rail.failure.lock().expect("rail lock").get_or_insert(reason);
        for c in rail.conns.read().expect("rail lock").iter() {
            c.dead.store(true, Ordering::Release);
        }
        for s in rail.fds.lock().expect("rail lock").iter() {
            abort_socket(s);
        }
    }

    /// Reconnect a down rail in the background and readmit it.
    fn start_probe(self: &Arc<Self>, ri: usize) {
        if self.rails[ri].probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let l = self.clone();
        let _ = std::thread::Builder::new().name(format!("mr-probe-{ri}")).spawn(move || {
            let mut backoff = Duration::from_millis(200);
            let dev = l.rails[ri].local.as_ref().map(|x| x.0.clone()).filter(|d| !d.is_empty());
            let dial_timeout = l.ctx.cfg.timeout.min(FENCE_TIMEOUT);
            while !l.shutdown.load(Ordering::Acquire) {
                std::thread::sleep(backoff);
                if l.shutdown.load(Ordering::Acquire) || l.rails[ri].live_receivers.load(Ordering::Acquire) > 0 {
                    break;
                }
                if dev.as_deref().and_then(link_down).is_some() {
                    // The local link is still down: watch it closely (cheap) instead of dialing.
                    backoff = LINK_CHECK;
                    continue;
                }
                match l.readmit(ri, dial_timeout) {
                    Ok(_) => break,
                    Err(e @ Error::StaleMetadata { .. }) => {
                        l.ctx.log(&format!("peer {}: {e}", l.peer_name));
                        *l.fatal.lock().expect("link lock") = Some(e);
                        break;
                    }
                    Err(_) => backoff = (backoff * 2).min(Duration::from_secs(2)),
                }
            }
            l.rails[ri].probing.store(false, Ordering::Release);
        });
    }

    /// Have the peer fence every connection in `unfenced`, over a fresh connection on the first
    /// of `via` that works. Ok when there was nothing to fence.
    fn fence_pending(&self, via: &[usize]) -> Result<()> {
        let ids: Vec<[u8; 16]> = self.unfenced.lock().expect("fence lock").clone();
        if ids.is_empty() {
            return Ok(());
        }
        let timeout = self.ctx.cfg.timeout.min(FENCE_TIMEOUT);
        let mut last = Error::PeerLost { peer: self.peer_name.clone(), reason: "no live rail to send a fence on".into() };
        for &ri in via {
            let rail = &self.rails[ri];
            let t0 = Instant::now();
            let r = dial_id(&self.ctx, rail.local.as_ref(), rail.remote, Role::Control, Some((&self.peer_name, self.incarnation)), timeout)
                .and_then(|(mut s, _)| {
                    let deadline = Instant::now() + timeout;
                    let mut tick = |_: bool| if Instant::now() > deadline { Err("fence timed out".to_string()) } else { Ok(()) };
                    for part in ids.chunks(multirail_proto::codec::MAX_FENCE) {
                        let r =
                            wire::send(&mut s, &Body::Fence(part.to_vec()), 0, &mut tick).and_then(|_| wire::read_frame(&mut s, &mut tick));
                        match r {
                            Ok((_, Body::Resp { status: Status::Ok, .. })) => {}
                            Ok((_, Body::Resp { status, msg, .. })) | Ok((_, Body::Error { status, msg })) => {
                                return Err(status_error(&self.peer_name, status, msg))
                            }
                            Ok((_, other)) => {
                                return Err(Error::Protocol {
                                    who: self.peer_name.clone(),
                                    msg: format!("unexpected {:?} in answer to a fence", other.kind()),
                                })
                            }
                            Err(e) => return Err(Error::PeerLost { peer: self.peer_name.clone(), reason: format!("fence: {e}") }),
                        }
                    }
                    let _ = s.shutdown(Shutdown::Both);
                    Ok(())
                });
            match r {
                Ok(()) => {
                    self.unfenced.lock().expect("fence lock").retain(|id| !ids.contains(id));
                    self.counters.fenced_connections.fetch_add(ids.len() as u64, Ordering::Relaxed);
                    self.ctx.log(&format!(
                        "peer {}: fenced {} dead connection(s) via rail {ri} in {:?}",
                        self.peer_name,
                        ids.len(),
                        t0.elapsed()
                    ));
                    return Ok(());
                }
                Err(e @ Error::StaleMetadata { .. }) => {
                    // The peer restarted: none of the old connections exist any more.
                    self.unfenced.lock().expect("fence lock").retain(|id| !ids.contains(id));
                    return Err(e);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// One request/response on the control connection (notifications), failing over between
    /// rails: each try gets `stall_timeout` (at least 200 ms) for its answer; a rail that does
    /// not answer, or whose local link is down, is left for the next one, until the agent's
    /// `timeout`. A notification whose answer was lost may thus arrive twice (at least once).
    fn control_request(&self, body: Body) -> Result<()> {
        let who = self.peer_name.clone();
        let overall = Instant::now() + self.ctx.cfg.timeout;
        let per_try = self.ctx.cfg.planner.stall_timeout.max(Duration::from_millis(200)).min(self.ctx.cfg.timeout);
        let mut g = self.control.lock().expect("control lock");
        let mut last: Option<Error> = None;
        let mut tries = 0usize;
        while Instant::now() < overall {
            tries += 1;
            if g.is_none() {
                // Rails whose local link is up, those still carrying data first.
                let up = |r: &RailLink| r.local.as_ref().map(|l| l.0.as_str()).filter(|d| !d.is_empty()).and_then(link_down).is_none();
                let mut order: Vec<usize> = (0..self.rails.len()).filter(|&r| up(&self.rails[r])).collect();
                order.sort_by_key(|&r| self.rails[r].live_receivers.load(Ordering::Acquire) == 0);
                if order.is_empty() {
                    order = (0..self.rails.len()).collect();
                }
                let ri = order[(tries - 1) % order.len()];
                let rail = &self.rails[ri];
                let expect = Some((self.peer_name.as_str(), self.incarnation));
                match dial_id(&self.ctx, rail.local.as_ref(), rail.remote, Role::Control, expect, per_try) {
                    Ok((s, _)) => *g = Some(s),
                    Err(e @ (Error::StaleMetadata { .. } | Error::Auth { .. } | Error::Metadata(_))) => return Err(e),
                    Err(e) => {
                        last = Some(e);
                        continue;
                    }
                }
            }
            let s = g.as_mut().expect("connected");
            let deadline = Instant::now() + per_try;
            let mut tick =
                |_: bool| if Instant::now() > deadline { Err("no answer on the control connection".to_string()) } else { Ok(()) };
            let r = wire::send(s, &body, 0, &mut tick).and_then(|_| wire::read_frame(s, &mut tick));
            match r {
                Ok((_, Body::Resp { status: Status::Ok, .. })) => return Ok(()),
                Ok((_, Body::Resp { status, msg, .. })) | Ok((_, Body::Error { status, msg })) => {
                    *g = None;
                    return Err(status_error(&who, status, msg));
                }
                Ok((_, other)) => {
                    *g = None;
                    return Err(Error::Protocol { who, msg: format!("unexpected {:?} on the control connection", other.kind()) });
                }
                Err(e) => {
                    // Dead or silent path: drop this connection (purging what is queued on it)
                    // and try the next rail.
                    if let Some(s) = g.take() {
                        abort_socket(&s);
                    }
                    last = Some(Error::PeerLost { peer: who.clone(), reason: format!("control connection: {e}") });
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::Timeout(format!("control request to {who} not answered within {:?}", self.ctx.cfg.timeout))))
    }

    fn rail_reports(&self) -> Vec<RailReport> {
        let g = self.sched.lock().expect("sched lock");
        self.rails
            .iter()
            .enumerate()
            .map(|(i, r)| RailReport {
                name: r.remote_name.clone(),
                local_addr: r.local.as_ref().map(|l| l.1.to_string()).unwrap_or_default(),
                remote_addr: r.remote.to_string(),
                connections: r.conns.read().expect("rail lock").len(),
                stats: g.planner.rail_stats(i),
                io: r.io.snapshot(),
            })
            .collect()
    }

    /// Shut the link down and return once no thread of it touches registered memory any more
    /// (senders, receivers, callers posting or driving): after this the application may free
    /// the memory its transfers named. Must not be called from a link thread (they count in
    /// `active`); those use `close_with`.
    pub(crate) fn close(&self) {
        self.close_with("link closed");
        // Every such thread sees `shutdown` within a tick: sockets are aborted, senders woken.
        let deadline = Instant::now() + self.ctx.cfg.timeout.max(Duration::from_secs(5));
        while self.active.load(Ordering::SeqCst) > 0 {
            if Instant::now() > deadline {
                self.ctx.log(&format!("peer {}: link threads still running after close", self.peer_name));
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Shut everything down; transfers still pending fail with `reason`.
    fn close_with(&self, reason: &str) {
        self.shutdown.store(true, Ordering::SeqCst);
        for r in &self.rails {
            for c in r.conns.read().expect("rail lock").iter() {
                c.kill();
                c.kick();
            }
            for s in r.fds.lock().expect("rail lock").iter() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        if let Some(s) = self.control.lock().expect("control lock").take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.notify_tx.lock().expect("link lock").take();
        let mut g = self.sched.lock().expect("sched lock");
        let pending: Vec<Arc<XferShared>> = g.xfers.drain().map(|(_, x)| x).collect();
        drop(g);
        for x in pending {
            x.finish(Err(Error::PeerLost { peer: self.peer_name.clone(), reason: reason.into() }));
        }
        self.cond.notify_all();
    }
}
