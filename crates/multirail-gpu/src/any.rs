//! One device type for the runtime: CUDA or the stand-in, chosen at run time.
//!
//! The runtime registers VRAM and stages it through one of these. Which kind is a per-process
//! choice (`MULTIRAIL_GPU=cuda|standin`, default `cuda`, or the agent's `gpu` config key): a
//! process has one view of "its GPUs", as it has with CUDA. Handles are opened once per
//! (kind, id) and shared, so the agent, the Python allocation helpers and the bench see the same
//! stand-in allocations.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::cuda::{Cuda, CudaEvent, CudaStream};
use crate::device::{BatchCopy, CopyKind, Device, DeviceError, DevicePtr, IpcHandle, MemKind, PinnedMem, Queued, Result};
use crate::standin::{StandIn, StandInConfig, StandInEvent, StandInStream};

/// Which device implementation a process uses for VRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum GpuKind {
    /// libcudart, loaded at run time.
    #[default]
    Cuda,
    /// Host memory posing as device memory, copies on threads (CI, tests).
    StandIn,
}

/// Environment variable naming the process's device kind.
pub const ENV_GPU: &str = "MULTIRAIL_GPU";
/// Stand-in copy rate in bytes/s for every direction (default: memcpy speed).
pub const ENV_STANDIN_RATE: &str = "MULTIRAIL_STANDIN_RATE";
/// Stand-in per-copy latency in microseconds (default 0).
pub const ENV_STANDIN_LATENCY_US: &str = "MULTIRAIL_STANDIN_LATENCY_US";

impl GpuKind {
    pub fn parse(s: &str) -> Option<GpuKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" => Some(GpuKind::Cuda),
            "standin" | "stand-in" => Some(GpuKind::StandIn),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            GpuKind::Cuda => "cuda",
            GpuKind::StandIn => "standin",
        }
    }

    /// `$MULTIRAIL_GPU`, or CUDA. An unknown value is an error, not a silent default.
    pub fn from_env() -> std::result::Result<GpuKind, String> {
        match std::env::var(ENV_GPU) {
            Ok(v) if !v.trim().is_empty() => GpuKind::parse(&v).ok_or_else(|| format!("{ENV_GPU}={v:?}: expected \"cuda\" or \"standin\"")),
            _ => Ok(GpuKind::Cuda),
        }
    }
}

/// A device of either kind. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Gpu {
    Cuda(Cuda),
    StandIn(StandIn),
}

#[derive(Debug)]
pub enum GpuStream {
    Cuda(CudaStream),
    StandIn(StandInStream),
}

#[derive(Debug)]
pub enum GpuEvent {
    Cuda(CudaEvent),
    StandIn(StandInEvent),
}

fn standin_config_from_env() -> StandInConfig {
    let rate = std::env::var(ENV_STANDIN_RATE).ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|r| *r > 0.0);
    let latency = std::env::var(ENV_STANDIN_LATENCY_US).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
    StandInConfig { d2h_rate: rate, h2d_rate: rate, d2d_rate: rate, latency: Duration::from_micros(latency), ipc_same_process: false }
}

fn opened() -> &'static Mutex<BTreeMap<(GpuKind, i32), Gpu>> {
    static OPENED: OnceLock<Mutex<BTreeMap<(GpuKind, i32), Gpu>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(BTreeMap::new()))
}

impl Gpu {
    /// Device `id` of `kind`, opened once per process (failures are not cached: a driver that
    /// comes up later is found then). The stand-in takes its rates from the environment
    /// ([`ENV_STANDIN_RATE`], [`ENV_STANDIN_LATENCY_US`]) when first opened.
    pub fn open(kind: GpuKind, id: i32) -> Result<Gpu> {
        let mut map = opened().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(g) = map.get(&(kind, id)) {
            return Ok(g.clone());
        }
        let g = match kind {
            GpuKind::Cuda => Gpu::Cuda(Cuda::open(id)?),
            GpuKind::StandIn => {
                let count = crate::standin::device_count();
                if !(0..count).contains(&id) {
                    return Err(DeviceError::BadDevice { id, count });
                }
                Gpu::StandIn(StandIn::new(id, standin_config_from_env()))
            }
        };
        map.insert((kind, id), g.clone());
        Ok(g)
    }

    pub fn kind(&self) -> GpuKind {
        match self {
            Gpu::Cuda(_) => GpuKind::Cuda,
            Gpu::StandIn(_) => GpuKind::StandIn,
        }
    }

