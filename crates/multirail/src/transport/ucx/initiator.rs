//! The initiator's side of one UCX rail to one peer: [`UcxRail`], a worker of its own, one
//! endpoint to the target's per-session worker, the rkeys the session announced; `post`,
//! `progress` and `abort` (module docs of `transport::ucx`).

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use multirail_proto::codec::{
    decode_ucx_am_reply, UcxAm, UcxRegion, VecOp, VecPiece, HELLO_UCX_FEATURES, UCX_AM_REPLY, UCX_AM_REQ, UCX_FEATURE_AM,
};
use multirail_proto::{Body, RegionKey, Status};
use multirail_ucx::{AmData, CloseMode, Endpoint, MemRegion, PackedRkey, RemoteRegion, Request, Rkey, ThreadMode, Worker, WorkerAddress};

use super::{find_local, lock, seal, sealed, Kick, Maps, UcxAgent, NO_SECRET};
use crate::auth;
use crate::error::{Error, Result};
use crate::net::{abort_socket, status_error};
use crate::registry::random_bytes;
use crate::wire::{self, WireError};

/// Bounded progress calls per sweep.
const PROGRESS_BURST: usize = 64;

/// A target region as the session announced it; the rkey is unpacked on first use.
struct Remote {
    region: RemoteRegion,
    packed: PackedRkey,
    rkey: Option<Rkey>,
}

impl Remote {
    /// Its rkey on `ep`, unpacked on first use and then kept.
    fn rkey(&mut self, ep: &Endpoint) -> std::result::Result<Rkey, multirail_ucx::Error> {
        if let Some(k) = &self.rkey {
            return Ok(k.clone());
        }
        let k = ep.unpack_rkey(&self.packed, self.region)?;
        self.rkey = Some(k.clone());
        Ok(k)
    }
}

/// Set `MULTIRAIL_UCX_AM=0` to keep every chunk on RMA (no `UCX_FEATURE_AM` offered): an A/B
/// switch for measurements.
pub(crate) const ENV_AM: &str = "MULTIRAIL_UCX_AM";

/// A chunk sent as one active message, waiting for its reply (`UcxRail::post_v`), under the
/// random token its request carries.
struct AmPending {
    /// The chunk's token (what `progress` reports).
    token: u64,
    write: bool,
    /// A READ's local destinations (address, length), in the order of the reply's bytes.
    dst: Vec<(u64, usize)>,
    /// A READ's bytes in all.
    total: usize,
    /// The local mappings of `dst`, kept while the reply may still land.
    _mems: Vec<MemRegion>,
}

/// What the reply handler shares with the rail: replies wait for their pending entry here.
/// Locked innermost (inside the rail state and the worker's lock).
#[derive(Default)]
struct AmInbox {
    /// By the random token of the request (not the chunk's: a reply cannot be guessed).
    pending: HashMap<u64, AmPending>,
    /// The session's active-message secret (`auth::am_secret`), in every request and reply.
    secret: [u8; 16],
    /// Replies handled, not yet seen by `sweep`.
    done: Vec<(u64, std::result::Result<(), String>)>,
}

/// A refusal status from the target, worded for `rails::refused`.
fn target_refusal(op: &str, status: Status) -> String {
    match status {
        Status::OutOfBounds => format!("{op}: a piece is outside the remote region (refused by the target)"),
        Status::UnknownRegion => format!("{op}: the peer exports no such region over ucx (refused by the target)"),
        Status::ReadOnly => format!("{op}: the remote region is read-only (refused by the target)"),
        s => format!("{op} refused by the target: {s:?}"),
    }
}

/// The reply handler of a rail's worker (runs in `ucp_worker_progress`): a READ's bytes are
/// scattered into its local pieces once their length is checked; a reply for no pending chunk
/// (after an abort), from another endpoint than the session's (`ep`: `Endpoint::handle_id`),
/// or without the session's secret is dropped untouched.
fn on_reply(inbox: &Mutex<AmInbox>, ep: &AtomicUsize, header: &[u8], data: AmData<'_>, from: Option<usize>) {
    let Ok((wire, status, secret)) = decode_ucx_am_reply(header) else { return };
    let ours = ep.load(Ordering::Acquire);
    if ours == 0 || from != Some(ours) {
        return;
    }
    let mut ib = lock(inbox);
    if !auth::bytes_equal(&secret, &ib.secret) {
        return;
    }
    let Some(p) = ib.pending.remove(&wire) else { return };
    let token = p.token;
    let op = if p.write { "WRITE" } else { "READ" };
    let want = if p.write { 0 } else { p.total };
    let r = match data {
        _ if status != Status::Ok => Err(target_refusal(op, status)),
        AmData::Eager(b) if b.len() == want => {
            let mut at = 0usize;
            for &(addr, n) in &p.dst {
                // SAFETY: [addr, addr + n) is a piece of a READ posted on this rail, inside memory
                // registered with this agent (checked at post) that the transfer keeps
                // allocated until it is reported; the entry was pending, so the rail was not
                // aborted (an abort empties the table under this lock). The lengths sum to
                // `want` == b.len().
                unsafe { std::ptr::copy_nonoverlapping(b[at..at + n].as_ptr(), addr as *mut u8, n) };
                at += n;
            }
            Ok(())
        }
        AmData::Eager(b) => Err(format!("{op}: the target's reply carries {} bytes, expected {want}", b.len())),
        AmData::Rendezvous { .. } => Err(format!("{op}: the target's reply came by rendezvous")),
    };
    ib.done.push((token, r));
}

