//! `multirail._core`: thin PyO3 bindings. Conversions and exception mapping only; the Python
//! API (`python/multirail/agent.py`) builds the user-facing surface on top.
//!
//! Descriptor lists cross the boundary as contiguous Nx3 uint64 arrays (address of the first
//! element + row count), so no per-descriptor Python object is created on either side.

mod gpu;

use std::borrow::Cow;
use std::time::Duration;

use multirail::config::{Config, Progress, RailSpec};
use multirail::{Agent, Error, Op, XferHandle, XferState};
use multirail_proto::codec::Status;
use multirail_proto::{Access, DecodeError, DescList, MemType, Policy};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// Map every runtime error onto exactly one class of python/multirail/errors.py.
fn to_py(e: Error) -> PyErr {
    let class = match &e {
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::UnknownPeer(_) => "UnknownPeerError",
        Error::NotRegistered { .. } => "NotRegisteredError",
        Error::OutOfBounds { .. } => "OutOfBoundsError",
        Error::LengthMismatch { .. } => "LengthMismatchError",
        Error::Remote { status, .. } => match status {
            Status::BadKey | Status::UnknownRegion => "AccessDeniedError",
            Status::ReadOnly => "ReadOnlyError",
            Status::OutOfBounds => "OutOfBoundsError",
            Status::TooLarge | Status::Malformed | Status::Unexpected => "ProtocolError",
            Status::VersionMismatch => "VersionMismatchError",
            Status::AuthFailed => "AuthenticationError",
            Status::Ok | Status::Busy | Status::Internal => "TransferError",
        },
        Error::Decode { source: DecodeError::VersionMismatch { .. }, .. } => "VersionMismatchError",
        Error::Decode { .. } | Error::Protocol { .. } => "ProtocolError",
        Error::Metadata(_) => "MetadataError",
        Error::StaleMetadata { .. } => "StaleMetadataError",
        Error::Auth { .. } => "AuthenticationError",
        Error::PeerLost { .. } => "PeerLostError",
        Error::Timeout(_) => "TransferTimeoutError",
        Error::AddrInUse(_) => "AddressInUseError",
        Error::Io { kind, .. } => match kind {
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted => {
                "PeerLostError"
            }
            _ => "TransferError",
        },
        Error::Closed => "TransferError",
        Error::Unavailable(_) => "TransportUnavailableError",
        Error::Gpu(_) => "GpuError",
    };
    Python::with_gil(|py| {
        let made = py.import("multirail.errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1((e.to_string(),)));
        match made {
            Ok(obj) => PyErr::from_value(obj),
            Err(err) => err,
        }
    })
}

fn parse_policy(s: &str) -> PyResult<Policy> {
    match s {
        "weighted" => Ok(Policy::Weighted),
        "round_robin" | "round-robin" | "rr" => Ok(Policy::RoundRobin),
        _ => match s.strip_prefix("pinned:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => Ok(Policy::Pinned(n)),
            None => Err(PyValueError::new_err(format!("unknown policy {s:?}: expected weighted, round_robin or pinned:N"))),
        },
    }
}

fn parse_mem(s: &str) -> PyResult<MemType> {
    match s.to_ascii_uppercase().as_str() {
        "DRAM" | "CPU" => Ok(MemType::Dram),
        "VRAM" | "GPU" | "CUDA" => Ok(MemType::Vram),
        _ => Err(PyValueError::new_err(format!("unknown memory type {s:?}: expected DRAM or VRAM"))),
    }
}

fn mem_name(m: MemType) -> &'static str {
    match m {
        MemType::Dram => "DRAM",
        MemType::Vram => "VRAM",
    }
}

/// The rows of an NxW uint64 array at `ptr`, read in place (copied only when `ptr` is not
/// 8-byte aligned): W = 3 for plain descriptors (address, len, device), 5 for strided ones
/// (address, len, device, stride, count).
///
/// # Safety
/// `ptr` is the data pointer of a C-contiguous (n, W) uint64 array that the caller (the Python
/// layer) holds, unchanged, for as long as the returned rows are used; the GIL may be released
/// meanwhile (a thread that rewrites the array under a running call gets rows that are
/// validated like any others).
unsafe fn rows<'a, const W: usize>(ptr: usize, n: usize) -> Cow<'a, [[u64; W]]> {
    if n == 0 {
        Cow::Borrowed(&[])
    } else if (ptr as *const [u64; W]).is_aligned() {
        Cow::Borrowed(std::slice::from_raw_parts(ptr as *const [u64; W], n))
    } else {
        Cow::Owned((0..n).map(|i| std::ptr::read_unaligned((ptr as *const [u64; W]).add(i))).collect())
    }
}

