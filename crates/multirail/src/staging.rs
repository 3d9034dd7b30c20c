//! GPU memory on byte-stream rails (issue 10): every connection that carries VRAM stages it
//! through a bounded pool of pinned bounce buffers, with `multirail-gpu`'s pipelined executor
//! (D2H of piece k+1, the wire for piece k and the H2D of piece k-1 at once).
//!
//! # The pinned budget (issue 35 defect 6, issue 33 item 5)
//! Pinned memory is one process-wide budget of at most [`pinned_max`] bytes
//! (`StagingConfig::pinned_max`, the agent's `staging_pinned_max`; the agent made last sets it
//! for the process). Pools (`buffers x buffer_size`, of one device, with their stream and
//! events) are pinned by [`prewarm`], which an agent calls when a GPU region is registered:
//! per NUMA node of its rails' NICs, a pool per direction for each connection its rails open,
//! as far as the budget allows. Connections *borrow* pools ([`Stagers`]): an idle pool of
//! their device and direction, preferably of their NIC's node and their shape (so a connection
//! may get fewer or smaller buffers than it is configured for). A connection keeps its pool between requests, but a pool it holds
//! idle (no copy running, nothing queued) is taken back by a connection that waits for one, so
//! an idle connection never starves a busy one. With no pool free, a connection waits, for as
//! long as its request's tick allows (the transfer's timeout); if none comes back within
//! [`GROW_AFTER`] and the budget has room, one more pool is pinned ([`pinned_on_demand`]
//! counts these: a warm-up that covers the load makes none). Nothing is ever pinned beyond the
//! budget, and nothing is unpinned on the data path: a connection that closes gives its pools
//! back idle (`cudaFreeHost` can wait for the whole device, the application's kernels
//! included); only a budget lowered below what is pinned frees pools, idle ones at once and
//! lent ones when they come back.
//!
//! The totals of every connection on a rail (initiator side) or served connection (target
//! side) add up in one [`StageStats`], which `rail_stats()` / `served_stats()` and the bench
//! report.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use multirail_gpu::{DevicePtr, Gpu, GpuKind, PipelineError, PoolConfig, Role, Src, StageTotal, Staged, Wire};

use crate::wire::{self, Inbound, WireError};

/// Which device kind and pool shape a process stages with (`Config::gpu`, `Config::staging`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    pub gpu: GpuKind,
    pub pool: PoolConfig,
    /// Hand out (as a target) and use (as an initiator) CUDA IPC handles between agents on one
    /// host (crate::ipc).
    pub ipc: bool,
    /// The process-wide cap on pinned staging memory, in bytes (module docs; at least a pool per
    /// direction).
    pub pinned_max: u64,
}

/// Default process-wide cap on pinned staging memory: 64 pools of the default shape.
pub const DEFAULT_PINNED_MAX: u64 = 256 << 20;

impl Default for StagingConfig {
    fn default() -> Self {
        // 4 x 1 MiB per connection and direction: one piece per default planner chunk (a piece
        // never spans chunks, so larger buffers would only pin more), few enough copy launches
        // that their ~10 us each cost under 20 % of a 25 GB/s copy engine, and the pipeline runs
        // across chunks (no fill or drain at each). 4 MiB of pinned memory per pool.
        StagingConfig {
            gpu: GpuKind::Cuda,
            pool: PoolConfig { buffers: 4, buffer_size: 1 << 20 },
            ipc: true,
            pinned_max: DEFAULT_PINNED_MAX,
        }
    }
}

/// How long a connection waits for a pool to come back before the budget pins another (when
/// it has room).
pub const GROW_AFTER: Duration = Duration::from_millis(50);

/// What tells pools apart: (device kind, device, direction, NUMA node of its buffers, shape).
type Key = (GpuKind, u32, Role, Option<i32>, PoolConfig);

/// A pinned pool and what it is.
struct Pool {
    key: Key,
    st: Staged<Gpu>,
}

/// A connection's hold on a pool: the budget reaches it through a `Weak` to take it back while
/// idle (the connection's stats lose its bytes then).
struct Held {
    pool: Pool,
    stats: Arc<StageStats>,
    /// The serving side's peer it is held for ([`Stagers::for_peer`]), counted in
    /// `Budget::held_by` while held.
    owner: Option<u64>,
}

type Slot = Mutex<Option<Held>>;

/// The process-wide budget (module docs).
struct Budget {
    cap: u64,
    /// Bytes of every pool alive: idle and lent.
    pinned: u64,
    /// The key of every pool alive (and of those being pinned).
    alive: Vec<Key>,
    idle: Vec<Pool>,
    lent: Vec<Weak<Slot>>,
    /// What each live agent's registrations asked the warm-up for: (agent, key, pools). The
    /// warm-up of a key pins until the pools alive reach the sum over agents (within the cap).
    claims: Vec<(u64, Key, usize)>,
    /// Pools held by connections served for each peer (by [`Stagers::for_peer`]'s tag).
    held_by: Vec<(u64, usize)>,
    /// Peers with a served connection waiting for a pool of a key (one entry per waiter).
    waiting_for: Vec<(u64, Key)>,
}