struct Op {
    token: u64,
    /// An active message's random request token (its inbox entry), else 0.
    wire: u64,
    write: bool,
    /// The chunk's gets or puts, one per piece (never empty); or its active message's send.
    reqs: Vec<Request>,
    /// Sent as one active message: complete once its reply arrived (and the send completed).
    am: bool,
    /// For a WRITE: an endpoint flush issued right after its puts, complete once they are
    /// complete at the target (remote completion). One per chunk, so each chunk is reported as
    /// soon as it landed: a flush covering the whole window would report nothing until the
    /// window drained.
    flush: Option<Request>,
}

struct RailState {
    /// `None` once aborted.
    ep: Option<Endpoint>,
    remote: HashMap<u64, Remote>,
    /// Posted, not yet complete (a PUT: not yet complete at the target).
    ops: Vec<Op>,
    /// Tokens of chunks that were outstanding when the rail was aborted (never reported).
    lost: Vec<u64>,
    failed: Option<String>,
    /// The stall clock: last completion, or when the rail became busy.
    last_event: Instant,
    transport: Option<String>,
    completed_any: bool,
    /// Active-message replies taken from the inbox, by token, until their op is collected.
    replied: HashMap<u64, std::result::Result<(), String>>,
}

impl RailState {
    fn outstanding(&self) -> usize {
        self.ops.len()
    }

    fn fail(&mut self, reason: String) -> String {
        self.failed.get_or_insert(reason).clone()
    }
}

/// Initiator side of one rail to one peer: a worker of its own (per link and rail, so a fence
/// can tear exactly it down), one endpoint to the target's per-session worker, rkeys by region.
///
/// `Send + Sync`: one progress thread calls [`UcxRail::progress`]; any thread may `post` and
/// `abort`. Lock order: the rail state, then (inside the bindings) the worker.
pub(crate) struct UcxRail {
    local_rail: usize,
    id: [u8; 16],
    maps: Arc<Maps>,
    worker: Worker,
    state: Mutex<RailState>,
    /// The session socket for `UcxRkeys` round trips.
    sock: Mutex<TcpStream>,
    /// Another handle on it: hang-up checks and the abort.
    sock_ctl: TcpStream,
    kick: Kick,
    timeout: Duration,
    aborted: AtomicBool,
    /// The session negotiated `UCX_FEATURE_AM`.
    am: bool,
    inbox: Arc<Mutex<AmInbox>>,
    /// The session key: seals and checks the session's messages (`UcxRkeys` answers).
    key: [u8; 32],
    /// The target's session worker address (tests play a third party with it).
    #[cfg(test)]
    peer_addr: Vec<u8>,
    /// `UcxRkeys` answers received so far (the next is sealed as this plus one).
    rkeys_seq: std::sync::atomic::AtomicU64,
}

fn wire_error(who: &str, e: WireError) -> Error {
    match e {
        WireError::Decode(source) => Error::Decode { who: who.into(), source },
        WireError::GaveUp(m) => Error::Timeout(m),
        WireError::Io(e) => Error::PeerLost { peer: who.into(), reason: format!("ucx session: {e}") },
    }
}

/// Wrap an announced region list (from a `UcxReady` whose MAC verified) for use; a packed rkey
/// without the structure `ucp_rkey_pack` gives refuses the whole list.
fn remotes(regions: Vec<UcxRegion>) -> std::result::Result<Vec<(u64, Remote)>, String> {
    regions
        .into_iter()
        .map(|g| {
            PackedRkey::check_shape(&g.rkey).map_err(|e| format!("region {}: {e}", g.id))?;
            // SAFETY: the bytes came in a UcxReady sealed with this session's key (only the
            // target of this authenticated connection could produce it), checked for the
            // structure of a packed rkey just above.
            let packed = unsafe { PackedRkey::from_peer(g.rkey) }.map_err(|e| format!("region {}: {e}", g.id))?;
            Ok((g.id, Remote { region: RemoteRegion { addr: g.base, len: g.len }, packed, rkey: None }))
        })
        .collect()
}

