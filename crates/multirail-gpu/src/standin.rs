//! A host-backed stand-in for a GPU: its "device memory" is host memory, and each stream is a
//! thread that runs the stream's copies in order at a configurable rate.
//!
//! It behaves like CUDA where the staged path can tell: copies are asynchronous and ordered per
//! stream, events complete when what was queued before them has, pinned and device allocations
//! are counted (so tests can check that the pool is allocated once), and pointers are
//! classified. It also logs every copy with its real start and end, which is what the overlap
//! tests assert on.
//!
//! It also models the hazards a real GPU has and a plain host buffer does not:
//! - **a per-thread current device** ([`current_device`], [`set_current_device`]): every call
//!   makes its device current for its duration and puts the thread's previous one back, as
//!   `Cuda::enter` does; a device first made current on a thread counts as a context created
//!   ([`contexts`]);
//! - **application streams with pending work**: streams have raw handles
//!   ([`Device::stream_handle`], 0 = the device's default stream, made on first use), and
//!   [`StandIn::enqueue_sleep`] queues a "kernel" that takes a while, so a test can show that a
//!   transfer ordered after it reads what it produced;
//! - **failing calls** ([`StandIn::fail_in`]) and copies still running ([`StandIn::copies_in_flight`]),
//!   for the error and drop paths.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::{CopyKind, Device, DeviceError, DevicePtr, IpcHandle, MemKind, PinnedMem, Result};

/// Copy rates (bytes/s, `None` = as fast as memcpy) and a per-copy latency.
#[derive(Debug, Clone, Copy, Default)]
pub struct StandInConfig {
    pub d2h_rate: Option<f64>,
    pub h2d_rate: Option<f64>,
    pub d2d_rate: Option<f64>,
    /// Time before each copy starts moving bytes (launch overhead).
    pub latency: Duration,
    /// Let `ipc_open` map handles of this same process. CUDA refuses that, and so does the
    /// stand-in by default, so that agents in one process stage as they would on a GPU.
    pub ipc_same_process: bool,
}

impl StandInConfig {
    /// Every kind of copy at `rate` bytes/s.
    pub fn uniform(rate: f64) -> Self {
        StandInConfig { d2h_rate: Some(rate), h2d_rate: Some(rate), d2d_rate: Some(rate), latency: Duration::ZERO, ipc_same_process: false }
    }

    fn rate(&self, kind: CopyKind) -> Option<f64> {
        match kind {
            CopyKind::DeviceToHost => self.d2h_rate,
            CopyKind::HostToDevice => self.h2d_rate,
            CopyKind::DeviceToDevice => self.d2d_rate,
        }
    }
}

/// One executed copy, with the times it really ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRecord {
    pub kind: CopyKind,
    pub len: usize,
    pub start: Instant,
    pub end: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AllocKind {
    Device,
    Pinned,
}

#[derive(Debug)]
struct Inner {
    id: i32,
    cfg: StandInConfig,
    /// base address → (length, kind), for free and pointer_kind.
    allocs: Mutex<BTreeMap<u64, (usize, AllocKind)>>,
    /// Device allocations (and IPC mappings): base → the memfd behind them (-1: a mapping
    /// opened from a peer's handle, whose fd was closed after mmap).
    memfds: Mutex<BTreeMap<u64, i32>>,
    /// Device allocations that are not plain `cudaMalloc` memory ([`StandInAlloc`]), by base.
    styles: Mutex<BTreeMap<u64, Style>>,
    /// Address space reserved for a peer's VMM allocation and not yet committed
    /// (`vmm_reserve`): base -> length.
    reserved: Mutex<BTreeMap<u64, usize>>,
    device_allocs: AtomicU64,
    pinned_allocs: AtomicU64,
    /// Pinned buffers freed (`cudaFreeHost`) so far.
    pinned_frees: AtomicU64,
    log: Arc<Mutex<Vec<CopyRecord>>>,
    /// Copies queued and not finished, over every stream of this device.
    in_flight: Arc<AtomicU64>,
    /// The device's default stream (handle 0), made on first use.
    default_stream: Mutex<Option<StandInStream>>,
    /// Injected failures: the n-th next call of that kind fails (0: none).
    fail_record: AtomicU64,
    fail_create_event: AtomicU64,
    fail_alloc_pinned: AtomicU64,
    fail_query: AtomicU64,
    fail_synchronize: AtomicU64,
    fail_copy: AtomicU64,
    fail_flush: AtomicU64,
    /// GPUDirect facts a test injects ([`StandIn::set_gdr`]): dma-buf support (None: the
    /// driver cannot be asked) and the RDMA write ordering.
    gdr: Mutex<(Option<bool>, crate::RdmaWritesOrdering)>,
    /// `flush_rdma_writes` calls so far.
    rdma_flushes: AtomicU64,
}

/// A stand-in call whose failure a test can inject ([`StandIn::fail_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOp {
    Record,
    CreateEvent,
    AllocPinned,
    /// `cudaEventQuery` (what another thread's graph capture or a sticky error makes fail).
    Query,
    /// `cudaEventSynchronize`.
    Synchronize,
    /// `cudaMemcpyAsync` and the batched copies (a staging copy).
    Copy,
    /// `cuFlushGPUDirectRDMAWrites` (counted by `rdma_flushes` all the same).
    Flush,
}

/// `fail_in`'s `n` for a failure that persists: every call of that kind fails until cleared
/// (what a sticky device error or a broken copy engine does).
pub const FAIL_ALWAYS: u64 = u64::MAX;

thread_local! {
    /// The calling thread's current stand-in device (None: never set, like a thread with no
    /// CUDA context).
    static CURRENT: Cell<Option<i32>> = const { Cell::new(None) };
}

fn contexts_made() -> &'static Mutex<BTreeSet<i32>> {
    static C: OnceLock<Mutex<BTreeSet<i32>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(BTreeSet::new()))
}

/// The calling thread's current stand-in device (what `cudaGetDevice` would say).
pub fn current_device() -> Option<i32> {
    CURRENT.with(|c| c.get())
}

/// Sets the calling thread's current stand-in device (what `cudaSetDevice` or
/// `torch.cuda.set_device` would do); counts as creating that device's context.
pub fn set_current_device(id: Option<i32>) {
    if let Some(d) = id {
        lock(contexts_made()).insert(d);
    }
    CURRENT.with(|c| c.set(id));
}

/// Devices on which some thread of this process made a context current.
pub fn contexts() -> Vec<i32> {
    lock(contexts_made()).iter().copied().collect()
}

/// The stand-in's `Cuda::enter`: device `id` current and the thread's capture mode relaxed
/// until drop, then the previous device and mode back.
struct Entered(Option<i32>, CaptureMode);

impl Entered {
    fn new(id: i32) -> Entered {
        let prev = current_device();
        if prev != Some(id) {
            set_current_device(Some(id));
        }
        Entered(prev, exchange_capture_mode(CaptureMode::Relaxed))
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
        exchange_capture_mode(self.1);
    }
}

/// A thread's stream-capture mode (`cudaStreamCaptureMode`): what calls that are unsafe during
/// a capture do when some stream is capturing. The stand-in models captures begun in global
/// mode (torch's default): a call from a thread in `Global` or `ThreadLocal` mode fails and
/// invalidates every such capture; a thread in `Relaxed` mode may call anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    Global,
    ThreadLocal,
    Relaxed,
}

thread_local! {
    static MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// `cudaThreadExchangeStreamCaptureMode`: sets the calling thread's mode, returns the old one.
pub fn exchange_capture_mode(mode: CaptureMode) -> CaptureMode {
    MODE.with(|c| c.replace(mode))
}

/// Number of stand-in GPUs in this process (`cudaGetDeviceCount`): 1 to 64, default 64.
pub const ENV_STANDIN_DEVICES: &str = "MULTIRAIL_STANDIN_DEVICES";
/// Which stand-in GPUs can reach each other's memory (`cudaDeviceCanAccessPeer`): unset or
/// `all`, every pair; `none`, no pair (GPUs without P2P between them).
pub const ENV_STANDIN_PEERS: &str = "MULTIRAIL_STANDIN_PEERS";

/// How the stand-in's device allocations are made, as an application's allocator would
/// (`malloc`, `vmm`, `vmm:BYTES`, `vmm-nofd:BYTES`, `pool`; default `malloc`): see
/// [`StandInAlloc`]. Read at each allocation, so a test sets it for one process.
pub const ENV_STANDIN_ALLOC: &str = "MULTIRAIL_STANDIN_ALLOC";

/// What made a stand-in device allocation, and so which IPC can export it (the export rules
/// of docs/gpu.md, "Memory that legacy CUDA IPC cannot export").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandInAlloc {
    /// `cudaMalloc`: legacy CUDA IPC exports it (`cudaIpcGetMemHandle`).
    Malloc,
    /// CUDA VMM, as PyTorch's expandable segments make it: `chunk`-byte physical allocations
    /// (`cuMemCreate`, each its own memfd here) mapped side by side into one reserved address
    /// range. Legacy IPC refuses it; with `posix_fd` (the allocation requested
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) each chunk exports as a file descriptor.
    Vmm { chunk: usize, posix_fd: bool },
    /// A stream-ordered pool's memory (`cudaMallocAsync` from the default pool): neither legacy
    /// IPC nor VMM export takes it.
    Pool,
}

