//! Workers, their addresses, progress, and requests (non-blocking operations polled to completion).

use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use crate::capture::capture;
use crate::context::{Context, MemInner};
use crate::endpoint::{Endpoint, RkeyInner};
use crate::error::{Error, Result};
use crate::status::{ptr_status, PtrStatus, Status};
use crate::sys;

/// The largest worker address accepted (a few hundred bytes per device in practice).
pub const MAX_ADDRESS_LEN: usize = 64 * 1024;
/// Consecutive idle polls before a waiting thread yields its CPU once.
const SPINS_BEFORE_YIELD: u32 = 64;
/// How long dropping a worker keeps progressing to let abandoned requests finish.
const DROP_DRAIN: Duration = Duration::from_millis(100);

/// How the worker may be used across threads. Both mean "no locking inside UCX"; this crate
/// serialises every call on a worker (and its endpoints, rkeys, requests) with one mutex.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThreadMode {
    /// `UCS_THREAD_MODE_SINGLE`: only the creating thread may use the worker and what hangs off
    /// it; calls from other threads fail with [`Error::WrongThread`] (UCX 1.18+ asserts on it in
    /// builds with assertions). Drops from another thread still release (serialised).
    Single,
    /// `UCS_THREAD_MODE_SERIALIZED`: any thread, one at a time (the mutex). The default: a
    /// caller-driven transport progresses the worker from whichever thread waits.
    #[default]
    Serialized,
}

/// Failure state of an endpoint, written by UCX's error callback (error mode PEER).
#[derive(Default)]
pub(crate) struct EpFail {
    status: AtomicI8,
}

impl EpFail {
    pub(crate) fn set(&self, status: i8) {
        // A failure must read as one: UCS_OK would mean "healthy".
        let s = if status == 0 { Status::ERR_IO_ERROR.0 } else { status };
        self.status.store(s, Ordering::Release);
    }

    pub(crate) fn get(&self) -> Option<Status> {
        match self.status.load(Ordering::Acquire) {
            0 => None,
            s => Some(Status(s)),
        }
    }
}

/// What an in-flight operation needs kept alive: the local mapping and the remote key it uses.
#[derive(Default)]
pub(crate) struct KeepAlive {
    pub(crate) _mem: Option<Arc<MemInner>>,
    pub(crate) _rkey: Option<Arc<RkeyInner>>,
    /// An active message's header, data head, iov array and the mappings its iov points into
    /// (UCX reads all of them until the send completes).
    pub(crate) _am: Option<Box<AmKeep>>,
}

/// What an active-message send needs alive until it completes (`Endpoint::am_send`).
pub(crate) struct AmKeep {
    pub(crate) _header: Vec<u8>,
    pub(crate) _head: Vec<u8>,
    pub(crate) _iov: Vec<sys::ucp_dt_iov_t>,
    pub(crate) _mems: Vec<Arc<MemInner>>,
}

/// An active message's data as its handler sees it ([`Worker::set_am_handler`]).
#[derive(Debug)]
pub enum AmData<'a> {
    /// The message's bytes, valid only during the call (the handler copies what it keeps).
    Eager(&'a [u8]),
    /// A rendezvous descriptor for `len` bytes: the bytes are not here. This crate never
    /// receives it (dropped when the handler returns; the sender's request then completes);
    /// its own sends are eager only ([`crate::Endpoint::am_send`]). A handler refuses it.
    Rendezvous { len: usize },
}

