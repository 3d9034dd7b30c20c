//! GPU helpers for Python: device memory for tests and the bench (`multirail.gpu`), and the
//! staging statistics as dicts. The device kind is `"cuda"`, `"standin"`, or None for
//! `$MULTIRAIL_GPU` (default cuda), as for agents.

use multirail::staging::{StageReport, STAGES};
use multirail::Error;
use multirail_gpu::{CopyKind, Device, DevicePtr, Gpu, GpuKind, MemKind};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub(crate) fn kind(k: Option<&str>) -> PyResult<GpuKind> {
    match k {
        None => GpuKind::from_env().map_err(PyValueError::new_err),
        Some(s) => GpuKind::parse(s).ok_or_else(|| PyValueError::new_err(format!("gpu must be 'cuda' or 'standin', not {s:?}"))),
    }
}

fn open(k: Option<&str>, device: i32) -> PyResult<Gpu> {
    Gpu::open(kind(k)?, device).map_err(|e| crate::to_py(Error::Gpu(format!("GPU {device}: {e}"))))
}

fn gpu_err(op: &str, e: impl std::fmt::Display) -> PyErr {
    crate::to_py(Error::Gpu(format!("{op}: {e}")))
}

/// Allocates `nbytes` of device memory; returns its address.
#[pyfunction]
#[pyo3(signature = (nbytes, device=0, kind=None))]
pub fn gpu_alloc(nbytes: usize, device: i32, kind: Option<&str>) -> PyResult<u64> {
    if nbytes == 0 {
        return Err(PyValueError::new_err("cannot allocate 0 bytes"));
    }
    open(kind, device)?.alloc(nbytes).map(|p| p.0).map_err(|e| gpu_err("device allocation", e))
}

/// Frees memory from `gpu_alloc` (the caller guarantees nothing uses it any more).
#[pyfunction]
#[pyo3(signature = (addr, device=0, kind=None))]
pub fn gpu_free(addr: u64, device: i32, kind: Option<&str>) -> PyResult<()> {
    let g = open(kind, device)?;
    // SAFETY: the Python wrapper frees each allocation once, after its users are done.
    unsafe { g.free(DevicePtr(addr)) }.map_err(|e| gpu_err("device free", e))
}

/// Synchronous copy of `nbytes` from `src` to `dst`; `direction` is "h2d", "d2h" or "d2d".
/// Host addresses are the caller's buffers (pageable memory is fine: CUDA stages it).
#[pyfunction]
#[pyo3(signature = (dst, src, nbytes, direction, device=0, kind=None))]
pub fn gpu_copy(py: Python<'_>, dst: u64, src: u64, nbytes: usize, direction: &str, device: i32, kind: Option<&str>) -> PyResult<()> {
    let k = match direction {
        "h2d" => CopyKind::HostToDevice,
        "d2h" => CopyKind::DeviceToHost,
        "d2d" => CopyKind::DeviceToDevice,
        _ => return Err(PyValueError::new_err(format!("direction must be 'h2d', 'd2h' or 'd2d', not {direction:?}"))),
    };
    let g = open(kind, device)?;
    // Both ends must be what the direction says, so a wrong address is an error, not a crash.
    let want_dev = |addr: u64, what: &str| -> PyResult<()> {
        match g.pointer_kind(addr).map_err(|e| gpu_err("pointer query", e))? {
            MemKind::Device { .. } | MemKind::Managed { .. } => Ok(()),
            other => Err(crate::to_py(Error::Gpu(format!("{what} {addr:#x} is not GPU memory ({other:?})")))),
        }
    };
    let want_dev_range = |addr: u64, what: &str| -> PyResult<()> {
        want_dev(addr, what)?;
        want_dev(addr + nbytes.max(1) as u64 - 1, what)
    };
    match k {
        CopyKind::HostToDevice => want_dev_range(dst, "destination")?,
        CopyKind::DeviceToHost => want_dev_range(src, "source")?,
        CopyKind::DeviceToDevice => {
            want_dev_range(dst, "destination")?;
            want_dev_range(src, "source")?;
        }
    }
    py.allow_threads(|| -> Result<(), multirail_gpu::DeviceError> {
        let stream = g.create_stream()?;
        let ev = g.create_event()?;
        // SAFETY: device ends checked above; host ends are the caller's live buffers of
        // `nbytes` (the Python wrapper passes numpy/bytearray buffers it holds), and the call
        // waits for the copy before returning.
        unsafe { g.copy_async(k, dst, src, nbytes, &stream)? };
        g.record(&ev, &stream)?;
        g.synchronize(&ev)
    })
    .map_err(|e| gpu_err("copy", e))
}

/// Streams made for the application through `multirail.gpu.Stream`, by raw handle.
type AppStreams = std::sync::Mutex<std::collections::HashMap<u64, (Gpu, multirail_gpu::GpuStream)>>;

