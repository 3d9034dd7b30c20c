//! CUDA IPC between two agents on one host (issue 10): a transfer whose remote side is GPU
//! memory of a peer on this host is one device copy (D2D, or H2D/D2H for host memory on our
//! side) into the peer's allocation, mapped with its IPC handle; no bounce, no socket.
//!
//! - **Handles** travel on the authenticated control connection (`IpcReq` → `IpcHandles`),
//!   never in published metadata. The target answers only a peer with its own host id (the
//!   kernel's boot id), only for exported read-write GPU regions whose key matches, and only
//!   when `gpu_ipc` is on (the default). An IPC handle maps the whole allocation that contains
//!   the region (PyTorch's caching allocator hands out offsets into larger blocks), so the
//!   answer carries the region's offset in it; docs/SECURITY.md says what that exposes.
//! - **Device** by UUID: the answer names the exporter's device UUID, and the handle is opened
//!   on the local device with that UUID (ordinals differ between processes with different
//!   `CUDA_VISIBLE_DEVICES`); no local device with it is a fallback reason naming the UUID.
//! - **Mapping** happens once per (peer, region), at the first transfer that names it, and is
//!   kept until the peer revokes it, or is closed or replaced. If anything fails (another host,
//!   IPC off, the driver refusing, CUDA not opening handles of its own process) the reason is
//!   kept and the transfer is staged over the rails instead.
//! - **Revocation** (a mapping never outlives the exporter's memory): before its first
//!   `IpcReq` the initiator opens a `Role::IpcWatch` connection and names it in every
//!   `IpcReq`; the target refuses an `IpcReq` without a live one of the same peer and records
//!   which watch connections were handed which regions ([`Exports`]). Deregistering a region
//!   pushes `IpcRevoke` on each of them and returns only once each answered `IpcReleased` (the
//!   initiator took the worker's `copying` lock, so no copy runs, closed the mapping and
//!   forgot it) or its connection closed (the initiator closes its mappings before it closes
//!   the connection, and drops all of them when it sees the connection end), bounded by the
//!   agent's `timeout`: a peer that did not answer in time is named in the error, and its
//!   watch connection is aborted. Transfers prepared against a revoked mapping fail with
//!   `UnknownRegion` instead of copying; a new transfer asks again and is refused (then
//!   staged, and refused by the target for the region it no longer has).
//! - **Copies** are queued by one worker thread per peer, on its own stream per device: all of
//!   a transfer's copies, then an event of its own. The worker goes on to the next transfer at
//!   once; a second thread (the completer) waits for each event in order, then completes the
//!   transfer, or hands it to the link's notifier, which sends the notifications queued
//!   meanwhile pipelined (`Link::control_batch`) and completes each once the peer has it. So
//!   the copies of transfer k+1 run while transfer k's notification crosses to the peer.
//!   [`InFlight`] counts transfers queued on the device and not yet waited for: `cancel`,
//!   `close` and a revocation take the worker's `copying` lock (nothing new is queued) and wait
//!   until it is zero, so once they return no copy touches the application's memory or a
//!   closed mapping.

use std::collections::{HashMap, HashSet};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use multirail_gpu::{uuid_string, CopyKind, Device, DevicePtr, Gpu, GpuEvent, GpuStream, IpcHandle};
use multirail_proto::codec::{IpcEntry, RemoteOp, Role, MAX_IPC_REGIONS, MAX_IPC_REVOKE};
use multirail_proto::{Body, Kind, MemType, RegionKey, Status};

use crate::error::{Error, Result};
use crate::ipc_fd::FetchError;
use crate::link::{Keys, Link};
use crate::net::abort_socket;
use crate::wire::{self, WireError};
use crate::xfer::{IpcPlan, Op, XferShared, XferState};

/// This host's identity for IPC: the kernel's boot id (shared by every process and network
/// namespace of this boot), else a hash of the host name.
pub fn host_id() -> [u8; 16] {
    static ID: OnceLock<[u8; 16]> = OnceLock::new();
    *ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let hex: Vec<u8> = boot.trim().bytes().filter(u8::is_ascii_hexdigit).collect();
        if hex.len() == 32 {
            let mut id = [0u8; 16];
            for (i, pair) in hex.chunks(2).enumerate() {
                id[i] = u8::from_str_radix(std::str::from_utf8(pair).unwrap_or("0"), 16).unwrap_or(0);
            }
            return id;
        }
        use sha2::Digest;
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let d = sha2::Sha256::digest(name.trim().as_bytes());
        d[..16].try_into().expect("16 bytes")
    })
}

fn refuse(status: Status, msg: String) -> Body {
    Body::Resp { status, bulk_len: 0, msg }
}

/// The target's answer to `IpcReq` from `peer` (module docs): the agent's config, registry and
/// IPC exports are passed in (this module sits below the server).
pub(crate) fn answer(
    cfg: &crate::config::Config,
    registry: &crate::registry::Registry,
    exports: &Exports,
    peer: &str,
    host: [u8; 16],
    watch: [u8; 16],
    regions: &[(u64, RegionKey)],
) -> Body {
    if !cfg.staging.ipc {
        return refuse(Status::Unexpected, "CUDA IPC is off on this agent (gpu_ipc=False)".into());
    }
    if host != host_id() {
        return refuse(Status::Unexpected, "not on this host: CUDA IPC needs both agents on one host".into());
    }
    if !exports.watching(&watch, peer) {
        return refuse(
            Status::Unexpected,
            "no IpcWatch connection of this peer with that id: handles are given only to a peer that can be told to close them".into(),
        );
    }
    let mut held = Vec::with_capacity(regions.len().min(MAX_IPC_REGIONS));
    let mut out = Vec::with_capacity(regions.len().min(MAX_IPC_REGIONS));
    for &(region, key) in regions {
        // The same checks as a WRITE: an IPC mapping is writable, so read-only regions are
        // never handed out.
        let r = match registry.check_remote(&RemoteOp { region, key, offset: 0, len: 0 }, true) {
            Ok(r) => r,
            Err((status, msg)) => return refuse(status, msg),
        };
        if r.mem != MemType::Vram {
            return refuse(Status::Unexpected, format!("region {region} is not GPU memory"));
        }
        match export(cfg.staging.gpu, &r) {
            Ok(e) => out.push(e),
            Err(m) => return refuse(Status::Unexpected, format!("no IPC handle for region {region}: {m}")),
        }
        held.push(r);
    }
    // VMM regions: a token each for their chunks' fds (`ipc_fd`), only now that every region
    // is answered.
    let owner = exports.owner();
    let mut entries = Vec::with_capacity(out.len());
    for (mut e, vmm) in out {
        if let Some((gpu, chunks)) = vmm {
            match crate::ipc_fd::offer(owner, e.region, gpu, chunks, cfg.timeout) {
                Ok(h) => e.handle = h,
                Err(m) => {
                    crate::ipc_fd::withdraw(owner, Some(&held.iter().map(|r| r.id).collect::<Vec<_>>()));
                    return refuse(Status::Unexpected, format!("no IPC handle for region {}: {m}", e.region));
                }
            }
        }
        entries.push(e);
    }
    // Recorded while the regions are held: a deregistration waits for `held` to go, and then
    // finds this watch connection among the holders.
    if !exports.handed(&watch, entries.iter().map(|e| e.region)) {
        crate::ipc_fd::withdraw(owner, Some(&held.iter().map(|r| r.id).collect::<Vec<_>>()));
        return refuse(Status::Unexpected, "the IpcWatch connection closed, or this agent is closing".into());
    }
    drop(held);
    Body::IpcHandles(entries)
}