/// An active-message handler: `(header, data, from)`; `from` is the receiving worker's endpoint
/// to the sender (`reply_ep`, compare with [`crate::Endpoint::handle_id`]) when the sender asked
/// for one ([`crate::Endpoint::am_send`] always does), else `None`. Runs inside `ucp_worker_progress`, on the
/// thread progressing the worker, with the worker's lock held: it must not call anything of
/// that worker (its endpoints, requests or progress), must not block for long, and a panic in
/// it is caught and dropped (the message with it).
pub type AmHandler = dyn Fn(&[u8], AmData<'_>, Option<usize>) + Send + Sync;

/// UCX's active-message callback: hands header and data to the registered [`AmHandler`].
unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    if arg.is_null() {
        return Status::OK.0;
    }
    // SAFETY: `arg` is a `Box<Box<AmHandler>>` owned by the worker's state, freed only after
    // `ucp_worker_destroy` (no callback can run after that).
    let f = unsafe { &*(arg as *const Box<AmHandler>) };
    let h: &[u8] = if header.is_null() || header_length == 0 {
        &[]
    } else {
        // SAFETY: UCX passes `header_length` readable bytes at `header`, valid during the call.
        unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
    };
    // SAFETY: UCX passes a valid parameter struct (or NULL, handled) for the call's duration.
    let attr = if param.is_null() { 0 } else { unsafe { (*param).recv_attr } };
    let from = if attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 {
        // SAFETY: as above; the field is valid when its attribute bit is set.
        Some(unsafe { (*param).reply_ep } as usize).filter(|&p| p != 0)
    } else {
        None
    };
    let d = if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        AmData::Rendezvous { len: length }
    } else if data.is_null() || length == 0 {
        AmData::Eager(&[])
    } else {
        // SAFETY: not a rendezvous descriptor, so `data` is `length` bytes of the message,
        // valid until this callback returns (we return UCS_OK: UCX releases them after).
        AmData::Eager(unsafe { std::slice::from_raw_parts(data as *const u8, length) })
    };
    // Never unwind into UCX.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(h, d, from)));
    Status::OK.0
}

/// A request whose [`Request`] was dropped before it completed: polled on every progress,
/// released (with what it keeps alive) once complete.
struct Orphan {
    req: NonNull<c_void>,
    keep: KeepAlive,
}

pub(crate) struct WorkerState {
    orphans: Vec<Orphan>,
    /// Active-message handlers handed to UCX (their addresses are the callback arguments): kept
    /// until the worker is destroyed. Boxed twice: the outer box's address is a thin pointer
    /// that stays put while the Vec grows.
    #[allow(clippy::vec_box)]
    am_handlers: Vec<Box<Box<AmHandler>>>,
    /// Error-callback arguments of endpoints whose close did not finish in time: UCX may still
    /// call back with them until the worker is destroyed.
    zombies: Vec<*const EpFail>,
}

pub(crate) struct WorkerInner {
    pub(crate) ctx: Context,
    pub(crate) handle: sys::ucp_worker_h,
    mode: ThreadMode,
    owner: ThreadId,
    efd: Option<c_int>,
    state: Mutex<WorkerState>,
}

// SAFETY: `handle` (and every endpoint, rkey and request of this worker) is used only while
// `state` is locked, so UCX sees one thread at a time, which is what SERIALIZED mode requires;
// SINGLE mode additionally refuses other threads (`lock`). The raw pointers in `state` are only
// touched under the same lock.
unsafe impl Send for WorkerInner {}
// SAFETY: as above.
unsafe impl Sync for WorkerInner {}

/// The worker lock. Keep-alives of requests completed while it is held are dropped after it is
/// released (dropping an rkey takes the lock again).
pub(crate) struct Locked<'a> {
    pub(crate) w: &'a WorkerInner,
    guard: Option<MutexGuard<'a, WorkerState>>,
    dead: Vec<KeepAlive>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.dead.clear();
    }
}

