//! A deterministic simulator of N rails driving the sans-IO [`Planner`], shared by the
//! scenario tests (`tests/sim.rs`) and the property tests (`tests/props.rs`).
//!
//! Model:
//! - Virtual time: one real `Instant` is taken at start and only ever advanced by adding
//!   `Duration`s; nothing reads the clock afterwards, so every run is reproducible.
//! - A rail is a pipe with a rate schedule (bytes/s from a given time on; a rate of 0 is a
//!   silent stall), a one-way latency and seeded jitter. Chunks are served FIFO: a chunk issued
//!   at `t` starts serialising at `max(t, end of the previous chunk)`, takes `len * f / rate`
//!   (integrated over the rate schedule; `f` is a jitter factor uniform in `[1-j, 1+j]`) and
//!   its completion reaches the planner `2 * latency` later (data there, response back).
//! - A rail may start cold: the driver does not poll it before its `start` (its connection is
//!   still being made; the planner counts it as up all the same), and with `slow_start` a pipe
//!   that starts serialising for the first time, or after being idle a while, runs at a
//!   fraction of its rate that doubles every step (TCP slow start). `hiccups` hold the pipe a
//!   while after a random share of chunks (a noisy host descheduling the sender).
//!   `late_reports` delay a random share of completions on their way to the planner while the
//!   pipe goes on (a receiving thread that notices late; reports stay in order per rail).
//! - Faults: an `Outage` takes a rail down with an error at `at` (the driver calls
//!   `handle_rail_down`, everything in its pipe is lost) and brings it back at `until`
//!   (`handle_rail_up`). A stall is a rate of 0 for a while; the planner's stall timeout has
//!   to notice it, and when it does the pipe is dropped like the runtime would drop the
//!   connection. When a stall ends on a rail the planner had declared down, the driver calls
//!   `handle_rail_up` (a reconnect).
//! - The driver loop: at each event time, process everything due (completions, faults,
//!   submissions, cancels, the planner's timeout), then poll work for every rail in turn
//!   (rotating the starting rail) until a full pass hands out nothing, then drain the planner's
//!   events and advance to the next event time. A planner that still has work but no event can
//!   ever occur again is a hang and fails the run.
//! - Transfers are submitted at fixed times, or (`submit_after`) a gap after another one ends,
//!   as a caller that waits for each transfer does.
//!
//! Everything that happened is recorded in a [`Report`] (every chunk with its outcome and the
//! time it held its pipe, every planner event with its time, the planner's rate estimates
//! after every completion) so tests can assert both performance and invariants.
#![allow(dead_code)] // each test crate uses a different part of the simulator

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use multirail_proto::planner::RailStats;
use multirail_proto::{Chunk, ChunkId, Event, Pair, Planner, PlannerConfig, RailId, XferId};

/// A tiny seeded xorshift64* generator: deterministic jitter without extra dependencies.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1e3)
}

pub fn gbit(v: f64) -> f64 {
    v * 1e9 / 8.0
}

/// A rail goes down with an error at `at` and comes back at `until` (never, if `None`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outage {
    pub at: Duration,
    pub until: Option<Duration>,
}

/// TCP-like slow start: a pipe that starts serialising for the first time, or after it has
/// been idle for at least `after_idle`, runs at `2^-doublings` of its rate and doubles that
/// every `step` until it is at full rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowStart {
    pub step: Duration,
    pub doublings: u32,
    pub after_idle: Duration,
}

/// One simulated rail.
#[derive(Debug, Clone, PartialEq)]
pub struct RailSpec {
    /// `(from, bytes/s)`, sorted by time; the first entry should be at 0. A rate of 0 stalls.
    pub rates: Vec<(Duration, f64)>,
    pub latency: Duration,
    /// Service-time jitter: each chunk's time is scaled by a factor uniform in `[1-j, 1+j]`.
    pub jitter: f64,
    /// What `add_rail` is told (the link speed, when known).
    pub hint: Option<f64>,
    pub outages: Vec<Outage>,
    /// When the driver brings the rail's connection up: before that it never polls the rail,
    /// although the planner counts it as up (a rail whose connection is still being made).
    pub start: Duration,
    pub slow_start: Option<SlowStart>,
    /// A noisy host: with probability `.0` a chunk also holds its pipe for `.1` (the sender was
    /// descheduled).
    pub hiccups: Option<(f64, Duration)>,
    /// With probability `.0` a chunk's completion reaches the planner up to `.1` (uniform) late,
    /// while the pipe moves on: the data arrived, the thread that reports it noticed late (a
    /// UCX acknowledgement processed late on a busy host). Reports stay in order per rail, so
    /// the ones behind a late report arrive with it.
    pub late_reports: Option<(f64, Duration)>,
    /// `[from, until)` stretches in which the pipe moves nothing because this host's own queue
    /// is full of other flows (TCP: its packets were dropped locally and it retries on a
    /// backing-off timer): the rate is 0 there and, with `byte_progress`, the driver reports the
    /// rail held (`handle_held`) instead of nothing.
    pub holds: Vec<(Duration, Duration)>,
}