/// `Agent::prepare` or `Agent::prepare_strided`, for descriptors of W u64.
type Build<const W: usize> = fn(&Agent, Op, &[[u64; W]], &[[u64; W]], &str, Vec<u8>) -> multirail::Result<XferHandle>;

/// What `prepare` and `prepare_strided` share: parse `op`, read both NxW descriptor arrays in
/// place (the Python layer holds them until this returns, see `rows`), and have `build` make
/// the handle with the GIL released.
#[allow(clippy::too_many_arguments)]
fn prepare_rows<const W: usize>(
    py: Python<'_>,
    agent: &Agent,
    op: &str,
    (lptr, ln): (usize, usize),
    (rptr, rn): (usize, usize),
    peer: &str,
    notif: Vec<u8>,
    build: Build<W>,
) -> PyResult<PyXfer> {
    let op = Op::parse(op).map_err(to_py)?;
    // SAFETY: see `rows`; the Python layer holds both arrays until this returns.
    let (local, remote) = unsafe { (rows::<W>(lptr, ln), rows::<W>(rptr, rn)) };
    py.allow_threads(|| build(agent, op, &local, &remote, peer, notif)).map(PyXfer).map_err(to_py)
}

/// (interface, address, prefix length, speed Mbit/s, MTU, NUMA node, RDMA device, bind device)
type RailRow = (String, String, u8, u64, u32, i32, String, bool);

#[pyclass(name = "Agent", module = "multirail._core", frozen)]
struct PyAgent(Agent);

#[pyclass(name = "XferHandle", module = "multirail._core", frozen)]
struct PyXfer(XferHandle);