impl Locked<'_> {
    pub(crate) fn api(&self) -> &sys::Api {
        self.w.ctx.inner.ucx.api()
    }

    fn state(&mut self) -> Option<&mut WorkerState> {
        self.guard.as_deref_mut()
    }

    /// `ucp_worker_progress` once, then releases abandoned requests that completed.
    pub(crate) fn progress(&mut self) -> u32 {
        // SAFETY: the worker is live and locked.
        let n = unsafe { (self.api().worker_progress)(self.w.handle) };
        self.reap();
        n
    }

    fn reap(&mut self) {
        let api = self.w.ctx.inner.ucx.api();
        let Some(st) = self.guard.as_deref_mut() else { return };
        let mut i = 0;
        while i < st.orphans.len() {
            // SAFETY: orphans are requests not yet freed.
            let s = unsafe { (api.request_check_status)(st.orphans[i].req.as_ptr()) };
            if s == Status::INPROGRESS.0 {
                i += 1;
                continue;
            }
            let o = st.orphans.swap_remove(i);
            // SAFETY: completed and freed exactly once.
            unsafe { (api.request_free)(o.req.as_ptr()) };
            self.dead.push(o.keep);
        }
    }

    /// Status of a pending request; frees it once complete.
    pub(crate) fn poll_req(&mut self, req: NonNull<c_void>) -> Option<Result<(), Status>> {
        let api = self.api();
        // SAFETY: `req` is a live request of this worker.
        let s = unsafe { (api.request_check_status)(req.as_ptr()) };
        if s == Status::INPROGRESS.0 {
            return None;
        }
        // SAFETY: complete, freed once.
        unsafe { (api.request_free)(req.as_ptr()) };
        Some(Status::check(s))
    }

    /// Drops a keep-alive after the lock is released.
    pub(crate) fn bury(&mut self, keep: KeepAlive) {
        self.dead.push(keep);
    }

    pub(crate) fn add_zombie(&mut self, arg: *const EpFail) {
        if let Some(st) = self.state() {
            st.zombies.push(arg);
        }
    }
}

impl WorkerInner {
    /// Locks the worker, refusing other threads in single-thread mode.
    pub(crate) fn lock(&self) -> Result<Locked<'_>> {
        if self.mode == ThreadMode::Single && thread::current().id() != self.owner {
            return Err(Error::WrongThread);
        }
        Ok(self.lock_unchecked())
    }

    /// Locks the worker from any thread (releases in `Drop`).
    pub(crate) fn lock_unchecked(&self) -> Locked<'_> {
        Locked { w: self, guard: Some(self.state.lock().unwrap_or_else(PoisonError::into_inner)), dead: Vec::new() }
    }

    /// Progresses until `req` completes (then frees it) or `deadline` passes (then leaves it
    /// pending: `None`). The lock is released between polls.
    pub(crate) fn wait_req(&self, req: NonNull<c_void>, deadline: Instant, checked: bool) -> Result<Option<Result<(), Status>>> {
        let mut idle = 0u32;
        loop {
            {
                let mut l = if checked { self.lock()? } else { self.lock_unchecked() };
                let n = l.progress();
                if let Some(r) = l.poll_req(req) {
                    return Ok(Some(r));
                }
                idle = if n == 0 { idle + 1 } else { 0 };
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            if idle >= SPINS_BEFORE_YIELD {
                idle = 0;
                thread::yield_now();
            }
        }
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        let api = self.ctx.inner.ucx.api();
        let end = Instant::now() + DROP_DRAIN;
        let mut l = self.lock_unchecked();
        while l.state().is_some_and(|s| !s.orphans.is_empty()) && Instant::now() < end {
            l.progress();
        }
        let (orphans, zombies, handlers) = match l.state() {
            Some(s) => (std::mem::take(&mut s.orphans), std::mem::take(&mut s.zombies), std::mem::take(&mut s.am_handlers)),
            None => (Vec::new(), Vec::new(), Vec::new()),
        };
        for o in &orphans {
            // SAFETY: not yet freed; UCX releases it when the worker goes.
            unsafe { (api.request_free)(o.req.as_ptr()) };
        }
        let t = crate::quiesce::teardown();
        // SAFETY: nothing else refers to the worker (this is the last Arc); every endpoint of
        // ours is closed (each holds an Arc), so this only tears down UCX-internal state.
        unsafe { (api.worker_destroy)(self.handle) };
        drop(t);
        drop(l);
        // No callback runs after the worker is destroyed.
        drop(handlers);
        drop(orphans);
        for z in zombies {
            // SAFETY: `z` came from Arc::into_raw in Endpoint::connect; the worker (and with it
            // the endpoint that could call back with it) is destroyed.
            drop(unsafe { Arc::from_raw(z) });
        }
    }
}

/// A UCP worker: progress engine and owner of endpoints. Cheap to clone (all clones are the same
/// worker). Dropped (`ucp_worker_destroy`) when the last clone, endpoint, rkey and request is gone.
#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Arc<WorkerInner>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("handle", &self.inner.handle).field("mode", &self.inner.mode).finish()
    }
}

