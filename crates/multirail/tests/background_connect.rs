//! Dialing a peer that never answers (a listener whose kernel accepts connections and whose
//! application never reads: the handshake waits until `timeout`): who waits for it.
//! - `Config::background_connect` (the NIXL backend): prepare, post and send_notif return at
//!   once, and the transfer fails within `timeout` of its post (docs/nixl-plugin.md, "No network
//!   I/O on the caller's thread").
//! - Either mode: removing the peer does not wait for a dial in progress (before: `Peer::close`
//!   waited on the link slot's lock, which the dial held until `timeout`).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use multirail::{Agent, Config, Error, Op, XferState};
use multirail_proto::{Access, AgentMeta, MemType, RailInfo, RegionKey, RegionMeta};

/// Metadata of a peer `name` whose one rail is `port` on loopback, exporting one region.
fn peer_at(name: &str, port: u16) -> Vec<u8> {
    let rail = RailInfo {
        name: "lo".into(),
        addr: "127.0.0.1".into(),
        prefix_len: 8,
        port,
        speed_mbps: 0,
        mtu: 65536,
        numa: -1,
        rdma_dev: String::new(),
    };
    let region =
        RegionMeta { id: 1, base: 0x10_0000, len: 1 << 20, dev: 0, mem: MemType::Dram, access: Access::ReadWrite, key: RegionKey([7; 16]) };
    AgentMeta { name: name.into(), incarnation: 7, rails: vec![rail], regions: vec![region] }.encode()
}

#[test]
fn background_connect_never_blocks_the_caller_and_fails_within_timeout() {
    let timeout = Duration::from_secs(1);
    let a = Agent::new("bg-a", Config { timeout, background_connect: true, ..Config::default() }).expect("agent");
    let silent = TcpListener::bind("127.0.0.1:0").expect("listener");
    let name = a.add_remote(&peer_at("silent", silent.local_addr().expect("address").port())).expect("peer");
    let buf = vec![0u8; 1 << 20];
    let base = buf.as_ptr() as u64;
    a.register(base, buf.len() as u64, 0, MemType::Dram, Access::ReadWrite).expect("register");
    let limit = Duration::from_millis(50);

    let t = Instant::now();
    let h = a.prepare(Op::Read, &[[base, 4096, 0]], &[[0x10_0000, 4096, 0]], &name, Vec::new()).expect("prepare");
    let prep = t.elapsed();
    let t = Instant::now();
    let posted = h.post(None).expect("post");
    let post = t.elapsed();
    let t = Instant::now();
    a.send_notif(&name, b"hello").expect("send_notif");
    let notif = t.elapsed();
    assert!(prep < limit && post < limit && notif < limit, "prepare {prep:?}, post {post:?}, send_notif {notif:?}");
    assert_eq!(posted, XferState::InProgress);

    let t = Instant::now();
    while h.state() == XferState::InProgress && t.elapsed() < timeout * 5 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let failed = t.elapsed();
    assert_eq!(h.state(), XferState::Error, "still {:?} after {failed:?}", h.state());
    // The peer may be alive (its kernel answers): a timeout, not PeerLost (NIXL_ERR_BACKEND).
    assert!(h.error().is_some() && !matches!(h.error(), Some(Error::PeerLost { .. })), "{:?}", h.error());
    assert!(failed < timeout + Duration::from_millis(1500), "failed after {failed:?}");

    // A transfer released while it waits for its connection is never started.
    let h2 = a.prepare(Op::Read, &[[base, 4096, 0]], &[[0x10_0000, 4096, 0]], &name, Vec::new()).expect("prepare");
    h2.post(None).expect("post");
    h2.release();
    assert_eq!(h2.state(), XferState::Error);
    a.close();
}

#[test]
fn removing_a_peer_does_not_wait_for_its_dial() {
    let timeout = Duration::from_secs(2);
    let a = Agent::new("bg-b", Config { timeout, ..Config::default() }).expect("agent");
    let silent = TcpListener::bind("127.0.0.1:0").expect("listener");
    let name = a.add_remote(&peer_at("silent", silent.local_addr().expect("address").port())).expect("peer");
    std::thread::scope(|sc| {
        let peer = a.peer(&name).expect("peer");
        let dialing = sc.spawn(move || peer.link().map(|_| ()));
        let _dialed = silent.accept().expect("the dial"); // the link is being opened now
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        a.remove_remote(&name).expect("remove");
        let waited = t.elapsed();
        assert!(waited < timeout / 4, "remove_remote waited {waited:?} for the dial");
        assert!(dialing.join().expect("dial").is_err(), "the removed peer was connected");
    });
    a.close();
}
