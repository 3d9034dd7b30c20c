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
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use multirail_gpu::{DevicePtr, Pages, Src};
use multirail_proto::codec::{Role, Status, VecOp};
use multirail_proto::{AgentMeta, Body, DecodeError, MemType, RailInfo};

use crate::auth;
use crate::config::Progress;
use crate::ctx::Ctx;
use crate::error::{Error, Result};
use crate::net::abort_socket;
use crate::peer::Peer;
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

/// State shared between the agent handle, its listeners and its connection threads.
pub struct Shared {
    pub ctx: Arc<Ctx>,
    pub registry: Registry,
    pub peers: RwLock<HashMap<String, Arc<Peer>>>,
    /// Notifications from peers, until the application takes them.
    pub notifs: crate::inbox::Inbox,
    pub shutdown: AtomicBool,
    pub rails_meta: Vec<RailInfo>,
    /// Serving threads running (each leaves it only after dropping its `Shared`: `close` then
    /// knows that no serving thread holds the last reference, whose drop would tear UCX down
    /// on a thread the application no longer waits for).
    pub open_conns: Arc<AtomicUsize>,
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

    /// Install metadata for a peer (replacing an older life of it).
    pub fn add_remote(&self, meta: AgentMeta, addr_hint: Option<IpAddr>) -> Result<String> {
        if meta.name.is_empty() {
            return Err(Error::Metadata("metadata has an empty agent name".into()));
        }
        if meta.name == self.ctx.name {
            return Err(Error::Metadata(format!("metadata is this agent's own ({:?})", meta.name)));
        }
        let name = meta.name.clone();
        let peer = Arc::new(Peer::new(meta, addr_hint, self.ctx.clone()));
        if let Some(old) = self.peers.write().expect("peers lock").insert(name.clone(), peer) {
            old.close();
        }
        Ok(name)
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
        if sh.open_conns.load(Ordering::Acquire) >= sh.ctx.cfg.max_connections {
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
    let Some(Greeted { role, name: peer_name, conn_id, version: hello_version, welcome }) = handshake(sh, &mut s, &who, listener) else {
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
    // A data connection takes its share of its rail's receive window (off by default); the
    // others on the rail shrink now and grow back when it leaves.
    let _share = if role == Role::Data { sh.shares.join(listener, me.clone()) } else { None };
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
        serve_ucx(sh, &mut s, &me, &who, hello_version);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    if role == Role::IpcWatch {
        crate::ipc::serve_watch(&sh.ctx, &sh.ipc_exports, &mut s, conn_id, &peer_name);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    let mut inb = wire::Inbound::new();
    // Bounce pools for GPU regions, made on the first request that needs one.
    let mut stage = Stagers::new(sh.ctx.cfg.staging, ctr.staging.clone());
    // WRITEs into GPU memory received but maybe not landed: their last H2D copies run while the
    // next request is read, so the pipeline does not drain at every request. Their responses go
    // out in order once landed, and always before this connection waits for the socket or
    // serves anything else. The fence lock is held meanwhile (`held`).
    let mut pending = PendingWrites::default();
    // Answers of landed WRITEs go out on a second handle of the socket while this one is
    // receiving the next payload (made on first use).
    let mut answers: Option<TcpStream> = None;
    let mut held: Option<std::sync::MutexGuard<'_, ()>> = None;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    let spin = wire::SpinBudget::new(sh.ctx.cfg.serve_spin);
    // Only data connections busy-poll for their next request. A control connection carries
    // notifications, fences, probes and metadata: nothing waits on its round trip by the
    // microsecond, and its spin after each of a request's per-layer notifications took ~100 us
    // of CPU apiece (~10% of a core in loopback kv at 8 KiB pages) from the data path's threads.
    let spins = role == Role::Data && sh.ctx.cfg.progress != Progress::Block;
    loop {
        if !pending.is_empty() && inb.unread() == 0 && !wire::readable_now(fd) {
            // Nothing more to read right now: let every pending WRITE land and answer it.
            let mut t = |_: bool| if sh.shutdown.load(Ordering::Acquire) { Err(String::new()) } else { Ok(()) };
            if pending.flush(&mut stage, &mut s, &mut inb, &ctr, true, &mut t).is_err() {
                break;
            }
            held = None;
        }
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
        // When a spin ran out: when it began (the budget grows back if the request came soon after).
        let mut spun_out: Option<Instant> = None;
        if spins && inb.unread() == 0 {
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
        while inb.unread() == 0 && !wire::poll_in(fd, IDLE_WAIT) {
            if sh.shutdown.load(Ordering::Acquire) || me.fenced.load(Ordering::Acquire) {
                break;
            }
        }
        if let Some(t) = spun_out {
            spin.woke(t.elapsed());
        }
        let (h, body) = match inb.read_frame(&mut s, &mut tick) {
            Ok(f) => f,
            Err(WireError::Decode(e)) => {
                refuse(sh, &ctr, &mut s, &who, decode_status(&e), e.to_string());
                break;
            }
            Err(WireError::GaveUp(m)) => {
                if !m.is_empty() {
                    refuse(sh, &ctr, &mut s, &who, Status::Malformed, m);
                }
                break;
            }
            Err(WireError::Io(_)) => break,
        };
        if sh.shutdown.load(Ordering::SeqCst) || me.fenced.load(Ordering::Acquire) {
            // Closing (or fenced): serve nothing more, touch no memory.
            break;
        }
        let t0 = Instant::now();
        let mut op_tick = |_: bool| {
            if sh.shutdown.load(Ordering::Acquire) || me.fenced.load(Ordering::Acquire) {
                Err(String::new())
            } else if t0.elapsed() > timeout {
                Err(format!("request not completed within {timeout:?}"))
            } else {
                Ok(())
            }
        };
        // A WRITE into GPU memory (one range, or a vectored request's pages): staged, answered
        // once it has landed. Refused ones take the normal path below (which says why).
        let vram_write = match &body {
            Body::WriteReq(op) => sh
                .registry
                .check_remote(op, true)
                .ok()
                .filter(|r| r.mem == MemType::Vram)
                .map(|r| (Src::At(DevicePtr(r.ptr(op.offset) as u64), op.len), r)),
            Body::WriteVReq(op) => {
                sh.registry.check_vec(op, true).ok().filter(|r| r.mem == MemType::Vram).map(|r| (region_pages(&r, op), r))
            }
            _ => None,
        };
        if !pending.is_empty() && vram_write.as_ref().is_none_or(|(_, r)| Some(r.dev) != pending.dev) {
            // Responses go out in request order: the pending WRITEs first.
            if pending.flush(&mut stage, &mut s, &mut inb, &ctr, true, &mut op_tick).is_err() {
                break;
            }
            held = None;
        }
        if let Some((dst, region)) = vram_write {
            let len = dst.len();
            if held.is_none() {
                held = Some(me.apply.lock().expect("apply lock"));
            }
            if me.fenced.load(Ordering::Acquire) {
                break;
            }
            if answers.is_none() {
                match s.try_clone() {
                    Ok(w) => answers = Some(w),
                    Err(_) => break,
                }
            }
            let w = answers.as_mut().expect("made above");
            let mut answer_err = None;
            let mut landed = |tag: u64| {
                if answer_err.is_none() {
                    if let Err(e) = pending.answer(tag, w, &ctr, &mut |_| {
                        if sh.shutdown.load(Ordering::Acquire) {
                            Err(String::new())
                        } else {
                            Ok(())
                        }
                    }) {
                        answer_err = Some(e);
                    }
                }
            };
            let mut inp = SockIn::new(&mut s, &mut inb, &mut op_tick);
            // SAFETY: check_remote / check_vec proved every range lies in the region, GPU
            // memory of `region.dev`, registered read-write; `pending` holds the region until
            // the segment has landed, and the fence lock stays held until then.
            let r = unsafe { stage.recv_segment_notify(region.dev, dst, h.req_id, &mut inp, Some(&mut landed)) };
            if r.is_err() || answer_err.is_some() {
                break; // the stream is out of step; the initiator reissues on another path
            }
            pending.push(h.req_id, len, region);
            if pending.flush(&mut stage, &mut s, &mut inb, &ctr, false, &mut op_tick).is_err() {
                break;
            }
            continue;
        }
        // READs of GPU memory (one range, or a vectored request's pages): one staging
        // pipeline over this READ and the READs of the same GPU already read ahead behind it:
        // the D2H of the next overlaps the sends of this one (no fill at every request). Each
        // answer's header goes right before its payload; the regions stay held until all are
        // sent. `first` passed the registry's checks; a READ behind it that would be refused,
        // or is of other memory, waits for the normal path.
        let mut staged_reads = |first: (Src, u64, Vec<u8>), region: Arc<Region>| {
            let dev = region.dev;
            let mut held_regions = vec![region];
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
                if r2.mem != MemType::Vram || r2.dev != dev {
                    return None;
                }
                inb.consume(n);
                ctr.bytes_read.fetch_add(src.len(), Ordering::Relaxed);
                ctr.requests_read.fetch_add(1, Ordering::Relaxed);
                let hdr2 = Body::Resp { status: Status::Ok, bulk_len: src.len(), msg: String::new() }.encode(h2.req_id);
                held_regions.push(r2);
                Some((src, h2.req_id, hdr2))
            };
            let mut out = SockOut::new(&mut s, &mut op_tick);
            // SAFETY: check_remote / check_vec proved each range lies in its region (GPU memory
            // of `dev`), held registered in `held_regions` until this returns.
            unsafe { stage.send_stream(dev, first, &mut out, &mut more) }.map_err(staging_failed)
        };
        let r = match body {
            Body::ReadReq(op) => match sh.registry.check_remote(&op, false) {
                Ok(region) => {
                    let hdr = Body::Resp { status: Status::Ok, bulk_len: op.len, msg: String::new() }.encode(h.req_id);
                    let r = if region.mem == MemType::Vram {
                        let first = (Src::At(DevicePtr(region.ptr(op.offset) as u64), op.len), h.req_id, hdr.to_vec());
                        staged_reads(first, region.clone())
                    } else {
                        // SAFETY: check_remote proved [offset, offset+len) lies in the region, and
                        // `region` holds it registered for the duration of the write.
                        let data = unsafe { std::slice::from_raw_parts(region.ptr(op.offset), op.len as usize) };
                        wire::write_full(&mut s, &[&hdr, data], &mut op_tick)
                    };
                    if r.is_ok() {
                        ctr.bytes_read.fetch_add(op.len, Ordering::Relaxed);
                        ctr.requests_read.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                }
                Err((status, msg)) => {
                    count_refused(sh, &ctr, status);
                    wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick)
                }
            },
            Body::ReadVReq(op) => match sh.registry.check_vec(&op, false) {
                Ok(region) if region.mem == MemType::Vram => {
                    // The pages gathered into the pinned buffers a buffer's worth at a time.
                    let total = op.total();
                    let hdr = Body::Resp { status: Status::Ok, bulk_len: total, msg: String::new() }.encode(h.req_id);
                    let first = (region_pages(&region, &op), h.req_id, hdr.to_vec());
                    let r = staged_reads(first, region);
                    if r.is_ok() {
                        ctr.bytes_read.fetch_add(total, Ordering::Relaxed);
                        ctr.requests_read.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                }
                Ok(region) => {
                    let total = op.total();
                    let hdr = Body::Resp { status: Status::Ok, bulk_len: total, msg: String::new() }.encode(h.req_id);
                    let mut bufs: Vec<&[u8]> = Vec::with_capacity(op.pieces.len() + 1);
                    bufs.push(&hdr);
                    for p in &op.pieces {
                        for k in 0..p.count {
                            // SAFETY: check_vec proved every piece lies in the region (host
                            // memory), which `region` holds registered while this is sent.
                            bufs.push(unsafe { std::slice::from_raw_parts(region.ptr(p.offset + k * p.stride), p.len as usize) });
                        }
                    }
                    let r = wire::write_full(&mut s, &bufs, &mut op_tick);
                    if r.is_ok() {
                        ctr.bytes_read.fetch_add(total, Ordering::Relaxed);
                        ctr.requests_read.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                }
                Err((status, msg)) => {
                    count_refused(sh, &ctr, status);
                    wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick)
                }
            },
            // GPU regions were staged above; never a host write into one here.
            Body::WriteVReq(op) => match sh.registry.check_vec(&op, true).and_then(|r| match r.mem {
                MemType::Dram => Ok(r),
                MemType::Vram => Err((Status::Unexpected, format!("region {} is GPU memory", op.region))),
            }) {
                Ok(region) => {
                    let total = op.total();
                    let guard = me.apply.lock().expect("apply lock");
                    if me.fenced.load(Ordering::Acquire) {
                        break;
                    }
                    let mut spans: Vec<(*mut u8, usize)> = Vec::with_capacity(op.pieces.len());
                    for p in &op.pieces {
                        spans.extend((0..p.count).map(|k| (region.ptr(p.offset + k * p.stride), p.len as usize)));
                    }
                    // SAFETY: check_vec proved every piece lies in the region, host memory
                    // registered read-write and held by `region` while this runs.
                    let r = unsafe { inb.read_into_spans(&mut s, &spans, &mut op_tick) };
                    drop(guard);
                    if r.is_ok() {
                        ctr.bytes_written.fetch_add(total, Ordering::Relaxed);
                        ctr.requests_written.fetch_add(1, Ordering::Relaxed);
                    }
                    r.and_then(|_| {
                        wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
                    })
                }
                Err((status, msg)) => {
                    // The payload is drained, never applied, so the stream stays in step.
                    count_refused(sh, &ctr, status);
                    inb.discard(&mut s, op.total(), &mut op_tick)
                        .and_then(|_| wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick))
                }
            },
            Body::WriteReq(op) => match sh.registry.check_remote(&op, true) {
                Ok(region) => {
                    let guard = me.apply.lock().expect("apply lock");
                    if me.fenced.load(Ordering::Acquire) {
                        break;
                    }
                    let r = if region.mem == MemType::Vram {
                        let mut inp = SockIn::new(&mut s, &mut inb, &mut op_tick);
                        // SAFETY: as above, GPU memory of `region.dev`; every copy into it has
                        // completed when this returns (so a fence after it finds none running).
                        unsafe { stage.recv(region.dev, region.ptr(op.offset) as u64, op.len, &mut inp) }.map_err(staging_failed)
                    } else {
                        // SAFETY: as above; the region is registered read-write.
                        let dst = unsafe { std::slice::from_raw_parts_mut(region.ptr(op.offset), op.len as usize) };
                        inb.read_into(&mut s, dst, &mut op_tick)
                    };
                    drop(guard);
                    if r.is_ok() {
                        ctr.bytes_written.fetch_add(op.len, Ordering::Relaxed);
                        ctr.requests_written.fetch_add(1, Ordering::Relaxed);
                    }
                    r.and_then(|_| {
                        wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
                    })
                }
                Err((status, msg)) => {
                    count_refused(sh, &ctr, status);
                    inb.discard(&mut s, op.len, &mut op_tick)
                        .and_then(|_| wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick))
                }
            },
            Body::IpcReq { host, watch, regions } => {
                let answer = crate::ipc::answer(&sh.ctx.cfg, &sh.registry, &sh.ipc_exports, &peer_name, host, watch, &regions);
                wire::send(&mut s, &answer, h.req_id, &mut op_tick)
            }
            Body::Notif(msg) => {
                let (status, msg) = match sh.notifs.push(peer_name.clone(), msg) {
                    Ok(()) => (Status::Ok, String::new()),
                    Err(why) => {
                        count_refused(sh, &ctr, Status::Busy);
                        (Status::Busy, why)
                    }
                };
                wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick)
            }
            Body::Fence(ids) => {
                fence(sh, &peer_name, &ids);
                wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
            }
            Body::Ping => wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick),
            Body::MetaGet => wire::send(&mut s, &Body::Meta(sh.metadata().encode()), h.req_id, &mut op_tick),
            Body::MetaPut(blob) => {
                let hint = s.peer_addr().ok().map(|a| a.ip());
                let resp = match AgentMeta::decode(&blob) {
                    Ok(meta) if meta.name != peer_name => Body::Resp {
                        status: Status::Unexpected,
                        bulk_len: 0,
                        msg: format!("metadata names {:?} but the connection is from {peer_name:?}", meta.name),
                    },
                    Ok(meta) => match sh.add_remote(meta, hint) {
                        Ok(_) => Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() },
                        Err(e) => Body::Resp { status: Status::Malformed, bulk_len: 0, msg: e.to_string() },
                    },
                    Err(e) => Body::Resp { status: decode_status(&e), bulk_len: 0, msg: e.to_string() },
                };
                wire::send(&mut s, &resp, h.req_id, &mut op_tick)
            }
            other => {
                refuse(sh, &ctr, &mut s, &who, Status::Unexpected, format!("{:?} is not a request", other.kind()));
                break;
            }
        };
        if r.is_err() {
            break;
        }
    }
    // Before the fence lock goes: no staged copy may still write the application's memory.
    stage.abandon();
    drop(held);
    let _ = s.shutdown(Shutdown::Both);
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
        r.map_err(staging_failed)?;
        let tags = std::mem::take(&mut self.tags);
        for &tag in &tags {
            self.answer(tag, s, ctr, tick)?;
        }
        self.tags = tags;
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
fn serve_ucx(sh: &Shared, s: &mut TcpStream, me: &Served, who: &str, hello_version: u16) {
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
    let session = crate::transport::ucx::Session { fenced: &me.fenced, who, hello_version, counters: me.ctr.clone() };
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
    let (role, name, client_nonce, version) = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::Hello { role, name, nonce, version, .. })) => (role, name, nonce, version),
        Ok((_, other)) => {
            deny(s, Status::Unexpected, format!("expected Hello, got {:?}", other.kind()));
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
    let mac = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::Auth { mac })) => mac,
        Ok((_, other)) => {
            deny(s, Status::Unexpected, format!("expected Auth, got {:?}", other.kind()));
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
    Some(Greeted { role, name, conn_id: client_nonce, version, welcome: reply })
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
