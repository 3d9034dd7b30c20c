//! The transport seam: what one transport (TCP sockets, UCX) does for the rails of one link.
//!
//! A link (`crate::link`) is transport-independent: it owns the planner (chunk scheduling, weights, tail
//! balancing), the transfers in flight, failover (a rail's chunks requeued once its last path
//! stopped), the fence -> reissue -> readmit sequence, notifications and completion. A
//! [`Transport`] moves chunks over the link's rails and reports back through [`Host`], the narrow
//! interface the link implements for it (the seam runs one way: nothing here, nor in any
//! transport, imports the agent, peer, link or server; `tests/layers.rs` checks it):
//!
//! | the transport calls | when |
//! |---|---|
//! | [`Host::next_chunk`] / [`Host::wait_chunk`] | it has room for one more chunk on a rail |
//! | [`Host::chunk_done`] | a chunk finished (landed, or refused by the target) |
//! | [`Host::rail_failed`] | a path of a rail failed (the link then shuts the rail: `shut_rail`) |
//! | [`Host::path_stopped`] | a path stopped; the last one of a rail runs the rail-down path |
//! | [`Host::enter`] | before a thread of its own touches registered memory |
//! | [`Host::dial`] | open an authenticated connection on a rail (`net::dial`, peer checked) |
//!
//! Rules every transport keeps (the conformance tests in `tests/test_transports.py` check them
//! through the Python API, for each transport):
//! - A chunk handed out by the link is reported exactly once, through `chunk_done` or by its
//!   rail's last path stopping (then the planner requeues it).
//! - When `path_stopped` reports the last path of a rail, nothing of that rail touches local
//!   memory any more, and `fence_ids` names every path of the rail that carried a WRITE: the
//!   link has the target fence them before any chunk is reissued.
//! - After `close` returns no new work starts; threads of the transport leave within a tick of
//!   seeing `Host::is_shutdown` (the link waits for `enter` counts to drain).
//! - Nothing blocks without a deadline. Stalls are not the transport's to decide: the link's
//!   watchdog asks the planner (`Planner::poll_stalled`), with `quiet_for` as evidence, and shuts
//!   a stalled rail (`shut_rail`); the transport only has to stop promptly when shut.
//!
//! docs/transports.md is the guide for writing a new one.

pub mod faulty;
pub mod mixed;
pub mod select;
pub(crate) mod tcp;
pub(crate) mod ucx;

use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status};
use multirail_proto::{Chunk, ChunkId, RegionKey};

use crate::config::Config;
use crate::error::Result;
use crate::staging::StageStats;
use crate::xfer::XferShared;

