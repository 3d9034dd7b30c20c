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
//! checks the rkey and bounds, and each region is mapped with its access (`protection`): a
//! read-only region's rkey allows no RDMA WRITE, a local region none at all.
//!
//! Split by responsibility:
//! - this module: the agent-wide part, [`UcxAgent`] (UCX loaded once, one context per local
//!   rail, every registered region mapped in each);
//! - `initiator`: [`UcxRail`], one rail to one peer (worker, endpoint, rkeys, post/progress/abort);
//! - `target`: [`serve_session`], the target's worker per session;
//! - `rails`: [`UcxRails`], `UcxRail`s behind the engine's `Transport` trait (one per rail of a
//!   link, a progress thread each); the planner, not this module, requeues what a failed rail
//!   left unfinished (`take_unfinished` serves the tests).
//!
//! What UCX needs from the agent is passed in: the local rails and their metadata
//! (`UcxAgent::new`), regions (`map`/`unmap`), and for a served session the configuration, the
//! shutdown flag and the event log (`serve_session`).

mod initiator;
mod rails;
mod target;

pub(crate) use initiator::UcxRail;
pub(crate) use rails::UcxRails;
pub(crate) use target::{serve_session, AmCounters, Session, NO_SECRET};
#[cfg(test)]
pub(crate) use target::{set_reply_cap, MAX_REPLY_BYTES};

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use multirail_proto::codec::{UcxRegion, HEADER_LEN};
use multirail_proto::{Access, Body, RailInfo, RegionKey};
use multirail_ucx::{Context, ContextConfig, MemRegion, MemoryType, PackedRkey, Protection, Ucx};

use crate::error::{Error, Result};
use crate::net::LocalRail;
use crate::registry::Region;

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
    /// Its key: an active-message request must name it (checked in constant time).
    key: RegionKey,
    exported: bool,
    /// What a peer may do to it (the active-message path checks it on the target).
    access: Access,
    /// Host memory: the target may copy into and out of it itself (active messages).
    host: bool,
    /// None on rails without a UCX context (they run tcp).
    per_rail: Vec<Option<(MemRegion, Option<PackedRkey>)>>,
}

/// Region id -> mapping; shared with the rails (they find local memory handles in it).
type Maps = RwLock<HashMap<u64, Arc<Mapped>>>;

/// An eventfd that wakes a sleeper: a rail's progress thread when a chunk is posted or the rail
/// aborted (a PUT can complete locally inside the post, leaving no event on the worker's fd); a
/// session loop when its active-message handler left replies to send.
pub(super) struct Kick(OwnedFd);

