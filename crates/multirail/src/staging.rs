//! GPU memory on byte-stream rails (issue 10): every connection that carries VRAM stages it
//! through its own bounded pool of pinned bounce buffers, with `multirail-gpu`'s pipelined
//! executor (D2H of piece k+1, the wire for piece k and the H2D of piece k-1 at once).
//!
//! Pools are pinned once per process and reused ([`take_pool`] / [`prewarm`]): an agent pins the
//! pools its rails will need when the first GPU region of a device is registered, a connection
//! takes one per (device, direction) on its first VRAM chunk and gives it back when it closes,
//! and the next connection takes the same buffers. So nothing is pinned mid-transfer, and
//! nothing is unpinned when a connection drops (`cudaFreeHost` can wait for the whole device,
//! the application's kernels included). Idle pools are kept up to [`MAX_IDLE_BYTES`] of pinned
//! memory; beyond that a returned pool is freed. The totals of every connection on a rail
//! (initiator side) or served connection (target side) add up in one [`StageStats`], which
//! `rail_stats()` / `served_stats()` and the bench report.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

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
}

impl Default for StagingConfig {
    fn default() -> Self {
        // 4 x 1 MiB per connection and direction: one piece per default planner chunk (a piece
        // never spans chunks, so larger buffers would only pin more), few enough copy launches
        // that their ~10 us each cost under 20 % of a 25 GB/s copy engine, and the pipeline runs
        // across chunks (no fill or drain at each). 4 MiB of pinned memory per pool.
        StagingConfig { gpu: GpuKind::Cuda, pool: PoolConfig { buffers: 4, buffer_size: 1 << 20 }, ipc: true }
    }
}

/// Pinned bytes of idle pools kept for reuse, process-wide; a pool returned beyond it is freed.
pub const MAX_IDLE_BYTES: u64 = 256 << 20;

/// A pool waiting for its next connection: (device kind, device, direction, shape, the pool,
/// the NUMA node its buffers were placed on).
type IdlePool = (GpuKind, u32, Role, PoolConfig, Staged<Gpu>, Option<i32>);

fn idle() -> &'static Mutex<Vec<IdlePool>> {
    static IDLE: OnceLock<Mutex<Vec<IdlePool>>> = OnceLock::new();
    IDLE.get_or_init(|| Mutex::new(Vec::new()))
}

