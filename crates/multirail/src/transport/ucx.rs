//! The UCX data path: one UCP context per local rail, every registered region mapped in each;
//! per (link, rail) an initiator worker with one endpoint to a per-session worker on the target.
//!
//! Session set-up goes over an authenticated multirail connection of `Role::UcxSession` on the
//! target's rail: the initiator sends `UcxOpen { rail, addr }`, the target creates a worker just
//! for this session on that rail's context and answers `UcxReady { addr, regions }` with the
//! packed rkeys of the regions it exports (rkeys are capabilities: they travel only over the
//! session, never in published metadata). Regions registered later are fetched with
//! `UcxRkeys` when a post names them. The target then progresses the session's worker (UCX over
//! tcp does the RMA in software on the target) until the session socket hangs up, the agent
//! closes or the session is fenced; a fence returns only after that worker is destroyed, so no
//! late PUT of the session can land after it (docs/ucx.md, "What the ucx transport on top must
//! do", item 7).
//!
//! Not protected over tcp: UCX's software RMA writes wherever the initiator says (docs/ucx.md,
//! "Trust"); bounds are checked on the initiator (here and in the bindings). Over RDMA the HCA
//! checks the rkey and bounds, but rkeys are mapped read-write, so a read-only region is
//! writable by a peer that holds its rkey (the initiator refuses it only by the metadata).
//!
//! `transport::ucx_rails` puts [`UcxRail`]s behind the engine's `Transport` trait (one per rail
//! of a link, a progress thread each); the planner, not this module, requeues what a failed rail
//! left unfinished (`take_unfinished` serves the tests).

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use multirail_proto::codec::UcxRegion;
use multirail_proto::{Access, Body, RailInfo, Status};
use multirail_ucx::{
    CloseMode, Context, ContextConfig, Endpoint, LoadOptions, MemRegion, PackedRkey, RemoteRegion, Request, Rkey, ThreadMode, Ucx, Worker,
    WorkerAddress,
};

use crate::agent::{LocalRail, Shared};
use crate::error::{Error, Result};
use crate::peer::{abort_socket, status_error};
use crate::registry::Region;
use crate::wire::{self, WireError};

/// How long the target's session loop sleeps at most between checks of shutdown and fence flags
/// (both also abort the session socket, which wakes it at once).
const SESSION_TICK: Duration = Duration::from_millis(250);
/// Bounded progress calls per sweep.
const PROGRESS_BURST: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One local rail's UCX context and what it is restricted to.
struct RailCtx {
    ctx: Context,
    /// `NET_DEVICES` (and `TLS`) it was created with, for reports.
    devices: String,
}

/// A registered region mapped in every rail context: `(mapping, packed rkey if exported)`.
struct Mapped {
    base: u64,
    len: u64,
    exported: bool,
    per_rail: Vec<(MemRegion, Option<PackedRkey>)>,
}

/// Region id -> mapping; shared with the rails (they find local memory handles in it).
type Maps = RwLock<HashMap<u64, Arc<Mapped>>>;

fn find_local(maps: &Maps, rail: usize, addr: u64, len: u64) -> Option<(MemRegion, usize)> {
    let end = addr.checked_add(len)?;
    let g = maps.read().unwrap_or_else(PoisonError::into_inner);
    g.values()
        .find(|m| m.base <= addr && end <= m.base + m.len)
        .and_then(|m| m.per_rail.get(rail).map(|(mr, _)| (mr.clone(), (addr - m.base) as usize)))
}

/// Per-agent UCX state: UCX loaded once; one UCP context (with WAKEUP) per local rail,
/// restricted to that rail (`NET_DEVICES` = its RDMA device:port, else its netdev with
/// `TLS=tcp`); UCX's own multi-rail splitting off (`MAX_RNDV_RAILS=1`, `MAX_EAGER_LANES=1`):
/// multirail stripes itself. Every registered region is `ucp_mem_map`ed once per rail context.
pub(crate) struct UcxAgent {
    ucx: Ucx,
    rails: Vec<RailCtx>,
    maps: Arc<Maps>,
    /// Target-side session workers alive now.
    sessions: std::sync::atomic::AtomicUsize,
    /// Whether GPU memory can go over these rails directly (GPUDirect RDMA), or why not.
    gpu_direct: std::result::Result<(), String>,
}

impl UcxAgent {
    pub fn new(rails: &[LocalRail], rail_meta: &[RailInfo]) -> Result<UcxAgent> {
        let ucx = Ucx::load_with(&LoadOptions::from_env()).map_err(|e| Error::Unavailable(format!("cannot load UCX: {e}")))?;
        let mut ctxs = Vec::with_capacity(rails.len());
        for (i, r) in rails.iter().enumerate() {
            let rdma = rail_meta.get(i).map(|m| m.rdma_dev.as_str()).unwrap_or("");
            let (cfg, devices) = rail_config(i, r, rdma);
            let ctx = Context::new(&ucx, &cfg)
                .map_err(|e| Error::Unavailable(format!("UCX context for rail {i} ({devices}) with {}: {e}", ucx.info())))?;
            ctxs.push(RailCtx { ctx, devices });
        }
        let infos: Vec<(String, &str)> = ctxs.iter().map(|r| (r.ctx.info_string().unwrap_or_default(), r.devices.as_str())).collect();
        let gpu_direct = gpu_direct_check(&infos, std::path::Path::new("/sys/module"));
        Ok(UcxAgent { ucx, rails: ctxs, maps: Arc::new(RwLock::new(HashMap::new())), sessions: Default::default(), gpu_direct })
    }

    /// Ok when every rail can move GPU memory directly (module docs of `gpu_direct_check`),
    /// else why not.
    pub fn gpu_direct(&self) -> std::result::Result<(), &str> {
        self.gpu_direct.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Map a newly registered region in every rail context (and pack its rkey when exported).
    pub fn map(&self, region: &Region) -> Result<()> {
        let exported = region.access != Access::Local;
        let mut per_rail = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            // SAFETY: the caller registered [base, base+len) with the agent and keeps it
            // allocated while registered; it is unmapped at deregistration, after the registry
            // saw no holder (a request still pending keeps its own mapping alive until done).
            let m = unsafe { r.ctx.map(region.base as *mut u8, region.len as usize) }
                .map_err(|e| Error::InvalidArgument(format!("UCX cannot map region {} on rail {i} ({}): {e}", region.id, r.devices)))?;
            let packed =
                if exported {
                    Some(m.pack_rkey().map_err(|e| {
                        Error::InvalidArgument(format!("UCX cannot pack the rkey of region {} on rail {i}: {e}", region.id))
                    })?)
                } else {
                    None
                };
            per_rail.push((m, packed));
        }
        let mapped = Arc::new(Mapped { base: region.base, len: region.len, exported, per_rail });
        self.maps.write().unwrap_or_else(PoisonError::into_inner).insert(region.id, mapped);
        Ok(())
    }

    /// Drop a deregistered region's mappings (each is unmapped once no pending request uses it).
    pub fn unmap(&self, region_id: u64) {
        self.maps.write().unwrap_or_else(PoisonError::into_inner).remove(&region_id);
    }

