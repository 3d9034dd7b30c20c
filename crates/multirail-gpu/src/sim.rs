//! A simulated copy engine: a sender [`Stager`] and a receiver [`Stager`] driven in virtual
//! time against three FIFO servers (the D2H copy engine, the wire, the H2D copy engine), each
//! with its own rate and per-operation latency.
//!
//! This is where the staging schedule is tested for speed, not just for correctness: the
//! tests assert overlap, finishing times against the analytic bound ([`lower_bound`]), the pool
//! bound and the per-stage breakdown, without a GPU or a clock.
//!
//! Model. An operation occupies its server for `latency + bytes / rate` (latency is launch and
//! completion overhead that the stage cannot overlap with its own next operation). A wire
//! operation for chunk k starts once the sender has issued its send, the receiver has posted
//! a buffer for it and the wire is free; its end completes both sides' wire stage. Completion
//! events at the same instant are delivered D2H first, then wire, then H2D.

use std::collections::VecDeque;
use std::time::Duration;

use crate::staging::{Action, BufId, ChunkId, Piece, PoolConfig, Role, Stager, StagingError};
use crate::timeline::{Interval, Stage, Timeline};

/// Rates in bytes/s and per-operation latencies of the three stages, and each side's pool.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub d2h_rate: f64,
    pub wire_rate: f64,
    pub h2d_rate: f64,
    pub d2h_latency: Duration,
    pub wire_latency: Duration,
    pub h2d_latency: Duration,
    pub sender_pool: PoolConfig,
    pub receiver_pool: PoolConfig,
}

impl SimConfig {
    /// Time one operation of `bytes` occupies `stage`.
    pub fn op_time(&self, stage: Stage, bytes: u64) -> Duration {
        let (rate, lat) = match stage {
            Stage::D2H => (self.d2h_rate, self.d2h_latency),
            Stage::Wire => (self.wire_rate, self.wire_latency),
            Stage::H2D => (self.h2d_rate, self.h2d_latency),
        };
        lat + Duration::from_nanos((bytes as f64 / rate * 1e9).round() as u64)
    }
}

/// What a simulated transfer did.
#[derive(Debug, Clone)]
pub struct SimResult {
    /// Virtual time at which the last H2D copy completed.
    pub finish: Duration,
    pub timeline: Timeline,
    pub sender_max_in_use: usize,
    pub receiver_max_in_use: usize,
    /// Chunks as they landed in device memory (H2D completions), in completion order.
    pub landed: Vec<Piece>,
    /// Buffer-discipline violations seen by the simulator (must be empty).
    pub violations: Vec<String>,
}

/// Why a simulation could not run to the end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Staging(#[from] StagingError),
    /// Nothing can make progress but chunks are left: a scheduling deadlock.
    #[error("stuck at {at:?} with {left} chunks not landed")]
    Stuck { at: Duration, left: usize },
}

#[derive(Debug, Clone, Copy)]
struct Op {
    piece: Piece,
    sbuf: Option<BufId>,
    rbuf: Option<BufId>,
}

#[derive(Debug, Default)]
struct Server {
    queue: VecDeque<Op>,
    running: Option<(Op, Duration, Duration)>,
}

