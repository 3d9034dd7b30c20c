//! The whole staged path (VRAM → D2H → wire → H2D → VRAM) on the host-backed stand-in device:
//! bytes, overlap measured on the recorded per-stage timeline, and the pool allocated once.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use multirail_gpu::pipeline::{timeline, Op, PipelineError};
use multirail_gpu::standin::CopyRecord;
use multirail_gpu::{mem_pair, ChunkId, CopyKind, Device, PoolConfig, Role, Stage, Staged, StandIn, StandInConfig, Wire};

const KIB: u64 = 1 << 10;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

/// Allocates `len` bytes of stand-in device memory holding `data`.
fn upload(dev: &StandIn, data: &[u8]) -> multirail_gpu::DevicePtr {
    let p = dev.alloc(data.len()).unwrap();
    // SAFETY: the stand-in's device memory is host memory of at least data.len() bytes.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.0 as *mut u8, data.len()) };
    p
}

fn download(p: multirail_gpu::DevicePtr, len: usize) -> Vec<u8> {
    // SAFETY: as in upload; no copy runs on it any more.
    unsafe { std::slice::from_raw_parts(p.0 as *const u8, len) }.to_vec()
}

/// Runs one transfer per size through a sender and a receiver (each on its own thread and
/// stand-in device, reused across sizes) and returns what landed, per size.
fn transfer_all(
    tx_dev: &StandIn,
    rx_dev: &StandIn,
    pool: PoolConfig,
    sizes: &[usize],
    wires: (Box<dyn Wire + Send>, Box<dyn Wire + Send>),
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (mut wa, mut wb) = wires;
    let srcs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| pattern(n, i as u8)).collect();
    let sizes2 = sizes.to_vec();
    let rxd = rx_dev.clone();
    let receiver = std::thread::spawn(move || {
        let mut rx = Staged::new(rxd.clone(), Role::Receiver, pool).unwrap();
        sizes2
            .iter()
            .map(|&n| {
                let dst = rxd.alloc(n).unwrap();
                // SAFETY: dst is a stand-in allocation of n bytes used by nothing else.
                unsafe { rx.recv(dst, n as u64, &mut *wb) }.unwrap();
                let out = download(dst, n);
                // SAFETY: the transfer is complete.
                unsafe { rxd.free(dst) }.unwrap();
                out
            })
            .collect::<Vec<_>>()
    });
    let mut tx = Staged::new(tx_dev.clone(), Role::Sender, pool).unwrap();
    assert_eq!(tx.pool_bytes(), pool.bytes());
    for src in &srcs {
        let p = upload(tx_dev, src);
        // SAFETY: p is a stand-in allocation of src.len() bytes, not written during the call.
        unsafe { tx.send(p, src.len() as u64, &mut *wa) }.unwrap();
        // SAFETY: the transfer is complete.
        unsafe { tx_dev.free(p) }.unwrap();
    }
    let got = receiver.join().unwrap();
    srcs.into_iter().zip(got).collect()
}

#[test]
fn vram_to_vram_bytes_exact_for_odd_sizes() {
    let (a, b) = (StandIn::new(0, StandInConfig::default()), StandIn::new(1, StandInConfig::default()));
    let pool = PoolConfig { buffers: 3, buffer_size: 64 * KIB };
    let sizes = [1, 4095, 64 * 1024, 3 * 64 * 1024, 3 * 64 * 1024 + 17, (1 << 20) + 1, 7];
    let (wa, wb) = mem_pair(None);
    for (want, got) in transfer_all(&a, &b, pool, &sizes, (Box::new(wa), Box::new(wb))) {
        assert_eq!(want.len(), got.len());
        assert!(want == got, "size {} differs", want.len());
    }
}

#[test]
fn mem_pair_transfers_in_both_orders_of_sizes() {
    let (a, b) = (StandIn::new(0, StandInConfig::default()), StandIn::new(1, StandInConfig::default()));
    let (wa, wb) = mem_pair(None);
    let pool = PoolConfig { buffers: 2, buffer_size: 4 * KIB };
    let sizes = [100_000, 1, 8192, 8191, 8193];
    for (want, got) in transfer_all(&a, &b, pool, &sizes, (Box::new(wa), Box::new(wb))) {
        assert!(want == got, "size {} differs", want.len());
    }
    assert_eq!((a.live_allocs(), b.live_allocs()), (0, 0), "pools freed on drop");
}

#[test]
fn over_loopback_tcp() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let (a, b) = (StandIn::new(0, StandInConfig::default()), StandIn::new(1, StandInConfig::default()));
    let pool = PoolConfig { buffers: 4, buffer_size: 256 * KIB };
    for (want, got) in transfer_all(&a, &b, pool, &[(4 << 20) + 3, 10], (Box::new(c), Box::new(s))) {
        assert!(want == got, "size {} differs", want.len());
    }
}

#[test]
fn pool_is_allocated_once_and_reused() {
    let (a, b) = (StandIn::new(0, StandInConfig::default()), StandIn::new(1, StandInConfig::default()));
    let (wa, wb) = mem_pair(None);
    let pool = PoolConfig { buffers: 3, buffer_size: 16 * KIB };
    let sizes = vec![100 * 1024; 8];
    let out = transfer_all(&a, &b, pool, &sizes, (Box::new(wa), Box::new(wb)));
    assert!(out.iter().all(|(w, g)| w == g));
    // Each side allocated its three pinned buffers once for eight transfers; device
    // allocations are the test's own (one per transfer).
    assert_eq!(a.pinned_allocs(), 3);
    assert_eq!(b.pinned_allocs(), 3);
    assert_eq!((a.device_allocs(), b.device_allocs()), (8, 8));
}

