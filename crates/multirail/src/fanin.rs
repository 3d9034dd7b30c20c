//! Fan-in shares: the target bounds how much each peer may have in flight towards it on a rail.
//!
//! Many initiators writing into one target through one bottleneck queue (a shaped link, a
//! switch port) are TCP flows competing in that queue. Without a fair-queueing discipline in
//! it, the flows that lose packets back off (on a sender's local qdisc: to a probe timer that
//! doubles up to seconds) while the others keep the queue full, and the peers' shares drift
//! apart (docs/benchmarks.md, "Issue 22: many peers (session 9)").
//!
//! The target is the one place that sees every peer of a rail. With a per-rail budget `B`
//! (`Config::fan_in_window`, bytes), each of the `n` data connections accepted on that rail's
//! listener gets a receive window of about `max(MIN_SHARE, B / n)`: its receive buffer set to
//! the share (which stops the kernel's receive-buffer autotuning) and `TCP_WINDOW_CLAMP`; the
//! window the kernel then offers is between one and two shares (see [`set_window`]).
//! Window-limited flows through one FIFO with the same round-trip time move at the same rate,
//! and while what they have in flight fits in the bottleneck's queue nothing is dropped. Every
//! share on the rail is recomputed when a connection joins or leaves, so the budget follows the
//! number of peers. `B = 0` (the default) leaves sockets as the kernel sets them.
//!
//! `B` bounds the rail's throughput to `B / RTT`: it must be at least the rail's
//! bandwidth-delay product (2 Gbit/s x 1 ms = 250 KB; 100 Gbit/s x 50 us = 625 KB). On the
//! 2 x 2 Gbit/s testbed (tbf queue ~1.5 MB) 2 MiB measured best: docs/benchmarks.md.
//! Cost: two or three `setsockopt`s per connection on the rail at each join or leave (O(n) per
//! accept, O(n^2) while n peers connect), nothing on the data path.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

/// The smallest window a connection is given, whatever the number of peers: 16 KiB (about 11
/// segments at a 1500-byte MTU) keeps a connection out of the one-segment-at-a-time regime.
pub const MIN_SHARE: usize = 16 << 10;

/// A socket the shares can resize (a served connection).
pub trait Resizable: AsRawFd + Send + Sync {}
impl<T: AsRawFd + Send + Sync> Resizable for T {}

/// One rail's live data connections, by membership id.
type RailConns = Vec<(u64, Arc<dyn Resizable>)>;

/// The live data connections of each rail listener and the budget they share.
pub struct WindowShares {
    budget: usize,
    rails: Mutex<HashMap<usize, RailConns>>,
    next: Mutex<u64>,
}

/// A connection's membership in its rail's share; leaving (drop) re-grows the others' shares.
pub struct Member<'a> {
    shares: &'a WindowShares,
    listener: usize,
    id: u64,
}

impl Drop for Member<'_> {
    fn drop(&mut self) {
        self.shares.leave(self.listener, self.id);
    }
}

impl WindowShares {
    /// `budget`: bytes of receive window per rail, shared by its connections; 0: off.
    pub fn new(budget: usize) -> WindowShares {
        WindowShares { budget, rails: Mutex::new(HashMap::new()), next: Mutex::new(0) }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// The window each of `n` connections of one rail gets.
    pub fn share(&self, n: usize) -> usize {
        (self.budget / n.max(1)).max(MIN_SHARE)
    }

    /// Add `sock` (accepted on `listener`) to its rail's share and resize every connection of
    /// that rail. `None` when shares are off.
    pub fn join(&self, listener: usize, sock: Arc<dyn Resizable>) -> Option<Member<'_>> {
        if !self.enabled() {
            return None;
        }
        let id = {
            let mut g = self.next.lock().expect("shares id lock");
            *g += 1;
            *g
        };
        let mut g = self.rails.lock().expect("shares lock");
        let conns = g.entry(listener).or_default();
        conns.push((id, sock));
        self.apply(conns);
        Some(Member { shares: self, listener, id })
    }

    fn leave(&self, listener: usize, id: u64) {
        let mut g = self.rails.lock().expect("shares lock");
        if let Some(conns) = g.get_mut(&listener) {
            conns.retain(|(i, _)| *i != id);
            if conns.is_empty() {
                g.remove(&listener);
            } else {
                self.apply(conns);
            }
        }
    }

