//! Failure detection under contention (issue 22 item 3), in the deterministic simulator.
//!
//! A rail shared by many peers serves each one slowly: this planner's chunks take up to
//! seconds each. A rail is stalled only when it makes no progress: no chunk completed and,
//! with `byte_progress` (the tcp runtime), no bytes moved, for `stall_timeout`; without byte
//! evidence (ucx) for at least 4 head-chunk times at the rail's measured rate. A rail whose
//! own host holds its packets back (TCP retrying a full local queue on a backing-off timer,
//! every byte it sent acknowledged) gets `held_timeout`. A dead rail is still declared down
//! within about a second.

mod simnet;

use std::time::Duration;

use multirail_proto::{Event, PlannerConfig, XferId};
use simnet::{gbit, ms, RailSpec, Report, Sim, XferSpec, XorShift};

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// `n` WRITEs of 4 MiB back to back (as one of many initiators of a fan-in does).
fn back_to_back(sim: &mut Sim, n: u64, block: u64) {
    sim.submit(XferSpec::contiguous(1, Duration::ZERO, block));
    for i in 2..=n {
        sim.submit_after(XferSpec::contiguous(i, Duration::ZERO, block), XferId(i - 1), ms(0.1));
    }
}

fn stalls(rep: &Report) -> u64 {
    rep.stats.iter().map(|s| s.stalls + s.times_down).sum()
}

fn down_at(rep: &Report, rail: usize) -> Option<(Duration, String)> {
    rep.events.iter().find_map(|(t, e)| match e {
        Event::RailDown { rail: r, reason } if *r == rail => Some((*t, reason.clone())),
        _ => None,
    })
}

/// 2 x 2 Gbit/s rails, each shared fairly with `peers` flows: this planner gets 1/peers of
/// each, with 10% jitter, and knows only the link speed (its hint).
fn shared(peers: u32) -> Vec<RailSpec> {
    (0..2).map(|_| RailSpec::steady(gbit(2.0) / peers as f64).hint(Some(gbit(2.0))).jitter(0.1)).collect()
}

/// Many peers, any chunk size: no stall is ever declared, every transfer completes.
#[test]
fn a_slow_fair_share_is_never_a_stall() {
    for peers in [8u32, 32, 128, 512] {
        for chunk in [256 * KIB, MIB, 4 * MIB, 16 * MIB] {
            // tcp: byte-level evidence, a link-speed hint that says nothing of the sharing.
            let cfg = PlannerConfig { chunk_size: chunk, byte_progress: true, ..PlannerConfig::default() };
            let mut sim = Sim::new(cfg, shared(peers), peers as u64);
            back_to_back(&mut sim, 4, 4 * MIB);
            let rep = sim.run();
            assert_eq!(stalls(&rep), 0, "tcp, {peers} peers, chunk {chunk}: {:?}", rep.events);
            assert!((1..=4).all(|i| rep.done_at(XferId(i)).is_some()));

            // ucx: chunk completions only. The rate it knows is its share (measured by earlier
            // transfers): the deadline stretches with the head chunk's service time.
            let cfg = PlannerConfig { chunk_size: chunk, byte_progress: false, ..PlannerConfig::default() };
            let rails: Vec<RailSpec> = shared(peers).into_iter().map(|r| r.hint(Some(gbit(2.0) / peers as f64))).collect();
            let mut sim = Sim::new(cfg, rails, peers as u64);
            back_to_back(&mut sim, 4, 4 * MIB);
            let rep = sim.run();
            assert_eq!(stalls(&rep), 0, "ucx, {peers} peers, chunk {chunk}: {:?}", rep.events);
        }
    }
}

/// The fan-in on the testbed (32 initiators into one target over 2 x 2 Gbit/s): the
/// initiators' shared egress queue drops their packets, and each connection, every byte it
/// sent acknowledged, retries on TCP's backing-off timer: 0.2, 0.6, 1.4 s of silence.
fn held_rails(seed: u64, peers: u32) -> Vec<RailSpec> {
    let mut rng = XorShift::new(seed);
    (0..2)
        .map(|_| {
            let mut r = RailSpec::steady(gbit(2.0) / peers as f64).hint(Some(gbit(2.0))).jitter(0.1);
            let mut t = 0.05 + 0.2 * rng.unit();
            while t < 6.0 {
                let len = [0.2, 0.6, 1.4][(rng.unit() * 3.0) as usize % 3];
                r = r.held(Duration::from_secs_f64(t), Duration::from_secs_f64(t + len));
                t += len + 0.1 + 0.5 * rng.unit();
            }
            r
        })
        .collect()
}

