//! A host-backed stand-in for a GPU: its "device memory" is host memory, and each stream is a
//! thread that runs the stream's copies in order at a configurable rate.
//!
//! It behaves like CUDA where the staged path can tell: copies are asynchronous and ordered per
//! stream, events complete when what was queued before them has, pinned and device allocations
//! are counted (so tests can check that the pool is allocated once), and pointers are
//! classified. It also logs every copy with its real start and end, which is what the overlap
//! tests assert on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::{CopyKind, Device, DeviceError, DevicePtr, MemKind, PinnedMem, Result};

/// Copy rates (bytes/s, `None` = as fast as memcpy) and a per-copy latency.
#[derive(Debug, Clone, Copy, Default)]
pub struct StandInConfig {
    pub d2h_rate: Option<f64>,
    pub h2d_rate: Option<f64>,
    pub d2d_rate: Option<f64>,
    /// Time before each copy starts moving bytes (launch overhead).
    pub latency: Duration,
}

impl StandInConfig {
    /// Every kind of copy at `rate` bytes/s.
    pub fn uniform(rate: f64) -> Self {
        StandInConfig { d2h_rate: Some(rate), h2d_rate: Some(rate), d2d_rate: Some(rate), latency: Duration::ZERO }
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
    device_allocs: AtomicU64,
    pinned_allocs: AtomicU64,
    log: Arc<Mutex<Vec<CopyRecord>>>,
}

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
                device_allocs: AtomicU64::new(0),
                pinned_allocs: AtomicU64::new(0),
                log: Arc::new(Mutex::new(Vec::new())),
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

    /// Allocations not freed yet.
    pub fn live_allocs(&self) -> usize {
        lock(&self.inner.allocs).len()
    }

    /// Takes the log of executed copies.
    pub fn take_copy_log(&self) -> Vec<CopyRecord> {
        std::mem::take(&mut *lock(&self.inner.log))
    }

    fn alloc_raw(&self, len: usize, kind: AllocKind) -> Result<u64> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN).map_err(|_| DeviceError::HostAlloc { len })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(DeviceError::HostAlloc { len });
        }
        lock(&self.inner.allocs).insert(p as u64, (len.max(1), kind));
        let counter = if kind == AllocKind::Device { &self.inner.device_allocs } else { &self.inner.pinned_allocs };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(p as u64)
    }

    fn free_raw(&self, addr: u64, kind: AllocKind) -> Result<()> {
        let mut allocs = lock(&self.inner.allocs);
        match allocs.get(&addr) {
            Some(&(len, k)) if k == kind => {
                allocs.remove(&addr);
                // SAFETY: allocated by alloc_raw with this size and alignment, removed from the
                // table, so freed once.
                unsafe { std::alloc::dealloc(addr as *mut u8, std::alloc::Layout::from_size_align_unchecked(len, ALIGN)) };
                Ok(())
            }
            _ => Err(DeviceError::UnknownPointer { addr }),
        }
    }
}

/// A stand-in stream: a thread that executes its queue in order.
#[derive(Debug)]
pub struct StandInStream {
    tx: Option<mpsc::Sender<Op>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for StandInStream {
    fn drop(&mut self) {
        // Closing the queue ends the thread after it has run what was queued.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, Default)]
struct EventState {
    /// Sequence number of the last record.
    recorded: AtomicU64,
    /// Sequence number of the last record the stream reached.
    done: Mutex<u64>,
    cv: Condvar,
}

/// A stand-in event: reusable, like a CUDA event.
#[derive(Debug, Default)]
pub struct StandInEvent(Arc<EventState>);

enum Op {
    Copy { kind: CopyKind, dst: usize, src: usize, len: usize },
    Signal(Arc<EventState>, u64),
}

fn stream_thread(rx: mpsc::Receiver<Op>, cfg: StandInConfig, log: Arc<Mutex<Vec<CopyRecord>>>) {
    for op in rx {
        match op {
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

    fn alloc(&self, len: usize) -> Result<DevicePtr> {
        self.alloc_raw(len, AllocKind::Device).map(DevicePtr)
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.free_raw(ptr.0, AllocKind::Device)
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        let p = self.alloc_raw(len, AllocKind::Pinned)?;
        // SAFETY: `len` bytes (at least 1) allocated above, valid until free_pinned.
        Ok(unsafe { PinnedMem::from_raw(p as *mut u8, len) })
    }

    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()> {
        self.free_raw(mem.addr(), AllocKind::Pinned)
    }

    fn pointer_kind(&self, addr: u64) -> Result<MemKind> {
        let allocs = lock(&self.inner.allocs);
        Ok(match allocs.range(..=addr).next_back() {
            Some((&base, &(len, kind))) if addr < base + len as u64 => match kind {
                AllocKind::Device => MemKind::Device { device: self.inner.id },
                AllocKind::Pinned => MemKind::Host,
            },
            _ => MemKind::Unregistered,
        })
    }

    fn create_stream(&self) -> Result<StandInStream> {
        let (tx, rx) = mpsc::channel();
        let (cfg, log) = (self.inner.cfg, self.inner.log.clone());
        let thread = std::thread::Builder::new()
            .name(format!("standin{}-stream", self.inner.id))
            .spawn(move || stream_thread(rx, cfg, log))
            .map_err(|_| DeviceError::StreamGone)?;
        Ok(StandInStream { tx: Some(tx), thread: Some(thread) })
    }

    fn create_event(&self) -> Result<StandInEvent> {
        Ok(StandInEvent::default())
    }

    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &StandInStream) -> Result<()> {
        stream.send(Op::Copy { kind, dst: dst as usize, src: src as usize, len })
    }

    fn record(&self, event: &StandInEvent, stream: &StandInStream) -> Result<()> {
        let seq = event.0.recorded.fetch_add(1, Ordering::SeqCst) + 1;
        stream.send(Op::Signal(event.0.clone(), seq))
    }

    fn query(&self, event: &StandInEvent) -> Result<bool> {
        Ok(*lock(&event.0.done) >= event.0.recorded.load(Ordering::SeqCst))
    }

    fn synchronize(&self, event: &StandInEvent) -> Result<()> {
        let want = event.0.recorded.load(Ordering::SeqCst);
        let mut d = lock(&event.0.done);
        while *d < want {
            d = event.0.cv.wait(d).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }
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
        assert!(matches!(dev.ipc_handle(d), Err(DeviceError::Unsupported { .. })));
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
}
