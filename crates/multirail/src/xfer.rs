//! Transfer handles.
//!
//! A handle is created once (descriptors resolved and paired, local regions pinned against
//! deregistration) and may be posted many times; each post gets a fresh planner `XferId`.
//! State is an atomic the caller can poll cheaply; `wait` sleeps on a condvar.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use multirail_proto::planner::Run;
use multirail_proto::Pair;

use crate::config::Progress;
use crate::error::{Error, Result};
use crate::registry::Region;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    pub fn parse(s: &str) -> Result<Op> {
        match s.to_ascii_uppercase().as_str() {
            "READ" => Ok(Op::Read),
            "WRITE" => Ok(Op::Write),
            other => Err(Error::InvalidArgument(format!("unknown operation {other:?}: expected \"READ\" or \"WRITE\""))),
        }
    }
}

/// A descriptor row as `prepare` reads it: (address, length, device); the device is not used.
/// `[u64; 3]` is a row of an Nx3 uint64 array read in place.
pub trait Desc: Copy + Sync {
    /// (address, length).
    fn span(&self) -> (u64, u64);
}

impl Desc for (u64, u64, u32) {
    #[inline]
    fn span(&self) -> (u64, u64) {
        (self.0, self.1)
    }
}

impl Desc for [u64; 3] {
    #[inline]
    fn span(&self) -> (u64, u64) {
        (self[0], self[1])
    }
}

/// Transfer state. `Idle` is a handle never posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum XferState {
    Idle = 0,
    InProgress = 1,
    Done = 2,
    Error = 3,
}

impl XferState {
    fn from_u8(v: u8) -> XferState {
        match v {
            1 => XferState::InProgress,
            2 => XferState::Done,
            3 => XferState::Error,
            _ => XferState::Idle,
        }
    }
}

/// What a transfer needs from the peer it goes to (implemented by `Peer`): the transfer types
/// sit below the peer, the link and the transports, and name none of them.
pub(crate) trait Poster: Send + Sync {
    fn name(&self) -> &str;
    /// Post `x` (on a link, or by CUDA IPC). `will_drive`: the caller waits for it next.
    fn submit(&self, x: Arc<XferShared>, will_drive: bool) -> Result<()>;
    /// Let the waiting caller complete `x` itself (`Link::drive`); false when it cannot.
    fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool;
    /// Abort `x`; returns once no path holds a chunk of it.
    fn cancel(&self, x: &Arc<XferShared>);
    /// The agent's progress mode and spin budget (for waiting callers).
    fn progress(&self) -> (Progress, Duration);
    /// A post ended (DONE, or in ERROR): the peer's counters.
    fn count(&self, ok: bool);
    /// Send `x`'s notification to the peer, then complete `x` with its result (a transfer by
    /// CUDA IPC whose copies are done): through the link's notifier, which batches them.
    fn notify_then_finish(&self, x: Arc<XferShared>);
    /// The device kind local GPU memory is (the agent's `gpu` setting): the stream contract's
    /// events are made on it.
    fn gpu_kind(&self) -> multirail_gpu::GpuKind;
    /// Posts to this peer handed to the GPU-order waiter and not yet submitted by it. While any
    /// are, later posts to the peer queue behind them there too, even when their own stream
    /// work is done: a post never overtakes an earlier one to the same peer (CUDA IPC
    /// transfers complete, and notify, in posting order). Other peers' posts are not held.
    fn order_waiting(&self) -> &std::sync::atomic::AtomicUsize;
}

/// What each rail did for the last post of a transfer over a link ([`XferHandle::trace`]): of a
/// slow transfer, it says whether one rail finished late (its share or its rate estimate was
/// off, or its completions reached the planner late) or every rail did (the host was slow, or a
/// rail idled mid-transfer and the others took its share). Times are since the post.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct XferTrace {
    /// From the post to the planner's last completion (before any notification); None while the
    /// transfer runs, or when it failed.
    pub total: Option<Duration>,
    /// One per rail of the link, by rail index.
    pub rails: Vec<RailTrace>,
}

/// One rail's part in one post (see [`XferTrace`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RailTrace {
    /// Bytes and chunks that completed on the rail (reissued chunks where they landed).
    pub bytes: u64,
    pub chunks: u64,
    /// When the rail was handed its first chunk of the post, and when its last one completed.
    pub first_issue: Option<Duration>,
    pub last_done: Option<Duration>,
    /// The planner's rate estimate for the rail in bytes/s, at the post and at the end.
    pub rate_at_post: f64,
    pub rate_at_end: f64,
}

/// A post's trace as the link records it (under its scheduler lock).
#[derive(Debug, Default)]
pub(crate) struct TraceRec {
    pub posted: Option<Instant>,
    pub trace: XferTrace,
}

impl TraceRec {
    /// A new post at `now` over rails whose rate estimates are `rates`; reuses the allocation.
    pub(crate) fn start(&mut self, now: Instant, rates: impl Iterator<Item = f64>) {
        self.posted = Some(now);
        self.trace.total = None;
        self.trace.rails.clear();
        self.trace.rails.extend(rates.map(|r| RailTrace { rate_at_post: r, ..RailTrace::default() }));
    }