impl Worker {
    /// `ucp_worker_create` in the given thread mode. With a context created with
    /// `wakeup(true)`, also fetches the worker's event fd.
    pub fn new(ctx: &Context, mode: ThreadMode) -> Result<Worker> {
        let api = ctx.inner.ucx.api();
        let mut params: sys::ucp_worker_params_t = sys::zeroed();
        params.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = match mode {
            ThreadMode::Single => sys::UCS_THREAD_MODE_SINGLE,
            ThreadMode::Serialized => sys::UCS_THREAD_MODE_SERIALIZED,
        };
        let mut handle: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: context live; params initialised for the masked field.
        let st = unsafe { (api.worker_create)(ctx.inner.handle, &params, &mut handle) };
        Status::check(st).map_err(|s| Error::ucx("ucp_worker_create", s))?;
        let mut efd = None;
        if ctx.inner.wakeup {
            let mut fd: c_int = -1;
            // SAFETY: worker live; UCX owns the fd (not closed by us).
            let st = unsafe { (api.worker_get_efd)(handle, &mut fd) };
            if let Err(s) = Status::check(st) {
                // SAFETY: just created, nothing hangs off it.
                unsafe { (api.worker_destroy)(handle) };
                return Err(Error::ucx("ucp_worker_get_efd", s));
            }
            efd = Some(fd);
        }
        let inner = WorkerInner {
            ctx: ctx.clone(),
            handle,
            mode,
            owner: thread::current().id(),
            efd,
            state: Mutex::new(WorkerState { orphans: Vec::new(), am_handlers: Vec::new(), zombies: Vec::new() }),
        };
        Ok(Worker { inner: Arc::new(inner) })
    }

    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub fn thread_mode(&self) -> ThreadMode {
        self.inner.mode
    }

    /// `ucp_worker_get_address`, copied out (bounded by [`MAX_ADDRESS_LEN`]) and released.
    pub fn address(&self) -> Result<WorkerAddress> {
        let l = self.inner.lock()?;
        let api = l.api();
        let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: worker live and locked; UCX allocates `addr` (released below).
        let st = unsafe { (api.worker_get_address)(self.inner.handle, &mut addr, &mut len) };
        Status::check(st).map_err(|s| Error::ucx("ucp_worker_get_address", s))?;
        let bytes = if addr.is_null() {
            Vec::new()
        } else {
            // SAFETY: UCX wrote `len` bytes at `addr`.
            unsafe { std::slice::from_raw_parts(addr as *const u8, len.min(MAX_ADDRESS_LEN + 1)) }.to_vec()
        };
        if !addr.is_null() {
            // SAFETY: from ucp_worker_get_address on this worker, released once.
            unsafe { (api.worker_release_address)(self.inner.handle, addr) };
        }
        if len > MAX_ADDRESS_LEN {
            return Err(Error::TooLarge { what: "worker address", len, max: MAX_ADDRESS_LEN });
        }
        if bytes.is_empty() {
            return Err(Error::Empty { what: "worker address" });
        }
        Ok(WorkerAddress(bytes))
    }

    /// One `ucp_worker_progress` (also releases abandoned requests that completed). Returns the
    /// number of events UCX processed.
    pub fn progress(&self) -> Result<u32> {
        let mut l = self.inner.lock()?;
        Ok(l.progress())
    }

