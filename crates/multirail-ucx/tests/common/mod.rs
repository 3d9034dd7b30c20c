//! Shared helpers: load UCX or skip, two workers on one host over UCX's tcp transport on `lo`,
//! a background progress thread for the passive side.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use multirail_ucx::{Context, ContextConfig, LoadOptions, ThreadMode, Ucx, Worker};

/// The `libucx` wheel in the repository's `.venv`, if installed (`pip install libucx-cu12`).
pub fn venv_wheel_dir() -> Option<PathBuf> {
    let venv_lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    std::fs::read_dir(venv_lib)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/libucx/lib"))
        .find(|p| p.join("libucp.so.0").is_file() || p.join("libucp.so").is_file())
}

/// Loads UCX as the environment says (`MULTIRAIL_UCX_LIB`, `MULTIRAIL_UCX_WHEEL_DIR`,
/// `MULTIRAIL_UCX_SYSTEM`), plus the `.venv` wheel. These tests are `#[ignore]`d in a plain
/// `cargo test` (no UCX may be installed) and run by `make test` (which installs the wheel) with
/// `-- --ignored`: there a missing UCX is a failure, never a silent pass.
pub fn load(test: &str) -> Ucx {
    let mut opts = LoadOptions::from_env();
    if let Some(dir) = venv_wheel_dir() {
        opts = opts.wheel_dir(dir);
    }
    match Ucx::load_with(&opts) {
        Ok(ucx) => {
            eprintln!("{test}: {}", ucx.info());
            ucx
        }
        Err(e) => panic!("{test}: no UCX could be loaded: {e}"),
    }
}

/// A context restricted to UCX's tcp transport on the loopback device, and its worker.
pub struct Side {
    pub ctx: Context,
    pub worker: Worker,
}

pub fn tcp_lo_config() -> ContextConfig {
    ContextConfig::new().tls("tcp").net_devices("lo").wakeup(true).name("mr-ucx-test")
}

pub fn side(ucx: &Ucx, mode: ThreadMode) -> Side {
    let ctx = Context::new(ucx, &tcp_lo_config()).expect("ucp_init (tcp on lo)");
    let worker = Worker::new(&ctx, mode).expect("ucp_worker_create");
    Side { ctx, worker }
}

/// Progresses a (passive) worker on a thread until dropped: what the target side of a real
/// transport does (tcp RMA is carried out by the target's worker).
pub struct Progressor {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Progressor {
    pub fn start(worker: &Worker) -> Progressor {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, w) = (stop.clone(), worker.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                if w.progress().expect("progress") == 0 {
                    w.wait_for_events(Duration::from_millis(5)).expect("wait_for_events");
                }
            }
        });
        Progressor { stop, handle: Some(handle) }
    }
}

impl Drop for Progressor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            h.join().expect("progress thread panicked");
        }
    }
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed).collect()
}
