//! The target's side of UCX sessions: per `Role::UcxSession` connection a worker of its own on
//! the requested rail's context, progressed until the session ends; destroying it is the fence
//! (module docs of `transport::ucx`).
//!
//! A session that negotiated `UCX_FEATURE_AM` also takes vectored chunks as active messages
//! (`UcxAm`): the handler checks the piece list against the region this agent exports (known,
//! exported, host memory, writable for a WRITE, every piece inside it) before it touches any
//! byte, scatters a WRITE's data into the region itself, and leaves one reply per request for
//! the session loop to send on an endpoint of its own to the initiator's worker (a READ's reply
//! carries the pieces gathered from the region by an iov). A refused request is answered with
//! its status and writes nothing.
//!
//! Tied to the session (issue 33): a session needs a shared secret (the connection's session
//! key, `auth::session_key`); `UcxOpen`'s MAC is checked and the initiator's worker address is
//! checked for structure before UCX sees it, and `UcxReady` is sealed. An active message is
//! handled only when it comes from the session's own endpoint (UCX's `reply_ep`) and carries
//! the session's active-message secret; it must name the region's real key. READ replies
//! waiting to be sent are bounded per session ([`MAX_REPLY_BYTES`], [`MAX_QUEUED_REPLIES`]),
//! and session workers per process (`SessionSlot`).

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use multirail_proto::codec::{encode_ucx_am_reply, UcxAm, HELLO_UCX_FEATURES, UCX_AM_REPLY, UCX_AM_REQ, UCX_AM_REQ_HEADER, UCX_FEATURE_AM};
use multirail_proto::{Access, Body, Status};
use multirail_ucx::{AmData, CloseMode, Endpoint, MemRegion, Request, ThreadMode, Worker, WorkerAddress};

use super::{seal, sealed, Kick, Mapped, SessionSlot, UcxAgent};
use crate::auth;

/// Why a UCX session is refused without a shared secret (both sides say it, naming the setting).
pub(crate) const NO_SECRET: &str = "UCX sessions need a shared secret on both agents (auth_secret, or MULTIRAIL_SECRET): \
     a session hands peer-supplied worker addresses and rkeys to UCX, which takes them unchecked, so only a MAC-checked \
     session of an authenticated peer may (docs/SECURITY.md)";

/// Most bytes of READ replies a session holds at once (queued, or sent and not yet complete):
/// beyond, a READ is refused `Busy` (a 65-byte request can ask for 64 MiB). Far above what an
/// initiator's window of chunks asks at once.
pub(crate) const MAX_REPLY_BYTES: u64 = 1 << 30;
/// Most replies a session queues before the session loop sends them; beyond, requests are
/// dropped (counted `Busy`; the initiator's stall rule fails the rail).
pub(crate) const MAX_QUEUED_REPLIES: usize = 1 << 16;

/// [`MAX_REPLY_BYTES`], lowered by tests (a session takes it when it starts).
static REPLY_CAP: AtomicU64 = AtomicU64::new(MAX_REPLY_BYTES);

/// Sessions started from now on bound their READ replies to `cap` bytes (tests).
#[cfg(test)]
pub(crate) fn set_reply_cap(cap: u64) {
    REPLY_CAP.store(cap, Ordering::SeqCst);
}

/// A refused session's message when the asked rail does not run ucx on this agent.
pub(crate) const NOT_ON_RAIL: &str = "this agent does not run the ucx transport on rail";
use crate::config::{Config, Progress};
use crate::wire::{self, WireError};

/// How long the target's session loop sleeps at most between checks of shutdown and fence flags
/// (both also abort the session socket, which wakes it at once).
const SESSION_TICK: Duration = Duration::from_millis(250);

/// A `wire` tick for the session's frames: gives up (an empty reason: just close) once `stop()`,
/// or with `late()`'s reason after `deadline`.
fn tick_until<'a>(
    stop: &'a impl Fn() -> bool,
    deadline: Instant,
    late: impl Fn() -> String + 'a,
) -> impl FnMut(bool) -> std::result::Result<(), String> + 'a {
    move |_| {
        if stop() {
            Err(String::new())
        } else if Instant::now() > deadline {
            Err(late())
        } else {
            Ok(())
        }
    }
}

