//! `multirail`: the runtime that drives the sans-IO core (`multirail-proto`) with sockets and
//! threads.
//!
//! - [`agent::Agent`] owns the memory [`registry::Registry`], the listeners (side channel and one
//!   per rail) and the table of remote peers. Inbound connections are served by
//!   [`server`]: every remote READ/WRITE is checked against the registry before any memory is
//!   touched, and bulk bytes move between the socket and registered memory directly.
//! - [`peer::Peer`] is a remote agent as seen from here: its metadata, and once used, a
//!   [`link::Link`]: the planner that stripes transfers over the rails, failover (a failing
//!   rail is shut, its chunks are reissued on the others once fenced, and it is probed and
//!   readmitted later), notifications and completion. What carries the rails is a
//!   [`transport`]: TCP connections (`transport::tcp`: per connection a sender that pulls
//!   chunks when it has window room and a receiver that lands READ data in place) or UCX.
//! - [`xfer`] holds transfer handles and their state.
//!
//! Threads, not async: a handful of blocking threads per peer keep the data path short (one
//! syscall per chunk per direction) and the latency path free of executor hops.

pub mod agent;
pub mod auth;
pub mod config;
pub mod ctx;
pub mod error;
pub mod fanin;
pub(crate) mod gdr;
pub mod inbox;
pub mod ipc;
pub(crate) mod ipc_fd;
pub mod link;
pub mod net;
pub mod notif_seen;
pub mod numa;
pub mod peer;
pub mod registry;
pub mod server;
pub mod staging;
pub mod transport;
pub mod wire;
pub mod xfer;

#[cfg(test)]
mod ucx_tests;

pub use agent::Agent;
pub use config::{Config, FanInWindow, RailSpec, TransportKind};
pub use error::{Error, Result};
pub use xfer::{Op, RailTrace, XferHandle, XferState, XferTrace};
