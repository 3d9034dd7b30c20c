//! Sockets below every transport and above nothing: the authenticated handshake every
//! connection to a peer starts with (`dial`, whatever the transport and role), aborting a
//! connection (`abort_socket`), the local carrier check (`link_down`), the local rails as the
//! runtime uses them, and the mapping of a peer's refusal onto an [`Error`]. `peer`, `link`,
//! `server` and the transports all use it; it imports nothing of theirs.

use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status, HELLO_UCX_FEATURES, HELLO_VERSION};
use multirail_proto::Body;

use crate::auth;
use crate::error::{Error, Result};
use crate::registry::random_bytes;
use crate::wire::{self, WireError};

/// Socket timeout granularity: how often blocked reads/writes re-check deadlines and shutdown.
pub(crate) const TICK: Duration = Duration::from_millis(50);
/// How long a busy connection may be quiet before its local link's carrier is checked.
pub(crate) const LINK_CHECK: Duration = Duration::from_millis(100);

/// A local rail as the runtime uses it.
#[derive(Debug, Clone)]
pub struct LocalRail {
    pub device: String,
    pub addr: Option<IpAddr>,
    pub prefix_len: u8,
    pub speed_mbps: u64,
}

/// Who dials: what the handshake says about this agent and proves (`Ctx::identity`).
#[derive(Clone, Copy)]
pub(crate) struct Identity<'a> {
    pub name: &'a str,
    pub incarnation: u64,
    pub secret: Option<&'a [u8]>,
    /// Bind connections to the rail's device (SO_BINDTODEVICE) as well as its address.
    pub bind_devices: bool,
}

/// Why the local interface `dev` cannot carry traffic (admin down or no carrier), if it cannot.
/// Interfaces without a carrier notion (loopback: operstate "unknown") always pass.
pub(crate) fn link_down(dev: &str) -> Option<String> {
    if dev.contains('/') || dev.starts_with('.') {
        return None;
    }
    let base = format!("/sys/class/net/{dev}");
    let oper = std::fs::read_to_string(format!("{base}/operstate")).ok()?;
    let oper = oper.trim();
    if oper == "down" || oper == "lowerlayerdown" || oper == "notpresent" {
        return Some(format!("link down: {dev} is {oper}"));
    }
    match std::fs::read_to_string(format!("{base}/carrier")) {
        Ok(c) if c.trim() == "0" => Some(format!("link down: {dev} has no carrier")),
        _ => None,
    }
}

/// Abort a connection now: discard what is still queued to send and reset it.
///
/// A plain shutdown keeps the send queue and appends a FIN, so after a link failure the kernel
/// would go on retransmitting queued WRITE requests and, once the link returned, the target
/// could apply a stale chunk after its reissue on another rail had already landed newer data.
/// `connect(AF_UNSPEC)` on a TCP socket is Linux's `tcp_disconnect`: it purges the queues and
/// sends a RST, for every handle that shares the socket.
pub(crate) fn abort_socket(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    let unspec = libc::sockaddr { sa_family: libc::AF_UNSPEC as libc::sa_family_t, sa_data: [0; 14] };
    // SAFETY: plain syscalls on a file descriptor we own, with correctly sized arguments.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
        libc::connect(fd, &unspec, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t);
    }
    let _ = s.shutdown(Shutdown::Both);
}

/// Where to dial and whom to expect there (`dial`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dial<'a> {
    /// The rail's local end (interface, address) to bind to; None: the kernel's choice.
    pub local: Option<&'a (String, IpAddr)>,
    pub remote: SocketAddr,
    pub role: Role,
    /// The agent (name, incarnation) we have metadata for: another answering is an error
    /// (`Metadata`; `StaleMetadata` for a restarted one). None: whoever answers.
    pub expect: Option<(&'a str, u64)>,
    /// For the connect, and again for the handshake after it.
    pub timeout: Duration,
}