/// What a transport sees of the link whose rails it carries (implemented by `link::Link`).
/// Everything else (the planner, transfers, fences, probes, the peer's metadata) stays above.
pub(crate) trait Host: Send + Sync {
    /// The peer's name (for errors).
    fn peer_name(&self) -> &str;
    /// The agent's configuration (connections, windows, progress mode, staging, timeouts).
    fn cfg(&self) -> &Config;
    /// How many rails the link has.
    fn rails(&self) -> usize;
    /// Rail `ri`'s local interface, if it has one (for carrier checks: `net::link_down`).
    fn local_dev(&self, ri: usize) -> Option<&str>;
    /// The CPUs local to rail `ri`'s NIC, where its threads run (`numa::pin_current_thread`;
    /// empty: unknown, leave them be).
    fn rail_cpus(&self, _ri: usize) -> Vec<usize> {
        Vec::new()
    }
    /// Rail `ri`'s index among this agent's rails and among the peer's.
    fn rail_indices(&self, ri: usize) -> (usize, usize);
    /// Rail `ri`'s GPU staging totals (its counters outlive the link).
    fn staging(&self, ri: usize) -> Arc<StageStats>;
    /// The key of the peer's region `region` (sent with each request on tcp).
    fn key(&self, region: u64) -> RegionKey;
    /// An authenticated connection of `role` on rail `ri` to the peer (its name and
    /// incarnation checked: a restarted peer is `StaleMetadata`) and its id (the `Hello` nonce).
    fn dial(&self, ri: usize, role: Role, timeout: Duration) -> Result<(TcpStream, [u8; 16])>;
    /// As `dial`, and the `Hello` version the peer accepted (a `Role::UcxSession` connection
    /// offers `HELLO_UCX_FEATURES`: version 3 carries the ucx feature words).
    /// Also the connection's session key (with a shared secret; a UCX session needs it).
    fn dial_hello(&self, ri: usize, role: Role, timeout: Duration) -> Result<crate::net::Dialed> {
        self.dial(ri, role, timeout).map(|(stream, id)| crate::net::Dialed { stream, id, version: 1, session_key: None })
    }
    /// Whether rail `ri` is handed vectored chunks (many pieces of one region per chunk, see
    /// `Chunk::vec`): a transport sets it once it knows it and the peer take them on that rail.
    fn set_vectored(&self, ri: usize, on: bool);
    /// Whether rail `ri`'s peer takes vectored requests on its GPU regions too (`Hello`
    /// version `HELLO_VECTORED_GPU`, on every connection): transfers into the peer's GPU memory
    /// are vectored only when every rail says so (`Link::vectored_gpu`).
    fn set_vectored_gpu(&self, _ri: usize, _on: bool) {}
    /// Whether rail `ri` reports progress below chunk level (`quiet_for`): a transport sets it
    /// when it opens the rail (tcp: yes; ucx: no), so the planner measures that rail's silence
    /// in bytes or in whole chunks (`Planner::set_byte_progress`).
    fn set_byte_progress(&self, ri: usize, on: bool);
    /// Count the calling thread as one that may touch registered memory; None once the link is
    /// shutting down. Hold the guard while the thread may.
    fn enter(&self) -> Option<Active<'_>>;
    /// True once the link is shutting down: transport threads leave.
    fn is_shutdown(&self) -> bool;
    /// Microseconds since the link opened (a clock for timestamps in atomics).
    fn now_us(&self) -> u64;
    /// The next chunk the planner has for rail `ri`, with its transfer.
    fn next_chunk(&self, ri: usize) -> Option<(Chunk, Arc<XferShared>)>;
    /// Wait until `room()` and the planner has a chunk for rail `ri`, or `stop()`.
    fn wait_chunk(&self, ri: usize, room: &dyn Fn() -> bool, stop: &dyn Fn() -> bool) -> Option<(Chunk, Arc<XferShared>)>;
    /// Wake the threads waiting in `wait_chunk` so that they look at their `stop()` again.
    fn wake_senders(&self);
    /// A chunk handed out for rail `ri` finished: landed (`Ok`) or refused by the target.
    fn chunk_done(&self, ri: usize, chunk: ChunkId, x: &XferShared, len: u64, r: std::result::Result<(), (Status, String)>);
    /// A path of rail `ri` failed; the link records the first reason and shuts the rail.
    fn rail_failed(&self, ri: usize, reason: String);
    /// A path of rail `ri` stopped; `last()` (run under the rail's readmission lock) says
    /// whether it was the rail's last live path.
    fn path_stopped(&self, ri: usize, last: &mut dyn FnMut() -> bool);
    /// Carry out the transport's scheduled faults that are due (`Transport::tick_faults`).
    fn tick_faults(&self);
    /// Record an event in the agent's log (rail switches), naming the peer.
    fn log(&self, msg: &str);
}

/// One thread counted as touching registered memory through a link (see [`Host::enter`]).
pub(crate) struct Active<'a>(pub(crate) &'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a transport can do; reported per rail by `rail_stats()` and used by the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Can READ/WRITE straight into remote device (GPU) memory (GPUDirect RDMA).
    pub remote_vram: bool,
    /// One-sided: the target's CPU does not touch the bytes (RDMA). TCP and UCX's tcp
    /// transport are two-sided (the target's thread copies).
    pub one_sided: bool,
    /// How GPU memory crosses this rail.
    pub gpu: GpuPath,
}

/// How a rail moves GPU memory (`rail_stats()["gpu_path"]`, docs/gpu.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuPath {
    /// Through pinned bounce buffers, pipelined (D2H, wire, H2D).
    Staged,
    /// The NIC reads and writes device memory itself (GPUDirect RDMA).
    Direct,
}

impl GpuPath {
    pub fn as_str(self) -> &'static str {
        match self {
            GpuPath::Staged => "staged",
            GpuPath::Direct => "direct",
        }
    }
}

/// How a rail came to run its transport, for `rail_stats()` (`Transport::choice`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailChoice {
    /// Why ("auto: no RDMA device", "explicit", "fallback after 3 ucx failures", ...).
    pub reason: String,
    /// Times the rail fell back from ucx to tcp (on this link).
    pub fallbacks: u64,
    /// Changes of transport (fallbacks and retries of ucx).
    pub switches: u64,
    /// When ucx is tried again, if the rail is on tcp after a fallback and a retry is left.
    pub next_retry: Option<Duration>,
}

/// What the link does with a chunk's completion (`Transport::verdict`; fault injection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Deliver,
    /// Never reported: the chunk stays in flight until its rail is declared down.
    Drop,
    /// Reported this late.
    Delay(Duration),
}