fn lock_idle() -> std::sync::MutexGuard<'static, Vec<IdlePool>> {
    idle().lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new pool whose pinned buffers come from `node` (the NUMA node of the rail's NIC, issue
/// 34 item 3), not from whichever thread first needed them: the allocation runs under a
/// thread policy preferring `node` (`cudaHostAlloc` touches and pins its pages at once), and
/// each buffer's range then carries that policy itself (`numa::prefer_node`, for pages not
/// yet touched). `None`: placed as before (first touch).
fn new_pool(cfg: StagingConfig, dev: u32, role: Role, node: Option<i32>) -> Result<Staged<Gpu>, StageError> {
    let id = i32::try_from(dev).map_err(|_| StageError::Device(format!("device id {dev} out of range")))?;
    let gpu = Gpu::open(cfg.gpu, id).map_err(|e| StageError::Device(e.to_string()))?;
    let mut st =
        crate::numa::with_preferred_node(node, || Staged::new(gpu, role, cfg.pool)).map_err(|e| StageError::Device(e.to_string()))?;
    if let Some(n) = node {
        for (p, len) in st.pinned_ranges() {
            // Best effort: a mapping the kernel will not take a policy for (a driver's) keeps
            // the placement the thread policy gave it.
            crate::numa::prefer_node(p, len, n);
        }
    }
    st.keep_ops(false);
    Ok(st)
}

fn fits(p: &IdlePool, cfg: StagingConfig, dev: u32, role: Role, node: Option<i32>) -> bool {
    p.0 == cfg.gpu && p.1 == dev && p.2 == role && p.3 == cfg.pool && p.5 == node
}

/// A pool for (`dev`, `role`) of `cfg`'s shape with its buffers on `node`: an idle one if
/// there is one, else a new one.
pub fn take_pool(cfg: StagingConfig, dev: u32, role: Role, node: Option<i32>) -> Result<Staged<Gpu>, StageError> {
    {
        let mut idle = lock_idle();
        if let Some(i) = idle.iter().position(|p| fits(p, cfg, dev, role, node)) {
            return Ok(idle.swap_remove(i).4);
        }
    }
    new_pool(cfg, dev, role, node)
}

/// Gives a pool back for the next connection (idle: its last transfer has returned, so no
/// copy runs on it), or frees it when [`MAX_IDLE_BYTES`] are idle already.
fn give_pool(cfg: StagingConfig, dev: u32, role: Role, st: Staged<Gpu>, node: Option<i32>) {
    let mut idle = lock_idle();
    let held: u64 = idle.iter().map(|p| p.4.pool_bytes()).sum();
    if held + st.pool_bytes() <= MAX_IDLE_BYTES {
        idle.push((cfg.gpu, dev, role, cfg.pool, st, node));
    } else {
        drop(idle);
        drop(st); // waits for its stream, then frees the pinned buffers
    }
}

/// Pins, ahead of the first transfer, `per_role` pools of each direction for device `dev`
/// (those already idle count), so no transfer pins memory. Registration of the first GPU
/// region of a device calls it per NUMA node of its rails' NICs (`node`) with the number of
/// connections those rails open.
pub fn prewarm(cfg: StagingConfig, dev: u32, per_role: usize, node: Option<i32>) -> Result<(), StageError> {
    for role in [Role::Sender, Role::Receiver] {
        let have = lock_idle().iter().filter(|p| fits(p, cfg, dev, role, node)).count();
        for _ in have..per_role {
            let st = new_pool(cfg, dev, role, node)?;
            give_pool(cfg, dev, role, st, node);
        }
    }
    Ok(())
}

/// Pinned bytes held by idle pools (reported by `gpu.info` as `idle_pool_bytes`).
pub fn idle_pool_bytes() -> u64 {
    lock_idle().iter().map(|p| p.4.pool_bytes()).sum()
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
    /// Pools taken by connections (each is `buffers x buffer_size` of pinned memory, taken
    /// from the process's idle pools when one fits: [`take_pool`]).
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

/// The staging pools of one connection (module docs).
pub struct Stagers {
    cfg: StagingConfig,
    stats: Arc<StageStats>,
    /// The NUMA node of the rail's NIC, where this connection's pools are (None: unknown).
    node: Option<i32>,
    /// (device, role) → that direction's pool on that device.
    sides: Vec<(u32, Role, Staged<Gpu>)>,
}

impl std::fmt::Debug for Stagers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stagers").field("cfg", &self.cfg).field("pools", &self.sides.len()).finish()
    }
}

impl Stagers {
    /// `node`: the NUMA node of the rail's NIC, where the pools' buffers go (None: unknown).
    pub fn new(cfg: StagingConfig, stats: Arc<StageStats>, node: Option<i32>) -> Stagers {
        Stagers { cfg, stats, node, sides: Vec::new() }
    }

    /// Runs `f` on this connection's pool for (`dev`, `role`), made on first use, and adds what
    /// it did to the rail's totals.
    fn staged<T>(
        &mut self,
        dev: u32,
        role: Role,
        f: impl FnOnce(&mut Staged<Gpu>) -> Result<T, PipelineError>,
    ) -> Result<Result<T, PipelineError>, StageError> {
        let Stagers { cfg, stats, node, sides } = self;
        let i = match sides.iter().position(|(d, r, _)| *d == dev && *r == role) {
            Some(i) => i,
            None => {
                let st = take_pool(*cfg, dev, role, *node)?;
                stats.pool_bytes.fetch_add(st.pool_bytes(), Ordering::Relaxed);
                stats.pools.fetch_add(1, Ordering::Relaxed);
                sides.push((dev, role, st));
                sides.len() - 1
            }
        };
        let st = &mut sides[i].2;
        let before = st.totals();
        let r = f(st);
        stats.add(&before, &st.totals(), true);
        Ok(r)
    }

