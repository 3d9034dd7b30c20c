//! Issue 34, "Simulation": eight processes on a DGX-H100-like host each move 1 GiB of GPU
//! memory to a peer host at once, driving the real planner over a simulated PCIe fabric
//! (`fabric/mod.rs` has the model). The table is printed with
//! `cargo test -p multirail-proto --test topo_sim -- --nocapture` and snapshotted below, so a
//! change of planner or model shows as a diff; docs/benchmarks.md quotes it.
//!
//! The figures of the model (bytes/s, one direction), and why:
//! - wire: 400 Gbit/s = 50 GB/s per ConnectX-7 (the link rate; packet headers are not charged).
//! - PCIe Gen5 x16 (a GPU's link to its NIC's switch, the switch's uplink to its root port):
//!   55 GB/s. The raw rate is 32 GT/s x 16 lanes x 128/130 = 63.0 GB/s; transaction-layer
//!   packets of 256 bytes carry about 24 bytes of header, framing and CRC each (91%), and flow
//!   control and acknowledgements take a few percent more, so about 55 GB/s is usable.
//! - socket link: 2 x Xeon 8480C, 4 UPI 2.0 links at 16 GT/s: 32 GB/s raw per link and
//!   direction, about 24 GB/s after flit overhead, 96 GB/s each way in all.
//! - root complex: 48 GB/s of peer-to-peer forwarding per socket. The least certain figure:
//!   GPU memory through a NIC behind another root port was measured at 22-25 GB/s for one GPU
//!   (Mooncake #813: 1 PXB + 3 NODE NICs gave 30 GB/s at equal shares; ucx #11259: half of a
//!   CX-7 across sockets) and NCCL models a Sapphire Rapids path between sockets at 22 GB/s
//!   (`SRP_QPI_BW`, src/graph/topo.h); we allow a socket twice that. The table also shows
//!   host-wide striping with 24 GB/s and with no root-complex limit at all.
//! - DRAM: 8 channels of DDR5-4800 per socket, 307 GB/s (not on these paths).
//! - latency: 5 us one way (a completion reaches the planner 10 us after its last byte left).

mod fabric;

use std::fmt::Write as _;
use std::time::Duration;

use fabric::{gbit, Class, Fabric, FabricSim, Mem, Params, ProcSpec, RunReport, GB};
use multirail_proto::PlannerConfig;

const GIB: u64 = 1 << 30;

fn dgx_h100(rc: f64) -> Params {
    Params {
        sockets: 2,
        pairs_per_socket: 4,
        wire: gbit(400.0),
        pcie: 55.0 * GB,
        rc,
        socket_link: 4.0 * 24.0 * GB,
        dram: 8.0 * 38.4 * GB,
        latency: Duration::from_micros(5),
    }
}

const RC: f64 = 48.0 * GB;

/// Each process over its GPU's near NIC only (the best class: PXB), falling back to the next
/// class (NODE: the other NICs of its socket) when that fails.
fn affinity(f: &Fabric) -> Vec<ProcSpec> {
    (0..f.pairs())
        .map(|k| ProcSpec {
            mem: Mem::Gpu(k),
            rails: f.nics_in(Mem::Gpu(k), Class::Pxb),
            fallback: vec![f.nics_in(Mem::Gpu(k), Class::Node)],
            bytes: GIB,
            count: 1,
            cfg: PlannerConfig::default(),
            hint: Some(f.params.wire),
        })
        .collect()
}

/// Each process over all eight NICs (`affinity="none"`: what `rails="auto"` did before).
fn striping(f: &Fabric) -> Vec<ProcSpec> {
    (0..f.pairs())
        .map(|k| ProcSpec {
            mem: Mem::Gpu(k),
            rails: (0..f.pairs()).collect(),
            fallback: Vec::new(),
            bytes: GIB,
            count: 1,
            cfg: PlannerConfig::default(),
            hint: Some(f.params.wire),
        })
        .collect()
}

