//! The device interface the staged path runs against, and its errors.
//!
//! Two implementations: [`crate::Cuda`] (libcudart loaded at run time) and [`crate::StandIn`]
//! (host memory, copies on a thread per stream at a configurable rate), so that CI runs the
//! whole staged path and only the CUDA calls are left for a GPU machine.
//!
//! The model is CUDA's: copies are queued on a stream and run in order, asynchronously; an
//! event recorded on a stream completes when everything queued before it has; events are
//! created once and recorded many times (no allocation on the hot path).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::PathBuf;

/// An address in device memory (a CUDA device pointer; a host address on the stand-in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// `self + off` (the caller keeps it inside the allocation).
    pub fn offset(self, off: u64) -> DevicePtr {
        DevicePtr(self.0 + off)
    }
}

/// Page-locked host memory (`cudaMallocHost`): what copy engines DMA to and from, and what the
/// wire reads and writes. Freed with [`Device::free_pinned`].
#[derive(Debug, PartialEq, Eq)]
pub struct PinnedMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by whoever holds the value; no thread affinity.
unsafe impl Send for PinnedMem {}
// SAFETY: shared access only hands out raw pointers and `&[u8]` under the caller's contracts.
unsafe impl Sync for PinnedMem {}

impl PinnedMem {
    /// # Safety
    /// `ptr` must point to `len` bytes of host memory that stay valid until freed by the device
    /// that made it.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        PinnedMem { ptr, len }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address, as a copy source or destination.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// # Safety
    /// No copy may be writing this memory (its event has completed).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for `len` bytes (constructor contract); no concurrent writer (caller).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No copy may be reading or writing this memory (its event has completed).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: valid for `len` bytes; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One copy of [`Device::copy_batch_async`]: (kind, dst, src, len).
pub type BatchCopy = (CopyKind, u64, u64, usize);

/// How [`Device::copy_batch_async`] queued a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyHow {
    /// One copy call per copy (`cudaMemcpyAsync`).
    PerCopy,
    /// `cudaMemcpyBatchAsync` (CUDA 12.8+).
    Batch,
    /// One launch of the gather-copy kernel (`crate::gather`).
    Kernel,
}

impl CopyHow {
    pub fn describe(self) -> &'static str {
        match self {
            CopyHow::PerCopy => "one copy call per copy",
            CopyHow::Batch => "cudaMemcpyBatchAsync",
            CopyHow::Kernel => "gather-copy kernel",
        }
    }
}

/// What [`Device::copy_batch_async`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    /// Device API calls made.
    pub calls: usize,
    pub how: CopyHow,
    /// Why a faster way was not taken, when one was wanted and could not be used.
    pub note: Option<String>,
}

/// Direction of an asynchronous copy (`cudaMemcpyKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// What an address is, as `cudaPointerGetAttributes` classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Not known to the device: ordinary pageable host memory.
    Unregistered,
    /// Page-locked host memory.
    Host,
    /// Device memory (of `device`).
    Device { device: i32 },
    /// Unified (managed) memory.
    Managed { device: i32 },
}

/// A CUDA IPC handle: lets another process on the same host map a device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

/// How to install the CUDA runtime when it is missing.
pub const INSTALL_HINT: &str = "install the CUDA runtime with `pip install nvidia-cuda-runtime-cu12` (into the .venv) or the system CUDA toolkit, or set MULTIRAIL_CUDART to a libcudart.so";