    /// Sends `len` bytes of device `dev`'s memory at `src` (D2H → wire).
    ///
    /// # Safety
    /// `src..src+len` is device memory of `dev`, registered and held for the call.
    pub unsafe fn send(&mut self, dev: u32, src: u64, len: u64, out: &mut SockOut<'_>) -> Result<(), StageError> {
        // SAFETY: the caller's contract.
        let r = self.staged(dev, Role::Sender, |st| unsafe { st.send(DevicePtr(src), len, out) })?;
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
        let r = self.staged(dev, Role::Sender, |st| {
            let current = first.1;
            // SAFETY: the caller's contract, for `first` and every refilled segment.
            unsafe { st.submit_src(first.0, first.1, Some(first.2))? };
            let mut more = || {
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
        let r = self.staged(dev, Role::Receiver, |st| {
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
        let Some(st) = self.side(dev, Role::Receiver) else { return Ok(()) };
        let before = st.totals();
        let r = st.poll();
        stats.add(&before, &st.totals(), false);
        r.map_err(|e| StageError::Device(e.to_string()))?;
        while let Some(t) = st.take_done() {
            out.push(t);
        }
        Ok(())
    }

    /// Waits until every received segment on `dev` has landed; their tags, in order.
    pub fn recv_finish(&mut self, dev: u32, inp: &mut SockIn<'_>, out: &mut Vec<u64>) -> Result<(), StageError> {
        let stats = self.stats.clone();
        let Some(st) = self.side(dev, Role::Receiver) else { return Ok(()) };
        let before = st.totals();
        let r = st.finish(inp);
        stats.add(&before, &st.totals(), false);
        while let Some(t) = st.take_done() {
            out.push(t);
        }
        finish(r, &mut inp.err)
    }

    /// Waits for every copy of every pool and drops what was queued (a connection that ends
    /// with segments in flight: once this returns, no copy touches the application's memory).
    pub fn abandon(&mut self) {
        for (_, _, st) in &mut self.sides {
            st.abandon();
        }
    }

    fn side(&mut self, dev: u32, role: Role) -> Option<&mut Staged<Gpu>> {
        self.sides.iter_mut().find(|(d, r, _)| *d == dev && *r == role).map(|(_, _, st)| st)
    }

    /// Receives `len` bytes into device `dev`'s memory at `dst` (wire → H2D). On return every
    /// copy into `dst` has completed, whether it succeeded or not.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory of `dev`, registered, held and not otherwise touched
    /// for the call.
    pub unsafe fn recv(&mut self, dev: u32, dst: u64, len: u64, inp: &mut SockIn<'_>) -> Result<(), StageError> {
        // SAFETY: the caller's contract.
        let r = self.staged(dev, Role::Receiver, |st| unsafe { st.recv(DevicePtr(dst), len, inp) })?;
        finish(r, &mut inp.err)
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
        let held: u64 = self.sides.iter().map(|(_, _, s)| s.pool_bytes()).sum();
        self.stats.pool_bytes.fetch_sub(held, Ordering::Relaxed);
        // No copy may run on a pool that goes back: wait for each stream (a no-op when every
        // transfer has returned), then back to the process's idle pools.
        for (dev, role, mut st) in self.sides.drain(..) {
            st.abandon();
            give_pool(self.cfg, dev, role, st, self.node);
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
    #[test]
    fn a_pool_for_a_node_0_rail_has_its_buffers_on_node_0() {
        let cfg = StagingConfig { gpu: GpuKind::StandIn, pool: PoolConfig { buffers: 2, buffer_size: 1 << 20 }, ipc: false };
        let st = take_pool(cfg, 0, Role::Sender, Some(0)).expect("stand-in pool");
        let ranges: Vec<_> = st.pinned_ranges().collect();
        assert_eq!(ranges.len(), 2);
        for (p, len) in ranges {
            for addr in [p as u64, p as u64 + len as u64 - 1] {
                let line = numa_maps_line(addr).expect("numa_maps has the buffer's mapping");
                assert!(line.contains(" prefer:0"), "{addr:#x}: {line}");
                assert_eq!(crate::numa::policy_of_addr(addr), Some((1, vec![0])), "{addr:#x}: {line}");
            }
        }
        // An idle pool of node 0 is not handed out to a connection of another (or no) node.
        let mine: Vec<_> = st.pinned_ranges().map(|r| r.0 as u64).collect();
        give_pool(cfg, 0, Role::Sender, st, Some(0));
        let other = take_pool(cfg, 0, Role::Sender, None).expect("stand-in pool");
        assert!(other.pinned_ranges().all(|r| !mine.contains(&(r.0 as u64))));
        let again = take_pool(cfg, 0, Role::Sender, Some(0)).expect("stand-in pool");
        assert_eq!(again.pinned_ranges().map(|r| r.0 as u64).collect::<Vec<_>>(), mine, "the idle node-0 pool is reused");
    }
}
