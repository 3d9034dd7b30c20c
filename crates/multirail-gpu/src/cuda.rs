//! The CUDA device: libcudart **loaded at run time** (`dlopen` via libloading), so the crate
//! builds, and the program starts, on machines without CUDA; [`Cuda::open`] then returns a
//! typed error that names the cause and how to fix it.
//!
//! Search order ([`LoadOptions::candidates`]):
//! 1. `MULTIRAIL_CUDART`: a path to a libcudart. If set, nothing else is tried.
//! 2. The `nvidia-cuda-runtime` wheels under each directory of `MULTIRAIL_CUDA_WHEEL_DIRS`
//!    (`:`-separated python site-packages dirs, e.g. the .venv's):
//!    `nvidia/cuda_runtime/lib/libcudart.so.12` (cu12 wheel), `nvidia/cu13/lib/libcudart.so.13`
//!    (CUDA 13 wheel layout).
//! 3. The system sonames `libcudart.so.12`, `libcudart.so.13`, `libcudart.so` (ld.so's search).
//!
//! Then `cudaGetDeviceCount` decides whether there is a usable GPU ([`DeviceError::NoDevice`]
//! carries CUDA's own error string: no device, no driver, driver older than the runtime).
//!
//! A candidate is taken only if its runtime major version is at most the driver's
//! ([`runtime_fits_driver`]: `cudaRuntimeGetVersion` against `cudaDriverGetVersion`): a CUDA 13
//! runtime on a CUDA 12 driver is skipped, with the reason kept, and the next candidate tried.
//!
//! Choices: streams are created non-blocking (`cudaStreamCreateWithFlags(cudaStreamNonBlocking)`,
//! so staging never synchronises with work on the legacy default stream; ordering with the
//! application's streams is explicit, see [`crate::Device::record_external`]), events without
//! timing and with blocking sync (`cudaEventDisableTiming | cudaEventBlockingSync`: cheapest
//! record/query, and a thread waiting in `cudaEventSynchronize` sleeps instead of spinning).
//!
//! **The caller's current device is never changed.** CUDA's current device is per host thread,
//! and these calls run on application threads too (registration, the tcp send path, `wait`).
//! Every call that depends on it runs inside [`Cuda::enter`]: the device's primary context is
//! made current through the driver API (`cuCtxGetCurrent` / `cuCtxSetCurrent`, with the context
//! retained once at open) and the thread's previous context, possibly none, is put back when the
//! guard drops. The runtime's own per-thread device (what `cudaGetDevice` falls back to with no
//! context current) is never touched, so no context is created on a device the application did
//! not use. Without the driver symbols, `cudaGetDevice`/`cudaSetDevice` save and restore it.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::Library;

use crate::device::{
    BatchCopy, CopyHow, CopyKind, Device, DeviceError, DevicePtr, IpcHandle, MemKind, PinnedMem, Queued, RdmaWritesOrdering, Result,
};

/// Environment variable naming a libcudart explicitly.
pub const ENV_CUDART: &str = "MULTIRAIL_CUDART";
/// Environment variable listing python site-packages directories to search for the wheels.
pub const ENV_WHEEL_DIRS: &str = "MULTIRAIL_CUDA_WHEEL_DIRS";
/// Where the wheels put libcudart, relative to a site-packages directory.
pub const WHEEL_PATHS: [&str; 2] = ["nvidia/cuda_runtime/lib/libcudart.so.12", "nvidia/cu13/lib/libcudart.so.13"];
/// System sonames, in order.
pub const SYSTEM_SONAMES: [&str; 3] = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"];

type Err = c_int;
type Stream = *mut c_void;
type Event = *mut c_void;

const SUCCESS: Err = 0;
const ERROR_NOT_READY: Err = 600;
const MEMCPY_H2D: c_int = 1;
const MEMCPY_D2H: c_int = 2;
const MEMCPY_D2D: c_int = 3;
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_BLOCKING_SYNC: c_uint = 1;
const EVENT_DISABLE_TIMING: c_uint = 2;
/// Every event: blocking sync (waiters sleep), no timing.
const EVENT_FLAGS: c_uint = EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING;
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// Bytes reserved for `cudaDeviceProp` (about 1 KiB in CUDA 12 and 13; `name` comes first).
const DEVICE_PROP_BYTES: usize = 8192;

/// `cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr)`.
type AddressRange = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;
type Ctx = *mut c_void;

/// The few driver-API calls the runtime API lacks (libcuda.so.1, present wherever a driver is),
/// loaded once. Every field is optional: an old or odd driver just loses that feature.
struct DriverApi {
    /// `cuMemGetAddressRange_v2`: an allocation's base and size.
    address_range: Option<AddressRange>,
    /// `cuInit(unsigned)`.
    init: Option<unsafe extern "C" fn(c_uint) -> c_int>,
    /// `cuDeviceGet(CUdevice*, int ordinal)`.
    device_get: Option<unsafe extern "C" fn(*mut c_int, c_int) -> c_int>,
    /// `cuDevicePrimaryCtxRetain(CUcontext*, CUdevice)`.
    primary_ctx_retain: Option<unsafe extern "C" fn(*mut Ctx, c_int) -> c_int>,
    /// `cuCtxGetCurrent(CUcontext*)`.
    ctx_get_current: Option<unsafe extern "C" fn(*mut Ctx) -> c_int>,
    /// `cuCtxSetCurrent(CUcontext)`.
    ctx_set_current: Option<unsafe extern "C" fn(Ctx) -> c_int>,
    /// `cuPointerGetAttribute(void*, CUpointer_attribute, CUdeviceptr)`: classifies an address
    /// without a current context (the runtime's `cudaPointerGetAttributes` makes one).
    pointer_get_attribute: Option<unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int>,
    /// `cuDeviceGetAttribute(int*, CUdevice_attribute, CUdevice)`.
    device_get_attribute: Option<unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int>,
    /// `cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope)`.
    flush_gpudirect_rdma_writes: Option<unsafe extern "C" fn(c_int, c_int) -> c_int>,
    /// The CUDA VMM calls that export and import memory legacy IPC cannot (`Cuda::vmm_*`).
    vmm: Option<VmmApi>,
    _lib: Library,
}

/// `CUmemGenericAllocationHandle`.
type MemHandle = u64;

/// The CUDA VMM driver calls (CUDA 10.2+; all or none), prototypes as in cuda.h.
struct VmmApi {
    /// `cuMemRetainAllocationHandle(CUmemGenericAllocationHandle*, void* addr)`.
    retain: unsafe extern "C" fn(*mut MemHandle, *mut c_void) -> c_int,
    /// `cuMemRelease(CUmemGenericAllocationHandle)`.
    release: unsafe extern "C" fn(MemHandle) -> c_int,
    /// `cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp*, handle)`.
    properties: unsafe extern "C" fn(*mut c_void, MemHandle) -> c_int,
    /// `cuMemExportToShareableHandle(void* out, handle, CUmemAllocationHandleType, flags)`.
    export: unsafe extern "C" fn(*mut c_void, MemHandle, c_int, u64) -> c_int,
    /// `cuMemImportFromShareableHandle(CUmemGenericAllocationHandle*, void* osHandle, type)`.
    import: unsafe extern "C" fn(*mut MemHandle, *mut c_void, c_int) -> c_int,
    /// `cuMemAddressReserve(CUdeviceptr*, size_t size, size_t alignment, CUdeviceptr addr, flags)`.
    reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> c_int,
    /// `cuMemAddressFree(CUdeviceptr, size_t)`.
    address_free: unsafe extern "C" fn(u64, usize) -> c_int,
    /// `cuMemMap(CUdeviceptr, size_t size, size_t offset, handle, flags)`.
    map: unsafe extern "C" fn(u64, usize, usize, MemHandle, u64) -> c_int,
    /// `cuMemUnmap(CUdeviceptr, size_t)`.
    unmap: unsafe extern "C" fn(u64, usize) -> c_int,
    /// `cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t count)`.
    set_access: unsafe extern "C" fn(u64, usize, *const MemAccessDesc, usize) -> c_int,
}

/// `CUmemAccessDesc`: `CUmemLocation { type, id }` then the access flags.
#[repr(C)]
struct MemAccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const ACCESS_READWRITE: c_int = 3;
/// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`: the pool of stream-ordered memory, else null.
const ATTR_MEMPOOL_HANDLE: c_int = 17;
/// Bytes reserved for `CUmemAllocationProp` (32 in CUDA 12 and 13); `requestedHandleTypes`,
/// an int, is at offset 4.
const ALLOCATION_PROP_BYTES: usize = 128;

/// A peer's VMM allocation mapped here: reservation length, chunks mapped (offset, length).
type VmmImports = std::sync::Mutex<std::collections::BTreeMap<u64, (usize, Vec<(u64, usize)>)>>;

/// Every VMM import of the process, by reservation base (`Cuda::ipc_close` finds them here).
fn vmm_imports() -> &'static VmmImports {
    static V: std::sync::OnceLock<VmmImports> = std::sync::OnceLock::new();
    V.get_or_init(Default::default)
}

fn driver_err(op: &'static str, rc: c_int, message: String) -> DeviceError {
    DeviceError::Cuda { op, code: rc, name: format!("CUresult {rc}"), message }
}