impl RailSpec {
    /// A steady rail whose link speed is known to the planner.
    pub fn steady(rate: f64) -> Self {
        RailSpec {
            rates: vec![(Duration::ZERO, rate)],
            latency: Duration::from_micros(25),
            jitter: 0.0,
            hint: Some(rate),
            outages: Vec::new(),
            start: Duration::ZERO,
            slow_start: None,
            hiccups: None,
            late_reports: None,
            holds: Vec::new(),
        }
    }

    /// The pipe moves nothing in `[at, until)` and the driver reports the rail held back on
    /// this host meanwhile (see `holds`).
    pub fn held(mut self, at: Duration, until: Duration) -> Self {
        let after = self.rate(until);
        self.rates.retain(|r| r.0 < at || r.0 > until);
        self = self.rate_at(at, 0.0).rate_at(until, after);
        self.holds.push((at, until));
        self
    }

    /// True inside a hold.
    pub fn in_hold(&self, t: Duration) -> bool {
        self.holds.iter().any(|&(a, u)| a <= t && t < u)
    }

    /// The driver polls the rail from `at` on (it is cold until then).
    pub fn start_at(mut self, at: Duration) -> Self {
        self.start = at;
        self
    }

    /// Slow start, [`SlowStart`]: from `2^-doublings` of the rate, doubling every `step`.
    pub fn slow_start(mut self, step: Duration, doublings: u32, after_idle: Duration) -> Self {
        self.slow_start = Some(SlowStart { step, doublings, after_idle });
        self
    }

    pub fn hiccups(mut self, p: f64, d: Duration) -> Self {
        self.hiccups = Some((p, d));
        self
    }

    pub fn late_reports(mut self, p: f64, d: Duration) -> Self {
        self.late_reports = Some((p, d));
        self
    }

    pub fn latency(mut self, l: Duration) -> Self {
        self.latency = l;
        self
    }

    pub fn jitter(mut self, j: f64) -> Self {
        self.jitter = j;
        self
    }

    pub fn hint(mut self, h: Option<f64>) -> Self {
        self.hint = h;
        self
    }

    /// From `at` on, the rail delivers `rate` bytes/s.
    pub fn rate_at(mut self, at: Duration, rate: f64) -> Self {
        self.rates.push((at, rate));
        self.rates.sort_by_key(|r| r.0);
        self
    }

    pub fn outage(mut self, at: Duration, until: Option<Duration>) -> Self {
        self.outages.push(Outage { at, until });
        self
    }

    /// The rate in effect at `t`.
    pub fn rate(&self, t: Duration) -> f64 {
        self.rates.iter().take_while(|r| r.0 <= t).last().map_or(0.0, |r| r.1)
    }

    /// The slow-start factor at `t` of a ramp that began at `ramp`.
    fn ramp_factor(&self, t: Duration, ramp: Option<Duration>) -> f64 {
        match (self.slow_start, ramp) {
            (Some(s), Some(r0)) if t >= r0 => {
                let k = ((t - r0).as_nanos() / s.step.as_nanos().max(1)) as u32;
                0.5f64.powi(s.doublings.saturating_sub(k) as i32)
            }
            _ => 1.0,
        }
    }

    /// The next time after `t` at which the rate schedule or the ramp changes.
    fn next_change(&self, t: Duration, ramp: Option<Duration>) -> Option<Duration> {
        let sched = self.rates.iter().map(|r| r.0).find(|&x| x > t);
        let ramp = match (self.slow_start, ramp) {
            (Some(s), Some(r0)) => (1..=s.doublings).map(|k| r0 + s.step * k).find(|&x| x > t),
            _ => None,
        };
        [sched, ramp].into_iter().flatten().min()
    }