/// Only a region that is its whole allocation goes out by IPC (issue 33, item 4): a handle maps
/// the **whole** allocation read-write, so a region inside a larger block (PyTorch's caching
/// allocator) would hand the peer its neighbours too, read-only and local regions included.
/// Such a region is refused here and the initiator stages it over the rails instead.
fn owns_allocation(r: &crate::registry::Region, alloc_base: u64, alloc_len: u64) -> std::result::Result<(), String> {
    if r.base == alloc_base && r.len == alloc_len {
        return Ok(());
    }
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let msg = format!(
        "region {} ({:#x} + {}) is part of a larger GPU allocation ({alloc_base:#x} + {alloc_len}): an IPC handle would map \
         the whole allocation, so it is not exported by IPC (staged instead); register whole allocations to use CUDA IPC",
        r.id, r.base, r.len
    );
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!("multirail: warning: {msg} (said once per process)");
    }
    Err(msg)
}

/// A VMM region's device and chunks, offered once the answer is complete (`ipc_fd::offer`).
type VmmExport = Option<(Gpu, Vec<(DevicePtr, usize)>)>;

/// The IPC handle of the allocation holding GPU region `r`, and where `r` starts in it; for
/// memory legacy IPC cannot export (CUDA VMM: expandable segments), the chunks to offer
/// instead (docs/gpu.md, "Memory that legacy CUDA IPC cannot export").
fn export(kind: multirail_gpu::GpuKind, r: &crate::registry::Region) -> std::result::Result<(IpcEntry, VmmExport), String> {
    let id = i32::try_from(r.dev).map_err(|_| format!("device id {} out of range", r.dev))?;
    let gpu = Gpu::open(kind, id).map_err(|e| e.to_string())?;
    let (base, alloc_len) = gpu.alloc_range(DevicePtr(r.base)).map_err(|e| e.to_string())?;
    let uuid = || gpu.uuid().map_err(|e| format!("no UUID for GPU {id}: {e}"));
    // Asking for a handle gives nothing out: the whole-allocation rule is checked before any.
    let legacy = match r.base + r.len <= base.0 + alloc_len as u64 {
        true => gpu.ipc_handle(base).map_err(|e| e.to_string()),
        false => Err(format!("region {} spans more than one allocation", r.id)),
    };
    let legacy_err = match legacy {
        Ok(handle) => {
            owns_allocation(r, base.0, alloc_len as u64)?;
            let entry = IpcEntry {
                region: r.id,
                device: r.dev,
                uuid: uuid()?,
                handle: handle.0,
                offset: r.base - base.0,
                alloc_len: alloc_len as u64,
            };
            return Ok((entry, None));
        }
        Err(e) => e,
    };
    let len = usize::try_from(r.len).map_err(|_| "region too large".to_string())?;
    let chunks = gpu
        .vmm_chunks(DevicePtr(r.base), len)
        .map_err(|e| format!("cudaIpcGetMemHandle cannot export it ({legacy_err}), nor can CUDA VMM export ({e})"))?;
    owns_chunks(r, &chunks)?;
    let total: u64 = chunks.iter().map(|c| c.1 as u64).sum();
    let entry = IpcEntry { region: r.id, device: r.dev, uuid: uuid()?, handle: [0; 64], offset: 0, alloc_len: total };
    Ok((entry, Some((gpu, chunks))))
}

/// The whole-allocation rule for VMM memory: a chunk's fd maps the whole chunk, so the region
/// must be exactly the chunks it lies in (first chunk's start to last chunk's end, no hole).
fn owns_chunks(r: &crate::registry::Region, chunks: &[(DevicePtr, usize)]) -> std::result::Result<(), String> {
    if chunks.len() > crate::ipc_fd::MAX_CHUNKS {
        return Err(format!("region {} lies in {} VMM chunks, more than {}", r.id, chunks.len(), crate::ipc_fd::MAX_CHUNKS));
    }
    let contiguous = chunks.windows(2).all(|w| w[0].0 .0 + w[0].1 as u64 == w[1].0 .0);
    let (first, last) = match (chunks.first(), chunks.last()) {
        (Some(f), Some(l)) => (f.0 .0, l.0 .0 + l.1 as u64),
        _ => return Err(format!("region {} has no VMM chunk", r.id)),
    };
    if contiguous && first == r.base && last == r.base + r.len {
        return Ok(());
    }
    owns_allocation(r, first, last - first)
}

/// The local ordinal of the device with UUID `uuid` (module docs).
fn local_device(kind: multirail_gpu::GpuKind, uuid: &[u8; 16], their_ordinal: u32) -> std::result::Result<i32, String> {
    let uuids = kind.device_uuids().map_err(|e| format!("cannot list this process's GPUs: {e}"))?;
    match uuids.iter().position(|u| u == uuid) {
        Some(i) => Ok(i as i32),
        None => Err(format!(
            "no GPU of this process has UUID {} (the peer's GPU {their_ordinal}; {} GPU(s) visible here): check CUDA_VISIBLE_DEVICES",
            uuid_string(uuid),
            uuids.len()
        )),
    }
}

/// The device a mapping for a host-memory local side is opened on: the exporter's GPU when
/// this process already uses it, else a GPU it uses that can reach the exporter's, else (a
/// process that uses no GPU yet) the exporter's.
fn host_side_device(kind: multirail_gpu::GpuKind, home: i32) -> i32 {
    let used = Gpu::opened_devices(kind);
    if used.contains(&home) {
        return home;
    }
    used.into_iter().find(|&d| Gpu::open(kind, d).ok().and_then(|g| g.can_access_peer(home).ok()).unwrap_or(false)).unwrap_or(home)
}

/// Maps a peer's handle on `dev`, the local buffer's device (None: the local side is host
/// memory, `host_side_device`), not on the exporter's: the copies (and the gather kernel, which
/// dereferences both sides) then run on the local buffer's device, and no context is made on a
/// GPU this process does not use. Where that is another GPU than the exporter's, the mapping
/// reaches it by peer access (`cudaIpcMemLazyEnablePeerAccess` when opened), checked first
/// with `cudaDeviceCanAccessPeer`: GPUs that cannot reach each other are refused here (the
/// transfer is staged, and says why).
fn open_entry(kind: multirail_gpu::GpuKind, e: &IpcEntry, dev: Option<i32>) -> std::result::Result<Mapped, FetchError> {
    let home = local_device(kind, &e.uuid, e.device)?;
    let id = dev.unwrap_or_else(|| host_side_device(kind, home));
    let gpu = Gpu::open(kind, id).map_err(|err| format!("GPU {id}: {err}"))?;
    if id != home {
        match gpu.can_access_peer(home) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "GPU {id} (the local buffer's) cannot access GPU {home} (the peer's memory) peer to peer: staged instead"
                )
                .into())
            }
            Err(err) => return Err(format!("GPU {id}: cannot tell whether it reaches GPU {home}: {err}").into()),
        }
    }
    let len = region_room(e.alloc_len, e.offset)?;
    if crate::ipc_fd::is_vmm(&e.handle) {
        // Exactly `alloc_len` bytes are reserved and mapped, chunk by chunk (checked there).
        let base = crate::ipc_fd::fetch_and_map(&gpu, &e.handle, e.alloc_len, home).map_err(|err| match err {
            FetchError::Refused(m) => FetchError::Refused(format!("cannot map the peer's CUDA VMM memory: {m}")),
            FetchError::Transient(m) => {
                FetchError::Transient(format!("cannot map the peer's CUDA VMM memory (tried again next transfer): {m}"))
            }
        })?;
        return Ok(Mapped { gpu, base, at: base.0 + e.offset, len, gen: NEXT_GEN.fetch_add(1, Ordering::Relaxed) });
    }
    // SAFETY: the handle comes from the peer's live allocation (its IpcHandles answer on the
    // authenticated control connection); a bad one is refused by the device.
    let base = unsafe { gpu.ipc_open(&IpcHandle(e.handle)) }.map_err(|err| format!("cannot open the peer's IPC handle: {err}"))?;
    if let Err(why) = mapping_holds(&gpu, base, e.alloc_len) {
        // SAFETY: just mapped, not yet used by any plan.
        let _ = unsafe { gpu.ipc_close(base) };
        return Err(why.into());
    }
    Ok(Mapped { gpu, base, at: base.0 + e.offset, len, gen: NEXT_GEN.fetch_add(1, Ordering::Relaxed) })
}

