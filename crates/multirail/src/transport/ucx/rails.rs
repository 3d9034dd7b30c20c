//! The `ucx` transport: the rails of one link over UCX, one [`UcxRail`] (a worker of its own, one
//! endpoint to a per-session worker on the target) per rail.
//!
//! Per rail one progress thread posts the planner's chunks (one-sided get/put into the peer's
//! region through the rkeys its session announced), progresses the worker and reports
//! completions to the link; a posting caller also posts from its own thread. multirail's planner
//! does the striping (UCX's own multi-rail splitting is off in every rail's context), so
//! weighting, tail balancing and failover are the same as over TCP.
//!
//! Failure: the endpoint's error callback, a failed request, the session socket hanging up, or
//! no completion for `stall_timeout` while chunks are outstanding (UCX over tcp does not report
//! a hung peer) fails the rail. Its thread force-closes the endpoint (after which nothing of
//! the rail touches local memory) and reports the path stopped; a session that carried a PUT is
//! named by `fence_ids`, so the link has the target destroy that session's worker (`Fence`)
//! before any chunk is reissued: a late PUT of the dead rail can no longer land.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status};
use multirail_proto::planner::vec_pieces;
use multirail_proto::Chunk;

use super::{UcxAgent, UcxRail};
use crate::config::Progress;
use crate::error::{Error, Result};
use crate::net::{link_down, LINK_CHECK};
use crate::transport::{Caps, GpuPath, Host, Transport};
use crate::xfer::{Op, XferShared, XferState};

/// Longest an idle progress thread sleeps before it looks at the planner again (it is kicked by
/// posts, by the link's `wake`, and by the worker's events before that).
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// How long a progress wait lasts while chunks are outstanding (the carrier check's period).
const BUSY_WAIT: Duration = Duration::from_millis(20);
/// The stall clock handed to `UcxRail::progress`: off (a day).
const NO_STALL: Duration = Duration::from_secs(86_400);

/// One open rail: the UCX rail and the chunks it carries, by token.
struct Path {
    rail: UcxRail,
    /// The agent (GPUDirect write flushes after READs into local GPU memory).
    agent: Arc<UcxAgent>,
    inflight: Mutex<HashMap<u64, (Chunk, Arc<XferShared>)>>,
    next_token: AtomicU64,
    /// Carried a PUT: its session must be fenced on the target if the rail dies.
    wrote: AtomicBool,
    /// Shut (by the link, a failure, or close): the progress thread stops.
    dead: AtomicBool,
}

#[derive(Default)]
struct Slot {
    path: RwLock<Option<Arc<Path>>>,
    /// A progress thread runs (the rail is up while one does).
    live: AtomicBool,
}

/// The rails of one link over UCX.
pub(crate) struct UcxRails {
    agent: Arc<UcxAgent>,
    rails: Vec<Arc<Slot>>,
}

impl UcxRails {
    pub(crate) fn new(agent: Arc<UcxAgent>, n: usize) -> UcxRails {
        UcxRails { agent, rails: (0..n).map(|_| Arc::new(Slot::default())).collect() }
    }

    fn path(&self, ri: usize) -> Option<Arc<Path>> {
        self.rails[ri].path.read().expect("rail lock").clone()
    }
}

/// A vectored chunk goes as one active message (on a rail that negotiated them) when its
/// pieces average at most this: small pieces are where one UCP put per piece costs a send and
/// an acknowledgement each over tcp; large ones stay zero-copy RMA.
pub(crate) const AM_MAX_AVG_PIECE: u64 = 64 << 10;

/// Whether a chunk of `n` pieces and `bytes` in all goes as one active message.
pub(crate) fn use_am(n: usize, bytes: u64) -> bool {
    n > 1 && bytes <= AM_MAX_AVG_PIECE.saturating_mul(n as u64)
}

/// A refusal of one chunk (before or by UCX, or by the target) that is not a rail failure.
fn refused(msg: &str) -> Status {
    if msg.contains("outside") || msg.contains("too large") {
        Status::OutOfBounds
    } else if msg.contains("exports no region") || msg.contains("exports no such region") {
        Status::UnknownRegion
    } else if msg.contains("read-only") {
        Status::ReadOnly
    } else {
        Status::Internal
    }
}

