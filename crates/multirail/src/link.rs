//! A link: the transport-independent half of the connection to one peer.
//!
//! It owns the planner that stripes transfers over the rails (chunk scheduling, weights, tail
//! balancing), the transfers in flight, failover (a failed rail's chunks are requeued once its
//! last path stopped and its WRITE paths are fenced on the target), probing and readmission of
//! down rails, notifications (over the control connection) and completion. What carries the
//! rails is a [`Transport`] (`transport::tcp`, `transport::ucx`), which pulls chunks from the
//! link and reports back to it (see `transport/mod.rs` for the contract).
//!
//! Lock order: `sched` before nothing else; a transport never calls into the link while holding
//! a lock the link's callbacks take, and never does I/O under `sched`.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status};
use multirail_proto::planner::{RailMask, RailStats};
use multirail_proto::{AgentMeta, Body, Chunk, ChunkId, Event, Kind, Planner, RailInfo, RegionKey, XferId};

use crate::config::{Config, Fault, TransportKind};
use crate::ctx::Ctx;
use crate::error::{Error, Result};
use crate::net::{abort_socket, dial, link_down, status_error, Dial, Dialed, LINK_CHECK};
use crate::numa::Loc;
use crate::staging::StageStats;
use crate::transport::faulty::Faulty;
use crate::transport::mixed::{Carrier, Mixed};
use crate::transport::{tcp::TcpRails, ucx::UcxRails, Active, Caps, Host, RailChoice, Transport, Verdict};
use crate::wire;
use crate::xfer::{Op, XferShared};

/// Most notifications the notifier sends in one pipelined batch (`Link::control_batch`).
const NOTIFY_BATCH: usize = 64;
/// Pause before a refused notification (the peer's inbox full) is sent again, doubling up to
/// the max (`Link::notifier`).
const NOTIFY_RETRY_MIN: Duration = Duration::from_millis(1);
const NOTIFY_RETRY_MAX: Duration = Duration::from_millis(100);
/// What a link's notifier sends, in the order queued (`Link::notifier`).
pub(crate) enum Outgoing {
    /// A transfer whose data landed: its notification is sent, then it completes.
    Xfer(Arc<XferShared>),
    /// A notification of its own (`Link::send_notif`); `reply` gets the peer's answer when
    /// the caller waits for it.
    Notif { msg: Vec<u8>, reply: Option<mpsc::Sender<Result<()>>> },
}

impl Outgoing {
    fn msg(&self) -> Vec<u8> {
        match self {
            Outgoing::Xfer(x) => x.notif.lock().expect("xfer lock").clone().unwrap_or_default(),
            Outgoing::Notif { msg, .. } => msg.clone(),
        }
    }
}

fn is_busy(r: &Result<()>) -> bool {
    matches!(r, Err(Error::Remote { status: Status::Busy, .. }))
}

/// A notification held by the notifier (refused, or behind a refused one).
struct Held {
    body: Body,
    since: Instant,
    /// The `send_notif` caller waiting for the answer.
    reply: Option<mpsc::Sender<Result<()>>>,
    /// A `send_notif` nobody waits for: a drop is said on stderr.
    warn: bool,
}

impl Held {
    /// It leaves the queue with `r`: taken by the peer, or dropped.
    fn end(self, link: &Link, r: Result<()>) {
        match self.reply {
            Some(tx) => {
                let _ = tx.send(r);
            }
            None if self.warn => link.notif_sent(r),
            None => {}
        }
    }
}

/// Longest a fence may take on one rail (connect, handshake, answer) before the next is tried.
const FENCE_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause after a failed control dial, doubling up to the max until the request's `timeout`.
const DIAL_RETRY_MIN: Duration = Duration::from_millis(5);
const DIAL_RETRY_MAX: Duration = Duration::from_millis(100);
/// The watchdog's longest and shortest naps (it sleeps until the planner's next stall deadline).
const WATCH_IDLE: Duration = Duration::from_millis(100);
const WATCH_MIN: Duration = Duration::from_millis(5);

/// One rail of a link, whatever carries it: addresses, counters, failure and readmission state.
pub(crate) struct RailState {
    /// The local rail's device and address (None: let the kernel choose).
    pub local: Option<(String, IpAddr)>,
    /// The peer's side-channel address on this rail (handshakes, fences, UCX sessions).
    pub remote: SocketAddr,
    /// This agent's index for the rail (`Ctx::rails`) and the peer's (its `AgentMeta::rails`).
    pub local_index: usize,
    pub remote_index: usize,
    pub remote_name: String,
    probing: AtomicBool,
    /// Serialises readmission (the probe thread and a caller reviving a dead link).
    readmit: Mutex<()>,
    /// This rail's counters (shared with the `Peer`, so they outlive the link).
    pub io: Arc<RailIo>,
    /// First failure cause since the rail was last opened.
    failure: Mutex<Option<String>>,
    /// Why the rail runs its transport (the agent's choice; `Transport::choice` once it switched).
    pub reason: String,
    /// Every connection's peer takes vectored requests on GPU regions (`HELLO_VECTORED_GPU`);
    /// set by the transport when it opens the rail.
    vectored_gpu: AtomicBool,
    /// The memory location (`Loc::pack`) of the last tiered transfer the rail took a chunk of
    /// (its first location, for a transfer over several); 0: none yet.
    last_loc: AtomicU64,
}

struct Sched {
    planner: Planner,
    xfers: HashMap<XferId, Arc<XferShared>>,
    next_xfer: u64,
    /// A handoff post woke one sender: the first to wake wakes the others (`wait_chunk`).
    chain_wake: bool,
}

/// The live connections to one peer and the planner that stripes over them.
pub struct Link {
    pub(crate) peer_name: String,
    pub(crate) incarnation: u64,
    pub(crate) ctx: Arc<Ctx>,
    /// The peer's region keys, by region id (sent with each request on TCP); shared with the
    /// `Peer`, whose region updates the link sees at once.
    pub(crate) keys: Arc<Keys>,
    pub(crate) rails: Vec<RailState>,
    /// What carries the rails.
    t: Box<dyn Transport>,
    /// Some rail runs ucx (GPU memory then goes through the peer's tcp link unless direct).
    any_ucx: bool,
    sched: Mutex<Sched>,
    cond: Condvar,
    control: Mutex<Option<TcpStream>>,
    /// The `Hello` version the peer accepted on the control connection (0: none yet).
    control_version: std::sync::atomic::AtomicU16,
    notify_tx: Mutex<Option<mpsc::Sender<Outgoing>>>,
    shutdown: AtomicBool,
    /// Set when the peer is known gone for good (restarted: stale metadata).
    pub(crate) fatal: Mutex<Option<Error>>,
    /// Shared with the [`Peer`]; see `Peer::unfenced`.
    unfenced: Arc<Mutex<Vec<[u8; 16]>>>,
    /// Shared with the [`Peer`].
    counters: Arc<PeerCounters>,
    /// Time base of `Conn::caller_at`.
    epoch: Instant,
    /// Threads that may touch registered memory through this link right now (senders,
    /// receivers, callers posting or driving a transfer); `close` waits until none is left.
    active: AtomicUsize,
    /// This link, for the transport's callbacks that need to own it (`Host::path_stopped`).
    me: Weak<Link>,
    /// Per memory location, its rail tiers over this link's rails (`Ctx::topo`, mapped through
    /// each link rail's local rail); empty: every transfer uses every rail.
    loc_tiers: HashMap<Loc, Arc<[RailMask]>>,
}

/// What a link is made from: the peer as `Peer` knows it (the link names no `Peer`).
pub(crate) struct PeerInfo<'a> {
    pub name: &'a str,
    pub meta: &'a AgentMeta,
    /// The peer's region keys, by region id (kept up to date by the peer).
    pub keys: &'a Arc<Keys>,
    /// The address its metadata was fetched from; stands in for unspecified rail addresses.
    pub addr_hint: Option<IpAddr>,
    pub ctx: &'a Arc<Ctx>,
    /// The counters of rails 0..n, kept across links.
    pub rail_io: &'a dyn Fn(usize) -> Vec<Arc<RailIo>>,
    /// Ids of dead connections not yet fenced, kept across links.
    pub unfenced: &'a Arc<Mutex<Vec<[u8; 16]>>>,
    pub counters: &'a Arc<PeerCounters>,
}

