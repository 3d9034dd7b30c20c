//! The hazards a real GPU has and a host buffer does not, as the stand-in models them (issue
//! 19): the caller's current device, a producer's pending work, copies still running on error
//! and drop paths, and a pool that must not leak when its setup fails half-way.

use std::time::Duration;

use multirail_gpu::standin::{contexts, current_device, set_current_device};
use multirail_gpu::{mem_pair, Device, FailOp, PoolConfig, Role, Staged, StandIn, StandInConfig};

fn fill(dev: &StandIn, p: multirail_gpu::DevicePtr, len: usize, byte: u8) {
    let _ = dev;
    // SAFETY: stand-in device memory is host memory of at least `len` bytes.
    unsafe { std::ptr::write_bytes(p.0 as *mut u8, byte, len) };
}

/// Every call made on device 7 leaves the thread's current device as the application set it,
/// and creates no context on a device nobody asked for.
#[test]
fn calls_restore_the_callers_current_device() {
    set_current_device(Some(3));
    let dev = StandIn::new(7, StandInConfig::default());
    let p = dev.alloc(4096).unwrap();
    let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
    let h = dev.alloc_pinned(4096).unwrap();
    // SAFETY: both ranges are live allocations of 4096 bytes.
    unsafe { dev.copy_async(multirail_gpu::CopyKind::DeviceToHost, h.addr(), p.0, 4096, &s).unwrap() };
    dev.record(&e, &s).unwrap();
    dev.synchronize(&e).unwrap();
    dev.stream_synchronize(&s).unwrap();
    assert_eq!(current_device(), Some(3), "the application's device is back");
    // SAFETY: idle.
    unsafe {
        dev.free_pinned(h).unwrap();
        dev.free(p).unwrap();
    }
    assert_eq!(current_device(), Some(3));
    assert!(contexts().contains(&7) && contexts().contains(&3));
    // A thread that never chose a device still has none afterwards.
    std::thread::spawn(move || {
        let q = dev.alloc(16).unwrap();
        assert_eq!(current_device(), None);
        // SAFETY: unused.
        unsafe { dev.free(q).unwrap() };
    })
    .join()
    .unwrap();
}

/// A producer still running on the application's stream: a staged send ordered after it with
/// `record_external` + `wait_for` sends what the producer wrote, not what was there before.
#[test]
fn a_send_ordered_after_the_producer_sends_its_bytes() {
    const N: usize = 300_000;
    let dev = StandIn::new(0, StandInConfig::default());
    let src = dev.alloc(N).unwrap();
    fill(&dev, src, N, 0x11); // stale contents
    let produced: Vec<u8> = (0..N).map(|i| (i * 13 + 5) as u8).collect();
    // The application's stream: a long "kernel", then the copy that produces the data.
    let app = dev.create_stream().unwrap();
    dev.enqueue_sleep(&app, Duration::from_millis(300)).unwrap();
    // SAFETY: `produced` outlives the copy (synchronised below); src is a live allocation.
    unsafe { dev.copy_async(multirail_gpu::CopyKind::HostToDevice, src.0, produced.as_ptr() as u64, N, &app).unwrap() };
    let ready = dev.create_event().unwrap();
    dev.record_external(&ready, dev.stream_handle(&app)).unwrap();

    let pool = PoolConfig { buffers: 3, buffer_size: 64 << 10 };
    let dst = dev.alloc(N).unwrap();
    let (mut a, mut b) = mem_pair(None);
    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let mut rx = Staged::new(dev.clone(), Role::Receiver, pool).unwrap();
    tx.wait_for(&ready).unwrap();
    let t = std::thread::spawn(move || {
        // SAFETY: src is a live allocation of N bytes; the producer's copy is ordered before.
        unsafe { tx.send(src, N as u64, &mut a) }.unwrap();
    });
    // SAFETY: dst is a live allocation of N bytes nobody else touches.
    unsafe { rx.recv(dst, N as u64, &mut b) }.unwrap();
    t.join().unwrap();
    // SAFETY: host memory, every copy complete.
    let got = unsafe { std::slice::from_raw_parts(dst.0 as *const u8, N) };
    assert!(got == &produced[..], "the bytes sent are the ones the producer wrote");
    dev.stream_synchronize(&app).unwrap();
}

/// The default stream (handle 0) is a stream like any other; an unknown handle is an error.
#[test]
fn external_handles_resolve_or_fail() {
    let dev = StandIn::new(1, StandInConfig::default());
    let e = dev.create_event().unwrap();
    dev.record_external(&e, 0).unwrap();
    dev.synchronize(&e).unwrap();
    let err = dev.record_external(&e, 0xdead_beef).unwrap_err();
    assert!(err.to_string().contains("0xdeadbeef"), "{err}");
    let other = StandIn::new(2, StandInConfig::default());
    let s = other.create_stream().unwrap();
    assert!(dev.record_external(&e, other.stream_handle(&s)).is_err(), "a stream of another device");
}

/// A copy whose event record failed is tracked by no event: the failed transfer must still not
/// return while it runs (it would be reused or freed under the DMA).
#[test]
fn a_failed_record_leaves_no_copy_running() {
    let dev = StandIn::new(0, StandInConfig::uniform(20e6)); // 256 KiB: ~13 ms per copy
    let src = dev.alloc(1 << 20).unwrap();
    let pool = PoolConfig { buffers: 2, buffer_size: 256 << 10 };
    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let (mut a, _b) = mem_pair(None);
    dev.fail_in(FailOp::Record, 1);
    // SAFETY: src is live; the wire's other end is never read, but the failure comes first.
    let r = unsafe { tx.send(src, 1 << 20, &mut a) };
    assert!(r.is_err(), "the injected record failure surfaces");
    assert_eq!(dev.copies_in_flight(), 0, "no copy runs once the failed send has returned");
    drop(tx);
    assert_eq!(dev.copies_in_flight(), 0);
}

/// A pool whose setup fails half-way frees what it pinned.
#[test]
fn a_failing_event_creation_leaks_no_pinned_buffer() {
    let dev = StandIn::new(0, StandInConfig::default());
    dev.fail_in(FailOp::CreateEvent, 2);
    let r = Staged::new(dev.clone(), Role::Sender, PoolConfig { buffers: 4, buffer_size: 4096 });
    assert!(r.is_err());
    assert_eq!(dev.live_allocs(), 0, "every pinned buffer of the failed pool is freed");
    dev.fail_in(FailOp::AllocPinned, 3);
    assert!(Staged::new(dev.clone(), Role::Receiver, PoolConfig { buffers: 4, buffer_size: 4096 }).is_err());
    assert_eq!(dev.live_allocs(), 0);
}