fn app_streams() -> &'static AppStreams {
    static S: std::sync::OnceLock<AppStreams> = std::sync::OnceLock::new();
    S.get_or_init(Default::default)
}

fn lock_streams() -> std::sync::MutexGuard<'static, std::collections::HashMap<u64, (Gpu, multirail_gpu::GpuStream)>> {
    app_streams().lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn copy_kind(direction: &str) -> PyResult<CopyKind> {
    match direction {
        "h2d" => Ok(CopyKind::HostToDevice),
        "d2h" => Ok(CopyKind::DeviceToHost),
        "d2d" => Ok(CopyKind::DeviceToDevice),
        _ => Err(PyValueError::new_err(format!("direction must be 'h2d', 'd2h' or 'd2d', not {direction:?}"))),
    }
}

/// A new (non-blocking) stream on `device`; returns its raw handle (a `cudaStream_t` on CUDA).
#[pyfunction]
#[pyo3(signature = (device=0, kind=None))]
pub fn gpu_stream_create(device: i32, kind: Option<&str>) -> PyResult<u64> {
    let g = open(kind, device)?;
    let s = g.create_stream().map_err(|e| gpu_err("stream creation", e))?;
    let h = g.stream_handle(&s);
    lock_streams().insert(h, (g, s));
    Ok(h)
}

/// Destroys a stream from `gpu_stream_create` after what was queued on it has run.
#[pyfunction]
pub fn gpu_stream_destroy(py: Python<'_>, handle: u64) -> PyResult<()> {
    let s = lock_streams().remove(&handle);
    match s {
        Some((g, s)) => py.allow_threads(move || g.stream_synchronize(&s)).map_err(|e| gpu_err("stream synchronize", e)),
        None => Err(PyValueError::new_err(format!("no stream {handle:#x} made by multirail.gpu.Stream"))),
    }
}

/// Queues a pause of `seconds` on a stand-in stream: a "kernel" still running (tests of the
/// stream contract). CUDA streams refuse it: launch a real kernel there.
#[pyfunction]
pub fn gpu_stream_sleep(handle: u64, seconds: f64) -> PyResult<()> {
    let map = lock_streams();
    let (g, s) = map.get(&handle).ok_or_else(|| PyValueError::new_err(format!("no stream {handle:#x}")))?;
    match (g.as_standin(), s) {
        (Some(d), multirail_gpu::GpuStream::StandIn(s)) => {
            d.enqueue_sleep(s, std::time::Duration::from_secs_f64(seconds.clamp(0.0, 60.0))).map_err(|e| gpu_err("stream sleep", e))
        }
        _ => Err(PyValueError::new_err("sleep is a stand-in stream's stand-in for a kernel; on CUDA, launch a kernel")),
    }
}

/// Waits until the work queued on stream `handle` (any raw handle of `device`, 0 = its legacy
/// default stream, the application's included) before this call has completed.
#[pyfunction]
#[pyo3(signature = (handle, device=0, kind=None))]
pub fn gpu_stream_synchronize(py: Python<'_>, handle: u64, device: i32, kind: Option<&str>) -> PyResult<()> {
    let g = open(kind, device)?;
    py.allow_threads(|| -> Result<(), multirail_gpu::DeviceError> {
        let ev = g.create_event()?;
        g.record_external(&ev, handle)?;
        g.synchronize(&ev)
    })
    .map_err(|e| gpu_err("stream synchronize", e))
}

/// Queues a copy on a stream of `gpu_stream_create` and returns at once. The caller keeps both
/// ranges alive and untouched until the stream has run it (`gpu_stream_synchronize`).
#[pyfunction]
#[pyo3(signature = (dst, src, nbytes, direction, stream))]
pub fn gpu_copy_async(dst: u64, src: u64, nbytes: usize, direction: &str, stream: u64) -> PyResult<()> {
    let k = copy_kind(direction)?;
    let map = lock_streams();
    let (g, s) = map.get(&stream).ok_or_else(|| PyValueError::new_err(format!("no stream {stream:#x} made by multirail.gpu.Stream")))?;
    let dev_end = |addr: u64| matches!(g.pointer_kind(addr), Ok(MemKind::Device { .. } | MemKind::Managed { .. }));
    let dev_ok = |addr: u64| dev_end(addr) && dev_end(addr + nbytes.max(1) as u64 - 1);
    let ok = match k {
        CopyKind::HostToDevice => dev_ok(dst),
        CopyKind::DeviceToHost => dev_ok(src),
        CopyKind::DeviceToDevice => dev_ok(dst) && dev_ok(src),
    };
    if !ok {
        return Err(crate::to_py(Error::Gpu(format!("{direction} copy: the device side is not GPU memory of GPU {}", g.id()))));
    }
    // SAFETY: the device ends are checked above; the host end and liveness are the caller's
    // contract (the Python wrapper keeps the host array referenced until synchronised).
    unsafe { g.copy_async(k, dst, src, nbytes, s) }.map_err(|e| gpu_err("copy", e))
}