/// Errors of the device layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// No libcudart could be loaded from the wheel directories or the system.
    #[error("CUDA runtime (libcudart) not found; tried: {tried}; {hint}", hint = INSTALL_HINT)]
    NotFound { tried: String },
    /// The library named by MULTIRAIL_CUDART cannot be loaded. No other library is tried.
    #[error("cannot load the libcudart named by MULTIRAIL_CUDART ({}): {reason}; fix the path or unset it", path.display())]
    ExplicitLoad { path: PathBuf, reason: String },
    /// The library lacks a function these bindings need: not a libcudart, or too old (< 11).
    #[error("{} is not a usable libcudart: symbol {symbol} is missing ({reason})", path.display())]
    MissingSymbol { path: PathBuf, symbol: &'static str, reason: String },
    /// The runtime loaded but there is no usable GPU (no device, no driver, driver too old).
    #[error("no usable GPU: {reason} (libcudart {}); VRAM cannot be used on this machine", lib.display())]
    NoDevice { lib: PathBuf, reason: String },
    /// A device id beyond `cudaGetDeviceCount`.
    #[error("GPU {id} does not exist: this machine has {count}")]
    BadDevice { id: i32, count: i32 },
    /// A CUDA call failed.
    #[error("{op} failed: {name} ({code}): {message}")]
    Cuda { op: &'static str, code: i32, name: String, message: String },
    /// The stand-in could not allocate host memory for a "device" or pinned allocation.
    #[error("cannot allocate {len} bytes of host memory for the stand-in device")]
    HostAlloc { len: usize },
    /// `free` of an address this device did not allocate.
    #[error("{addr:#x} was not allocated by this device (or was freed already)")]
    UnknownPointer { addr: u64 },
    /// The stand-in's copy thread for a stream is gone (it panicked).
    #[error("the stand-in copy thread of a stream stopped")]
    StreamGone,
    /// A stream handle that names no stream of this device.
    #[error("stream handle {handle:#x} is not a stream of this device")]
    UnknownStream { handle: u64 },
    /// A failure injected into the stand-in (tests of error paths).
    #[error("injected stand-in failure: {op}")]
    Injected { op: &'static str },
    /// The device does not implement this operation.
    #[error("{op} is not supported by the {device} device")]
    Unsupported { op: &'static str, device: &'static str },
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// A GPU, as the staged path needs it (module docs). Order of calls: allocate the bounce pool
/// once ([`Device::alloc_pinned`]), create a stream and one event per buffer, then per chunk
/// [`Device::copy_async`] + [`Device::record`], and [`Device::query`] or
/// [`Device::synchronize`] before touching the buffer.
pub trait Device: Send + Sync {
    /// An in-order queue of copies.
    type Stream: Send;
    /// A marker recorded on a stream; reusable.
    type Event: Send;

    /// Ordinal of the device (`cudaSetDevice`).
    fn id(&self) -> i32;
    /// Human-readable name ("NVIDIA H100 80GB HBM3", "stand-in").
    fn name(&self) -> String;

    /// Allocates device memory (tests and benchmarks; applications bring their own).
    fn alloc(&self, len: usize) -> Result<DevicePtr>;
    /// Frees memory from [`Device::alloc`].
    ///
    /// # Safety
    /// No copy may still use it.
    unsafe fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// Allocates page-locked host memory (the bounce pool).
    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem>;
    /// Frees memory from [`Device::alloc_pinned`].
    ///
    /// # Safety
    /// No copy may still use it.
    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()>;
    /// Classifies an address (device, pinned host, managed, or plain host memory).
    fn pointer_kind(&self, addr: u64) -> Result<MemKind>;

    fn create_stream(&self) -> Result<Self::Stream>;
    fn create_event(&self) -> Result<Self::Event>;
    /// Queues a copy of `len` bytes from `src` to `dst` on `stream` and returns at once.
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes of the kinds `kind` names, must not overlap,
    /// and must stay valid and untouched by anything else until an event recorded after the copy
    /// has completed.
    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &Self::Stream) -> Result<()>;
    /// Queues every copy of `copies` (kind, dst, src, len) on `stream` and returns at once: what
    /// an event recorded after it waits for is all of them. Says how it queued them and in how
    /// many device API calls (the default: one `copy_async` per copy; CUDA has faster ways for
    /// many device-to-device copies, [`crate::Cuda`]). The copies must not overlap one another.
    ///
    /// # Safety
    /// As [`Device::copy_async`], for every copy.
    unsafe fn copy_batch_async(&self, copies: &[BatchCopy], stream: &Self::Stream) -> Result<Queued> {
        for &(kind, dst, src, len) in copies {
            // SAFETY: the caller's contract, per copy.
            unsafe { self.copy_async(kind, dst, src, len, stream) }?;
        }
        Ok(Queued { calls: copies.len(), how: CopyHow::PerCopy, note: None })
    }
    /// [`Device::copy_batch_async`] where every host side lies in memory from
    /// [`Device::alloc_pinned`] (a staging buffer): a device that can reach pinned memory
    /// directly may copy them all in one kernel launch (CUDA with unified addressing does).
    ///
    /// # Safety
    /// As [`Device::copy_batch_async`], and every host range lies in pinned memory of this
    /// device's kind that stays allocated until the copies complete.
    unsafe fn copy_batch_pinned_async(&self, copies: &[BatchCopy], stream: &Self::Stream) -> Result<Queued> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_batch_async(copies, stream) }
    }
    /// Records `event` on `stream`: it completes when everything queued before it has.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// Has the event completed (an event never recorded counts as complete)?
    fn query(&self, event: &Self::Event) -> Result<bool>;
    /// Blocks until the event has completed.
    fn synchronize(&self, event: &Self::Event) -> Result<()>;
    /// Blocks until everything queued on `stream` has completed, whether or not an event was
    /// recorded after it (error and drop paths: a copy whose event record failed still runs).
    fn stream_synchronize(&self, stream: &Self::Stream) -> Result<()>;
    /// Records `event` on an application's stream, given by its raw handle (a `cudaStream_t`;
    /// 0 is the device's legacy default stream): the event completes when the work the
    /// application queued there before this call has. How a transfer orders itself after the
    /// producer of its data (docs/gpu.md, "The stream contract").
    fn record_external(&self, event: &Self::Event, stream: u64) -> Result<()>;
    /// Makes `stream` wait (on the device, without blocking the host) until `event` completes.
    fn stream_wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;
    /// The raw handle of one of our streams, as [`Device::record_external`] takes it.
    fn stream_handle(&self, stream: &Self::Stream) -> u64;

    /// The allocation that contains `ptr`: its base and length (`cuMemGetAddressRange`). An IPC
    /// handle maps a whole allocation, so a tensor inside a larger block (PyTorch's caching
    /// allocator) is found at `ptr - base` in the peer's mapping.
    fn alloc_range(&self, _ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        Err(DeviceError::Unsupported { op: "alloc_range", device: "this" })
    }
    /// An IPC handle for the device allocation whose base is `ptr`, for another process on
    /// this host.
    fn ipc_handle(&self, _ptr: DevicePtr) -> Result<IpcHandle> {
        Err(DeviceError::Unsupported { op: "ipc_handle", device: "this" })
    }
    /// Maps a peer process's allocation.
    ///
    /// # Safety
    /// The handle must come intact from a live allocation of a peer process.
    unsafe fn ipc_open(&self, _handle: &IpcHandle) -> Result<DevicePtr> {
        Err(DeviceError::Unsupported { op: "ipc_open", device: "this" })
    }
    /// Unmaps what [`Device::ipc_open`] mapped.
    ///
    /// # Safety
    /// No copy may still use the mapping.
    unsafe fn ipc_close(&self, _ptr: DevicePtr) -> Result<()> {
        Err(DeviceError::Unsupported { op: "ipc_close", device: "this" })
    }
    /// The chunks of a CUDA VMM allocation (`cuMemCreate` + `cuMemMap`: PyTorch's expandable
    /// segments, VMM allocators) that back `len` bytes at `ptr`, in address order, each as its
    /// mapping's base and size (`cuMemGetAddressRange` gives a VMM mapping's): what
    /// [`Device::vmm_export_fd`] exports when `cudaIpcGetMemHandle` cannot. Err says why not:
    /// not VMM memory (e.g. a `cudaMallocAsync` pool's), created without the POSIX file
    /// descriptor handle type, or a hole in the range.
    fn vmm_chunks(&self, _ptr: DevicePtr, _len: usize) -> Result<Vec<(DevicePtr, usize)>> {
        Err(DeviceError::Unsupported { op: "vmm_chunks", device: "this" })
    }
    /// The VMM chunk mapped at `base` as a shareable file descriptor
    /// (`cuMemRetainAllocationHandle` + `cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)`),
    /// for another process on this host.
    fn vmm_export_fd(&self, _base: DevicePtr) -> Result<OwnedFd> {
        Err(DeviceError::Unsupported { op: "vmm_export_fd", device: "this" })
    }
    /// Reserves `len` bytes of address space for a peer's VMM allocation
    /// (`cuMemAddressReserve`); its chunks are mapped with [`Device::vmm_map`], then
    /// [`Device::vmm_commit`]. [`Device::ipc_close`] undoes it at any stage.
    fn vmm_reserve(&self, _len: usize) -> Result<DevicePtr> {
        Err(DeviceError::Unsupported { op: "vmm_reserve", device: "this" })
    }
    /// Maps the chunk exported as `fd` (`len` bytes) at `base + offset` of a reservation
    /// (`cuMemImportFromShareableHandle` + `cuMemMap`). The fd stays the caller's.
    ///
    /// # Safety
    /// `base` comes from [`Device::vmm_reserve`] and `offset + len` lies inside it, unmapped.
    unsafe fn vmm_map(&self, _base: DevicePtr, _offset: u64, _len: usize, _fd: BorrowedFd<'_>) -> Result<()> {
        Err(DeviceError::Unsupported { op: "vmm_map", device: "this" })
    }
    /// Makes a reservation whose chunks are all mapped usable by this device
    /// (`cuMemSetAccess` read-write for this device: the local buffer's, where the copies
    /// run); `home` is the device (of this process) whose memory it is.
    ///
    /// # Safety
    /// `base` comes from [`Device::vmm_reserve`] of `len` bytes, every byte of it mapped.
    unsafe fn vmm_commit(&self, _base: DevicePtr, _len: usize, _home: i32) -> Result<()> {
        Err(DeviceError::Unsupported { op: "vmm_commit", device: "this" })
    }
    /// The device's UUID (`cudaDeviceProp.uuid`): one physical GPU has the same UUID in every
    /// process, whatever its ordinal there (`CUDA_VISIBLE_DEVICES` differs per process), so a
    /// peer's IPC handle is opened on the local device with the exporter's UUID.
    fn uuid(&self) -> Result<[u8; 16]> {
        Err(DeviceError::Unsupported { op: "uuid", device: "this" })
    }
    /// Whether kernels on this device can reach device `peer`'s memory once peer access is
    /// enabled (`cudaDeviceCanAccessPeer`). The default: only its own.
    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        Ok(peer == self.id())
    }
    /// Enables peer access from this device to `peer` (`cudaDeviceEnablePeerAccess`); enabling
    /// it again is not an error.
    fn enable_peer_access(&self, _peer: i32) -> Result<()> {
        Err(DeviceError::Unsupported { op: "enable_peer_access", device: "this" })
    }
    /// Whether the raw stream `stream` of this device is being captured into a graph
    /// (`cudaStreamIsCapturing`).
    fn stream_is_capturing(&self, _stream: u64) -> Result<bool> {
        Ok(false)
    }
    /// Whether the device can export its memory as dma-buf, the GPUDirect RDMA registration of
    /// the open kernel module (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`); None where the driver
    /// cannot be asked.
    fn dma_buf_supported(&self) -> Result<Option<bool>> {
        Ok(None)
    }
    /// How GPUDirect RDMA writes into this device's memory are ordered against its own later
    /// reads (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`).
    fn rdma_writes_ordering(&self) -> Result<RdmaWritesOrdering> {
        Err(DeviceError::Unsupported { op: "rdma_writes_ordering", device: "this" })
    }
    /// Makes the GPUDirect RDMA writes that reached this device so far visible to the work that
    /// reads them next (`cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER)` with the
    /// device's context current). Needed only where [`Device::rdma_writes_ordering`] says
    /// [`RdmaWritesOrdering::None`].
    fn flush_rdma_writes(&self) -> Result<()> {
        Err(DeviceError::Unsupported { op: "flush_rdma_writes", device: "this" })
    }
}

/// `CUGPUDirectRDMAWritesOrdering`: whether the device orders GPUDirect RDMA writes into its
/// memory before its own later accesses, or a flush must.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaWritesOrdering {
    /// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE` (0): no native ordering; flush before the
    /// device's work reads what a NIC wrote.
    None,
    /// `..._OWNER` (100): ordered for the device's own work.
    Owner,
    /// `..._ALL_DEVICES` (200): ordered for every device.
    AllDevices,
}

impl RdmaWritesOrdering {
    /// From the attribute's value; an unknown one counts as no ordering (flushing is safe).
    pub fn from_attr(v: i32) -> Self {
        match v {
            200 => RdmaWritesOrdering::AllDevices,
            100 => RdmaWritesOrdering::Owner,
            _ => RdmaWritesOrdering::None,
        }
    }

    /// Whether a flush must make a NIC's writes visible (the attribute is neither OWNER nor
    /// ALL_DEVICES).
    pub fn needs_flush(self) -> bool {
        self == RdmaWritesOrdering::None
    }
}

/// A device UUID as `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}
