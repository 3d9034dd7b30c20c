//! `Faulty<T>`: any transport with faults injected on a schedule, so failover runs the same code
//! as production without a network to break (smoltcp's `FaultInjector` is the model).
//!
//! A schedule is a list of [`Fault`]s, each on one rail, from `at` after the link opened, for
//! `dur` (or for good):
//! - `kill`: the rail's paths are shut (as a dead NIC would make them), and reopening it is
//!   refused until the fault ends; the probe then readmits it.
//! - `blackhole`: the rail goes on carrying bytes but nothing it finishes is reported, and it
//!   shows no progress: only the planner's stall rule can find it (as a path that silently drops).
//! - `slow=D`: every completion on the rail is reported D late (a slow or congested rail).
//!
//! Written `RAIL:KIND@AT[+DUR]`, comma-separated: `1:kill@200ms+1s,0:slow=2ms@0`. On a link of
//! mixed rails, `RAIL/TRANSPORT:...` (`1/ucx:kill@200ms+2s`) wraps only that transport inside
//! `Mixed`: the rail's ucx path is killed and refused while its tcp fallback works.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Caps, Host, Transport, Verdict};
use crate::error::{Error, Result};
use crate::xfer::XferShared;

/// The schedule's types live with the configuration that carries them.
pub use crate::config::{Fault, FaultKind};

/// A transport with a fault schedule.
pub(crate) struct Faulty<T> {
    inner: T,
    faults: Vec<Fault>,
    start: Instant,
    timer: AtomicBool,
    /// Kills already carried out (index into `faults`).
    killed: Mutex<Vec<usize>>,
}

impl<T: Transport> Faulty<T> {
    pub(crate) fn new(inner: T, faults: Vec<Fault>) -> Faulty<T> {
        Faulty { inner, faults, start: Instant::now(), timer: AtomicBool::new(false), killed: Mutex::new(Vec::new()) }
    }

    fn active(&self, ri: usize) -> impl Iterator<Item = (usize, &Fault)> {
        let since = self.start.elapsed();
        self.faults.iter().enumerate().filter(move |(_, f)| f.rail == ri && f.active(since))
    }

    /// Carry out kills that are due (from the timer thread). A rail that is not up now (still
    /// opening, or a mixed link's rail on its other transport) is killed when it comes up while
    /// the fault lasts: an open that began before the fault and ended inside it would otherwise
    /// escape it. A rail that stays down is only refused reopening here.
    fn kill_due(&self, link: &dyn Host) {
        for ri in 0..link.rails() {
            for (i, f) in self.active(ri) {
                if f.kind == FaultKind::Kill && self.inner.is_up(ri) {
                    let mut k = self.killed.lock().expect("fault lock");
                    if !k.contains(&i) {
                        k.push(i);
                        drop(k);
                        link.rail_failed(ri, "fault injected: rail killed".into());
                    }
                }
            }
        }
    }
}

impl<T: Transport + 'static> Transport for Faulty<T> {
    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn rail_caps(&self, ri: usize) -> Caps {
        self.inner.rail_caps(ri)
    }

    fn choice(&self, ri: usize) -> Option<(String, super::RailChoice)> {
        self.inner.choice(ri).map(|(what, c)| (format!("faulty({what})"), c))
    }

    fn tick(&self, link: &dyn Host) {
        self.inner.tick(link)
    }

    fn gpu_detail(&self) -> Option<String> {
        self.inner.gpu_detail()
    }

    fn open_rail(&self, link: &Arc<dyn Host>, ri: usize, timeout: Duration) -> Result<()> {
        if self.active(ri).any(|(_, f)| f.kind == FaultKind::Kill) {
            return Err(Error::PeerLost { peer: link.peer_name().to_string(), reason: "fault injected: rail killed".into() });
        }
        self.inner.open_rail(link, ri, timeout)?;
        if !self.timer.swap(true, Ordering::AcqRel) && self.faults.iter().any(|f| f.kind == FaultKind::Kill) {
            // Kills happen on time, whatever the traffic: a thread of their own, until shutdown
            // or the last kill is done. It holds a weak reference: the link's life is its own.
            let weak = Arc::downgrade(link);
            std::thread::Builder::new()
                .name("mr-faults".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_millis(5));
                    let Some(l) = weak.upgrade() else { return };
                    if l.is_shutdown() {
                        return;
                    }
                    l.tick_faults();
                })
                .map_err(|e| Error::io("spawn", e))?;
        }
        Ok(())
    }

    fn is_up(&self, ri: usize) -> bool {
        self.inner.is_up(ri)
    }

    fn post_ready(&self, link: &dyn Host, will_drive: bool) -> bool {
        self.inner.post_ready(link, will_drive)
    }

    fn drive(&self, link: &dyn Host, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        // A blackholed or slowed rail must not be bypassed by a caller reading its own answers.
        if (0..link.rails()).any(|ri| self.active(ri).any(|(_, f)| matches!(f.kind, FaultKind::Blackhole | FaultKind::Slow(_)))) {
            return false;
        }
        self.inner.drive(link, x, deadline, poll_only)
    }

    fn holds(&self, x: &Arc<XferShared>) -> bool {
        self.inner.holds(x)
    }

    fn holds_on(&self, ri: usize, x: &Arc<XferShared>) -> bool {
        self.inner.holds_on(ri, x)
    }

    fn shut_rail(&self, ri: usize) {
        self.inner.shut_rail(ri)
    }

    fn fence_ids(&self, ri: usize) -> Vec<[u8; 16]> {
        self.inner.fence_ids(ri)
    }

    fn paths(&self, ri: usize) -> usize {
        self.inner.paths(ri)
    }

    fn describe(&self, ri: usize) -> String {
        format!("faulty({})", self.inner.describe(ri))
    }

    fn quiet_for(&self, ri: usize) -> Option<Duration> {
        if self.active(ri).any(|(_, f)| f.kind == FaultKind::Blackhole) {
            return None;
        }
        self.inner.quiet_for(ri)
    }

    fn held_back(&self, ri: usize) -> bool {
        !self.active(ri).any(|(_, f)| f.kind == FaultKind::Blackhole) && self.inner.held_back(ri)
    }

    fn path_dead(&self, ri: usize) -> bool {
        self.inner.path_dead(ri)
    }

    fn evidence(&self, ri: usize) -> Option<String> {
        self.inner.evidence(ri)
    }

    fn verdict(&self, ri: usize) -> Verdict {
        let mut v = Verdict::Deliver;
        for (_, f) in self.active(ri) {
            match f.kind {
                FaultKind::Blackhole => return Verdict::Drop,
                FaultKind::Slow(d) => v = Verdict::Delay(d),
                FaultKind::Kill | FaultKind::LoseAnswer => {}
            }
        }
        v
    }

    fn tick_faults(&self, link: &dyn Host) {
        self.kill_due(link);
        self.inner.tick_faults(link)
    }

    fn wake(&self) {
        self.inner.wake()
    }

    fn close(&self) {
        self.inner.close()
    }
}
