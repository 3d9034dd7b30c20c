//! Streams of segments through one pipeline (issue 19: no fill or drain at every planner chunk):
//! a sender that refills with the next segment while the current one is still on the wire,
//! preambles written in front of their segment, a receiver that returns once a segment is off the
//! wire and hands segments back, in order, once their H2D copies are done.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use multirail_gpu::{mem_pair, Device, DevicePtr, Pages, PoolConfig, Role, Src, Staged, StandIn, StandInConfig, Wire};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed).collect()
}

/// Counts the bytes a wire has sent.
struct Counting<W> {
    inner: W,
    sent: Arc<AtomicU64>,
}

impl<W: Wire> Wire for Counting<W> {
    fn send(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.inner.send(buf)?;
        self.sent.fetch_add(buf.len() as u64, Ordering::SeqCst);
        Ok(())
    }
    fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.recv(buf)
    }
}

#[test]
fn a_stream_of_segments_overlaps_across_segment_boundaries() {
    let sizes = [1 << 20, 300_001, 1 << 20, 5, 2 << 20, 777_777];
    let dev = StandIn::new(0, StandInConfig::uniform(400e6));
    let srcs: Vec<(DevicePtr, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let d = pattern(n, i as u8);
            let p = dev.alloc(n).unwrap();
            // SAFETY: stand-in device memory is host memory of n bytes.
            unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), p.0 as *mut u8, n) };
            (p, d)
        })
        .collect();
    let dsts: Vec<DevicePtr> = sizes.iter().map(|&n| dev.alloc(n).unwrap()).collect();
    let pool = PoolConfig { buffers: 3, buffer_size: 256 << 10 };
    let (a, mut b) = mem_pair(Some(800e6));
    let sent = Arc::new(AtomicU64::new(0));
    let mut a = Counting { inner: a, sent: sent.clone() };

    // The receiver: read each segment's 8-byte preamble off the wire, then receive the segment
    // through the pipeline; H2D copies of earlier segments keep running meanwhile.
    let rxd = dev.clone();
    let dsts2 = dsts.clone();
    let sizes2 = sizes.to_vec();
    let receiver = std::thread::spawn(move || {
        let mut rx = Staged::new(rxd, Role::Receiver, pool).unwrap();
        let mut done = Vec::new();
        for (i, &n) in sizes2.iter().enumerate() {
            let mut hdr = [0u8; 8];
            b.recv(&mut hdr).unwrap();
            assert_eq!(u64::from_le_bytes(hdr), i as u64 + 1000, "preamble {i} in front of its segment");
            // SAFETY: dsts2[i] is a live allocation of n bytes nobody else touches.
            unsafe { rx.submit(dsts2[i], n as u64, i as u64, None).unwrap() };
            rx.run_until_wired(i as u64, &mut b, None).unwrap();
            rx.poll().unwrap();
            while let Some(t) = rx.take_done() {
                done.push(t);
            }
        }
        rx.finish(&mut b).unwrap();
        while let Some(t) = rx.take_done() {
            done.push(t);
        }
        done
    });

    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let ends: Vec<u64> = sizes.iter().enumerate().map(|(i, _)| sizes[..=i].iter().map(|&n| n as u64 + 8).sum()).collect();
    // When segment k+1 was taken, how much of segment k had crossed the wire.
    let mut taken_at: Vec<u64> = Vec::new();
    let mut next = 1;
    // SAFETY: the sources are live allocations nobody writes.
    unsafe { tx.submit(srcs[0].0, sizes[0] as u64, 0, Some(1000u64.to_le_bytes().to_vec())).unwrap() };
    for k in 0..sizes.len() as u64 {
        let mut refill = || {
            if next >= sizes.len() {
                return None;
            }
            taken_at.push(sent.load(Ordering::SeqCst));
            let i = next;
            next += 1;
            Some((Src::At(srcs[i].0, sizes[i] as u64), i as u64, Some((1000 + i as u64).to_le_bytes().to_vec())))
        };
        tx.run_until_wired(k, &mut a, Some(&mut refill)).unwrap();
        assert_eq!(tx.take_done(), Some(k), "a sender's segment is done once sent");
    }
    tx.finish(&mut a).unwrap();
    let done = receiver.join().unwrap();
    assert_eq!(done, (0..sizes.len() as u64).collect::<Vec<_>>(), "handed back once each, in order");
    for (i, &n) in sizes.iter().enumerate() {
        // SAFETY: every copy is complete.
        let got = unsafe { std::slice::from_raw_parts(dsts[i].0 as *const u8, n) };
        assert!(got == &srcs[i].1[..], "segment {i} byte-exact");
    }
    // No fill at the boundaries: each next segment was taken (its D2H queued) before the
    // previous one had finished crossing the wire.
    assert_eq!(taken_at.len(), sizes.len() - 1);
    for (k, &at) in taken_at.iter().enumerate() {
        assert!(at < ends[k], "segment {} was taken only after segment {k} was sent ({at} >= {})", k + 1, ends[k]);
    }
    let totals = tx.totals();
    assert_eq!(totals[0].bytes, sizes.iter().sum::<usize>() as u64, "every byte D2H'd once");
}

