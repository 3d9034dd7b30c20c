//! The agent: identity, registry, listeners and the table of known peers.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status, MAX_NAME};
use multirail_proto::{Access, AgentMeta, Body, MemType, RailInfo};

use crate::config::{Config, TransportKind};
use crate::error::{Error, Result};
use crate::net::{dial, status_error, Dial};
use crate::peer::{resolve_in, Peer, RailReport};
use crate::registry::{random_bytes, Region, Registry};
use crate::server;
use crate::transport::select;
use crate::transport::ucx::UcxAgent;
use crate::wire::{self, WireError};
use crate::xfer::{Desc, Op, XferHandle};

/// Moved below the agent (the link, peer and server read them); kept here by their old paths.
pub use crate::ctx::Ctx;
pub use crate::net::LocalRail;
pub use crate::peer::ResolvedLocal;
pub use crate::server::Shared;

/// GPU memory is registered only when the device (CUDA loaded at run time, or the stand-in)
/// says the range is device (or managed) memory of that device: otherwise a typed error names
/// the cause (no CUDA runtime found, no usable GPU, a host address) instead of a crash on first
/// use.
fn check_device_memory(kind: multirail_gpu::GpuKind, base: u64, len: u64, dev: u32) -> Result<()> {
    use multirail_gpu::{Device, MemKind};
    let id = i32::try_from(dev).map_err(|_| Error::Gpu(format!("device id {dev} out of range")))?;
    let gpu = multirail_gpu::Gpu::open(kind, id).map_err(|e| Error::Gpu(format!("cannot register {len} bytes on GPU {dev}: {e}")))?;
    let last = base.checked_add(len - 1).ok_or_else(|| Error::InvalidArgument(format!("bad region address {base:#x} + {len}")))?;
    for addr in [base, last] {
        match gpu.pointer_kind(addr) {
            Ok(MemKind::Device { device } | MemKind::Managed { device }) if device == id => {}
            Ok(MemKind::Device { device } | MemKind::Managed { device }) => {
                return Err(Error::Gpu(format!("address {addr:#x} is memory of GPU {device}, not of GPU {dev}")))
            }
            Ok(k) => return Err(Error::Gpu(format!("address {addr:#x} is not GPU memory ({} says {k:?})", gpu.name()))),
            Err(e) => return Err(Error::Gpu(format!("cannot classify address {addr:#x}: {e}"))),
        }
    }
    Ok(())
}

/// A multirail agent. Dropping it closes its listeners and links.
pub struct Agent {
    shared: Arc<Shared>,
    /// Address, a handle on the socket (to shut it down) and accept thread of each listener.
    listeners: Mutex<Vec<(SocketAddr, TcpListener, JoinHandle<()>)>>,
    port: u16,
}

fn bind(addr: &str, port: u16) -> Result<TcpListener> {
    let sa = (addr, port)
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("bad listen address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("listen address {addr:?} resolves to nothing")))?;
    let sock = socket2::Socket::new(socket2::Domain::for_address(sa), socket2::Type::STREAM, None).map_err(|e| Error::io("socket", e))?;
    sock.set_reuse_address(true).map_err(|e| Error::io("SO_REUSEADDR", e))?;
    sock.bind(&sa.into()).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => Error::AddrInUse(sa.to_string()),
        _ => Error::io(format!("bind {sa}"), e),
    })?;
    sock.listen(1024).map_err(|e| Error::io(format!("listen on {sa}"), e))?;
    Ok(sock.into())
}

