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

/// Which data path carries READ/WRITE chunks (`Config::transport`, per rail
/// `Config::rail_transports`; docs/transports.md, "Per-rail choice").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// multirail's own TCP connections.
    #[default]
    Tcp,
    /// UCX (one UCP context per rail): RDMA where the loaded UCX and the rail have it, else
    /// UCX's tcp. Needs a UCX library at run time (`pip install "multirail[ucx]"`,
    /// `apt-get install libucx0`, or `MULTIRAIL_UCX_LIB`).
    Ucx,
    /// Per rail: ucx where the rail's NIC has an RDMA device and the loaded UCX has an RDMA
    /// transport for it, tcp elsewhere (`transport::select::choose`). Never UCX over TCP.
    Auto,
}

impl TransportKind {
    pub fn parse(s: &str) -> Option<TransportKind> {
        match s {
            "tcp" => Some(TransportKind::Tcp),
            "ucx" => Some(TransportKind::Ucx),
            "auto" => Some(TransportKind::Auto),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
            TransportKind::Auto => "auto",
        }
    }
}

/// When a ucx rail falls back to tcp, and when it tries ucx again (`transport::mixed`,
/// docs/transports.md, "Fallback").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallbackPolicy {
    /// Failures of a rail's ucx path (the rail failing, or ucx refusing to open) before it is
    /// reopened over tcp on the same addresses; 0: never fall back.
    pub after: u32,
    /// How long a fallen-back rail stays on tcp before ucx is tried again; doubles with each
    /// fallback of the rail, up to `max_cooldown`.
    pub cooldown: Duration,
    pub max_cooldown: Duration,
    /// Most switches (ucx -> tcp and back) per rail of a link; once spent, the rail stays on tcp.
    pub max_switches: u32,
}

impl Default for FallbackPolicy {
    fn default() -> Self {
        FallbackPolicy { after: 3, cooldown: Duration::from_secs(5), max_cooldown: Duration::from_secs(300), max_switches: 8 }
    }
}

/// Default of [`Config::max_peers`].
pub const DEFAULT_MAX_PEERS: usize = 4096;

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
    /// `planner.stall_timeout`; a held one, whose path answers while nothing moves, after at
    /// most this, or `planner.held_timeout` if shorter).
    pub timeout: Duration,
    /// Shared secret for the handshake; `None` disables authentication.
    pub secret: Option<Vec<u8>>,
    /// Most simultaneous authenticated inbound connections.
    pub max_connections: usize,
    /// Most inbound connections in their handshake at once (not authenticated yet; they take no
    /// slot of `max_connections`); beyond it the oldest handshake is dropped for the newest.
    pub max_handshakes: usize,
    /// Serve `MetaPut` (a peer pushing its own metadata) on control connections. Off by default:
    /// metadata then comes only from the application (fetch_remote, add_remote, NIXL, etcd).
    pub accept_metaput: bool,
    /// Most peers in the peer table (installed by the application or by `MetaPut`); beyond it,
    /// a `MetaPut` of a new name is refused, and an application install takes the place of a
    /// peer that came by `MetaPut` (refused with an error only when the application's own fill it).
    pub max_peers: usize,
    /// Most requests one connection keeps in flight.
    pub conn_window: usize,
    /// How threads wait for data (see [`Progress`]).
    pub progress: Progress,
    /// Busy-poll budget per wait for `Progress::Adaptive` callers (and the ucx transport's
    /// threads).
    pub spin: Duration,
    /// Busy-poll budget of a tcp data connection's serving thread waiting for its next request
    /// (control connections never spin), under
    /// `Progress::Adaptive` (adapted: `wire::SpinBudget`) and `Progress::Poll` (whole). Longer
    /// than `spin`: a request that comes after it is spent costs a scheduler wake-up, and
    /// requests 250 us apart found a 200 us budget spent every time (docs/benchmarks.md,
    /// "4 KiB READ latency at a request rate").
    pub serve_spin: Duration,
    /// The data path of every rail not named in `rail_transports` (see [`TransportKind`]).
    pub transport: TransportKind,
    /// Per local rail (by index), the transport asked for; None (or missing): `transport`.
    pub rail_transports: Vec<Option<TransportKind>>,
    /// When a failing ucx rail is reopened over tcp, and when ucx is tried again.
    pub fallback: FallbackPolicy,
    /// Faults to inject on every link (testing failover; see `transport::faulty`). Empty: none.
    pub faults: Vec<Fault>,
    /// GPU memory: which device kind registers and stages VRAM, and the bounce pools' shape
    /// (per connection and direction).
    pub staging: crate::staging::StagingConfig,
    /// Vectored requests: chunks of many pieces of one region, to peers and over transports
    /// that take them (docs/PROTOCOL.md). False: one request per contiguous piece.
    pub vectored: bool,
    /// Receive window per rail shared by the data connections this agent accepts on that rail
    /// (fan-in fairness, `fanin`).
    pub fan_in_window: FanInWindow,
    /// Losing every rail of a link does not fail its transfers while the peer may come back:
    /// they stay queued while probes reconnect, and fail only after `timeout` (`Error::Timeout`)
    /// or when the peer refuses every dial or restarted (`Error::PeerLost`). False: they fail
    /// at once (`PeerLost`, "no rail left"). The NIXL backend sets it (a blip is not a
    /// disconnect: docs/nixl-plugin.md).
    pub hold_when_down: bool,
    /// No network I/O on the threads that prepare, post and send notifications (the NIXL
    /// backend sets it: vLLM calls those on its engine step loop). A peer is dialled by a
    /// thread of its own (`peer::connect`), started by the first prepare; a post to a peer not
    /// connected yet is queued there and fails (`Error::Timeout`) if no connection comes within
    /// `timeout`; `send_notif` queues the notification and returns. False: those calls dial the
    /// peer themselves when it is not connected (`prepare` fails at once for an unreachable
    /// peer), and a post to a link whose every rail is down probes them first.
    pub background_connect: bool,
}