struct Shared {
    budget: Mutex<Budget>,
    /// Signalled when a pool comes back or a holder's pool may have become idle.
    returned: Condvar,
    /// Connections waiting for a pool (read without the lock after every staged request).
    waiting: AtomicUsize,
    on_demand: AtomicU64,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| Shared {
        budget: Mutex::new(Budget {
            cap: DEFAULT_PINNED_MAX,
            pinned: 0,
            alive: Vec::new(),
            idle: Vec::new(),
            lent: Vec::new(),
            claims: Vec::new(),
            held_by: Vec::new(),
            waiting_for: Vec::new(),
        }),
        returned: Condvar::new(),
        waiting: AtomicUsize::new(0),
        on_demand: AtomicU64::new(0),
    })
}

fn lock_budget() -> MutexGuard<'static, Budget> {
    shared().budget.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lock_slot(s: &Slot) -> MutexGuard<'_, Option<Held>> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Budget {
    /// Removes one pool of `key` from the live count (it is being freed or was never made).
    fn forget(&mut self, key: &Key, bytes: u64) {
        if let Some(i) = self.alive.iter().position(|k| k == key) {
            self.alive.swap_remove(i);
        }
        self.pinned -= bytes;
    }

    fn held(&self, owner: u64) -> usize {
        self.held_by.iter().find(|h| h.0 == owner).map_or(0, |h| h.1)
    }

    fn count_held(&mut self, owner: Option<u64>, up: bool) {
        let Some(o) = owner else { return };
        match self.held_by.iter().position(|h| h.0 == o) {
            Some(i) if up => self.held_by[i].1 += 1,
            Some(i) => {
                self.held_by[i].1 = self.held_by[i].1.saturating_sub(1);
                if self.held_by[i].1 == 0 {
                    self.held_by.swap_remove(i);
                }
            }
            None if up => self.held_by.push((o, 1)),
            None => {}
        }
    }

    /// Whether `owner` (a peer served here) holds its share of `want`'s pools already while a
    /// peer that holds fewer waits for one (issue 33 item 5: one peer cannot hold the whole
    /// budget): the share is the pools alive of that device and direction divided by the peers
    /// that hold or wait for them, rounded up. Only a peer holding more than a waiting one
    /// yields, so the peer holding least is never held back (no two peers wait on each other).
    fn over_share(&self, want: &Key, owner: u64) -> bool {
        let same = |k: &Key| k.0 == want.0 && k.1 == want.1 && k.2 == want.2;
        let mine = self.held(owner);
        if !self.waiting_for.iter().any(|(o, k)| *o != owner && same(k) && self.held(*o) < mine) {
            return false;
        }
        let mut peers: Vec<u64> = self.waiting_for.iter().filter(|(_, k)| same(k)).map(|w| w.0).collect();
        peers.extend(self.held_by.iter().filter(|h| h.1 > 0).map(|h| h.0));
        peers.push(owner);
        peers.sort_unstable();
        peers.dedup();
        let pools = self.alive.iter().filter(|k| same(k)).count();
        mine >= pools.div_ceil(peers.len()).max(1)
    }

    /// Reserves room for one pool of `key` when the budget has it.
    fn reserve(&mut self, key: Key) -> bool {
        let bytes = key.4.bytes();
        if self.pinned + bytes > self.cap {
            return false;
        }
        self.pinned += bytes;
        self.alive.push(key);
        true
    }

    /// Idle pools beyond the cap, taken out to be freed (outside the lock).
    fn over_cap(&mut self) -> Vec<Pool> {
        let mut out = Vec::new();
        while self.pinned > self.cap {
            let Some(p) = self.idle.pop() else { break };
            self.forget(&p.key, p.key.4.bytes());
            out.push(p);
        }
        out
    }
}

/// Sets the process-wide cap on pinned staging memory (module docs). Idle pools beyond it are
/// freed now; lent ones when they come back.
pub fn set_pinned_max(cap: u64) {
    let freed = {
        let mut b = lock_budget();
        b.cap = cap;
        b.over_cap()
    };
    drop(freed); // each waits for its stream, then frees its pinned buffers
    shared().returned.notify_all();
}

/// The process-wide cap on pinned staging memory.
pub fn pinned_max() -> u64 {
    lock_budget().cap
}

/// Pinned bytes of every staging pool alive in this process (idle and lent): never above
/// [`pinned_max`].
pub fn pinned_bytes() -> u64 {
    lock_budget().pinned
}

/// Pinned bytes held by idle pools (reported by `gpu.info` as `idle_pool_bytes`).
pub fn idle_pool_bytes() -> u64 {
    lock_budget().idle.iter().map(|p| p.st.pool_bytes()).sum()
}

/// Pools pinned on the data path (a connection found none free within [`GROW_AFTER`] and the
/// budget had room): zero when the warm-up covers the load.
pub fn pinned_on_demand() -> u64 {
    shared().on_demand.load(Ordering::Relaxed)
}

