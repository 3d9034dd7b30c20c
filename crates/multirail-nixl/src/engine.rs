//! The backend engine behind the C ABI: one multirail [`Agent`] per NIXL backend instance,
//! plus what NIXL's metadata model needs on top of it.
//!
//! NIXL's metadata comes in two parts, and so does ours:
//! - the connection info (`getConnInfo`, read once when the backend is created): the agent's
//!   multirail metadata *without* regions (name, incarnation, rails and their ports);
//! - one public blob per registered region (`getPublicData`): the agent's metadata holding
//!   just that region (its id, bounds, memory kind, access and key).
//!
//! On the loading side the regions of a peer accumulate (`loadRemoteMD`, one call per region
//! of a metadata blob) and are installed into the runtime the next time the peer is used
//! (`connect`, `prepXfer`, `genNotif`). Regions loaded or unloaded after the peer was used
//! change the live peer in place (same incarnation and rails: `Shared::install`): its links,
//! connections and transfers in flight stay. Only new connection info (the peer restarted, or
//! its rails changed) replaces the peer; the old one keeps serving the handles prepared on it
//! and is closed when NIXL disconnects the peer or the engine goes away.
//!
//! Transfers to the agent itself (NIXL's local transfers) are copies in this process: `memcpy`
//! for host memory, a device copy for GPU memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use multirail::peer::Peer;
use multirail::{Agent, Error, Op, XferHandle, XferState};
use multirail_gpu::{CopyKind, Device, Gpu, GpuKind};
use multirail_proto::codec::Status as WireStatus;
use multirail_proto::{Access, AgentMeta, MemType};

use crate::status::*;

/// Peers replaced (new connection info) while handles prepared on them may still be in use;
/// beyond this many per peer the oldest is closed (its handles then fail with a clear error
/// instead of leaking). Region changes never replace a peer (`ensure_peer`).
const MAX_RETIRED: usize = 8;

pub fn log(msg: &str) {
    eprintln!("[multirail-nixl] {msg}");
}

/// A lock of the engine, taken even when a panic poisoned it: every `mr_nixl_*` call catches
/// its panics (lib.rs), and the state under these locks stays consistent at every point a
/// panic can leave it (a peer left `dirty` is installed again), so one panic must not fail
/// every later call of the engine.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The environment variable of the plugin's fault points, for tests: comma-separated
/// `panic:POINT` (a panic at POINT, once) and `sleep:POINT:MS` (a pause at POINT, each time).
/// Points: `release` (in `releaseReqH`, after the transfer was released), `install` (in
/// `prepXfer`'s peer installation, under the engine's peer lock), `close` (while a peer's
/// links close).
pub const ENV_FAULT: &str = "MULTIRAIL_NIXL_FAULT";

fn faults() -> &'static Mutex<(String, Vec<String>)> {
    static F: OnceLock<Mutex<(String, Vec<String>)>> = OnceLock::new();
    F.get_or_init(|| Mutex::new((std::env::var(ENV_FAULT).unwrap_or_default(), Vec::new())))
}

/// Replace the fault points' settings (tests in one process; the environment is read once).
pub fn set_faults(spec: &str) {
    *lock(faults()) = (spec.to_string(), Vec::new());
}