#[pymethods]
impl PyAgent {
    #[new]
    #[pyo3(signature = (name, host, port, connections, rails, rail_map, policy, chunk_size, stripe_threshold, timeout_s, stall_timeout_s, secret=None, progress="adaptive", spin_us=200.0, transport="tcp", faults="", gpu=None, staging_buffers=4, staging_buffer_size=1048576, gpu_ipc=true, rail_transports=Vec::new(), fallback_after=3, fallback_cooldown_s=5.0, fallback_max_switches=8, vectored=true, fan_in_window="auto", serve_spin_us=1000.0, accept_metaput=false, max_peers=multirail::config::DEFAULT_MAX_PEERS, max_connections=1024, max_handshakes=256, staging_pinned_max=multirail::staging::DEFAULT_PINNED_MAX))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        host: &str,
        port: u16,
        connections: usize,
        rails: Vec<RailRow>,
        rail_map: Vec<(usize, usize)>,
        policy: &str,
        chunk_size: u64,
        stripe_threshold: u64,
        timeout_s: f64,
        stall_timeout_s: f64,
        secret: Option<Vec<u8>>,
        progress: &str,
        spin_us: f64,
        transport: &str,
        faults: &str,
        gpu: Option<&str>,
        staging_buffers: usize,
        staging_buffer_size: u64,
        gpu_ipc: bool,
        rail_transports: Vec<String>,
        fallback_after: u32,
        fallback_cooldown_s: f64,
        fallback_max_switches: u32,
        vectored: bool,
        fan_in_window: &str,
        serve_spin_us: f64,
        accept_metaput: bool,
        max_peers: usize,
        max_connections: usize,
        max_handshakes: usize,
        staging_pinned_max: u64,
    ) -> PyResult<Self> {
        let mut cfg = Config { host: host.to_string(), port, connections, rail_map, secret, ..Config::default() };
        for (rname, addr, prefix_len, speed_mbps, mtu, numa, rdma_dev, bind_device) in rails {
            let addr = addr.parse().map_err(|_| PyValueError::new_err(format!("bad rail address {addr:?}")))?;
            cfg.rails.push(RailSpec { name: rname, addr, prefix_len, speed_mbps, mtu, numa, rdma_dev, bind_device });
        }
        cfg.planner.policy = parse_policy(policy)?;
        if !(4096..=multirail_proto::codec::MAX_CHUNK).contains(&chunk_size) {
            return Err(PyValueError::new_err("chunk_size must be between 4 KiB and 64 MiB"));
        }
        cfg.planner.chunk_size = chunk_size;
        cfg.planner.min_chunk = cfg.planner.min_chunk.min(chunk_size);
        cfg.planner.stripe_threshold = stripe_threshold;
        if !(timeout_s > 0.0 && stall_timeout_s > 0.0) {
            return Err(PyValueError::new_err("timeouts must be positive"));
        }
        cfg.timeout = Duration::from_secs_f64(timeout_s);
        cfg.planner.stall_timeout = Duration::from_secs_f64(stall_timeout_s);
        cfg.progress = Progress::parse(progress)
            .ok_or_else(|| PyValueError::new_err(format!("progress must be 'poll', 'block' or 'adaptive', not {progress:?}")))?;
        if !(0.0..=1e6).contains(&spin_us) {
            return Err(PyValueError::new_err("spin_us must be between 0 and 1,000,000"));
        }
        cfg.spin = Duration::from_secs_f64(spin_us / 1e6);
        if !(0.0..=1e6).contains(&serve_spin_us) {
            return Err(PyValueError::new_err("serve_spin_us must be between 0 and 1,000,000"));
        }
        cfg.serve_spin = Duration::from_secs_f64(serve_spin_us / 1e6);
        let kind = |t: &str| {
            multirail::config::TransportKind::parse(t)
                .ok_or_else(|| PyValueError::new_err(format!("transport must be 'tcp', 'ucx' or 'auto', not {t:?}")))
        };
        cfg.transport = kind(transport)?;
        cfg.rail_transports =
            rail_transports.iter().map(|t| if t.is_empty() { Ok(None) } else { kind(t).map(Some) }).collect::<PyResult<_>>()?;
        if !(0.001..=86_400.0).contains(&fallback_cooldown_s) {
            return Err(PyValueError::new_err("fallback_cooldown must be between 1 ms and a day"));
        }
        cfg.fallback = multirail::config::FallbackPolicy {
            after: fallback_after,
            cooldown: Duration::from_secs_f64(fallback_cooldown_s),
            max_cooldown: Duration::from_secs_f64(fallback_cooldown_s).max(Duration::from_secs(300)),
            max_switches: fallback_max_switches,
        };
        cfg.faults = multirail::transport::faulty::Fault::parse_list(faults).map_err(PyValueError::new_err)?;
        cfg.staging.gpu = gpu::kind(gpu)?;
        if !(2..=64).contains(&staging_buffers) {
            return Err(PyValueError::new_err("staging_buffers must be between 2 and 64 (2 is what overlap needs)"));
        }
        if !(4096..=multirail_proto::codec::MAX_CHUNK).contains(&staging_buffer_size) {
            return Err(PyValueError::new_err("staging_buffer_size must be between 4 KiB and 64 MiB"));
        }
        cfg.staging.pool = multirail_gpu::PoolConfig { buffers: staging_buffers, buffer_size: staging_buffer_size };
        cfg.staging.ipc = gpu_ipc;
        if staging_pinned_max < 2 * cfg.staging.pool.bytes() {
            return Err(PyValueError::new_err(format!(
                "staging_pinned_max ({staging_pinned_max} bytes) must hold a staging pool per direction (2 x staging_buffers x staging_buffer_size = {} bytes)",
                2 * cfg.staging.pool.bytes()
            )));
        }
        cfg.staging.pinned_max = staging_pinned_max;
        cfg.vectored = vectored;
        cfg.accept_metaput = accept_metaput;
        if max_peers == 0 {
            return Err(PyValueError::new_err("max_peers must be at least 1"));
        }
        cfg.max_peers = max_peers;
        if max_connections == 0 || max_handshakes == 0 {
            return Err(PyValueError::new_err("max_connections and max_handshakes must be at least 1"));
        }
        cfg.max_connections = max_connections;
        cfg.max_handshakes = max_handshakes;
        cfg.fan_in_window = multirail::FanInWindow::parse(fan_in_window)
            .ok_or_else(|| PyValueError::new_err(format!("fan_in_window: {fan_in_window:?} is not 'auto', 'off' or a byte count")))?;
        let name = name.to_string();
        py.allow_threads(|| Agent::new(&name, cfg)).map(PyAgent).map_err(to_py)
    }

    #[getter]
    fn name(&self) -> String {
        self.0.name().to_string()
    }
    #[getter]
    fn port(&self) -> u16 {
        self.0.port()
    }
    #[getter]
    fn incarnation(&self) -> u64 {
        self.0.incarnation()
    }

    /// Register [addr, addr+len); returns the region id.
    fn register(&self, addr: u64, len: u64, dev: u32, mem: &str, access: &str) -> PyResult<u64> {
        let access = match access {
            "rw" | "read_write" => Access::ReadWrite,
            "ro" | "read_only" => Access::ReadOnly,
            "local" | "none" => Access::Local,
            other => return Err(PyValueError::new_err(format!("unknown access {other:?}: expected rw, ro or local"))),
        };
        self.0.register(addr, len, dev, parse_mem(mem)?, access).map(|r| r.id).map_err(to_py)
    }

    fn deregister(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        py.allow_threads(|| self.0.deregister(id)).map_err(to_py)
    }

    /// (addr, len, dev) of every registered region containing each descriptor, or an error.
    fn check_local(&self, ptr: usize, n: usize) -> PyResult<()> {
        // SAFETY: see `rows`; the array is only read before this returns.
        self.0.resolve_local(&unsafe { rows(ptr, n) }).map(|_| ()).map_err(to_py)
    }

    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.metadata().encode())
    }

    fn add_remote(&self, blob: &[u8]) -> PyResult<String> {
        self.0.add_remote(blob).map_err(to_py)
    }
    fn remove_remote(&self, name: &str) -> PyResult<()> {
        self.0.remove_remote(name).map_err(to_py)
    }
    fn has_remote(&self, name: &str) -> bool {
        self.0.has_remote(name)
    }
    fn fetch_remote(&self, py: Python<'_>, name: &str, ip: &str, port: u16) -> PyResult<String> {
        py.allow_threads(|| self.0.fetch_remote(name, ip, port)).map_err(to_py)
    }
    fn send_local(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<()> {
        py.allow_threads(|| self.0.send_local(ip, port)).map_err(to_py)
    }
    fn connect(&self, py: Python<'_>, peer: &str) -> PyResult<()> {
        py.allow_threads(|| self.0.peer(peer).and_then(|p| p.link()).map(|_| ())).map_err(to_py)
    }

    /// Build a transfer handle from two Nx3 uint64 arrays (data pointer, rows), read in place
    /// with the GIL released.
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        op: &str,
        lptr: usize,
        ln: usize,
        rptr: usize,
        rn: usize,
        peer: &str,
        notif: Vec<u8>,
    ) -> PyResult<PyXfer> {
        prepare_rows::<3>(py, &self.0, op, (lptr, ln), (rptr, rn), peer, notif, Agent::prepare::<[u64; 3]>)
    }

    /// `prepare` from two Nx5 strided descriptor arrays, kept compressed.
    #[allow(clippy::too_many_arguments)]
    fn prepare_strided(
        &self,
        py: Python<'_>,
        op: &str,
        lptr: usize,
        ln: usize,
        rptr: usize,
        rn: usize,
        peer: &str,
        notif: Vec<u8>,
    ) -> PyResult<PyXfer> {
        prepare_rows::<5>(py, &self.0, op, (lptr, ln), (rptr, rn), peer, notif, Agent::prepare_strided)
    }

    fn send_notif(&self, py: Python<'_>, peer: &str, msg: Vec<u8>) -> PyResult<()> {
        py.allow_threads(|| self.0.send_notif(peer, &msg)).map_err(to_py)
    }

    /// Notifications not yet taken; with none queued, sleep (GIL released) up to `timeout`
    /// seconds for one.
    #[pyo3(signature = (timeout=0.0))]
    fn take_notifs<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        if timeout.is_nan() {
            return Err(PyValueError::new_err("timeout must be a number of seconds, not NaN"));
        }
        let got = if timeout > 0.0 {
            // inf (or any longer wait) sleeps ~31 years: until a notification or close().
            let wait = Duration::from_secs_f64(timeout.min(1e9));
            py.allow_threads(|| self.0.wait_notifs(wait))
        } else {
            self.0.take_notifs()
        };
        Ok(got.into_iter().map(|(n, b)| (n, PyBytes::new(py, &b))).collect())
    }

    /// (transport, UCX version or None, UCX rail restrictions or None).
    fn transport_info(&self) -> (String, Option<String>, Option<String>) {
        self.0.transport_info()
    }

    /// Per local rail: (transport, reason, unprotected: UCX without RDMA).
    fn rail_transports(&self) -> Vec<(String, String, bool)> {
        self.0.rail_transports()
    }

    fn rail_stats<'py>(&self, py: Python<'py>, peer: &str) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in self.0.rail_stats(peer).map_err(to_py)? {
            let d = PyDict::new(py);
            d.set_item("name", r.name)?;
            d.set_item("local_addr", r.local_addr)?;
            d.set_item("remote_addr", r.remote_addr)?;
            d.set_item("connections", r.connections)?;
            d.set_item("transport", r.transport)?;
            d.set_item("transport_reason", r.choice.reason)?;
            d.set_item("fallbacks", r.choice.fallbacks)?;
            d.set_item("transport_switches", r.choice.switches)?;
            d.set_item("next_ucx_retry_s", r.choice.next_retry.map(|d| d.as_secs_f64()))?;
            d.set_item("one_sided", r.caps.one_sided)?;
            d.set_item("remote_vram", r.caps.remote_vram)?;
            d.set_item("gpu_path", r.caps.gpu.as_str())?;
            d.set_item("gpu_path_reason", r.gpu_reason)?;
            d.set_item("staging", gpu::staging_dict(py, &r.io.staging)?)?;
            d.set_item("up", r.stats.up)?;
            d.set_item("bytes", r.stats.bytes_done)?;
            d.set_item("chunks", r.stats.chunks_done)?;
            d.set_item("reissued", r.stats.chunks_reissued)?;
            d.set_item("times_down", r.stats.times_down)?;
            d.set_item("rate_gbps", r.stats.rate * 8.0 / 1e9)?;
            d.set_item("down_reason", r.stats.down_reason)?;
            d.set_item("last_down_reason", r.stats.last_down_reason)?;
            d.set_item("bytes_read", r.io.bytes_read)?;
            d.set_item("chunks_read", r.io.chunks_read)?;
            d.set_item("bytes_written", r.io.bytes_written)?;
            d.set_item("chunks_written", r.io.chunks_written)?;
            d.set_item("readmissions", r.io.readmissions)?;
            d.set_item("stalls", r.io.stalls)?;
            d.set_item("local_index", r.local_index)?;
            d.set_item("tier", r.stats.tier)?;
            d.set_item("tier_location", r.location.map(|l| l.label()))?;
            d.set_item("fallback_bytes", r.stats.fallback_bytes)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// The peer's counters: transfers done and failed, connections it fenced for us.
    fn peer_counters<'py>(&self, py: Python<'py>, peer: &str) -> PyResult<Bound<'py, PyDict>> {
        let c = self.0.peer(peer).map_err(to_py)?.counters.clone();
        let d = PyDict::new(py);
        d.set_item("transfers_done", c.transfers_done.load(std::sync::atomic::Ordering::Relaxed))?;
        d.set_item("transfers_failed", c.transfers_failed.load(std::sync::atomic::Ordering::Relaxed))?;
        d.set_item("fenced_connections", c.fenced_connections.load(std::sync::atomic::Ordering::Relaxed))?;
        let ipc = self.0.peer(peer).map_err(to_py)?.ipc_info();
        d.set_item("ipc_transfers", ipc.transfers)?;
        d.set_item("ipc_bytes", ipc.bytes)?;
        d.set_item("ipc_copies", ipc.copies)?;
        d.set_item("ipc_copy_calls", ipc.copy_calls)?;
        d.set_item("ipc_copy_path", ipc.copy_path)?;
        d.set_item("ipc_regions_mapped", ipc.regions_mapped)?;
        d.set_item("ipc_regions_revoked", ipc.regions_revoked)?;
        d.set_item("ipc_devices", ipc.devices)?;
        d.set_item("ipc_fallback_reason", ipc.fallback_reason)?;
        Ok(d)
    }

    /// What this agent served to peers, one dict per (peer, local rail): see
    /// `Agent::served_stats`. `rail_index` is None for the side channel of an agent with rails.
    fn served_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in self.0.served_stats() {
            let d = PyDict::new(py);
            d.set_item("peer", r.peer)?;
            d.set_item("rail", r.rail)?;
            d.set_item("rail_index", r.rail_index)?;
            d.set_item("bytes_read", r.bytes_read)?;
            d.set_item("requests_read", r.requests_read)?;
            d.set_item("bytes_written", r.bytes_written)?;
            d.set_item("requests_written", r.requests_written)?;
            d.set_item("refused", r.refused)?;
            let by = PyDict::new(py);
            for (status, n) in r.refused_by_status {
                by.set_item(format!("{status:?}"), n)?;
            }
            d.set_item("refused_by_status", by)?;
            d.set_item("connections", r.connections)?;
            d.set_item("ucx_sessions", r.ucx_sessions)?;
            d.set_item("fenced", r.fenced)?;
            d.set_item("staging", gpu::staging_dict(py, &r.staging)?)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Which local rails carry which memory (per location "gpu:K"/"numa:N": tiers of local
    /// rail indices, nearest first) and each local rail's NIC-local CPUs; once, before the
    /// first transfer (`multirail.Agent.__init__`).
    fn set_topology(&self, py: Python<'_>, tiers: Vec<(String, Vec<Vec<usize>>)>, cpus: Vec<Vec<usize>>) -> PyResult<()> {
        py.allow_threads(|| self.0.set_topology(tiers, cpus)).map_err(to_py)
    }

    /// (name, address, port) of every local rail's listener.
    fn rails(&self) -> Vec<(String, String, u16)> {
        self.0.shared().rails_meta.iter().map(|r| (r.name.clone(), r.addr.clone(), r.port)).collect()
    }

    fn events(&self) -> Vec<String> {
        self.0.events()
    }

    /// Requests refused from peers so far (bad frames, wrong keys, ...).
    fn refused(&self) -> usize {
        self.0.shared().refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| self.0.close())
    }
}

