//! A remote agent as seen from here: its metadata, descriptor resolution, and once used, the
//! [`Link`] that carries transfers to it. (The handshake every connection starts with is
//! `net::dial`.)

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use multirail_proto::codec::Status;
use multirail_proto::planner::{pair_rows, pair_segments};
use multirail_proto::{AgentMeta, MemType, Pair, RegionKey, RegionMeta};

use crate::config::Progress;
use crate::ctx::Ctx;
use crate::error::{Error, Result};
use crate::link::{Keys, Link, PeerInfo};
use crate::registry::Region;
use crate::xfer::{Desc, Op, Poster, XferHandle, XferShared};

mod connect;
use connect::{Connector, Job};

/// The link's per-rail and per-peer counters and reports, by their old paths.
pub use crate::link::{PeerCounters, RailIo, RailIoSnapshot, RailReport};

/// Local descriptors as (addr, len), and the registered regions that contain them.
pub type ResolvedLocal = (Vec<(u64, u64)>, Vec<Arc<Region>>);

/// A peer: its metadata and, once used, its link.
/// Where a peer's metadata came from (`Shared::add_remote`, `Shared::add_remote_from_wire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerOrigin {
    /// fetch_remote, add_remote, NIXL, a metadata store: never replaced from the wire.
    App,
    /// A `MetaPut` the peer sent (`Config::accept_metaput`).
    Wire,
}

pub struct Peer {
    pub name: String,
    /// Who installed the metadata: the application, or the peer itself by `MetaPut`.
    pub origin: PeerOrigin,
    /// Its name, incarnation and rails. Its regions are not here (`meta.regions` is empty):
    /// they change while the peer lives (`update_regions`); [`Peer::regions`] has them.
    pub meta: AgentMeta,
    /// Exported regions sorted by base, for resolving remote descriptors: swapped whole by
    /// `update_regions`; a prepare works on the snapshot it took.
    regions: RwLock<Arc<Vec<RegionMeta>>>,
    /// Their keys by region id, shared with the links (updated in place with the regions).
    pub(crate) keys: Arc<Keys>,
    /// Regions removed so far (`update_regions`): a handle prepared before a removal has its
    /// remote regions checked again at its next post (`submit`).
    removals: AtomicU64,
    /// The address its metadata was fetched from; stands in for unspecified rail addresses.
    pub(crate) addr_hint: Option<IpAddr>,
    pub(crate) ctx: Arc<Ctx>,
    link: Mutex<Option<Arc<Link>>>,
    /// A tcp link for GPU memory when the agent's transport cannot take it directly (ucx
    /// without GPUDirect RDMA): staged over the same rails. Opened on first use.
    gpu_link: Mutex<Option<Arc<Link>>>,
    /// Ids of dead connections that carried WRITEs and that the peer has not yet confirmed
    /// fenced. Kept across links: no WRITE goes to the peer again before they are fenced.
    pub(crate) unfenced: Arc<Mutex<Vec<[u8; 16]>>>,
    /// Counters per rail (by the link's rail index), kept across reconnections.
    io: Mutex<Vec<Arc<RailIo>>>,
    /// Counters of the peer as a whole.
    pub counters: Arc<PeerCounters>,
    /// CUDA IPC mappings of the peer's GPU regions, and the copy worker (same host only).
    pub(crate) ipc: crate::ipc::IpcPeer,
    /// Posts to this peer held by the GPU-order waiter, not yet submitted (`Poster::order_waiting`).
    order_waiting: std::sync::atomic::AtomicUsize,
    /// This peer, for the threads it starts (set by `into_arc`).
    me: Weak<Peer>,
    /// What waits for a connection made in the background (`Config::background_connect`).
    pub(crate) connector: Connector,
    /// Held while dialing a link (one dial at a time; the link slots stay free meanwhile).
    dial: Mutex<()>,
    /// Set by `close`: no link is opened any more.
    closed: AtomicBool,
}

/// Regions an in-place update (`Peer::update_regions`) removed from a live peer, whose CUDA
/// IPC mappings are still to be closed: `finish` closes them, and waits for the copies in
/// flight to that peer to end, so it runs with no table lock held (the NIXL engine's `remotes`,
/// the agent's `peers`): other peers' calls must not wait for this peer's GPU copies.
#[must_use = "call finish() once no table lock is held"]
#[derive(Default)]
pub struct Removed(Option<(Arc<Peer>, Vec<u64>)>);

impl Removed {
    pub(crate) fn new(peer: Arc<Peer>, regions: Vec<u64>) -> Removed {
        Removed((!regions.is_empty()).then_some((peer, regions)))
    }

