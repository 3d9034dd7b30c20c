//! Property tests.
//!
//! Planner invariants, checked on random runs of the rail simulator (random pair lists, rail
//! counts, rates, latencies, jitter, policies, chunk sizes, failure schedules with rails going
//! down and coming back, silent stalls, refused chunks and cancels):
//! - every transfer that completes was covered exactly once by its accepted chunks, each
//!   chunk mapping local to remote bytes as its pair does;
//! - work is redone only for what was lost: bytes issued = bytes of the transfer + bytes lost;
//! - every transfer ends with exactly one `XferDone` or `XferFailed` (none once cancelled);
//! - a transfer fails only when no rail is left, when its pinned rail is down, or when the
//!   remote refused one of its chunks;
//! - the planner never hangs, never panics, and its counters return to zero.
//!
//! Codec properties: arbitrary bodies, metadata and descriptor lists round-trip. An ignored
//! test writes the committed fuzz seed corpus (`cargo test -p multirail-proto --test props --
//! --ignored write_fuzz_corpus`).

mod simnet;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use multirail_proto::codec::{IpcEntry, RemoteOp, Role, UcxRegion, VecOp, VecPiece, HEADER_LEN, MAX_VEC_ENTRIES, MAX_VEC_PIECES};
use multirail_proto::planner::{pair_rows, pair_segments, Run};
use multirail_proto::{
    Access, AgentMeta, Body, ChunkId, DescList, Event, Header, MemType, Pair, PlannerConfig, Policy, RailInfo, RegionKey, RegionMeta,
    Status, XferId,
};
use proptest::prelude::*;
use simnet::{Outcome, RailSpec, Report, Sim, XferSpec};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
struct Scenario {
    cfg: PlannerConfig,
    rails: Vec<RailSpec>,
    xfers: Vec<XferSpec>,
    cancels: Vec<(Duration, XferId)>,
    refuse: Vec<u64>,
    seed: u64,
}

fn rail() -> impl Strategy<Value = RailSpec> {
    (
        250.0e6..4.0e9f64, // rate, bits/s
        0u64..400,         // one-way latency, us
        prop_oneof![Just(0.0), 0.0..0.4f64],
        any::<bool>(),                                                        // hint known
        prop::collection::vec((0u64..150, prop::option::of(1u64..80)), 0..3), // outages (ms)
        prop::option::of((0u64..150, 5u64..80)),                              // silent stall (ms)
    )
        .prop_map(|(bits, lat, jitter, hint, outages, stall)| {
            let rate = bits / 8.0;
            let mut r = RailSpec::steady(rate).latency(Duration::from_micros(lat)).jitter(jitter);
            if !hint {
                r = r.hint(None);
            }
            for (at, dur) in outages {
                r = r.outage(ms(at), dur.map(|d| ms(at + d)));
            }
            if let Some((at, dur)) = stall {
                r = r.rate_at(ms(at), 0.0).rate_at(ms(at + dur), rate);
            }
            r
        })
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Pairs with disjoint local ranges (so a local address names one byte of the transfer).
fn pairs(id: u64) -> impl Strategy<Value = Vec<Pair>> {
    prop::collection::vec((prop_oneof![1u64..4 * KIB, 1u64..128 * KIB, 1u64..3 * MIB], 0u64..4, 0u64..1 << 30), 1..5).prop_map(move |v| {
        let mut local = id << 40;
        v.into_iter()
            .map(|(len, region, offset)| {
                let p = Pair { local, region, offset, len };
                local += len + 4096;
                p
            })
            .collect()
    })
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1usize..5, prop::sample::select(vec![64 * KIB, 256 * KIB, MIB]), 0u64..4, any::<u64>())
        .prop_flat_map(|(n, chunk, pol, seed)| {
            let policy = match pol {
                0 | 1 => Just(Policy::Weighted).boxed(),
                2 => Just(Policy::RoundRobin).boxed(),
                _ => (0..n + 1).prop_map(Policy::Pinned).boxed(), // n: a rail that does not exist
            };
            let xfers = prop::collection::vec((0u64..120, 0u64..1 << 20), 1..6).prop_flat_map(|v| {
                v.into_iter()
                    .enumerate()
                    .map(|(i, (at, _))| pairs(i as u64 + 1).prop_map(move |p| XferSpec { id: XferId(i as u64 + 1), at: ms(at), pairs: p }))
                    .collect::<Vec<_>>()
            });
            (
                prop::collection::vec(rail(), n),
                policy,
                xfers,
                prop::collection::vec((0u64..200, 1u64..6), 0..3),
                prop::collection::vec(0u64..200, 0..2),
                prop_oneof![0u64..64 * KIB, 0u64..(2 * MIB)],
                Just((chunk, seed)),
            )
        })
        .prop_map(|(rails, policy, xfers, cancels, refuse, threshold, (chunk, seed))| Scenario {
            cfg: PlannerConfig {
                chunk_size: chunk,
                min_chunk: (chunk / 4).max(4096),
                stripe_threshold: threshold,
                stall_timeout: ms(20),
                policy,
                ..PlannerConfig::default()
            },
            rails,
            xfers,
            cancels: cancels.into_iter().map(|(t, x)| (ms(t), XferId(x))).collect(),
            refuse,
            seed,
        })
}

