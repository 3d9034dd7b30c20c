//! Typed errors. Loading errors say how to get a UCX; call errors name the UCP function and the
//! UCX status.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::load::Version;
use crate::status::Status;

/// How to get a UCX, appended to every "not found" message.
pub const INSTALL_HINT: &str = "install one with `pip install \"multirail[ucx]\"` (the libucx-cu12 wheel: tcp/shm only, \
     no RDMA) or the system package `libucx0` (Debian/Ubuntu; RDMA-capable; DOCA/MLNX_OFED UCX on clusters), \
     or set MULTIRAIL_UCX_LIB=/path/to/libucp.so.0";

/// One library the loader tried, and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The path (or the place searched when nothing was there).
    pub path: PathBuf,
    /// Why it was not used (the `dlopen` error, "not found", ...).
    pub reason: String,
}

/// The list of [`Attempt`]s, printed one after the other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attempts(pub Vec<Attempt>);

impl fmt::Display for Attempts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return write!(f, "no candidate libucp.so.0 (no system UCX, no wheel directory given)");
        }
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{}: {}", a.path.display(), a.reason)?;
        }
        Ok(())
    }
}

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No libucp could be found or loaded (explicit path unset, no usable system or wheel UCX).
    #[error("UCX not found (tried: {tried}); {hint}", hint = INSTALL_HINT)]
    NotFound { tried: Attempts },
    /// The library named explicitly (`MULTIRAIL_UCX_LIB` or [`crate::LoadOptions::explicit`])
    /// does not exist or cannot be `dlopen`ed. No other library is tried.
    #[error("cannot load the UCX named by MULTIRAIL_UCX_LIB ({path}): {reason}; point it at a libucp.so.0 or unset it to search the system and the wheel ({hint})", path = path.display(), hint = INSTALL_HINT)]
    ExplicitLoad { path: PathBuf, reason: String },
    /// The library was loaded but lacks a UCP function: not a libucp, or a build too old.
    #[error("{} is not a usable libucp: symbol {symbol} is missing ({reason})", path.display())]
    MissingSymbol { path: PathBuf, symbol: &'static str, reason: String },
    /// The library is older than the oldest UCX whose headers were checked ([`crate::MIN_VERSION`]),
    /// or of another API major version.
    #[error("UCX {found} at {} is not supported: these bindings need UCX {min} or a later 1.x; {hint}", path.display(), hint = INSTALL_HINT)]
    UnsupportedVersion { path: PathBuf, found: Version, min: Version },
    /// libucp was bound to a libucs/libuct/libucm from another directory: two UCX builds mixed.
    #[error("{} was bound to {}, which is not in its directory: two UCX installations are mixed (check LD_LIBRARY_PATH)", libucp.display(), dependency.display())]
    MixedInstall { libucp: PathBuf, dependency: PathBuf },
    /// A different libucp is already loaded in this process (at most one UCX per process).
    #[error("UCX is already loaded from {} in this process; cannot also load {} (one UCX per process)", loaded.display(), requested.display())]
    AlreadyLoaded { loaded: PathBuf, requested: PathBuf },
    /// A UCP call returned an error status.
    #[error("{op} failed: {status}")]
    Ucx { op: &'static str, status: Status },
    /// `ucp_config_modify` refused a setting (unknown name or bad value).
    #[error("UCX configuration {key}={value:?} refused: {status}")]
    Config { key: String, value: String, status: Status },
    /// A string handed to UCX contains a NUL byte.
    #[error("{what} contains a NUL byte")]
    Nul { what: &'static str },
    /// An access outside a mapped local region or outside the remote region an rkey covers.
    #[error("{what}: [{offset:#x}, +{len}) is outside [{base:#x}, +{size})")]
    OutOfBounds { what: &'static str, offset: u64, len: u64, base: u64, size: u64 },
    /// A zero-length region was given where UCX needs memory.
    #[error("{what} is empty")]
    Empty { what: &'static str },
    /// The endpoint's error callback fired (error mode PEER): the peer or the path to it is gone.
    /// The endpoint only accepts a (forced) close now.
    #[error("endpoint failed: {status}; close it and connect again")]
    EndpointFailed { status: Status },
    /// The endpoint was closed already.
    #[error("endpoint is closed")]
    EndpointClosed,
    /// A bounded wait ran out. The operation may still complete later.
    #[error("{op} did not complete within {waited:?}")]
    Timeout { op: &'static str, waited: Duration },
    /// A worker created with [`crate::ThreadMode::Single`] was used from another thread.
    #[error("this worker was created in single-thread mode on another thread; use ThreadMode::Serialized to share it")]
    WrongThread,
    /// A blob (worker address, packed rkey) is larger than its bound.
    #[error("{what} is {len} bytes, more than the bound of {max}")]
    TooLarge { what: &'static str, len: usize, max: usize },
    /// A blob from a peer (worker address, packed rkey) does not have the structure the loaded
    /// UCX produces ([`crate::WorkerAddress::check_shape`], [`crate::PackedRkey::check_shape`]).
    #[error("{what} from the peer is malformed: {why}")]
    Shape { what: &'static str, why: String },
    /// Objects of two different workers, endpoints or contexts were combined.
    #[error("{what} belongs to another {owner}")]
    Mismatch { what: &'static str, owner: &'static str },
    /// [`crate::Worker::wait_for_events`] on a context created without `wakeup(true)`.
    #[error("the context was created without the WAKEUP feature (ContextConfig::wakeup)")]
    NoWakeup,
    /// An operating-system call failed.
    #[error("{op}: {source}")]
    Io { op: &'static str, source: std::io::Error },
}

impl Error {
    pub(crate) fn ucx(op: &'static str, status: Status) -> Error {
        Error::Ucx { op, status }
    }

    /// The UCX status behind this error, if any.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Ucx { status, .. } | Error::Config { status, .. } | Error::EndpointFailed { status } => Some(*status),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
