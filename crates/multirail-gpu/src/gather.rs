//! One kernel launch for many device-to-device copies: `mr_gather_copy`.
//!
//! A CUDA IPC transfer of KV pages is thousands of small copies (4-64 KiB pages in shuffled
//! order). Measured on an H200 (docs/benchmarks.md), each copy costs the device about 4-5 µs
//! whether it is queued by `cudaMemcpyAsync` or by one `cudaMemcpyBatchAsync`: 0.9 GB/s for
//! 4 KiB pages, 17 GB/s for 64 KiB, against terabytes per second for one large copy. The copy
//! engines take the copies one at a time. This kernel takes them all at once: each thread block
//! copies whole pieces (16 bytes per thread per step when the piece's two addresses and length
//! are 16-byte aligned, byte by byte otherwise), blocks striding over the piece table.
//!
//! The kernel is PTX written for this crate (ISA 7.0, `sm_70`: any CUDA 11+ driver JIT-compiles
//! it for the GPU at hand), loaded with the driver API (`cuModuleLoadDataEx`, once per context)
//! and launched with `cuLaunchKernel` on the caller's stream. The piece table (dst, src, len as
//! three u64 each) is written to one of the stream's pinned host slots and copied from there to
//! a device buffer of the stream ([`crate::cuda::CudaStream`]) in stream order before the
//! launch, so the next transfer's table overwrites it only after this kernel has read it, and
//! queuing a launch never waits for the stream (an upload from pageable memory may).
//!
//! Trade-off: a kernel takes SMs, copy engines do not. [`crate::Cuda`] uses it only for batches
//! of small pieces ([`crate::cuda::ENV_CUDA_COPY`] says when and turns it on or off).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

/// The kernel's name in [`PTX`].
pub const KERNEL: &str = "mr_gather_copy";
/// Threads per block.
pub const BLOCK: u32 = 256;
/// Most blocks per launch (they stride over the table beyond that).
pub const MAX_GRID: u32 = 65_535;