    #[cfg(test)]
    /// Target-side session workers alive now (a fenced or closed session's worker is gone).
    pub fn sessions(&self) -> usize {
        self.sessions.load(Ordering::SeqCst)
    }

    /// e.g. "1.22.0 (libucx wheel /path/libucp.so.0)".
    pub fn version(&self) -> String {
        let i = self.ucx.info();
        format!("{} ({} {})", i.version, i.source, i.path.display())
    }

    /// The library and each rail's restriction, for the start-up log.
    pub fn describe(&self) -> String {
        let rails: Vec<String> = self.rails.iter().enumerate().map(|(i, r)| format!("rail {i}: {}", r.devices)).collect();
        format!("{}; {}", self.ucx.info(), rails.join("; "))
    }

    /// The loud warning for a host with RDMA devices and a UCX without InfiniBand.
    pub fn rdma_warning(&self) -> Option<String> {
        self.ucx.info().rdma_warning()
    }

    /// Exported regions with their rkeys packed in `rail`'s context (all, or those in `ids`).
    fn ready_regions(&self, rail: usize, ids: Option<&[u64]>) -> Vec<UcxRegion> {
        let g = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let one = |id: u64, m: &Mapped| -> Option<UcxRegion> {
            if !m.exported {
                return None;
            }
            let packed = m.per_rail.get(rail)?.1.as_ref()?;
            Some(UcxRegion { id, base: m.base, len: m.len, rkey: packed.as_bytes().to_vec() })
        };
        match ids {
            Some(ids) => ids.iter().filter_map(|id| g.get(id).and_then(|m| one(*id, m))).collect(),
            None => {
                let mut v: Vec<UcxRegion> = g.iter().filter_map(|(id, m)| one(*id, m)).collect();
                v.sort_by_key(|r| r.id);
                v
            }
        }
    }
}

/// The UCX context configuration of one rail, and a description of its restriction.
fn rail_config(i: usize, r: &LocalRail, rdma_dev: &str) -> (ContextConfig, String) {
    let cfg = ContextConfig::new().wakeup(true).name(format!("multirail-rail{i}")).set("MAX_RNDV_RAILS", "1").set("MAX_EAGER_LANES", "1");
    if !rdma_dev.is_empty() {
        let dev = if rdma_dev.contains(':') { rdma_dev.to_string() } else { format!("{rdma_dev}:1") };
        return (cfg.net_devices(dev.clone()), format!("NET_DEVICES={dev}"));
    }
    match netdev_of(r) {
        Some(dev) => (cfg.net_devices(dev.clone()).tls("tcp"), format!("NET_DEVICES={dev} TLS=tcp")),
        // An unspecified address (0.0.0.0): no single device to restrict to.
        None => (cfg.tls("tcp"), "NET_DEVICES=all TLS=tcp".into()),
    }
}

/// GPUDirect RDMA over every rail needs three things; the first one missing is the reason:
/// 1. a UCX with CUDA support that found a GPU driver (its contexts list a `cuda` transport);
/// 2. rails on RDMA devices (a rail over UCX's tcp copies through host memory);
/// 3. the kernel's GPUDirect RDMA support: `nvidia_peermem` (or the older `nv_peer_mem`) loaded.
///    (dma-buf registration, the other way, is not detected by this build.)
///
/// When it holds, GPU regions are `ucp_mem_map`ped like host ones (UCX detects the memory type)
/// and GPU transfers go over the ucx rails as they are ("direct"). Not verified on hardware here.
/// `rails`: each rail context's `ucp_context_print_info` and its device restriction.
fn gpu_direct_check(rails: &[(String, &str)], sys_module: &std::path::Path) -> std::result::Result<(), String> {
    for (i, (info, devices)) in rails.iter().enumerate() {
        if !info.contains("cuda") {
            return Err(format!("the loaded UCX has no CUDA transport on rail {i} (UCX built without CUDA, or no GPU driver)"));
        }
        if devices.contains("TLS=tcp") {
            return Err(format!("rail {i} runs on UCX's tcp ({devices}): GPUDirect needs an RDMA device"));
        }
    }
    if rails.is_empty() {
        return Err("no rails".into());
    }
    if !["nvidia_peermem", "nv_peer_mem"].iter().any(|m| sys_module.join(m).exists()) {
        return Err("GPUDirect RDMA kernel support is missing: nvidia_peermem is not loaded (`modprobe nvidia_peermem`)".into());
    }
    Ok(())
}

/// The network interface of a tcp rail: its name when that is an interface, else the interface
/// holding its address, else `lo` (the default single loopback rail has no device name).
fn netdev_of(r: &LocalRail) -> Option<String> {
    if !r.device.is_empty() {
        if let Ok(c) = std::ffi::CString::new(r.device.as_str()) {
            // SAFETY: a NUL-terminated string; if_nametoindex only reads it.
            if unsafe { libc::if_nametoindex(c.as_ptr()) } != 0 {
                return Some(r.device.clone());
            }
        }
    }
    match r.addr {
        Some(a) if a.is_unspecified() => None,
        Some(a) if a.is_loopback() => Some("lo".into()),
        Some(a) => Some(iface_for(a).unwrap_or_else(|| "lo".into())),
        None => Some("lo".into()),
    }
}

/// The interface that holds `addr` (getifaddrs).
fn iface_for(addr: IpAddr) -> Option<String> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says its real type.
            let a = unsafe {
                match (*ifa.ifa_addr).sa_family as i32 {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                    }
                    _ => None,
                }
            };
            if a == Some(addr) && !ifa.ifa_name.is_null() {
                // SAFETY: a NUL-terminated interface name owned by the list.
                found = Some(unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned());
                break;
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found
}

/// An eventfd that wakes a rail's progress thread when a chunk is posted or the rail aborted
/// (a PUT can complete locally inside the post, leaving no event on the worker's fd).
struct Kick(OwnedFd);