/// The calling thread's current stand-in device (the stand-in's `cudaGetDevice`), or None.
#[pyfunction]
pub fn gpu_current_device() -> Option<i32> {
    multirail_gpu::standin::current_device()
}

/// Sets the calling thread's current stand-in device (the stand-in's `cudaSetDevice`).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn gpu_set_current_device(device: Option<i32>) {
    multirail_gpu::standin::set_current_device(device)
}

/// The stand-in's modelled hazards, for tests (docs/gpu.md, "The stand-in"):
/// `fail_query`/`fail_synchronize` (the `n`-th next call on `device` fails), `begin_capture`/
/// `end_capture` of `stream` (global mode; ending an invalidated capture raises), `contexts`
/// (devices with a context), `peers` (enabled pairs, flattened), `sticky` ([1] when `device`
/// has a sticky error).
#[pyfunction]
#[pyo3(signature = (action, device=0, n=0, stream=0))]
pub fn gpu_standin(action: &str, device: i32, n: u64, stream: u64) -> PyResult<Vec<i64>> {
    use multirail_gpu::standin;
    let fail = |op: multirail_gpu::FailOp| -> PyResult<Vec<i64>> {
        let g = open(Some("standin"), device)?;
        g.as_standin().ok_or_else(|| PyValueError::new_err("not a stand-in"))?.fail_in(op, n);
        Ok(Vec::new())
    };
    match action {
        "fail_query" => fail(multirail_gpu::FailOp::Query),
        "fail_synchronize" => fail(multirail_gpu::FailOp::Synchronize),
        "fail_copy" => fail(multirail_gpu::FailOp::Copy),
        "begin_capture" => standin::begin_capture(stream).map(|_| Vec::new()).map_err(|e| gpu_err("begin capture", e)),
        "end_capture" => standin::end_capture(stream).map(|_| Vec::new()).map_err(|e| gpu_err("end capture", e)),
        "contexts" => Ok(standin::contexts().into_iter().map(i64::from).collect()),
        "peers" => Ok(standin::peers_enabled().into_iter().flat_map(|(a, b)| [i64::from(a), i64::from(b)]).collect()),
        "sticky" => Ok(standin::sticky_error(device).map(|_| vec![1]).unwrap_or_default()),
        _ => Err(PyValueError::new_err(format!("unknown stand-in action {action:?}"))),
    }
}

/// {"kind", "device", "name"}; on CUDA "gather_kernel" (the image the device runs: `SASS sm_90
/// (fatbin)`, `PTX JIT ...`, or `unusable: why`); on the stand-in its allocation counters.
#[pyfunction]
#[pyo3(signature = (device=0, kind=None))]
pub fn gpu_info<'py>(py: Python<'py>, device: i32, kind: Option<&str>) -> PyResult<Bound<'py, PyDict>> {
    let g = open(kind, device)?;
    let d = PyDict::new(py);
    d.set_item("kind", g.kind().as_str())?;
    d.set_item("device", g.id())?;
    d.set_item("name", g.name())?;
    if let Some(s) = g.as_standin() {
        d.set_item("device_allocs", s.device_allocs())?;
        d.set_item("pinned_allocs", s.pinned_allocs())?;
        d.set_item("pinned_frees", s.pinned_frees())?;
        d.set_item("live_allocs", s.live_allocs())?;
    }
    if let Some(k) = g.gather_kernel() {
        d.set_item("gather_kernel", k.unwrap_or_else(|why| format!("unusable: {why}")))?;
    }
    d.set_item("idle_pool_bytes", multirail::staging::idle_pool_bytes())?;
    // The process-wide pinned budget (docs/gpu.md, "The pinned budget").
    d.set_item("pinned_bytes", multirail::staging::pinned_bytes())?;
    d.set_item("pinned_max", multirail::staging::pinned_max())?;
    d.set_item("pinned_on_demand", multirail::staging::pinned_on_demand())?;
    Ok(d)
}

/// The staging totals as a dict: per stage (d2h, wire, h2d) ops, bytes and seconds busy.
pub(crate) fn staging_dict<'py>(py: Python<'py>, r: &StageReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (i, name) in STAGES.iter().enumerate() {
        let s = PyDict::new(py);
        s.set_item("ops", r.ops[i])?;
        s.set_item("bytes", r.bytes[i])?;
        s.set_item("busy_s", r.busy_ns[i] as f64 / 1e9)?;
        d.set_item(*name, s)?;
    }
    d.set_item("chunks", r.chunks)?;
    d.set_item("pool_bytes", r.pool_bytes)?;
    d.set_item("pools", r.pools)?;
    d.set_item("overlapped", r.overlapped)?;
    Ok(d)
}