#[pymethods]
impl PyXfer {
    /// Post (or re-post) the transfer; returns the state code. `stream`: the raw CUDA stream
    /// the transfer is ordered after (None: each local GPU's legacy default stream).
    #[pyo3(signature = (notif=None, stream=None))]
    fn post(&self, py: Python<'_>, notif: Option<Vec<u8>>, stream: Option<u64>) -> PyResult<u8> {
        py.allow_threads(|| self.0.post_on(notif, stream)).map(|s| s as u8).map_err(to_py)
    }
    fn state(&self) -> u8 {
        self.0.state() as u8
    }
    /// State after completing responses that have already arrived (see `XferHandle::progress`).
    fn progress(&self, py: Python<'_>) -> u8 {
        py.allow_threads(|| self.0.progress()) as u8
    }
    /// Raise the transfer's error if it failed.
    fn check(&self) -> PyResult<u8> {
        let s = self.0.state();
        if s == XferState::Error {
            if let Some(e) = self.0.error() {
                return Err(to_py(e));
            }
        }
        Ok(s as u8)
    }
    /// Post and wait in one call (one GIL release): the blocking form for latency-bound use.
    #[pyo3(signature = (notif=None, timeout=None, stream=None))]
    fn post_wait(&self, py: Python<'_>, notif: Option<Vec<u8>>, timeout: Option<f64>, stream: Option<u64>) -> PyResult<()> {
        let t = wait_timeout(timeout)?;
        py.allow_threads(|| self.0.post_wait_on(notif, t, stream)).map_err(to_py)
    }
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = wait_timeout(timeout)?;
        py.allow_threads(|| self.0.wait(t)).map_err(to_py)
    }
    fn release(&self, py: Python<'_>) {
        py.allow_threads(|| self.0.release())
    }
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.0.total_bytes()
    }
    #[getter]
    fn num_pieces(&self) -> usize {
        self.0.num_pieces()
    }
    /// The last post's trace (`XferHandle::trace`) as a dict, or None.
    fn trace<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(t) = self.0.trace() else { return Ok(None) };
        let us = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6);
        let out = PyDict::new(py);
        out.set_item("total_us", us(t.total))?;
        let rails = PyList::empty(py);
        for r in t.rails {
            let d = PyDict::new(py);
            d.set_item("bytes", r.bytes)?;
            d.set_item("chunks", r.chunks)?;
            d.set_item("first_issue_us", us(r.first_issue))?;
            d.set_item("last_done_us", us(r.last_done))?;
            d.set_item("rate_gbps_at_post", r.rate_at_post * 8.0 / 1e9)?;
            d.set_item("rate_gbps_at_end", r.rate_at_end * 8.0 / 1e9)?;
            rails.append(d)?;
        }
        out.set_item("rails", rails)?;
        Ok(Some(out))
    }
}