fn driver() -> Option<&'static DriverApi> {
    static F: std::sync::OnceLock<Option<DriverApi>> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        // SAFETY: loading the CUDA driver library runs its initialisers, which are benign (no
        // driver work happens before the first call).
        let lib = unsafe { Library::new("libcuda.so.1") }.ok()?;
        macro_rules! opt {
            ($name:literal) => {
                // SAFETY: the field's type is this symbol's prototype in cuda.h.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }.ok().map(|s| *s)
            };
        }
        Some(DriverApi {
            address_range: opt!("cuMemGetAddressRange_v2"),
            init: opt!("cuInit"),
            device_get: opt!("cuDeviceGet"),
            primary_ctx_retain: opt!("cuDevicePrimaryCtxRetain"),
            ctx_get_current: opt!("cuCtxGetCurrent"),
            ctx_set_current: opt!("cuCtxSetCurrent"),
            pointer_get_attribute: opt!("cuPointerGetAttribute"),
            device_get_attribute: opt!("cuDeviceGetAttribute"),
            flush_gpudirect_rdma_writes: opt!("cuFlushGPUDirectRDMAWrites"),
            vmm: (|| {
                Some(VmmApi {
                    retain: opt!("cuMemRetainAllocationHandle")?,
                    release: opt!("cuMemRelease")?,
                    properties: opt!("cuMemGetAllocationPropertiesFromHandle")?,
                    export: opt!("cuMemExportToShareableHandle")?,
                    import: opt!("cuMemImportFromShareableHandle")?,
                    reserve: opt!("cuMemAddressReserve")?,
                    address_free: opt!("cuMemAddressFree")?,
                    map: opt!("cuMemMap")?,
                    unmap: opt!("cuMemUnmap")?,
                    set_access: opt!("cuMemSetAccess")?,
                })
            })(),
            _lib: lib,
        })
    })
    .as_ref()
}

/// A retained primary context (never released: it lives as long as the process's use of the
/// device, like the runtime's own).
#[derive(Debug, Clone, Copy)]
struct PrimaryCtx(Ctx);
// SAFETY: a CUcontext handle may be made current on any thread.
unsafe impl Send for PrimaryCtx {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for PrimaryCtx {}

/// Retains device `id`'s primary context through the driver API (what the runtime uses too).
fn retain_primary(id: i32) -> Option<PrimaryCtx> {
    let d = driver()?;
    let (init, get, retain) = (d.init?, d.device_get?, d.primary_ctx_retain?);
    d.ctx_get_current?;
    d.ctx_set_current?;
    let (mut dev, mut ctx): (c_int, Ctx) = (0, std::ptr::null_mut());
    // SAFETY: plain calls with valid out-pointers; cuInit is idempotent.
    let ok = unsafe { init(0) == 0 && get(&mut dev, id) == 0 && retain(&mut ctx, dev) == 0 };
    (ok && !ctx.is_null()).then_some(PrimaryCtx(ctx))
}

/// The oldest CUDA 13 runtime version number (`cudaRuntimeGetVersion`: 1000 x major + 10 x minor).
pub const CUDA_13: i32 = 13000;

/// Whether a runtime of version `runtime` can run on a driver that supports up to `driver`
/// (both as `cudaRuntimeGetVersion` / `cudaDriverGetVersion` report them). CUDA's minor-version
/// compatibility lets any 12.x runtime run on any 12.x driver (and newer), but never a runtime
/// of a newer major version than the driver's; a driver version of 0 means no driver.
pub fn runtime_fits_driver(runtime: i32, driver: i32) -> std::result::Result<(), String> {
    let v = |x: i32| format!("{}.{}", x / 1000, (x % 1000) / 10);
    if driver <= 0 {
        return Err("no CUDA driver is installed (cudaDriverGetVersion reports 0)".into());
    }
    if runtime <= 0 {
        return Err("the runtime reports no version".into());
    }
    if runtime / 1000 > driver / 1000 {
        return Err(format!("runtime {} needs a CUDA {} driver; this driver supports CUDA {}", v(runtime), runtime / 1000, v(driver)));
    }
    Ok(())
}

/// `cudaPointerAttributes`, sized for every runtime the loader accepts: CUDA 11 and 12 write
/// the first four fields (24 bytes); CUDA 13 adds `long reserved[8]` and writes all 88 bytes.
/// A 24-byte struct on a CUDA 13 runtime is a 64-byte stack overflow.
#[repr(C)]
struct PointerAttributes {
    kind: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    /// CUDA 13's `long reserved[8]`.
    reserved: [std::ffi::c_long; 8],
}

impl PointerAttributes {
    fn zeroed() -> Self {
        PointerAttributes {
            kind: 0,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            reserved: [0; 8],
        }
    }
}

/// `cudaMemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `cudaMemcpyAttributes` (CUDA 12.8 and later; the same in 13): 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemcpyAttributes {
    src_access_order: c_int,
    src_loc_hint: MemLocation,
    dst_loc_hint: MemLocation,
    flags: c_uint,
}

/// `cudaMemcpySrcAccessOrderStream`: the source is read in stream order, like `cudaMemcpyAsync`.
const SRC_ACCESS_ORDER_STREAM: c_int = 1;
/// Copies per `cudaMemcpyBatchAsync` call (the arrays are built per call).
const BATCH_MAX: usize = 8192;
/// How a batch of device-to-device copies is queued ([`CopyMode`]): `auto` (the default),
/// `kernel`, `batch` or `loop`.
pub const ENV_CUDA_COPY: &str = "MULTIRAIL_CUDA_COPY";
/// `auto` takes the gather kernel for batches whose pieces average at most this many bytes; the
/// copy engines for larger ones (they move big copies as fast and leave the SMs alone).
pub const KERNEL_MAX_AVG_PIECE: usize = 1 << 20;

/// How [`Device::copy_batch_async`] queues two or more device-to-device copies
/// (`MULTIRAIL_CUDA_COPY`). Whatever is chosen falls back to the next way down when it cannot be
/// used (kernel, then `cudaMemcpyBatchAsync`, then one `cudaMemcpyAsync` per copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMode {
    /// The kernel for small pieces (average at most [`KERNEL_MAX_AVG_PIECE`]), else the batch call.
    Auto,
    /// The kernel for every batch.
    Kernel,
    /// `cudaMemcpyBatchAsync`, never the kernel.
    Batch,
    /// One `cudaMemcpyAsync` per copy.
    Loop,
}

impl CopyMode {
    /// From `MULTIRAIL_CUDA_COPY` (unset or unknown: `Auto`).
    pub fn from_env() -> CopyMode {
        match std::env::var(ENV_CUDA_COPY).unwrap_or_default().trim() {
            "kernel" => CopyMode::Kernel,
            "batch" => CopyMode::Batch,
            "loop" => CopyMode::Loop,
            _ => CopyMode::Auto,
        }
    }
}

/// CUDA 12.8-12.9: `cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count,
/// cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
/// cudaStream_t stream)`.
type Batch12 = unsafe extern "C" fn(
    *mut *mut c_void,
    *mut *mut c_void,
    *mut usize,
    usize,
    *mut MemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    Stream,
) -> Err;
/// CUDA 13: the same without `failIdx`.
type Batch13 =
    unsafe extern "C" fn(*mut *mut c_void, *mut *mut c_void, *mut usize, usize, *mut MemcpyAttributes, *mut usize, usize, Stream) -> Err;

/// `cudaMemcpyBatchAsync` in the prototype of the loaded runtime's version.
#[derive(Clone, Copy)]
enum MemcpyBatch {
    V12(Batch12),
    V13(Batch13),
}

impl MemcpyBatch {
    /// The batch call of a runtime of version `rv`, if it has one (12.8 and later).
    ///
    /// # Safety
    /// `lib` is a libcudart of version `rv`: the prototype is chosen by that version.
    unsafe fn load(lib: &Library, rv: c_int) -> Option<MemcpyBatch> {
        const NAME: &[u8] = b"cudaMemcpyBatchAsync\0";
        // SAFETY: the caller's contract; the type is that version's prototype.
        unsafe {
            if rv >= 13000 {
                lib.get::<Batch13>(NAME).ok().map(|f| MemcpyBatch::V13(*f))
            } else if rv >= 12080 {
                lib.get::<Batch12>(NAME).ok().map(|f| MemcpyBatch::V12(*f))
            } else {
                None
            }
        }
    }
}

/// `cudaIpcMemHandle_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcMemHandle {
    reserved: [c_char; 64],
}

/// The libcudart functions used, resolved once.
struct Api {
    get_device_count: unsafe extern "C" fn(*mut c_int) -> Err,
    get_device: unsafe extern "C" fn(*mut c_int) -> Err,
    set_device: unsafe extern "C" fn(c_int) -> Err,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> Err,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> Err,
    stream_synchronize: unsafe extern "C" fn(Stream) -> Err,
    stream_wait_event: unsafe extern "C" fn(Stream, Event, c_uint) -> Err,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Err,
    free: unsafe extern "C" fn(*mut c_void) -> Err,
    malloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> Err,
    free_host: unsafe extern "C" fn(*mut c_void) -> Err,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> Err,
    stream_create_with_flags: unsafe extern "C" fn(*mut Stream, c_uint) -> Err,
    stream_destroy: unsafe extern "C" fn(Stream) -> Err,
    event_create_with_flags: unsafe extern "C" fn(*mut Event, c_uint) -> Err,
    event_record: unsafe extern "C" fn(Event, Stream) -> Err,
    event_query: unsafe extern "C" fn(Event) -> Err,
    event_synchronize: unsafe extern "C" fn(Event) -> Err,
    event_destroy: unsafe extern "C" fn(Event) -> Err,
    pointer_get_attributes: unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> Err,
    ipc_get_mem_handle: unsafe extern "C" fn(*mut IpcMemHandle, *mut c_void) -> Err,
    ipc_open_mem_handle: unsafe extern "C" fn(*mut *mut c_void, IpcMemHandle, c_uint) -> Err,
    ipc_close_mem_handle: unsafe extern "C" fn(*mut c_void) -> Err,
    get_error_string: unsafe extern "C" fn(Err) -> *const c_char,
    get_error_name: unsafe extern "C" fn(Err) -> *const c_char,
    get_last_error: unsafe extern "C" fn() -> Err,
    /// `cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*)` (CUDA 10.1+).
    exchange_capture_mode: Option<unsafe extern "C" fn(*mut c_int) -> Err>,
    /// `cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus*)`.
    stream_is_capturing: Option<unsafe extern "C" fn(Stream, *mut c_int) -> Err>,
    /// `cudaDeviceCanAccessPeer(int*, int device, int peer)`.
    can_access_peer: Option<unsafe extern "C" fn(*mut c_int, c_int, c_int) -> Err>,
    /// `cudaDeviceEnablePeerAccess(int peer, unsigned flags)`.
    enable_peer_access: Option<unsafe extern "C" fn(c_int, c_uint) -> Err>,
    /// `cudaGetDeviceProperties_v2` (12+) or `cudaGetDeviceProperties`; only for the name.
    get_device_properties: Option<unsafe extern "C" fn(*mut c_void, c_int) -> Err>,
}