impl Dial<'_> {
    /// To `remote` as `role`, from any local address, whoever answers.
    pub(crate) fn to(remote: SocketAddr, role: Role, timeout: Duration) -> Self {
        Dial { local: None, remote, role, expect: None, timeout }
    }
}

/// An authenticated connection (`dial`).
#[derive(Debug)]
pub(crate) struct Dialed {
    pub stream: TcpStream,
    /// Its id: the nonce its `Hello` carried (the target fences connections by it).
    pub id: [u8; 16],
    /// The `Hello` version the peer accepted: [`HELLO_VERSION`], or 1 for a peer from before
    /// vectored requests (its connections carry none).
    pub version: u16,
    /// With a shared secret: the connection's session key (`auth::session_key` over both
    /// nonces), which keys a UCX session's MACs and active-message secret.
    pub session_key: Option<[u8; 32]>,
}

/// Open one authenticated connection and check the peer is the life we have metadata for.
/// Offers [`HELLO_VERSION`] first ([`HELLO_UCX_FEATURES`] on a `Role::UcxSession` connection); a
/// peer that answers `Error(VersionMismatch)` (an older build) is dialled again one version
/// lower, down to 1.
pub(crate) fn dial(me: &Identity<'_>, to: Dial<'_>) -> Result<Dialed> {
    let mut version = if to.role == Role::UcxSession { HELLO_UCX_FEATURES } else { HELLO_VERSION };
    loop {
        match dial_version(me, &to, version) {
            Err(Error::Decode { source: multirail_proto::DecodeError::VersionMismatch { .. }, .. }) if version > 1 => version -= 1,
            r => return r.map(|(stream, id, session_key)| Dialed { stream, id, version, session_key }),
        }
    }
}

/// Whether `e` is a dial refused by the peer's host: nothing listens on that address any more
/// (the peer closed or exited; a restarted peer is a new incarnation, refused by metadata).
pub(crate) fn refused(e: &Error) -> bool {
    matches!(e, Error::Io { kind: std::io::ErrorKind::ConnectionRefused, .. })
}