fn run(s: &Scenario) -> Report {
    let mut sim = Sim::new(s.cfg.clone(), s.rails.clone(), s.seed);
    sim.limit = Duration::from_secs(3600);
    sim.refuse = s.refuse.iter().map(|&i| ChunkId(i)).collect();
    for x in &s.xfers {
        sim.submit(x.clone());
    }
    for &(t, x) in &s.cancels {
        sim.cancel_at(t, x);
    }
    sim.run()
}

/// Map a piece back to its transfer's logical byte range, checking it lies inside one pair and
/// maps local to remote bytes as that pair does.
fn logical_range(pairs: &[Pair], piece: &Pair) -> Result<(u64, u64), String> {
    let mut start = 0;
    for p in pairs {
        if piece.local >= p.local && piece.local + piece.len <= p.local + p.len {
            let d = piece.local - p.local;
            if piece.region != p.region || piece.offset != p.offset + d {
                return Err(format!("piece {piece:?} maps local to remote unlike its pair {p:?}"));
            }
            return Ok((start + d, start + d + piece.len));
        }
        start += p.len;
    }
    Err(format!("piece {piece:?} lies in no pair"))
}

fn check(s: &Scenario, rep: &Report) -> Result<(), TestCaseError> {
    prop_assert!(rep.idle_at_end);
    for (i, st) in rep.stats.iter().enumerate() {
        prop_assert_eq!(st.inflight_bytes, 0, "rail {} still has bytes in flight", i);
    }
    let refused: HashSet<ChunkId> = s.refuse.iter().map(|&i| ChunkId(i)).collect();
    let accepted: u64 = rep
        .chunks
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Done(_)) && !refused.contains(&c.chunk.id))
        .map(|c| c.chunk.piece.len)
        .sum();
    prop_assert_eq!(rep.stats.iter().map(|s| s.bytes_done).sum::<u64>(), accepted);

    // Replay rail states from the planner's own events to judge each failure.
    let mut up = vec![true; s.rails.len()];
    let mut terminal: HashMap<XferId, Vec<(Duration, &Event)>> = HashMap::new();
    for (t, e) in &rep.events {
        match e {
            Event::RailDown { rail, .. } => up[*rail] = false,
            Event::RailUp(rail) => up[*rail] = true,
            Event::XferDone(x) => terminal.entry(*x).or_default().push((*t, e)),
            Event::XferFailed { xfer, reason } => {
                terminal.entry(*xfer).or_default().push((*t, e));
                let ok = if reason.starts_with("no rail left") {
                    !up.iter().any(|u| *u)
                } else if reason.starts_with("pinned rail") {
                    match s.cfg.policy {
                        Policy::Pinned(p) => up.get(p) != Some(&true),
                        _ => false,
                    }
                } else {
                    reason == "sim: refused"
                };
                prop_assert!(ok, "transfer {:?} failed with {:?} while rails up = {:?}", xfer, reason, up);
            }
        }
    }

    // The first cancel at or after its transfer's submission (an earlier one finds nothing).
    let submitted: HashMap<XferId, Duration> = s.xfers.iter().map(|x| (x.id, x.at)).collect();
    let mut cancelled: BTreeMap<XferId, Duration> = BTreeMap::new();
    for &(t, x) in &s.cancels {
        if submitted.get(&x).is_some_and(|&at| at <= t) {
            let e = cancelled.entry(x).or_insert(t);
            *e = (*e).min(t);
        }
    }
    for x in &s.xfers {
        let ends = terminal.get(&x.id).cloned().unwrap_or_default();
        prop_assert!(ends.len() <= 1, "transfer {:?} ended twice: {:?}", x.id, ends);
        match cancelled.get(&x.id) {
            // A cancel may come after the transfer ended; after it, nothing is reported.
            Some(&tc) => prop_assert!(ends.iter().all(|(t, _)| *t <= tc), "event after cancel: {:?}", ends),
            None => prop_assert_eq!(ends.len(), 1, "transfer {:?} never ended", x.id),
        }
        if !matches!(ends.first(), Some((_, Event::XferDone(_)))) {
            continue;
        }
        // Completed: accepted chunks tile the transfer exactly once.
        let mut ranges = Vec::new();
        for c in rep.done_chunks(x.id) {
            ranges.push(logical_range(&x.pairs, &c.chunk.piece).map_err(TestCaseError::fail)?);
        }
        ranges.sort();
        let mut covered = 0;
        for (a, b) in ranges {
            prop_assert_eq!(a, covered, "gap or overlap in transfer {:?}", x.id);
            covered = b;
        }
        prop_assert_eq!(covered, x.total());
        // Redone work is exactly what was lost.
        let (mut issued, mut lost) = (0, 0);
        for c in rep.chunks.iter().filter(|c| c.chunk.xfer == x.id) {
            issued += c.chunk.piece.len;
            if matches!(c.outcome, Outcome::Lost(_)) {
                lost += c.chunk.piece.len;
            }
            prop_assert!(!matches!(c.outcome, Outcome::Stale(_)), "completed transfer had a stale chunk");
        }
        prop_assert_eq!(issued, x.total() + lost);
    }
    Ok(())
}