impl UcxRail {
    /// `session`: an already authenticated TCP connection to the target's rail (opened with
    /// `net::dial` and `Role::UcxSession`), `id` its Hello nonce (what a `Fence` names),
    /// `hello_version` the `Hello` version the target accepted (3 and up: the active-message
    /// path is offered, unless `MULTIRAIL_UCX_AM=0`), `session_key` the connection's
    /// (`net::Dialed`; none without a shared secret, and then the session is refused,
    /// [`NO_SECRET`]).
    /// Does the UcxOpen/UcxReady exchange and connects the endpoint (waits for the wire-up with a
    /// flush). Bounded by `timeout`, which also bounds later `UcxRkeys` round trips and `abort`.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        agent: &UcxAgent,
        local_rail: usize,
        remote_rail: u16,
        session: TcpStream,
        id: [u8; 16],
        hello_version: u16,
        session_key: Option<[u8; 32]>,
        timeout: Duration,
    ) -> Result<UcxRail> {
        let who = session.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let Some(key) = session_key else { return Err(Error::Auth { who, msg: NO_SECRET.into() }) };
        let rail = agent.rail(local_rail).ok_or_else(|| {
            Error::InvalidArgument(format!("local rail {local_rail} does not run ucx (this agent has {} rails)", agent.rails.len()))
        })?;
        let ucx_err = |what: &str, e: multirail_ucx::Error| match e {
            multirail_ucx::Error::Timeout { .. } => Error::Timeout(format!("ucx session with {who}: {what}: {e}")),
            e => Error::PeerLost { peer: who.clone(), reason: format!("ucx session: {what}: {e}") },
        };
        let worker = Worker::new(&rail.ctx, ThreadMode::Serialized).map_err(|e| ucx_err("worker", e))?;
        let inbox = Arc::new(Mutex::new(AmInbox { secret: auth::am_secret(&key), ..AmInbox::default() }));
        let ep_id = Arc::new(AtomicUsize::new(0));
        let offer = hello_version >= HELLO_UCX_FEATURES && std::env::var(ENV_AM).map_or(true, |v| v.trim() != "0") && {
            let (ib, id) = (inbox.clone(), ep_id.clone());
            // Before UcxOpen: no reply can come earlier. A worker that refuses it offers nothing.
            worker.set_am_handler(UCX_AM_REPLY, Box::new(move |h, d, from| on_reply(&ib, &id, h, d, from))).is_ok()
        };
        let addr = worker.address().map_err(|e| ucx_err("worker address", e))?;
        let local_addr = addr.as_bytes().to_vec();
        let deadline = Instant::now() + timeout;
        let mut s = session;
        let mut tick =
            |_: bool| if Instant::now() > deadline { Err(format!("ucx session with {who} not open within {timeout:?}")) } else { Ok(()) };
        let features = if offer { UCX_FEATURE_AM } else { 0 };
        let open = seal(&key, 0, Body::UcxOpen { rail: remote_rail, addr: addr.into_bytes(), features, mac: None });
        wire::send(&mut s, &open, 0, &mut tick).map_err(|e| wire_error(&who, e))?;
        let ready = match wire::read_frame(&mut s, &mut tick).map_err(|e| wire_error(&who, e))?.1 {
            b @ Body::UcxReady { .. } => b,
            Body::Error { status, msg } | Body::Resp { status, msg, .. } => return Err(status_error(&who, status, msg)),
            other => return Err(Error::Protocol { who, msg: format!("expected UcxReady, got {:?}", other.kind()) }),
        };
        if !sealed(&key, 0, &ready) {
            return Err(Error::Auth {
                who,
                msg: "UcxReady carries no valid MAC (not from the target of this handshake, or altered on the way): refused".into(),
            });
        }
        let Body::UcxReady { addr: peer_addr, regions, features: served, .. } = ready else {
            return Err(Error::Protocol { who, msg: "not a UcxReady".into() });
        };
        let bad = |msg: String| Error::Protocol { who: who.clone(), msg };
        WorkerAddress::check_shape(&peer_addr, &local_addr).map_err(|e| bad(format!("UcxReady: {e}")))?;
        let remote = remotes(regions).map_err(|e| bad(format!("UcxReady: {e}")))?;
        // SAFETY: the target's worker address, in a UcxReady sealed with this session's key
        // (only the target of this authenticated connection could produce it), its structure
        // checked against this UCX's own address just above.
        #[cfg(test)]
        let peer_bytes = peer_addr.clone();
        let peer_addr = unsafe { WorkerAddress::from_peer(peer_addr) }.map_err(|e| bad(format!("bad worker address in UcxReady: {e}")))?;
        let ep = worker.connect(&peer_addr).map_err(|e| ucx_err("connect", e))?;
        ep_id.store(ep.handle_id(), Ordering::Release);
        // The wire-up completes only while both sides progress: wait for it here, bounded.
        ep.flush().and_then(|mut r| r.wait(deadline)).map_err(|e| ucx_err("connect (wire-up flush)", e))?;
        let kick = Kick::new().map_err(|e| Error::io("eventfd", e))?;
        let sock_ctl = s.try_clone().map_err(|e| Error::io("clone ucx session socket", e))?;
        let state = RailState {
            ep: Some(ep),
            remote: remote.into_iter().collect(),
            ops: Vec::new(),
            lost: Vec::new(),
            failed: None,
            last_event: Instant::now(),
            transport: None,
            completed_any: false,
            replied: HashMap::new(),
        };
        Ok(UcxRail {
            local_rail,
            id,
            maps: agent.maps.clone(),
            worker,
            state: Mutex::new(state),
            sock: Mutex::new(s),
            sock_ctl,
            kick,
            timeout,
            aborted: AtomicBool::new(false),
            am: offer && served & UCX_FEATURE_AM != 0,
            inbox,
            key,
            rkeys_seq: Default::default(),
            #[cfg(test)]
            peer_addr: peer_bytes,
        })
    }

    /// Whether this rail may send a vectored chunk as one active message (negotiated).
    pub fn am(&self) -> bool {
        self.am
    }

    /// Wake a `progress` sleeping on this rail (work may be waiting in the planner).
    pub fn wake(&self) {
        self.kick.kick();
    }

    /// The session's Hello nonce: what a `Fence` to the target names to tear the session down.
    pub fn id(&self) -> [u8; 16] {
        self.id
    }

    /// Post one chunk; `token` comes back from [`UcxRail::progress`]. `local` is an address
    /// inside a region registered (hence mapped) here; `remote_region` / `remote_offset` name
    /// the target's region. WRITE = put, READ = get. A batch of one ([`UcxRail::post_v`]; the
    /// rails post every chunk through that).
    #[cfg(test)]
    pub fn post(
        &self,
        token: u64,
        write: bool,
        local: u64,
        remote_region: u64,
        remote_offset: u64,
        len: u64,
    ) -> std::result::Result<(), String> {
        self.post_v(token, write, remote_region, RegionKey([0; 16]), &[(local, remote_offset, len)], None)
    }

    /// Post a chunk of `pieces` (local address, remote offset, length), all in remote region
    /// `remote_region`, as one batch of nonblocking gets (READ) or puts (WRITE); `token` comes
    /// back from [`UcxRail::progress`] once every piece completed (a WRITE: once one endpoint
    /// flush posted after the puts completed, i.e. remotely). Every piece is checked against
    /// the local mappings and the region bounds the session announced before UCX is called, so
    /// a refusal by these checks leaves nothing in flight. A refusal by UCX of the first piece
    /// (nothing in flight yet) refuses the chunk; of a later piece, or of the flush, it fails
    /// the rail (pieces may be in flight: the chunk is reissued after the fence).
    ///
    /// `wire`: the chunk's piece table (`planner::vec_pieces`, the same pieces on the remote
    /// side). Given on a rail with [`UcxRail::am`], the chunk goes as one active message instead
    /// (`UcxAm`: the table, and a WRITE's pieces gathered from local memory by an iov); the
    /// target checks and applies it and answers once, and the chunk completes on that reply (a
    /// READ's reply is scattered into the local pieces). Same checks first; a refused send
    /// refuses the chunk.
    ///
    /// `key`: the remote region's key (from the peer's metadata), which an active message
    /// carries and the target checks; RMA does not use it.
    pub fn post_v(
        &self,
        token: u64,
        write: bool,
        remote_region: u64,
        key: RegionKey,
        pieces: &[(u64, u64, u64)],
        wire: Option<&[VecPiece]>,
    ) -> std::result::Result<(), String> {
        self.post_checked(token, write, (remote_region, key), pieces, wire.filter(|_| self.am), true)
    }

    #[cfg(test)]
    /// An active message with `wire` as its piece table as is, unchecked against the bounds the
    /// session announced (what a faulty or hostile initiator could send: the target's checks
    /// are under test). The local pieces are still checked.
    pub fn post_am_unchecked(
        &self,
        token: u64,
        write: bool,
        remote: (u64, RegionKey),
        pieces: &[(u64, u64, u64)],
        wire: &[VecPiece],
    ) -> std::result::Result<(), String> {
        self.post_checked(token, write, remote, pieces, Some(wire), false)
    }

    #[cfg(test)]
    /// The target's session worker address, as its UcxReady gave it.
    pub fn peer_address(&self) -> Vec<u8> {
        self.peer_addr.clone()
    }

    #[cfg(test)]
    /// The session's active-message secret (tests build raw requests with it).
    pub fn am_secret(&self) -> [u8; 16] {
        lock(&self.inbox).secret
    }

    #[cfg(test)]
    /// A raw active message (header and data exactly as given) waited for as WRITE chunk
    /// `token`: malformed requests, to test the target's decoding. A request the target cannot
    /// answer (no token) stays outstanding.
    pub fn post_am_raw(&self, token: u64, header: Vec<u8>, data: Vec<u8>) -> std::result::Result<(), String> {
        let mut g = lock(&self.state);
        let st = &mut *g;
        let Some(ep) = st.ep.as_ref() else { return Err("rail was aborted".into()) };
        lock(&self.inbox).pending.insert(token, AmPending { token, write: true, dst: Vec::new(), total: 0, _mems: Vec::new() });
        let req = ep.am_send(UCX_AM_REQ, header, data, &[]).map_err(|e| {
            lock(&self.inbox).pending.remove(&token);
            e.to_string()
        })?;
        st.ops.push(Op { token, wire: token, write: true, reqs: vec![req], am: true, flush: None });
        Ok(())
    }

    fn post_checked(
        &self,
        token: u64,
        write: bool,
        (remote_region, key): (u64, RegionKey),
        pieces: &[(u64, u64, u64)],
        wire: Option<&[VecPiece]>,
        check_remote: bool,
    ) -> std::result::Result<(), String> {
        let op = if write { "WRITE" } else { "READ" };
        if pieces.is_empty() {
            return Err(format!("{op}: a chunk with no pieces"));
        }
        let mut locals = Vec::with_capacity(pieces.len());
        let mut last: Option<(u64, u64, MemRegion)> = None;
        for &(local, _, len) in pieces {
            // Pieces of one chunk mostly share a mapping: look it up again only when they leave it.
            let hit = last.as_ref().filter(|(b, e, _)| *b <= local && local.checked_add(len).is_some_and(|end| end <= *e));
            let (mem, off) = match hit {
                Some((b, _, m)) => (m.clone(), (local - b) as usize),
                None => {
                    let (mem, off) = find_local(&self.maps, self.local_rail, local, len)
                        .ok_or_else(|| format!("{op}: local range {local:#x} + {len} is not inside memory registered with this agent"))?;
                    let base = local - off as u64;
                    last = Some((base, base + mem.len() as u64, mem.clone()));
                    (mem, off)
                }
            };
            locals.push((mem, off, usize::try_from(len).map_err(|_| format!("{op}: length {len} too large"))?));
        }
        if check_remote && !lock(&self.state).remote.contains_key(&remote_region) {
            self.fetch_rkey(remote_region)?;
        }
        let mut g = lock(&self.state);
        let st = &mut *g;
        if let Some(f) = &st.failed {
            return Err(format!("rail is down: {f}"));
        }
        let Some(ep) = st.ep.as_ref() else { return Err("rail was aborted".into()) };
        if !check_remote {
            if let Some(wire) = wire {
                return self.post_am(st, token, write, (remote_region, key), pieces, &locals, wire);
            }
        }
        let remote =
            st.remote.get_mut(&remote_region).ok_or_else(|| format!("{op}: the peer exports no region {remote_region} over ucx"))?;
        let mut addrs = Vec::with_capacity(pieces.len());
        for &(_, off, len) in pieces {
            match remote.region.addr.checked_add(off) {
                Some(a) if remote.region.contains(a, len) => addrs.push(a),
                _ => {
                    return Err(format!(
                        "{op}: remote offset {off} + {len} is outside region {remote_region} ({} bytes)",
                        remote.region.len
                    ))
                }
            }
        }
        if let Some(wire) = wire {
            return self.post_am(st, token, write, (remote_region, key), pieces, &locals, wire);
        }
        let rkey = remote.rkey(ep).map_err(|e| format!("{op}: cannot unpack the rkey of region {remote_region}: {e}"))?;
        let mut reqs = Vec::with_capacity(pieces.len());
        for ((mem, off, n), addr) in locals.iter().zip(addrs) {
            let r = if write { ep.put(mem, *off, *n, &rkey, addr) } else { ep.get(mem, *off, *n, &rkey, addr) };
            match r {
                Ok(req) => reqs.push(req),
                Err(e @ multirail_ucx::Error::EndpointFailed { .. }) => return Err(format!("rail is down: {}", st.fail(e.to_string()))),
                // Nothing of this chunk in flight: only the chunk is refused.
                Err(e) if reqs.is_empty() => return Err(format!("{op} refused: {e}")),
                // Some pieces may be in flight: the rail goes down and the whole chunk is
                // reissued after the fence.
                Err(e) => return Err(format!("rail is down: {}", st.fail(format!("{op} of a vectored chunk refused: {e}")))),
            }
        }
        // A READ's gets complete when their data is here; a WRITE completes at the target only
        // with a flush after its puts. (A batch of gets keeps its flush as before.)
        let flush = match write || reqs.len() > 1 {
            false => None,
            true => match ep.flush() {
                Ok(f) => Some(f),
                Err(e) => return Err(format!("rail is down: {}", st.fail(format!("flush refused: {e}")))),
            },
        };
        if st.outstanding() == 0 {
            st.last_event = Instant::now();
        }
        st.ops.push(Op { token, wire: 0, write, reqs, am: false, flush });
        drop(g);
        self.kick.kick();
        Ok(())
    }

    /// Send a checked chunk as one active message (`post_v`); the state is locked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn post_am(
        &self,
        st: &mut RailState,
        token: u64,
        write: bool,
        (remote_region, key): (u64, RegionKey),
        pieces: &[(u64, u64, u64)],
        locals: &[(MemRegion, usize, usize)],
        wire: &[VecPiece],
    ) -> std::result::Result<(), String> {
        let op = if write { "WRITE" } else { "READ" };
        let Some(ep) = st.ep.as_ref() else { return Err("rail was aborted".into()) };
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let mut ib = lock(&self.inbox);
        // A random request token, not the chunk's (a reply cannot be forged by guessing it).
        let wire_token = loop {
            let t = u64::from_le_bytes(random_bytes());
            if t != 0 && !ib.pending.contains_key(&t) {
                break t;
            }
        };
        let secret = ib.secret;
        let am = UcxAm { token: wire_token, write, op: VecOp { region: remote_region, key, pieces: wire.to_vec() }, secret };
        if am.op.total() != total {
            return Err(format!("{op}: the piece table ({} bytes) does not match the chunk ({total} bytes)", am.op.total()));
        }
        let (header, desc) = am.encode().map_err(|e| format!("{op}: {e}"))?;
        let mut mems: Vec<MemRegion> = Vec::new();
        let dst = if write {
            Vec::new()
        } else {
            for (m, _, _) in locals {
                if !mems.iter().any(|x| x.addr() == m.addr()) {
                    mems.push(m.clone());
                }
            }
            pieces.iter().map(|&(l, _, n)| (l, n as usize)).collect()
        };
        // Pending before the send: another thread's progress may run the reply handler at once.
        ib.pending.insert(wire_token, AmPending { token, write, dst, total: total as usize, _mems: mems });
        drop(ib);
        let iov: Vec<(&MemRegion, usize, usize)> = if write { locals.iter().map(|(m, o, n)| (m, *o, *n)).collect() } else { Vec::new() };
        match ep.am_send(UCX_AM_REQ, header.to_vec(), desc, &iov) {
            Ok(req) => {
                if st.outstanding() == 0 {
                    st.last_event = Instant::now();
                }
                st.ops.push(Op { token, wire: wire_token, write, reqs: vec![req], am: true, flush: None });
                self.kick.kick();
                Ok(())
            }
            Err(e) => {
                lock(&self.inbox).pending.remove(&wire_token);
                match e {
                    e @ multirail_ucx::Error::EndpointFailed { .. } => Err(format!("rail is down: {}", st.fail(e.to_string()))),
                    // Nothing of this chunk in flight: only the chunk is refused.
                    e => Err(format!("{op} refused: {e}")),
                }
            }
        }
    }

    /// Ask the target for the rkey of a region registered after the session opened.
    fn fetch_rkey(&self, id: u64) -> std::result::Result<(), String> {
        let mut s = lock(&self.sock);
        if self.aborted.load(Ordering::Acquire) {
            return Err("rail was aborted".into());
        }
        let deadline = Instant::now() + self.timeout;
        let mut tick =
            |_: bool| if Instant::now() > deadline { Err(format!("no rkey for region {id} within {:?}", self.timeout)) } else { Ok(()) };
        wire::send(&mut s, &Body::UcxRkeys(vec![id]), 0, &mut tick).map_err(|e| format!("ucx session: {e}"))?;
        match wire::read_frame(&mut s, &mut tick).map_err(|e| format!("ucx session: {e}"))?.1 {
            b @ Body::UcxReady { .. } => {
                let seq = self.rkeys_seq.fetch_add(1, Ordering::AcqRel) + 1;
                if !sealed(&self.key, seq, &b) {
                    return Err(format!(
                        "rail is down: {}",
                        lock(&self.state).fail("a UcxReady without a valid MAC: session refused".into())
                    ));
                }
                let Body::UcxReady { regions, .. } = b else { return Err("not a UcxReady".into()) };
                let got = remotes(regions).map_err(|e| format!("rail is down: {}", lock(&self.state).fail(format!("UcxReady: {e}"))))?;
                lock(&self.state).remote.extend(got);
                Ok(())
            }
            Body::Error { status, msg } => Err(format!("ucx session refused: {status:?}: {msg}")),
            other => Err(format!("ucx session: expected UcxReady, got {:?}", other.kind())),
        }
    }

    /// Progress the worker; push finished chunks into `done` (token, Ok, or Err(reason) for a
    /// chunk-level refusal). A PUT is done only once a flush issued after it completed (remote
    /// completion; one flush per PUT). Sleeps at most `wait` on the worker's event fd (and
    /// the session socket and the post kick) when nothing is ready. `Err(reason)`: the rail
    /// failed (endpoint error, a request failed with EndpointFailed, the session socket hung
    /// up, or nothing completed for `stall` while chunks were outstanding: UCX over tcp does not
    /// report a hung peer). Failure is sticky; the caller aborts, fences and reissues
    /// ([`UcxRail::take_unfinished`] lists what was not reported).
    pub fn progress(
        &self,
        done: &mut Vec<(u64, std::result::Result<(), String>)>,
        wait: Duration,
        stall: Duration,
    ) -> std::result::Result<(), String> {
        let start = Instant::now();
        loop {
            let before = done.len();
            let busy_since = self.sweep(done, stall)?;
            if done.len() > before {
                return Ok(());
            }
            let now = Instant::now();
            let elapsed = now - start;
            if elapsed >= wait {
                return Ok(());
            }
            let mut sleep = wait - elapsed;
            if let Some(t) = busy_since {
                // Wake to check the stall clock when it runs out.
                sleep = sleep.min((t + stall).saturating_duration_since(now) + Duration::from_millis(1));
            }
            let mut fds = [
                libc::pollfd { fd: self.sock_ctl.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 },
                libc::pollfd { fd: self.kick.fd(), events: libc::POLLIN, revents: 0 },
            ];
            if let Err(e) = self.worker.wait_for_events_or(sleep, &mut fds) {
                return Err(lock(&self.state).fail(format!("waiting for ucx events: {e}")));
            }
            if fds[1].revents != 0 {
                self.kick.drain();
            }
        }
    }

    /// One pass: progress, collect completions, flush, check failure and the stall clock.
    /// Returns the stall clock's start when chunks are outstanding.
    fn sweep(
        &self,
        done: &mut Vec<(u64, std::result::Result<(), String>)>,
        stall: Duration,
    ) -> std::result::Result<Option<Instant>, String> {
        let mut g = lock(&self.state);
        let st = &mut *g;
        if let Some(f) = &st.failed {
            return Err(f.clone());
        }
        let Some(ep) = st.ep.as_ref() else { return Err(st.fail("rail was aborted".into())) };
        for _ in 0..PROGRESS_BURST {
            match self.worker.progress() {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => return Err(st.fail(format!("ucp_worker_progress: {e}"))),
            }
        }
        if let Some(status) = ep.failure() {
            return Err(st.fail(format!("ucx endpoint failed: {status}")));
        }
        if self.am {
            let replies = std::mem::take(&mut lock(&self.inbox).done);
            st.replied.extend(replies);
        }
        let replied = &mut st.replied;
        let mut progressed = false;
        let mut i = 0;
        while i < st.ops.len() {
            let op = &mut st.ops[i];
            // The flush completes after the puts it follows, remotely; every get or put of the
            // chunk was posted before it.
            let r = (|| -> std::result::Result<bool, multirail_ucx::Error> {
                if op.am && !replied.contains_key(&op.token) {
                    return Ok(false);
                }
                if let Some(f) = op.flush.as_mut() {
                    if !f.check()? {
                        return Ok(false);
                    }
                }
                for r in &mut op.reqs {
                    if !r.check()? {
                        return Ok(false);
                    }
                }
                Ok(true)
            })();
            match r {
                Ok(false) => i += 1,
                Ok(true) => {
                    let op = st.ops.swap_remove(i);
                    progressed = true;
                    // An active message is done as its reply says.
                    let r = if op.am { replied.remove(&op.token).unwrap_or(Ok(())) } else { Ok(()) };
                    done.push((op.token, r));
                }
                Err(e @ multirail_ucx::Error::EndpointFailed { .. }) => return Err(st.fail(e.to_string())),
                Err(e) => {
                    let op = st.ops.swap_remove(i);
                    progressed = true;
                    replied.remove(&op.token);
                    if op.am {
                        lock(&self.inbox).pending.remove(&op.wire);
                    }
                    done.push((op.token, Err(format!("{} failed: {e}", if op.write { "WRITE" } else { "READ" }))));
                }
            }
        }
        let now = Instant::now();
        if progressed {
            st.last_event = now;
            st.completed_any = true;
        }
        if let Some(reason) = self.session_hung_up() {
            return Err(st.fail(reason));
        }
        let n = st.outstanding();
        if n == 0 {
            return Ok(None);
        }
        if now.duration_since(st.last_event) > stall {
            return Err(st.fail(format!("no ucx completion for {stall:?} with {n} chunk(s) outstanding (peer hung or path lost)")));
        }
        Ok(Some(st.last_event))
    }

    /// Whether the target closed the session (it closes it when it tears the session's worker
    /// down: agent closed, session fenced, or a refusal).
    fn session_hung_up(&self) -> Option<String> {
        let mut b = [0u8; 1];
        // SAFETY: peeks at most 1 byte into a live buffer; non-blocking.
        let n = unsafe { libc::recv(self.sock_ctl.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n == 0 {
            return Some("ucx session closed by the target".into());
        }
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => None,
                _ => Some(format!("ucx session: {e}")),
            };
        }
        // Bytes nobody asked for (no rkey fetch holds the socket): the target's Error frame.
        let Ok(mut s) = self.sock.try_lock() else { return None };
        let mut tick = |_: bool| Err::<(), String>("partial frame".into());
        Some(match wire::read_frame(&mut s, &mut tick) {
            Ok((_, Body::Error { status, msg })) => format!("ucx session ended by the target: {status:?}: {msg}"),
            Ok((_, other)) => format!("ucx session: unexpected {:?} from the target", other.kind()),
            Err(e) => format!("ucx session: {e}"),
        })
    }

    #[cfg(test)]
    /// Chunks posted and not yet reported by `progress`.
    pub fn outstanding(&self) -> usize {
        let st = lock(&self.state);
        st.outstanding() + st.lost.len()
    }

    #[cfg(test)]
    /// After a failure and [`UcxRail::abort`]: the tokens of every chunk posted and never
    /// reported (to reissue elsewhere once the session is fenced). Empties the list.
    pub fn take_unfinished(&self) -> Vec<u64> {
        let mut st = lock(&self.state);
        let mut v = std::mem::take(&mut st.lost);
        v.extend(st.ops.iter().map(|o| o.token));
        v
    }

    /// "ucx/tcp", "ucx/rc_mlx5", ... (the transports of the endpoint's lanes, joined by '+');
    /// asked once after the first completion (lanes change during wire-up), "ucx" before.
    pub fn transport_name(&self) -> String {
        let mut st = lock(&self.state);
        if let Some(t) = &st.transport {
            return t.clone();
        }
        let Some(ep) = st.ep.as_ref() else { return "ucx".into() };
        let Ok(t) = ep.transports() else { return "ucx".into() };
        let mut names: Vec<&str> = Vec::new();
        for e in &t.entries {
            if !e.transport.is_empty() && !names.contains(&e.transport.as_str()) {
                names.push(&e.transport);
            }
        }
        if names.is_empty() {
            return "ucx".into();
        }
        let name = format!("ucx/{}", names.join("+"));
        if st.completed_any {
            st.transport = Some(name.clone());
        }
        name
    }

    /// Force-close the endpoint and abort the session socket; when this returns no request of
    /// this rail touches local memory any more (GET destinations may be reissued, PUT sources
    /// reused). Safe to call twice and concurrently with `progress` and `post`. The target's
    /// session worker may still apply PUT data already sent: fence the session ([`UcxRail::id`])
    /// before reissuing WRITEs.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let mut g = lock(&self.state);
        let st = &mut *g;
        st.fail("rail aborted".into());
        if let Some(ep) = st.ep.take() {
            // Cancels what is outstanding; forced closes complete without the peer.
            let _ = ep.close(CloseMode::Force, Instant::now() + self.timeout.max(Duration::from_secs(1)));
            let lost: Vec<u64> = st.ops.drain(..).map(|o| o.token).collect();
            st.lost.extend(lost);
            st.replied.clear();
            // A reply that still arrives finds nothing pending and touches no memory.
            let mut ib = lock(&self.inbox);
            ib.pending.clear();
            ib.done.clear();
            // Closed by the force close: these requests are complete (cancelled) and drop here.
        }
        drop(g);
        abort_socket(&self.sock_ctl);
        self.kick.kick();
    }
}

