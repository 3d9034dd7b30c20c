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
//! it for the GPU at hand). It ships as [`FATBIN`]: SASS for sm_80, sm_90, sm_100 and sm_120
//! (ptxas of CUDA 12.9) and this PTX, built by `make kernels` (kernels/build.py) and checked in.
//! It is loaded with the driver API (`cuModuleLoadDataEx`, once per context: the driver takes
//! the SASS of the device's architecture or JIT-compiles the embedded PTX); if the fatbin does
//! not load there, the plain [`PTX`] is tried, and what was used is said once per device
//! ([`Loaded::image`], `multirail.gpu.info()["gather_kernel"]`). The kernel is then launched with `cuLaunchKernel` on the caller's stream. The piece table (dst, src, len as
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
///
/// Editing it needs `make kernels` (the fatbin embeds it; a test compares the two).
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

/// [`PTX`] assembled for [`SASS_ARCHS`], plus [`PTX`] itself, in one fatbin (`make kernels`).
pub const FATBIN: &[u8] = include_bytes!("../kernels/gather.fatbin");
/// The architectures [`FATBIN`] has SASS for (kernels/build.py's `ARCHS`).
pub const SASS_ARCHS: [u32; 4] = [80, 90, 100, 120];

type CuResult = c_int;
/// `CUjit_option` values used.
const JIT_ERROR_LOG_BUFFER: c_int = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;
/// `CUdevice_attribute`: compute capability major, minor.
const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;

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
    /// `cuCtxGetDevice(CUdevice*)` and `cuDeviceGetAttribute(int*, attr, CUdevice)`: the
    /// current device's compute capability, to say which image the driver took (optional).
    ctx_device: Option<unsafe extern "C" fn(*mut c_int) -> CuResult>,
    device_attribute: Option<unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult>,
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
            ctx_device: unsafe { lib.get(b"cuCtxGetDevice\0") }.ok().map(|s| *s),
            // SAFETY: as above; optional.
            device_attribute: unsafe { lib.get(b"cuDeviceGetAttribute\0") }.ok().map(|s| *s),
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Function(usize);

/// The kernel as loaded in one context, and which image the driver was given and took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub(crate) f: Function,
    /// `SASS sm_90 (fatbin)`, `PTX JIT for sm_75 (fatbin)`, `PTX JIT (plain PTX; the fatbin
    /// failed: ...)`: said once per device and reported by `multirail.gpu.info()`.
    pub image: String,
}

/// What [`FATBIN`] holds, as its container says (no toolkit needed to read it).
pub mod fatbin {
    /// One image of a fatbin.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Entry<'a> {
        /// 1: PTX, 2: ELF (a cubin of SASS).
        pub kind: u16,
        /// The architecture, as `sm_XY` -> XY.
        pub arch: u32,
        /// Entry flags (bit 0x2000: compressed).
        pub flags: u64,
        pub payload: &'a [u8],
    }

    pub const KIND_PTX: u16 = 1;
    pub const KIND_ELF: u16 = 2;
    const MAGIC: u32 = 0xBA55_ED50;

    fn u16_at(d: &[u8], at: usize) -> Option<u16> {
        Some(u16::from_le_bytes(d.get(at..at + 2)?.try_into().ok()?))
    }
    fn u32_at(d: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(d.get(at..at + 4)?.try_into().ok()?))
    }
    fn u64_at(d: &[u8], at: usize) -> Option<u64> {
        Some(u64::from_le_bytes(d.get(at..at + 8)?.try_into().ok()?))
    }

    /// The images of a fatbin (header: magic 0xBA55ED50, version u16, header size u16, size
    /// of the entries u64; each entry: kind u16, u16, header size u32, payload size u64, ...,
    /// arch u32 at 28, flags u64 at 40; its payload follows its header).
    pub fn entries(d: &[u8]) -> Result<Vec<Entry<'_>>, String> {
        let bad = |what: &str| format!("not a fatbin: {what}");
        if u32_at(d, 0) != Some(MAGIC) {
            return Err(bad("no magic 0xBA55ED50"));
        }
        let hs = usize::from(u16_at(d, 6).ok_or_else(|| bad("short header"))?);
        let size = u64_at(d, 8).and_then(|s| usize::try_from(s).ok()).ok_or_else(|| bad("short header"))?;
        let end = hs.checked_add(size).filter(|&e| e <= d.len()).ok_or_else(|| bad("size beyond the data"))?;
        let (mut at, mut out) = (hs, Vec::new());
        while at < end {
            let kind = u16_at(d, at).ok_or_else(|| bad("short entry"))?;
            let ehs = u32_at(d, at + 4).and_then(|v| usize::try_from(v).ok()).ok_or_else(|| bad("short entry"))?;
            let len = u64_at(d, at + 8).and_then(|v| usize::try_from(v).ok()).ok_or_else(|| bad("short entry"))?;
            let arch = u32_at(d, at + 28).ok_or_else(|| bad("short entry"))?;
            let flags = u64_at(d, at + 40).ok_or_else(|| bad("short entry"))?;
            let from = at.checked_add(ehs).ok_or_else(|| bad("entry header size"))?;
            let to = from.checked_add(len).filter(|&t| t <= end && ehs >= 48).ok_or_else(|| bad("entry beyond the data"))?;
            out.push(Entry { kind, arch, flags, payload: &d[from..to] });
            at = to;
        }
        Ok(out)
    }
}