    fn since(&self, now: Instant) -> Option<Duration> {
        self.posted.map(|p| now.saturating_duration_since(p))
    }

    /// Rail `ri` was handed a chunk at `now`.
    pub(crate) fn issued(&mut self, ri: usize, now: Instant) {
        let at = self.since(now);
        if let Some(r) = self.trace.rails.get_mut(ri) {
            r.first_issue = r.first_issue.or(at);
        }
    }

    /// A chunk of `len` bytes completed on rail `ri` at `now`.
    pub(crate) fn landed(&mut self, ri: usize, len: u64, now: Instant) {
        let at = self.since(now);
        if let Some(r) = self.trace.rails.get_mut(ri) {
            r.bytes += len;
            r.chunks += 1;
            r.last_done = at;
        }
    }

    /// The planner's last completion, at `now`, with the rails' rate estimates then.
    pub(crate) fn done(&mut self, now: Instant, rates: impl Iterator<Item = f64>) {
        self.trace.total = self.since(now);
        for (r, rate) in self.trace.rails.iter_mut().zip(rates) {
            r.rate_at_end = rate;
        }
    }
}

/// A CUDA IPC mapping's key: (remote region id, the local device it is opened on; None for host
/// memory). Defined here, below `ipc`, so that `IpcPlan` names it without `xfer` importing `ipc`
/// (tests/layers.rs forbids the cycle).
pub(crate) type MapKey = (u64, Option<i32>);

/// What a prepared IPC transfer does when posted: copies on the mapping's device.
pub(crate) struct IpcPlan {
    /// Per local device, the copies that run there: (kind, dst, src, len), pieces that continue
    /// one another on both sides merged.
    pub parts: Vec<(multirail_gpu::Gpu, Vec<multirail_gpu::BatchCopy>)>,
    /// (mapping key, mapping generation) of every mapping the copies use (`ipc` checks
    /// them under its copy lock: a revoked mapping is never copied into).
    pub uses: Vec<(MapKey, u64)>,
}

pub(crate) struct XferShared {
    pub op: Op,
    /// The peer it goes to (`Peer`), which posts it on a link.
    pub peer: Arc<dyn Poster>,
    /// The transfer's pieces as runs (a pair is a run of one piece; a strided list stays one
    /// run), shared with every post: reposting copies nothing per piece.
    pub runs: Arc<[Run]>,
    /// Pieces counted out (`num_pieces`).
    pieces: u64,
    pub total: u64,
    /// Host memory on both sides: chunks may be vectored (many pieces per request) on rails
    /// whose transport and peer take them. GPU memory goes one piece per chunk (staged or
    /// IPC paths).
    vectored: AtomicBool,
    /// The notification sent once the data landed: None for none; `Some` of an empty message
    /// is an empty notification (NIXL delivers those).
    pub notif: Mutex<Option<Vec<u8>>>,
    /// Local regions this transfer touches; held so they cannot be deregistered under it.
    /// Emptied by `release`, after which the handle can no longer be posted.
    hold: Mutex<Vec<Arc<Region>>>,
    state: AtomicU8,
    error: Mutex<Option<Error>>,
    lock: Mutex<()>,
    cv: Condvar,
    /// Threads asleep in `wait`; `finish` skips the futex wake when there are none.
    sleepers: AtomicU64,
    /// Planner id of the current post (0 when none).
    pub current: AtomicU64,
    /// Planner id of a post the link gave up on (failed or cancelled; 0: none). See `gone`.
    given_up: AtomicU64,
    /// Local GPU regions among `hold`: (base, end, device). Their chunks are staged.
    vram: Vec<(u64, u64, u32)>,
    /// Set when the transfer goes by CUDA IPC (same host, remote GPU memory): device copies
    /// instead of the rails (crate::ipc).
    pub(crate) ipc: Option<IpcPlan>,
    /// Carried by the peer's tcp link for GPU memory (`Peer::gpu_link`), not its main link.
    via_gpu_link: AtomicBool,
    /// A GPU transfer prepared before its peer was connected (background mode): the link
    /// (`via_gpu_link`) and vectoring are settled at its first post over a live link
    /// (`Peer::settle`); it never goes by CUDA IPC.
    unsettled: AtomicBool,
    /// Some run targets the peer's GPU memory: over ucx (GPUDirect) a vectored chunk of it goes
    /// as a batch of gets or puts, never as one active message (the target applies those to
    /// host memory only).
    pub(crate) remote_vram: bool,
    /// The stream contract (docs/gpu.md): events recorded at post on the application's stream,
    /// one per local GPU device, that every engine access to local GPU memory waits for.
    gpu_order: Mutex<GpuOrder>,
    /// Held by the GPU-order waiter while it hands a post to the link, and by `release`:
    /// a transfer released while its post waits for the application's stream (or for a
    /// connection: `peer::connect`) never starts.
    pub(crate) post_gate: Mutex<()>,
    /// Posted by [`XferHandle::post_polled`]: its caller polls it to completion with
    /// [`XferHandle::progress`], so a poll that leaves its connection with responses still due
    /// does not wake the receiver for them (the next poll reads them; a receiver parked for
    /// callers looks again within `transport::tcp::POLL_PARK` should the polls stop).
    pub(crate) polled: std::sync::atomic::AtomicBool,
    /// A post without a stream orders after each local GPU's legacy default stream (the native
    /// API's contract); cleared by [`XferHandle::set_default_stream_order`] for callers whose
    /// contract has no stream (NIXL: the application makes its data ready before it posts).
    default_stream_order: std::sync::atomic::AtomicBool,
    /// Posted by [`XferHandle::post_handoff`]: the link's own threads send every chunk; the
    /// posting thread only queues the transfer and wakes them.
    pub(crate) handoff: std::sync::atomic::AtomicBool,
    /// What each rail did for the current (or last) post over a link; see [`XferTrace`].
    pub(crate) trace: Mutex<TraceRec>,
    /// Where its local memory is, distinct, in the order met ([`XferShared::locs`]).
    locs: std::sync::OnceLock<Vec<crate::numa::Loc>>,
    /// The peer's count of region removals its remote regions were last checked against (at
    /// prepare, then at each post after a removal: `Peer::submit`).
    pub(crate) remote_gen: AtomicU64,
    /// The peer's regions as they were at prepare (the offsets of `runs` are from them): a
    /// post after a removal checks each region it names is still the same (`Peer::submit`).
    pub(crate) remote_regions: std::sync::OnceLock<Arc<Vec<multirail_proto::RegionMeta>>>,
}

