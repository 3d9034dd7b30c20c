//! A peer's regions change while it lives (issue 36 item 6): metadata of the same incarnation
//! and rails, with regions added or removed (NIXL's `loadRemoteMD` / `unloadRemoteMD`, one
//! region per call; `Agent::add_remote` with a newer blob), updates the installed peer in place.
//! Its link and connections stay, a transfer in flight across the updates completes, a new
//! region is usable at once, and a removed one is refused (a new prepare, and the next post of
//! a handle prepared before the removal) while the others keep working.
//!
//! Before, each update built a new peer: `add_remote` closed the old one, failing the transfer
//! in flight (PeerLost, which NIXL reports as NIXL_ERR_REMOTE_DISCONNECT), and every new peer
//! dialed new connections on every rail.

use std::time::Duration;

use multirail::config::Fault;
use multirail::{Agent, Config, Error, Op, TransportKind, XferState};
use multirail_proto::{Access, AgentMeta, MemType, PlannerConfig};

/// Regions added one at a time (NIXL loads one per layer and kind for vLLM).
const ADDED: usize = 24;
const SMALL: usize = 64 << 10;
const BIG: usize = 4 << 20;

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(u32::from(seed)) as u8 ^ seed).collect()
}

/// Connections the target accepted from `peer` so far (every rail, data and control).
fn accepted(target: &Agent, peer: &str) -> u64 {
    target.served_stats().iter().filter(|s| s.peer == peer).map(|s| s.connections).sum()
}

/// `meta` holding only the regions `keep` says.
fn with_regions(meta: &AgentMeta, keep: impl Fn(u64) -> bool) -> Vec<u8> {
    let mut m = meta.clone();
    m.regions.retain(|r| keep(r.id));
    m.encode()
}

fn live_updates(cfg: Config) {
    let transport = cfg.transport;
    let target = Agent::new("live-t", cfg.clone()).expect("target agent");
    // The initiator's completions come late (`slow`), so its big READ is in flight for a while.
    let faults = Fault::parse_list("0:slow=150ms@0").expect("faults");
    let init = Agent::new("live-i", Config { faults, planner: PlannerConfig { chunk_size: 256 << 10, ..cfg.planner.clone() }, ..cfg })
        .expect("initiator agent");

    let big = pattern(1, BIG);
    let smalls: Vec<Vec<u8>> = (0..ADDED).map(|i| pattern(10 + i as u8, SMALL)).collect();
    let reg =
        |a: &Agent, b: &[u8]| a.register(b.as_ptr() as u64, b.len() as u64, 0, MemType::Dram, Access::ReadWrite).expect("register").id;
    let big_id = reg(&target, &big);
    let small_ids: Vec<u64> = smalls.iter().map(|b| reg(&target, b)).collect();
    let meta = target.metadata();

    let mut dst = vec![0u8; BIG];
    let mut sdst = vec![0u8; SMALL];
    let dbase = dst.as_mut_ptr() as u64;
    let sbase = sdst.as_mut_ptr() as u64;
    init.register(dbase, BIG as u64, 0, MemType::Dram, Access::ReadWrite).expect("register");
    init.register(sbase, SMALL as u64, 0, MemType::Dram, Access::ReadWrite).expect("register");

    // The peer as first loaded: the big region only. Connected by a first READ.
    let name = init.add_remote(&with_regions(&meta, |id| id == big_id)).expect("add_remote");
    let peer = init.peer(&name).expect("peer");
    let first = init.prepare(Op::Read, &[[sbase, 4096, 0]], &[[big.as_ptr() as u64, 4096, 0]], &name, Vec::new()).expect("prepare");
    first.post_wait(None, Some(Duration::from_secs(20))).expect("first READ");
    assert_eq!(&sdst[..4096], &big[..4096]);
    if transport == TransportKind::Ucx {
        let rails: Vec<String> = init.rail_stats(&name).expect("rail stats").into_iter().map(|r| r.transport).collect();
        assert!(!rails.is_empty() && rails.iter().all(|t| t.contains("ucx")), "not on ucx rails: {rails:?}");
    }
    let conns = accepted(&target, "live-i");
    assert!(conns > 0, "the target counted no connection from the initiator");

    // A big READ in flight while the regions are loaded one at a time.
    let h = init.prepare(Op::Read, &[[dbase, BIG as u64, 0]], &[[big.as_ptr() as u64, BIG as u64, 0]], &name, Vec::new()).expect("prepare");
    h.post(None).expect("post");
    for i in 0..ADDED {
        let now = init.add_remote(&with_regions(&meta, |id| id == big_id || small_ids[..=i].contains(&id))).expect("add_remote");
        assert_eq!(now, name);
    }
    match h.state() {
        XferState::InProgress => {}
        s => panic!("the big READ is {s:?} ({:?}) after the updates: it must be in flight across them", h.error()),
    }
    assert!(std::sync::Arc::ptr_eq(&peer, &init.peer(&name).expect("peer")), "a region update replaced the peer");
    h.wait(Some(Duration::from_secs(30))).expect("the READ in flight across the updates");
    assert!(dst == big, "the READ in flight across the updates: bytes differ");

    // A new region works at once (the last one added, and the first).
    for i in [ADDED - 1, 0] {
        sdst.fill(0);
        let r = init.prepare(Op::Read, &[[sbase, SMALL as u64, 0]], &[[smalls[i].as_ptr() as u64, SMALL as u64, 0]], &name, Vec::new());
        r.expect("prepare on an added region").post_wait(None, Some(Duration::from_secs(20))).expect("READ of an added region");
        assert!(sdst == smalls[i], "READ of added region {i}: bytes differ");
    }

    // A handle on region 3, then region 3 removed.
    let gone = smalls[3].as_ptr() as u64;
    let held = init.prepare(Op::Read, &[[sbase, 4096, 0]], &[[gone, 4096, 0]], &name, Vec::new()).expect("prepare");
    init.add_remote(&with_regions(&meta, |id| id != small_ids[3])).expect("add_remote without region 3");
    match init.prepare(Op::Read, &[[sbase, 4096, 0]], &[[gone, 4096, 0]], &name, Vec::new()) {
        Err(Error::OutOfBounds { .. }) => {}
        other => panic!("a prepare on a removed region: {:?}", other.map(|_| "a handle")),
    }
    sdst.fill(0xaa);
    let e = held.post(None).expect_err("the post of a handle on a removed region");
    assert!(e.to_string().contains("was removed"), "{e}");
    assert_eq!(held.state(), XferState::Error);
    assert!(sdst.iter().all(|b| *b == 0xaa), "a post on a removed region moved bytes");
    // The others keep working, on the same peer and connections.
    let r = init.prepare(Op::Read, &[[sbase, SMALL as u64, 0]], &[[smalls[4].as_ptr() as u64, SMALL as u64, 0]], &name, Vec::new());
    r.expect("prepare").post_wait(None, Some(Duration::from_secs(20))).expect("READ of a region kept");
    assert!(sdst == smalls[4], "READ of a kept region: bytes differ");
    assert!(std::sync::Arc::ptr_eq(&peer, &init.peer(&name).expect("peer")), "a region removal replaced the peer");
    assert_eq!(accepted(&target, "live-i"), conns, "region updates opened new connections");

    // Another incarnation (the peer restarted) still replaces the peer.
    let mut next = meta.clone();
    next.incarnation ^= 1;
    init.add_remote(&next.encode()).expect("add_remote of a new incarnation");
    assert!(!std::sync::Arc::ptr_eq(&peer, &init.peer(&name).expect("peer")), "a new incarnation kept the old peer");
    init.close();
    target.close();
}