/// Which image of `archs` (SASS) the driver takes for a device of compute capability `cc`:
/// the newest one of the same major version not newer than the device (SASS runs on later
/// minor versions of its major: sm_80 on sm_86 and sm_89); None: it JIT-compiles the PTX.
pub fn sass_for(archs: &[u32], cc: (i32, i32)) -> Option<u32> {
    let (major, minor) = (u32::try_from(cc.0).ok()?, u32::try_from(cc.1).ok()?);
    archs.iter().copied().filter(|a| a / 10 == major && a % 10 <= minor).max()
}

/// Loads a module image in the current context and finds the kernel in it (a fake in tests).
pub(crate) trait Loader {
    /// `image` is [`FATBIN`] (`fatbin`) or the NUL-terminated [`PTX`].
    fn load(&mut self, image: &[u8], fatbin: bool) -> std::result::Result<Function, String>;
    /// The current device's compute capability, when the driver says.
    fn compute_capability(&mut self) -> Option<(i32, i32)>;
}

/// The fatbin first, then the plain PTX; Err carries both reasons.
pub(crate) fn load_with(l: &mut dyn Loader) -> std::result::Result<Loaded, String> {
    let fat_err = match l.load(FATBIN, true) {
        Ok(f) => {
            let image = match l.compute_capability() {
                Some(cc) => match sass_for(&SASS_ARCHS, cc) {
                    Some(a) => format!("SASS sm_{a} (fatbin)"),
                    None => format!("PTX JIT for sm_{}{} (fatbin)", cc.0, cc.1),
                },
                None => "fatbin (SASS sm_80/90/100/120 or PTX JIT; compute capability unknown)".to_string(),
            };
            return Ok(Loaded { f, image });
        }
        Err(why) => why,
    };
    let mut ptx = PTX.as_bytes().to_vec();
    ptx.push(0);
    match l.load(&ptx, false) {
        Ok(f) => {
            let on = l.compute_capability().map(|cc| format!(" for sm_{}{}", cc.0, cc.1)).unwrap_or_default();
            Ok(Loaded { f, image: format!("PTX JIT{on} (plain PTX; the fatbin failed: {fat_err})") })
        }
        Err(why) => Err(format!("{why} (the fatbin failed too: {fat_err})")),
    }
}

/// The kernel in the context `ctx` (which must be current on this thread), loaded on first use
/// and said once (stderr); Err says why it cannot be used there (kept: not retried).
pub(crate) fn function(ctx: usize) -> std::result::Result<Loaded, String> {
    static LOADED: OnceLock<Mutex<HashMap<usize, std::result::Result<Loaded, String>>>> = OnceLock::new();
    let mut m = LOADED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.entry(ctx)
        .or_insert_with(|| {
            let r = api().and_then(|a| load_with(&mut Driver(a)));
            match &r {
                Ok(l) => eprintln!("multirail: gather kernel: {}", l.image),
                Err(why) => eprintln!("multirail: warning: gather kernel unusable on this device, small copies go by copy engines: {why}"),
            }
            r
        })
        .clone()
}