/// What the active-message handler leaves for the session loop to send.
enum AmReply {
    /// A status only: a WRITE applied, or any refusal.
    Status { token: u64, status: Status },
    /// A READ's pieces (offset, length) of this mapping, sent gathered as the reply's data.
    /// `region` is held until the send completes: `UcxAgent::unmap` (deregistration) waits
    /// for it, so no reply reads the application's memory after deregistration returned.
    /// `bytes` count in the session's [`MAX_REPLY_BYTES`] until the send completes.
    Read { token: u64, mem: MemRegion, region: Arc<Mapped>, pieces: Vec<(usize, usize)>, bytes: u64 },
}

/// READ replies still being sent (UCX may send an iov after `ucp_am_send_nbx` returned), each
/// with the region it reads and its bytes, released once the send completed or failed.
type Sending = Mutex<Vec<(Request, Arc<Mapped>, u64)>>;

/// The handler's replies, the kick that wakes the session loop for them, and what ties a
/// message to the session.
struct AmInbox {
    replies: Mutex<Vec<AmReply>>,
    kick: Kick,
    /// The session's active-message secret (`auth::am_secret`), in every request and reply.
    secret: [u8; 16],
    /// The session's endpoint to the initiator (`Endpoint::handle_id`; 0 until connected):
    /// the only sender whose messages are handled.
    ep: AtomicUsize,
    /// READ reply bytes queued or being sent, and their bound ([`MAX_REPLY_BYTES`]).
    reply_bytes: AtomicU64,
    reply_cap: u64,
}

/// Where a session counts its active-message requests (the server's per-peer serving counters):
/// they count as served READs/WRITEs and refusals by status, as tcp requests do.
pub(crate) trait AmCounters: Send + Sync {
    fn served(&self, write: bool, bytes: u64);
    fn refused(&self, status: Status);
}

/// A served session's identity and bookkeeping (from the server's handshake).
pub(crate) struct Session<'a> {
    /// Set when the session is fenced (its worker must go).
    pub fenced: &'a AtomicBool,
    /// The peer, for logs.
    pub who: &'a str,
    /// The `Hello` version the initiator offered (3 and up: `UcxOpen` may offer features).
    pub hello_version: u16,
    /// The peer's serving counters: active-message requests count as served READs/WRITEs
    /// (and refusals by status); RMA is one-sided and counted nowhere here.
    pub counters: Arc<dyn AmCounters>,
    /// The connection's session key (`auth::session_key`): None without a shared secret,
    /// and then the session is refused ([`NO_SECRET`]).
    pub session_key: Option<[u8; 32]>,
}

