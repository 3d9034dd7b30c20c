//! The striping planner: a sans-IO state machine that cuts transfers into chunks and hands
//! them to rails.
//!
//! Order of calls (the runtime's per-connection workers and the simulator do the same):
//! 1. [`Planner::add_rail`] once per rail, seeded with its link speed when known.
//! 2. [`Planner::submit`] a transfer as a list of [`Pair`]s (see [`pair_segments`]).
//! 3. A worker with room calls [`Planner::poll_work`] for its rail and executes the chunk.
//! 4. It reports [`Planner::handle_done`] (or [`Planner::handle_failed`]); the planner updates the
//!    rail's measured rate (see "Rate estimation" below).
//! 5. [`Planner::poll_event`] yields `XferDone` / `XferFailed`.
//! 6. A rail that errors is reported with [`Planner::handle_rail_down`]: its in-flight chunks go
//!    back to their transfers' retry queues and are reissued on the surviving rails.
//!    [`Planner::poll_timeout`] / [`Planner::poll_stalled`] decide that a rail stalled (the runtime's
//!    and the simulator's one stall decision); the driver stops the rail, then `handle_rail_down`.
//!
//! Weighted policy ("earliest common finish"): given each up rail's measured rate `r_j` and the
//! time `b_j` it needs to drain what it already has in flight (its in-flight bytes at `r_j`,
//! less what it has served since its last completion), the planner solves for the time
//! `T` at which all remaining unassigned bytes would be done if every rail worked until `T`
//! (`sum_j r_j * max(0, T - b_j) = remaining`). A rail asking for work gets at most
//! `r * (T - b)` bytes, so near the tail slow rails take smaller pieces or none and all rails
//! finish within about one chunk time of each other. When no rail's share is worth `min_chunk`
//! any more, the next crumb goes to the rail that would finish it first, so the pool always
//! drains. Transfers below `stripe_threshold` stay on one rail (the one that would finish them
//! first) for latency, and are served before the chunks of large transfers.
//!
//! Window: each rail keeps at most `chunk_size + rate * (window_time + rtt)` bytes in flight
//! (at least `min_window`, times a probe gain, below, at most `max_window`): the chunk being
//! served, the bytes that cover the round trip, and a queue of about `window_time` at the
//! rail. `rtt` is the in-flight time of a chunk that met no queue (issued to an idle rail) less
//! its service time at the *current* rate, so a round trip first measured against a wrong seed
//! does not stick.
//!
//! Rate estimation. The seed (`add_rail`'s link speed, else `default_rate`) only stands until
//! the first sample. A sample is the bytes a rail delivered over at least `sample_interval` of
//! a busy period, timed from completion to completion (so the first round trip is not counted
//! as slowness). Each chunk's wait behind other chunks at the rail is known (its in-flight time
//! less that of a chunk that met no queue), and samples are sorted by it:
//! - every chunk of the sample waited at least `window_time / 2`: the link was busy throughout
//!   and the sample measures it. It joins decayed sums of bytes and seconds (each sample decays
//!   the sums by `(1 - ewma_alpha)^(dt / sample_interval)`), and the rate is their ratio: the
//!   recent samples' bytes over their seconds. The sums start empty, so the first sample
//!   replaces the seed outright and the next ones average in as `1/n` until the EWMA's memory
//!   (about 95 ms at the defaults) takes over: no seed, however wrong, is worth more than one
//!   sample.
//! - otherwise the link may have idled and the sample measured the load offered, not the
//!   link: it is dropped, so tails, gaps and trickles cannot drag an estimate down. If the rail
//!   had work waiting all along, its window was what held it back, the window's gain is doubled
//!   (up to 16) until its chunks queue, and the first queued sample measures the link and
//!   resets the gain. This is what keeps an underestimate from confirming itself on a long
//!   path, where a window sized from a low rate cannot cover the bandwidth-delay product. A
//!   window already at `max_window` (or grown 16-fold to no effect) cannot help, and its
//!   samples count as they are.
//!
//! docs/planner.md has the details and the simulator results that chose the defaults.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::codec::{MAX_VEC_ENTRIES, MAX_VEC_PIECES};

pub type RailId = usize;

/// Largest window gain of a rail whose window holds it back (see [`Rail::add_sample`]).
const MAX_PROBE: f64 = 16.0;

/// Without progress evidence below chunk level, a rail may be silent for this many times the
/// service time of the chunk at the head of its queue (at its measured rate) before it counts
/// as stalled (see [`Planner::stall_deadline`]).
const STALL_CHUNKS: f64 = 4.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct XferId(pub u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub u64);

/// One contiguous piece of a transfer: `len` bytes at local address (or offset) `local` map to
/// `len` bytes at `offset` in remote region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub local: u64,
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// `count` pieces of `len` bytes each, all in remote region `region`: piece `k` is at local
/// address `local + k * lstride` and remote offset `offset + k * rstride`. A [`Pair`] is a run
/// of one piece; a strided descriptor list (NIXL's Nx5 rows, the native strided form) stays
/// one run from prepare to the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub local: u64,
    pub region: u64,
    pub offset: u64,
    pub len: u64,
    pub count: u64,
    pub lstride: u64,
    pub rstride: u64,
}

impl From<Pair> for Run {
    fn from(p: Pair) -> Run {
        Run { local: p.local, region: p.region, offset: p.offset, len: p.len, count: 1, lstride: 0, rstride: 0 }
    }
}

impl Run {
    /// Bytes of all its pieces.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// Piece `k` as a pair.
    pub fn piece(&self, k: u64) -> Pair {
        Pair {
            local: self.local.wrapping_add(k.wrapping_mul(self.lstride)),
            region: self.region,
            offset: self.offset.wrapping_add(k.wrapping_mul(self.rstride)),
            len: self.len,
        }
    }

    /// Its pieces, in order.
    pub fn pieces(&self) -> impl Iterator<Item = Pair> + '_ {
        (0..self.count).map(|k| self.piece(k))
    }
}

/// The wire's piece table for a vectored chunk's runs (all in one region): a run of one piece
/// is one entry, a strided run one strided entry (one plain entry when contiguous on the remote
/// side), and entries that continue each other on the remote side are merged. The local side
/// does not matter here: the initiator gathers or scatters its own pieces.
pub fn vec_pieces(runs: &[Run]) -> Vec<crate::codec::VecPiece> {
    use crate::codec::VecPiece;
    let mut out: Vec<VecPiece> = Vec::with_capacity(runs.len());
    for r in runs {
        let p = if r.count == 1 || r.rstride == r.len {
            VecPiece { offset: r.offset, len: r.len * r.count, count: 1, stride: 0 }
        } else {
            VecPiece { offset: r.offset, len: r.len, count: r.count, stride: r.rstride }
        };
        match out.last_mut() {
            Some(q) if p.count == 1 && q.count == 1 && q.offset + q.len == p.offset => q.len += p.len,
            _ => out.push(p),
        }
    }
    out
}

/// A unit of work handed to one rail.
///
/// `piece` names the chunk's first byte (local address, region, offset) and its length in
/// bytes. When `vec` is None the chunk is that one contiguous piece. Otherwise it is a vectored
/// chunk (only handed to rails marked with [`Planner::set_vectored`]): `vec` lists its runs in
/// order, all in `piece.region`, `piece.len` bytes in all, within the protocol's vectored
/// bounds ([`MAX_VEC_ENTRIES`] runs, [`MAX_VEC_PIECES`] pieces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub xfer: XferId,
    pub id: ChunkId,
    pub rail: RailId,
    pub piece: Pair,
    pub vec: Option<Arc<[Run]>>,
    /// For a transfer submitted with rail tiers ([`Planner::submit_tiered`]): the tier the
    /// rail was taken from (0: the nearest). None for a transfer free to use every rail.
    pub tier: Option<u8>,
}

impl Chunk {
    /// The chunk's pieces, in order.
    pub fn pieces(&self) -> Vec<Pair> {
        match &self.vec {
            None => vec![self.piece],
            Some(v) => v.iter().flat_map(|r| r.pieces()).collect(),
        }
    }
}

/// Work cut from a transfer: a chunk's contents (see [`Chunk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Work {
    piece: Pair,
    vec: Option<Arc<[Run]>>,
}

/// A position in a run list: run `idx`, its piece `elem`, `skip` bytes into that piece.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    idx: usize,
    elem: u64,
    skip: u64,
}

/// Cut at most `max` bytes (at least one when any is left) from `runs` at `cur`, advancing it.
/// With `vec` the cut takes pieces of one region while they fit, whole strided runs (or whole
/// pieces of them) staying one run, within the vectored bounds; without, it is one contiguous
/// piece. Returns the work and its length; None when nothing is left.
fn cut(runs: &[Run], cur: &mut Cursor, max: u64, vec: bool) -> Option<Work> {
    let mut out: Vec<Run> = Vec::new();
    let (mut bytes, mut elems) = (0u64, 0u64);
    let mut region = None;
    while cur.idx < runs.len() && bytes < max {
        let r = &runs[cur.idx];
        if r.len == 0 || cur.elem >= r.count {
            *cur = Cursor { idx: cur.idx + 1, elem: 0, skip: 0 };
            continue;
        }
        if region.is_some_and(|g| g != r.region) {
            break;
        }
        if !out.is_empty() && (!vec || out.len() >= MAX_VEC_ENTRIES || elems >= MAX_VEC_PIECES) {
            break;
        }
        region = Some(r.region);
        let room = max - bytes;
        let at = r.piece(cur.elem);
        if cur.skip > 0 || room < r.len || !vec || r.count == 1 {
            let n = (r.len - cur.skip).min(room);
            out.push(Run { local: at.local + cur.skip, offset: at.offset + cur.skip, len: n, count: 1, lstride: 0, rstride: 0, ..*r });
            bytes += n;
            elems += 1;
            cur.skip += n;
            if cur.skip == r.len {
                cur.skip = 0;
                cur.elem += 1;
            }
        } else {
            let k = (r.count - cur.elem).min(room / r.len).min(MAX_VEC_PIECES - elems);
            let run = if k == 1 { Run { count: 1, lstride: 0, rstride: 0, ..*r } } else { Run { count: k, ..*r } };
            out.push(Run { local: at.local, offset: at.offset, ..run });
            bytes += k * r.len;
            elems += k;
            cur.elem += k;
        }
        if cur.elem >= r.count {
            *cur = Cursor { idx: cur.idx + 1, elem: 0, skip: 0 };
        }
        if !vec {
            break;
        }
    }
    let first = out.first()?;
    let piece = Pair { local: first.local, region: first.region, offset: first.offset, len: bytes };
    let vec = if out.len() == 1 && out[0].count == 1 { None } else { Some(Arc::from(out)) };
    Some(Work { piece, vec })
}

/// What is left of `runs` from `cur` on.
fn rest(runs: &[Run], cur: Cursor) -> Vec<Run> {
    let mut out = Vec::new();
    let Some(r) = runs.get(cur.idx) else { return out };
    let mut elem = cur.elem;
    if cur.skip > 0 {
        let at = r.piece(elem);
        out.push(Run {
            local: at.local + cur.skip,
            offset: at.offset + cur.skip,
            len: r.len - cur.skip,
            count: 1,
            lstride: 0,
            rstride: 0,
            ..*r
        });
        elem += 1;
    }
    if elem < r.count {
        let at = r.piece(elem);
        out.push(Run { local: at.local, offset: at.offset, count: r.count - elem, ..*r });
    }
    out.extend_from_slice(&runs[cur.idx + 1..]);
    out
}

