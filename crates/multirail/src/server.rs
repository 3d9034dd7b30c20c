//! Serving inbound connections: handshake, then metadata, notifications and one-sided
//! READ/WRITE against the registry.
//!
//! Every request is validated by `Registry::check_remote` before memory is touched. A refused
//! WRITE's payload is read into scratch and dropped, so the stream stays in sync and memory
//! outside valid requests is untouched. A peer that sends undecodable bytes gets an `Error`
//! frame and is disconnected; other connections are unaffected.
//!
//! Fencing: every served connection is registered under its `Hello` nonce. When an initiator
//! gives up on a rail it sends `Fence` with the nonces of that rail's connections (over another
//! connection); the connections named are aborted, and the reply goes out only once none of them
//! can write memory any more. WRITE payloads are applied under the connection's `apply` lock and
//! only while it is not fenced, so bytes that were still queued in the dead path (and reach this
//! host after the link returns) never land over data the reissue wrote since.
//!
//! Serving-side counters (`ServedTable`): per authenticated peer name and local rail (the
//! listener that accepted the connection), bytes and requests served by direction, refusals by
//! status, connections accepted and fenced. A connection looks its `ServedCounters` up once,
//! after the handshake; the request path only bumps relaxed atomics.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use multirail_gpu::{DevicePtr, Pages, Src};
use multirail_proto::codec::{Kind, RemoteOp, Role, Status, VecOp};
use multirail_proto::{AgentMeta, Body, DecodeError, MemType, RailInfo};

use crate::auth;
use crate::config::Progress;
use crate::ctx::Ctx;
use crate::error::{Error, Result};
use crate::net::abort_socket;
use crate::peer::{Peer, PeerOrigin, Removed};
use crate::registry::random_bytes;
use crate::registry::{Region, Registry};
use crate::staging::{SockIn, SockOut, StageError, Stagers};
use crate::transport::ucx::UcxAgent;
use crate::wire::{self, WireError};

/// A staged request that failed mid-payload leaves the stream out of step: the connection
/// ends (the initiator requeues the chunk), as for a socket error.
fn staging_failed(e: StageError) -> WireError {
    match e {
        StageError::Wire(w) => w,
        StageError::Device(m) => WireError::GaveUp(format!("GPU staging failed: {m}")),
    }
}

/// A device error stopped a stream of staged READ answers after `sent` bytes (issue 35 defect
/// 5). When it stopped between answers, those not begun are answered with the error and the
/// connection serves on: the READs fail, not the rail. An answer cut short leaves the stream out
/// of step: the connection ends then (a header already said Ok).
fn unsent_reads_fail(
    s: &mut TcpStream,
    ctr: &ServedCounters,
    segs: &[(u64, u64, u64)],
    sent: u64,
    m: &str,
    tick: &mut dyn FnMut(bool) -> Result<(), String>,
) -> Result<(), WireError> {
    let mut at = 0u64;
    let mut unsent = Vec::new();
    for &(id, wire_len, _) in segs {
        if sent > at && sent < at + wire_len {
            return Err(staging_failed(StageError::Device(m.to_string())));
        }
        if sent <= at {
            unsent.push(id);
        }
        at += wire_len;
    }
    let msg = format!("GPU staging failed on the target: {m}");
    for id in unsent {
        ctr.refuse(Status::Internal);
        wire::send(s, &Body::Resp { status: Status::Internal, bulk_len: 0, msg: msg.clone() }, id, tick)?;
    }
    Ok(())
}

