//! Planner scenarios in the deterministic rail simulator (see `simnet/mod.rs` for the model).
//!
//! Each scenario runs transfers over simulated rails and compares the finishing time with the
//! ideal: total bytes over the summed rates (integrated over rate changes and outages). The
//! throughput table is printed (`cargo test -p multirail-proto --test sim -- --nocapture`)
//! and asserted on, so a striping regression fails here rather than on a testbed.
//!
//! The convergence tests (`uneven_rails_*`) run back-to-back 64 MiB transfers over uneven rails
//! from wrong seeds, a cold start and noise, and check the rate estimates and the throughput
//! once the first 100 MiB are through.

mod simnet;

use std::time::Duration;

use multirail_proto::{Event, PlannerConfig, Policy, XferId};
use simnet::{gbit, ideal_finish, ms, table, Outcome, RailSpec, Report, Row, Sim, XferSpec};

const MIB: u64 = 1 << 20;

fn cfg(policy: Policy) -> PlannerConfig {
    PlannerConfig { policy, ..PlannerConfig::default() }
}

fn weighted() -> PlannerConfig {
    cfg(Policy::Weighted)
}

/// Run one transfer of `bytes` submitted at 0 and summarise it as a table row.
fn one_transfer(name: &str, cfg: PlannerConfig, rails: Vec<RailSpec>, bytes: u64, seed: u64) -> (Row, Report) {
    let chunk = cfg.chunk_size;
    let mut sim = Sim::new(cfg, rails.clone(), seed);
    sim.submit(XferSpec::contiguous(1, Duration::ZERO, bytes));
    let rep = sim.run();
    let done = rep.done_at(XferId(1)).unwrap_or_else(|| panic!("{name}: transfer did not complete: {:?}", rep.events));
    let last: Vec<Duration> = rep.last_done_per_rail(XferId(1), rails.len()).into_iter().flatten().collect();
    let spread = last.iter().max().copied().unwrap_or_default() - last.iter().min().copied().unwrap_or_default();
    let slowest = rails.iter().map(|r| r.rate(done)).filter(|r| *r > 0.0).fold(f64::INFINITY, f64::min);
    let row = Row {
        scenario: name.to_string(),
        ideal: ideal_finish(&rails, Duration::ZERO, bytes),
        achieved: done,
        tail_chunks: spread.as_secs_f64() / (chunk as f64 / slowest),
    };
    (row, rep)
}

/// A table row with its acceptance bounds.
struct Case {
    row: Row,
    rep: Report,
    /// Efficiency must fall in `[min, max]`.
    eff: (f64, f64),
    /// Rails' last completions must lie within this many chunk times of each other.
    max_tail: Option<f64>,
}

fn case(name: &str, cfg: PlannerConfig, rails: Vec<RailSpec>, eff: (f64, f64), max_tail: Option<f64>) -> Case {
    sized_case(name, cfg, rails, 64 * MIB, eff, max_tail)
}

fn sized_case(name: &str, cfg: PlannerConfig, rails: Vec<RailSpec>, bytes: u64, eff: (f64, f64), max_tail: Option<f64>) -> Case {
    let (row, rep) = one_transfer(name, cfg, rails, bytes, 1);
    Case { row, rep, eff, max_tail }
}

fn steady(gbits: &[f64]) -> Vec<RailSpec> {
    gbits.iter().map(|g| RailSpec::steady(gbit(*g))).collect()
}

