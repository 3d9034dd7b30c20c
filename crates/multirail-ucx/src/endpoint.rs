//! Endpoints (error mode PEER), remote keys, one-sided PUT/GET, flush, close, transport query.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::capture::capture;
use crate::context::{MemRegion, PackedRkey, RemoteRegion};
use crate::error::{Error, Result};
use crate::load::Version;
use crate::status::{ptr_status, PtrStatus, Status};
use crate::sys;
use crate::worker::{AmKeep, EpFail, KeepAlive, Request, Worker, WorkerAddress, WorkerInner};

/// How long dropping an endpoint waits for its close before leaving it to the worker.
pub const DROP_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The first UCX whose `ucp_ep_query` reports transports (`UCP_EP_ATTR_FIELD_TRANSPORTS`).
pub const EP_QUERY_TRANSPORTS_SINCE: Version = Version { major: 1, minor: 14, release: 0 };
/// Most lanes an endpoint has (UCP_MAX_LANES is 64 from 1.18 on, 16 before).
const MAX_LANES: usize = 64;

static NEXT_EP_ID: AtomicU64 = AtomicU64::new(1);

/// UCX's error callback: marks the endpoint failed. Runs inside `ucp_worker_progress` on the
/// thread that progresses (with the worker lock held); does nothing that can unwind.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the Arc<EpFail> leaked in Endpoint::connect, alive until the endpoint is
    // destroyed (freed after a completed close, or at worker destruction).
    let fail = unsafe { &*(arg as *const EpFail) };
    fail.set(status);
}

/// How [`Endpoint::close`] ends an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseMode {
    /// Complete outstanding operations first (`ucp_ep_close_nbx` without flags). Needs the peer.
    Flush,
    /// Cancel outstanding operations and release at once (`UCP_EP_CLOSE_FLAG_FORCE`): the mode
    /// for a failed endpoint, and the fence of a rail being taken down.
    Force,
}

/// One transport lane of an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TransportEntry {
    /// UCT transport: `rc_mlx5`, `dc_mlx5`, `ud_verbs`, `tcp`, `sysv`, `cma`, ...
    pub transport: String,
    /// Device: `mlx5_0:1`, `eth1`, `lo`, `memory`, ... (empty for a connection-manager lane).
    pub device: String,
}

/// Where [`Endpoint::transports`] got its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportSource {
    /// `ucp_ep_query` with `UCP_EP_ATTR_FIELD_TRANSPORTS` (UCX 1.14+).
    EpQuery,
    /// Parsed from `ucp_ep_print_info` (UCX 1.13, which has no transports query).
    PrintInfo,
}

/// The transports an endpoint's lanes use, deduplicated, in lane order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transports {
    pub entries: Vec<TransportEntry>,
    pub source: TransportSource,
}

impl Transports {
    /// Whether any lane uses a transport whose name starts with `prefix` (`rc`, `dc`, `tcp`).
    pub fn uses(&self, prefix: &str) -> bool {
        self.entries.iter().any(|e| e.transport.starts_with(prefix))
    }
}

pub(crate) struct RkeyInner {
    worker: Arc<WorkerInner>,
    handle: sys::ucp_rkey_h,
    ep_id: u64,
    region: RemoteRegion,
}

// SAFETY: `handle` is used (in PUT/GET and ucp_rkey_destroy) only under the worker lock.
unsafe impl Send for RkeyInner {}
// SAFETY: as above.
unsafe impl Sync for RkeyInner {}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        let l = self.worker.lock_unchecked();
        // SAFETY: no pending request uses it (each holds an Arc to this); destroyed once, while
        // the worker (whose memory pool it came from) is alive.
        unsafe { (l.api().rkey_destroy)(self.handle) };
    }
}

/// A remote key unpacked for one endpoint, with the remote region it covers (from the peer's
/// metadata): PUT/GET outside that region are refused before UCX sees them.
#[derive(Clone)]
pub struct Rkey {
    inner: Arc<RkeyInner>,
}

impl std::fmt::Debug for Rkey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rkey").field("region", &self.inner.region).finish()
    }
}

impl Rkey {
    pub fn region(&self) -> RemoteRegion {
        self.inner.region
    }
}

