//! The staging core: a sans-IO state machine that moves chunks through a bounded pool of
//! bounce buffers, for one side of one rail.
//!
//! Without GPUDirect a NIC cannot read or write VRAM, so every chunk of GPU memory is staged
//! through pinned host memory. Each side is a two-stage pipeline, and a bounce buffer is held
//! from the start of the first stage to the end of the second:
//!
//! | role                | stage 1 (fills the buffer) | stage 2 (empties it) |
//! |---------------------|----------------------------|----------------------|
//! | [`Role::Sender`]    | D2H copy                   | wire send            |
//! | [`Role::Receiver`]  | wire receive               | H2D copy             |
//!
//! A sender serves a WRITE from VRAM or a READ of VRAM; a receiver lands bytes into VRAM.
//! With two or more buffers per side, the D2H copy of chunk k+1, the wire for chunk k and the
//! H2D copy of chunk k-1 run at once (docs/gpu.md).
//!
//! # Order of calls
//! 1. [`Stager::new`] with the role and the pool (once per rail and direction: the pool is the
//!    runtime's, allocated once; transfers flow through the same stager).
//! 2. [`Stager::submit`] each chunk, in wire order, with a caller-chosen [`ChunkId`].
//! 3. [`Stager::poll_action`] until `None`, executing each [`Action`] (see its variants).
//! 4. Report completions with [`Stager::handle_stage1_done`] / [`Stager::handle_stage2_done`]
//!    (or the named aliases), then poll again. Completions may come in any order; stage 2 is
//!    still issued in submission order (the wire is a byte stream, so chunks cross it in order).
//! 5. [`Stager::is_idle`] says that every submitted chunk has been released.
//!
//! No clocks, no I/O: the same machine runs under the simulator ([`crate::sim`]) and the
//! executor ([`crate::pipeline`]).

use std::collections::VecDeque;

/// The caller's name for a chunk (the planner's chunk id, or an index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub u64);

/// Index of a bounce buffer in the pool, `0..pool.buffers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub usize);

/// Which side of the wire this stager serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Device memory → bounce buffer (D2H) → wire.
    Sender,
    /// Wire → bounce buffer → device memory (H2D).
    Receiver,
}

/// The bounce pool of one rail and direction: `buffers` pinned buffers of `buffer_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    pub buffers: usize,
    pub buffer_size: u64,
}

impl PoolConfig {
    /// Pinned bytes this pool holds.
    pub fn bytes(&self) -> u64 {
        self.buffers as u64 * self.buffer_size
    }
}

/// One chunk: `len` bytes at `offset` in the device region of the transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub chunk: ChunkId,
    pub offset: u64,
    pub len: u64,
}

/// What the runtime must do next. Every action names its chunk and buffer, so the runtime
/// needs no state of its own to execute it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Sender, stage 1: copy `len` bytes at device `offset` into buffer `buf` (async, on the
    /// D2H stream); report [`Stager::handle_d2h_done`] when its event completes.
    StartD2H { piece: Piece, buf: BufId },
    /// Sender, stage 2: send the first `len` bytes of `buf`; report
    /// [`Stager::handle_wire_done`] once the wire no longer needs the buffer.
    StartSend { piece: Piece, buf: BufId },
    /// Receiver, stage 1: receive the chunk's `len` bytes into `buf`; report
    /// [`Stager::handle_wire_done`].
    StartRecv { piece: Piece, buf: BufId },
    /// Receiver, stage 2: copy the first `len` bytes of `buf` to device `offset` (async, on
    /// the H2D stream); report [`Stager::handle_h2d_done`].
    StartH2D { piece: Piece, buf: BufId },
    /// The chunk is through both stages and `buf` is free again. Nothing to execute; it tells
    /// a tracer (and a runtime that keeps per-buffer state) that the buffer may be reused.
    Release { chunk: ChunkId, buf: BufId },
}

