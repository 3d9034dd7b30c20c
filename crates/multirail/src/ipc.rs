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
//! - **Mapping** happens once per (peer, region), at the first transfer that names it, and is
//!   kept until the peer is closed or replaced. If anything fails (another host, IPC off, the
//!   driver refusing, CUDA not opening handles of its own process) the reason is kept and the
//!   transfer is staged over the rails instead.
//! - **Copies** run on one worker thread per peer: its own stream and event, all of a
//!   transfer's copies queued, one event wait, then the notification, then completion.
//!   `cancel` and `close` take the worker's lock, so once they return no copy touches the
//!   application's memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use multirail_gpu::{CopyKind, Device, DevicePtr, Gpu, GpuEvent, GpuStream, IpcHandle};
use multirail_proto::codec::{IpcEntry, RemoteOp, MAX_IPC_REGIONS};
use multirail_proto::{Body, Kind, MemType, RegionKey, Status};

use crate::error::{Error, Result};
use crate::link::Link;
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

/// The target's answer to `IpcReq` (module docs).
pub(crate) fn answer(
    cfg: &crate::config::Config,
    registry: &crate::registry::Registry,
    host: [u8; 16],
    regions: &[(u64, RegionKey)],
) -> Body {
    if !cfg.staging.ipc {
        return refuse(Status::Unexpected, "CUDA IPC is off on this agent (gpu_ipc=False)".into());
    }
    if host != host_id() {
        return refuse(Status::Unexpected, "not on this host: CUDA IPC needs both agents on one host".into());
    }
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
        let entry = export(cfg.staging.gpu, &r);
        match entry {
            Ok(e) => out.push(e),
            Err(m) => return refuse(Status::Unexpected, format!("no IPC handle for region {region}: {m}")),
        }
    }
    Body::IpcHandles(out)
}

/// The IPC handle of the allocation holding GPU region `r`, and where `r` starts in it.
fn export(kind: multirail_gpu::GpuKind, r: &crate::registry::Region) -> std::result::Result<IpcEntry, String> {
    let id = i32::try_from(r.dev).map_err(|_| format!("device id {} out of range", r.dev))?;
    let gpu = Gpu::open(kind, id).map_err(|e| e.to_string())?;
    let (base, alloc_len) = gpu.alloc_range(DevicePtr(r.base)).map_err(|e| e.to_string())?;
    if r.base + r.len > base.0 + alloc_len as u64 {
        return Err(format!("region {} spans more than one allocation", r.id));
    }
    let handle = gpu.ipc_handle(base).map_err(|e| e.to_string())?;
    Ok(IpcEntry { region: r.id, device: r.dev, handle: handle.0, offset: r.base - base.0, alloc_len: alloc_len as u64 })
}

/// Maps a peer's handle on device `e.device` of `kind`.
fn open_entry(kind: multirail_gpu::GpuKind, e: &IpcEntry) -> std::result::Result<Mapped, String> {
    let id = i32::try_from(e.device).map_err(|_| "bad device id".to_string())?;
    let gpu = Gpu::open(kind, id).map_err(|err| format!("GPU {id}: {err}"))?;
    let len = region_room(e.alloc_len, e.offset)?;
    // SAFETY: the handle comes from the peer's live allocation (its IpcHandles answer on the
    // authenticated control connection); a bad one is refused by the device.
    let base = unsafe { gpu.ipc_open(&IpcHandle(e.handle)) }.map_err(|err| format!("cannot open the peer's IPC handle: {err}"))?;
    Ok(Mapped { gpu, base, at: base.0 + e.offset, len })
}

/// Queues every copy of `plan` on the device's stream (made once, kept in `queues`) and waits
/// for them: on return, also on error, no copy runs.
fn run_copies(plan: &IpcPlan, queues: &mut Vec<(i32, GpuStream, GpuEvent)>) -> std::result::Result<(), String> {
    let id = plan.gpu.id();
    if !queues.iter().any(|q| q.0 == id) {
        let s = plan.gpu.create_stream().map_err(|e| e.to_string())?;
        let e = plan.gpu.create_event().map_err(|e| e.to_string())?;
        queues.push((id, s, e));
    }
    let (_, s, e) = queues.iter().find(|q| q.0 == id).expect("made above");
    for &(kind, dst, src, len) in &plan.copies {
        // SAFETY: the local side is registered and held by the transfer, the remote side lies
        // inside the peer's mapped allocation (checked at plan time), and the event wait below
        // ends every copy before the transfer completes or is cancelled.
        if let Err(err) = unsafe { plan.gpu.copy_async(kind, dst, src, len as usize, s) } {
            let _ = plan.gpu.record(e, s).and_then(|_| plan.gpu.synchronize(e));
            return Err(err.to_string());
        }
    }
    plan.gpu.record(e, s).and_then(|_| plan.gpu.synchronize(e)).map_err(|err| err.to_string())
}