/// Every copy into a mapping is bounded by the allocation size the peer claims (`alloc_len`),
/// so the claim must not exceed what its handle really mapped here: a peer that claimed more
/// would have our copies run past its allocation into this process's other GPU memory. Checked
/// where the device can say (CUDA: `cuMemGetAddressRange` on the mapping; the stand-in: its
/// allocation table); where it cannot, the claim stands.
fn mapping_holds(gpu: &Gpu, base: DevicePtr, claimed: u64) -> std::result::Result<(), String> {
    match gpu.alloc_range(base) {
        Ok((b, real)) if b == base && real as u64 >= claimed => Ok(()),
        Ok((b, real)) => Err(format!(
            "the peer's IPC handle maps {real} bytes at {:#x}, but the peer claims an allocation of {claimed} bytes at {:#x}: refused",
            b.0, base.0
        )),
        Err(_) => Ok(()),
    }
}

/// Appends copy `c`, or extends the last copy when `c` continues it on both sides (pages that
/// are adjacent in both pools become one copy).
fn push_merged(copies: &mut Vec<multirail_gpu::BatchCopy>, c: multirail_gpu::BatchCopy) {
    if let Some(last) = copies.last_mut() {
        if last.0 == c.0 && last.1 + last.3 as u64 == c.1 && last.2 + last.3 as u64 == c.2 {
            last.3 += c.3;
            return;
        }
    }
    copies.push(c);
}

/// Logs, once per (peer, reason), that IPC could not be used and the transfer is staged (D2H,
/// loopback, H2D: several times slower): a warning whatever `MULTIRAIL_LOG` says
/// (`Ctx::warn`); the reason is also in `ipc_fallback_reason`. At most 256 distinct lines per
/// process (a peer that fails with ever new reasons cannot flood the log).
fn fallback_loudly(link: &Link, peer: &str, why: &str) {
    // Keyed by agent too: two agents of one process may each have a peer of that name.
    static SEEN: Mutex<Vec<(String, String, String)>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let me = &link.ctx.name;
    if seen.iter().any(|(a, p, w)| a == me && p == peer && w == why) || seen.len() >= 256 {
        return;
    }
    seen.push((me.clone(), peer.to_string(), why.to_string()));
    link.ctx.warn(&format!(
        "CUDA IPC is not used with peer {peer:?}, same-host GPU memory is staged through host memory and loopback instead: {why}"
    ));
}

/// Mapping generations: a plan names the generations it copies into, and runs only while
/// they are still mapped.
static NEXT_GEN: AtomicU64 = AtomicU64::new(1);

/// Queues each device's part of `plan` on that device's stream (`queue_part`) and returns the
/// events after them, without waiting. On error nothing of this transfer runs any more (the
/// parts queued before were waited for).
fn queue_copies(
    plan: &IpcPlan,
    queues: &mut Vec<(i32, GpuStream)>,
    events: &EventPool,
    counters: &Counters,
) -> std::result::Result<Vec<(Gpu, GpuEvent)>, String> {
    let mut out: Vec<(Gpu, GpuEvent)> = Vec::with_capacity(plan.parts.len());
    for (gpu, copies) in &plan.parts {
        match queue_part(gpu, copies, queues, events, counters) {
            Ok(e) => out.push((gpu.clone(), e)),
            Err(why) => {
                for (g, e) in out {
                    let _ = g.synchronize(&e);
                    events.lock().expect("ipc lock").push((g.id(), e));
                }
                return Err(why);
            }
        }
    }
    Ok(out)
}

/// Queues `copies` on `gpu`'s stream (made once, kept in `queues`; batched,
/// `Device::copy_batch_async`), then records an event from `events` after them, and returns it
/// without waiting. On error nothing of it runs any more (the stream was drained). `counters`
/// gets the device API calls that queued the copies and how.
fn queue_part(
    gpu: &Gpu,
    copies: &[multirail_gpu::BatchCopy],
    queues: &mut Vec<(i32, GpuStream)>,
    events: &EventPool,
    counters: &Counters,
) -> std::result::Result<GpuEvent, String> {
    let id = gpu.id();
    if !queues.iter().any(|q| q.0 == id) {
        let s = gpu.create_stream().map_err(|e| e.to_string())?;
        queues.push((id, s));
    }
    let (_, s) = queues.iter().find(|q| q.0 == id).expect("made above");
    let pooled = {
        let mut p = events.lock().expect("ipc lock");
        p.iter().position(|e| e.0 == id).map(|i| p.swap_remove(i).1)
    };
    let e = match pooled {
        Some(e) => e,
        None => gpu.create_event().map_err(|e| e.to_string())?,
    };
    // SAFETY: the local side is registered and held by the transfer, the remote side lies
    // inside the peer's mapped allocation (checked at plan time), pieces do not overlap, and
    // the completer's event wait ends every copy before the transfer completes; a cancel, a
    // close or a revocation waits for that (`InFlight`).
    match unsafe { gpu.copy_batch_async(copies, s) } {
        Ok(q) => {
            counters.copy_calls.fetch_add(q.calls as u64, Ordering::Relaxed);
            // Formatted when reported, not per transfer.
            *counters.copy_path.lock().expect("ipc lock") = Some((q.how, q.note));
        }
        Err(err) => {
            // Copies queued before the failing one still run: wait for the stream itself.
            let _ = gpu.stream_synchronize(s);
            events.lock().expect("ipc lock").push((id, e));
            return Err(err.to_string());
        }
    }
    match gpu.record(&e, s) {
        Ok(()) => Ok(e),
        Err(err) => {
            // A failed record tracks nothing: the stream is what holds the copies.
            let _ = gpu.stream_synchronize(s);
            events.lock().expect("ipc lock").push((id, e));
            Err(err.to_string())
        }
    }
}

/// One peer region mapped into this process.
struct Mapped {
    gpu: Gpu,
    /// Base of our mapping of the peer's allocation (what `ipc_close` takes).
    base: DevicePtr,
    /// Where the region starts in our mapping, and its length.
    at: u64,
    len: u64,
    /// Unique per mapping (a region revoked and mapped again gets a new one).
    gen: u64,
}

// A mapping's key: the peer's region and the local device it is opened for (None: for a
// host-memory local side); defined in `xfer`, which must not import this module.
use crate::xfer::MapKey;

type Maps = Arc<Mutex<HashMap<MapKey, std::result::Result<Mapped, String>>>>;

/// The first region whose mapping `plan` copies into that is gone (revoked, or the peer's
/// watch connection ended), if any. Checked under the `copying` lock.
fn revoked(plan: &IpcPlan, maps: &HashMap<MapKey, std::result::Result<Mapped, String>>) -> Option<u64> {
    plan.uses.iter().find(|(k, g)| !matches!(maps.get(k), Some(Ok(m)) if m.gen == *g)).map(|(k, _)| k.0)
}