/// Misuse of the staging core (a runtime bug, not a transfer failure).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StagingError {
    /// The pool has no buffer or zero-byte buffers: nothing could ever move.
    #[error("bounce pool of {buffers} buffers of {buffer_size} bytes cannot hold a chunk")]
    EmptyPool { buffers: usize, buffer_size: u64 },
    /// A chunk does not fit one bounce buffer.
    #[error("chunk {chunk:?} of {len} bytes exceeds the bounce buffer size {buffer_size}")]
    ChunkTooLarge { chunk: ChunkId, len: u64, buffer_size: u64 },
    /// A chunk of zero bytes was submitted (it would hold a buffer for nothing).
    #[error("chunk {chunk:?} is empty")]
    EmptyChunk { chunk: ChunkId },
    /// A completion was reported for a chunk that is not in that stage.
    #[error("{event} reported for chunk {chunk:?}, which is not in that stage")]
    UnexpectedEvent { chunk: ChunkId, event: &'static str },
    /// A completion named by its hardware stage does not belong to this role (e.g. an H2D done
    /// on a sender).
    #[error("{event} does not exist on the {role:?} side")]
    WrongRole { role: Role, event: &'static str },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Stage 1 issued.
    Filling(Piece),
    /// Stage 1 done; waiting for its turn at stage 2.
    Full(Piece),
    /// Stage 2 issued.
    Draining(Piece),
}

/// The staging state machine of one side of one rail (module docs).
#[derive(Debug)]
pub struct Stager {
    role: Role,
    pool: PoolConfig,
    slots: Vec<Slot>,
    /// Free buffers, oldest-freed first (FIFO, so reuse is spread evenly and deterministic).
    free: VecDeque<BufId>,
    /// Submitted chunks that have no buffer yet.
    waiting: VecDeque<Piece>,
    /// Buffers in stage-1 issue order: stage 2 is issued from the front, in this order.
    order: VecDeque<BufId>,
    actions: VecDeque<Action>,
    in_use: usize,
    max_in_use: usize,
    bytes_released: u64,
}

impl Stager {
    /// A stager with all `pool.buffers` buffers free.
    pub fn new(role: Role, pool: PoolConfig) -> Result<Self, StagingError> {
        if pool.buffers == 0 || pool.buffer_size == 0 {
            return Err(StagingError::EmptyPool { buffers: pool.buffers, buffer_size: pool.buffer_size });
        }
        Ok(Stager {
            role,
            pool,
            slots: vec![Slot::Free; pool.buffers],
            free: (0..pool.buffers).map(BufId).collect(),
            waiting: VecDeque::new(),
            order: VecDeque::with_capacity(pool.buffers),
            actions: VecDeque::new(),
            in_use: 0,
            max_in_use: 0,
            bytes_released: 0,
        })
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn pool(&self) -> PoolConfig {
        self.pool
    }

    /// Queues a chunk. Chunks cross the wire in submission order, so both sides must submit
    /// the same chunks in the same order (see [`split`]).
    pub fn submit(&mut self, piece: Piece) -> Result<(), StagingError> {
        if piece.len == 0 {
            return Err(StagingError::EmptyChunk { chunk: piece.chunk });
        }
        if piece.len > self.pool.buffer_size {
            return Err(StagingError::ChunkTooLarge { chunk: piece.chunk, len: piece.len, buffer_size: self.pool.buffer_size });
        }
        self.waiting.push_back(piece);
        self.issue();
        Ok(())
    }

    /// The next thing to do, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Stage 1 of `chunk` completed (sender: D2H copy; receiver: wire receive).
    pub fn handle_stage1_done(&mut self, chunk: ChunkId) -> Result<(), StagingError> {
        let i = self
            .find(|s| matches!(s, Slot::Filling(p) if p.chunk == chunk))
            .ok_or(StagingError::UnexpectedEvent { chunk, event: self.stage_name(1) })?;
        if let Slot::Filling(p) = self.slots[i] {
            self.slots[i] = Slot::Full(p);
        }
        self.issue();
        Ok(())
    }

    /// Stage 2 of `chunk` completed (sender: wire send; receiver: H2D copy): its buffer is free.
    pub fn handle_stage2_done(&mut self, chunk: ChunkId) -> Result<(), StagingError> {
        let i = self
            .find(|s| matches!(s, Slot::Draining(p) if p.chunk == chunk))
            .ok_or(StagingError::UnexpectedEvent { chunk, event: self.stage_name(2) })?;
        if let Slot::Draining(p) = self.slots[i] {
            self.bytes_released += p.len;
        }
        self.slots[i] = Slot::Free;
        self.free.push_back(BufId(i));
        self.in_use -= 1;
        self.actions.push_back(Action::Release { chunk, buf: BufId(i) });
        self.issue();
        Ok(())
    }

    /// Sender: the D2H copy of `chunk` completed.
    pub fn handle_d2h_done(&mut self, chunk: ChunkId) -> Result<(), StagingError> {
        match self.role {
            Role::Sender => self.handle_stage1_done(chunk),
            Role::Receiver => Err(StagingError::WrongRole { role: self.role, event: "d2h_done" }),
        }
    }

    /// Receiver: the H2D copy of `chunk` completed.
    pub fn handle_h2d_done(&mut self, chunk: ChunkId) -> Result<(), StagingError> {
        match self.role {
            Role::Receiver => self.handle_stage2_done(chunk),
            Role::Sender => Err(StagingError::WrongRole { role: self.role, event: "h2d_done" }),
        }
    }

    /// The wire is done with `chunk` (sender: sent; receiver: received).
    pub fn handle_wire_done(&mut self, chunk: ChunkId) -> Result<(), StagingError> {
        match self.role {
            Role::Sender => self.handle_stage2_done(chunk),
            Role::Receiver => self.handle_stage1_done(chunk),
        }
    }

    /// Every submitted chunk went through both stages and no action is pending.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.in_use == 0 && self.actions.is_empty()
    }

    /// Buffers held right now.
    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// Most buffers ever held at once (never more than the pool).
    pub fn max_in_use(&self) -> usize {
        self.max_in_use
    }

    /// Bytes of chunks that completed both stages.
    pub fn bytes_released(&self) -> u64 {
        self.bytes_released
    }

    fn stage_name(&self, stage: u8) -> &'static str {
        match (self.role, stage) {
            (Role::Sender, 1) => "d2h_done",
            (Role::Sender, _) => "wire_done (send)",
            (Role::Receiver, 1) => "wire_done (recv)",
            (Role::Receiver, _) => "h2d_done",
        }
    }

    fn find(&self, pred: impl Fn(&Slot) -> bool) -> Option<usize> {
        self.slots.iter().position(pred)
    }

    /// Issues stage 2 for the oldest full buffers (in order), then stage 1 into free buffers.
    fn issue(&mut self) {
        while let Some(&b) = self.order.front() {
            let Slot::Full(piece) = self.slots[b.0] else { break };
            self.order.pop_front();
            self.slots[b.0] = Slot::Draining(piece);
            self.actions.push_back(match self.role {
                Role::Sender => Action::StartSend { piece, buf: b },
                Role::Receiver => Action::StartH2D { piece, buf: b },
            });
        }
        while !self.waiting.is_empty() {
            let Some(b) = self.free.pop_front() else { break };
            let Some(piece) = self.waiting.pop_front() else { break };
            self.slots[b.0] = Slot::Filling(piece);
            self.order.push_back(b);
            self.in_use += 1;
            self.max_in_use = self.max_in_use.max(self.in_use);
            self.actions.push_back(match self.role {
                Role::Sender => Action::StartD2H { piece, buf: b },
                Role::Receiver => Action::StartRecv { piece, buf: b },
            });
        }
    }
}

