//! `multirail-proto`: the sans-IO heart of multirail.
//!
//! Nothing in this crate opens a socket, starts a thread, touches CUDA or reads a clock:
//! time is passed in by the caller (`now: Instant`). The runtime crate (`multirail`) is a
//! thin driver around these state machines, and the simulator in `tests/` drives the same
//! code with virtual time.
//!
//! Modules, top down:
//! - [`codec`]: the versioned, length-prefixed wire format of the side channel and data plane.
//!   Every length read from the wire is bounded before anything is allocated.
//! - [`meta`]: agent metadata (name, incarnation, rails, endpoints, exported regions) and
//!   serialised descriptor lists, as explicit binary schemas (no pickle).
//! - [`planner`]: cuts transfers into chunks and hands them to rails by measured weight,
//!   balances the tail, re-plans when a rail fails.

pub mod codec;
pub mod meta;
pub mod planner;
pub mod reader;

pub use codec::{Body, DecodeError, EncodeError, Header, Kind, Status};
pub use meta::{Access, AgentMeta, DescList, MemType, RailInfo, RegionKey, RegionMeta};
pub use planner::{Chunk, ChunkId, Event, Pair, Planner, PlannerConfig, Policy, RailId, XferId};