/// A stream of staged READ answers (`segs`: request id, bytes on the wire, payload bytes) ended
/// after `sent` bytes: the answers not sent in full are taken back out of the served counts
/// (`staged_reads` counted each when it joined the stream).
fn uncount_unsent_reads(ctr: &ServedCounters, segs: &[(u64, u64, u64)], sent: u64) {
    let mut at = 0u64;
    for &(_, wire_len, payload) in segs {
        at += wire_len;
        if sent < at {
            ctr.bytes_read.fetch_sub(payload, Ordering::Relaxed);
            ctr.requests_read.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// State shared between the agent handle, its listeners and its connection threads.
pub struct Shared {
    pub ctx: Arc<Ctx>,
    pub registry: Registry,
    pub peers: RwLock<HashMap<String, Arc<Peer>>>,
    /// Notifications from peers, until the application takes them.
    pub notifs: crate::inbox::Inbox,
    /// Numbered notifications already queued, per peer and incarnation (exactly once).
    pub notif_seen: crate::notif_seen::NotifSeen,
    pub shutdown: AtomicBool,
    pub rails_meta: Vec<RailInfo>,
    /// Serving threads running (each leaves it only after dropping its `Shared`: `close` then
    /// knows that no serving thread holds the last reference, whose drop would tear UCX down
    /// on a thread the application no longer waits for).
    pub open_conns: Arc<AtomicUsize>,
    /// Connections in their handshake (at most `max_handshakes`), and authenticated ones (at most
    /// `max_connections`): the two never share slots.
    pub handshakes: Handshakes,
    pub authed: AtomicUsize,
    /// Served connections by their `Hello` nonce, for `Fence`.
    pub served: Mutex<HashMap<[u8; 16], Arc<Served>>>,
    /// Connections aborted by a peer's `Fence`.
    pub fenced: AtomicUsize,
    /// Frames refused from peers (malformed, wrong key, ...), for tests and reports.
    pub refused: AtomicUsize,
    /// Serving-side counters per (peer, local rail): what peers read from and wrote into us.
    pub served_stats: ServedTable,
    /// UCX state (one context per rail, every region mapped) when `cfg.transport` is Ucx.
    pub(crate) ucx: Option<Arc<UcxAgent>>,
    /// CUDA IPC handles given to peers, and their watch connections (revocation).
    pub(crate) ipc_exports: crate::ipc::Exports,
    /// Receive-window shares of each rail's data connections (`Config::fan_in_window`).
    pub(crate) shares: crate::fanin::WindowShares,
}

impl Shared {
    pub fn metadata(&self) -> AgentMeta {
        AgentMeta {
            name: self.ctx.name.clone(),
            incarnation: self.ctx.incarnation,
            rails: self.rails_meta.clone(),
            regions: self.registry.exported(),
        }
    }

    /// Install metadata for a peer, from the application (replacing an older life of it; the
    /// same life with other regions is updated in place: `Shared::install`).
    pub fn add_remote(&self, meta: AgentMeta, addr_hint: Option<IpAddr>) -> Result<String> {
        let (name, replaced, removed) = self.replace_remote(meta, addr_hint)?;
        removed.finish();
        if let Some(p) = replaced {
            p.close();
        }
        Ok(name)
    }

    /// As [`Shared::add_remote`], in one step under the table's lock, but the peer it replaced
    /// (if any) is handed to the caller, open, rather than closed (the NIXL engine lets its
    /// transfers finish), and so are the regions an in-place update removed (`Removed::finish`
    /// closes their CUDA IPC mappings: call it once no lock of the caller's is held). On an
    /// error nothing changed: a peer of that name stays installed.
    pub fn replace_remote(&self, meta: AgentMeta, addr_hint: Option<IpAddr>) -> Result<(String, Option<Arc<Peer>>, Removed)> {
        self.install(meta, addr_hint, PeerOrigin::App).map_err(|(_, msg)| Error::Metadata(msg))
    }

    /// Install metadata a peer pushed itself (`MetaPut`): never over a peer the application
    /// installed. Refusals carry the status to answer.
    pub(crate) fn add_remote_from_wire(&self, meta: AgentMeta, addr_hint: Option<IpAddr>) -> std::result::Result<String, (Status, String)> {
        let (name, replaced, removed) = self.install(meta, addr_hint, PeerOrigin::Wire)?;
        removed.finish();
        if let Some(p) = replaced {
            p.close();
        }
        Ok(name)
    }

    /// Insert or replace a peer, within `max_peers`; the replaced one is returned (the caller
    /// closes it, after the table's lock is released: other threads keep using the table).
    /// Metadata of the installed peer's own life (same incarnation, rails, address hint and
    /// origin: `Peer::same_life`) only changes its regions, in place (`Peer::update_regions`,
    /// checked and done under the table's write lock, so a peer removed or replaced meanwhile
    /// is never the one updated): its links, connections and transfers in flight stay, and
    /// nothing is returned to close, only the removed regions (`Removed`) to finish.
    /// Peers pushed from the wire never keep the application's own out: a full table makes room
    /// for an application install by dropping (and closing) a peer that came by `MetaPut`.
    #[allow(clippy::type_complexity)]
    fn install(
        &self,
        meta: AgentMeta,
        addr_hint: Option<IpAddr>,
        origin: PeerOrigin,
    ) -> std::result::Result<(String, Option<Arc<Peer>>, Removed), (Status, String)> {
        if meta.name.is_empty() {
            return Err((Status::Malformed, "metadata has an empty agent name".into()));
        }
        if meta.name == self.ctx.name {
            return Err((Status::Malformed, format!("metadata is this agent's own ({:?})", meta.name)));
        }
        let name = meta.name.clone();
        {
            let g = self.peers.write().expect("peers lock");
            if let Some(p) = g.get(&name).filter(|p| p.same_life(&meta, addr_hint, origin)) {
                let removed = p.update_regions(meta.regions);
                return Ok((name, None, Removed::new(p.clone(), removed)));
            }
        }
        let mut peer = Peer::new(meta, addr_hint, self.ctx.clone());
        peer.origin = origin;
        let (old, evicted) = {
            let mut g = self.peers.write().expect("peers lock");
            let mut evicted = None;
            match g.get(&name) {
                Some(old) if origin == PeerOrigin::Wire && old.origin == PeerOrigin::App => {
                    return Err((
                        Status::Unexpected,
                        format!("peer {name:?} was installed by the application; MetaPut does not replace it"),
                    ));
                }
                None if g.len() >= self.ctx.cfg.max_peers => {
                    let pushed = g.iter().find(|(_, p)| p.origin == PeerOrigin::Wire).map(|(n, _)| n.clone());
                    match pushed {
                        Some(n) if origin == PeerOrigin::App => evicted = g.remove(&n),
                        _ => {
                            return Err((
                                Status::Busy,
                                format!("peer table full: {} peers (max_peers = {}); {name:?} not added", g.len(), self.ctx.cfg.max_peers),
                            ))
                        }
                    }
                }
                _ => {}
            }
            (g.insert(name.clone(), peer.into_arc()), evicted)
        };
        if let Some(p) = evicted {
            p.close();
        }
        Ok((name, old, Removed::default()))
    }
}

/// Connections still in their handshake (accepted, not authenticated yet), at most
/// `Config::max_handshakes`: when full, the oldest is dropped for the newcomer. Unauthenticated
/// sockets then can neither take the connection slots of authenticated peers (counted apart, in
/// `Shared::authed`) nor keep new peers out by idling in their handshake.
#[derive(Default)]
pub struct Handshakes {
    inner: Mutex<(u64, std::collections::VecDeque<(u64, TcpStream)>)>,
}

impl Handshakes {
    /// Admit `s`'s handshake, aborting the oldest ones beyond `max`; the id to `finish` with.
    fn admit(&self, s: &TcpStream, max: usize) -> Option<u64> {
        let clone = s.try_clone().ok()?;
        let mut g = self.inner.lock().expect("handshakes lock");
        while g.1.len() >= max.max(1) {
            if let Some((_, old)) = g.1.pop_front() {
                abort_socket(&old);
            }
        }
        g.0 += 1;
        let id = g.0;
        g.1.push_back((id, clone));
        Some(id)
    }

    fn finish(&self, id: u64) {
        self.inner.lock().expect("handshakes lock").1.retain(|(i, _)| *i != id);
    }
}

/// An authenticated connection's slot (`Shared::authed`), given back when it ends.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

const TICK: Duration = Duration::from_millis(50);
/// Longest sleep of an idle served connection between two checks of the shutdown and fence
/// flags (closing and fencing also wake it at once, by aborting its socket).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Distinct peer names `ServedTable` keeps counters for; later names are folded into
/// [`OTHER_PEER`], so a stream of made-up names cannot grow the table without bound.
pub const MAX_SERVED_PEERS: usize = 4096;
/// The peer label of the names beyond [`MAX_SERVED_PEERS`].
pub const OTHER_PEER: &str = "_other";
/// The peer label of refusals before a peer authenticated (bad Hello, failed proof).
pub const UNAUTHENTICATED_PEER: &str = "_unauthenticated";
/// The rail label of the side channel (`host:port`) when the agent has configured rails.
pub const SIDE_RAIL: &str = "side";
/// Number of `Status` codes (refusals are counted per code).
const N_STATUS: usize = Status::Internal as usize + 1;

/// What one peer got served on one local rail. Relaxed atomics: monotonic counters, read
/// at scrape time.
#[derive(Default)]
pub struct ServedCounters {
    /// READ payload bytes sent out of our memory, and READ requests answered with data.
    pub bytes_read: AtomicU64,
    pub requests_read: AtomicU64,
    /// WRITE payload bytes landed in our memory, and WRITE requests applied.
    pub bytes_written: AtomicU64,
    pub requests_written: AtomicU64,
    /// Requests refused, by `Status` code.
    refused: [AtomicU64; N_STATUS],
    /// Connections accepted (after the handshake), UCX sessions among them.
    pub connections: AtomicU64,
    pub ucx_sessions: AtomicU64,
    /// Connections a `Fence` of the peer aborted.
    pub fenced: AtomicU64,
    /// GPU memory staged to serve this peer on this rail.
    pub staging: Arc<crate::staging::StageStats>,
}

impl crate::transport::ucx::AmCounters for ServedCounters {
    fn served(&self, write: bool, bytes: u64) {
        let (b, n) = if write { (&self.bytes_written, &self.requests_written) } else { (&self.bytes_read, &self.requests_read) };
        b.fetch_add(bytes, Ordering::Relaxed);
        n.fetch_add(1, Ordering::Relaxed);
    }

    fn refused(&self, status: Status) {
        self.refuse(status);
    }
}

impl ServedCounters {
    pub fn refuse(&self, status: Status) {
        self.refused[(status as usize).min(N_STATUS - 1)].fetch_add(1, Ordering::Relaxed);
    }
    fn refused_by_status(&self) -> Vec<(Status, u64)> {
        (0..N_STATUS as u16)
            .filter_map(|c| {
                let n = self.refused[c as usize].load(Ordering::Relaxed);
                (n > 0).then(|| (Status::from_u16(c), n))
            })
            .collect()
    }
}

/// A local rail as the serving counters label it: the listener that accepted a connection.
#[derive(Debug, Clone)]
pub struct ServedRail {
    /// The rail's name (`RailInfo::name`), or [`SIDE_RAIL`] for a separate side channel.
    pub name: String,
    /// Index into the agent's rails; None for the side channel of an agent with rails.
    pub index: Option<usize>,
}

/// One (peer, rail) row of `Agent::served_stats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedReport {
    /// The authenticated peer name, [`OTHER_PEER`] or [`UNAUTHENTICATED_PEER`].
    pub peer: String,
    /// The local rail's name ([`SIDE_RAIL`] for the side channel) and index (None: side channel).
    pub rail: String,
    pub rail_index: Option<usize>,
    pub bytes_read: u64,
    pub requests_read: u64,
    pub bytes_written: u64,
    pub requests_written: u64,
    /// Requests refused in all, and by status (codes with a count only).
    pub refused: u64,
    pub refused_by_status: Vec<(Status, u64)>,
    pub connections: u64,
    pub ucx_sessions: u64,
    pub fenced: u64,
    pub staging: crate::staging::StageReport,
}

#[derive(Default)]
struct TableInner {
    by_key: HashMap<(String, usize), Arc<ServedCounters>>,
    peers: HashSet<String>,
}

/// Serving-side counters of an agent, by (peer, listener). Consulted under its lock only when a
/// connection starts (or is refused before authenticating); memory is bounded by
/// `max_peers` + 2 names times the number of listeners.
pub struct ServedTable {
    rails: Vec<ServedRail>,
    max_peers: usize,
    inner: Mutex<TableInner>,
}

impl ServedTable {
    /// `rails[i]` labels listener `i` (0: the side channel).
    pub fn new(rails: Vec<ServedRail>, max_peers: usize) -> ServedTable {
        ServedTable { rails, max_peers, inner: Mutex::new(TableInner::default()) }
    }

    /// The counters of `peer` on listener `listener`; a new name beyond `max_peers` gets the
    /// shared [`OTHER_PEER`] counters.
    pub fn counters(&self, peer: &str, listener: usize) -> Arc<ServedCounters> {
        let mut g = self.inner.lock().expect("served table lock");
        let label = if peer == UNAUTHENTICATED_PEER || peer == OTHER_PEER || g.peers.contains(peer) {
            peer
        } else if g.peers.len() < self.max_peers {
            g.peers.insert(peer.to_string());
            peer
        } else {
            OTHER_PEER
        };
        g.by_key.entry((label.to_string(), listener)).or_default().clone()
    }

    /// The CPUs local to the NIC of listener `listener`'s rail, from `topo` (empty: the side
    /// channel, no topology set, or unknown).
    pub fn rail_cpus(&self, listener: usize, topo: Option<&crate::ctx::RailTopo>) -> Vec<usize> {
        let index = self.rails.get(listener).and_then(|r| r.index);
        index.and_then(|i| topo?.cpus.get(i).cloned()).unwrap_or_default()
    }

    /// Every (peer, rail) row, sorted by peer then listener.
    pub fn report(&self) -> Vec<ServedReport> {
        let rows: Vec<((String, usize), Arc<ServedCounters>)> =
            self.inner.lock().expect("served table lock").by_key.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut out: Vec<(usize, ServedReport)> = rows
            .into_iter()
            .map(|((peer, l), c)| {
                let rail = self.rails.get(l).cloned().unwrap_or(ServedRail { name: format!("listener{l}"), index: None });
                let by_status = c.refused_by_status();
                let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
                let rep = ServedReport {
                    peer,
                    rail: rail.name,
                    rail_index: rail.index,
                    bytes_read: ld(&c.bytes_read),
                    requests_read: ld(&c.requests_read),
                    bytes_written: ld(&c.bytes_written),
                    requests_written: ld(&c.requests_written),
                    refused: by_status.iter().map(|(_, n)| n).sum(),
                    refused_by_status: by_status,
                    connections: ld(&c.connections),
                    ucx_sessions: ld(&c.ucx_sessions),
                    fenced: ld(&c.fenced),
                    staging: c.staging.report(),
                };
                (l, rep)
            })
            .collect();
        out.sort_by(|a, b| (&a.1.peer, a.0).cmp(&(&b.1.peer, b.0)));
        out.into_iter().map(|(_, r)| r).collect()
    }
}

/// One served connection, as known to `Fence`.
pub struct Served {
    /// The authenticated peer name; only that peer may fence the connection.
    peer: String,
    fenced: AtomicBool,
    /// Held while a WRITE payload is being applied to memory.
    apply: Mutex<()>,
    sock: TcpStream,
    /// The peer's serving counters on the listener that accepted the connection.
    ctr: Arc<ServedCounters>,
}

impl std::os::fd::AsRawFd for Served {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }
}

/// Removes a connection from the fence table when its serve loop ends (no memory access after).
struct Registered<'a> {
    sh: &'a Shared,
    id: [u8; 16],
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.sh.served.lock().expect("served lock").remove(&self.id);
    }
}