fn dial_version(ctx: &Identity<'_>, to: &Dial<'_>, version: u16) -> Result<(TcpStream, [u8; 16], Option<[u8; 32]>)> {
    let Dial { local, remote, role, expect, timeout } = *to;
    let who = format!("{remote}");
    let domain = socket2::Domain::for_address(remote);
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP)).map_err(|e| Error::io("socket", e))?;
    if let Some((dev, addr)) = local {
        if ctx.bind_devices && !dev.is_empty() {
            // Needs CAP_NET_RAW; without it the source-address binding below still steers
            // traffic through per-rail policy routing.
            let _ = sock.bind_device(Some(dev.as_bytes()));
        }
        sock.bind(&SocketAddr::new(*addr, 0).into()).map_err(|e| Error::io(format!("bind to rail address {addr}"), e))?;
    }
    // A refusal stays typed (`Io` of kind `ConnectionRefused`, which `refused` reads and the
    // Python and NIXL layers map to a lost peer).
    sock.connect_timeout(&remote.into(), timeout).map_err(|e| Error::io(format!("connect to {remote}"), e))?;
    let mut s: TcpStream = sock.into();
    s.set_nodelay(true).map_err(|e| Error::io("nodelay", e))?;
    s.set_read_timeout(Some(TICK)).map_err(|e| Error::io("timeout", e))?;
    s.set_write_timeout(Some(TICK)).map_err(|e| Error::io("timeout", e))?;
    let deadline = Instant::now() + timeout;
    let mut tick = |_: bool| if Instant::now() > deadline { Err(format!("handshake with {remote} timed out")) } else { Ok(()) };
    let nonce: [u8; 16] = random_bytes();
    let wire_err = |e: WireError| match e {
        WireError::Decode(source) => Error::Decode { who: who.clone(), source },
        WireError::GaveUp(m) => Error::Timeout(m),
        WireError::Io(e) => Error::PeerLost { peer: who.clone(), reason: format!("handshake: {e}") },
    };
    wire::send(&mut s, &Body::Hello { version, role, incarnation: ctx.incarnation, name: ctx.name.to_string(), nonce }, 0, &mut tick)
        .map_err(wire_err)?;
    let (_, b) = wire::read_frame(&mut s, &mut tick).map_err(wire_err)?;
    let (auth_required, incarnation, server_nonce, server_name) = match b {
        Body::Challenge { auth_required, incarnation, nonce, name } => (auth_required, incarnation, nonce, name),
        Body::Error { status, msg } => return Err(status_error(&who, status, msg)),
        other => return Err(Error::Protocol { who, msg: format!("expected Challenge, got {:?}", other.kind()) }),
    };
    if let Some((name, inc)) = expect {
        if server_name != name {
            return Err(Error::Metadata(format!("{remote} is agent {server_name:?}, not {name:?}")));
        }
        if incarnation != inc {
            return Err(Error::StaleMetadata { peer: name.to_string(), cached: inc, current: incarnation });
        }
    }
    let mac = match (&ctx.secret, auth_required) {
        (Some(secret), true) => auth::client_proof(secret, &server_nonce, &nonce, ctx.name),
        (None, true) => return Err(Error::Auth { who, msg: "peer requires a shared secret and none is configured".into() }),
        (Some(_), false) => {
            return Err(Error::Auth { who, msg: "peer does not authenticate but a shared secret is configured here".into() })
        }
        (None, false) => [0u8; 32],
    };
    wire::send(&mut s, &Body::Auth { mac }, 0, &mut tick).map_err(wire_err)?;
    let (_, b) = wire::read_frame(&mut s, &mut tick).map_err(wire_err)?;
    match b {
        Body::Welcome { mac } => {
            if let Some(secret) = &ctx.secret {
                if !auth::proofs_equal(&mac, &auth::server_proof(secret, &nonce, &server_nonce, &server_name)) {
                    return Err(Error::Auth { who, msg: "peer failed to prove the shared secret".into() });
                }
            }
        }
        Body::Error { status, msg } => return Err(status_error(&who, status, msg)),
        other => return Err(Error::Protocol { who, msg: format!("expected Welcome, got {:?}", other.kind()) }),
    }
    let session_key = ctx.secret.map(|secret| auth::session_key(secret, &nonce, &server_nonce));
    Ok((s, nonce, session_key))
}