impl Kick {
    pub(super) fn new() -> std::io::Result<Kick> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nobody else owns.
        Ok(Kick(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(super) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    pub(super) fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: 8 bytes from a live u64 to our eventfd (a full counter only means "kicked").
        unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    pub(super) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

fn find_local(maps: &Maps, rail: usize, addr: u64, len: u64) -> Option<(MemRegion, usize)> {
    let end = addr.checked_add(len)?;
    let g = maps.read().unwrap_or_else(PoisonError::into_inner);
    g.values()
        .find(|m| m.base <= addr && end <= m.base + m.len)
        .and_then(|m| m.per_rail.get(rail)?.as_ref().map(|(mr, _)| (mr.clone(), (addr - m.base) as usize)))
}

/// Per-agent UCX state: UCX loaded once; one UCP context (with WAKEUP) per local rail that runs
/// ucx (a rail chosen tcp has none, and refuses UCX sessions),
/// restricted to that rail (`NET_DEVICES` = its RDMA device:port, else its netdev with
/// `TLS=tcp`); UCX's own multi-rail splitting off (`MAX_RNDV_RAILS=1`, `MAX_EAGER_LANES=1`):
/// multirail stripes itself. Every registered region is `ucp_mem_map`ed once per rail context.
pub(crate) struct UcxAgent {
    ucx: Ucx,
    /// By local rail index; None where the rail runs tcp.
    rails: Vec<Option<RailCtx>>,
    maps: Arc<Maps>,
    /// Target-side session workers alive now.
    sessions: std::sync::atomic::AtomicUsize,
    /// Whether GPU memory can go over these rails directly (GPUDirect RDMA) and by which
    /// kernel support, or why not.
    gpu_direct: std::result::Result<String, String>,
    /// Devices whose GPUDirect writes are flushed before a notification is queued.
    gdr_flush: crate::gdr::GdrFlush,
    /// Tests only ([`with_standin_gpudirect`]): the stand-in GPU's memory (host memory
    /// underneath) counts as GPUDirect memory on any rail, UCX's tcp included. Always false
    /// outside `cargo test`.
    standin_direct: bool,
}

#[cfg(test)]
thread_local! {
    static STANDIN_GPUDIRECT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests only: the ucx agents made by `f` on this thread take the stand-in GPU's memory as
/// GPUDirect memory (`gpu_direct` holds, VRAM regions are mapped, the rails say "direct"), so
/// UCX's tcp transport really moves it by RMA: the direct data path runs without a GPU or an
/// RDMA NIC. The memory is mapped as host memory (it is), not declared as CUDA memory. Not
/// compiled outside `cargo test`: a build's own check (`gpu_direct_check`) is unchanged.
#[cfg(test)]
pub(crate) fn with_standin_gpudirect<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            STANDIN_GPUDIRECT.with(|c| c.set(false));
        }
    }
    STANDIN_GPUDIRECT.with(|c| c.set(true));
    let _reset = Reset;
    f()
}

impl UcxAgent {
    /// Contexts for the rails with `on[i]` (the others run tcp and get none).
    pub fn new(ucx: Ucx, rails: &[LocalRail], rail_meta: &[RailInfo], on: &[bool]) -> Result<UcxAgent> {
        let mut ctxs = Vec::with_capacity(rails.len());
        for (i, r) in rails.iter().enumerate() {
            if !on.get(i).copied().unwrap_or(false) {
                ctxs.push(None);
                continue;
            }
            let rdma = rail_meta.get(i).map(|m| m.rdma_dev.as_str()).unwrap_or("");
            let (cfg, devices) = rail_config(i, r, rdma);
            let ctx = Context::new(&ucx, &cfg)
                .map_err(|e| Error::Unavailable(format!("UCX context for rail {i} ({devices}) with {}: {e}", ucx.info())))?;
            ctxs.push(Some(RailCtx { ctx, devices }));
        }
        let infos: Vec<(String, &str)> =
            ctxs.iter().flatten().map(|r| (r.ctx.info_string().unwrap_or_default(), r.devices.as_str())).collect();
        let gpu_direct = gpu_direct_check(&infos, std::path::Path::new("/"));
        #[cfg(not(test))]
        let standin_direct = false;
        #[cfg(test)]
        let standin_direct = STANDIN_GPUDIRECT.with(|c| c.get());
        #[cfg(test)]
        let gpu_direct = if standin_direct { Ok("peermem (the stand-in's, tests only)".to_string()) } else { gpu_direct };
        Ok(UcxAgent {
            ucx,
            rails: ctxs,
            maps: Arc::new(RwLock::new(HashMap::new())),
            sessions: Default::default(),
            gpu_direct,
            gdr_flush: Default::default(),
            standin_direct,
        })
    }

    /// Tests only: the stand-in's memory counts as GPUDirect memory ([`with_standin_gpudirect`]).
    pub fn standin_direct(&self) -> bool {
        self.standin_direct
    }

