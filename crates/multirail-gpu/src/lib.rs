//! `multirail-gpu`: GPU memory at the rails' speed without GPUDirect (issue #10).
//!
//! A NIC that cannot address VRAM needs every chunk staged through pinned host memory. This
//! crate pipelines that staging so the D2H copy of chunk k+1, the wire for chunk k and the H2D
//! copy of chunk k-1 run at once, through a bounded pool of bounce buffers per rail allocated
//! once (docs/gpu.md).
//!
//! Layers, top-down:
//! - [`staging`]: the sans-IO state machine ([`Stager`]): which chunk goes into which buffer,
//!   what to start next, when a buffer is free. No clock, no I/O.
//! - [`sim`]: the same machine against a simulated copy engine in virtual time; the tests there
//!   assert overlap, finishing times against the analytic bound, the pool bound and the
//!   per-stage breakdown ([`timeline`]).
//! - [`device`]: the [`Device`] trait (CUDA's model: streams, reusable events, pinned memory),
//!   implemented by [`Cuda`] (libcudart loaded at run time; typed errors when there is none) and
//!   [`StandIn`] (host memory, a copy thread per stream at a configurable rate).
//! - [`pipeline`]: the executor ([`Staged`]) that runs the stager against a device and a
//!   [`Wire`].
//!
//! Everything but the CUDA calls runs in CI on the stand-in; `make test-gpu` runs the rest on a
//! GPU machine.

pub mod any;
pub mod cuda;
pub mod device;
pub mod gather;
pub mod pipeline;
pub mod sim;
pub mod staging;
pub mod standin;
pub mod timeline;
pub mod wire;

pub use any::{Gpu, GpuEvent, GpuKind, GpuStream, ENV_GPU};
pub use cuda::{CopyMode, Cuda, CudaRuntime, LoadOptions, ENV_CUDART, ENV_CUDA_COPY, ENV_WHEEL_DIRS, KERNEL_MAX_AVG_PIECE};
pub use device::{
    uuid_string, BatchCopy, CopyHow, CopyKind, Device, DeviceError, DevicePtr, IpcHandle, MemKind, PinnedMem, Queued, RdmaWritesOrdering,
};
pub use pipeline::{Pages, PipelineError, Src, StageTotal, Staged, TransferReport};
pub use staging::{split, Action, BufId, ChunkId, Piece, PoolConfig, Role, Stager, StagingError};
pub use standin::{FailOp, StandIn, StandInConfig};
pub use timeline::{Breakdown, Stage, Timeline};
pub use wire::{mem_pair, MemWire, Wire};
