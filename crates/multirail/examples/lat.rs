//! In-process 4 KiB READ latency: `cargo run --release -p multirail --example lat [ITERS]`.
//! Engine-only (no Python) post+wait round trips against a target agent in the same process;
//! prints p50/p99 in microseconds. For breaking down where the time goes; the benchmark of
//! record is `multirail bench local --baseline`.
use multirail::config::Progress;
use multirail::{Agent, Config, Op};
use multirail_proto::{Access, MemType};
use std::time::Instant;

fn main() {
    let iters: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(20000);
    // MR_PROGRESS=block|poll|adaptive (default adaptive), MR_SPIN_US (default 200).
    let mut cfg = Config::default();
    if let Some(p) = std::env::var("MR_PROGRESS").ok().and_then(|p| Progress::parse(&p)) {
        cfg.progress = p;
    }
    if let Some(us) = std::env::var("MR_SPIN_US").ok().and_then(|s| s.parse::<u64>().ok()) {
        cfg.spin = std::time::Duration::from_micros(us);
    }
    let t = Agent::new("t", cfg.clone()).unwrap();
    let i = Agent::new("i", cfg).unwrap();
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    t.register(src.as_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadWrite).unwrap();
    i.register(dst.as_mut_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadWrite).unwrap();
    i.fetch_remote("t", "127.0.0.1", t.port()).unwrap();
    let h = i.prepare(Op::Read, &[(dst.as_ptr() as u64, 4096, 0)], &[(src.as_ptr() as u64, 4096, 0)], "t", vec![]).unwrap();
    let mut lat = Vec::with_capacity(iters);
    for k in 0..iters + 1000 {
        let t0 = Instant::now();
        h.post_wait(None, None).unwrap();
        if k >= 1000 {
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |f: f64| lat[((lat.len() as f64 * f) as usize).min(lat.len() - 1)];
    println!(
        "p50 {:.2} us  p90 {:.2} us  p99 {:.2} us  p99.9 {:.2} us  min {:.2} us  >20us: {}",
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        lat[0],
        lat.iter().filter(|&&x| x > 20.0).count()
    );
}