/// Post the planner's chunks for rail `ri` while the rail has window room, at most `limit`.
fn pump(link: &dyn Host, ri: usize, p: &Path, limit: usize) {
    let window = link.cfg().conn_window * link.cfg().connections.max(1);
    for _ in 0..limit {
        if p.dead.load(Ordering::Acquire) || link.is_shutdown() || p.inflight.lock().expect("path lock").len() >= window {
            return;
        }
        let Some((chunk, x)) = link.next_chunk(ri) else { return };
        let write = x.op == Op::Write;
        if write && !p.wrote.load(Ordering::Relaxed) {
            // Before the first byte: from now on this session's death needs a fence.
            p.wrote.store(true, Ordering::Release);
        }
        if x.local_dev(chunk.piece.local).is_some() {
            // The stream contract (GPUDirect: the NIC reads or writes GPU memory directly).
            if let Err(e) = x.wait_gpu_order() {
                // A device error: the transfer fails with it, nothing is read or written.
                let msg = e.to_string();
                x.set_cause(e);
                link.chunk_done(ri, chunk.id, &x, chunk.piece.len, Err((Status::Internal, msg)));
                continue;
            }
        }
        let token = p.next_token.fetch_add(1, Ordering::Relaxed);
        let piece = chunk.piece;
        // One batch of gets or puts (one piece unless the chunk is vectored) and, for a WRITE,
        // one flush.
        let pieces: Vec<(u64, u64, u64)> = match chunk.vec.as_ref() {
            Some(v) => v.iter().flat_map(|r| r.pieces()).map(|q| (q.local, q.offset, q.len)).collect(),
            None => vec![(piece.local, piece.offset, piece.len)],
        };
        // Many small pieces of host memory on both sides: one active message with the piece
        // table instead. GPU memory (GPUDirect) stays RMA, one get or put per piece: the target
        // copies active messages with its CPU, into and out of host memory only.
        let bytes: u64 = pieces.iter().map(|q| q.2).sum();
        let host_only = x.local_dev(piece.local).is_none() && !x.remote_vram;
        let wire = match chunk.vec.as_ref() {
            Some(runs) if p.rail.am() && host_only && use_am(pieces.len(), bytes) => Some(vec_pieces(runs)),
            _ => None,
        };
        let xid = chunk.xfer.0;
        p.inflight.lock().expect("path lock").insert(token, (chunk, x.clone()));
        if x.gone(xid) {
            // Failed or cancelled meanwhile (`XferShared::give_up`): not sent.
            p.inflight.lock().expect("path lock").remove(&token);
            continue;
        }
        let posted = p.rail.post_v(token, write, piece.region, link.key(piece.region), &pieces, wire.as_deref());
        if let Err(msg) = posted {
            let Some((chunk, x)) = p.inflight.lock().expect("path lock").remove(&token) else { continue };
            if msg.starts_with("rail is down") || msg.starts_with("rail was aborted") {
                // Left in the planner's books for this rail: requeued when the rail stops.
                p.dead.store(true, Ordering::Release);
                p.rail.wake();
                link.rail_failed(ri, msg);
                return;
            }
            link.chunk_done(ri, chunk.id, &x, piece.len, Err((refused(&msg), msg)));
        }
    }
}

/// Report finished chunks (from `UcxRail::progress`) to the link. READ chunks whose gets wrote
/// local GPU memory (GPUDirect) are made visible to their device first (`read_visible`): one
/// flush per device for the whole batch, before any of them counts as done.
fn report(link: &dyn Host, ri: usize, p: &Path, done: &mut Vec<(u64, std::result::Result<(), String>)>) {
    let finished: Vec<(Chunk, Arc<XferShared>, std::result::Result<(), String>)> = {
        let mut inflight = p.inflight.lock().expect("path lock");
        done.drain(..).filter_map(|(token, r)| inflight.remove(&token).map(|(chunk, x)| (chunk, x, r))).collect()
    };
    let mut flushed: Vec<(u32, std::result::Result<(), String>)> = Vec::new();
    for (chunk, x, r) in finished {
        let r = match (r, written_dev(&chunk, &x)) {
            (Ok(()), Some(dev)) => {
                let f = match flushed.iter().find(|f| f.0 == dev) {
                    Some(f) => f.1.clone(),
                    None => {
                        let f = read_visible(p, dev);
                        flushed.push((dev, f.clone()));
                        f
                    }
                };
                // The device's error, not the peer's: the caller sees the GPU flush fail.
                f.map_err(|m| {
                    x.set_cause(Error::Gpu(m.clone()));
                    (Status::Internal, m)
                })
            }
            (r, _) => r.map_err(|m| (refused(&m), m)),
        };
        link.chunk_done(ri, chunk.id, &x, chunk.piece.len, r);
    }
}

/// The local GPU a READ chunk's gets wrote (GPUDirect), if any.
fn written_dev(chunk: &Chunk, x: &XferShared) -> Option<u32> {
    x.local_dev(chunk.piece.local).filter(|_| x.op == Op::Read)
}