impl StandInAlloc {
    /// Parses [`ENV_STANDIN_ALLOC`]'s value (None: not one of the forms it takes).
    pub fn parse(v: &str) -> Option<StandInAlloc> {
        let v = v.trim().to_ascii_lowercase();
        let chunk = |rest: Option<&str>| match rest {
            None => Some(2 << 20),
            Some(n) => n.parse::<usize>().ok().filter(|n| *n > 0 && n % ALIGN == 0),
        };
        let (head, rest) = match v.split_once(':') {
            Some((h, r)) => (h, Some(r)),
            None => (v.as_str(), None),
        };
        match head {
            "" | "malloc" if rest.is_none() => Some(StandInAlloc::Malloc),
            "pool" if rest.is_none() => Some(StandInAlloc::Pool),
            "vmm" => Some(StandInAlloc::Vmm { chunk: chunk(rest)?, posix_fd: true }),
            "vmm-nofd" => Some(StandInAlloc::Vmm { chunk: chunk(rest)?, posix_fd: false }),
            _ => None,
        }
    }

    fn from_env() -> Result<StandInAlloc> {
        match std::env::var(ENV_STANDIN_ALLOC) {
            Err(_) => Ok(StandInAlloc::Malloc),
            Ok(v) => StandInAlloc::parse(&v).ok_or_else(|| {
                cuda_err(
                    "cudaMalloc",
                    1,
                    "standinBadAlloc",
                    format!(
                        "{ENV_STANDIN_ALLOC}={v:?}: expected malloc, pool, vmm[:BYTES] or vmm-nofd[:BYTES] (BYTES a multiple of {ALIGN})"
                    ),
                )
            }),
        }
    }
}

/// A device allocation other than plain `cudaMalloc` memory.
#[derive(Debug)]
enum Style {
    /// VMM chunks: (offset in the allocation, length, memfd).
    Vmm {
        chunks: Vec<(u64, usize, i32)>,
        posix_fd: bool,
    },
    Pool,
}

/// The number of stand-in GPUs ([`ENV_STANDIN_DEVICES`]); an ordinal at or beyond it is
/// refused as CUDA refuses an invalid device.
pub fn device_count() -> i32 {
    std::env::var(ENV_STANDIN_DEVICES).ok().and_then(|v| v.trim().parse::<i32>().ok()).filter(|n| (1..=64).contains(n)).unwrap_or(64)
}

/// What is shared by every stand-in GPU of the process: where device memory lives, which peer
/// access is enabled, sticky errors and the captures under way.
#[derive(Debug, Default)]
struct World {
    /// Device memory and IPC mappings of every stand-in GPU: base -> (length, the GPU whose
    /// memory it is).
    homes: BTreeMap<u64, (usize, i32)>,
    /// Peer access enabled, (from, to): kernels on `from` may touch `to`'s memory.
    peers: BTreeSet<(i32, i32)>,
    /// Sticky errors by GPU: once set, every later call on that GPU fails with it (hardware:
    /// `cudaErrorIllegalAddress` poisons the context until the process exits).
    sticky: BTreeMap<i32, String>,
    /// Streams being captured (by handle), each with why its capture was invalidated, if it was.
    captures: BTreeMap<u64, Option<String>>,
}

fn world() -> MutexGuard<'static, World> {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    lock(W.get_or_init(|| Mutex::new(World::default())))
}

fn cuda_err(op: &'static str, code: i32, name: &str, message: String) -> DeviceError {
    DeviceError::Cuda { op, code, name: name.into(), message }
}

/// `cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal)` on stand-in stream `handle`.
pub fn begin_capture(handle: u64) -> Result<()> {
    if !lock(streams()).contains_key(&handle) {
        return Err(DeviceError::UnknownStream { handle });
    }
    let mut w = world();
    if w.captures.contains_key(&handle) {
        return Err(cuda_err("cudaStreamBeginCapture", 900, "cudaErrorStreamCaptureUnsupported", "the stream is already capturing".into()));
    }
    w.captures.insert(handle, None);
    Ok(())
}

/// `cudaStreamEndCapture`: Err (`cudaErrorStreamCaptureInvalidated`) when a call capture
/// forbids was made meanwhile by a thread not in relaxed mode.
pub fn end_capture(handle: u64) -> Result<()> {
    match world().captures.remove(&handle) {
        None => Err(cuda_err("cudaStreamEndCapture", 901, "cudaErrorIllegalState", "the stream is not capturing".into())),
        Some(Some(why)) => Err(cuda_err("cudaStreamEndCapture", 901, "cudaErrorStreamCaptureInvalidated", why)),
        Some(None) => Ok(()),
    }
}

/// `cudaStreamIsCapturing`.
pub fn is_capturing(handle: u64) -> bool {
    world().captures.contains_key(&handle)
}

/// Whether stand-in GPUs `a` and `b` can reach each other's memory ([`ENV_STANDIN_PEERS`]).
pub fn can_access_peer(a: i32, b: i32) -> bool {
    a == b || !matches!(std::env::var(ENV_STANDIN_PEERS).map(|v| v.trim().to_ascii_lowercase()).as_deref(), Ok("none"))
}

/// Peer access pairs enabled so far (from, to).
pub fn peers_enabled() -> Vec<(i32, i32)> {
    world().peers.iter().copied().collect()
}

/// The sticky error of stand-in GPU `id`, if it has one.
pub fn sticky_error(id: i32) -> Option<String> {
    world().sticky.get(&id).cloned()
}

/// Live stand-in streams by handle: (device, queue).
type StreamTable = Mutex<BTreeMap<u64, (i32, mpsc::Sender<Op>)>>;

/// Every live stand-in stream, by handle: how `record_external` finds an application's stream.
fn streams() -> &'static StreamTable {
    static S: OnceLock<StreamTable> = OnceLock::new();
    S.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Stand-in stream handles start here (0 is the default stream; small numbers look like CUDA's
/// special handles).
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x5100);

/// The stand-in device (module docs). Cheap to clone: clones share memory and counters.
#[derive(Debug, Clone)]
pub struct StandIn {
    inner: Arc<Inner>,
}

