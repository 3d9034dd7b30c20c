//! A deterministic simulator of one host's PCIe fabric, shared by several processes that each
//! drive their own real [`Planner`] (the one the engine uses: weights from measured delivery,
//! chunking, failure handling), used by `tests/topo_sim.rs` (issue 34).
//!
//! Model:
//! - Two hosts of the same shape, A (sender) and B (receiver), joined rail by rail: NIC `j` of A
//!   is wired to NIC `j` of B (a rail-optimised fabric). Every capacity is one direction of a
//!   link, in bytes/s: a GPU's own PCIe link (`gpu_up`: out of the GPU, `gpu_dn`: into it), the
//!   PCIe switch's uplink to its CPU root port (`up_up`, `up_dn`), the root complex of each
//!   socket (`rc`: what it forwards peer to peer between root ports and to or from the socket
//!   link; plain DMA to or from DRAM does not count), the socket link each way (`upi`), each
//!   socket's DRAM and each rail's wire.
//! - A path is the list of links a byte crosses from its memory to its NIC on A, the wire, and
//!   from the NIC to its memory on B (see [`Fabric::path`]).
//! - A connection is one process's rail: a FIFO of the chunks its planner handed it (within the
//!   planner's window). The chunk at its head is being served and is one flow; flows share
//!   every link by max-min fairness (water-filling), recomputed whenever a flow starts or ends.
//!   A chunk's completion reaches its planner `2 * latency` after its last byte left.
//! - Virtual time: one real `Instant` is taken at start and only advanced by `Duration`s, so
//!   every run is reproducible; times are whole nanoseconds and a flow ends at the first
//!   nanosecond by which its bytes are through.
//! - A NIC failure at `at` drops what every connection on it holds; for each process using it
//!   the driver first admits the process's next class of rails (`add_rail`, if its current class
//!   has no rail left), then reports the rail down (`handle_rail_down`), so the planner reissues
//!   the lost chunks on the new rails. Stalls are decided by the planner (`poll_timeout`,
//!   `poll_stalled`) as in the runtime; none occur in these scenarios.
//! - A process's planner is polled for work when something happened to it (a completion, a
//!   rail change, its submission), as the engine's workers are woken.
#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use multirail_proto::{ChunkId, Event, Pair, Planner, PlannerConfig, RailId, XferId};

pub const GB: f64 = 1e9;

/// Gbit/s to bytes/s.
pub fn gbit(v: f64) -> f64 {
    v * 1e9 / 8.0
}

/// Where a transfer's bytes live (on A; the same place on B receives them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// GPU `k`'s HBM.
    Gpu(usize),
    /// A socket's (NUMA node's) DRAM.
    Dram(usize),
}

/// The distance of a memory and a NIC, in nvidia-smi's sense (no PIX on this model: each GPU
/// sits behind its NIC's own switch, which nvidia-smi reports as PXB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Through PCIe switches only.
    Pxb,
    /// Through the socket's root complex.
    Node,
    /// Across the socket link.
    Sys,
}

/// The capacities of the model, bytes/s per direction (`f64::INFINITY`: not a constraint).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub sockets: usize,
    /// GPU/NIC pairs per socket: GPU `k` and NIC `k` share switch `k`.
    pub pairs_per_socket: usize,
    pub wire: f64,
    /// A PCIe Gen5 x16 link (GPU to switch, switch to root port).
    pub pcie: f64,
    /// Peer-to-peer forwarding through one socket's root complex.
    pub rc: f64,
    /// The socket link, each way.
    pub socket_link: f64,
    /// One socket's DRAM.
    pub dram: f64,
    /// One-way latency of the wire and the far host (a completion is reported `2 *` later).
    pub latency: Duration,
}

pub type LinkId = usize;

#[derive(Debug, Clone)]
pub struct Link {
    pub name: String,
    pub cap: f64,
    pub wire: bool,
}

/// The links of both hosts and the wires.
#[derive(Debug, Clone)]
pub struct Fabric {
    pub params: Params,
    pub links: Vec<Link>,
    /// Per host: gpu_up, gpu_dn, up_up, up_dn per pair; rc, dram per socket; upi[from][to].
    gpu_up: [Vec<LinkId>; 2],
    gpu_dn: [Vec<LinkId>; 2],
    up_up: [Vec<LinkId>; 2],
    up_dn: [Vec<LinkId>; 2],
    rc: [Vec<LinkId>; 2],
    dram: [Vec<LinkId>; 2],
    upi: [Vec<Vec<Option<LinkId>>>; 2],
    wires: Vec<LinkId>,
}