#[test]
fn a_failed_stream_drops_its_segments_and_leaves_no_copy_running() {
    let dev = StandIn::new(0, StandInConfig::uniform(50e6));
    let src = dev.alloc(2 << 20).unwrap();
    let mut tx = Staged::new(dev.clone(), Role::Sender, PoolConfig { buffers: 2, buffer_size: 256 << 10 }).unwrap();
    let (mut a, b) = mem_pair(None);
    drop(b); // the peer is gone: the first send fails
             // SAFETY: src is live and nobody writes it.
    unsafe {
        tx.submit(src, 1 << 20, 1, Some(vec![1, 2, 3])).unwrap();
        tx.submit(DevicePtr(src.0 + (1 << 20)), 1 << 20, 2, None).unwrap();
    }
    assert!(tx.run_until_wired(2, &mut a, None).is_err());
    assert_eq!(dev.copies_in_flight(), 0);
    assert_eq!(tx.queued(), 0, "every segment dropped");
    assert_eq!(tx.take_done(), None);
}

#[test]
fn pieces_cover_segments_with_short_ramps() {
    use multirail_gpu::pipeline::piece_lengths;
    let m = 1u64 << 20;
    assert_eq!(piece_lengths(m, m, false, false).collect::<Vec<_>>(), [m]);
    assert_eq!(piece_lengths(m, m, true, false).collect::<Vec<_>>(), [m / 4, 3 * m / 4]);
    assert_eq!(piece_lengths(m, m, false, true).collect::<Vec<_>>(), [3 * m / 4, m / 4]);
    assert_eq!(piece_lengths(m, m, true, true).collect::<Vec<_>>(), [m / 4, m / 2, m / 4]);
    assert_eq!(piece_lengths(100, m, true, true).collect::<Vec<_>>(), [100]);
    for len in [0u64, 1, 4095, 4096, 300_001, m, 5 * m + 7] {
        for (buf, head, tail) in [(m, true, true), (256 << 10, false, true), (4096, true, false), (1, true, true)] {
            let p: Vec<u64> = piece_lengths(len, buf, head, tail).collect();
            assert_eq!(p.iter().sum::<u64>(), len, "{len} {buf} {head} {tail}: {p:?}");
            assert!(p.iter().all(|&l| l > 0 && l <= buf.max(1)), "{len} {buf}: {p:?}");
        }
    }
}

/// Pages scattered on both sides (a vectored request's pieces, in shuffled order and of odd
/// sizes, some adjacent): the sender gathers them into its pinned buffers, the receiver scatters
/// the stream into other pages, in segments that follow one another through one pipeline; every
/// byte lands where its page says.
#[test]
fn scattered_pages_stream_through_the_pinned_buffers_byte_exact() {
    let dev = StandIn::new(0, StandInConfig::uniform(2e9));
    let page = 4099usize;
    let n_pages = 700;
    let src = dev.alloc(page * n_pages).unwrap();
    let dst = dev.alloc(page * n_pages).unwrap();
    let data = pattern(page * n_pages, 9);
    // SAFETY: stand-in device memory is host memory of that many bytes.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.0 as *mut u8, data.len()) };
    // Page i of the stream comes from source page perm[i] and goes to destination page
    // perm2[i]; a run of pages in order makes adjacent spans (merged by `Pages::new`).
    let perm: Vec<usize> = (0..n_pages).map(|i| if i % 10 < 3 { i } else { (i * 389) % n_pages }).collect();
    let perm2: Vec<usize> = (0..n_pages).map(|i| (i * 211 + 5) % n_pages).collect();
    // Three segments of uneven page counts.
    let cuts = [0, 123, 500, n_pages];
    let segs = |base: DevicePtr, order: &[usize]| -> Vec<Arc<Pages>> {
        cuts.windows(2)
            .map(|w| Arc::new(Pages::new(order[w[0]..w[1]].iter().map(|&p| (base.0 + (p * page) as u64, page as u64)))))
            .collect()
    };
    let (tx_pages, rx_pages) = (segs(src, &perm), segs(dst, &perm2));
    assert!(tx_pages[0].spans().len() < cuts[1], "adjacent pages merged");
    let pool = PoolConfig { buffers: 3, buffer_size: 64 << 10 };
    let (mut a, mut b) = mem_pair(None);
    let rxd = dev.clone();
    let rx_pages2 = rx_pages.clone();
    let receiver = std::thread::spawn(move || {
        let mut rx = Staged::new(rxd, Role::Receiver, pool).unwrap();
        for (i, p) in rx_pages2.iter().enumerate() {
            // SAFETY: the destination pages are a live allocation nobody else touches.
            unsafe { rx.submit_src(Src::Pieces(p.clone()), i as u64, None).unwrap() };
            rx.run_until_wired(i as u64, &mut b, None).unwrap();
        }
        rx.finish(&mut b).unwrap();
    });
    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let mut next = 1;
    // SAFETY: the source pages are a live allocation nobody writes.
    unsafe { tx.submit_src(Src::Pieces(tx_pages[0].clone()), 0, None).unwrap() };
    for k in 0..tx_pages.len() as u64 {
        let mut refill = || {
            let p = tx_pages.get(next)?.clone();
            next += 1;
            Some((Src::Pieces(p), next as u64 - 1, None))
        };
        tx.run_until_wired(k, &mut a, Some(&mut refill)).unwrap();
    }
    tx.finish(&mut a).unwrap();
    receiver.join().unwrap();
    // SAFETY: every copy is complete.
    let got = unsafe { std::slice::from_raw_parts(dst.0 as *const u8, page * n_pages) };
    for i in 0..n_pages {
        let (s, d) = (perm[i] * page, perm2[i] * page);
        assert!(got[d..d + page] == data[s..s + page], "stream page {i}: source page {} into destination page {}", perm[i], perm2[i]);
    }
    assert_eq!(tx.totals()[0].bytes, (page * n_pages) as u64);
}