    /// Progresses until `cond()` holds or `deadline` passes (then [`Error::Timeout`] naming `op`).
    /// `cond` runs without the worker lock held.
    pub fn progress_until(&self, deadline: Instant, op: &'static str, mut cond: impl FnMut() -> bool) -> Result<()> {
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            let n = self.progress()?;
            if cond() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout { op, waited: start.elapsed() });
            }
            idle = if n == 0 { idle + 1 } else { 0 };
            if idle >= SPINS_BEFORE_YIELD {
                idle = 0;
                thread::yield_now();
            }
        }
    }

    /// Sleeps until the worker has events or `timeout` passes (`ucp_worker_arm` + `poll` on the
    /// event fd; needs `ContextConfig::wakeup(true)`). Progresses first, and returns at once
    /// when that ran anything: a request it completed (or a handler it ran) must be seen by the
    /// caller before anyone sleeps, since no event will come for it. `Ok(true)` means "call
    /// progress again and look at your requests". For a passive side that must keep its worker
    /// progressed without spinning.
    pub fn wait_for_events(&self, timeout: Duration) -> Result<bool> {
        self.wait_for_events_or(timeout, &mut [])
    }

    /// [`Worker::wait_for_events`] that also wakes when one of `extra` (the caller's file
    /// descriptors: a control socket, an eventfd to kick the waiter) reports one of its
    /// `events`; their `revents` are set by `poll` (left 0 when the worker had events at once).
    pub fn wait_for_events_or(&self, timeout: Duration, extra: &mut [libc::pollfd]) -> Result<bool> {
        for p in extra.iter_mut() {
            p.revents = 0;
        }
        let efd = self.inner.efd.ok_or(Error::NoWakeup)?;
        {
            let mut l = self.inner.lock()?;
            // What arrived since the caller's last progress. Anything it runs may complete a
            // request the caller polls: return so that the caller looks, rather than arm and
            // sleep on a completion that no event will announce (the caller's last request of a
            // burst waited out the whole `timeout` that way: ucx rails finishing 20 ms late).
            if l.progress() > 0 {
                return Ok(true);
            }
            // SAFETY: worker live and locked.
            let st = unsafe { (l.api().worker_arm)(self.inner.handle) };
            if st == Status::ERR_BUSY.0 {
                return Ok(true);
            }
            Status::check(st).map_err(|s| Error::ucx("ucp_worker_arm", s))?;
        }
        let mut pfds = Vec::with_capacity(1 + extra.len());
        pfds.push(libc::pollfd { fd: efd, events: libc::POLLIN, revents: 0 });
        pfds.extend(extra.iter().map(|p| libc::pollfd { revents: 0, ..*p }));
        let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        // SAFETY: `pfds.len()` valid pollfds (poll on an arbitrary fd touches no memory of ours).
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        for (p, q) in extra.iter_mut().zip(&pfds[1..]) {
            p.revents = q.revents;
        }
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(true);
            }
            return Err(Error::Io { op: "poll(worker event fd)", source: e });
        }
        Ok(rc > 0)
    }

    /// `ucp_worker_flush_nbx`: completes when every operation posted on this worker so far has
    /// completed remotely.
    pub fn flush(&self) -> Result<Request> {
        let l = self.inner.lock()?;
        let param: sys::ucp_request_param_t = sys::zeroed();
        // SAFETY: worker live and locked.
        let p = unsafe { (l.api().worker_flush_nbx)(self.inner.handle, &param) };
        drop(l);
        Ok(Request::from_ptr(self.inner.clone(), "ucp_worker_flush_nbx", None, p, KeepAlive::default()))
    }

    /// `ucp_worker_print_info`: the worker's address and resources.
    pub fn info_string(&self) -> Result<String> {
        let l = self.inner.lock()?;
        let api = l.api();
        // SAFETY: worker live and locked; stream valid during the call.
        capture(|f| unsafe { (api.worker_print_info)(self.inner.handle, f) })
    }

    /// `ucp_worker_set_am_recv_handler`: `handler` receives every active message `id` that
    /// arrives on this worker (whole messages, [`AmData`]); see [`AmHandler`] for what it may
    /// do. Needs a context with [`crate::ContextConfig::active_messages`]. Setting `id` again
    /// replaces the handler (the old one is kept until the worker goes).
    pub fn set_am_handler(&self, id: u16, handler: Box<AmHandler>) -> Result<()> {
        let mut l = self.inner.lock()?;
        let boxed: Box<Box<AmHandler>> = Box::new(handler);
        let arg = &*boxed as *const Box<AmHandler> as *mut c_void;
        let mut param: sys::ucp_am_handler_param_t = sys::zeroed();
        param.field_mask = sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG;
        param.id = id.into();
        param.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        param.cb = Some(on_am);
        param.arg = arg;
        // SAFETY: worker live and locked; `arg` points into a heap box kept in the worker's
        // state until after `ucp_worker_destroy`.
        let st = unsafe { (l.api().worker_set_am_recv_handler)(self.inner.handle, &param) };
        Status::check(st).map_err(|s| Error::ucx("ucp_worker_set_am_recv_handler", s))?;
        if let Some(state) = l.state() {
            state.am_handlers.push(boxed);
        }
        Ok(())
    }

    /// Creates an endpoint to the worker at `remote` (error mode PEER). See [`Endpoint::connect`].
    pub fn connect(&self, remote: &WorkerAddress) -> Result<Endpoint> {
        Endpoint::connect(self, remote)
    }
}