impl Work {
    fn runs(&self) -> Vec<Run> {
        match &self.vec {
            None => vec![Run::from(self.piece)],
            Some(v) => v.to_vec(),
        }
    }

    /// Cut the front (at most `max` bytes; one contiguous piece unless `vec`) off this work:
    /// the head, and the rest as works within the vectored bounds (in order). None when all
    /// of it goes as it is.
    fn split_front(&self, max: u64, vec: bool) -> Option<(Work, Vec<Work>)> {
        if self.piece.len <= max && (vec || self.vec.is_none()) {
            return None;
        }
        let runs = self.runs();
        let mut cur = Cursor::default();
        let head = cut(&runs, &mut cur, max, vec).expect("work is never empty");
        let left = rest(&runs, cur);
        let mut c2 = Cursor::default();
        let tail = std::iter::from_fn(|| cut(&left, &mut c2, u64::MAX, true)).collect();
        Some((head, tail))
    }
}

/// The most lateness of completions a rail's window covers, in `window_time`s (see
/// [`Rail::window`]): 2 x 4 ms covers the 1-6 ms late reports of a busy host.
const LATE_COVER_WINDOWS: f64 = 2.0;

/// How chunks are assigned to rails. A named public type so callers and the bench can pick it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// By measured throughput, with tail balancing (default).
    Weighted,
    /// Chunk i of a transfer goes to the i-th up rail in turn, whatever the rails deliver.
    RoundRobin,
    /// Everything on one rail.
    Pinned(RailId),
}

#[derive(Debug, Clone)]
pub struct PlannerConfig {
    /// Largest chunk handed out.
    pub chunk_size: u64,
    /// Smallest piece the tail balancer cuts (the last piece of a pair may be smaller).
    pub min_chunk: u64,
    /// Transfers smaller than this stay on one rail.
    pub stripe_threshold: u64,
    /// A rail keeps `chunk_size + rate * (window_time + rtt)` bytes in flight: about
    /// `window_time` of work queued at the rail ...
    pub window_time: Duration,
    /// ... but never less than this ...
    pub min_window: u64,
    /// ... nor more than this.
    pub max_window: u64,
    /// Rate assumed for a rail whose link speed is unknown, in bytes/s (until its first sample).
    pub default_rate: f64,
    /// Weight of one `sample_interval` worth of new measurement in the rate estimate, once the
    /// estimate has that much history (before, the samples are averaged evenly).
    pub ewma_alpha: f64,
    /// Shortest stretch of a busy period that yields a rate sample.
    pub sample_interval: Duration,
    /// A rail with work in flight and no progress for this long is declared down (see
    /// [`Planner::poll_stalled`] for what counts as progress and when the deadline is longer).
    pub stall_timeout: Duration,
    /// The driver reports progress below chunk level ([`Planner::handle_progress`]: bytes
    /// received, or sent bytes acknowledged) whenever a rail moved bytes within
    /// `stall_timeout`. Then silence is measured in bytes and the deadline is `stall_timeout`
    /// whatever the chunk size. Without it, only a completed chunk shows progress, and a rail
    /// may stay silent for up to `STALL_CHUNKS` (4) service times of its head chunk at its
    /// measured rate: a rail shared by many peers serves each one's chunks slowly.
    pub byte_progress: bool,
    /// A rail whose driver reports it held ([`Planner::handle_held`]; e.g. held back on this host: every
    /// byte it sent was acknowledged and the rest waits in this host's own full queue, which
    /// TCP retries on a backing-off timer) is not stalled until it has made no progress for
    /// this long: a path that answered everything it was asked is not dead.
    pub held_timeout: Duration,
    pub policy: Policy,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            chunk_size: 1 << 20,
            min_chunk: 64 << 10,
            stripe_threshold: 256 << 10,
            window_time: Duration::from_millis(4),
            min_window: 2 << 20,
            max_window: 64 << 20,
            default_rate: 1.25e9,
            ewma_alpha: 0.1,
            sample_interval: Duration::from_millis(10),
            stall_timeout: Duration::from_millis(500),
            byte_progress: false,
            held_timeout: Duration::from_secs(5),
            policy: Policy::Weighted,
        }
    }
}

/// What the planner tells its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    XferDone(XferId),
    /// The transfer cannot complete: no rail is left (the reason names each rail and its cause),
    /// or it was pinned to a rail that went down.
    XferFailed {
        xfer: XferId,
        reason: String,
    },
    RailDown {
        rail: RailId,
        reason: String,
    },
    RailUp(RailId),
}

/// A rail's state and counters, for bench output and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct RailStats {
    pub up: bool,
    /// Measured (or seeded) rate in bytes/s.
    pub rate: f64,
    pub inflight_bytes: u64,
    pub bytes_done: u64,
    pub chunks_done: u64,
    pub chunks_reissued: u64,
    pub times_down: u64,
    /// Times declared stalled (`Planner::poll_stalled`).
    pub stalls: u64,
    pub down_reason: Option<String>,
    /// Why the rail last went down, kept after it is readmitted.
    pub last_down_reason: Option<String>,
    /// The tier of the last chunk the rail took for a tiered transfer (0: the nearest); None
    /// when it has served none.
    pub tier: Option<u8>,
    /// Bytes the rail completed for tiered transfers as a farther tier (> 0): the transfer's
    /// nearer rails were all down.
    pub fallback_bytes: u64,
}

#[derive(Debug)]
struct Rail {
    up: bool,
    /// Takes vectored chunks ([`Planner::set_vectored`]).
    vectored: bool,
    /// Its driver reports progress below chunk level (`PlannerConfig::byte_progress`, per rail
    /// since [`Planner::set_byte_progress`]).
    byte_progress: bool,
    /// Estimated delivery rate, bytes/s: the seed until the first sample, then
    /// `est_bytes / est_secs`.
    rate: f64,
    /// Decayed sums over the samples behind `rate`: bytes delivered and the seconds it took.
    /// Both start at zero, so the first sample replaces the seed outright.
    est_bytes: f64,
    est_secs: f64,
    inflight_bytes: u64,
    inflight_chunks: usize,
    /// Start of the current rate sample: the first completion of a busy period (a period
    /// with work in flight), so the sample measures delivery, not the first round trip.
    busy_since: Option<Instant>,
    /// Bytes completed since `busy_since`.
    sample_bytes: u64,
    /// The shortest time a chunk completed in the current sample waited behind other chunks
    /// at the rail (see [`Rail::queued_for`]); infinite while none was measured.
    sample_wait: f64,
    /// A chunk completed in the current sample was issued while the rail was `starved`.
    sample_starved: bool,
    /// The rail had room in its window and nothing to take, and has not been filled to its
    /// window since: a chunk issued now may find the link idle for want of work.
    starved: bool,
    /// Window gain, doubled while the window holds the rail back (see [`Rail::add_sample`]).
    probe: f64,
    last_progress: Instant,
    /// When the driver last reported the rail held (`handle_held`).
    last_held: Option<Instant>,
    /// Declared stalled (`poll_stalled`) and not yet down: no new work, its chunks stay in
    /// flight until the driver has stopped the rail's paths and calls `handle_rail_down`.
    failing: bool,
    /// Of the chunks issued while the rail had nothing in flight (so they met no queue), the
    /// (time in flight, length) of the one with the least time beyond its own service time.
    /// The round trip is recomputed from it with the current rate (see [`Rail::rtt`]).
    idle_trip: Option<(Duration, u64)>,
    /// The last completion, while a chunk issued before it is still in flight (see `late`).
    last_done: Option<Instant>,
    /// How late completions reach the planner beyond the service time of their chunk, in
    /// seconds: a decaying maximum (same memory as the rate estimate) of the gap between two
    /// completions of a busy rail less the second chunk's service time at the current rate. The
    /// window covers it (see [`Rail::window`]). It decays with the time the rail is busy (from
    /// one completion to the next), not across idle gaps: a rail whose completions come late
    /// keeps its cover from one transfer to the next.
    late: f64,
    bytes_done: u64,
    chunks_done: u64,
    chunks_reissued: u64,
    times_down: u64,
    /// Times declared stalled.
    stalls: u64,
    down_reason: Option<String>,
    last_down_reason: Option<String>,
    tier: Option<u8>,
    fallback_bytes: u64,
}

/// Rails as a bit set (bit i: rail i). Tiers name at most 64 rails; a link with more rails
/// does not tier its transfers (the runtime's check).
pub type RailMask = u64;

/// Every rail.
pub const ALL_RAILS: RailMask = u64::MAX;

#[derive(Debug)]
struct Xfer {
    id: XferId,
    /// Shared with the prepared handle: a post copies nothing per piece.
    runs: Arc<[Run]>,
    /// Where the next fresh chunk starts.
    cur: Cursor,
    /// Bytes of `runs` not cut yet.
    fresh: u64,
    /// Chunks of this transfer may be vectored (on rails that take them).
    vectored: bool,
    /// Pieces to do again (their rail failed); served before new pieces.
    retry: VecDeque<Work>,
    unassigned: u64,
    inflight: usize,
    pinned: Option<RailId>,
    /// Below `stripe_threshold` (weighted policy): kept on one rail and served before the
    /// chunks of large transfers, so a small transfer never waits behind a large one's queue.
    small: bool,
    rr_next: usize,
    /// Rail tiers, nearest first ([`Planner::submit_tiered`]): the transfer uses only the
    /// first tier with a rail up. None: every rail.
    tiers: Option<Arc<[RailMask]>>,
}

impl Rail {
    /// The round trip: time in flight of a chunk that met no queue, less its service time at
    /// the current rate. Recomputed on every use, so a round trip measured while the rate was
    /// far off (a seed) does not stick once the rate is known.
    fn rtt(&self) -> Duration {
        self.idle_trip.map_or(Duration::ZERO, |(t, len)| trip_excess(t, len, self.rate))
    }

    /// Seconds until the rail has delivered what it has in flight: its in-flight bytes at its
    /// rate, less what it has served of the chunk at their head since its last completion (a
    /// busy rail starts on its next chunk when it finishes one; `chunk_size` bounds that
    /// chunk, so a rail that is late or stalled still counts as busy with the rest). Counting
    /// the head chunk as unserved would make every busy rail look up to a chunk time later
    /// than it is, and the tail would then give the rail asking for work too much.
    fn drain_time(&self, now: Instant, chunk_size: u64) -> f64 {
        let head = self.inflight_bytes.min(chunk_size) as f64 / self.rate;
        let served = now.saturating_duration_since(self.last_progress).as_secs_f64().min(head);
        self.inflight_bytes as f64 / self.rate - served
    }

    /// Forget the current sample (a new busy period starts).
    fn clear_sample(&mut self) {
        self.busy_since = None;
        self.sample_bytes = 0;
        self.sample_wait = f64::INFINITY;
        self.sample_starved = false;
    }

    /// Open a new sample at `now` (a completion).
    fn start_sample(&mut self, now: Instant) {
        self.clear_sample();
        self.busy_since = Some(now);
    }

    /// Seconds a chunk of `len` bytes that spent `trip` in flight waited behind other chunks
    /// at the rail: `trip` less the in-flight time of a chunk that met no queue (scaled to
    /// `len`). `None` until such a chunk has been seen.
    fn queued_for(&self, trip: Duration, len: u64) -> Option<f64> {
        let (t0, len0) = self.idle_trip?;
        let alone = t0.as_secs_f64() + (len as f64 - len0 as f64) / self.rate;
        Some(trip.as_secs_f64() - alone)
    }

