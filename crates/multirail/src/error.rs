//! Typed errors of the runtime. Each variant maps onto exactly one Python exception class
//! (crates/multirail-py/src/errors.rs, python/multirail/errors.py).

use multirail_proto::{DecodeError, Status};

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A malformed argument from the caller.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No metadata is loaded for this peer.
    #[error("unknown peer {0:?}: load its metadata first (fetch_remote_metadata / add_remote_agent)")]
    UnknownPeer(String),
    /// A local descriptor is not inside registered memory.
    #[error("local descriptor {index} ({addr:#x}, {len} bytes) is not inside memory registered with this agent")]
    NotRegistered { index: usize, addr: u64, len: u64 },
    /// A remote descriptor is not inside the peer's exported regions.
    #[error("remote descriptor {index} ({addr:#x}, {len} bytes) is outside every region peer {peer:?} exports")]
    OutOfBounds { peer: String, index: usize, addr: u64, len: u64 },
    /// Local and remote totals differ.
    #[error("local descriptors total {local} bytes but remote descriptors total {remote}")]
    LengthMismatch { local: u64, remote: u64 },
    /// The peer refused a request.
    #[error("peer {peer:?} refused the request: {status:?}: {msg}")]
    Remote { peer: String, status: Status, msg: String },
    /// Bytes from the wire that do not fit the protocol.
    #[error("protocol error from {who}: {source}")]
    Decode { who: String, source: DecodeError },
    /// A peer said something out of order.
    #[error("protocol error from {who}: {msg}")]
    Protocol { who: String, msg: String },
    /// Metadata that cannot be used.
    #[error("metadata error: {0}")]
    Metadata(String),
    /// Metadata from an earlier life of the peer.
    #[error("stale metadata for peer {peer:?}: cached incarnation {cached:#x}, peer is now {current:#x}; fetch its metadata again")]
    StaleMetadata { peer: String, cached: u64, current: u64 },
    /// The shared-secret handshake failed.
    #[error("authentication failed with {who}: {msg}")]
    Auth { who: String, msg: String },
    /// The peer vanished and no rail is left.
    #[error("peer {peer:?} lost: {reason}")]
    PeerLost { peer: String, reason: String },
    /// A deadline passed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The listen address is taken.
    #[error("address {0} is already in use")]
    AddrInUse(String),
    /// An operating-system error with context.
    #[error("{context}: {msg}")]
    Io { context: String, msg: String, kind: std::io::ErrorKind },
    /// A transport that was asked for cannot run here (e.g. no UCX library could be loaded);
    /// the message says how to install it.
    #[error("transport unavailable: {0}")]
    Unavailable(String),
    /// GPU memory cannot be used here: no usable CUDA (the message names the cause), an address
    /// that is not device memory, or no transport of this build that moves it.
    #[error("GPU memory: {0}")]
    Gpu(String),
    /// The agent is closed.
    #[error("agent is closed")]
    Closed,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(context: impl Into<String>, e: std::io::Error) -> Error {
        let context = context.into();
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(format!("{context}: {e}")),
            std::io::ErrorKind::AddrInUse => Error::AddrInUse(context),
            kind => Error::Io { context, msg: e.to_string(), kind },
        }
    }
}