    /// When `bytes` of service starting at `start` end, integrating the rate schedule (and the
    /// slow-start ramp that began at `ramp`), or `None` if the rail stalls for ever first.
    fn serve(&self, start: Duration, bytes: f64, ramp: Option<Duration>) -> Option<Duration> {
        let mut t = start;
        let mut left = bytes;
        loop {
            let rate = self.rate(t) * self.ramp_factor(t, ramp);
            let next = self.next_change(t, ramp);
            if rate > 0.0 {
                let need = left / rate;
                match next {
                    Some(n) if (n - t).as_secs_f64() < need => left -= rate * (n - t).as_secs_f64(),
                    _ => return Some(t + Duration::from_secs_f64(need)),
                }
            }
            t = next?;
        }
    }

    /// True while an error outage holds the rail down.
    fn in_outage(&self, t: Duration) -> bool {
        self.outages.iter().any(|o| o.at <= t && o.until.is_none_or(|u| t < u))
    }

    /// Bytes the rail can carry in `[0, t)`, outside error outages.
    fn capacity(&self, t: Duration) -> f64 {
        let mut cuts: Vec<Duration> = self.rates.iter().map(|r| r.0).collect();
        for o in &self.outages {
            cuts.push(o.at);
            cuts.extend(o.until);
        }
        cuts.push(Duration::ZERO);
        cuts.push(t);
        cuts.retain(|&c| c <= t);
        cuts.sort();
        cuts.dedup();
        cuts.windows(2).filter(|w| !self.in_outage(w[0])).map(|w| self.rate(w[0]) * (w[1] - w[0]).as_secs_f64()).sum()
    }
}

/// A transfer submitted at `at`.
#[derive(Debug, Clone, PartialEq)]
pub struct XferSpec {
    pub id: XferId,
    pub at: Duration,
    pub pairs: Vec<Pair>,
}

impl XferSpec {
    /// One contiguous transfer of `len` bytes, at a local address unique to `id`.
    pub fn contiguous(id: u64, at: Duration, len: u64) -> Self {
        XferSpec { id: XferId(id), at, pairs: vec![Pair { local: id << 40, region: id, offset: 0, len }] }
    }

    pub fn total(&self) -> u64 {
        self.pairs.iter().map(|p| p.len).sum()
    }
}

/// What became of a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Still in the pipe when the run ended (only for runs cut short).
    Pending,
    /// Completed and accepted by the planner (`handle_done` or `handle_failed` returned true).
    Done(Duration),
    /// Completed, but the planner no longer tracked it (`handle_done` returned false).
    Stale(Duration),
    /// Dropped with its rail (error outage, or the planner declared the rail stalled).
    Lost(Duration),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChunkRecord {
    pub chunk: Chunk,
    pub issued: Duration,
    pub outcome: Outcome,
    /// Time the chunk held its pipe (jitter, hiccups and slow start included).
    pub served: Duration,
}

/// The planner's rate estimates after a completion, with the bytes completed so far.
#[derive(Debug, Clone, PartialEq)]
pub struct RateSample {
    pub at: Duration,
    /// Bytes of all transfers completed so far (accepted chunks).
    pub bytes_done: u64,
    pub rates: Vec<f64>,
}

/// Everything a run produced.
#[derive(Debug)]
pub struct Report {
    pub chunks: Vec<ChunkRecord>,
    /// Every planner event with the time it was polled.
    pub events: Vec<(Duration, Event)>,
    pub stats: Vec<RailStats>,
    pub end: Duration,
    pub idle_at_end: bool,
    /// Per rail, the time it spent serialising chunks (including ones later lost).
    pub serving: Vec<Duration>,
    /// When each transfer was submitted (chained ones are submitted when their predecessor
    /// ends).
    pub submitted: Vec<(XferId, Duration)>,
    /// The rate estimates after every accepted completion.
    pub trace: Vec<RateSample>,
}

impl Report {
    /// When the transfer's `XferDone` came out, if it did.
    pub fn done_at(&self, x: XferId) -> Option<Duration> {
        self.events.iter().find(|(_, e)| *e == Event::XferDone(x)).map(|(t, _)| *t)
    }