/// A new pool whose pinned buffers come from `node` (the NUMA node of the rail's NIC, issue
/// 34 item 3), not from whichever thread first needed them: the allocation runs under a
/// thread policy preferring `node` (`cudaHostAlloc` touches and pins its pages at once), and
/// each buffer's range then carries that policy itself (`numa::prefer_node`, for pages not
/// yet touched). `None`: placed as before (first touch). Its room in the budget is reserved
/// already; on failure it is given back.
fn new_pool(key: Key) -> Result<Pool, StageError> {
    let made = (|| {
        let (kind, dev, role, node, shape) = key;
        let id = i32::try_from(dev).map_err(|_| StageError::Device(format!("device id {dev} out of range")))?;
        let gpu = Gpu::open(kind, id).map_err(|e| StageError::Device(e.to_string()))?;
        let mut st =
            crate::numa::with_preferred_node(node, || Staged::new(gpu, role, shape)).map_err(|e| StageError::Device(e.to_string()))?;
        if let Some(n) = node {
            for (p, len) in st.pinned_ranges() {
                // Best effort: a mapping the kernel will not take a policy for (a driver's) keeps
                // the placement the thread policy gave it.
                crate::numa::prefer_node(p, len, n);
            }
        }
        st.keep_ops(false);
        Ok(Pool { key, st })
    })();
    if made.is_err() {
        lock_budget().forget(&key, key.4.bytes());
        shared().returned.notify_all();
    }
    made
}

/// How well a pool of `have` suits a connection that wants `want`: None when it cannot serve
/// it (another device or direction); more is better (the NIC's node first, then the shape).
///
/// Directions do not share pools: a sender holds its pool until the peer's receiver has taken
/// its bytes, so senders holding every pool of a budget that receivers also draw from could
/// each wait on a receiver that waits for a pool (two agents in one process, or two processes
/// sending to each other). Receivers only ever wait for senders that hold a pool already.
fn suits(have: &Key, want: &Key) -> Option<u8> {
    (have.0 == want.0 && have.1 == want.1 && have.2 == want.2).then_some(2 * u8::from(have.3 == want.3) + u8::from(have.4 == want.4))
}

/// Gives a pool back to the budget (idle: no copy runs on it), or frees it when the budget is
/// over its cap (it was lowered meanwhile).
fn give_back(pool: Pool) {
    let mut b = lock_budget();
    if b.pinned > b.cap {
        b.forget(&pool.key, pool.key.4.bytes());
        drop(b);
        drop(pool);
    } else {
        b.idle.push(pool);
        drop(b);
    }
    shared().returned.notify_all();
}

/// The best pool for `want` that can be had without waiting: an idle one, or one a connection
/// holds idle (taken back from it).
fn take_ready(b: &mut Budget, want: &Key) -> Option<Pool> {
    let best = b.idle.iter().enumerate().filter_map(|(i, p)| Some((suits(&p.key, want)?, i))).max();
    if let Some((_, i)) = best {
        return Some(b.idle.swap_remove(i));
    }
    b.lent.retain(|w| w.strong_count() > 0);
    let mut taken = None;
    for w in &b.lent {
        let Some(slot) = w.upgrade() else { continue };
        // Busy (its connection is using it right now): not this one.
        let Ok(mut g) = slot.try_lock() else { continue };
        if g.as_ref().is_some_and(|h| suits(&h.pool.key, want).is_some() && h.pool.st.is_idle()) {
            let h = g.take().expect("checked");
            h.stats.pool_bytes.fetch_sub(h.pool.st.pool_bytes(), Ordering::Relaxed);
            taken = Some(h);
            break;
        }
    }
    let h = taken?;
    b.count_held(h.owner, false);
    Some(h.pool)
}