    /// Ordinals of `kind` this process has opened (a context each, on CUDA), sorted.
    pub fn opened_devices(kind: GpuKind) -> Vec<i32> {
        let map = opened().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.keys().filter(|k| k.0 == kind).map(|k| k.1).collect()
    }

    /// Which image of the gather kernel the device runs, or why none (CUDA only: None on the
    /// stand-in, which copies without a kernel). Loads it on first call.
    pub fn gather_kernel(&self) -> Option<std::result::Result<String, String>> {
        match self {
            Gpu::Cuda(c) => Some(c.gather_kernel()),
            Gpu::StandIn(_) => None,
        }
    }

    /// The stand-in, when this is one (tests read its counters).
    pub fn as_standin(&self) -> Option<&StandIn> {
        match self {
            Gpu::StandIn(s) => Some(s),
            Gpu::Cuda(_) => None,
        }
    }
}

fn mismatch() -> DeviceError {
    DeviceError::Unsupported { op: "a stream or event of another device kind", device: "this" }
}

impl Device for Gpu {
    type Stream = GpuStream;
    type Event = GpuEvent;

    fn id(&self) -> i32 {
        match self {
            Gpu::Cuda(d) => d.id(),
            Gpu::StandIn(d) => d.id(),
        }
    }
    fn name(&self) -> String {
        match self {
            Gpu::Cuda(d) => d.name(),
            Gpu::StandIn(d) => d.name(),
        }
    }
    fn alloc(&self, len: usize) -> Result<DevicePtr> {
        match self {
            Gpu::Cuda(d) => d.alloc(len),
            Gpu::StandIn(d) => d.alloc(len),
        }
    }
    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.free(ptr),
                Gpu::StandIn(d) => d.free(ptr),
            }
        }
    }
    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        match self {
            Gpu::Cuda(d) => d.alloc_pinned(len),
            Gpu::StandIn(d) => d.alloc_pinned(len),
        }
    }
    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.free_pinned(mem),
                Gpu::StandIn(d) => d.free_pinned(mem),
            }
        }
    }
    fn pointer_kind(&self, addr: u64) -> Result<MemKind> {
        match self {
            Gpu::Cuda(d) => d.pointer_kind(addr),
            Gpu::StandIn(d) => d.pointer_kind(addr),
        }
    }
    fn create_stream(&self) -> Result<GpuStream> {
        Ok(match self {
            Gpu::Cuda(d) => GpuStream::Cuda(d.create_stream()?),
            Gpu::StandIn(d) => GpuStream::StandIn(d.create_stream()?),
        })
    }
    fn create_event(&self) -> Result<GpuEvent> {
        Ok(match self {
            Gpu::Cuda(d) => GpuEvent::Cuda(d.create_event()?),
            Gpu::StandIn(d) => GpuEvent::StandIn(d.create_event()?),
        })
    }
    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &GpuStream) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match (self, stream) {
                (Gpu::Cuda(d), GpuStream::Cuda(s)) => d.copy_async(kind, dst, src, len, s),
                (Gpu::StandIn(d), GpuStream::StandIn(s)) => d.copy_async(kind, dst, src, len, s),
                _ => Err(mismatch()),
            }
        }
    }
    unsafe fn copy_batch_async(&self, copies: &[BatchCopy], stream: &GpuStream) -> Result<Queued> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match (self, stream) {
                (Gpu::Cuda(d), GpuStream::Cuda(s)) => d.copy_batch_async(copies, s),
                (Gpu::StandIn(d), GpuStream::StandIn(s)) => d.copy_batch_async(copies, s),
                _ => Err(mismatch()),
            }
        }
    }
    unsafe fn copy_batch_pinned_async(&self, copies: &[BatchCopy], stream: &GpuStream) -> Result<Queued> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match (self, stream) {
                (Gpu::Cuda(d), GpuStream::Cuda(s)) => d.copy_batch_pinned_async(copies, s),
                (Gpu::StandIn(d), GpuStream::StandIn(s)) => d.copy_batch_pinned_async(copies, s),
                _ => Err(mismatch()),
            }
        }
    }
    fn record(&self, event: &GpuEvent, stream: &GpuStream) -> Result<()> {
        match (self, event, stream) {
            (Gpu::Cuda(d), GpuEvent::Cuda(e), GpuStream::Cuda(s)) => d.record(e, s),
            (Gpu::StandIn(d), GpuEvent::StandIn(e), GpuStream::StandIn(s)) => d.record(e, s),
            _ => Err(mismatch()),
        }
    }
    fn query(&self, event: &GpuEvent) -> Result<bool> {
        match (self, event) {
            (Gpu::Cuda(d), GpuEvent::Cuda(e)) => d.query(e),
            (Gpu::StandIn(d), GpuEvent::StandIn(e)) => d.query(e),
            _ => Err(mismatch()),
        }
    }
    fn synchronize(&self, event: &GpuEvent) -> Result<()> {
        match (self, event) {
            (Gpu::Cuda(d), GpuEvent::Cuda(e)) => d.synchronize(e),
            (Gpu::StandIn(d), GpuEvent::StandIn(e)) => d.synchronize(e),
            _ => Err(mismatch()),
        }
    }
    fn stream_synchronize(&self, stream: &GpuStream) -> Result<()> {
        match (self, stream) {
            (Gpu::Cuda(d), GpuStream::Cuda(s)) => d.stream_synchronize(s),
            (Gpu::StandIn(d), GpuStream::StandIn(s)) => d.stream_synchronize(s),
            _ => Err(mismatch()),
        }
    }
    fn record_external(&self, event: &GpuEvent, stream: u64) -> Result<()> {
        match (self, event) {
            (Gpu::Cuda(d), GpuEvent::Cuda(e)) => d.record_external(e, stream),
            (Gpu::StandIn(d), GpuEvent::StandIn(e)) => d.record_external(e, stream),
            _ => Err(mismatch()),
        }
    }
    fn stream_wait(&self, stream: &GpuStream, event: &GpuEvent) -> Result<()> {
        match (self, stream, event) {
            (Gpu::Cuda(d), GpuStream::Cuda(s), GpuEvent::Cuda(e)) => d.stream_wait(s, e),
            (Gpu::StandIn(d), GpuStream::StandIn(s), GpuEvent::StandIn(e)) => d.stream_wait(s, e),
            _ => Err(mismatch()),
        }
    }
    fn stream_handle(&self, stream: &GpuStream) -> u64 {
        match (self, stream) {
            (Gpu::Cuda(d), GpuStream::Cuda(s)) => d.stream_handle(s),
            (Gpu::StandIn(d), GpuStream::StandIn(s)) => d.stream_handle(s),
            _ => u64::MAX,
        }
    }
    fn alloc_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        match self {
            Gpu::Cuda(d) => d.alloc_range(ptr),
            Gpu::StandIn(d) => d.alloc_range(ptr),
        }
    }
    fn ipc_handle(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        match self {
            Gpu::Cuda(d) => d.ipc_handle(ptr),
            Gpu::StandIn(d) => d.ipc_handle(ptr),
        }
    }
    unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<DevicePtr> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.ipc_open(handle),
                Gpu::StandIn(d) => d.ipc_open(handle),
            }
        }
    }
    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.ipc_close(ptr),
                Gpu::StandIn(d) => d.ipc_close(ptr),
            }
        }
    }
    fn vmm_chunks(&self, ptr: DevicePtr, len: usize) -> Result<Vec<(DevicePtr, usize)>> {
        match self {
            Gpu::Cuda(d) => d.vmm_chunks(ptr, len),
            Gpu::StandIn(d) => d.vmm_chunks(ptr, len),
        }
    }
    fn vmm_export_fd(&self, base: DevicePtr) -> Result<std::os::fd::OwnedFd> {
        match self {
            Gpu::Cuda(d) => d.vmm_export_fd(base),
            Gpu::StandIn(d) => d.vmm_export_fd(base),
        }
    }
    fn vmm_reserve(&self, len: usize) -> Result<DevicePtr> {
        match self {
            Gpu::Cuda(d) => d.vmm_reserve(len),
            Gpu::StandIn(d) => d.vmm_reserve(len),
        }
    }
    unsafe fn vmm_map(&self, base: DevicePtr, offset: u64, len: usize, fd: std::os::fd::BorrowedFd<'_>) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.vmm_map(base, offset, len, fd),
                Gpu::StandIn(d) => d.vmm_map(base, offset, len, fd),
            }
        }
    }
    unsafe fn vmm_commit(&self, base: DevicePtr, len: usize, home: i32) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                Gpu::Cuda(d) => d.vmm_commit(base, len, home),
                Gpu::StandIn(d) => d.vmm_commit(base, len, home),
            }
        }
    }
    fn uuid(&self) -> Result<[u8; 16]> {
        match self {
            Gpu::Cuda(d) => d.uuid(),
            Gpu::StandIn(d) => d.uuid(),
        }
    }
    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        match self {
            Gpu::Cuda(d) => d.can_access_peer(peer),
            Gpu::StandIn(d) => d.can_access_peer(peer),
        }
    }
    fn enable_peer_access(&self, peer: i32) -> Result<()> {
        match self {
            Gpu::Cuda(d) => d.enable_peer_access(peer),
            Gpu::StandIn(d) => d.enable_peer_access(peer),
        }
    }
    fn stream_is_capturing(&self, stream: u64) -> Result<bool> {
        match self {
            Gpu::Cuda(d) => d.stream_is_capturing(stream),
            Gpu::StandIn(d) => d.stream_is_capturing(stream),
        }
    }
    fn dma_buf_supported(&self) -> Result<Option<bool>> {
        match self {
            Gpu::Cuda(d) => d.dma_buf_supported(),
            Gpu::StandIn(d) => d.dma_buf_supported(),
        }
    }
    fn rdma_writes_ordering(&self) -> Result<crate::RdmaWritesOrdering> {
        match self {
            Gpu::Cuda(d) => d.rdma_writes_ordering(),
            Gpu::StandIn(d) => d.rdma_writes_ordering(),
        }
    }
    fn flush_rdma_writes(&self) -> Result<()> {
        match self {
            Gpu::Cuda(d) => d.flush_rdma_writes(),
            Gpu::StandIn(d) => d.flush_rdma_writes(),
        }
    }
}