/// Handle one `UcxAm` request (in UCX's callback, on the session thread): every check before
/// any byte is touched, then a WRITE is scattered into the region; the reply to send, if the
/// request named a token to answer (a header too short to hold one is dropped).
///
/// Messages from any endpoint but the session's own, or without the session's secret, are
/// dropped unanswered (counted `AuthFailed`): nothing of them is read past the header.
fn handle_am(
    maps: &RwLock<HashMap<u64, Arc<Mapped>>>,
    rail: usize,
    ctr: &dyn AmCounters,
    ib: &AmInbox,
    header: &[u8],
    data: AmData<'_>,
    from: Option<usize>,
) -> Option<AmReply> {
    let Some(token) = (header.len() == UCX_AM_REQ_HEADER).then(|| u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"))) else {
        ctr.refused(Status::Malformed);
        return None;
    };
    let ours = ib.ep.load(Ordering::Acquire);
    if ours == 0 || from != Some(ours) || !auth::bytes_equal(&header[13..29], &ib.secret) {
        ctr.refused(Status::AuthFailed);
        return None;
    }
    let refuse = |status: Status| {
        ctr.refused(status);
        Some(AmReply::Status { token, status })
    };
    // Our initiators send eagerly only; the bytes of a rendezvous are never fetched.
    let AmData::Eager(data) = data else { return refuse(Status::Unexpected) };
    let Ok((am, payload)) = UcxAm::decode(header, data) else { return refuse(Status::Malformed) };
    let m = maps.read().unwrap_or_else(PoisonError::into_inner).get(&am.op.region).cloned();
    let Some(m) = m.filter(|m| m.exported) else { return refuse(Status::UnknownRegion) };
    if !auth::bytes_equal(&am.op.key.0, &m.key.0) {
        return refuse(Status::BadKey);
    }
    if !m.host {
        // GPU memory is not the CPU's to copy (vectored requests are for host memory).
        return refuse(Status::Unexpected);
    }
    if am.write && m.access != Access::ReadWrite {
        return refuse(Status::ReadOnly);
    }
    if am.op.pieces.iter().any(|p| p.end().is_none_or(|end| end > m.len)) {
        return refuse(Status::OutOfBounds);
    }
    if am.write {
        let mut at = 0usize;
        for p in &am.op.pieces {
            for k in 0..p.count {
                // In bounds: `end()` (the last piece's end) is within the region, checked above.
                let off = p.offset + k * p.stride;
                let n = p.len as usize;
                let dst = (m.base + off) as *mut u8;
                // SAFETY: [base + off, + n) lies inside a region registered with this agent and
                // exported read-write (checked above), which the application keeps allocated
                // while registered, as for any peer's WRITE; `payload` holds exactly the pieces'
                // bytes (decode checked), so `at + n <= payload.len()`; UCX's buffer and the
                // region do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(payload[at..at + n].as_ptr(), dst, n) };
                at += n;
            }
        }
        ctr.served(true, at as u64);
        return Some(AmReply::Status { token, status: Status::Ok });
    }
    let Some(Some((mem, _))) = m.per_rail.get(rail) else { return refuse(Status::Internal) };
    // Bounded per session: replies the initiator does not take pile up here otherwise.
    let total = am.op.total();
    if ib.reply_bytes.fetch_add(total, Ordering::AcqRel) + total > ib.reply_cap {
        ib.reply_bytes.fetch_sub(total, Ordering::AcqRel);
        return refuse(Status::Busy);
    }
    // At most MAX_VEC_PIECES (decode bounded the count).
    let mut pieces = Vec::with_capacity(am.op.pieces.iter().map(|p| p.count as usize).sum());
    for p in &am.op.pieces {
        for k in 0..p.count {
            pieces.push(((p.offset + k * p.stride) as usize, p.len as usize));
        }
    }
    ctr.served(false, total);
    Some(AmReply::Read { token, mem: mem.clone(), region: m.clone(), pieces, bytes: total })
}