impl Fabric {
    pub fn new(params: Params) -> Self {
        let n = params.sockets * params.pairs_per_socket;
        let mut f = Fabric {
            links: Vec::new(),
            gpu_up: Default::default(),
            gpu_dn: Default::default(),
            up_up: Default::default(),
            up_dn: Default::default(),
            rc: Default::default(),
            dram: Default::default(),
            upi: Default::default(),
            wires: Vec::new(),
            params: params.clone(),
        };
        for (h, host) in ["A", "B"].iter().enumerate() {
            for k in 0..n {
                let l = f.link(format!("{host}.gpu{k}.up"), params.pcie, false);
                f.gpu_up[h].push(l);
                let l = f.link(format!("{host}.gpu{k}.down"), params.pcie, false);
                f.gpu_dn[h].push(l);
                let l = f.link(format!("{host}.sw{k}.uplink.up"), params.pcie, false);
                f.up_up[h].push(l);
                let l = f.link(format!("{host}.sw{k}.uplink.down"), params.pcie, false);
                f.up_dn[h].push(l);
            }
            for s in 0..params.sockets {
                let l = f.link(format!("{host}.rc{s}"), params.rc, false);
                f.rc[h].push(l);
                let l = f.link(format!("{host}.dram{s}"), params.dram, false);
                f.dram[h].push(l);
            }
            let mut upi = vec![vec![None; params.sockets]; params.sockets];
            for (a, row) in upi.iter_mut().enumerate() {
                for (b, cell) in row.iter_mut().enumerate() {
                    if a != b {
                        *cell = Some(f.link(format!("{host}.socket{a}->{b}"), params.socket_link, false));
                    }
                }
            }
            f.upi[h] = upi;
        }
        for j in 0..n {
            let w = f.link(format!("wire{j}"), params.wire, true);
            f.wires.push(w);
        }
        f
    }

    fn link(&mut self, name: String, cap: f64, wire: bool) -> LinkId {
        self.links.push(Link { name, cap, wire });
        self.links.len() - 1
    }

    /// GPUs (and NICs) in all.
    pub fn pairs(&self) -> usize {
        self.params.sockets * self.params.pairs_per_socket
    }

    pub fn socket_of(&self, pair: usize) -> usize {
        pair / self.params.pairs_per_socket
    }

    fn mem_socket(&self, mem: Mem) -> usize {
        match mem {
            Mem::Gpu(k) => self.socket_of(k),
            Mem::Dram(s) => s,
        }
    }

    /// The distance class of `mem` and NIC `nic`.
    pub fn class(&self, mem: Mem, nic: usize) -> Class {
        match mem {
            Mem::Gpu(k) if k == nic => Class::Pxb,
            _ if self.mem_socket(mem) == self.socket_of(nic) => Class::Node,
            _ => Class::Sys,
        }
    }

    /// NICs of `mem` in `class`, in order.
    pub fn nics_in(&self, mem: Mem, class: Class) -> Vec<usize> {
        (0..self.pairs()).filter(|&j| self.class(mem, j) == class).collect()
    }

    /// Host `h`'s links between `mem` and NIC `nic`'s switch, from the memory on, in the
    /// direction out of the memory (`out`) or into it.
    fn host_path(&self, h: usize, mem: Mem, nic: usize, out: bool) -> Vec<LinkId> {
        let (ns, ms) = (self.socket_of(nic), self.mem_socket(mem));
        let mut p = Vec::new();
        match mem {
            Mem::Gpu(k) => {
                p.push(if out { self.gpu_up[h][k] } else { self.gpu_dn[h][k] });
                if k != nic {
                    // Up through its own switch into the root complex, across (if need be),
                    // down into the NIC's switch (or the reverse, into the memory).
                    p.push(if out { self.up_up[h][k] } else { self.up_dn[h][k] });
                    p.push(self.rc[h][ms]);
                    if ms != ns {
                        p.extend(if out { self.upi[h][ms][ns] } else { self.upi[h][ns][ms] });
                        p.push(self.rc[h][ns]);
                    }
                    p.push(if out { self.up_dn[h][nic] } else { self.up_up[h][nic] });
                }
            }
            Mem::Dram(s) => {
                p.push(self.dram[h][s]);
                if ms != ns {
                    p.extend(if out { self.upi[h][ms][ns] } else { self.upi[h][ns][ms] });
                }
                p.push(if out { self.up_dn[h][nic] } else { self.up_up[h][nic] });
            }
        }
        p
    }