/// Abort `peer`'s connections named by `ids` and wait until none of them is applying a WRITE.
/// Unknown ids (already closed) and other peers' connections are skipped. Returns how many
/// connections were fenced.
fn fence(sh: &Shared, peer: &str, ids: &[[u8; 16]]) -> usize {
    let victims: Vec<Arc<Served>> = {
        let g = sh.served.lock().expect("served lock");
        ids.iter().filter_map(|id| g.get(id)).filter(|c| c.peer == peer).cloned().collect()
    };
    for c in &victims {
        c.fenced.store(true, Ordering::Release);
        // Purges whatever is still queued on the socket and wakes a reader blocked on it.
        abort_socket(&c.sock);
    }
    for c in &victims {
        drop(c.apply.lock().expect("apply lock"));
        c.ctr.fenced.fetch_add(1, Ordering::Relaxed);
    }
    sh.fenced.fetch_add(victims.len(), Ordering::Relaxed);
    if !victims.is_empty() {
        sh.ctx.log(&format!("fenced {} connection(s) of {peer}", victims.len()));
    }
    victims.len()
}

/// Abort every served connection (at `Agent::close`): blocked reads and writes fail at once,
/// and no further request is served on any of them.
pub(crate) fn abort_all(sh: &Shared) {
    let all: Vec<Arc<Served>> = sh.served.lock().expect("served lock").values().cloned().collect();
    for c in all {
        c.fenced.store(true, Ordering::Release);
        abort_socket(&c.sock);
    }
}