/// A connection to a remote worker (`ucp_ep_create` from its address) with error mode PEER: when
/// the peer or the path fails, UCX calls back, the endpoint is marked failed, its operations
/// fail, and only a close is accepted. Dropping it closes it (flush, or force if failed, bounded
/// by [`DROP_CLOSE_TIMEOUT`]).
pub struct Endpoint {
    worker: Arc<WorkerInner>,
    handle: sys::ucp_ep_h,
    fail: Arc<EpFail>,
    /// The reference to `fail` held by UCX's error callback.
    cb_arg: *const EpFail,
    id: u64,
    closed: bool,
}

// SAFETY: the endpoint handle is used only under the worker lock (see WorkerInner); `cb_arg` is
// only released under that lock after UCX is done with it.
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("id", &self.id).field("failed", &self.failure()).field("closed", &self.closed).finish()
    }
}

#[derive(Clone, Copy)]
enum Rma {
    Put,
    Get,
}

impl Endpoint {
    /// `ucp_ep_create` to `remote` with `UCP_ERR_HANDLING_MODE_PEER` and an error callback that
    /// marks this endpoint failed. Connection set-up continues while either side progresses.
    pub fn connect(worker: &Worker, remote: &WorkerAddress) -> Result<Endpoint> {
        let w = &worker.inner;
        let l = w.lock()?;
        let fail = Arc::new(EpFail::default());
        let cb_arg = Arc::into_raw(fail.clone());
        let mut params: sys::ucp_ep_params_t = sys::zeroed();
        params.field_mask =
            sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = remote.as_bytes().as_ptr().cast();
        params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler = sys::ucp_err_handler_t { cb: Some(on_ep_error), arg: cb_arg as *mut c_void };
        let mut handle: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: worker live and locked; the address bytes are a peer's worker address
        // (WorkerAddress::from_peer's contract) and are only read during the call.
        let st = unsafe { (l.api().ep_create)(w.handle, &params, &mut handle) };
        drop(l);
        if let Err(s) = Status::check(st) {
            // SAFETY: UCX did not keep the callback argument (no endpoint was created).
            drop(unsafe { Arc::from_raw(cb_arg) });
            return Err(Error::ucx("ucp_ep_create", s));
        }
        Ok(Endpoint { worker: w.clone(), handle, fail, cb_arg, id: NEXT_EP_ID.fetch_add(1, Ordering::Relaxed), closed: false })
    }

    /// The status UCX reported through the error callback, if the endpoint failed.
    pub fn failure(&self) -> Option<Status> {
        self.fail.get()
    }

    pub fn is_failed(&self) -> bool {
        self.fail.get().is_some()
    }

    fn usable(&self) -> Result<()> {
        if self.closed {
            return Err(Error::EndpointClosed);
        }
        match self.fail.get() {
            Some(status) => Err(Error::EndpointFailed { status }),
            None => Ok(()),
        }
    }