/// A caller's timeout in seconds (None: no limit); negative, NaN or absurd values are refused.
fn wait_timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if (0.0..1e9).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(to_py(multirail::Error::InvalidArgument(format!("timeout must be a non-negative number of seconds, got {s}")))),
    }
}

/// Serialise an Nx3 uint64 descriptor array.
#[pyfunction]
fn serialize_descs<'py>(py: Python<'py>, ptr: usize, n: usize, mem: &str) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: see `rows`; the array is only read before this returns.
    let descs = unsafe { rows::<3>(ptr, n) }.iter().map(|r| (r[0], r[1], r[2] as u32)).collect();
    let d = DescList { mem: parse_mem(mem)?, descs };
    Ok(PyBytes::new(py, &d.encode()))
}

/// Parse serialised descriptors into (mem type, packed little-endian Nx3 uint64 bytes).
#[pyfunction]
fn deserialize_descs<'py>(py: Python<'py>, blob: &[u8]) -> PyResult<(&'static str, Bound<'py, PyBytes>)> {
    let d = DescList::decode(blob).map_err(|e| to_py(Error::Decode { who: "descriptor list".into(), source: e }))?;
    let mut out = Vec::with_capacity(d.descs.len() * 24);
    for (a, l, dev) in d.descs {
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&l.to_le_bytes());
        out.extend_from_slice(&(dev as u64).to_le_bytes());
    }
    Ok((mem_name(d.mem), PyBytes::new(py, &out)))
}

