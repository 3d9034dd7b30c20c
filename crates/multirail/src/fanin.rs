//! Fan-in shares: the target bounds how much each peer may have in flight towards it on a rail.
//!
//! Many initiators writing into one target through one bottleneck queue (a shaped link, a
//! switch port) are TCP flows competing in that queue. Without a fair-queueing discipline in
//! it, the flows that lose packets back off (on a sender's local qdisc: to a probe timer that
//! doubles up to seconds) while the others keep the queue full, and the peers' shares drift
//! apart (docs/benchmarks.md, "Issue 22: many peers (session 9)").
//!
//! The target is the one place that sees every peer of a rail. With a per-rail budget `B`,
//! shared by the `p` peers that have data connections on that rail's listener, each peer's
//! share is `B / p`, split evenly among its own `k` connections there: each gets a receive
//! window of about `max(MIN_SHARE, B / p / k)`: its receive buffer set to the share (which
//! stops the kernel's receive-buffer autotuning) and `TCP_WINDOW_CLAMP`; the window the kernel
//! then offers is between one and two shares (see [`set_window`]). Window-limited flows through
//! one FIFO with the same round-trip time move at the same rate, and while what they have in
//! flight fits in the bottleneck's queue nothing is dropped. Every share on the rail is
//! recomputed when a connection joins or leaves, so the budget follows the number of peers.
//! This is the receiver-side cure for incast that ICTCP (Wu et al., CoNEXT 2010) proposed, with
//! a fixed budget instead of a measured one.
//!
//! Shares are per peer, not per connection (issue 33): a peer that opens many (idle) data
//! connections divides only its own share among them, so it takes no more of the rail's window
//! from the others than a peer with one connection does. A peer is what [`peer_key`] says: the
//! authenticated name when the agent has a shared secret, else the remote IP address (names
//! are the peer's own claim then, and a hostile one could take a new one per connection).
//!
//! `Config::fan_in_window` ([`FanInWindow`]):
//! - `Auto` (the default): a rail's shares start once it has [`AUTO_MIN_CONNS`] data
//!   connections, with the budget [`auto_budget`] (`max(2 MiB, speed x 200 us)`); below that
//!   the sockets are the kernel's. With few flows TCP shares a FIFO well (8 -> 1 measured Jain
//!   0.98-0.999 without shares), and a lone peer is never capped. Once started, a rail's shares
//!   stay on (growing as peers leave) until its last connection leaves: the kernel's receive
//!   buffer autotuning cannot be given back to a socket whose buffer was set.
//! - `Bytes(B)`: that budget, from the first connection.
//! - `Off`: sockets as the kernel sets them.
//!
//! `B` bounds the rail's throughput to `B / RTT`: it must be at least the rail's
//! bandwidth-delay product (2 Gbit/s x 1 ms = 250 KB; 100 Gbit/s x 50 us = 625 KB; 400 Gbit/s x
//! 200 us = 10 MB, which is what `auto_budget` gives such a rail). On the 2 x 2 Gbit/s testbed
//! (tbf queue ~1.5 MB) 2 MiB measured best: docs/benchmarks.md.
//! Cost: two or three `setsockopt`s per connection on the rail at each join or leave while the
//! shares are on (O(n) per accept, O(n^2) while n peers connect), nothing on the data path.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use crate::config::FanInWindow;

/// The smallest window a connection is given, whatever the number of peers: 16 KiB (about 11
/// segments at a 1500-byte MTU) keeps a connection out of the one-segment-at-a-time regime.
pub const MIN_SHARE: usize = 16 << 10;

/// `FanInWindow::Auto` starts a rail's shares at this many data connections on it.
pub const AUTO_MIN_CONNS: usize = 16;

/// The smallest automatic budget: what measured best on 2 Gbit/s rails (2 MiB).
pub const AUTO_MIN_BUDGET: usize = 2 << 20;

/// The round-trip time the automatic budget covers at the rail's speed: 200 us, several times a
/// rail-optimized fabric's unloaded RTT (5-30 us), so the shares never cap a rail below its
/// speed there.
pub const AUTO_RTT_US: u64 = 200;

/// `FanInWindow::Auto`'s budget for a rail of `speed_mbps` (0: unknown, as on veth):
/// `max(AUTO_MIN_BUDGET, speed x AUTO_RTT_US)`.
pub fn auto_budget(speed_mbps: u64) -> usize {
    let bdp = speed_mbps.saturating_mul(AUTO_RTT_US) / 8; // Mbit/s x us / 8 = bytes
    usize::try_from(bdp).unwrap_or(usize::MAX).max(AUTO_MIN_BUDGET)
}

