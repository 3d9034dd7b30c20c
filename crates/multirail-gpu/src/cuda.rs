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
//! Choices: streams are created non-blocking (`cudaStreamCreateWithFlags(cudaStreamNonBlocking)`,
//! so staging never synchronises with work on the legacy default stream), events without timing
//! (`cudaEventDisableTiming`: cheapest record/query). The current device is per host thread in
//! CUDA, so every call that depends on it sets it first.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::Library;

use crate::device::{CopyKind, Device, DeviceError, DevicePtr, IpcHandle, MemKind, PinnedMem, Result};

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
const EVENT_DISABLE_TIMING: c_uint = 2;
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// Bytes reserved for `cudaDeviceProp` (about 1 KiB in CUDA 12 and 13; `name` comes first).
const DEVICE_PROP_BYTES: usize = 8192;

/// `cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr)`.
type AddressRange = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;

/// The driver API's `cuMemGetAddressRange_v2` (libcuda.so.1, present wherever a driver is):
/// the runtime API has no call that finds an allocation's base. Loaded once; None when absent.
fn address_range() -> Option<AddressRange> {
    static F: std::sync::OnceLock<Option<(Library, AddressRange)>> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        // SAFETY: loading the CUDA driver library runs its initialisers, which are benign (no
        // driver work happens before the first call).
        let lib = unsafe { Library::new("libcuda.so.1") }.ok()?;
        // SAFETY: the prototype of cuMemGetAddressRange_v2 in cuda.h.
        let f: AddressRange = unsafe { *lib.get::<AddressRange>(b"cuMemGetAddressRange_v2\0").ok()? };
        Some((lib, f))
    })
    .as_ref()
    .map(|(_, f)| *f)
}

/// `cudaPointerAttributes` (CUDA 11 and later).
#[repr(C)]
struct PointerAttributes {
    kind: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
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
    set_device: unsafe extern "C" fn(c_int) -> Err,
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
            set_device: sym!("cudaSetDevice"),
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
            get_device_properties: props.ok().map(|s| *s),
        })
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
    // Dropped last: the function pointers in `api` point into it.
    _lib: Library,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime").field("path", &self.path).finish()
    }
}

impl CudaRuntime {
    /// Loads the first libcudart of `opts.candidates()` that opens and has every symbol.
    pub fn load(opts: &LoadOptions) -> Result<Arc<CudaRuntime>> {
        let mut tried = Vec::new();
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
                    return Ok(Arc::new(CudaRuntime { api, path, _lib: lib }));
                }
                Err(e) if opts.explicit.is_some() => return Err(DeviceError::ExplicitLoad { path, reason: e.to_string() }),
                Err(e) => tried.push(format!("{} ({e})", path.display())),
            }
        }
        if tried.is_empty() {
            tried.push("nothing: no wheel dirs and system search off".into());
        }
        Err(DeviceError::NotFound { tried: tried.join("; ") })
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
}

/// A CUDA stream (destroyed on drop).
#[derive(Debug)]
pub struct CudaStream {
    rt: Arc<CudaRuntime>,
    raw: Stream,
}

/// A CUDA event (destroyed on drop).
#[derive(Debug)]
pub struct CudaEvent {
    rt: Arc<CudaRuntime>,
    raw: Event,
}

