//! A remote agent as seen from here: its metadata, descriptor resolution, and once used, the
//! [`Link`] that carries transfers to it. Also the authenticated handshake (`dial`) every
//! connection to a peer starts with, whatever the transport.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status};
use multirail_proto::planner::{pair_rows, pair_segments, RailStats};
use multirail_proto::{AgentMeta, Body, MemType, Pair, RegionKey, RegionMeta};

use crate::agent::{Ctx, ResolvedLocal};
use crate::auth;
use crate::config::{Progress, TransportKind};
use crate::error::{Error, Result};
use crate::link::Link;
use crate::registry::{random_bytes, Region};
use crate::wire::{self, WireError};
use crate::xfer::{Desc, Op, XferHandle, XferShared};

/// Socket timeout granularity: how often blocked reads/writes re-check deadlines and shutdown.
const TICK: Duration = Duration::from_millis(50);

/// A peer: its metadata and, once used, its link.
pub struct Peer {
    pub name: String,
    pub meta: AgentMeta,
    /// Exported regions sorted by base, for resolving remote descriptors.
    regions: Vec<RegionMeta>,
    pub(crate) keys: HashMap<u64, RegionKey>,
    /// The address its metadata was fetched from; stands in for unspecified rail addresses.
    pub(crate) addr_hint: Option<IpAddr>,
    pub(crate) ctx: Arc<Ctx>,
    link: Mutex<Option<Arc<Link>>>,
    /// A tcp link for GPU memory when the agent's transport cannot take it directly (ucx
    /// without GPUDirect RDMA): staged over the same rails. Opened on first use.
    gpu_link: Mutex<Option<Arc<Link>>>,
    /// Ids of dead connections that carried WRITEs and that the peer has not yet confirmed
    /// fenced. Kept across links: no WRITE goes to the peer again before they are fenced.
    pub(crate) unfenced: Arc<Mutex<Vec<[u8; 16]>>>,
    /// Counters per rail (by the link's rail index), kept across reconnections.
    io: Mutex<Vec<Arc<RailIo>>>,
    /// Counters of the peer as a whole.
    pub counters: Arc<PeerCounters>,
    /// CUDA IPC mappings of the peer's GPU regions, and the copy worker (same host only).
    pub(crate) ipc: crate::ipc::IpcPeer,
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
    /// GPU memory staged on this rail (D2H / wire / H2D totals, pinned pool bytes).
    pub staging: Arc<crate::staging::StageStats>,
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
    pub staging: crate::staging::StageReport,
}

impl RailIo {
    pub(crate) fn snapshot(&self) -> RailIoSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RailIoSnapshot {
            bytes_read: g(&self.bytes_read),
            chunks_read: g(&self.chunks_read),
            bytes_written: g(&self.bytes_written),
            chunks_written: g(&self.chunks_written),
            readmissions: g(&self.readmissions),
            stalls: g(&self.stalls),
            staging: self.staging.report(),
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
            gpu_link: Mutex::new(None),
            unfenced: Arc::new(Mutex::new(Vec::new())),
            io: Mutex::new(Vec::new()),
            counters: Arc::new(PeerCounters::default()),
            ipc: crate::ipc::IpcPeer::default(),
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
        self.open_link(&self.link, self.ctx.cfg.transport)
    }

    /// The tcp link that stages GPU memory for an agent whose transport cannot take it.
    pub(crate) fn gpu_link(self: &Arc<Self>) -> Result<Arc<Link>> {
        self.open_link(&self.gpu_link, TransportKind::Tcp)
    }

    fn slot(&self, x: &XferShared) -> &Mutex<Option<Arc<Link>>> {
        if x.via_gpu_link {
            &self.gpu_link
        } else {
            &self.link
        }
    }

    fn open_link(self: &Arc<Self>, slot: &Mutex<Option<Arc<Link>>>, kind: TransportKind) -> Result<Arc<Link>> {
        let mut g = slot.lock().expect("peer lock");
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
        let l = Link::connect_with(self, kind)?;
        *g = Some(l.clone());
        Ok(l)
    }

    /// The counters of rails 0..n (created as needed).
    pub(crate) fn rail_io(&self, n: usize) -> Vec<Arc<RailIo>> {
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
        if x.ipc.is_some() {
            return self.ipc.submit(x);
        }
        let link = if x.via_gpu_link { self.gpu_link()? } else { self.link()? };
        link.submit(x, will_drive)
    }

    /// See [`Link::drive`]; false when there is no link.
    pub(crate) fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        let link = self.slot(x).lock().expect("peer lock").clone();
        link.is_some_and(|l| l.drive(x, deadline, poll_only))
    }

    pub(crate) fn cancel(&self, x: &Arc<XferShared>) {
        if x.ipc.is_some() {
            return self.ipc.cancel(x);
        }
        if let Some(l) = self.slot(x).lock().expect("peer lock").as_ref() {
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
        self.ipc.close();
        for slot in [&self.link, &self.gpu_link] {
            if let Some(l) = slot.lock().expect("peer lock").take() {
                l.close();
            }
        }
    }

    /// What CUDA IPC did for transfers to this peer.
    pub fn ipc_info(&self) -> crate::ipc::IpcReport {
        self.ipc.report()
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
                if fresh && local_regions[k].mem == MemType::Vram {
                    return None;
                }
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
                    if (write && r.access != multirail_proto::Access::ReadWrite) || r.mem == MemType::Vram {
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
        Ok(XferHandle(XferShared::new(op, self.clone(), pairs, notif, hold, None, false)))
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
        let vram_remote = remote.iter().any(|&(region, _, _)| self.regions.iter().any(|r| r.id == region && r.mem == MemType::Vram));
        // GPU memory: tcp stages it; another transport takes it directly (GPUDirect RDMA) or
        // hands it to a tcp link over the same rails, which stages it.
        let gpu = vram_remote || hold.iter().any(|r| r.mem == MemType::Vram);
        let via_gpu_link =
            gpu && self.ctx.cfg.transport != TransportKind::Tcp && self.link()?.caps().gpu != crate::transport::GpuPath::Direct;
        let pairs = self.pair(&local, &remote)?;
        let link = if via_gpu_link { self.gpu_link()? } else { self.link()? };
        // Remote GPU memory on this host: one device copy by CUDA IPC when it maps.
        let all_remote_vram = !remote.is_empty()
            && remote.iter().all(|&(region, _, _)| self.regions.iter().any(|r| r.id == region && r.mem == MemType::Vram));
        let ipc = if all_remote_vram && self.ctx.cfg.staging.ipc {
            let vram: Vec<(u64, u64)> = hold.iter().filter(|r| r.mem == MemType::Vram).map(|r| (r.base, r.base + r.len)).collect();
            let local_is_gpu = |a: u64| vram.iter().any(|&(b, e)| b <= a && a < e);
            self.ipc.plan(&link, &self.keys, op, &pairs, local_is_gpu)
        } else {
            None
        };
        Ok(XferHandle(XferShared::new(op, self.clone(), pairs, notif, hold, ipc, via_gpu_link)))
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
    /// What carries the rail: "tcp", "ucx/tcp", "ucx/rc_mlx5", ...
    pub transport: String,
    /// What the rail's transport can do.
    pub caps: crate::transport::Caps,
    /// Why GPU memory takes `caps.gpu` on this rail.
    pub gpu_reason: String,
    pub stats: RailStats,
    pub io: RailIoSnapshot,
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