/// A socket the shares can resize (a served connection).
pub trait Resizable: AsRawFd + Send + Sync {}
impl<T: AsRawFd + Send + Sync> Resizable for T {}

/// Who a data connection counts as in its rail's shares: with a shared secret (`authenticated`),
/// the name it proved; without one, its remote IP address whatever the port (a name would be
/// the peer's own claim, new for every connection if it likes). `None` (the address is gone:
/// the connection is closing) counts as one peer of its own.
pub fn peer_key(authenticated: bool, name: &str, remote: Option<SocketAddr>) -> String {
    match (authenticated, remote) {
        (true, _) => format!("name {name}"),
        (false, Some(a)) => format!("addr {}", a.ip()),
        (false, None) => "addr ?".into(),
    }
}

/// A live data connection: its membership id, its peer ([`peer_key`]) and its socket.
struct Conn {
    id: u64,
    peer: String,
    sock: Arc<dyn Resizable>,
}

/// One rail's live data connections, and whether its shares are on.
#[derive(Default)]
struct RailConns {
    conns: Vec<Conn>,
    on: bool,
}

/// The live data connections of each rail listener and the budget they share.
pub struct WindowShares {
    policy: FanInWindow,
    /// Link speed (Mbit/s, 0 unknown) of each listener, by index (`Auto`'s budget).
    speeds: Vec<u64>,
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
    /// `speeds`: each listener's link speed in Mbit/s (0: unknown), by listener index.
    pub fn new(policy: FanInWindow, speeds: Vec<u64>) -> WindowShares {
        WindowShares { policy, speeds, rails: Mutex::new(HashMap::new()), next: Mutex::new(0) }
    }

    pub fn enabled(&self) -> bool {
        self.policy != FanInWindow::Off
    }

    /// The budget of listener `listener`'s rail (0 when off).
    pub fn budget(&self, listener: usize) -> usize {
        match self.policy {
            FanInWindow::Off => 0,
            FanInWindow::Bytes(b) => b,
            FanInWindow::Auto => auto_budget(self.speeds.get(listener).copied().unwrap_or(0)),
        }
    }

    /// Connections on a rail from which its shares start.
    fn min_conns(&self) -> usize {
        match self.policy {
            FanInWindow::Auto => AUTO_MIN_CONNS,
            _ => 1,
        }
    }

    /// The window of each of a peer's `conns` connections on listener `listener`'s rail, once
    /// on, while `peers` peers have connections there: the budget split evenly among the peers,
    /// each peer's part evenly among its connections.
    pub fn share(&self, listener: usize, peers: usize, conns: usize) -> usize {
        (self.budget(listener) / peers.max(1) / conns.max(1)).max(MIN_SHARE)
    }