    /// Every link a byte of `mem` crosses on its way to the same memory on B over rail `nic`,
    /// without capacities that do not constrain (infinite ones).
    pub fn path(&self, mem: Mem, nic: usize) -> Vec<LinkId> {
        let mut p = self.host_path(0, mem, nic, true);
        p.push(self.wires[nic]);
        p.extend(self.host_path(1, mem, nic, false).into_iter().rev());
        p.retain(|&l| self.links[l].cap.is_finite());
        p
    }

    pub fn path_names(&self, mem: Mem, nic: usize) -> Vec<&str> {
        self.path(mem, nic).into_iter().map(|l| self.links[l].name.as_str()).collect()
    }

    /// The wires' capacity in all.
    pub fn wire_total(&self) -> f64 {
        self.wires.iter().map(|&w| self.links[w].cap).sum()
    }
}

/// Max-min fair rates of `flows` (each a list of links) over links of capacity `caps`:
/// water-filling, the most constrained link first.
pub fn max_min(caps: &[f64], flows: &[&[LinkId]]) -> Vec<f64> {
    let mut left = caps.to_vec();
    let mut count = vec![0usize; caps.len()];
    for f in flows {
        for &l in *f {
            count[l] += 1;
        }
    }
    let mut rate = vec![0.0; flows.len()];
    let mut fixed = vec![false; flows.len()];
    let mut todo = flows.len();
    while todo > 0 {
        // The link whose unfixed flows would get the least.
        let mut best: Option<(f64, LinkId)> = None;
        for (l, &c) in count.iter().enumerate() {
            if c > 0 {
                let share = left[l].max(0.0) / c as f64;
                if best.is_none_or(|(s, _)| share < s) {
                    best = Some((share, l));
                }
            }
        }
        let Some((share, bottleneck)) = best else {
            break; // flows that cross no finite link: none in these models
        };
        for (i, f) in flows.iter().enumerate() {
            if !fixed[i] && f.contains(&bottleneck) {
                fixed[i] = true;
                todo -= 1;
                rate[i] = share;
                for &l in *f {
                    left[l] -= share;
                    count[l] -= 1;
                }
            }
        }
    }
    rate
}

/// One process: a memory, the rails it starts with, and the classes it may fall back to.
#[derive(Debug, Clone)]
pub struct ProcSpec {
    pub mem: Mem,
    /// NICs of its rails from the start (planner rail `i` is NIC `rails[i]`).
    pub rails: Vec<usize>,
    /// Further classes of NICs, each admitted when every rail admitted so far is down.
    pub fallback: Vec<Vec<usize>>,
    /// Each transfer's size.
    pub bytes: u64,
    /// Transfers, back to back: the next is submitted when the previous is done.
    pub count: u32,
    pub cfg: PlannerConfig,
    /// What `add_rail` is told of each rail: the engine passes the NIC's link speed.
    pub hint: Option<f64>,
}

/// A chunk in a connection's queue; the head is being served.
#[derive(Debug, Clone)]
struct Queued {
    id: ChunkId,
    left: f64,
}

#[derive(Debug)]
struct Conn {
    nic: usize,
    path: Vec<LinkId>,
    queue: VecDeque<Queued>,
    epoch: u64,
    up: bool,
}

struct Proc {
    planner: Planner,
    mem: Mem,
    conns: Vec<Conn>,
    fallback: VecDeque<Vec<usize>>,
    /// The transfer in progress (process `i`'s `n`-th is `i << 32 | n`).
    xfer: XferId,
    bytes: u64,
    hint: Option<f64>,
    /// Transfers still to submit after the current one.
    more: u32,
    /// When each of its transfers ended.
    dones: Vec<Duration>,
    done: Option<Duration>,
    failed: Option<String>,
    /// Something happened to it: poll its planner for work.
    dirty: bool,
}