impl Api {
    /// # Safety
    /// `lib` must be a libcudart (11 or later): the field types are the C prototypes.
    unsafe fn load(lib: &Library, path: &Path) -> Result<Api> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the caller vouches that `lib` is libcudart; the field type is this
                // symbol's prototype in cuda_runtime_api.h.
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(e) => return Err(DeviceError::MissingSymbol { path: path.to_path_buf(), symbol: $name, reason: e.to_string() }),
                }
            }};
        }
        // SAFETY: as above; optional symbols.
        let props = unsafe { lib.get(b"cudaGetDeviceProperties_v2\0").or_else(|_| lib.get(b"cudaGetDeviceProperties\0")) };
        Ok(Api {
            get_device_count: sym!("cudaGetDeviceCount"),
            get_device: sym!("cudaGetDevice"),
            set_device: sym!("cudaSetDevice"),
            runtime_get_version: sym!("cudaRuntimeGetVersion"),
            driver_get_version: sym!("cudaDriverGetVersion"),
            stream_synchronize: sym!("cudaStreamSynchronize"),
            stream_wait_event: sym!("cudaStreamWaitEvent"),
            malloc: sym!("cudaMalloc"),
            free: sym!("cudaFree"),
            malloc_host: sym!("cudaMallocHost"),
            free_host: sym!("cudaFreeHost"),
            memcpy_async: sym!("cudaMemcpyAsync"),
            stream_create_with_flags: sym!("cudaStreamCreateWithFlags"),
            stream_destroy: sym!("cudaStreamDestroy"),
            event_create_with_flags: sym!("cudaEventCreateWithFlags"),
            event_record: sym!("cudaEventRecord"),
            event_query: sym!("cudaEventQuery"),
            event_synchronize: sym!("cudaEventSynchronize"),
            event_destroy: sym!("cudaEventDestroy"),
            pointer_get_attributes: sym!("cudaPointerGetAttributes"),
            ipc_get_mem_handle: sym!("cudaIpcGetMemHandle"),
            ipc_open_mem_handle: sym!("cudaIpcOpenMemHandle"),
            ipc_close_mem_handle: sym!("cudaIpcCloseMemHandle"),
            get_error_string: sym!("cudaGetErrorString"),
            get_error_name: sym!("cudaGetErrorName"),
            get_last_error: sym!("cudaGetLastError"),
            // SAFETY: as above; optional symbols with their cuda_runtime_api.h prototypes.
            exchange_capture_mode: unsafe { lib.get(b"cudaThreadExchangeStreamCaptureMode\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            stream_is_capturing: unsafe { lib.get(b"cudaStreamIsCapturing\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            can_access_peer: unsafe { lib.get(b"cudaDeviceCanAccessPeer\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            enable_peer_access: unsafe { lib.get(b"cudaDeviceEnablePeerAccess\0") }.ok().map(|s| *s),
            get_device_properties: props.ok().map(|s| *s),
        })
    }
}

/// Devices on which the gather kernel failed (loading, JIT or launch), with why: it is not
/// tried again on that device, and every other device keeps it (a JIT failure on one GPU, an
/// out-of-memory at first use on a full one, says nothing about the others).
#[derive(Debug, Default)]
struct KernelFailures(std::sync::Mutex<std::collections::BTreeMap<i32, String>>);

impl KernelFailures {
    fn get(&self, dev: i32) -> Option<String> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&dev).cloned()
    }

    /// Records the first failure on `dev`.
    fn set(&self, dev: i32, why: &str) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(dev).or_insert_with(|| why.to_string());
    }
}

/// Where to look for libcudart (module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// If set, the only library tried (`MULTIRAIL_CUDART`).
    pub explicit: Option<PathBuf>,
    /// Python site-packages directories holding the nvidia wheels (`MULTIRAIL_CUDA_WHEEL_DIRS`).
    pub wheel_dirs: Vec<PathBuf>,
    /// Also try the system sonames.
    pub system: bool,
}

impl LoadOptions {
    /// From `MULTIRAIL_CUDART` and `MULTIRAIL_CUDA_WHEEL_DIRS`, system search on.
    pub fn from_env() -> Self {
        LoadOptions {
            explicit: std::env::var_os(ENV_CUDART).filter(|v| !v.is_empty()).map(PathBuf::from),
            wheel_dirs: std::env::var(ENV_WHEEL_DIRS).map(|v| parse_dirs(&v)).unwrap_or_default(),
            system: true,
        }
    }

    /// Libraries to try, in order (the explicit one alone when set).
    pub fn candidates(&self) -> Vec<PathBuf> {
        if let Some(p) = &self.explicit {
            return vec![p.clone()];
        }
        let wheels = self.wheel_dirs.iter().flat_map(|d| WHEEL_PATHS.iter().map(move |w| d.join(w)));
        let system = SYSTEM_SONAMES.iter().filter(|_| self.system).map(PathBuf::from);
        wheels.chain(system).collect()
    }
}

/// Splits a `:`-separated directory list, skipping empty entries.
pub fn parse_dirs(s: &str) -> Vec<PathBuf> {
    s.split(':').filter(|p| !p.is_empty()).map(PathBuf::from).collect()
}

/// A loaded libcudart.
pub struct CudaRuntime {
    api: Api,
    path: PathBuf,
    /// `cudaRuntimeGetVersion` (e.g. 12090 for 12.9).
    runtime_version: i32,
    /// `cudaDriverGetVersion`: the newest CUDA the installed driver supports.
    driver_version: i32,
    /// `cudaMemcpyBatchAsync` (12.8 and later), unless turned off.
    batch: Option<MemcpyBatch>,
    /// Set when a batch call failed: the per-copy loop is used from then on, and this says why.
    batch_failed: std::sync::OnceLock<String>,
    /// Set when the gather kernel failed to launch: not tried again, and this says why.
    kernel_failed: KernelFailures,
    /// `MULTIRAIL_CUDA_COPY`, read at load.
    copy_mode: CopyMode,
    // Dropped last: the function pointers in `api` point into it.
    _lib: Library,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime")
            .field("path", &self.path)
            .field("runtime_version", &self.runtime_version)
            .field("driver_version", &self.driver_version)
            .finish()
    }
}

impl CudaRuntime {
    /// Loads the first libcudart of `opts.candidates()` that opens, has every symbol, and whose
    /// major version the driver supports ([`runtime_fits_driver`]). A runtime the driver cannot
    /// run is skipped with its reason, so a cu13 wheel on a CUDA 12 driver falls through to the
    /// system's libcudart.so.12. If no driver is installed at all, the first runtime that loads
    /// is kept: `device_count` then says why there is no GPU.
    pub fn load(opts: &LoadOptions) -> Result<Arc<CudaRuntime>> {
        let mut tried = Vec::new();
        let mut no_driver: Option<Arc<CudaRuntime>> = None;
        for path in opts.candidates() {
            // A wheel path that does not exist is not worth a dlopen (and its message).
            if path.is_absolute() && !path.exists() && opts.explicit.is_none() {
                tried.push(format!("{} (absent)", path.display()));
                continue;
            }
            // SAFETY: loading runs the library's initialisers; libcudart's are benign (it
            // defers all driver work to the first call).
            match unsafe { Library::new(&path) } {
                Ok(lib) => {
                    // SAFETY: a library that loads under a libcudart name is taken to be one;
                    // a missing symbol is reported rather than called.
                    let api = unsafe { Api::load(&lib, &path) }?;
                    let (mut rv, mut dv): (c_int, c_int) = (0, 0);
                    // SAFETY: valid out-pointers; neither call needs a device.
                    unsafe {
                        (api.runtime_get_version)(&mut rv);
                        (api.driver_get_version)(&mut dv);
                        (api.get_last_error)();
                    }
                    // SAFETY: `lib` is the libcudart whose version was just read.
                    let batch = unsafe { MemcpyBatch::load(&lib, rv) };
                    let rt = Arc::new(CudaRuntime {
                        api,
                        path,
                        runtime_version: rv,
                        driver_version: dv,
                        batch,
                        batch_failed: std::sync::OnceLock::new(),
                        kernel_failed: KernelFailures::default(),
                        copy_mode: CopyMode::from_env(),
                        _lib: lib,
                    });
                    match runtime_fits_driver(rv, dv) {
                        Ok(()) => return Ok(rt),
                        Err(why) if opts.explicit.is_some() => {
                            return Err(DeviceError::NoDevice { lib: rt.path.clone(), reason: why });
                        }
                        Err(why) => {
                            tried.push(format!("{} ({why})", rt.path.display()));
                            if dv <= 0 && no_driver.is_none() {
                                no_driver = Some(rt);
                            }
                        }
                    }
                }
                Err(e) if opts.explicit.is_some() => return Err(DeviceError::ExplicitLoad { path, reason: e.to_string() }),
                Err(e) => tried.push(format!("{} ({e})", path.display())),
            }
        }
        if let Some(rt) = no_driver {
            return Ok(rt);
        }
        if tried.is_empty() {
            tried.push("nothing: no wheel dirs and system search off".into());
        }
        Err(DeviceError::NotFound { tried: tried.join("; ") })
    }