/// A peer's region keys by region id, shared by the `Peer` and its links: regions the peer
/// adds or removes with the same incarnation and rails change this table in place (its links
/// and connections stay). A read lock per request on the data path; written only on a change.
#[derive(Default)]
pub(crate) struct Keys(RwLock<HashMap<u64, RegionKey>>);

impl Keys {
    pub fn new(keys: HashMap<u64, RegionKey>) -> Keys {
        Keys(RwLock::new(keys))
    }

    /// The key of `region`; None once it was removed (or never was).
    pub fn get(&self, region: u64) -> Option<RegionKey> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).get(&region).copied()
    }

    /// Replace the whole table.
    pub fn set(&self, keys: HashMap<u64, RegionKey>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = keys;
    }
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

/// One rail's state and counters as reported to the caller.
#[derive(Debug, Clone)]
pub struct RailReport {
    pub name: String,
    pub local_addr: String,
    pub remote_addr: String,
    pub connections: usize,
    /// What carries the rail: "tcp", "ucx/tcp", "ucx/rc_mlx5", ...
    pub transport: String,
    /// Why it runs that, and its switches between ucx and tcp (fallback).
    pub choice: RailChoice,
    /// What the rail's transport can do.
    pub caps: Caps,
    /// Why GPU memory takes `caps.gpu` on this rail.
    pub gpu_reason: String,
    pub stats: RailStats,
    /// Where the memory of the last tiered transfer the rail carried is (`stats.tier` is the
    /// tier it served that memory as); None before any.
    pub location: Option<Loc>,
    /// This agent's index of the rail's local rail (`Ctx::rails`).
    pub local_index: usize,
    pub io: RailIoSnapshot,
}

