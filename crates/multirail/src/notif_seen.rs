//! Exactly-once notifications at the target.
//!
//! A notification travels over the control connection as a request the target answers. When
//! the answer is lost (the connection dies after the target queued the notification), the
//! initiator sends it again, on another connection or rail (`Link::control_call`): without a
//! check the application would get it twice. vLLM counts notifications per request to decide
//! when the KV blocks may be freed, so a duplicate frees blocks another reader still uses.
//!
//! Each notification carries its sender's incarnation and a sequence number unique within that
//! incarnation (`Body::NotifSeq`); the target queues a (peer, incarnation, number) once. It
//! keeps the last [`WINDOW`] numbers per peer (a resend follows its first copy within the
//! request timeout, far fewer notifications later) and forgets a peer's older incarnation
//! when a newer one speaks.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::{Fault, FaultKind};

/// Sequence numbers remembered per peer.
pub const WINDOW: usize = 1 << 16;
/// Peers remembered; beyond this many the oldest entry is dropped.
const MAX_PEERS: usize = 1 << 14;

/// The next notification number of this process: unique per sender incarnation, which is
/// what the target keys on.
pub fn next_seq() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

struct Seen {
    incarnation: u64,
    /// Numbers below this were forgotten: a copy of one of them is a duplicate.
    floor: u64,
    nums: BTreeSet<u64>,
    last_used: u64,
}

pub struct NotifSeen {
    peers: Mutex<(HashMap<String, Seen>, u64)>,
    /// Fault injection (`lose_answer`): from `at` after the agent started, the answer to the
    /// next notification is lost once.
    lose_at: Option<Duration>,
    lost: AtomicBool,
    start: Instant,
}

impl NotifSeen {
    pub fn new(faults: &[Fault]) -> NotifSeen {
        NotifSeen {
            peers: Mutex::new((HashMap::new(), 0)),
            lose_at: faults.iter().filter(|f| f.kind == FaultKind::LoseAnswer).map(|f| f.at).min(),
            lost: AtomicBool::new(false),
            start: Instant::now(),
        }
    }

    /// Whether notification `seq` of `peer` in `incarnation` is new (then it is remembered);
    /// false for a copy already queued.
    pub fn first(&self, peer: &str, incarnation: u64, seq: u64) -> bool {
        let mut g = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let (map, clock) = &mut *g;
        *clock += 1;
        let now = *clock;
        if !map.contains_key(peer) && map.len() >= MAX_PEERS {
            if let Some(old) = map.iter().min_by_key(|(_, s)| s.last_used).map(|(k, _)| k.clone()) {
                map.remove(&old);
            }
        }
        let s = map.entry(peer.to_string()).or_insert(Seen { incarnation, floor: 0, nums: BTreeSet::new(), last_used: now });
        if s.incarnation != incarnation {
            *s = Seen { incarnation, floor: 0, nums: BTreeSet::new(), last_used: now };
        }
        s.last_used = now;
        if seq < s.floor || !s.nums.insert(seq) {
            return false;
        }
        while s.nums.len() > WINDOW {
            if let Some(min) = s.nums.pop_first() {
                s.floor = min + 1;
            }
        }
        true
    }

    /// Forget notification `seq` of `peer` in `incarnation` (it was refused, not queued): a
    /// copy sent again is then queued.
    pub fn forget(&self, peer: &str, incarnation: u64, seq: u64) {
        let mut g = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = g.0.get_mut(peer).filter(|s| s.incarnation == incarnation) {
            s.nums.remove(&seq);
        }
    }

    /// Fault injection: whether the answer to the notification being served now is to be lost
    /// (the notification is queued, the connection closed unanswered). Once.
    pub fn lose_answer(&self) -> bool {
        match self.lose_at {
            Some(at) if self.start.elapsed() >= at => !self.lost.swap(true, Ordering::AcqRel),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_dropped_per_peer_and_incarnation() {
        let s = NotifSeen::new(&[]);
        assert!(s.first("a", 1, 5));
        assert!(!s.first("a", 1, 5));
        assert!(s.first("b", 1, 5), "another peer's number is its own");
        assert!(s.first("a", 2, 5), "a restarted peer numbers afresh");
        assert!(s.first("a", 2, 3), "out of order is not a copy");
        assert!(!s.first("a", 2, 3));
        for k in 0..WINDOW as u64 + 10 {
            s.first("c", 1, 100 + k);
        }
        assert!(!s.first("c", 1, 100), "forgotten numbers below the window are copies");
    }
}
