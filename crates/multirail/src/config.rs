//! Agent configuration.

use std::net::IpAddr;
use std::time::Duration;

use multirail_proto::PlannerConfig;

/// One local rail: an interface (or just an address) whose traffic leaves through one NIC.
#[derive(Debug, Clone)]
pub struct RailSpec {
    /// Interface name, or a label when only an address is known.
    pub name: String,
    pub addr: IpAddr,
    pub prefix_len: u8,
    /// Link speed in Mbit/s; 0 when unknown.
    pub speed_mbps: u64,
    pub mtu: u32,
    pub numa: i32,
    pub rdma_dev: String,
    /// Bind connections to the interface too (SO_BINDTODEVICE; needs CAP_NET_RAW, tried and
    /// skipped silently without it). The source address is always bound.
    pub bind_device: bool,
}

/// How a thread that waits for data on a connection behaves (`Config::progress`).
///
/// Waiting in the kernel (`Block`) costs no CPU but puts a scheduler wake-up on every round
/// trip, which a loaded host makes slow and erratic; busy-polling keeps the thread on the CPU
/// and sees the data as soon as it lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Sleep in the kernel until data arrives (no spinning).
    Block,
    /// A waiting caller busy-polls until its transfer completes or its deadline passes; a
    /// serving connection busy-polls for `spin` after each request, then sleeps.
    Poll,
    /// Waiting callers and serving connections busy-poll for up to `spin`, then sleep.
    Adaptive,
}

impl Progress {
    pub fn parse(s: &str) -> Option<Progress> {
        match s {
            "block" => Some(Progress::Block),
            "poll" => Some(Progress::Poll),
            "adaptive" => Some(Progress::Adaptive),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Progress::Block => "block",
            Progress::Poll => "poll",
            Progress::Adaptive => "adaptive",
        }
    }
}

/// Which data path carries READ/WRITE chunks (`Config::transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// multirail's own TCP connections.
    #[default]
    Tcp,
    /// UCX (one UCP context per rail): RDMA where the loaded UCX and the rail have it, else
    /// UCX's tcp. Needs a UCX library at run time (`pip install "multirail[ucx]"`,
    /// `apt-get install libucx0`, or `MULTIRAIL_UCX_LIB`).
    Ucx,
}

impl TransportKind {
    pub fn parse(s: &str) -> Option<TransportKind> {
        match s {
            "tcp" => Some(TransportKind::Tcp),
            "ucx" => Some(TransportKind::Ucx),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Side-channel listen address.
    pub host: String,
    /// Side-channel port; 0 picks one (see `Agent::port`).
    pub port: u16,
    /// Connections per rail per peer.
    pub connections: usize,
    /// Local rails; empty means one rail on `host`.
    pub rails: Vec<RailSpec>,
    /// Explicit (local rail index, remote rail index) pairs; empty means pair by shared subnet.
    pub rail_map: Vec<(usize, usize)>,
    pub planner: PlannerConfig,
    /// Connect, handshake and request timeout (a stalled rail is declared down after
    /// `planner.stall_timeout`).
    pub timeout: Duration,
    /// Shared secret for the handshake; `None` disables authentication.
    pub secret: Option<Vec<u8>>,
    /// Most simultaneous inbound connections.
    pub max_connections: usize,
    /// Most requests one connection keeps in flight.
    pub conn_window: usize,
    /// How threads wait for data (see [`Progress`]).
    pub progress: Progress,
    /// Busy-poll budget per wait for `Progress::Adaptive` (callers and serving connections)
    /// and for serving connections under `Progress::Poll`.
    pub spin: Duration,
    /// The data path (see [`TransportKind`]).
    pub transport: TransportKind,
    /// Faults to inject on every link (testing failover; see `transport::faulty`). Empty: none.
    pub faults: Vec<crate::transport::faulty::Fault>,
    /// GPU memory: which device kind registers and stages VRAM, and the bounce pools' shape
    /// (per connection and direction).
    pub staging: crate::staging::StagingConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: "127.0.0.1".into(),
            port: 0,
            connections: 1,
            rails: Vec::new(),
            rail_map: Vec::new(),
            planner: PlannerConfig::default(),
            timeout: Duration::from_secs(10),
            secret: None,
            max_connections: 1024,
            conn_window: 16,
            progress: Progress::Adaptive,
            spin: Duration::from_micros(200),
            transport: TransportKind::Tcp,
            faults: Vec::new(),
            staging: crate::staging::StagingConfig::default(),
        }
    }
}
