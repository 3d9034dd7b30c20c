//! The CUDA half: the same checks as tests/standin.rs, on a real GPU. Ignored in a plain
//! `cargo test` (no GPU in CI); `make test-gpu` runs them with `-- --ignored`.
//!
//! libcudart is found as `Cuda::open` says (MULTIRAIL_CUDART, MULTIRAIL_CUDA_WHEEL_DIRS, the
//! system); a machine without one fails these tests with the typed error, which is the point of
//! running them there.

use std::time::Instant;

use multirail_gpu::{mem_pair, CopyKind, Cuda, Device, DevicePtr, MemKind, PoolConfig, Role, Staged};

const MIB: usize = 1 << 20;

fn gpu() -> Cuda {
    match Cuda::open(0) {
        Ok(d) => {
            eprintln!("GPU 0: {} via {}", d.name(), d.runtime().path().display());
            d
        }
        Err(e) => panic!("{e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

/// Copies host bytes to a fresh device allocation (through a stream, synchronised).
fn upload(dev: &Cuda, data: &[u8]) -> DevicePtr {
    let p = dev.alloc(data.len()).unwrap();
    let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
    // SAFETY: p has data.len() bytes; data outlives the synchronize below.
    unsafe { dev.copy_async(CopyKind::HostToDevice, p.0, data.as_ptr() as u64, data.len(), &s) }.unwrap();
    dev.record(&e, &s).unwrap();
    dev.synchronize(&e).unwrap();
    p
}

fn download(dev: &Cuda, p: DevicePtr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
    // SAFETY: p has len bytes; out outlives the synchronize below.
    unsafe { dev.copy_async(CopyKind::DeviceToHost, out.as_mut_ptr() as u64, p.0, len, &s) }.unwrap();
    dev.record(&e, &s).unwrap();
    dev.synchronize(&e).unwrap();
    out
}

#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_memory_kinds_and_copies() {
    let dev = gpu();
    let data = pattern(3 * MIB + 5, 3);
    let a = upload(&dev, &data);
    let b = dev.alloc(data.len()).unwrap();
    let pinned = dev.alloc_pinned(data.len()).unwrap();
    assert_eq!(dev.pointer_kind(a.0).unwrap(), MemKind::Device { device: 0 });
    assert_eq!(dev.pointer_kind(pinned.addr()).unwrap(), MemKind::Host);
    assert_eq!(dev.pointer_kind(data.as_ptr() as u64).unwrap(), MemKind::Unregistered);
    let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
    // SAFETY: all ranges are allocations of data.len() bytes, synchronised before use.
    unsafe {
        dev.copy_async(CopyKind::DeviceToDevice, b.0, a.0, data.len(), &s).unwrap();
        dev.copy_async(CopyKind::DeviceToHost, pinned.addr(), b.0, data.len(), &s).unwrap();
    }
    dev.record(&e, &s).unwrap();
    dev.synchronize(&e).unwrap();
    assert!(dev.query(&e).unwrap());
    // SAFETY: the copy into it completed.
    assert!(unsafe { pinned.as_slice() } == &data[..]);
    let h = dev.ipc_handle(a).unwrap();
    assert_ne!(h.0, [0u8; 64]);
    // SAFETY: nothing uses them any more.
    unsafe {
        dev.free_pinned(pinned).unwrap();
        dev.free(a).unwrap();
        dev.free(b).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_staged_vram_to_vram_bytes_exact() {
    let dev = gpu();
    let pool = PoolConfig { buffers: 4, buffer_size: MIB as u64 };
    let sizes = [1, 4095, MIB, 3 * MIB + 17, 64 * MIB + 1];
    let (mut wa, mut wb) = mem_pair(None);
    let rxdev = dev.clone();
    let sizes2 = sizes.to_vec();
    let rx = std::thread::spawn(move || {
        let mut rx = Staged::new(rxdev.clone(), Role::Receiver, pool).unwrap();
        sizes2
            .iter()
            .map(|&n| {
                let dst = rxdev.alloc(n).unwrap();
                // SAFETY: dst is a device allocation of n bytes used by nothing else.
                unsafe { rx.recv(dst, n as u64, &mut wb) }.unwrap();
                let out = download(&rxdev, dst, n);
                // SAFETY: done with it.
                unsafe { rxdev.free(dst) }.unwrap();
                out
            })
            .collect::<Vec<_>>()
    });
    let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
    let mut want = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(n, i as u8);
        let src = upload(&dev, &data);
        // SAFETY: src is a device allocation of n bytes.
        let r = unsafe { tx.send(src, n as u64, &mut wa) }.unwrap();
        eprintln!("{n} B in {:?}", r.elapsed);
        // SAFETY: done with it.
        unsafe { dev.free(src) }.unwrap();
        want.push(data);
    }
    for (w, g) in want.iter().zip(rx.join().unwrap()) {
        assert!(*w == g, "size {} differs", w.len());
    }
}

/// Throughput of the staged path over an unlimited in-memory wire, with the observed
/// per-stage breakdown (for the bench's numbers; asserts only that bytes arrive).
#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_staged_throughput() {
    let dev = gpu();
    let len = 512 * MIB;
    for (buffers, size) in [(2, MIB), (4, 4 * MIB), (8, 4 * MIB)] {
        let pool = PoolConfig { buffers, buffer_size: size as u64 };
        let (mut wa, mut wb) = mem_pair(None);
        let src = upload(&dev, &pattern(len, 7));
        let dst = dev.alloc(len).unwrap();
        let rxdev = dev.clone();
        let rx = std::thread::spawn(move || {
            let mut rx = Staged::new(rxdev, Role::Receiver, pool).unwrap();
            // SAFETY: dst is a device allocation of len bytes used by nothing else.
            unsafe { rx.recv(dst, len as u64, &mut wb) }.unwrap()
        });
        let mut tx = Staged::new(dev.clone(), Role::Sender, pool).unwrap();
        let t0 = Instant::now();
        // SAFETY: src is a device allocation of len bytes.
        let sent = unsafe { tx.send(src, len as u64, &mut wa) }.unwrap();
        let got = rx.join().unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let mut ops = sent.ops.clone();
        ops.extend(got.ops.iter().filter(|o| o.stage != multirail_gpu::Stage::Wire));
        let b = multirail_gpu::pipeline::timeline(sent.started, ops).breakdown();
        eprintln!("pool {buffers} x {size} B: {:.2} GB/s\n{b}", len as f64 / secs / 1e9);
        assert!(download(&dev, dst, len) == pattern(len, 7));
        // SAFETY: done with them.
        unsafe {
            dev.free(src).unwrap();
            dev.free(dst).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_uuid_is_the_one_nvidia_smi_names() {
    // cudaDeviceProp.uuid sits right after name[256]: a wrong offset reads name bytes (or
    // zeros). Each visible device has a distinct, non-zero UUID; with nvidia-smi present, it
    // lists the same UUID.
    let dev = gpu();
    let u = dev.uuid().expect("uuid");
    assert_ne!(u, [0u8; 16]);
    assert_ne!(&u[..], &dev.name().as_bytes()[..16.min(dev.name().len())]);
    let count = dev.runtime().device_count().unwrap();
    let all: Vec<[u8; 16]> = (0..count).map(|i| Cuda::open(i).unwrap().uuid().unwrap()).collect();
    let mut uniq = all.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), all.len(), "{all:?}");
    if let Ok(out) = std::process::Command::new("nvidia-smi").arg("-L").output() {
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.success() && text.contains("UUID") && std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() {
            assert!(text.contains(&multirail_gpu::uuid_string(&u)), "{} not in nvidia-smi -L:\n{text}", multirail_gpu::uuid_string(&u));
        }
    }
}

/// Scattered page copies (KV pages in shuffled order, as CUDA IPC queues them), each way of
/// queueing them (`MULTIRAIL_CUDA_COPY`): one `cudaMemcpyAsync` per copy, `cudaMemcpyBatchAsync`
/// (12.8+), and the gather kernel (from the fatbin: SASS or PTX JIT). Every byte lands where it belongs,
/// also for pieces that are not 16-byte aligned (the kernel's byte path); the kernel and the
/// batch take the ways asked for on a real GPU. Prints each way's rate.
#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_page_copies_by_kernel_batch_and_loop_land_byte_exact() {
    use multirail_gpu::{CopyHow, CopyMode};
    let dev = gpu();
    eprintln!("runtime {}", dev.runtime().runtime_version());
    // (piece bytes, pieces, gap between pieces): the gap makes every piece unaligned when odd.
    for (page, pages, skew) in [(4096usize, 4096usize, 0usize), (65536, 2048, 0), (4099, 512, 5)] {
        let stride = page + skew;
        let len = stride * pages;
        let data = pattern(len, 11);
        let src = upload(&dev, &data);
        let dst = dev.alloc(len).unwrap();
        // Piece i of src goes to slot perm[i] of dst (a fixed shuffle: nothing adjacent).
        let perm: Vec<usize> = (0..pages).map(|i| (i * 1021 + 7) % pages).collect();
        let copies: Vec<multirail_gpu::BatchCopy> = (0..pages)
            .map(|i| (CopyKind::DeviceToDevice, dst.0 + (perm[i] * stride + skew) as u64, src.0 + (i * stride) as u64, page))
            .collect();
        let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
        let mut want = vec![0u8; len];
        for i in 0..pages {
            want[perm[i] * stride + skew..][..page].copy_from_slice(&data[i * stride..][..page]);
        }
        let mut rates = Vec::new();
        for mode in [CopyMode::Loop, CopyMode::Batch, CopyMode::Kernel] {
            let zero = vec![0u8; len];
            // SAFETY: dst has len bytes; zero outlives the synchronize.
            unsafe { dev.copy_async(CopyKind::HostToDevice, dst.0, zero.as_ptr() as u64, len, &s) }.unwrap();
            dev.record(&e, &s).unwrap();
            dev.synchronize(&e).unwrap();
            let mut best = f64::MAX;
            let mut q = None;
            for _ in 0..3 {
                let t0 = Instant::now();
                // SAFETY: every copy lies inside src and dst, and no two destinations overlap.
                q = Some(unsafe { dev.copy_batch_as(mode, &copies, &s) }.unwrap());
                dev.record(&e, &s).unwrap();
                dev.synchronize(&e).unwrap();
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let q = q.unwrap();
            rates.push(format!(
                "{mode:?}: {:?} in {} calls{}, {:.2} us/piece, {:.1} GB/s",
                q.how,
                q.calls,
                q.note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default(),
                best * 1e6 / pages as f64,
                (page * pages) as f64 / best / 1e9
            ));
            assert!(download(&dev, dst, len) == want, "{mode:?}: {page}-byte pieces landed wrong");
            match mode {
                CopyMode::Kernel => assert_eq!(q.how, CopyHow::Kernel, "the gather kernel did not run: {:?}", q.note),
                CopyMode::Batch if dev.runtime().runtime_version() >= 12080 => {
                    assert_eq!((q.how, q.calls), (CopyHow::Batch, 1), "{:?}", q.note)
                }
                CopyMode::Loop => assert_eq!((q.how, q.calls), (CopyHow::PerCopy, pages)),
                _ => {}
            }
        }
        eprintln!("{pages} x {page} B pieces (skew {skew}):\n  {}", rates.join("\n  "));
        // SAFETY: done with them.
        unsafe {
            dev.free(src).unwrap();
            dev.free(dst).unwrap();
        }
    }
}

/// Scattered pages gathered into one pinned buffer and scattered back out of it (what a staged
/// vectored request does with each buffer's worth): with `pinned`, the gather kernel reads and
/// writes the pinned buffer by its host address (unified addressing), one launch per batch.
/// Every byte lands where it belongs, aligned and unaligned pieces alike; prints the rates
/// against one `cudaMemcpyAsync` per page.
#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_pages_gathered_into_and_scattered_from_pinned_memory() {
    use multirail_gpu::{CopyHow, CopyMode};
    let dev = gpu();
    // One staging buffer's worth (1 MiB) of 8 and 4 KiB pages, unaligned pages, and 16 MiB of
    // 8 KiB pages (the rate without the fixed cost of a launch and its wait).
    for (page, pages, skew) in [(8192usize, 128usize, 0usize), (4096, 256, 0), (4099, 200, 3), (8192, 2048, 0)] {
        let stride = page + skew;
        let len = stride * pages;
        let data = pattern(len, 21);
        let src = upload(&dev, &data);
        let back = dev.alloc(len).unwrap();
        let pin = dev.alloc_pinned(page * pages).unwrap();
        let perm: Vec<usize> = (0..pages).map(|i| (i * 37 + 11) % pages).collect();
        // Buffer slot i holds source page perm[i].
        let gather: Vec<multirail_gpu::BatchCopy> = (0..pages)
            .map(|i| (CopyKind::DeviceToHost, pin.addr() + (i * page) as u64, src.0 + (perm[i] * stride + skew) as u64, page))
            .collect();
        // And goes back to the same place in `back`.
        let scatter: Vec<multirail_gpu::BatchCopy> = (0..pages)
            .map(|i| (CopyKind::HostToDevice, back.0 + (perm[i] * stride + skew) as u64, pin.addr() + (i * page) as u64, page))
            .collect();
        let (s, e) = (dev.create_stream().unwrap(), dev.create_event().unwrap());
        let mut rates = Vec::new();
        for mode in [CopyMode::Loop, CopyMode::Auto] {
            let zero = vec![0u8; len];
            // SAFETY: `back` has len bytes; zero outlives the synchronize.
            unsafe { dev.copy_async(CopyKind::HostToDevice, back.0, zero.as_ptr() as u64, len, &s) }.unwrap();
            dev.record(&e, &s).unwrap();
            dev.synchronize(&e).unwrap();
            // Best of 3 (the first launch of a way pays its setup): (seconds, how it was queued).
            let best_of_3 = |copies: &[multirail_gpu::BatchCopy]| {
                let mut best = (f64::MAX, None);
                for _ in 0..3 {
                    let t0 = Instant::now();
                    // SAFETY: every copy lies inside src/back and the pinned buffer, none overlap.
                    let q = unsafe { dev.copy_batch_with(mode, copies, true, &s) }.unwrap();
                    dev.record(&e, &s).unwrap();
                    dev.synchronize(&e).unwrap();
                    best = (best.0.min(t0.elapsed().as_secs_f64()), Some(q));
                }
                (best.0, best.1.unwrap())
            };
            let (t_gather, q) = best_of_3(&gather);
            // SAFETY: the gather has completed.
            let staged = unsafe { pin.as_slice() };
            for (i, p) in perm.iter().enumerate() {
                let at = p * stride + skew;
                assert!(staged[i * page..][..page] == data[at..][..page], "{mode:?}: page {i} gathered wrong");
            }
            let (t_scatter, q2) = best_of_3(&scatter);
            let got = download(&dev, back, len);
            for (i, p) in perm.iter().enumerate() {
                let at = p * stride + skew;
                assert!(got[at..][..page] == data[at..][..page], "{mode:?}: page {i} scattered wrong");
            }
            if mode == CopyMode::Auto {
                assert_eq!((q.how, q2.how), (CopyHow::Kernel, CopyHow::Kernel), "{:?} {:?}", q.note, q2.note);
            }
            let gbps = |t: f64| (page * pages) as f64 / t / 1e9;
            rates.push(format!(
                "{mode:?}: gather {:?} {:.1} GB/s, scatter {:?} {:.1} GB/s",
                q.how,
                gbps(t_gather),
                q2.how,
                gbps(t_scatter)
            ));
        }
        eprintln!("{pages} x {page} B pages (skew {skew}) through pinned memory:\n  {}", rates.join("\n  "));
        // SAFETY: done with them (the stream is idle).
        unsafe {
            dev.free(src).unwrap();
            dev.free(back).unwrap();
            dev.free_pinned(pin).unwrap();
        }
    }
}

/// The gather kernel loads from the fatbin on a real GPU: SASS when the fatbin has the
/// device's architecture (sm_80/90/100/120 and their later minors), the fatbin's PTX JIT
/// otherwise; never the plain-PTX fallback or nothing (docs/gpu.md, "Kernel images").
#[test]
#[ignore = "needs a GPU: run with make test-gpu"]
fn cuda_gather_kernel_loads_from_the_fatbin() {
    let dev = gpu();
    let image = dev.gather_kernel().expect("the gather kernel loads");
    eprintln!("gather kernel on {}: {image}", dev.name());
    assert!(image.ends_with("(fatbin)"), "{image}");
    assert_eq!(dev.gather_kernel(), Ok(image), "loaded once, the same answer");
}