/// Why a rail moves GPU memory the way it does (`RailReport::gpu_reason`). `ucx`: the link has
/// ucx rails (its GPU memory then goes through the peer's tcp link unless direct).
fn gpu_reason(path: crate::transport::GpuPath, cfg: &crate::config::Config, detail: Option<String>, ucx: bool) -> String {
    use crate::transport::GpuPath;
    let pool = cfg.staging.pool;
    match path {
        GpuPath::Staged => format!(
            "{}GPU memory is staged through {} x {} KiB pinned buffers per connection and direction ({} device){}",
            match ucx {
                false => "tcp rails carry host memory only: ".to_string(),
                true => format!("ucx rails cannot take GPU memory directly ({}): ", detail.as_deref().unwrap_or("no GPUDirect RDMA")),
            },
            pool.buffers,
            pool.buffer_size >> 10,
            cfg.staging.gpu.as_str(),
            if ucx { ", over the same rails through multirail's tcp connections" } else { "" }
        ),
        GpuPath::Direct => "the rail's NIC addresses GPU memory (GPUDirect RDMA)".into(),
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

/// The agent's rail tiers per memory location (`Ctx::topo`) as masks over a link's rails: link
/// rail k is in a tier when its local rail is (several link rails may share a local rail when
/// rails pair by index). Tiers that name none of the link's rails are dropped; so is a location
/// left with none. A link of more than 64 rails is not tiered.
fn loc_tiers(ctx: &Ctx, rails: &[RailState]) -> HashMap<Loc, Arc<[RailMask]>> {
    let Some(topo) = ctx.topo.get() else { return HashMap::new() };
    if rails.len() > 64 {
        return HashMap::new();
    }
    let mut out = HashMap::new();
    for (loc, tiers) in &topo.tiers {
        let masks: Vec<RailMask> = tiers
            .iter()
            .map(|t| rails.iter().enumerate().filter(|(_, r)| t.contains(&r.local_index)).fold(0, |m, (k, _)| m | (1u64 << k)))
            .filter(|m| *m != 0)
            .collect();
        if !masks.is_empty() {
            out.insert(*loc, Arc::from(masks));
        }
    }
    out
}

/// The tiers of a transfer whose local memory is at `locs`: those of its location; for memory at
/// several locations, tier i is the union of their tiers i (a transfer from GPU 0 and GPU 1
/// stripes over both GPUs' near rails). Locations without tiers add nothing; None when no
/// location has any (every rail).
fn tiers_for(map: &HashMap<Loc, Arc<[RailMask]>>, locs: &[Loc]) -> Option<Arc<[RailMask]>> {
    if map.is_empty() {
        return None;
    }
    let mut have = locs.iter().filter_map(|l| map.get(l));
    let first = have.next()?.clone();
    let rest: Vec<&Arc<[RailMask]>> = have.collect();
    if rest.is_empty() {
        return Some(first);
    }
    let mut u: Vec<RailMask> = first.to_vec();
    for t in rest {
        for (i, m) in t.iter().enumerate() {
            match u.get_mut(i) {
                Some(x) => *x |= m,
                None => u.push(*m),
            }
        }
    }
    Some(Arc::from(u))
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

impl Link {
    /// A link to `peer`: each rail over the transport the agent chose for it (a link of mixed
    /// rails, or one whose ucx rails may fall back to tcp, runs `Mixed`), or with `all_tcp`
    /// every rail over tcp (for the GPU memory ucx rails cannot move directly: `Peer::gpu_link`).
    pub(crate) fn connect_with(peer: &PeerInfo<'_>, all_tcp: bool) -> Result<Arc<Link>> {
        let ctx = peer.ctx.clone();
        let pairs = rail_pairs(&ctx, &peer.meta.rails);
        if pairs.is_empty() {
            return Err(Error::Metadata(format!("peer {:?} publishes no rail this agent can reach", peer.name)));
        }
        let choice = |li: usize| ctx.choices.get(li).filter(|_| !all_tcp);
        let carriers: Vec<Carrier> = pairs
            .iter()
            .map(|&(li, _)| if choice(li).is_some_and(|c| c.kind == TransportKind::Ucx) { Carrier::Ucx } else { Carrier::Tcp })
            .collect();
        let any_ucx = carriers.contains(&Carrier::Ucx);
        // tcp reports bytes moving below chunk level (`quiet_for`): a tcp rail's silence is
        // measured in bytes, a ucx rail's in whole chunks (docs/planner.md, failure detection).
        // Set per rail here and again by the transport that opens it (a fallback changes it).
        // A hold (the path owes nothing, yet nothing moves: e.g. a peer whose kernel answers
        // and whose application does not) lasts at most the request `timeout`.
        let held_timeout = ctx.cfg.planner.held_timeout.min(ctx.cfg.timeout.max(ctx.cfg.planner.stall_timeout));
        let mut planner = Planner::new(multirail_proto::PlannerConfig { byte_progress: true, held_timeout, ..ctx.cfg.planner.clone() });
        planner.set_hold_when_all_down(ctx.cfg.hold_when_down);
        let now = Instant::now();
        let io = (peer.rail_io)(pairs.len());
        let mut rails = Vec::new();
        for (k, &(li, ri)) in pairs.iter().enumerate() {
            let l = &ctx.rails[li];
            let r = &peer.meta.rails[ri];
            let mut ip: IpAddr = r.addr.parse().map_err(|_| Error::Metadata(format!("bad rail address {:?}", r.addr)))?;
            if ip.is_unspecified() {
                ip = peer.addr_hint.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            }
            let speeds: Vec<u64> = [l.speed_mbps, r.speed_mbps].into_iter().filter(|s| *s > 0).collect();
            let hint = speeds.iter().min().map(|m| *m as f64 * 1e6 / 8.0);
            let id = planner.add_rail(hint, now);
            planner.set_byte_progress(id, carriers[k] == Carrier::Tcp);
            rails.push(RailState {
                local: l.addr.filter(|a| !a.is_unspecified()).map(|a| (l.device.clone(), a)),
                remote: SocketAddr::new(ip, r.port),
                local_index: li,
                remote_index: ri,
                remote_name: r.name.clone(),
                probing: AtomicBool::new(false),
                readmit: Mutex::new(()),
                io: io[rails.len()].clone(),
                failure: Mutex::new(None),
                vectored_gpu: AtomicBool::new(false),
                last_loc: AtomicU64::new(0),
                reason: match choice(li) {
                    Some(c) => c.reason.clone(),
                    None => "GPU memory staged over tcp (the agent's ucx rails cannot take it directly)".into(),
                },
            });
        }
        let t = transport_for(&ctx, &carriers, &rails)?;
        let loc_tiers = loc_tiers(&ctx, &rails);
        let link = Arc::new_cyclic(|me| Link {
            loc_tiers,
            me: me.clone(),
            peer_name: peer.name.to_string(),
            incarnation: peer.meta.incarnation,
            ctx: ctx.clone(),
            keys: peer.keys.clone(),
            rails,
            t,
            any_ucx,
            sched: Mutex::new(Sched { planner, xfers: HashMap::new(), next_xfer: 1, chain_wake: false }),
            cond: Condvar::new(),
            control: Mutex::new(None),
            control_version: std::sync::atomic::AtomicU16::new(0),
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
            return Err(
                first_err.unwrap_or_else(|| Error::PeerLost { peer: peer.name.to_string(), reason: "no rail could connect".into() })
            );
        }
        // Connections of an earlier link that died with WRITEs aboard must be fenced before
        // anything is written through this one.
        let live: Vec<usize> = (0..link.rails.len()).filter(|&r| link.t.is_up(r)).collect();
        if let Err(e) = link.fence_pending(&live) {
            link.close();
            return Err(e);
        }
        // Drain the RailDown events of rails that failed to connect.
        link.sched.lock().expect("sched lock").planner.poll_event();
        let (tx, rx) = mpsc::channel::<Outgoing>();
        *link.notify_tx.lock().expect("link lock") = Some(tx);
        let l2 = link.clone();
        std::thread::Builder::new()
            .name(format!("mr-notify-{}", peer.name))
            .spawn(move || l2.notifier(rx))
            .map_err(|e| Error::io("spawn", e))?;
        let l3 = link.clone();
        std::thread::Builder::new()
            .name(format!("mr-watch-{}", peer.name))
            .spawn(move || l3.watchdog())
            .map_err(|e| Error::io("spawn", e))?;
        Ok(link)
    }

    /// The stall watchdog: the one place a rail is declared stalled, by the planner's rule
    /// (`Planner::poll_stalled`: work in flight, no progress for `stall_timeout`), the same
    /// rule the simulator runs. The transport's `quiet_for` (bytes or ACKs received lately)
    /// counts as progress: a large chunk on a slow rail is not a stall; `held_back` (the path owes
    /// nothing: the rail waits in this host's own full queue, behind the peer's closed window,
    /// or on the peer's application while the path answers probes) gives it `held_timeout`,
    /// and `path_dead` (a probe unanswered) ends a hold at once.
    /// A stalled rail is shut (`rail_failed`); its chunks are requeued once its paths stopped
    /// (and were fenced).
    fn watchdog(self: Arc<Self>) {
        let stall = self.ctx.cfg.planner.stall_timeout;
        while !self.is_shutdown() {
            let next = self.sched.lock().expect("sched lock").planner.poll_timeout();
            let now = Instant::now();
            let nap = next.map_or(WATCH_IDLE, |t| t.saturating_duration_since(now)).clamp(WATCH_MIN, WATCH_IDLE);
            std::thread::sleep(nap);
            if !self.is_shutdown() {
                // Time-driven work of the transport (a fallen-back rail's retry of ucx).
                self.t.tick(&*self);
            }
            let now = Instant::now();
            self.expire_held(now);
            // Judged at the planner's next deadline, and at every nap while a rail is held: a
            // hold may end early (a probe unanswered) and must not outlast it by a renewal.
            let due = {
                let g = self.sched.lock().expect("sched lock");
                g.planner.poll_timeout().is_some_and(|t| t <= now) || g.planner.holding(now)
            };
            if self.is_shutdown() || !due {
                continue;
            }
            // Evidence first, outside the lock (socket queries).
            let quiet: Vec<Option<Duration>> = (0..self.rails.len()).map(|ri| self.t.quiet_for(ri)).collect();
            let held: Vec<bool> = (0..self.rails.len()).map(|ri| self.t.held_back(ri)).collect();
            let dead: Vec<bool> = (0..self.rails.len()).map(|ri| self.t.path_dead(ri)).collect();
            let mut g = self.sched.lock().expect("sched lock");
            for (ri, q) in quiet.iter().enumerate() {
                if let Some(q) = q.filter(|q| *q < stall) {
                    g.planner.handle_progress(ri, now.checked_sub(q).unwrap_or(now));
                }
                if dead[ri] {
                    g.planner.handle_path_dead(ri);
                } else if held[ri] {
                    g.planner.handle_held(ri, now);
                }
            }
            let stalled = g.planner.poll_stalled(now);
            drop(g);
            for (ri, reason) in stalled {
                self.rails[ri].io.stalls.fetch_add(1, Ordering::Relaxed);
                // The paths' state at the verdict goes with the reason (rail_stats, events): a
                // stall on a rail that was not dead is diagnosed from it.
                let reason = match self.t.evidence(ri) {
                    Some(e) => format!("{reason} ({e})"),
                    None => reason,
                };
                self.rail_failed(ri, reason);
            }
        }
    }

    /// Transfers held since every rail went down (`Config::hold_when_down`) fail once no data
    /// has moved within `timeout` of that, at a moment when no rail is up.
    fn expire_held(&self, now: Instant) {
        let timeout = self.ctx.cfg.timeout;
        let since = self.sched.lock().expect("sched lock").planner.all_down_since();
        if since.is_some_and(|t| now.saturating_duration_since(t) >= timeout) {
            // Only while no rail is up: the chunks of a readmitted rail may still be landing,
            // and a rail that moves nothing is declared down again within its stall (or held)
            // timeout, so such a phase comes.
            self.fail_held(true, |why| {
                Error::Timeout(format!("peer {}: no data moved within {timeout:?} after every rail went down ({why})", self.peer_name))
            });
        }
    }

    /// Fail every transfer held since every rail went down (and no data moved since) with
    /// `err(why the rails went down)`; with `only_when_none_up`, nothing while a rail is up.
    fn fail_held(&self, only_when_none_up: bool, err: impl Fn(&str) -> Error) {
        let mut g = self.sched.lock().expect("sched lock");
        if g.planner.all_down_since().is_none() || (only_when_none_up && g.planner.any_rail_up()) {
            return;
        }
        let why = g.planner.down_reason();
        let ids = g.planner.take_all();
        let held: Vec<Arc<XferShared>> = ids.iter().filter_map(|id| g.xfers.remove(id)).collect();
        drop(g);
        for x in held {
            x.finish(Err(err(&why)));
        }
    }

    pub(crate) fn usable(&self) -> bool {
        !self.shutdown.load(Ordering::Acquire) && self.fatal.lock().expect("link lock").is_none()
    }

    /// True once the link is shutting down: transport threads leave.
    pub(crate) fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// The next chunk the planner has for rail `ri`, with its transfer; None when there is
    /// nothing for the rail now (or its rail window is full: a completion wakes the senders).
    pub(crate) fn next_chunk(&self, ri: usize) -> Option<(Chunk, Arc<XferShared>)> {
        let mut g = self.sched.lock().expect("sched lock");
        let now = Instant::now();
        let chunk = g.planner.poll_work(ri, now)?;
        match g.xfers.get(&chunk.xfer).cloned() {
            Some(x) => {
                x.trace.lock().expect("xfer lock").issued(ri, now);
                self.note_loc(&chunk, &x);
                Some((chunk, x))
            }
            None => {
                // Cannot happen: the planner only hands out chunks of transfers in `xfers`.
                g.planner.cancel(chunk.xfer);
                None
            }
        }
    }

    /// For a rail's own sending thread: wait until `room()` and the planner has a chunk for rail
    /// `ri`, or `stop()`. Polls and sleeps under one lock hold, so no wakeup is lost between.
    pub(crate) fn wait_chunk(&self, ri: usize, room: impl Fn() -> bool, stop: impl Fn() -> bool) -> Option<(Chunk, Arc<XferShared>)> {
        let mut g = self.sched.lock().expect("sched lock");
        loop {
            if g.chain_wake {
                g.chain_wake = false;
                self.cond.notify_all();
            }
            if self.is_shutdown() || stop() {
                return None;
            }
            if room() {
                let now = Instant::now();
                if let Some(chunk) = g.planner.poll_work(ri, now) {
                    if let Some(x) = g.xfers.get(&chunk.xfer).cloned() {
                        x.trace.lock().expect("xfer lock").issued(ri, now);
                        self.note_loc(&chunk, &x);
                        return Some((chunk, x));
                    }
                    g.planner.cancel(chunk.xfer);
                    continue;
                }
            }
            g = self.cond.wait_timeout(g, Duration::from_millis(100)).expect("sched lock").0;
        }
    }

    /// Remember where the memory of a tiered chunk's transfer is, for `rail_stats`.
    fn note_loc(&self, chunk: &Chunk, x: &XferShared) {
        if chunk.tier.is_some() {
            if let Some(l) = x.locs().first() {
                self.rails[chunk.rail].last_loc.store(l.pack(), Ordering::Relaxed);
            }
        }
    }

    /// A chunk handed out for rail `ri` finished: landed (`Ok`) or refused by the target.
    pub(crate) fn chunk_done(&self, ri: usize, chunk: ChunkId, x: &XferShared, len: u64, r: std::result::Result<(), (Status, String)>) {
        match self.t.verdict(ri) {
            Verdict::Deliver => {}
            Verdict::Drop => return,
            Verdict::Delay(d) => std::thread::sleep(d),
        }
        let now = Instant::now();
        let mut g = self.sched.lock().expect("sched lock");
        match r {
            Ok(()) => {
                let io = &self.rails[ri].io;
                let (bytes, chunks) = match x.op {
                    Op::Read => (&io.bytes_read, &io.chunks_read),
                    Op::Write => (&io.bytes_written, &io.chunks_written),
                };
                bytes.fetch_add(len, Ordering::Relaxed);
                chunks.fetch_add(1, Ordering::Relaxed);
                if g.planner.handle_done(chunk, now) {
                    x.trace.lock().expect("xfer lock").landed(ri, len, now);
                }
            }
            Err((status, msg)) => {
                x.set_cause(Error::Remote { peer: self.peer_name.clone(), status, msg: msg.clone() });
                g.planner.handle_failed(chunk, msg, now);
            }
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
    }

    /// A path (connection, endpoint) of rail `ri` stopped. `last` runs under the rail's
    /// readmission lock and says whether it was the rail's last live path (the transport counts);
    /// then nothing of the rail touches local memory any more, and its chunks can be reissued
    /// elsewhere once the target has fenced the paths that carried WRITEs (frames still queued in
    /// the dead path must never land after the reissue).
    pub(crate) fn path_stopped(self: &Arc<Self>, ri: usize, last: impl FnOnce() -> bool) {
        let rail = &self.rails[ri];
        // Under the readmit lock: a rail is never readmitted between its last path stopping and
        // the planner learning that it is down.
        let _one = rail.readmit.lock().expect("rail lock");
        if !last() {
            return;
        }
        let shutting = self.shutdown.load(Ordering::Acquire);
        let reason = if shutting { "link closed".to_string() } else { "connections lost".to_string() };
        let reason = rail.failure.lock().expect("rail lock").take().unwrap_or(reason);
        if !shutting {
            let ids = self.t.fence_ids(ri);
            self.unfenced.lock().expect("fence lock").extend(ids);
            let others: Vec<usize> = (0..self.rails.len()).filter(|&r| r != ri && self.t.is_up(r)).collect();
            if let Err(e) = self.fence_pending(&others) {
                if !others.is_empty() {
                    // Other rails are carrying data, and the target might still apply this
                    // rail's stale WRITEs over what they write: stop everything. The next link
                    // fences first.
                    let why = format!("rail {ri} failed ({reason}) and its connections could not be fenced: {e}");
                    self.ctx.log(&format!("peer {}: {why}", self.peer_name));
                    self.close_with(&why);
                    return;
                }
                // No rail left: the transfers fail below, and nothing is written again before a
                // probe has fenced (see `start_probe`).
            }
        }
        let mut g = self.sched.lock().expect("sched lock");
        g.planner.handle_rail_down(ri, reason, Instant::now());
        let done = self.drain_events(&mut g);
        drop(g);
        self.complete(done);
        self.cond.notify_all();
        self.t.wake();
        if !self.shutdown.load(Ordering::Acquire) {
            self.start_probe(ri);
        }
    }

    /// See [`Transport::drive`].
    pub(crate) fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        let Some(_active) = self.enter() else { return false };
        self.t.drive(self, x, deadline, poll_only)
    }

    /// Count the calling thread as one that may touch registered memory through this link;
    /// None once the link is shutting down. With `close` (which sets `shutdown`, then waits for
    /// `active` to reach zero) this is a store-then-load handshake on both sides (SeqCst):
    /// either `close` sees the count or the thread sees the shutdown.
    pub(crate) fn enter(&self) -> Option<Active<'_>> {
        self.active.fetch_add(1, Ordering::SeqCst);
        if self.shutdown.load(Ordering::SeqCst) {
            self.active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Active(&self.active))
    }

    pub(crate) fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// True when no rail of the link has a live connection.
    fn all_down(&self) -> bool {
        (0..self.rails.len()).all(|r| !self.t.is_up(r))
    }

    /// A link whose every rail is down is probed now, from the caller's thread, rather than
    /// left to the background probe's backoff: a peer that restarted is found out (its new
    /// incarnation fails the handshake) and reported as stale at once, and one that came back
    /// is readmitted before the caller's transfer fails for want of a rail. One dial per rail,
    /// each bounded by `stall_timeout` (at least 200 ms, at most `timeout`).
    pub(crate) fn revive(self: &Arc<Self>) -> Result<()> {
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
        if self.t.is_up(ri) {
            return Ok(false);
        }
        // Fence first: a rail is not readmitted while dead connections are unfenced.
        let mut via: Vec<usize> = (0..self.rails.len()).filter(|&r| r != ri && self.t.is_up(r)).collect();
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
        self.t.wake();
        Ok(true)
    }

    /// Open rail `ri` through the transport.
    fn open_rail(self: &Arc<Self>, ri: usize, timeout: Duration) -> Result<()> {
        let host: Arc<dyn Host> = self.clone();
        self.t.open_rail(&host, ri, timeout)
    }

    pub(crate) fn submit(self: &Arc<Self>, x: Arc<XferShared>, will_drive: bool) -> Result<()> {
        if !self.usable() {
            return Err(Error::PeerLost { peer: self.peer_name.clone(), reason: "link closed".into() });
        }
        // Where the memory is decides the rails (worked out once per handle, outside the lock).
        let tiers = if self.loc_tiers.is_empty() { None } else { tiers_for(&self.loc_tiers, x.locs()) };
        let mut g = self.sched.lock().expect("sched lock");
        let id = XferId(g.next_xfer);
        g.next_xfer += 1;
        x.current.store(id.0, Ordering::Release);
        let handoff = x.handoff.load(Ordering::Acquire);
        g.xfers.insert(id, x.clone());
        let now = Instant::now();
        x.trace.lock().expect("xfer lock").start(now, g.planner.rates());
        g.planner.submit_tiered(id, x.runs.clone(), x.total, x.vectored(), tiers, now);
        let done = self.drain_events(&mut g);
        g.chain_wake |= handoff;
        drop(g);
        self.complete(done);
        if handoff {
            // `XferHandle::post_handoff`: the rails' threads send it all. This thread wakes one
            // sender, which wakes the others (`wait_chunk`): on a loaded host each thread woken
            // here may take the caller's CPU, so the post wakes as few as it can. Other
            // transports' threads, which do not wait on the link's condition, by `wake`.
            self.t.wake();
            self.cond.notify_one();
            return Ok(());
        }
        // Post the first chunks from this thread: saves a wakeup on the latency path. The
        // transport's own threads are woken only if some rail ran out of room with work left.
        let Some(_active) = self.enter() else { return Ok(()) };
        // The transport reports that a rail may have work left without room for it; the
        // senders are woken only when the planner really holds bytes not yet handed out (a
        // 4 KiB post that sent its one chunk inline wakes nobody: waking every rail's sender
        // per small post cost a wake-up per rail per round trip).
        if self.t.post_ready(&**self, will_drive) && self.sched.lock().expect("sched lock").planner.has_work() {
            self.cond.notify_all();
        }
        Ok(())
    }

    pub(crate) fn cancel(&self, x: &Arc<XferShared>) {
        let id = XferId(x.current.load(Ordering::Acquire));
        let mut g = self.sched.lock().expect("sched lock");
        g.planner.cancel(id);
        g.xfers.remove(&id);
        drop(g);
        x.give_up(id.0);
        // Wait until no connection still holds a chunk of this transfer.
        let deadline = Instant::now() + self.ctx.cfg.planner.stall_timeout + Duration::from_secs(1);
        while Instant::now() < deadline {
            let busy = self.t.holds(x);
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
                        x.trace.lock().expect("xfer lock").done(Instant::now(), g.planner.rates());
                        out.push((x, Ok(())));
                    }
                }
                Event::XferFailed { xfer, reason } => {
                    if let Some(x) = g.xfers.remove(&xfer) {
                        x.give_up(xfer.0);
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
            let has_notif = r.is_ok() && x.notif.lock().expect("xfer lock").is_some();
            if has_notif {
                self.notify_then_finish(x);
            } else if r.is_err() && self.t.holds(&x) {
                self.drain_then_fail(x, r);
            } else {
                x.finish(r);
            }
        }
    }

    /// A transfer failed (a chunk refused, say) while other chunks of it are still in paths:
    /// their gets, or the responses a receiver has yet to read, may still write its local
    /// memory. It is reported failed only once none can any more, so that the caller may free
    /// or reuse the memory as soon as it sees the error. From a thread of its own: the
    /// transport's threads that complete those chunks may be the caller here.
    fn drain_then_fail(&self, x: Arc<XferShared>, r: Result<()>) {
        let Some(me) = self.me.upgrade() else { return x.finish(r) };
        let (x2, r2) = (x.clone(), r.clone());
        let spawned = std::thread::Builder::new().name("mr-drain".into()).spawn(move || {
            me.drain(&x2);
            x2.finish(r2);
        });
        if let Err(e) = spawned {
            // No thread to wait from: this one waits (its own chunks then time out the bound).
            self.ctx.log(&format!("peer {}: cannot spawn a drain thread ({e}): waiting here", self.peer_name));
            self.drain(&x);
            x.finish(r);
        }
    }

    /// Wait until no path holds a chunk of `x`, for at most the stall timeout (+1 s, as
    /// `cancel`); past that, the rails still holding one are failed, so that nothing of them
    /// touches local memory once their paths have stopped, and waited for as long again.
    fn drain(&self, x: &Arc<XferShared>) {
        let bound = self.ctx.cfg.planner.stall_timeout + Duration::from_secs(1);
        let released = |bound: Duration| {
            let deadline = Instant::now() + bound;
            while self.t.holds(x) {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        };
        if released(bound) {
            return;
        }
        for ri in (0..self.rails.len()).filter(|&ri| self.t.holds_on(ri, x)) {
            self.rail_failed(ri, format!("a chunk of a failed transfer was still in flight after {bound:?}"));
        }
        if !released(bound) {
            self.ctx.log(&format!("peer {}: a failed transfer's chunks are still held after their rails were shut", self.peer_name));
        }
    }

    /// Shut every connection of a rail so all its receivers stop.
    pub(crate) fn rail_failed(&self, ri: usize, reason: String) {
        let rail = &self.rails[ri];
        self.ctx.log(&format!("peer {}: rail {ri} ({}) failed: {reason}", self.peer_name, rail.remote));
        // Its paths take no new chunks; chunks in flight are requeued when the last path of the
        // rail has stopped (see `path_stopped`).
        rail.failure.lock().expect("rail lock").get_or_insert(reason);
        self.t.shut_rail(ri);
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
                if l.shutdown.load(Ordering::Acquire) || l.t.is_up(ri) {
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
                        let why = e.to_string();
                        *l.fatal.lock().expect("link lock") = Some(e);
                        l.fail_held(false, |_| Error::PeerLost { peer: l.peer_name.clone(), reason: format!("the peer restarted: {why}") });
                        break;
                    }
                    Err(e) => {
                        if crate::net::refused(&e) {
                            // Nothing listens at the peer's address any more: it exited; what
                            // waits for every rail to come back fails now.
                            l.fail_held(true, |why| Error::PeerLost { peer: l.peer_name.clone(), reason: format!("{e}; {why}") });
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
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
            let t0 = Instant::now();
            let r = self.dial_rail(ri, Role::Control, timeout).and_then(|Dialed { stream: mut s, .. }| {
                let deadline = Instant::now() + timeout;
                let mut tick = |_: bool| if Instant::now() > deadline { Err("fence timed out".to_string()) } else { Ok(()) };
                for part in ids.chunks(multirail_proto::codec::MAX_FENCE) {
                    let r = wire::send(&mut s, &Body::Fence(part.to_vec()), 0, &mut tick).and_then(|_| wire::read_frame(&mut s, &mut tick));
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
    /// `timeout`. A notification whose answer was lost is sent again; the target queues it once
    /// (`Body::NotifSeq`, `notif_seen`), or twice if it is from before `HELLO_NOTIF_SEQ`.
    pub(crate) fn control_request(&self, body: Body) -> Result<()> {
        self.control_call(body, Kind::Resp).map(|_| ())
    }

    /// Several `control_request`s pipelined on the open control connection: every frame is
    /// written, then the answers are read in order (the peer serves the connection in order),
    /// each within `stall_timeout` (at least 200 ms) of the one before. Each request gets its
    /// own result. Without an open connection, or from the first that fails on the wire on,
    /// the rest go one by one through `control_request` (which dials and fails over), so, as
    /// there, a notification whose answer was lost is resent and queued once.
    pub(crate) fn control_batch(&self, bodies: Vec<Body>) -> Vec<Result<()>> {
        if bodies.len() < 2 {
            return bodies.into_iter().map(|b| self.control_request(b)).collect();
        }
        let who = self.peer_name.clone();
        let per_try = self.ctx.cfg.planner.stall_timeout.max(Duration::from_millis(200)).min(self.ctx.cfg.timeout);
        let mut out: Vec<Result<()>> = Vec::with_capacity(bodies.len());
        {
            let mut g = self.control.lock().expect("control lock");
            if let Some(s) = g.as_mut() {
                let deadline = std::cell::Cell::new(Instant::now() + per_try);
                let mut tick =
                    |_: bool| if Instant::now() > deadline.get() { Err("no answer on the control connection".to_string()) } else { Ok(()) };
                let mut sent = 0;
                for b in &bodies {
                    if wire::send(s, &self.on_wire(b), 0, &mut tick).is_err() {
                        break;
                    }
                    sent += 1;
                }
                let mut broken = sent < bodies.len();
                while out.len() < sent {
                    deadline.set(Instant::now() + per_try);
                    match wire::read_frame(s, &mut tick) {
                        Ok((_, Body::Resp { status: Status::Ok, .. })) => out.push(Ok(())),
                        // A refusal answers its own request; the ones after it are answered too.
                        Ok((_, Body::Resp { status, msg, .. })) => out.push(Err(status_error(&who, status, msg))),
                        Ok((_, Body::Error { status, msg })) => {
                            out.push(Err(status_error(&who, status, msg)));
                            broken = true;
                            break;
                        }
                        Ok((_, other)) => {
                            out.push(Err(Error::Protocol {
                                who: who.clone(),
                                msg: format!("unexpected {:?} on the control connection", other.kind()),
                            }));
                            broken = true;
                            break;
                        }
                        Err(_) => {
                            broken = true;
                            break;
                        }
                    }
                }
                if broken {
                    if let Some(s) = g.take() {
                        abort_socket(&s);
                    }
                }
            }
        }
        // One by one from the first not answered; after a refusal (the inbox full) the later
        // ones are not sent, so that none is queued before it.
        for b in bodies.into_iter().skip(out.len()) {
            let busy = out.iter().any(is_busy);
            out.push(match busy {
                true => Err(status_error(&who, Status::Busy, "not sent: an earlier notification was refused (inbox full)".into())),
                false => self.control_request(b),
            });
        }
        out
    }

    /// A notification as sent: numbered within this agent's incarnation, so that the target
    /// queues it once however often a lost answer makes `control_call` send it again
    /// (`notif_seen`).
    pub(crate) fn notif_body(&self, msg: Vec<u8>) -> Body {
        Body::NotifSeq { incarnation: self.ctx.incarnation, seq: crate::notif_seen::next_seq(), msg }
    }

    /// `body` as the control connection's peer takes it: a numbered notification goes as a
    /// plain one to a peer from before `HELLO_NOTIF_SEQ` (at least once, as before).
    fn on_wire<'b>(&self, body: &'b Body) -> std::borrow::Cow<'b, Body> {
        match body {
            Body::NotifSeq { msg, .. } if self.control_version.load(Ordering::Acquire) < multirail_proto::codec::HELLO_NOTIF_SEQ => {
                std::borrow::Cow::Owned(Body::Notif(msg.clone()))
            }
            b => std::borrow::Cow::Borrowed(b),
        }
    }

    /// The notifier thread: every notification of this link goes through it, in the order
    /// queued (a transfer's once its data landed, `send_notif`'s when called), so the peer
    /// queues them in that order. Each pass takes every notification queued meanwhile (at most
    /// NOTIFY_BATCH), numbers them and sends them pipelined: a request of 32 layer WRITEs pays
    /// about one round trip for its notifications, not 32, and a lone one pays no wait.
    ///
    /// A notification the target refuses because its inbox is full (`Status::Busy`: its
    /// application has not taken its notifications) does not fail the transfer, whose data
    /// landed: the transfer completes, and the notification is held here and sent again
    /// (same number, so the target queues it once) with a growing pause, the later ones of
    /// this link behind it, until the target takes it. The target refuses the rest of a
    /// pipelined batch after a refusal (`server::Conn::notif_seq`), so they are held behind
    /// it, not queued before it. One still refused `timeout` after its first refusal is
    /// dropped with a log line, as is one beyond `inbox::PEER_MAX_QUEUED` held
    /// (docs/nixl-plugin.md, "Notifications"). A `send_notif` whose caller waits for the
    /// answer (the native API) is not held: its refusal is its caller's error.
    fn notifier(&self, rx: mpsc::Receiver<Outgoing>) {
        let mut held: VecDeque<Held> = VecDeque::new();
        let mut pause = NOTIFY_RETRY_MIN;
        loop {
            let first = if held.is_empty() {
                match rx.recv() {
                    Ok(x) => Some(x),
                    Err(_) => break,
                }
            } else {
                match rx.recv_timeout(pause) {
                    Ok(x) => Some(x),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            };
            let mut batch: Vec<Outgoing> = first.into_iter().collect();
            while !batch.is_empty() && batch.len() < NOTIFY_BATCH {
                match rx.try_recv() {
                    Ok(x) => batch.push(x),
                    Err(_) => break,
                }
            }
            let items: Vec<(Body, Outgoing)> = batch.into_iter().map(|o| (self.notif_body(o.msg()), o)).collect();
            if !held.is_empty() {
                // Behind the held ones, in order.
                for (b, o) in items {
                    self.hold_notif(&mut held, b, o);
                }
            } else {
                let bodies: Vec<Body> = items.iter().map(|(b, _)| b.clone()).collect();
                let mut refused = false;
                for (i, ((b, o), r)) in items.into_iter().zip(self.control_batch(bodies)).enumerate() {
                    let busy = is_busy(&r);
                    match o {
                        Outgoing::Notif { reply: Some(tx), .. } if !(busy && refused) => {
                            let _ = tx.send(self.answer_of_first(i, busy, b, r));
                        }
                        o if busy => self.hold_notif(&mut held, b, o),
                        Outgoing::Xfer(x) => x.finish(r),
                        Outgoing::Notif { .. } => self.notif_sent(r),
                    }
                    refused |= busy;
                }
                pause = NOTIFY_RETRY_MIN;
                continue;
            }
            pause = if self.send_held(&mut held) { (pause * 2).min(NOTIFY_RETRY_MAX) } else { NOTIFY_RETRY_MIN };
            let timeout = self.ctx.cfg.timeout;
            while held.front().is_some_and(|h| h.since.elapsed() > timeout) {
                if let Some(h) = held.pop_front() {
                    let why = format!("the peer's inbox stayed full for {timeout:?} (its application does not take its notifications)");
                    self.ctx.log(&format!("peer {}: notification dropped: {why}", self.peer_name));
                    h.end(self, Err(Error::Timeout(format!("peer {}: notification not taken: {why}", self.peer_name))));
                }
            }
        }
        if !held.is_empty() {
            self.ctx.log(&format!(
                "peer {}: link closed with {} notifications not taken by the peer (inbox full)",
                self.peer_name,
                held.len()
            ));
        }
    }

    /// Send the held notifications again, oldest first (at most NOTIFY_BATCH): the ones taken
    /// leave the queue up to the first refused again. Whether one was refused again.
    fn send_held(&self, held: &mut VecDeque<Held>) -> bool {
        let n = held.len().min(NOTIFY_BATCH);
        let again: Vec<Body> = held.iter().take(n).map(|h| h.body.clone()).collect();
        let rest = held.split_off(n);
        let mut refused = false;
        let mut kept = VecDeque::with_capacity(held.len() + rest.len());
        for (i, (h, r)) in held.drain(..).zip(self.control_batch(again)).enumerate() {
            let busy = is_busy(&r);
            match r {
                Ok(()) if !refused => h.end(self, Ok(())),
                // A caller waiting for the answer is told of a refusal of its own; its
                // notification is not held.
                _ if busy && !refused && h.reply.is_some() => {
                    let r = self.answer_of_first(i, busy, h.body.clone(), r);
                    h.end(self, r);
                }
                Err(e) if !refused && !busy => {
                    self.ctx.log(&format!("peer {}: a held notification could not be sent, dropped: {e}", self.peer_name));
                    h.end(self, Err(e));
                }
                // Refused; or behind a refused one: refused by the target's order rule, or
                // taken by a target from before it (then sent again, queued once).
                _ => kept.push_back(h),
            }
            refused |= busy;
        }
        kept.extend(rest);
        *held = kept;
        refused
    }

    /// The answer for a waiting caller's notification `body`, sent `i`th in a pipelined batch
    /// and answered `r`, nothing before it refused. Refused first in its batch, it is sent
    /// once more: the target may have refused it only because it still refused behind an
    /// earlier refusal (`server::Conn::notif_seq`), which a number sent again clears.
    fn answer_of_first(&self, i: usize, busy: bool, body: Body, r: Result<()>) -> Result<()> {
        match busy && i == 0 {
            true => self.control_request(body),
            false => r,
        }
    }

    /// Hold `body` (from `o`, refused or behind a refused one): a transfer completes now (its
    /// data landed); a waiting `send_notif` waits on.
    fn hold_notif(&self, held: &mut VecDeque<Held>, body: Body, o: Outgoing) {
        if held.len() >= crate::inbox::PEER_MAX_QUEUED {
            if let Some(h) = held.pop_front() {
                let why = format!("{} held for a peer whose inbox is full", held.len() + 1);
                self.ctx.log(&format!("peer {}: notification dropped: {why}", self.peer_name));
                h.end(self, Err(Error::Timeout(format!("peer {}: notification dropped: {why}", self.peer_name))));
            }
        }
        let (reply, warn) = match o {
            Outgoing::Xfer(x) => {
                x.finish(Ok(()));
                (None, false)
            }
            Outgoing::Notif { reply, .. } => {
                let warn = reply.is_none();
                (reply, warn)
            }
        };
        held.push_back(Held { body, since: Instant::now(), reply, warn });
    }

    /// The outcome of a `send_notif` nobody waits for: a failure is said on stderr (the caller
    /// has returned already) and in the agent's event log.
    fn notif_sent(&self, r: Result<()>) {
        if let Err(e) = r {
            let msg = format!("peer {}: a notification was not delivered: {e}", self.peer_name);
            self.ctx.log(&msg);
            eprintln!("multirail: warning: {msg}");
        }
    }

    /// Hands a transfer that has completed its data to the notifier, which sends its
    /// notification and then completes it (the rails' transfers, from `complete`, and CUDA IPC
    /// transfers); without a notifier (the link closed) it fails at once.
    pub(crate) fn notify_then_finish(&self, x: Arc<XferShared>) {
        let x = match self.notify_tx.lock().expect("link lock").as_ref() {
            Some(tx) => match tx.send(Outgoing::Xfer(x)) {
                Ok(()) => return,
                Err(mpsc::SendError(Outgoing::Xfer(x))) => x,
                Err(_) => unreachable!("a transfer was sent"),
            },
            None => x,
        };
        x.finish(Err(Error::PeerLost { peer: self.peer_name.clone(), reason: "link closed before the notification was sent".into() }));
    }

    /// Queue a notification behind this link's others (`notifier`). `wait`: return the peer's
    /// answer (the native API; a refusal is the error); else return at once and report a
    /// failure on stderr (the NIXL backend's `genNotif`), a refusal held and sent again.
    pub(crate) fn send_notif(&self, msg: Vec<u8>, wait: bool) -> Result<()> {
        let (reply, answer) = match wait {
            true => {
                let (tx, rx) = mpsc::channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        let closed = || Error::PeerLost { peer: self.peer_name.clone(), reason: "link closed before the notification was sent".into() };
        let queued = self.notify_tx.lock().expect("link lock").as_ref().is_some_and(|tx| tx.send(Outgoing::Notif { msg, reply }).is_ok());
        if !queued {
            return Err(closed());
        }
        match answer {
            Some(rx) => rx.recv().unwrap_or_else(|_| Err(closed())),
            None => Ok(()),
        }
    }

    /// Send `body` on the control connection and return the answer, which must be a `Resp`
    /// with status Ok or a frame of kind `answer` (a refusal is returned as its error).
    pub(crate) fn control_call(&self, body: Body, answer: Kind) -> Result<Body> {
        let who = self.peer_name.clone();
        let overall = Instant::now() + self.ctx.cfg.timeout;
        let per_try = self.ctx.cfg.planner.stall_timeout.max(Duration::from_millis(200)).min(self.ctx.cfg.timeout);
        let mut g = self.control.lock().expect("control lock");
        let mut last: Option<Error> = None;
        let mut tries = 0usize;
        // Rails whose dial was refused (nothing listens there), and the pause after a failed
        // dial: a refused connect returns at once, and retrying it in a loop took a core for
        // the whole `timeout`.
        let mut refused = vec![false; self.rails.len()];
        let mut pause = DIAL_RETRY_MIN;
        while Instant::now() < overall {
            tries += 1;
            if g.is_none() {
                // Rails whose local link is up, those still carrying data first.
                let up = |r: &RailState| r.local.as_ref().map(|l| l.0.as_str()).filter(|d| !d.is_empty()).and_then(link_down).is_none();
                let mut order: Vec<usize> = (0..self.rails.len()).filter(|&r| up(&self.rails[r])).collect();
                order.sort_by_key(|&r| !self.t.is_up(r));
                if order.is_empty() {
                    order = (0..self.rails.len()).collect();
                }
                let ri = order[(tries - 1) % order.len()];
                match self.dial_rail(ri, Role::Control, per_try) {
                    Ok(c) => {
                        self.control_version.store(c.version, Ordering::Release);
                        *g = Some(c.stream)
                    }
                    Err(e @ (Error::StaleMetadata { .. } | Error::Auth { .. } | Error::Metadata(_))) => return Err(e),
                    Err(e) => {
                        refused[ri] = crate::net::refused(&e);
                        if order.iter().all(|&r| refused[r]) {
                            // Every rail's address refused us: the peer is not listening any
                            // more. Waiting out `timeout` would not bring it back.
                            return Err(Error::PeerLost {
                                peer: who,
                                reason: format!("every rail refused the connection (last: {e}): the peer closed or exited"),
                            });
                        }
                        last = Some(e);
                        std::thread::sleep(pause.min(overall.saturating_duration_since(Instant::now())));
                        pause = (pause * 2).min(DIAL_RETRY_MAX);
                        continue;
                    }
                }
            }
            let s = g.as_mut().expect("connected");
            let deadline = Instant::now() + per_try;
            let mut tick =
                |_: bool| if Instant::now() > deadline { Err("no answer on the control connection".to_string()) } else { Ok(()) };
            let r = wire::send(s, &self.on_wire(&body), 0, &mut tick).and_then(|_| wire::read_frame(s, &mut tick));
            match r {
                Ok((_, b @ Body::Resp { status: Status::Ok, .. })) if answer == Kind::Resp => return Ok(b),
                Ok((_, b)) if answer != Kind::Resp && b.kind() == answer => return Ok(b),
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

    /// Open one more authenticated connection to the peer with `role` (the CUDA IPC watch
    /// connection), on the first rail whose local link is up that accepts it, within the
    /// agent's `timeout`. Returns it with its connection id.
    pub(crate) fn dial_role(&self, role: Role) -> Result<(TcpStream, [u8; 16])> {
        let overall = Instant::now() + self.ctx.cfg.timeout;
        let per_try = self.ctx.cfg.planner.stall_timeout.max(Duration::from_millis(200)).min(self.ctx.cfg.timeout);
        let up = |r: &RailState| r.local.as_ref().map(|l| l.0.as_str()).filter(|d| !d.is_empty()).and_then(link_down).is_none();
        let mut order: Vec<usize> = (0..self.rails.len()).filter(|&r| up(&self.rails[r])).collect();
        order.sort_by_key(|&r| !self.t.is_up(r));
        if order.is_empty() {
            order = (0..self.rails.len()).collect();
        }
        let mut last = None;
        for &ri in order.iter().cycle().take(order.len() * 2) {
            match self.dial_rail(ri, role, per_try) {
                Ok(c) => return Ok((c.stream, c.id)),
                Err(e @ (Error::StaleMetadata { .. } | Error::Auth { .. } | Error::Metadata(_))) => return Err(e),
                Err(e) => last = Some(e),
            }
            if Instant::now() > overall {
                break;
            }
        }
        Err(last.unwrap_or_else(|| Error::PeerLost { peer: self.peer_name.clone(), reason: "no rail to connect on".into() }))
    }

    /// One authenticated connection of `role` to the peer on rail `ri` (its local end bound),
    /// the peer checked to be the life this link has metadata for.
    fn dial_rail(&self, ri: usize, role: Role, timeout: Duration) -> Result<Dialed> {
        let rail = &self.rails[ri];
        let to = Dial {
            local: rail.local.as_ref(),
            remote: rail.remote,
            role,
            expect: Some((self.peer_name.as_str(), self.incarnation)),
            timeout,
        };
        dial(&self.ctx.identity(), to)
    }

    /// Whether some rail of this link runs ucx (GPU memory then goes through the peer's tcp
    /// link unless the rails take it directly).
    pub(crate) fn has_ucx_rails(&self) -> bool {
        self.any_ucx
    }

    /// Whether vectored requests may name the peer's GPU regions: the peer on every connection
    /// of every rail took them when the rail was opened (an older peer refuses them).
    pub(crate) fn vectored_gpu(&self) -> bool {
        self.rails.iter().all(|r| r.vectored_gpu.load(Ordering::Acquire))
    }

    /// What the transport can do (GPU path included).
    pub(crate) fn caps(&self) -> Caps {
        self.t.caps()
    }

    pub(crate) fn rail_reports(&self) -> Vec<RailReport> {
        let g = self.sched.lock().expect("sched lock");
        self.rails
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // A transport that chooses per rail reports the carrier and its reason together.
                let (transport, choice) = self
                    .t
                    .choice(i)
                    .unwrap_or_else(|| (self.t.describe(i), RailChoice { reason: r.reason.clone(), ..RailChoice::default() }));
                RailReport {
                    name: r.remote_name.clone(),
                    local_addr: r.local.as_ref().map(|l| l.1.to_string()).unwrap_or_default(),
                    remote_addr: r.remote.to_string(),
                    connections: self.t.paths(i),
                    transport,
                    choice,
                    caps: self.t.rail_caps(i),
                    gpu_reason: gpu_reason(self.t.caps().gpu, &self.ctx.cfg, self.t.gpu_detail(), self.any_ucx),
                    stats: g.planner.rail_stats(i),
                    location: Loc::unpack(r.last_loc.load(Ordering::Relaxed)),
                    local_index: r.local_index,
                    io: r.io.snapshot(),
                }
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
        self.t.close();
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
        self.t.wake();
    }
}

/// What the transport sees of the link (`transport::Host`): the link's own methods, and the
/// rail facts a transport needs without the link's insides.
impl Host for Link {
    fn peer_name(&self) -> &str {
        &self.peer_name
    }

    fn cfg(&self) -> &Config {
        &self.ctx.cfg
    }

    fn rails(&self) -> usize {
        self.rails.len()
    }

    fn rail_cpus(&self, ri: usize) -> Vec<usize> {
        self.ctx.topo.get().and_then(|t| t.cpus.get(self.rails[ri].local_index).cloned()).unwrap_or_default()
    }

    fn local_dev(&self, ri: usize) -> Option<&str> {
        self.rails[ri].local.as_ref().map(|l| l.0.as_str()).filter(|d| !d.is_empty())
    }

    fn rail_indices(&self, ri: usize) -> (usize, usize) {
        (self.rails[ri].local_index, self.rails[ri].remote_index)
    }

    fn staging(&self, ri: usize) -> Arc<StageStats> {
        self.rails[ri].io.staging.clone()
    }

    /// A removed region's key is all zeros: the peer refuses the request (a transfer prepared
    /// before the removal is refused at post already, `Peer::submit`; this covers a race).
    fn key(&self, region: u64) -> RegionKey {
        self.keys.get(region).unwrap_or(RegionKey([0; 16]))
    }

    fn dial(&self, ri: usize, role: Role, timeout: Duration) -> Result<(TcpStream, [u8; 16])> {
        self.dial_rail(ri, role, timeout).map(|c| (c.stream, c.id))
    }

    fn dial_hello(&self, ri: usize, role: Role, timeout: Duration) -> Result<Dialed> {
        self.dial_rail(ri, role, timeout)
    }

    fn set_vectored(&self, ri: usize, on: bool) {
        self.sched.lock().expect("sched lock").planner.set_vectored(ri, on);
    }

    fn set_vectored_gpu(&self, ri: usize, on: bool) {
        self.rails[ri].vectored_gpu.store(on, Ordering::Release);
    }

    fn set_byte_progress(&self, ri: usize, on: bool) {
        self.sched.lock().expect("sched lock").planner.set_byte_progress(ri, on);
    }

    fn enter(&self) -> Option<Active<'_>> {
        Link::enter(self)
    }

    fn is_shutdown(&self) -> bool {
        Link::is_shutdown(self)
    }

    fn now_us(&self) -> u64 {
        Link::now_us(self)
    }

    fn next_chunk(&self, ri: usize) -> Option<(Chunk, Arc<XferShared>)> {
        Link::next_chunk(self, ri)
    }

    fn wait_chunk(&self, ri: usize, room: &dyn Fn() -> bool, stop: &dyn Fn() -> bool) -> Option<(Chunk, Arc<XferShared>)> {
        Link::wait_chunk(self, ri, room, stop)
    }

    fn wake_senders(&self) {
        self.cond.notify_all();
    }

    fn chunk_done(&self, ri: usize, chunk: ChunkId, x: &XferShared, len: u64, r: std::result::Result<(), (Status, String)>) {
        Link::chunk_done(self, ri, chunk, x, len, r)
    }

    fn rail_failed(&self, ri: usize, reason: String) {
        Link::rail_failed(self, ri, reason)
    }

    fn path_stopped(&self, ri: usize, last: &mut dyn FnMut() -> bool) {
        // A transport's thread holds the link (as `Arc<dyn Host>`) while it calls this.
        if let Some(me) = self.me.upgrade() {
            me.path_stopped(ri, last)
        }
    }

    fn tick_faults(&self) {
        self.t.tick_faults(self)
    }

    fn log(&self, msg: &str) {
        self.ctx.log(&format!("peer {}: {msg}", self.peer_name))
    }
}

/// `t`, with the faults scheduled for it (if any).
fn faulty<T: Transport + 'static>(t: T, faults: Vec<Fault>) -> Box<dyn Transport> {
    if faults.is_empty() {
        Box::new(t)
    } else {
        Box::new(Faulty::new(t, faults))
    }
}

/// What carries a link's rails: tcp alone, ucx alone (when no fallback is configured), or
/// `Mixed`, each with the fault schedule meant for it. A fault naming a transport
/// (`1/ucx:kill@...`) wraps that transport inside `Mixed`; one naming none wraps the whole.
fn transport_for(ctx: &Ctx, carriers: &[Carrier], rails: &[RailState]) -> Result<Box<dyn Transport>> {
    let n = carriers.len();
    let faults = &ctx.cfg.faults;
    let only = |k: Option<TransportKind>| -> Vec<Fault> { faults.iter().filter(|f| f.transport == k).copied().collect() };
    let with = |k: TransportKind| -> Vec<Fault> { faults.iter().filter(|f| f.transport.is_none_or(|t| t == k)).copied().collect() };
    if !carriers.contains(&Carrier::Ucx) {
        return Ok(faulty(TcpRails::new(n), with(TransportKind::Tcp)));
    }
    let Some(u) = &ctx.ucx else {
        return Err(Error::Unavailable("this agent was not started with the ucx transport".into()));
    };
    if carriers.iter().all(|c| *c == Carrier::Ucx) && ctx.cfg.fallback.after == 0 {
        return Ok(faulty(UcxRails::new(u.clone(), n), with(TransportKind::Ucx)));
    }
    let why = rails.iter().zip(carriers).map(|(r, c)| (*c, r.reason.clone())).collect();
    let mixed = Mixed::new(
        faulty(TcpRails::new(n), only(Some(TransportKind::Tcp))),
        faulty(UcxRails::new(u.clone(), n), only(Some(TransportKind::Ucx))),
        why,
        ctx.cfg.fallback,
    );
    Ok(faulty(mixed, only(None)))
}