/// Runs `chunks` (in wire order) through a sender and a receiver stager (module docs).
pub fn run(cfg: &SimConfig, chunks: &[Piece]) -> Result<SimResult, SimError> {
    let mut tx = Stager::new(Role::Sender, cfg.sender_pool)?;
    let mut rx = Stager::new(Role::Receiver, cfg.receiver_pool)?;
    for p in chunks {
        tx.submit(*p)?;
        rx.submit(*p)?;
    }
    let mut servers: [Server; 3] = Default::default();
    let (mut sends, mut recvs) = (VecDeque::new(), VecDeque::new());
    // What each bounce buffer holds (after its filling stage completed), and who owns it.
    let mut s_owner: Vec<Option<ChunkId>> = vec![None; cfg.sender_pool.buffers];
    let mut r_owner: Vec<Option<ChunkId>> = vec![None; cfg.receiver_pool.buffers];
    let mut s_data: Vec<Option<ChunkId>> = vec![None; cfg.sender_pool.buffers];
    let mut r_data: Vec<Option<ChunkId>> = vec![None; cfg.receiver_pool.buffers];
    let mut out = SimResult {
        finish: Duration::ZERO,
        timeline: Timeline::new(),
        sender_max_in_use: 0,
        receiver_max_in_use: 0,
        landed: Vec::new(),
        violations: Vec::new(),
    };
    let mut now = Duration::ZERO;
    loop {
        while let Some(a) = tx.poll_action() {
            match a {
                Action::StartD2H { piece, buf } => {
                    take(&mut s_owner, buf, piece.chunk, "sender", &mut out.violations);
                    servers[0].queue.push_back(Op { piece, sbuf: Some(buf), rbuf: None });
                }
                Action::StartSend { piece, buf } => {
                    if s_data[buf.0] != Some(piece.chunk) {
                        out.violations.push(format!("send of {:?} from {buf:?} holding {:?}", piece.chunk, s_data[buf.0]));
                    }
                    sends.push_back((piece, buf));
                }
                Action::Release { chunk, buf } => give(&mut s_owner, buf, chunk, "sender", &mut out.violations),
                other => out.violations.push(format!("sender emitted {other:?}")),
            }
        }
        while let Some(a) = rx.poll_action() {
            match a {
                Action::StartRecv { piece, buf } => {
                    take(&mut r_owner, buf, piece.chunk, "receiver", &mut out.violations);
                    recvs.push_back((piece, buf));
                }
                Action::StartH2D { piece, buf } => {
                    if r_data[buf.0] != Some(piece.chunk) {
                        out.violations.push(format!("H2D of {:?} from {buf:?} holding {:?}", piece.chunk, r_data[buf.0]));
                    }
                    servers[2].queue.push_back(Op { piece, sbuf: None, rbuf: Some(buf) });
                }
                Action::Release { chunk, buf } => give(&mut r_owner, buf, chunk, "receiver", &mut out.violations),
                other => out.violations.push(format!("receiver emitted {other:?}")),
            }
        }
        while let (Some(&(sp, sb)), Some(&(rp, rb))) = (sends.front(), recvs.front()) {
            if sp != rp {
                out.violations.push(format!("wire order: sender {sp:?} vs receiver {rp:?}"));
            }
            sends.pop_front();
            recvs.pop_front();
            servers[1].queue.push_back(Op { piece: sp, sbuf: Some(sb), rbuf: Some(rb) });
        }
        for (i, s) in servers.iter_mut().enumerate() {
            if s.running.is_none() {
                if let Some(op) = s.queue.pop_front() {
                    s.running = Some((op, now, now + cfg.op_time(Stage::ALL[i], op.piece.len)));
                }
            }
        }
        let Some(next) = servers.iter().filter_map(|s| s.running.map(|r| r.2)).min() else { break };
        now = next;
        for (i, s) in servers.iter_mut().enumerate() {
            let Some((op, start, end)) = s.running else { continue };
            if end != now {
                continue;
            }
            s.running = None;
            let stage = Stage::ALL[i];
            out.timeline.record(Interval { stage, chunk: op.piece.chunk, bytes: op.piece.len, start, end });
            match stage {
                Stage::D2H => {
                    if let Some(b) = op.sbuf {
                        s_data[b.0] = Some(op.piece.chunk);
                    }
                    tx.handle_d2h_done(op.piece.chunk)?;
                }
                Stage::Wire => {
                    if let Some(b) = op.rbuf {
                        r_data[b.0] = Some(op.piece.chunk);
                    }
                    tx.handle_wire_done(op.piece.chunk)?;
                    rx.handle_wire_done(op.piece.chunk)?;
                }
                Stage::H2D => {
                    out.landed.push(op.piece);
                    out.finish = now;
                    rx.handle_h2d_done(op.piece.chunk)?;
                }
            }
        }
    }
    if !(tx.is_idle() && rx.is_idle()) || out.landed.len() != chunks.len() {
        return Err(SimError::Stuck { at: now, left: chunks.len() - out.landed.len() });
    }
    out.sender_max_in_use = tx.max_in_use();
    out.receiver_max_in_use = rx.max_in_use();
    Ok(out)
}

fn take(owner: &mut [Option<ChunkId>], buf: BufId, chunk: ChunkId, side: &str, v: &mut Vec<String>) {
    match owner.get(buf.0) {
        Some(None) => owner[buf.0] = Some(chunk),
        Some(Some(c)) => v.push(format!("{side} {buf:?} given to {chunk:?} while {c:?} holds it")),
        None => v.push(format!("{side} {buf:?} is outside the pool")),
    }
}

fn give(owner: &mut [Option<ChunkId>], buf: BufId, chunk: ChunkId, side: &str, v: &mut Vec<String>) {
    match owner.get(buf.0) {
        Some(Some(c)) if *c == chunk => owner[buf.0] = None,
        other => v.push(format!("{side} release of {buf:?} by {chunk:?}, owner {other:?}")),
    }
}

