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
//! Written `RAIL:KIND@AT[+DUR]`, comma-separated: `1:kill@200ms+1s,0:slow=2ms@0`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Caps, Transport, Verdict};
use crate::error::{Error, Result};
use crate::link::Link;
use crate::xfer::XferShared;

/// What a fault does to its rail (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Kill,
    Blackhole,
    Slow(Duration),
}

/// One scheduled fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rail: usize,
    pub kind: FaultKind,
    /// From when (after the link opened).
    pub at: Duration,
    /// For how long; None: for good.
    pub dur: Option<Duration>,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("bad duration {s:?} (e.g. 200ms, 1.5s)"))?;
    if !(0.0..=86_400.0).contains(&(v * scale)) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

impl Fault {
    /// Parse a schedule: `RAIL:KIND@AT[+DUR]`, comma-separated (see the module docs).
    pub fn parse_list(s: &str) -> std::result::Result<Vec<Fault>, String> {
        s.split(',').map(str::trim).filter(|f| !f.is_empty()).map(Fault::parse).collect()
    }

    pub fn parse(s: &str) -> std::result::Result<Fault, String> {
        let bad = || format!("fault {s:?} is not RAIL:KIND@AT[+DUR] (KIND: kill, blackhole, slow=DELAY)");
        let (rail, rest) = s.split_once(':').ok_or_else(bad)?;
        let rail: usize = rail.trim().parse().map_err(|_| bad())?;
        let (kind, when) = rest.split_once('@').ok_or_else(bad)?;
        let kind = match kind.trim() {
            "kill" => FaultKind::Kill,
            "blackhole" => FaultKind::Blackhole,
            k => match k.strip_prefix("slow=") {
                Some(d) => FaultKind::Slow(parse_duration(d)?),
                None => return Err(bad()),
            },
        };
        let (at, dur) = match when.split_once('+') {
            Some((a, d)) => (parse_duration(a)?, Some(parse_duration(d)?)),
            None => (parse_duration(when)?, None),
        };
        Ok(Fault { rail, kind, at, dur })
    }

    fn active(&self, since: Duration) -> bool {
        since >= self.at && self.dur.is_none_or(|d| since < self.at + d)
    }
}

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

    /// Carry out kills that are due (from the timer thread).
    fn tick(&self, link: &Link) {
        for ri in 0..link.rails.len() {
            for (i, f) in self.active(ri) {
                if f.kind == FaultKind::Kill {
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

    fn gpu_detail(&self) -> Option<String> {
        self.inner.gpu_detail()
    }

    fn open_rail(&self, link: &Arc<Link>, ri: usize, timeout: Duration) -> Result<()> {
        if self.active(ri).any(|(_, f)| f.kind == FaultKind::Kill) {
            return Err(Error::PeerLost { peer: link.peer_name.clone(), reason: "fault injected: rail killed".into() });
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
                    l.with_transport(|t| t.tick_faults(&l));
                })
                .map_err(|e| Error::io("spawn", e))?;
        }
        Ok(())
    }

    fn is_up(&self, ri: usize) -> bool {
        self.inner.is_up(ri)
    }

    fn post_ready(&self, link: &Link, will_drive: bool) -> bool {
        self.inner.post_ready(link, will_drive)
    }

    fn drive(&self, link: &Link, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        // A blackholed or slowed rail must not be bypassed by a caller reading its own answers.
        if (0..link.rails.len()).any(|ri| self.active(ri).any(|(_, f)| f.kind != FaultKind::Kill)) {
            return false;
        }
        self.inner.drive(link, x, deadline, poll_only)
    }

    fn holds(&self, x: &Arc<XferShared>) -> bool {
        self.inner.holds(x)
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

    fn verdict(&self, ri: usize) -> Verdict {
        let mut v = Verdict::Deliver;
        for (_, f) in self.active(ri) {
            match f.kind {
                FaultKind::Blackhole => return Verdict::Drop,
                FaultKind::Slow(d) => v = Verdict::Delay(d),
                FaultKind::Kill => {}
            }
        }
        v
    }

    fn tick_faults(&self, link: &Link) {
        self.tick(link)
    }

    fn wake(&self) {
        self.inner.wake()
    }

    fn close(&self) {
        self.inner.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schedules() {
        let f = Fault::parse_list("1:kill@200ms+1s, 0:slow=2ms@0,2:blackhole@1.5s").unwrap();
        assert_eq!(f[0], Fault { rail: 1, kind: FaultKind::Kill, at: Duration::from_millis(200), dur: Some(Duration::from_secs(1)) });
        assert_eq!(f[1], Fault { rail: 0, kind: FaultKind::Slow(Duration::from_millis(2)), at: Duration::ZERO, dur: None });
        assert_eq!(f[2].kind, FaultKind::Blackhole);
        assert_eq!(f[2].at, Duration::from_millis(1500));
        for bad in ["kill@1s", "x:kill@1s", "1:boom@1s", "1:kill", "1:kill@-1s", "1:slow=@1s", "1:kill@1s+forever"] {
            assert!(Fault::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn windows() {
        let f = Fault { rail: 0, kind: FaultKind::Kill, at: Duration::from_secs(1), dur: Some(Duration::from_secs(2)) };
        assert!(!f.active(Duration::from_millis(999)));
        assert!(f.active(Duration::from_secs(1)));
        assert!(f.active(Duration::from_millis(2999)));
        assert!(!f.active(Duration::from_secs(3)));
    }
}