    /// Ok when every rail can move GPU memory directly (module docs of `gpu_direct_check`),
    /// else why not.
    pub fn gpu_direct(&self) -> std::result::Result<(), &str> {
        self.gpu_direct.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// A VRAM region of `gpu` is about to be mapped for direct RMA (GPUDirect holds): refuses
    /// a device that cannot export dma-buf where only dma-buf gives GPUDirect, and remembers a
    /// device whose RDMA writes need flushing (`crate::gdr`).
    pub fn note_vram(&self, gpu: &multirail_gpu::Gpu) -> Result<()> {
        let kernel = self.gpu_direct.as_deref().map_err(|why| Error::Gpu(why.to_string()))?;
        self.gdr_flush.note_region(gpu, kernel).map(|_| ()).map_err(Error::Gpu)
    }

    /// Before a notification tells the application that writes landed: flush the GPUDirect
    /// writes of every device that does not order them (`crate::gdr`). Returns how many.
    pub fn flush_gdr_writes(&self) -> std::result::Result<usize, String> {
        self.gdr_flush.flush()
    }

    /// A READ by GPUDirect landed in local memory of GPU `dev`: flush its RDMA writes where the
    /// device does not order them (`crate::gdr`). Returns whether it flushed.
    pub fn flush_gdr_reads(&self, dev: u32) -> std::result::Result<bool, String> {
        let id = i32::try_from(dev).map_err(|_| format!("device id {dev} out of range"))?;
        self.gdr_flush.flush_device(id)
    }

    /// Rail `i`'s context, if it runs ucx.
    fn rail(&self, i: usize) -> Option<&RailCtx> {
        self.rails.get(i)?.as_ref()
    }

    /// Map a newly registered region in every rail context (and pack its rkey when exported).
    pub fn map(&self, region: &Region) -> Result<()> {
        let exported = region.access != Access::Local;
        let mut per_rail = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            let Some(r) = r else {
                per_rail.push(None);
                continue;
            };
            // The stand-in's "VRAM" is host memory: mapped as such (tests only).
            let mem_type = if self.standin_direct { MemoryType::Detect } else { memory_type(region.mem) };
            // SAFETY: the caller registered [base, base+len) with the agent and keeps it
            // allocated while registered; it is unmapped at deregistration, after the registry
            // saw no holder (a request still pending keeps its own mapping alive until done).
            let m = unsafe { r.ctx.map_typed(region.base as *mut u8, region.len as usize, protection(region.access), mem_type) }
                .map_err(|e| Error::InvalidArgument(format!("UCX cannot map region {} on rail {i} ({}): {e}", region.id, r.devices)))?;
            let packed =
                if exported {
                    Some(m.pack_rkey().map_err(|e| {
                        Error::InvalidArgument(format!("UCX cannot pack the rkey of region {} on rail {i}: {e}", region.id))
                    })?)
                } else {
                    None
                };
            per_rail.push(Some((m, packed)));
        }
        let host = region.mem == multirail_proto::MemType::Dram;
        let mapped =
            Arc::new(Mapped { base: region.base, len: region.len, key: region.key, exported, access: region.access, host, per_rail });
        self.maps.write().unwrap_or_else(PoisonError::into_inner).insert(region.id, mapped);
        Ok(())
    }

    /// Drop a deregistered region's mappings (each is unmapped once no pending request uses it).
    /// Hold region `id`'s mapping as an active-message request does while it uses the region
    /// (tests of `unmap`'s wait).
    #[cfg(test)]
    pub(crate) fn hold(&self, id: u64) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        let m = self.maps.read().unwrap_or_else(PoisonError::into_inner).get(&id).cloned()?;
        Some(Box::new(m))
    }