    /// `ucp_ep_rkey_unpack` of a peer's packed rkey; `region` is the remote memory it covers (from
    /// the same metadata) and bounds every PUT/GET with the returned [`Rkey`].
    pub fn unpack_rkey(&self, packed: &PackedRkey, region: RemoteRegion) -> Result<Rkey> {
        self.usable()?;
        let l = self.worker.lock()?;
        let mut handle: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: endpoint live and locked; the buffer is a packed rkey (PackedRkey's contract).
        let st = unsafe { (l.api().ep_rkey_unpack)(self.handle, packed.as_bytes().as_ptr().cast(), &mut handle) };
        drop(l);
        Status::check(st).map_err(|s| Error::ucx("ucp_ep_rkey_unpack", s))?;
        Ok(Rkey { inner: Arc::new(RkeyInner { worker: self.worker.clone(), handle, ep_id: self.id, region }) })
    }

    /// `ucp_put_nbx`: writes `local[local_offset .. local_offset + len]` to `remote_addr` (inside
    /// `rkey`'s region). Complete = the source may be reused; flush for remote visibility.
    pub fn put(&self, local: &MemRegion, local_offset: usize, len: usize, rkey: &Rkey, remote_addr: u64) -> Result<Request> {
        self.rma(Rma::Put, local, local_offset, len, rkey, remote_addr)
    }

    /// `ucp_get_nbx`: reads `len` bytes at `remote_addr` (inside `rkey`'s region) into
    /// `local[local_offset ..]`. Complete = the data is in local memory.
    pub fn get(&self, local: &MemRegion, local_offset: usize, len: usize, rkey: &Rkey, remote_addr: u64) -> Result<Request> {
        self.rma(Rma::Get, local, local_offset, len, rkey, remote_addr)
    }

    fn rma(&self, op: Rma, local: &MemRegion, local_offset: usize, len: usize, rkey: &Rkey, remote_addr: u64) -> Result<Request> {
        self.usable()?;
        if rkey.inner.ep_id != self.id {
            return Err(Error::Mismatch { what: "rkey", owner: "endpoint (unpack it with this endpoint)" });
        }
        if !self.worker.ctx.same(&local.inner.ctx) {
            return Err(Error::Mismatch { what: "local region", owner: "context (map it with this worker's context)" });
        }
        let ptr = local.check(local_offset, len)?;
        let region = rkey.inner.region;
        if !region.contains(remote_addr, len as u64) {
            return Err(Error::OutOfBounds {
                what: "remote region",
                offset: remote_addr,
                len: len as u64,
                base: region.addr,
                size: region.len,
            });
        }
        let name = match op {
            Rma::Put => "ucp_put_nbx",
            Rma::Get => "ucp_get_nbx",
        };
        if len == 0 {
            return Ok(Request::done(self.worker.clone(), name, Ok(())));
        }
        let l = self.worker.lock()?;
        let mut param: sys::ucp_request_param_t = sys::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = local.inner.memh;
        let api = l.api();
        // SAFETY: endpoint, rkey and memh are live (the request keeps the latter two alive until
        // it completes); `ptr..ptr+len` lies inside the mapped local region (checked above) and
        // the remote range inside the rkey's region. The worker is locked.
        let p = unsafe {
            match op {
                Rma::Put => (api.put_nbx)(self.handle, ptr as *const c_void, len, remote_addr, rkey.inner.handle, &param),
                Rma::Get => (api.get_nbx)(self.handle, ptr.cast(), len, remote_addr, rkey.inner.handle, &param),
            }
        };
        drop(l);
        let keep = KeepAlive { _mem: Some(local.inner.clone()), _rkey: Some(rkey.inner.clone()), _am: None };
        Ok(Request::from_ptr(self.worker.clone(), name, Some(self.fail.clone()), p, keep))
    }

    /// What an active-message handler of this endpoint's worker gets as `from` for messages of
    /// the peer this endpoint leads to, when UCX answers them on this endpoint (the handle's
    /// address; an identity only, never dereferenced).
    pub fn handle_id(&self) -> usize {
        self.handle as usize
    }

    /// `ucp_am_send_nbx` of active message `id` (eager protocol only: never rendezvous): `header`
    /// as its header, and as its data `head` followed by `pieces` (local region, offset,
    /// length) in order, gathered by UCX from their memory (an iov: no copy where the transport
    /// sends from user memory). Every piece is checked against its region first. Complete =
    /// the sources may be reused; nothing says the peer handled it (it replies for that).
    /// `header`, `head` and the iov are kept alive by the request until it completes.
    pub fn am_send(&self, id: u16, header: Vec<u8>, head: Vec<u8>, pieces: &[(&MemRegion, usize, usize)]) -> Result<Request> {
        self.usable()?;
        let mut iov: Vec<sys::ucp_dt_iov_t> = Vec::with_capacity(pieces.len() + 1);
        if !head.is_empty() {
            iov.push(sys::ucp_dt_iov_t { buffer: head.as_ptr() as *mut c_void, length: head.len() });
        }
        let mut mems = Vec::with_capacity(pieces.len().min(8));
        for (mem, off, len) in pieces {
            let ptr = mem.check(*off, *len)?;
            if *len == 0 {
                continue;
            }
            if !mems.iter().any(|m| Arc::ptr_eq(m, &mem.inner)) {
                mems.push(mem.inner.clone());
            }
            iov.push(sys::ucp_dt_iov_t { buffer: ptr.cast(), length: *len });
        }
        let l = self.worker.lock()?;
        let mut param: sys::ucp_request_param_t = sys::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        // REPLY: the receiver learns which of its endpoints leads back here (`reply_ep`), so
        // it can tell its peer's messages from anyone else's.
        param.flags = sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY;
        let (buf, count) = if iov.is_empty() {
            (std::ptr::null(), 0)
        } else {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
            param.datatype = sys::UCP_DATATYPE_IOV;
            (iov.as_ptr() as *const c_void, iov.len())
        };
        let hdr = if header.is_empty() { std::ptr::null() } else { header.as_ptr() as *const c_void };
        // SAFETY: endpoint live, worker locked. The header, the head and the iov array are heap
        // buffers moved into the request's keep-alive below (a Vec's buffer does not move with
        // it), and every iov entry lies inside a mapped region (checked above) kept mapped by
        // the same keep-alive, until the request completes.
        let p = unsafe { (l.api().am_send_nbx)(self.handle, id.into(), hdr, header.len(), buf, count, &param) };
        drop(l);
        let keep =
            KeepAlive { _am: Some(Box::new(AmKeep { _header: header, _head: head, _iov: iov, _mems: mems })), ..KeepAlive::default() };
        Ok(Request::from_ptr(self.worker.clone(), "ucp_am_send_nbx", Some(self.fail.clone()), p, keep))
    }

    /// `ucp_ep_flush_nbx`: completes when every operation posted on this endpoint so far has
    /// completed remotely (PUT data visible at the target).
    pub fn flush(&self) -> Result<Request> {
        self.usable()?;
        let l = self.worker.lock()?;
        let param: sys::ucp_request_param_t = sys::zeroed();
        // SAFETY: endpoint live, worker locked.
        let p = unsafe { (l.api().ep_flush_nbx)(self.handle, &param) };
        drop(l);
        Ok(Request::from_ptr(self.worker.clone(), "ucp_ep_flush_nbx", Some(self.fail.clone()), p, KeepAlive::default()))
    }

    /// `ucp_ep_print_info`: lanes, transports and thresholds, as text.
    pub fn info_string(&self) -> Result<String> {
        if self.closed {
            return Err(Error::EndpointClosed);
        }
        let l = self.worker.lock()?;
        let api = l.api();
        // SAFETY: endpoint live, worker locked, stream valid during the call.
        capture(|f| unsafe { (api.ep_print_info)(self.handle, f) })
    }

    /// Which transports (and devices) the endpoint's lanes use: `ucp_ep_query` on UCX 1.14+,
    /// else parsed from `ucp_ep_print_info`. Ask after the first operation has completed: lanes
    /// can change while the connection is being set up.
    pub fn transports(&self) -> Result<Transports> {
        if self.closed {
            return Err(Error::EndpointClosed);
        }
        if self.worker.ctx.ucx().info().version < EP_QUERY_TRANSPORTS_SINCE {
            let text = self.info_string()?;
            return Ok(Transports { entries: parse_print_info(&text), source: TransportSource::PrintInfo });
        }
        let l = self.worker.lock()?;
        let mut entries = [sys::zeroed::<sys::ucp_transport_entry_t>(); MAX_LANES];
        let mut attr: sys::ucp_ep_attr_t = sys::zeroed();
        attr.field_mask = sys::UCP_EP_ATTR_FIELD_TRANSPORTS;
        attr.transports.entries = entries.as_mut_ptr();
        attr.transports.num_entries = MAX_LANES as u32;
        attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>();
        // SAFETY: endpoint live, worker locked; UCX writes at most num_entries entries of
        // entry_size bytes into `entries`.
        let st = unsafe { (l.api().ep_query)(self.handle, &mut attr) };
        Status::check(st).map_err(|s| Error::ucx("ucp_ep_query", s))?;
        let n = (attr.transports.num_entries as usize).min(MAX_LANES);
        let mut out: Vec<TransportEntry> = Vec::new();
        for e in &entries[..n] {
            let s = |p: *const std::ffi::c_char| {
                if p.is_null() {
                    String::new()
                } else {
                    // SAFETY: UCX sets NUL-terminated names owned by the context/worker (alive
                    // and locked); copied at once.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            };
            let entry = TransportEntry { transport: s(e.transport_name), device: s(e.device_name) };
            if !out.contains(&entry) {
                out.push(entry);
            }
        }
        Ok(Transports { entries: out, source: TransportSource::EpQuery })
    }

    /// Closes the endpoint (`ucp_ep_close_nbx`) and progresses until it is released or
    /// `deadline` passes. A failed endpoint is always closed with [`CloseMode::Force`]. On
    /// timeout the close goes on in the background and [`Error::Timeout`] is returned.
    pub fn close(mut self, mode: CloseMode, deadline: Instant) -> Result<()> {
        self.close_inner(mode, deadline, true)
    }

    fn close_inner(&mut self, mode: CloseMode, deadline: Instant, checked: bool) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let start = Instant::now();
        let force = mode == CloseMode::Force || self.fail.get().is_some();
        let l = if checked { self.worker.lock()? } else { self.worker.lock_unchecked() };
        self.closed = true;
        let mut param: sys::ucp_request_param_t = sys::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = if force { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        let t = crate::quiesce::teardown();
        // SAFETY: endpoint live, worker locked; the handle is not used after this.
        let p = unsafe { (l.api().ep_close_nbx)(self.handle, &param) };
        drop(t);
        let result = match ptr_status(p) {
            PtrStatus::Done(r) => r,
            PtrStatus::Pending(req) => {
                drop(l);
                match self.worker.wait_req(req, deadline, false)? {
                    Some(r) => r,
                    None => {
                        let mut l = self.worker.lock_unchecked();
                        // SAFETY: releases our reference; UCX finishes the close on its own.
                        unsafe { (l.api().request_free)(req.as_ptr()) };
                        l.add_zombie(self.cb_arg);
                        self.cb_arg = std::ptr::null();
                        return Err(Error::Timeout { op: "ucp_ep_close_nbx", waited: start.elapsed() });
                    }
                }
            }
        };
        let arg = std::mem::replace(&mut self.cb_arg, std::ptr::null());
        if !arg.is_null() {
            // SAFETY: the close completed, so the endpoint is gone and UCX will not call back.
            drop(unsafe { Arc::from_raw(arg) });
        }
        match result {
            // A forced close of a broken connection reports the breakage; the endpoint is
            // released all the same.
            Err(_) if force => Ok(()),
            Err(s) => Err(Error::ucx("ucp_ep_close_nbx", s)),
            Ok(()) => Ok(()),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; a timed-out close is finished by the worker.
        let _ = self.close_inner(CloseMode::Flush, Instant::now() + DROP_CLOSE_TIMEOUT, false);
    }
}

/// Transports of the lanes in `ucp_ep_print_info` output (UCX 1.13 has no transports query).
/// Lane lines are `lane[<n>]: <rsc>:<transport>/<device>.<path index> md[<m>] -> ...`
/// (`"lane[%d]: %2d:" UCT_TL_RESOURCE_DESC_FMT ".%u md[%d] %-*c-> "` in 1.13's ucp_ep.c), or
/// `lane[<n>]: cm <name>` for a connection-manager lane.
pub fn parse_print_info(text: &str) -> Vec<TransportEntry> {
    let mut out: Vec<TransportEntry> = Vec::new();
    for line in text.lines() {
        let Some((_, rest)) = line.split_once("lane[") else { continue };
        let Some((_, rest)) = rest.split_once("]:") else { continue };
        let mut words = rest.split_whitespace();
        let Some(tok) = words.next() else { continue };
        let entry = if tok == "cm" {
            let Some(name) = words.next() else { continue };
            TransportEntry { transport: name.to_string(), device: String::new() }
        } else {
            // "0:tcp/lo.0" → "tcp/lo.0"; tolerate a missing resource index.
            let tok = match tok.split_once(':') {
                Some((idx, t)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => t,
                _ => tok,
            };
            let Some((tl, dev)) = tok.split_once('/') else { continue };
            // Drop the ".<path index>" suffix.
            let dev = match dev.rsplit_once('.') {
                Some((d, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => d,
                _ => dev,
            };
            if tl.is_empty() {
                continue;
            }
            TransportEntry { transport: tl.to_string(), device: dev.to_string() }
        };
        if !out.contains(&entry) {
            out.push(entry);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(t: &str, d: &str) -> TransportEntry {
        TransportEntry { transport: t.into(), device: d.into() }
    }

    #[test]
    fn print_info_lanes() {
        // UCX 1.13.1, tcp on lo (captured), plus RDMA and cm lanes in the same format.
        let text = "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n\
            #                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup\n\
            #                 lane[1]: 12:rc_mlx5/mlx5_0:1.1 md[3]      -> md[3]/ib/sysdev[1] rma_bw#0\n\
            #                 lane[2]: 12:rc_mlx5/mlx5_0:1.0 md[3]      -> md[3]/ib/sysdev[1] rma_bw#1\n\
            #                 lane[3]:  4:tcp/eth0.100.0 md[0]          -> md[0]/tcp am\n\
            #                 lane[4]: cm rdmacm\n\
            #\n#                  rma_bw: mds [3] #\n";
        assert_eq!(parse_print_info(text), vec![e("tcp", "lo"), e("rc_mlx5", "mlx5_0:1"), e("tcp", "eth0.100"), e("rdmacm", "")]);
        assert!(parse_print_info("no lanes here\n").is_empty());
    }
}