/// A pool for a connection that wants `want` in `role` (module docs): waits, calling `tick`
/// between waits (its error ends the wait), while none is free.
fn borrow(want: Key, owner: Option<u64>, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<Pool, StageError> {
    let sh = shared();
    let since = Instant::now();
    let mut b = lock_budget();
    loop {
        // A peer holding its share while another peer waits waits too (no pool of its own yet
        // pinned on demand either): what it would have taken goes to the others.
        let capped = owner.is_some_and(|o| b.over_share(&want, o));
        if !capped {
            if let Some(p) = take_ready(&mut b, &want) {
                b.count_held(owner, true);
                return Ok(p);
            }
        }
        let of_device = b.alive.iter().any(|k| suits(k, &want).is_some());
        // Pin one more when none of this device exists (no warm-up could pin one) or none came
        // back in time, within the budget.
        if !capped && (!of_device || since.elapsed() >= GROW_AFTER) && b.reserve(want) {
            b.count_held(owner, true);
            drop(b);
            if of_device {
                sh.on_demand.fetch_add(1, Ordering::Relaxed);
            }
            return new_pool(want).inspect_err(|_| lock_budget().count_held(owner, false));
        }
        if !of_device && b.cap < want.4.bytes() {
            return Err(StageError::Device(format!(
                "the pinned staging budget ({} bytes, staging_pinned_max) is smaller than one pool ({} bytes)",
                b.cap,
                want.4.bytes()
            )));
        }
        if !of_device {
            // The budget is full of other devices' (or the other direction's) pools: free an
            // idle one to make room (a budget too small for every device in use).
            if let Some(i) = b.idle.iter().position(|p| suits(&p.key, &want).is_none()) {
                let p = b.idle.swap_remove(i);
                b.forget(&p.key, p.key.4.bytes());
                drop(b);
                drop(p);
                b = lock_budget();
                continue;
            }
        }
        sh.waiting.fetch_add(1, Ordering::AcqRel);
        if let Some(o) = owner {
            b.waiting_for.push((o, want));
        }
        let (mut g, _) = sh.returned.wait_timeout(b, Duration::from_millis(10)).unwrap_or_else(PoisonError::into_inner);
        if let Some(o) = owner {
            if let Some(i) = g.waiting_for.iter().position(|w| w.0 == o && w.1 == want) {
                g.waiting_for.swap_remove(i);
            }
        }
        sh.waiting.fetch_sub(1, Ordering::AcqRel);
        drop(g);
        tick(true).map_err(|r| StageError::Wire(WireError::GaveUp(r)))?;
        b = lock_budget();
    }
}

/// Pins, ahead of the first transfer, `per_role` pools of each direction for agent `owner`'s
/// connections on device `dev`, with their buffers on `node`, the directions in turn, as far as
/// the budget allows, so that no transfer pins memory. Agents add up: a key is warmed until
/// the pools alive reach the sum of every live agent's claim on it ([`release`] drops an
/// agent's claims); asking again is a no-op. Registration of a GPU region calls it per NUMA
/// node of its rails' NICs (`node`) with the number of connections those rails open.
pub fn prewarm(cfg: StagingConfig, dev: u32, per_role: usize, node: Option<i32>, owner: u64) -> Result<(), StageError> {
    let keys = [Role::Sender, Role::Receiver].map(|role| (cfg.gpu, dev, role, node, cfg.pool));
    let mut wanted = [0; 2];
    {
        let mut b = lock_budget();
        for (w, key) in wanted.iter_mut().zip(keys) {
            match b.claims.iter_mut().find(|c| c.0 == owner && c.1 == key) {
                Some(c) => c.2 = per_role,
                None => b.claims.push((owner, key, per_role)),
            }
            *w = b.claims.iter().filter(|c| c.1 == key).map(|c| c.2).sum();
        }
    }
    for _ in 0..wanted.iter().copied().max().unwrap_or(0) {
        for (key, want) in keys.iter().zip(wanted) {
            {
                let mut b = lock_budget();
                if b.alive.iter().filter(|k| *k == key).count() >= want {
                    continue;
                }
                if !b.reserve(*key) {
                    return Ok(()); // the budget is spent
                }
            }
            give_back(new_pool(*key)?);
        }
    }
    Ok(())
}

/// Drops agent `owner`'s warm-up claims (it closed): its pools stay pinned, idle, for the next.
pub fn release(owner: u64) {
    lock_budget().claims.retain(|c| c.0 != owner);
}

/// Stage totals of a rail (or of a served peer and rail), all connections together.
#[derive(Debug, Default)]
pub struct StageStats {
    /// [D2H, wire, H2D]: operations, bytes, nanoseconds busy.
    ops: [AtomicU64; 3],
    bytes: [AtomicU64; 3],
    busy_ns: [AtomicU64; 3],
    /// Chunks staged (each one planner chunk or served request).
    pub chunks: AtomicU64,
    /// Pinned bytes held by the pools of live connections.
    pub pool_bytes: AtomicU64,
    /// Segments (chunks, requests) that entered a pipeline still busy with the ones before
    /// them: no fill or drain at their boundary.
    pub overlapped: AtomicU64,
    /// Pools borrowed by connections (each is `buffers x buffer_size` of pinned memory, from the
    /// process's budget: module docs). A connection borrows again after another connection
    /// took back the pool it held idle.
    pub pools: AtomicU64,
}

/// A copy of [`StageStats`] for reporting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageReport {
    pub ops: [u64; 3],
    pub bytes: [u64; 3],
    pub busy_ns: [u64; 3],
    pub chunks: u64,
    pub pool_bytes: u64,
    pub pools: u64,
    pub overlapped: u64,
}

/// Stage names in the order of the arrays above.
pub const STAGES: [&str; 3] = ["d2h", "wire", "h2d"];

impl StageStats {
    fn add(&self, before: &[StageTotal; 3], after: &[StageTotal; 3], chunk: bool) {
        for i in 0..3 {
            self.ops[i].fetch_add(after[i].ops - before[i].ops, Ordering::Relaxed);
            self.bytes[i].fetch_add(after[i].bytes - before[i].bytes, Ordering::Relaxed);
            let ns = after[i].busy.saturating_sub(before[i].busy).as_nanos() as u64;
            self.busy_ns[i].fetch_add(ns, Ordering::Relaxed);
        }
        if chunk {
            self.chunks.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn report(&self) -> StageReport {
        let get = |a: &[AtomicU64; 3]| [0, 1, 2].map(|i| a[i].load(Ordering::Relaxed));
        StageReport {
            ops: get(&self.ops),
            bytes: get(&self.bytes),
            busy_ns: get(&self.busy_ns),
            chunks: self.chunks.load(Ordering::Relaxed),
            pool_bytes: self.pool_bytes.load(Ordering::Relaxed),
            pools: self.pools.load(Ordering::Relaxed),
            overlapped: self.overlapped.load(Ordering::Relaxed),
        }
    }
}

/// Why a staged chunk failed.
#[derive(Debug)]
pub enum StageError {
    /// The socket failed (or the tick gave up): the rail's usual failure path.
    Wire(WireError),
    /// The device failed: opening it, allocating the pool, a copy.
    Device(String),
}

impl std::fmt::Display for StageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageError::Wire(e) => write!(f, "{e}"),
            StageError::Device(m) => write!(f, "GPU staging failed: {m}"),
        }
    }
}