    /// `cudaRuntimeGetVersion` of the loaded library (1000 x major + 10 x minor).
    pub fn runtime_version(&self) -> i32 {
        self.runtime_version
    }

    /// `cudaDriverGetVersion`: the newest CUDA version the driver supports (0: no driver).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// `MULTIRAIL_CUDA_COPY` as read when this runtime was loaded.
    pub fn copy_mode(&self) -> CopyMode {
        self.copy_mode
    }

    /// Why `cudaMemcpyBatchAsync` is not used (None: it is available).
    fn batch_unusable(&self) -> Option<String> {
        if let Some(why) = self.batch_failed.get() {
            return Some(why.clone());
        }
        match self.batch {
            Some(_) => None,
            None => Some(format!("runtime {} has no cudaMemcpyBatchAsync (12.8 and later)", self.runtime_version)),
        }
    }

    /// The library that was loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `cudaGetDeviceCount`, with 0 or an error turned into [`DeviceError::NoDevice`].
    pub fn device_count(&self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        let rc = unsafe { (self.api.get_device_count)(&mut n) };
        if rc != SUCCESS {
            let (name, msg) = self.describe(rc);
            return Err(DeviceError::NoDevice { lib: self.path.clone(), reason: format!("cudaGetDeviceCount failed: {name}: {msg}") });
        }
        if n <= 0 {
            return Err(DeviceError::NoDevice { lib: self.path.clone(), reason: "cudaGetDeviceCount found 0 devices".into() });
        }
        Ok(n)
    }

    fn describe(&self, rc: Err) -> (String, String) {
        // SAFETY: both return static strings (or null for unknown codes in old runtimes); the
        // call to cudaGetLastError clears a non-sticky error so the next call starts clean.
        unsafe {
            (self.api.get_last_error)();
            (cstr((self.api.get_error_name)(rc)), cstr((self.api.get_error_string)(rc)))
        }
    }

    fn check(&self, op: &'static str, rc: Err) -> Result<()> {
        if rc == SUCCESS {
            return Ok(());
        }
        let (name, message) = self.describe(rc);
        Err(DeviceError::Cuda { op, code: rc, name, message })
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// One GPU through libcudart. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cuda {
    rt: Arc<CudaRuntime>,
    id: i32,
    name: String,
    /// The device's primary context, retained through the driver API (None: no driver symbols;
    /// `enter` then saves and restores the runtime's current device instead).
    ctx: Option<PrimaryCtx>,
}

/// What [`Cuda::enter`] puts back when it drops.
enum Restore {
    /// The context that was current (possibly none).
    Ctx(unsafe extern "C" fn(Ctx) -> c_int, Ctx),
    /// The runtime's current device, when it was another one.
    Device(c_int),
    Nothing,
}

/// The device made current on this thread for the guard's lifetime; the thread's previous
/// context (or device) comes back on drop (module docs).
#[must_use]
pub struct OnDevice<'a> {
    cuda: &'a Cuda,
    restore: Restore,
    /// The thread's stream-capture mode before `enter` made it relaxed.
    mode: Option<c_int>,
}

/// `cudaStreamCaptureModeRelaxed`.
const CAPTURE_MODE_RELAXED: c_int = 2;

impl Drop for OnDevice<'_> {
    fn drop(&mut self) {
        if let (Some(mut m), Some(f)) = (self.mode, self.cuda.api().exchange_capture_mode) {
            // SAFETY: valid in/out pointer; puts back the mode `enter` replaced.
            unsafe { f(&mut m) };
        }
        match self.restore {
            // SAFETY: the context that was current on this thread before `enter` (or null).
            Restore::Ctx(set, prev) => unsafe {
                set(prev);
            },
            // SAFETY: a device ordinal cudaGetDevice returned.
            Restore::Device(d) => unsafe {
                (self.cuda.api().set_device)(d);
                (self.cuda.api().get_last_error)();
            },
            Restore::Nothing => {}
        }
    }
}

/// A CUDA stream (destroyed on drop).
#[derive(Debug)]
pub struct CudaStream {
    /// The device it was made on: destroyed there, through the device guard (a destroy on a
    /// thread with no context would make one on device 0).
    dev: Cuda,
    raw: Stream,
    /// The gather kernel's piece table (`crate::gather`), written in stream order before each
    /// launch.
    table: std::sync::Mutex<KernelTable>,
}

/// Pinned host slots a stream's piece tables are uploaded from, used in turn.
const TABLE_SLOTS: usize = 4;

/// A stream's gather-kernel piece table: the device buffer the kernel reads, and the pinned
/// host slots it is uploaded from. Pinned, because `cudaMemcpyAsync` from pageable memory may
/// wait for the stream (CUDA's "API synchronization behavior"), which would serialize a caller
/// that queues transfers ahead of their completion (crate `multirail`'s IPC worker). A slot is
/// written again only once the upload that read it has run (its event), so up to
/// [`TABLE_SLOTS`] launches are queued without a host wait. Addresses are kept as integers
/// (0: none yet); all are freed with the stream.
#[derive(Debug, Default)]
struct KernelTable {
    dev: u64,
    dev_cap: usize,
    /// (pinned host address, capacity, event recorded after the upload that read it or 0).
    slots: [(u64, usize, u64); TABLE_SLOTS],
    next: usize,
}

/// A CUDA event (destroyed on drop).
#[derive(Debug)]
pub struct CudaEvent {
    /// As `CudaStream::dev`.
    dev: Cuda,
    raw: Event,
}

// SAFETY: CUDA streams and events may be used from any host thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Send for CudaEvent {}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // On the stream's device (no context on device 0 for a thread that has none). Errors
        // here (a context torn down at exit) leave nothing to do.
        let _on = self.dev.enter();
        let api = &self.dev.rt.api;
        // SAFETY: created by cudaStreamCreateWithFlags, destroyed once, after its work ran (the
        // gather table below is freed only then: cudaFree's implicit wait is not promised).
        unsafe {
            (api.stream_synchronize)(self.raw);
            (api.stream_destroy)(self.raw);
        }
        let t = std::mem::take(&mut *self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        if t.dev != 0 {
            // SAFETY: allocated by cudaMalloc for this stream, which is gone (its work done:
            // cudaStreamDestroy lets queued work finish, and cudaFree waits for the device).
            unsafe { (api.free)(t.dev as *mut c_void) };
        }
        for (host, _, ev) in t.slots {
            if ev != 0 {
                // SAFETY: our event, waited for before the slot goes.
                unsafe {
                    (api.event_synchronize)(ev as Event);
                    (api.event_destroy)(ev as Event);
                }
            }
            if host != 0 {
                // SAFETY: from cudaMallocHost for this stream; its upload has run (above).
                unsafe { (api.free_host)(host as *mut c_void) };
            }
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let _on = self.dev.enter();
        // SAFETY: created by cudaEventCreateWithFlags, destroyed once, on its device.
        unsafe { (self.dev.rt.api.event_destroy)(self.raw) };
    }
}

impl Cuda {
    /// GPU `id`, with libcudart found as [`LoadOptions::from_env`] says.
    pub fn open(id: i32) -> Result<Cuda> {
        Cuda::open_with(&LoadOptions::from_env(), id)
    }

    pub fn open_with(opts: &LoadOptions, id: i32) -> Result<Cuda> {
        let rt = CudaRuntime::load(opts)?;
        let count = rt.device_count()?;
        if id < 0 || id >= count {
            return Err(DeviceError::BadDevice { id, count });
        }
        let dev = Cuda { rt, id, name: String::new(), ctx: retain_primary(id) };
        drop(dev.enter()?);
        let name = dev.query_name().unwrap_or_else(|| format!("CUDA device {id}"));
        Ok(Cuda { name, ..dev })
    }