/// Held back on this host is not stalled: zero stalls (the old rule, which took the silence
/// for a dead path, counts them on the same runs).
#[test]
fn held_back_on_this_host_is_not_a_stall() {
    let mut old_rule = 0;
    for seed in 1..=10 {
        let cfg = PlannerConfig { byte_progress: true, ..PlannerConfig::default() };
        let mut sim = Sim::new(cfg.clone(), held_rails(seed, 32), seed);
        back_to_back(&mut sim, 12, 4 * MIB);
        let rep = sim.run();
        assert_eq!(stalls(&rep), 0, "seed {seed}: {:?}", rep.events);
        assert!((1..=12).all(|i| rep.done_at(XferId(i)).is_some()));

        // Holds not taken into account (held_timeout no longer than stall_timeout).
        let old = PlannerConfig { held_timeout: cfg.stall_timeout, ..cfg };
        let mut sim = Sim::new(old, held_rails(seed, 32), seed);
        back_to_back(&mut sim, 12, 4 * MIB);
        old_rule += stalls(&sim.run());
    }
    assert!(old_rule > 0, "the scenario must reproduce the false stalls of the old rule");
}

/// A dead rail (silent, nothing held) is declared down within about a second however many
/// peers share it, and the work moves to the other rail.
#[test]
fn a_dead_rail_is_detected_within_a_second_under_contention() {
    for peers in [1u32, 8, 32, 128, 512] {
        for byte_progress in [true, false] {
            if !byte_progress && peers > 32 {
                // Without byte evidence the deadline is 4 head-chunk times at the rate: 2.1 s
                // for a 1 MiB chunk at 1/128 of 2 Gbit/s. Checked below for 32 peers.
                continue;
            }
            let dies = ms(700.0);
            // Both rails in use when rail 1 dies (an idle rail has nothing to be late with).
            let mut rails: Vec<RailSpec> = shared(peers).into_iter().map(|r| r.hint(Some(gbit(2.0) / peers as f64))).collect();
            rails[1] = rails[1].clone().rate_at(dies, 0.0);
            let cfg = PlannerConfig { byte_progress, ..PlannerConfig::default() };
            let mut sim = Sim::new(cfg, rails, 7);
            // Enough transfers to keep both rails busy for about 2 s.
            let n = ((2.0 * 2.0 * gbit(2.0) / peers as f64) / (4 * MIB) as f64).ceil().max(2.0) as u64;
            back_to_back(&mut sim, n, 4 * MIB);
            let rep = sim.run();
            let (t, reason) = down_at(&rep, 1).unwrap_or_else(|| panic!("{peers} peers: rail 1 never declared down"));
            assert!(reason.contains("stalled"), "{reason}");
            assert!(t > dies && t - dies <= ms(1000.0), "{peers} peers, bytes {byte_progress}: down {:?} after it died", t - dies);
            assert_eq!(rep.stats[0].stalls, 0);
            assert!(rep.events.iter().all(|(_, e)| !matches!(e, Event::XferFailed { .. })));
        }
    }
}

/// A rail that dies while held is declared down once the hold evidence stops (within
/// `stall_timeout` of it), and one held for ever is declared down after `held_timeout`.
#[test]
fn a_hold_does_not_hide_a_dead_rail_for_long() {
    let cfg = PlannerConfig { byte_progress: true, ..PlannerConfig::default() };
    // Held 0.3-0.9 s, dead (silent) from 0.9 s on.
    let mut rails = shared(32);
    rails[1] = rails[1].clone().held(ms(300.0), ms(900.0)).rate_at(ms(900.0), 0.0);
    let mut sim = Sim::new(cfg.clone(), rails, 3);
    back_to_back(&mut sim, 8, 4 * MIB);
    let rep = sim.run();
    let (t, _) = down_at(&rep, 1).expect("declared down");
    assert!(t > ms(900.0) && t <= ms(900.0) + cfg.stall_timeout + ms(10.0), "down at {t:?}");

    // Held for ever from 0.3 s: given `held_timeout` since its last progress, then down.
    let mut rails = shared(32);
    rails[1] = rails[1].clone().held(ms(300.0), Duration::from_secs(20));
    let mut sim = Sim::new(cfg.clone(), rails, 3);
    back_to_back(&mut sim, 30, 4 * MIB);
    let rep = sim.run();
    let (t, reason) = down_at(&rep, 1).expect("declared down");
    assert!(reason.contains("held"), "{reason}");
    assert!(t >= cfg.held_timeout && t <= ms(300.0) + cfg.held_timeout + ms(10.0), "down at {t:?}");
}