impl Kick {
    fn new() -> std::io::Result<Kick> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nobody else owns.
        Ok(Kick(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: 8 bytes from a live u64 to our eventfd (a full counter only means "kicked").
        unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

/// A target region as the session announced it; the rkey is unpacked on first use.
struct Remote {
    region: RemoteRegion,
    packed: PackedRkey,
    rkey: Option<Rkey>,
}

struct Op {
    token: u64,
    write: bool,
    req: Request,
    /// For a PUT: an endpoint flush issued right after it, complete once the PUT is complete
    /// at the target (remote completion). One per PUT, so each chunk is reported as soon as it
    /// landed: a flush covering the whole window would report nothing until the window drained.
    flush: Option<Request>,
}

struct RailState {
    /// `None` once aborted.
    ep: Option<Endpoint>,
    remote: HashMap<u64, Remote>,
    /// Posted, not yet complete (a PUT: not yet complete at the target).
    ops: Vec<Op>,
    /// Tokens of chunks that were outstanding when the rail was aborted (never reported).
    lost: Vec<u64>,
    failed: Option<String>,
    /// The stall clock: last completion, or when the rail became busy.
    last_event: Instant,
    transport: Option<String>,
    completed_any: bool,
}

impl RailState {
    fn outstanding(&self) -> usize {
        self.ops.len()
    }

    fn fail(&mut self, reason: String) -> String {
        self.failed.get_or_insert(reason).clone()
    }
}

/// Initiator side of one rail to one peer: a worker of its own (per link and rail, so a fence
/// can tear exactly it down), one endpoint to the target's per-session worker, rkeys by region.
///
/// `Send + Sync`: one progress thread calls [`UcxRail::progress`]; any thread may `post` and
/// `abort`. Lock order: the rail state, then (inside the bindings) the worker.
pub(crate) struct UcxRail {
    local_rail: usize,
    id: [u8; 16],
    maps: Arc<Maps>,
    worker: Worker,
    state: Mutex<RailState>,
    /// The session socket for `UcxRkeys` round trips.
    sock: Mutex<TcpStream>,
    /// Another handle on it: hang-up checks and the abort.
    sock_ctl: TcpStream,
    kick: Kick,
    timeout: Duration,
    aborted: AtomicBool,
}

fn wire_error(who: &str, e: WireError) -> Error {
    match e {
        WireError::Decode(source) => Error::Decode { who: who.into(), source },
        WireError::GaveUp(m) => Error::Timeout(m),
        WireError::Io(e) => Error::PeerLost { peer: who.into(), reason: format!("ucx session: {e}") },
    }
}

/// Wrap an announced region list (from the authenticated session) for use.
fn remotes(regions: Vec<UcxRegion>) -> impl Iterator<Item = (u64, Remote)> {
    regions.into_iter().filter_map(|g| {
        // SAFETY: the bytes come intact over the authenticated session from the target's
        // `ucp_rkey_pack` (the codec bounds their length; empty ones are refused here).
        let packed = unsafe { PackedRkey::from_peer(g.rkey) }.ok()?;
        Some((g.id, Remote { region: RemoteRegion { addr: g.base, len: g.len }, packed, rkey: None }))
    })
}

impl UcxRail {
    /// `session`: an already authenticated TCP connection to the target's rail (opened with
    /// `peer::dial_id` and `Role::UcxSession`), `id` its Hello nonce (what a `Fence` names).
    /// Does the UcxOpen/UcxReady exchange and connects the endpoint (waits for the wire-up with a
    /// flush). Bounded by `timeout`, which also bounds later `UcxRkeys` round trips and `abort`.
    pub fn open(
        agent: &UcxAgent,
        local_rail: usize,
        remote_rail: u16,
        session: TcpStream,
        id: [u8; 16],
        timeout: Duration,
    ) -> Result<UcxRail> {
        let who = session.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let rail = agent
            .rails
            .get(local_rail)
            .ok_or_else(|| Error::InvalidArgument(format!("no local rail {local_rail} (this agent has {})", agent.rails.len())))?;
        let ucx_err = |what: &str, e: multirail_ucx::Error| match e {
            multirail_ucx::Error::Timeout { .. } => Error::Timeout(format!("ucx session with {who}: {what}: {e}")),
            e => Error::PeerLost { peer: who.clone(), reason: format!("ucx session: {what}: {e}") },
        };
        let worker = Worker::new(&rail.ctx, ThreadMode::Serialized).map_err(|e| ucx_err("worker", e))?;
        let addr = worker.address().map_err(|e| ucx_err("worker address", e))?;
        let deadline = Instant::now() + timeout;
        let mut s = session;
        let mut tick =
            |_: bool| if Instant::now() > deadline { Err(format!("ucx session with {who} not open within {timeout:?}")) } else { Ok(()) };
        wire::send(&mut s, &Body::UcxOpen { rail: remote_rail, addr: addr.into_bytes() }, 0, &mut tick).map_err(|e| wire_error(&who, e))?;
        let (peer_addr, regions) = match wire::read_frame(&mut s, &mut tick).map_err(|e| wire_error(&who, e))?.1 {
            Body::UcxReady { addr, regions } => (addr, regions),
            Body::Error { status, msg } | Body::Resp { status, msg, .. } => return Err(status_error(&who, status, msg)),
            other => return Err(Error::Protocol { who, msg: format!("expected UcxReady, got {:?}", other.kind()) }),
        };
        // SAFETY: the target's `ucp_worker_get_address`, intact over the authenticated session.
        let peer_addr = unsafe { WorkerAddress::from_peer(peer_addr) }
            .map_err(|e| Error::Protocol { who: who.clone(), msg: format!("bad worker address in UcxReady: {e}") })?;
        let ep = worker.connect(&peer_addr).map_err(|e| ucx_err("connect", e))?;
        // The wire-up completes only while both sides progress: wait for it here, bounded.
        ep.flush().and_then(|mut r| r.wait(deadline)).map_err(|e| ucx_err("connect (wire-up flush)", e))?;
        let kick = Kick::new().map_err(|e| Error::io("eventfd", e))?;
        let sock_ctl = s.try_clone().map_err(|e| Error::io("clone ucx session socket", e))?;
        let state = RailState {
            ep: Some(ep),
            remote: remotes(regions).collect(),
            ops: Vec::new(),
            lost: Vec::new(),
            failed: None,
            last_event: Instant::now(),
            transport: None,
            completed_any: false,
        };
        Ok(UcxRail {
            local_rail,
            id,
            maps: agent.maps.clone(),
            worker,
            state: Mutex::new(state),
            sock: Mutex::new(s),
            sock_ctl,
            kick,
            timeout,
            aborted: AtomicBool::new(false),
        })
    }

    /// Wake a `progress` sleeping on this rail (work may be waiting in the planner).
    pub fn wake(&self) {
        self.kick.kick();
    }

    /// The session's Hello nonce: what a `Fence` to the target names to tear the session down.
    pub fn id(&self) -> [u8; 16] {
        self.id
    }

    /// Post one chunk; `token` comes back from [`UcxRail::progress`]. `local` is an address
    /// inside a region registered (hence mapped) here; `remote_region` / `remote_offset` name
    /// the target's region. WRITE = put, READ = get. Bounds are checked against the local
    /// mapping and the region bounds the session announced, before UCX is called.
    pub fn post(
        &self,
        token: u64,
        write: bool,
        local: u64,
        remote_region: u64,
        remote_offset: u64,
        len: u64,
    ) -> std::result::Result<(), String> {
        let op = if write { "WRITE" } else { "READ" };
        let (mem, off) = find_local(&self.maps, self.local_rail, local, len)
            .ok_or_else(|| format!("{op}: local range {local:#x} + {len} is not inside memory registered with this agent"))?;
        let n = usize::try_from(len).map_err(|_| format!("{op}: length {len} too large"))?;
        if !lock(&self.state).remote.contains_key(&remote_region) {
            self.fetch_rkey(remote_region)?;
        }
        let mut g = lock(&self.state);
        let st = &mut *g;
        if let Some(f) = &st.failed {
            return Err(format!("rail is down: {f}"));
        }
        let Some(ep) = st.ep.as_ref() else { return Err("rail was aborted".into()) };
        let remote =
            st.remote.get_mut(&remote_region).ok_or_else(|| format!("{op}: the peer exports no region {remote_region} over ucx"))?;
        let remote_addr = match remote.region.addr.checked_add(remote_offset) {
            Some(a) if remote.region.contains(a, len) => a,
            _ => {
                return Err(format!(
                    "{op}: remote offset {remote_offset} + {len} is outside region {remote_region} ({} bytes)",
                    remote.region.len
                ))
            }
        };
        let rkey = match &remote.rkey {
            Some(k) => k.clone(),
            None => {
                let k = ep
                    .unpack_rkey(&remote.packed, remote.region)
                    .map_err(|e| format!("{op}: cannot unpack the rkey of region {remote_region}: {e}"))?;
                remote.rkey = Some(k.clone());
                k
            }
        };
        let r = if write { ep.put(&mem, off, n, &rkey, remote_addr) } else { ep.get(&mem, off, n, &rkey, remote_addr) };
        let req = match r {
            Ok(req) => req,
            Err(e @ multirail_ucx::Error::EndpointFailed { .. }) => return Err(format!("rail is down: {}", st.fail(e.to_string()))),
            Err(e) => return Err(format!("{op} refused: {e}")),
        };
        let flush = match write {
            false => None,
            true => match ep.flush() {
                Ok(f) => Some(f),
                Err(e) => return Err(format!("rail is down: {}", st.fail(format!("flush refused: {e}")))),
            },
        };
        if st.outstanding() == 0 {
            st.last_event = Instant::now();
        }
        st.ops.push(Op { token, write, req, flush });
        drop(g);
        self.kick.kick();
        Ok(())
    }

    /// Ask the target for the rkey of a region registered after the session opened.
    fn fetch_rkey(&self, id: u64) -> std::result::Result<(), String> {
        let mut s = lock(&self.sock);
        if self.aborted.load(Ordering::Acquire) {
            return Err("rail was aborted".into());
        }
        let deadline = Instant::now() + self.timeout;
        let mut tick =
            |_: bool| if Instant::now() > deadline { Err(format!("no rkey for region {id} within {:?}", self.timeout)) } else { Ok(()) };
        wire::send(&mut s, &Body::UcxRkeys(vec![id]), 0, &mut tick).map_err(|e| format!("ucx session: {e}"))?;
        match wire::read_frame(&mut s, &mut tick).map_err(|e| format!("ucx session: {e}"))?.1 {
            Body::UcxReady { regions, .. } => {
                lock(&self.state).remote.extend(remotes(regions));
                Ok(())
            }
            Body::Error { status, msg } => Err(format!("ucx session refused: {status:?}: {msg}")),
            other => Err(format!("ucx session: expected UcxReady, got {:?}", other.kind())),
        }
    }

    /// Progress the worker; push finished chunks into `done` (token, Ok, or Err(reason) for a
    /// chunk-level refusal). A PUT is done only once a flush issued after it completed (remote
    /// completion; one flush per PUT). Sleeps at most `wait` on the worker's event fd (and
    /// the session socket and the post kick) when nothing is ready. `Err(reason)`: the rail
    /// failed (endpoint error, a request failed with EndpointFailed, the session socket hung
    /// up, or nothing completed for `stall` while chunks were outstanding: UCX over tcp does not
    /// report a hung peer). Failure is sticky; the caller aborts, fences and reissues
    /// ([`UcxRail::take_unfinished`] lists what was not reported).
    pub fn progress(
        &self,
        done: &mut Vec<(u64, std::result::Result<(), String>)>,
        wait: Duration,
        stall: Duration,
    ) -> std::result::Result<(), String> {
        let start = Instant::now();
        loop {
            let before = done.len();
            let busy_since = self.sweep(done, stall)?;
            if done.len() > before {
                return Ok(());
            }
            let now = Instant::now();
            let elapsed = now - start;
            if elapsed >= wait {
                return Ok(());
            }
            let mut sleep = wait - elapsed;
            if let Some(t) = busy_since {
                // Wake to check the stall clock when it runs out.
                sleep = sleep.min((t + stall).saturating_duration_since(now) + Duration::from_millis(1));
            }
            let mut fds = [
                libc::pollfd { fd: self.sock_ctl.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 },
                libc::pollfd { fd: self.kick.fd(), events: libc::POLLIN, revents: 0 },
            ];
            if let Err(e) = self.worker.wait_for_events_or(sleep, &mut fds) {
                return Err(lock(&self.state).fail(format!("waiting for ucx events: {e}")));
            }
            if fds[1].revents != 0 {
                self.kick.drain();
            }
        }
    }

    /// One pass: progress, collect completions, flush, check failure and the stall clock.
    /// Returns the stall clock's start when chunks are outstanding.
    fn sweep(
        &self,
        done: &mut Vec<(u64, std::result::Result<(), String>)>,
        stall: Duration,
    ) -> std::result::Result<Option<Instant>, String> {
        let mut g = lock(&self.state);
        let st = &mut *g;
        if let Some(f) = &st.failed {
            return Err(f.clone());
        }
        let Some(ep) = st.ep.as_ref() else { return Err(st.fail("rail was aborted".into())) };
        for _ in 0..PROGRESS_BURST {
            match self.worker.progress() {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => return Err(st.fail(format!("ucp_worker_progress: {e}"))),
            }
        }
        if let Some(status) = ep.failure() {
            return Err(st.fail(format!("ucx endpoint failed: {status}")));
        }
        let mut progressed = false;
        let mut i = 0;
        while i < st.ops.len() {
            let op = &mut st.ops[i];
            let r = match op.flush.as_mut() {
                // The flush completes after the PUT it follows, remotely.
                Some(f) => f.check().and_then(|done| if done { op.req.check() } else { Ok(false) }),
                None => op.req.check(),
            };
            match r {
                Ok(false) => i += 1,
                Ok(true) => {
                    let op = st.ops.swap_remove(i);
                    progressed = true;
                    done.push((op.token, Ok(())));
                }
                Err(e @ multirail_ucx::Error::EndpointFailed { .. }) => return Err(st.fail(e.to_string())),
                Err(e) => {
                    let op = st.ops.swap_remove(i);
                    progressed = true;
                    done.push((op.token, Err(format!("{} failed: {e}", if op.write { "WRITE" } else { "READ" }))));
                }
            }
        }
        let now = Instant::now();
        if progressed {
            st.last_event = now;
            st.completed_any = true;
        }
        if let Some(reason) = self.session_hung_up() {
            return Err(st.fail(reason));
        }
        let n = st.outstanding();
        if n == 0 {
            return Ok(None);
        }
        if now.duration_since(st.last_event) > stall {
            return Err(st.fail(format!("no ucx completion for {stall:?} with {n} chunk(s) outstanding (peer hung or path lost)")));
        }
        Ok(Some(st.last_event))
    }

    /// Whether the target closed the session (it closes it when it tears the session's worker
    /// down: agent closed, session fenced, or a refusal).
    fn session_hung_up(&self) -> Option<String> {
        let mut b = [0u8; 1];
        // SAFETY: peeks at most 1 byte into a live buffer; non-blocking.
        let n = unsafe { libc::recv(self.sock_ctl.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n == 0 {
            return Some("ucx session closed by the target".into());
        }
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => None,
                _ => Some(format!("ucx session: {e}")),
            };
        }
        // Bytes nobody asked for (no rkey fetch holds the socket): the target's Error frame.
        let Ok(mut s) = self.sock.try_lock() else { return None };
        let mut tick = |_: bool| Err::<(), String>("partial frame".into());
        Some(match wire::read_frame(&mut s, &mut tick) {
            Ok((_, Body::Error { status, msg })) => format!("ucx session ended by the target: {status:?}: {msg}"),
            Ok((_, other)) => format!("ucx session: unexpected {:?} from the target", other.kind()),
            Err(e) => format!("ucx session: {e}"),
        })
    }

    #[cfg(test)]
    /// Chunks posted and not yet reported by `progress`.
    pub fn outstanding(&self) -> usize {
        let st = lock(&self.state);
        st.outstanding() + st.lost.len()
    }

    #[cfg(test)]
    /// After a failure and [`UcxRail::abort`]: the tokens of every chunk posted and never
    /// reported (to reissue elsewhere once the session is fenced). Empties the list.
    pub fn take_unfinished(&self) -> Vec<u64> {
        let mut st = lock(&self.state);
        let mut v = std::mem::take(&mut st.lost);
        v.extend(st.ops.iter().map(|o| o.token));
        v
    }

    /// "ucx/tcp", "ucx/rc_mlx5", ... (the transports of the endpoint's lanes, joined by '+');
    /// asked once after the first completion (lanes change during wire-up), "ucx" before.
    pub fn transport_name(&self) -> String {
        let mut st = lock(&self.state);
        if let Some(t) = &st.transport {
            return t.clone();
        }
        let Some(ep) = st.ep.as_ref() else { return "ucx".into() };
        let Ok(t) = ep.transports() else { return "ucx".into() };
        let mut names: Vec<&str> = Vec::new();
        for e in &t.entries {
            if !e.transport.is_empty() && !names.contains(&e.transport.as_str()) {
                names.push(&e.transport);
            }
        }
        if names.is_empty() {
            return "ucx".into();
        }
        let name = format!("ucx/{}", names.join("+"));
        if st.completed_any {
            st.transport = Some(name.clone());
        }
        name
    }

    /// Force-close the endpoint and abort the session socket; when this returns no request of
    /// this rail touches local memory any more (GET destinations may be reissued, PUT sources
    /// reused). Safe to call twice and concurrently with `progress` and `post`. The target's
    /// session worker may still apply PUT data already sent: fence the session ([`UcxRail::id`])
    /// before reissuing WRITEs.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let mut g = lock(&self.state);
        let st = &mut *g;
        st.fail("rail aborted".into());
        if let Some(ep) = st.ep.take() {
            // Cancels what is outstanding; forced closes complete without the peer.
            let _ = ep.close(CloseMode::Force, Instant::now() + self.timeout.max(Duration::from_secs(1)));
            let lost: Vec<u64> = st.ops.drain(..).map(|o| o.token).collect();
            st.lost.extend(lost);
            // Closed by the force close: these requests are complete (cancelled) and drop here.
        }
        drop(g);
        abort_socket(&self.sock_ctl);
        self.kick.kick();
    }
}

// Progress runs on one thread per rail while others post and abort.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<UcxRail>();
    send_sync::<UcxAgent>();
};

impl Drop for UcxRail {
    fn drop(&mut self) {
        self.abort();
    }
}

/// A `wire` tick for the session's frames: gives up (an empty reason: just close) once `stop()`,
/// or with `late()`'s reason after `deadline`.
fn tick_until<'a>(
    stop: &'a impl Fn() -> bool,
    deadline: Instant,
    late: impl Fn() -> String + 'a,
) -> impl FnMut(bool) -> std::result::Result<(), String> + 'a {
    move |_| {
        if stop() {
            Err(String::new())
        } else if Instant::now() > deadline {
            Err(late())
        } else {
            Ok(())
        }
    }
}