/// Events of [`XferShared::gpu_order`]: made on the first post that needs them, then reused.
#[derive(Default)]
struct GpuOrder {
    events: Vec<(u32, multirail_gpu::Gpu, multirail_gpu::GpuEvent)>,
    /// Recorded by the current post and not yet waited for.
    pending: bool,
    /// Events recorded by a post: no GPU work waited for them yet.
    posts: u64,
    /// Why the current post's order could not be established (a failed query or wait): the
    /// transfer fails with it, it is never taken for "ready".
    error: Option<Error>,
}

/// Whether a transfer's chunks may be vectored (many pieces per request): its local pieces are
/// all host memory, or all GPU memory of one device (`vram`: the local GPU regions held, of
/// `held` regions in all; staged through the pinned buffers), and a transfer into the peer's GPU
/// memory needs a peer that takes vectored requests there (`vectored_gpu`).
fn chunks_vectored(vram: &[(u64, u64, u32)], held: usize, remote_vram: bool, vectored_gpu: bool) -> bool {
    let one_local_memory = vram.is_empty() || (vram.len() == held && vram.iter().all(|v| v.2 == vram[0].2));
    one_local_memory && (!remote_vram || vectored_gpu)
}

impl XferShared {
    /// Where the transfer's local memory is (rail choice, `Link`'s tiers): a GPU region on
    /// its device; a host region on the NUMA node of its first page when that page is resident,
    /// else on the node of the thread that first asks (docs/topology.md, "The engine").
    /// Worked out at the first post over a link with tiers, then kept.
    pub(crate) fn locs(&self) -> &[crate::numa::Loc] {
        self.locs.get_or_init(|| {
            use crate::numa::{host_node, Loc};
            let hold = self.hold.lock().expect("xfer lock");
            let mut out: Vec<Loc> = Vec::new();
            for r in hold.iter() {
                let l = match r.mem {
                    multirail_proto::MemType::Vram => Some(Loc::Gpu(r.dev)),
                    _ => host_node(r.base).filter(|n| *n >= 0).map(Loc::Numa),
                };
                if let Some(l) = l.filter(|l| !out.contains(l)) {
                    out.push(l);
                }
            }
            out
        })
    }

    pub fn new(
        op: Op,
        peer: Arc<dyn Poster>,
        pairs: Vec<Pair>,
        notif: Vec<u8>,
        hold: Vec<Arc<Region>>,
        ipc: Option<IpcPlan>,
        via_gpu_link: bool,
    ) -> Arc<XferShared> {
        let runs: Vec<Run> = pairs.into_iter().map(Run::from).collect();
        Self::with_runs(op, peer, runs, notif, hold, ipc, via_gpu_link, false, false)
    }