/// A transfer of runs for the packer: explicit pages and strided runs over a few regions, local
/// addresses increasing and disjoint (so every local byte names one remote byte).
fn packer_runs() -> impl Strategy<Value = Vec<Run>> {
    let run = (0u64..3, 1u64..20_000, prop_oneof![3 => Just(1u64), 1 => 2u64..300], 0u64..5000, 0u64..3000, any::<bool>());
    prop::collection::vec(run, 1..60).prop_map(|rows| {
        let (mut local, mut off) = (1u64 << 30, [0u64; 3]);
        rows.into_iter()
            .map(|(region, len, count, lgap, rgap, contiguous)| {
                let lstride = if count == 1 { 0 } else { len + lgap };
                let rstride = if count == 1 {
                    0
                } else if contiguous {
                    len
                } else {
                    len + rgap
                };
                let r = Run { local, region, offset: off[region as usize], len, count, lstride, rstride };
                local += len * count + lgap * count + 1;
                off[region as usize] += len * count + rgap * count + 7;
                r
            })
            .collect()
    })
}

/// Checks the chunks a packer run accepted against the transfer: same mapping of local to
/// remote bytes, each byte exactly once.
fn covers_exactly(runs: &[Run], done: &[Pair]) -> Result<(), TestCaseError> {
    let pieces: Vec<Pair> = runs.iter().flat_map(|r| r.pieces().collect::<Vec<_>>()).collect();
    let mut got = done.to_vec();
    got.sort_by_key(|p| p.local);
    let mut covered = 0u64;
    for w in got.windows(2) {
        prop_assert!(w[0].local + w[0].len <= w[1].local, "overlap: {:?}", w);
    }
    for p in &got {
        let i = pieces.partition_point(|e| e.local + e.len <= p.local);
        let e = pieces.get(i).ok_or_else(|| TestCaseError::fail(format!("{p:?} outside the transfer")))?;
        prop_assert!(e.local <= p.local && p.local + p.len <= e.local + e.len, "{:?} not inside one piece {:?}", p, e);
        prop_assert_eq!((p.region, p.offset - e.offset), (e.region, p.local - e.local), "wrong remote bytes for {:?}", p);
        covered += p.len;
    }
    prop_assert_eq!(covered, runs.iter().map(|r| r.bytes()).sum::<u64>());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// The vectored packer: chunks stay within `chunk_size`, one region, the wire's entry and
    /// piece bounds, are contiguous on rails that do not take vectors, and the accepted chunks
    /// cover every byte of the transfer exactly once, through rails going down (their chunks
    /// re-cut onto the other rails) and reposts of the same shared runs.
    #[test]
    fn packer_covers_exactly_within_bounds(
        runs in packer_runs(),
        chunk_k in prop_oneof![Just(4u64), Just(64), Just(1024)],
        vec_rails in prop::collection::vec(any::<bool>(), 1..4),
        weighted in any::<bool>(),
        down_at in prop::option::of(0usize..40),
    ) {
        let chunk = chunk_k * KIB;
        let cfg = PlannerConfig {
            chunk_size: chunk,
            min_chunk: chunk.min(64 * KIB),
            policy: if weighted { Policy::Weighted } else { Policy::RoundRobin },
            ..PlannerConfig::default()
        };
        let now = std::time::Instant::now();
        let runs: std::sync::Arc<[Run]> = runs.into();
        let total: u64 = runs.iter().map(|r| r.bytes()).sum();
        let mut p = multirail_proto::Planner::new(cfg);
        let rails: Vec<usize> = vec_rails.iter().map(|_| p.add_rail(Some(1e9), now)).collect();
        for (r, v) in rails.iter().zip(&vec_rails) {
            p.set_vectored(*r, *v);
        }
        // Post the same prepared runs twice, one after the other.
        for post in 0..2u64 {
            let xid = XferId(post);
            p.submit_runs(xid, runs.clone(), total, true, now);
            let mut done: Vec<Pair> = Vec::new();
            let mut steps = 0usize;
            let mut downed = false;
            loop {
                let mut any = false;
                for (&r, &v) in rails.iter().zip(&vec_rails) {
                    let mut mine = Vec::new();
                    while let Some(c) = p.poll_work(r, now) {
                        any = true;
                        prop_assert!(c.piece.len <= chunk && c.piece.len > 0);
                        let pieces = c.pieces();
                        prop_assert_eq!(pieces.iter().map(|x| x.len).sum::<u64>(), c.piece.len);
                        prop_assert!(pieces.iter().all(|x| x.region == c.piece.region), "one region per chunk");
                        prop_assert_eq!((pieces[0].local, pieces[0].offset), (c.piece.local, c.piece.offset));
                        match &c.vec {
                            None => prop_assert_eq!(pieces.len(), 1),
                            Some(vr) => {
                                prop_assert!(v, "vectored chunk on a rail that takes none");
                                prop_assert!(vr.len() <= MAX_VEC_ENTRIES && pieces.len() as u64 <= MAX_VEC_PIECES);
                                prop_assert!(vr.len() > 1 || vr[0].count > 1);
                            }
                        }
                        mine.push(c);
                    }
                    steps += 1;
                    if !downed && down_at == Some(steps) && rails.len() > 1 && !mine.is_empty() {
                        // Lose everything this rail holds; it comes back right away.
                        downed = true;
                        p.handle_rail_down(r, "test".into(), now);
                        p.handle_rail_up(r, now);
                        continue;
                    }
                    for c in mine {
                        prop_assert!(p.handle_done(c.id, now));
                        done.extend(c.pieces());
                    }
                }
                if !any {
                    break;
                }
            }
            let mut ended = false;
            while let Some(e) = p.poll_event() {
                if e == Event::XferDone(xid) {
                    ended = true;
                }
            }
            prop_assert!(ended, "post {} never completed", post);
            covers_exactly(&runs, &done)?;
            prop_assert!(p.is_idle());
        }
    }

    #[test]
    fn planner_invariants_hold(s in scenario()) {
        let rep = run(&s);
        check(&s, &rep)?;
    }

    /// pair_segments cuts two segmentations into equal-length pairs that cover both lists in
    /// order; unequal totals are refused.
    #[test]
    fn pair_segments_covers_both_sides(
        local in prop::collection::vec((0u64..1 << 40, 0u64..10_000), 0..8),
        cuts in prop::collection::vec(0u64..1000, 0..8),
        extra in 0u64..2,
    ) {
        let total: u64 = local.iter().map(|l| l.1).sum();
        let mut points: Vec<u64> = cuts.iter().map(|c| c * total / 1000).collect();
        points.push(0);
        points.push(total);
        points.sort();
        let remote: Vec<(u64, u64, u64)> =
            points.windows(2).enumerate().map(|(i, w)| (i as u64, 100 * i as u64, w[1] - w[0])).collect();
        let mut remote_bad = remote.clone();
        remote_bad.push((99, 0, extra));
        if extra > 0 {
            prop_assert_eq!(pair_segments(&local, &remote_bad), Err((total, total + extra)));
        }
        let pairs = pair_segments(&local, &remote).expect("equal totals");
        prop_assert!(pairs.iter().all(|p| p.len > 0));
        prop_assert_eq!(pairs.iter().map(|p| p.len).sum::<u64>(), total);
        // Walk both lists alongside the pairs.
        let (mut li, mut lo, mut rj, mut ro) = (0usize, 0u64, 0usize, 0u64);
        for p in &pairs {
            while local[li].1 == lo { li += 1; lo = 0; }
            while remote[rj].2 == ro { rj += 1; ro = 0; }
            prop_assert_eq!(p.local, local[li].0 + lo);
            prop_assert_eq!((p.region, p.offset), (remote[rj].0, remote[rj].1 + ro));
            prop_assert!(lo + p.len <= local[li].1 && ro + p.len <= remote[rj].2);
            lo += p.len;
            ro += p.len;
        }
    }

    /// pair_rows (one pass, merging) pairs exactly the bytes pair_segments pairs: every piece
    /// of the unmerged pairing lies, in order, at the same place in one merged pair; merged
    /// pairs are maximal (two in a row are never adjacent on both sides within one local tag
    /// and region); each row is resolved once, in order. Unequal totals or a row that does
    /// not resolve give None.
    #[test]
    fn pair_rows_pairs_the_same_bytes_as_pair_segments(
        lrows in prop::collection::vec((0u8..3, any::<bool>(), 0u64..1 << 40, prop_oneof![Just(0u64), 1u64..5000]), 0..10),
        cuts in prop::collection::vec(0u64..1000, 0..10),
        rsteps in prop::collection::vec((0u8..3, any::<bool>(), 0u64..1 << 30), 12),
        extra in 0u64..2,
        fail in prop::option::of((any::<bool>(), 0usize..12)),
    ) {
        // Local rows (tag, addr, len): most continue the row before (some in the next tag).
        let (mut local, mut end, mut tag) = (Vec::new(), 0u64, 0u64);
        for (k, &(cont, step, jump, len)) in lrows.iter().enumerate() {
            tag += step as u64;
            let addr = if k > 0 && cont > 0 { end } else { jump };
            local.push((tag, addr, len));
            end = addr + len;
        }
        // Remote rows (region, offset, len) cutting the same total differently.
        let total: u64 = local.iter().map(|l| l.2).sum();
        let mut points: Vec<u64> = cuts.iter().map(|c| c * total / 1000).collect();
        points.extend([0, total]);
        points.sort();
        let (mut remote, mut end, mut region) = (Vec::new(), 0u64, 0u64);
        for (k, w) in points.windows(2).enumerate() {
            let (cont, step, jump) = rsteps[k % rsteps.len()];
            region += step as u64;
            let offset = if k > 0 && cont > 0 { end } else { jump };
            remote.push((region, offset, w[1] - w[0]));
            end = offset + (w[1] - w[0]);
        }
        if extra > 0 {
            remote.push((99, 0, extra));
        }
        let fail = fail.filter(|&(side, k)| k < if side { local.len() } else { remote.len() });
        let (mut lseen, mut rseen) = (Vec::new(), Vec::new());
        let got = pair_rows(
            local.len(),
            |i| {
                lseen.push(i);
                (fail != Some((true, i))).then_some(local[i])
            },
            remote.len(),
            |j| {
                rseen.push(j);
                (fail != Some((false, j))).then_some(remote[j])
            },
        );
        if extra > 0 || fail.is_some() {
            prop_assert_eq!(got, None);
            return Ok(());
        }
        let merged = got.expect("equal totals, every row resolves");
        prop_assert_eq!(lseen, (0..local.len()).collect::<Vec<_>>());
        prop_assert_eq!(rseen, (0..remote.len()).collect::<Vec<_>>());
        let l2: Vec<(u64, u64)> = local.iter().map(|l| (l.1, l.2)).collect();
        let unmerged = pair_segments(&l2, &remote).expect("equal totals");
        prop_assert!(merged.iter().all(|p| p.len > 0));
        prop_assert_eq!(merged.iter().map(|p| p.len).sum::<u64>(), total);
        // Walk the unmerged pieces through the merged pairs.
        let (mut k, mut off) = (0usize, 0u64);
        for u in &unmerged {
            let m = merged[k];
            prop_assert_eq!((u.local, u.region, u.offset), (m.local + off, m.region, m.offset + off), "piece {:?} in {:?}", u, m);
            prop_assert!(off + u.len <= m.len);
            off += u.len;
            if off == m.len {
                k += 1;
                off = 0;
            }
        }
        prop_assert_eq!((k, off), (merged.len(), 0));
        // Maximal: adjacent pairs on both sides are cut only where the local tag changes.
        let tag_at = |pos: u64| {
            let mut start = 0;
            local.iter().find(|l| { start += l.2; l.2 > 0 && pos < start }).map(|l| l.0)
        };
        let mut pos = 0;
        for m in &merged {
            prop_assert_eq!(tag_at(pos), tag_at(pos + m.len - 1), "{:?} spans two local tags", m);
            pos += m.len;
        }
        pos = 0;
        for w in merged.windows(2) {
            pos += w[0].len;
            if w[0].local + w[0].len == w[1].local && w[0].region == w[1].region && w[0].offset + w[0].len == w[1].offset {
                prop_assert_ne!(tag_at(pos - 1), tag_at(pos), "{:?} and {:?} not merged", w[0], w[1]);
            }
        }
    }

    #[test]
    fn bodies_round_trip(b in body(), req in any::<u64>()) {
        let bytes = b.encode(req);
        let h = Header::decode(bytes[..HEADER_LEN].try_into().expect("16 bytes")).expect("header");
        prop_assert_eq!(h.req_id, req);
        prop_assert_eq!(Body::decode(h.kind, &bytes[HEADER_LEN..]).expect("body"), b);
    }

    #[test]
    fn metadata_round_trips(m in agent_meta(), d in desc_list()) {
        prop_assert_eq!(AgentMeta::decode(&m.encode()).expect("metadata"), m);
        prop_assert_eq!(DescList::decode(&d.encode()).expect("descriptor list"), d);
    }
}