/// Cuts `len` bytes starting at device offset `base` into chunks of at most `chunk` bytes,
/// numbered from `first`. Both sides of a transfer call it with the same arguments.
pub fn split(base: u64, len: u64, chunk: u64, first: u64) -> impl Iterator<Item = Piece> {
    let chunk = chunk.max(1);
    let n = len.div_ceil(chunk);
    (0..n).map(move |i| {
        let off = i * chunk;
        Piece { chunk: ChunkId(first + i), offset: base + off, len: chunk.min(len - off) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> PoolConfig {
        PoolConfig { buffers: n, buffer_size: 100 }
    }

    fn drain(s: &mut Stager) -> Vec<Action> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    #[test]
    fn sender_fills_pool_then_sends_in_order() {
        let mut s = Stager::new(Role::Sender, pool(2)).unwrap();
        for p in split(0, 350, 100, 0) {
            s.submit(p).unwrap();
        }
        let a = drain(&mut s);
        assert_eq!(a.len(), 2, "only two buffers: {a:?}");
        assert!(matches!(a[0], Action::StartD2H { piece: Piece { chunk: ChunkId(0), .. }, buf: BufId(0) }));
        assert!(matches!(a[1], Action::StartD2H { piece: Piece { chunk: ChunkId(1), .. }, buf: BufId(1) }));
        // Chunk 1's copy finishes first: chunk 0 still goes on the wire first.
        s.handle_d2h_done(ChunkId(1)).unwrap();
        assert!(drain(&mut s).is_empty());
        s.handle_d2h_done(ChunkId(0)).unwrap();
        let a = drain(&mut s);
        assert!(matches!(a[0], Action::StartSend { piece: Piece { chunk: ChunkId(0), .. }, buf: BufId(0) }));
        assert!(matches!(a[1], Action::StartSend { piece: Piece { chunk: ChunkId(1), .. }, buf: BufId(1) }));
        s.handle_wire_done(ChunkId(0)).unwrap();
        let a = drain(&mut s);
        assert_eq!(a[0], Action::Release { chunk: ChunkId(0), buf: BufId(0) });
        assert!(matches!(a[1], Action::StartD2H { piece: Piece { chunk: ChunkId(2), .. }, buf: BufId(0) }));
        assert_eq!(s.max_in_use(), 2);
    }

    #[test]
    fn receiver_receives_then_copies_up() {
        let mut s = Stager::new(Role::Receiver, pool(3)).unwrap();
        for p in split(1000, 250, 100, 7) {
            s.submit(p).unwrap();
        }
        let a = drain(&mut s);
        assert_eq!(a.len(), 3);
        assert!(matches!(a[2], Action::StartRecv { piece: Piece { chunk: ChunkId(9), offset: 1200, len: 50 }, buf: BufId(2) }));
        s.handle_wire_done(ChunkId(7)).unwrap();
        assert!(matches!(drain(&mut s)[..], [Action::StartH2D { piece: Piece { chunk: ChunkId(7), offset: 1000, len: 100 }, .. }]));
        for c in [8, 9] {
            s.handle_wire_done(ChunkId(c)).unwrap();
        }
        for c in [9, 7, 8] {
            s.handle_h2d_done(ChunkId(c)).unwrap();
        }
        assert_eq!(drain(&mut s).len(), 2 + 3);
        assert!(s.is_idle());
        assert_eq!(s.bytes_released(), 250);
    }

    #[test]
    fn misuse_is_a_typed_error() {
        assert!(matches!(Stager::new(Role::Sender, pool(0)), Err(StagingError::EmptyPool { .. })));
        let mut s = Stager::new(Role::Sender, pool(1)).unwrap();
        let big = Piece { chunk: ChunkId(1), offset: 0, len: 101 };
        assert!(matches!(s.submit(big), Err(StagingError::ChunkTooLarge { .. })));
        assert!(matches!(s.submit(Piece { len: 0, ..big }), Err(StagingError::EmptyChunk { .. })));
        s.submit(Piece { len: 10, ..big }).unwrap();
        assert!(matches!(s.handle_wire_done(ChunkId(1)), Err(StagingError::UnexpectedEvent { .. })));
        assert!(matches!(s.handle_h2d_done(ChunkId(1)), Err(StagingError::WrongRole { .. })));
        assert!(matches!(s.handle_d2h_done(ChunkId(2)), Err(StagingError::UnexpectedEvent { .. })));
        let msg = s.handle_d2h_done(ChunkId(2)).unwrap_err().to_string();
        assert!(msg.contains("d2h_done"), "{msg}");
    }

    #[test]
    fn split_covers_exactly() {
        let v: Vec<Piece> = split(10, 1001, 100, 0).collect();
        assert_eq!(v.len(), 11);
        assert_eq!(v.iter().map(|p| p.len).sum::<u64>(), 1001);
        assert_eq!(v[10], Piece { chunk: ChunkId(10), offset: 1010, len: 1 });
        assert_eq!(split(0, 0, 100, 0).count(), 0);
    }
}