/// Target side of one `Role::UcxSession` connection (already authenticated and registered in
/// `Shared::served`; the caller holds the connection's `apply` lock for the whole call). Reads
/// `UcxOpen`, creates a worker on that rail's context for this session only, answers
/// `UcxReady`, then progresses the worker (sleeping on its event fd and the socket) and answers
/// `UcxRkeys` until the socket hangs up, the agent shuts down or the session is fenced. The
/// worker is destroyed before this returns. `Err((status, msg))`: refuse with that (an empty
/// message means just close).
pub(crate) fn serve_session(
    sh: &Shared,
    agent: &UcxAgent,
    s: &mut TcpStream,
    fenced: &AtomicBool,
    who: &str,
) -> std::result::Result<(), (Status, String)> {
    let timeout = sh.ctx.cfg.timeout;
    let stop = || sh.shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("no UcxOpen within {timeout:?}"));
    let rail = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::UcxOpen { rail, addr: _ })) => rail as usize,
        Ok((_, other)) => return Err((Status::Unexpected, format!("expected UcxOpen, got {:?}", other.kind()))),
        Err(WireError::Decode(e)) => return Err((Status::Malformed, e.to_string())),
        Err(WireError::GaveUp(m)) => return Err((Status::Malformed, m)),
        Err(WireError::Io(_)) => return Err((Status::Ok, String::new())),
    };
    let Some(rc) = agent.rails.get(rail) else {
        return Err((Status::Unexpected, format!("no rail {rail} here (this agent has {})", agent.rails.len())));
    };
    let worker = Worker::new(&rc.ctx, ThreadMode::Serialized).map_err(|e| (Status::Internal, format!("ucx session worker: {e}")))?;
    agent.sessions.fetch_add(1, Ordering::SeqCst);
    let r = session_loop(sh, agent, s, &worker, rail, fenced, who);
    // The session's worker goes here: its connections close, nothing of the session can touch
    // memory after this (the caller releases the fence lock only afterwards).
    drop(worker);
    agent.sessions.fetch_sub(1, Ordering::SeqCst);
    r
}