/// READ chunks whose gets wrote local GPU memory of `dev` (GPUDirect): the NIC's writes are
/// made visible to the device (`cuFlushGPUDirectRDMAWrites` where it does not order them,
/// `crate::gdr`) before the chunks count as done, since the application reads the pages once
/// the transfer completed. A failed flush fails the chunks: their bytes may not be visible.
fn read_visible(p: &Path, dev: u32) -> std::result::Result<(), String> {
    p.agent.flush_gdr_reads(dev).map(|_| ()).map_err(|e| format!("READ into GPU {dev}: GPUDirect write flush failed: {e}"))
}

/// The progress thread of one rail.
fn run(link: Arc<dyn Host>, ri: usize, slot: Arc<Slot>, p: Arc<Path>) {
    // Stalls are the planner's to decide (the link's watchdog): UCX's own clock stays out.
    let stall = NO_STALL;
    let reason = match link.enter() {
        Some(_active) => {
            let mut done = Vec::new();
            let dev = link.local_dev(ri).map(str::to_string);
            let (mut last_done, mut last_check) = (Instant::now(), Instant::now());
            let reason = loop {
                if link.is_shutdown() {
                    break None;
                }
                if p.dead.load(Ordering::Acquire) {
                    break Some("rail shut".to_string());
                }
                pump(&*link, ri, &p, usize::MAX);
                let wait = if p.inflight.lock().expect("path lock").is_empty() { IDLE_WAIT } else { BUSY_WAIT };
                if let Err(e) = p.rail.progress(&mut done, wait, stall) {
                    break Some(e);
                }
                let now = Instant::now();
                if !done.is_empty() || p.inflight.lock().expect("path lock").is_empty() {
                    last_done = now;
                } else if now - last_done > LINK_CHECK && now - last_check > LINK_CHECK {
                    // A local link that lost carrier is dead now; no need to wait for the stall.
                    last_check = now;
                    if let Some(why) = dev.as_deref().and_then(link_down) {
                        break Some(why);
                    }
                }
                report(&*link, ri, &p, &mut done);
            };
            // When this returns nothing of the rail touches local memory any more: its chunks
            // may be reissued (after the fence) and the application may free the memory. The
            // path then holds none of them (`holds`).
            p.rail.abort();
            p.inflight.lock().expect("path lock").clear();
            reason
        }
        None => {
            p.rail.abort();
            None
        }
    };
    p.dead.store(true, Ordering::Release);
    if let Some(reason) = reason {
        if !link.is_shutdown() {
            link.rail_failed(ri, reason);
        }
    }
    link.path_stopped(ri, &mut || slot.live.swap(false, Ordering::AcqRel));
}

impl Transport for UcxRails {
    fn caps(&self) -> Caps {
        // One-sided when the lanes are RDMA ones (UCX's tcp and shm lanes emulate RMA with the
        // target's thread). GPU memory goes directly only with GPUDirect RDMA on every rail
        // (`UcxAgent::gpu_direct`).
        let rdma = |t: &str| ["rc", "dc", "ud", "ib"].iter().any(|p| t.split(['/', '+']).any(|l| l.starts_with(p)));
        let one_sided = (0..self.rails.len()).any(|ri| self.is_up(ri) && rdma(&self.describe(ri)));
        // Without GPUDirect, GPU memory goes over the same rails staged, through a tcp link the
        // peer opens for it (`Peer::gpu_link`).
        // (Tests: the stand-in's memory over UCX's tcp, `ucx::with_standin_gpudirect`.)
        let direct = (one_sided || self.agent.standin_direct()) && self.agent.gpu_direct().is_ok();
        Caps { remote_vram: direct, one_sided, gpu: if direct { GpuPath::Direct } else { GpuPath::Staged } }
    }