/// `Peer::ipc_info`.
#[derive(Debug, Clone, Default)]
pub struct IpcReport {
    pub regions_mapped: usize,
    /// Local device ordinals that hold mappings (sorted, distinct).
    pub devices: Vec<i32>,
    /// Mappings closed because the peer revoked them (deregistration) or its watch
    /// connection ended.
    pub regions_revoked: u64,
    pub transfers: u64,
    pub bytes: u64,
    /// Device copies those transfers made (after merging pieces adjacent on both sides), and
    /// the device API calls that queued them (fewer when batched).
    pub copies: u64,
    pub copy_calls: u64,
    /// How device-to-device copies are queued on the last device used: the batch call, or why
    /// each copy is its own call (empty before the first transfer).
    pub copy_path: String,
    /// Why the last transfer that could have used IPC was staged instead (empty: none was).
    pub fallback_reason: String,
}

/// What the copy worker counts (`IpcReport`).
#[derive(Default)]
struct Counters {
    transfers: AtomicU64,
    bytes: AtomicU64,
    copies: AtomicU64,
    copy_calls: AtomicU64,
    /// How the last transfer's copies were queued, and why not a faster way (if wanted).
    copy_path: Mutex<Option<(multirail_gpu::CopyHow, Option<String>)>>,
}

struct Worker {
    tx: mpsc::Sender<Arc<XferShared>>,
    thread: JoinHandle<()>,
    /// The completer's thread id (`close` from it must not wait for itself).
    completer: std::thread::ThreadId,
}

/// Transfers whose copies are queued on the device and not yet waited for (module docs).
#[derive(Default)]
struct InFlight {
    n: Mutex<usize>,
    cv: Condvar,
}

impl InFlight {
    fn add(&self) {
        *self.n.lock().expect("ipc lock") += 1;
    }

    fn done(&self) {
        let mut n = self.n.lock().expect("ipc lock");
        *n -= 1;
        if *n == 0 {
            self.cv.notify_all();
        }
    }

    /// Waits until no queued copy is left; the caller holds `copying`, so none is added. The
    /// completer waits for every queued event without a timeout of its own, so neither does
    /// this: a device that never finishes a copy cannot be unmapped safely anyway.
    fn drain(&self) {
        let mut n = self.n.lock().expect("ipc lock");
        while *n > 0 {
            n = self.cv.wait(n).expect("ipc lock");
        }
    }
}

/// One transfer between the worker and the completer: its copies are queued on each device's
/// stream, followed by that device's event.
struct Queued {
    x: Arc<XferShared>,
    events: Vec<(Gpu, GpuEvent)>,
}

/// Events to mark each queued transfer's end, per device, reused.
type EventPool = Arc<Mutex<Vec<(i32, GpuEvent)>>>;

/// The initiator's end of its `Role::IpcWatch` connection.
struct WatchConn {
    id: [u8; 16],
    sock: TcpStream,
    /// Set by the reader thread when the connection ended (a new one is opened on next use).
    dead: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// A peer's IPC state (module docs).
#[derive(Default)]
pub(crate) struct IpcPeer {
    /// By region id: the mapping, or why there is none (not retried for that region).
    maps: Maps,
    watch: Mutex<Option<WatchConn>>,
    revoked: Arc<AtomicU64>,
    worker: Mutex<Option<Worker>>,
    /// Held by the worker while it decides on and queues a transfer; `cancel`/`close` take it,
    /// then wait for `in_flight` to drain.
    copying: Arc<Mutex<()>>,
    in_flight: Arc<InFlight>,
    closing: Arc<AtomicBool>,
    counters: Arc<Counters>,
    fallback: Mutex<String>,
}

impl IpcPeer {
    /// A plan for a transfer of `pairs` (local address, remote region, offset, len) when every
    /// remote region maps over IPC; None (reason recorded) to stage it over the rails.
    /// `local_dev`: the GPU a local address is memory of (D2D, run on that GPU), None for host
    /// memory (H2D/D2H). The plan has one part per local device: each runs on its own GPU.
    pub fn plan(
        &self,
        link: &Link,
        keys: &Keys,
        op: Op,
        pairs: &[multirail_proto::Pair],
        local_dev: impl Fn(u64) -> Option<i32>,
    ) -> Option<IpcPlan> {
        let mut want: Vec<MapKey> = pairs.iter().map(|p| (p.region, local_dev(p.local))).collect();
        want.sort_unstable();
        want.dedup();
        if let Err(why) = self.map(link, keys, &want) {
            fallback_loudly(link, &link.peer_name, &why);
            *self.fallback.lock().expect("ipc lock") = why;
            return None;
        }
        let maps = self.maps.lock().expect("ipc lock");
        let mut parts: Vec<(Gpu, Vec<multirail_gpu::BatchCopy>)> = Vec::new();
        let mut uses: Vec<(MapKey, u64)> = Vec::new();
        for p in pairs {
            let dev = local_dev(p.local);
            let key = (p.region, dev);
            let Some(Ok(m)) = maps.get(&key) else { return None };
            if !uses.iter().any(|u| u.0 == key) {
                uses.push((key, m.gen));
            }
            if p.offset + p.len > m.len {
                return None; // resolved against the peer's metadata already; defensive
            }
            let remote = m.at + p.offset;
            let on_gpu = dev.is_some();
            let len = usize::try_from(p.len).ok()?;
            let part = match parts.iter().position(|(g, _)| g.id() == m.gpu.id()) {
                Some(i) => i,
                None => {
                    parts.push((m.gpu.clone(), Vec::new()));
                    parts.len() - 1
                }
            };
            push_merged(
                &mut parts[part].1,
                match (op, on_gpu) {
                    (Op::Read, true) => (CopyKind::DeviceToDevice, p.local, remote, len),
                    (Op::Read, false) => (CopyKind::DeviceToHost, p.local, remote, len),
                    (Op::Write, true) => (CopyKind::DeviceToDevice, remote, p.local, len),
                    (Op::Write, false) => (CopyKind::HostToDevice, remote, p.local, len),
                },
            );
        }
        if parts.is_empty() {
            return None;
        }
        Some(IpcPlan { parts, uses })
    }

    /// The id of a live watch connection to the peer, opening one (and its reader) if needed.
    fn watch_id(&self, link: &Link) -> std::result::Result<[u8; 16], String> {
        let mut w = self.watch.lock().expect("ipc lock");
        if let Some(c) = w.as_ref().filter(|c| !c.dead.load(Ordering::Acquire)) {
            return Ok(c.id);
        }
        // A dead one's reader has finished or finishes by itself (it takes `maps`, which our
        // caller holds: not joined here).
        let (mut sock, id) = link.dial_role(Role::IpcWatch).map_err(|e| format!("cannot open the IPC watch connection: {e}"))?;
        // The target says when it has registered the connection (an IpcReq naming it before
        // that would be refused).
        let deadline = Instant::now() + link.ctx.cfg.timeout;
        let mut tick = |_: bool| if Instant::now() > deadline { Err("no answer".to_string()) } else { Ok(()) };
        match wire::read_frame(&mut sock, &mut tick) {
            Ok((_, Body::Resp { status: Status::Ok, .. })) => {}
            Ok((_, Body::Resp { status, msg, .. } | Body::Error { status, msg })) => {
                return Err(format!("the peer refused the IPC watch connection: {status:?}: {msg}"))
            }
            Ok((_, other)) => return Err(format!("unexpected {:?} on the IPC watch connection", other.kind())),
            Err(e) => return Err(format!("IPC watch connection: {e}")),
        }
        let reader = sock.try_clone().map_err(|e| format!("IPC watch connection: {e}"))?;
        let dead = Arc::new(AtomicBool::new(false));
        let (maps, copying, in_flight, closing, revoked, d2) =
            (self.maps.clone(), self.copying.clone(), self.in_flight.clone(), self.closing.clone(), self.revoked.clone(), dead.clone());
        let timeout = link.ctx.cfg.timeout;
        let thread = std::thread::Builder::new()
            .name("mr-ipc-watch".into())
            .spawn(move || watch_reader(reader, maps, copying, in_flight, closing, revoked, d2, timeout))
            .map_err(|e| format!("spawn: {e}"))?;
        if let Some(old) = w.replace(WatchConn { id, sock, dead, thread }) {
            let _ = old.sock.shutdown(Shutdown::Both);
        }
        Ok(id)
    }