fn name(max: usize) -> impl Strategy<Value = String> {
    prop::string::string_regex(&format!("[a-z0-9\u{e9}\u{4e2d}._-]{{0,{}}}", max / 3)).expect("regex")
}

fn status() -> impl Strategy<Value = Status> {
    (0u16..12).prop_map(Status::from_u16)
}

fn remote_op() -> impl Strategy<Value = RemoteOp> {
    (any::<u64>(), any::<[u8; 16]>(), any::<u64>(), 0..=multirail_proto::codec::MAX_CHUNK).prop_map(|(region, key, offset, len)| RemoteOp {
        region,
        key: RegionKey(key),
        offset,
        len,
    })
}

/// A valid vectored request: 1..40 entries, some strided, within every bound.
fn vec_op() -> impl Strategy<Value = VecOp> {
    let piece = (0u64..1 << 50, 1u64..1 << 16, prop_oneof![Just(1u64), 2u64..64], 0u64..1 << 12)
        .prop_map(|(offset, len, count, gap)| VecPiece { offset, len, count, stride: if count == 1 { 0 } else { len + gap } });
    (any::<u64>(), any::<[u8; 16]>(), prop::collection::vec(piece, 1..40)).prop_map(|(region, key, pieces)| VecOp {
        region,
        key: RegionKey(key),
        pieces,
    })
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        (1u16..=multirail_proto::codec::HELLO_VERSION, 0u8..4, any::<u64>(), name(255), any::<[u8; 16]>()).prop_map(
            |(version, r, incarnation, name, nonce)| {
                Body::Hello {
                    version,
                    role: [Role::Control, Role::Data, Role::UcxSession, Role::IpcWatch][r as usize],
                    incarnation,
                    name,
                    nonce,
                }
            }
        ),
        vec_op().prop_map(Body::ReadVReq),
        vec_op().prop_map(Body::WriteVReq),
        (any::<bool>(), any::<u64>(), any::<[u8; 16]>(), name(255)).prop_map(|(auth_required, incarnation, nonce, name)| Body::Challenge {
            auth_required,
            incarnation,
            nonce,
            name
        }),
        any::<[u8; 32]>().prop_map(|mac| Body::Auth { mac }),
        any::<[u8; 32]>().prop_map(|mac| Body::Welcome { mac }),
        remote_op().prop_map(Body::ReadReq),
        remote_op().prop_map(Body::WriteReq),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Body::Notif),
        Just(Body::Ping),
        (status(), 0..=multirail_proto::codec::MAX_CHUNK, name(512)).prop_map(|(status, bulk_len, msg)| Body::Resp {
            status,
            bulk_len,
            msg
        }),
        Just(Body::MetaGet),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Body::Meta),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Body::MetaPut),
        (status(), name(512)).prop_map(|(status, msg)| Body::Error { status, msg }),
        (any::<u16>(), prop::collection::vec(any::<u8>(), 0..300), any::<u32>(), any::<Option<[u8; 32]>>())
            .prop_map(|(rail, addr, features, mac)| Body::UcxOpen { rail, addr, features, mac }),
        (
            prop::collection::vec(any::<u8>(), 0..300),
            prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>(), prop::collection::vec(any::<u8>(), 0..100)), 0..5),
            any::<u32>(),
            any::<Option<[u8; 32]>>()
        )
            .prop_map(|(addr, rs, features, mac)| Body::UcxReady {
                addr,
                regions: rs.into_iter().map(|(id, base, len, rkey)| UcxRegion { id, base, len, rkey }).collect(),
                features,
                mac
            }),
        prop::collection::vec(any::<u64>(), 0..20).prop_map(Body::UcxRkeys),
        (any::<[u8; 16]>(), any::<[u8; 16]>(), prop::collection::vec((any::<u64>(), any::<[u8; 16]>()), 0..10))
            .prop_map(|(host, watch, rs)| Body::IpcReq { host, watch, regions: rs.into_iter().map(|(i, k)| (i, RegionKey(k))).collect() }),
        prop::collection::vec(
            (any::<u64>(), any::<u32>(), any::<[u8; 16]>(), prop::collection::vec(any::<u8>(), 64), any::<u64>(), any::<u64>()),
            0..5
        )
        .prop_map(|es| Body::IpcHandles(
            es.into_iter()
                .map(|(region, device, uuid, h, offset, alloc_len)| IpcEntry {
                    region,
                    device,
                    uuid,
                    handle: h.try_into().expect("64 bytes"),
                    offset,
                    alloc_len
                })
                .collect()
        )),
        prop::collection::vec(any::<u64>(), 0..20).prop_map(Body::IpcRevoke),
        prop::collection::vec(any::<u64>(), 0..20).prop_map(Body::IpcReleased),
    ]
}