    /// As `new`, from runs (strided descriptors kept compressed). `remote_vram`: some run
    /// targets GPU memory of the peer; `vectored_gpu`: the peer takes vectored requests on
    /// its GPU regions (else such a transfer's chunks are not vectored).
    #[allow(clippy::too_many_arguments)]
    pub fn with_runs(
        op: Op,
        peer: Arc<dyn Poster>,
        runs: Vec<Run>,
        notif: Vec<u8>,
        hold: Vec<Arc<Region>>,
        ipc: Option<IpcPlan>,
        via_gpu_link: bool,
        remote_vram: bool,
        vectored_gpu: bool,
    ) -> Arc<XferShared> {
        let total = runs.iter().map(|r| r.bytes()).sum();
        let pieces = runs.iter().map(|r| r.count).sum();
        let vram: Vec<(u64, u64, u32)> =
            hold.iter().filter(|r| r.mem == multirail_proto::MemType::Vram).map(|r| (r.base, r.base + r.len, r.dev)).collect();
        // A GPU transfer of a ucx agent without GPUDirect goes over its tcp link for GPU memory
        // (`via_gpu_link`), whose rails negotiate vectored requests as any tcp link's do.
        let vectored = chunks_vectored(&vram, hold.len(), remote_vram, vectored_gpu) && ipc.is_none();
        Arc::new(XferShared {
            vram,
            ipc,
            via_gpu_link: AtomicBool::new(via_gpu_link),
            unsettled: AtomicBool::new(false),
            remote_vram,
            op,
            peer,
            runs: runs.into(),
            pieces,
            total,
            vectored: AtomicBool::new(vectored),
            notif: Mutex::new((!notif.is_empty()).then_some(notif)),
            hold: Mutex::new(hold),
            state: AtomicU8::new(XferState::Idle as u8),
            error: Mutex::new(None),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            sleepers: AtomicU64::new(0),
            current: AtomicU64::new(0),
            given_up: AtomicU64::new(0),
            gpu_order: Mutex::new(GpuOrder::default()),
            post_gate: Mutex::new(()),
            polled: std::sync::atomic::AtomicBool::new(false),
            default_stream_order: std::sync::atomic::AtomicBool::new(true),
            handoff: std::sync::atomic::AtomicBool::new(false),
            trace: Mutex::new(TraceRec::default()),
            locs: std::sync::OnceLock::new(),
            remote_gen: AtomicU64::new(0),
            remote_regions: std::sync::OnceLock::new(),
        })
    }

    /// Carried by the peer's tcp link for GPU memory (`Peer::gpu_link`), not its main link.
    pub(crate) fn via_gpu_link(&self) -> bool {
        self.via_gpu_link.load(Ordering::Acquire)
    }

    /// Chunks may be vectored (see the field).
    pub fn vectored(&self) -> bool {
        self.vectored.load(Ordering::Acquire)
    }

    /// Prepared before its peer was connected: settle it before it is posted on a link.
    pub(crate) fn unsettled(&self) -> bool {
        self.unsettled.load(Ordering::Acquire)
    }

    pub(crate) fn mark_unsettled(&self) {
        self.unsettled.store(true, Ordering::Release);
    }

    /// Settle what the link decides (`Peer::settle`): which link carries it, and whether the
    /// peer takes vectored requests on its GPU regions.
    pub(crate) fn settle(&self, via_gpu_link: bool, vectored_gpu: bool) {
        let held = self.hold.lock().expect("xfer lock").len();
        self.via_gpu_link.store(via_gpu_link, Ordering::Release);
        self.vectored.store(chunks_vectored(&self.vram, held, self.remote_vram, vectored_gpu), Ordering::Release);
        self.unsettled.store(false, Ordering::Release);
    }