/// `mr_gather_copy(const u64 *table, u32 n)`: piece `i` is `table[3i..3i+3]` = (dst, src, len);
/// block `b` copies pieces b, b + gridDim.x, ...; the table and both sides are device
/// (generic) addresses.
pub const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry mr_gather_copy(
    .param .u64 mr_table,
    .param .u32 mr_n
)
{
    .reg .pred %p<8>;
    .reg .b16 %rs<4>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<32>;

    ld.param.u64 %rd1, [mr_table];
    ld.param.u32 %r1, [mr_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %nctaid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
    cvt.u64.u32 %rd20, %r4;
    cvt.u64.u32 %rd21, %r5;

PIECE:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd2, %r2, 24;
    add.u64 %rd3, %rd1, %rd2;
    ld.u64 %rd4, [%rd3];
    ld.u64 %rd5, [%rd3+8];
    ld.u64 %rd6, [%rd3+16];
    or.b64 %rd7, %rd4, %rd5;
    or.b64 %rd7, %rd7, %rd6;
    and.b64 %rd7, %rd7, 15;
    setp.ne.u64 %p2, %rd7, 0;
    @%p2 bra BYTES;
    shr.u64 %rd8, %rd6, 4;
    mov.u64 %rd9, %rd20;
VEC:
    setp.ge.u64 %p3, %rd9, %rd8;
    @%p3 bra NEXT;
    shl.b64 %rd10, %rd9, 4;
    add.u64 %rd11, %rd5, %rd10;
    add.u64 %rd12, %rd4, %rd10;
    ld.v4.u32 {%r6, %r7, %r8, %r9}, [%rd11];
    st.v4.u32 [%rd12], {%r6, %r7, %r8, %r9};
    add.u64 %rd9, %rd9, %rd21;
    bra VEC;
BYTES:
    mov.u64 %rd9, %rd20;
BYTE:
    setp.ge.u64 %p4, %rd9, %rd6;
    @%p4 bra NEXT;
    add.u64 %rd11, %rd5, %rd9;
    add.u64 %rd12, %rd4, %rd9;
    ld.u8 %rs1, [%rd11];
    st.u8 [%rd12], %rs1;
    add.u64 %rd9, %rd9, %rd21;
    bra BYTE;
NEXT:
    add.u32 %r2, %r2, %r3;
    bra PIECE;
DONE:
    ret;
}
"#;

type CuResult = c_int;
/// `CUjit_option` values used.
const JIT_ERROR_LOG_BUFFER: c_int = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;

/// The driver-API calls the kernel needs (libcuda.so.1), loaded once.
struct KernelApi {
    /// `cuModuleLoadDataEx(CUmodule*, const void *image, unsigned n, CUjit_option*, void **values)`.
    load: unsafe extern "C" fn(*mut *mut c_void, *const c_void, c_uint, *mut c_int, *mut *mut c_void) -> CuResult,
    /// `cuModuleGetFunction(CUfunction*, CUmodule, const char *name)`.
    get_function: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CuResult,
    /// `cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, void **params, void **extra)`.
    launch: unsafe extern "C" fn(
        *mut c_void,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    /// `cuGetErrorName(CUresult, const char **)`.
    error_name: Option<unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>,
    _lib: Library,
}

fn api() -> std::result::Result<&'static KernelApi, String> {
    static F: OnceLock<std::result::Result<KernelApi, String>> = OnceLock::new();
    F.get_or_init(|| {
        // SAFETY: libcuda's initialisers are benign (no driver work before the first call).
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| format!("libcuda.so.1: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the field's type is this symbol's prototype in cuda.h.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(KernelApi {
            load: sym!("cuModuleLoadDataEx"),
            get_function: sym!("cuModuleGetFunction"),
            launch: sym!("cuLaunchKernel"),
            // SAFETY: as above; optional.
            error_name: unsafe { lib.get(b"cuGetErrorName\0") }.ok().map(|s| *s),
            _lib: lib,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn describe(a: &KernelApi, rc: CuResult) -> String {
    let mut name: *const c_char = std::ptr::null();
    match a.error_name {
        // SAFETY: valid out-pointer; the driver returns a static string.
        Some(f) if unsafe { f(rc, &mut name) } == 0 && !name.is_null() => {
            // SAFETY: NUL-terminated static string.
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        }
        _ => format!("CUresult {rc}"),
    }
}

/// A loaded `mr_gather_copy` (a `CUfunction`, valid for the life of its context).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function(usize);

/// The kernel in the context `ctx` (which must be current on this thread), loaded on first use;
/// Err says why it cannot be used there (kept: not retried).
pub(crate) fn function(ctx: usize) -> std::result::Result<Function, String> {
    static LOADED: OnceLock<Mutex<HashMap<usize, std::result::Result<Function, String>>>> = OnceLock::new();
    let mut m = LOADED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.entry(ctx).or_insert_with(load).clone()
}

fn load() -> std::result::Result<Function, String> {
    let a = api()?;
    let ptx = std::ffi::CString::new(PTX).expect("no NUL in the PTX");
    let mut log = vec![0u8; 4096];
    let mut opts = [JIT_ERROR_LOG_BUFFER, JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut vals = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let mut module = std::ptr::null_mut();
    // SAFETY: a NUL-terminated PTX image; the option arrays have 2 entries and the log buffer
    // outlives the call.
    let rc = unsafe { (a.load)(&mut module, ptx.as_ptr() as *const c_void, 2, opts.as_mut_ptr(), vals.as_mut_ptr()) };
    if rc != 0 {
        let text = String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(log.len())]).trim().to_string();
        return Err(format!(
            "cuModuleLoadDataEx({KERNEL}): {}{}",
            describe(a, rc),
            if text.is_empty() { String::new() } else { format!(": {text}") }
        ));
    }
    let name = std::ffi::CString::new(KERNEL).expect("no NUL");
    let mut f = std::ptr::null_mut();
    // SAFETY: a module just loaded; valid out-pointer.
    let rc = unsafe { (a.get_function)(&mut f, module, name.as_ptr()) };
    if rc != 0 || f.is_null() {
        return Err(format!("cuModuleGetFunction({KERNEL}): {}", describe(a, rc)));
    }
    Ok(Function(f as usize))
}

/// Launches `f` over the `n` pieces of the device table at `table` on `stream`.
///
/// # Safety
/// The context `f` was loaded in is current; `table` holds `3 * n` u64 in device memory, written
/// in stream order before this launch; every piece's ranges are valid device memory for its
/// length and no two destinations overlap, until the stream has passed this launch.
pub(crate) unsafe fn launch(f: Function, table: u64, n: u32, stream: *mut c_void) -> std::result::Result<(), String> {
    let a = api()?;
    let grid = n.clamp(1, MAX_GRID);
    let (mut p_table, mut p_n) = (table, n);
    let mut params = [&mut p_table as *mut u64 as *mut c_void, &mut p_n as *mut u32 as *mut c_void];
    // SAFETY: the caller's contract; params point at the kernel's two arguments (u64, u32),
    // which the driver copies at the call.
    let rc = unsafe { (a.launch)(f.0 as *mut c_void, grid, 1, 1, BLOCK, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut()) };
    if rc != 0 {
        return Err(format!("cuLaunchKernel({KERNEL}): {}", describe(a, rc)));
    }
    Ok(())
}