type Tick<'a> = &'a mut dyn FnMut(bool) -> Result<(), String>;

/// The sending half of a connection as a staging wire.
pub struct SockOut<'a> {
    pub s: &'a mut TcpStream,
    pub tick: Tick<'a>,
    err: Option<WireError>,
    /// Bytes written so far (preambles and payload): after a device error, where the stream
    /// stopped (see the tcp transport's `stream_device_failed`).
    pub sent: u64,
}

impl<'a> SockOut<'a> {
    pub fn new(s: &'a mut TcpStream, tick: Tick<'a>) -> Self {
        SockOut { s, tick, err: None, sent: 0 }
    }
}

impl Wire for SockOut<'_> {
    fn send(&mut self, buf: &[u8]) -> std::io::Result<()> {
        wire::write_full(self.s, &[buf], self.tick).map_err(|e| {
            let m = e.to_string();
            self.err = Some(e);
            std::io::Error::other(m)
        })?;
        self.sent += buf.len() as u64;
        Ok(())
    }
    fn recv(&mut self, _buf: &mut [u8]) -> std::io::Result<()> {
        Err(std::io::Error::other("the sending half of a connection cannot receive"))
    }
}

/// The receiving half of a connection (with its read-ahead) as a staging wire.
pub struct SockIn<'a> {
    pub s: &'a mut TcpStream,
    pub inb: &'a mut Inbound,
    pub tick: Tick<'a>,
    err: Option<WireError>,
    /// Bytes received so far (what is left of a payload a device error cut short is known).
    got: u64,
}

impl<'a> SockIn<'a> {
    pub fn new(s: &'a mut TcpStream, inb: &'a mut Inbound, tick: Tick<'a>) -> Self {
        SockIn { s, inb, tick, err: None, got: 0 }
    }

    /// Bytes received through this wire so far.
    pub fn received(&self) -> u64 {
        self.got
    }
}

impl Wire for SockIn<'_> {
    fn send(&mut self, _buf: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::other("the receiving half of a connection cannot send"))
    }
    fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inb.read_into(self.s, buf, self.tick).map_err(|e| {
            let m = e.to_string();
            self.err = Some(e);
            std::io::Error::other(m)
        })?;
        self.got += buf.len() as u64;
        Ok(())
    }
}

/// The staging pools one connection has borrowed (module docs).
pub struct Stagers {
    cfg: StagingConfig,
    stats: Arc<StageStats>,
    /// The NUMA node of the rail's NIC, where this connection's pools should be (None: unknown).
    node: Option<i32>,
    /// (device, role) → that direction's pool on that device, while the budget has not taken it
    /// back (an empty slot borrows again on next use).
    sides: Vec<(u32, Role, Arc<Slot>)>,
    /// The peer served through these pools (a hash of its `fanin::peer_key`; None: an
    /// initiator's own connection, not capped per peer).
    owner: Option<u64>,
}

impl std::fmt::Debug for Stagers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stagers").field("cfg", &self.cfg).field("sides", &self.sides.len()).finish()
    }
}

/// Tells connections waiting for a pool that one held may have become idle.
fn nudge_waiters() {
    let sh = shared();
    if sh.waiting.load(Ordering::Acquire) > 0 {
        sh.returned.notify_all();
    }
}

impl Stagers {
    /// `node`: the NUMA node of the rail's NIC, where the pools' buffers should be (None: unknown).
    pub fn new(cfg: StagingConfig, stats: Arc<StageStats>, node: Option<i32>) -> Stagers {
        Stagers { cfg, stats, node, sides: Vec::new(), owner: None }
    }

    /// These pools are held for the connections served to one peer (`peer`: its
    /// `fanin::peer_key`, its proven name or, without a secret, its address): while another
    /// peer waits for a pool, a peer holds at most its share of the budget (issue 33 item 5).
    pub fn for_peer(mut self, peer: &str) -> Stagers {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        peer.hash(&mut h);
        self.owner = Some(h.finish());
        self
    }

    /// This connection's slot for (`dev`, `role`), made on first use.
    fn slot(&mut self, dev: u32, role: Role) -> Arc<Slot> {
        if let Some((_, _, s)) = self.sides.iter().find(|(d, r, _)| *d == dev && *r == role) {
            return s.clone();
        }
        let s = Arc::new(Mutex::new(None));
        self.sides.push((dev, role, s.clone()));
        s
    }