/// The flow-shop lower bound on the finishing time: for each stage, the time the first chunk
/// needs to reach it (fill), all of the stage's work, and the time the last chunk needs after
/// it (drain); the largest of the three. With unbounded buffers and equal chunks it is exact:
/// `(n - 1) * t_max + t_d2h + t_wire + t_h2d`.
pub fn lower_bound(cfg: &SimConfig, chunks: &[Piece]) -> Duration {
    let (Some(first), Some(last)) = (chunks.first(), chunks.last()) else { return Duration::ZERO };
    let t = |s: Stage, p: &Piece| cfg.op_time(s, p.len);
    Stage::ALL
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let fill: Duration = Stage::ALL[..i].iter().map(|&b| t(b, first)).sum();
            let work: Duration = chunks.iter().map(|p| t(s, p)).sum();
            let drain: Duration = Stage::ALL[i + 1..].iter().map(|&a| t(a, last)).sum();
            fill + work + drain
        })
        .max()
        .unwrap_or_default()
}

/// The finishing time of the same chunks through the three stages in order with unbounded
/// buffers: `C[k][s] = max(C[k-1][s], C[k][s-1]) + t_s(k)`. Exact where [`lower_bound`] is
/// loose (a short last chunk waits for the previous chunk's H2D), and what a pool large enough
/// to never stall achieves.
pub fn ideal_finish(cfg: &SimConfig, chunks: &[Piece]) -> Duration {
    let mut done = [Duration::ZERO; 3];
    for p in chunks {
        let mut ready = Duration::ZERO;
        for (i, &s) in Stage::ALL.iter().enumerate() {
            done[i] = done[i].max(ready) + cfg.op_time(s, p.len);
            ready = done[i];
        }
    }
    done[2]
}