/// What transport `asked` ("auto", "tcp", "ucx") gives a rail whose RDMA device is `rdma_dev`
/// ("" for none), with UCX as `ucx` describes it (`ucx_facts()`; None: not loaded): (transport,
/// reason, unprotected). The agent's own rule (`transport::select::choose`), for `doctor`.
#[pyfunction]
#[pyo3(signature = (asked, rdma_dev, ucx=None))]
fn choose_transport(asked: &str, rdma_dev: &str, ucx: Option<(String, String, Vec<String>)>) -> PyResult<(String, String, bool)> {
    use multirail::transport::select::{choose, RailFacts, UcxFacts};
    let kind = multirail::config::TransportKind::parse(asked)
        .ok_or_else(|| PyValueError::new_err(format!("transport must be 'tcp', 'ucx' or 'auto', not {asked:?}")))?;
    let facts = match ucx {
        None => UcxFacts::NotTried,
        Some((state, label, modules)) if state == "loaded" => UcxFacts::Loaded { label, modules },
        Some((_, why, _)) => UcxFacts::Failed(why),
    };
    let c = choose(kind, RailFacts { rdma_dev }, &facts);
    Ok((c.kind.as_str().to_string(), c.reason, c.unprotected))
}

/// Load UCX as an agent would: ("loaded", "1.22.0 (libucx wheel)", modules) or ("failed", why, []).
#[pyfunction]
fn ucx_facts(py: Python<'_>) -> (String, String, Vec<String>) {
    use multirail::transport::select::{load_ucx, UcxFacts};
    match py.allow_threads(load_ucx) {
        Ok((_, UcxFacts::Loaded { label, modules })) => ("loaded".into(), label, modules),
        Ok(_) => ("failed".into(), "no UCX".into(), Vec::new()),
        Err(e) => ("failed".into(), e.to_string(), Vec::new()),
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(choose_transport, m)?)?;
    m.add_function(wrap_pyfunction!(ucx_facts, m)?)?;
    m.add_class::<PyAgent>()?;
    m.add_class::<PyXfer>()?;
    m.add_function(wrap_pyfunction!(serialize_descs, m)?)?;
    m.add_function(wrap_pyfunction!(deserialize_descs, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_free, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_copy, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_info, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_stream_create, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_stream_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_stream_sleep, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_stream_synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_copy_async, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_current_device, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_set_current_device, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_standin, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", multirail_proto::codec::VERSION)?;
    Ok(())
}