    /// Runs `f` on this connection's pool for (`dev`, `role`), borrowed from the budget when
    /// the connection holds none (waiting, with the wire's tick, while none is free), and adds
    /// what it did to the rail's totals.
    fn staged<W: Ticks, T>(
        &mut self,
        dev: u32,
        role: Role,
        w: &mut W,
        f: impl FnOnce(&mut Staged<Gpu>, &mut W) -> Result<T, PipelineError>,
    ) -> Result<Result<T, PipelineError>, StageError> {
        let slot = self.slot(dev, role);
        let mut g = lock_slot(&slot);
        if g.is_none() {
            drop(g);
            let pool = borrow((self.cfg.gpu, dev, role, self.node, self.cfg.pool), self.owner, w.tick())?;
            self.stats.pool_bytes.fetch_add(pool.st.pool_bytes(), Ordering::Relaxed);
            self.stats.pools.fetch_add(1, Ordering::Relaxed);
            {
                // Where a waiting connection can find it (once per slot).
                let mut b = lock_budget();
                if !b.lent.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&slot))) {
                    b.lent.push(Arc::downgrade(&slot));
                }
            }
            g = lock_slot(&slot);
            *g = Some(Held { pool, stats: self.stats.clone(), owner: self.owner });
        }
        let st = &mut g.as_mut().expect("filled above").pool.st;
        let before = st.totals();
        let r = f(st, w);
        self.stats.add(&before, &st.totals(), true);
        drop(g);
        nudge_waiters();
        Ok(r)
    }

    /// Runs `f` on the pool this connection holds for (`dev`, `role`), if it holds one.
    fn with_side<T>(&mut self, dev: u32, role: Role, f: impl FnOnce(&mut Staged<Gpu>) -> T) -> Option<T> {
        let (_, _, slot) = self.sides.iter().find(|(d, r, _)| *d == dev && *r == role)?;
        let mut g = lock_slot(slot);
        let r = g.as_mut().map(|h| f(&mut h.pool.st));
        drop(g);
        nudge_waiters();
        r
    }

    /// Sends `len` bytes of device `dev`'s memory at `src` (D2H → wire).
    ///
    /// # Safety
    /// `src..src+len` is device memory of `dev`, registered and held for the call.
    pub unsafe fn send(&mut self, dev: u32, src: u64, len: u64, out: &mut SockOut<'_>) -> Result<(), StageError> {
        // SAFETY: the caller's contract.
        let r = self.staged(dev, Role::Sender, out, |st, out| unsafe { st.send(DevicePtr(src), len, out) })?;
        finish(r, &mut out.err)
    }

    /// Sends a stream of segments of device `dev`'s memory through one pipeline (no fill at
    /// segment boundaries): `first` = (where its bytes are: one range or a vectored request's
    /// pages, tag, preamble), then whatever `refill`
    /// returns while it returns segments, each written as its preamble (the request header)
    /// followed by its bytes. Returns once every segment is on the wire.
    ///
    /// # Safety
    /// Every segment's range is device memory of `dev`, registered and held until this returns.
    pub unsafe fn send_stream(
        &mut self,
        dev: u32,
        first: (Src, u64, Vec<u8>),
        out: &mut SockOut<'_>,
        refill: &mut dyn FnMut() -> Option<(Src, u64, Vec<u8>)>,
    ) -> Result<(), StageError> {
        // `staged` counts the first segment; each refilled one counts too.
        let segments = self.stats.clone();
        let r = self.staged(dev, Role::Sender, out, |st, out| {
            let current = first.1;
            // SAFETY: the caller's contract, for `first` and every refilled segment.
            unsafe { st.submit_src(first.0, first.1, Some(first.2))? };
            let mut more = || {
                // Another connection waits for a pool: end this stream at a segment boundary, so
                // this pool becomes idle and can be taken back (what `refill` would have given
                // stays queued for the caller's next stream).
                if shared().waiting.load(Ordering::Acquire) > 0 {
                    return None;
                }
                let next = refill()?;
                segments.chunks.fetch_add(1, Ordering::Relaxed);
                segments.overlapped.fetch_add(1, Ordering::Relaxed);
                Some((next.0, next.1, Some(next.2)))
            };
            let mut current = current;
            loop {
                st.run_until_wired(current, out, Some(&mut more))?;
                while st.take_done().is_some() {}
                match st.next_queued() {
                    Some(tag) => current = tag,
                    None => return Ok(()),
                }
            }
        })?;
        finish(r, &mut out.err)
    }

    /// Receives segment `tag` into device `dev`'s memory at `dst` (one range, or the pages of a
    /// vectored request in stream order), returning once
    /// they are off the wire; the segment's last H2D copies may still run (and those of the
    /// segments before it). [`Stagers::recv_done`] hands segments back once landed,
    /// [`Stagers::recv_finish`] waits for all. On error every queued segment is dropped, with no
    /// copy left running.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory of `dev`, registered, held and not otherwise touched
    /// until the segment is handed back (or a call fails).
    pub unsafe fn recv_segment(&mut self, dev: u32, dst: Src, tag: u64, inp: &mut SockIn<'_>) -> Result<(), StageError> {
        // SAFETY: the caller's contract.
        unsafe { self.recv_segment_notify(dev, dst, tag, inp, None) }
    }

    /// [`Stagers::recv_segment`], handing `landed` each earlier segment as soon as its last copy
    /// completes while this one is received (in order; those are not returned by `recv_done`).
    ///
    /// # Safety
    /// As [`Stagers::recv_segment`].
    pub unsafe fn recv_segment_notify(
        &mut self,
        dev: u32,
        dst: Src,
        tag: u64,
        inp: &mut SockIn<'_>,
        landed: Option<&mut dyn FnMut(u64)>,
    ) -> Result<(), StageError> {
        let stats = self.stats.clone();
        let r = self.staged(dev, Role::Receiver, inp, |st, inp| {
            if st.queued() > 0 {
                stats.overlapped.fetch_add(1, Ordering::Relaxed); // earlier ones still landing
            }
            // SAFETY: the caller's contract.
            unsafe { st.submit_src(dst, tag, None)? };
            st.run_until_wired_notify(tag, inp, None, landed)
        })?;
        finish(r, &mut inp.err)
    }

    /// Tags of received segments on `dev` whose copies have all completed, in order (no wait).
    pub fn recv_done(&mut self, dev: u32, out: &mut Vec<u64>) -> Result<(), StageError> {
        let stats = self.stats.clone();
        let r = self.with_side(dev, Role::Receiver, |st| {
            let before = st.totals();
            let r = st.poll();
            stats.add(&before, &st.totals(), false);
            r.map_err(|e| StageError::Device(e.to_string()))?;
            while let Some(t) = st.take_done() {
                out.push(t);
            }
            Ok(())
        });
        r.unwrap_or(Ok(()))
    }

    /// Waits until every received segment on `dev` has landed; their tags, in order.
    pub fn recv_finish(&mut self, dev: u32, inp: &mut SockIn<'_>, out: &mut Vec<u64>) -> Result<(), StageError> {
        let stats = self.stats.clone();
        let r = self.with_side(dev, Role::Receiver, |st| {
            let before = st.totals();
            let r = st.finish(inp);
            stats.add(&before, &st.totals(), false);
            while let Some(t) = st.take_done() {
                out.push(t);
            }
            r
        });
        match r {
            Some(r) => finish(r, &mut inp.err),
            None => Ok(()),
        }
    }

    /// Waits for every copy of every pool and drops what was queued (a connection that ends
    /// with segments in flight: once this returns, no copy touches the application's memory).
    pub fn abandon(&mut self) {
        for (_, _, slot) in &self.sides {
            if let Some(h) = lock_slot(slot).as_mut() {
                h.pool.st.abandon();
            }
        }
        nudge_waiters();
    }

    /// Receives `len` bytes into device `dev`'s memory at `dst` (wire → H2D). On return every
    /// copy into `dst` has completed, whether it succeeded or not.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory of `dev`, registered, held and not otherwise touched
    /// for the call.
    pub unsafe fn recv(&mut self, dev: u32, dst: u64, len: u64, inp: &mut SockIn<'_>) -> Result<(), StageError> {
        // SAFETY: the caller's contract.
        let r = self.staged(dev, Role::Receiver, inp, |st, inp| unsafe { st.recv(DevicePtr(dst), len, inp) })?;
        finish(r, &mut inp.err)
    }
}