fn agent_meta() -> impl Strategy<Value = AgentMeta> {
    let rail = (name(64), name(64), any::<u8>(), any::<u16>(), any::<u64>(), any::<u32>(), any::<i32>(), name(64)).prop_map(
        |(name, addr, prefix_len, port, speed_mbps, mtu, numa, rdma_dev)| RailInfo {
            name,
            addr,
            prefix_len,
            port,
            speed_mbps,
            mtu,
            numa,
            rdma_dev,
        },
    );
    let region = (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>(), any::<bool>(), 0u8..3, any::<[u8; 16]>()).prop_map(
        |(id, base, len, dev, vram, access, key)| RegionMeta {
            id,
            base: base / 2,
            len: len / 2,
            dev,
            mem: if vram { MemType::Vram } else { MemType::Dram },
            access: [Access::Local, Access::ReadOnly, Access::ReadWrite][access as usize],
            key: RegionKey(key),
        },
    );
    (name(255), any::<u64>(), prop::collection::vec(rail, 0..4), prop::collection::vec(region, 0..6))
        .prop_map(|(name, incarnation, rails, regions)| AgentMeta { name, incarnation, rails, regions })
}

fn desc_list() -> impl Strategy<Value = DescList> {
    (any::<bool>(), prop::collection::vec((0u64..1 << 62, 0u64..1 << 62, any::<u32>()), 0..10))
        .prop_map(|(vram, descs)| DescList { mem: if vram { MemType::Vram } else { MemType::Dram }, descs })
}