#[test]
fn regions_added_and_removed_in_place_keep_the_peers_connections() {
    live_updates(Config { timeout: Duration::from_secs(10), ..Config::default() });
}

/// On a ucx rail: the initiator fetches the rkey of a region it has not seen from the session
/// (`UcxRkeys`), without reconnecting. Needs a UCX: run with `cargo test -p multirail --
/// --ignored ucx` (`make test` does).
#[test]
#[ignore = "needs UCX"]
fn regions_added_in_place_on_a_ucx_rail() {
    live_updates(Config {
        transport: TransportKind::Ucx,
        secret: Some(b"live-regions".to_vec()),
        timeout: Duration::from_secs(10),
        ..Config::default()
    });
}

/// A region changed under the same id (here its base moved by a page) counts as removed: a
/// handle prepared on its old bounds fails its next post, touching no memory, as for a region
/// unloaded. Before, only the id was checked, so the handle posted offsets computed from the
/// old bounds. And metadata listing a region id twice is refused.
#[test]
fn a_region_changed_under_its_id_fails_the_handles_prepared_before() {
    let cfg = Config { timeout: Duration::from_secs(10), ..Config::default() };
    let target = Agent::new("moved-t", cfg.clone()).expect("target agent");
    let init = Agent::new("moved-i", cfg).expect("initiator agent");
    let src = pattern(3, 3 * 4096);
    let id = target.register(src.as_ptr() as u64, src.len() as u64, 0, MemType::Dram, Access::ReadWrite).expect("register").id;
    let meta = target.metadata();
    let mut dst = vec![0u8; 4096];
    let dbase = dst.as_mut_ptr() as u64;
    init.register(dbase, 4096, 0, MemType::Dram, Access::ReadWrite).expect("register");
    let name = init.add_remote(&meta.encode()).expect("add_remote");
    let peer = init.peer(&name).expect("peer");
    let at = src.as_ptr() as u64 + 4096;
    let read = || init.prepare(Op::Read, &[[dbase, 4096, 0]], &[[at, 4096, 0]], &name, Vec::new()).expect("prepare");
    read().post_wait(None, Some(Duration::from_secs(20))).expect("first READ");
    assert!(dst[..] == src[4096..8192], "first READ: bytes differ");
    let held = read();

    let mut dup = meta.clone();
    let again = dup.regions.iter().find(|r| r.id == id).expect("the region").clone();
    dup.regions.push(again);
    match init.add_remote(&dup.encode()) {
        Err(e) => assert!(e.to_string().contains("region id twice"), "{e}"),
        Ok(_) => panic!("metadata listing region {id} twice was installed"),
    }

    let mut moved = meta.clone();
    let r = moved.regions.iter_mut().find(|r| r.id == id).expect("the region");
    r.base += 4096;
    r.len -= 4096;
    init.add_remote(&moved.encode()).expect("add_remote with the region moved");
    assert!(std::sync::Arc::ptr_eq(&peer, &init.peer(&name).expect("peer")), "a region update replaced the peer");
    dst.fill(0xaa);
    let e = held.post(None).expect_err("the post of a handle on a region changed since its prepare");
    assert!(e.to_string().contains("was removed"), "{e}");
    assert_eq!(held.state(), XferState::Error);
    assert!(dst.iter().all(|b| *b == 0xaa), "a post on a changed region moved bytes");
    init.close();
    target.close();
}