struct Row {
    name: String,
    rep: RunReport,
    /// The earliest the wires could have finished (see `ideal`).
    ideal: Duration,
    /// The wires' rate between a failure and the first transfer's end, as a share of all wires.
    while_down: Option<f64>,
    total: f64,
    wires: f64,
}

impl Row {
    /// Bytes over the time the last transfer ended, as a share of the eight wires.
    fn aggregate(&self) -> f64 {
        self.total / self.rep.end.as_secs_f64() / self.wires
    }
}

/// The earliest every transfer could end: all wires full; after a NIC fails at `at`, its
/// socket's transfers can only use the socket's other NICs (the failover class), so that
/// socket's bytes left at `at` go over its remaining wires.
fn ideal(f: &Fabric, specs: &[ProcSpec], fail: Option<(Duration, usize)>) -> Duration {
    let total: f64 = specs.iter().map(|s| s.bytes as f64 * s.count as f64).sum();
    let plain = Duration::from_secs_f64(total / f.wire_total());
    let Some((at, nic)) = fail else {
        return plain;
    };
    let s = f.socket_of(nic);
    let wire = f.params.wire;
    let per_socket = f.params.pairs_per_socket as f64;
    let left: f64 = specs
        .iter()
        .filter(|p| matches!(p.mem, Mem::Gpu(k) if f.socket_of(k) == s))
        .map(|p| p.bytes as f64 - wire * at.as_secs_f64())
        .sum();
    plain.max(at + Duration::from_secs_f64(left / (wire * (per_socket - 1.0))))
}

fn run(name: &str, params: Params, procs: fn(&Fabric) -> Vec<ProcSpec>, fail: Option<(Duration, usize)>) -> Row {
    let f = Fabric::new(params);
    let wires = f.wire_total();
    let specs = procs(&f);
    let total = specs.iter().map(|s| s.bytes as f64 * s.count as f64).sum();
    let ideal = ideal(&f, &specs, fail);
    let mut sim = FabricSim::new(f, specs);
    if let Some((at, nic)) = fail {
        sim.fail_nic(at, nic);
    }
    let rep = sim.run();
    for (k, p) in rep.procs.iter().enumerate() {
        assert!(p.failed.is_none() && p.done.is_some(), "{name}: process {k} did not finish: {:?}", p.failed);
    }
    let while_down = fail.map(|(at, _)| rep.wire_rate(at, rep.first_done()) / wires);
    Row { name: name.to_string(), rep, ideal, while_down, total, wires }
}

fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| {:<48} | {:>8} | {:>7} | {:>5} | {:>12} | {:>12} |",
        "scenario (8 processes x 1 GiB, GPU to GPU)", "ideal ms", "last ms", "eff %", "% of 8x400G", "while down %"
    );
    let _ = writeln!(s, "|{:-<50}|{:->10}|{:->9}|{:->7}|{:->14}|{:->14}|", "", "", "", "", "", "");
    for r in rows {
        let down = r.while_down.map_or("-".to_string(), |d| format!("{:.1}", d * 100.0));
        let _ = writeln!(
            s,
            "| {:<48} | {:>8.3} | {:>7.3} | {:>5.1} | {:>12.1} | {:>12} |",
            r.name,
            r.ideal.as_secs_f64() * 1e3,
            r.rep.end.as_secs_f64() * 1e3,
            r.ideal.as_secs_f64() / r.rep.end.as_secs_f64() * 100.0,
            r.aggregate() * 100.0,
            down
        );
    }
    s
}