    /// Map every (region, local device) of `want` not mapped yet (one request for all of them).
    fn map(&self, link: &Link, keys: &Keys, want: &[MapKey]) -> std::result::Result<(), String> {
        let mut maps = self.maps.lock().expect("ipc lock");
        if let Some(Err(why)) = want.iter().find_map(|k| maps.get(k).filter(|m| m.is_err())) {
            return Err(why.clone());
        }
        let missing: Vec<MapKey> = want.iter().filter(|k| !maps.contains_key(k)).copied().collect();
        let mut ids: Vec<u64> = missing.iter().map(|k| k.0).collect();
        ids.dedup();
        let ask: Vec<(u64, RegionKey)> = ids.iter().filter_map(|r| keys.get(*r).map(|k| (*r, k))).collect();
        if ask.is_empty() {
            return Ok(());
        }
        if ask.len() > MAX_IPC_REGIONS {
            return Err(format!("more than {MAX_IPC_REGIONS} GPU regions in one transfer"));
        }
        let kind = link.ctx.cfg.staging.gpu;
        // Revocations reach us on the watch connection; `maps` stays locked until the answer
        // is mapped, so a revocation of these regions is handled after them.
        let watch = self.watch_id(link)?;
        let answer = link.control_call(Body::IpcReq { host: host_id(), watch, regions: ask.clone() }, Kind::IpcHandles);
        let entries = match answer {
            Ok(Body::IpcHandles(es)) if es.len() == ask.len() => es,
            Ok(_) => Err("the peer answered IpcReq with the wrong number of handles".to_string())?,
            // The peer said no (another host, IPC off, no handle): remember it for these regions.
            Err(e @ Error::Remote { .. }) => {
                let why = format!("peer refused CUDA IPC: {e}");
                for k in &missing {
                    maps.insert(*k, Err(why.clone()));
                }
                return Err(why);
            }
            // Transient (connection trouble): not remembered.
            Err(e) => return Err(format!("CUDA IPC request failed: {e}")),
        };
        let mut first_err = None;
        let mut seen: Vec<u64> = Vec::with_capacity(entries.len());
        for e in entries {
            // A region that came twice in this answer is mapped once (mapping it again would
            // leak the first mapping).
            if seen.contains(&e.region) {
                first_err.get_or_insert_with(|| format!("the peer sent region {} twice", e.region));
                continue;
            }
            seen.push(e.region);
            if !ask.iter().any(|(r, _)| *r == e.region) {
                first_err.get_or_insert_with(|| format!("the peer sent a handle for region {} it was not asked for", e.region));
                continue;
            }
            for k in missing.iter().filter(|k| k.0 == e.region) {
                match open_entry(kind, &e, k.1) {
                    Ok(m) => {
                        maps.insert(*k, Ok(m));
                    }
                    // A definite no: remembered for the region (it is staged from now on).
                    Err(FetchError::Refused(why)) => {
                        first_err.get_or_insert_with(|| why.clone());
                        maps.insert(*k, Err(why));
                    }
                    // Trouble on the way (a timeout, a busy exporter): staged this time,
                    // tried again by the next transfer (a new IpcReq, a new token).
                    Err(FetchError::Transient(why)) => {
                        first_err.get_or_insert(why);
                    }
                }
            }
        }
        match first_err {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// Close and forget the mappings of `regions`, which the peer's metadata no longer holds
    /// (`Peer::update_regions`), once no queued copy runs: a transfer planned on one of them
    /// then fails with `UnknownRegion` instead of copying (`revoked`), and one prepared after
    /// the region is added again maps it again.
    pub fn forget(&self, regions: &[u64]) {
        let any = self.maps.lock().expect("ipc lock").keys().any(|k| regions.contains(&k.0));
        if any {
            unmap(&self.maps, &self.copying, &self.in_flight, Some(regions), &AtomicU64::new(0));
        }
    }

    /// Test hook (`Peer::hold_ipc_copy_for_test`): a known (failed) mapping of `region`, and
    /// the `copying` lock held as the worker holds it while it queues copies.
    pub(crate) fn hold_copy_for_test(&self, region: u64) -> std::sync::MutexGuard<'_, ()> {
        self.maps.lock().expect("ipc lock").insert((region, None), Err("test hold".into()));
        self.copying.lock().expect("ipc lock")
    }

    /// Queue a planned transfer on the worker (started on first use).
    pub fn submit(&self, x: Arc<XferShared>) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::PeerLost { peer: x.peer.name().to_string(), reason: "peer closed".into() });
        }
        let mut w = self.worker.lock().expect("ipc lock");
        if w.is_none() {
            let (tx, rx) = mpsc::channel::<Arc<XferShared>>();
            let (done_tx, done_rx) = mpsc::channel::<Queued>();
            let events = EventPool::default();
            let (in_flight, counters, pool) = (self.in_flight.clone(), self.counters.clone(), events.clone());
            let completer = std::thread::Builder::new()
                .name("mr-ipc-done".into())
                .spawn(move || completer(done_rx, pool, in_flight, counters))
                .map_err(|e| Error::io("spawn", e))?;
            let completer_id = completer.thread().id();
            let (copying, closing, counters, maps, in_flight) =
                (self.copying.clone(), self.closing.clone(), self.counters.clone(), self.maps.clone(), self.in_flight.clone());
            let spawned = std::thread::Builder::new().name("mr-ipc".into()).spawn(move || {
                worker(rx, done_tx, events, copying, closing, counters, maps, in_flight);
                // The completer ends once the worker's sender is gone and every queued
                // transfer is completed. Not joined when it is the thread that closes us.
                if completer.thread().id() != std::thread::current().id() {
                    let _ = completer.join();
                }
            });
            // Without a worker, the completer's channel is already closed and it ends by itself.
            let thread = spawned.map_err(|e| Error::io("spawn", e))?;
            *w = Some(Worker { tx, thread, completer: completer_id });
        }
        w.as_ref().expect("started").tx.send(x).map_err(|_| Error::Gpu("the IPC worker stopped".into()))
    }

    /// Abort `x` if it has not run: once this returns, the worker does not touch its memory.
    pub fn cancel(&self, x: &XferShared) {
        let _g = self.copying.lock().expect("ipc lock");
        // Its copies may be queued: wait for every queued transfer (nothing new is queued while
        // we hold `copying`). Only an application thread releases a handle, never the worker or
        // the completer, which hold transfers, not handles.
        self.in_flight.drain();
        x.finish(Err(Error::InvalidArgument("transfer handle released while in progress".into())));
    }

    /// Stop the worker (queued transfers fail, a running copy completes first) and unmap.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
        let w = self.worker.lock().expect("ipc lock").take();
        if let Some(w) = w {
            drop(w.tx);
            // The worker or the completer may drop the last reference to the peer (through a
            // finished transfer). Every transfer queued holds a reference, so none is queued
            // then; neither must wait for itself, and the worker waits for the completer.
            let me = std::thread::current().id();
            if w.thread.thread().id() != me && w.completer != me {
                let _ = w.thread.join();
            }
        }
        {
            let _c = self.copying.lock().expect("ipc lock");
            self.in_flight.drain();
            for (_, m) in self.maps.lock().expect("ipc lock").drain() {
                if let Ok(m) = m {
                    // SAFETY: the worker is gone (or between copies, holding no lock: we hold
                    // `copying`), so no copy uses the mapping.
                    let _ = unsafe { m.gpu.ipc_close(m.base) };
                }
            }
        }
        // Only now (every mapping closed) does the target see the watch connection end, which
        // it counts as this peer having released everything.
        let w = self.watch.lock().expect("ipc lock").take();
        if let Some(w) = w {
            let _ = w.sock.shutdown(Shutdown::Both);
            if w.thread.thread().id() != std::thread::current().id() {
                let _ = w.thread.join();
            }
        }
    }

    pub fn report(&self) -> IpcReport {
        let maps = self.maps.lock().expect("ipc lock");
        let mut devices: Vec<i32> = maps.values().filter_map(|m| m.as_ref().ok()).map(|m| m.gpu.id()).collect();
        devices.sort_unstable();
        devices.dedup();
        IpcReport {
            regions_mapped: maps.values().filter(|m| m.is_ok()).count(),
            devices,
            regions_revoked: self.revoked.load(Ordering::Relaxed),
            transfers: self.counters.transfers.load(Ordering::Relaxed),
            bytes: self.counters.bytes.load(Ordering::Relaxed),
            copies: self.counters.copies.load(Ordering::Relaxed),
            copy_calls: self.counters.copy_calls.load(Ordering::Relaxed),
            copy_path: match &*self.counters.copy_path.lock().expect("ipc lock") {
                Some((how, Some(why))) => format!("{} ({why})", how.describe()),
                Some((how, None)) => how.describe().to_string(),
                None => String::new(),
            },
            fallback_reason: self.fallback.lock().expect("ipc lock").clone(),
        }
    }
}