    /// Close the removed regions' CUDA IPC mappings (`IpcPeer::forget`), once no copy to the
    /// peer runs.
    pub fn finish(self) {
        if let Some((peer, regions)) = self.0 {
            peer.ipc.forget(&regions);
        }
    }
}

impl Peer {
    pub fn new(mut meta: AgentMeta, addr_hint: Option<IpAddr>, ctx: Arc<Ctx>) -> Peer {
        let (regions, keys) = sorted_regions(std::mem::take(&mut meta.regions));
        Peer {
            name: meta.name.clone(),
            origin: PeerOrigin::App,
            meta,
            regions: RwLock::new(Arc::new(regions)),
            keys: Arc::new(Keys::new(keys)),
            removals: AtomicU64::new(0),
            addr_hint,
            ctx,
            link: Mutex::new(None),
            gpu_link: Mutex::new(None),
            unfenced: Arc::new(Mutex::new(Vec::new())),
            io: Mutex::new(Vec::new()),
            counters: Arc::new(PeerCounters::default()),
            ipc: crate::ipc::IpcPeer::default(),
            order_waiting: std::sync::atomic::AtomicUsize::new(0),
            me: Weak::new(),
            connector: Connector::default(),
            dial: Mutex::new(()),
            closed: AtomicBool::new(false),
        }
    }

    /// The peer as the agent's table holds it (it knows itself, for the threads it starts).
    pub fn into_arc(self) -> Arc<Peer> {
        Arc::new_cyclic(|me| Peer { me: me.clone(), ..self })
    }

    /// `Config::background_connect`: the calling threads never dial (`connect`).
    fn background(&self) -> bool {
        self.ctx.cfg.background_connect
    }

    /// Start connecting in the background, if not connected (`Config::background_connect`).
    pub fn connect_soon(&self) -> Result<()> {
        match self.live(false)? {
            Some(_) => Ok(()),
            None => self.connector.defer(self, Job::Connect),
        }
    }

    /// The peer's exported regions as known now, sorted by base.
    pub fn regions(&self) -> Arc<Vec<RegionMeta>> {
        self.snapshot().0
    }

    /// The regions and the count of removals they reflect, taken together.
    fn snapshot(&self) -> (Arc<Vec<RegionMeta>>, u64) {
        let g = self.regions.read().unwrap_or_else(|p| p.into_inner());
        (g.clone(), self.removals.load(Ordering::Acquire))
    }

    /// Whether metadata `meta` (from `origin`, fetched from `addr_hint`) describes this peer's
    /// life as it is: same incarnation, rails and origin, and the peer is open. Then only its
    /// regions may differ, and they are updated in place (`update_regions`), its links and
    /// connections kept; anything else is a new peer.
    pub(crate) fn same_life(&self, meta: &AgentMeta, addr_hint: Option<IpAddr>, origin: PeerOrigin) -> bool {
        meta.name == self.name
            && meta.incarnation == self.meta.incarnation
            && meta.rails == self.meta.rails
            && addr_hint == self.addr_hint
            && origin == self.origin
            && !self.closed.load(Ordering::SeqCst)
    }

    /// Make `regions` the peer's exported regions, in place: links and connections stay, new
    /// regions can be prepared and posted at once (their keys reach the links first), removed
    /// ones can no longer be prepared, and a handle prepared on one fails its next post
    /// (`submit`). Returns the ids removed (or changed), whose CUDA IPC mappings the caller
    /// closes (`IpcPeer::forget`: it waits for copies in flight, so not under a table lock).
    pub(crate) fn update_regions(&self, regions: Vec<RegionMeta>) -> Vec<u64> {
        let (sorted, keys) = sorted_regions(regions);
        let mut g = self.regions.write().unwrap_or_else(|p| p.into_inner());
        let now: HashMap<u64, &RegionMeta> = sorted.iter().map(|r| (r.id, r)).collect();
        let removed: Vec<u64> = g.iter().filter(|old| now.get(&old.id) != Some(old)).map(|r| r.id).collect();
        if !removed.is_empty() {
            // Under the write lock: a prepare's snapshot pairs the regions with their count.
            self.removals.fetch_add(1, Ordering::AcqRel);
        }
        self.keys.set(keys);
        *g = Arc::new(sorted);
        removed
    }