    /// The loaded runtime.
    pub fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }

    fn api(&self) -> &Api {
        &self.rt.api
    }

    /// One gather-kernel launch for `copies` (device to device, none empty), with the device
    /// entered: the piece table goes to the stream's table buffer in stream order, then the
    /// launch. Returns the calls made; Err (nothing queued that touches the copies) says why not.
    ///
    /// # Safety
    /// As [`Device::copy_batch_async`].
    unsafe fn copy_kernel(&self, copies: &[&BatchCopy], stream: &CudaStream) -> std::result::Result<usize, String> {
        if let Some(why) = self.rt.kernel_failed.get(self.id) {
            return Err(why);
        }
        let ctx = self.ctx.ok_or("the gather kernel needs the driver API (libcuda.so.1 symbols missing)")?;
        let f = crate::gather::function(ctx.0 as usize).inspect_err(|why| self.rt.kernel_failed.set(self.id, why))?.f;
        let n = u32::try_from(copies.len()).map_err(|_| "more than 2^32 pieces".to_string())?;
        let bytes = copies.len() * 24;
        let mut t = stream.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let t = &mut *t;
        let check = |op: &'static str, rc: Err| self.rt.check(op, rc).map_err(|e| e.to_string());
        if t.dev_cap < bytes {
            if t.dev != 0 {
                // The old table may still be read by a launch queued before: wait for it.
                self.stream_synchronize(stream).map_err(|e| e.to_string())?;
                // SAFETY: our own allocation, no longer used.
                unsafe { (self.api().free)(t.dev as *mut c_void) };
                (t.dev, t.dev_cap) = (0, 0);
            }
            let cap = bytes.next_power_of_two().max(64 << 10);
            let mut p = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check("cudaMalloc", unsafe { (self.api().malloc)(&mut p, cap) })?;
            (t.dev, t.dev_cap) = (p as u64, cap);
        }
        let slot = &mut t.slots[t.next];
        t.next = (t.next + 1) % TABLE_SLOTS;
        if slot.2 != 0 {
            // The upload that last read this slot (TABLE_SLOTS launches ago) must have run.
            // SAFETY: our live event.
            check("cudaEventSynchronize", unsafe { (self.api().event_synchronize)(slot.2 as Event) })?;
        } else {
            let mut e = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check("cudaEventCreateWithFlags", unsafe { (self.api().event_create_with_flags)(&mut e, EVENT_FLAGS) })?;
            slot.2 = e as u64;
        }
        if slot.1 < bytes {
            if slot.0 != 0 {
                // SAFETY: ours, and its last upload has run (above).
                unsafe { (self.api().free_host)(slot.0 as *mut c_void) };
                (slot.0, slot.1) = (0, 0);
            }
            let cap = bytes.next_power_of_two().max(16 << 10);
            let mut p = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check("cudaMallocHost", unsafe { (self.api().malloc_host)(&mut p, cap) })?;
            (slot.0, slot.1) = (p as u64, cap);
        }
        // SAFETY: the slot holds `bytes` = 3 u64 per piece and nothing reads it now (its last
        // upload has run); cudaMallocHost memory is page-aligned.
        let host = unsafe { std::slice::from_raw_parts_mut(slot.0 as *mut u64, copies.len() * 3) };
        for (h, c) in host.chunks_exact_mut(3).zip(copies) {
            h.copy_from_slice(&[c.1, c.2, c.3 as u64]);
        }
        // In stream order: the launch below reads the table, an earlier launch's read is done.
        // SAFETY: both buffers hold at least `bytes`; the slot stays untouched until `slot.2`.
        let rc = unsafe { (self.api().memcpy_async)(t.dev as *mut c_void, slot.0 as *const c_void, bytes, MEMCPY_H2D, stream.raw) };
        check("cudaMemcpyAsync", rc)?;
        // SAFETY: live event and stream.
        check("cudaEventRecord", unsafe { (self.api().event_record)(slot.2 as Event, stream.raw) })?;
        // SAFETY: the context is current (entered by the caller); the table is in place in stream
        // order; the caller's contract covers every piece.
        unsafe { crate::gather::launch(f, t.dev, n, stream.raw) }.inspect_err(|why| self.rt.kernel_failed.set(self.id, why))?;
        Ok(2)
    }

    /// `cudaMemcpyBatchAsync` calls for `copies` (device to device, none empty), up to
    /// [`BATCH_MAX`] each (the runtime has the call: checked by the caller).
    ///
    /// # Safety
    /// As [`Device::copy_batch_async`].
    unsafe fn copy_batched(&self, copies: &[&BatchCopy], stream: &CudaStream) -> Result<Queued> {
        let batch = self.rt.batch.expect("checked by the caller");
        let _on = self.enter()?;
        let mut calls = 0;
        for (i, part) in copies.chunks(BATCH_MAX).enumerate() {
            let mut dsts: Vec<*mut c_void> = part.iter().map(|c| c.1 as *mut c_void).collect();
            let mut srcs: Vec<*mut c_void> = part.iter().map(|c| c.2 as *mut c_void).collect();
            let mut sizes: Vec<usize> = part.iter().map(|c| c.3).collect();
            let mut attr = MemcpyAttributes { src_access_order: SRC_ACCESS_ORDER_STREAM, ..Default::default() };
            let mut attr_idx: usize = 0;
            // SAFETY: the arrays hold part.len() entries and outlive the call (the runtime
            // reads them during it); one attribute applies from copy 0 on; the caller's
            // contract covers every range; the stream is live.
            let rc = unsafe {
                match batch {
                    MemcpyBatch::V12(f) => {
                        let mut fail = usize::MAX;
                        f(
                            dsts.as_mut_ptr(),
                            srcs.as_mut_ptr(),
                            sizes.as_mut_ptr(),
                            part.len(),
                            &mut attr,
                            &mut attr_idx,
                            1,
                            &mut fail,
                            stream.raw,
                        )
                    }
                    MemcpyBatch::V13(f) => {
                        f(dsts.as_mut_ptr(), srcs.as_mut_ptr(), sizes.as_mut_ptr(), part.len(), &mut attr, &mut attr_idx, 1, stream.raw)
                    }
                }
            };
            if rc != SUCCESS {
                let (name, msg) = self.rt.describe(rc);
                let why = format!("cudaMemcpyBatchAsync failed ({name}: {msg}); copying one by one");
                let _ = self.rt.batch_failed.set(why.clone());
                // What the failed call queued, if anything, ends before its copies are queued
                // again (the earlier calls' copies are disjoint from these).
                self.stream_synchronize(stream)?;
                for c in &copies[i * BATCH_MAX..] {
                    // SAFETY: the caller's contract, per copy.
                    unsafe { self.copy_async(c.0, c.1, c.2, c.3, stream) }?;
                    calls += 1;
                }
                return Ok(Queued { calls, how: CopyHow::PerCopy, note: Some(why) });
            }
            calls += 1;
        }
        Ok(Queued { calls, how: CopyHow::Batch, note: None })
    }

    /// [`Device::copy_batch_async`] in `mode` instead of the runtime's `MULTIRAIL_CUDA_COPY`
    /// (benchmarks and tests compare the ways side by side).
    ///
    /// # Safety
    /// As [`Device::copy_batch_async`].
    pub unsafe fn copy_batch_as(&self, mode: CopyMode, copies: &[BatchCopy], stream: &CudaStream) -> Result<Queued> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_batch_with(mode, copies, false, stream) }
    }

    /// [`Cuda::copy_batch_as`]; `pinned`: every host side lies in pinned memory
    /// ([`Device::copy_batch_pinned_async`]), which the kernel reaches by its host address
    /// (unified addressing: memory from `cudaMallocHost` is mapped into every device at the
    /// same address), so host-device batches may go as one launch too.
    ///
    /// # Safety
    /// As [`Device::copy_batch_pinned_async`] when `pinned`, else [`Device::copy_batch_async`].
    pub unsafe fn copy_batch_with(&self, mode: CopyMode, copies: &[BatchCopy], pinned: bool, stream: &CudaStream) -> Result<Queued> {
        let batchable = copies.len() > 1 && copies.iter().all(|c| pinned || c.0 == CopyKind::DeviceToDevice);
        let nonempty: Vec<&BatchCopy> = if batchable { copies.iter().filter(|c| c.3 > 0).collect() } else { Vec::new() };
        let mut note = None;
        if !nonempty.is_empty() {
            let avg = nonempty.iter().map(|c| c.3).sum::<usize>() / nonempty.len();
            if mode == CopyMode::Kernel || (mode == CopyMode::Auto && avg <= KERNEL_MAX_AVG_PIECE) {
                let _on = self.enter()?;
                // SAFETY: the caller's contract.
                match unsafe { self.copy_kernel(&nonempty, stream) } {
                    Ok(calls) => return Ok(Queued { calls, how: CopyHow::Kernel, note: None }),
                    Err(why) => note = Some(why),
                }
            }
            if mode != CopyMode::Loop {
                match self.rt.batch_unusable() {
                    // SAFETY: the caller's contract.
                    None => {
                        return unsafe { self.copy_batched(&nonempty, stream) }.map(|mut q| {
                            q.note = q.note.or(note);
                            q
                        })
                    }
                    Some(why) => note = Some(note.map_or(why.clone(), |n| format!("{n}; {why}"))),
                }
            } else {
                note = Some(format!("{ENV_CUDA_COPY}=loop"));
            }
        }
        for &(kind, dst, src, len) in copies {
            // SAFETY: the caller's contract, per copy.
            unsafe { self.copy_async(kind, dst, src, len, stream) }?;
        }
        Ok(Queued { calls: copies.len(), how: CopyHow::PerCopy, note: note.filter(|_| batchable) })
    }

    /// Makes this device current on the calling thread until the guard drops, then puts the
    /// thread's previous context (or runtime device) back (module docs).
    ///
    /// It also puts the thread in relaxed stream-capture mode for the guard's lifetime
    /// (`cudaThreadExchangeStreamCaptureMode`): what the engine calls (event queries and syncs,
    /// allocations, stream and event creation) must not invalidate a CUDA graph another thread
    /// of the application is capturing in global mode (docs/gpu.md, "Graph capture").
    pub fn enter(&self) -> Result<OnDevice<'_>> {
        let mut g = self.enter_device()?;
        if let Some(f) = self.api().exchange_capture_mode {
            let mut m = CAPTURE_MODE_RELAXED;
            // SAFETY: valid in/out pointer; a thread-local setting of the runtime.
            if unsafe { f(&mut m) } == SUCCESS {
                g.mode = Some(m);
            }
        }
        Ok(g)
    }

    fn enter_device(&self) -> Result<OnDevice<'_>> {
        if let (Some(ctx), Some(d)) = (self.ctx, driver()) {
            if let (Some(get), Some(set)) = (d.ctx_get_current, d.ctx_set_current) {
                let mut prev: Ctx = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                if unsafe { get(&mut prev) } == 0 {
                    if prev == ctx.0 {
                        return Ok(OnDevice { cuda: self, restore: Restore::Nothing, mode: None });
                    }
                    // SAFETY: a primary context retained at open.
                    let rc = unsafe { set(ctx.0) };
                    if rc != 0 {
                        return Err(DeviceError::Cuda {
                            op: "cuCtxSetCurrent",
                            code: rc,
                            name: format!("CUresult {rc}"),
                            message: "cannot make the device's context current".into(),
                        });
                    }
                    return Ok(OnDevice { cuda: self, restore: Restore::Ctx(set, prev), mode: None });
                }
            }
        }
        let mut prev: c_int = -1;
        // SAFETY: valid out-pointer; cudaGetDevice creates no context.
        let got = unsafe { (self.api().get_device)(&mut prev) } == SUCCESS;
        if got && prev == self.id {
            return Ok(OnDevice { cuda: self, restore: Restore::Nothing, mode: None });
        }
        let guard = OnDevice { cuda: self, restore: if got { Restore::Device(prev) } else { Restore::Nothing }, mode: None };
        // SAFETY: plain call with a valid ordinal.
        self.rt.check("cudaSetDevice", unsafe { (self.api().set_device)(self.id) })?;
        Ok(guard)
    }

    /// Which image of the gather kernel this device runs (`SASS sm_90 (fatbin)`, `PTX JIT ...`),
    /// loading it now if it was not yet, or why the kernel is not used here (`crate::gather`).
    pub fn gather_kernel(&self) -> std::result::Result<String, String> {
        if let Some(why) = self.rt.kernel_failed.get(self.id) {
            return Err(why);
        }
        let ctx = self.ctx.ok_or("the gather kernel needs the driver API (libcuda.so.1 symbols missing)")?;
        let _on = self.enter().map_err(|e| e.to_string())?;
        let loaded = crate::gather::function(ctx.0 as usize).inspect_err(|why| self.rt.kernel_failed.set(self.id, why))?;
        Ok(loaded.image)
    }

    fn query_name(&self) -> Option<String> {
        let f = self.api().get_device_properties?;
        let mut buf = vec![0u8; DEVICE_PROP_BYTES];
        // SAFETY: the buffer is larger than any cudaDeviceProp; `name` is its first field,
        // char[256].
        let rc = unsafe { f(buf.as_mut_ptr().cast(), self.id) };
        if rc != SUCCESS {
            self.rt.describe(rc);
            return None;
        }
        let name = &buf[..256];
        let end = name.iter().position(|&b| b == 0).unwrap_or(256);
        Some(String::from_utf8_lossy(&name[..end]).into_owned())
    }
}

