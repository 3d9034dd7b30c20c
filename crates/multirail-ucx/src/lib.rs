//! `multirail-ucx`: safe Rust bindings to the part of UCX's UCP API that one-sided RDMA needs,
//! with libucp **loaded at run time** (`dlopen`). Nothing links against UCX at build time, so the
//! crate builds, and the program starts, on hosts without UCX; [`Ucx::load`] then reports a typed
//! [`Error::NotFound`] that says how to install it.
//!
//! The building block of the `ucx` transport (issue #9); docs/ucx.md says what the transport on
//! top must do.
//!
//! # Model and order of calls
//! 1. [`Ucx::load`] (or [`Ucx::load_with`]) finds libucp: `MULTIRAIL_UCX_LIB`, then a system UCX
//!    with InfiniBand, then the `libucx` wheel, then a system UCX without InfiniBand
//!    ([`load`] module docs). [`Ucx::info`] says which library, version and
//!    transport modules were loaded. One UCX per process.
//! 2. Per rail: a [`Context`] restricted to the rail's device ([`ContextConfig::net_devices`],
//!    [`ContextConfig::tls`]) and one [`Worker`].
//! 3. Target side: [`Context::map`] existing memory → [`MemRegion::pack_rkey`] and
//!    [`Worker::address`] go into the metadata, with [`MemRegion::remote_region`].
//! 4. Initiator side: [`Worker::connect`] to the peer's [`WorkerAddress`] (error mode PEER) →
//!    [`Endpoint::unpack_rkey`] → [`Endpoint::put`] / [`Endpoint::get`] → [`Request::wait`]
//!    (and [`Endpoint::flush`] for remote completion of PUTs).
//! 5. Teardown: [`Endpoint::close`] (force on failure), then drop rkeys, regions, workers,
//!    contexts (each object keeps what it depends on alive, so any drop order is safe).
//!
//! # Progress
//! No UCX progress thread: completions happen only while a thread calls [`Worker::progress`]
//! (directly, or inside [`Request::wait`], [`Request::test`], [`Worker::progress_until`],
//! [`Endpoint::close`]). Every wait takes a deadline. Both sides must progress: the target's
//! worker completes connection set-up and, on transports without hardware RMA (tcp, shm), carries
//! out the PUT/GET itself ([`Worker::wait_for_events`] lets a passive side sleep between events).
//!
//! # Threads
//! Every object is `Send + Sync`. All calls on one worker (and its endpoints, rkeys and requests)
//! are serialised by one mutex, so UCX runs with `UCS_THREAD_MODE_SERIALIZED` (default) or
//! `SINGLE` ([`ThreadMode`]). Context-level calls (map, pack) may run on any thread
//! (`mt_workers_shared = 1`).
//!
//! # Trust
//! UCX parses worker addresses and packed rkeys without a length, so bytes from a peer enter only
//! through the `unsafe` constructors [`WorkerAddress::from_peer`] and [`PackedRkey::from_peer`]:
//! they must come intact from an authenticated channel. [`Context::map`] is `unsafe` because the
//! memory is shared with UCX and peers for as long as it is mapped.

mod capture;
pub mod context;
pub mod endpoint;
pub mod error;
pub mod load;
mod quiesce;
pub mod status;
pub mod sys;
pub mod worker;

pub use context::{Context, ContextConfig, MemRegion, MemoryType, PackedRkey, Protection, RemoteRegion, MAX_RKEY_LEN};
pub use endpoint::{CloseMode, Endpoint, Rkey, TransportEntry, TransportSource, Transports, DROP_CLOSE_TIMEOUT};
pub use error::{Error, Result};
pub use load::{rdma_devices, LibInfo, LoadOptions, Source, Ucx, Version, ENV_LIB, ENV_SYSTEM, ENV_WHEEL_DIR, MIN_VERSION};
pub use status::Status;
pub use worker::{AmData, AmHandler, Request, ThreadMode, Worker, WorkerAddress, MAX_ADDRESS_LEN};