/// Target side of one `Role::UcxSession` connection (already authenticated and registered in
/// the agent's table of served connections; the caller holds the connection's `apply` lock for the whole call). Reads
/// `UcxOpen`, creates a worker on that rail's context for this session only, answers
/// `UcxReady`, then progresses the worker (sleeping on its event fd and the socket) and answers
/// `UcxRkeys` until the socket hangs up, the agent shuts down or the session is fenced. The
/// worker is destroyed before this returns. `Err((status, msg))`: refuse with that (an empty
/// message means just close).
pub(crate) fn serve_session(
    cfg: &Config,
    shutdown: &AtomicBool,
    log: &dyn Fn(&str),
    agent: &UcxAgent,
    s: &mut TcpStream,
    session: Session<'_>,
) -> std::result::Result<(), (Status, String)> {
    let Session { fenced, who, hello_version, counters, session_key } = session;
    let timeout = cfg.timeout;
    let stop = || shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("no UcxOpen within {timeout:?}"));
    let open = match wire::read_frame(s, &mut tick) {
        Ok((_, b @ Body::UcxOpen { .. })) => b,
        Ok((_, other)) => return Err((Status::Unexpected, format!("expected UcxOpen, got {:?}", other.kind()))),
        Err(WireError::Decode(e)) => return Err((Status::Malformed, e.to_string())),
        Err(WireError::GaveUp(m)) => return Err((Status::Malformed, m)),
        Err(WireError::Io(_)) => return Err((Status::Ok, String::new())),
    };
    // Read first, so the refusal reaches the initiator instead of a reset.
    let Some(key) = session_key.filter(|_| cfg.secret.is_some()) else {
        log(&format!("ucx session from {who} refused: {NO_SECRET}"));
        return Err((Status::AuthFailed, NO_SECRET.into()));
    };
    if !sealed(&key, 0, &open) {
        return Err((
            Status::AuthFailed,
            "UcxOpen carries no valid MAC (not from the peer that completed this handshake, altered on the way, or a build \
             from before issue 33): refused"
                .into(),
        ));
    }
    let Body::UcxOpen { rail, addr: peer_addr, features: offered, .. } = open else {
        return Err((Status::Internal, "not a UcxOpen".into()));
    };
    let rail = rail as usize;
    if rail >= agent.rails.len() {
        return Err((Status::Unexpected, format!("no rail {rail} here (this agent has {})", agent.rails.len())));
    }
    let Some(rc) = agent.rail(rail) else {
        // Chosen tcp here (auto without RDMA, or explicit): no UCX over TCP without asking.
        return Err((Status::Unexpected, format!("{NOT_ON_RAIL} {rail} (it runs tcp there)")));
    };
    let slot = SessionSlot::take().map_err(|e| (Status::Busy, e))?;
    let worker = Worker::new(&rc.ctx, ThreadMode::Serialized).map_err(|e| (Status::Internal, format!("ucx session worker: {e}")))?;
    let local = worker.address().map_err(|e| (Status::Internal, format!("ucx session worker address: {e}")))?;
    if let Err(e) = WorkerAddress::check_shape(&peer_addr, local.as_bytes()) {
        return Err((Status::Malformed, format!("UcxOpen: {e}")));
    }
    let am = if hello_version >= HELLO_UCX_FEATURES && offered & UCX_FEATURE_AM != 0 {
        match am_setup(agent, rail, &worker, peer_addr, counters, auth::am_secret(&key)) {
            Ok(am) => Some(am),
            Err(e) => {
                // The session still serves RMA; the initiator sees no AM feature in UcxReady.
                log(&format!("ucx session from {who}: no active messages: {e}"));
                None
            }
        }
    } else {
        None
    };
    agent.sessions.fetch_add(1, Ordering::SeqCst);
    let sending = Sending::default();
    let r = session_serve(cfg, shutdown, log, agent, s, (&worker, local, &key), rail, fenced, who, am.as_ref(), &sending);
    if let Some((ep, _)) = am {
        // Pending replies are cancelled: the session is over (and the worker goes next).
        let _ = ep.close(CloseMode::Force, Instant::now() + Duration::from_secs(1));
    }
    // The session's worker goes here: its connections close, nothing of the session can touch
    // memory after this (the caller releases the fence lock only afterwards).
    drop(worker);
    // Only now the READ replies' regions: a reply the close left running kept the worker alive
    // (a request holds it), so it is destroyed, and the reply cancelled, as the last request
    // drops here, before the region it reads is released (a tuple drops its request first).
    drop(sending);
    agent.sessions.fetch_sub(1, Ordering::SeqCst);
    drop(slot);
    r
}