/// A staging wire whose tick also bounds a wait for a pool.
trait Ticks {
    fn tick(&mut self) -> &mut dyn FnMut(bool) -> Result<(), String>;
}

impl Ticks for SockOut<'_> {
    fn tick(&mut self) -> &mut dyn FnMut(bool) -> Result<(), String> {
        &mut *self.tick
    }
}

impl Ticks for SockIn<'_> {
    fn tick(&mut self) -> &mut dyn FnMut(bool) -> Result<(), String> {
        &mut *self.tick
    }
}

fn finish<T>(r: Result<T, PipelineError>, wire_err: &mut Option<WireError>) -> Result<(), StageError> {
    match r {
        Ok(_) => Ok(()),
        Err(PipelineError::Wire { .. }) if wire_err.is_some() => Err(StageError::Wire(wire_err.take().expect("checked"))),
        Err(e) => Err(StageError::Device(e.to_string())),
    }
}

impl Drop for Stagers {
    fn drop(&mut self) {
        // No copy may run on a pool that goes back: wait for each stream (a no-op when every
        // transfer has returned), then back to the budget, idle.
        for (_, _, slot) in self.sides.drain(..) {
            let held = lock_slot(&slot).take();
            if let Some(mut h) = held {
                h.stats.pool_bytes.fetch_sub(h.pool.st.pool_bytes(), Ordering::Relaxed);
                h.pool.st.abandon();
                lock_budget().count_held(h.owner, false);
                give_back(h.pool);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The /proc/self/numa_maps line of the mapping that holds `addr` (lines start with the
    /// mapping's start address; the last one at or below `addr`).
    fn numa_maps_line(addr: u64) -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/numa_maps").ok()?;
        maps.lines()
            .filter_map(|l| Some((u64::from_str_radix(l.split_whitespace().next()?, 16).ok()?, l.to_string())))
            .filter(|(start, _)| *start <= addr)
            .max_by_key(|(start, _)| *start)
            .map(|(_, l)| l)
    }

    /// Issue 34 item 3: a pool for a rail whose NIC is on node 0 has every pinned buffer's
    /// pages under a policy preferring node 0 (numa_maps "prefer:0", and get_mempolicy says so
    /// for the buffer's address), not the policy of whichever thread allocated it. Before the
    /// node was passed down, the buffers had the default policy.
    /// Issue 33 item 5: a peer that holds its share of a device's pools while another peer
    /// waits takes no more (before, it took every pool that came back, and a peer that never
    /// let its pools go kept the others waiting until their timeout).
    #[test]
    fn a_peer_holding_its_share_leaves_the_next_pool_to_a_waiting_peer() {
        // A stand-in device of its own: other tests of this binary share the budget.
        let dev = 43;
        let cfg = StagingConfig {
            gpu: GpuKind::StandIn,
            pool: PoolConfig { buffers: 1, buffer_size: 64 << 10 },
            ipc: false,
            pinned_max: DEFAULT_PINNED_MAX,
        };
        prewarm(cfg, dev, 4, None, 9).expect("stand-in pools");
        let key = (cfg.gpu, dev, Role::Receiver, None, cfg.pool);
        let (a, b_peer) = (Some(1u64), Some(2u64));
        let mut no_wait = |_: bool| -> Result<(), String> { Err("would wait".into()) };
        // Peer A holds all four pools (nobody waits: no cap).
        let mut held: Vec<Pool> = (0..4).map(|_| borrow(key, a, &mut no_wait).expect("a warm pool")).collect();
        // Peer B waits for one.
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            let mut tick = |_: bool| if t.elapsed() > Duration::from_secs(20) { Err("gave up".to_string()) } else { Ok(()) };
            borrow(key, b_peer, &mut tick).map(|p| (p, t.elapsed()))
        });
        let t = Instant::now();
        while !lock_budget().waiting_for.iter().any(|w| w.0 == 2) {
            assert!(t.elapsed() < Duration::from_secs(20), "peer B never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
        // A gives one back (idle, without waking B yet) and asks again at once: it holds 3 of
        // 4 pools with another peer waiting, beyond its share (2): it must not take it.
        {
            let p = held.pop().expect("four");
            let mut b = lock_budget();
            b.count_held(a, false);
            b.idle.push(p);
        }
        let again = borrow(key, a, &mut no_wait);
        assert!(again.is_err(), "peer A took a fourth pool while peer B waited");
        shared().returned.notify_all();
        let (p, waited) = waiter.join().expect("waiter").expect("peer B got the pool");
        assert!(waited < Duration::from_secs(20));
        lock_budget().count_held(b_peer, false);
        give_back(p);
        for p in held {
            lock_budget().count_held(a, false);
            give_back(p);
        }
        let b = lock_budget();
        assert_eq!(b.held(1) + b.held(2), 0);
    }

    #[test]
    fn a_pool_for_a_node_0_rail_has_its_buffers_on_node_0() {
        // A stand-in device of its own: other tests of this binary share the budget.
        let dev = 41;
        let cfg = StagingConfig {
            gpu: GpuKind::StandIn,
            pool: PoolConfig { buffers: 2, buffer_size: 1 << 20 },
            ipc: false,
            pinned_max: DEFAULT_PINNED_MAX,
        };
        prewarm(cfg, dev, 1, Some(0), 7).expect("stand-in pools");
        prewarm(cfg, dev, 1, None, 7).expect("stand-in pools");
        let mut no_wait = |_: bool| -> Result<(), String> { Err("would wait".into()) };
        let p = borrow((cfg.gpu, dev, Role::Sender, Some(0), cfg.pool), None, &mut no_wait).expect("a warm pool");
        let ranges: Vec<_> = p.st.pinned_ranges().collect();
        assert_eq!(ranges.len(), 2);
        for (ptr, len) in ranges {
            for addr in [ptr as u64, ptr as u64 + len as u64 - 1] {
                let line = numa_maps_line(addr).expect("numa_maps has the buffer's mapping");
                assert!(line.contains(" prefer:0"), "{addr:#x}: {line}");
                assert_eq!(crate::numa::policy_of_addr(addr), Some((1, vec![0])), "{addr:#x}: {line}");
            }
        }
        // A connection of no known node prefers a pool placed as it asks (first touch), and a
        // node-0 connection gets the node-0 pool back.
        let mine: Vec<_> = p.st.pinned_ranges().map(|r| r.0 as u64).collect();
        give_back(p);
        let other = borrow((cfg.gpu, dev, Role::Sender, None, cfg.pool), None, &mut no_wait).expect("a warm pool");
        assert_eq!(other.key.3, None);
        assert!(other.st.pinned_ranges().all(|r| !mine.contains(&(r.0 as u64))));
        let again = borrow((cfg.gpu, dev, Role::Sender, Some(0), cfg.pool), None, &mut no_wait).expect("a warm pool");
        assert_eq!(again.st.pinned_ranges().map(|r| r.0 as u64).collect::<Vec<_>>(), mine, "the idle node-0 pool is reused");
        give_back(other);
        give_back(again);
    }
}