// SAFETY: CUDA streams and events may be used from any host thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Send for CudaEvent {}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: created by cudaStreamCreateWithFlags, destroyed once. Errors here (a context
        // torn down at exit) leave nothing to do.
        unsafe { (self.rt.api.stream_destroy)(self.raw) };
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: created by cudaEventCreateWithFlags, destroyed once.
        unsafe { (self.rt.api.event_destroy)(self.raw) };
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
        let dev = Cuda { rt, id, name: String::new() };
        dev.current()?;
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

    /// Makes this device current on the calling thread.
    fn current(&self) -> Result<()> {
        // SAFETY: plain call with a valid ordinal.
        self.rt.check("cudaSetDevice", unsafe { (self.api().set_device)(self.id) })
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
        self.current()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaMalloc", unsafe { (self.api().malloc)(&mut p, len) })?;
        Ok(DevicePtr(p as u64))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.current()?;
        // SAFETY: the caller's contract (allocated by cudaMalloc, unused).
        self.rt.check("cudaFree", unsafe { (self.api().free)(ptr.0 as *mut c_void) })
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        self.current()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaMallocHost", unsafe { (self.api().malloc_host)(&mut p, len) })?;
        // SAFETY: `len` bytes of pinned host memory, valid until cudaFreeHost.
        Ok(unsafe { PinnedMem::from_raw(p.cast(), len) })
    }

    unsafe fn free_pinned(&self, mem: PinnedMem) -> Result<()> {
        // SAFETY: the caller's contract (from cudaMallocHost, unused).
        self.rt.check("cudaFreeHost", unsafe { (self.api().free_host)(mem.as_ptr().cast()) })
    }

    fn pointer_kind(&self, addr: u64) -> Result<MemKind> {
        let mut a = PointerAttributes { kind: 0, device: -1, device_pointer: std::ptr::null_mut(), host_pointer: std::ptr::null_mut() };
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
        self.current()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaStreamCreateWithFlags", unsafe { (self.api().stream_create_with_flags)(&mut s, STREAM_NON_BLOCKING) })?;
        Ok(CudaStream { rt: self.rt.clone(), raw: s })
    }

    fn create_event(&self) -> Result<CudaEvent> {
        self.current()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.rt.check("cudaEventCreateWithFlags", unsafe { (self.api().event_create_with_flags)(&mut e, EVENT_DISABLE_TIMING) })?;
        Ok(CudaEvent { rt: self.rt.clone(), raw: e })
    }

    unsafe fn copy_async(&self, kind: CopyKind, dst: u64, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
        self.current()?;
        let k = match kind {
            CopyKind::HostToDevice => MEMCPY_H2D,
            CopyKind::DeviceToHost => MEMCPY_D2H,
            CopyKind::DeviceToDevice => MEMCPY_D2D,
        };
        // SAFETY: the caller's contract on both ranges; the stream is live.
        self.rt.check("cudaMemcpyAsync", unsafe { (self.api().memcpy_async)(dst as *mut c_void, src as *const c_void, len, k, stream.raw) })
    }

    fn record(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        // SAFETY: live event and stream.
        self.rt.check("cudaEventRecord", unsafe { (self.api().event_record)(event.raw, stream.raw) })
    }

    fn query(&self, event: &CudaEvent) -> Result<bool> {
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
        // SAFETY: live event.
        self.rt.check("cudaEventSynchronize", unsafe { (self.api().event_synchronize)(event.raw) })
    }

    fn alloc_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        self.current()?;
        let f = address_range().ok_or(DeviceError::Unsupported { op: "cuMemGetAddressRange (no libcuda.so.1)", device: "CUDA" })?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the driver checks `ptr` (the runtime made the primary
        // context current on this thread in `current`).
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
        self.current()?;
        let mut h = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer; CUDA checks that `ptr` is a device allocation.
        self.rt.check("cudaIpcGetMemHandle", unsafe { (self.api().ipc_get_mem_handle)(&mut h, ptr.0 as *mut c_void) })?;
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }

    unsafe fn ipc_open(&self, handle: &IpcHandle) -> Result<DevicePtr> {
        self.current()?;
        let h = IpcMemHandle { reserved: handle.0.map(|b| b as c_char) };
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle's validity is the caller's contract.
        self.rt.check("cudaIpcOpenMemHandle", unsafe { (self.api().ipc_open_mem_handle)(&mut p, h, IPC_LAZY_ENABLE_PEER_ACCESS) })?;
        Ok(DevicePtr(p as u64))
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        self.current()?;
        // SAFETY: the caller's contract (from ipc_open, unused).
        self.rt.check("cudaIpcCloseMemHandle", unsafe { (self.api().ipc_close_mem_handle)(ptr.0 as *mut c_void) })
    }

    fn uuid(&self) -> Result<[u8; 16]> {
        self.rt.device_uuid(self.id)
    }
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