impl Drop for IpcPeer {
    fn drop(&mut self) {
        self.close();
    }
}

fn region_room(alloc_len: u64, offset: u64) -> std::result::Result<u64, String> {
    alloc_len.checked_sub(offset).filter(|n| *n > 0).ok_or_else(|| "the region's offset lies outside its allocation".to_string())
}

#[allow(clippy::too_many_arguments)]
fn worker(
    rx: mpsc::Receiver<Arc<XferShared>>,
    done: mpsc::Sender<Queued>,
    events: EventPool,
    copying: Arc<Mutex<()>>,
    closing: Arc<AtomicBool>,
    counters: Arc<Counters>,
    maps: Maps,
    in_flight: Arc<InFlight>,
) {
    // One stream per device, made once.
    let mut queues: Vec<(i32, GpuStream)> = Vec::new();
    for x in rx {
        let g = copying.lock().expect("ipc lock");
        if x.state() != XferState::InProgress {
            continue; // cancelled while queued
        }
        if closing.load(Ordering::Acquire) {
            x.finish(Err(Error::PeerLost { peer: x.peer.name().to_string(), reason: "peer closed".into() }));
            continue;
        }
        let Some(plan) = x.ipc.as_ref() else { continue };
        // Under `copying`: a revocation waits for us, or has already closed the mapping.
        if let Some(region) = revoked(plan, &maps.lock().expect("ipc lock")) {
            drop(g);
            x.finish(Err(Error::Remote {
                peer: x.peer.name().to_string(),
                status: Status::UnknownRegion,
                msg: format!(
                    "region {region}: its CUDA IPC mapping was revoked (the region was removed from the peer's metadata, or the peer \
                     deregistered it or closed); prepare the transfer again"
                ),
            }));
            continue;
        }
        // The stream contract: after the application's work queued at post (already done when
        // the post came through the GPU-order waiter).
        let r = x.wait_gpu_order().map_err(|e| e.to_string()).and_then(|_| queue_copies(plan, &mut queues, &events, &counters));
        match r {
            Ok(evs) => {
                in_flight.add();
                drop(g);
                if let Err(mpsc::SendError(q)) = done.send(Queued { x, events: evs }) {
                    // No completer (it could not be started): wait here.
                    complete(q, &events, &in_flight, &counters);
                }
            }
            Err(m) => {
                drop(g);
                x.finish(Err(Error::Gpu(format!("CUDA IPC copy failed: {m}"))));
            }
        }
    }
}

/// The completer: each queued transfer in order, its event waited for, then its notification and
/// completion.
fn completer(rx: mpsc::Receiver<Queued>, events: EventPool, in_flight: Arc<InFlight>, counters: Arc<Counters>) {
    for q in rx {
        complete(q, &events, &in_flight, &counters);
    }
}

fn complete(q: Queued, events: &EventPool, in_flight: &InFlight, counters: &Counters) {
    let Queued { x, events: evs } = q;
    // A failed wait is a device error, sticky for the context: no copy of it runs after that.
    let mut r = Ok(());
    for (gpu, event) in evs {
        let w = gpu.synchronize(&event);
        if r.is_ok() {
            r = w;
        }
        events.lock().expect("ipc lock").push((gpu.id(), event));
    }
    in_flight.done();
    match r {
        // Released (or failed) meanwhile: its copies are done, and it sends no notification.
        Ok(()) if x.state() != XferState::InProgress => {}
        Ok(()) => {
            let Some(plan) = x.ipc.as_ref() else { return };
            counters.transfers.fetch_add(1, Ordering::Relaxed);
            counters.bytes.fetch_add(x.total, Ordering::Relaxed);
            counters.copies.fetch_add(plan.parts.iter().map(|p| p.1.len() as u64).sum(), Ordering::Relaxed);
            if x.notif.lock().expect("xfer lock").is_none() {
                x.finish(Ok(()));
            } else {
                // Sent by the link's notifier, pipelined with the notifications queued before
                // it (`Link::control_batch`); it completes `x` once the peer has it.
                x.peer.clone().notify_then_finish(x);
            }
        }
        Err(e) => x.finish(Err(Error::Gpu(format!("CUDA IPC copy failed: {e}")))),
    }
}

/// Close and forget the mappings of `regions` (all of them: None), with no copy running.
fn unmap(maps: &Maps, copying: &Mutex<()>, in_flight: &InFlight, regions: Option<&[u64]>, revoked: &AtomicU64) {
    let _c = copying.lock().expect("ipc lock");
    in_flight.drain();
    let mut m = maps.lock().expect("ipc lock");
    let gone: Vec<std::result::Result<Mapped, String>> = match regions {
        Some(ids) => {
            let keys: Vec<MapKey> = m.keys().filter(|k| ids.contains(&k.0)).copied().collect();
            keys.iter().filter_map(|k| m.remove(k)).collect()
        }
        None => m.drain().map(|(_, v)| v).collect(),
    };
    for g in gone.into_iter().flatten() {
        // SAFETY: we hold `copying`, so no copy runs, and the mapping is out of `maps`, so no
        // later plan or copy uses it.
        let _ = unsafe { g.gpu.ipc_close(g.base) };
        revoked.fetch_add(1, Ordering::Relaxed);
    }
}

