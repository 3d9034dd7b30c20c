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

/// {"kind", "device", "name"} and, on the stand-in, its allocation counters.
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
        d.set_item("live_allocs", s.live_allocs())?;
    }
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
    Ok(d)
}