    /// The rail's in-flight budget: `chunk_size + rate * (window_time + rtt)`, at least
    /// `min_window`, times `probe`, at most `max_window`: the chunk being served, the bytes
    /// that cover the round trip (so the link does not idle while a new chunk is on its way)
    /// and `window_time` of margin, a queue of about `window_time` at the rail. `probe` is 1
    /// unless the window has been found too small (see [`Rail::add_sample`]).
    fn window(&self, cfg: &PlannerConfig) -> u64 {
        let mut cover = self.rate * self.rtt().as_secs_f64();
        // Completions that reach the planner late leave the link idle unless the window holds
        // the work that arrives meanwhile (issue 22: UCX put acknowledgements processed late on
        // a busy host; with the window of a 2 Gbit/s rail at two chunks the link idled, the
        // rail's estimate fell short of its link and the slower rails got its share).
        // Capped at LATE_COVER_WINDOWS x `window_time`: one descheduled stretch of the host
        // (a completion 100+ ms late) must not widen the window by that much work.
        cover += self.rate * self.late.min(LATE_COVER_WINDOWS * cfg.window_time.as_secs_f64());
        if self.est_secs == 0.0 {
            // No sample yet: the rate is a seed, and the excess of a chunk's time in flight over
            // its service time at a seed that is too high is mostly the chunk's own service,
            // not a round trip. Cover at most two chunks' worth of it until the rate is known.
            // Issue 22: a 0.5 Gbit/s rail seeded at a veth's 10 Gbit/s saw 16 ms of "round
            // trip" in its first chunk, and a 24 MiB window at the seed took 19 chunks at once,
            // 4x its share: the first 64 MiB READ over 2 + 1 + 0.5 Gbit/s ran at 33% in the
            // simulator, 47% on the testbed.
            cover = cover.min(2.0 * cfg.chunk_size as f64);
        }
        let w = (cfg.chunk_size as f64 + self.rate * cfg.window_time.as_secs_f64() + cover).max(cfg.min_window as f64) * self.probe;
        (w as u64).min(cfg.max_window.max(cfg.min_window))
    }

    /// Fold a sample of `bytes` delivered in `dt` into the estimate.
    ///
    /// Only a sample taken while the link was kept busy measures the link. The window keeps
    /// about `window_time` of work queued at a busy rail, so when every chunk of the sample
    /// waited behind others for at least half of that, the link was busy: the sample is
    /// added to the decayed sums (decayed by `(1 - ewma_alpha)^(dt / sample_interval)`), and
    /// the estimate is bytes over seconds of the recent samples, each counting by its length.
    ///
    /// Otherwise the link may have idled, and the sample measured what the rail was given,
    /// not what it can do; it is dropped. If the rail was short of work, that is all. If it
    /// was not, its window held it back: the estimate (or the round trip) is too low for the
    /// window to cover the path, and the window is doubled (`probe`) until the chunks queue;
    /// the first queued sample then measures the link, and `probe` returns to 1. A window
    /// already at `max_window` cannot grow: the rail is as fast as the configuration lets it
    /// be, and the sample counts. So it does once the window has grown `MAX_PROBE`-fold
    /// without the chunks queueing: something other than the window (the driver's own
    /// limits) holds the rail back, and what it delivers is what it can do.
    fn add_sample(&mut self, bytes: u64, dt: Duration, cfg: &PlannerConfig) {
        let secs = dt.as_secs_f64();
        if secs <= 0.0 {
            return;
        }
        let margin = cfg.window_time.as_secs_f64() / 2.0;
        let queued = self.sample_wait >= margin;
        let capped = self.probe >= MAX_PROBE || self.window(cfg) >= cfg.max_window;
        if !queued && !capped {
            if !self.sample_starved {
                self.probe = (self.probe * 2.0).min(MAX_PROBE);
            }
            return;
        }
        self.probe = 1.0;
        let keep = (1.0 - cfg.ewma_alpha).powf(secs / cfg.sample_interval.as_secs_f64());
        self.est_bytes = self.est_bytes * keep + bytes as f64;
        self.est_secs = self.est_secs * keep + secs;
        self.rate = self.est_bytes / self.est_secs;
    }
}

/// Time in flight beyond the service time of `len` bytes at `rate`.
fn trip_excess(in_flight: Duration, len: u64, rate: f64) -> Duration {
    in_flight.saturating_sub(Duration::from_secs_f64(len as f64 / rate))
}

impl Xfer {
    fn has_work(&self) -> bool {
        !self.retry.is_empty() || self.fresh > 0
    }
}

#[derive(Debug, Clone)]
struct InFlight {
    xfer: XferId,
    rail: RailId,
    piece: Pair,
    vec: Option<Arc<[Run]>>,
    issued: Instant,
    /// Issued while its rail had nothing in flight: it met no queue.
    idle_start: bool,
    /// Issued while its rail was `starved`.
    starved: bool,
    /// The tier the rail served its transfer as (see [`Chunk::tier`]).
    tier: Option<u8>,
}

/// See the module documentation for the model and the order of calls.
#[derive(Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    rails: Vec<Rail>,
    xfers: VecDeque<Xfer>,
    inflight: HashMap<ChunkId, InFlight>,
    events: VecDeque<Event>,
    next_chunk: u64,
    /// Unassigned bytes of striped (not pinned) transfers.
    striped_unassigned: u64,
    /// Keep transfers queued while every rail is down ([`Planner::set_hold_when_all_down`]).
    hold: bool,
    /// Since when every rail has been down with transfers held.
    all_down_since: Option<Instant>,
    /// Transfers queued with rail tiers ([`Planner::submit_tiered`]); while there are none,
    /// every striped transfer shares one pool over every rail.
    tiered: usize,
}

/// Rail `i` as a mask bit (rails beyond the 64th share bit 63: only untiered transfers, whose
/// mask is every rail, reach them).
fn bit(i: RailId) -> RailMask {
    1u64 << i.min(63)
}

/// Cut two differently segmented lists of equal total length into pairs of equal-length
/// pieces. `local` is (address, len); `remote` is (region, offset, len).
pub fn pair_segments(local: &[(u64, u64)], remote: &[(u64, u64, u64)]) -> Result<Vec<Pair>, (u64, u64)> {
    let lt: u64 = local.iter().map(|l| l.1).sum();
    let rt: u64 = remote.iter().map(|r| r.2).sum();
    if lt != rt {
        return Err((lt, rt));
    }
    let mut out = Vec::with_capacity(local.len().max(remote.len()));
    let (mut i, mut j, mut li, mut rj) = (0usize, 0usize, 0u64, 0u64);
    while i < local.len() && j < remote.len() {
        let (la, ll) = local[i];
        let (rg, ro, rl) = remote[j];
        let n = (ll - li).min(rl - rj);
        if n > 0 {
            out.push(Pair { local: la + li, region: rg, offset: ro + rj, len: n });
        }
        li += n;
        rj += n;
        if li == ll {
            i += 1;
            li = 0;
        }
        if rj == rl {
            j += 1;
            rj = 0;
        }
    }
    Ok(out)
}