/// A fault point (see [`ENV_FAULT`]); nothing when none is set for `point`.
pub fn fault_point(point: &str) {
    let mut sleep = None;
    {
        let mut g = lock(faults());
        if g.0.is_empty() {
            return;
        }
        let (spec, fired) = &mut *g;
        for f in spec.split(',').map(str::trim) {
            let mut it = f.split(':');
            match (it.next(), it.next(), it.next()) {
                (Some("panic"), Some(p), None) if p == point && !fired.iter().any(|x| x == p) => {
                    fired.push(p.to_string());
                    drop(g);
                    panic!("fault injection ({ENV_FAULT}): panic at {point}");
                }
                (Some("sleep"), Some(p), Some(ms)) if p == point => sleep = ms.parse::<u64>().ok(),
                _ => {}
            }
        }
    }
    if let Some(ms) = sleep {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Close peers' links, with no engine lock held: a link's close waits for its threads.
fn close_all(peers: Vec<Arc<Peer>>) {
    if !peers.is_empty() {
        fault_point("close");
    }
    for p in peers {
        p.close();
    }
}

/// NIXL status of a runtime error.
pub fn status_of(e: &Error) -> i32 {
    match e {
        Error::InvalidArgument(_) | Error::LengthMismatch { .. } => ERR_INVALID_PARAM,
        Error::UnknownPeer(_) | Error::NotRegistered { .. } | Error::OutOfBounds { .. } => ERR_NOT_FOUND,
        Error::Metadata(_) | Error::Decode { .. } | Error::StaleMetadata { .. } => ERR_MISMATCH,
        Error::Remote {
            status: WireStatus::BadKey | WireStatus::UnknownRegion | WireStatus::ReadOnly | WireStatus::AuthFailed, ..
        }
        | Error::Auth { .. } => ERR_NOT_ALLOWED,
        Error::Remote { status: WireStatus::OutOfBounds, .. } => ERR_NOT_FOUND,
        Error::PeerLost { .. } => ERR_REMOTE_DISCONNECT,
        Error::Io {
            kind: std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted,
            ..
        } => ERR_REMOTE_DISCONNECT,
        Error::Unavailable(_) => ERR_NOT_SUPPORTED,
        _ => ERR_BACKEND,
    }
}

/// A peer as NIXL loaded it: its connection info and the regions loaded so far.
struct Remote {
    meta: AgentMeta,
    regions: BTreeMap<u64, multirail_proto::RegionMeta>,
    /// Regions changed since the runtime's peer was (re)installed.
    dirty: bool,
    retired: Vec<Arc<Peer>>,
}

impl Remote {
    /// The retired peers, to close once the engine's lock is released (`close_all`).
    fn take_retired(&mut self) -> Vec<Arc<Peer>> {
        std::mem::take(&mut self.retired)
    }
}

pub struct Engine {
    pub agent: Agent,
    name: String,
    gpu: GpuKind,
    remotes: Mutex<HashMap<String, Remote>>,
    /// Notifications from this agent to itself (local transfers, genNotif to self).
    local_notifs: Mutex<Vec<(String, Vec<u8>)>>,
    /// Regions registered through NIXL: id -> memory kind (for local copies) and the region's
    /// metadata (`getPublicData` of one region costs O(1), not a copy of the agent's metadata
    /// of every region: NIXL asks once per region, which made N registrations O(N^2)).
    mems: Mutex<HashMap<u64, (MemType, multirail_proto::RegionMeta)>>,
    /// This agent's incarnation (its metadata's).
    incarnation: u64,
    /// Transfers smaller than this are polled to completion by checkXfer (`is_small`).
    small_below: u64,
}

/// One of NIXL's meta descriptors as its descriptor vector holds it (the shim hands the vector
/// over in place): address, length, device id, and NIXL's backend metadata pointer (not read).
/// 32 bytes, asserted in shim/plugin.cpp.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaRow {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
    pub md: u64,
}

impl multirail::xfer::Desc for MetaRow {
    #[inline]
    fn span(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
}

/// A prepared transfer.
pub enum Xfer {
    Remote { h: XferHandle, reported: AtomicBool },
    Local { copies: Vec<(u64, u64, u64)>, dst_mem: MemType, src_mem: MemType, dev: u32, done: AtomicBool },
}

fn mem_of(m: i32) -> Result<MemType, Error> {
    match m {
        0 => Ok(MemType::Dram),
        1 => Ok(MemType::Vram),
        other => Err(Error::InvalidArgument(format!("memory type {other} is not DRAM or VRAM (MULTIRAIL moves host and GPU memory)"))),
    }
}

/// The start-up warning of an agent that anyone on the network can use (issue 33): it listens on
/// an address other than loopback (its host or a rail) and has no shared secret. None otherwise.
pub fn open_without_secret(name: &str, secret: bool, host: &str, rails: &[multirail_proto::RailInfo]) -> Option<String> {
    let loopback = |a: &str| a == "localhost" || a.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let mut open: Vec<&str> = std::iter::once(host).chain(rails.iter().map(|r| r.addr.as_str())).filter(|a| !loopback(a)).collect();
    if secret || open.is_empty() {
        return None;
    }
    open.sort_unstable();
    open.dedup();
    Some(format!(
        "agent {name:?} listens on {} without auth_secret: anyone who can reach these addresses can read and write its \
         exported memory (set auth_secret / MULTIRAIL_SECRET on every agent; docs/SECURITY.md)",
        open.join(", ")
    ))
}

impl Engine {
    pub fn new(name: &str, cfg: multirail::Config) -> Result<Engine, Error> {
        let gpu = cfg.staging.gpu;
        let small_below = cfg.planner.stripe_threshold;
        let (host, secret) = (cfg.host.clone(), cfg.secret.is_some());
        let agent = Agent::new(name, cfg)?;
        let incarnation = agent.metadata().incarnation;
        if let Some(msg) = open_without_secret(name, secret, &host, &agent.metadata().rails) {
            eprintln!("multirail: warning: {msg}");
        }
        Ok(Engine {
            agent,
            name: name.to_string(),
            gpu,
            remotes: Mutex::new(HashMap::new()),
            local_notifs: Mutex::new(Vec::new()),
            mems: Mutex::new(HashMap::new()),
            incarnation,
            small_below,
        })
    }

    /// Tiers the agent's rails per memory location (the `affinity` setting, crate::affinity):
    /// a VRAM descriptor on devId K is the engine's location `gpu:K`, host memory `numa:N`.
    /// Nothing is set where nothing is tiered (every rail serves all memory, as before).
    pub fn apply_affinity(
        &self,
        setting: &crate::affinity::Setting,
        rails_auto: bool,
        env: crate::affinity::Env<'_>,
    ) -> Result<(), String> {
        let rails = self.agent.metadata().rails;
        let kind = self.gpu;
        let cuda_uuids = move || -> Option<Vec<String>> {
            // Only the real runtime knows which GPU a CUDA ordinal is (CUDA_DEVICE_ORDER,
            // CUDA_VISIBLE_DEVICES); the stand-in's ordinals are the view's.
            if kind != GpuKind::Cuda {
                return None;
            }
            kind.device_uuids().ok().map(|u| u.iter().map(crate::topo::uuid_text).collect())
        };
        let mut notes = Vec::new();
        let chosen = crate::affinity::resolve(setting, rails_auto, &rails, env, &cuda_uuids, &mut notes)?;
        for n in notes {
            log(&n);
        }
        let Some(c) = chosen else { return Ok(()) };
        let names: Vec<String> = rails.iter().map(|r| r.name.clone()).collect();
        log(&format!("rail choice ({}): {}", c.source, c.describe(&names)));
        self.agent.set_topology(c.tiers, c.cpus).map_err(|e| format!("affinity: {e}"))
    }

    pub fn register(&self, addr: u64, len: u64, dev: u64, mem: i32) -> Result<u64, Error> {
        let mem = mem_of(mem)?;
        let dev = u32::try_from(dev).map_err(|_| Error::InvalidArgument(format!("device id {dev} out of range")))?;
        let region = self.agent.register(addr, len, dev, mem, Access::ReadWrite)?.meta();
        let id = region.id;
        lock(&self.mems).insert(id, (mem, region));
        Ok(id)
    }

    pub fn deregister(&self, id: u64) -> Result<(), Error> {
        lock(&self.mems).remove(&id);
        // At once, whatever handle still holds it: NIXL forgets the registration whatever this
        // returns, and the application may free the memory next.
        self.agent.withdraw(id)
    }

    pub fn conn_info(&self) -> Vec<u8> {
        let mut m = self.agent.metadata();
        m.regions.clear();
        m.encode()
    }

    pub fn public_data(&self, id: u64) -> Result<Vec<u8>, Error> {
        let region = lock(&self.mems).get(&id).map(|(_, r)| r.clone());
        let region = region.ok_or_else(|| Error::InvalidArgument(format!("region {id} is not registered here")))?;
        Ok(AgentMeta { name: self.name.clone(), incarnation: self.incarnation, rails: Vec::new(), regions: vec![region] }.encode())
    }

    fn decode(blob: &[u8]) -> Result<AgentMeta, Error> {
        AgentMeta::decode(blob).map_err(|e| Error::Metadata(format!("not MULTIRAIL metadata: {e}")))
    }

    pub fn load_conn_info(&self, agent: &str, blob: &[u8]) -> Result<(), Error> {
        let meta = Self::decode(blob)?;
        if meta.name != agent {
            return Err(Error::Metadata(format!("connection info names agent {:?}, NIXL loads it for {agent:?}", meta.name)));
        }
        if meta.name == self.name {
            return Err(Error::Metadata("connection info is this agent's own".into()));
        }
        if !meta.regions.is_empty() {
            return Err(Error::Metadata("connection info must not carry regions".into()));
        }
        let mut g = lock(&self.remotes);
        let mut closing = Vec::new();
        if let Some(r) = g.get_mut(agent) {
            if r.meta.incarnation == meta.incarnation && r.meta.rails == meta.rails {
                return Ok(());
            }
            closing = r.take_retired();
        }
        g.insert(agent.to_string(), Remote { meta, regions: BTreeMap::new(), dirty: true, retired: Vec::new() });
        drop(g);
        close_all(closing);
        Ok(())
    }

    pub fn load_remote_md(&self, agent: &str, blob: &[u8]) -> Result<u64, Error> {
        let m = Self::decode(blob)?;
        let mut g = lock(&self.remotes);
        let r = g.get_mut(agent).ok_or_else(|| Error::UnknownPeer(agent.to_string()))?;
        if m.name != agent || m.incarnation != r.meta.incarnation {
            return Err(Error::Metadata(format!(
                "region metadata is from agent {:?} incarnation {:#x}, not {agent:?} incarnation {:#x}",
                m.name, m.incarnation, r.meta.incarnation
            )));
        }
        let [region] = <[_; 1]>::try_from(m.regions)
            .map_err(|v: Vec<_>| Error::Metadata(format!("region metadata holds {} regions, not 1", v.len())))?;
        let id = region.id;
        if r.regions.get(&id) != Some(&region) {
            r.regions.insert(id, region);
            r.dirty = true;
        }
        Ok(id)
    }

    pub fn unload_remote_md(&self, agent: &str, id: u64) {
        if let Some(r) = lock(&self.remotes).get_mut(agent) {
            if r.regions.remove(&id).is_some() {
                r.dirty = true;
            }
        }
    }

    /// Forget a peer: close its links (transfers in flight on them fail) and drop its metadata.
    pub fn disconnect(&self, agent: &str) {
        let removed = lock(&self.remotes).remove(agent);
        let mut closing = removed.map(|mut r| r.take_retired()).unwrap_or_default();
        // The runtime's peer too: out of its table, then closed with no lock held.
        closing.extend(self.agent.shared().peers.write().unwrap_or_else(|p| p.into_inner()).remove(agent));
        close_all(closing);
    }

    /// Install the peer's current regions into the runtime when they changed. The peer of the
    /// same incarnation and rails is updated in place (its links and connections stay; a
    /// handle prepared on a region unloaded since fails its next post). After new connection
    /// info, a new peer takes the old one's place in one step (the table never lacks the
    /// name), and the old one is retired while connected (its transfers finish) or closed.
    /// When the install fails, nothing changed: the old peer stays installed and open (its
    /// transfers go on), and the regions stay dirty, so the next call tries again.
    fn ensure_peer(&self, agent: &str) -> Result<(), Error> {
        let mut g = lock(&self.remotes);
        let r = g.get_mut(agent).ok_or_else(|| Error::UnknownPeer(agent.to_string()))?;
        if !r.dirty && self.agent.has_remote(agent) {
            return Ok(());
        }
        // Dirty until installed: a failure (or a panic) on the way leaves it to the next call.
        r.dirty = true;
        fault_point("install");
        let mut meta = r.meta.clone();
        meta.regions = r.regions.values().cloned().collect();
        let (_, old, removed) = self.agent.shared().replace_remote(meta, None)?;
        let mut closing = Vec::new();
        if let Some(old) = old {
            if old.connected() {
                r.retired.push(old);
                if r.retired.len() > MAX_RETIRED {
                    closing.push(r.retired.remove(0));
                }
            } else {
                closing.push(old);
            }
        }
        r.dirty = false;
        drop(g);
        // Closing removed regions' CUDA IPC mappings waits for this peer's copies in flight:
        // not under `remotes`, which every call to every peer takes.
        removed.finish();
        close_all(closing);
        Ok(())
    }

    pub fn connect(&self, agent: &str) -> Result<(), Error> {
        if agent == self.name {
            return Ok(());
        }
        self.ensure_peer(agent)?;
        self.agent.peer(agent)?.link().map(|_| ())
    }

    pub fn prep(&self, op: i32, lmem: i32, local: &[MetaRow], rmem: i32, remote: &[MetaRow], agent: &str) -> Result<Xfer, Error> {
        let op = match op {
            0 => Op::Read,
            1 => Op::Write,
            other => return Err(Error::InvalidArgument(format!("operation {other} is neither READ nor WRITE"))),
        };
        let (lmem, rmem) = (mem_of(lmem)?, mem_of(rmem)?);
        if agent == self.name {
            let three = |v: &[MetaRow]| v.iter().map(|d| [d.addr, d.len, d.dev]).collect::<Vec<_>>();
            return self.prep_local(op, lmem, &three(local), rmem, &three(remote));
        }
        self.ensure_peer(agent)?;
        let h = self.agent.prepare(op, local, remote, agent, Vec::new())?;
        // NIXL has no stream: the application makes its data ready before it posts, and a
        // post must not wait behind work queued on a GPU's default stream (issue 36 item 7).
        h.set_default_stream_order(false);
        Ok(Xfer::Remote { h, reported: AtomicBool::new(false) })
    }

    /// A transfer to this agent itself: pair the two segmentations into copies now.
    fn prep_local(&self, op: Op, lmem: MemType, local: &[[u64; 3]], rmem: MemType, remote: &[[u64; 3]]) -> Result<Xfer, Error> {
        self.agent.resolve_local(local)?;
        self.agent.resolve_local(remote).map_err(|e| match e {
            Error::NotRegistered { index, addr, len } => Error::OutOfBounds { peer: self.name.clone(), index, addr, len },
            e => e,
        })?;
        let (lt, rt) = (local.iter().map(|d| d[1]).sum::<u64>(), remote.iter().map(|d| d[1]).sum::<u64>());
        if lt != rt {
            return Err(Error::LengthMismatch { local: lt, remote: rt });
        }
        let mut copies = Vec::new();
        let (mut i, mut j, mut oi, mut oj) = (0, 0, 0u64, 0u64);
        while i < local.len() && j < remote.len() {
            let n = (local[i][1] - oi).min(remote[j][1] - oj);
            if n > 0 {
                let (l, r) = (local[i][0] + oi, remote[j][0] + oj);
                copies.push(if op == Op::Read { (l, r, n) } else { (r, l, n) });
            }
            oi += n;
            oj += n;
            if oi == local[i][1] {
                i += 1;
                oi = 0;
            }
            if j < remote.len() && oj == remote[j][1] {
                j += 1;
                oj = 0;
            }
        }
        let (dst_mem, src_mem) = if op == Op::Read { (lmem, rmem) } else { (rmem, lmem) };
        // The device whose copy engine runs the copies: the GPU side's (the local one's if both).
        let vram_side = if lmem == MemType::Vram {
            local
        } else if rmem == MemType::Vram {
            remote
        } else {
            &[]
        };
        let dev = vram_side.first().map_or(0, |d| d[2] as u32);
        Ok(Xfer::Local { copies, dst_mem, src_mem, dev, done: AtomicBool::new(false) })
    }

    fn run_local(&self, copies: &[(u64, u64, u64)], dst_mem: MemType, src_mem: MemType, dev: u32) -> Result<(), Error> {
        if dst_mem == MemType::Dram && src_mem == MemType::Dram {
            for &(d, s, n) in copies {
                // SAFETY: both ranges were checked to lie inside memory registered with this
                // agent when the transfer was prepared; NIXL keeps registrations alive while
                // handles that use them exist. `copy` tolerates overlap.
                unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n as usize) };
            }
            return Ok(());
        }
        let kind = match (src_mem, dst_mem) {
            (MemType::Dram, MemType::Vram) => CopyKind::HostToDevice,
            (MemType::Vram, MemType::Dram) => CopyKind::DeviceToHost,
            _ => CopyKind::DeviceToDevice,
        };
        let gerr = |e: multirail_gpu::DeviceError| Error::Gpu(format!("local copy: {e}"));
        let g = Gpu::open(self.gpu, dev as i32).map_err(|e| Error::Gpu(format!("GPU {dev}: {e}")))?;
        let stream = g.create_stream().map_err(gerr)?;
        let ev = g.create_event().map_err(gerr)?;
        for &(d, s, n) in copies {
            // SAFETY: as above; the device ends were registered as this device's memory.
            unsafe { g.copy_async(kind, d, s, n as usize, &stream) }.map_err(gerr)?;
        }
        g.record(&ev, &stream).map_err(gerr)?;
        g.synchronize(&ev).map_err(gerr)
    }

    /// Post; returns the NIXL status (IN_PROG, SUCCESS or an error).
    pub fn post(&self, x: &Xfer, notif: Option<&[u8]>) -> Result<i32, Error> {
        match x {
            Xfer::Remote { h, reported } => {
                reported.store(false, Ordering::Relaxed);
                // NIXL's `hasNotif` decides, whatever the message: an empty one is delivered.
                h.set_notif(notif.map(<[u8]>::to_vec))?;
                // A small transfer is polled to completion by NIXL's checkXfer, which reads its
                // response itself (no thread wake-up on the round trip); a large one is carried
                // by the rails' threads from the start (`post_handoff`: postXfer sends nothing
                // itself and returns at once), and checkXfer only looks (see `check`).
                let posted = if self.is_small(h) { h.post_polled(None)? } else { h.post_handoff(None)? };
                match posted {
                    XferState::Done => Ok(SUCCESS),
                    XferState::Error => Err(h.error().unwrap_or(Error::Closed)),
                    _ => Ok(IN_PROG),
                }
            }
            Xfer::Local { copies, dst_mem, src_mem, dev, done } => {
                done.store(false, Ordering::SeqCst);
                if let Some(n) = notif {
                    multirail::xfer::check_notif(n)?;
                }
                self.run_local(copies, *dst_mem, *src_mem, *dev)?;
                done.store(true, Ordering::SeqCst);
                if let Some(n) = notif {
                    lock(&self.local_notifs).push((self.name.clone(), n.to_vec()));
                }
                Ok(SUCCESS)
            }
        }
    }

    /// Whether `h` is a small transfer: one that stays on one rail (below the stripe
    /// threshold) and that NIXL's checkXfer polls to completion itself (`post_polled`).
    fn is_small(&self, h: &XferHandle) -> bool {
        h.total_bytes() < self.small_below
    }

    /// (status, error to log once).
    pub fn check(&self, x: &Xfer) -> (i32, Option<Error>) {
        match x {
            Xfer::Remote { h, reported } => match if self.is_small(h) { h.progress() } else { h.state() } {
                XferState::Done => (SUCCESS, None),
                XferState::InProgress => {
                    if !self.is_small(h) {
                        // A caller spinning on checkXfer must not starve the receiver threads
                        // that move a large transfer (2 cores: a busy-polling caller halved
                        // READ throughput): give up the rest of the time slice to them.
                        std::thread::yield_now();
                    }
                    (IN_PROG, None)
                }
                XferState::Idle => (ERR_NOT_POSTED, None),
                XferState::Error => {
                    let e = h.error().unwrap_or(Error::Closed);
                    let first = !reported.swap(true, Ordering::Relaxed);
                    (status_of(&e), first.then_some(e))
                }
            },
            Xfer::Local { done, .. } => (if done.load(Ordering::SeqCst) { SUCCESS } else { ERR_NOT_POSTED }, None),
        }
    }

    pub fn release(&self, x: Xfer) {
        if let Xfer::Remote { h, .. } = x {
            h.release();
        }
        fault_point("release");
    }

    pub fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<(), Error> {
        if agent == self.name {
            lock(&self.local_notifs).push((self.name.clone(), msg.to_vec()));
            return Ok(());
        }
        self.ensure_peer(agent)?;
        self.agent.send_notif(agent, msg)
    }

    pub fn take_notifs(&self) -> Vec<(String, Vec<u8>)> {
        let mut v = std::mem::take(&mut *lock(&self.local_notifs));
        v.extend(self.agent.take_notifs());
        v
    }

    pub fn mem_of_region(&self, id: u64) -> Option<MemType> {
        lock(&self.mems).get(&id).map(|(m, _)| *m)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let retired: Vec<Arc<Peer>> = lock(&self.remotes).drain().flat_map(|(_, mut r)| r.take_retired()).collect();
        close_all(retired);
        // Returns only once nothing of the agent touches registered memory any more.
        self.agent.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_proto::{Access, MemType, RailInfo, RegionKey, RegionMeta};
    use std::sync::atomic::AtomicUsize;

    fn conn_info(name: &str) -> Vec<u8> {
        let rail = RailInfo {
            name: "lo".into(),
            addr: "127.0.0.1".into(),
            prefix_len: 8,
            port: 1,
            speed_mbps: 0,
            mtu: 65536,
            numa: -1,
            rdma_dev: String::new(),
        };
        AgentMeta { name: name.into(), incarnation: 7, rails: vec![rail], regions: Vec::new() }.encode()
    }

    fn region_md(name: &str, id: u64) -> Vec<u8> {
        let r = RegionMeta {
            id,
            base: id << 12,
            len: 4096,
            dev: 0,
            mem: MemType::Dram,
            access: Access::ReadWrite,
            key: RegionKey([id as u8; 16]),
        };
        AgentMeta { name: name.into(), incarnation: 7, rails: Vec::new(), regions: vec![r] }.encode()
    }

    /// Reinstalling a peer whose regions changed used to take it out of the table, then add
    /// the new one: between the two another thread found no such peer (a transfer prepared
    /// then failed with UnknownPeer), and had the add failed (a full table) the old peer was
    /// dropped unclosed. Region changes update the installed peer in place now (issue 36 item
    /// 6): the same peer stays, with the latest regions.
    #[test]
    fn a_peer_being_reinstalled_never_leaves_the_table() {
        let e = Engine::new("nixl-a", multirail::Config::default()).expect("engine");
        e.load_conn_info("peer", &conn_info("peer")).expect("conn info");
        e.ensure_peer("peer").expect("install");
        let first = e.agent.peer("peer").expect("installed");
        let (stop, looks, missing) = (AtomicBool::new(false), AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|sc| {
            sc.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    looks.fetch_add(1, Ordering::Relaxed);
                    if !e.agent.has_remote("peer") {
                        missing.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            for id in 1..=3000 {
                e.load_remote_md("peer", &region_md("peer", id)).expect("region");
                e.unload_remote_md("peer", id - 1);
                e.ensure_peer("peer").expect("reinstall");
            }
            stop.store(true, Ordering::Relaxed);
        });
        let (looks, missing) = (looks.into_inner(), missing.into_inner());
        assert_eq!(missing, 0, "the peer was missing from the table in {missing} of {looks} look-ups");
        assert!(Arc::ptr_eq(&first, &e.agent.peer("peer").expect("installed")), "region changes replaced the peer");
        let regions: Vec<u64> = e.agent.peer("peer").expect("installed").regions().iter().map(|r| r.id).collect();
        assert_eq!(regions, vec![3000]);
    }

    /// Unloading a region closes its CUDA IPC mapping once the copies in flight to that peer
    /// end. That wait ran under `remotes`, the lock of every engine call: a metadata update
    /// of one peer blocked calls to every other peer until its GPU copies finished.
    #[test]
    fn closing_a_removed_regions_ipc_mapping_blocks_no_other_peer() {
        use std::time::Duration;
        let e = Engine::new("nixl-a", multirail::Config::default()).expect("engine");
        for name in ["slow", "other"] {
            e.load_conn_info(name, &conn_info(name)).expect("conn info");
            e.load_remote_md(name, &region_md(name, 1)).expect("region");
            e.ensure_peer(name).expect("install");
        }
        let slow = e.agent.peer("slow").expect("installed");
        let copy = slow.hold_ipc_copy_for_test(1);
        std::thread::scope(|sc| {
            let unload = sc.spawn(|| {
                e.unload_remote_md("slow", 1);
                e.ensure_peer("slow")
            });
            // The update itself is done (region 1 gone) while its mapping waits for the copy.
            let t0 = std::time::Instant::now();
            while !slow.regions().is_empty() && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(5));
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let e = &e;
            sc.spawn(move || {
                e.load_remote_md("other", &region_md("other", 2)).expect("region");
                let _ = tx.send(e.ensure_peer("other"));
            });
            let other = rx.recv_timeout(Duration::from_secs(10));
            drop(copy);
            assert!(matches!(other, Ok(Ok(()))), "another peer's update waited for this peer's GPU copies: {other:?}");
            unload.join().expect("unload").expect("reinstall");
        });
        assert!(slow.regions().is_empty());
        assert_eq!(e.agent.peer("other").expect("installed").regions().len(), 2);
    }
}