    pub fn failed(&self, x: XferId) -> Option<&str> {
        self.events.iter().find_map(|(_, e)| match e {
            Event::XferFailed { xfer, reason } if *xfer == x => Some(reason.as_str()),
            _ => None,
        })
    }

    /// Chunks of `x` the planner accepted as done.
    pub fn done_chunks(&self, x: XferId) -> impl Iterator<Item = &ChunkRecord> {
        self.chunks.iter().filter(move |c| c.chunk.xfer == x && matches!(c.outcome, Outcome::Done(_)))
    }

    /// Per rail, the time of the last accepted completion of transfer `x`.
    pub fn last_done_per_rail(&self, x: XferId, rails: usize) -> Vec<Option<Duration>> {
        let mut last = vec![None; rails];
        for c in self.done_chunks(x) {
            if let Outcome::Done(t) = c.outcome {
                let l: &mut Option<Duration> = &mut last[c.chunk.rail];
                *l = Some(l.map_or(t, |v: Duration| v.max(t)));
            }
        }
        last
    }

    /// Bytes of `x` each rail carried to completion.
    pub fn bytes_per_rail(&self, x: XferId, rails: usize) -> Vec<u64> {
        let mut b = vec![0; rails];
        for c in self.done_chunks(x) {
            b[c.chunk.rail] += c.chunk.piece.len;
        }
        b
    }

    pub fn submitted_at(&self, x: XferId) -> Option<Duration> {
        self.submitted.iter().find(|s| s.0 == x).map(|s| s.1)
    }