/// The rails of one link over one transport.
pub(crate) trait Transport: Send + Sync {
    fn caps(&self) -> Caps;
    /// What rail `ri` can do (a link of mixed rails differs per rail).
    fn rail_caps(&self, _ri: usize) -> Caps {
        self.caps()
    }
    /// Why GPU memory takes the path `caps().gpu` says, beyond what the path implies (for
    /// `rail_stats()`'s `gpu_path_reason`).
    fn gpu_detail(&self) -> Option<String> {
        None
    }
    /// Open rail `ri` (its connections or endpoints, and the threads that move its chunks) to
    /// the link's peer, within `timeout`. On success the rail pulls work from the link.
    fn open_rail(&self, link: &Arc<dyn Host>, ri: usize, timeout: Duration) -> Result<()>;
    /// Whether rail `ri` has a live path.
    fn is_up(&self, ri: usize) -> bool;
    /// Start what the planner has for every rail from the calling thread (a post saves a
    /// thread wakeup this way). `will_drive`: the caller waits for its transfer next and drives
    /// it (see `drive`). Returns true when some rail still has work and no room for it.
    fn post_ready(&self, link: &dyn Host, will_drive: bool) -> bool;
    /// Let the waiting caller complete `x` itself, until `deadline`; `poll_only`: only what has
    /// already arrived. Returns whether `x` is finished. A transport without caller-driven
    /// completion returns false at once (the caller then waits on the transfer).
    fn drive(&self, link: &dyn Host, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool;
    /// Whether a chunk of `x` is still in a path of this transport (cancel waits for none).
    fn holds(&self, x: &Arc<XferShared>) -> bool;
    /// Whether a chunk of `x` is still in a path of rail `ri`; a path that stopped holds none.
    fn holds_on(&self, _ri: usize, x: &Arc<XferShared>) -> bool {
        self.holds(x)
    }
    /// Shut every path of rail `ri` now; each then reports `path_stopped`.
    fn shut_rail(&self, ri: usize);
    /// Ids (Hello nonces) of rail `ri`'s paths that carried WRITEs: the target must fence them.
    fn fence_ids(&self, ri: usize) -> Vec<[u8; 16]>;
    /// Paths (connections, endpoints) of rail `ri` now.
    fn paths(&self, ri: usize) -> usize;
    /// What rail `ri` runs on, for `rail_stats()` ("tcp", "ucx/tcp", "ucx/rc_mlx5").
    fn describe(&self, ri: usize) -> String;
    /// How long rail `ri` has gone without any sign of progress below chunk level (bytes or
    /// acknowledgements received), if the transport can tell: the planner's stall clock counts
    /// whole chunks only, and a large chunk on a slow rail is progress. None: no such evidence.
    fn quiet_for(&self, _ri: usize) -> Option<Duration> {
        None
    }
    /// Whether rail `ri` is held: its silence is no sign of a dead path (`Planner::handle_held`).
    /// A path with work has had every byte it sent acknowledged, and the rest waits in this
    /// host's own full queue (TCP: its packets were dropped by the local qdisc and it retries on
    /// a backing-off timer), or behind the peer's closed receive window, or the peer's
    /// application has not answered yet while its kernel answers the path's probes. False when
    /// the transport cannot tell, and whenever `path_dead` says true.
    fn held_back(&self, _ri: usize) -> bool {
        false
    }
    /// Whether a path of rail `ri` with work shows that it is dead: a probe of it went
    /// unanswered (TCP: the keepalive of a connection that owes nothing). A hold then ends at
    /// once (`Planner::handle_path_dead`) instead of lasting out its renewal period.
    fn path_dead(&self, _ri: usize) -> bool {
        false
    }
    /// What rail `ri`'s busy paths look like now, for the reason of a stall (TCP: each busy
    /// connection's TCP_INFO in brief). None when the transport cannot say.
    fn evidence(&self, _ri: usize) -> Option<String> {
        None
    }
    /// What to do with a completion on rail `ri` (only `Faulty` says other than Deliver).
    fn verdict(&self, _ri: usize) -> Verdict {
        Verdict::Deliver
    }
    /// Carry out scheduled faults that are due (only `Faulty`).
    fn tick_faults(&self, _link: &dyn Host) {}
    /// Called by the link's watchdog every 100 ms or less: time-driven work of the transport
    /// (`Mixed` retries ucx after a cool-down by failing the rail's tcp paths).
    fn tick(&self, _link: &dyn Host) {}
    /// When the transport decides per rail what carries it (`Mixed`): what rail `ri` runs on
    /// (as `describe`) and how it came to, read together so that `rail_stats()` never pairs
    /// one carrier with another's reason. None: `describe` and the agent's choice stand.
    fn choice(&self, _ri: usize) -> Option<(String, RailChoice)> {
        None
    }
    /// Work may be waiting for rails whose threads do not wait on the link's condition (a rail
    /// went down and its chunks were requeued, a rail came back): look again.
    fn wake(&self);
    /// Shut everything (the link is closing); threads leave on their own.
    fn close(&self);
}