    /// The link gave up on post `xfer` (it failed or was cancelled): a chunk of it that a
    /// transport took from the planner before, and records in a path only now, is not sent.
    /// A transport records the chunk first, then asks `gone`; the link calls this, then waits
    /// until no path holds a chunk (`Transport::holds`). With the fences on both sides either
    /// the transport sees this or the link sees the chunk.
    pub(crate) fn give_up(&self, xfer: u64) {
        self.given_up.store(xfer, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether the link gave up on post `xfer` (see `give_up`): its chunk, just recorded in a
    /// path, must be taken out again and not sent.
    pub(crate) fn gone(&self, xfer: u64) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.given_up.load(Ordering::SeqCst) == xfer
    }

    /// Whether the application's work recorded at post has completed (no wait).
    pub fn gpu_order_ready(&self) -> bool {
        use multirail_gpu::Device;
        let mut o = self.gpu_order.lock().expect("xfer lock");
        if !o.pending {
            return true;
        }
        if o.error.is_some() {
            return false;
        }
        // An error is not "ready": it stays pending, with the error kept, and `wait_gpu_order`
        // (on the waiter thread) fails the transfer with it.
        let mut all = true;
        for (d, gpu, ev) in &o.events {
            match gpu.query(ev) {
                Ok(true) => {}
                Ok(false) => all = false,
                Err(e) => {
                    o.error = Some(Error::Gpu(format!("cannot tell whether the application's stream on GPU {d} is done: {e}")));
                    return false;
                }
            }
        }
        if all {
            o.pending = false;
        }
        !o.pending
    }

    /// Orders this post after the work queued on the application's `stream` (a raw
    /// `cudaStream_t`; None: the legacy default stream of each local GPU) by recording an event
    /// there per local GPU device. Called on the caller's thread at post; costs one
    /// `cudaEventRecord` per device, and nothing for host-only transfers.
    pub fn record_gpu_order(&self, kind: multirail_gpu::GpuKind, stream: Option<u64>) -> Result<()> {
        use multirail_gpu::Device;
        if self.vram.is_empty() {
            return Ok(());
        }
        let mut devs: Vec<u32> = self.vram.iter().map(|v| v.2).collect();
        devs.sort_unstable();
        devs.dedup();
        if let Some(s) = stream.filter(|s| *s != 0) {
            for &d in &devs {
                let id = i32::try_from(d).map_err(|_| Error::Gpu(format!("device id {d} out of range")))?;
                let gpu = multirail_gpu::Gpu::open(kind, id).map_err(|e| Error::Gpu(format!("GPU {d}: {e}")))?;
                if gpu.stream_is_capturing(s).map_err(|e| Error::Gpu(format!("GPU {d}: stream {s:#x}: {e}")))? {
                    return Err(Error::InvalidArgument(format!(
                        "stream {s:#x} is being captured into a CUDA graph: a transfer cannot be ordered after work that has not been launched; post it after the capture ends, or with another stream"
                    )));
                }
            }
        }
        if stream.is_some_and(|s| s != 0) && devs.len() > 1 {
            return Err(Error::InvalidArgument(format!(
                "a stream belongs to one GPU, but this transfer's local memory is on GPUs {devs:?}: post it without stream=                  (each GPU's default stream) or split it per GPU"
            )));
        }
        let mut o = self.gpu_order.lock().expect("xfer lock");
        for d in devs {
            if !o.events.iter().any(|e| e.0 == d) {
                let id = i32::try_from(d).map_err(|_| Error::Gpu(format!("device id {d} out of range")))?;
                let gpu = multirail_gpu::Gpu::open(kind, id).map_err(|e| Error::Gpu(format!("GPU {d}: {e}")))?;
                let ev = gpu.create_event().map_err(|e| Error::Gpu(format!("GPU {d}: {e}")))?;
                o.events.push((d, gpu, ev));
            }
            let (_, gpu, ev) = o.events.iter().find(|e| e.0 == d).expect("made above");
            gpu.record_external(ev, stream.unwrap_or(0))
                .map_err(|e| Error::Gpu(format!("cannot order the transfer after stream {:#x} on GPU {d}: {e}", stream.unwrap_or(0))))?;
        }
        o.pending = true;
        o.error = None;
        o.posts += 1;
        Ok(())
    }

    /// Blocks (an engine thread) until the application's work recorded by
    /// [`XferShared::record_gpu_order`] has completed; free once it has. Every path that reads or
    /// writes local GPU memory calls it first: the staged tcp path, CUDA IPC, GPUDirect.
    pub fn wait_gpu_order(&self) -> Result<()> {
        use multirail_gpu::Device;
        let mut o = self.gpu_order.lock().expect("xfer lock");
        if !o.pending {
            return Ok(());
        }
        if let Some(e) = &o.error {
            return Err(e.clone());
        }
        let mut failed = None;
        for (d, gpu, ev) in &o.events {
            if let Err(e) = gpu.synchronize(ev) {
                failed = Some(Error::Gpu(format!("waiting for the application's stream on GPU {d}: {e}")));
                break;
            }
        }
        if let Some(e) = failed {
            // Kept: every later chunk of this post fails with it too (none is sent unordered).
            o.error = Some(e.clone());
            return Err(e);
        }
        o.pending = false;
        Ok(())
    }

    /// Whether this transfer touches local GPU memory.
    pub fn has_local_vram(&self) -> bool {
        !self.vram.is_empty()
    }

    /// The GPU whose memory holds the local address `addr`, if it is GPU memory (a chunk lies
    /// inside one region, so its start decides).
    #[inline]
    pub fn local_dev(&self, addr: u64) -> Option<u32> {
        if self.vram.is_empty() {
            return None;
        }
        self.vram.iter().find(|&&(b, e, _)| b <= addr && addr < e).map(|&(_, _, d)| d)
    }

    pub fn state(&self) -> XferState {
        XferState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Move to InProgress; refuses a handle that is already in flight.
    pub fn begin(&self) -> Result<()> {
        let _g = self.lock.lock().expect("xfer lock");
        if self.state() == XferState::InProgress {
            return Err(Error::InvalidArgument("transfer is still in progress; wait for it before posting again".into()));
        }
        let hold = self.hold.lock().expect("xfer lock");
        if hold.is_empty() && self.total > 0 {
            return Err(Error::InvalidArgument("transfer handle was released".into()));
        }
        if let Some(r) = hold.iter().find(|r| r.withdrawn()) {
            return Err(Error::InvalidArgument(format!(
                "local region {} ({:#x} + {}) was deregistered while this handle held it: prepare the transfer again",
                r.id, r.base, r.len
            )));
        }
        drop(hold);
        *self.error.lock().expect("xfer lock") = None;
        self.state.store(XferState::InProgress as u8, Ordering::Release);
        Ok(())
    }

    pub fn finish(&self, result: Result<()>) {
        let _g = self.lock.lock().expect("xfer lock");
        if self.state() != XferState::InProgress {
            return;
        }
        self.peer.count(result.is_ok());
        match result {
            Ok(()) => self.state.store(XferState::Done as u8, Ordering::Release),
            Err(e) => {
                let mut slot = self.error.lock().expect("xfer lock");
                if slot.is_none() {
                    *slot = Some(e);
                }
                self.state.store(XferState::Error as u8, Ordering::Release);
            }
        }
        if self.sleepers.load(Ordering::Acquire) > 0 {
            self.cv.notify_all();
        }
    }

    /// Record the cause before the planner fails the transfer, so the caller sees the specific
    /// error (e.g. the peer's "read-only") rather than a generic failure.
    pub fn set_cause(&self, e: Error) {
        let mut slot = self.error.lock().expect("xfer lock");
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    pub fn error(&self) -> Option<Error> {
        self.error.lock().expect("xfer lock").clone()
    }

    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // Read our own responses when no receiver thread is busy with the connection: the
        // completion then costs no thread handoff (see `Link::drive`).
        if self.state() == XferState::InProgress {
            self.peer.drive(self, deadline, false);
        }
        // Otherwise spin before sleeping: small transfers complete in tens of microseconds, and a
        // condvar sleep would add a wakeup to their latency. How long follows the progress
        // mode: 50 µs when blocking, the spin budget when adaptive, up to the deadline when
        // polling.
        let (mode, spin) = self.peer.progress();
        let spin = match mode {
            Progress::Block => Duration::from_micros(50),
            Progress::Adaptive => spin.max(Duration::from_micros(50)),
            Progress::Poll => deadline.map_or(Duration::from_secs(3600), |d| d.saturating_duration_since(Instant::now())),
        };
        let spin_until = Instant::now() + spin;
        while self.state() == XferState::InProgress && Instant::now() < spin_until {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
        let mut g = self.lock.lock().expect("xfer lock");
        loop {
            match self.state() {
                XferState::Done => return Ok(()),
                XferState::Error => {
                    return Err(self
                        .error()
                        .unwrap_or_else(|| Error::Protocol { who: "engine".into(), msg: "failed without a cause".into() }))
                }
                XferState::Idle => return Err(Error::InvalidArgument("transfer was never posted".into())),
                XferState::InProgress => {}
            }
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout(format!("transfer not done within {:?}", timeout.unwrap_or_default())));
                    }
                    (d - now).min(Duration::from_millis(100))
                }
                None => Duration::from_millis(100),
            };
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            g = self.cv.wait_timeout(g, wait).expect("xfer lock").0;
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The thread that hands posts to their link once the application's stream work they are ordered
/// after has completed (`XferHandle::post_on` with work still queued); one per process.
fn gpu_waiter() -> &'static Mutex<std::sync::mpsc::Sender<Arc<XferShared>>> {
    static W: std::sync::OnceLock<Mutex<std::sync::mpsc::Sender<Arc<XferShared>>>> = std::sync::OnceLock::new();
    W.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Arc<XferShared>>();
        let spawned = std::thread::Builder::new().name("mr-gpu-order".into()).spawn(move || {
            for x in rx {
                let r = x.wait_gpu_order();
                {
                    let _gate = x.post_gate.lock().expect("xfer lock");
                    if x.state() == XferState::InProgress {
                        match r {
                            Err(e) => x.finish(Err(e)),
                            Ok(()) => {
                                if let Err(e) = x.peer.submit(x.clone(), false) {
                                    x.finish(Err(e));
                                }
                            }
                        }
                    } // else: released meanwhile
                }
                // Only once it is submitted: a post that sees no one waiting goes straight in,
                // after this one.
                x.peer.order_waiting().fetch_sub(1, Ordering::AcqRel);
            }
        });
        if spawned.is_err() {
            // No thread: the receiver is gone and every send fails with a clear error.
            return Mutex::new(std::sync::mpsc::channel().0);
        }
        Mutex::new(tx)
    })
}