/// A worker address: opaque bytes to put in the metadata; the peer connects to it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct WorkerAddress(Vec<u8>);

impl std::fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerAddress({} bytes)", self.0.len())
    }
}

impl WorkerAddress {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// Wraps an address received from a peer.
    ///
    /// # Safety
    /// `bytes` must be exactly what `ucp_worker_get_address` produced on the peer, delivered
    /// intact over an authenticated channel. `ucp_ep_create` takes no length and trusts the
    /// contents: a truncated or forged address makes it read out of bounds. Only the length is
    /// checked here (1 ..= [`MAX_ADDRESS_LEN`]).
    pub unsafe fn from_peer(bytes: Vec<u8>) -> Result<WorkerAddress> {
        Self::check_len(&bytes)?;
        Ok(WorkerAddress(bytes))
    }

    fn check_len(bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Err(Error::Empty { what: "worker address" });
        }
        if bytes.len() > MAX_ADDRESS_LEN {
            return Err(Error::TooLarge { what: "worker address", len: bytes.len(), max: MAX_ADDRESS_LEN });
        }
        Ok(())
    }

    /// Whether a peer's address has the structure of `local` (an address this process's UCX
    /// produced for a worker of the same configuration): the same address version (the low
    /// nibble of the first byte, `UCP_ADDRESS_HEADER_VERSION_MASK`), at least a header and a
    /// worker id, and no more than 16 times `local`'s length (4 KiB at least). A plausibility
    /// check before `ucp_ep_create`, which takes no length: it stops garbage and truncation,
    /// not a well-formed forgery (the channel's MAC does that).
    pub fn check_shape(peer: &[u8], local: &[u8]) -> Result<()> {
        Self::check_len(peer)?;
        let bad = |why: String| Err(Error::Shape { what: "worker address", why });
        let min = local.len().min(9);
        if peer.len() < min {
            return bad(format!("{} bytes, shorter than a header and worker id ({min})", peer.len()));
        }
        let max = (local.len() * 16).clamp(4096, MAX_ADDRESS_LEN);
        if peer.len() > max {
            return bad(format!("{} bytes, more than 16 times this worker's address ({} bytes)", peer.len(), local.len()));
        }
        let (theirs, ours) = (peer[0] & 0x0f, local.first().map_or(0, |b| b & 0x0f));
        if theirs != ours {
            return bad(format!("address version {theirs}, this UCX packs version {ours}"));
        }
        Ok(())
    }
}

enum ReqState {
    Done(Result<(), Status>),
    Pending(NonNull<c_void>, KeepAlive),
}

/// A non-blocking operation (PUT, GET, flush). Completion is driven by the caller: [`Request::wait`]
/// and [`Request::test`] progress the worker. A PUT is complete when its source buffer may be
/// reused, not when the data is visible remotely: flush the endpoint or worker for that.
///
/// Dropping a pending request does not cancel it: it finishes in the background (on later
/// progress, or when its endpoint is closed), keeping its memory mapping and rkey alive until then.
#[must_use = "a request completes only while someone progresses its worker: wait for it"]
pub struct Request {
    worker: Arc<WorkerInner>,
    op: &'static str,
    fail: Option<Arc<EpFail>>,
    state: ReqState,
}