#[test]
fn a_broken_wire_is_a_typed_error_and_the_pool_survives() {
    let dev = StandIn::new(0, StandInConfig::default());
    let pool = PoolConfig { buffers: 2, buffer_size: 4 * KIB };
    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let src = upload(&dev, &pattern(64 * 1024, 1));
    let (mut wa, wb) = mem_pair(None);
    drop(wb);
    // SAFETY: src is a stand-in allocation of 64 KiB.
    let e = unsafe { tx.send(src, 64 * 1024, &mut wa) }.unwrap_err();
    assert!(matches!(e, PipelineError::Wire { op: "send", chunk: ChunkId(0), .. }), "{e:?}");
    assert!(e.to_string().contains("wire send of chunk"), "{e}");
    // The same pool then serves a good transfer.
    let (mut wa, mut wb) = mem_pair(None);
    let rxdev = StandIn::new(1, StandInConfig::default());
    let dst = rxdev.alloc(64 * 1024).unwrap();
    let rxd = rxdev.clone();
    let h = std::thread::spawn(move || {
        let mut rx = Staged::new(rxd, Role::Receiver, pool).unwrap();
        // SAFETY: dst is a stand-in allocation of 64 KiB used by nothing else.
        unsafe { rx.recv(dst, 64 * 1024, &mut wb) }.unwrap();
    });
    // SAFETY: as above.
    unsafe { tx.send(src, 64 * 1024, &mut wa) }.unwrap();
    h.join().unwrap();
    assert_eq!(download(dst, 64 * 1024), pattern(64 * 1024, 1));
    assert_eq!(dev.pinned_allocs(), 2);
}

fn copy_ops(log: &[CopyRecord], kind: CopyKind, stage: Stage) -> Vec<Op> {
    log.iter()
        .filter(|r| r.kind == kind)
        .enumerate()
        .map(|(i, r)| Op { stage, chunk: ChunkId(i as u64), bytes: r.len as u64, start: r.start, end: r.end })
        .collect()
}

/// D2H, wire and H2D each limited to the same rate R: the stages must run at the same time.
/// Asserted on the recorded timeline (the stand-in's own copy log and the sender's timed
/// sends), not on wall-clock ratios, so a loaded machine cannot make it flaky.
#[test]
fn stages_overlap_when_each_is_rate_limited() {
    const RATE: f64 = 64e6; // 256 KiB chunks: ~4.1 ms per stage per chunk
    let chunk = 256 * KIB;
    let chunks = 12u64;
    let len = (chunk * chunks) as usize;
    let a = StandIn::new(0, StandInConfig { d2h_rate: Some(RATE), ..StandInConfig::default() });
    let b = StandIn::new(1, StandInConfig { h2d_rate: Some(RATE), ..StandInConfig::default() });
    let (mut wa, mut wb) = mem_pair(Some(RATE));
    let pool = PoolConfig { buffers: 3, buffer_size: chunk };
    let src_data = pattern(len, 9);
    let src = upload(&a, &src_data);
    let dst = b.alloc(len).unwrap();
    let bd = b.clone();
    let h = std::thread::spawn(move || {
        let mut rx = Staged::new(bd, Role::Receiver, pool).unwrap();
        // SAFETY: dst is a stand-in allocation of len bytes used by nothing else.
        unsafe { rx.recv(dst, len as u64, &mut wb) }.unwrap()
    });
    let mut tx = Staged::new(a.clone(), Role::Sender, pool).unwrap();
    // SAFETY: src is a stand-in allocation of len bytes.
    let sent = unsafe { tx.send(src, len as u64, &mut wa) }.unwrap();
    let recvd = h.join().unwrap();
    assert!(download(dst, len) == src_data);

    let mut ops = copy_ops(&a.take_copy_log(), CopyKind::DeviceToHost, Stage::D2H);
    ops.extend(sent.ops.iter().filter(|o| o.stage == Stage::Wire));
    ops.extend(copy_ops(&b.take_copy_log(), CopyKind::HostToDevice, Stage::H2D));
    let t = timeline(sent.started.min(recvd.started), ops);
    let b = t.breakdown();
    let single = Duration::from_secs_f64(len as f64 / RATE);
    let elapsed = recvd.elapsed.max(sent.elapsed);
    eprintln!(
        "{b}single-stage time {single:?}, elapsed {elapsed:?} ({:.2}x; serial would be 3x, ideal {:.2}x)\n\
         overlap D2H+wire {:?}, wire+H2D {:?}, all three {:?}",
        elapsed.as_secs_f64() / single.as_secs_f64(),
        (chunks + 2) as f64 / chunks as f64,
        t.overlap(Stage::D2H, Stage::Wire),
        t.overlap(Stage::Wire, Stage::H2D),
        t.overlap_all(),
    );
    for s in Stage::ALL {
        // A sender's first piece and a receiver's last are short ramps: one piece more at most.
        assert!((chunks..=chunks + 1).contains(&b.stage(s).ops), "{s:?}: {} ops", b.stage(s).ops);
        assert_eq!(b.stage(s).bytes, len as u64, "{s:?}");
    }
    // With no overlap each pair of stages would share zero time; pipelined, they share about
    // (n-1)/n of a stage's busy time. A quarter is a margin no scheduler hiccup takes away.
    assert!(t.overlap(Stage::D2H, Stage::Wire) > single / 4, "D2H and wire did not overlap");
    assert!(t.overlap(Stage::Wire, Stage::H2D) > single / 4, "wire and H2D did not overlap");
    assert!(!t.overlap_all().is_zero(), "the three stages never ran at once");
}