    /// Per rail, the rate it really served `x`'s completed chunks at (bytes over the time they
    /// held the pipe: jitter and hiccups included, idle time not), `None` if it served none.
    pub fn realised_rates(&self, x: XferId, rails: usize) -> Vec<Option<f64>> {
        let mut acc = vec![(0u64, Duration::ZERO); rails];
        for c in self.done_chunks(x) {
            acc[c.chunk.rail].0 += c.chunk.piece.len;
            acc[c.chunk.rail].1 += c.served;
        }
        acc.into_iter().map(|(b, t)| (b > 0 && !t.is_zero()).then(|| b as f64 / t.as_secs_f64())).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum What {
    /// Chunk `idx` (into the records) completes on its rail, if the rail is still in `epoch`.
    Complete {
        rail: RailId,
        epoch: u64,
        idx: usize,
    },
    Down(RailId),
    Up(RailId),
    /// The end of a stall: reconnect the rail if the planner gave up on it.
    Probe(RailId),
    Submit(usize),
    Cancel(XferId),
    /// The rail's connection is up: the driver starts polling it.
    Start(RailId),
}

#[derive(Debug, Default)]
struct Pipe {
    /// When the last chunk in the pipe finishes serialising.
    busy_until: Duration,
    /// Bumped whenever the pipe's contents are dropped.
    epoch: u64,
    /// Between an error outage and its end (the driver knows; the planner was told).
    broken: bool,
    /// Total time spent serialising chunks (jitter included).
    serving: Duration,
    /// Whether the pipe has carried anything since it was (re)connected.
    used: bool,
    /// Start of the current slow-start ramp.
    ramp: Option<Duration>,
    /// When the last completion scheduled for this pipe reaches the planner (reports in order).
    reported_until: Duration,
}

/// The simulator: a planner, its rails and a timeline.
pub struct Sim {
    pub planner: Planner,
    specs: Vec<RailSpec>,
    pipes: Vec<Pipe>,
    xfers: Vec<XferSpec>,
    t0: Instant,
    now: Duration,
    rng: XorShift,
    queue: BinaryHeap<Reverse<(Duration, u64, What)>>,
    seq: u64,
    records: Vec<ChunkRecord>,
    by_id: HashMap<ChunkId, usize>,
    events: Vec<(Duration, Event)>,
    poll_from: usize,
    /// A run that reaches this virtual time is declared hung.
    pub limit: Duration,
    /// Chunks (by id) the remote refuses: their completion is reported with `handle_failed`.
    pub refuse: HashSet<ChunkId>,
    /// Per rail: polled by the driver (its start time has come).
    started: Vec<bool>,
    /// Transfers (by index) to submit a gap after the given one ends.
    chained: HashMap<XferId, Vec<(usize, Duration)>>,
    submitted: Vec<(XferId, Duration)>,
    trace: Vec<RateSample>,
    bytes_done: u64,
}

impl Sim {
    pub fn new(cfg: PlannerConfig, rails: Vec<RailSpec>, seed: u64) -> Self {
        let t0 = Instant::now();
        let mut sim = Sim {
            planner: Planner::new(cfg),
            pipes: rails.iter().map(|_| Pipe::default()).collect(),
            specs: Vec::new(),
            xfers: Vec::new(),
            t0,
            now: Duration::ZERO,
            rng: XorShift::new(seed),
            queue: BinaryHeap::new(),
            seq: 0,
            records: Vec::new(),
            by_id: HashMap::new(),
            events: Vec::new(),
            poll_from: 0,
            limit: Duration::from_secs(600),
            refuse: HashSet::new(),
            started: rails.iter().map(|r| r.start.is_zero()).collect(),
            chained: HashMap::new(),
            submitted: Vec::new(),
            trace: Vec::new(),
            bytes_done: 0,
        };
        for (i, r) in rails.iter().enumerate() {
            assert_eq!(sim.planner.add_rail(r.hint, t0), i);
            for o in &r.outages {
                sim.push(o.at, What::Down(i));
                if let Some(u) = o.until {
                    sim.push(u, What::Up(i));
                }
            }
            for w in r.rates.windows(2) {
                if w[0].1 == 0.0 && w[1].1 > 0.0 {
                    sim.push(w[1].0, What::Probe(i));
                }
            }
            if !r.start.is_zero() {
                sim.push(r.start, What::Start(i));
            }
        }
        sim.specs = rails;
        sim
    }

    pub fn submit(&mut self, x: XferSpec) {
        self.xfers.push(x.clone());
        self.push(x.at, What::Submit(self.xfers.len() - 1));
    }

    /// Submit `x` (its `at` is ignored) `gap` after transfer `after` ends, as a caller that
    /// waits for each transfer before starting the next does.
    pub fn submit_after(&mut self, x: XferSpec, after: XferId, gap: Duration) {
        self.xfers.push(x);
        let i = self.xfers.len() - 1;
        self.chained.entry(after).or_default().push((i, gap));
    }

    pub fn cancel_at(&mut self, at: Duration, x: XferId) {
        self.push(at, What::Cancel(x));
    }

    fn push(&mut self, t: Duration, w: What) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, w)));
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    /// Drop everything in a rail's pipe (the connection is gone).
    fn drop_pipe(&mut self, rail: RailId) {
        let p = &mut self.pipes[rail];
        p.epoch += 1;
        p.busy_until = self.now;
        p.used = false;
        for r in self.records.iter_mut() {
            if r.chunk.rail == rail && r.outcome == Outcome::Pending {
                r.outcome = Outcome::Lost(self.now);
            }
        }
    }

    fn handle(&mut self, w: What) {
        let now = self.at();
        match w {
            What::Complete { rail, epoch, idx } => {
                if self.pipes[rail].epoch != epoch {
                    return; // dropped with its pipe
                }
                let id = self.records[idx].chunk.id;
                let accepted = if self.refuse.contains(&id) {
                    self.planner.handle_failed(id, "sim: refused".into(), now)
                } else {
                    self.planner.handle_done(id, now)
                };
                self.records[idx].outcome = if accepted { Outcome::Done(self.now) } else { Outcome::Stale(self.now) };
                if accepted {
                    self.bytes_done += self.records[idx].chunk.piece.len;
                    let rates = (0..self.specs.len()).map(|r| self.planner.rail_stats(r).rate).collect();
                    self.trace.push(RateSample { at: self.now, bytes_done: self.bytes_done, rates });
                }
            }
            What::Down(rail) => {
                self.drop_pipe(rail);
                self.pipes[rail].broken = true;
                self.planner.handle_rail_down(rail, "sim: link error".into(), now);
            }
            What::Up(rail) => {
                self.pipes[rail].broken = false;
                self.pipes[rail].busy_until = self.now;
                self.pipes[rail].used = false;
                self.planner.handle_rail_up(rail, now);
            }
            What::Probe(rail) => {
                if !self.pipes[rail].broken && !self.planner.is_up(rail) {
                    self.planner.handle_rail_up(rail, now);
                }
            }
            What::Submit(i) => {
                let x = &self.xfers[i];
                self.submitted.push((x.id, self.now));
                self.planner.submit(x.id, x.pairs.clone(), now);
            }
            What::Cancel(x) => self.planner.cancel(x),
            What::Start(rail) => self.started[rail] = true,
        }
    }

    /// Put a chunk into its rail's pipe and schedule its completion.
    fn issue(&mut self, c: Chunk) {
        let spec = &self.specs[c.rail];
        let f = if spec.jitter > 0.0 { 1.0 + spec.jitter * (2.0 * self.rng.unit() - 1.0) } else { 1.0 };
        let pipe = &mut self.pipes[c.rail];
        assert!(!pipe.broken, "planner handed work to rail {} that it was told is down", c.rail);
        let start = pipe.busy_until.max(self.now);
        if let Some(s) = spec.slow_start {
            if !pipe.used || start - pipe.busy_until >= s.after_idle {
                pipe.ramp = Some(start);
            }
        }
        pipe.used = true;
        let hiccup = match spec.hiccups {
            Some((p, d)) if self.rng.unit() < p => d,
            _ => Duration::ZERO,
        };
        let idx = self.records.len();
        self.records.push(ChunkRecord { chunk: c.clone(), issued: self.now, outcome: Outcome::Pending, served: Duration::ZERO });
        let prev = self.by_id.insert(c.id, idx);
        assert!(prev.is_none(), "chunk id {:?} handed out twice", c.id);
        match spec.serve(start, c.piece.len as f64 * f, pipe.ramp) {
            Some(end) => {
                let end = end + hiccup;
                self.records[idx].served = end - start;
                pipe.serving += end - start;
                pipe.busy_until = end;
                let epoch = pipe.epoch;
                let mut t = end + 2 * spec.latency;
                if let Some((p, d)) = spec.late_reports {
                    if self.rng.unit() < p {
                        t += d.mul_f64(self.rng.unit());
                    }
                    t = t.max(pipe.reported_until);
                    pipe.reported_until = t;
                }
                self.push(t, What::Complete { rail: c.rail, epoch, idx });
            }
            // Stalled for ever: never completes; only the stall timeout can recover.
            None => pipe.busy_until = Duration::MAX / 4,
        }
    }

    /// Hand out work until no rail takes any more.
    fn poll_all(&mut self) {
        let n = self.specs.len();
        if n == 0 {
            return;
        }
        loop {
            let mut any = false;
            for k in 0..n {
                let rail = (self.poll_from + k) % n;
                if !self.started[rail] {
                    continue;
                }
                if let Some(c) = self.planner.poll_work(rail, self.at()) {
                    assert_eq!(c.rail, rail, "chunk handed to the wrong rail");
                    self.issue(c);
                    any = true;
                }
            }
            self.poll_from = (self.poll_from + 1) % n;
            if !any {
                break;
            }
        }
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.planner.poll_event() {
            let ended = match &e {
                Event::XferDone(x) | Event::XferFailed { xfer: x, .. } => Some(*x),
                _ => None,
            };
            for (i, gap) in ended.and_then(|x| self.chained.remove(&x)).unwrap_or_default() {
                self.push(self.now + gap, What::Submit(i));
            }
            self.events.push((self.now, e));
        }
    }

    /// Run until nothing is left to happen. Panics if the planner hangs (work left, no event
    /// can ever occur) or the run passes `limit`.
    pub fn run(mut self) -> Report {
        loop {
            while let Some(Reverse((t, _, w))) = self.queue.peek().copied() {
                if t > self.now {
                    break;
                }
                self.queue.pop();
                self.handle(w);
            }
            if self.planner.poll_timeout().is_some_and(|t| t <= self.at()) {
                // The runtime's sequence: evidence from below chunk level first, then the
                // planner decides, the driver stops the rail's paths (here: drops what is in its
                // pipe), then reports it down.
                self.evidence();
                for (rail, reason) in self.planner.poll_stalled(self.at()) {
                    self.drop_pipe(rail);
                    self.planner.handle_rail_down(rail, reason, self.at());
                }
            }
            self.poll_all();
            self.drain_events();
            let next_q = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let next_to = self.planner.poll_timeout().map(|t| t.saturating_duration_since(self.t0).max(self.now));
            let Some(next) = [next_q, next_to].into_iter().flatten().min() else {
                break;
            };
            assert!(next < self.limit, "run passed its limit of {:?}: hung?\n{}", self.limit, self.dump());
            self.now = next;
        }
        let idle = self.planner.is_idle();
        assert!(idle, "planner hung: work left but no event pending at {:?}\n{}", self.now, self.dump());
        Report {
            stats: (0..self.specs.len()).map(|r| self.planner.rail_stats(r)).collect(),
            chunks: self.records,
            events: self.events,
            end: self.now,
            idle_at_end: idle,
            serving: self.pipes.iter().map(|p| p.serving).collect(),
            submitted: self.submitted,
            trace: self.trace,
        }
    }

    /// The watchdog's evidence, as the tcp transport gives it (only with `byte_progress`): a
    /// rail whose pipe is moving bytes of ours progressed (its acknowledgements arrive a round
    /// trip later); one in a hold with work queued is held back on this host.
    fn evidence(&mut self) {
        if !self.planner.config().byte_progress {
            return;
        }
        let now = self.at();
        for rail in 0..self.specs.len() {
            let (spec, pipe) = (&self.specs[rail], &self.pipes[rail]);
            if pipe.broken || pipe.busy_until <= self.now {
                continue;
            }
            if spec.in_hold(self.now) {
                self.planner.handle_held(rail, now);
            } else if spec.rate(self.now) > 0.0 {
                self.planner.handle_progress(rail, now.checked_sub(2 * spec.latency).unwrap_or(now));
            }
        }
    }

    fn dump(&self) -> String {
        let mut s = String::new();
        for r in 0..self.specs.len() {
            let _ = writeln!(s, "rail {r}: {:?}", self.planner.rail_stats(r));
        }
        let pending = self.records.iter().filter(|r| r.outcome == Outcome::Pending).count();
        let _ = writeln!(s, "{pending} chunks pending; last events: {:?}", self.events.iter().rev().take(5).collect::<Vec<_>>());
        s
    }
}