/// What a process did, for the report.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcReport {
    pub mem: Mem,
    /// When its last transfer ended.
    pub done: Option<Duration>,
    /// When each of its transfers ended.
    pub dones: Vec<Duration>,
    pub failed: Option<String>,
    /// Per NIC: bytes its chunks carried to completion (accepted by the planner).
    pub bytes_per_nic: Vec<u64>,
    pub events: Vec<(Duration, Event)>,
}

#[derive(Debug, Clone)]
pub struct RunReport {
    pub procs: Vec<ProcReport>,
    /// When the last transfer ended.
    pub end: Duration,
    /// `(t, bytes carried by all wires in [0, t))`, at every change of rates.
    pub wire_trace: Vec<(Duration, f64)>,
    /// Bytes each link carried, by link id.
    pub link_bytes: Vec<f64>,
    pub steps: u64,
}

impl RunReport {
    /// Bytes the wires carried in `[0, t)` (the trace is piecewise linear).
    pub fn wire_bytes_at(&self, t: Duration) -> f64 {
        let i = self.wire_trace.partition_point(|&(at, _)| at <= t);
        if i == 0 {
            return 0.0;
        }
        let (t0, b0) = self.wire_trace[i - 1];
        match self.wire_trace.get(i) {
            Some(&(t1, b1)) => b0 + (b1 - b0) * (t - t0).as_secs_f64() / (t1 - t0).as_secs_f64(),
            None => b0,
        }
    }

    /// The wires' aggregate rate over `[a, b)`, bytes/s.
    pub fn wire_rate(&self, a: Duration, b: Duration) -> f64 {
        (self.wire_bytes_at(b) - self.wire_bytes_at(a)) / (b - a).as_secs_f64()
    }

    /// When the first transfer ended.
    pub fn first_done(&self) -> Duration {
        self.procs.iter().filter_map(|p| p.done).min().unwrap_or(self.end)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum What {
    /// A chunk's completion reaches its process.
    Report { proc: usize, rail: RailId, epoch: u64, id: ChunkId },
    /// A NIC fails (for good).
    NicDown(usize),
}

pub struct FabricSim {
    fabric: Fabric,
    procs: Vec<Proc>,
    t0: Instant,
    now: Duration,
    queue: BinaryHeap<Reverse<(Duration, u64, What)>>,
    seq: u64,
    /// A run that reaches this virtual time is declared hung.
    pub limit: Duration,
    events: Vec<Vec<(Duration, Event)>>,
    bytes_per_nic: Vec<Vec<u64>>,
    /// Per process, its chunks in flight: NIC and length.
    chunk_nic: Vec<HashMap<ChunkId, (usize, u64)>>,
    link_bytes: Vec<f64>,
    wire_trace: Vec<(Duration, f64)>,
    wire_bytes: f64,
    steps: u64,
}

impl FabricSim {
    /// Every process submits its transfer at 0.
    pub fn new(fabric: Fabric, specs: Vec<ProcSpec>) -> Self {
        let t0 = Instant::now();
        let nlinks = fabric.links.len();
        let procs = specs
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let mut planner = Planner::new(s.cfg.clone());
                let xfer = XferId((i as u64) << 32);
                let mut conns = Vec::new();
                for &nic in &s.rails {
                    assert_eq!(planner.add_rail(s.hint, t0), conns.len());
                    conns.push(Conn { nic, path: fabric.path(s.mem, nic), queue: VecDeque::new(), epoch: 0, up: true });
                }
                planner.submit(xfer, Self::pairs(i, s.bytes), t0);
                Proc {
                    planner,
                    mem: s.mem,
                    conns,
                    fallback: s.fallback.into_iter().collect(),
                    xfer,
                    bytes: s.bytes,
                    hint: s.hint,
                    more: s.count.saturating_sub(1),
                    dones: Vec::new(),
                    done: None,
                    failed: None,
                    dirty: true,
                }
            })
            .collect::<Vec<_>>();
        let n = procs.len();
        FabricSim {
            fabric,
            procs,
            t0,
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            seq: 0,
            limit: Duration::from_secs(60),
            events: vec![Vec::new(); n],
            bytes_per_nic: Vec::new(),
            chunk_nic: vec![HashMap::new(); n],
            link_bytes: vec![0.0; nlinks],
            wire_trace: vec![(Duration::ZERO, 0.0)],
            wire_bytes: 0.0,
            steps: 0,
        }
    }