    /// Add `sock` (accepted on `listener`, from `peer`: [`peer_key`]) to its rail's
    /// connections; once the rail's shares are on (or this connection turns them on), resize
    /// every connection of that rail. `None` when shares are off.
    pub fn join(&self, listener: usize, peer: String, sock: Arc<dyn Resizable>) -> Option<Member<'_>> {
        if !self.enabled() {
            return None;
        }
        let id = {
            let mut g = self.next.lock().expect("shares id lock");
            *g += 1;
            *g
        };
        let mut g = self.rails.lock().expect("shares lock");
        let rail = g.entry(listener).or_default();
        rail.conns.push(Conn { id, peer, sock });
        if rail.on || rail.conns.len() >= self.min_conns() {
            rail.on = true;
            self.apply(listener, &rail.conns);
        }
        Some(Member { shares: self, listener, id })
    }

    fn leave(&self, listener: usize, id: u64) {
        let mut g = self.rails.lock().expect("shares lock");
        if let Some(rail) = g.get_mut(&listener) {
            rail.conns.retain(|c| c.id != id);
            if rail.conns.is_empty() {
                g.remove(&listener);
            } else if rail.on {
                self.apply(listener, &rail.conns);
            }
        }
    }

    /// Connections per rail listener now, and whether its shares are on (tests, reports).
    pub fn counts(&self) -> Vec<(usize, usize, bool)> {
        let g = self.rails.lock().expect("shares lock");
        let mut v: Vec<(usize, usize, bool)> = g.iter().map(|(l, r)| (*l, r.conns.len(), r.on)).collect();
        v.sort();
        v
    }

    fn apply(&self, listener: usize, conns: &[Conn]) {
        let mut per_peer: HashMap<&str, usize> = HashMap::new();
        for c in conns {
            *per_peer.entry(c.peer.as_str()).or_default() += 1;
        }
        for c in conns {
            let w = self.share(listener, per_peer.len(), per_peer[c.peer.as_str()]);
            // Best effort: a connection closing meanwhile fails here and leaves on its own.
            let _ = set_window(c.sock.as_raw_fd(), w);
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
        let sh = WindowShares::new(FanInWindow::Bytes(1 << 20), vec![]);
        let (_c1, s1) = pair(&l);
        let (_c2, s2) = pair(&l);
        let (_c3, s3) = pair(&l);
        let m1 = sh.join(1, "a".into(), s1.clone()).unwrap();
        assert_eq!(window_clamp(s1.as_raw_fd()).unwrap(), 1 << 20);
        let m2 = sh.join(1, "b".into(), s2.clone()).unwrap();
        // Another rail's connection does not count against rail 1.
        let m3 = sh.join(2, "c".into(), s3.clone()).unwrap();
        assert_eq!(sh.counts(), vec![(1, 2, true), (2, 1, true)]);
        assert_eq!(window_clamp(s1.as_raw_fd()).unwrap(), 512 << 10);
        assert_eq!(window_clamp(s2.as_raw_fd()).unwrap(), 512 << 10);
        assert_eq!(window_clamp(s3.as_raw_fd()).unwrap(), 1 << 20);
        drop(m1);
        assert_eq!(window_clamp(s2.as_raw_fd()).unwrap(), 1 << 20);
        assert_eq!(sh.counts(), vec![(1, 1, true), (2, 1, true)]);
        drop((m2, m3));
        assert!(sh.counts().is_empty());
    }

    #[test]
    fn shares_never_go_below_the_floor_and_off_touches_nothing() {
        let sh = WindowShares::new(FanInWindow::Bytes(64 << 10), vec![]);
        assert_eq!(sh.share(0, 1, 1), 64 << 10);
        assert_eq!(sh.share(0, 1000, 1), MIN_SHARE);
        assert_eq!(sh.share(0, 1, 1000), MIN_SHARE);
        let off = WindowShares::new(FanInWindow::Off, vec![]);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (_c, s) = pair(&l);
        let before = window_clamp(s.as_raw_fd()).unwrap();
        assert!(off.join(1, "a".into(), s.clone()).is_none());
        assert_eq!(window_clamp(s.as_raw_fd()).unwrap(), before);
    }

    #[test]
    fn auto_starts_at_many_connections_with_a_budget_from_the_rail_speed() {
        assert_eq!(auto_budget(0), AUTO_MIN_BUDGET);
        assert_eq!(auto_budget(2_000), AUTO_MIN_BUDGET);
        assert_eq!(auto_budget(400_000), 10_000_000);
        // listener 0: unknown speed (2 MiB); listener 1: a 400 Gbit/s rail (10 MB)
        let sh = WindowShares::new(FanInWindow::Auto, vec![0, 400_000]);
        assert_eq!(sh.budget(1), 10_000_000);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut socks = Vec::new();
        let mut members = Vec::new();
        for _ in 0..AUTO_MIN_CONNS - 1 {
            let (c, s) = pair(&l);
            let before = window_clamp(s.as_raw_fd()).unwrap();
            members.push(sh.join(0, "one".into(), s.clone()).unwrap());
            // below the threshold: the kernel's socket, untouched
            assert_eq!(window_clamp(s.as_raw_fd()).unwrap(), before);
            socks.push((c, s));
        }
        assert_eq!(sh.counts(), vec![(0, AUTO_MIN_CONNS - 1, false)]);
        let (c, s) = pair(&l);
        members.push(sh.join(0, "one".into(), s.clone()).unwrap());
        socks.push((c, s));
        // the 16th connection turns the rail's shares on, for every connection of the rail
        let share = AUTO_MIN_BUDGET / AUTO_MIN_CONNS;
        assert_eq!(sh.counts(), vec![(0, AUTO_MIN_CONNS, true)]);
        for (_, s) in &socks {
            assert_eq!(window_clamp(s.as_raw_fd()).unwrap(), share);
        }
        // peers leaving: the shares stay on and grow
        members.truncate(4);
        assert_eq!(sh.counts(), vec![(0, 4, true)]);
        assert_eq!(window_clamp(socks[0].1.as_raw_fd()).unwrap(), AUTO_MIN_BUDGET / 4);
        members.clear();
        assert!(sh.counts().is_empty());
    }

    #[test]
    fn a_peers_many_connections_take_no_more_than_one_connection_would() {
        // Issue 33: shares were per connection, so one peer's idle connections shrank every
        // other peer's window. Peer "a" has one connection; next to it, peer "b" with one
        // connection and then with eight must leave "a" the same window.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let sh = WindowShares::new(FanInWindow::Bytes(1 << 20), vec![]);
        let (_ca, a) = pair(&l);
        let _ma = sh.join(1, "a".into(), a.clone()).unwrap();
        let mut b = Vec::new();
        let (c, s) = pair(&l);
        b.push((sh.join(1, "b".into(), s.clone()).unwrap(), c, s));
        assert_eq!(window_clamp(a.as_raw_fd()).unwrap(), 512 << 10);
        for _ in 0..7 {
            let (c, s) = pair(&l);
            b.push((sh.join(1, "b".into(), s.clone()).unwrap(), c, s));
        }
        assert_eq!(sh.counts(), vec![(1, 9, true)]);
        assert_eq!(window_clamp(a.as_raw_fd()).unwrap(), 512 << 10, "b's extra connections shrank a's window");
        // b's eight split b's half.
        for (_, _, s) in &b {
            assert_eq!(window_clamp(s.as_raw_fd()).unwrap(), 64 << 10);
        }
        // A third peer: a third each, whatever b holds.
        let (_cc, cs) = pair(&l);
        let mc = sh.join(1, "c".into(), cs.clone()).unwrap();
        assert_eq!(window_clamp(a.as_raw_fd()).unwrap(), (1 << 20) / 3);
        assert_eq!(window_clamp(cs.as_raw_fd()).unwrap(), (1 << 20) / 3);
        drop(mc);
        // b's connections leaving one by one: a keeps half until b's last one goes.
        while b.len() > 1 {
            b.pop();
            assert_eq!(window_clamp(a.as_raw_fd()).unwrap(), 512 << 10);
        }
        b.clear();
        assert_eq!(window_clamp(a.as_raw_fd()).unwrap(), 1 << 20);
    }

    #[test]
    fn a_peer_is_its_proven_name_with_a_secret_else_its_address() {
        let at = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        // Without a secret, names are claims: two connections from one address are one peer
        // whatever names they give, and one name from two addresses is two peers.
        assert_eq!(peer_key(false, "x", at("10.0.0.1:1000")), peer_key(false, "y", at("10.0.0.1:2000")));
        assert_ne!(peer_key(false, "x", at("10.0.0.1:1000")), peer_key(false, "x", at("10.0.0.2:1000")));
        // With one, the proven name.
        assert_eq!(peer_key(true, "x", at("10.0.0.1:1000")), peer_key(true, "x", at("10.0.0.2:1000")));
        assert_ne!(peer_key(true, "x", at("10.0.0.1:1000")), peer_key(true, "y", at("10.0.0.1:1000")));
        // A name can never pass for an address.
        assert_ne!(peer_key(true, "addr 10.0.0.1", None), peer_key(false, "", at("10.0.0.1:1")));
    }

    #[test]
    fn fan_in_window_settings_parse() {
        assert_eq!(FanInWindow::parse("auto"), Some(FanInWindow::Auto));
        assert_eq!(FanInWindow::parse("off"), Some(FanInWindow::Off));
        assert_eq!(FanInWindow::parse("0"), Some(FanInWindow::Off));
        assert_eq!(FanInWindow::parse("2MiB"), Some(FanInWindow::Bytes(2 << 20)));
        assert_eq!(FanInWindow::parse("512k"), Some(FanInWindow::Bytes(512 << 10)));
        assert_eq!(FanInWindow::parse("1048576"), Some(FanInWindow::Bytes(1 << 20)));
        assert_eq!(FanInWindow::parse("x"), None);
        assert_eq!(FanInWindow::parse("2Q"), None);
        assert_eq!(FanInWindow::parse("99999999999G"), None);
    }
}