pub(crate) fn status_error(who: &str, status: Status, msg: String) -> Error {
    match status {
        Status::AuthFailed => Error::Auth { who: who.into(), msg },
        Status::VersionMismatch => Error::Decode {
            who: who.into(),
            source: multirail_proto::DecodeError::VersionMismatch { got: 0, want: multirail_proto::codec::VERSION },
        },
        _ => Error::Remote { peer: who.into(), status, msg },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_proto::codec::{Kind, HELLO_VECTORED, HELLO_VECTORED_GPU};
    use std::net::TcpListener;

    /// A server that speaks `max` as its newest `Hello` version: a newer Hello is answered
    /// `Error(VersionMismatch)` and the connection closed, as a build from before vectored
    /// requests does. Records the versions it was offered.
    fn server(max: u16, conns: usize) -> (SocketAddr, std::thread::JoinHandle<Vec<u16>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for _ in 0..conns {
                let (mut s, _) = l.accept().unwrap();
                let mut tick = |_: bool| Ok(());
                let (_, b) = wire::read_frame(&mut s, &mut tick).unwrap();
                let Body::Hello { version, .. } = b else { panic!("expected Hello") };
                seen.push(version);
                if version > max {
                    wire::send(&mut s, &Body::Error { status: Status::VersionMismatch, msg: "old".into() }, 0, &mut tick).unwrap();
                    continue;
                }
                let ch = Body::Challenge { auth_required: false, incarnation: 1, nonce: [1; 16], name: "srv".into() };
                wire::send(&mut s, &ch, 0, &mut tick).unwrap();
                let (h, _) = wire::read_frame(&mut s, &mut tick).unwrap();
                assert_eq!(h.kind, Kind::Auth);
                wire::send(&mut s, &Body::Welcome { mac: [0; 32] }, 0, &mut tick).unwrap();
            }
            seen
        });
        (addr, h)
    }

    #[test]
    fn hello_offers_the_newest_version_and_falls_back_for_an_old_peer() {
        let me = Identity { name: "cli", incarnation: 7, secret: None, bind_devices: false };
        let t = Duration::from_secs(5);
        let (addr, h) = server(HELLO_VERSION, 1);
        let v = dial(&me, Dial::to(addr, Role::Data, t)).unwrap().version;
        assert_eq!(v, HELLO_VERSION);
        assert!(v >= HELLO_VECTORED_GPU);
        assert_eq!(h.join().unwrap(), vec![HELLO_VERSION]);
        // A build from before vectored requests on GPU regions (it speaks 3): vectored
        // requests on host memory only.
        // Each version is offered in turn, newest first, until the server takes one.
        let offered = |down_to: u16| (down_to..=HELLO_VERSION).rev().collect::<Vec<u16>>();
        let (addr, h) = server(3, offered(3).len());
        let v = dial(&me, Dial::to(addr, Role::Data, t)).unwrap().version;
        assert!((HELLO_VECTORED..HELLO_VECTORED_GPU).contains(&v), "{v}");
        assert_eq!(h.join().unwrap(), offered(3));
        // An old server: refused until version 1 (no vectored requests).
        let (addr, h) = server(1, offered(1).len());
        let v = dial(&me, Dial::to(addr, Role::Data, t)).unwrap().version;
        assert_eq!(v, 1);
        assert_eq!(h.join().unwrap(), offered(1));
    }

    #[test]
    fn a_refused_dial_is_typed_and_other_failures_are_not_refusals() {
        let me = Identity { name: "cli", incarnation: 7, secret: None, bind_devices: false };
        let t = Duration::from_secs(5);
        // A port nothing listens on any more.
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let e = dial(&me, Dial::to(addr, Role::Control, t)).unwrap_err();
        assert!(refused(&e), "{e:?}");
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
        // A peer that answers and then hangs up is not a refusal (it may be restarting, or
        // a path may be failing): the caller keeps trying other rails.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || drop(l.accept().unwrap()));
        let e = dial(&me, Dial::to(addr, Role::Control, t)).unwrap_err();
        h.join().unwrap();
        assert!(!refused(&e), "{e:?}");
    }

    #[test]
    fn ucx_session_offers_v3_and_steps_down_for_older_peers() {
        let me = Identity { name: "cli", incarnation: 7, secret: None, bind_devices: false };
        let t = Duration::from_secs(5);
        let (addr, h) = server(HELLO_UCX_FEATURES, 1);
        assert_eq!(dial(&me, Dial::to(addr, Role::UcxSession, t)).unwrap().version, HELLO_UCX_FEATURES);
        assert_eq!(h.join().unwrap(), vec![HELLO_UCX_FEATURES]);
        // A build with vectored requests but no ucx features: 3 refused, 2 accepted.
        let (addr, h) = server(2, 2);
        assert_eq!(dial(&me, Dial::to(addr, Role::UcxSession, t)).unwrap().version, 2);
        assert_eq!(h.join().unwrap(), vec![HELLO_UCX_FEATURES, 2]);
        let (addr, h) = server(1, 3);
        assert_eq!(dial(&me, Dial::to(addr, Role::UcxSession, t)).unwrap().version, 1);
        assert_eq!(h.join().unwrap(), vec![HELLO_UCX_FEATURES, 2, 1]);
    }
}
