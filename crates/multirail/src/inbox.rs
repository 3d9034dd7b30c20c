//! Notifications received from peers, queued for the application until it takes them.
//!
//! An application either polls ([`Inbox::take`] with no wait, NIXL's `getNotifs`) or sleeps
//! until one arrives ([`Inbox::take`] with a wait): a decode process that waits for a layer's
//! notification then costs one wake-up per batch of notifications, where a poll loop every
//! 100 us costs ~10,000 wake-ups a second on the cores the transfers need.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Most notifications of one peer queued and not yet taken by the application, and most bytes of
/// them: a peer's notifications beyond either are refused (`Status::Busy`) rather than grown
/// without bound by the wire, and one peer cannot fill the queue for the others. The
/// initiator's transfer, whose data landed, completes anyway; its link holds the notification
/// and sends it again until it is taken (`Link::notifier`); a `send_notif` refused fails.
pub const PEER_MAX_QUEUED: usize = 1 << 16;
pub const PEER_MAX_QUEUED_BYTES: usize = 64 << 20;
/// Most notifications (and bytes) queued from all peers together.
pub const MAX_QUEUED: usize = 4 * PEER_MAX_QUEUED;
pub const MAX_QUEUED_BYTES: usize = 4 * PEER_MAX_QUEUED_BYTES;

#[derive(Default)]
pub struct Inbox {
    q: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    msgs: Vec<(String, Vec<u8>)>,
    /// Bytes of `msgs`' messages.
    bytes: usize,
    /// Notifications and bytes of `msgs` by peer (at most one entry per queued message).
    per_peer: std::collections::HashMap<String, (usize, usize)>,
    closed: bool,
}

impl Inbox {
    /// Queue a peer's notification and wake the waiters; refused (with why) when the queue
    /// holds [`MAX_QUEUED`] notifications or this one would take it past [`MAX_QUEUED_BYTES`].
    pub fn push(&self, peer: String, msg: Vec<u8>) -> Result<(), String> {
        let mut g = self.q.lock().expect("inbox lock");
        let (n, b) = g.per_peer.get(&peer).copied().unwrap_or_default();
        if n >= PEER_MAX_QUEUED || b + msg.len() > PEER_MAX_QUEUED_BYTES {
            return Err(format!(
                "notification queue full for {peer:?}: {n} notifications ({b} bytes) from it not taken by the application yet (at most {PEER_MAX_QUEUED}, {PEER_MAX_QUEUED_BYTES} bytes per peer)"
            ));
        }
        if g.msgs.len() >= MAX_QUEUED || g.bytes + msg.len() > MAX_QUEUED_BYTES {
            return Err(format!(
                "notification queue full: {} notifications ({} bytes) not taken by the application yet (at most {MAX_QUEUED}, {MAX_QUEUED_BYTES} bytes)",
                g.msgs.len(),
                g.bytes
            ));
        }
        g.bytes += msg.len();
        let e = g.per_peer.entry(peer.clone()).or_default();
        e.0 += 1;
        e.1 += msg.len();
        g.msgs.push((peer, msg));
        drop(g);
        self.cv.notify_all();
        Ok(())
    }

    /// Every notification queued, in arrival order. With an empty queue, wait up to `wait`
    /// for one to arrive (zero: return at once); an agent closing ends the wait early.
    pub fn take(&self, wait: Duration) -> Vec<(String, Vec<u8>)> {
        let mut g = self.q.lock().expect("inbox lock");
        if g.msgs.is_empty() && !wait.is_zero() {
            // A deadline, not one `wait_timeout`: a spurious wake-up must not end the wait early.
            let deadline = Instant::now().checked_add(wait);
            while g.msgs.is_empty() && !g.closed {
                let left = match deadline {
                    Some(d) => match d.checked_duration_since(Instant::now()) {
                        Some(left) if !left.is_zero() => left,
                        _ => break,
                    },
                    None => Duration::from_secs(3600),
                };
                g = self.cv.wait_timeout(g, left).expect("inbox lock").0;
            }
        }
        g.bytes = 0;
        g.per_peer.clear();
        std::mem::take(&mut g.msgs)
    }