/// Refuses a notification longer than the protocol carries (`MAX_NOTIF`).
pub fn check_notif(n: &[u8]) -> Result<()> {
    if n.len() > multirail_proto::codec::MAX_NOTIF {
        return Err(Error::InvalidArgument(format!("notification of {} bytes exceeds {}", n.len(), multirail_proto::codec::MAX_NOTIF)));
    }
    Ok(())
}

/// A prepared transfer: post it with [`XferHandle::post`], as often as needed.
#[derive(Clone)]
pub struct XferHandle(pub(crate) Arc<XferShared>);

/// How a post sends its first chunks (the three are exclusive).
#[derive(Clone, Copy, PartialEq, Eq)]
enum PostMode {
    /// From the posting thread, one per idle connection; the rails' threads send the rest.
    Inline,
    /// As `Inline`, for a caller that polls to completion next (`XferHandle::post_polled`).
    Polled,
    /// None from the posting thread (`XferHandle::post_handoff`).
    Handoff,
}

impl XferHandle {
    /// Set the notification the next posts send: None for none, `Some(empty)` for an empty
    /// one (NIXL's `hasNotif` with an empty message; the `post*` methods take an empty message
    /// as "none").
    pub fn set_notif(&self, notif: Option<Vec<u8>>) -> Result<()> {
        if let Some(n) = &notif {
            check_notif(n)?;
        }
        *self.0.notif.lock().expect("xfer lock") = notif;
        Ok(())
    }