impl Device for Cuda {
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn id(&self) -> i32 {
        self.id
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize) -> Result<DevicePtr> {
        let _on = self.enter()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaMalloc", unsafe { (self.api().malloc)(&mut p, len) })?;
        Ok(DevicePtr(p as u64))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: the caller's contract (allocated by cudaMalloc, unused).
        self.rt.check("cudaFree", unsafe { (self.api().free)(ptr.0 as *mut c_void) })
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        let _on = self.enter()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaMallocHost", unsafe { (self.api().malloc_host)(&mut p, len) })?;
        // SAFETY: `len` bytes of pinned host memory, valid until cudaFreeHost.
        Ok(unsafe { PinnedMem::from_raw(p.cast(), len) })
    }

    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: the caller's contract (from cudaMallocHost, unused).
        self.rt.check("cudaFreeHost", unsafe { (self.api().free_host)(mem.as_ptr().cast()) })
    }

    fn pointer_kind(&self, addr: u64) -> Result<MemKind> {
        if let Some(k) = driver_pointer_kind(addr) {
            return Ok(k);
        }
        // No driver symbol (or an uninitialised driver): the runtime, on this device's context
        // (on a thread with none it would make one on GPU 0).
        let _on = self.enter()?;
        let mut a = PointerAttributes::zeroed();
        // SAFETY: valid out-pointer; the address is only classified, never dereferenced.
        self.rt.check("cudaPointerGetAttributes", unsafe { (self.api().pointer_get_attributes)(&mut a, addr as *const c_void) })?;
        Ok(match a.kind {
            1 => MemKind::Host,
            2 => MemKind::Device { device: a.device },
            3 => MemKind::Managed { device: a.device },
            _ => MemKind::Unregistered,
        })
    }

    fn create_stream(&self) -> Result<CudaStream> {
        let _on = self.enter()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaStreamCreateWithFlags", unsafe { (self.api().stream_create_with_flags)(&mut s, STREAM_NON_BLOCKING) })?;
        Ok(CudaStream { dev: self.clone(), raw: s, table: std::sync::Mutex::default() })
    }

    fn create_event(&self) -> Result<CudaEvent> {
        let _on = self.enter()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaEventCreateWithFlags", unsafe { (self.api().event_create_with_flags)(&mut e, EVENT_FLAGS) })?;
        Ok(CudaEvent { dev: self.clone(), raw: e })
    }

    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
        let _on = self.enter()?;
        let k = match kind {
            CopyKind::HostToDevice => MEMCPY_H2D,
            CopyKind::DeviceToHost => MEMCPY_D2H,
            CopyKind::DeviceToDevice => MEMCPY_D2D,
        };
        // SAFETY: the caller's contract on both ranges; the stream is live.
        self.rt.check("cudaMemcpyAsync", unsafe { (self.api().memcpy_async)(dst as *mut c_void, src as *const c_void, len, k, stream.raw) })
    }

    /// Two or more device-to-device copies go, by [`CopyMode`]: as one launch of the gather
    /// kernel (`crate::gather`; `auto` takes it when the pieces average at most
    /// [`KERNEL_MAX_AVG_PIECE`]), or as `cudaMemcpyBatchAsync` calls of up to 8192 copies (12.8+),
    /// or one `cudaMemcpyAsync` each; any other batch goes one by one. A way that fails at its
    /// call is not tried again by this runtime (the reason is kept, and given in
    /// [`Queued::note`]): for a failed batch call the stream is drained of whatever it queued,
    /// and the copies from that call on are queued one by one.
    unsafe fn copy_batch_async(&self, copies: &[BatchCopy], stream: &CudaStream) -> Result<Queued> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_batch_as(self.rt.copy_mode, copies, stream) }
    }

    unsafe fn copy_batch_pinned_async(&self, copies: &[BatchCopy], stream: &CudaStream) -> Result<Queued> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_batch_with(self.rt.copy_mode, copies, true, stream) }
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: live event and stream.
        self.rt.check("cudaEventRecord", unsafe { (self.api().event_record)(event.raw, stream.raw) })
    }

    fn record_external(&self, event: &CudaEvent, stream: u64) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: live event; `stream` is the application's cudaStream_t of this device (0: the
        // legacy default stream), which CUDA validates.
        self.rt.check("cudaEventRecord", unsafe { (self.api().event_record)(event.raw, stream as Stream) })
    }

    fn stream_synchronize(&self, stream: &CudaStream) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: live stream.
        self.rt.check("cudaStreamSynchronize", unsafe { (self.api().stream_synchronize)(stream.raw) })
    }

    fn stream_wait(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: live stream and event (flags must be 0).
        self.rt.check("cudaStreamWaitEvent", unsafe { (self.api().stream_wait_event)(stream.raw, event.raw, 0) })
    }

    fn stream_handle(&self, stream: &CudaStream) -> u64 {
        stream.raw as u64
    }

    fn query(&self, event: &CudaEvent) -> Result<bool> {
        let _on = self.enter()?;
        // SAFETY: live event.
        match unsafe { (self.api().event_query)(event.raw) } {
            SUCCESS => Ok(true),
            ERROR_NOT_READY => {
                // cudaEventQuery's "not ready" is also left as the last error; clear it.
                // SAFETY: plain call.
                unsafe { (self.api().get_last_error)() };
                Ok(false)
            }
            rc => self.rt.check("cudaEventQuery", rc).map(|_| false),
        }
    }

    fn synchronize(&self, event: &CudaEvent) -> Result<()> {
        let _on = self.enter()?;
        // SAFETY: live event.
        self.rt.check("cudaEventSynchronize", unsafe { (self.api().event_synchronize)(event.raw) })
    }

    fn alloc_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        let _on = self.enter()?;
        let f = driver()
            .and_then(|d| d.address_range)
            .ok_or(DeviceError::Unsupported { op: "cuMemGetAddressRange (no libcuda.so.1)", device: "CUDA" })?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the driver checks `ptr` (the device's primary context is
        // current on this thread inside `enter`).
        let rc = unsafe { f(&mut base, &mut size, ptr.0) };
        if rc != 0 {
            return Err(DeviceError::Cuda {
                op: "cuMemGetAddressRange",
                code: rc,
                name: format!("CUresult {rc}"),
                message: "not an address of device memory".into(),
            });
        }
        Ok((DevicePtr(base), size))
    }

    fn ipc_handle(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        let _on = self.enter()?;
        let mut h = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer; CUDA checks that `ptr` is a device allocation.
        self.rt.check("cudaIpcGetMemHandle", unsafe { (self.api().ipc_get_mem_handle)(&mut h, ptr.0 as *mut c_void) })?;
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }

    unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<DevicePtr> {
        let _on = self.enter()?;
        let h = IpcMemHandle { reserved: handle.0.map(|b| b as c_char) };
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle's validity is the caller's contract.
        self.rt.check("cudaIpcOpenMemHandle", unsafe { (self.api().ipc_open_mem_handle)(&mut p, h, IPC_LAZY_ENABLE_PEER_ACCESS) })?;
        Ok(DevicePtr(p as u64))
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        let _on = self.enter()?;
        let import = vmm_imports().lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&ptr.0);
        if let Some((len, mapped)) = import {
            let v = self.vmm_api()?;
            for (off, n) in mapped {
                // SAFETY: a chunk this process mapped there (vmm_map); no copy uses it (the
                // caller's contract).
                unsafe { (v.unmap)(ptr.0 + off, n) };
            }
            // SAFETY: our reservation, every mapping in it gone.
            let rc = unsafe { (v.address_free)(ptr.0, len) };
            return if rc == 0 { Ok(()) } else { Err(driver_err("cuMemAddressFree", rc, format!("{len} bytes at {:#x}", ptr.0))) };
        }
        // SAFETY: the caller's contract (from ipc_open, unused).
        self.rt.check("cudaIpcCloseMemHandle", unsafe { (self.api().ipc_close_mem_handle)(ptr.0 as *mut c_void) })
    }

    fn uuid(&self) -> Result<[u8; 16]> {
        self.rt.device_uuid(self.id)
    }

    /// Walks the range mapping by mapping (`cuMemGetAddressRange`); each must be VMM memory
    /// (`cuMemRetainAllocationHandle`) whose allocation requested the POSIX file descriptor
    /// handle type (`cuMemGetAllocationPropertiesFromHandle`).
    fn vmm_chunks(&self, ptr: DevicePtr, len: usize) -> Result<Vec<(DevicePtr, usize)>> {
        let v = self.vmm_api()?;
        let _on = self.enter()?;
        if let Some(f) = driver().and_then(|d| d.pointer_get_attribute) {
            let mut pool: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out-pointer of the attribute's type (CUmemoryPool, a pointer).
            if unsafe { f((&mut pool as *mut *mut c_void).cast(), ATTR_MEMPOOL_HANDLE, ptr.0) } == 0 && !pool.is_null() {
                return Err(driver_err(
                    "cuMemRetainAllocationHandle",
                    1,
                    "memory of a stream-ordered pool (cudaMallocAsync) is not a VMM allocation; pool export \
                     (cudaMemPoolExportPointer) is not supported"
                        .into(),
                ));
            }
        }
        let end = ptr.0.checked_add(len as u64).ok_or(DeviceError::UnknownPointer { addr: ptr.0 })?;
        let mut out = Vec::new();
        let mut p = ptr.0;
        while p < end {
            let (base, n) = self.alloc_range(DevicePtr(p))?;
            if n == 0 || base.0 > p {
                return Err(driver_err("cuMemGetAddressRange", 1, format!("no mapping at {p:#x}")));
            }
            let mut h: MemHandle = 0;
            // SAFETY: valid out-pointer; the driver checks the address.
            let rc = unsafe { (v.retain)(&mut h, base.0 as *mut c_void) };
            if rc != 0 {
                return Err(driver_err(
                    "cuMemRetainAllocationHandle",
                    rc,
                    format!("{:#x} is not a VMM allocation (cuMemCreate + cuMemMap)", base.0),
                ));
            }
            let mut prop = [0u8; ALLOCATION_PROP_BYTES];
            // SAFETY: the buffer is larger than CUmemAllocationProp; the handle was just retained
            // and is released once.
            let rc = unsafe {
                let rc = (v.properties)(prop.as_mut_ptr().cast(), h);
                (v.release)(h);
                rc
            };
            if rc != 0 {
                return Err(driver_err("cuMemGetAllocationPropertiesFromHandle", rc, format!("allocation at {:#x}", base.0)));
            }
            let requested = c_int::from_ne_bytes(prop[4..8].try_into().expect("4 bytes"));
            if requested & HANDLE_TYPE_POSIX_FD == 0 {
                return Err(driver_err(
                    "cuMemExportToShareableHandle",
                    1,
                    format!(
                        "the allocation at {:#x} was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes ({requested:#x})",
                        base.0
                    ),
                ));
            }
            out.push((base, n));
            p = base.0 + n as u64;
        }
        Ok(out)
    }

    fn vmm_export_fd(&self, base: DevicePtr) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let v = self.vmm_api()?;
        let _on = self.enter()?;
        let mut h: MemHandle = 0;
        // SAFETY: valid out-pointer; the driver checks the address.
        let rc = unsafe { (v.retain)(&mut h, base.0 as *mut c_void) };
        if rc != 0 {
            return Err(driver_err("cuMemRetainAllocationHandle", rc, format!("{:#x}", base.0)));
        }
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the out-parameter is an int; the handle is released once.
        let rc = unsafe {
            let rc = (v.export)((&mut fd as *mut c_int).cast(), h, HANDLE_TYPE_POSIX_FD, 0);
            (v.release)(h);
            rc
        };
        if rc != 0 || fd < 0 {
            return Err(driver_err("cuMemExportToShareableHandle", rc, format!("POSIX file descriptor of {:#x}", base.0)));
        }
        // SAFETY: a new descriptor the driver made for us.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    fn vmm_reserve(&self, len: usize) -> Result<DevicePtr> {
        let v = self.vmm_api()?;
        let _on = self.enter()?;
        let mut p = 0u64;
        // SAFETY: valid out-pointer; default alignment, no fixed address, no flags.
        let rc = unsafe { (v.reserve)(&mut p, len, 0, 0, 0) };
        if rc != 0 {
            return Err(driver_err("cuMemAddressReserve", rc, format!("{len} bytes")));
        }
        vmm_imports().lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(p, (len, Vec::new()));
        Ok(DevicePtr(p))
    }

    unsafe fn vmm_map(&self, base: DevicePtr, offset: u64, len: usize, fd: std::os::fd::BorrowedFd<'_>) -> Result<()> {
        use std::os::fd::AsRawFd;
        let v = self.vmm_api()?;
        let _on = self.enter()?;
        let mut imports = vmm_imports().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((room, mapped)) = imports.get_mut(&base.0) else { return Err(DeviceError::UnknownPointer { addr: base.0 }) };
        if offset.checked_add(len as u64).is_none_or(|e| e > *room as u64) {
            return Err(driver_err("cuMemMap", 1, format!("{len} bytes at offset {offset} do not fit the reservation of {room}")));
        }
        let mut h: MemHandle = 0;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the OS handle is the fd itself, passed as a pointer
        // value; the driver takes its own reference (the fd stays ours).
        let rc = unsafe { (v.import)(&mut h, fd.as_raw_fd() as usize as *mut c_void, HANDLE_TYPE_POSIX_FD) };
        if rc != 0 {
            return Err(driver_err("cuMemImportFromShareableHandle", rc, "the peer's chunk".into()));
        }
        // SAFETY: inside our reservation (checked), unmapped (the caller's contract); the
        // mapping keeps the allocation alive after our handle is released.
        let rc = unsafe {
            let rc = (v.map)(base.0 + offset, len, 0, h, 0);
            (v.release)(h);
            rc
        };
        if rc != 0 {
            return Err(driver_err("cuMemMap", rc, format!("{len} bytes at offset {offset}")));
        }
        mapped.push((offset, len));
        Ok(())
    }

    /// Read-write access for this device only: the local buffer's, where the copies run; the
    /// memory's own GPU (`home`) is reached peer to peer (checked by the caller).
    unsafe fn vmm_commit(&self, base: DevicePtr, len: usize, _home: i32) -> Result<()> {
        let v = self.vmm_api()?;
        let _on = self.enter()?;
        let desc = MemAccessDesc { location_type: LOCATION_DEVICE, location_id: self.id, flags: ACCESS_READWRITE };
        // SAFETY: one valid descriptor; the range is our reservation, fully mapped (the
        // caller's contract).
        let rc = unsafe { (v.set_access)(base.0, len, &desc, 1) };
        if rc != 0 {
            return Err(driver_err("cuMemSetAccess", rc, format!("read-write for GPU {}", self.id)));
        }
        Ok(())
    }

    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        if peer == self.id {
            return Ok(true);
        }
        let f = self.api().can_access_peer.ok_or(DeviceError::Unsupported { op: "cudaDeviceCanAccessPeer", device: "this runtime" })?;
        let mut can: c_int = 0;
        // SAFETY: valid out-pointer; a device property, no context needed.
        self.rt.check("cudaDeviceCanAccessPeer", unsafe { f(&mut can, self.id, peer) })?;
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: i32) -> Result<()> {
        let f =
            self.api().enable_peer_access.ok_or(DeviceError::Unsupported { op: "cudaDeviceEnablePeerAccess", device: "this runtime" })?;
        let _on = self.enter()?;
        // SAFETY: plain call (flags must be 0).
        match unsafe { f(peer, 0) } {
            ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                // SAFETY: plain call; clears the error left as the last one.
                unsafe { (self.api().get_last_error)() };
                Ok(())
            }
            rc => self.rt.check("cudaDeviceEnablePeerAccess", rc),
        }
    }

    fn stream_is_capturing(&self, stream: u64) -> Result<bool> {
        let Some(f) = self.api().stream_is_capturing else { return Ok(false) };
        let _on = self.enter()?;
        let mut status: c_int = 0;
        // SAFETY: valid out-pointer; the stream handle is the application's (0: legacy).
        self.rt.check("cudaStreamIsCapturing", unsafe { f(stream as Stream, &mut status) })?;
        Ok(status != 0)
    }

    fn dma_buf_supported(&self) -> Result<Option<bool>> {
        Ok(self.driver_attribute(ATTR_DMA_BUF_SUPPORTED)?.map(|v| v != 0))
    }

    fn rdma_writes_ordering(&self) -> Result<RdmaWritesOrdering> {
        // Without the driver symbol the ordering is unknown: none, so writes are flushed.
        Ok(RdmaWritesOrdering::from_attr(self.driver_attribute(ATTR_GPU_DIRECT_RDMA_WRITES_ORDERING)?.unwrap_or(0)))
    }

    fn flush_rdma_writes(&self) -> Result<()> {
        let f = driver()
            .and_then(|d| d.flush_gpudirect_rdma_writes)
            .ok_or(DeviceError::Unsupported { op: "cuFlushGPUDirectRDMAWrites (driver older than CUDA 11.3)", device: "cuda" })?;
        let _on = self.enter()?;
        // SAFETY: plain call; the device's context is current (enter).
        let rc = unsafe { f(FLUSH_TARGET_CURRENT_CTX, FLUSH_TO_OWNER) };
        if rc != 0 {
            return Err(DeviceError::Cuda {
                op: "cuFlushGPUDirectRDMAWrites",
                code: rc,
                name: "CUresult".into(),
                message: "TARGET_CURRENT_CTX, TO_OWNER".into(),
            });
        }
        Ok(())
    }
}