/// The initiator's reader of its watch connection: answers each `IpcRevoke` once the mappings
/// are closed; when the connection ends, closes every mapping of the peer (the target counts
/// a closed connection as released).
#[allow(clippy::too_many_arguments)]
fn watch_reader(
    mut s: TcpStream,
    maps: Maps,
    copying: Arc<Mutex<()>>,
    in_flight: Arc<InFlight>,
    closing: Arc<AtomicBool>,
    revoked: Arc<AtomicU64>,
    dead: Arc<AtomicBool>,
    timeout: Duration,
) {
    loop {
        let mut started: Option<Instant> = None;
        let mut tick = |mid: bool| {
            if closing.load(Ordering::Acquire) {
                return Err(String::new());
            }
            if mid && started.get_or_insert_with(Instant::now).elapsed() > timeout {
                return Err("IpcRevoke frame not completed in time".to_string());
            }
            Ok(())
        };
        match wire::read_frame(&mut s, &mut tick) {
            Ok((h, Body::IpcRevoke(ids))) => {
                unmap(&maps, &copying, &in_flight, Some(&ids), &revoked);
                let deadline = Instant::now() + timeout;
                let mut wtick = |_: bool| if Instant::now() > deadline { Err("IpcReleased not sent in time".to_string()) } else { Ok(()) };
                if wire::send(&mut s, &Body::IpcReleased(ids), h.req_id, &mut wtick).is_err() {
                    break;
                }
            }
            _ => break,
        }
    }
    dead.store(true, Ordering::Release);
    let _ = s.shutdown(Shutdown::Both);
    // No more revocations can reach us: keep no mapping that one could have been meant for.
    unmap(&maps, &copying, &in_flight, None, &revoked);
}

/// The target's view of one `Role::IpcWatch` connection.
struct Watch {
    peer: String,
    /// Writes (`IpcRevoke`) and the next request id; held for one send.
    out: Mutex<(TcpStream, u64)>,
    /// (highest request id answered by `IpcReleased`, connection ended).
    state: Mutex<(u64, bool)>,
    cv: Condvar,
}

/// The target's record of CUDA IPC handles it gave out (module docs).
pub(crate) struct Exports {
    watches: Mutex<HashMap<[u8; 16], Arc<Watch>>>,
    /// Region id -> the watch connections whose peer was handed its handle; None once the
    /// agent closes (no handle is given out after its last revocation).
    handed: Mutex<Option<HashMap<u64, HashSet<[u8; 16]>>>>,
}

impl Default for Exports {
    fn default() -> Exports {
        Exports { watches: Mutex::default(), handed: Mutex::new(Some(HashMap::new())) }
    }
}

impl Exports {
    /// This agent's identity for its VMM offers (`ipc_fd`): the address of its exports.
    fn owner(&self) -> usize {
        self as *const Exports as usize
    }

    /// Is `id` a live watch connection of `peer`?
    fn watching(&self, id: &[u8; 16], peer: &str) -> bool {
        self.watches.lock().expect("ipc lock").get(id).is_some_and(|w| w.peer == peer)
    }

    /// Record that the peer of watch connection `id` holds handles of `regions`; false if the
    /// connection is gone (then nothing is recorded and no handle may be given).
    fn handed(&self, id: &[u8; 16], regions: impl Iterator<Item = u64>) -> bool {
        let w = self.watches.lock().expect("ipc lock");
        if !w.contains_key(id) {
            return false;
        }
        let mut h = self.handed.lock().expect("ipc lock");
        let Some(h) = h.as_mut() else { return false };
        for r in regions {
            h.entry(r).or_default().insert(*id);
        }
        true
    }

    /// Forget watch connection `id` (it ended): its peer released everything.
    fn ended(&self, id: &[u8; 16]) {
        let w = self.watches.lock().expect("ipc lock").remove(id);
        if let Some(h) = self.handed.lock().expect("ipc lock").as_mut() {
            h.retain(|_, ids| {
                ids.remove(id);
                !ids.is_empty()
            });
        }
        if let Some(w) = w {
            w.state.lock().expect("ipc lock").1 = true;
            w.cv.notify_all();
        }
    }
}

/// Serve a `Role::IpcWatch` connection of `peer` (id `id`) until it ends or the agent closes:
/// `IpcReleased` answers wake the deregistrations waiting for them.
pub(crate) fn serve_watch(ctx: &crate::ctx::Ctx, exports: &Exports, s: &mut TcpStream, id: [u8; 16], peer: &str) {
    let Ok(out) = s.try_clone() else { return };
    let w = Arc::new(Watch { peer: peer.to_string(), out: Mutex::new((out, 0)), state: Mutex::new((0, false)), cv: Condvar::new() });
    exports.watches.lock().expect("ipc lock").insert(id, w.clone());
    let timeout = ctx.cfg.timeout;
    // Registered: the peer may name this connection in an `IpcReq` from now on.
    {
        let deadline = Instant::now() + timeout;
        let mut tick = |_: bool| if Instant::now() > deadline { Err(String::new()) } else { Ok(()) };
        let ok = Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() };
        if wire::send(&mut w.out.lock().expect("ipc lock").0, &ok, 0, &mut tick).is_err() {
            exports.ended(&id);
            return;
        }
    }
    // Not ended by the agent's shutdown flag: `Agent::close` revokes over these connections
    // first, then aborts them (`abort_all`), which ends this loop.
    loop {
        let mut started: Option<Instant> = None;
        let mut tick = |mid: bool| {
            if mid && started.get_or_insert_with(Instant::now).elapsed() > timeout {
                return Err(String::new());
            }
            Ok(())
        };
        match wire::read_frame(s, &mut tick) {
            Ok((h, Body::IpcReleased(_))) => {
                // Only a revocation actually sent can be answered: a forged id (u64::MAX) would
                // acknowledge every later revocation in advance.
                let sent = w.out.lock().expect("ipc lock").1;
                if h.req_id > sent {
                    ctx.log(&format!(
                        "IPC watch connection of {peer:?}: IpcReleased for request {} not sent yet (last {sent}); ignored",
                        h.req_id
                    ));
                    continue;
                }
                let mut st = w.state.lock().expect("ipc lock");
                st.0 = st.0.max(h.req_id);
                w.cv.notify_all();
            }
            Ok((_, other)) => {
                ctx.log(&format!("IPC watch connection of {peer}: unexpected {:?}; closing it", other.kind()));
                break;
            }
            Err(_) => break,
        }
    }
    exports.ended(&id);
}

/// Revoke every peer's mappings of `regions` (being deregistered), or of every region handed
/// out when the agent closes (None: no handle is given out after this), and wait until each
/// peer released them or its watch connection ended, at most `wait`. Err names the peers that
/// did not confirm in time (their watch connections are aborted).
pub(crate) fn revoke(ctx: &crate::ctx::Ctx, exports: &Exports, regions: Option<&[u64]>, wait: Duration) -> std::result::Result<(), String> {
    // VMM offers not fetched yet are withdrawn first: no fd of these regions goes out after.
    crate::ipc_fd::withdraw(exports.owner(), regions);
    // Per watch connection, the regions to revoke on it.
    let mut by_watch: HashMap<[u8; 16], Vec<u64>> = HashMap::new();
    {
        let mut g = exports.handed.lock().expect("ipc lock");
        let all = match regions {
            Some(rs) => g.as_mut().map(|h| rs.iter().filter_map(|r| h.remove(r).map(|w| (*r, w))).collect()).unwrap_or_default(),
            None => g.take().unwrap_or_default(),
        };
        for (r, ws) in all {
            for w in ws {
                by_watch.entry(w).or_default().push(r);
            }
        }
    }
    if by_watch.is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + wait;
    let watches: Vec<(Arc<Watch>, Vec<u64>)> = {
        let w = exports.watches.lock().expect("ipc lock");
        by_watch.into_iter().filter_map(|(id, rs)| w.get(&id).map(|w| (w.clone(), rs))).collect()
    };
    // Send every revocation first, then wait for all of them: peers release in parallel.
    let mut waiting: Vec<(Arc<Watch>, u64)> = Vec::new();
    for (w, rs) in watches {
        let mut out = w.out.lock().expect("ipc lock");
        let mut sent = 0;
        for chunk in rs.chunks(MAX_IPC_REVOKE) {
            out.1 += 1;
            let req = out.1;
            let mut tick = |_: bool| if Instant::now() > deadline { Err("IpcRevoke not sent in time".to_string()) } else { Ok(()) };
            match wire::send(&mut out.0, &Body::IpcRevoke(chunk.to_vec()), req, &mut tick) {
                Ok(()) => sent = req,
                // A connection that fails now has ended or is about to: its reader sees it.
                Err(WireError::Io(_)) => break,
                Err(_) => {
                    sent = req;
                    break;
                }
            }
        }
        drop(out);
        if sent > 0 {
            waiting.push((w, sent));
        }
    }
    let mut late: Vec<String> = Vec::new();
    for (w, req) in waiting {
        let mut st = w.state.lock().expect("ipc lock");
        while st.0 < req && !st.1 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = w.cv.wait_timeout(st, deadline - now).expect("ipc lock").0;
        }
        if st.0 < req && !st.1 {
            drop(st);
            abort_socket(&w.out.lock().expect("ipc lock").0);
            if !late.contains(&w.peer) {
                late.push(w.peer.clone());
            }
        }
    }
    if late.is_empty() {
        return Ok(());
    }
    let msg = format!("peer(s) {} did not confirm within {wait:?} that they closed their CUDA IPC mappings", late.join(", "));
    ctx.log(&msg);
    Err(msg)
}