/// Accept connections on listener number `listener` (0: the side channel, then one per rail; the
/// label of its serving counters).
pub fn accept_loop(sh: Arc<Shared>, l: TcpListener, listener: usize) {
    loop {
        let r = l.accept();
        if sh.shutdown.load(Ordering::Acquire) {
            return;
        }
        let Ok((s, _)) = r else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        // Serving threads: authenticated connections plus handshakes (each bounded on its own).
        if sh.open_conns.load(Ordering::Acquire) >= sh.ctx.cfg.max_connections + sh.ctx.cfg.max_handshakes {
            let mut s = s;
            let _ = s.set_write_timeout(Some(TICK));
            let _ = wire::send(&mut s, &Body::Error { status: Status::Busy, msg: "too many connections".into() }, 0, &mut |_| {
                Err(String::new())
            });
            continue;
        }
        sh.open_conns.fetch_add(1, Ordering::AcqRel);
        let (sh2, running) = (sh.clone(), sh.open_conns.clone());
        let spawned = std::thread::Builder::new().name("mr-serve".into()).spawn(move || {
            serve(&sh2, s, listener);
            drop(sh2);
            running.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            sh.open_conns.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn decode_status(e: &DecodeError) -> Status {
    match e {
        DecodeError::VersionMismatch { .. } => Status::VersionMismatch,
        DecodeError::BodyTooLarge { .. } | DecodeError::TooMany { .. } => Status::TooLarge,
        _ => Status::Malformed,
    }
}

/// Count a refused request: the agent's total and the peer's counters.
fn count_refused(sh: &Shared, ctr: &ServedCounters, status: Status) {
    sh.refused.fetch_add(1, Ordering::Relaxed);
    ctr.refuse(status);
}

/// Tell the peer why it is being dropped (best effort) and count the refusal.
fn refuse(sh: &Shared, ctr: &ServedCounters, s: &mut TcpStream, who: &str, status: Status, msg: String) {
    count_refused(sh, ctr, status);
    sh.ctx.log(&format!("refused {who}: {status:?}: {msg}"));
    let _ = wire::send(s, &Body::Error { status, msg }, 0, &mut |_| Err(String::new()));
}

fn serve(sh: &Arc<Shared>, mut s: TcpStream, listener: usize) {
    let who = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(TICK));
    let _ = s.set_write_timeout(Some(TICK));
    let timeout = sh.ctx.cfg.timeout;
    let Some(admitted) = sh.handshakes.admit(&s, sh.ctx.cfg.max_handshakes) else {
        let _ = s.shutdown(Shutdown::Both);
        return;
    };
    let greeted = handshake(sh, &mut s, &who, listener);
    sh.handshakes.finish(admitted);
    let Some(Greeted { role, name: peer_name, conn_id, version: hello_version, welcome, session_key }) = greeted else {
        let _ = s.shutdown(Shutdown::Both);
        return;
    };
    let who = format!("{peer_name}@{who}");
    let Ok(sock) = s.try_clone() else {
        let _ = s.shutdown(Shutdown::Both);
        return;
    };
    // Looked up once per connection: the request path below only bumps its atomics.
    let ctr = sh.served_stats.counters(&peer_name, listener);
    if sh.authed.fetch_add(1, Ordering::AcqRel) >= sh.ctx.cfg.max_connections {
        sh.authed.fetch_sub(1, Ordering::AcqRel);
        refuse(sh, &ctr, &mut s, &who, Status::Busy, "too many connections".into());
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    let _slot = Slot(&sh.authed);
    ctr.connections.fetch_add(1, Ordering::Relaxed);
    if role == Role::UcxSession {
        ctr.ucx_sessions.fetch_add(1, Ordering::Relaxed);
    }
    let me = Arc::new(Served { peer: peer_name.clone(), fenced: AtomicBool::new(false), apply: Mutex::new(()), sock, ctr: ctr.clone() });
    {
        let mut g = sh.served.lock().expect("served lock");
        if g.contains_key(&conn_id) {
            drop(g);
            refuse(sh, &ctr, &mut s, &who, Status::Unexpected, "connection id already in use".into());
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        g.insert(conn_id, me.clone());
    }
    let _registered = Registered { sh, id: conn_id };
    // A data connection takes its share of its peer's part of its rail's receive window; the
    // others on the rail shrink now and grow back when it leaves. A peer is its proven name, or
    // without a secret its address: its many connections never take the others' parts.
    let peer_key = crate::fanin::peer_key(sh.ctx.cfg.secret.is_some(), &peer_name, s.peer_addr().ok());
    let _share = if role == Role::Data { sh.shares.join(listener, peer_key.clone(), me.clone()) } else { None };
    // `Agent::close` sets `shutdown` before it aborts the connections in `served`: one
    // registered after that sees the flag here.
    if sh.shutdown.load(Ordering::SeqCst) {
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    // Only now may the peer use the connection: a Fence that names it (sent over another
    // connection right after this handshake) finds it registered. Welcomed before, a serving
    // thread descheduled between the two could miss the Fence and apply a WRITE after it.
    let deadline = Instant::now() + timeout;
    let mut tick = |_: bool| if sh.shutdown.load(Ordering::Acquire) || Instant::now() > deadline { Err(String::new()) } else { Ok(()) };
    if wire::send(&mut s, &Body::Welcome { mac: welcome }, 0, &mut tick).is_err() {
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    if role == Role::UcxSession {
        serve_ucx(sh, &mut s, &me, &who, hello_version, session_key);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    if role == Role::IpcWatch {
        crate::ipc::serve_watch(&sh.ctx, &sh.ipc_exports, &mut s, conn_id, &peer_name);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    // Only data connections busy-poll for their next request. A control connection carries
    // notifications, fences, probes and metadata: nothing waits on its round trip by the
    // microsecond, and its spin after each of a request's per-layer notifications took ~100 us
    // of CPU apiece (~10% of a core in loopback kv at 8 KiB pages) from the data path's threads.
    let spins = role == Role::Data && sh.ctx.cfg.progress != Progress::Block;
    // Issue 34 item 3: a connection on a rail runs on that rail's NIC-local CPUs and stages
    // through pools on the NIC's NUMA node, as the initiator's rail threads do (none known: as
    // before).
    let cpus = sh.served_stats.rail_cpus(listener, sh.ctx.topo.get());
    crate::numa::pin_current_thread(&cpus);
    Conn::new(sh, &me, ctr, &peer_name, &who, role, s, crate::numa::node_of_cpus(&cpus), &peer_key).run(spins);
}

/// What a request handler returns; an error ends the connection (the stream is out of step, the
/// connection was fenced or the agent is closing; the initiator reissues on another path).
type Handled = std::result::Result<(), WireError>;
type TickFn<'t> = dyn FnMut(bool) -> std::result::Result<(), String> + 't;

/// The error a handler returns to end its connection without a word to the peer.
fn hang_up() -> WireError {
    WireError::GaveUp(String::new())
}

fn ok_resp() -> Body {
    Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }
}

/// The tick of one request: gives up when the agent closes, the connection is fenced, or the
/// request has run `timeout`.
fn request_tick<'t>(sh: &'t Shared, me: &'t Served, timeout: Duration) -> impl FnMut(bool) -> std::result::Result<(), String> + 't {
    let t0 = Instant::now();
    move |_| {
        if sh.shutdown.load(Ordering::Acquire) || me.fenced.load(Ordering::Acquire) {
            Err(String::new())
        } else if t0.elapsed() > timeout {
            Err(format!("request not completed within {timeout:?}"))
        } else {
            Ok(())
        }
    }
}

/// The fence lock of a served connection (`Served::apply`) and the GPU WRITEs it covers.
///
/// Invariant, between requests: the lock is held exactly while GPU WRITEs are pending (received,
/// their last copies maybe still running). `check` asserts it in debug builds at every request.
/// Every acquisition of the lock on the serving thread goes through these methods, so that thread
/// never takes it twice, and a `Fence` of the connection waits only for WRITEs in flight.
struct FenceLock<'a> {
    apply: &'a Mutex<()>,
    held: Option<MutexGuard<'a, ()>>,
    pending: PendingWrites,
}

impl<'a> FenceLock<'a> {
    fn new(apply: &'a Mutex<()>) -> Self {
        FenceLock { apply, held: None, pending: PendingWrites::default() }
    }

    fn check(&self) {
        debug_assert_eq!(self.held.is_some(), !self.pending.is_empty(), "the fence lock is held exactly while GPU WRITEs are pending");
    }

    /// Take the lock (or keep it) for a GPU WRITE about to be staged; `push` records it.
    fn hold(&mut self) {
        if self.held.is_none() {
            self.held = Some(self.apply.lock().expect("apply lock"));
        }
    }

    fn push(&mut self, req_id: u64, len: u64, region: Arc<Region>) {
        debug_assert!(self.held.is_some(), "a staged WRITE is pending only under the fence lock");
        self.pending.push(req_id, len, region);
    }

    /// After pending WRITEs were answered: the lock goes once none is left.
    fn settle(&mut self) {
        if self.pending.is_empty() {
            self.held = None;
        }
    }

    /// The lock for one host WRITE, which the caller applies and then drops. No GPU WRITE is
    /// pending then (the dispatcher answers them before anything else).
    fn for_host_write(&mut self) -> MutexGuard<'a, ()> {
        debug_assert!(self.pending.is_empty() && self.held.is_none());
        self.held.take().unwrap_or_else(|| self.apply.lock().expect("apply lock"))
    }
}

/// One served control or data connection after its handshake: its socket and what its requests
/// share. `run` is the dispatcher: it waits for a frame and hands it to the handler of its kind
/// (one per row of docs/PROTOCOL.md's table); a handler answers, or ends the connection.
struct Conn<'a> {
    sh: &'a Shared,
    me: &'a Served,
    ctr: Arc<ServedCounters>,
    peer: &'a str,
    who: &'a str,
    /// Control or data (`Hello`'s role).
    role: Role,
    timeout: Duration,
    s: TcpStream,
    fd: std::os::fd::RawFd,
    inb: wire::Inbound,
    /// Bounce pools for GPU regions, made on the first request that needs one.
    stage: Stagers,
    /// Answers of landed GPU WRITEs go out on a second handle of the socket while this one is
    /// receiving the next payload (made on first use).
    answers: Option<TcpStream>,
    /// WRITEs into GPU memory received but maybe not landed: their last H2D copies run while
    /// the next request is read, so the pipeline does not drain at every request. Their
    /// responses go out in order once landed, and always before this connection waits for the
    /// socket or serves anything else. The fence lock is held meanwhile.
    lock: FenceLock<'a>,
    /// Order of numbered notifications (`notif_seq`): the number of the last one on this
    /// connection, and when one was refused (None: not since the sender last went back to an
    /// older one).
    notif_last: u64,
    notif_refused: Option<Instant>,
}

impl<'a> Conn<'a> {
    /// `node`: the NUMA node of the rail's NIC, where its staging pools should be (None: unknown).
    #[allow(clippy::too_many_arguments)]
    fn new(
        sh: &'a Shared,
        me: &'a Served,
        ctr: Arc<ServedCounters>,
        peer: &'a str,
        who: &'a str,
        role: Role,
        s: TcpStream,
        node: Option<i32>,
        peer_key: &str,
    ) -> Self {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
        // Pools borrowed for this peer: while another peer waits, it holds at most its share.
        let stage = Stagers::new(sh.ctx.cfg.staging, ctr.staging.clone(), node).for_peer(peer_key);
        Conn {
            sh,
            me,
            ctr,
            peer,
            who,
            role,
            timeout: sh.ctx.cfg.timeout,
            s,
            fd,
            inb: wire::Inbound::new(),
            stage,
            answers: None,
            lock: FenceLock::new(&me.apply),
            notif_last: 0,
            notif_refused: None,
        }
    }

    fn closing(&self) -> bool {
        self.sh.shutdown.load(Ordering::Acquire) || self.me.fenced.load(Ordering::Acquire)
    }

    /// The dispatcher.
    fn run(mut self, spins: bool) {
        let spin = wire::SpinBudget::new(self.sh.ctx.cfg.serve_spin);
        loop {
            self.lock.check();
            if !self.lock.pending.is_empty() && self.inb.unread() == 0 && !wire::readable_now(self.fd) {
                // Nothing more to read right now: let every pending WRITE land and answer it.
                // Bounded as a request: a peer that stops reading its answers loses the
                // connection after `timeout` (it used to keep this thread, the fence lock and the
                // pinned staging pool until a fence or close).
                let mut t = request_tick(self.sh, self.me, self.timeout);
                if self.flush_writes(true, &mut t).is_err() {
                    break;
                }
            }
            self.wait_for_request(spins, &spin);
            let Some((h, body)) = self.next_frame() else { break };
            if self.sh.shutdown.load(Ordering::SeqCst) || self.me.fenced.load(Ordering::Acquire) {
                break; // closing (or fenced): serve nothing more, touch no memory
            }
            let mut tick = request_tick(self.sh, self.me, self.timeout);
            if self.dispatch(h.req_id, body, &mut tick).is_err() {
                break;
            }
        }
        // Before the fence lock goes: no staged copy may still write the application's memory.
        let Conn { mut stage, lock, s, .. } = self;
        stage.abandon();
        drop(lock);
        let _ = s.shutdown(Shutdown::Both);
    }

    /// Waits until a request starts to arrive (or the agent closes, or a fence aborts the socket).
    fn wait_for_request(&mut self, spins: bool, spin: &wire::SpinBudget) {
        let (sh, me, fd) = (self.sh, self.me, self.fd);
        // When a spin ran out: when it began (the budget grows back if the request came soon after).
        let mut spun_out: Option<Instant> = None;
        if spins && self.inb.unread() == 0 {
            // Busy-poll for the next request before sleeping in the kernel: a client in a
            // round-trip loop sends it within microseconds, and a wake-up costs more.
            // `Poll` spins the whole `serve_spin` every time (its contract: busy-poll for it after
            // each request); `Adaptive` adapts the budget to how often spinning pays.
            let adaptive = sh.ctx.cfg.progress == Progress::Adaptive;
            let t_spin = Instant::now();
            let r = wire::spin_readable(fd, if adaptive { spin.get() } else { sh.ctx.cfg.serve_spin }, || {
                Ok::<bool, ()>(!sh.shutdown.load(Ordering::Acquire) && !me.fenced.load(Ordering::Acquire))
            });
            if let (Ok(how), true) = (r, adaptive) {
                spin.record(how);
                spun_out = (how == wire::Spin::Exhausted).then_some(t_spin);
            }
        }
        // Idle between frames: sleep in `poll` until a request comes, not in 50 ms read ticks
        // (an idle peer cost 20 wake-ups a second per connection; 64 idle peers x 2 rails took
        // 2.6% of a core). Close and fence abort the socket, which wakes the poll at once;
        // IDLE_WAIT only bounds a wake-up that could be missed.
        while self.inb.unread() == 0 && !wire::poll_in(fd, IDLE_WAIT) {
            if self.closing() {
                break;
            }
        }
        if let Some(t) = spun_out {
            spin.woke(t.elapsed());
        }
    }

    /// The next frame; None ends the connection (refused with a reason where there is one).
    fn next_frame(&mut self) -> Option<(multirail_proto::codec::Header, Body)> {
        let (sh, timeout) = (self.sh, self.timeout);
        // Idle between frames is fine; a frame, once started, must finish within `timeout`.
        let mut started_at: Option<Instant> = None;
        let mut tick = |started: bool| {
            if sh.shutdown.load(Ordering::Acquire) {
                return Err(String::new());
            }
            if started {
                let t = *started_at.get_or_insert_with(Instant::now);
                if t.elapsed() > timeout {
                    return Err(format!("frame not completed within {timeout:?}"));
                }
            }
            Ok(())
        };
        match self.inb.read_frame(&mut self.s, &mut tick) {
            Ok(f) => Some(f),
            Err(WireError::Decode(e)) => {
                refuse(sh, &self.ctr, &mut self.s, self.who, decode_status(&e), e.to_string());
                None
            }
            Err(WireError::GaveUp(m)) => {
                if !m.is_empty() {
                    refuse(sh, &self.ctr, &mut self.s, self.who, Status::Malformed, m);
                }
                None
            }
            Err(WireError::Io(_)) => None,
        }
    }

    /// One request to its handler. Answers go out in request order: GPU WRITEs still pending are
    /// answered first, unless this is another GPU WRITE into the same device.
    fn dispatch(&mut self, req: u64, body: Body, tick: &mut TickFn<'_>) -> Handled {
        let gpu_write = self.gpu_write_target(&body);
        if !self.lock.pending.is_empty() && gpu_write.as_ref().is_none_or(|(_, r)| Some(r.dev) != self.lock.pending.dev) {
            self.flush_writes(true, tick)?;
        }
        if let Some((dst, region)) = gpu_write {
            return self.write_gpu(req, dst, region, tick);
        }
        match body {
            Body::ReadReq(op) => self.read(req, op, tick),
            Body::WriteReq(op) => self.write(req, op, tick),
            Body::Notif(msg) => self.notif(req, msg, tick),
            Body::NotifSeq { incarnation, seq, msg } => self.notif_seq(req, incarnation, seq, msg, tick),
            Body::Ping => self.answer(req, &ok_resp(), tick),
            Body::Fence(ids) => self.fence(req, &ids, tick),
            Body::ReadVReq(op) => self.read_vec(req, op, tick),
            Body::WriteVReq(op) => self.write_vec(req, op, tick),
            Body::MetaGet => self.answer(req, &Body::Meta(self.sh.metadata().encode()), tick),
            Body::MetaPut(blob) => self.meta_put(req, &blob, tick),
            Body::IpcReq { host, watch, regions } => {
                let answer =
                    crate::ipc::answer(&self.sh.ctx.cfg, &self.sh.registry, &self.sh.ipc_exports, self.peer, host, watch, &regions);
                self.answer(req, &answer, tick)
            }
            other => {
                refuse(self.sh, &self.ctr, &mut self.s, self.who, Status::Unexpected, format!("{:?} is not a request", other.kind()));
                Err(hang_up())
            }
        }
    }

    fn answer(&mut self, req: u64, body: &Body, tick: &mut TickFn<'_>) -> Handled {
        wire::send(&mut self.s, body, req, tick)
    }

    /// A request the registry (or a handler) refused: counted, answered with why.
    fn refused(&mut self, req: u64, status: Status, msg: String, tick: &mut TickFn<'_>) -> Handled {
        count_refused(self.sh, &self.ctr, status);
        self.answer(req, &Body::Resp { status, bulk_len: 0, msg }, tick)
    }

    fn served(&self, write: bool, bytes: u64) {
        let c = &self.ctr;
        let (b, n) = if write { (&c.bytes_written, &c.requests_written) } else { (&c.bytes_read, &c.requests_read) };
        b.fetch_add(bytes, Ordering::Relaxed);
        n.fetch_add(1, Ordering::Relaxed);
    }

    /// Answers the pending GPU WRITEs that have landed (all of them when `wait`); the fence lock
    /// goes when none is left.
    fn flush_writes(&mut self, wait: bool, tick: &mut TickFn<'_>) -> Handled {
        let r = self.lock.pending.flush(&mut self.stage, &mut self.s, &mut self.inb, &self.ctr, wait, tick);
        self.lock.settle();
        r
    }

    /// Where a request writes into GPU memory (one range, or a vectored request's pages), when
    /// the registry accepts it and it carries bytes. Refused ones take their handler, which says
    /// why; a zero-length WRITE is answered there without touching staging.
    fn gpu_write_target(&self, body: &Body) -> Option<(Src, Arc<Region>)> {
        let reg = &self.sh.registry;
        match body {
            Body::WriteReq(op) if op.len > 0 => reg
                .check_remote(op, true)
                .ok()
                .filter(|r| r.mem == MemType::Vram)
                .map(|r| (Src::At(DevicePtr(r.ptr(op.offset) as u64), op.len), r)),
            Body::WriteVReq(op) => reg
                .check_vec(op, true)
                .ok()
                .filter(|r| r.mem == MemType::Vram && crate::registry::overlapping_ranges(op).is_none())
                .map(|r| (region_pages(&r, op), r)),
            _ => None,
        }
    }

    /// WriteReq / WriteVReq into GPU memory: staged under the fence lock, answered once landed.
    fn write_gpu(&mut self, req: u64, dst: Src, region: Arc<Region>, tick: &mut TickFn<'_>) -> Handled {
        let len = dst.len();
        self.lock.hold();
        if self.me.fenced.load(Ordering::Acquire) {
            return Err(hang_up());
        }
        if self.answers.is_none() {
            self.answers = Some(self.s.try_clone().map_err(|_| hang_up())?);
        }
        let Conn { sh, me, ctr, s, inb, stage, answers, lock, timeout, .. } = self;
        let (sh, me, timeout): (&Shared, &Served, Duration) = (sh, me, *timeout);
        let w = answers.as_mut().ok_or_else(hang_up)?;
        let pending = &mut lock.pending;
        let mut answer_err = None;
        let mut landed = |tag: u64| {
            if answer_err.is_none() {
                // Each answer within `timeout`, as any request's (the peer may stop reading).
                let mut t = request_tick(sh, me, timeout);
                if let Err(e) = pending.answer(tag, w, ctr, &mut t) {
                    answer_err = Some(e);
                }
            }
        };
        let mut inp = SockIn::new(s, inb, tick);
        // SAFETY: check_remote / check_vec proved every range lies in the region, GPU memory of
        // `region.dev`, registered read-write; `pending` holds the region until the segment has
        // landed, and the fence lock stays held until then.
        let r = unsafe { stage.recv_segment_notify(region.dev, dst, req, &mut inp, Some(&mut landed)) };
        let got = inp.received();
        match r {
            _ if answer_err.is_some() => return Err(hang_up()),
            Ok(()) => {}
            // A device error (issue 35 defect 5): the rest of the payload is read and dropped, so
            // the stream stays in step; this WRITE and those still landing (their copies were
            // dropped) are answered with the error, and the connection serves on.
            Err(StageError::Device(m)) => {
                inb.discard(s, len - got.min(len), tick)?;
                let mut t = request_tick(sh, me, timeout);
                lock.pending.fail_all(&m, w, ctr, &mut t)?;
                lock.settle();
                ctr.refuse(Status::Internal);
                let msg = format!("GPU staging failed on the target: {m}");
                return wire::send(w, &Body::Resp { status: Status::Internal, bulk_len: 0, msg }, req, &mut t);
            }
            // The stream is out of step; the initiator reissues on another path.
            Err(StageError::Wire(_)) => return Err(hang_up()),
        }
        self.lock.push(req, len, region);
        self.flush_writes(false, tick)
    }

    /// ReadReq: the range's bytes follow the answer.
    fn read(&mut self, req: u64, op: RemoteOp, tick: &mut TickFn<'_>) -> Handled {
        let region = match self.sh.registry.check_remote(&op, false) {
            Ok(r) => r,
            Err((status, msg)) => return self.refused(req, status, msg, tick),
        };
        let hdr = Body::Resp { status: Status::Ok, bulk_len: op.len, msg: String::new() }.encode(req);
        let r = if op.len == 0 {
            // Nothing to stage or copy: a staged segment without pieces would never send its header.
            wire::write_full(&mut self.s, &[&hdr], tick)
        } else if region.mem == MemType::Vram {
            // Counted by `staged_reads`, which knows which answers went out.
            let first = (Src::At(DevicePtr(region.ptr(op.offset) as u64), op.len), req, hdr.to_vec());
            return self.staged_reads(first, region.clone(), tick);
        } else {
            // SAFETY: check_remote proved [offset, offset+len) lies in the region, and `region`
            // holds it registered for the duration of the write.
            let data = unsafe { std::slice::from_raw_parts(region.ptr(op.offset), op.len as usize) };
            wire::write_full(&mut self.s, &[&hdr, data], tick)
        };
        if r.is_ok() {
            self.served(false, op.len);
        }
        r
    }

    /// ReadVReq: the pieces' bytes follow the answer, in entry order.
    fn read_vec(&mut self, req: u64, op: VecOp, tick: &mut TickFn<'_>) -> Handled {
        let region = match self.sh.registry.check_vec(&op, false) {
            Ok(r) => r,
            Err((status, msg)) => return self.refused(req, status, msg, tick),
        };
        let total = op.total();
        let hdr = Body::Resp { status: Status::Ok, bulk_len: total, msg: String::new() }.encode(req);
        let r = if region.mem == MemType::Vram {
            // The pages gathered into the pinned buffers a buffer's worth at a time; counted by
            // `staged_reads`, which knows which answers went out.
            let first = (region_pages(&region, &op), req, hdr.to_vec());
            return self.staged_reads(first, region, tick);
        } else {
            let mut bufs: Vec<&[u8]> = Vec::with_capacity(op.pieces.len() + 1);
            bufs.push(&hdr);
            for p in &op.pieces {
                for k in 0..p.count {
                    // SAFETY: check_vec proved every piece lies in the region (host memory),
                    // which `region` holds registered while this is sent.
                    bufs.push(unsafe { std::slice::from_raw_parts(region.ptr(p.offset + k * p.stride), p.len as usize) });
                }
            }
            wire::write_full(&mut self.s, &bufs, tick)
        };
        if r.is_ok() {
            self.served(false, total);
        }
        r
    }

    /// READs of GPU memory (one range, or a vectored request's pages): one staging pipeline over
    /// this READ and the READs of the same GPU already read ahead behind it: the D2H of the next
    /// overlaps the sends of this one (no fill at every request). Each answer's header goes right
    /// before its payload; the regions stay held until all are sent. `first` passed the
    /// registry's checks; a READ behind it that would be refused, is empty or is of other
    /// memory, waits for its handler.
    fn staged_reads(&mut self, first: (Src, u64, Vec<u8>), region: Arc<Region>, tick: &mut TickFn<'_>) -> Handled {
        let Conn { sh, me, ctr, s, inb, stage, fd, .. } = self;
        let (sh, me, fd): (&Shared, &Served, _) = (sh, me, *fd);
        let dev = region.dev;
        let mut held_regions = vec![region];
        // Each answer's (request id, bytes on the wire, payload bytes), in stream order.
        let mut segs: Vec<(u64, u64, u64)> = vec![(first.1, first.2.len() as u64 + first.0.len(), first.0.len())];
        // Each answer is counted served when it joins the stream, and taken back out if it is
        // not sent in full (`uncount_unsent_reads`).
        ctr.bytes_read.fetch_add(first.0.len(), Ordering::Relaxed);
        ctr.requests_read.fetch_add(1, Ordering::Relaxed);
        let mut more = || {
            if sh.shutdown.load(Ordering::Acquire) || me.fenced.load(Ordering::Acquire) {
                return None;
            }
            if inb.peek_frame().is_none() {
                inb.fill_now(fd); // requests the initiator pipelined behind
            }
            let (h2, r2, src, n) = match inb.peek_frame()? {
                (h2, Body::ReadReq(op2), n) => {
                    let r2 = sh.registry.check_remote(&op2, false).ok()?;
                    let src = Src::At(DevicePtr(r2.ptr(op2.offset) as u64), op2.len);
                    (h2, r2, src, n)
                }
                (h2, Body::ReadVReq(op2), n) => {
                    let r2 = sh.registry.check_vec(&op2, false).ok()?;
                    (h2, r2.clone(), region_pages(&r2, &op2), n)
                }
                _ => return None,
            };
            if r2.mem != MemType::Vram || r2.dev != dev || src.is_empty() {
                return None;
            }
            inb.consume(n);
            ctr.bytes_read.fetch_add(src.len(), Ordering::Relaxed);
            ctr.requests_read.fetch_add(1, Ordering::Relaxed);
            let hdr2 = Body::Resp { status: Status::Ok, bulk_len: src.len(), msg: String::new() }.encode(h2.req_id);
            held_regions.push(r2);
            segs.push((h2.req_id, hdr2.len() as u64 + src.len(), src.len()));
            Some((src, h2.req_id, hdr2))
        };
        let mut out = SockOut::new(s, tick);
        // SAFETY: check_remote / check_vec proved each range lies in its region (GPU memory of
        // `dev`), held registered in `held_regions` until this returns.
        let r = unsafe { stage.send_stream(dev, first, &mut out, &mut more) };
        let sent = out.sent;
        drop(out);
        if r.is_err() {
            uncount_unsent_reads(ctr, &segs, sent);
        }
        match r {
            Ok(()) => Ok(()),
            Err(StageError::Device(m)) => unsent_reads_fail(s, ctr, &segs, sent, &m, tick),
            Err(e) => Err(staging_failed(e)),
        }
    }

    /// WriteReq into host memory (GPU ones were staged by `write_gpu`), or of no bytes.
    fn write(&mut self, req: u64, op: RemoteOp, tick: &mut TickFn<'_>) -> Handled {
        let region = match self.sh.registry.check_remote(&op, true) {
            Ok(r) => r,
            Err((status, msg)) => {
                // The payload is drained, never applied, so the stream stays in step.
                count_refused(self.sh, &self.ctr, status);
                self.inb.discard(&mut self.s, op.len, tick)?;
                return self.answer(req, &Body::Resp { status, bulk_len: 0, msg }, tick);
            }
        };
        if op.len > 0 && region.mem == MemType::Vram {
            let dst = Src::At(DevicePtr(region.ptr(op.offset) as u64), op.len);
            return self.write_gpu(req, dst, region, tick);
        }
        if op.len > 0 {
            let guard = self.lock.for_host_write();
            if self.me.fenced.load(Ordering::Acquire) {
                return Err(hang_up());
            }
            // SAFETY: check_remote proved [offset, offset+len) lies in the region, host memory
            // registered read-write and held by `region` while this runs.
            let dst = unsafe { std::slice::from_raw_parts_mut(region.ptr(op.offset), op.len as usize) };
            let r = self.inb.read_into(&mut self.s, dst, tick);
            drop(guard);
            r?;
        }
        self.served(true, op.len);
        self.answer(req, &ok_resp(), tick)
    }

    /// WriteVReq into host memory, its pieces applied in entry order (GPU ones were staged by
    /// `write_gpu`; one whose entries overlap is refused here: their copies run in one launch,
    /// in no order).
    fn write_vec(&mut self, req: u64, op: VecOp, tick: &mut TickFn<'_>) -> Handled {
        let checked = self.sh.registry.check_vec(&op, true).and_then(|r| match r.mem {
            MemType::Dram => Ok(r),
            MemType::Vram => Err(match crate::registry::overlapping_ranges(&op) {
                Some(((a, n), (b, m))) => (
                    Status::Malformed,
                    format!(
                        "vectored WRITE into GPU region {}: entries overlap (bytes {a}..{} and {b}..{}); GPU memory takes only disjoint entries",
                        op.region,
                        a + n,
                        b + m
                    ),
                ),
                None => (Status::Unexpected, format!("region {} is GPU memory", op.region)),
            }),
        });
        let region = match checked {
            Ok(r) => r,
            Err((status, msg)) => {
                // The payload is drained, never applied, so the stream stays in step.
                count_refused(self.sh, &self.ctr, status);
                self.inb.discard(&mut self.s, op.total(), tick)?;
                return self.answer(req, &Body::Resp { status, bulk_len: 0, msg }, tick);
            }
        };
        let total = op.total();
        let guard = self.lock.for_host_write();
        if self.me.fenced.load(Ordering::Acquire) {
            return Err(hang_up());
        }
        let mut spans: Vec<(*mut u8, usize)> = Vec::with_capacity(op.pieces.len());
        for p in &op.pieces {
            spans.extend((0..p.count).map(|k| (region.ptr(p.offset + k * p.stride), p.len as usize)));
        }
        // SAFETY: check_vec proved every piece lies in the region, host memory registered
        // read-write and held by `region` while this runs.
        let r = unsafe { self.inb.read_into_spans(&mut self.s, &spans, tick) };
        drop(guard);
        r?;
        self.served(true, total);
        self.answer(req, &ok_resp(), tick)
    }

    /// Notif: queued for the application, or Busy when the inbox is full.
    fn notif(&mut self, req: u64, msg: Vec<u8>, tick: &mut TickFn<'_>) -> Handled {
        if let Err(why) = self.flush_gdr_writes() {
            return self.refused(req, Status::Internal, why, tick);
        }
        match self.sh.notifs.push(self.peer.to_string(), msg) {
            Ok(()) => self.answer(req, &ok_resp(), tick),
            Err(why) => self.refused(req, Status::Busy, why, tick),
        }
    }

    /// A numbered notification: queued once per (peer, incarnation, number); a copy resent
    /// after a lost answer is answered, not queued again (`notif_seen`).
    ///
    /// Order: a sender numbers its notifications in the order it sends them and pipelines
    /// them. Once one is refused (inbox full), the later ones on this connection are refused
    /// too, even if the inbox has room again, so that none is queued before it: the sender
    /// holds them behind it and sends them again, oldest first. A number not above the last
    /// one seen starts such a resend (or a one-by-one send), and is served afresh; so is any
    /// notification `timeout` after the refusal (a sender from before this rule never goes
    /// back for a notification its caller was told was refused).
    fn notif_seq(&mut self, req: u64, incarnation: u64, seq: u64, msg: Vec<u8>, tick: &mut TickFn<'_>) -> Handled {
        if let Err(why) = self.flush_gdr_writes() {
            return self.refused(req, Status::Internal, why, tick);
        }
        let behind_refused = self.notif_refused.is_some_and(|t| t.elapsed() < self.timeout) && seq > self.notif_last;
        self.notif_last = seq;
        if behind_refused {
            let why = "an earlier notification on this connection was refused (inbox full); this one would overtake it".to_string();
            return self.refused(req, Status::Busy, why, tick);
        }
        self.notif_refused = None;
        let queued = if self.sh.notif_seen.first(self.peer, incarnation, seq) {
            // Refused (inbox full): not queued, so a copy sent again later is not a duplicate.
            self.sh.notifs.push(self.peer.to_string(), msg).inspect_err(|_| self.sh.notif_seen.forget(self.peer, incarnation, seq))
        } else {
            Ok(())
        };
        if self.sh.notif_seen.lose_answer() {
            return Err(hang_up()); // fault injection: queued, never answered
        }
        match queued {
            Ok(()) => self.answer(req, &ok_resp(), tick),
            Err(why) => {
                self.notif_refused = Some(Instant::now());
                self.refused(req, Status::Busy, why, tick)
            }
        }
    }

    /// A notification tells the application that the peer's writes landed: GPUDirect writes
    /// into devices that do not order them are flushed first (crate::gdr). A failed flush
    /// refuses the notification (Internal): it is not queued, and the peer's WRITE fails, as
    /// its READ into local GPU memory does when its own flush fails (the writes may not be
    /// visible to the device).
    fn flush_gdr_writes(&self) -> std::result::Result<(), String> {
        match self.sh.ucx.as_ref().map(|u| u.flush_gdr_writes()) {
            Some(Err(e)) => {
                let why = format!("GPUDirect write flush before the notification failed: {e}");
                self.sh.ctx.log(&format!("{why} (from {})", self.peer));
                Err(why)
            }
            _ => Ok(()),
        }
    }

    /// Fence: the peer's connections named are aborted; answered once none can write memory.
    fn fence(&mut self, req: u64, ids: &[[u8; 16]], tick: &mut TickFn<'_>) -> Handled {
        // This connection may name itself: it holds no fence lock now (nothing is pending).
        debug_assert!(self.lock.held.is_none());
        fence(self.sh, self.peer, ids);
        self.answer(req, &ok_resp(), tick)
    }

    /// MetaPut: the metadata of the connection's own peer, served only where the application
    /// asked for it (`accept_metaput`) and on control connections; never over a peer the
    /// application installed; within `max_peers`.
    fn meta_put(&mut self, req: u64, blob: &[u8], tick: &mut TickFn<'_>) -> Handled {
        if !self.sh.ctx.cfg.accept_metaput {
            return self.refused(req, Status::Unexpected, "this agent does not accept MetaPut (accept_metaput is off)".into(), tick);
        }
        if self.role != Role::Control {
            return self.refused(req, Status::Unexpected, "MetaPut is served on control connections only".into(), tick);
        }
        let meta = match AgentMeta::decode(blob) {
            Ok(m) => m,
            Err(e) => return self.refused(req, decode_status(&e), e.to_string(), tick),
        };
        if meta.name != self.peer {
            let msg = format!("metadata names {:?} but the connection is from {:?}", meta.name, self.peer);
            return self.refused(req, Status::Unexpected, msg, tick);
        }
        let hint = self.s.peer_addr().ok().map(|a| a.ip());
        match self.sh.add_remote_from_wire(meta, hint) {
            Ok(_) => self.answer(req, &ok_resp(), tick),
            Err((status, msg)) => self.refused(req, status, msg, tick),
        }
    }
}

/// WRITEs into GPU memory of one device whose payload is in and whose copies may still run
/// (`serve`): request id, length, and the region, held registered until landed.
#[derive(Default)]
struct PendingWrites {
    dev: Option<u32>,
    q: std::collections::VecDeque<(u64, u64, Arc<crate::registry::Region>)>,
    tags: Vec<u64>,
}

impl PendingWrites {
    fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    fn push(&mut self, req_id: u64, len: u64, region: Arc<crate::registry::Region>) {
        self.dev = Some(region.dev);
        self.q.push_back((req_id, len, region));
    }

    /// Answers the WRITEs that have landed (all of them when `wait`), in order.
    fn flush(
        &mut self,
        stage: &mut Stagers,
        s: &mut TcpStream,
        inb: &mut wire::Inbound,
        ctr: &ServedCounters,
        wait: bool,
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(), WireError> {
        let Some(dev) = self.dev else { return Ok(()) };
        self.tags.clear();
        let r = if wait {
            let mut inp = SockIn::new(s, inb, tick);
            stage.recv_finish(dev, &mut inp, &mut self.tags)
        } else {
            stage.recv_done(dev, &mut self.tags)
        };
        if let Err(StageError::Device(m)) = r {
            // Their bytes are off the wire (the stream is in step): a device error fails these
            // WRITEs, not the connection (issue 35 defect 5); the landed ones are answered first.
            stage.abandon();
            let tags = std::mem::take(&mut self.tags);
            for &tag in &tags {
                self.answer(tag, s, ctr, tick)?;
            }
            return self.fail_all(&m, s, ctr, tick);
        }
        r.map_err(staging_failed)?;
        let tags = std::mem::take(&mut self.tags);
        for &tag in &tags {
            self.answer(tag, s, ctr, tick)?;
        }
        self.tags = tags;
        Ok(())
    }

    /// Answers every pending WRITE with the device error `m` that dropped its copies (in order;
    /// none is left pending after).
    fn fail_all(
        &mut self,
        m: &str,
        s: &mut TcpStream,
        ctr: &ServedCounters,
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(), WireError> {
        self.dev = None;
        let msg = format!("GPU staging failed on the target: {m}");
        while let Some((req_id, _, _region)) = self.q.pop_front() {
            ctr.refuse(Status::Internal);
            wire::send(s, &Body::Resp { status: Status::Internal, bulk_len: 0, msg: msg.clone() }, req_id, tick)?;
        }
        Ok(())
    }

    /// Answers the oldest pending WRITE, which has landed (`tag` is its request id).
    fn answer(
        &mut self,
        tag: u64,
        s: &mut TcpStream,
        ctr: &ServedCounters,
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(), WireError> {
        let Some((req_id, len, _region)) = self.q.pop_front() else { return Ok(()) };
        debug_assert_eq!(req_id, tag);
        if self.q.is_empty() {
            self.dev = None;
        }
        ctr.bytes_written.fetch_add(len, Ordering::Relaxed);
        ctr.requests_written.fetch_add(1, Ordering::Relaxed);
        wire::send(s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, req_id, tick)
    }
}

/// A `Role::UcxSession` connection: the session's own UCX worker lives (and is progressed) in
/// `transport::ucx::serve_session` until the socket hangs up, the agent closes or the session is
/// fenced. The connection's `apply` lock is held for the worker's whole life: `fence` takes it
/// after aborting the socket, so a fence returns only once the worker is destroyed, and then no
/// late PUT of this session can land (the UCX fence).
fn serve_ucx(sh: &Shared, s: &mut TcpStream, me: &Served, who: &str, hello_version: u16, session_key: Option<[u8; 32]>) {
    let Some(ucx) = sh.ucx.as_ref() else {
        // Read the UcxOpen first (bounded), so the refusal is not lost to a reset.
        let deadline = Instant::now() + sh.ctx.cfg.timeout;
        let mut tick = |_: bool| if sh.shutdown.load(Ordering::Acquire) || Instant::now() > deadline { Err(String::new()) } else { Ok(()) };
        let _ = wire::read_frame(s, &mut tick);
        refuse(sh, &me.ctr, s, who, Status::Unexpected, "this agent does not run the ucx transport".into());
        return;
    };
    let guard = me.apply.lock().expect("apply lock");
    if me.fenced.load(Ordering::Acquire) {
        return;
    }
    let session = crate::transport::ucx::Session { fenced: &me.fenced, who, hello_version, counters: me.ctr.clone(), session_key };
    let r = crate::transport::ucx::serve_session(&sh.ctx.cfg, &sh.shutdown, &|m| sh.ctx.log(m), ucx, s, session);
    drop(guard);
    if let Err((status, msg)) = r {
        if !msg.is_empty() {
            refuse(sh, &me.ctr, s, who, status, msg);
        }
    }
}

/// What a handshake proved: see `handshake`.
struct Greeted {
    role: Role,
    name: String,
    conn_id: [u8; 16],
    version: u16,
    welcome: [u8; 32],
    /// With a secret: the connection's session key (`auth::session_key`; UCX sessions).
    session_key: Option<[u8; 32]>,
}

/// Hello -> Challenge -> Auth. Returns the peer's role, name, connection id (the nonce of its
/// `Hello`), the `Hello` version it offered (accepted: 1 to `HELLO_MAX`) and the proof its
/// `Welcome` carries. The caller sends the `Welcome` once the connection is in the fence table:
/// from the moment the peer may send on it, a `Fence` naming it finds it.
fn handshake(sh: &Shared, s: &mut TcpStream, who: &str, listener: usize) -> Option<Greeted> {
    // Refusals before the peer proved its name count under UNAUTHENTICATED_PEER.
    let deny = |s: &mut TcpStream, status: Status, msg: String| {
        refuse(sh, &sh.served_stats.counters(UNAUTHENTICATED_PEER, listener), s, who, status, msg)
    };
    let deadline = Instant::now() + sh.ctx.cfg.timeout;
    let mut tick = |_: bool| {
        if sh.shutdown.load(Ordering::Acquire) {
            Err(String::new())
        } else if Instant::now() > deadline {
            Err("handshake timed out".to_string())
        } else {
            Ok(())
        }
    };
    // Only a Hello's header is accepted before its body is read: nothing larger is allocated.
    let (role, name, client_nonce, version) = match wire::read_frame_expect(s, Kind::Hello, &mut tick) {
        Ok(Ok((_, Body::Hello { role, name, nonce, version, .. }))) => (role, name, nonce, version),
        Ok(Ok((_, other))) => {
            deny(s, Status::Unexpected, format!("expected Hello, got {:?}", other.kind()));
            return None;
        }
        Ok(Err(kind)) => {
            deny(s, Status::Unexpected, format!("expected Hello, got {kind:?}"));
            return None;
        }
        Err(WireError::Decode(e)) => {
            deny(s, decode_status(&e), e.to_string());
            return None;
        }
        Err(WireError::GaveUp(m)) => {
            if !m.is_empty() {
                deny(s, Status::Malformed, m);
            }
            return None;
        }
        Err(WireError::Io(_)) => return None,
    };
    let nonce: [u8; 16] = random_bytes();
    let secret = sh.ctx.cfg.secret.as_deref();
    let ch = Body::Challenge { auth_required: secret.is_some(), incarnation: sh.ctx.incarnation, nonce, name: sh.ctx.name.clone() };
    wire::send(s, &ch, 0, &mut tick).ok()?;
    let mac = match wire::read_frame_expect(s, Kind::Auth, &mut tick) {
        Ok(Ok((_, Body::Auth { mac }))) => mac,
        Ok(Ok((_, other))) => {
            deny(s, Status::Unexpected, format!("expected Auth, got {:?}", other.kind()));
            return None;
        }
        Ok(Err(kind)) => {
            deny(s, Status::Unexpected, format!("expected Auth, got {kind:?}"));
            return None;
        }
        Err(WireError::Decode(e)) => {
            deny(s, decode_status(&e), e.to_string());
            return None;
        }
        Err(_) => return None,
    };
    let reply = match secret {
        Some(secret) => {
            if !auth::proofs_equal(&mac, &auth::client_proof(secret, &nonce, &client_nonce, &name)) {
                deny(s, Status::AuthFailed, format!("{name:?} did not prove the shared secret"));
                return None;
            }
            auth::server_proof(secret, &client_nonce, &nonce, &sh.ctx.name)
        }
        None => [0u8; 32],
    };
    let session_key = secret.map(|secret| auth::session_key(secret, &client_nonce, &nonce));
    Some(Greeted { role, name, conn_id: client_nonce, version, welcome: reply, session_key })
}

/// The device ranges of a vectored request's pieces in region `r`, in stream order (checked
/// against the region by `check_vec` first).
fn region_pages(r: &Region, op: &VecOp) -> Src {
    let spans = op.pieces.iter().flat_map(|p| (0..p.count).map(move |k| (r.ptr(p.offset + k * p.stride) as u64, p.len)));
    Src::Pieces(Arc::new(Pages::new(spans)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(max_peers: usize) -> ServedTable {
        let rails = vec![
            ServedRail { name: SIDE_RAIL.into(), index: None },
            ServedRail { name: "eth0".into(), index: Some(0) },
            ServedRail { name: "eth1".into(), index: Some(1) },
        ];
        ServedTable::new(rails, max_peers)
    }

    /// Issue 34 item 3, target side: a served connection's CPUs are those of its listener's
    /// rail; the side channel, and an agent with no topology (no NUMA information), get none
    /// (not pinned, pools placed as before).
    #[test]
    fn served_connections_take_their_rails_cpus() {
        let t = table(3);
        let topo = crate::ctx::RailTopo { tiers: Default::default(), cpus: vec![vec![0, 1], vec![2]] };
        assert_eq!(t.rail_cpus(0, Some(&topo)), Vec::<usize>::new(), "side channel");
        assert_eq!(t.rail_cpus(1, Some(&topo)), vec![0, 1]);
        assert_eq!(t.rail_cpus(2, Some(&topo)), vec![2]);
        assert_eq!(t.rail_cpus(3, Some(&topo)), Vec::<usize>::new(), "unknown listener");
        assert_eq!(t.rail_cpus(1, None), Vec::<usize>::new(), "no topology");
        let short = crate::ctx::RailTopo { tiers: Default::default(), cpus: vec![vec![0]] };
        assert_eq!(t.rail_cpus(2, Some(&short)), Vec::<usize>::new(), "a rail with no CPUs listed");
    }

    #[test]
    fn peers_beyond_the_cap_fold_into_other() {
        let t = table(3);
        for i in 0..3 {
            t.counters(&format!("p{i}"), 1).bytes_read.fetch_add(10, Ordering::Relaxed);
        }
        // A hostile stream of names: every one beyond the cap shares the `_other` counters.
        for i in 3..10_000 {
            let c = t.counters(&format!("p{i}"), 1 + i % 2);
            c.bytes_written.fetch_add(1, Ordering::Relaxed);
            c.refuse(Status::BadKey);
        }
        // Known names keep their own counters, on any rail, after the cap is reached.
        t.counters("p0", 2).requests_read.fetch_add(1, Ordering::Relaxed);
        // The pre-authentication label does not take a slot.
        t.counters(UNAUTHENTICATED_PEER, 0).refuse(Status::AuthFailed);
        let rep = t.report();
        let peers: HashSet<&str> = rep.iter().map(|r| r.peer.as_str()).collect();
        assert_eq!(peers, ["p0", "p1", "p2", OTHER_PEER, UNAUTHENTICATED_PEER].into_iter().collect());
        assert_eq!(rep.len(), 3 + 2 + 1 + 1, "{rep:?}");
        let other: Vec<&ServedReport> = rep.iter().filter(|r| r.peer == OTHER_PEER).collect();
        assert_eq!(other.iter().map(|r| r.bytes_written).sum::<u64>(), 10_000 - 3);
        assert_eq!(other.iter().map(|r| r.refused).sum::<u64>(), 10_000 - 3);
        assert!(other.iter().all(|r| r.refused_by_status.iter().all(|(s, _)| *s == Status::BadKey)));
        let p0: Vec<&ServedReport> = rep.iter().filter(|r| r.peer == "p0").collect();
        assert_eq!(p0.len(), 2);
        assert_eq!((p0[0].rail.as_str(), p0[0].rail_index, p0[0].bytes_read), ("eth0", Some(0), 10));
        assert_eq!((p0[1].rail.as_str(), p0[1].rail_index, p0[1].requests_read), ("eth1", Some(1), 1));
        let un = rep.iter().find(|r| r.peer == UNAUTHENTICATED_PEER).unwrap();
        assert_eq!((un.rail.as_str(), un.rail_index), (SIDE_RAIL, None));
        assert_eq!(un.refused_by_status, vec![(Status::AuthFailed, 1)]);
    }

    #[test]
    fn counters_are_shared_per_peer_and_rail() {
        let t = table(MAX_SERVED_PEERS);
        let a = t.counters("a", 1);
        let b = t.counters("a", 1);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &t.counters("a", 2)));
        assert!(!Arc::ptr_eq(&a, &t.counters("b", 1)));
    }
}