// Progress runs on one thread per rail while others post and abort.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<UcxRail>();
    send_sync::<UcxAgent>();
};

impl Drop for UcxRail {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_proto::codec::encode_ucx_am_reply;

    /// Issue 33, item 3: a reply is taken only from the session's endpoint, with the session's
    /// secret and the request's random token: a guessed token (the chunk's, which used to be
    /// the request's, counting from 1), a missing secret or another sender change nothing.
    #[test]
    fn forged_replies_are_ignored() {
        let secret = [7u8; 16];
        let inbox = Mutex::new(AmInbox { secret, ..AmInbox::default() });
        let ep = AtomicUsize::new(0x1000);
        let mut dst = vec![0u8; 4];
        let at = dst.as_mut_ptr() as u64;
        let wire = 0x5eed_u64;
        lock(&inbox).pending.insert(wire, AmPending { token: 1, write: false, dst: vec![(at, 4)], total: 4, _mems: Vec::new() });
        let reply = |token, secret: &[u8; 16]| encode_ucx_am_reply(token, Status::Ok, secret);
        on_reply(&inbox, &ep, &reply(1, &secret), AmData::Eager(b"evil"), Some(0x1000));
        on_reply(&inbox, &ep, &reply(wire, &[0; 16]), AmData::Eager(b"evil"), Some(0x1000));
        on_reply(&inbox, &ep, &reply(wire, &secret), AmData::Eager(b"evil"), Some(0x2000));
        on_reply(&inbox, &ep, &reply(wire, &secret), AmData::Eager(b"evil"), None);
        assert_eq!(dst, [0; 4], "a forged reply wrote");
        assert!(lock(&inbox).done.is_empty() && lock(&inbox).pending.contains_key(&wire));
        on_reply(&inbox, &ep, &reply(wire, &secret), AmData::Eager(b"good"), Some(0x1000));
        assert_eq!(&dst, b"good");
        assert_eq!(lock(&inbox).done, vec![(1, Ok(()))]);
    }
}