#[cfg(test)]
mod tests {
    use super::{mapping_holds, push_merged};
    use multirail_gpu::{Device, DevicePtr, Gpu, StandIn, StandInConfig};

    #[test]
    fn a_forged_release_does_not_acknowledge_later_revocations() {
        use super::{revoke, serve_watch, Exports};
        use crate::wire;
        use multirail_proto::codec::Status;
        use multirail_proto::Body;
        use std::net::TcpStream;
        use std::sync::Mutex;
        use std::time::{Duration, Instant};
        let ctx = crate::ctx::Ctx {
            name: "t".into(),
            incarnation: 1,
            cfg: crate::config::Config { timeout: Duration::from_secs(2), ..Default::default() },
            rails: Vec::new(),
            bind_devices: false,
            events: Mutex::new(Default::default()),
            started: Instant::now(),
            closed: std::sync::atomic::AtomicBool::new(false),
            ucx: None,
            choices: Vec::new(),
            topo: Default::default(),
        };
        let exports = Exports::default();
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut peer = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mut s, _) = l.accept().expect("accept");
        let id = [7u8; 16];
        std::thread::scope(|sc| {
            sc.spawn(|| serve_watch(&ctx, &exports, &mut s, id, "hostile"));
            let mut tick = |_: bool| Ok(());
            let (_, ok) = wire::read_frame(&mut peer, &mut tick).expect("watch registered");
            assert!(matches!(ok, Body::Resp { status: Status::Ok, .. }), "{ok:?}");
            assert!(exports.handed(&id, [5u64].into_iter()));
            // Before any revocation: a release of request u64::MAX (never sent).
            wire::send(&mut peer, &Body::IpcReleased(vec![5]), u64::MAX, &mut tick).expect("forged release");
            std::thread::sleep(Duration::from_millis(200));
            let r = revoke(&ctx, &exports, Some(&[5]), Duration::from_millis(500));
            // Ends serve_watch whatever `r` is (a failed assertion must not hang the scope).
            let _ = peer.shutdown(std::net::Shutdown::Both);
            assert!(r.as_ref().is_err_and(|e| e.contains("hostile")), "{r:?}");
        });
    }

    #[test]
    fn a_peer_claiming_more_than_its_handle_maps_is_refused() {
        let dev = StandIn::new(0, StandInConfig { ipc_same_process: true, ..StandInConfig::default() });
        let a = dev.alloc(1 << 20).unwrap();
        let h = dev.ipc_handle(a).unwrap();
        // SAFETY: a live allocation's handle.
        let m = unsafe { dev.ipc_open(&h) }.unwrap();
        let gpu = Gpu::StandIn(dev.clone());
        assert!(mapping_holds(&gpu, m, 1 << 20).is_ok());
        assert!(mapping_holds(&gpu, m, 4096).is_ok(), "claiming less only narrows what is copied");
        let e = mapping_holds(&gpu, m, (1 << 20) + 1).unwrap_err();
        assert!(e.contains("claims an allocation of 1048577 bytes") && e.contains("maps 1048576 bytes"), "{e}");
        // An address the device knows nothing about: the claim stands (as on a driver without
        // cuMemGetAddressRange).
        assert!(mapping_holds(&gpu, DevicePtr(0x10), 1 << 40).is_ok());
        // SAFETY: done with them.
        unsafe {
            dev.ipc_close(m).unwrap();
            dev.free(a).unwrap();
        }
    }

    /// Issue 33, item 4: an IPC handle maps the whole allocation, so only a region that is its
    /// whole allocation is exported; a read-write region sharing a block with read-only and
    /// local ones is refused (the initiator then stages), naming why.
    #[test]
    fn only_regions_owning_their_whole_allocation_go_out_by_ipc() {
        use multirail_gpu::GpuKind;
        use multirail_proto::{Access, MemType};
        // A device id of its own: stand-ins are per (kind, id) and process-wide.
        let dev = 41u32;
        let gpu = Gpu::open(GpuKind::StandIn, dev as i32).unwrap();
        let block = gpu.alloc(3 * 4096).unwrap();
        let whole = gpu.alloc(4096).unwrap();
        let reg = crate::registry::Registry::default();
        let rw = reg.register(block.0, 4096, dev, MemType::Vram, Access::ReadWrite).unwrap();
        let _ro = reg.register(block.0 + 4096, 4096, dev, MemType::Vram, Access::ReadOnly).unwrap();
        let _local = reg.register(block.0 + 8192, 4096, dev, MemType::Vram, Access::Local).unwrap();
        let own = reg.register(whole.0, 4096, dev, MemType::Vram, Access::ReadWrite).unwrap();
        let e = super::export(GpuKind::StandIn, &rw).unwrap_err();
        assert!(e.contains("part of a larger GPU allocation") && e.contains("staged instead"), "{e}");
        let (ok, vmm) = super::export(GpuKind::StandIn, &own).unwrap();
        assert!(vmm.is_none(), "cudaMalloc memory goes by its legacy handle");
        assert_eq!((ok.region, ok.offset, ok.alloc_len), (own.id, 0, 4096));
        // SAFETY: done with them.
        unsafe {
            gpu.free(block).unwrap();
            gpu.free(whole).unwrap();
        }
    }

    #[test]
    fn pieces_adjacent_on_both_sides_merge_into_one_copy() {
        use multirail_gpu::CopyKind::{DeviceToDevice as D2D, HostToDevice as H2D};
        let mut c = Vec::new();
        push_merged(&mut c, (D2D, 1000, 5000, 100));
        push_merged(&mut c, (D2D, 1100, 5100, 50)); // continues both: merged
        push_merged(&mut c, (D2D, 1150, 9000, 10)); // dst continues, src does not
        push_merged(&mut c, (D2D, 2000, 9010, 10)); // src continues, dst does not
        push_merged(&mut c, (H2D, 2010, 9020, 10)); // both continue, another kind
        push_merged(&mut c, (H2D, 2020, 9030, 0)); // empty, continues: absorbed
        assert_eq!(c, vec![(D2D, 1000, 5000, 150), (D2D, 1150, 9000, 10), (D2D, 2000, 9010, 10), (H2D, 2010, 9020, 10)]);
    }
}