/// One peer region mapped into this process.
struct Mapped {
    gpu: Gpu,
    /// Base of our mapping of the peer's allocation (what `ipc_close` takes).
    base: DevicePtr,
    /// Where the region starts in our mapping, and its length.
    at: u64,
    len: u64,
}

/// `Peer::ipc_info`.
#[derive(Debug, Clone, Default)]
pub struct IpcReport {
    pub regions_mapped: usize,
    pub transfers: u64,
    pub bytes: u64,
    /// Why the last transfer that could have used IPC was staged instead (empty: none was).
    pub fallback_reason: String,
}

struct Worker {
    tx: mpsc::Sender<Arc<XferShared>>,
    thread: JoinHandle<()>,
}

/// A peer's IPC state (module docs).
#[derive(Default)]
pub(crate) struct IpcPeer {
    /// By region id: the mapping, or why there is none (not retried for that region).
    maps: Mutex<HashMap<u64, std::result::Result<Mapped, String>>>,
    worker: Mutex<Option<Worker>>,
    /// Held by the worker while it decides on and copies a transfer; `cancel`/`close` take it.
    copying: Arc<Mutex<()>>,
    closing: Arc<AtomicBool>,
    transfers: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    fallback: Mutex<String>,
}

impl IpcPeer {
    /// A plan for a transfer of `pairs` (local address, remote region, offset, len) when every
    /// remote region maps over IPC; None (reason recorded) to stage it over the rails.
    /// `local_is_gpu`: whether a local address is GPU memory (D2D) or host memory (H2D/D2H).
    pub fn plan(
        &self,
        link: &Link,
        keys: &HashMap<u64, RegionKey>,
        op: Op,
        pairs: &[multirail_proto::Pair],
        local_is_gpu: impl Fn(u64) -> bool,
    ) -> Option<IpcPlan> {
        let mut want: Vec<u64> = pairs.iter().map(|p| p.region).collect();
        want.sort_unstable();
        want.dedup();
        if let Err(why) = self.map(link, keys, &want) {
            *self.fallback.lock().expect("ipc lock") = why;
            return None;
        }
        let maps = self.maps.lock().expect("ipc lock");
        let mut gpu: Option<Gpu> = None;
        let mut copies = Vec::with_capacity(pairs.len());
        for p in pairs {
            let Some(Ok(m)) = maps.get(&p.region) else { return None };
            if p.offset + p.len > m.len {
                return None; // resolved against the peer's metadata already; defensive
            }
            let remote = m.at + p.offset;
            let on_gpu = local_is_gpu(p.local);
            copies.push(match (op, on_gpu) {
                (Op::Read, true) => (CopyKind::DeviceToDevice, p.local, remote, p.len),
                (Op::Read, false) => (CopyKind::DeviceToHost, p.local, remote, p.len),
                (Op::Write, true) => (CopyKind::DeviceToDevice, remote, p.local, p.len),
                (Op::Write, false) => (CopyKind::HostToDevice, remote, p.local, p.len),
            });
            gpu.get_or_insert_with(|| m.gpu.clone());
        }
        Some(IpcPlan { gpu: gpu?, copies })
    }