    /// Forget a region: no new request of any session finds it. Returns once no active-message
    /// request uses it any more (a WRITE being scattered into it, a READ reply still being sent
    /// from it; they hold its `Mapped`), or `Err` after `wait` with the region forgotten all the
    /// same. UCX's own RMA over tcp is not covered (docs/ucx.md, "Trust").
    pub fn unmap(&self, region_id: u64, wait: std::time::Duration) -> std::result::Result<(), String> {
        let Some(m) = self.maps.write().unwrap_or_else(PoisonError::into_inner).remove(&region_id) else { return Ok(()) };
        let deadline = std::time::Instant::now() + wait;
        while Arc::strong_count(&m) > 1 {
            if std::time::Instant::now() >= deadline {
                return Err(format!("an active-message request of a ucx session still used it after {wait:?}"));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    #[cfg(test)]
    /// The access region `id` is mapped with on rail `rail` (`protection`).
    pub(crate) fn protection_of(&self, id: u64, rail: usize) -> Option<Protection> {
        let g = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        Some(g.get(&id)?.per_rail.get(rail)?.as_ref()?.0.protection())
    }

    #[cfg(test)]
    /// Target-side session workers alive now (a fenced or closed session's worker is gone).
    pub fn sessions(&self) -> usize {
        self.sessions.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// e.g. "1.22.0 (libucx wheel /path/libucp.so.0)".
    pub fn version(&self) -> String {
        let i = self.ucx.info();
        format!("{} ({} {})", i.version, i.source, i.path.display())
    }

    /// The library and each rail's restriction, for the start-up log.
    pub fn describe(&self) -> String {
        let rails: Vec<String> =
            self.rails.iter().enumerate().filter_map(|(i, r)| r.as_ref().map(|r| format!("rail {i}: {}", r.devices))).collect();
        format!("{}; {}", self.ucx.info(), rails.join("; "))
    }

    /// Exported regions with their rkeys packed in `rail`'s context (all, or those in `ids`).
    fn ready_regions(&self, rail: usize, ids: Option<&[u64]>) -> Vec<UcxRegion> {
        let g = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let one = |id: u64, m: &Mapped| -> Option<UcxRegion> {
            if !m.exported {
                return None;
            }
            let packed = m.per_rail.get(rail)?.as_ref()?.1.as_ref()?;
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

/// MAC labels of a session's `UcxOpen` and `UcxReady` (docs/PROTOCOL.md, "UCX sessions").
const OPEN_LABEL: &[u8] = b"multirail-ucx-open-v1";
const READY_LABEL: &[u8] = b"multirail-ucx-ready-v1";

/// `body` (a `UcxOpen` or `UcxReady`) with `mac` in its MAC field.
fn with_mac(body: Body, mac: Option<[u8; 32]>) -> Body {
    match body {
        Body::UcxOpen { rail, addr, features, .. } => Body::UcxOpen { rail, addr, features, mac },
        Body::UcxReady { addr, regions, features, .. } => Body::UcxReady { addr, regions, features, mac },
        other => other,
    }
}

/// The MAC of a `UcxOpen`/`UcxReady` body: `auth::session_mac` over its encoding with a zero
/// MAC (canonical: what the receiver decodes re-encodes to the same bytes), its kind's label
/// and `seq` (its place in the session: `UcxReady` 0 answers `UcxOpen` 0, the n-th `UcxRkeys`
/// answer is `UcxReady` n).
fn mac_of(key: &[u8; 32], seq: u64, body: &Body) -> [u8; 32] {
    let label = if matches!(body, Body::UcxOpen { .. }) { OPEN_LABEL } else { READY_LABEL };
    let bytes = with_mac(body.clone(), Some([0; 32])).encode(0);
    crate::auth::session_mac(key, label, seq, &bytes[HEADER_LEN..])
}

/// `body` with its MAC.
pub(crate) fn seal(key: &[u8; 32], seq: u64, body: Body) -> Body {
    let mac = mac_of(key, seq, &body);
    with_mac(body, Some(mac))
}

/// Whether `body` carries the MAC `seal` gives it (constant-time compare); false without one.
fn sealed(key: &[u8; 32], seq: u64, body: &Body) -> bool {
    let mac = match body {
        Body::UcxOpen { mac: Some(m), .. } | Body::UcxReady { mac: Some(m), .. } => m,
        _ => return false,
    };
    crate::auth::bytes_equal(mac, &mac_of(key, seq, body))
}

/// Default of [`ENV_MAX_SESSIONS`].
pub(crate) const DEFAULT_MAX_SESSIONS: usize = 256;
/// Most UCX session workers the agents of this process serve at once (each holds its own UCX
/// worker: endpoints, queues, memory; on RDMA, QPs and CQs of the HCA).
pub(crate) const ENV_MAX_SESSIONS: &str = "MULTIRAIL_UCX_MAX_SESSIONS";

/// Session workers alive in this process (all agents).
static SESSION_WORKERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One of the process's session-worker slots, released on drop.
struct SessionSlot(&'static std::sync::atomic::AtomicUsize);

impl SessionSlot {
    /// A slot, or why not (the cap and the setting that raises it).
    fn take() -> std::result::Result<SessionSlot, String> {
        let max = std::env::var(ENV_MAX_SESSIONS).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_MAX_SESSIONS);
        Self::take_in(&SESSION_WORKERS, max)
    }

    fn take_in(count: &'static std::sync::atomic::AtomicUsize, max: usize) -> std::result::Result<SessionSlot, String> {
        let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n >= max {
            count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            return Err(format!(
                "this process serves {n} UCX sessions already, its cap ({ENV_MAX_SESSIONS}={max}): refused; raise \
                 {ENV_MAX_SESSIONS} if that many peers are expected"
            ));
        }
        Ok(SessionSlot(count))
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What a region's rkey allows peers (`ucp_mem_map`'s `prot`): a read-only region is mapped
/// without remote write, a local one without any remote access (issue 33, item 4). The HCA
/// enforces it over RDMA; UCX's tcp transport does not (docs/ucx.md, "Trust").
pub(crate) fn protection(access: Access) -> Protection {
    match access {
        Access::Local => Protection::LocalOnly,
        Access::ReadOnly => Protection::RemoteRead,
        Access::ReadWrite => Protection::RemoteReadWrite,
    }
}

/// What a region is declared as to `ucp_mem_map` (issue 35, item 7a): device memory as CUDA
/// memory, so UCX registers it with the domains that take it (GPUDirect by peermem or dma-buf)
/// rather than guessing from the address; host memory is left to UCX's detection.
pub(crate) fn memory_type(mem: multirail_proto::MemType) -> MemoryType {
    match mem {
        multirail_proto::MemType::Vram => MemoryType::Cuda,
        multirail_proto::MemType::Dram => MemoryType::Detect,
    }
}

/// The UCX context configuration of one rail, and a description of its restriction.
///
/// Besides the restriction and UCX's own striping off, three settings for UCX's tcp transport
/// (measured in docs/benchmarks.md, "Issue 22: kv over ucx (session 9)"):
/// - `RNDV_THRESH=inf` (rendezvous off). Our endpoints ask for peer-failure error handling, and
///   while rendezvous is enabled UCX then wants memory invalidation (`UCT_MD_FLAG_INVALIDATE_RMA`)
///   on its bandwidth lanes; tcp has none, so every `ucp_put` over tcp ran as software emulation
///   (an active message per put, or per 8 KiB fragment of a bigger put, each answered by a UCP
///   completion message: two `send`s per fragment). With rendezvous off, puts are tcp's own
///   put_zcopy: one `sendmsg` per put from the user's memory, the data received straight into
///   the target's, and acknowledgements that merge when the target is busy
///   (`UCX_PROTO_INFO=y` prints "zero-copy" instead of "software emulation").
/// - `TCP_TX_SEG_SIZE=32K`, `TCP_RX_SEG_SIZE=64K` (UCX's defaults: 8K and 64K). What still goes
///   as active messages (a get's reply over tcp) is cut into fragments of the send segment:
///   an 8 KiB page plus its header took two, now one, and a large reply a quarter as many. A
///   peer's send segment must fit our receive segment (UCX's default 64K: a peer with defaults
///   and one with these settings talk both ways).
///
/// The contexts also request `UCP_FEATURE_AM` (the vectored active-message path,
/// `UCX_FEATURE_AM`); every active message we send asks for the eager protocol
/// (`UCP_AM_SEND_FLAG_EAGER`), and the threshold keeps rendezvous off as well.
///
/// Why these are safe for RDMA rails too: rendezvous is a protocol of tagged, stream and
/// active-message sends; we send no tagged or stream messages and our active messages are eager,
/// so no rendezvous ever runs and no rendezvous buffer exists to invalidate; `ucp_put`/`ucp_get` over
/// rc/dc use their registered-memory RMA protocols whatever the threshold. The memory they
/// touch is the agent's own mapping, which stays mapped, and a dead rail's late PUTs are stopped
/// by the fence (the target destroys the session's worker), not by UCX invalidation. The
/// `TCP_*` settings configure only UCX's tcp transport, which an RDMA rail does not use
/// (`NET_DEVICES` names the HCA port).
fn rail_config(i: usize, r: &LocalRail, rdma_dev: &str) -> (ContextConfig, String) {
    let cfg = ContextConfig::new()
        .wakeup(true)
        .name(format!("multirail-rail{i}"))
        .set("MAX_RNDV_RAILS", "1")
        .set("MAX_EAGER_LANES", "1")
        .set("RNDV_THRESH", "inf")
        .set("TCP_TX_SEG_SIZE", "32K")
        .set("TCP_RX_SEG_SIZE", "64K")
        .active_messages(true);
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
/// 1. a UCX with CUDA support that found a GPU driver: its context lists the `cuda_cpy` memory
///    domain component (`ucp_context_print_info`), without which UCX cannot tell or reach CUDA
///    memory;
/// 2. on each rail, a transport that does RMA from and into registered memory over an RDMA
///    device (`rc_*`, `dc_*`, EFA's `srd*`), as the context's resources list them: a rail over
///    UCX's tcp, or whose `UCX_TLS` leaves only `ud` (RMA emulated by active messages), stages
///    CUDA memory through host bounce buffers inside UCX: "direct" would be false (issue 35,
///    item 7c);
/// 3. the kernel's GPUDirect RDMA support, peermem or dma-buf ([`gdr_kernel_support`]).
///
/// When it holds, GPU regions are `ucp_mem_map`ped declared as CUDA memory ([`memory_type`])
/// and GPU transfers go over the ucx rails as they are ("direct"). Not verified on hardware here.
/// `rails`: each rail context's `ucp_context_print_info` and its device restriction; `root`:
/// where /sys and /proc are (`/`, or a test's tree).
fn gpu_direct_check(rails: &[(String, &str)], root: &std::path::Path) -> std::result::Result<String, String> {
    if rails.is_empty() {
        return Err("no rails".into());
    }
    for (i, (info, devices)) in rails.iter().enumerate() {
        if !has_cuda_domain(info) {
            return Err(format!("the loaded UCX has no CUDA transport on rail {i} (UCX built without CUDA, or no GPU driver)"));
        }
        if devices.contains("TLS=tcp") {
            return Err(format!("rail {i} runs on UCX's tcp ({devices}): GPUDirect needs an RDMA device"));
        }
        let tls = rail_transports(info);
        if !tls.iter().any(|t| rma_capable(t)) {
            return Err(format!(
                "rail {i} ({devices}) has no UCX transport that does RMA into GPU memory (its transports: {}; rc, dc or \
                 srd needed, check UCX_TLS): UCX would stage GPU memory through host buffers",
                if tls.is_empty() { "none".to_string() } else { tls.join(", ") }
            ));
        }
    }
    gdr_kernel_support(root).map_err(|why| format!("GPUDirect RDMA kernel support is missing: {why}"))
}

/// Whether a context's `ucp_context_print_info` lists the CUDA copy memory domain
/// (`#  component 5  :  cuda_cpy`).
fn has_cuda_domain(info: &str) -> bool {
    info.lines().any(|l| l.contains("component") && (l.contains("cuda_cpy") || l.contains("cuda_copy")))
}

/// The transports (`rc_mlx5`, `tcp`, ...) a context's `ucp_context_print_info` lists, from its
/// `#  resource 0  :  md 0  dev 0  flags -- tcp/lo` lines.
fn rail_transports(info: &str) -> Vec<String> {
    let mut out: Vec<String> = info
        .lines()
        .filter(|l| l.contains("resource") && l.contains(" md "))
        .filter_map(|l| l.split_whitespace().last()?.split('/').next().map(str::to_string))
        .collect();
    out.dedup();
    out
}

/// A UCX transport that does one-sided RMA over an RDMA device (what can put into and get from
/// registered GPU memory without staging).
fn rma_capable(tl: &str) -> bool {
    ["rc_", "dc_", "srd"].iter().any(|p| tl.starts_with(p))
}

/// Kernel modules that let an RDMA NIC register GPU memory as peer memory (the last: the AWS
/// EFA installer's), and the peer-memory clients UCX and NCCL look for.
const PEERMEM_MODULES: [&str; 3] = ["nvidia_peermem", "nv_peer_mem", "efa_nv_peermem"];
const PEER_CLIENTS: [&str; 2] = ["nv_mem", "nv_mem_nc"];

/// How this host's kernel lets an RDMA NIC register GPU memory (issue 35, item 7b), from the
/// tree at `root` (`/` on a host): `Ok(evidence)` or `Err(why not)`.
/// - peermem: a [`PEERMEM_MODULES`] module loaded (`/sys/module/<m>`), or a peer-memory client
///   registered (`/sys/kernel/mm/memory_peers/<c>/version`, as UCX checks);
/// - dma-buf: the open NVIDIA kernel module (`/proc/driver/nvidia/version` says "Open Kernel
///   Module") on Linux >= 5.12. Per device the driver has the last word
///   (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`, asked where a VRAM region is registered).
///
/// `multirail doctor` decides the same way (python/multirail/doctor_topology.py,
/// `gpudirect_support`).
fn gdr_kernel_support(root: &std::path::Path) -> std::result::Result<String, String> {
    if let Some(m) = PEERMEM_MODULES.iter().find(|m| root.join("sys/module").join(m).exists()) {
        return Ok(format!("peermem ({m} loaded)"));
    }
    if let Some(c) = PEER_CLIENTS.iter().find(|c| root.join("sys/kernel/mm/memory_peers").join(c).join("version").exists()) {
        return Ok(format!("peermem (the {c} peer-memory client)"));
    }
    let version = std::fs::read_to_string(root.join("proc/driver/nvidia/version")).unwrap_or_default();
    let release = std::fs::read_to_string(root.join("proc/sys/kernel/osrelease")).unwrap_or_default();
    let release = release.trim();
    let open = version.contains("Open Kernel Module");
    if open && kernel_at_least(release, (5, 12)) {
        return Ok(format!("dma-buf (the open NVIDIA kernel module on Linux {release})"));
    }
    let why = if open {
        format!("the open NVIDIA kernel module, but Linux {release} is older than 5.12 (dma-buf RDMA)")
    } else if !version.is_empty() {
        "the proprietary NVIDIA kernel module has no dma-buf".to_string()
    } else {
        "no /proc/driver/nvidia/version".to_string()
    };
    Err(format!("none of {} is loaded and dma-buf is not available ({why}); `modprobe nvidia_peermem`", PEERMEM_MODULES.join(", ")))
}

/// `release` ("6.8.0-45-generic") is at least `want` (major, minor).
fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut it = release.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).map(str::parse::<u32>);
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) => (a, b) >= want,
        _ => false,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs without UCX: the decision from what the contexts report and /sys/module.
    /// Issue 33, item 5: session workers are capped per process, the refusal naming the setting.
    #[test]
    fn session_workers_are_capped() {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let a = SessionSlot::take_in(&COUNT, 2).unwrap();
        let b = SessionSlot::take_in(&COUNT, 2).unwrap();
        let e = SessionSlot::take_in(&COUNT, 2).err().expect("over the cap");
        assert!(e.contains(ENV_MAX_SESSIONS) && e.contains("=2"), "{e}");
        drop(a);
        let _c = SessionSlot::take_in(&COUNT, 2).expect("a slot came free");
        drop(b);
        assert_eq!(COUNT.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// Issue 33, item 2: `UcxOpen`/`UcxReady` carry a MAC keyed by the session: a changed byte,
    /// another key, another place in the session, another kind or no MAC at all fail.
    #[test]
    fn session_messages_are_sealed() {
        let key = crate::auth::session_key(b"s", &[1; 16], &[2; 16]);
        let open = seal(&key, 0, Body::UcxOpen { rail: 0, addr: vec![5; 300], features: 1, mac: None });
        assert!(sealed(&key, 0, &open));
        assert!(!sealed(&key, 1, &open), "another place");
        assert!(!sealed(&crate::auth::session_key(b"s", &[1; 16], &[3; 16]), 0, &open), "another session");
        let Body::UcxOpen { rail, mut addr, features, mac } = open.clone() else { panic!() };
        addr[7] ^= 1;
        assert!(!sealed(&key, 0, &Body::UcxOpen { rail, addr, features, mac }), "a changed address");
        assert!(!sealed(&key, 0, &with_mac(open.clone(), None)), "no MAC");
        let ready = seal(&key, 0, Body::UcxReady { addr: vec![5; 300], regions: vec![], features: 1, mac: None });
        assert!(sealed(&key, 0, &ready));
        let Body::UcxOpen { mac, .. } = open else { panic!() };
        assert!(!sealed(&key, 0, &with_mac(ready, mac)), "an open's MAC on a ready");
    }

    /// Runs without UCX: what each access maps to (enforced by the HCA over RDMA only; the
    /// hardware check is `ucx_tests::ucx_put_into_a_read_only_region_fails_on_rdma`).
    #[test]
    fn regions_are_mapped_with_their_access() {
        assert_eq!(protection(Access::ReadOnly), Protection::RemoteRead);
        assert_eq!(protection(Access::Local), Protection::LocalOnly);
        assert_eq!(protection(Access::ReadWrite), Protection::RemoteReadWrite);
    }

    /// Issue 35, item 7a: VRAM regions are mapped declared as CUDA memory.
    #[test]
    fn vram_regions_are_mapped_as_cuda_memory() {
        assert_eq!(memory_type(multirail_proto::MemType::Vram), MemoryType::Cuda);
        assert_eq!(memory_type(multirail_proto::MemType::Dram), MemoryType::Detect);
    }

    /// A `ucp_context_print_info` of a rail: the CUDA copy domain or not, and these transports.
    fn info(cuda: bool, tls: &[&str]) -> String {
        let mut s = String::from("#     component 0  :  self\n#     component 1  :  ib\n");
        if cuda {
            s += "#     component 2  :  cuda_cpy\n#            md 1  :  component 2  cuda_cpy\n";
        }
        s += "#            md 0  :  component 1  mlx5_0\n";
        for (i, t) in tls.iter().enumerate() {
            s += &format!("#      resource {i}  :  md 0  dev 0  flags -- {t}/mlx5_0:1\n");
        }
        s
    }

    #[test]
    fn gpu_direct_needs_cuda_rdma_and_peermem() {
        let dir = std::env::temp_dir().join(format!("mr-gdr-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sys/module")).unwrap();
        let cuda = info(true, &["rc_mlx5", "ud_mlx5"]);
        let rdma = "NET_DEVICES=mlx5_0:1";
        let no_cuda = gpu_direct_check(&[(info(false, &["rc_mlx5"]), rdma)], &dir).unwrap_err();
        assert!(no_cuda.contains("no CUDA transport"), "{no_cuda}");
        let tcp = gpu_direct_check(&[(cuda.clone(), rdma), (cuda.clone(), "NET_DEVICES=eth1 TLS=tcp")], &dir).unwrap_err();
        assert!(tcp.contains("rail 1 runs on UCX's tcp"), "{tcp}");
        let no_peermem = gpu_direct_check(&[(cuda.clone(), rdma)], &dir).unwrap_err();
        assert!(no_peermem.contains("nvidia_peermem"), "{no_peermem}");
        std::fs::create_dir_all(dir.join("sys/module/nvidia_peermem")).unwrap();
        let ok = gpu_direct_check(&[(cuda.clone(), rdma), (info(true, &["dc_mlx5"]), "NET_DEVICES=mlx5_1:1")], &dir);
        assert!(ok.as_ref().is_ok_and(|w| w.contains("peermem")), "{ok:?}");
        assert!(gpu_direct_check(&[], &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue 35, item 7c: "direct" needs a transport on the rail that does RMA into GPU memory.
    /// A UCX that lists its CUDA domain (main looked only for the word "cuda" in its info) but runs
    /// the rail on `ud` only (UCX_TLS=ud,cuda_copy) emulates RMA and stages: not direct.
    #[test]
    fn gpu_direct_needs_an_rma_transport_on_the_rail() {
        let dir = std::env::temp_dir().join(format!("mr-gdr-rma-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sys/module/nvidia_peermem")).unwrap();
        let ud_only = gpu_direct_check(&[(info(true, &["ud_mlx5", "ud_verbs"]), "NET_DEVICES=mlx5_0:1")], &dir).unwrap_err();
        assert!(ud_only.contains("no UCX transport that does RMA") && ud_only.contains("ud_mlx5, ud_verbs"), "{ud_only}");
        assert!(gpu_direct_check(&[(info(true, &["rc_verbs"]), "NET_DEVICES=mlx5_0:1")], &dir).is_ok());
        assert_eq!(rail_transports("#      resource 0  :  md 0  dev 0  flags -- tcp/lo\n"), vec!["tcp".to_string()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue 35, item 7b: dma-buf counts where there is no peermem: the open kernel module on
    /// Linux >= 5.12; the proprietary one or an older kernel do not. The peer-memory client's
    /// sysfs entry and AWS's efa_nv_peermem count as peermem.
    #[test]
    fn gpu_direct_kernel_support_counts_dma_buf() {
        let dir = std::env::temp_dir().join(format!("mr-gdr-kern-{}", std::process::id()));
        let put = |rel: &str, text: &str| {
            let p = dir.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        std::fs::create_dir_all(&dir).unwrap();
        assert!(gdr_kernel_support(&dir).unwrap_err().contains("no /proc/driver/nvidia/version"));
        put("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n");
        put("proc/sys/kernel/osrelease", "6.8.0-45-generic\n");
        assert!(gdr_kernel_support(&dir).unwrap_err().contains("proprietary"));
        put("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15\n");
        assert_eq!(gdr_kernel_support(&dir), Ok("dma-buf (the open NVIDIA kernel module on Linux 6.8.0-45-generic)".into()));
        put("proc/sys/kernel/osrelease", "5.4.0-150-generic\n");
        assert!(gdr_kernel_support(&dir).unwrap_err().contains("older than 5.12"));
        put("sys/kernel/mm/memory_peers/nv_mem/version", "1.3\n");
        assert!(gdr_kernel_support(&dir).unwrap().contains("nv_mem"));
        std::fs::create_dir_all(dir.join("sys/module/efa_nv_peermem")).unwrap();
        assert!(gdr_kernel_support(&dir).unwrap().contains("efa_nv_peermem"));
        assert!(kernel_at_least("5.12", (5, 12)) && !kernel_at_least("4.19.0", (5, 12)) && !kernel_at_least("", (5, 12)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