/// How a target bounds what the peers of a rail have in flight towards it (`crate::fanin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FanInWindow {
    /// Sockets as the kernel sets them.
    Off,
    /// From `fanin::AUTO_MIN_CONNS` data connections on a rail on, a budget of
    /// `max(2 MiB, the rail's speed x 200 us)` for that rail (`fanin::auto_budget`); fewer
    /// connections are left as the kernel sets them. The default.
    Auto,
    /// This many bytes per rail, shared from the first connection on.
    Bytes(usize),
}

/// A byte count with an optional binary suffix, any case: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`
/// (`None`: not a size, or past u64).
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let (num, mult) = [("kib", 1u64 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)]
        .iter()
        .find_map(|(suf, m)| lower.strip_suffix(suf).map(|n| (t[..n.len()].trim(), *m)))
        .unwrap_or((t, 1));
    num.parse::<u64>().ok()?.checked_mul(mult)
}

impl FanInWindow {
    /// `"auto"`, `"off"` (or `"0"`), or a byte count ([`parse_size`]).
    pub fn parse(s: &str) -> Option<FanInWindow> {
        let t = s.trim();
        match t.to_ascii_lowercase().as_str() {
            "auto" => return Some(FanInWindow::Auto),
            "off" | "0" => return Some(FanInWindow::Off),
            _ => {}
        }
        let b = parse_size(t)?;
        Some(if b == 0 { FanInWindow::Off } else { FanInWindow::Bytes(usize::try_from(b).ok()?) })
    }
}

impl Config {
    /// The transport asked for on local rail `i`.
    pub fn asked(&self, i: usize) -> TransportKind {
        self.rail_transports.get(i).copied().flatten().unwrap_or(self.transport)
    }
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
            max_handshakes: 256,
            accept_metaput: false,
            max_peers: DEFAULT_MAX_PEERS,
            conn_window: 16,
            progress: Progress::Adaptive,
            spin: Duration::from_micros(200),
            serve_spin: Duration::from_micros(1000),
            transport: TransportKind::Tcp,
            rail_transports: Vec::new(),
            fallback: FallbackPolicy::default(),
            faults: Vec::new(),
            staging: crate::staging::StagingConfig::default(),
            vectored: true,
            fan_in_window: FanInWindow::Auto,
            hold_when_down: false,
            background_connect: false,
        }
    }
}

/// A fault schedule for `Faulty<T>` (`transport::faulty`): `RAIL[/TRANSPORT]:KIND@AT[+DUR]`,
/// comma-separated.
/// What a fault does to its rail (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Kill,
    Blackhole,
    Slow(Duration),
    /// At the target (this agent): the answer to the first notification served from AT on is
    /// lost once (queued, the connection closed unanswered), so the initiator resends it. The
    /// rail and DUR are ignored.
    LoseAnswer,
}