// SAFETY: the request pointer is used only under the worker lock (see WorkerInner).
unsafe impl Send for Request {}
// SAFETY: &Request methods read only `state`'s discriminant and immutable fields.
unsafe impl Sync for Request {}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            ReqState::Done(r) => format!("{r:?}"),
            ReqState::Pending(..) => "pending".into(),
        };
        f.debug_struct("Request").field("op", &self.op).field("state", &state).finish()
    }
}

impl Request {
    pub(crate) fn done(worker: Arc<WorkerInner>, op: &'static str, r: Result<(), Status>) -> Request {
        Request { worker, op, fail: None, state: ReqState::Done(r) }
    }

    /// Wraps what a `*_nbx` call returned. `keep` is released at once if it completed already.
    pub(crate) fn from_ptr(
        worker: Arc<WorkerInner>,
        op: &'static str,
        fail: Option<Arc<EpFail>>,
        p: sys::ucs_status_ptr_t,
        keep: KeepAlive,
    ) -> Request {
        let state = match ptr_status(p) {
            PtrStatus::Done(r) => ReqState::Done(r),
            PtrStatus::Pending(req) => ReqState::Pending(req, keep),
        };
        Request { worker, op, fail, state }
    }

    /// The UCP function that started this request.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Whether it has completed (as last seen; does not progress).
    pub fn is_done(&self) -> bool {
        matches!(self.state, ReqState::Done(_))
    }

    fn result(&self) -> Option<Result<()>> {
        match &self.state {
            ReqState::Done(Ok(())) => Some(Ok(())),
            ReqState::Done(Err(s)) => Some(Err(match self.fail.as_ref().and_then(|f| f.get()) {
                Some(status) => Error::EndpointFailed { status },
                None => Error::ucx(self.op, *s),
            })),
            ReqState::Pending(..) => None,
        }
    }

    fn finish(&mut self, l: &mut Locked<'_>, r: Result<(), Status>) {
        if let ReqState::Pending(_, keep) = std::mem::replace(&mut self.state, ReqState::Done(r)) {
            l.bury(keep);
        }
    }

    /// Progresses the worker once and checks: `Ok(true)` done, `Ok(false)` still running, `Err`
    /// failed (an endpoint failure shows as [`Error::EndpointFailed`]).
    pub fn test(&mut self) -> Result<bool> {
        self.poll(true)
    }

    /// Checks for completion without progressing the worker (for a caller that progresses once
    /// and then sweeps many requests): `Ok(true)` done, `Ok(false)` still running, `Err` failed.
    pub fn check(&mut self) -> Result<bool> {
        self.poll(false)
    }

    /// `test` (`progress`: the worker is progressed first) and `check` (it is not).
    fn poll(&mut self, progress: bool) -> Result<bool> {
        if let Some(r) = self.result() {
            return r.map(|()| true);
        }
        let worker = self.worker.clone();
        let mut l = worker.lock()?;
        if progress {
            l.progress();
        }
        if let ReqState::Pending(req, _) = &self.state {
            if let Some(r) = l.poll_req(*req) {
                self.finish(&mut l, r);
            }
        }
        drop(l);
        match self.result() {
            Some(r) => r.map(|()| true),
            None => Ok(false),
        }
    }

    /// Progresses the worker until the request completes or `deadline` passes
    /// ([`Error::Timeout`]; the request stays pending and may be waited for again).
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        if let ReqState::Pending(req, _) = &self.state {
            let req = *req;
            let worker = self.worker.clone();
            match worker.wait_req(req, deadline, true)? {
                Some(r) => {
                    let mut l = worker.lock_unchecked();
                    self.finish(&mut l, r);
                }
                None => return Err(Error::Timeout { op: self.op, waited: start.elapsed() }),
            }
        }
        self.result().unwrap_or(Ok(()))
    }

    /// [`Request::wait`] with a timeout instead of a deadline.
    pub fn wait_for(&mut self, timeout: Duration) -> Result<()> {
        self.wait(Instant::now() + timeout)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let ReqState::Pending(req, keep) = std::mem::replace(&mut self.state, ReqState::Done(Ok(()))) {
            let mut l = self.worker.lock_unchecked();
            match l.state() {
                Some(st) => st.orphans.push(Orphan { req, keep }),
                None => l.bury(keep),
            }
        }
    }
}