/// A row of the table: its name, the model, the processes, a NIC failing at a time.
type Scenario = (&'static str, Params, fn(&Fabric) -> Vec<ProcSpec>, Option<(Duration, usize)>);

const FAIL_AT: Duration = Duration::from_millis(10);

/// The table, exactly: the simulation is deterministic (no jitter, virtual time).
const SNAPSHOT: &str = "\
| scenario (8 processes x 1 GiB, GPU to GPU)       | ideal ms | last ms | eff % |  % of 8x400G | while down % |
|--------------------------------------------------|----------|---------|-------|--------------|--------------|
| affinity: near NIC (PXB) only                    |   21.475 |  21.485 | 100.0 |        100.0 |            - |
| host-wide striping over all 8 NICs               |   21.475 |  72.100 |  29.8 |         29.8 |            - |
|   the same, root complex 24 GB/s                 |   21.475 | 132.655 |  16.2 |         16.2 |            - |
|   the same, root complex 96 GB/s                 |   21.475 |  40.861 |  52.6 |         52.6 |            - |
|   the same, no root-complex limit                |   21.475 |  21.485 | 100.0 |        100.0 |            - |
|   the same, 2 x 1 GiB back to back               |   42.950 |  93.586 |  45.9 |         45.9 |            - |
|   the same, rails' speed not told                |   21.475 |  31.729 |  67.7 |         67.7 |            - |
| affinity, NIC 0 fails at 10 ms (GPU 0 -> NODE)   |   25.300 |  25.316 |  99.9 |         84.8 |         87.5 |

back to back, from the last first transfer's end: 21.487 ms, 99.9% of 8x400G
";

#[test]
fn dgx_h100_affinity_against_striping() {
    let scenarios: Vec<Scenario> = vec![
        ("affinity: near NIC (PXB) only", dgx_h100(RC), affinity, None),
        ("host-wide striping over all 8 NICs", dgx_h100(RC), striping, None),
        ("  the same, root complex 24 GB/s", dgx_h100(24.0 * GB), striping, None),
        ("  the same, root complex 96 GB/s", dgx_h100(96.0 * GB), striping, None),
        ("  the same, no root-complex limit", dgx_h100(f64::INFINITY), striping, None),
        (
            "  the same, 2 x 1 GiB back to back",
            dgx_h100(RC),
            |f| striping(f).into_iter().map(|p| ProcSpec { count: 2, ..p }).collect(),
            None,
        ),
        (
            "  the same, rails' speed not told",
            dgx_h100(RC),
            |f| striping(f).into_iter().map(|p| ProcSpec { hint: None, ..p }).collect(),
            None,
        ),
        ("affinity, NIC 0 fails at 10 ms (GPU 0 -> NODE)", dgx_h100(RC), affinity, Some((FAIL_AT, 0))),
    ];
    // Independent runs, in parallel: the test takes as long as its longest run.
    let rows: Vec<Row> = std::thread::scope(|s| {
        let runs: Vec<_> =
            scenarios.into_iter().map(|(name, params, procs, fail)| s.spawn(move || run(name, params, procs, fail))).collect();
        runs.into_iter().map(|r| r.join().expect("a scenario panicked (its message is above)")).collect()
    });
    let mut t = table(&rows);
    // The second transfer of the back-to-back row, once every process has finished its first
    // (its planner has measured its rails by then).
    let twice = &rows[5].rep;
    let first = twice.procs.iter().map(|p| p.dones[0]).max().expect("processes");
    let second = (twice.end - first).as_secs_f64();
    let _ = writeln!(
        t,
        "\nback to back, from the last first transfer's end: {:.3} ms, {:.1}% of 8x400G",
        second * 1e3,
        8.0 * GIB as f64 / second / rows[5].wires * 100.0
    );
    println!("{t}");
    let (aff, stripe, fail) = (&rows[0], &rows[1], &rows[rows.len() - 1]);

    // (a) Affinity: at least 95% of 8 x 400 Gbit/s, every byte over its GPU's own NIC.
    assert!(aff.aggregate() >= 0.95, "affinity reached {:.4}", aff.aggregate());
    for (k, p) in aff.rep.procs.iter().enumerate() {
        let mut want = vec![0; 8];
        want[k] = 1 << 30;
        assert_eq!(p.bytes_per_nic, want, "process {k}");
    }
    // (b) Host-wide striping on the same model: below affinity.
    assert!(stripe.aggregate() < aff.aggregate(), "striping {:.4} >= affinity {:.4}", stripe.aggregate(), aff.aggregate());
    // (c) NIC 0 fails: GPU 0's bytes go to the NODE class (NICs 1-3), nobody else's move, and
    // while it is down the wires' aggregate falls by no more than that NIC's share (1/8).
    let share = 1.0 / 8.0;
    let down = fail.while_down.expect("a failure row");
    assert!(down >= aff.aggregate() - share - 1e-9, "while NIC 0 was down the wires ran at {down:.4}, affinity {:.4}", aff.aggregate());
    let gpu0 = &fail.rep.procs[0].bytes_per_nic;
    assert!(gpu0[0] > 0 && gpu0[1..4].iter().all(|&b| b > 0) && gpu0[4..].iter().all(|&b| b == 0), "GPU 0's bytes per NIC: {gpu0:?}");
    assert_eq!(gpu0.iter().sum::<u64>(), 1 << 30);
    for (k, p) in fail.rep.procs.iter().enumerate().skip(1) {
        assert_eq!(p.bytes_per_nic.iter().enumerate().filter(|&(j, _)| j != k).map(|(_, b)| b).sum::<u64>(), 0, "process {k}");
    }
    // The planner moves GPU 0's bytes as fast as the failover class allows: within 1% of the
    // earliest finish with NIC 0 gone.
    assert!(fail.rep.end.as_secs_f64() <= fail.ideal.as_secs_f64() * 1.01, "{:?} against {:?}", fail.rep.end, fail.ideal);

    assert_eq!(t, SNAPSHOT, "the table changed: if on purpose, update SNAPSHOT (and docs/benchmarks.md)");
}

/// The paths the model gives, hop by hop (what the figures above rest on).
#[test]
fn dgx_h100_paths() {
    let f = Fabric::new(dgx_h100(RC));
    assert_eq!(f.path_names(Mem::Gpu(0), 0), ["A.gpu0.up", "wire0", "B.gpu0.down"]);
    assert_eq!(
        f.path_names(Mem::Gpu(0), 2),
        [
            "A.gpu0.up",
            "A.sw0.uplink.up",
            "A.rc0",
            "A.sw2.uplink.down",
            "wire2",
            "B.sw2.uplink.up",
            "B.rc0",
            "B.sw0.uplink.down",
            "B.gpu0.down"
        ]
    );
    assert_eq!(
        f.path_names(Mem::Gpu(1), 6),
        [
            "A.gpu1.up",
            "A.sw1.uplink.up",
            "A.rc0",
            "A.socket0->1",
            "A.rc1",
            "A.sw6.uplink.down",
            "wire6",
            "B.sw6.uplink.up",
            "B.rc1",
            "B.socket1->0",
            "B.rc0",
            "B.sw1.uplink.down",
            "B.gpu1.down"
        ]
    );
    assert_eq!(
        f.path_names(Mem::Dram(1), 2),
        ["A.dram1", "A.socket1->0", "A.sw2.uplink.down", "wire2", "B.sw2.uplink.up", "B.socket0->1", "B.dram1"]
    );
    assert_eq!(f.nics_in(Mem::Gpu(5), Class::Pxb), [5]);
    assert_eq!(f.nics_in(Mem::Gpu(5), Class::Node), [4, 6, 7]);
    assert_eq!(f.nics_in(Mem::Gpu(5), Class::Sys), [0, 1, 2, 3]);
    assert_eq!(f.nics_in(Mem::Dram(0), Class::Node), [0, 1, 2, 3]);
    // Water-filling: three flows on a 30-unit link, one of them also on a 5-unit link.
    let caps = [30.0, 5.0];
    let rates = fabric::max_min(&caps, &[&[0], &[0, 1], &[0]]);
    assert_eq!(rates, [12.5, 5.0, 12.5]);
}