/// The main table: 64 MiB transfers; the targets are the first three rows.
#[test]
fn throughput_table() {
    let any = 1.01;
    let cases = vec![
        case("2 x 2 Gbit/s, weighted", weighted(), steady(&[2.0, 2.0]), (0.97, any), Some(1.0)),
        case("4 x 2 Gbit/s, weighted", weighted(), steady(&[2.0; 4]), (0.96, any), Some(1.0)),
        case("2 + 1 Gbit/s, weighted", weighted(), steady(&[2.0, 1.0]), (0.95, any), Some(1.0)),
        case("2 + 1 Gbit/s, round-robin", cfg(Policy::RoundRobin), steady(&[2.0, 1.0]), (0.62, 0.72), None),
        case("2 + 1 Gbit/s, pinned to rail 0", cfg(Policy::Pinned(0)), steady(&[2.0, 1.0]), (0.65, 0.68), None),
        case(
            "2 + 1 Gbit/s, no speed hints (EWMA)",
            weighted(),
            steady(&[2.0, 1.0]).into_iter().map(|r| r.hint(None)).collect(),
            (0.95, any),
            Some(1.0),
        ),
        case("4 + 2 + 1 + 1 Gbit/s, weighted", weighted(), steady(&[4.0, 2.0, 1.0, 1.0]), (0.95, any), Some(1.0)),
        case(
            "2 x 2 Gbit/s, rail 1 halves at 40 ms",
            weighted(),
            vec![RailSpec::steady(gbit(2.0)), RailSpec::steady(gbit(2.0)).rate_at(ms(40.0), gbit(1.0))],
            (0.95, any),
            Some(1.0),
        ),
        case(
            "2 x 2 Gbit/s, rail 1 doubles at 40 ms",
            weighted(),
            vec![RailSpec::steady(gbit(2.0)), RailSpec::steady(gbit(2.0)).rate_at(ms(40.0), gbit(4.0))],
            (0.95, any),
            Some(1.0),
        ),
        case(
            "2 x 2 Gbit/s, rail 0 down 30-80 ms",
            weighted(),
            vec![RailSpec::steady(gbit(2.0)).outage(ms(30.0), Some(ms(80.0))), RailSpec::steady(gbit(2.0))],
            (0.93, any),
            Some(1.0),
        ),
        case(
            "2 x 2 Gbit/s, rail 1 stalls 30-200 ms",
            PlannerConfig { stall_timeout: ms(20.0), ..weighted() },
            vec![RailSpec::steady(gbit(2.0)), RailSpec::steady(gbit(2.0)).rate_at(ms(30.0), 0.0).rate_at(ms(200.0), gbit(2.0))],
            (0.90, any),
            None,
        ),
        // 256 MiB: the first round trip (10 ms) alone is 4% of the ideal.
        sized_case(
            "2 x 4 Gbit/s, 5 ms one-way, 256 MiB",
            weighted(),
            (0..2).map(|_| RailSpec::steady(gbit(4.0)).latency(ms(5.0))).collect(),
            256 * MIB,
            (0.92, any),
            Some(1.0),
        ),
        case(
            "2 x 100 Gbit/s, 5 us",
            weighted(),
            (0..2).map(|_| RailSpec::steady(gbit(100.0)).latency(Duration::from_micros(5))).collect(),
            (0.95, any),
            Some(1.0),
        ),
    ];
    let rows: Vec<Row> = cases.iter().map(|c| c.row.clone()).collect();
    println!("{}", table(&rows));
    let mut bad = Vec::new();
    for c in &cases {
        let e = c.row.efficiency();
        if e < c.eff.0 || e > c.eff.1 {
            bad.push(format!("{}: efficiency {:.3} outside {:?}", c.row.scenario, e, c.eff));
        }
        if c.max_tail.is_some_and(|m| c.row.tail_chunks > m) {
            bad.push(format!("{}: rails finished {:.2} chunk times apart", c.row.scenario, c.row.tail_chunks));
        }
        assert_eq!(simnet::totals(&c.rep.stats)["inflight_bytes"], 0, "{}", c.row.scenario);
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Jitter (30% per chunk, i.i.d.): the realised service time of each run differs from the
/// nominal rate, so the table averages over seeds, and the planner's own share of the loss is
/// checked directly: every rail must have been serialising for most of the transfer. The slow
/// rail's committed window (4 chunks) and its noisy rate estimate are what remains.
#[test]
fn jittery_rails_stay_busy_and_balanced() {
    let rails = vec![
        RailSpec::steady(gbit(2.0)).jitter(0.3),
        RailSpec::steady(gbit(2.0)).jitter(0.3).latency(Duration::from_micros(250)),
        RailSpec::steady(gbit(1.0)).jitter(0.3).latency(Duration::from_micros(100)),
    ];
    let mut effs = Vec::new();
    for seed in 1..=8 {
        let (row, rep) = one_transfer("jitter", weighted(), rails.clone(), 64 * MIB, seed);
        for (i, busy) in rep.serving.iter().enumerate() {
            let u = busy.as_secs_f64() / row.achieved.as_secs_f64();
            assert!(u >= 0.88, "seed {seed}: rail {i} busy only {:.1}% of the transfer", u * 100.0);
        }
        assert!(row.tail_chunks <= 1.5, "seed {seed}: rails finished {:.2} chunk times apart", row.tail_chunks);
        effs.push(row.efficiency());
    }
    let mean = effs.iter().sum::<f64>() / effs.len() as f64;
    let ideal = ideal_finish(&rails, Duration::ZERO, 64 * MIB);
    let row = Row {
        scenario: "2 + 2 + 1 Gbit/s, jitter 30%, mean of 8 seeds".into(),
        ideal,
        achieved: ideal.div_f64(mean),
        tail_chunks: f64::NAN,
    };
    println!("{}", table(&[row]));
    assert!(mean >= 0.94, "mean efficiency {mean:.3} over seeds: {effs:?}");
}

/// Transfers below `stripe_threshold` use one rail, finish in one chunk time on idle rails, and
/// do not wait behind a large transfer's unassigned chunks.
#[test]
fn small_transfers_stay_on_one_rail_and_skip_the_queue() {
    let rails = steady(&[2.0, 2.0]);
    let c = weighted();
    let (window, threshold) = (c.min_window, c.stripe_threshold);
    let mut sim = Sim::new(c, rails.clone(), 1);
    let small = |i: u64| 4096 + (i * 37_000) % (threshold - 4096);
    // Idle rails: ten small transfers, one every 2 ms.
    for i in 0..10 {
        sim.submit(XferSpec::contiguous(100 + i, ms(2.0 * i as f64), small(i)));
    }
    // A 64 MiB transfer at 30 ms, and ten small ones while it runs.
    sim.submit(XferSpec::contiguous(1, ms(30.0), 64 * MIB));
    for i in 0..10 {
        sim.submit(XferSpec::contiguous(200 + i, ms(40.0 + 5.0 * i as f64), small(i)));
    }
    let rep = sim.run();
    let rate = gbit(2.0);
    let rtt = 2 * rails[0].latency;
    for i in 0..10 {
        for (x, at, bound) in [
            // Alone: its own service time and one round trip.
            (100 + i, ms(2.0 * i as f64), Duration::from_secs_f64(small(i) as f64 / rate) + rtt),
            // Behind at most one full window on its rail.
            (200 + i, ms(40.0 + 5.0 * i as f64), Duration::from_secs_f64((small(i) + window) as f64 / rate) + rtt),
        ] {
            let rails_used: std::collections::BTreeSet<usize> = rep.done_chunks(XferId(x)).map(|c| c.chunk.rail).collect();
            assert_eq!(rails_used.len(), 1, "small transfer {x} used rails {rails_used:?}");
            let took = rep.done_at(XferId(x)).expect("small transfer done") - at;
            assert!(took <= bound + Duration::from_micros(1), "transfer {x} took {took:?} > {bound:?}");
        }
    }
    let (row, _) = one_transfer("", weighted(), rails.clone(), 64 * MIB, 1);
    let big = rep.done_at(XferId(1)).expect("large transfer done") - ms(30.0);
    // The small ones (1 MiB in all) cost the large one about their own service time only.
    assert!(big.as_secs_f64() <= row.achieved.as_secs_f64() * 1.03, "large transfer took {big:?}");
}

/// A rail whose rate changes mid-run is re-weighted: its estimate follows the new rate and its
/// share of the bytes shrinks or grows accordingly.
#[test]
fn changed_rate_is_reweighted() {
    for (new, name) in [(1.0, "halves"), (4.0, "doubles")] {
        let rails = vec![RailSpec::steady(gbit(2.0)), RailSpec::steady(gbit(2.0)).rate_at(ms(40.0), gbit(new))];
        let (row, rep) = one_transfer(name, weighted(), rails, 256 * MIB, 1);
        let est = rep.stats[1].rate;
        assert!((est / gbit(new) - 1.0).abs() < 0.05, "rail 1 {name}: estimate {:.0} Mbit/s", est * 8e-6);
        assert!(row.efficiency() >= 0.97, "rail 1 {name}: efficiency {:.3}", row.efficiency());
        let b = rep.bytes_per_rail(XferId(1), 2);
        let (r0, r1) = (b[0] as f64, b[1] as f64);
        assert!(if new < 2.0 { r1 < r0 } else { r1 > r0 }, "rail 1 {name}: bytes {b:?}");
    }
}

/// Several transfers at once share the rails and all finish near the ideal for their sum.
#[test]
fn concurrent_transfers_share_the_rails() {
    let rails = steady(&[2.0, 1.0]);
    let mut sim = Sim::new(weighted(), rails.clone(), 1);
    for i in 0..8 {
        sim.submit(XferSpec::contiguous(i + 1, Duration::ZERO, 8 * MIB + i * 12_345));
    }
    let total: u64 = (0..8).map(|i| 8 * MIB + i * 12_345).sum();
    let rep = sim.run();
    let last = (1..=8).map(|i| rep.done_at(XferId(i)).expect("all done")).max().expect("eight");
    let eff = ideal_finish(&rails, Duration::ZERO, total).as_secs_f64() / last.as_secs_f64();
    assert!(eff >= 0.95, "8 concurrent transfers: efficiency {eff:.3}");
    // FIFO: the first transfer is not starved by later ones.
    assert!(rep.done_at(XferId(1)) <= rep.done_at(XferId(8)));
}

/// A rail that stops completing without an error is declared down by the stall timeout, its
/// chunks move to the other rail, and it is used again after it comes back.
#[test]
fn stalled_rail_is_detected_and_work_moves() {
    let rails = vec![RailSpec::steady(gbit(2.0)), RailSpec::steady(gbit(2.0)).rate_at(ms(30.0), 0.0).rate_at(ms(60.0), gbit(2.0))];
    // The tcp runtime's evidence: bytes moving on a rail count as progress.
    let mut sim = Sim::new(PlannerConfig { stall_timeout: ms(10.0), byte_progress: true, ..weighted() }, rails, 1);
    sim.submit(XferSpec::contiguous(1, Duration::ZERO, 64 * MIB));
    let rep = sim.run();
    let down = rep.events.iter().find_map(|(t, e)| match e {
        Event::RailDown { rail: 1, reason } => Some((*t, reason.clone())),
        _ => None,
    });
    let (t_down, reason) = down.expect("rail 1 declared down");
    assert!(reason.contains("stalled"), "{reason}");
    // The last completion before the stall was at most a chunk time before 30 ms.
    assert!(t_down >= ms(35.0) && t_down <= ms(41.0), "declared down at {t_down:?}");
    assert!(rep.events.iter().any(|(t, e)| *e == Event::RailUp(1) && *t == ms(60.0)));
    assert!(rep.stats[0].chunks_reissued > 0, "lost chunks were reissued on rail 0");
    assert!(rep.chunks.iter().any(|c| c.chunk.rail == 1 && c.issued > ms(60.0)), "rail 1 used again");
    assert!(rep.chunks.iter().any(|c| matches!(c.outcome, Outcome::Lost(_))));
    assert!(rep.done_at(XferId(1)).is_some());
}

/// With every rail down the transfer fails and says why for each rail.
#[test]
fn all_rails_down_fails_the_transfer() {
    let rails = vec![RailSpec::steady(gbit(2.0)).outage(ms(10.0), None), RailSpec::steady(gbit(2.0)).outage(ms(20.0), Some(ms(50.0)))];
    let mut sim = Sim::new(weighted(), rails, 1);
    sim.submit(XferSpec::contiguous(1, Duration::ZERO, 64 * MIB));
    // Submitted while no rail is up: fails at once.
    sim.submit(XferSpec::contiguous(2, ms(30.0), MIB));
    // Submitted after rail 1 is back: completes.
    sim.submit(XferSpec::contiguous(3, ms(60.0), 8 * MIB));
    let rep = sim.run();
    let reason = rep.failed(XferId(1)).expect("transfer 1 failed");
    assert!(reason.contains("rail 0: sim: link error") && reason.contains("rail 1: sim: link error"), "{reason}");
    assert!(rep.failed(XferId(2)).is_some());
    assert!(rep.done_at(XferId(3)).is_some());
    assert!(rep.done_at(XferId(1)).is_none());
}

/// The same seed gives the same run, chunk for chunk.
#[test]
fn runs_are_deterministic() {
    let run = || {
        let rails = vec![RailSpec::steady(gbit(2.0)).jitter(0.2), RailSpec::steady(gbit(1.0)).jitter(0.2).outage(ms(20.0), Some(ms(40.0)))];
        let mut sim = Sim::new(weighted(), rails, 42);
        sim.submit(XferSpec::contiguous(1, Duration::ZERO, 16 * MIB));
        sim.submit(XferSpec::contiguous(2, ms(5.0), 100_000));
        sim.run()
    };
    let (a, b) = (run(), run());
    assert_eq!(a.chunks, b.chunks);
    assert_eq!(a.events, b.events);
}

// ---------------------------------------------------------------------------------------------
// Convergence from any start (issue #12 point 4: on 2 + 1 Gbit/s one run in four reached 91.5%,
// and the split was once 1.62:1 after six 64 MiB READs).

/// How the planner's rate estimates start out, and how the rails come up.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Start {
    /// Hints are the true rates.
    Exact,
    /// Every hint is the mean of the true rates (every link reports the same speed).
    Equal,
    /// No hints: `default_rate` (10 Gbit/s, what a veth reports) for every rail.
    Unknown,
    /// Hints in reverse order: the slowest rail is seeded as the fastest and so on.
    Inverted,
    /// Hints a tenth of the true rates.
    Low,
    /// Hints ten times the true rates.
    High,
    /// Equal hints; rail 0 starts alone and the others connect 20 ms later, every rail in
    /// TCP-like slow start (from 1/32 of its rate, doubling every 2 ms): the first samples are
    /// taken while the other rails are cold or ramping.
    Cold,
    /// Equal hints and 10% per-chunk jitter.
    Noisy,
    /// A noisy host: equal hints, 25% per-chunk jitter and 2% of chunks held 5 ms longer.
    NoisyHost,
    /// Exact hints; 10% of completions reach the planner up to 6 ms late while the pipe goes
    /// on (reports in order per rail): UCX's put acknowledgements handled late on a busy host.
    LateReports,
}

const STARTS: [Start; 8] =
    [Start::Exact, Start::Equal, Start::Unknown, Start::Inverted, Start::Low, Start::High, Start::Cold, Start::Noisy];

/// Uneven rail sets, in Gbit/s: the 2 + 1 both ways round, 4 + 1 and three rails.
const UNEVEN: [&[f64]; 5] = [&[2.0, 1.0], &[1.0, 2.0], &[4.0, 1.0], &[4.0, 2.0, 1.0], &[2.0, 1.0, 0.5]];

/// Rails of the given rates (5% jitter on every chunk) seeded and started as `start` says.
fn started_rails(gbits: &[f64], start: Start, latency: Duration) -> Vec<RailSpec> {
    let mean = gbits.iter().sum::<f64>() / gbits.len() as f64;
    let mut sorted = gbits.to_vec();
    sorted.sort_by(f64::total_cmp);
    gbits
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            let r = RailSpec::steady(gbit(g)).jitter(0.05).latency(latency);
            match start {
                Start::Exact => r,
                Start::Equal => r.hint(Some(gbit(mean))),
                Start::Unknown => r.hint(None),
                Start::Inverted => {
                    let rank = gbits.iter().filter(|&&x| x < g).count();
                    r.hint(Some(gbit(sorted[sorted.len() - 1 - rank])))
                }
                Start::Low => r.hint(Some(gbit(g / 10.0))),
                Start::High => r.hint(Some(gbit(g * 10.0))),
                Start::Cold => {
                    let r = r.hint(Some(gbit(mean))).slow_start(ms(2.0), 5, ms(200.0));
                    if i == 0 {
                        r
                    } else {
                        r.start_at(ms(20.0))
                    }
                }
                Start::Noisy => r.hint(Some(gbit(mean))).jitter(0.10),
                Start::NoisyHost => r.hint(Some(gbit(mean))).jitter(0.25).hiccups(0.02, ms(5.0)),
                Start::LateReports => r.late_reports(LATE.0, ms(LATE.1)),
            }
        })
        .collect()
}