/// The earliest time at which the rails, running flat out from `start` outside their
/// outages, could have carried `bytes`: the ideal finishing time of a transfer.
pub fn ideal_finish(rails: &[RailSpec], start: Duration, bytes: u64) -> Duration {
    let cap = |t: Duration| -> f64 { rails.iter().map(|r| r.capacity(t) - r.capacity(start)).sum() };
    let (mut lo, mut hi) = (start, start + Duration::from_millis(1));
    while cap(hi) < bytes as f64 {
        hi = start + (hi - start) * 2;
        assert!(hi < Duration::from_secs(1_000_000), "rails cannot carry {bytes} bytes");
    }
    while hi - lo > Duration::from_nanos(100) {
        let mid = lo + (hi - lo) / 2;
        if cap(mid) >= bytes as f64 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// One row of a throughput table.
#[derive(Debug, Clone)]
pub struct Row {
    pub scenario: String,
    pub ideal: Duration,
    pub achieved: Duration,
    /// Largest gap between two rails' last completions, in chunk times of the slowest rail.
    pub tail_chunks: f64,
}

impl Row {
    pub fn efficiency(&self) -> f64 {
        self.ideal.as_secs_f64() / self.achieved.as_secs_f64()
    }
}

/// Format rows smoltcp-style.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "| {:<44} | {:>9} | {:>11} | {:>7} | {:>6} |", "scenario", "ideal ms", "achieved ms", "eff %", "tail");
    let _ = writeln!(s, "|{:-<46}|{:->11}|{:->13}|{:->9}|{:->8}|", "", "", "", "", "");
    for r in rows {
        let _ = writeln!(
            s,
            "| {:<44} | {:>9.2} | {:>11.2} | {:>7.1} | {:>6.2} |",
            r.scenario,
            r.ideal.as_secs_f64() * 1e3,
            r.achieved.as_secs_f64() * 1e3,
            r.efficiency() * 100.0,
            r.tail_chunks
        );
    }
    s
}

/// Sum of a planner's per-rail stats, keyed by name, for quick assertions.
pub fn totals(stats: &[RailStats]) -> BTreeMap<&'static str, u64> {
    let mut m = BTreeMap::new();
    m.insert("inflight_bytes", stats.iter().map(|s| s.inflight_bytes).sum());
    m.insert("bytes_done", stats.iter().map(|s| s.bytes_done).sum());
    m.insert("chunks_done", stats.iter().map(|s| s.chunks_done).sum());
    m
}