    /// Start (or restart) the transfer. `notif` replaces the handle's notification when given
    /// (an empty one removes it; see [`XferHandle::set_notif`]).
    pub fn post(&self, notif: Option<Vec<u8>>) -> Result<XferState> {
        self.post_inner(notif, false, None, PostMode::Inline)
    }

    /// [`XferHandle::post`] that sends nothing from the calling thread: the transfer is queued
    /// and the rails' own threads (woken once) send all of it. For a large transfer whose
    /// caller only looks at the state afterwards (NIXL's `postXfer`): the post costs one
    /// wake-up and no socket call, so it returns in microseconds even on a loaded host, where
    /// sending the first chunks itself (and kicking each rail's receiver) can cost the caller
    /// its time slice. A small transfer should use [`XferHandle::post`] or `post_polled`: the
    /// handoff adds one thread wake-up to its latency.
    pub fn post_handoff(&self, notif: Option<Vec<u8>>) -> Result<XferState> {
        self.post_inner(notif, false, None, PostMode::Handoff)
    }

    /// [`XferHandle::post`], ordered after the work queued on the application's CUDA `stream`
    /// (a raw `cudaStream_t`; the stream contract of docs/gpu.md). A plain `post` orders after
    /// each local GPU's legacy default stream.
    pub fn post_on(&self, notif: Option<Vec<u8>>, stream: Option<u64>) -> Result<XferState> {
        self.post_inner(notif, false, stream, PostMode::Inline)
    }

    /// Whether a post without a stream waits for each local GPU's legacy default stream (true,
    /// the default: the stream contract of docs/gpu.md). False for a caller whose contract has
    /// no stream (NIXL's: data is ready when the application posts), so a READ into GPU memory
    /// does not wait behind the forward pass queued on the default stream.
    pub fn set_default_stream_order(&self, on: bool) {
        self.0.default_stream_order.store(on, Ordering::Release);
    }

    /// [`XferHandle::post`] for a caller that polls the transfer to completion next with
    /// [`XferHandle::progress`] (NIXL's `checkXfer` loop): its first chunks go out from this
    /// thread and no receiver thread is woken for their responses; the polls read them, as
    /// `post_wait` would, with no thread wake-up on the round trip. For small transfers: a
    /// caller that stops polling leaves its responses to a receiver that looks again within
    /// a millisecond (a large transfer's data would wait that long on each connection).
    pub fn post_polled(&self, notif: Option<Vec<u8>>) -> Result<XferState> {
        self.post_inner(notif, true, None, PostMode::Polled)
    }

    /// Post and wait in one call: the caller reads its own responses (no receiver wake-up on
    /// the round trip), the lowest-latency form for a caller that would wait anyway.
    pub fn post_wait(&self, notif: Option<Vec<u8>>, timeout: Option<Duration>) -> Result<()> {
        self.post_wait_on(notif, timeout, None)
    }

    /// [`XferHandle::post_wait`] on the application's `stream` (see [`XferHandle::post_on`]).
    pub fn post_wait_on(&self, notif: Option<Vec<u8>>, timeout: Option<Duration>, stream: Option<u64>) -> Result<()> {
        self.post_inner(notif, true, stream, PostMode::Inline)?;
        self.wait(timeout)
    }

    fn post_inner(&self, notif: Option<Vec<u8>>, will_drive: bool, stream: Option<u64>, mode: PostMode) -> Result<XferState> {
        if let Some(n) = notif {
            check_notif(&n)?;
            *self.0.notif.lock().expect("xfer lock") = (!n.is_empty()).then_some(n);
        }
        if self.0.has_local_vram() {
            if self.0.state() == XferState::InProgress {
                return Err(Error::InvalidArgument("transfer is still in progress; wait for it before posting again".into()));
            }
            if stream.is_some() || self.0.default_stream_order.load(Ordering::Acquire) {
                self.0.record_gpu_order(self.0.peer.gpu_kind(), stream)?;
            } else {
                self.0.gpu_order.lock().expect("xfer lock").pending = false;
            }
        }
        self.0.begin()?;
        self.0.polled.store(mode == PostMode::Polled, Ordering::Release);
        self.0.handoff.store(mode == PostMode::Handoff, Ordering::Release);
        let x = self.0.clone();
        if !x.gpu_order_ready() || x.peer.order_waiting().load(Ordering::Acquire) > 0 {
            // The producer's work is still queued: the transfer enters the link (and the
            // planner's stall clocks) once it is done, from the waiter thread, so `post`
            // returns at once and no rail waits on the GPU. Posts behind one waiting there
            // to the same peer queue behind it (`Poster::order_waiting`).
            x.peer.order_waiting().fetch_add(1, Ordering::AcqRel);
            return match gpu_waiter().lock().expect("waiter lock").send(x) {
                Ok(()) => Ok(self.state()),
                Err(_) => {
                    self.0.peer.order_waiting().fetch_sub(1, Ordering::AcqRel);
                    let e = Error::Gpu("the GPU-order waiter thread is gone".into());
                    self.0.finish(Err(e.clone()));
                    Err(e)
                }
            };
        }
        if let Err(e) = self.0.peer.submit(x, will_drive) {
            self.0.finish(Err(e.clone()));
            return Err(e);
        }
        Ok(self.state())
    }