    /// Map every region of `want` not mapped yet (one request for all of them).
    fn map(&self, link: &Link, keys: &HashMap<u64, RegionKey>, want: &[u64]) -> std::result::Result<(), String> {
        let mut maps = self.maps.lock().expect("ipc lock");
        if let Some(Err(why)) = want.iter().find_map(|r| maps.get(r).filter(|m| m.is_err())) {
            return Err(why.clone());
        }
        let ask: Vec<(u64, RegionKey)> =
            want.iter().filter(|r| !maps.contains_key(r)).filter_map(|r| keys.get(r).map(|k| (*r, *k))).collect();
        if ask.is_empty() {
            return Ok(());
        }
        if ask.len() > MAX_IPC_REGIONS {
            return Err(format!("more than {MAX_IPC_REGIONS} GPU regions in one transfer"));
        }
        let kind = link.ctx.cfg.staging.gpu;
        let answer = link.control_call(Body::IpcReq { host: host_id(), regions: ask.clone() }, Kind::IpcHandles);
        let entries = match answer {
            Ok(Body::IpcHandles(es)) if es.len() == ask.len() => es,
            Ok(_) => Err("the peer answered IpcReq with the wrong number of handles".to_string())?,
            // The peer said no (another host, IPC off, no handle): remember it for these regions.
            Err(e @ Error::Remote { .. }) => {
                let why = format!("peer refused CUDA IPC: {e}");
                for (r, _) in &ask {
                    maps.insert(*r, Err(why.clone()));
                }
                return Err(why);
            }
            // Transient (connection trouble): not remembered.
            Err(e) => return Err(format!("CUDA IPC request failed: {e}")),
        };
        let mut first_err = None;
        for e in entries {
            // Regions asked for were not in `maps`: one there now came twice in this answer
            // (mapping it again would leak the first mapping).
            if maps.contains_key(&e.region) {
                first_err.get_or_insert_with(|| format!("the peer sent region {} twice", e.region));
                continue;
            }
            let m = if ask.iter().any(|(r, _)| *r == e.region) {
                open_entry(kind, &e)
            } else {
                Err(format!("the peer sent a handle for region {} it was not asked for", e.region))
            };
            if let Err(why) = &m {
                first_err.get_or_insert_with(|| why.clone());
            }
            maps.insert(e.region, m);
        }
        match first_err {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// Queue a planned transfer on the worker (started on first use).
    pub fn submit(&self, x: Arc<XferShared>) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::PeerLost { peer: x.peer.name().to_string(), reason: "peer closed".into() });
        }
        let mut w = self.worker.lock().expect("ipc lock");
        if w.is_none() {
            let (tx, rx) = mpsc::channel::<Arc<XferShared>>();
            let (copying, closing, transfers, bytes) =
                (self.copying.clone(), self.closing.clone(), self.transfers.clone(), self.bytes.clone());
            let thread = std::thread::Builder::new()
                .name("mr-ipc".into())
                .spawn(move || worker(rx, copying, closing, transfers, bytes))
                .map_err(|e| Error::io("spawn", e))?;
            *w = Some(Worker { tx, thread });
        }
        w.as_ref().expect("started").tx.send(x).map_err(|_| Error::Gpu("the IPC worker stopped".into()))
    }

    /// Abort `x` if it has not run: once this returns, the worker does not touch its memory.
    pub fn cancel(&self, x: &XferShared) {
        let _g = self.copying.lock().expect("ipc lock");
        x.finish(Err(Error::InvalidArgument("transfer handle released while in progress".into())));
    }

    /// Stop the worker (queued transfers fail, a running copy completes first) and unmap.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
        let w = self.worker.lock().expect("ipc lock").take();
        if let Some(w) = w {
            drop(w.tx);
            // The worker itself may drop the last reference to the peer (through a finished
            // transfer): it is between copies then, and must not wait for itself.
            if w.thread.thread().id() != std::thread::current().id() {
                let _ = w.thread.join();
            }
        }
        for (_, m) in self.maps.lock().expect("ipc lock").drain() {
            if let Ok(m) = m {
                // SAFETY: the worker is gone, so no copy uses the mapping.
                let _ = unsafe { m.gpu.ipc_close(m.base) };
            }
        }
    }

    pub fn report(&self) -> IpcReport {
        IpcReport {
            regions_mapped: self.maps.lock().expect("ipc lock").values().filter(|m| m.is_ok()).count(),
            transfers: self.transfers.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
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

fn worker(
    rx: mpsc::Receiver<Arc<XferShared>>,
    copying: Arc<Mutex<()>>,
    closing: Arc<AtomicBool>,
    transfers: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
) {
    // One stream and event per device, made once.
    let mut queues: Vec<(i32, GpuStream, GpuEvent)> = Vec::new();
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
        let r = run_copies(plan, &mut queues);
        drop(g);
        match r {
            Ok(()) => {
                transfers.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(x.total, Ordering::Relaxed);
                let notif = x.notif.lock().expect("xfer lock").clone();
                let r = if notif.is_empty() { Ok(()) } else { x.peer.send_notif(&notif) };
                x.finish(r);
            }
            Err(m) => x.finish(Err(Error::Gpu(format!("CUDA IPC copy failed: {m}")))),
        }
    }
}