/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
const ATTR_GPU_DIRECT_RDMA_WRITES_ORDERING: c_int = 118;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
const ATTR_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX`.
const FLUSH_TARGET_CURRENT_CTX: c_int = 0;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER`.
const FLUSH_TO_OWNER: c_int = 100;

impl Cuda {
    fn vmm_api(&self) -> Result<&'static VmmApi> {
        driver()
            .and_then(|d| d.vmm.as_ref())
            .ok_or(DeviceError::Unsupported { op: "CUDA VMM (cuMem*) calls: no libcuda.so.1 or older than CUDA 10.2", device: "cuda" })
    }
}

impl Cuda {
    /// A driver attribute of this device (`cuDeviceGetAttribute`); None without the symbols.
    fn driver_attribute(&self, attr: c_int) -> Result<Option<i32>> {
        let Some(d) = driver() else { return Ok(None) };
        let (Some(init), Some(get), Some(query)) = (d.init, d.device_get, d.device_get_attribute) else { return Ok(None) };
        let (mut dev, mut v): (c_int, c_int) = (0, 0);
        // SAFETY: plain calls with valid out-pointers; cuInit is idempotent.
        let rc = unsafe {
            match init(0) {
                0 => match get(&mut dev, self.id) {
                    0 => query(&mut v, attr, dev),
                    e => e,
                },
                e => e,
            }
        };
        if rc != 0 {
            return Err(DeviceError::Cuda {
                op: "cuDeviceGetAttribute",
                code: rc,
                name: "CUresult".into(),
                message: format!("attribute {attr}"),
            });
        }
        Ok(Some(v))
    }
}