/// What a run of back-to-back 64 MiB transfers showed after its first `WARMUP` bytes.
#[derive(Debug, Clone)]
struct Converged {
    /// Largest relative error of a rail's weight (its share of the summed estimates against
    /// its share of the summed true rates) at any completion after the warm-up.
    weight_err: f64,
    /// Mean relative error of each rail's weight over the completions after the warm-up.
    weight_bias: Vec<f64>,
    /// Efficiency of each transfer submitted after the warm-up.
    effs: Vec<f64>,
}

const WARMUP: u64 = 100 * MIB;

/// `n` transfers of 64 MiB, each submitted 1 ms after the previous one ends (a caller that
/// waits for each READ before the next).
///
/// The true rate of a rail is what it delivered over the whole run (bytes over the time its
/// chunks held it, so jitter and hiccups count). A transfer's efficiency is against the
/// capacity the rails really had while carrying it, plus the first round trip, which no
/// planner can avoid.
fn back_to_back(cfg: PlannerConfig, rails: &[RailSpec], n: u64, seed: u64) -> Converged {
    let size = 64 * MIB;
    let mut sim = Sim::new(cfg, rails.to_vec(), seed);
    sim.submit(XferSpec::contiguous(1, Duration::ZERO, size));
    for i in 2..=n {
        sim.submit_after(XferSpec::contiguous(i, Duration::ZERO, size), XferId(i - 1), ms(1.0));
    }
    let rep = sim.run();
    let truth: Vec<f64> = (0..rails.len())
        .map(|r| {
            let done = rep.chunks.iter().filter(|c| c.chunk.rail == r && matches!(c.outcome, Outcome::Done(_)));
            let (b, t) = done.fold((0, Duration::ZERO), |a, c| (a.0 + c.chunk.piece.len, a.1 + c.served));
            b as f64 / t.as_secs_f64()
        })
        .collect();
    let total: f64 = truth.iter().sum();
    let mut weight_err: f64 = 0.0;
    // The mean (signed) error of each rail's weight over the completions after the warm-up:
    // a bias, where `weight_err` is the worst moment.
    let after: Vec<_> = rep.trace.iter().filter(|s| s.bytes_done >= WARMUP).collect();
    let mut weight_bias = vec![0.0; rails.len()];
    for s in &after {
        let sum: f64 = s.rates.iter().sum();
        for (b, (r, t)) in weight_bias.iter_mut().zip(s.rates.iter().zip(&truth)) {
            *b += ((r / sum) / (t / total) - 1.0) / after.len() as f64;
        }
    }
    for s in rep.trace.iter().filter(|s| s.bytes_done >= WARMUP) {
        let sum: f64 = s.rates.iter().sum();
        for (r, t) in s.rates.iter().zip(&truth) {
            weight_err = weight_err.max(((r / sum) / (t / total) - 1.0).abs());
        }
    }
    let warm_at = rep.trace.iter().find(|s| s.bytes_done >= WARMUP).expect("warm-up reached").at;
    let rtt = 2 * rails.iter().map(|r| r.latency).min().unwrap_or_default();
    let mut effs = Vec::new();
    for i in 1..=n {
        let x = XferId(i);
        let at = rep.submitted_at(x).expect("submitted");
        if at < warm_at {
            continue;
        }
        let took = rep.done_at(x).expect("done") - at;
        let cap: f64 = rep.realised_rates(x, rails.len()).iter().zip(rails).map(|(r, s)| r.unwrap_or(s.rate(at))).sum();
        effs.push((size as f64 / cap + rtt.as_secs_f64()) / took.as_secs_f64());
    }
    Converged { weight_err, weight_bias, effs }
}