/// One scheduled fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rail: usize,
    /// Only the rail's path over this transport (`RAIL/ucx:...`): on a link of mixed rails the
    /// fault hits the rail while it runs ucx and leaves its tcp fallback alone. None: the rail,
    /// whatever carries it.
    pub transport: Option<TransportKind>,
    pub kind: FaultKind,
    /// From when (after the link opened).
    pub at: Duration,
    /// For how long; None: for good.
    pub dur: Option<Duration>,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("bad duration {s:?} (e.g. 200ms, 1.5s)"))?;
    if !(0.0..=86_400.0).contains(&(v * scale)) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

impl Fault {
    /// Parse a schedule: `RAIL[/TRANSPORT]:KIND@AT[+DUR]`, comma-separated (see the module docs).
    pub fn parse_list(s: &str) -> std::result::Result<Vec<Fault>, String> {
        s.split(',').map(str::trim).filter(|f| !f.is_empty()).map(Fault::parse).collect()
    }

    pub fn parse(s: &str) -> std::result::Result<Fault, String> {
        let bad = || {
            format!("fault {s:?} is not RAIL:KIND@AT[+DUR] or RAIL/TRANSPORT:KIND@AT[+DUR] (KIND: kill, blackhole, slow=DELAY, lose_answer; TRANSPORT: tcp, ucx)")
        };
        let (rail, rest) = s.split_once(':').ok_or_else(bad)?;
        let (rail, transport) = match rail.split_once('/') {
            Some((r, t)) => (r, Some(TransportKind::parse(t.trim()).filter(|t| *t != TransportKind::Auto).ok_or_else(bad)?)),
            None => (rail, None),
        };
        let rail: usize = rail.trim().parse().map_err(|_| bad())?;
        let (kind, when) = rest.split_once('@').ok_or_else(bad)?;
        let kind = match kind.trim() {
            "kill" => FaultKind::Kill,
            "blackhole" => FaultKind::Blackhole,
            "lose_answer" => FaultKind::LoseAnswer,
            k => match k.strip_prefix("slow=") {
                Some(d) => FaultKind::Slow(parse_duration(d)?),
                None => return Err(bad()),
            },
        };
        let (at, dur) = match when.split_once('+') {
            Some((a, d)) => (parse_duration(a)?, Some(parse_duration(d)?)),
            None => (parse_duration(when)?, None),
        };
        Ok(Fault { rail, transport, kind, at, dur })
    }

    pub(crate) fn active(&self, since: Duration) -> bool {
        since >= self.at && self.dur.is_none_or(|d| since < self.at + d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schedules() {
        let f = Fault::parse_list("1:kill@200ms+1s, 0:slow=2ms@0,2:blackhole@1.5s").unwrap();
        assert_eq!(
            f[0],
            Fault { rail: 1, transport: None, kind: FaultKind::Kill, at: Duration::from_millis(200), dur: Some(Duration::from_secs(1)) }
        );
        assert_eq!(
            f[1],
            Fault { rail: 0, transport: None, kind: FaultKind::Slow(Duration::from_millis(2)), at: Duration::ZERO, dur: None }
        );
        assert_eq!(f[2].kind, FaultKind::Blackhole);
        assert_eq!(f[2].at, Duration::from_millis(1500));
        let u = Fault::parse("1/ucx:kill@0.5s+2s").unwrap();
        assert_eq!((u.rail, u.transport, u.kind), (1, Some(TransportKind::Ucx), FaultKind::Kill));
        for bad in [
            "kill@1s",
            "x:kill@1s",
            "1:boom@1s",
            "1:kill",
            "1:kill@-1s",
            "1:slow=@1s",
            "1:kill@1s+forever",
            "1/rdma:kill@1s",
            "1/auto:kill@1s",
        ] {
            assert!(Fault::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn windows() {
        let f = Fault { rail: 0, transport: None, kind: FaultKind::Kill, at: Duration::from_secs(1), dur: Some(Duration::from_secs(2)) };
        assert!(!f.active(Duration::from_millis(999)));
        assert!(f.active(Duration::from_secs(1)));
        assert!(f.active(Duration::from_millis(2999)));
        assert!(!f.active(Duration::from_secs(3)));
    }
}