    /// Wake every waiter and let no later wait sleep (the agent is closing). Queued
    /// notifications stay takeable.
    pub fn close(&self) {
        self.q.lock().expect("inbox lock").closed = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A thread waits up to 30 s on `inbox`; after 50 ms `wake` runs here. Returns what the
    /// wait took, having checked that it ended well before its timeout.
    fn wait_then(inbox: &Arc<Inbox>, wake: impl FnOnce(&Inbox)) -> Vec<(String, Vec<u8>)> {
        let i2 = inbox.clone();
        let t0 = Instant::now();
        let h = std::thread::spawn(move || i2.take(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(50));
        wake(inbox);
        let got = h.join().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(20), "the waiter woke only at its timeout");
        got
    }

    #[test]
    fn a_waiter_wakes_when_a_notification_arrives_not_at_its_timeout() {
        let inbox = Arc::new(Inbox::default());
        let got = wait_then(&inbox, |i| i.push("p".into(), b"m".to_vec()).unwrap());
        assert_eq!(got, vec![("p".to_string(), b"m".to_vec())]);
    }

    #[test]
    fn an_empty_wait_times_out_and_a_zero_wait_polls() {
        let inbox = Inbox::default();
        let t0 = Instant::now();
        assert!(inbox.take(Duration::ZERO).is_empty());
        assert!(inbox.take(Duration::from_millis(30)).is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(30));
        inbox.push("a".into(), vec![1]).unwrap();
        inbox.push("b".into(), vec![2]).unwrap();
        assert_eq!(inbox.take(Duration::ZERO).len(), 2, "all queued, in order");
        assert!(inbox.take(Duration::ZERO).is_empty());
    }

    #[test]
    fn a_full_queue_refuses_and_taking_makes_room() {
        let inbox = Inbox::default();
        for i in 0..PEER_MAX_QUEUED {
            inbox.push("p".into(), (i as u32).to_le_bytes().to_vec()).unwrap();
        }
        let e = inbox.push("p".into(), vec![0]).unwrap_err();
        assert!(e.contains("notification queue full") && e.contains("65536"), "{e}");
        let got = inbox.take(Duration::ZERO);
        assert_eq!(got.len(), PEER_MAX_QUEUED, "the queued ones are all kept");
        assert!(got.iter().enumerate().all(|(i, (_, m))| m[..] == (i as u32).to_le_bytes()), "in order");
        inbox.push("p".into(), vec![0]).unwrap();
        // By bytes: 64 x 1 MiB fill it; one more byte does not fit.
        inbox.take(Duration::ZERO);
        let mib = vec![7u8; 1 << 20];
        for _ in 0..PEER_MAX_QUEUED_BYTES >> 20 {
            inbox.push("p".into(), mib.clone()).unwrap();
        }
        assert!(inbox.push("p".into(), vec![1]).is_err());
        assert_eq!(inbox.take(Duration::ZERO).len(), PEER_MAX_QUEUED_BYTES >> 20);
        inbox.push("p".into(), mib).unwrap();
    }

    #[test]
    fn one_peer_cannot_fill_the_queue_for_the_others() {
        let inbox = Inbox::default();
        for _ in 0..PEER_MAX_QUEUED {
            inbox.push("noisy".into(), vec![]).expect("within its quota");
        }
        let e = inbox.push("noisy".into(), vec![]).expect_err("over its quota");
        assert!(e.contains("per peer") && e.contains("noisy"), "{e}");
        inbox.push("quiet".into(), b"layer 0".to_vec()).expect("another peer still queues");
        // All peers together: bounded by MAX_QUEUED.
        for k in 1..MAX_QUEUED / PEER_MAX_QUEUED {
            for _ in 0..PEER_MAX_QUEUED - usize::from(k == 1) {
                inbox.push(format!("p{k}"), vec![]).expect("within the total");
            }
        }
        let e = inbox.push("late".into(), vec![]).expect_err("over the total");
        assert!(e.contains("notification queue full:"), "{e}");
        assert_eq!(inbox.take(Duration::ZERO).len(), MAX_QUEUED);
        inbox.push("noisy".into(), vec![]).expect("taking makes room");
    }

    #[test]
    fn close_wakes_a_waiter_and_keeps_what_was_queued() {
        let inbox = Arc::new(Inbox::default());
        assert!(wait_then(&inbox, Inbox::close).is_empty());
        inbox.push("p".into(), vec![3]).unwrap();
        assert_eq!(inbox.take(Duration::from_secs(30)).len(), 1);
        let t1 = Instant::now();
        assert!(inbox.take(Duration::from_secs(30)).is_empty());
        assert!(t1.elapsed() < Duration::from_secs(20), "a closed inbox must not sleep");
    }
}