/// Alignment of stand-in allocations (CUDA's are at least 256 bytes).
const ALIGN: usize = 4096;
/// Bytes copied between two pacing checks.
const SLICE: usize = 64 << 10;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain data consistent: keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StandIn {
    pub fn new(id: i32, cfg: StandInConfig) -> Self {
        StandIn {
            inner: Arc::new(Inner {
                id,
                cfg,
                allocs: Mutex::new(BTreeMap::new()),
                memfds: Mutex::new(BTreeMap::new()),
                styles: Mutex::new(BTreeMap::new()),
                reserved: Mutex::new(BTreeMap::new()),
                device_allocs: AtomicU64::new(0),
                pinned_allocs: AtomicU64::new(0),
                pinned_frees: AtomicU64::new(0),
                log: Arc::new(Mutex::new(Vec::new())),
                in_flight: Arc::new(AtomicU64::new(0)),
                default_stream: Mutex::new(None),
                fail_record: AtomicU64::new(0),
                fail_create_event: AtomicU64::new(0),
                fail_alloc_pinned: AtomicU64::new(0),
                fail_query: AtomicU64::new(0),
                fail_synchronize: AtomicU64::new(0),
                fail_copy: AtomicU64::new(0),
                fail_flush: AtomicU64::new(0),
                gdr: Mutex::new((None, crate::RdmaWritesOrdering::Owner)),
                rdma_flushes: AtomicU64::new(0),
            }),
        }
    }

    /// Device allocations made so far (frees do not count down).
    pub fn device_allocs(&self) -> u64 {
        self.inner.device_allocs.load(Ordering::Relaxed)
    }

    /// Pinned allocations made so far: the bounce pool should account for all of them.
    pub fn pinned_allocs(&self) -> u64 {
        self.inner.pinned_allocs.load(Ordering::Relaxed)
    }

    /// Pinned buffers freed so far (`cudaFreeHost`): with [`StandIn::pinned_allocs`], what a
    /// test checks to show that the data path neither pins nor unpins.
    pub fn pinned_frees(&self) -> u64 {
        self.inner.pinned_frees.load(Ordering::Relaxed)
    }

    /// Allocations not freed yet.
    pub fn live_allocs(&self) -> usize {
        lock(&self.inner.allocs).len()
    }

    /// Copies queued on any stream of this device that have not finished.
    pub fn copies_in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Sets what the stand-in reports as `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (None: cannot
    /// be asked, the default) and `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` (the
    /// default: OWNER, no flush needed).
    pub fn set_gdr(&self, dma_buf: Option<bool>, ordering: crate::RdmaWritesOrdering) {
        *lock(&self.inner.gdr) = (dma_buf, ordering);
    }

    /// `flush_rdma_writes` calls so far (`cuFlushGPUDirectRDMAWrites` on a GPU).
    pub fn rdma_flushes(&self) -> u64 {
        self.inner.rdma_flushes.load(Ordering::SeqCst)
    }

    /// Makes the `n`-th next call of `op` fail (n >= 1; 0 clears it; [`FAIL_ALWAYS`]: every call
    /// until cleared).
    pub fn fail_in(&self, op: FailOp, n: u64) {
        self.counter(op).store(n, Ordering::SeqCst);
    }

    fn counter(&self, op: FailOp) -> &AtomicU64 {
        match op {
            FailOp::Record => &self.inner.fail_record,
            FailOp::CreateEvent => &self.inner.fail_create_event,
            FailOp::AllocPinned => &self.inner.fail_alloc_pinned,
            FailOp::Query => &self.inner.fail_query,
            FailOp::Synchronize => &self.inner.fail_synchronize,
            FailOp::Copy => &self.inner.fail_copy,
            FailOp::Flush => &self.inner.fail_flush,
        }
    }

    /// Counts a call of `op` down; Err when this is the one to fail.
    fn maybe_fail(&self, op: FailOp, name: &'static str) -> Result<()> {
        let c = self.counter(op);
        let mut n = c.load(Ordering::SeqCst);
        if n == FAIL_ALWAYS {
            return Err(DeviceError::Injected { op: name });
        }
        while n > 0 {
            match c.compare_exchange(n, n - 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) if n == 1 => return Err(DeviceError::Injected { op: name }),
                Ok(_) => return Ok(()),
                Err(now) => n = now,
            }
        }
        Ok(())
    }

    /// A runtime call: made on a thread with no current device, it creates (and makes current)
    /// the context of device 0 first, as the CUDA runtime does; then fails with the device's
    /// sticky error, if any.
    fn runtime_call(&self, op: &'static str) -> Result<()> {
        if current_device().is_none() {
            set_current_device(Some(0));
        }
        match world().sticky.get(&self.inner.id) {
            Some(why) => Err(cuda_err(op, 700, "cudaErrorIllegalAddress", why.clone())),
            None => Ok(()),
        }
    }

    /// A call that a capture in global mode forbids (event queries and syncs, allocation and
    /// freeing, stream and event creation): from a thread not in relaxed mode while a stream
    /// is capturing, it fails and invalidates the capture, as CUDA does.
    fn capture_forbids(&self, op: &'static str) -> Result<()> {
        if MODE.with(|m| m.get()) == CaptureMode::Relaxed {
            return Ok(());
        }
        let mut w = world();
        let mut hit = false;
        let thread = std::thread::current();
        for why in w.captures.values_mut().filter(|c| c.is_none()) {
            *why = Some(format!(
                "{op} on thread {:?} (capture mode not relaxed) while the stream was capturing",
                thread.name().unwrap_or("?")
            ));
            hit = true;
        }
        if hit {
            return Err(cuda_err(op, 900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing".into()));
        }
        Ok(())
    }

    /// A kernel on this device touches `addr`: device memory of another stand-in GPU is
    /// reachable only with peer access enabled from this one; without it the access faults,
    /// which leaves this device with a sticky `cudaErrorIllegalAddress`.
    fn kernel_touches(&self, addr: u64) -> Result<()> {
        let me = self.inner.id;
        let mut w = world();
        let home = match w.homes.range(..=addr).next_back() {
            Some((&base, &(len, home))) if addr < base + len as u64 => home,
            _ => return Ok(()),
        };
        if home == me || w.peers.contains(&(me, home)) {
            return Ok(());
        }
        let why = format!("a kernel on stand-in GPU {me} touched {addr:#x}, memory of GPU {home}, without peer access");
        w.sticky.entry(me).or_insert_with(|| why.clone());
        Err(cuda_err("cudaLaunchKernel", 700, "cudaErrorIllegalAddress", why))
    }

    /// `cudaDeviceEnablePeerAccess(peer)` from this device (an error when the pair cannot).
    pub fn enable_peer(&self, peer: i32) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaDeviceEnablePeerAccess")?;
        if !can_access_peer(self.inner.id, peer) {
            return Err(cuda_err(
                "cudaDeviceEnablePeerAccess",
                217,
                "cudaErrorPeerAccessUnsupported",
                format!("stand-in GPU {} cannot access GPU {peer} ({ENV_STANDIN_PEERS})", self.inner.id),
            ));
        }
        world().peers.insert((self.inner.id, peer));
        Ok(())
    }

    /// Queues a pause of `d` on `stream`: a stand-in "kernel" that keeps everything queued
    /// after it waiting (a producer still running when a transfer is posted).
    pub fn enqueue_sleep(&self, stream: &StandInStream, d: Duration) -> Result<()> {
        stream.send(Op::Sleep(d))
    }

    /// Queues a pause of `d` on the stream with raw handle `handle` (0: the legacy default
    /// stream): the application's work still queued there when a transfer is posted.
    pub fn enqueue_sleep_on_handle(&self, handle: u64, d: Duration) -> Result<()> {
        self.stream_by_handle(handle)?.send(Op::Sleep(d)).map_err(|_| DeviceError::StreamGone)
    }

    /// The sender of stream `handle` of this device (0, and CUDA's special handles 1 and 2 for
    /// the legacy and per-thread default streams: the default stream, made on first use).
    fn stream_by_handle(&self, handle: u64) -> Result<mpsc::Sender<Op>> {
        if handle <= 2 {
            let mut d = lock(&self.inner.default_stream);
            if d.is_none() {
                *d = Some(self.create_stream()?);
            }
            let s = d.as_ref().expect("made above");
            return s.tx.clone().ok_or(DeviceError::StreamGone);
        }
        match lock(streams()).get(&handle) {
            Some((dev, tx)) if *dev == self.inner.id => Ok(tx.clone()),
            _ => Err(DeviceError::UnknownStream { handle }),
        }
    }

    /// Allocates `len` bytes of device memory the way `how` says ([`StandInAlloc`]).
    pub fn alloc_as(&self, len: usize, how: StandInAlloc) -> Result<DevicePtr> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaMalloc")?;
        self.capture_forbids("cudaMalloc")?;
        match how {
            StandInAlloc::Malloc => self.alloc_raw(len, AllocKind::Device).map(DevicePtr),
            StandInAlloc::Pool => {
                let p = self.alloc_raw(len, AllocKind::Device)?;
                lock(&self.inner.styles).insert(p, Style::Pool);
                Ok(DevicePtr(p))
            }
            StandInAlloc::Vmm { chunk, posix_fd } => self.alloc_vmm(len, chunk, posix_fd).map(DevicePtr),
        }
    }

    /// A reserved range of `len` bytes rounded up to `chunk`, each `chunk` a memfd of its own
    /// mapped in place (an expandable segment).
    fn alloc_vmm(&self, len: usize, chunk: usize, posix_fd: bool) -> Result<u64> {
        let total = len.max(1).div_ceil(chunk) * chunk;
        let base = reserve(total).ok_or(DeviceError::HostAlloc { len: total })?;
        let mut chunks: Vec<(u64, usize, i32)> = Vec::new();
        for off in (0..total).step_by(chunk) {
            let fd = memfd_sized(chunk);
            // SAFETY: inside our fresh reservation; MAP_FIXED replaces its PROT_NONE pages.
            let ok = fd.is_some_and(|fd| unsafe { map_fd_at(base + off as u64, chunk, fd) });
            match fd {
                Some(fd) if ok => chunks.push((off as u64, chunk, fd)),
                _ => {
                    // SAFETY: our reservation and memfds, used by nobody yet.
                    unsafe {
                        if let Some(fd) = fd {
                            libc::close(fd);
                        }
                        for c in &chunks {
                            libc::close(c.2);
                        }
                        libc::munmap(base as *mut libc::c_void, total);
                    }
                    return Err(DeviceError::HostAlloc { len: total });
                }
            }
        }
        lock(&self.inner.allocs).insert(base, (total, AllocKind::Device));
        lock(&self.inner.styles).insert(base, Style::Vmm { chunks, posix_fd });
        world().homes.insert(base, (total, self.inner.id));
        self.inner.device_allocs.fetch_add(1, Ordering::Relaxed);
        Ok(base)
    }

    /// The export rule of the allocation holding `base`: Err (as CUDA's call fails) when
    /// `cudaIpcGetMemHandle` cannot export it.
    fn legacy_exportable(&self, base: u64) -> Result<()> {
        let refuse = |what: &str| {
            Err(cuda_err("cudaIpcGetMemHandle", 1, "cudaErrorInvalidValue", format!("{what}: legacy CUDA IPC cannot export it")))
        };
        match lock(&self.inner.styles).get(&base) {
            Some(Style::Vmm { .. }) => refuse("a CUDA VMM allocation (cuMemCreate + cuMemMap, e.g. an expandable segment)"),
            Some(Style::Pool) => refuse("memory of a stream-ordered pool (cudaMallocAsync)"),
            None => Ok(()),
        }
    }

    /// Takes the log of executed copies.
    pub fn take_copy_log(&self) -> Vec<CopyRecord> {
        std::mem::take(&mut *lock(&self.inner.log))
    }

    fn alloc_raw(&self, len: usize, kind: AllocKind) -> Result<u64> {
        let p = if kind == AllocKind::Device {
            // Device memory is a shared memfd mapping, so that another process can map it from
            // an IPC handle, as CUDA IPC lets it (`ipc_handle`).
            let (p, fd) = memfd_map(len).ok_or(DeviceError::HostAlloc { len })?;
            lock(&self.inner.memfds).insert(p, fd);
            p as *mut u8
        } else {
            let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN).map_err(|_| DeviceError::HostAlloc { len })?;
            // SAFETY: the layout has a non-zero size.
            unsafe { std::alloc::alloc_zeroed(layout) }
        };
        if p.is_null() {
            return Err(DeviceError::HostAlloc { len });
        }
        lock(&self.inner.allocs).insert(p as u64, (len.max(1), kind));
        if kind == AllocKind::Device {
            world().homes.insert(p as u64, (len.max(1), self.inner.id));
        }
        let counter = if kind == AllocKind::Device { &self.inner.device_allocs } else { &self.inner.pinned_allocs };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(p as u64)
    }

    fn free_raw(&self, addr: u64, kind: AllocKind) -> Result<()> {
        let mut allocs = lock(&self.inner.allocs);
        match allocs.get(&addr) {
            Some(&(len, k)) if k == kind => {
                allocs.remove(&addr);
                if kind == AllocKind::Device {
                    world().homes.remove(&addr);
                    if let Some(Style::Vmm { chunks, .. }) = lock(&self.inner.styles).remove(&addr) {
                        for (_, _, fd) in chunks {
                            // SAFETY: the chunk's memfd, owned by the allocation being freed.
                            unsafe { libc::close(fd) };
                        }
                    }
                    let fd = lock(&self.inner.memfds).remove(&addr).unwrap_or(-1);
                    // SAFETY: mapped by memfd_map (or ipc_open) with this length; removed from
                    // the table, so unmapped once.
                    unsafe { unmap(addr, len, fd) };
                } else {
                    self.inner.pinned_frees.fetch_add(1, Ordering::Relaxed);
                    // SAFETY: allocated by alloc_raw with this size and alignment, removed from
                    // the table, so freed once.
                    unsafe { std::alloc::dealloc(addr as *mut u8, std::alloc::Layout::from_size_align_unchecked(len, ALIGN)) };
                }
                Ok(())
            }
            _ => Err(DeviceError::UnknownPointer { addr }),
        }
    }

    fn containing(&self, addr: u64) -> Option<(u64, usize, AllocKind)> {
        let allocs = lock(&self.inner.allocs);
        match allocs.range(..=addr).next_back() {
            Some((&base, &(len, kind))) if addr < base + len as u64 => Some((base, len, kind)),
            _ => None,
        }
    }
}

/// Magic of a stand-in IPC handle: `MRSI`, pid, memfd, length (the rest zero).
const IPC_MAGIC: &[u8; 4] = b"MRSI";

/// A zeroed shared mapping of `len` bytes backed by a new memfd: (address, fd).
fn memfd_map(len: usize) -> Option<(u64, i32)> {
    let len = len.max(1);
    // SAFETY: plain syscalls; every failure path closes what was opened.
    unsafe {
        let fd = libc::memfd_create(c"multirail-standin".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return None;
        }
        if libc::ftruncate(fd, len as libc::off_t) != 0 {
            libc::close(fd);
            return None;
        }
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        if p == libc::MAP_FAILED {
            libc::close(fd);
            return None;
        }
        Some((p as u64, fd))
    }
}

/// A new memfd of `len` bytes (the caller closes it).
fn memfd_sized(len: usize) -> Option<i32> {
    // SAFETY: plain syscalls; the fd is closed on failure.
    unsafe {
        let fd = libc::memfd_create(c"multirail-standin-vmm".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return None;
        }
        if libc::ftruncate(fd, len as libc::off_t) != 0 {
            libc::close(fd);
            return None;
        }
        Some(fd)
    }
}

/// Reserves `len` bytes of address space, inaccessible until mapped (`cuMemAddressReserve`).
fn reserve(len: usize) -> Option<u64> {
    // SAFETY: a fresh anonymous mapping.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len.max(1), libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
    };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

/// Maps `len` bytes of `fd` read-write, shared, at `at` (`cuMemMap`).
///
/// # Safety
/// `at..at+len` lies inside a reservation of the caller's that nothing else uses.
unsafe fn map_fd_at(at: u64, len: usize, fd: i32) -> bool {
    // SAFETY: the caller's contract; MAP_FIXED replaces only pages of its reservation.
    let p =
        unsafe { libc::mmap(at as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0) };
    p as u64 == at
}

/// # Safety
/// `addr..addr+len` is a mapping made by `memfd_map` or `ipc_open` that nothing uses any more.
unsafe fn unmap(addr: u64, len: usize, fd: i32) {
    // SAFETY: the caller's contract.
    unsafe {
        libc::munmap(addr as *mut libc::c_void, len.max(1));
        if fd >= 0 {
            libc::close(fd);
        }
    }
}

/// A stand-in stream: a thread that executes its queue in order.
#[derive(Debug)]
pub struct StandInStream {
    handle: u64,
    /// The device it was made on: its destroy runs there (the device guard), as every call.
    device: i32,
    tx: Option<mpsc::Sender<Op>>,
    thread: Option<JoinHandle<()>>,
}

/// A destroy call (`cudaStreamDestroy`, `cudaEventDestroy`) of an object made on `device`,
/// through the device guard: without it, a thread with no context would get one on device 0.
fn destroy_on(device: i32) {
    let _on = Entered::new(device);
    if current_device().is_none() {
        set_current_device(Some(0));
    }
}

impl Drop for StandInStream {
    fn drop(&mut self) {
        destroy_on(self.device);
        // Closing the queue (ours and the registry's sender) ends the thread after it has run
        // what was queued.
        lock(streams()).remove(&self.handle);
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, Default)]
struct EventState {
    /// Recorded into a stream that was capturing: querying or waiting for it fails
    /// (`cudaErrorCapturedEvent`), as CUDA's does.
    captured: std::sync::atomic::AtomicBool,
    /// Sequence number of the last record.
    recorded: AtomicU64,
    /// Sequence number of the last record the stream reached.
    done: Mutex<u64>,
    cv: Condvar,
}

/// A stand-in event: reusable, like a CUDA event.
#[derive(Debug, Default)]
pub struct StandInEvent(Arc<EventState>, Option<i32>);

impl Drop for StandInEvent {
    fn drop(&mut self) {
        if let Some(d) = self.1 {
            destroy_on(d);
        }
    }
}

enum Op {
    Copy {
        kind: CopyKind,
        dst: usize,
        src: usize,
        len: usize,
    },
    Signal(Arc<EventState>, u64),
    /// Wait until the event reaches this sequence number (`stream_wait`).
    Wait(Arc<EventState>, u64),
    /// A "kernel" that runs this long.
    Sleep(Duration),
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Copy { kind, len, .. } => write!(f, "Copy({kind:?}, {len})"),
            Op::Signal(_, seq) => write!(f, "Signal({seq})"),
            Op::Wait(_, seq) => write!(f, "Wait({seq})"),
            Op::Sleep(d) => write!(f, "Sleep({d:?})"),
        }
    }
}

fn stream_thread(rx: mpsc::Receiver<Op>, cfg: StandInConfig, log: Arc<Mutex<Vec<CopyRecord>>>, in_flight: Arc<AtomicU64>) {
    for op in rx {
        match op {
            Op::Sleep(d) => std::thread::sleep(d),
            Op::Wait(ev, seq) => {
                let mut d = lock(&ev.done);
                while *d < seq {
                    d = ev.cv.wait(d).unwrap_or_else(PoisonError::into_inner);
                }
            }
            Op::Copy { kind, dst, src, len } => {
                let start = Instant::now();
                if !cfg.latency.is_zero() {
                    std::thread::sleep(cfg.latency);
                }
                let mut done = 0;
                while done < len {
                    let n = SLICE.min(len - done);
                    // SAFETY: copy_async's contract: both ranges valid, disjoint and reserved for
                    // this copy until the event after it completes.
                    unsafe { std::ptr::copy_nonoverlapping((src + done) as *const u8, (dst + done) as *mut u8, n) };
                    done += n;
                    if let Some(rate) = cfg.rate(kind) {
                        // Pace against the copy's start, so one late wake-up is made up later.
                        let due = start + cfg.latency + Duration::from_secs_f64(done as f64 / rate);
                        let now = Instant::now();
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                    }
                }
                lock(&log).push(CopyRecord { kind, len, start, end: Instant::now() });
                in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            Op::Signal(ev, seq) => {
                let mut d = lock(&ev.done);
                *d = (*d).max(seq);
                ev.cv.notify_all();
            }
        }
    }
}

impl StandInStream {
    fn send(&self, op: Op) -> Result<()> {
        self.tx.as_ref().ok_or(DeviceError::StreamGone)?.send(op).map_err(|_| DeviceError::StreamGone)
    }
}

impl Device for StandIn {
    type Stream = StandInStream;
    type Event = StandInEvent;

    fn id(&self) -> i32 {
        self.inner.id
    }

    fn name(&self) -> String {
        format!("stand-in {} (host memory)", self.inner.id)
    }

    /// As the allocator [`ENV_STANDIN_ALLOC`] names (default `cudaMalloc`).
    fn alloc(&self, len: usize) -> Result<DevicePtr> {
        self.alloc_as(len, StandInAlloc::from_env()?)
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaFree")?;
        self.capture_forbids("cudaFree")?;
        self.free_raw(ptr.0, AllocKind::Device)
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaMallocHost")?;
        self.capture_forbids("cudaMallocHost")?;
        self.maybe_fail(FailOp::AllocPinned, "alloc_pinned")?;
        let p = self.alloc_raw(len, AllocKind::Pinned)?;
        // SAFETY: `len` bytes (at least 1) allocated above, valid until free_pinned.
        Ok(unsafe { PinnedMem::from_raw(p as *mut u8, len) })
    }

    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaFreeHost")?;
        self.capture_forbids("cudaFreeHost")?;
        self.free_raw(mem.addr(), AllocKind::Pinned)
    }

    /// Classified as the driver API does (`cuPointerGetAttributes`): no context is needed, so
    /// none is made on the calling thread.
    fn pointer_kind(&self, addr: u64) -> Result<MemKind> {
        Ok(match self.containing(addr) {
            Some((_, _, AllocKind::Device)) => MemKind::Device { device: self.inner.id },
            Some((_, _, AllocKind::Pinned)) => MemKind::Host,
            None => MemKind::Unregistered,
        })
    }

    /// The allocation, or for VMM memory the chunk mapped there (as `cuMemGetAddressRange`
    /// gives a VMM mapping's range).
    fn alloc_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        match self.containing(ptr.0) {
            Some((base, len, AllocKind::Device)) => {
                if let Some(Style::Vmm { chunks, .. }) = lock(&self.inner.styles).get(&base) {
                    let off = ptr.0 - base;
                    if let Some(c) = chunks.iter().find(|c| off >= c.0 && off < c.0 + c.1 as u64) {
                        return Ok((DevicePtr(base + c.0), c.1));
                    }
                }
                Ok((DevicePtr(base), len))
            }
            _ => Err(DeviceError::UnknownPointer { addr: ptr.0 }),
        }
    }

    /// Refuses what `cuMemRetainAllocationHandle` refuses (memory that is not VMM) and VMM
    /// memory created without the POSIX file descriptor handle type
    /// (`cuMemGetAllocationPropertiesFromHandle`).
    fn vmm_chunks(&self, ptr: DevicePtr, len: usize) -> Result<Vec<(DevicePtr, usize)>> {
        let (base, total, _) =
            self.containing(ptr.0).filter(|c| c.2 == AllocKind::Device).ok_or(DeviceError::UnknownPointer { addr: ptr.0 })?;
        let styles = lock(&self.inner.styles);
        let not_vmm = |what: &str| {
            Err(cuda_err("cuMemRetainAllocationHandle", 1, "CUDA_ERROR_INVALID_VALUE", format!("{what} is not a VMM allocation")))
        };
        match styles.get(&base) {
            None => not_vmm("cudaMalloc memory"),
            Some(Style::Pool) => not_vmm("memory of a stream-ordered pool (cudaMallocAsync)"),
            Some(Style::Vmm { posix_fd: false, .. }) => Err(cuda_err(
                "cuMemExportToShareableHandle",
                1,
                "CUDA_ERROR_INVALID_VALUE",
                "the allocation's requestedHandleTypes lacks CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR".into(),
            )),
            Some(Style::Vmm { chunks, .. }) => {
                let (start, end) = (ptr.0 - base, ptr.0 - base + len as u64);
                if end > total as u64 {
                    return Err(DeviceError::UnknownPointer { addr: base + total as u64 });
                }
                Ok(chunks.iter().filter(|c| c.0 < end && c.0 + c.1 as u64 > start).map(|c| (DevicePtr(base + c.0), c.1)).collect())
            }
        }
    }

    /// A duplicate of the chunk's memfd.
    fn vmm_export_fd(&self, at: DevicePtr) -> Result<OwnedFd> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cuMemExportToShareableHandle")?;
        self.vmm_chunks(at, 1)?;
        let (base, _, _) = self.containing(at.0).ok_or(DeviceError::UnknownPointer { addr: at.0 })?;
        let styles = lock(&self.inner.styles);
        let Some(Style::Vmm { chunks, .. }) = styles.get(&base) else { return Err(DeviceError::UnknownPointer { addr: at.0 }) };
        let c = chunks.iter().find(|c| base + c.0 == at.0).ok_or(DeviceError::UnknownPointer { addr: at.0 })?;
        // SAFETY: a live memfd of ours; the duplicate is owned by the result.
        let fd = unsafe { libc::fcntl(c.2, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(cuda_err(
                "cuMemExportToShareableHandle",
                2,
                "CUDA_ERROR_OUT_OF_MEMORY",
                std::io::Error::last_os_error().to_string(),
            ));
        }
        // SAFETY: just made, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn vmm_reserve(&self, len: usize) -> Result<DevicePtr> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cuMemAddressReserve")?;
        let base = reserve(len).ok_or(DeviceError::HostAlloc { len })?;
        lock(&self.inner.reserved).insert(base, len.max(1));
        Ok(DevicePtr(base))
    }

    unsafe fn vmm_map(&self, base: DevicePtr, offset: u64, len: usize, fd: BorrowedFd<'_>) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cuMemMap")?;
        let bad = |why: String| cuda_err("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE", why);
        let room = lock(&self.inner.reserved).get(&base.0).copied().ok_or_else(|| bad(format!("{:#x} is not a reservation", base.0)))?;
        if offset.checked_add(len as u64).is_none_or(|e| e > room as u64) {
            return Err(bad(format!("{len} bytes at offset {offset} do not fit the reservation of {room}")));
        }
        // SAFETY: fstat on a borrowed fd.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(bad(format!("fstat: {}", std::io::Error::last_os_error())));
            }
            st.st_size as u64
        };
        if size < len as u64 {
            return Err(bad(format!("the exported allocation has {size} bytes, not {len}")));
        }
        // SAFETY: inside our reservation (checked above), which nothing uses until committed.
        if !unsafe { map_fd_at(base.0 + offset, len, fd.as_raw_fd()) } {
            return Err(bad(format!("mmap: {}", std::io::Error::last_os_error())));
        }
        Ok(())
    }

    /// Opened on another GPU than `home`, the mapping needs peer access from this one
    /// (`cuMemSetAccess` for this device on memory of another).
    unsafe fn vmm_commit(&self, base: DevicePtr, len: usize, home: i32) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cuMemSetAccess")?;
        if home != self.inner.id {
            if !can_access_peer(self.inner.id, home) {
                return Err(cuda_err(
                    "cuMemSetAccess",
                    217,
                    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                    format!("stand-in GPU {} cannot access GPU {home}, where the allocation is", self.inner.id),
                ));
            }
            world().peers.insert((self.inner.id, home));
        }
        match lock(&self.inner.reserved).remove(&base.0) {
            Some(r) if r == len.max(1) => {}
            Some(r) => {
                lock(&self.inner.reserved).insert(base.0, r);
                return Err(cuda_err("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE", format!("the reservation has {r} bytes, not {len}")));
            }
            None => return Err(DeviceError::UnknownPointer { addr: base.0 }),
        }
        lock(&self.inner.allocs).insert(base.0, (len.max(1), AllocKind::Device));
        lock(&self.inner.memfds).insert(base.0, -1);
        world().homes.insert(base.0, (len.max(1), home));
        Ok(())
    }

    /// A handle naming this process and the allocation's memfd: another process (of the same
    /// user) maps it through `/proc/PID/fd/FD`, the stand-in's CUDA IPC. Like CUDA, handles of
    /// the opening process itself are refused (unless `ipc_same_process`).
    fn ipc_handle(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        if let Some((whole, _, AllocKind::Device)) = self.containing(ptr.0) {
            self.legacy_exportable(whole)?;
        }
        let (base, len) = self.alloc_range(ptr)?;
        if base != ptr {
            return Err(DeviceError::Unsupported { op: "ipc_handle of an interior pointer", device: "stand-in" });
        }
        let fd = *lock(&self.inner.memfds).get(&base.0).ok_or(DeviceError::UnknownPointer { addr: ptr.0 })?;
        if fd < 0 {
            return Err(DeviceError::Unsupported { op: "ipc_handle of an IPC mapping", device: "stand-in" });
        }
        let mut h = [0u8; 64];
        h[..4].copy_from_slice(IPC_MAGIC);
        h[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        h[8..12].copy_from_slice(&fd.to_le_bytes());
        h[12..20].copy_from_slice(&(len as u64).to_le_bytes());
        let physical = standin_physical(std::env::var(ENV_STANDIN_VISIBLE_DEVICES).ok().as_deref(), self.inner.id)?;
        h[20..24].copy_from_slice(&physical.to_le_bytes());
        Ok(IpcHandle(h))
    }

    unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<DevicePtr> {
        let h = &handle.0;
        let bad = |why: &str| DeviceError::Cuda { op: "ipc_open", code: 0, name: "standinInvalidHandle".into(), message: why.into() };
        if &h[..4] != IPC_MAGIC {
            return Err(bad("not a stand-in IPC handle"));
        }
        let pid = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        let fd = i32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(h[12..20].try_into().expect("8 bytes"));
        let len = usize::try_from(len).map_err(|_| bad("length out of range"))?;
        if pid == std::process::id() && !self.inner.cfg.ipc_same_process {
            return Err(bad("a handle of this same process (CUDA IPC maps only other processes' memory)"));
        }
        // The GPU whose memory it is, as this process numbers it; opened on another GPU, the
        // mapping needs peer access from this one (`cudaIpcMemLazyEnablePeerAccess`).
        let physical = i32::from_le_bytes(h[20..24].try_into().expect("4 bytes"));
        let home = standin_ordinal(std::env::var(ENV_STANDIN_VISIBLE_DEVICES).ok().as_deref(), physical)
            .ok_or_else(|| bad(&format!("the allocation is on stand-in GPU {physical}, which this process does not see")))?;
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaIpcOpenMemHandle")?;
        if home != self.inner.id {
            if !can_access_peer(self.inner.id, home) {
                return Err(cuda_err(
                    "cudaIpcOpenMemHandle",
                    101,
                    "cudaErrorInvalidDevice",
                    format!("stand-in GPU {} cannot access GPU {home}, where the allocation is", self.inner.id),
                ));
            }
            world().peers.insert((self.inner.id, home));
        }
        let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no NUL");
        // SAFETY: plain syscalls; the fd opened here is closed once mapped (the mapping stays).
        let p = unsafe {
            let f = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if f < 0 {
                return Err(bad(&format!("cannot open {}: {}", path.to_string_lossy(), std::io::Error::last_os_error())));
            }
            let mut st: libc::stat = std::mem::zeroed();
            let size_ok = libc::fstat(f, &mut st) == 0 && st.st_size as u64 >= len as u64;
            let p = if size_ok {
                libc::mmap(std::ptr::null_mut(), len.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f, 0)
            } else {
                libc::MAP_FAILED
            };
            libc::close(f);
            if p == libc::MAP_FAILED {
                return Err(bad("the allocation is gone or smaller than the handle says"));
            }
            p as u64
        };
        lock(&self.inner.allocs).insert(p, (len.max(1), AllocKind::Device));
        lock(&self.inner.memfds).insert(p, -1);
        world().homes.insert(p, (len.max(1), home));
        Ok(DevicePtr(p))
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        if let Some(len) = lock(&self.inner.reserved).remove(&ptr.0) {
            // SAFETY: a reservation never committed, so no copy uses it (the caller's contract).
            unsafe { libc::munmap(ptr.0 as *mut libc::c_void, len) };
            return Ok(());
        }
        if lock(&self.inner.memfds).get(&ptr.0) != Some(&-1) {
            return Err(DeviceError::UnknownPointer { addr: ptr.0 });
        }
        self.free_raw(ptr.0, AllocKind::Device)
    }

    fn create_stream(&self) -> Result<StandInStream> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaStreamCreateWithFlags")?;
        self.capture_forbids("cudaStreamCreateWithFlags")?;
        let (tx, rx) = mpsc::channel();
        let (cfg, log, in_flight) = (self.inner.cfg, self.inner.log.clone(), self.inner.in_flight.clone());
        let thread = std::thread::Builder::new()
            .name(format!("standin{}-stream", self.inner.id))
            .spawn(move || stream_thread(rx, cfg, log, in_flight))
            .map_err(|_| DeviceError::StreamGone)?;
        let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        lock(streams()).insert(handle, (self.inner.id, tx.clone()));
        Ok(StandInStream { handle, device: self.inner.id, tx: Some(tx), thread: Some(thread) })
    }

    fn create_event(&self) -> Result<StandInEvent> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaEventCreateWithFlags")?;
        self.capture_forbids("cudaEventCreateWithFlags")?;
        self.maybe_fail(FailOp::CreateEvent, "create_event")?;
        Ok(StandInEvent(Arc::default(), Some(self.inner.id)))
    }

    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &StandInStream) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaMemcpyAsync")?;
        self.maybe_fail(FailOp::Copy, "cudaMemcpyAsync")?;
        self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
        stream.send(Op::Copy { kind, dst: dst as usize, src: src as usize, len }).inspect_err(|_| {
            self.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
        })
    }

    fn record(&self, event: &StandInEvent, stream: &StandInStream) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaEventRecord")?;
        self.maybe_fail(FailOp::Record, "record")?;
        let seq = event.0.recorded.fetch_add(1, Ordering::SeqCst) + 1;
        stream.send(Op::Signal(event.0.clone(), seq))
    }

    fn record_external(&self, event: &StandInEvent, stream: u64) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaEventRecord")?;
        let tx = self.stream_by_handle(stream)?;
        if is_capturing(stream) {
            // Captured into the graph, not run now: waiting for it is an error.
            event.0.captured.store(true, Ordering::SeqCst);
            return Ok(());
        }
        event.0.captured.store(false, Ordering::SeqCst);
        let seq = event.0.recorded.fetch_add(1, Ordering::SeqCst) + 1;
        tx.send(Op::Signal(event.0.clone(), seq)).map_err(|_| DeviceError::StreamGone)
    }

    fn stream_synchronize(&self, stream: &StandInStream) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaStreamSynchronize")?;
        self.capture_forbids("cudaStreamSynchronize")?;
        let ev = StandInEvent::default();
        let seq = ev.0.recorded.fetch_add(1, Ordering::SeqCst) + 1;
        stream.send(Op::Signal(ev.0.clone(), seq))?;
        wait_event(&ev)
    }

    fn stream_wait(&self, stream: &StandInStream, event: &StandInEvent) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        let seq = event.0.recorded.load(Ordering::SeqCst);
        stream.send(Op::Wait(event.0.clone(), seq))
    }

    fn stream_handle(&self, stream: &StandInStream) -> u64 {
        stream.handle
    }

    fn query(&self, event: &StandInEvent) -> Result<bool> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaEventQuery")?;
        self.capture_forbids("cudaEventQuery")?;
        self.maybe_fail(FailOp::Query, "cudaEventQuery")?;
        captured_check(event, "cudaEventQuery")?;
        Ok(*lock(&event.0.done) >= event.0.recorded.load(Ordering::SeqCst))
    }

    fn synchronize(&self, event: &StandInEvent) -> Result<()> {
        let _on = Entered::new(self.inner.id);
        self.runtime_call("cudaEventSynchronize")?;
        self.capture_forbids("cudaEventSynchronize")?;
        self.maybe_fail(FailOp::Synchronize, "cudaEventSynchronize")?;
        captured_check(event, "cudaEventSynchronize")?;
        wait_event(event)
    }

    /// Two or more device-to-device copies averaging at most [`crate::KERNEL_MAX_AVG_PIECE`]
    /// go as one "gather kernel" launch (as CUDA's `auto` copy mode does), which dereferences
    /// every address on this device: memory of another GPU without peer access faults
    /// ([`StandIn::kernel_touches`]). Anything else goes one copy (engine) call per copy,
    /// which may cross GPUs (a peer copy).
    unsafe fn copy_batch_async(&self, copies: &[crate::BatchCopy], stream: &StandInStream) -> Result<crate::Queued> {
        let mode = crate::cuda::CopyMode::from_env();
        let d2d = copies.len() > 1 && copies.iter().all(|c| c.0 == CopyKind::DeviceToDevice);
        let avg = copies.iter().map(|c| c.3).sum::<usize>() / copies.len().max(1);
        let kernel = d2d
            && (mode == crate::cuda::CopyMode::Kernel || (mode == crate::cuda::CopyMode::Auto && avg <= crate::cuda::KERNEL_MAX_AVG_PIECE));
        if kernel {
            let _on = Entered::new(self.inner.id);
            self.runtime_call("cudaLaunchKernel")?;
            for &(_, dst, src, len) in copies.iter().filter(|c| c.3 > 0) {
                for a in [dst, src, dst + len as u64 - 1, src + len as u64 - 1] {
                    self.kernel_touches(a)?;
                }
            }
        }
        for &(kind, dst, src, len) in copies {
            // SAFETY: the caller's contract, per copy.
            unsafe { self.copy_async(kind, dst, src, len, stream) }?;
        }
        Ok(if kernel {
            crate::Queued { calls: 1, how: crate::CopyHow::Kernel, note: None }
        } else {
            crate::Queued { calls: copies.len(), how: crate::CopyHow::PerCopy, note: None }
        })
    }

    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        Ok(can_access_peer(self.inner.id, peer))
    }

    fn enable_peer_access(&self, peer: i32) -> Result<()> {
        self.enable_peer(peer)
    }

    fn stream_is_capturing(&self, stream: u64) -> Result<bool> {
        Ok(is_capturing(stream))
    }

    fn dma_buf_supported(&self) -> Result<Option<bool>> {
        Ok(lock(&self.inner.gdr).0)
    }

    fn rdma_writes_ordering(&self) -> Result<crate::RdmaWritesOrdering> {
        Ok(lock(&self.inner.gdr).1)
    }

    /// Counts the call (host memory needs no flush); fails where `fail_in(FailOp::Flush, ..)`
    /// says.
    fn flush_rdma_writes(&self) -> Result<()> {
        self.inner.rdma_flushes.fetch_add(1, Ordering::SeqCst);
        self.maybe_fail(FailOp::Flush, "cuFlushGPUDirectRDMAWrites")
    }

    /// Derived from the physical stand-in GPU behind this ordinal
    /// ([`ENV_STANDIN_VISIBLE_DEVICES`]), as CUDA's follows the GPU, not the ordinal.
    fn uuid(&self) -> Result<[u8; 16]> {
        let physical = standin_physical(std::env::var(ENV_STANDIN_VISIBLE_DEVICES).ok().as_deref(), self.inner.id)?;
        Ok(standin_uuid(physical))
    }
}

/// Per-process visibility of the stand-in's GPUs, as `CUDA_VISIBLE_DEVICES` is for CUDA: a
/// comma-separated list of physical stand-in GPUs; ordinal `i` of this process is the `i`-th.
/// Unset or empty: ordinal `i` is physical GPU `i`. Only the UUIDs follow it (memory is host
/// memory either way), which is what CUDA IPC's device mapping needs to be tested.
pub const ENV_STANDIN_VISIBLE_DEVICES: &str = "MULTIRAIL_STANDIN_VISIBLE_DEVICES";

/// Fails an event recorded while its stream was capturing (`cudaErrorCapturedEvent`).
fn captured_check(event: &StandInEvent, op: &'static str) -> Result<()> {
    if event.0.captured.load(Ordering::SeqCst) {
        return Err(cuda_err(op, 907, "cudaErrorCapturedEvent", "the event was recorded in a stream that is capturing".into()));
    }
    Ok(())
}

/// Waits until the stream has reached the event's last record.
fn wait_event(event: &StandInEvent) -> Result<()> {
    let want = event.0.recorded.load(Ordering::SeqCst);
    let mut d = lock(&event.0.done);
    while *d < want {
        d = event.0.cv.wait(d).unwrap_or_else(PoisonError::into_inner);
    }
    Ok(())
}

/// This process's ordinal of physical stand-in GPU `physical` under the visibility list
/// `visible` (None: it does not see that GPU).
pub fn standin_ordinal(visible: Option<&str>, physical: i32) -> Option<i32> {
    let n = device_count();
    (0..n).find(|&i| standin_physical(visible, i).ok() == Some(physical))
}

/// The physical stand-in GPU of ordinal `id` under the visibility list `visible`.
pub fn standin_physical(visible: Option<&str>, id: i32) -> Result<i32> {
    let Some(list) = visible.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(id);
    };
    let phys: Vec<i32> =
        list.split(',').map(|p| p.trim().parse::<i32>().ok().filter(|n| *n >= 0)).collect::<Option<_>>().ok_or_else(|| {
            DeviceError::Cuda {
                op: "uuid",
                code: 0,
                name: "standinBadVisibleDevices".into(),
                message: format!("{ENV_STANDIN_VISIBLE_DEVICES}={list:?}"),
            }
        })?;
    usize::try_from(id).ok().and_then(|i| phys.get(i).copied()).ok_or(DeviceError::BadDevice { id, count: phys.len() as i32 })
}

/// The UUID of physical stand-in GPU `physical`.
pub fn standin_uuid(physical: i32) -> [u8; 16] {
    let mut u = *b"mr-standin--\0\0\0\0";
    u[12..16].copy_from_slice(&physical.to_be_bytes());
    u
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_ordered_and_events_complete() {
        let dev = StandIn::new(0, StandInConfig::default());
        let d = dev.alloc(1000).unwrap();
        let h = dev.alloc_pinned(1000).unwrap();
        let src: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
        assert!(dev.query(&e).unwrap(), "a fresh event counts as complete");
        unsafe {
            dev.copy_async(CopyKind::HostToDevice, d.0, src.as_ptr() as u64, 1000, &s).unwrap();
            dev.copy_async(CopyKind::DeviceToHost, h.addr(), d.0, 1000, &s).unwrap();
        }
        dev.record(&e, &s).unwrap();
        dev.synchronize(&e).unwrap();
        assert!(dev.query(&e).unwrap());
        assert_eq!(unsafe { h.as_slice() }, &src[..]);
        assert_eq!(dev.pointer_kind(d.0 + 999).unwrap(), MemKind::Device { device: 0 });
        assert_eq!(dev.pointer_kind(h.addr()).unwrap(), MemKind::Host);
        assert_eq!(dev.pointer_kind(src.as_ptr() as u64).unwrap(), MemKind::Unregistered);
        assert_eq!(dev.take_copy_log().len(), 2);
        unsafe {
            dev.free(d).unwrap();
            assert!(matches!(dev.free(d), Err(DeviceError::UnknownPointer { .. })));
            dev.free_pinned(h).unwrap();
        }
        assert_eq!((dev.device_allocs(), dev.pinned_allocs(), dev.live_allocs()), (1, 1, 0));
        assert_eq!(dev.pinned_frees(), 1);
    }

    #[test]
    fn ipc_maps_the_same_memory() {
        let plain = StandIn::new(0, StandInConfig::default());
        let p = plain.alloc(4096).unwrap();
        let own = plain.ipc_handle(p).unwrap();
        assert!(unsafe { plain.ipc_open(&own) }.is_err(), "CUDA refuses handles of its own process");
        unsafe { plain.free(p).unwrap() };
        let dev = StandIn::new(0, StandInConfig { ipc_same_process: true, ..StandInConfig::default() });
        let d = dev.alloc(10_000).unwrap();
        assert_eq!(dev.alloc_range(d.offset(5000)).unwrap(), (d, 10_000));
        assert!(matches!(dev.ipc_handle(d.offset(1)), Err(DeviceError::Unsupported { .. })));
        let h = dev.ipc_handle(d).unwrap();
        let m = unsafe { dev.ipc_open(&h).unwrap() };
        assert_ne!(m, d);
        assert_eq!(dev.pointer_kind(m.0 + 9999).unwrap(), MemKind::Device { device: 0 });
        unsafe { *(d.0 as *mut u8).add(1234) = 77 };
        assert_eq!(unsafe { *(m.0 as *const u8).add(1234) }, 77, "one memory, two mappings");
        assert!(matches!(unsafe { dev.ipc_close(d) }, Err(DeviceError::UnknownPointer { .. })));
        unsafe { dev.ipc_close(m).unwrap() };
        unsafe { dev.free(d).unwrap() };
        assert_eq!(dev.live_allocs(), 0);
        let mut forged = h;
        forged.0[0] = b'X';
        assert!(unsafe { dev.ipc_open(&forged) }.is_err());
    }

    /// The export rules: cudaMalloc memory by legacy IPC only; VMM memory (an expandable
    /// segment of 3 chunks) by VMM export only, chunk by chunk, mapped back into one range that
    /// is the same memory; a stream-ordered pool's memory, and VMM memory without the POSIX fd
    /// handle type, by neither.
    #[test]
    fn vmm_memory_exports_by_chunk_fds_and_pool_memory_not_at_all() {
        use std::os::fd::AsFd;
        let dev = StandIn::new(44, StandInConfig::default());
        let chunk = 64 << 10;
        let v = dev.alloc_as(2 * chunk + 100, StandInAlloc::Vmm { chunk, posix_fd: true }).unwrap();
        assert_eq!(dev.pointer_kind(v.0 + 3 * chunk as u64 - 1).unwrap(), MemKind::Device { device: 44 }, "rounded up to whole chunks");
        assert_eq!(dev.alloc_range(v.offset(chunk as u64 + 5)).unwrap(), (v.offset(chunk as u64), chunk), "a VMM mapping's range");
        let e = dev.ipc_handle(v).unwrap_err().to_string();
        assert!(e.contains("cudaIpcGetMemHandle") && e.contains("VMM"), "{e}");
        let chunks = dev.vmm_chunks(v, 3 * chunk).unwrap();
        assert_eq!(chunks, vec![(v, chunk), (v.offset(chunk as u64), chunk), (v.offset(2 * chunk as u64), chunk)]);
        assert_eq!(dev.vmm_chunks(v.offset(chunk as u64 + 1), 10).unwrap().len(), 1);
        // Imported on another stand-in GPU: peer access from it to 44.
        let imp = StandIn::new(45, StandInConfig::default());
        let base = imp.vmm_reserve(3 * chunk).unwrap();
        for (i, (at, len)) in chunks.iter().enumerate() {
            let fd = dev.vmm_export_fd(*at).unwrap();
            unsafe { imp.vmm_map(base, (i * chunk) as u64, *len, fd.as_fd()).unwrap() };
        }
        unsafe { imp.vmm_commit(base, 3 * chunk, 44).unwrap() };
        assert!(peers_enabled().contains(&(45, 44)));
        unsafe { *(v.0 as *mut u8).add(2 * chunk + 9) = 99 };
        assert_eq!(unsafe { *(base.0 as *const u8).add(2 * chunk + 9) }, 99, "one memory, two mappings");
        unsafe { imp.ipc_close(base).unwrap() };
        // A reservation abandoned half-way is undone by ipc_close too.
        let half = imp.vmm_reserve(2 * chunk).unwrap();
        let fd = dev.vmm_export_fd(v).unwrap();
        unsafe { imp.vmm_map(half, 0, chunk, fd.as_fd()).unwrap() };
        assert!(unsafe { imp.vmm_map(half, chunk as u64, 2 * chunk, fd.as_fd()) }.is_err(), "past the reservation");
        unsafe { imp.ipc_close(half).unwrap() };
        unsafe { dev.free(v).unwrap() };
        for how in [StandInAlloc::Pool, StandInAlloc::Vmm { chunk, posix_fd: false }] {
            let p = dev.alloc_as(chunk, how).unwrap();
            assert!(dev.ipc_handle(p).is_err(), "{how:?}");
            let e = dev.vmm_chunks(p, chunk).unwrap_err().to_string();
            assert!(e.contains(if how == StandInAlloc::Pool { "stream-ordered pool" } else { "POSIX_FILE_DESCRIPTOR" }), "{e}");
            unsafe { dev.free(p).unwrap() };
        }
        let m = dev.alloc_as(chunk, StandInAlloc::Malloc).unwrap();
        assert!(dev.ipc_handle(m).is_ok() && dev.vmm_chunks(m, chunk).is_err());
        unsafe { dev.free(m).unwrap() };
        assert_eq!(dev.live_allocs(), 0);
        assert_eq!(StandInAlloc::parse("vmm:65536"), Some(StandInAlloc::Vmm { chunk: 65536, posix_fd: true }));
        assert_eq!(StandInAlloc::parse(" POOL "), Some(StandInAlloc::Pool));
        assert_eq!(StandInAlloc::parse("vmm:100"), None, "a chunk is a multiple of the page");
        assert_eq!(StandInAlloc::parse("vmm-nofd"), Some(StandInAlloc::Vmm { chunk: 2 << 20, posix_fd: false }));
    }

    #[test]
    fn copies_are_rate_limited() {
        // 4 MiB at 200 MB/s: at least ~21 ms (the bound only; a loaded machine may be slower).
        let dev = StandIn::new(0, StandInConfig::uniform(200e6));
        let (a, b) = (dev.alloc(4 << 20).unwrap(), dev.alloc(4 << 20).unwrap());
        let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
        unsafe { dev.copy_async(CopyKind::DeviceToDevice, b.0, a.0, 4 << 20, &s).unwrap() };
        dev.record(&e, &s).unwrap();
        dev.synchronize(&e).unwrap();
        let log = dev.take_copy_log();
        assert!(log[0].end - log[0].start >= Duration::from_millis(20), "{log:?}");
        unsafe {
            dev.free(a).unwrap();
            dev.free(b).unwrap();
        }
    }

    #[test]
    fn a_kernel_touching_another_gpus_memory_needs_peer_access_and_the_fault_is_sticky() {
        // Devices 40 and 41: no other test here uses them (the peer table is per process).
        let (a, b) = (StandIn::new(40, StandInConfig::default()), StandIn::new(41, StandInConfig::default()));
        let (pa, pb) = (a.alloc(8192).unwrap(), b.alloc(8192).unwrap());
        let s = b.create_stream().unwrap();
        let pages = [(CopyKind::DeviceToDevice, pb.0, pa.0, 4096), (CopyKind::DeviceToDevice, pb.0 + 4096, pa.0 + 4096, 4096)];
        // A copy engine crosses GPUs without peer access (a peer copy); a kernel cannot.
        unsafe { b.copy_async(CopyKind::DeviceToDevice, pb.0, pa.0, 8192, &s).unwrap() };
        b.stream_synchronize(&s).unwrap();
        let e = unsafe { b.copy_batch_async(&pages, &s) }.unwrap_err();
        assert!(e.to_string().contains("cudaErrorIllegalAddress"), "{e}");
        assert!(sticky_error(41).is_some());
        assert!(b.create_event().is_err(), "sticky: every later call on the device fails");
        assert!(sticky_error(40).is_none(), "the other device is unharmed");
        // From device 40 with peer access to 41 enabled, the kernel runs.
        let s2 = a.create_stream().unwrap();
        let back = [(CopyKind::DeviceToDevice, pa.0, pb.0, 4096), (CopyKind::DeviceToDevice, pa.0 + 4096, pb.0 + 4096, 4096)];
        assert!(unsafe { a.copy_batch_async(&back, &s2) }.is_err());
        world().sticky.remove(&40);
        a.enable_peer(41).unwrap();
        let q = unsafe { a.copy_batch_async(&back, &s2) }.unwrap();
        assert_eq!(q.how, crate::CopyHow::Kernel);
        a.stream_synchronize(&s2).unwrap();
    }

    #[test]
    fn a_forbidden_call_invalidates_a_capture_unless_the_thread_is_relaxed() {
        let dev = StandIn::new(42, StandInConfig::default());
        let s = dev.create_stream().unwrap();
        begin_capture(s.handle).unwrap();
        assert!(is_capturing(s.handle));
        // The stand-in's calls run in relaxed mode (as `Cuda::enter` sets it): no harm.
        let e = dev.create_event().unwrap();
        dev.query(&e).unwrap();
        end_capture(s.handle).unwrap();
        // A thread in global mode that calls what capture forbids invalidates it.
        begin_capture(s.handle).unwrap();
        let prev = exchange_capture_mode(CaptureMode::Global);
        assert!(dev.capture_forbids("cudaEventQuery").is_err());
        exchange_capture_mode(prev);
        assert!(end_capture(s.handle).unwrap_err().to_string().contains("Invalidated"));
        // An event recorded into a capturing stream cannot be waited for.
        begin_capture(s.handle).unwrap();
        dev.record_external(&e, s.handle).unwrap();
        assert!(dev.query(&e).unwrap_err().to_string().contains("cudaErrorCapturedEvent"));
        end_capture(s.handle).unwrap();
    }

    #[test]
    fn uuids_follow_the_physical_gpu_not_the_ordinal() {
        // Two processes with different visibility lists see one physical GPU under different
        // ordinals, with the same UUID.
        assert_eq!(standin_physical(None, 3).unwrap(), 3);
        assert_eq!(standin_physical(Some(" "), 0).unwrap(), 0);
        assert_eq!(standin_physical(Some("1,0"), 0).unwrap(), 1);
        assert_eq!(standin_physical(Some("1, 0"), 1).unwrap(), 0);
        assert!(matches!(standin_physical(Some("1,0"), 2), Err(DeviceError::BadDevice { id: 2, count: 2 })));
        assert!(standin_physical(Some("a,0"), 0).is_err());
        assert_eq!(standin_uuid(standin_physical(Some("1,0"), 0).unwrap()), standin_uuid(standin_physical(Some("0,1"), 1).unwrap()));
        assert_ne!(standin_uuid(0), standin_uuid(1));
        assert_eq!(crate::device::uuid_string(&standin_uuid(1)), "GPU-6d722d73-7461-6e64-696e-2d2d00000001");
    }
}