impl Agent {
    pub fn new(name: &str, cfg: Config) -> Result<Agent> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Error::InvalidArgument(format!("agent name must be 1..={MAX_NAME} bytes")));
        }
        if cfg.connections == 0 || cfg.connections > 64 {
            return Err(Error::InvalidArgument("connections must be 1..=64".into()));
        }
        let side = bind(&cfg.host, cfg.port)?;
        // The process-wide pinned staging budget: the agent made last sets it (docs/gpu.md).
        crate::staging::set_pinned_max(cfg.staging.pinned_max);
        let side_addr = side.local_addr().map_err(|e| Error::io("local_addr", e))?;
        let mut listeners = vec![side];
        let mut rails_meta = Vec::new();
        let mut rails = Vec::new();
        if cfg.rails.is_empty() {
            rails_meta.push(RailInfo {
                name: "default".into(),
                addr: side_addr.ip().to_string(),
                prefix_len: 0,
                port: side_addr.port(),
                speed_mbps: 0,
                mtu: 0,
                numa: -1,
                rdma_dev: String::new(),
            });
            rails.push(LocalRail { device: String::new(), addr: Some(side_addr.ip()), prefix_len: 0, speed_mbps: 0 });
        } else {
            for r in &cfg.rails {
                let l = bind(&r.addr.to_string(), 0)?;
                let port = l.local_addr().map_err(|e| Error::io("local_addr", e))?.port();
                listeners.push(l);
                rails_meta.push(RailInfo {
                    name: r.name.clone(),
                    addr: r.addr.to_string(),
                    prefix_len: r.prefix_len,
                    port,
                    speed_mbps: r.speed_mbps,
                    mtu: r.mtu,
                    numa: r.numa,
                    rdma_dev: r.rdma_dev.clone(),
                });
                rails.push(LocalRail { device: r.name.clone(), addr: Some(r.addr), prefix_len: r.prefix_len, speed_mbps: r.speed_mbps });
            }
        }
        // Labels of the listeners' serving counters: the side channel is rail 0 of a one-rail
        // agent, its own "rail" otherwise.
        let mut served_rails = Vec::with_capacity(listeners.len());
        if cfg.rails.is_empty() {
            served_rails.push(server::ServedRail { name: rails_meta[0].name.clone(), index: Some(0) });
        } else {
            served_rails.push(server::ServedRail { name: server::SIDE_RAIL.into(), index: None });
            served_rails.extend(rails_meta.iter().enumerate().map(|(i, r)| server::ServedRail { name: r.name.clone(), index: Some(i) }));
        }
        let bind_devices = cfg.rails.iter().any(|r| r.bind_device);
        let (choices, ucx, ucx_notes) = choose_transports(&cfg, &rails, &mut rails_meta)?;
        let fan_in_window = cfg.fan_in_window;
        // By listener index: the side channel (or a one-rail agent's only rail), then each rail.
        let listener_speeds: Vec<u64> =
            if cfg.rails.is_empty() { vec![0] } else { std::iter::once(0).chain(cfg.rails.iter().map(|r| r.speed_mbps)).collect() };
        let ctx = Arc::new(Ctx {
            name: name.to_string(),
            incarnation: u64::from_le_bytes(random_bytes()),
            cfg,
            rails,
            bind_devices,
            events: Mutex::new(VecDeque::new()),
            started: Instant::now(),
            closed: AtomicBool::new(false),
            ucx: ucx.clone(),
            choices,
            topo: std::sync::OnceLock::new(),
        });
        let notif_seen = crate::notif_seen::NotifSeen::new(&ctx.cfg.faults);
        let shared = Arc::new(Shared {
            ctx,
            notif_seen,
            registry: Registry::default(),
            peers: RwLock::new(HashMap::new()),
            notifs: crate::inbox::Inbox::default(),
            shutdown: AtomicBool::new(false),
            rails_meta,
            open_conns: Arc::new(AtomicUsize::new(0)),
            handshakes: server::Handshakes::default(),
            authed: AtomicUsize::new(0),
            served: Mutex::new(HashMap::new()),
            fenced: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            served_stats: server::ServedTable::new(served_rails, server::MAX_SERVED_PEERS),
            ucx,
            ipc_exports: crate::ipc::Exports::default(),
            shares: crate::fanin::WindowShares::new(fan_in_window, listener_speeds),
        });
        if let Some(u) = &shared.ucx {
            shared.ctx.log(&format!("ucx transport: {}", u.describe()));
        }
        for (i, c) in shared.ctx.choices.iter().enumerate() {
            shared.ctx.log(&format!("rail {i} ({}): {} ({})", shared.rails_meta[i].name, c.kind.as_str(), c.reason));
        }
        // Loud, once per agent: RDMA NICs that UCX cannot drive, and UCX over TCP on purpose.
        for w in ucx_notes {
            shared.ctx.log(&w);
            eprintln!("multirail: warning: {w}");
        }
        let mut handles = Vec::new();
        for (i, l) in listeners.into_iter().enumerate() {
            let addr = l.local_addr().map_err(|e| Error::io("local_addr", e))?;
            let handle = l.try_clone().map_err(|e| Error::io("clone listener", e))?;
            let sh = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("mr-accept-{}", addr.port()))
                .spawn(move || server::accept_loop(sh, l, i))
                .map_err(|e| Error::io("spawn", e))?;
            handles.push((addr, handle, h));
        }
        Ok(Agent { shared, listeners: Mutex::new(handles), port: side_addr.port() })
    }

    pub fn name(&self) -> &str {
        &self.shared.ctx.name
    }
    pub fn port(&self) -> u16 {
        self.port
    }
    pub fn incarnation(&self) -> u64 {
        self.shared.ctx.incarnation
    }
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn register(&self, base: u64, len: u64, dev: u32, mem: MemType, access: Access) -> Result<Arc<Region>> {
        if mem == MemType::Vram {
            if len == 0 {
                return Err(Error::InvalidArgument("cannot register an empty region".into()));
            }
            check_device_memory(self.shared.ctx.cfg.staging.gpu, base, len, dev)?;
            // Pin the staging pools this agent's connections will take, now rather than
            // mid-transfer (crate::staging::prewarm). A failure here is not the region's: a
            // transfer that needs a pool reports it with its cause.
            let cfg = &self.shared.ctx.cfg;
            let direct = self.shared.ucx.as_ref().is_some_and(|u| u.gpu_direct().is_ok());
            if !direct {
                // Per NUMA node of the rails' NICs (issue 34 item 3): each rail's connections
                // take pools placed on its NIC's node (`Stagers::new` in transport/tcp.rs).
                let topo = self.shared.ctx.topo.get();
                let mut per_node: std::collections::BTreeMap<Option<i32>, usize> = Default::default();
                for i in 0..cfg.rails.len().max(1) {
                    let node = topo.and_then(|t| t.cpus.get(i)).and_then(|c| crate::numa::node_of_cpus(c));
                    *per_node.entry(node).or_default() += cfg.connections.max(1);
                }
                for (node, n) in per_node {
                    let _ = crate::staging::prewarm(cfg.staging, dev, n, node, self.shared.ctx.incarnation);
                }
            }
        }
        let r = self.shared.registry.register(base, len, dev, mem, access)?;
        // Device memory handed to a UCX without CUDA support would be dereferenced as host
        // memory: VRAM is mapped only when the rails can take it directly (docs/gpu.md).
        // UCX maps GPU memory only with GPUDirect RDMA on every rail (`UcxAgent::gpu_direct`).
        if let Some(u) = self.shared.ucx.as_ref().filter(|u| mem != MemType::Vram || u.gpu_direct().is_ok()) {
            // The device's dma-buf support and write ordering (issue 35, item 7; crate::gdr).
            let noted = match mem {
                MemType::Vram => i32::try_from(dev)
                    .map_err(|_| Error::Gpu(format!("device id {dev} out of range")))
                    .and_then(|id| {
                        multirail_gpu::Gpu::open(self.shared.ctx.cfg.staging.gpu, id).map_err(|e| Error::Gpu(format!("GPU {dev}: {e}")))
                    })
                    .and_then(|g| u.note_vram(&g)),
                MemType::Dram => Ok(()),
            };
            // Mapped in every rail's UCX context now, so the data path never registers.
            if let Err(e) = noted.and_then(|_| u.map(&r)) {
                let id = r.id;
                drop(r);
                let _ = self.shared.registry.deregister(id, Duration::ZERO);
                return Err(e);
            }
        }
        Ok(r)
    }

    /// Remove a region. Returns once no peer can touch it: peers that mapped it over CUDA IPC
    /// closed their mappings (docs/gpu.md); one that does not confirm within `timeout` is
    /// named in a `Timeout` error, and the region is removed all the same.
    pub fn deregister(&self, id: u64) -> Result<()> {
        self.shared.registry.deregister(id, Duration::from_secs(2))?;
        // The registry let go only once no transfer holds the region, so no local UCX request
        // uses it any more (and a pending one keeps its own mapping alive until it completes).
        self.unmap_and_revoke(id)
    }

    /// Deregister a region at once, even while a transfer handle holds it (NIXL's contract:
    /// `deregisterMem` does not wait, and NIXL forgets the registration whatever it returns):
    /// peers are refused from now on, UCX mappings and CUDA IPC handles are withdrawn, and a
    /// handle that holds it fails its next post.
    pub fn withdraw(&self, id: u64) -> Result<()> {
        self.shared.registry.withdraw(id)?;
        self.unmap_and_revoke(id)
    }

    /// After region `id` left the registry: its UCX mappings go (a no-op for regions never
    /// mapped, such as VRAM; waits for the ucx sessions' active-message requests that still use
    /// it) and peers' CUDA IPC mappings of it are revoked.
    fn unmap_and_revoke(&self, id: u64) -> Result<()> {
        if let Some(u) = &self.shared.ucx {
            u.unmap(id, self.shared.ctx.cfg.timeout).map_err(|why| {
                Error::Timeout(format!("region {id} is deregistered, but {why}: do not free or reuse it until this agent is closed"))
            })?;
        }
        crate::ipc::revoke(&self.shared.ctx, &self.shared.ipc_exports, Some(&[id]), self.shared.ctx.cfg.timeout).map_err(|why| {
            Error::Timeout(format!(
                "region {id} is deregistered, but {why}: they may still write into this GPU memory, so do not free or reuse it until those peers are closed"
            ))
        })
    }

    pub fn metadata(&self) -> AgentMeta {
        self.shared.metadata()
    }

    pub fn add_remote(&self, blob: &[u8]) -> Result<String> {
        let meta = AgentMeta::decode(blob).map_err(|e| match e {
            e @ multirail_proto::DecodeError::VersionMismatch { .. } => Error::Decode { who: "metadata".into(), source: e },
            e => Error::Metadata(format!("cannot parse metadata: {e}")),
        })?;
        self.shared.add_remote(meta, None)
    }

    /// Forget peer `name` and close it (its transfers fail). It is closed after the peer
    /// table's lock is released: closing may wait (for a dial in progress, up to `timeout`),
    /// and other threads keep using the table meanwhile.
    pub fn remove_remote(&self, name: &str) -> Result<()> {
        let removed = self.shared.peers.write().expect("peers lock").remove(name);
        let p = removed.ok_or_else(|| Error::UnknownPeer(name.to_string()))?;
        p.close();
        Ok(())
    }

    pub fn has_remote(&self, name: &str) -> bool {
        self.shared.peers.read().expect("peers lock").contains_key(name)
    }

    pub fn peer(&self, name: &str) -> Result<Arc<Peer>> {
        self.shared.peers.read().expect("peers lock").get(name).cloned().ok_or_else(|| Error::UnknownPeer(name.to_string()))
    }

    fn control(&self, ip: &str, port: u16, body: Body) -> Result<Body> {
        let addr: SocketAddr = (ip, port)
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("bad address {ip}:{port}: {e}")))?
            .next()
            .ok_or_else(|| Error::InvalidArgument(format!("{ip}:{port} resolves to nothing")))?;
        let mut s: TcpStream = dial(&self.shared.ctx.identity(), Dial::to(addr, Role::Control, self.shared.ctx.cfg.timeout))?.stream;
        let deadline = Instant::now() + self.shared.ctx.cfg.timeout;
        let mut tick = |_: bool| if Instant::now() > deadline { Err(format!("request to {addr} timed out")) } else { Ok(()) };
        let who = addr.to_string();
        let r = wire::send(&mut s, &body, 0, &mut tick).and_then(|_| wire::read_frame(&mut s, &mut tick));
        match r {
            Ok((_, b)) => Ok(b),
            Err(WireError::Decode(source)) => Err(Error::Decode { who, source }),
            Err(WireError::GaveUp(m)) => Err(Error::Timeout(m)),
            Err(WireError::Io(e)) => Err(Error::PeerLost { peer: who, reason: e.to_string() }),
        }
    }

    /// Fetch a peer's metadata from its side channel. `name` must match the agent there.
    pub fn fetch_remote(&self, name: &str, ip: &str, port: u16) -> Result<String> {
        match self.control(ip, port, Body::MetaGet)? {
            Body::Meta(blob) => {
                let meta = AgentMeta::decode(&blob).map_err(|e| Error::Decode { who: format!("{ip}:{port}"), source: e })?;
                if !name.is_empty() && meta.name != name {
                    return Err(Error::Metadata(format!("agent at {ip}:{port} is {:?}, not {name:?}", meta.name)));
                }
                self.shared.add_remote(meta, ip.parse().ok())
            }
            Body::Resp { status, msg, .. } | Body::Error { status, msg } => Err(status_error(&format!("{ip}:{port}"), status, msg)),
            other => Err(Error::Protocol { who: format!("{ip}:{port}"), msg: format!("expected Meta, got {:?}", other.kind()) }),
        }
    }

    /// Push this agent's metadata to the side channel at ip:port.
    pub fn send_local(&self, ip: &str, port: u16) -> Result<()> {
        match self.control(ip, port, Body::MetaPut(self.metadata().encode()))? {
            Body::Resp { status: Status::Ok, .. } => Ok(()),
            Body::Resp { status, msg, .. } | Body::Error { status, msg } => Err(status_error(&format!("{ip}:{port}"), status, msg)),
            other => Err(Error::Protocol { who: format!("{ip}:{port}"), msg: format!("expected Resp, got {:?}", other.kind()) }),
        }
    }

    /// Resolve local descriptors against the registry: every one must lie inside a registered
    /// region. Returns the (addr, len) list and the regions to hold.
    pub fn resolve_local<D: Desc>(&self, descs: &[D]) -> Result<ResolvedLocal> {
        resolve_in(&self.shared.registry.snapshot(), descs)
    }

    /// Make a transfer handle (resolve, validate and pair all descriptors now; see
    /// [`Peer::prepare`]). Rows are read where they are: an Nx3 uint64 array can be passed as
    /// `&[[u64; 3]]` without a copy.
    pub fn prepare<D: Desc>(&self, op: Op, local: &[D], remote: &[D], peer: &str, notif: Vec<u8>) -> Result<XferHandle> {
        let peer = self.peer(peer)?;
        peer.prepare(op, local, &self.shared.registry.snapshot(), remote, notif)
    }

    /// `prepare` from strided descriptors (Nx5 rows: address, len, device, stride, count),
    /// kept compressed (see `Peer::prepare_strided`).
    pub fn prepare_strided(&self, op: Op, local: &[[u64; 5]], remote: &[[u64; 5]], peer: &str, notif: Vec<u8>) -> Result<XferHandle> {
        let peer = self.peer(peer)?;
        peer.prepare_strided(op, local, &self.shared.registry.snapshot(), remote, notif)
    }

    pub fn send_notif(&self, peer: &str, msg: &[u8]) -> Result<()> {
        if msg.len() > multirail_proto::codec::MAX_NOTIF {
            return Err(Error::InvalidArgument(format!(
                "notification of {} bytes exceeds {}",
                msg.len(),
                multirail_proto::codec::MAX_NOTIF
            )));
        }
        self.peer(peer)?.send_notif(msg)
    }

    /// Every notification received and not yet taken, in arrival order (a poll).
    pub fn take_notifs(&self) -> Vec<(String, Vec<u8>)> {
        self.shared.notifs.take(Duration::ZERO)
    }

    /// As [`Agent::take_notifs`], but with none queued, sleep until one arrives, up to `wait`
    /// (or until the agent closes). One wake-up per batch, where polling costs one per poll.
    pub fn wait_notifs(&self, wait: Duration) -> Vec<(String, Vec<u8>)> {
        self.shared.notifs.take(wait)
    }

    /// Per local rail: the transport it runs ("tcp", "ucx"), why, and whether it is UCX without
    /// RDMA (no memory bounds checked: docs/SECURITY.md).
    pub fn rail_transports(&self) -> Vec<(String, String, bool)> {
        self.shared.ctx.choices.iter().map(|c| (c.kind.as_str().to_string(), c.reason.clone(), c.unprotected)).collect()
    }

    /// The transport this agent was asked to run ("tcp", "ucx", "auto"; per rail:
    /// [`Agent::rail_transports`]) and, when a rail runs ucx, the loaded UCX (version, where it
    /// came from) and each ucx rail's device restriction.
    pub fn transport_info(&self) -> (String, Option<String>, Option<String>) {
        let kind = self.shared.ctx.cfg.transport.as_str().to_string();
        match &self.shared.ucx {
            Some(u) => (kind, Some(u.version()), Some(u.describe())),
            None => (kind, None, None),
        }
    }

    /// Which local rails carry which memory, and where each rail's threads run (issue 34,
    /// docs/topology.md, "The engine"): `tiers` per location ("gpu:K", "numa:N") lists tiers
    /// of local rail indices, nearest first; `cpus` per local rail its NIC's local CPUs (empty:
    /// leave its threads where they are). Set once, before the first transfer; links opened
    /// before it (none, when the Python layer calls it from `Agent.__init__`) keep every rail.
    pub fn set_topology(&self, tiers: Vec<(String, Vec<Vec<usize>>)>, cpus: Vec<Vec<usize>>) -> Result<()> {
        let ctx = &self.shared.ctx;
        let n = ctx.rails.len().max(1);
        let mut topo = crate::ctx::RailTopo { tiers: Default::default(), cpus };
        if topo.cpus.len() > n {
            return Err(Error::InvalidArgument(format!("topology: CPU lists for {} rails, the agent has {n}", topo.cpus.len())));
        }
        for (loc, t) in tiers {
            let l = crate::numa::Loc::parse(&loc)
                .ok_or_else(|| Error::InvalidArgument(format!("affinity: location {loc:?} is not \"gpu:K\" or \"numa:N\"")))?;
            if let Some(bad) = t.iter().flatten().find(|&&i| i >= n) {
                return Err(Error::InvalidArgument(format!("affinity {loc}: rail index {bad} out of range (the agent has {n} rails)")));
            }
            let t: Vec<Vec<usize>> = t.into_iter().filter(|tier| !tier.is_empty()).collect();
            if !t.is_empty() {
                topo.tiers.insert(l, t);
            }
        }
        if n > 64 && !topo.tiers.is_empty() {
            return Err(Error::InvalidArgument(format!("affinity: tiers name at most 64 rails, the agent has {n}")));
        }
        ctx.topo.set(topo).map_err(|_| Error::InvalidArgument("the rail topology is set once per agent".into()))
    }

    pub fn rail_stats(&self, peer: &str) -> Result<Vec<RailReport>> {
        Ok(self.peer(peer)?.rail_stats())
    }

    /// What this agent served to peers, per (authenticated peer, local rail): READ bytes and
    /// requests (data sent out of our memory), WRITE bytes and requests (data landed in it),
    /// refusals, connections accepted and fenced. Peers beyond `server::MAX_SERVED_PEERS`
    /// distinct names are folded into `server::OTHER_PEER`; refusals before authentication
    /// count under `server::UNAUTHENTICATED_PEER`. Kept for the agent's life.
    pub fn served_stats(&self) -> Vec<server::ServedReport> {
        self.shared.served_stats.report()
    }

    pub fn events(&self) -> Vec<String> {
        self.shared.ctx.events.lock().expect("events lock").iter().cloned().collect()
    }

    /// Stop serving and close every link. When this returns, nothing of this agent touches
    /// registered memory any more: no inbound request is being served or will be (inbound
    /// connections are aborted and their threads have finished), and no outbound transfer is
    /// reading or landing data. Transfers still in flight fail with `PeerLost`.
    pub fn close(&self) {
        self.shared.ctx.closed.store(true, Ordering::SeqCst);
        if self.shared.shutdown.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.notifs.close();
        crate::staging::release(self.shared.ctx.incarnation);
        // Closed after the table's lock is released (as `remove_remote`).
        let peers: Vec<Arc<Peer>> = self.shared.peers.write().expect("peers lock").drain().map(|(_, p)| p).collect();
        for p in peers {
            p.close();
        }
        let listeners: Vec<_> = self.listeners.lock().expect("listeners lock").drain(..).collect();
        for (_addr, l, h) in listeners {
            // Wake the blocking accept: shutdown(2) on a listening socket makes accept fail at
            // once (a wake-up connection would not do when the address has vanished, e.g. a
            // deleted rail's interface).
            // SAFETY: shutdown on a socket this agent owns (`l` keeps it open).
            unsafe {
                libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&l), libc::SHUT_RDWR);
            }
            let _ = h.join();
        }
        // Peers close their CUDA IPC mappings of our memory (bounded) before their watch
        // connections go with the others.
        let _ = crate::ipc::revoke(&self.shared.ctx, &self.shared.ipc_exports, None, self.shared.ctx.cfg.timeout);
        // No connection is accepted any more; stop the ones being served and wait for their
        // threads (each notices within a tick even mid-handshake).
        server::abort_all(&self.shared);
        let deadline = Instant::now() + self.shared.ctx.cfg.timeout.max(Duration::from_secs(5));
        while self.shared.open_conns.load(Ordering::SeqCst) > 0 {
            if Instant::now() > deadline {
                self.shared.ctx.log("close: inbound connection threads still running");
                break;
            }
            server::abort_all(&self.shared);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The per-rail transport choice (`transport::select::choose`) for the agent's rails; UCX is
/// loaded only when a rail may use it, and contexts are made only for the rails that run ucx.
/// Also returns the warnings to print once: RDMA devices the loaded UCX cannot drive, and rails
/// that run UCX over TCP because they were asked to. Fills in `rdma_dev` of rails given by
/// name or address only, from sysfs.
#[allow(clippy::type_complexity)]
fn choose_transports(
    cfg: &Config,
    rails: &[LocalRail],
    rails_meta: &mut [RailInfo],
) -> Result<(Vec<select::Choice>, Option<Arc<UcxAgent>>, Vec<String>)> {
    for (m, r) in rails_meta.iter_mut().zip(rails) {
        if m.rdma_dev.is_empty() {
            m.rdma_dev = select::rdma_dev_of(&r.device).unwrap_or_default();
        }
    }
    let asked: Vec<(TransportKind, &str)> = rails_meta.iter().enumerate().map(|(i, m)| (cfg.asked(i), m.rdma_dev.as_str())).collect();
    let (lib, facts) = if select::needs_ucx(&asked) {
        match select::load_ucx() {
            Ok((u, facts)) => (Some(u), facts),
            // Asked for by name: the agent cannot run as configured.
            Err(e) if asked.iter().any(|(k, _)| *k == TransportKind::Ucx) => return Err(e),
            Err(e) => (None, select::UcxFacts::Failed(e.to_string())),
        }
    } else {
        (None, select::UcxFacts::NotTried)
    };
    let choices: Vec<select::Choice> =
        asked.iter().map(|(k, dev)| select::choose(*k, select::RailFacts { rdma_dev: dev }, &facts)).collect();
    let would: Vec<usize> = choices.iter().enumerate().filter(|(_, c)| c.kind == TransportKind::Ucx).map(|(i, _)| i).collect();
    let kinds: Vec<TransportKind> = asked.iter().map(|(k, _)| *k).collect();
    let choices = select::require_secret(&kinds, choices, cfg.secret.is_some())?;
    let mut notes = Vec::new();
    let fell: Vec<String> =
        would.iter().filter(|&&i| choices[i].kind == TransportKind::Tcp).map(|i| format!("{i} ({})", rails_meta[*i].name)).collect();
    if !fell.is_empty() {
        notes.push(format!(
            "rail(s) {} have RDMA and would run ucx (transport \"auto\"), but no shared secret is set (auth_secret, or \
             MULTIRAIL_SECRET): UCX sessions need one, so they run tcp. Set the same auth_secret on every agent to use RDMA",
            fell.join(", ")
        ));
    }
    if let Some(w) = lib.as_ref().and_then(|u| u.info().rdma_warning()) {
        notes.push(w);
    }
    let bare: Vec<String> =
        choices.iter().enumerate().filter(|(_, c)| c.unprotected).map(|(i, _)| format!("{i} ({})", rails_meta[i].name)).collect();
    if !bare.is_empty() {
        notes.push(format!(
            "rail(s) {} run UCX without RDMA, over UCX's tcp transport, as asked: UCX's tcp and shm transports check no \
             memory bounds, so a peer holding this agent's rkeys can read and write outside the regions it exports \
             (docs/SECURITY.md). Use transport \"auto\" or \"tcp\" on such rails unless every peer is trusted",
            bare.join(", ")
        ));
    }
    let on: Vec<bool> = choices.iter().map(|c| c.kind == TransportKind::Ucx).collect();
    let ucx = match lib {
        Some(u) if on.iter().any(|b| *b) => Some(Arc::new(UcxAgent::new(u, rails, rails_meta, &on)?)),
        _ => None,
    };
    Ok((choices, ucx, notes))
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Metadata of a peer `name` whose rails `rails` are all `port` on loopback.
    fn rails_at(name: &str, port: u16, rails: &[&str]) -> Vec<u8> {
        let rail = |n: &&str| RailInfo {
            name: (*n).into(),
            addr: "127.0.0.1".into(),
            prefix_len: 8,
            port,
            speed_mbps: 0,
            mtu: 65536,
            numa: -1,
            rdma_dev: String::new(),
        };
        AgentMeta { name: name.into(), incarnation: 7, rails: rails.iter().map(rail).collect(), regions: Vec::new() }.encode()
    }

    /// Metadata of a peer `name` whose one rail is `port` on loopback.
    fn peer_at(name: &str, port: u16) -> Vec<u8> {
        rails_at(name, port, &["lo"])
    }

    /// Closing a peer could wait (until 6c912ce it waited for a dial in progress: here one to a
    /// listener that never answers its handshake, until `timeout`; tests/background_connect.rs
    /// now checks that it does not). `close` (removing that peer, or closing the agent) must not
    /// hold the peer table's lock meanwhile: another thread's look-up of another peer answers
    /// at once.
    fn the_table_stays_usable_while_a_peer_closes(close: fn(&Agent, &str)) {
        let timeout = Duration::from_secs(4);
        let a = Agent::new("lock-a", Config { timeout, ..Config::default() }).expect("agent");
        let silent = TcpListener::bind("127.0.0.1:0").expect("listener");
        let port = silent.local_addr().expect("address").port();
        let name = a.add_remote(&peer_at("silent", port)).expect("silent peer");
        a.add_remote(&peer_at("other", 1)).expect("other peer");
        std::thread::scope(|sc| {
            let dialing = sc.spawn(|| a.peer(&name).expect("peer").link().map(|_| ()));
            let _dialed = silent.accept().expect("the dial"); // the link is being opened now
            let closing = sc.spawn(|| close(&a, &name));
            // Give the close time to reach the peer (it then waits for the dial).
            std::thread::sleep(Duration::from_millis(300));
            let t0 = Instant::now();
            let _ = a.has_remote("other");
            let waited = t0.elapsed();
            closing.join().expect("close");
            assert!(dialing.join().expect("dial").is_err(), "the silent peer was connected");
            assert!(waited < timeout / 2, "a look-up waited {waited:?} for a peer to close: the table's lock was held");
        });
        assert!(!a.has_remote(&name));
        a.close();
    }

    #[test]
    fn removing_a_peer_closes_it_outside_the_tables_lock() {
        the_table_stays_usable_while_a_peer_closes(|a, name| a.remove_remote(name).expect("remove"));
    }

    #[test]
    fn closing_the_agent_closes_its_peers_outside_the_tables_lock() {
        the_table_stays_usable_while_a_peer_closes(|a, _| a.close());
    }

    // The background connect's dial (peer/connect.rs), tested here: its test needs an agent,
    // and a test inside peer/ importing agent would make the module graph cyclic (tests/layers.rs).
    mod background_dial {
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        use std::time::{Duration, Instant};

        use crate::agent::Agent;
        use crate::config::Config;

        /// A listener that accepts every connection and never answers (each dial's handshake
        /// waits for `timeout`); the number accepted so far.
        fn silent_listener(stop: Arc<AtomicBool>) -> (u16, Arc<Mutex<Vec<TcpStream>>>) {
            let l = TcpListener::bind("127.0.0.1:0").expect("listener");
            l.set_nonblocking(true).expect("nonblocking");
            let port = l.local_addr().expect("address").port();
            let held = Arc::new(Mutex::new(Vec::new()));
            let h = held.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => h.lock().expect("held").push(s),
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            });
            (port, held)
        }

        /// A dial that fails after every job waiting for it has timed out (two silent rails: the
        /// dial takes about twice `timeout`, each job waits one) must not fail the next job queued,
        /// any time later, with its old error: the next job dials again.
        #[test]
        fn a_dial_that_outlives_its_jobs_does_not_fail_the_next_job() {
            let timeout = Duration::from_millis(1500);
            let stop = Arc::new(AtomicBool::new(false));
            let (port, held) = silent_listener(stop.clone());
            let cfg = Config { timeout, background_connect: true, rail_map: vec![(0, 0), (0, 1)], ..Config::default() };
            let a = Agent::new("bg-a", cfg).expect("agent");
            let name = a.add_remote(&super::rails_at("silent", port, &["a", "b"])).expect("peer");
            let p = a.peer(&name).expect("peer");
            p.connect_soon().expect("queued");
            let idle = |p: &crate::peer::Peer| p.connector.is_idle();
            // The job times out after `timeout`; the dial ends after both rails have (2 x timeout).
            let t0 = Instant::now();
            while !idle(&p) || t0.elapsed() < timeout || held.lock().expect("held").len() < 2 {
                assert!(t0.elapsed() < Duration::from_secs(30), "the dial never ended");
                std::thread::sleep(Duration::from_millis(20));
            }
            let dials = held.lock().expect("held").len();
            assert!(dials >= 2, "{dials} connections: the dial did not reach both rails");
            // Later, another job: it must dial again, not take the old dial's failure.
            p.connect_soon().expect("queued");
            let t1 = Instant::now();
            while held.lock().expect("held").len() == dials {
                assert!(t1.elapsed() < Duration::from_secs(20), "the second job never dialed: it failed with the first dial's error");
                std::thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, Ordering::Relaxed);
            a.close();
        }
    }
}