/// The active-message side of a session: the handler on its worker, and an endpoint of its own
/// to the initiator's worker for the replies.
fn am_setup(
    agent: &UcxAgent,
    rail: usize,
    worker: &Worker,
    peer_addr: Vec<u8>,
    ctr: Arc<dyn AmCounters>,
    secret: [u8; 16],
) -> std::result::Result<(Endpoint, Arc<AmInbox>), String> {
    let kick = Kick::new().map_err(|e| format!("eventfd: {e}"))?;
    let inbox = Arc::new(AmInbox {
        replies: Mutex::new(Vec::new()),
        kick,
        secret,
        ep: AtomicUsize::new(0),
        reply_bytes: AtomicU64::new(0),
        reply_cap: REPLY_CAP.load(Ordering::SeqCst),
    });
    let (maps, ib) = (agent.maps.clone(), inbox.clone());
    worker
        .set_am_handler(
            UCX_AM_REQ,
            Box::new(move |h, d, from| {
                if let Some(r) = handle_am(&maps, rail, &*ctr, &ib, h, d, from) {
                    let mut q = ib.replies.lock().unwrap_or_else(PoisonError::into_inner);
                    if q.len() >= MAX_QUEUED_REPLIES {
                        // The session loop is behind by this much: drop (the initiator stalls).
                        if let AmReply::Read { bytes, .. } = r {
                            ib.reply_bytes.fetch_sub(bytes, Ordering::AcqRel);
                        }
                        ctr.refused(Status::Busy);
                        return;
                    }
                    q.push(r);
                    if q.len() == 1 {
                        ib.kick.kick();
                    }
                }
            }),
        )
        .map_err(|e| e.to_string())?;
    // SAFETY: the initiator's `ucp_worker_get_address`: its UcxOpen's MAC verified (only the
    // authenticated peer of this connection could have sent it) and its structure checked
    // against this UCX's own addresses (`serve_session`).
    let addr = unsafe { WorkerAddress::from_peer(peer_addr) }.map_err(|e| format!("initiator worker address: {e}"))?;
    let ep = worker.connect(&addr).map_err(|e| format!("reply endpoint: {e}"))?;
    // From now on the handler (which runs only inside this worker's progress) takes messages
    // that UCX delivers on this endpoint: the initiator's.
    inbox.ep.store(ep.handle_id(), Ordering::Release);
    Ok((ep, inbox))
}