    /// Test hook: act as if a CUDA IPC copy into region `region` of this peer were running
    /// (a mapping of it is known, and the IPC worker's `copying` lock is held until the guard
    /// drops), so that closing its mapping (`Removed::finish`) waits. Not for applications.
    #[doc(hidden)]
    pub fn hold_ipc_copy_for_test(&self, region: u64) -> std::sync::MutexGuard<'_, ()> {
        self.ipc.hold_copy_for_test(region)
    }

    /// A post of `x` after regions were removed: every remote region it names must still be
    /// the peer's (checked once per removal, not per post).
    fn check_regions(&self, x: &XferShared) -> Result<()> {
        let (regions, gen) = self.snapshot();
        if x.remote_gen.load(Ordering::Acquire) == gen {
            return Ok(());
        }
        // The whole entry, not only the id: a region whose bounds, key or access changed
        // under the same id was removed too (`update_regions`), and this handle's offsets
        // are from its old bounds.
        let now: HashMap<u64, &RegionMeta> = regions.iter().map(|m| (m.id, m)).collect();
        let then: HashMap<u64, &RegionMeta> = x.remote_regions.get().map(|p| p.iter().map(|m| (m.id, m)).collect()).unwrap_or_default();
        let mut last = None;
        for r in x.runs.iter() {
            if last == Some(r.region) {
                continue;
            }
            let same = match (now.get(&r.region), then.get(&r.region)) {
                (Some(n), Some(t)) => n == t,
                (Some(_), None) => x.remote_regions.get().is_none(),
                (None, _) => false,
            };
            if !same {
                return Err(Error::InvalidArgument(format!(
                    "remote region {} of peer {:?} was removed from its metadata (unloaded, or changed: other bounds, \
                     key or access) after this transfer was prepared: prepare the transfer again",
                    r.region, self.name
                )));
            }
            last = Some(r.region);
        }
        x.remote_gen.store(gen, Ordering::Release);
        Ok(())
    }

    /// Resolve remote (addr, len) descriptors into (region, offset, len) against the peer's
    /// exported regions.
    pub fn resolve<D: Desc>(&self, descs: &[D]) -> Result<Vec<(u64, u64, u64)>> {
        self.resolve_on(&self.regions(), descs)
    }

    fn resolve_on<D: Desc>(&self, regions: &[RegionMeta], descs: &[D]) -> Result<Vec<(u64, u64, u64)>> {
        let mut out = Vec::with_capacity(descs.len());
        let mut look = Lookup::new();
        for (i, d) in descs.iter().enumerate() {
            let (addr, len) = d.span();
            let (k, _) = look.find(regions, addr, len, |r| (r.base, r.len)).ok_or(Error::OutOfBounds {
                peer: self.name.clone(),
                index: i,
                addr,
                len,
            })?;
            out.push((regions[k].id, addr - look.base, len));
        }
        Ok(out)
    }

    pub fn pair(&self, local: &[(u64, u64)], remote: &[(u64, u64, u64)]) -> Result<Vec<Pair>> {
        pair_segments(local, remote).map_err(|(l, r)| Error::LengthMismatch { local: l, remote: r })
    }

    /// The live link, connecting first if needed.
    pub fn link(&self) -> Result<Arc<Link>> {
        self.open_link(&self.link, false)
    }

    /// The tcp link that stages GPU memory for an agent whose transport cannot take it.
    pub(crate) fn gpu_link(&self) -> Result<Arc<Link>> {
        self.open_link(&self.gpu_link, true)
    }

    fn slot(&self, x: &XferShared) -> &Mutex<Option<Arc<Link>>> {
        if x.via_gpu_link() {
            &self.gpu_link
        } else {
            &self.link
        }
    }

    /// The live link of `slot`, without dialing: None when there is none; the link's fatal
    /// error (the peer restarted) when it has one.
    fn live_in(&self, slot: &Mutex<Option<Arc<Link>>>) -> Result<Option<Arc<Link>>> {
        let g = slot.lock().expect("peer lock");
        if self.ctx.closed.load(Ordering::SeqCst) || self.closed.load(Ordering::SeqCst) {
            return Err(Error::PeerLost { peer: self.name.clone(), reason: "agent closed".into() });
        }
        match g.as_ref() {
            Some(l) if l.usable() => Ok(Some(l.clone())),
            Some(l) => match l.fatal.lock().expect("link lock").clone() {
                Some(e) => Err(e),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// `live_in` of the main link, or with `gpu` of the tcp link for GPU memory.
    fn live(&self, gpu: bool) -> Result<Option<Arc<Link>>> {
        self.live_in(if gpu { &self.gpu_link } else { &self.link })
    }

    /// Dial the main link (or with `gpu` the GPU one) if it is not live: the background
    /// connector's dial (`connect`).
    fn connect_slot(&self, gpu: bool) -> Result<Arc<Link>> {
        if gpu {
            self.gpu_link()
        } else {
            self.link()
        }
    }

    fn open_link(&self, slot: &Mutex<Option<Arc<Link>>>, all_tcp: bool) -> Result<Arc<Link>> {
        if let Some(l) = self.live_in(slot)? {
            // A link whose every rail is down is probed from here, unless no caller's thread
            // may do network I/O (background probes readmit its rails: `Link::revive`).
            if !self.background() {
                l.revive()?;
            }
            return Ok(l);
        }
        // One dial at a time; the slot's lock is not held meanwhile, so that polls (`drive`),
        // cancels and `close` never wait for a dial (up to `timeout` per rail).
        let _one = self.dial.lock().expect("peer lock");
        if let Some(l) = self.live_in(slot)? {
            return Ok(l);
        }
        let info = PeerInfo {
            name: &self.name,
            meta: &self.meta,
            keys: &self.keys,
            addr_hint: self.addr_hint,
            ctx: &self.ctx,
            rail_io: &|n| self.rail_io(n),
            unfenced: &self.unfenced,
            counters: &self.counters,
        };
        let l = Link::connect_with(&info, all_tcp)?;
        let mut g = slot.lock().expect("peer lock");
        // Checked under the lock that `close` takes: a link is never kept after the agent's (or
        // this peer's) close has passed this peer.
        if self.ctx.closed.load(Ordering::SeqCst) || self.closed.load(Ordering::SeqCst) {
            drop(g);
            l.close();
            return Err(Error::PeerLost { peer: self.name.clone(), reason: "agent closed".into() });
        }
        let old = g.replace(l.clone());
        drop(g);
        if let Some(old) = old {
            old.close();
        }
        Ok(l)
    }

    /// The counters of rails 0..n (created as needed).
    pub(crate) fn rail_io(&self, n: usize) -> Vec<Arc<RailIo>> {
        let mut g = self.io.lock().expect("peer lock");
        while g.len() < n {
            g.push(Arc::new(RailIo::default()));
        }
        g[..n].to_vec()
    }

    pub fn connected(&self) -> bool {
        self.link.lock().expect("peer lock").as_ref().is_some_and(|l| l.usable())
    }

    /// Post `x`. `will_drive`: the caller waits for it next (`post_wait`) and reads its own
    /// responses; otherwise a parked receiver is kicked to read them.
    pub(crate) fn submit(&self, x: Arc<XferShared>, will_drive: bool) -> Result<()> {
        if x.remote_gen.load(Ordering::Acquire) != self.removals.load(Ordering::Acquire) {
            self.check_regions(&x)?;
        }
        if x.ipc.is_some() {
            return self.ipc.submit(x);
        }
        if self.background() {
            if x.unsettled() {
                match self.live(false)? {
                    Some(main) => self.settle(&x, &main),
                    None => return self.connector.defer(self, Job::Submit(x)),
                }
            }
            // Not connected (yet, or any more): the connector posts it once a dial succeeds;
            // behind what it still holds, so that its notification follows theirs.
            return match self.live(x.via_gpu_link())? {
                Some(link) if !self.connector.busy() => link.submit(x, will_drive),
                _ => self.connector.defer(self, Job::Submit(x)),
            };
        }
        let link = if x.via_gpu_link() { self.gpu_link()? } else { self.link()? };
        link.submit(x, will_drive)
    }

    /// Settle a GPU transfer prepared before the first connection on what the live main link
    /// `main` says (`XferShared::settle`); no network I/O.
    pub(crate) fn settle(&self, x: &XferShared, main: &Link) {
        let via = main.has_ucx_rails() && main.caps().gpu != crate::transport::GpuPath::Direct;
        let vectored_gpu = match via {
            true => self.live(true).ok().flatten().is_some_and(|l| l.vectored_gpu()),
            false => main.vectored_gpu(),
        };
        x.settle(via, vectored_gpu);
    }

    /// See [`Link::drive`]; false when there is no link.
    pub(crate) fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        let link = self.slot(x).lock().expect("peer lock").clone();
        link.is_some_and(|l| l.drive(x, deadline, poll_only))
    }

    pub(crate) fn cancel(&self, x: &Arc<XferShared>) {
        if x.ipc.is_some() {
            return self.ipc.cancel(x);
        }
        if let Some(l) = self.slot(x).lock().expect("peer lock").as_ref() {
            l.cancel(x);
        }
    }

    /// Send a notification and wait for the peer's answer; with `Config::background_connect`
    /// queue it for the connector and return at once (a failure is then reported on stderr).
    pub fn send_notif(&self, msg: &[u8]) -> Result<()> {
        if self.background() {
            // A peer the link already knows is gone (it restarted) is said at once. Connected
            // and nothing waiting in the connector: straight into the link's notifier queue,
            // so a transfer posted next cannot have its notification queued first.
            if let Some(link) = self.live(false)? {
                if !self.connector.busy() && link.send_notif(msg.to_vec(), false).is_ok() {
                    return Ok(());
                }
            }
            return self.connector.defer(self, Job::Notif(msg.to_vec()));
        }
        self.link()?.send_notif(msg.to_vec(), true)
    }

    /// The agent's progress mode and spin budget (for waiting callers).
    pub(crate) fn progress(&self) -> (Progress, Duration) {
        (self.ctx.cfg.progress, self.ctx.cfg.spin)
    }

    pub fn rail_stats(&self) -> Vec<RailReport> {
        match self.link.lock().expect("peer lock").as_ref() {
            Some(l) => l.rail_reports(),
            None => Vec::new(),
        }
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.connector.close(Error::PeerLost { peer: self.name.clone(), reason: "peer closed (removed, replaced or agent closed)".into() });
        self.ipc.close();
        for slot in [&self.link, &self.gpu_link] {
            if let Some(l) = slot.lock().expect("peer lock").take() {
                l.close();
            }
        }
    }

    /// What CUDA IPC did for transfers to this peer.
    pub fn ipc_info(&self) -> crate::ipc::IpcReport {
        self.ipc.report()
    }

    /// Create a transfer handle: resolve, validate and pair all descriptors now, so posting is
    /// cheap. `local_regions` is this agent's registry (`Registry::snapshot`, sorted by base).
    ///
    /// One pass over both lists resolves each row (binary search, skipped while rows stay in
    /// the region last found) and writes the pairs, a contiguous run (adjacent on both sides,
    /// one region each) merged into one pair. When anything is wrong, the checks run again one
    /// at a time (`prepare_checked`) so that the error is the first of, in this order:
    /// a local row not registered, the notification too large, a remote row outside the
    /// peer's regions, a WRITE to a read-only region, unequal totals.
    pub fn prepare<D: Desc>(
        self: &Arc<Self>,
        op: Op,
        local: &[D],
        local_regions: &[Arc<Region>],
        remote: &[D],
        notif: Vec<u8>,
    ) -> Result<XferHandle> {
        if notif.len() > multirail_proto::codec::MAX_NOTIF {
            return self.prepare_checked(op, local, local_regions, remote, notif);
        }
        let (regions, gen) = self.snapshot();
        let mut hold: Vec<Arc<Region>> = Vec::new();
        let (mut llook, mut rlook) = (Lookup::new(), Lookup::new());
        let mut region = 0;
        let write = op == Op::Write;
        let pairs = pair_rows(
            local.len(),
            |i| {
                let (addr, len) = local[i].span();
                let (k, fresh) = llook.find(local_regions, addr, len, |r| (r.base, r.len))?;
                if fresh && local_regions[k].mem == MemType::Vram {
                    return None;
                }
                if fresh && !hold.iter().any(|h| h.id == local_regions[k].id) {
                    hold.push(local_regions[k].clone());
                }
                Some((k as u64, addr, len))
            },
            remote.len(),
            |j| {
                let (addr, len) = remote[j].span();
                let (k, fresh) = rlook.find(&regions, addr, len, |r| (r.base, r.len))?;
                if fresh {
                    let r = &regions[k];
                    if (write && r.access != multirail_proto::Access::ReadWrite) || r.mem == MemType::Vram {
                        return None;
                    }
                    region = r.id;
                }
                Some((region, addr - rlook.base, len))
            },
        );
        let Some(pairs) = pairs else {
            return self.prepare_checked(op, local, local_regions, remote, notif);
        };
        self.connect_at_prepare()?;
        Ok(handle(XferShared::new(op, self.clone(), pairs, notif, hold, None, false), (regions.clone(), gen)))
    }

    /// Strided descriptors (NIXL 1.5's Nx5 form: address, len, device, stride, count; `count`
    /// pieces of `len` bytes, piece k at `address + k * stride`), kept compressed: local row i
    /// and remote row i with the same len and count become ONE run (`Run`) from here through
    /// the planner to the wire (one strided entry of a vectored request), with no per-piece
    /// work at prepare or post. Each row's whole span (first to last piece) must lie in one
    /// region on its side. Lists that do not pair row by row (other lengths or counts, GPU
    /// memory, remote pieces that overlap, counts of 0 with bytes) are expanded into rows and
    /// prepared as `prepare` does, with its checks and errors.
    pub fn prepare_strided(
        self: &Arc<Self>,
        op: Op,
        local: &[[u64; 5]],
        local_regions: &[Arc<Region>],
        remote: &[[u64; 5]],
        notif: Vec<u8>,
    ) -> Result<XferHandle> {
        let expand = |rows: &[[u64; 5]]| -> Vec<[u64; 3]> {
            rows.iter().flat_map(|r| (0..r[4]).map(move |k| [r[0].wrapping_add(k.wrapping_mul(r[3])), r[1], r[2]])).collect()
        };
        let span = |r: &[u64; 5]| r[4].checked_sub(1).and_then(|k| k.checked_mul(r[3])).and_then(|s| s.checked_add(r[1]));
        let mut runs: Vec<multirail_proto::planner::Run> = Vec::with_capacity(local.len());
        let (regions, gen) = self.snapshot();
        let mut hold: Vec<Arc<Region>> = Vec::new();
        let (mut llook, mut rlook) = (Lookup::new(), Lookup::new());
        let write = op == Op::Write;
        let compressed = notif.len() <= multirail_proto::codec::MAX_NOTIF
            && local.len() == remote.len()
            && local.iter().zip(remote).all(|(l, r)| {
                if l[1] != r[1] || l[4] != r[4] {
                    return false;
                }
                if l[1] == 0 || l[4] == 0 {
                    return true; // no bytes
                }
                let (Some(ls), Some(rs)) = (span(l), span(r)) else { return false };
                if l[4] > 1 && r[3] < r[1] {
                    return false; // remote pieces overlap: not one wire entry
                }
                let Some((k, fresh)) = llook.find(local_regions, l[0], ls, |g| (g.base, g.len)) else { return false };
                let lr = &local_regions[k];
                if lr.mem == MemType::Vram {
                    return false;
                }
                if fresh && !hold.iter().any(|h| h.id == lr.id) {
                    hold.push(lr.clone());
                }
                let Some((j, _)) = rlook.find(&regions, r[0], rs, |g| (g.base, g.len)) else { return false };
                let rr = &regions[j];
                if (write && rr.access != multirail_proto::Access::ReadWrite) || rr.mem == MemType::Vram {
                    return false;
                }
                let (lstride, rstride) = if l[4] > 1 { (l[3], r[3]) } else { (0, 0) };
                runs.push(multirail_proto::planner::Run {
                    local: l[0],
                    region: rr.id,
                    offset: r[0] - rr.base,
                    len: l[1],
                    count: l[4],
                    lstride,
                    rstride,
                });
                true
            });
        if !compressed {
            return self.prepare(op, &expand(local), local_regions, &expand(remote), notif);
        }
        runs.retain(|r| r.bytes() > 0);
        self.connect_at_prepare()?;
        Ok(handle(XferShared::with_runs(op, self.clone(), runs, notif, hold, None, false, false, false), (regions.clone(), gen)))
    }

    /// Connect now, so unreachable peers fail at prepare rather than on the first post; in the
    /// background mode only start connecting.
    fn connect_at_prepare(&self) -> Result<()> {
        if self.background() {
            return self.connect_soon();
        }
        self.link().map(|_| ())
    }

    /// `prepare` one check at a time, each over all rows, pairing without merging: the
    /// error (if any) is the first in the order `prepare` documents.
    fn prepare_checked<D: Desc>(
        self: &Arc<Self>,
        op: Op,
        local: &[D],
        local_regions: &[Arc<Region>],
        remote: &[D],
        notif: Vec<u8>,
    ) -> Result<XferHandle> {
        let (local, hold) = resolve_in(local_regions, local)?;
        if notif.len() > multirail_proto::codec::MAX_NOTIF {
            return Err(Error::InvalidArgument(format!(
                "notification of {} bytes exceeds {}",
                notif.len(),
                multirail_proto::codec::MAX_NOTIF
            )));
        }
        let (regions, gen) = self.snapshot();
        let remote = self.resolve_on(&regions, remote)?;
        if op == Op::Write {
            for &(region, _, _) in &remote {
                if let Some(r) = regions.iter().find(|r| r.id == region) {
                    if r.access != multirail_proto::Access::ReadWrite {
                        return Err(Error::Remote {
                            peer: self.name.clone(),
                            status: Status::ReadOnly,
                            msg: format!("region {region} is exported read-only"),
                        });
                    }
                }
            }
        }
        let vram_remote = remote.iter().any(|&(region, _, _)| regions.iter().any(|r| r.id == region && r.mem == MemType::Vram));
        // GPU memory: tcp stages it; another transport takes it directly (GPUDirect RDMA) or
        // hands it to a tcp link over the same rails, which stages it.
        let gpu = vram_remote || hold.iter().any(|r| r.mem == MemType::Vram);
        let pairs = self.pair(&local, &remote)?;
        // Host memory needs no link to be prepared (`connect_at_prepare`). GPU memory needs
        // the link's capabilities: in the background mode, to a peer not connected yet (or whose
        // tcp link for GPU memory is not up), they are settled at the first post (`settle`),
        // so that nothing dials on the caller's thread.
        let bg = self.background();
        let main = match (gpu, bg) {
            (false, _) => None,
            (true, true) => self.live(false)?,
            (true, false) => Some(self.link()?),
        };
        let via_gpu_link = main.as_ref().is_some_and(|l| l.has_ucx_rails() && l.caps().gpu != crate::transport::GpuPath::Direct);
        let unsettled = gpu && bg && (main.is_none() || (via_gpu_link && self.live(true)?.is_none()));
        if bg && (!gpu || unsettled) {
            self.connect_soon()?;
            let runs = pairs.into_iter().map(multirail_proto::planner::Run::from).collect();
            let x = XferShared::with_runs(op, self.clone(), runs, notif, hold, None, false, vram_remote, false);
            if unsettled {
                x.mark_unsettled();
            }
            return Ok(handle(x, (regions.clone(), gen)));
        }
        let link = if via_gpu_link { self.gpu_link()? } else { self.link()? };
        // Remote GPU memory on this host: one device copy by CUDA IPC when it maps.
        let all_remote_vram =
            !remote.is_empty() && remote.iter().all(|&(region, _, _)| regions.iter().any(|r| r.id == region && r.mem == MemType::Vram));
        let ipc = if all_remote_vram && self.ctx.cfg.staging.ipc {
            let vram: Vec<(u64, u64, i32)> =
                hold.iter().filter(|r| r.mem == MemType::Vram).map(|r| (r.base, r.base + r.len, r.dev as i32)).collect();
            let local_dev = |a: u64| vram.iter().find(|&&(b, e, _)| b <= a && a < e).map(|v| v.2);
            self.ipc.plan(&link, &self.keys, op, &pairs, local_dev)
        } else {
            None
        };
        let runs = pairs.into_iter().map(multirail_proto::planner::Run::from).collect();
        let vectored_gpu = link.vectored_gpu();
        Ok(handle(
            XferShared::with_runs(op, self.clone(), runs, notif, hold, ipc, via_gpu_link, vram_remote, vectored_gpu),
            (regions.clone(), gen),
        ))
    }
}

impl Poster for Peer {
    fn name(&self) -> &str {
        &self.name
    }

    fn order_waiting(&self) -> &std::sync::atomic::AtomicUsize {
        &self.order_waiting
    }

    fn submit(&self, x: Arc<XferShared>, will_drive: bool) -> Result<()> {
        Peer::submit(self, x, will_drive)
    }

    fn drive(&self, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        Peer::drive(self, x, deadline, poll_only)
    }

    fn cancel(&self, x: &Arc<XferShared>) {
        Peer::cancel(self, x)
    }

    fn progress(&self) -> (Progress, Duration) {
        Peer::progress(self)
    }

    fn count(&self, ok: bool) {
        let counters = &self.counters;
        match ok {
            true => counters.transfers_done.fetch_add(1, Ordering::Relaxed),
            false => counters.transfers_failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    fn notify_then_finish(&self, x: Arc<XferShared>) {
        match self.link() {
            Ok(l) => l.notify_then_finish(x),
            Err(e) => x.finish(Err(e)),
        }
    }

    fn gpu_kind(&self) -> multirail_gpu::GpuKind {
        self.ctx.cfg.staging.gpu
    }
}

/// Regions sorted by base (the larger first at equal bases), and their keys by id.
fn sorted_regions(mut regions: Vec<RegionMeta>) -> (Vec<RegionMeta>, HashMap<u64, RegionKey>) {
    regions.sort_by_key(|r| (r.base, std::cmp::Reverse(r.len)));
    let keys = regions.iter().map(|r| (r.id, r.key)).collect();
    (regions, keys)
}

/// A handle of a transfer prepared against `regions`, of removal count `gen`.
fn handle(x: Arc<XferShared>, (regions, gen): (Arc<Vec<RegionMeta>>, u64)) -> XferHandle {
    x.remote_gen.store(gen, Ordering::Release);
    let _ = x.remote_regions.set(regions);
    XferHandle(x)
}

/// Binary search for a region containing [addr, addr+len), falling back to a scan when
/// regions overlap. Returns its index in `sorted`.
pub(crate) fn find_region<T>(sorted: &[T], addr: u64, len: u64, span: impl Fn(&T) -> (u64, u64)) -> Option<usize> {
    let end = addr.checked_add(len)?;
    let idx = sorted.partition_point(|r| span(r).0 <= addr);
    if idx > 0 {
        let (b, l) = span(&sorted[idx - 1]);
        if end <= b.saturating_add(l) {
            return Some(idx - 1);
        }
    }
    sorted[..idx].iter().rposition(|r| {
        let (b, l) = span(r);
        end <= b.saturating_add(l)
    })
}

/// [`find_region`] for runs of rows: the search is skipped while rows stay inside the region
/// last found and below the next region's base (where `find_region` would find it too).
pub(crate) struct Lookup {
    /// The region last found: index, base, end, and the base of the one after it.
    idx: usize,
    pub base: u64,
    end: u64,
    next: u64,
}

impl Lookup {
    pub fn new() -> Lookup {
        Lookup { idx: 0, base: u64::MAX, end: 0, next: 0 }
    }

    /// `find_region`'s answer, and whether it was searched for (the region changed) rather
    /// than the last one's again. `base` is the found region's base.
    #[inline]
    pub fn find<T>(&mut self, sorted: &[T], addr: u64, len: u64, span: impl Fn(&T) -> (u64, u64)) -> Option<(usize, bool)> {
        let end = addr.checked_add(len)?;
        if self.base <= addr && end <= self.end && addr < self.next {
            return Some((self.idx, false));
        }
        let k = find_region(sorted, addr, len, &span)?;
        let (b, l) = span(&sorted[k]);
        let next = sorted.get(k + 1).map_or(u64::MAX, |r| span(r).0);
        *self = Lookup { idx: k, base: b, end: b.saturating_add(l), next };
        Some((k, true))
    }
}

/// Resolve local descriptors against `regions` (sorted by base): every one must lie inside a
/// registered region. Returns the (addr, len) list and the regions to hold.
pub(crate) fn resolve_in<D: Desc>(regions: &[Arc<Region>], descs: &[D]) -> Result<ResolvedLocal> {
    let mut hold: Vec<Arc<Region>> = Vec::new();
    let mut out = Vec::with_capacity(descs.len());
    let mut look = Lookup::new();
    for (i, d) in descs.iter().enumerate() {
        let (addr, len) = d.span();
        let (k, fresh) = look.find(regions, addr, len, |r| (r.base, r.len)).ok_or(Error::NotRegistered { index: i, addr, len })?;
        if fresh && !hold.iter().any(|h| h.id == regions[k].id) {
            hold.push(regions[k].clone());
        }
        out.push((addr, len));
    }
    Ok((out, hold))
}

#[cfg(test)]
mod tests {
    use super::{find_region, Lookup};

    /// The lookup that `prepare` uses for runs of rows answers exactly as `find_region`, also
    /// with overlapping, nested, adjacent and duplicate-base regions, empty rows and rows
    /// whose end overflows.
    #[test]
    fn lookup_answers_as_find_region() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut total_hits = 0;
        for _ in 0..200 {
            let mut regions: Vec<(u64, u64)> = (0..1 + rand(6)).map(|_| (rand(64) * 16, 1 + rand(96))).collect();
            regions.sort_by_key(|&(b, l)| (b, std::cmp::Reverse(l)));
            let (mut look, mut end, mut hits) = (Lookup::new(), 0u64, 0);
            for _ in 0..300 {
                // Mostly runs (a row starting where the last one ended), then jumps.
                let (addr, len) = match rand(20) {
                    0 => (u64::MAX - rand(4), rand(8)),
                    1..=12 => (end, rand(24)),
                    _ => (rand(1100), rand(40)),
                };
                end = addr.saturating_add(len);
                let want = find_region(&regions, addr, len, |r| *r);
                let got = look.find(&regions, addr, len, |r| *r);
                hits += got.is_some_and(|(_, searched)| !searched) as usize;
                let got = got.map(|(k, _)| k);
                assert_eq!(got, want, "row ({addr}, {len}) in {regions:?}");
                if let Some(k) = got {
                    assert_eq!(look.base, regions[k].0);
                }
            }
            total_hits += hits;
        }
        assert!(total_hits > 1000, "the fast path was taken {total_hits} times");
    }
}