impl GpuKind {
    /// The UUID of every device of this kind this process sees, by ordinal, without making any
    /// of them current (no CUDA context is created). The stand-in's follow
    /// `MULTIRAIL_STANDIN_VISIBLE_DEVICES` (all `MULTIRAIL_STANDIN_DEVICES` ordinals when it is unset, as [`Gpu::open`] allows).
    pub fn device_uuids(self) -> Result<Vec<[u8; 16]>> {
        match self {
            GpuKind::Cuda => {
                let rt = crate::cuda::CudaRuntime::load(&crate::cuda::LoadOptions::from_env())?;
                (0..rt.device_count()?).map(|i| rt.device_uuid(i)).collect()
            }
            GpuKind::StandIn => {
                let visible = std::env::var(crate::standin::ENV_STANDIN_VISIBLE_DEVICES).ok();
                let count = crate::standin::device_count();
                let n = match visible.as_deref().map(str::trim).filter(|v| !v.is_empty()) {
                    Some(list) => (list.split(',').count() as i32).min(count),
                    None => count,
                };
                (0..n).map(|i| crate::standin::standin_physical(visible.as_deref(), i).map(crate::standin::standin_uuid)).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_standins_are_shared_per_process() {
        assert_eq!(GpuKind::parse("standin"), Some(GpuKind::StandIn));
        assert_eq!(GpuKind::parse(" CUDA "), Some(GpuKind::Cuda));
        assert_eq!(GpuKind::parse("rocm"), None);
        let a = Gpu::open(GpuKind::StandIn, 7).unwrap();
        let b = Gpu::open(GpuKind::StandIn, 7).unwrap();
        let p = a.alloc(4096).unwrap();
        // The same device: b knows a's allocation.
        assert_eq!(b.pointer_kind(p.0).unwrap(), MemKind::Device { device: 7 });
        assert!(matches!(Gpu::open(GpuKind::StandIn, 64), Err(DeviceError::BadDevice { .. })));
        // SAFETY: nothing uses it.
        unsafe { b.free(p).unwrap() };
    }

    #[test]
    fn staged_path_runs_on_the_enum() {
        let g = Gpu::open(GpuKind::StandIn, 8).unwrap();
        let src = g.alloc(100_000).unwrap();
        let dst = g.alloc(100_000).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: stand-in device memory is host memory of 100_000 bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.0 as *mut u8, data.len()) };
        let pool = crate::PoolConfig { buffers: 3, buffer_size: 16 << 10 };
        let (mut a, mut b) = crate::mem_pair(None);
        let mut tx = crate::Staged::new(g.clone(), crate::Role::Sender, pool).unwrap();
        let mut rx = crate::Staged::new(g.clone(), crate::Role::Receiver, pool).unwrap();
        let t = std::thread::spawn(move || {
            // SAFETY: src is a live 100_000-byte allocation nobody writes.
            unsafe { tx.send(src, 100_000, &mut a) }.unwrap();
        });
        // SAFETY: dst is a live 100_000-byte allocation nobody else touches.
        unsafe { rx.recv(dst, 100_000, &mut b) }.unwrap();
        t.join().unwrap();
        // SAFETY: host memory, all copies complete.
        let got = unsafe { std::slice::from_raw_parts(dst.0 as *const u8, 100_000) };
        assert_eq!(got, &data[..]);
    }
}