    /// Process `i`'s transfer: `bytes` of its memory to its region on the peer.
    fn pairs(i: usize, bytes: u64) -> Vec<Pair> {
        vec![Pair { local: (i as u64) << 40, region: i as u64, offset: 0, len: bytes }]
    }

    /// NIC `nic` fails at `at` and stays down.
    pub fn fail_nic(&mut self, at: Duration, nic: usize) {
        self.push(at, What::NicDown(nic));
    }

    fn push(&mut self, t: Duration, w: What) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, w)));
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    fn handle(&mut self, w: What) {
        let now = self.at();
        match w {
            What::Report { proc, rail, epoch, id } => {
                let p = &mut self.procs[proc];
                if p.conns[rail].epoch == epoch && p.planner.handle_done(id, now) {
                    if let Some((nic, len)) = self.chunk_nic[proc].remove(&id) {
                        self.bytes_per_nic[proc][nic] += len;
                    }
                }
                p.dirty = true;
            }
            What::NicDown(nic) => {
                for i in 0..self.procs.len() {
                    let rails: Vec<RailId> = (0..self.procs[i].conns.len())
                        .filter(|&r| self.procs[i].conns[r].nic == nic && self.procs[i].conns[r].up)
                        .collect();
                    for rail in rails {
                        self.rail_down(i, rail, format!("sim: NIC {nic} failed"));
                    }
                }
            }
        }
    }

    /// Drop what a connection holds and tell its planner, after admitting the next class if
    /// this was the last rail up.
    fn rail_down(&mut self, proc: usize, rail: RailId, reason: String) {
        let now = self.at();
        let p = &mut self.procs[proc];
        let c = &mut p.conns[rail];
        c.up = false;
        c.epoch += 1;
        c.queue.clear();
        let others_up = p.conns.iter().any(|c| c.up);
        if !others_up {
            if let Some(next) = p.fallback.pop_front() {
                for nic in next {
                    assert_eq!(p.planner.add_rail(p.hint, now), p.conns.len());
                    p.conns.push(Conn { nic, path: self.fabric.path(p.mem, nic), queue: VecDeque::new(), epoch: 0, up: true });
                }
            }
        }
        p.planner.handle_rail_down(rail, reason, now);
        p.dirty = true;
    }

    fn poll_work(&mut self) {
        let now = self.at();
        for (i, p) in self.procs.iter_mut().enumerate() {
            if !std::mem::take(&mut p.dirty) {
                continue;
            }
            let mut again = true;
            while std::mem::take(&mut again) {
                Self::poll_proc(p, &mut self.chunk_nic[i], now);
                while let Some(e) = p.planner.poll_event() {
                    match &e {
                        Event::XferDone(x) if *x == p.xfer => {
                            p.dones.push(self.now);
                            if p.more > 0 {
                                p.more -= 1;
                                p.xfer = XferId(p.xfer.0 + 1);
                                p.planner.submit(p.xfer, Self::pairs(i, p.bytes), now);
                                again = true;
                            } else {
                                p.done = Some(self.now);
                            }
                        }
                        Event::XferFailed { xfer, reason } if *xfer == p.xfer => p.failed = Some(reason.clone()),
                        _ => {}
                    }
                    self.events[i].push((self.now, e));
                }
            }
        }
    }

    /// Hand out work to a process's rails until none takes more.
    fn poll_proc(p: &mut Proc, chunk_nic: &mut HashMap<ChunkId, (usize, u64)>, now: Instant) {
        loop {
            let mut any = false;
            for rail in 0..p.conns.len() {
                if let Some(c) = p.planner.poll_work(rail, now) {
                    assert_eq!(c.rail, rail);
                    assert!(p.conns[rail].up, "work for a rail that is down");
                    chunk_nic.insert(c.id, (p.conns[rail].nic, c.piece.len));
                    p.conns[rail].queue.push_back(Queued { id: c.id, left: c.piece.len as f64 });
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    fn stalls(&mut self) {
        let now = self.at();
        for i in 0..self.procs.len() {
            if self.procs[i].planner.poll_timeout().is_some_and(|t| t <= now) {
                for (rail, reason) in self.procs[i].planner.poll_stalled(now) {
                    self.rail_down(i, rail, reason);
                }
            }
        }
    }

    /// Run until every transfer ended. Panics if the planners hang or the run passes `limit`.
    pub fn run(mut self) -> RunReport {
        let n = self.fabric.pairs();
        self.bytes_per_nic = vec![vec![0; n]; self.procs.len()];
        let caps: Vec<f64> = self.fabric.links.iter().map(|l| l.cap).collect();
        let wire_of: Vec<bool> = self.fabric.links.iter().map(|l| l.wire).collect();
        loop {
            while let Some(Reverse((t, _, w))) = self.queue.peek().copied() {
                if t > self.now {
                    break;
                }
                self.queue.pop();
                self.handle(w);
            }
            self.stalls();
            self.poll_work();
            if self.procs.iter().all(|p| p.done.is_some() || p.failed.is_some()) {
                break;
            }
            // The flows: every connection's head chunk.
            let heads: Vec<(usize, RailId)> = self
                .procs
                .iter()
                .enumerate()
                .flat_map(|(i, p)| p.conns.iter().enumerate().filter(|(_, c)| !c.queue.is_empty()).map(move |(r, _)| (i, r)))
                .collect();
            let paths: Vec<&[LinkId]> = heads.iter().map(|&(i, r)| self.procs[i].conns[r].path.as_slice()).collect();
            let rates = max_min(&caps, &paths);
            let ends: Vec<Duration> = heads
                .iter()
                .zip(&rates)
                .map(|(&(i, r), &rate)| {
                    let left = self.procs[i].conns[r].queue[0].left;
                    self.now + Duration::from_nanos((left / rate * 1e9).ceil().max(1.0) as u64)
                })
                .collect();
            let next_q = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let next_to = self
                .procs
                .iter()
                .filter_map(|p| p.planner.poll_timeout())
                .min()
                .map(|t| t.saturating_duration_since(self.t0).max(self.now));
            let Some(next) = [next_q, next_to, ends.iter().min().copied()].into_iter().flatten().min() else {
                panic!("planners hung at {:?}: work left, nothing in flight\n{}", self.now, self.dump());
            };
            assert!(next < self.limit, "run passed its limit of {:?}: hung?\n{}", self.limit, self.dump());
            let dt = (next - self.now).as_secs_f64();
            for (k, (&(i, r), &rate)) in heads.iter().zip(&rates).enumerate() {
                let moved;
                if ends[k] <= next {
                    let c = &mut self.procs[i].conns[r];
                    let head = c.queue.pop_front().expect("a head");
                    moved = head.left;
                    let (epoch, id) = (c.epoch, head.id);
                    let t = next + 2 * self.fabric.params.latency;
                    self.push(t, What::Report { proc: i, rail: r, epoch, id });
                } else {
                    moved = rate * dt;
                    self.procs[i].conns[r].queue[0].left -= moved;
                }
                for &l in &self.procs[i].conns[r].path {
                    self.link_bytes[l] += moved;
                    if wire_of[l] {
                        self.wire_bytes += moved;
                    }
                }
            }
            self.now = next;
            self.wire_trace.push((self.now, self.wire_bytes));
            self.steps += 1;
        }
        let end = self.procs.iter().filter_map(|p| p.done).max().unwrap_or(self.now);
        let procs = self
            .procs
            .iter()
            .zip(self.events)
            .zip(self.bytes_per_nic)
            .map(|((p, events), bytes_per_nic)| ProcReport {
                mem: p.mem,
                done: p.done,
                dones: p.dones.clone(),
                failed: p.failed.clone(),
                bytes_per_nic,
                events,
            })
            .collect();
        RunReport { procs, end, wire_trace: self.wire_trace, link_bytes: self.link_bytes, steps: self.steps }
    }

    fn dump(&self) -> String {
        let mut s = String::new();
        for (i, p) in self.procs.iter().enumerate() {
            let q: Vec<usize> = p.conns.iter().map(|c| c.queue.len()).collect();
            let _ = writeln!(s, "proc {i}: done {:?} failed {:?} queues {q:?} idle {}", p.done, p.failed, p.planner.is_idle());
        }
        s
    }
}