/// Send the replies the handler left; Err when the reply endpoint refuses (the initiator is gone).
/// A READ reply still sending is kept in `sending` with its region; finished ones are released.
fn send_replies(ep: &Endpoint, inbox: &AmInbox, sending: &Sending) -> std::result::Result<(), String> {
    let mut pending = sending.lock().unwrap_or_else(PoisonError::into_inner);
    // Done or failed: either way UCX no longer reads the region for it.
    pending.retain_mut(|(req, _, bytes)| {
        let keep = matches!(req.check(), Ok(false));
        if !keep {
            inbox.reply_bytes.fetch_sub(*bytes, Ordering::AcqRel);
        }
        keep
    });
    let replies = std::mem::take(&mut *inbox.replies.lock().unwrap_or_else(PoisonError::into_inner));
    let mut replies = replies.into_iter();
    let r = replies.try_for_each(|r| send_reply(ep, inbox, &mut pending, r));
    // Not sent (the endpoint refused one): their bytes no longer count.
    for left in replies {
        if let AmReply::Read { bytes, .. } = left {
            inbox.reply_bytes.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
    r
}

/// Send one reply; a READ's still sending joins `pending` (else its bytes are released).
fn send_reply(
    ep: &Endpoint,
    inbox: &AmInbox,
    pending: &mut Vec<(Request, Arc<Mapped>, u64)>,
    r: AmReply,
) -> std::result::Result<(), String> {
    match r {
        AmReply::Status { token, status } => {
            // A pending status reply keeps only its own buffers alive.
            drop(
                ep.am_send(UCX_AM_REPLY, encode_ucx_am_reply(token, status, &inbox.secret).to_vec(), Vec::new(), &[])
                    .map_err(|e| format!("reply: {e}"))?,
            );
        }
        AmReply::Read { token, mem, region, pieces, bytes } => {
            let iov: Vec<(&MemRegion, usize, usize)> = pieces.iter().map(|&(o, n)| (&mem, o, n)).collect();
            let sent = ep.am_send(UCX_AM_REPLY, encode_ucx_am_reply(token, Status::Ok, &inbox.secret).to_vec(), Vec::new(), &iov);
            let mut req = match sent {
                Ok(req) => req,
                Err(e) => {
                    inbox.reply_bytes.fetch_sub(bytes, Ordering::AcqRel);
                    return Err(format!("reply: {e}"));
                }
            };
            if matches!(req.check(), Ok(false)) {
                pending.push((req, region, bytes));
            } else {
                inbox.reply_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn session_serve(
    cfg: &Config,
    shutdown: &AtomicBool,
    log: &dyn Fn(&str),
    agent: &UcxAgent,
    s: &mut TcpStream,
    (worker, addr, key): (&Worker, WorkerAddress, &[u8; 32]),
    rail: usize,
    fenced: &AtomicBool,
    who: &str,
    am: Option<&(Endpoint, Arc<AmInbox>)>,
    sending: &Sending,
) -> std::result::Result<(), (Status, String)> {
    let timeout = cfg.timeout;
    let stop = || shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("UcxReady not sent within {timeout:?}"));
    let Some(rc) = agent.rail(rail) else { return Err((Status::Internal, format!("rail {rail} has no UCX context"))) };
    let features = if am.is_some() { UCX_FEATURE_AM } else { 0 };
    let ready = seal(key, 0, Body::UcxReady { addr: addr.into_bytes(), regions: agent.ready_regions(rail, None), features, mac: None });
    // The n-th answer to UcxRkeys is sealed as place n (no answer can stand in for another).
    let mut seq = 0u64;
    if wire::send(s, &ready, 0, &mut tick).is_err() {
        return Err((Status::Ok, String::new()));
    }
    log(&format!("ucx session from {who} on rail {rail} ({}){}", rc.devices, if am.is_some() { ", active messages" } else { "" }));
    // Replies left by the handler go out after every progress that may have run it.
    let answer = || match am {
        Some((ep, inbox)) => send_replies(ep, inbox, sending),
        None => Ok(()),
    };
    let fd = s.as_raw_fd();
    let spin = match cfg.progress {
        Progress::Block => Duration::ZERO,
        _ => cfg.spin,
    };
    let r = loop {
        if stop() {
            break Ok(());
        }
        // Serve like a TCP serving connection (`Config::progress`): after activity, keep
        // progressing the worker for `spin` (software RMA over tcp needs this side's progress, and
        // a wake-up from the event fd costs tens of microseconds on a busy host), then sleep.
        if spin > Duration::ZERO {
            let mut until = Instant::now() + spin;
            while Instant::now() < until && !stop() {
                match worker.progress() {
                    // Nothing ready: give the CPU to any other runnable thread first (a
                    // bulk stream keeps this loop spinning between its fragments, and on a
                    // busy host the threads it would starve are the transfer's own).
                    Ok(0) => std::thread::yield_now(),
                    Ok(_) => until = Instant::now() + spin,
                    Err(_) => break,
                }
                if let Err(e) = answer() {
                    log(&format!("ucx session from {who}: {e}"));
                    return Ok(());
                }
            }
        }
        let kick_fd = am.map_or(-1, |(_, ib)| ib.kick.fd());
        let mut fds = [
            libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 },
            libc::pollfd { fd: kick_fd, events: libc::POLLIN, revents: 0 },
        ];
        if let Err(e) = worker.wait_for_events_or(SESSION_TICK, &mut fds) {
            log(&format!("ucx session from {who}: {e}"));
            break Ok(());
        }
        if let Some((_, ib)) = am {
            if fds[1].revents != 0 {
                ib.kick.drain();
            }
        }
        if let Err(e) = answer() {
            log(&format!("ucx session from {who}: {e}"));
            break Ok(());
        }
        let rev = fds[0].revents;
        if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL | libc::POLLRDHUP) != 0 {
            break Ok(());
        }
        if rev & libc::POLLIN == 0 {
            continue;
        }
        let mut op_tick = tick_until(&stop, Instant::now() + timeout, || format!("request not completed within {timeout:?}"));
        match wire::read_frame(s, &mut op_tick) {
            Ok((h, Body::UcxRkeys(ids))) => {
                seq += 1;
                let resp = seal(
                    key,
                    seq,
                    Body::UcxReady { addr: Vec::new(), regions: agent.ready_regions(rail, Some(&ids)), features: 0, mac: None },
                );
                if wire::send(s, &resp, h.req_id, &mut op_tick).is_err() {
                    break Ok(());
                }
            }
            Ok((_, other)) => break Err((Status::Unexpected, format!("{:?} is not a ucx session request", other.kind()))),
            Err(WireError::Decode(e)) => break Err((Status::Malformed, e.to_string())),
            Err(WireError::GaveUp(m)) => break Err((Status::Malformed, m)),
            Err(WireError::Io(_)) => break Ok(()),
        }
    };
    r
}