    fn open_rail(&self, link: &Arc<dyn Host>, ri: usize, timeout: Duration) -> Result<()> {
        let (local_index, remote_index) = link.rail_indices(ri);
        let d = link.dial_hello(ri, Role::UcxSession, timeout)?;
        let remote_rail = u16::try_from(remote_index).map_err(|_| Error::Metadata(format!("rail index {remote_index} too large")))?;
        let rail = UcxRail::open(&self.agent, local_index, remote_rail, d.stream, d.id, d.version, d.session_key, timeout)?;
        // One-sided: the target parses nothing, so any peer takes batched gets and puts, into
        // its GPU memory too (GPUDirect: `pump` sends those as RMA, never as an active message).
        link.set_vectored(ri, link.cfg().vectored);
        link.set_vectored_gpu(ri, link.cfg().vectored);
        link.set_byte_progress(ri, false); // no progress evidence below a completion
        let p = Arc::new(Path {
            rail,
            agent: self.agent.clone(),
            inflight: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            wrote: AtomicBool::new(false),
            dead: AtomicBool::new(false),
        });
        let slot = self.rails[ri].clone();
        *slot.path.write().expect("rail lock") = Some(p.clone());
        slot.live.store(true, Ordering::Release);
        let l = link.clone();
        let s2 = slot.clone();
        let cpus = link.rail_cpus(ri);
        let spawned = std::thread::Builder::new().name(format!("mr-ucx-{ri}")).spawn(move || {
            crate::numa::pin_current_thread(&cpus);
            run(l, ri, s2, p)
        });
        if let Err(e) = spawned {
            slot.live.store(false, Ordering::Release);
            return Err(Error::io("spawn", e));
        }
        Ok(())
    }

    fn is_up(&self, ri: usize) -> bool {
        self.rails[ri].live.load(Ordering::Acquire)
    }

    fn post_ready(&self, link: &dyn Host, _will_drive: bool) -> bool {
        for ri in 0..self.rails.len() {
            // Only an idle rail is started from the caller's thread: a busy one's progress
            // thread posts as completions make room, so a post does not issue a window of
            // gets or puts (a vectored chunk is one per page) on the caller's time.
            if let Some(p) = self.path(ri).filter(|p| self.is_up(ri) && p.inflight.lock().expect("path lock").is_empty()) {
                // One chunk: its post kicks the progress thread, which posts the rest.
                pump(link, ri, &p, 1);
            }
        }
        // Each rail's progress thread posts the rest as completions make room.
        false
    }

    fn drive(&self, link: &dyn Host, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        // Caller-driven completion: the waiting thread progresses the rails that hold its chunks
        // itself (a polled worker answers in microseconds; a wake-up of the progress thread costs
        // tens on a busy host), for as long as the progress mode allows, then leaves the rest to
        // the progress threads.
        let cfg = link.cfg();
        let budget = match (poll_only, cfg.progress) {
            (true, _) => Duration::ZERO,
            (false, Progress::Block) => return false,
            (false, Progress::Adaptive) => cfg.spin,
            (false, Progress::Poll) => deadline.map_or(Duration::from_secs(3600), |d| d.saturating_duration_since(Instant::now())),
        };
        let end = Instant::now() + budget;
        let mine = |p: &Path| p.inflight.lock().expect("path lock").values().any(|(_, y)| std::ptr::eq(Arc::as_ptr(y), x));
        let mut done = Vec::new();
        loop {
            for ri in 0..self.rails.len() {
                let Some(p) = self.path(ri).filter(|p| !p.dead.load(Ordering::Acquire) && mine(p)) else { continue };
                if p.rail.progress(&mut done, Duration::ZERO, NO_STALL).is_err() {
                    // The rail's own thread sees the (sticky) failure and runs the rail-down path.
                    p.rail.wake();
                    return false;
                }
                report(link, ri, &p, &mut done);
            }
            if x.state() != XferState::InProgress {
                return true;
            }
            if Instant::now() >= end || deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    fn holds(&self, x: &Arc<XferShared>) -> bool {
        (0..self.rails.len()).any(|ri| self.holds_on(ri, x))
    }

    fn holds_on(&self, ri: usize, x: &Arc<XferShared>) -> bool {
        self.path(ri).is_some_and(|p| p.inflight.lock().expect("path lock").values().any(|(_, y)| Arc::ptr_eq(x, y)))
    }

    fn shut_rail(&self, ri: usize) {
        if let Some(p) = self.path(ri) {
            p.dead.store(true, Ordering::Release);
            p.rail.wake();
        }
    }

    fn fence_ids(&self, ri: usize) -> Vec<[u8; 16]> {
        self.path(ri).filter(|p| p.wrote.load(Ordering::Acquire)).map(|p| vec![p.rail.id()]).unwrap_or_default()
    }

    fn paths(&self, ri: usize) -> usize {
        usize::from(self.is_up(ri))
    }

    fn gpu_detail(&self) -> Option<String> {
        self.agent.gpu_direct().err().map(str::to_string)
    }

    fn describe(&self, ri: usize) -> String {
        self.path(ri).map(|p| p.rail.transport_name()).unwrap_or_else(|| "ucx".into())
    }

    fn wake(&self) {
        for ri in 0..self.rails.len() {
            if let Some(p) = self.path(ri) {
                p.rail.wake();
            }
        }
    }

    fn close(&self) {
        for ri in 0..self.rails.len() {
            self.shut_rail(ri);
        }
    }
}