/// Acceptance bounds of a convergence scenario.
struct Bounds {
    /// Largest weight error after the warm-up.
    weight_err: f64,
    /// Smallest efficiency of a transfer after the warm-up ...
    worst: f64,
    /// ... and of their mean over the 10 seeds.
    mean: f64,
}

/// Every uneven rail set from every start, 10 seeds each, 8 back-to-back 64 MiB transfers per
/// run: prints a table and returns what broke the bounds.
fn convergence(latency: Duration, starts: &[Start], bounds: Bounds) -> Vec<String> {
    let mut bad = Vec::new();
    let mut out = String::from("| Gbit/s          | start     | worst weight err % | worst transfer % | mean % |\n");
    out += "|-----------------|-----------|-------------------:|-----------------:|-------:|\n";
    for gbits in UNEVEN {
        for &start in starts {
            let rails = started_rails(gbits, start, latency);
            let (mut worst_w, mut worst_e, mut effs) = (0.0f64, f64::INFINITY, Vec::new());
            for seed in 1..=10 {
                let c = back_to_back(PlannerConfig::default(), &rails, 8, seed);
                let e = c.effs.iter().copied().fold(f64::INFINITY, f64::min);
                if c.weight_err > bounds.weight_err || e < bounds.worst {
                    bad.push(format!(
                        "{gbits:?} {start:?} seed {seed}: weight error {:.1}%, worst transfer {:.1}%",
                        c.weight_err * 100.0,
                        e * 100.0
                    ));
                }
                worst_w = worst_w.max(c.weight_err);
                worst_e = worst_e.min(e);
                effs.extend(c.effs);
            }
            let mean = effs.iter().sum::<f64>() / effs.len() as f64;
            if mean < bounds.mean {
                bad.push(format!("{gbits:?} {start:?}: mean efficiency {:.1}%", mean * 100.0));
            }
            let name = format!("{gbits:?}");
            out += &format!(
                "| {name:<15} | {:<9} | {:>18.1} | {:>16.1} | {:>6.1} |\n",
                format!("{start:?}"),
                worst_w * 100.0,
                worst_e * 100.0,
                mean * 100.0
            );
        }
    }
    println!("one-way latency {latency:?}:\n{out}");
    bad
}