/// Write the fuzz seed corpus: a valid encoding of every frame kind and of metadata and
/// descriptor lists, plus truncated copies. Run after a wire-format change and commit
/// `fuzz/corpus/`.
#[test]
#[ignore = "writes fuzz/corpus/; run by hand after a wire-format change"]
fn write_fuzz_corpus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let op = RemoteOp { region: 7, key: RegionKey([0x5a; 16]), offset: 4096, len: MIB };
    let frames: Vec<(&str, Body)> = vec![
        (
            "hello",
            Body::Hello {
                version: multirail_proto::codec::HELLO_VERSION,
                role: Role::Data,
                incarnation: 5,
                name: "prefill-0".into(),
                nonce: [3; 16],
            },
        ),
        ("challenge", Body::Challenge { auth_required: true, incarnation: 9, nonce: [1; 16], name: "decode-1".into() }),
        ("auth", Body::Auth { mac: [2; 32] }),
        ("welcome", Body::Welcome { mac: [4; 32] }),
        ("readreq", Body::ReadReq(op)),
        ("writereq", Body::WriteReq(op)),
        (
            "readvreq",
            Body::ReadVReq(VecOp {
                region: 7,
                key: RegionKey([0x5a; 16]),
                pieces: vec![
                    VecPiece { offset: 0, len: 4096, count: 1, stride: 0 },
                    VecPiece { offset: 65536, len: 8192, count: 16, stride: 16384 },
                ],
            }),
        ),
        (
            "writevreq",
            Body::WriteVReq(VecOp {
                region: 7,
                key: RegionKey([0x5a; 16]),
                pieces: vec![
                    VecPiece { offset: 8192, len: 4096, count: 1, stride: 0 },
                    VecPiece { offset: 0, len: 4096, count: 1, stride: 0 },
                    VecPiece { offset: 1 << 20, len: 512, count: 1000, stride: 4096 },
                ],
            }),
        ),
        ("hello_v1", Body::Hello { version: 1, role: Role::Data, incarnation: 5, name: "prefill-0".into(), nonce: [3; 16] }),
        ("notif", Body::Notif(b"kv-ready:layer=3".to_vec())),
        ("ping", Body::Ping),
        ("resp_ok", Body::Resp { status: Status::Ok, bulk_len: MIB, msg: String::new() }),
        ("resp_err", Body::Resp { status: Status::OutOfBounds, bulk_len: 0, msg: "offset past region end".into() }),
        ("metaget", Body::MetaGet),
        ("meta", Body::Meta(sample_meta().encode())),
        ("metaput", Body::MetaPut(sample_meta().encode())),
        ("error", Body::Error { status: Status::VersionMismatch, msg: "peer speaks 2".into() }),
        (
            "hello_ucx",
            Body::Hello {
                version: multirail_proto::codec::HELLO_VERSION,
                role: Role::UcxSession,
                incarnation: 5,
                name: "prefill-0".into(),
                nonce: [6; 16],
            },
        ),
        ("ucxopen", Body::UcxOpen { rail: 1, addr: vec![0x11; 170], features: 1, mac: Some([0x5a; 32]) }),
        (
            "ucxready",
            Body::UcxReady {
                addr: vec![0x22; 170],
                regions: vec![
                    UcxRegion { id: 1, base: 0x7f00_0000_0000, len: MIB, rkey: vec![0x33; 48] },
                    UcxRegion { id: 2, base: 0x7f00_1000_0000, len: 64 * MIB, rkey: vec![0x44; 48] },
                ],
                features: 1,
                mac: Some([0x5b; 32]),
            },
        ),
        ("ucxrkeys", Body::UcxRkeys(vec![3, 4])),
        (
            "ipcreq",
            Body::IpcReq { host: [0x42; 16], watch: [0x43; 16], regions: vec![(1, RegionKey([0x55; 16])), (2, RegionKey([0x66; 16]))] },
        ),
        (
            "ipchandles",
            Body::IpcHandles(vec![IpcEntry {
                region: 1,
                device: 0,
                uuid: [0x88; 16],
                handle: [0x77; 64],
                offset: 1 << 20,
                alloc_len: 2 << 20,
            }]),
        ),
        (
            "hello_ipcwatch",
            Body::Hello {
                version: multirail_proto::codec::HELLO_VERSION,
                role: Role::IpcWatch,
                incarnation: 5,
                name: "prefill-0".into(),
                nonce: [9; 16],
            },
        ),
        ("ipcrevoke", Body::IpcRevoke(vec![1, 2, 0x7fff_ffff_ffff])),
        ("ipcreleased", Body::IpcReleased(vec![1, 2, 0x7fff_ffff_ffff])),
    ];
    let metas: Vec<(&str, Vec<u8>)> = vec![
        ("agent", sample_meta().encode()),
        ("agent_empty", AgentMeta { name: String::new(), incarnation: 0, rails: vec![], regions: vec![] }.encode()),
        ("descs", DescList { mem: MemType::Dram, descs: vec![(4096, 100, 0), (1 << 40, MIB, 3)] }.encode()),
        ("descs_vram", DescList { mem: MemType::Vram, descs: vec![(0x7f00_0000_0000, 64 * MIB, 1)] }.encode()),
    ];
    // ucx active messages: [header length][header][data] (fuzz/fuzz_targets/ucx_am.rs).
    let am_seed = |write: bool, op: VecOp| {
        let am = multirail_proto::codec::UcxAm { token: 0x1234, write, op, secret: [0x5c; 16] };
        let (h, mut d) = am.encode().expect("fits");
        if write {
            d.resize(d.len() + am.op.total() as usize, 0x77);
        }
        let mut v = vec![h.len() as u8];
        v.extend_from_slice(&h);
        v.extend_from_slice(&d);
        v
    };
    let am_op = VecOp {
        region: 3,
        key: RegionKey([0; 16]),
        pieces: vec![VecPiece { offset: 8192, len: 64, count: 1, stride: 0 }, VecPiece { offset: 0, len: 16, count: 4, stride: 4096 }],
    };
    let ams: Vec<(&str, Vec<u8>)> = vec![
        ("am_read", am_seed(false, am_op.clone())),
        ("am_write", am_seed(true, am_op)),
        ("am_reply", {
            let mut v = vec![multirail_proto::codec::UCX_AM_REPLY_HEADER as u8];
            v.extend_from_slice(&multirail_proto::codec::encode_ucx_am_reply(0x1234, Status::OutOfBounds, &[0x5c; 16]));
            v
        }),
    ];
    for (dir, items) in
        [("frame", frames.into_iter().map(|(n, b)| (n, b.encode(42))).collect::<Vec<_>>()), ("metadata", metas), ("ucx_am", ams)]
    {
        let d = root.join(dir);
        std::fs::create_dir_all(&d).expect("create corpus dir");
        for (n, bytes) in items {
            std::fs::write(d.join(format!("{n}.bin")), &bytes).expect("write seed");
            // Truncated copies: inside the header / fixed fields, and one byte short.
            for cut in [bytes.len() / 3, bytes.len().saturating_sub(1)] {
                if cut > 0 {
                    std::fs::write(d.join(format!("{n}.cut{cut}.bin")), &bytes[..cut]).expect("write seed");
                }
            }
        }
    }
}

