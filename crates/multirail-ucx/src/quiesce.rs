//! Process exit against UCX teardown on other threads.
//!
//! `exit()` runs the `atexit` handlers and then the ELF destructors of every loaded library,
//! UCX's among them (`ucs_async_global_cleanup` and the rest), while the process's other
//! threads still run. An object of this crate whose last owner is a thread of the application
//! (a serving thread that just left, a transport thread finishing after `close` returned) may be
//! in `ucp_worker_destroy` at that moment: seen as a SIGSEGV in `ucs_async_context_cleanup` of a
//! target that exited right after its last session ended (issue 22, one core dump in ~200 ucx
//! runs), and once as glibc's `double free or corruption` in an initiator at exit.
//!
//! So every teardown call into UCX (`ucp_worker_destroy`, `ucp_cleanup`, `ucp_ep_close_nbx`)
//! runs under a shared lock, and an `atexit` handler registered when UCX is first loaded (so it
//! runs before UCX's destructors) takes that lock exclusively, waiting up to [`EXIT_WAIT`] for
//! teardowns in progress, and never gives it back: a teardown that starts after that blocks
//! until the process is gone instead of racing the destructors.

use std::sync::{Once, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

/// How long `exit()` waits for UCX teardowns in progress on other threads.
pub const EXIT_WAIT: Duration = Duration::from_secs(5);

static TEARDOWN: RwLock<()> = RwLock::new(());
static HOOK: Once = Once::new();

/// Held around one teardown call into UCX. Never nested on one thread: a thread waiting for a
/// second shared hold behind the exit handler's exclusive one would wait out [`EXIT_WAIT`].
pub(crate) fn teardown() -> RwLockReadGuard<'static, ()> {
    TEARDOWN.read().unwrap_or_else(PoisonError::into_inner)
}

extern "C" fn at_exit() {
    let end = Instant::now() + EXIT_WAIT;
    loop {
        match TEARDOWN.try_write() {
            Ok(g) => {
                // Held until the process is gone.
                std::mem::forget(g);
                return;
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                std::mem::forget(p.into_inner());
                return;
            }
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < end => std::thread::sleep(Duration::from_millis(1)),
            Err(std::sync::TryLockError::WouldBlock) => return,
        }
    }
}

/// Registers the exit handler, once per process (when UCX is loaded: later than the loader's own
/// handler, so it runs before the libraries' destructors).
pub(crate) fn hook() {
    HOOK.call_once(|| {
        // SAFETY: registers a plain function with no captured state; a failure (out of atexit
        // slots) only leaves the race this guards against.
        let _ = unsafe { libc::atexit(at_exit) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exit handler waits for a teardown in progress, and a teardown that starts after it
    /// blocks (run in a child process: the handler never gives the lock back).
    #[test]
    fn exit_waits_for_a_teardown_in_progress() {
        if std::env::var_os("MR_QUIESCE_CHILD").is_some() {
            let (held, hold) = std::sync::mpsc::channel();
            let t = std::thread::spawn(move || {
                let g = teardown();
                held.send(()).expect("send");
                std::thread::sleep(Duration::from_millis(300));
                drop(g);
            });
            hold.recv().expect("recv");
            let t0 = Instant::now();
            at_exit();
            let waited = t0.elapsed();
            t.join().expect("join");
            assert!(waited >= Duration::from_millis(250), "did not wait: {waited:?}");
            assert!(TEARDOWN.try_read().is_err(), "a later teardown would not block");
            return;
        }
        let exe = std::env::current_exe().expect("exe");
        let out = std::process::Command::new(exe)
            .args(["--exact", "quiesce::tests::exit_waits_for_a_teardown_in_progress", "--nocapture"])
            .env("MR_QUIESCE_CHILD", "1")
            .output()
            .expect("child");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "{}", String::from_utf8_lossy(&out.stdout));
    }
}