/// Issue #12 point 4: on uneven rails the weights converge within the first 100 MiB from any
/// seed (equal, unknown, inverted, a tenth, ten times) and from a cold start, and stay within
/// 5% of the true ratio; every 64 MiB transfer after that reaches >= 97% of the rails'
/// capacity, in every one of 10 seeds of every scenario.
#[test]
fn uneven_rails_converge_from_any_start() {
    let bad = convergence(Duration::from_micros(25), &STARTS, Bounds { weight_err: 0.05, worst: 0.97, mean: 0.97 });
    assert!(bad.is_empty(), "{} out of bounds ({} runs):\n{}", bad.len(), UNEVEN.len() * STARTS.len() * 10, bad.join("\n"));
}

/// The same on a long path (5 ms one way, a 10 ms round trip): a rail whose estimate is low
/// gets a window short of its bandwidth-delay product; the window must grow until the link,
/// not the window, limits what the rail delivers.
#[test]
fn uneven_rails_converge_on_a_long_path() {
    let bad = convergence(ms(5.0), &STARTS, Bounds { weight_err: 0.05, worst: 0.97, mean: 0.97 });
    assert!(bad.is_empty(), "{} out of bounds ({} runs):\n{}", bad.len(), UNEVEN.len() * STARTS.len() * 10, bad.join("\n"));
}