fn sample_meta() -> AgentMeta {
    AgentMeta {
        name: "decode-3".into(),
        incarnation: 0xdead_beef,
        rails: vec![
            RailInfo {
                name: "eth1".into(),
                addr: "10.0.1.2".into(),
                prefix_len: 24,
                port: 5555,
                speed_mbps: 100_000,
                mtu: 9000,
                numa: 0,
                rdma_dev: "mlx5_0".into(),
            },
            RailInfo {
                name: "eth2".into(),
                addr: "fd00:2::2".into(),
                prefix_len: 64,
                port: 5556,
                speed_mbps: 0,
                mtu: 1500,
                numa: -1,
                rdma_dev: String::new(),
            },
        ],
        regions: vec![RegionMeta {
            id: 1,
            base: 0x7f00_0000_0000,
            len: 1 << 30,
            dev: 0,
            mem: MemType::Dram,
            access: Access::ReadWrite,
            key: RegionKey([7; 16]),
        }],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A ucx active-message request round-trips (header, descriptor and a WRITE's bytes), and
    /// any mutation of its header or data decodes to an error or to a request whose payload is
    /// exactly its pieces' bytes: never a panic, never a payload that disagrees with the list.
    #[test]
    fn ucx_am_roundtrip_and_mutations(
        op in vec_op(),
        token in any::<u64>(),
        write in any::<bool>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        use multirail_proto::codec::UcxAm;
        // Small pieces (the strides stay >= the lengths): a WRITE's bytes stay small.
        let op = VecOp { pieces: op.pieces.into_iter().map(|p| VecPiece { len: p.len % 512 + 1, ..p }).collect(), ..op };
        let am = UcxAm { token, write, op, secret: [0x5d; 16] };
        let (h, desc) = am.encode().expect("fits");
        let mut data = desc.clone();
        if write {
            data.resize(desc.len() + am.op.total() as usize, 0x5a);
        }
        let (back, payload) = UcxAm::decode(&h, &data).expect("a valid request decodes");
        prop_assert_eq!(&back, &am);
        prop_assert_eq!(payload.len() as u64, if write { am.op.total() } else { 0 });
        let (mut h2, mut d2) = (h.to_vec(), data.clone());
        for (i, b) in &flips {
            if i.index(2) == 0 {
                let k = i.index(h2.len());
                h2[k] ^= b | 1;
            } else if !d2.is_empty() {
                let k = i.index(d2.len());
                d2[k] ^= b | 1;
            }
        }
        if let Some(c) = cut {
            d2.truncate(c.index(d2.len() + 1));
        }
        if let Ok((m, p)) = UcxAm::decode(&h2, &d2) {
            prop_assert_eq!(p.len() as u64, if m.write { m.op.total() } else { 0 });
            prop_assert!(m.op.pieces.iter().all(|q| q.len > 0 && q.count > 0 && q.end().is_some()));
        }
    }

    /// Arbitrary bytes as a request or a reply header never panic the decoders.
    #[test]
    fn ucx_am_arbitrary_bytes(h in prop::collection::vec(any::<u8>(), 0..40), d in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = multirail_proto::codec::UcxAm::decode(&h, &d);
        let _ = multirail_proto::codec::decode_ucx_am_reply(&h);
    }
}