/// `cudaErrorPeerAccessAlreadyEnabled`.
const ERROR_PEER_ACCESS_ALREADY_ENABLED: Err = 704;

/// Classifies `addr` with the driver API (`cuPointerGetAttribute`), which needs no current
/// context: None when the driver cannot say (no symbol, not initialised).
fn driver_pointer_kind(addr: u64) -> Option<MemKind> {
    // CUpointer_attribute: MEMORY_TYPE 2, IS_MANAGED 8, DEVICE_ORDINAL 9; CUmemorytype: HOST 1,
    // DEVICE 2, UNIFIED 4. CUDA_ERROR_INVALID_VALUE (1): memory CUDA does not know.
    let f = driver()?.pointer_get_attribute?;
    let mut mem_type: c_uint = 0;
    // SAFETY: valid out-pointer of the attribute's type (unsigned int); the address is only
    // classified.
    match unsafe { f((&mut mem_type as *mut c_uint).cast(), 2, addr) } {
        0 => {}
        1 => return Some(MemKind::Unregistered),
        _ => return None,
    }
    let (mut managed, mut ordinal): (c_uint, c_int) = (0, -1);
    // SAFETY: as above (IS_MANAGED: bool as unsigned int; DEVICE_ORDINAL: int).
    unsafe {
        f((&mut managed as *mut c_uint).cast(), 8, addr);
        f((&mut ordinal as *mut c_int).cast(), 9, addr);
    }
    Some(match (managed != 0, mem_type) {
        (true, _) => MemKind::Managed { device: ordinal },
        (false, 2) => MemKind::Device { device: ordinal },
        (false, 1) => MemKind::Host,
        _ => MemKind::Unregistered,
    })
}

impl CudaRuntime {
    /// `cudaDeviceProp.uuid` of device `ordinal`: the 16 bytes right after `char name[256]`
    /// (every runtime since CUDA 10; the same offset in `cudaGetDeviceProperties_v2`). Makes no
    /// device current (no context is created for it).
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16]> {
        let f =
            self.api.get_device_properties.ok_or(DeviceError::Unsupported { op: "uuid (no cudaGetDeviceProperties)", device: "cuda" })?;
        let mut buf = vec![0u8; DEVICE_PROP_BYTES];
        // SAFETY: the buffer is larger than any cudaDeviceProp; `uuid` (cudaUUID_t, 16 bytes)
        // follows `name`, char[256].
        self.check("cudaGetDeviceProperties", unsafe { f(buf.as_mut_ptr().cast(), ordinal) })?;
        Ok(buf[256..272].try_into().expect("16 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_failure_disables_it_on_that_device_only() {
        let k = KernelFailures::default();
        k.set(3, "JIT failed");
        k.set(3, "a later failure");
        assert_eq!(k.get(3).as_deref(), Some("JIT failed"));
        assert_eq!(k.get(0), None, "the other devices keep the kernel");
    }

    /// CUDA 13's `cudaPointerAttributes` is 88 bytes (type, device, devicePointer, hostPointer,
    /// long reserved[8]); CUDA 12's is the first 24. Ours must hold the larger one.
    #[test]
    fn pointer_attributes_hold_the_cuda13_layout() {
        assert_eq!(std::mem::size_of::<PointerAttributes>(), 88);
        assert_eq!(std::mem::offset_of!(PointerAttributes, device), 4);
        assert_eq!(std::mem::offset_of!(PointerAttributes, device_pointer), 8);
        assert_eq!(std::mem::offset_of!(PointerAttributes, host_pointer), 16);
        assert_eq!(std::mem::offset_of!(PointerAttributes, reserved), 24);
    }

    /// Events are made with cudaEventBlockingSync: a thread waiting for a copy (an idle
    /// pipeline, a transfer ordered after the application's stream) sleeps instead of spinning
    /// a core in cudaEventSynchronize; and without timing, the cheapest to record and query.
    #[test]
    fn events_block_instead_of_spinning() {
        assert_eq!(EVENT_FLAGS & EVENT_BLOCKING_SYNC, EVENT_BLOCKING_SYNC);
        assert_eq!(EVENT_FLAGS & EVENT_DISABLE_TIMING, EVENT_DISABLE_TIMING);
        assert_eq!((EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING), (0x01, 0x02), "cudaEventBlockingSync, cudaEventDisableTiming");
    }

    #[test]
    fn the_runtime_must_not_be_newer_than_the_driver() {
        assert!(runtime_fits_driver(12090, 12040).is_ok(), "minor-version compatibility within 12");
        assert!(runtime_fits_driver(12000, 13000).is_ok(), "an older runtime on a newer driver");
        assert!(runtime_fits_driver(13000, 13000).is_ok());
        let e = runtime_fits_driver(CUDA_13, 12080).unwrap_err();
        assert!(e.contains("runtime 13.0 needs a CUDA 13 driver") && e.contains("12.8"), "{e}");
        assert!(runtime_fits_driver(12090, 0).unwrap_err().contains("no CUDA driver"));
    }

    #[test]
    fn search_order() {
        let o = LoadOptions { explicit: None, wheel_dirs: parse_dirs("/a::/b"), system: true };
        let c: Vec<String> = o.candidates().iter().map(|p| p.display().to_string()).collect();
        assert_eq!(c[0], "/a/nvidia/cuda_runtime/lib/libcudart.so.12");
        assert_eq!(c[2], "/b/nvidia/cuda_runtime/lib/libcudart.so.12");
        assert_eq!(&c[4..], &["libcudart.so.12", "libcudart.so.13", "libcudart.so"]);
        let e = LoadOptions { explicit: Some("/x/libcudart.so".into()), ..o };
        assert_eq!(e.candidates(), vec![PathBuf::from("/x/libcudart.so")]);
    }

    /// On a machine without a GPU (this CI), loading gives a typed error that says why and what
    /// to do; on a GPU machine it succeeds.
    #[test]
    fn open_here_is_a_typed_error_or_a_gpu() {
        match Cuda::open(0) {
            Ok(dev) => eprintln!("GPU present: {} via {}", dev.name(), dev.runtime().path().display()),
            Err(e @ DeviceError::NotFound { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("pip install nvidia-cuda-runtime-cu12") && msg.contains("libcudart.so.12"), "{msg}");
                eprintln!("{msg}");
            }
            Err(e @ DeviceError::NoDevice { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("no usable GPU") && msg.contains("cudaGetDeviceCount"), "{msg}");
                eprintln!("{msg}");
            }
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
    }

    #[test]
    fn explicit_path_is_the_only_one_tried() {
        let o = LoadOptions { explicit: Some("/nonexistent/libcudart.so.12".into()), wheel_dirs: vec![], system: true };
        let e = Cuda::open_with(&o, 0).unwrap_err();
        assert!(matches!(e, DeviceError::ExplicitLoad { .. }), "{e:?}");
        assert!(e.to_string().contains("MULTIRAIL_CUDART"), "{e}");
    }

    #[test]
    fn a_library_that_is_not_libcudart_is_refused() {
        let o = LoadOptions { explicit: Some("libc.so.6".into()), wheel_dirs: vec![], system: false };
        let e = Cuda::open_with(&o, 0).unwrap_err();
        assert!(matches!(e, DeviceError::MissingSymbol { symbol: "cudaGetDeviceCount", .. }), "{e:?}");
    }

    #[test]
    fn nothing_to_try_is_not_found() {
        let o = LoadOptions { explicit: None, wheel_dirs: vec!["/nonexistent".into()], system: false };
        let e = Cuda::open_with(&o, 0).unwrap_err();
        assert!(matches!(e, DeviceError::NotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("/nonexistent/nvidia/cuda_runtime/lib/libcudart.so.12 (absent)"), "{e}");
    }
}