/// A noisy host (25% jitter, 2% of chunks held 5 ms): the estimates follow what the rails
/// really deliver, which itself wanders, and a hiccup on a slow rail's last chunk cannot be
/// made up by the others; the bounds are looser.
#[test]
fn uneven_rails_on_a_noisy_host() {
    let bad = convergence(Duration::from_micros(25), &[Start::NoisyHost], Bounds { weight_err: 0.15, worst: 0.90, mean: 0.97 });
    assert!(bad.is_empty(), "{} out of bounds ({} runs):\n{}", bad.len(), UNEVEN.len() * 10, bad.join("\n"));
}

/// Late completion reports: with probability `.0` a completion reaches the planner up to `.1` ms
/// late (uniform), the pipe going on meanwhile.
const LATE: (f64, f64) = (0.1, 6.0);

/// Issue 22 item 4 over ucx: WRITE over 2 + 1 + 0.5 Gbit/s testbed rails split 0.565 : 0.289 :
/// 0.146 where tcp split 0.571 : 0.286 : 0.143 in the same minutes, and reached 93.6-96.4% in
/// its bad runs. The 2 Gbit/s rail's chunk completions (put + flush) came in pairs after gaps:
/// an acknowledgement handled late held back the next chunk, and with a window of two chunks
/// (`chunk_size + rate * window_time`) the link idled until it came; the rail's estimate, which
/// measures what the link delivers, fell 2-3% short of it and the slower rails (8 and 17 ms a
/// chunk, more than the lateness) took its share. Late reports (10% of completions up to 6 ms
/// late) reproduce it here: before the window covered how late completions come (`Rail::late`),
/// the fastest rail's weight averaged 1.5-2% low and the worst seed's mean weight error was 3.1-
/// 6.9% on these shapes; now it is within 2% in every seed.
#[test]
fn uneven_rails_with_late_reports() {
    let mut bad = Vec::new();
    let mut out = String::from("| Gbit/s          | worst mean weight error % | mean transfer % |\n|---|---:|---:|\n");
    for gbits in [&[2.0, 1.0][..], &[2.0, 1.0, 0.5], &[4.0, 1.0]] {
        let rails = started_rails(gbits, Start::LateReports, Duration::from_micros(25));
        let (mut worst, mut effs) = (0.0f64, Vec::new());
        for seed in 1..=10 {
            let c = back_to_back(PlannerConfig::default(), &rails, 8, seed);
            let b = c.weight_bias.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            if b > 0.02 {
                bad.push(format!("{gbits:?} seed {seed}: mean weight errors {:?}", c.weight_bias));
            }
            worst = worst.max(b);
            effs.extend(c.effs);
        }
        let mean = effs.iter().sum::<f64>() / effs.len() as f64;
        if mean < 0.97 {
            bad.push(format!("{gbits:?}: mean efficiency {:.1}%", mean * 100.0));
        }
        out += &format!("| {:<15} | {:>25.1} | {:>15.1} |\n", format!("{gbits:?}"), worst * 100.0, mean * 100.0);
    }
    println!("late reports ({}% up to {} ms):\n{out}", LATE.0 * 100.0, LATE.1);
    assert!(bad.is_empty(), "{} out of bounds (30 runs):\n{}", bad.len(), bad.join("\n"));
}