/// [`pair_segments`] in one pass over rows resolved on the fly, merging as it goes: `local(i)`
/// resolves local row `i` to `(tag, address, len)` and `remote(j)` remote row `j` to
/// `(region, offset, len)`, each called once per row, in order. A piece that continues the
/// previous pair on both sides (adjacent local address and remote offset, same local tag, same
/// region) extends that pair instead of starting one, so contiguous runs become one pair; the
/// pairs map the same bytes to the same bytes as `pair_segments` does.
///
/// None when a row does not resolve or the totals differ (rows may be left unresolved then):
/// the caller works out which error to report.
pub fn pair_rows(
    ln: usize,
    mut local: impl FnMut(usize) -> Option<(u64, u64, u64)>,
    rn: usize,
    mut remote: impl FnMut(usize) -> Option<(u64, u64, u64)>,
) -> Option<Vec<Pair>> {
    let mut out: Vec<Pair> = Vec::with_capacity(ln.max(rn));
    // The unpaired rest of the current row on each side, and the local tag of the last pair.
    let ((mut ltag, mut la, mut ll), (mut rg, mut ro, mut rl)) = ((0, 0, 0), (0, 0, 0));
    let (mut i, mut j, mut last_tag) = (0usize, 0usize, 0u64);
    'pair: loop {
        while ll == 0 {
            if i == ln {
                break 'pair;
            }
            (ltag, la, ll) = local(i)?;
            i += 1;
        }
        while rl == 0 {
            if j == rn {
                break 'pair;
            }
            (rg, ro, rl) = remote(j)?;
            j += 1;
        }
        let n = ll.min(rl);
        let prev = out.last_mut().filter(|p| {
            last_tag == ltag && p.region == rg && p.local.checked_add(p.len) == Some(la) && p.offset.checked_add(p.len) == Some(ro)
        });
        match prev {
            Some(p) => p.len += n,
            None => {
                out.push(Pair { local: la, region: rg, offset: ro, len: n });
                last_tag = ltag;
            }
        }
        (la, ll, ro, rl) = (la.wrapping_add(n), ll - n, ro.wrapping_add(n), rl - n);
    }
    // The loop ends with every local row taken (when the remote rows ran out first, a local
    // row is left unpaired): what is left of the remote side must be empty rows.
    if ll != 0 || rl != 0 {
        return None;
    }
    for j in j..rn {
        if remote(j)?.2 != 0 {
            return None;
        }
    }
    if out.len() < out.capacity() / 2 {
        out.shrink_to_fit();
    }
    Some(out)
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Self {
        Planner {
            cfg,
            rails: Vec::new(),
            xfers: VecDeque::new(),
            inflight: HashMap::new(),
            events: VecDeque::new(),
            next_chunk: 0,
            striped_unassigned: 0,
            hold: false,
            all_down_since: None,
            tiered: 0,
        }
    }

    /// With `on`, losing the last up rail does not fail the transfers: they stay queued (and
    /// new ones are queued) while the driver probes and readmits rails. The driver decides when
    /// to give up: [`Planner::all_down_since`] says since when nothing could move, and
    /// [`Planner::take_all`] drops every transfer. Off (the default): they fail at once with
    /// "no rail left".
    pub fn set_hold_when_all_down(&mut self, on: bool) {
        self.hold = on;
    }

    /// Since when transfers have been held: every rail went down then, and no byte has moved
    /// since (a rail readmitted meanwhile does not end it until data moves on it). None while
    /// nothing is held.
    pub fn all_down_since(&self) -> Option<Instant> {
        if self.xfers.is_empty() {
            return None;
        }
        self.all_down_since
    }

    /// Drop every transfer (in-flight chunks forgotten, as [`Planner::cancel`]); returns their
    /// ids, for the driver to fail them with its own reason.
    pub fn take_all(&mut self) -> Vec<XferId> {
        let ids: Vec<XferId> = self.xfers.iter().map(|x| x.id).collect();
        for id in &ids {
            self.drop_xfer(*id);
        }
        ids
    }

    /// Whether any rail is up.
    pub fn any_rail_up(&self) -> bool {
        self.rails.iter().any(|r| r.up)
    }

    /// Why every rail is down, as the failure reason of held transfers.
    pub fn down_reason(&self) -> String {
        self.all_down_reason()
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// Add a rail; `rate_hint` is its link speed in bytes/s when known.
    pub fn add_rail(&mut self, rate_hint: Option<f64>, now: Instant) -> RailId {
        let rate = rate_hint.filter(|r| *r > 0.0).unwrap_or(self.cfg.default_rate);
        self.rails.push(Rail {
            up: true,
            vectored: false,
            byte_progress: self.cfg.byte_progress,
            rate,
            est_bytes: 0.0,
            est_secs: 0.0,
            inflight_bytes: 0,
            inflight_chunks: 0,
            busy_since: None,
            sample_bytes: 0,
            sample_wait: f64::INFINITY,
            sample_starved: false,
            starved: false,
            probe: 1.0,
            last_progress: now,
            last_held: None,
            failing: false,
            idle_trip: None,
            last_done: None,
            late: 0.0,
            bytes_done: 0,
            chunks_done: 0,
            chunks_reissued: 0,
            times_down: 0,
            stalls: 0,
            down_reason: None,
            last_down_reason: None,
            tier: None,
            fallback_bytes: 0,
        });
        self.rails.len() - 1
    }

    pub fn num_rails(&self) -> usize {
        self.rails.len()
    }

    pub fn rail_stats(&self, rail: RailId) -> RailStats {
        let r = &self.rails[rail];
        RailStats {
            up: r.up,
            rate: r.rate,
            inflight_bytes: r.inflight_bytes,
            bytes_done: r.bytes_done,
            chunks_done: r.chunks_done,
            chunks_reissued: r.chunks_reissued,
            times_down: r.times_down,
            stalls: r.stalls,
            down_reason: r.down_reason.clone(),
            last_down_reason: r.last_down_reason.clone(),
            tier: r.tier,
            fallback_bytes: r.fallback_bytes,
        }
    }

    /// Every rail's rate estimate, bytes/s, by rail index.
    pub fn rates(&self) -> impl Iterator<Item = f64> + '_ {
        self.rails.iter().map(|r| r.rate)
    }

    pub fn is_up(&self, rail: RailId) -> bool {
        self.rails[rail].up
    }

    /// True when no transfer is queued or in flight.
    pub fn is_idle(&self) -> bool {
        self.xfers.is_empty() && self.inflight.is_empty()
    }

    /// Whether some transfer still has bytes to hand out (fresh or to retry): what a sender
    /// thread could take now or once its rail has room. False once every byte is in flight
    /// or done, e.g. right after a small transfer's only chunk was sent.
    pub fn has_work(&self) -> bool {
        self.xfers.iter().any(|x| x.has_work())
    }

    /// Queue a transfer of contiguous pairs (never vectored). An empty transfer completes at
    /// once.
    pub fn submit(&mut self, xfer: XferId, pairs: Vec<Pair>, now: Instant) {
        let runs: Arc<[Run]> = pairs.into_iter().filter(|p| p.len > 0).map(Run::from).collect();
        let total = runs.iter().map(|r| r.len).sum();
        self.submit_runs(xfer, runs, total, false, now);
    }

    /// Mark whether `rail`'s driver reports progress below chunk level (bytes moving,
    /// [`Planner::handle_progress`]): then its silence is measured in bytes and its stall
    /// deadline is `stall_timeout`; otherwise in whole chunks (`STALL_CHUNKS` head-chunk
    /// times at its rate). Starts as `PlannerConfig::byte_progress`; a link whose rails run
    /// different transports sets it per rail (a rail that falls back from ucx to tcp gains it).
    pub fn set_byte_progress(&mut self, rail: RailId, on: bool) {
        if let Some(r) = self.rails.get_mut(rail) {
            r.byte_progress = on;
        }
    }

    /// Mark whether `rail` takes vectored chunks (its transport and the peer speak them).
    pub fn set_vectored(&mut self, rail: RailId, on: bool) {
        if let Some(r) = self.rails.get_mut(rail) {
            r.vectored = on;
        }
    }

    /// Queue a transfer of `runs` (`total` bytes: the sum of their [`Run::bytes`], which the
    /// caller computed once when it prepared them). With `vectored`, rails marked by
    /// [`Planner::set_vectored`] get chunks of many pieces of one region, packed by bytes
    /// (`chunk_size`), not by piece; other rails get one contiguous piece per chunk. The runs
    /// are shared, not copied: reposting a prepared transfer costs nothing per piece.
    pub fn submit_runs(&mut self, xfer: XferId, runs: Arc<[Run]>, total: u64, vectored: bool, now: Instant) {
        self.submit_tiered(xfer, runs, total, vectored, None, now);
    }

    /// As [`Planner::submit_runs`], over a subset of the rails: `tiers` lists rail sets
    /// (bit i: rail i), nearest first. At every moment the transfer uses only the first tier
    /// that has a rail up, striped by weight within it; a farther tier takes over only when
    /// every rail of the nearer ones is down, and the nearer tier takes the rest back once one
    /// of its rails is readmitted (chunks already handed out finish where they are). With no
    /// rail up in any tier the transfer fails, though rails outside the tiers may be up. The
    /// pinned policy ignores tiers (an explicit pin wins). None: every rail, as `submit_runs`.
    pub fn submit_tiered(
        &mut self,
        xfer: XferId,
        runs: Arc<[Run]>,
        total: u64,
        vectored: bool,
        tiers: Option<Arc<[RailMask]>>,
        now: Instant,
    ) {
        debug_assert_eq!(total, runs.iter().map(|r| r.bytes()).sum::<u64>());
        let tiers = tiers.filter(|_| !matches!(self.cfg.policy, Policy::Pinned(_)));
        if total == 0 {
            self.events.push_back(Event::XferDone(xfer));
            return;
        }
        let none_up = !self.rails.iter().any(|r| r.up);
        if none_up && !self.hold {
            let reason = self.all_down_reason();
            self.events.push_back(Event::XferFailed { xfer, reason });
            return;
        }
        // Held while no rail at all is up (`hold`); otherwise a transfer none of whose tiers
        // has a rail up fails.
        let mask = self.active_mask(tiers.as_deref());
        if mask == 0 && !none_up {
            let reason = self.tiers_down_reason(tiers.as_deref());
            self.events.push_back(Event::XferFailed { xfer, reason });
            return;
        }
        if none_up && self.xfers.is_empty() {
            self.all_down_since = Some(now);
        } else if none_up {
            self.all_down_since.get_or_insert(now);
        } else if self.xfers.is_empty() {
            self.all_down_since = None;
        }
        let pinned = match self.cfg.policy {
            Policy::Pinned(r) => Some(r),
            // Held while no rail is up: striped, whichever rail comes back takes it.
            Policy::Weighted if total < self.cfg.stripe_threshold && !none_up => Some(self.fastest_finish(total, mask, now)),
            _ => None,
        };
        if pinned.is_none() {
            self.striped_unassigned += total;
        }
        let small = self.cfg.policy == Policy::Weighted && pinned.is_some();
        self.xfers.push_back(Xfer {
            id: xfer,
            runs,
            cur: Cursor::default(),
            fresh: total,
            vectored,
            retry: VecDeque::new(),
            unassigned: total,
            inflight: 0,
            pinned,
            small,
            rr_next: 0,
            tiers,
        });
        if self.xfers.back().is_some_and(|x| x.tiers.is_some()) {
            self.tiered += 1;
        }
        if let Some(r) = pinned {
            if !self.rails.get(r).is_some_and(|r| r.up) {
                self.fail_xfer(xfer, format!("pinned rail {r} is not up"));
            }
        }
    }

    /// The rails a transfer with `tiers` may use now: those up in its first tier that has one
    /// up (every rail for None; 0 when no tier has a rail up).
    fn active_mask(&self, tiers: Option<&[RailMask]>) -> RailMask {
        let up = self.up_mask();
        match tiers {
            None => up,
            Some(t) => t.iter().map(|m| m & up).find(|m| *m != 0).unwrap_or(0),
        }
    }

    /// The up rails as a mask (every rail beyond the 64th counts as up in bit 63's place:
    /// tiers never name them, and untiered transfers only test membership of up rails).
    fn up_mask(&self) -> RailMask {
        self.rails.iter().enumerate().filter(|(_, r)| r.up).fold(0, |m, (i, _)| m | bit(i))
    }

    /// Why a transfer with `tiers` has no rail: each of its rails and its cause.
    fn tiers_down_reason(&self, tiers: Option<&[RailMask]>) -> String {
        let Some(t) = tiers else { return self.all_down_reason() };
        let mine = t.iter().fold(0, |a, m| a | m);
        let parts: Vec<String> = self
            .rails
            .iter()
            .enumerate()
            .filter(|(i, _)| mine & bit(*i) != 0)
            .map(|(i, r)| format!("rail {i}: {}", r.down_reason.clone().unwrap_or_else(|| "down".into())))
            .collect();
        if parts.is_empty() {
            return "no rail left: the transfer's rail tiers name none of the link's rails".into();
        }
        format!("no rail of the transfer's tiers left ({})", parts.join("; "))
    }

    /// Tiered transfers none of whose rails is up fail, naming each (rails outside their tiers
    /// may be up: they are not theirs).
    fn fail_stranded(&mut self) {
        if self.tiered == 0 {
            return;
        }
        let stranded: Vec<(XferId, String)> = self
            .xfers
            .iter()
            .filter(|x| x.tiers.is_some() && self.active_mask(x.tiers.as_deref()) == 0)
            .map(|x| (x.id, self.tiers_down_reason(x.tiers.as_deref())))
            .collect();
        for (id, why) in stranded {
            self.fail_xfer(id, why);
        }
    }

    /// The tier of `t` that holds `rail` (the first one), for the chunk's account.
    fn tier_of(t: Option<&[RailMask]>, rail: RailId) -> Option<u8> {
        let t = t?;
        t.iter().position(|m| m & bit(rail) != 0).map(|p| p.min(u8::MAX as usize) as u8)
    }

    /// The up rail in `mask` that would finish `bytes` first, given what it has in flight.
    fn fastest_finish(&self, bytes: u64, mask: RailMask, now: Instant) -> RailId {
        let mut best = (f64::INFINITY, 0);
        for (i, r) in self.rails.iter().enumerate().filter(|(i, r)| r.up && mask & bit(*i) != 0) {
            let t = r.drain_time(now, self.cfg.chunk_size) + bytes as f64 / r.rate;
            if t < best.0 {
                best = (t, i);
            }
        }
        best.1
    }

    /// The rail's in-flight budget (see [`Rail::window`]).
    fn window(&self, rail: RailId) -> u64 {
        self.rails[rail].window(&self.cfg)
    }

    /// Unassigned bytes of the striped transfers that use exactly the rails of `mask` now (all
    /// striped transfers when none is tiered).
    fn striped_for(&self, mask: RailMask) -> u64 {
        if self.tiered == 0 {
            return self.striped_unassigned;
        }
        let up = self.up_mask();
        self.xfers.iter().filter(|x| x.pinned.is_none() && self.active_mask(x.tiers.as_deref()) == mask & up).map(|x| x.unassigned).sum()
    }

    /// The most bytes `rail` should take now so that the rails of `mask` finish their striped
    /// transfers together (weighted policy).
    fn fair_share(&self, rail: RailId, mask: RailMask, now: Instant) -> u64 {
        let remaining = self.striped_for(mask) as f64;
        // b_j: seconds until rail j drains its in-flight work.
        let mut busy: Vec<(f64, f64)> = self
            .rails
            .iter()
            .enumerate()
            .filter(|(i, r)| r.up && mask & bit(*i) != 0)
            .map(|(_, r)| (r.drain_time(now, self.cfg.chunk_size), r.rate))
            .collect();
        busy.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut sum_rate, mut sum_rb) = (0.0, 0.0);
        let mut t = 0.0;
        for (k, &(b, r)) in busy.iter().enumerate() {
            sum_rate += r;
            sum_rb += r * b;
            t = (remaining + sum_rb) / sum_rate;
            let next_b = busy.get(k + 1).map(|x| x.0).unwrap_or(f64::INFINITY);
            if t <= next_b {
                break;
            }
        }
        let me = &self.rails[rail];
        let share = me.rate * (t - me.drain_time(now, self.cfg.chunk_size));
        if share <= 0.0 {
            0
        } else {
            share.ceil() as u64
        }
    }

    /// Hand `rail` its next chunk, or `None` when it has no window room, no eligible work, or
    /// (weighted policy, at the tail) another rail would finish the remaining bytes sooner.
    pub fn poll_work(&mut self, rail: RailId, now: Instant) -> Option<Chunk> {
        let r = self.rails.get(rail)?;
        if !r.up || r.failing {
            return None;
        }
        if self.rails[rail].inflight_bytes >= self.window(rail) {
            self.rails[rail].starved = false;
            return None;
        }
        let Some((xi, max_len)) = self.pick(rail, now) else {
            self.rails[rail].starved = true;
            return None;
        };
        Some(self.take(xi, rail, max_len, now))
    }

    /// Which transfer `rail` should serve next, and the largest piece it may take.
    fn pick(&self, rail: RailId, now: Instant) -> Option<(usize, u64)> {
        let chunk = self.cfg.chunk_size;
        // Small transfers kept on this rail for latency go first.
        if let Some(xi) = self.xfers.iter().position(|x| x.small && x.pinned == Some(rail) && x.has_work()) {
            return Some((xi, chunk));
        }
        for (xi, x) in self.xfers.iter().enumerate().filter(|(_, x)| x.has_work()) {
            let mask = if x.tiers.is_some() { self.active_mask(x.tiers.as_deref()) } else { ALL_RAILS };
            if x.pinned.is_none() && mask & bit(rail) == 0 {
                // Tiered away from this rail (a pinned small transfer was pinned within its tier).
                continue;
            }
            match (x.pinned, self.cfg.policy) {
                (Some(p), _) if p != rail => continue,
                (Some(_), _) => return Some((xi, chunk)),
                (None, Policy::RoundRobin) => {
                    // Retries go to any rail; fresh chunk i to the i-th up rail (`rail` is up).
                    let up: Vec<RailId> = (0..self.rails.len()).filter(|&i| self.rails[i].up && mask & bit(i) != 0).collect();
                    if x.retry.is_empty() && up[x.rr_next % up.len()] != rail {
                        continue;
                    }
                    return Some((xi, chunk));
                }
                // Weighted (a pinned policy pins every transfer). Transfers over the same rails
                // share one pool: the first one's answer stands for the others.
                (None, _) => {
                    if let Some(cap) = self.weighted_cap(rail, mask, now) {
                        return Some((xi, cap));
                    }
                    if self.tiered == 0 {
                        return None;
                    }
                    // Another transfer may stripe over other rails (tiers): ask for it too.
                }
            }
        }
        None
    }

    /// Weighted policy: the piece `rail` may take now from the striped pool of the transfers
    /// over the rails of `mask`, if any.
    fn weighted_cap(&self, rail: RailId, mask: RailMask, now: Instant) -> Option<u64> {
        let share = self.fair_share(rail, mask, now);
        if share >= self.cfg.min_chunk {
            return Some(share.next_multiple_of(4096).min(self.cfg.chunk_size));
        }
        // The tail: no rail's share is worth a minimum chunk any more. The next crumb (at most
        // `min_chunk`) goes to whichever rail would finish it first, so the pool always drains.
        let crumb = self.striped_for(mask).min(self.cfg.min_chunk);
        (self.fastest_finish(crumb, mask, now) == rail).then_some(self.cfg.min_chunk)
    }

    /// Cut the next piece (at most `max_len`) of transfer `xi` for `rail`.
    fn take(&mut self, xi: usize, rail: RailId, max_len: u64, now: Instant) -> Chunk {
        let vec = self.rails[rail].vectored;
        let x = &mut self.xfers[xi];
        let vec = vec && x.vectored;
        let Work { piece, vec } = if let Some(w) = x.retry.front() {
            let head = match w.split_front(max_len, vec) {
                Some((h, tail)) => {
                    x.retry.pop_front();
                    for t in tail.into_iter().rev() {
                        x.retry.push_front(t);
                    }
                    h
                }
                None => x.retry.pop_front().expect("front exists"),
            };
            self.rails[rail].chunks_reissued += 1;
            head
        } else {
            let head = cut(&x.runs, &mut x.cur, max_len, vec).expect("has_work: bytes are left");
            x.fresh -= head.piece.len;
            x.rr_next += 1;
            head
        };
        x.unassigned -= piece.len;
        x.inflight += 1;
        if x.pinned.is_none() {
            self.striped_unassigned -= piece.len;
        }
        let id = ChunkId(self.next_chunk);
        self.next_chunk += 1;
        let xfer = x.id;
        let tier = Self::tier_of(x.tiers.as_deref(), rail);
        let r = &mut self.rails[rail];
        r.tier = tier.or(r.tier);
        let idle_start = r.inflight_chunks == 0;
        if idle_start {
            // A new busy period: its first round trip is not sampled, so no gap before it counts.
            r.clear_sample();
            r.starved = false;
            r.last_progress = now;
            r.last_held = None;
        }
        let starved = r.starved;
        r.inflight_chunks += 1;
        r.inflight_bytes += piece.len;
        self.inflight.insert(id, InFlight { xfer, rail, piece, vec: vec.clone(), issued: now, idle_start, starved, tier });
        Chunk { xfer, id, rail, piece, vec, tier }
    }

    /// A chunk finished on its rail. Returns false for a chunk the planner no longer tracks
    /// (already reissued after its rail went down, or its transfer was cancelled).
    pub fn handle_done(&mut self, chunk: ChunkId, now: Instant) -> bool {
        let Some(f) = self.release(chunk, Some(now)) else {
            return false;
        };
        if self.rails[f.rail].up {
            self.all_down_since = None;
        }
        let cfg = &self.cfg;
        let r = &mut self.rails[f.rail];
        r.bytes_done += f.piece.len;
        r.chunks_done += 1;
        if f.tier.is_some_and(|t| t > 0) {
            r.fallback_bytes += f.piece.len;
        }
        if f.idle_start {
            // A chunk that met no queue: its time in flight is its service time plus the round
            // trip. Keep the one with the least excess (judged at the current rate).
            let trip = now.saturating_duration_since(f.issued);
            if r.idle_trip.is_none_or(|(t, len)| trip_excess(trip, f.piece.len, r.rate) < trip_excess(t, len, r.rate)) {
                r.idle_trip = Some((trip, f.piece.len));
            }
        }
        // How late this completion came: the gap since the last one, when this chunk was already
        // in flight before it (so the rail had it to serve throughout), less its service time.
        let busy = r.last_done.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
        let keep = (1.0 - cfg.ewma_alpha).powf(busy / cfg.sample_interval.as_secs_f64());
        let late = match r.last_done {
            Some(prev) if f.issued <= prev => now.saturating_duration_since(prev).as_secs_f64() - f.piece.len as f64 / r.rate,
            _ => 0.0,
        };
        r.late = (r.late * keep).max(late);
        r.last_done = (r.inflight_chunks > 0).then_some(now);
        if let Some(t0) = r.busy_since {
            r.sample_bytes += f.piece.len;
            if let Some(w) = r.queued_for(now.saturating_duration_since(f.issued), f.piece.len).filter(|_| !f.idle_start) {
                r.sample_wait = r.sample_wait.min(w);
            }
            r.sample_starved |= f.starved;
            let dt = now.saturating_duration_since(t0);
            if dt >= cfg.sample_interval {
                r.add_sample(r.sample_bytes, dt, cfg);
                r.start_sample(now);
            }
        } else {
            r.start_sample(now);
        }
        if r.inflight_chunks == 0 {
            r.busy_since = None;
        }
        if let Some(xi) = self.xfers.iter().position(|x| x.id == f.xfer) {
            let x = &mut self.xfers[xi];
            x.inflight -= 1;
            if x.unassigned == 0 && x.inflight == 0 {
                if x.tiers.is_some() {
                    self.tiered -= 1;
                }
                self.xfers.remove(xi);
                self.events.push_back(Event::XferDone(f.xfer));
            }
        }
        true
    }

    /// A chunk failed but its rail is still usable (e.g. the remote refused it): the transfer
    /// fails with `reason`. Use [`Planner::handle_rail_down`] for rail errors.
    pub fn handle_failed(&mut self, chunk: ChunkId, reason: String, now: Instant) -> bool {
        let Some(f) = self.release(chunk, Some(now)) else {
            return false;
        };
        // Put the chunk back on its transfer's books so that failing it cannot report a
        // transfer whose last chunk this was as done (or lose the event altogether).
        if let Some(x) = self.xfers.iter_mut().find(|x| x.id == f.xfer) {
            x.inflight -= 1;
        }
        self.fail_xfer(f.xfer, reason);
        true
    }

    /// Mark a rail down. Its in-flight chunks are requeued on their transfers (the driver must
    /// call this only once nothing on that rail will touch their memory any more). When no
    /// rail is left, every queued transfer fails.
    pub fn handle_rail_down(&mut self, rail: RailId, reason: String, now: Instant) {
        let _ = now;
        let Some(r) = self.rails.get_mut(rail) else {
            return;
        };
        if r.up {
            r.times_down += 1;
        }
        r.up = false;
        r.failing = false;
        r.last_held = None;
        r.down_reason = Some(reason.clone());
        r.last_down_reason = Some(reason.clone());
        r.inflight_bytes = 0;
        r.inflight_chunks = 0;
        r.clear_sample();
        let lost: Vec<ChunkId> = self.inflight.iter().filter(|(_, f)| f.rail == rail).map(|(id, _)| *id).collect();
        let mut lost: Vec<(ChunkId, InFlight)> = lost.into_iter().map(|id| (id, self.inflight.remove(&id).expect("listed"))).collect();
        lost.sort_by_key(|(id, _)| *id);
        for (_, f) in lost.into_iter().rev() {
            if let Some(x) = self.xfers.iter_mut().find(|x| x.id == f.xfer) {
                x.inflight -= 1;
                x.unassigned += f.piece.len;
                x.retry.push_front(Work { piece: f.piece, vec: f.vec.clone() });
                if x.pinned == Some(rail) && !matches!(self.cfg.policy, Policy::Pinned(_)) {
                    // A small transfer pinned for latency moves to the stripe.
                    x.pinned = None;
                    self.striped_unassigned += x.unassigned - f.piece.len;
                }
                if x.pinned.is_none() {
                    self.striped_unassigned += f.piece.len;
                }
            }
        }
        // Latency-pinned transfers that had not started on this rail move too.
        for x in self.xfers.iter_mut() {
            if x.pinned == Some(rail) && !matches!(self.cfg.policy, Policy::Pinned(_)) {
                x.pinned = None;
                self.striped_unassigned += x.unassigned;
            }
        }
        self.events.push_back(Event::RailDown { rail, reason });
        if self.rails.iter().any(|r| r.up) {
            self.fail_stranded();
        }
        if !self.rails.iter().any(|r| r.up) && self.hold {
            self.all_down_since.get_or_insert(now);
        } else if !self.rails.iter().any(|r| r.up) {
            let reason = self.all_down_reason();
            let ids: Vec<XferId> = self.xfers.iter().map(|x| x.id).collect();
            for id in ids {
                self.fail_xfer(id, reason.clone());
            }
        } else if let Policy::Pinned(p) = self.cfg.policy {
            if p == rail {
                let ids: Vec<XferId> = self.xfers.iter().map(|x| x.id).collect();
                for id in ids {
                    self.fail_xfer(
                        id,
                        format!("pinned rail {rail} went down: {}", self.rails[rail].down_reason.clone().unwrap_or_default()),
                    );
                }
            }
        }
    }

    /// A rail is usable again (reconnected, probe answered).
    pub fn handle_rail_up(&mut self, rail: RailId, now: Instant) {
        if let Some(r) = self.rails.get_mut(rail) {
            if !r.up {
                r.up = true;
                r.down_reason = None;
                r.last_progress = now;
                r.last_held = None;
                // The path may have changed: measure the round trip afresh.
                r.idle_trip = None;
                r.late = 0.0;
                r.last_done = None;
                r.probe = 1.0;
                // `all_down_since` stays: a readmitted rail ends the hold only once bytes move
                // on it (`handle_done`, `handle_progress`), so a peer that answers probes but
                // moves no data cannot renew the hold forever.
                self.events.push_back(Event::RailUp(rail));
                // A transfer held while every rail was down whose tiers are still all down.
                self.fail_stranded();
            }
        }
    }

    /// Drop a transfer. Its in-flight chunks are forgotten (their completions return false).
    /// No event is emitted for it.
    pub fn cancel(&mut self, xfer: XferId) {
        self.drop_xfer(xfer);
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When the driver should call [`Planner::poll_stalled`] next (after gathering its
    /// evidence of progress: [`Planner::handle_progress`], [`Planner::handle_held`]).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.rails.iter().filter(|r| r.up && !r.failing && r.inflight_chunks > 0).map(|r| self.check_at(r)).min()
    }

    /// The driver saw bytes move on `rail` at `at` (data received, or sent data acknowledged:
    /// a large chunk is progressing, not yet done): the stall clock restarts. Chunk
    /// completions restart it too.
    pub fn handle_progress(&mut self, rail: RailId, at: Instant) {
        if let Some(r) = self.rails.get_mut(rail) {
            if r.inflight_chunks > 0 && at > r.last_progress {
                r.last_progress = at;
                if r.up {
                    self.all_down_since = None;
                }
            }
        }
    }

    /// The driver saw `rail` held at `at`: its paths have had every byte they sent
    /// acknowledged, and what is left waits in this host's own queue (TCP: the egress queue
    /// dropped its packets and it retries on a backing-off timer, while the queue is full of
    /// other flows), behind the peer's closed receive window, or on the peer's application
    /// while its kernel answers the path's probes. The path owes nothing, so the silence is
    /// not a stall; the rail gets up to `held_timeout` without progress while the evidence
    /// keeps coming (a peer that never answers still fails it then).
    pub fn handle_held(&mut self, rail: RailId, at: Instant) {
        if let Some(r) = self.rails.get_mut(rail) {
            if r.inflight_chunks > 0 && r.last_held.is_none_or(|h| at > h) {
                r.last_held = Some(at);
            }
        }
    }

    /// The driver saw a path of `rail` dead (TCP: a probe went unanswered): a hold reported
    /// for it ends now, and the plain stall deadline applies.
    pub fn handle_path_dead(&mut self, rail: RailId) {
        if let Some(r) = self.rails.get_mut(rail) {
            r.last_held = None;
        }
    }

    /// Whether some busy rail is held at `now` (its hold may end before its next check: the
    /// driver looks at its evidence more often meanwhile).
    pub fn holding(&self, now: Instant) -> bool {
        self.rails.iter().any(|r| r.up && !r.failing && r.inflight_chunks > 0 && self.held_now(r, now))
    }

    /// How long `r` may go without progress before it counts as stalled, ignoring holds:
    /// `stall_timeout`, or without byte-level progress evidence at least `STALL_CHUNKS`
    /// service times of its head chunk at its measured rate (a chunk completes only once all
    /// of it arrived, and a rail shared by many peers serves each one slowly).
    fn stall_deadline(&self, r: &Rail) -> Duration {
        let t = self.cfg.stall_timeout;
        if r.byte_progress || r.inflight_chunks == 0 {
            return t;
        }
        let head = r.inflight_bytes.min(self.cfg.chunk_size) as f64 / r.rate;
        t.max(Duration::from_secs_f64((STALL_CHUNKS * head).min(3600.0)))
    }

    /// Whether a hold reported for `r` is recent enough to vouch for it at `now`.
    fn held_now(&self, r: &Rail, now: Instant) -> bool {
        r.last_held.is_some_and(|h| now.saturating_duration_since(h) < self.cfg.stall_timeout)
    }

    /// When `r` (busy, up) must next be judged: at its stall deadline; while it is held, when
    /// the hold evidence needs renewing (every `stall_timeout`) or `held_timeout` has passed.
    fn check_at(&self, r: &Rail) -> Instant {
        let plain = r.last_progress + self.stall_deadline(r);
        match r.last_held {
            Some(h) if h + self.cfg.stall_timeout > plain => {
                plain.max((h + self.cfg.stall_timeout).min(r.last_progress + self.cfg.held_timeout))
            }
            _ => plain,
        }
    }

    /// The one stall decision, for the runtime and the simulator alike: a rail with work in
    /// flight is declared failing when it has made no progress (no chunk completed, no bytes
    /// moved per `handle_progress`) for its deadline: `stall_timeout` (with `byte_progress`;
    /// without, at least `STALL_CHUNKS` head-chunk times at its rate), or `held_timeout` while
    /// the driver keeps reporting it held (`handle_held`, renewed within
    /// every `stall_timeout`). Rails are returned each once, with the reason. A failing rail
    /// takes no new work; its chunks stay in flight (their memory may still be touched) until
    /// the driver has stopped the rail's paths, fenced them if they wrote, and called
    /// [`Planner::handle_rail_down`], which requeues them.
    pub fn poll_stalled(&mut self, now: Instant) -> Vec<(RailId, String)> {
        let mut out = Vec::new();
        for i in 0..self.rails.len() {
            let r = &self.rails[i];
            if !r.up || r.failing || r.inflight_chunks == 0 {
                continue;
            }
            let silent = now.saturating_duration_since(r.last_progress);
            let deadline = self.stall_deadline(r);
            let held = self.held_now(r, now);
            if silent < deadline || (held && silent < self.cfg.held_timeout) {
                continue;
            }
            let why = if held {
                format!("stalled: held (the path owes nothing, yet nothing moves), no progress for {} ms", silent.as_millis())
            } else {
                format!("stalled: no progress for {} ms", silent.as_millis())
            };
            let r = &mut self.rails[i];
            r.failing = true;
            r.stalls += 1;
            out.push((i, why));
        }
        out
    }

    fn fail_xfer(&mut self, xfer: XferId, reason: String) {
        if self.drop_xfer(xfer) {
            self.events.push_back(Event::XferFailed { xfer, reason });
        }
    }

    /// Forget a transfer and its in-flight chunks. Returns whether it was known.
    fn drop_xfer(&mut self, xfer: XferId) -> bool {
        let Some(xi) = self.xfers.iter().position(|x| x.id == xfer) else {
            return false;
        };
        let x = self.xfers.remove(xi).expect("position is in range");
        if x.tiers.is_some() {
            self.tiered -= 1;
        }
        if x.pinned.is_none() {
            self.striped_unassigned -= x.unassigned;
        }
        let mut ids: Vec<ChunkId> = self.inflight.iter().filter(|(_, f)| f.xfer == xfer).map(|(id, _)| *id).collect();
        ids.sort();
        for id in ids {
            self.release(id, None);
        }
        for r in self.rails.iter_mut().filter(|r| r.inflight_chunks == 0) {
            r.busy_since = None;
        }
        true
    }

    /// Stop tracking an in-flight chunk and take it off its rail's counters. `now` is given
    /// when the rail answered for it (that counts as progress). The caller resets the rail's
    /// busy period once it has used it.
    fn release(&mut self, chunk: ChunkId, now: Option<Instant>) -> Option<InFlight> {
        let f = self.inflight.remove(&chunk)?;
        let r = &mut self.rails[f.rail];
        r.inflight_chunks -= 1;
        r.inflight_bytes -= f.piece.len;
        if let Some(now) = now {
            r.last_progress = now;
        }
        Some(f)
    }

    fn all_down_reason(&self) -> String {
        let parts: Vec<String> = self
            .rails
            .iter()
            .enumerate()
            .map(|(i, r)| format!("rail {i}: {}", r.down_reason.clone().unwrap_or_else(|| "down".into())))
            .collect();
        format!("no rail left ({})", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_segments_handles_different_segmentation() {
        let local = [(1000, 10), (5000, 30)];
        let remote = [(1, 0, 25), (2, 100, 15)];
        let p = pair_segments(&local, &remote).unwrap();
        assert_eq!(
            p,
            vec![
                Pair { local: 1000, region: 1, offset: 0, len: 10 },
                Pair { local: 5000, region: 1, offset: 10, len: 15 },
                Pair { local: 5015, region: 2, offset: 100, len: 15 },
            ]
        );
        assert_eq!(pair_segments(&local, &[(1, 0, 39)]), Err((40, 39)));
    }

    #[test]
    fn pair_rows_merges_runs_within_one_region_on_each_side() {
        // Local rows (tag, addr, len), remote rows (region, offset, len).
        let rows = |v: &'static [(u64, u64, u64)]| move |i: usize| Some(v[i]);
        let local: &[(u64, u64, u64)] = &[(0, 1000, 10), (0, 1010, 10), (0, 1020, 5), (1, 1025, 5), (1, 2000, 0), (1, 1030, 10)];
        let remote: &[(u64, u64, u64)] = &[(7, 0, 15), (7, 15, 10), (7, 25, 5), (8, 30, 10)];
        let p = pair_rows(local.len(), rows(local), remote.len(), rows(remote)).unwrap();
        assert_eq!(
            p,
            vec![
                // 1000..1025 and 0..25: one run on both sides
                Pair { local: 1000, region: 7, offset: 0, len: 25 },
                // contiguous on both sides, but another local region (tag 1)
                Pair { local: 1025, region: 7, offset: 25, len: 5 },
                // another remote region
                Pair { local: 1030, region: 8, offset: 30, len: 10 },
            ]
        );
        // Unequal totals, a trailing non-empty row, a row that does not resolve: None.
        assert_eq!(pair_rows(2, rows(local), 4, rows(remote)), None);
        assert_eq!(pair_rows(6, rows(local), 3, rows(remote)), None);
        assert_eq!(pair_rows(6, |i| (i != 3).then_some(local[i]), 4, rows(remote)), None);
        // Trailing empty rows are fine; nothing at all is no pairs.
        assert_eq!(pair_rows(5, rows(local), 1, |_| Some((9, 0, 30))).map(|p| p.len()), Some(2));
        assert_eq!(pair_rows(0, rows(local), 0, rows(remote)), Some(vec![]));
    }

    #[test]
    fn stall_evidence_is_per_rail() {
        // Two slow rails (1 MB/s, so a 1 MiB head chunk takes ~1 s), both silent for 2 s with
        // chunks in flight. The rail whose driver reports bytes (tcp) has had no bytes move
        // for its whole `stall_timeout`: stalled. The other (ucx: completions only) may take
        // STALL_CHUNKS head-chunk times: not yet. A fallback that gives it byte evidence
        // puts it on the byte rule.
        let t0 = Instant::now();
        let cfg = PlannerConfig { stall_timeout: Duration::from_millis(500), byte_progress: true, ..PlannerConfig::default() };
        let mut p = Planner::new(cfg);
        let (tcp, ucx) = (p.add_rail(Some(1e6), t0), p.add_rail(Some(1e6), t0));
        p.set_byte_progress(ucx, false);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], t0);
        assert!(p.poll_work(tcp, t0).is_some() && p.poll_work(ucx, t0).is_some());
        let stalled: Vec<RailId> = p.poll_stalled(t0 + Duration::from_secs(2)).into_iter().map(|(r, _)| r).collect();
        assert_eq!(stalled, vec![tcp]);
        p.set_byte_progress(ucx, true);
        let stalled: Vec<RailId> = p.poll_stalled(t0 + Duration::from_secs(2)).into_iter().map(|(r, _)| r).collect();
        assert_eq!(stalled, vec![ucx]);
    }

    #[test]
    fn a_hold_lasts_until_held_timeout_or_a_dead_path() {
        // A held rail (its path answers, its peer does not) is not stalled at `stall_timeout`,
        // only at `held_timeout` without progress; a dead path reported meanwhile ends the hold
        // at once, and the plain deadline, long past, applies.
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let cfg = PlannerConfig { stall_timeout: ms(500), held_timeout: ms(5000), byte_progress: true, ..PlannerConfig::default() };
        let mut p = Planner::new(cfg);
        let (a, b) = (p.add_rail(Some(1e9), t0), p.add_rail(Some(1e9), t0));
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 64 << 20 }], t0);
        assert!(p.poll_work(a, t0).is_some() && p.poll_work(b, t0).is_some());
        let mut t = t0;
        while t < t0 + ms(4000) {
            t += ms(400);
            p.handle_held(a, t);
            p.handle_held(b, t);
            assert!(p.holding(t));
            assert!(p.poll_stalled(t).is_empty(), "held at {:?}", t - t0);
        }
        p.handle_path_dead(b);
        let stalled: Vec<RailId> = p.poll_stalled(t).into_iter().map(|(r, _)| r).collect();
        assert_eq!(stalled, vec![b], "a dead path ends its rail's hold at once");
        let t = t0 + ms(5000);
        p.handle_held(a, t);
        let stalled = p.poll_stalled(t);
        assert_eq!(stalled.len(), 1, "held_timeout bounds a hold: {stalled:?}");
        assert!(stalled[0].0 == a && stalled[0].1.contains("held"), "{stalled:?}");
    }

    #[test]
    fn has_work_while_bytes_are_left_to_hand_out() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let r = p.add_rail(None, now);
        assert!(!p.has_work());
        // A small transfer: one chunk; once it is out, nothing is left for a sender although
        // the planner is not idle.
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 4096 }], now);
        assert!(p.has_work());
        let c = p.poll_work(r, now).expect("chunk");
        assert!(!p.has_work() && !p.is_idle());
        assert!(p.handle_done(c.id, now));
        assert!(!p.has_work() && p.is_idle());
        // A large one keeps work until its last chunk is handed out.
        p.submit(XferId(2), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], now);
        let mut n = 0;
        while p.has_work() {
            let c = p.poll_work(r, now).expect("work left means a chunk");
            assert!(p.handle_done(c.id, now));
            n += 1;
        }
        assert!(n > 1 && p.poll_work(r, now).is_none());
    }

    #[test]
    fn single_rail_covers_transfer_exactly_once() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let r = p.add_rail(None, now);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: (10 << 20) + 5 }], now);
        let mut covered = 0;
        while let Some(c) = p.poll_work(r, now) {
            assert_eq!(c.piece.local, covered);
            covered += c.piece.len;
            assert!(p.handle_done(c.id, now));
        }
        assert_eq!(covered, (10 << 20) + 5);
        assert_eq!(p.poll_event(), Some(Event::XferDone(XferId(1))));
        assert!(p.is_idle());
    }

    #[test]
    fn small_pages_pack_into_vectored_chunks_by_bytes() {
        // 512 scattered 4 KiB pages (every other page on both sides) and a strided run: a
        // vectored rail gets 1 MiB chunks of 256 pieces, the strided run stays one entry; a
        // plain rail gets one page per chunk.
        let now = Instant::now();
        let mut runs: Vec<Run> = (0..512u64).map(|i| Run::from(Pair { local: i * 8192, region: 1, offset: i * 8192, len: 4096 })).collect();
        runs.push(Run { local: 1 << 30, region: 1, offset: 1 << 30, len: 4096, count: 256, lstride: 8192, rstride: 12288 });
        let runs: Arc<[Run]> = runs.into();
        let total = 768 * 4096;
        let mut p = Planner::new(PlannerConfig::default());
        let r = p.add_rail(None, now);
        p.set_vectored(r, true);
        p.submit_runs(XferId(1), runs.clone(), total, true, now);
        let chunks: Vec<Chunk> = std::iter::from_fn(|| p.poll_work(r, now)).collect();
        assert_eq!(chunks.len(), 3);
        assert!(chunks[..2].iter().all(|c| c.piece.len == 1 << 20 && c.vec.as_ref().unwrap().len() == 256));
        for c in &chunks {
            p.handle_done(c.id, now);
        }
        let c = &chunks[2];
        assert_eq!(
            c.vec.as_deref(),
            Some(&[Run { local: 1 << 30, region: 1, offset: 1 << 30, len: 4096, count: 256, lstride: 8192, rstride: 12288 }][..])
        );
        p.handle_done(c.id, now);
        assert_eq!(p.poll_event(), Some(Event::XferDone(XferId(1))));
        p.set_vectored(r, false);
        p.submit_runs(XferId(2), runs, total, true, now);
        let c = p.poll_work(r, now).unwrap();
        assert_eq!((c.piece.len, c.vec.is_none()), (4096, true));
    }

    /// Drive every rail until the planner has nothing more for them; the bytes each rail
    /// completed, with the tier of its chunks.
    fn drain_all(p: &mut Planner, now: Instant) -> Vec<(u64, Option<u8>)> {
        let mut got = vec![(0u64, None); p.num_rails()];
        loop {
            // Each rail takes one chunk per round; the round's chunks then complete.
            let round: Vec<Chunk> = (0..p.num_rails()).filter_map(|r| p.poll_work(r, now)).collect();
            if round.is_empty() {
                return got;
            }
            for c in round {
                got[c.rail].0 += c.piece.len;
                got[c.rail].1 = c.tier;
                assert!(p.handle_done(c.id, now));
            }
        }
    }

    #[test]
    fn tiered_transfer_stripes_over_its_nearest_tier_only() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        for _ in 0..4 {
            p.add_rail(None, now);
        }
        // Near: rails 1 and 3; far: rail 0; rail 2 is nobody's.
        let tiers: Arc<[RailMask]> = Arc::from(vec![0b1010, 0b0001]);
        let runs: Arc<[Run]> = Arc::from(vec![Run::from(Pair { local: 0, region: 1, offset: 0, len: 16 << 20 })]);
        p.submit_tiered(XferId(1), runs.clone(), 16 << 20, false, Some(tiers.clone()), now);
        // An untiered transfer at the same time may use every rail.
        p.submit(XferId(2), vec![Pair { local: 1 << 30, region: 2, offset: 0, len: 8 << 20 }], now);
        let got = drain_all(&mut p, now);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        assert!(evs.contains(&Event::XferDone(XferId(1))) && evs.contains(&Event::XferDone(XferId(2))), "{evs:?}");
        assert_eq!((p.rail_stats(1).tier, p.rail_stats(3).tier), (Some(0), Some(0)));
        assert_eq!((p.rail_stats(0).tier, p.rail_stats(2).tier), (None, None), "no tiered chunk off its tier");
        let stats: Vec<RailStats> = (0..4).map(|r| p.rail_stats(r)).collect();
        assert!(stats.iter().all(|s| s.fallback_bytes == 0), "{stats:?}");
        assert_eq!(got.iter().map(|g| g.0).sum::<u64>(), 24 << 20);
        // Alone, the tiered transfer goes over rails 1 and 3 only, striped.
        p.submit_tiered(XferId(3), runs, 16 << 20, false, Some(tiers), now);
        let got = drain_all(&mut p, now);
        assert_eq!((got[0].0, got[2].0), (0, 0), "{got:?}");
        assert!(got[1].0 > 0 && got[3].0 > 0, "striped over both near rails: {got:?}");
        assert_eq!(got[1].0 + got[3].0, 16 << 20);
    }

    #[test]
    fn tiered_transfer_falls_back_to_the_next_tier_and_returns() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let far = p.add_rail(None, now);
        let near = p.add_rail(None, now);
        let tiers: Arc<[RailMask]> = Arc::from(vec![bit(near), bit(far)]);
        let len = 32u64 << 20;
        let runs: Arc<[Run]> = Arc::from(vec![Run::from(Pair { local: 0, region: 1, offset: 0, len })]);
        p.submit_tiered(XferId(1), runs, len, false, Some(tiers), now);
        let c = p.poll_work(near, now).expect("near rail serves");
        assert_eq!(c.tier, Some(0));
        assert!(p.poll_work(far, now).is_none(), "the far rail idles while the near one is up");
        assert!(p.handle_done(c.id, now));
        // The near rail goes down with a chunk in flight: the far tier carries on, its chunks
        // counted as fallback.
        let lost = p.poll_work(near, now).unwrap();
        p.handle_rail_down(near, "link down".into(), now);
        let c = p.poll_work(far, now).expect("the far tier takes over");
        assert_eq!(c.tier, Some(1));
        assert_eq!(c.piece, lost.piece, "the lost chunk is reissued first");
        assert!(p.handle_done(c.id, now));
        assert_eq!(p.rail_stats(far).fallback_bytes, lost.piece.len);
        assert_eq!(p.rail_stats(far).tier, Some(1));
        // Readmitted, the near rail takes the rest; the far one gets no new chunk.
        p.handle_rail_up(near, now);
        let far_before = p.rail_stats(far).bytes_done;
        let got = drain_all(&mut p, now);
        assert_eq!(got[far].0, 0, "no new chunk on the far rail once the near one is back: {got:?}");
        assert_eq!(p.rail_stats(far).bytes_done, far_before);
        assert_eq!(p.rail_stats(near).tier, Some(0));
        assert_eq!(p.rail_stats(near).bytes_done + far_before, len);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        assert!(evs.contains(&Event::XferDone(XferId(1))), "{evs:?}");
    }

    #[test]
    fn tiered_transfer_fails_when_no_rail_of_its_tiers_is_left() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let a = p.add_rail(None, now);
        let b = p.add_rail(None, now);
        let runs: Arc<[Run]> = Arc::from(vec![Run::from(Pair { local: 0, region: 1, offset: 0, len: 8 << 20 })]);
        p.submit_tiered(XferId(1), runs.clone(), 8 << 20, false, Some(Arc::from(vec![bit(a)])), now);
        p.poll_work(a, now).unwrap();
        p.handle_rail_down(a, "connection reset".into(), now);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        let why = evs.iter().find_map(|e| match e {
            Event::XferFailed { xfer: XferId(1), reason } => Some(reason.clone()),
            _ => None,
        });
        assert_eq!(why.as_deref(), Some("no rail of the transfer's tiers left (rail 0: connection reset)"));
        assert!(p.is_up(b) && p.is_idle());
        // Submitted while its tiers are down: fails at once.
        p.submit_tiered(XferId(2), runs, 8 << 20, false, Some(Arc::from(vec![bit(a)])), now);
        assert!(matches!(p.poll_event(), Some(Event::XferFailed { xfer: XferId(2), .. })));
    }

    #[test]
    fn held_tiered_transfer_waits_for_its_own_rails() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        p.set_hold_when_all_down(true);
        let a = p.add_rail(None, now);
        let b = p.add_rail(None, now);
        p.handle_rail_down(a, "link down".into(), now);
        p.handle_rail_down(b, "link down".into(), now);
        let runs: Arc<[Run]> = Arc::from(vec![Run::from(Pair { local: 0, region: 1, offset: 0, len: 4 << 20 })]);
        // Every rail down, hold on: both transfers are queued, not failed.
        p.submit_tiered(XferId(1), runs.clone(), 4 << 20, false, Some(Arc::from(vec![bit(a)])), now);
        p.submit_tiered(XferId(2), runs, 4 << 20, false, Some(Arc::from(vec![bit(b)])), now);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        assert!(!evs.iter().any(|e| matches!(e, Event::XferFailed { .. })), "{evs:?}");
        // Rail b returns: transfer 2 runs on it; transfer 1, whose only rail is still down while
        // another is up, fails naming its rail.
        p.handle_rail_up(b, now);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        let why = evs.iter().find_map(|e| match e {
            Event::XferFailed { xfer: XferId(1), reason } => Some(reason.clone()),
            _ => None,
        });
        assert_eq!(why.as_deref(), Some("no rail of the transfer's tiers left (rail 0: link down)"), "{evs:?}");
        let c = p.poll_work(b, now).expect("transfer 2 on its rail");
        assert_eq!((c.xfer, c.tier), (XferId(2), Some(0)));
    }

    #[test]
    fn small_tiered_transfer_stays_in_its_tier() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let fast = p.add_rail(Some(1e10), now);
        let near = p.add_rail(Some(1e8), now);
        let runs: Arc<[Run]> = Arc::from(vec![Run::from(Pair { local: 0, region: 1, offset: 0, len: 4096 })]);
        p.submit_tiered(XferId(1), runs, 4096, false, Some(Arc::from(vec![bit(near), bit(fast)])), now);
        assert!(p.poll_work(fast, now).is_none(), "the faster rail is not in the near tier");
        let c = p.poll_work(near, now).expect("pinned within its tier");
        assert_eq!((c.piece.len, c.tier), (4096, Some(0)));
    }

    #[test]
    fn rail_down_requeues_in_flight_to_survivor() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let a = p.add_rail(None, now);
        let b = p.add_rail(None, now);
        p.submit(XferId(7), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], now);
        let ca = p.poll_work(a, now).unwrap();
        p.handle_rail_down(a, "link down".into(), now);
        assert!(!p.handle_done(ca.id, now), "a reissued chunk's late completion is ignored");
        let mut got = vec![];
        while let Some(c) = p.poll_work(b, now) {
            got.push(c.piece);
            p.handle_done(c.id, now);
        }
        got.sort_by_key(|x| x.local);
        let mut off = 0;
        for g in got {
            assert_eq!(g.local, off);
            off += g.len;
        }
        assert_eq!(off, 8 << 20);
        assert!(matches!(p.poll_event(), Some(Event::RailDown { .. })));
        assert_eq!(p.poll_event(), Some(Event::XferDone(XferId(7))));
    }

    #[test]
    fn held_transfers_wait_for_a_rail_and_finish() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        p.set_hold_when_all_down(true);
        let a = p.add_rail(None, now);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], now);
        p.poll_work(a, now).unwrap();
        p.handle_rail_down(a, "killed".into(), now);
        assert_eq!(p.all_down_since(), Some(now));
        // posted while nothing is up: held too (a small one is not pinned to a dead rail)
        p.submit(XferId(2), vec![Pair { local: 0, region: 1, offset: 0, len: 4096 }], now);
        assert!(std::iter::from_fn(|| p.poll_event()).all(|e| !matches!(e, Event::XferFailed { .. })));
        p.handle_rail_up(a, now);
        assert_eq!(p.all_down_since(), Some(now), "readmitted, nothing moved yet");
        while let Some(c) = p.poll_work(a, now) {
            p.handle_done(c.id, now);
        }
        assert_eq!(p.all_down_since(), None);
        let done: Vec<Event> = std::iter::from_fn(|| p.poll_event()).filter(|e| matches!(e, Event::XferDone(_))).collect();
        assert_eq!(done.len(), 2, "{done:?}");
        // the driver gives up: every held transfer is dropped and named
        p.handle_rail_down(a, "killed".into(), now);
        p.submit(XferId(3), vec![Pair { local: 0, region: 1, offset: 0, len: 4096 }], now);
        assert_eq!(p.take_all(), vec![XferId(3)]);
        assert!(p.is_idle() && p.all_down_since().is_none());
    }

    #[test]
    fn a_rail_that_comes_back_but_moves_nothing_does_not_restart_the_hold() {
        // A peer that answers handshakes but moves no data (an MTU blackhole, a wedged
        // application): the probe readmits the rail, its chunk stalls, the rail goes down
        // again, and so on. The hold must still end `timeout` after the first outage, or the
        // transfer never fails (checkXfer IN_PROG forever).
        let t0 = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        p.set_hold_when_all_down(true);
        let a = p.add_rail(None, t0);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], t0);
        p.poll_work(a, t0).unwrap();
        p.handle_rail_down(a, "stalled".into(), t0);
        for k in 1..5u64 {
            let t = t0 + Duration::from_secs(k);
            p.handle_rail_up(a, t);
            p.poll_work(a, t).unwrap();
            assert_eq!(p.all_down_since(), Some(t0), "readmitted without progress: still held since the first outage");
            p.handle_rail_down(a, "stalled".into(), t + Duration::from_millis(500));
            assert_eq!(p.all_down_since(), Some(t0), "flap {k}: the clock restarted");
        }
        // bytes that move end the hold
        let t = t0 + Duration::from_secs(6);
        p.handle_rail_up(a, t);
        let c = p.poll_work(a, t).unwrap();
        p.handle_done(c.id, t);
        assert_eq!(p.all_down_since(), None);
    }

    #[test]
    fn all_rails_down_fails_with_each_cause() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let a = p.add_rail(None, now);
        let b = p.add_rail(None, now);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], now);
        p.poll_work(a, now).unwrap();
        p.handle_rail_down(a, "connection reset".into(), now);
        p.handle_rail_down(b, "link down".into(), now);
        let evs: Vec<Event> = std::iter::from_fn(|| p.poll_event()).collect();
        let failed = evs.iter().find_map(|e| match e {
            Event::XferFailed { reason, .. } => Some(reason.clone()),
            _ => None,
        });
        let reason = failed.expect("transfer failed");
        assert!(reason.contains("rail 0: connection reset") && reason.contains("rail 1: link down"), "{reason}");
    }

    #[test]
    fn tail_crumbs_always_drain() {
        // 1.5 minimum chunks over two idle equal rails: each fair share is below min_chunk,
        // yet someone must take the work.
        let now = Instant::now();
        let cfg = PlannerConfig { stripe_threshold: 0, ..PlannerConfig::default() };
        let len = cfg.min_chunk * 3 / 2;
        let mut p = Planner::new(cfg);
        let rails = [p.add_rail(None, now), p.add_rail(None, now)];
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len }], now);
        let mut done = 0;
        for _ in 0..4 {
            for r in rails {
                while let Some(c) = p.poll_work(r, now) {
                    done += c.piece.len;
                    p.handle_done(c.id, now);
                }
            }
        }
        assert_eq!(done, len);
        assert_eq!(p.poll_event(), Some(Event::XferDone(XferId(1))));
    }

    #[test]
    fn failed_last_chunk_fails_the_transfer() {
        let now = Instant::now();
        let mut p = Planner::new(PlannerConfig::default());
        let r = p.add_rail(None, now);
        p.submit(XferId(3), vec![Pair { local: 0, region: 1, offset: 0, len: 4096 }], now);
        let c = p.poll_work(r, now).unwrap();
        assert!(p.handle_failed(c.id, "bad key".into(), now));
        assert_eq!(p.poll_event(), Some(Event::XferFailed { xfer: XferId(3), reason: "bad key".into() }));
        assert_eq!(p.poll_event(), None);
        assert!(p.is_idle());
        assert_eq!(p.rail_stats(r).inflight_bytes, 0);
    }

    /// One rail at 100 MB/s, no latency, served FIFO: the `k`-th chunk (1 MiB) of a queue
    /// issued at `t0` completes `k` chunk times later.
    const RATE: f64 = 1e8;
    fn chunk_time() -> Duration {
        Duration::from_secs_f64((1 << 20) as f64 / RATE)
    }

    #[test]
    fn first_queued_sample_replaces_the_seed() {
        let t0 = Instant::now();
        let mut p = Planner::new(PlannerConfig { stripe_threshold: 0, ..PlannerConfig::default() });
        let r = p.add_rail(Some(RATE * 10.0), t0);
        p.submit(XferId(1), vec![Pair { local: 0, region: 1, offset: 0, len: 8 << 20 }], t0);
        let chunks: Vec<Chunk> = std::iter::from_fn(|| p.poll_work(r, t0)).collect();
        assert!(chunks.len() >= 3, "a seed ten times too high opens a wide window");
        // The first completion opens the sample; the next two (which queued behind it) close
        // it once 10 ms have passed.
        for (k, c) in chunks.iter().take(3).enumerate() {
            assert!(p.handle_done(c.id, t0 + chunk_time() * (k as u32 + 1)));
        }
        let rate = p.rail_stats(r).rate;
        assert!((rate / RATE - 1.0).abs() < 1e-6, "rate {rate}: one sample outweighs any seed");
    }

    #[test]
    fn sample_with_an_idle_link_is_dropped() {
        // 5 ms each way: a chunk completes 10 ms after the link has served it.
        let (t0, lat) = (Instant::now(), Duration::from_millis(5));
        let mut p = Planner::new(PlannerConfig { stripe_threshold: 0, ..PlannerConfig::default() });
        let r = p.add_rail(Some(RATE), t0);
        let one = |x: u64| vec![Pair { local: x << 30, region: 1, offset: 0, len: 1 << 20 }];
        // Two chunks at 0: the link serves them back to back.
        p.submit(XferId(1), one(1), t0);
        p.submit(XferId(2), one(2), t0);
        let (a, b) = (p.poll_work(r, t0).unwrap(), p.poll_work(r, t0).unwrap());
        assert!(p.handle_done(a.id, t0 + chunk_time() + 2 * lat));
        assert!(p.poll_work(r, t0 + chunk_time() + 2 * lat).is_none(), "nothing left to do");
        // A third chunk only once the link has gone idle, but before b's completion is back.
        let t_c = t0 + 2 * chunk_time() + lat + Duration::from_millis(1);
        p.submit(XferId(3), one(3), t_c);
        let c = p.poll_work(r, t_c).unwrap();
        assert!(p.handle_done(b.id, t0 + 2 * chunk_time() + 2 * lat));
        // c met no queue: the sample from a's completion to c's (2 MiB over more than two
        // chunk times) saw the link idle, and must not lower the estimate.
        assert!(p.handle_done(c.id, t_c + chunk_time() + 2 * lat));
        assert_eq!(p.rail_stats(r).rate, RATE);
        assert_eq!(p.rails[r].probe, 1.0, "the rail was short of work, not held back by its window");
    }
}