    /// Connections per rail listener now (tests, reports).
    pub fn counts(&self) -> Vec<(usize, usize)> {
        let g = self.rails.lock().expect("shares lock");
        let mut v: Vec<(usize, usize)> = g.iter().map(|(l, c)| (*l, c.len())).collect();
        v.sort();
        v
    }

    fn apply(&self, conns: &[(u64, Arc<dyn Resizable>)]) {
        let w = self.share(conns.len());
        for (_, s) in conns {
            // Best effort: a connection closing meanwhile fails here and leaves on its own.
            let _ = set_window(s.as_raw_fd(), w);
        }
    }
}

/// Bound a connected TCP socket's receive window to about `bytes`: its receive buffer set to
/// `bytes` (the kernel doubles it for its bookkeeping and stops autotuning it; the window it
/// offers is that buffer times the payload share of its segments' memory, 50% at first, more
/// once measured) and `TCP_WINDOW_CLAMP`. The buffer is the bound that holds: the clamp alone
/// is lifted by autotuning (measured on Linux 6.18: a 64 KiB clamp was 32 MiB after 2 s of
/// streaming), and even with the buffer fixed the kernel resets the clamp to what the buffer
/// allows when it re-measures that payload share (a 1 MiB clamp read back as 3.9 MiB with a
/// 4 MiB buffer). So the window ends between `bytes` and twice that. The buffer is set with
/// `SO_RCVBUFFORCE` where the process may (CAP_NET_ADMIN), else with `SO_RCVBUF`, which
/// the kernel caps at `net.core.rmem_max`: without the capability a share above that is cut to
/// it.
pub fn set_window(fd: RawFd, bytes: usize) -> std::io::Result<()> {
    let clamp = bytes.min(i32::MAX as usize / 4) as libc::c_int;
    let set = |level: libc::c_int, opt: libc::c_int, v: libc::c_int| -> std::io::Result<()> {
        // SAFETY: setsockopt on a descriptor the caller keeps open, with a c_int argument.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    let buf = clamp;
    if set(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, buf).is_err() {
        set(libc::SOL_SOCKET, libc::SO_RCVBUF, buf)?;
    }
    set(libc::IPPROTO_TCP, libc::TCP_WINDOW_CLAMP, clamp)
}

/// `TCP_WINDOW_CLAMP` of a socket as the kernel holds it (tests, diagnostics).
pub fn window_clamp(fd: RawFd) -> std::io::Result<usize> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized c_int.
    let r = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_WINDOW_CLAMP, &mut v as *mut libc::c_int as *mut libc::c_void, &mut len)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn pair(l: &TcpListener) -> (TcpStream, Arc<TcpStream>) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, Arc::new(s))
    }

    #[test]
    fn shares_split_the_budget_and_regrow_when_peers_leave() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let sh = WindowShares::new(1 << 20);
        let (_c1, s1) = pair(&l);
        let (_c2, s2) = pair(&l);
        let (_c3, s3) = pair(&l);
        let m1 = sh.join(1, s1.clone()).unwrap();
        assert_eq!(window_clamp(s1.as_raw_fd()).unwrap(), 1 << 20);
        let m2 = sh.join(1, s2.clone()).unwrap();
        // Another rail's connection does not count against rail 1.
        let m3 = sh.join(2, s3.clone()).unwrap();
        assert_eq!(sh.counts(), vec![(1, 2), (2, 1)]);
        assert_eq!(window_clamp(s1.as_raw_fd()).unwrap(), 512 << 10);
        assert_eq!(window_clamp(s2.as_raw_fd()).unwrap(), 512 << 10);
        assert_eq!(window_clamp(s3.as_raw_fd()).unwrap(), 1 << 20);
        drop(m1);
        assert_eq!(window_clamp(s2.as_raw_fd()).unwrap(), 1 << 20);
        assert_eq!(sh.counts(), vec![(1, 1), (2, 1)]);
        drop((m2, m3));
        assert!(sh.counts().is_empty());
    }

    #[test]
    fn shares_never_go_below_the_floor_and_off_touches_nothing() {
        let sh = WindowShares::new(64 << 10);
        assert_eq!(sh.share(1), 64 << 10);
        assert_eq!(sh.share(1000), MIN_SHARE);
        let off = WindowShares::new(0);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (_c, s) = pair(&l);
        let before = window_clamp(s.as_raw_fd()).unwrap();
        assert!(off.join(1, s.clone()).is_none());
        assert_eq!(window_clamp(s.as_raw_fd()).unwrap(), before);
    }
}