/// The real driver.
struct Driver(&'static KernelApi);

impl Loader for Driver {
    fn load(&mut self, image: &[u8], fatbin: bool) -> std::result::Result<Function, String> {
        let a = self.0;
        // The driver reads a fatbin through its 8-byte header fields: give it aligned memory.
        let mut buf = vec![0u64; image.len().div_ceil(8)];
        // SAFETY: `buf` has at least `image.len()` bytes; u8 has no alignment.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), buf.as_mut_ptr() as *mut u8, image.len()) };
        let what = if fatbin { "fatbin" } else { "PTX" };
        let mut log = vec![0u8; 4096];
        let mut opts = [JIT_ERROR_LOG_BUFFER, JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut vals = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
        let mut module = std::ptr::null_mut();
        // SAFETY: a fatbin or a NUL-terminated PTX image in aligned memory; the option arrays
        // have 2 entries and the log buffer outlives the call.
        let rc = unsafe { (a.load)(&mut module, buf.as_ptr() as *const c_void, 2, opts.as_mut_ptr(), vals.as_mut_ptr()) };
        if rc != 0 {
            let text = String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(log.len())]).trim().to_string();
            return Err(format!(
                "cuModuleLoadDataEx({KERNEL}, {what}): {}{}",
                describe(a, rc),
                if text.is_empty() { String::new() } else { format!(": {text}") }
            ));
        }
        let name = std::ffi::CString::new(KERNEL).map_err(|e| e.to_string())?;
        let mut f = std::ptr::null_mut();
        // SAFETY: a module just loaded; valid out-pointer.
        let rc = unsafe { (a.get_function)(&mut f, module, name.as_ptr()) };
        if rc != 0 || f.is_null() {
            return Err(format!("cuModuleGetFunction({KERNEL}, {what}): {}", describe(a, rc)));
        }
        Ok(Function(f as usize))
    }

    fn compute_capability(&mut self) -> Option<(i32, i32)> {
        let (get_dev, attr) = (self.0.ctx_device?, self.0.device_attribute?);
        let (mut dev, mut major, mut minor) = (0, 0, 0);
        // SAFETY: valid out-pointers; a context is current (function's contract).
        let ok =
            unsafe { get_dev(&mut dev) == 0 && attr(&mut major, ATTR_CC_MAJOR, dev) == 0 && attr(&mut minor, ATTR_CC_MINOR, dev) == 0 };
        ok.then_some((major, minor))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX as fatbinary stores it: each line's leading blanks dropped.
    fn as_packed(ptx: &str) -> String {
        ptx.split('\n').map(str::trim_start).collect::<Vec<_>>().join("\n")
    }

    /// The checked-in fatbin holds uncompressed SASS of the kernel for each of SASS_ARCHS and
    /// the PTX of this file: editing PTX without `make kernels` fails here (no toolkit needed;
    /// `make kernels-check` also rebuilds it byte for byte).
    #[test]
    fn fatbin_has_sass_for_each_arch_and_this_ptx() {
        let es = fatbin::entries(FATBIN).expect("parses");
        let mut archs: Vec<u32> = es.iter().filter(|e| e.kind == fatbin::KIND_ELF).map(|e| e.arch).collect();
        archs.sort_unstable();
        assert_eq!(archs, SASS_ARCHS.to_vec(), "SASS images");
        for e in &es {
            assert_eq!(e.flags & 0x2000, 0, "sm_{} is compressed", e.arch);
        }
        for e in es.iter().filter(|e| e.kind == fatbin::KIND_ELF) {
            assert!(e.payload.starts_with(b"\x7fELF"), "sm_{} is not an ELF cubin", e.arch);
            assert!(e.payload.windows(KERNEL.len() + 1).any(|w| w == b"mr_gather_copy\0"), "sm_{} lacks {KERNEL}", e.arch);
        }
        let ptx: Vec<_> = es.iter().filter(|e| e.kind == fatbin::KIND_PTX).collect();
        assert_eq!(ptx.len(), 1, "one PTX image");
        assert_eq!(ptx[0].arch, 70, "the PTX's target");
        let end = ptx[0].payload.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        let text = std::str::from_utf8(&ptx[0].payload[..end]).expect("utf-8 PTX");
        assert_eq!(text, as_packed(PTX), "kernels/gather.fatbin is stale: run `make kernels` after editing PTX");
    }

    #[test]
    fn a_changed_ptx_would_not_match() {
        // The comparison above is not blind to small edits (a register, a constant).
        assert_ne!(as_packed(&PTX.replace("and.b64 %rd7, %rd7, 15;", "and.b64 %rd7, %rd7, 7;")), as_packed(PTX));
    }

    #[test]
    fn bad_fatbins_are_refused() {
        assert!(fatbin::entries(b"").is_err());
        assert!(fatbin::entries(PTX.as_bytes()).is_err());
        let mut cut = FATBIN.to_vec();
        cut.truncate(FATBIN.len() - 100);
        assert!(fatbin::entries(&cut).unwrap_err().contains("beyond"));
        // An entry header claiming a huge payload.
        let mut big = FATBIN.to_vec();
        big[16 + 8..16 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(fatbin::entries(&big).is_err());
    }

    #[test]
    fn the_driver_takes_sass_of_the_same_major_not_newer() {
        let a = &SASS_ARCHS;
        assert_eq!(sass_for(a, (8, 0)), Some(80));
        assert_eq!(sass_for(a, (8, 6)), Some(80), "sm_80 SASS runs on sm_86");
        assert_eq!(sass_for(a, (8, 9)), Some(80));
        assert_eq!(sass_for(a, (9, 0)), Some(90));
        assert_eq!(sass_for(a, (10, 0)), Some(100));
        assert_eq!(sass_for(a, (10, 3)), Some(100));
        assert_eq!(sass_for(a, (12, 0)), Some(120));
        assert_eq!(sass_for(a, (12, 1)), Some(120));
        assert_eq!(sass_for(a, (7, 5)), None, "Turing: PTX JIT");
        assert_eq!(sass_for(a, (7, 0)), None);
        assert_eq!(sass_for(a, (11, 0)), None, "no SASS of that major: PTX JIT");
        assert_eq!(sass_for(a, (-1, 0)), None);
    }

    /// A driver that refuses the images listed and records what it was given.
    struct Fake {
        refuse_fatbin: Option<&'static str>,
        refuse_ptx: Option<&'static str>,
        cc: Option<(i32, i32)>,
        given: Vec<bool>,
    }

    impl Loader for Fake {
        fn load(&mut self, image: &[u8], fatbin: bool) -> std::result::Result<Function, String> {
            self.given.push(fatbin);
            if fatbin {
                assert_eq!(image, FATBIN);
            } else {
                assert_eq!(image.last(), Some(&0), "PTX is NUL-terminated");
                assert_eq!(&image[..image.len() - 1], PTX.as_bytes());
            }
            match if fatbin { self.refuse_fatbin } else { self.refuse_ptx } {
                Some(why) => Err(why.to_string()),
                None => Ok(Function(if fatbin { 1 } else { 2 })),
            }
        }
        fn compute_capability(&mut self) -> Option<(i32, i32)> {
            self.cc
        }
    }

    fn fake(refuse_fatbin: Option<&'static str>, refuse_ptx: Option<&'static str>, cc: Option<(i32, i32)>) -> Fake {
        Fake { refuse_fatbin, refuse_ptx, cc, given: Vec::new() }
    }

    #[test]
    fn the_fatbin_is_tried_first_and_says_which_image() {
        let mut l = fake(None, None, Some((9, 0)));
        assert_eq!(load_with(&mut l), Ok(Loaded { f: Function(1), image: "SASS sm_90 (fatbin)".into() }));
        assert_eq!(l.given, [true], "the PTX is not tried when the fatbin loads");
        let mut l = fake(None, None, Some((7, 5)));
        assert_eq!(load_with(&mut l).map(|x| x.image), Ok("PTX JIT for sm_75 (fatbin)".into()));
        let mut l = fake(None, None, None);
        assert!(load_with(&mut l).expect("loads").image.contains("compute capability unknown"));
    }

    #[test]
    fn a_fatbin_the_driver_refuses_falls_back_to_the_plain_ptx() {
        let mut l = fake(Some("CUDA_ERROR_UNSUPPORTED_PTX_VERSION"), None, Some((12, 0)));
        let got = load_with(&mut l).expect("the PTX loads");
        assert_eq!(got.f, Function(2));
        assert_eq!(got.image, "PTX JIT for sm_120 (plain PTX; the fatbin failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION)");
        assert_eq!(l.given, [true, false]);
    }

    #[test]
    fn both_failing_says_both_reasons() {
        let mut l = fake(Some("fat: no"), Some("ptx: no"), Some((9, 0)));
        assert_eq!(load_with(&mut l), Err("ptx: no (the fatbin failed too: fat: no)".into()));
    }
}