fn session_loop(
    sh: &Shared,
    agent: &UcxAgent,
    s: &mut TcpStream,
    worker: &Worker,
    rail: usize,
    fenced: &AtomicBool,
    who: &str,
) -> std::result::Result<(), (Status, String)> {
    let timeout = sh.ctx.cfg.timeout;
    let stop = || sh.shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("UcxReady not sent within {timeout:?}"));
    let rc = &agent.rails[rail];
    let addr = worker.address().map_err(|e| (Status::Internal, format!("ucx session worker address: {e}")))?;
    let ready = Body::UcxReady { addr: addr.into_bytes(), regions: agent.ready_regions(rail, None) };
    if wire::send(s, &ready, 0, &mut tick).is_err() {
        return Err((Status::Ok, String::new()));
    }
    sh.ctx.log(&format!("ucx session from {who} on rail {rail} ({})", rc.devices));
    let fd = s.as_raw_fd();
    let spin = match sh.ctx.cfg.progress {
        crate::config::Progress::Block => Duration::ZERO,
        _ => sh.ctx.cfg.spin,
    };
    let r = loop {
        if stop() {
            break Ok(());
        }
        // Serve like a TCP serving connection (`Config::progress`): after activity, keep
        // progressing the worker for `spin` (software RMA over tcp needs this side's progress, and
        // a wake-up from the event fd costs tens of microseconds on a busy host), then sleep.
        if spin > Duration::ZERO {
            let mut until = Instant::now() + spin;
            while Instant::now() < until && !stop() {
                match worker.progress() {
                    Ok(0) => std::hint::spin_loop(),
                    Ok(_) => until = Instant::now() + spin,
                    Err(_) => break,
                }
            }
        }
        let mut fds = [libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }];
        if let Err(e) = worker.wait_for_events_or(SESSION_TICK, &mut fds) {
            sh.ctx.log(&format!("ucx session from {who}: {e}"));
            break Ok(());
        }
        let rev = fds[0].revents;
        if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL | libc::POLLRDHUP) != 0 {
            break Ok(());
        }
        if rev & libc::POLLIN == 0 {
            continue;
        }
        let mut op_tick = tick_until(&stop, Instant::now() + timeout, || format!("request not completed within {timeout:?}"));
        match wire::read_frame(s, &mut op_tick) {
            Ok((h, Body::UcxRkeys(ids))) => {
                let resp = Body::UcxReady { addr: Vec::new(), regions: agent.ready_regions(rail, Some(&ids)) };
                if wire::send(s, &resp, h.req_id, &mut op_tick).is_err() {
                    break Ok(());
                }
            }
            Ok((_, other)) => break Err((Status::Unexpected, format!("{:?} is not a ucx session request", other.kind()))),
            Err(WireError::Decode(e)) => break Err((Status::Malformed, e.to_string())),
            Err(WireError::GaveUp(m)) => break Err((Status::Malformed, m)),
            Err(WireError::Io(_)) => break Ok(()),
        }
    };
    r
}