    pub fn state(&self) -> XferState {
        self.0.state()
    }

    /// The state after reading whatever responses have already arrived for this transfer (when
    /// no receiver thread is reading them): lets a polling caller complete small transfers
    /// without a thread handoff. Never blocks for data that has not arrived.
    pub fn progress(&self) -> XferState {
        if self.0.state() == XferState::InProgress {
            self.0.peer.drive(&self.0, None, true);
        }
        self.0.state()
    }

    pub fn error(&self) -> Option<Error> {
        self.0.error()
    }

    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        self.0.wait(timeout)
    }

    pub fn total_bytes(&self) -> u64 {
        self.0.total
    }

    /// What each rail did for the last post: its bytes, chunks, first issue and last completion,
    /// and the planner's rate estimates. None for a handle never posted over a link (a CUDA IPC
    /// transfer, or one not posted yet).
    pub fn trace(&self) -> Option<XferTrace> {
        let rec = self.0.trace.lock().expect("xfer lock");
        rec.posted.map(|_| rec.trace.clone())
    }

    pub fn num_pieces(&self) -> usize {
        self.0.pieces as usize
    }

    /// Abort if in flight; in-flight chunks drain before this returns (bounded by the stall
    /// timeout), so the local memory is no longer touched afterwards.
    pub fn release(&self) {
        let _gate = self.0.post_gate.lock().expect("xfer lock");
        if self.state() == XferState::InProgress {
            self.0.peer.cancel(&self.0);
            self.0.finish(Err(Error::InvalidArgument("transfer handle released while in progress".into())));
        }
        // Nothing touches the local memory any more: let it be deregistered.
        self.0.hold.lock().expect("xfer lock").clear();
    }
}

#[cfg(test)]
mod tests {
    use super::{chunks_vectored, RailTrace, TraceRec};
    use std::time::{Duration, Instant};

    #[test]
    fn a_trace_records_each_rails_part_and_a_new_post_resets_it() {
        let mut rec = TraceRec::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        rec.start(t0, [1e9, 5e8].into_iter());
        rec.issued(0, ms(0));
        rec.issued(1, ms(1));
        rec.issued(0, ms(2));
        rec.issued(1, ms(3)); // issued, never completed (its rail died): not counted
        rec.landed(0, 100, ms(5));
        rec.landed(1, 50, ms(7));
        rec.landed(0, 100, ms(9));
        rec.issued(5, ms(9)); // a rail the post does not know: ignored
        rec.done(ms(10), [2e9, 4e8].into_iter());
        let t = &rec.trace;
        assert_eq!(t.total, Some(Duration::from_millis(10)));
        assert_eq!(
            t.rails,
            vec![
                RailTrace {
                    bytes: 200,
                    chunks: 2,
                    first_issue: Some(Duration::ZERO),
                    last_done: Some(Duration::from_millis(9)),
                    rate_at_post: 1e9,
                    rate_at_end: 2e9
                },
                RailTrace {
                    bytes: 50,
                    chunks: 1,
                    first_issue: Some(Duration::from_millis(1)),
                    last_done: Some(Duration::from_millis(7)),
                    rate_at_post: 5e8,
                    rate_at_end: 4e8
                },
            ]
        );
        // The next post starts from nothing: no total until it is done, no bytes carried over.
        rec.start(ms(20), [2e9, 4e8].into_iter());
        assert_eq!(rec.trace.total, None);
        assert!(rec.trace.rails.iter().all(|r| r.bytes == 0 && r.chunks == 0 && r.last_done.is_none()));
    }

    #[test]
    fn vectored_chunks_need_one_local_memory_and_a_peer_that_takes_gpu_pieces() {
        let gpu0 = (1 << 40, 2 << 40, 0);
        // Host memory both sides, or the peer's GPU memory with a peer that takes it.
        assert!(chunks_vectored(&[], 2, false, false));
        assert!(chunks_vectored(&[], 1, true, true));
        // An older peer (Hello below 4) is not sent vectored requests on its GPU regions.
        assert!(!chunks_vectored(&[], 1, true, false));
        // Local GPU memory of one device (staged), to host or GPU memory of the peer.
        assert!(chunks_vectored(&[gpu0, (3 << 40, 4 << 40, 0)], 2, false, false));
        assert!(chunks_vectored(&[gpu0], 1, true, true));
        // Host and GPU memory mixed locally, or two devices: one request per piece.
        assert!(!chunks_vectored(&[gpu0], 2, false, true));
        assert!(!chunks_vectored(&[gpu0, (3 << 40, 4 << 40, 1)], 2, false, true));
    }
}