/// Finishing time with no overlap at all: every operation of every stage back to back.
pub fn serial_time(cfg: &SimConfig, chunks: &[Piece]) -> Duration {
    chunks.iter().map(|p| Stage::ALL.iter().map(|&s| cfg.op_time(s, p.len)).sum::<Duration>()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::split;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn cfg(d2h: f64, wire: f64, h2d: f64, n: usize) -> SimConfig {
        let pool = PoolConfig { buffers: n, buffer_size: MIB };
        SimConfig {
            d2h_rate: d2h,
            wire_rate: wire,
            h2d_rate: h2d,
            d2h_latency: Duration::ZERO,
            wire_latency: Duration::ZERO,
            h2d_latency: Duration::ZERO,
            sender_pool: pool,
            receiver_pool: pool,
        }
    }

    fn close(a: Duration, b: Duration, tol: f64) -> bool {
        (a.as_secs_f64() - b.as_secs_f64()).abs() <= tol * b.as_secs_f64()
    }

    #[test]
    fn equal_rates_overlap_all_three_stages() {
        let c = cfg(10e9, 10e9, 10e9, 2);
        let n = 32;
        let chunks: Vec<Piece> = split(0, n * MIB, MIB, 0).collect();
        let r = run(&c, &chunks).unwrap();
        let t = c.op_time(Stage::Wire, MIB);
        let pipelined = t * (n as u32 + 2);
        assert!(close(r.finish, pipelined, 0.01), "{:?} vs (n+2)t = {pipelined:?}", r.finish);
        assert!(r.finish * 2 < t * 3 * n as u32, "not overlapped: {:?} vs serial {:?}", r.finish, t * 3 * n as u32);
        // All three stages ran at once for all but the fill and drain.
        assert!(r.timeline.overlap_all() >= t * (n as u32 - 2) * 99 / 100, "{:?}", r.timeline.overlap_all());
        assert!(r.violations.is_empty(), "{:?}", r.violations);
    }

    #[test]
    fn finishes_within_a_few_percent_of_the_bound() {
        let mut c = cfg(22e9, 12.5e9, 25e9, 3);
        c.d2h_latency = Duration::from_micros(8);
        c.h2d_latency = Duration::from_micros(8);
        c.wire_latency = Duration::from_micros(3);
        for len in [MIB, 10 * MIB + 12345, 64 * MIB, 200 * MIB - 1] {
            let chunks: Vec<Piece> = split(0, len, MIB, 0).collect();
            let r = run(&c, &chunks).unwrap();
            let (lb, ideal) = (lower_bound(&c, &chunks), ideal_finish(&c, &chunks));
            assert!(r.finish >= lb && ideal >= lb, "below the lower bound: {:?} < {lb:?}", r.finish);
            assert!(close(r.finish, ideal, 0.01), "len {len}: {:?} vs unbounded-pool finish {ideal:?}", r.finish);
            if len % MIB == 0 {
                // Equal chunks: the closed-form bound is the finishing time.
                assert!(close(r.finish, lb, 0.03), "len {len}: {:?} vs bound {lb:?}", r.finish);
            }
        }
    }

    #[test]
    fn pool_bound_is_respected_and_one_buffer_serialises() {
        let chunks: Vec<Piece> = split(0, 20 * MIB, MIB, 0).collect();
        for n in 1..=5 {
            let c = cfg(20e9, 10e9, 20e9, n);
            let r = run(&c, &chunks).unwrap();
            assert!(r.sender_max_in_use <= n && r.receiver_max_in_use <= n);
            assert_eq!(r.sender_max_in_use, n.min(20));
            assert!(r.violations.is_empty(), "{:?}", r.violations);
            if n == 1 {
                // One buffer per side: D2H and wire of the sender never overlap.
                assert_eq!(r.timeline.overlap(Stage::D2H, Stage::Wire), Duration::ZERO);
            } else {
                assert!(close(r.finish, lower_bound(&c, &chunks), 0.01), "n={n}: {:?}", r.finish);
            }
        }
    }

    #[test]
    fn bottleneck_is_the_slowest_stage() {
        let chunks: Vec<Piece> = split(0, 32 * MIB, MIB, 0).collect();
        for (rates, want) in [((5e9, 20e9, 20e9), Stage::D2H), ((20e9, 5e9, 20e9), Stage::Wire), ((20e9, 20e9, 5e9), Stage::H2D)] {
            let r = run(&cfg(rates.0, rates.1, rates.2, 3), &chunks).unwrap();
            assert_eq!(r.timeline.breakdown().bottleneck, want, "{rates:?}");
        }
    }

    #[test]
    fn busy_fractions_follow_the_rates() {
        // Wire at 10 GB/s is the bottleneck; D2H at 20 and H2D at 40 are busy 1/2 and 1/4 of it.
        let chunks: Vec<Piece> = split(0, 64 * MIB, MIB, 0).collect();
        let r = run(&cfg(20e9, 10e9, 40e9, 3), &chunks).unwrap();
        let b = r.timeline.breakdown();
        let f = |s| b.stage(s).busy_frac;
        assert!(f(Stage::Wire) > 0.97, "{b}");
        assert!((f(Stage::D2H) - 0.5).abs() < 0.03, "{b}");
        assert!((f(Stage::H2D) - 0.25).abs() < 0.03, "{b}");
        assert_eq!(b.stage(Stage::Wire).per_chunk, cfg(20e9, 10e9, 40e9, 3).op_time(Stage::Wire, MIB));
        assert_eq!(b.stage(Stage::D2H).bytes, 64 * MIB);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn random_rates_sizes_and_pools(
            rates in (8.0f64..11.0, 8.0f64..11.0, 8.0f64..11.0),
            lats in (0u64..50, 0u64..50, 0u64..50),
            sizes in prop::collection::vec(1u64..=MIB, 1..40),
            pools in (1usize..6, 1usize..6),
        ) {
            let mut c = cfg(10f64.powf(rates.0), 10f64.powf(rates.1), 10f64.powf(rates.2), 1);
            c.d2h_latency = Duration::from_micros(lats.0);
            c.wire_latency = Duration::from_micros(lats.1);
            c.h2d_latency = Duration::from_micros(lats.2);
            c.sender_pool.buffers = pools.0;
            c.receiver_pool.buffers = pools.1;
            let mut off = 0;
            let chunks: Vec<Piece> = sizes.iter().enumerate().map(|(i, &len)| {
                let p = Piece { chunk: ChunkId(i as u64), offset: off, len };
                off += len;
                p
            }).collect();
            let r = run(&c, &chunks).unwrap();
            prop_assert!(r.violations.is_empty(), "{:?}", r.violations);
            prop_assert!(r.sender_max_in_use <= pools.0 && r.receiver_max_in_use <= pools.1);
            // Every chunk landed exactly once, where it belongs: bytes conserved.
            let mut landed = r.landed.clone();
            landed.sort_by_key(|p| p.chunk);
            prop_assert_eq!(&landed, &chunks);
            prop_assert_eq!(landed.iter().map(|p| p.len).sum::<u64>(), off);
            prop_assert!(r.finish >= lower_bound(&c, &chunks));
            prop_assert!(r.finish >= ideal_finish(&c, &chunks));
            prop_assert!(r.finish <= serial_time(&c, &chunks));
            for s in Stage::ALL {
                prop_assert_eq!(r.timeline.breakdown().stage(s).bytes, off);
            }
        }
    }
}