#[cfg(test)]
mod tests {
    //! Need a UCX: `#[ignore]`d, run with `cargo test -p multirail -- --ignored ucx` (UCX found
    //! as the bindings' loader says: MULTIRAIL_UCX_LIB, system, MULTIRAIL_UCX_WHEEL_DIR).
    use super::*;
    use crate::agent::Agent;
    use crate::config::{Config, TransportKind};
    use crate::peer::dial_id;
    use multirail_proto::codec::Role;
    use multirail_proto::MemType;
    use std::net::SocketAddr;

    const T: Duration = Duration::from_secs(5);

    /// Runs without UCX: the decision from what the contexts report and /sys/module.
    #[test]
    fn gpu_direct_needs_cuda_rdma_and_peermem() {
        let dir = std::env::temp_dir().join(format!("mr-sysmod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cuda = "# memory types: host, cuda\n#  md 3 : component cuda_cpy".to_string();
        let rdma = "NET_DEVICES=mlx5_0:1";
        let no_cuda = gpu_direct_check(&[("# md 0 : tcp".into(), rdma)], &dir).unwrap_err();
        assert!(no_cuda.contains("no CUDA transport"), "{no_cuda}");
        let tcp = gpu_direct_check(&[(cuda.clone(), rdma), (cuda.clone(), "NET_DEVICES=eth1 TLS=tcp")], &dir).unwrap_err();
        assert!(tcp.contains("rail 1 runs on UCX's tcp"), "{tcp}");
        let no_peermem = gpu_direct_check(&[(cuda.clone(), rdma)], &dir).unwrap_err();
        assert!(no_peermem.contains("nvidia_peermem"), "{no_peermem}");
        std::fs::create_dir_all(dir.join("nvidia_peermem")).unwrap();
        assert_eq!(gpu_direct_check(&[(cuda.clone(), rdma), (cuda, "NET_DEVICES=mlx5_1:1")], &dir), Ok(()));
        assert!(gpu_direct_check(&[], &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn agent(name: &str, transport: TransportKind) -> Agent {
        let cfg = Config { transport, timeout: T, ..Config::default() };
        match Agent::new(name, cfg) {
            Ok(a) => a,
            Err(e) => panic!("{name}: {e}"),
        }
    }

    fn rail_addr(a: &Agent) -> SocketAddr {
        let m = a.metadata();
        format!("{}:{}", m.rails[0].addr, m.rails[0].port).parse().unwrap()
    }

    fn try_open(init: &Agent, target: &Agent) -> Result<UcxRail> {
        let sh = init.shared();
        let (s, id) = dial_id(&sh.ctx, None, rail_addr(target), Role::UcxSession, Some((target.name(), target.incarnation())), T)?;
        UcxRail::open(sh.ucx.as_ref().expect("ucx agent"), 0, 0, s, id, T)
    }

    fn open(init: &Agent, target: &Agent) -> UcxRail {
        try_open(init, target).expect("open ucx rail")
    }

    /// Progress until `n` chunks are reported (or panic after 10 s).
    fn collect(rail: &UcxRail, n: usize) -> Vec<(u64, std::result::Result<(), String>)> {
        let mut done = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        while done.len() < n {
            assert!(Instant::now() < end, "only {} of {n} chunks done", done.len());
            rail.progress(&mut done, Duration::from_millis(50), Duration::from_secs(5)).expect("rail healthy");
        }
        done
    }

    fn pattern(seed: u8, n: usize) -> Vec<u8> {
        (0..n).map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(seed as u32) as u8 ^ seed).collect()
    }

    /// Chunks of varying lengths covering [0, total).
    fn chunks(total: usize) -> Vec<(usize, usize)> {
        let lens = [1usize, 13, 4096, 65536, 8191, 100_003, 2, 777, 32768, 250_000];
        let mut v = Vec::new();
        let (mut at, mut k) = (0, 0);
        while at < total {
            let n = lens[k % lens.len()].min(total - at);
            v.push((at, n));
            at += n;
            k += 1;
        }
        v
    }

    fn thread_cpu() -> Duration {
        // SAFETY: getrusage fills a zeroed struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
        let us = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) as u64 * 1_000_000 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) as u64;
        Duration::from_micros(us)
    }

    const MIB: usize = 1 << 20;

    #[test]
    #[ignore = "needs UCX"]
    fn ucx_reads_and_writes_land_exactly() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let target = agent("ucx-target", TransportKind::Ucx);
        eprintln!("UCX {}", init.shared().ucx.as_ref().unwrap().version());
        let ibuf = pattern(1, MIB);
        let tbuf = pattern(2, MIB);
        let (iorig, torig) = (ibuf.clone(), tbuf.clone());
        let ir = init.register(ibuf.as_ptr() as u64, MIB as u64, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let tr = target.register(tbuf.as_ptr() as u64, MIB as u64, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let rail = open(&init, &target);
        let ib = ibuf.as_ptr() as u64;
        // WRITE init[a..] -> target[a + 777..] for a in [0, 400000); READ target[c + 500000..]
        // -> init[c + 600000..] for c in [0, 300000), interleaved.
        let writes = chunks(400_000);
        let reads = chunks(300_000);
        let mut token = 0u64;
        for i in 0..writes.len().max(reads.len()) {
            if let Some(&(a, n)) = writes.get(i) {
                token += 1;
                rail.post(token, true, ib + a as u64, tr.id, a as u64 + 777, n as u64).unwrap();
            }
            if let Some(&(c, n)) = reads.get(i) {
                token += 1;
                rail.post(token, false, ib + 600_000 + c as u64, tr.id, 500_000 + c as u64, n as u64).unwrap();
            }
        }
        assert!(rail.outstanding() > 0);
        let done = collect(&rail, token as usize);
        assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
        let mut seen: Vec<u64> = done.iter().map(|d| d.0).collect();
        seen.sort_unstable();
        assert_eq!(seen, (1..=token).collect::<Vec<_>>());
        assert_eq!(rail.outstanding(), 0);
        assert_eq!(&tbuf[777..400_777], &iorig[..400_000], "written bytes");
        assert_eq!(&tbuf[..777], &torig[..777]);
        assert_eq!(&tbuf[400_777..], &torig[400_777..], "nothing past the writes");
        assert_eq!(&ibuf[600_000..900_000], &torig[500_000..800_000], "read bytes");
        assert_eq!(&ibuf[..600_000], &iorig[..600_000]);
        assert_eq!(&ibuf[900_000..], &iorig[900_000..]);
        let name = rail.transport_name();
        assert!(name.starts_with("ucx/") && name.contains("tcp"), "{name}");

        // Refusals, with a message, before UCX sees them.
        let e = rail.post(900, false, ib, tr.id, MIB as u64 - 10, 20).unwrap_err();
        assert!(e.contains("outside region"), "{e}");
        let e = rail.post(901, true, ib + MIB as u64 - 10, tr.id, 0, 20).unwrap_err();
        assert!(e.contains("not inside memory registered"), "{e}");
        let e = rail.post(902, true, ib, 12345, 0, 20).unwrap_err();
        assert!(e.contains("exports no region 12345"), "{e}");
        let e = rail.post(903, true, ib, tr.id, u64::MAX - 5, 20).unwrap_err();
        assert!(e.contains("outside region"), "{e}");
        assert_eq!(rail.outstanding(), 0);

        // A region the target registers after the session opened: its rkey is fetched.
        let late = pattern(3, 4096);
        let lr = target.register(late.as_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadWrite).unwrap();
        rail.post(1000, false, ib, lr.id, 100, 1000).unwrap();
        let done = collect(&rail, 1);
        assert_eq!(done, vec![(1000, Ok(()))]);
        assert_eq!(&ibuf[..1000], &late[100..1100]);
        rail.abort();
        rail.abort();
        assert!(rail.post(1001, false, ib, tr.id, 0, 8).is_err());
        drop(rail);
        drop((ir, tr, lr));
        let late_id = 2;
        target.deregister(late_id).unwrap();
        init.close();
        target.close();
    }

    /// Send a real `Fence` for `ids` over a control connection, as peer.rs does.
    fn send_fence(init: &Agent, target: &Agent, ids: Vec<[u8; 16]>) {
        let sh = init.shared();
        let (mut s, _) = dial_id(&sh.ctx, None, rail_addr(target), Role::Control, Some((target.name(), target.incarnation())), T).unwrap();
        let end = Instant::now() + T;
        let mut tick = |_: bool| if Instant::now() > end { Err("fence timed out".to_string()) } else { Ok(()) };
        wire::send(&mut s, &Body::Fence(ids), 0, &mut tick).unwrap();
        match wire::read_frame(&mut s, &mut tick).unwrap().1 {
            Body::Resp { status: Status::Ok, .. } => {}
            other => panic!("fence answered {other:?}"),
        }
    }

    #[test]
    #[ignore = "needs UCX"]
    fn ucx_fence_destroys_the_session_worker() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let target = agent("ucx-target", TransportKind::Ucx);
        let ibuf = pattern(4, 65536);
        let tbuf = vec![0u8; 65536];
        let _ir = init.register(ibuf.as_ptr() as u64, 65536, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let tr = target.register(tbuf.as_ptr() as u64, 65536, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let ib = ibuf.as_ptr() as u64;
        let old = open(&init, &target);
        old.post(1, true, ib, tr.id, 0, 4096).unwrap();
        assert_eq!(collect(&old, 1), vec![(1, Ok(()))]);
        assert_eq!(&tbuf[..4096], &ibuf[..4096]);
        let id = old.id();
        assert!(target.shared().served.lock().unwrap().contains_key(&id), "session registered for Fence");
        assert_eq!(target.shared().ucx.as_ref().unwrap().sessions(), 1);

        // The fence returns only once the session's worker is destroyed (and the session gone
        // from the fence table).
        let t0 = Instant::now();
        send_fence(&init, &target, vec![id]);
        eprintln!("fence took {:?}", t0.elapsed());
        assert_eq!(target.shared().ucx.as_ref().unwrap().sessions(), 0, "session worker alive after its fence");
        assert_eq!(target.shared().fenced.load(Ordering::Relaxed), 1);
        let t0 = Instant::now();
        while target.shared().served.lock().unwrap().contains_key(&id) {
            assert!(t0.elapsed() < Duration::from_secs(1), "session still served after its fence");
            std::thread::sleep(Duration::from_millis(1));
        }

        // The old rail learns it from the session socket at once.
        let t0 = Instant::now();
        let mut done = Vec::new();
        let err = loop {
            if let Err(e) = old.progress(&mut done, Duration::from_millis(50), Duration::from_secs(5)) {
                break e;
            }
            assert!(t0.elapsed() < Duration::from_secs(3), "fenced rail still healthy");
        };
        eprintln!("fenced rail: {err} after {:?}", t0.elapsed());
        assert!(old.post(2, true, ib, tr.id, 0, 8).is_err());
        old.abort();
        assert!(old.take_unfinished().is_empty());

        // A new session works.
        let new = open(&init, &target);
        new.post(3, true, ib + 4096, tr.id, 4096, 8192).unwrap();
        new.post(4, false, ib + 20000, tr.id, 0, 4096).unwrap();
        let mut got = collect(&new, 2);
        got.sort_by_key(|d| d.0);
        assert_eq!(got, vec![(3, Ok(())), (4, Ok(()))]);
        assert_eq!(&tbuf[4096..12288], &ibuf[4096..12288]);
        drop(new);
        drop(old);
        init.close();
        target.close();
    }

    #[test]
    #[ignore = "needs UCX"]
    fn ucx_target_closed_fails_the_rail_and_close_ends_sessions() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let target = agent("ucx-target", TransportKind::Ucx);
        let ibuf = vec![0u8; 65536];
        let tbuf = pattern(5, 65536);
        let _ir = init.register(ibuf.as_ptr() as u64, 65536, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let tr = target.register(tbuf.as_ptr() as u64, 65536, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let rail = open(&init, &target);
        let _second = open(&init, &target);
        rail.post(1, false, ibuf.as_ptr() as u64, tr.id, 0, 65536).unwrap();
        assert_eq!(collect(&rail, 1), vec![(1, Ok(()))]);
        assert_eq!(ibuf, tbuf);
        assert_eq!(target.shared().open_conns.load(Ordering::SeqCst), 2);
        let t0 = Instant::now();
        drop(tr);
        target.close();
        eprintln!("target close with 2 sessions took {:?}", t0.elapsed());
        assert_eq!(target.shared().open_conns.load(Ordering::SeqCst), 0, "sessions still running after close");
        assert_eq!(target.shared().ucx.as_ref().unwrap().sessions(), 0);
        assert!(t0.elapsed() < Duration::from_secs(2));
        let stall = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut done = Vec::new();
        let err = loop {
            if let Err(e) = rail.progress(&mut done, Duration::from_millis(50), stall) {
                break e;
            }
            assert!(t0.elapsed() < stall, "rail still healthy {:?} after its target closed", t0.elapsed());
        };
        eprintln!("after target close: {err} ({:?})", t0.elapsed());
        rail.abort();
        drop(target);
        init.close();
    }

    /// A target that answers the session, progresses its worker through the wire-up, then stops
    /// progressing (hung, sockets open): UCX reports nothing; the stall clock must.
    #[test]
    #[ignore = "needs UCX"]
    fn ucx_hung_target_fails_the_rail_within_the_stall_time() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let ucx = Ucx::load_with(&LoadOptions::from_env()).unwrap();
        let ctx = Context::new(&ucx, &ContextConfig::new().tls("tcp").net_devices("lo").wakeup(true)).unwrap();
        let tbuf = vec![0u8; 65536];
        // SAFETY: `tbuf` outlives the mapping (dropped at the end of the test).
        let tmap = unsafe { ctx.map(tbuf.as_ptr() as *mut u8, tbuf.len()) }.unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let hang = Arc::new(AtomicBool::new(false));
        let h2 = hang.clone();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut tick = |_: bool| Ok(());
            let Body::UcxOpen { .. } = wire::read_frame(&mut s, &mut tick).unwrap().1 else { panic!("no UcxOpen") };
            let w = Worker::new(&ctx, ThreadMode::Serialized).unwrap();
            let regions = vec![UcxRegion { id: 1, base: tmap.addr(), len: 65536, rkey: tmap.pack_rkey().unwrap().into_bytes() }];
            wire::send(&mut s, &Body::UcxReady { addr: w.address().unwrap().into_bytes(), regions }, 0, &mut tick).unwrap();
            while !h2.load(Ordering::Acquire) {
                let _ = w.wait_for_events(Duration::from_millis(10));
            }
            // Hung: no progress, socket and worker kept until told to go.
            while h2.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
            }
            drop((s, w, tmap));
        });
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let rail = UcxRail::open(init.shared().ucx.as_ref().unwrap(), 0, 0, s, [0; 16], T).unwrap();
        let ibuf = vec![0u8; 65536];
        let _ir = init.register(ibuf.as_ptr() as u64, 65536, 0, MemType::Dram, Access::ReadWrite).unwrap();
        rail.post(1, false, ibuf.as_ptr() as u64, 1, 0, 4096).unwrap();
        assert_eq!(collect(&rail, 1), vec![(1, Ok(()))]);
        hang.store(true, Ordering::Release);
        std::thread::sleep(Duration::from_millis(50));
        rail.post(2, false, ibuf.as_ptr() as u64, 1, 0, 65536).unwrap();
        rail.post(3, true, ibuf.as_ptr() as u64, 1, 0, 65536).unwrap();
        let stall = Duration::from_millis(500);
        let t0 = Instant::now();
        let mut done = Vec::new();
        let err = loop {
            if let Err(e) = rail.progress(&mut done, Duration::from_millis(50), stall) {
                break e;
            }
            assert!(t0.elapsed() < stall * 4, "hung target not detected");
        };
        eprintln!("hung target: {err} after {:?}; reported {done:?}", t0.elapsed());
        assert!(err.contains("no ucx completion"), "{err}");
        assert!(t0.elapsed() >= stall - Duration::from_millis(60));
        assert_eq!(rail.outstanding(), 2);
        rail.abort();
        let mut lost = rail.take_unfinished();
        lost.sort_unstable();
        assert_eq!(lost, vec![2, 3]);
        hang.store(false, Ordering::Release);
        drop(rail);
        fake.join().unwrap();
        init.close();
    }

    #[test]
    #[ignore = "needs UCX"]
    fn ucx_idle_rail_sleeps() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let target = agent("ucx-target", TransportKind::Ucx);
        let rail = open(&init, &target);
        let mut done = Vec::new();
        let (c0, t0) = (thread_cpu(), Instant::now());
        for _ in 0..20 {
            rail.progress(&mut done, Duration::from_millis(50), Duration::from_secs(5)).unwrap();
        }
        let (cpu, wall) = (thread_cpu() - c0, t0.elapsed());
        eprintln!("idle: 20 x progress(50 ms): wall {wall:?}, cpu {cpu:?}");
        assert!(done.is_empty());
        assert!(wall >= Duration::from_millis(950), "{wall:?}");
        assert!(cpu < Duration::from_millis(100), "idle progress burned {cpu:?}");
        // A post from another thread wakes the sleeping progress at once.
        let buf = vec![0u8; 4096];
        let tbuf = vec![7u8; 4096];
        let _r = init.register(buf.as_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let tr = target.register(tbuf.as_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let rail = Arc::new(rail);
        let r2 = rail.clone();
        let addr = buf.as_ptr() as u64;
        let id = tr.id;
        let poster = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            r2.post(1, false, addr, id, 0, 4096).unwrap();
        });
        let t0 = Instant::now();
        while done.is_empty() {
            rail.progress(&mut done, Duration::from_secs(2), Duration::from_secs(5)).unwrap();
            assert!(t0.elapsed() < Duration::from_secs(3));
        }
        poster.join().unwrap();
        eprintln!("posted-while-sleeping chunk done after {:?}", t0.elapsed());
        assert!(t0.elapsed() < Duration::from_millis(1000));
        assert_eq!(buf, tbuf);
        drop(rail);
        init.close();
        target.close();
    }

    #[test]
    #[ignore = "needs UCX"]
    fn ucx_session_refused_by_an_agent_without_ucx() {
        let init = agent("ucx-init", TransportKind::Ucx);
        let target = agent("tcp-target", TransportKind::Tcp);
        let e = try_open(&init, &target).err().expect("refused");
        assert!(e.to_string().contains("does not run the ucx transport"), "{e}");
        // A rail the target does not have.
        let ucx_target = agent("ucx-target", TransportKind::Ucx);
        let sh = init.shared();
        let (s, id) = dial_id(&sh.ctx, None, rail_addr(&ucx_target), Role::UcxSession, None, T).unwrap();
        let e = UcxRail::open(sh.ucx.as_ref().unwrap(), 0, 5, s, id, T).err().expect("refused");
        assert!(e.to_string().contains("no rail 5"), "{e}");
        assert_eq!(ucx_target.shared().ucx.as_ref().unwrap().sessions(), 0);
        ucx_target.close();
        init.close();
        target.close();
    }
}