/// Issue 22 item 4: the first transfer of a fresh engine on uneven rails. Every rail starts
/// from a seed (the link speed a veth reports, 10 Gbit/s; an equal guess; ten times its
/// speed), and what it commits before its first sample is committed at that seed. Before the
/// fix a 0.5 Gbit/s rail seeded at 10 Gbit/s took its first chunk's slow service for a 16 ms
/// round trip, sized its window from it at the seed (24 MiB) and took 19 chunks at once: the
/// first 64 MiB over 2 + 1 + 0.5 Gbit/s ran at 33% (seeded ten times high: 62%). Now every
/// seed reaches 97% in each of 10 seeds, and a cold start (one rail 20 ms late, every rail in
/// slow start from 1/32 of its rate) 92%, against the capacity the rails really had.
#[test]
fn first_transfer_on_uneven_rails() {
    let mut out = String::new();
    let mut bad = Vec::new();
    for gbits in [&[2.0, 1.0][..], &[2.0, 1.0, 0.5][..]] {
        for start in [Start::Exact, Start::Equal, Start::Unknown, Start::Inverted, Start::Low, Start::High, Start::Cold] {
            let rails = started_rails(gbits, start, Duration::from_micros(25));
            let mut worst = f64::INFINITY;
            for seed in 1..=10 {
                let mut sim = Sim::new(PlannerConfig::default(), rails.clone(), seed);
                sim.submit(XferSpec::contiguous(1, Duration::ZERO, 64 * MIB));
                let rep = sim.run();
                let took = rep.done_at(XferId(1)).expect("done");
                let cap: f64 =
                    rep.realised_rates(XferId(1), rails.len()).iter().zip(&rails).map(|(r, s)| r.unwrap_or(s.rate(Duration::ZERO))).sum();
                worst = worst.min((64 * MIB) as f64 / cap / took.as_secs_f64());
            }
            let floor = if start == Start::Cold { 0.92 } else { 0.97 };
            if worst < floor {
                bad.push(format!("{gbits:?} {start:?}: worst first transfer {:.1}% < {:.0}%", worst * 100.0, floor * 100.0));
            }
            out += &format!("{gbits:?} {start:?}: worst first transfer {:.1}%\n", worst * 100.0);
        }
    }
    println!("{out}");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
