//! The executor: runs the staging core against a [`Device`] and a [`Wire`], with a bounce pool
//! of pinned buffers allocated once.
//!
//! One thread per side. The only blocking call on the hot path is the wire's: copies are
//! queued on the device's stream and run on their own (the GPU's copy engine, or the stand-in's
//! stream thread) while the thread sends or receives the previous chunk. Completions are
//! polled without blocking after every wire operation; the thread waits on a copy's event only
//! when there is nothing to send or receive.
//!
//! ```text
//! sender:   D2H(k+1) ──┐ (stream)        receiver:   recv(k) ──┐ (wire)
//!           send(k)  ──┘ (this thread)               H2D(k-1) ─┘ (stream)
//! ```
//!
//! **Streams of segments.** Besides one-shot [`Staged::send`] / [`Staged::recv`], a side runs a
//! stream of segments (planner chunks, served requests) through one pipeline, so that it does
//! not fill and drain at every segment boundary: [`Staged::submit`] queues a segment (a sender's
//! may carry a preamble, e.g. the request header, written just before its first piece);
//! [`Staged::run_until_wired`] returns once a segment has crossed the wire while the copies of
//! its neighbours keep running (a sender may `refill` it with the next segment as soon as the
//! copy stage has nothing queued); [`Staged::take_done`] hands back, in order, the segments
//! that are completely done (a receiver's once its last H2D copy has completed), and
//! [`Staged::finish`] runs everything to the end. A failure waits for the stream and drops
//! every queued segment.
//!
//! **Scattered segments.** A segment is either one device range ([`Src::At`]) or many
//! ([`Src::Pieces`]: the pages of a vectored request, sent or received as one byte stream in
//! their order). A buffer's worth of a scattered segment is one batched copy
//! ([`Device::copy_batch_pinned_async`]: on CUDA one launch of the gather kernel, which reads
//! and writes the pinned buffer directly), not one copy per page: a device copy costs the GPU
//! about 4 µs however small it is.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::{BatchCopy, CopyKind, Device, DeviceError, DevicePtr, PinnedMem};
use crate::staging::{Action, BufId, ChunkId, Piece, PoolConfig, Role, Stager, StagingError};
use crate::timeline::{Interval, Stage, Timeline};
use crate::wire::Wire;

/// Errors of a staged transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// A device call failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The staging core refused a call (a bug in this executor).
    #[error(transparent)]
    Staging(#[from] StagingError),
    /// The wire failed while sending or receiving chunk `chunk`.
    #[error("wire {op} of chunk {chunk:?} failed: {source}")]
    Wire {
        op: &'static str,
        chunk: ChunkId,
        #[source]
        source: io::Error,
    },
    /// The staging core emitted an action of the other side (a bug in this executor).
    #[error("{role:?} side got an action it cannot execute: {action:?}")]
    WrongAction { role: Role, action: Action },
    /// Nothing in flight, yet chunks are left (a bug in the staging core).
    #[error("staged transfer stalled with nothing in flight")]
    Stalled,
}

/// One measured operation of a transfer (absolute times; see [`timeline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub stage: Stage,
    pub chunk: ChunkId,
    pub bytes: u64,
    pub start: Instant,
    pub end: Instant,
}

/// What one transfer did.
#[derive(Debug, Clone)]
pub struct TransferReport {
    pub bytes: u64,
    pub chunks: u64,
    pub started: Instant,
    pub elapsed: Duration,
    /// Wire operations as this thread timed them (exact for sends; a receive includes the wait
    /// for the sender), and copies as observed: from when the stream could start them to when
    /// their event was seen complete (an upper bound; the stand-in logs exact copy times).
    pub ops: Vec<Op>,
}

/// How a segment of `len` bytes is cut into pieces of at most `buf` bytes: full pieces, except
/// a quarter-buffer piece first (`head`: a sender starting an empty pipeline, which waits for
/// its first D2H before the wire can start) and last (`tail`: a receiver, whose landing waits
/// for the segment's last H2D). Each ramp costs one copy launch more and saves three quarters
/// of a full piece's copy time where nothing else overlaps it.
pub fn piece_lengths(len: u64, buf: u64, head: bool, tail: bool) -> impl Iterator<Item = u64> {
    let buf = buf.max(1);
    let q = (buf / 4).max(4096).min(buf);
    let head = if head && len > q { q } else { 0 };
    let tail = if tail && len - head > q { q } else { 0 };
    let middle = len - head - tail;
    let full = middle.div_ceil(buf);
    let heads = (head > 0).then_some(head);
    let tails = (tail > 0).then_some(tail);
    heads.into_iter().chain((0..full).map(move |i| buf.min(middle - i * buf))).chain(tails)
}

/// Builds a [`Timeline`] from absolute-time operations, relative to `epoch`.
pub fn timeline(epoch: Instant, ops: impl IntoIterator<Item = Op>) -> Timeline {
    let mut t = Timeline::new();
    for o in ops {
        t.record(Interval {
            stage: o.stage,
            chunk: o.chunk,
            bytes: o.bytes,
            start: o.start.saturating_duration_since(epoch),
            end: o.end.saturating_duration_since(epoch),
        });
    }
    t
}

/// Running totals of one stage over every transfer of a [`Staged`]: operations, bytes, and
/// time busy (as [`TransferReport::ops`] measures it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageTotal {
    pub ops: u64,
    pub bytes: u64,
    pub busy: Duration,
}

/// One side of a staged rail: device, stream, pinned pool and an event per buffer, all
/// created once; then any number of transfers.
pub struct Staged<D: Device> {
    dev: D,
    role: Role,
    stream: D::Stream,
    events: Vec<D::Event>,
    pool: Vec<PinnedMem>,
    pool_cfg: PoolConfig,
    stager: Stager,
    next_chunk: u64,
    /// Copies queued on the stream, oldest first: (piece, buffer, when the stream could start it).
    copies: VecDeque<(Piece, BufId, Instant)>,
    /// Wire operations the stager asked for, in order.
    wire_ops: VecDeque<(Piece, BufId)>,
    /// Per-stage totals, indexed like [`Stage::ALL`].
    totals: [StageTotal; 3],
    /// Keep every operation in [`TransferReport::ops`] (off: totals only, no allocation).
    keep_ops: bool,
    /// Segments submitted and not yet handed back by `take_done`, oldest first.
    segs: VecDeque<Seg>,
    /// Chunk ids below this have finished their wire operation.
    wired_upto: u64,
    /// Chunk ids below this are completely done (released).
    done_upto: u64,
    /// Pieces submitted whose first stage has not started.
    unstarted: u64,
}

/// One segment of a stream (module docs).
#[derive(Debug)]
struct Seg {
    tag: u64,
    /// Its pieces are chunk ids `first..end`.
    first: u64,
    end: u64,
    /// Written by a sender just before the segment's first piece.
    preamble: Option<Vec<u8>>,
    /// A scattered segment's pages (its pieces' offsets count from 0 in their byte stream);
    /// None: one range (the pieces' offsets are device addresses).
    pages: Option<Arc<Pages>>,
}

/// Where a segment's bytes are in device memory (module docs).
#[derive(Debug, Clone)]
pub enum Src {
    /// One range: (address, length).
    At(DevicePtr, u64),
    /// Many ranges, in the order their bytes travel.
    Pieces(Arc<Pages>),
}

impl Src {
    pub fn len(&self) -> u64 {
        match self {
            Src::At(_, n) => *n,
            Src::Pieces(p) => p.total,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The device ranges of a scattered segment, in stream order, with where each starts in the
/// stream (for a binary search by stream offset).
#[derive(Debug)]
pub struct Pages {
    spans: Vec<(u64, u64)>,
    starts: Vec<u64>,
    total: u64,
}

impl Pages {
    /// `spans`: (device address, length), in stream order; empty ones are dropped and ranges
    /// adjacent in memory are merged.
    pub fn new(spans: impl IntoIterator<Item = (u64, u64)>) -> Pages {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (a, n) in spans {
            if n == 0 {
                continue;
            }
            match out.last_mut() {
                Some(l) if l.0 + l.1 == a => l.1 += n,
                _ => out.push((a, n)),
            }
        }
        let mut starts = Vec::with_capacity(out.len());
        let mut total = 0;
        for s in &out {
            starts.push(total);
            total += s.1;
        }
        Pages { spans: out, starts, total }
    }

    pub fn spans(&self) -> &[(u64, u64)] {
        &self.spans
    }

    /// The copies that move stream bytes `off..off+len` between the pages and a host buffer at
    /// `host` (`kind` DeviceToHost: pages into the buffer; HostToDevice: the other way).
    pub fn copies(&self, kind: CopyKind, off: u64, len: u64, host: u64) -> Vec<BatchCopy> {
        let mut out = Vec::new();
        let mut i = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        let (mut at, end) = (off, off + len);
        while at < end && i < self.spans.len() {
            let (addr, n) = self.spans[i];
            let skip = at - self.starts[i];
            let take = (n - skip).min(end - at);
            let (dev, h) = (addr + skip, host + (at - off));
            out.push(match kind {
                CopyKind::HostToDevice => (kind, dev, h, take as usize),
                _ => (kind, h, dev, take as usize),
            });
            at += take;
            i += 1;
        }
        out
    }
}

/// What a `refill` callback returns: the next segment of a sender's stream, (where its bytes
/// are, tag, preamble).
pub type NextSegment = (Src, u64, Option<Vec<u8>>);

/// A receiver that hands segments over as they land reads a piece in slices of this size.
const RECV_SLICE: usize = 128 << 10;

/// When `run` returns.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// Every submitted piece is done.
    Idle,
    /// Chunk ids below this have finished their wire operation.
    Wired(u64),
}

impl<D: Device> std::fmt::Debug for Staged<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged").field("device", &self.dev.name()).field("role", &self.role).field("pool", &self.pool_cfg).finish()
    }
}

impl<D: Device> Staged<D> {
    /// Allocates the pool (`pool.buffers` pinned buffers of `pool.buffer_size` bytes), one
    /// stream and one event per buffer.
    pub fn new(dev: D, role: Role, pool: PoolConfig) -> Result<Self, PipelineError> {
        let stager = Stager::new(role, pool)?;
        let size = usize::try_from(pool.buffer_size).map_err(|_| DeviceError::HostAlloc { len: usize::MAX })?;
        let stream = dev.create_stream()?;
        let mut bufs = Vec::with_capacity(pool.buffers);
        let mut events = Vec::with_capacity(pool.buffers);
        let mut made = || -> Result<(), DeviceError> {
            for _ in 0..pool.buffers {
                // The buffer goes into `bufs` before the event is made, so a failing
                // create_event cannot leak it.
                bufs.push(dev.alloc_pinned(size)?);
                events.push(dev.create_event()?);
            }
            Ok(())
        };
        if let Err(e) = made() {
            for b in bufs {
                // SAFETY: nothing was queued on these buffers yet.
                let _ = unsafe { dev.free_pinned(b) };
            }
            return Err(e.into());
        }
        Ok(Staged {
            dev,
            role,
            stream,
            events,
            pool: bufs,
            pool_cfg: pool,
            stager,
            next_chunk: 0,
            copies: VecDeque::with_capacity(pool.buffers),
            wire_ops: VecDeque::with_capacity(pool.buffers),
            totals: [StageTotal::default(); 3],
            keep_ops: true,
            segs: VecDeque::new(),
            wired_upto: 0,
            done_upto: 0,
            unstarted: 0,
        })
    }

    /// Pinned bytes held by the pool.
    pub fn pool_bytes(&self) -> u64 {
        self.pool_cfg.bytes()
    }

    /// The pool's pinned buffers as (address, length), for placing them on a NUMA node.
    pub fn pinned_ranges(&self) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        self.pool.iter().map(|b| (b.as_ptr(), b.len()))
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Whether transfers list every operation in their report (default on). Off, a transfer
    /// allocates nothing and only [`Staged::totals`] advance.
    pub fn keep_ops(&mut self, on: bool) {
        self.keep_ops = on;
    }

    /// Per-stage totals since this side was made: `[D2H, Wire, H2D]`.
    pub fn totals(&self) -> [StageTotal; 3] {
        self.totals
    }

    fn note(&mut self, ops: &mut Vec<Op>, op: Op) {
        let i = Stage::ALL.iter().position(|s| *s == op.stage).unwrap_or(1);
        let t = &mut self.totals[i];
        t.ops += 1;
        t.bytes += op.bytes;
        t.busy += op.end.saturating_duration_since(op.start);
        if self.keep_ops {
            ops.push(op);
        }
    }

    /// Sends `len` bytes of device memory at `src` over `wire` (D2H → wire), in chunks of the
    /// pool's buffer size.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of this device that nothing writes during the call.
    pub unsafe fn send(&mut self, src: DevicePtr, len: u64, wire: &mut dyn Wire) -> Result<TransferReport, PipelineError> {
        debug_assert_eq!(self.role, Role::Sender);
        self.transfer(src, len, wire)
    }

    /// Receives `len` bytes from `wire` into device memory at `dst` (wire → H2D).
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory of this device that nothing else touches during the
    /// call.
    pub unsafe fn recv(&mut self, dst: DevicePtr, len: u64, wire: &mut dyn Wire) -> Result<TransferReport, PipelineError> {
        debug_assert_eq!(self.role, Role::Receiver);
        self.transfer(dst, len, wire)
    }

    fn transfer(&mut self, base: DevicePtr, len: u64, wire: &mut dyn Wire) -> Result<TransferReport, PipelineError> {
        let started = Instant::now();
        if !self.segs.is_empty() {
            // A one-shot transfer on a side with a stream in progress finishes the stream first.
            self.finish(wire)?;
            while self.take_done().is_some() {}
        }
        let mut report = TransferReport { bytes: len, chunks: 0, started, elapsed: Duration::ZERO, ops: Vec::new() };
        let first = self.next_chunk;
        // SAFETY: `send`/`recv`'s contract covers the range for this call, which runs the
        // segment to completion (or fails, dropping it) before returning.
        unsafe { self.submit(base, len, u64::MAX, None)? };
        report.chunks = self.next_chunk - first;
        let r = self.run(wire, &mut report.ops, Until::Idle, None);
        if r.is_err() {
            self.reset();
        }
        r?;
        self.segs.clear();
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Queues segment `tag`: `len` bytes of device memory at `base` (a sender's source, a
    /// receiver's destination), after the segments queued before it; a sender writes
    /// `preamble` just before the segment's first piece. Nothing runs until a `run_until_wired`
    /// or `finish`.
    ///
    /// # Safety
    /// As [`Staged::send`] / [`Staged::recv`] for the range, until the segment is handed back
    /// by [`Staged::take_done`] (or a call fails).
    pub unsafe fn submit(&mut self, base: DevicePtr, len: u64, tag: u64, preamble: Option<Vec<u8>>) -> Result<(), PipelineError> {
        // SAFETY: the caller's contract.
        unsafe { self.submit_src(Src::At(base, len), tag, preamble) }
    }

    /// [`Staged::submit`] of a segment that may be scattered over many device ranges.
    ///
    /// # Safety
    /// As [`Staged::submit`], for every range of `src`.
    pub unsafe fn submit_src(&mut self, src: Src, tag: u64, preamble: Option<Vec<u8>>) -> Result<(), PipelineError> {
        let len = src.len();
        let (base, pages) = match src {
            Src::At(base, _) => (base, None),
            // A scattered segment's pieces count from 0 in its stream (`start` maps them).
            Src::Pieces(p) => (DevicePtr(0), Some(p)),
        };
        let first = self.next_chunk;
        // Ramps (`piece_lengths`): a sender whose pipeline is empty starts with a short piece,
        // so the wire starts sooner; a receiver ends every segment with a short one, so its
        // last H2D (what a landing waits for) is short.
        let idle = self.segs.is_empty() && self.copies.is_empty();
        let head = self.role == Role::Sender && idle;
        let tail = self.role == Role::Receiver;
        let mut n = 0;
        let mut off = 0;
        for l in piece_lengths(len, self.pool_cfg.buffer_size, head, tail) {
            self.stager.submit(Piece { chunk: ChunkId(first + n), offset: base.0 + off, len: l })?;
            off += l;
            n += 1;
        }
        self.next_chunk += n;
        self.unstarted += n;
        self.segs.push_back(Seg { tag, first, end: first + n, preamble: preamble.filter(|_| self.role == Role::Sender), pages });
        Ok(())
    }

    /// Runs the stream until segment `tag` has crossed the wire (a sender's last piece sent, a
    /// receiver's last piece received; its copies may still run). A sender's `refill` is asked
    /// for the next segment whenever the copy stage has nothing queued, so the next segment's
    /// D2H overlaps this one's sends; it returns None when there is none (it is not asked
    /// again in this call). On error every queued segment is dropped, after the stream is idle.
    pub fn run_until_wired(
        &mut self,
        tag: u64,
        wire: &mut dyn Wire,
        refill: Option<&mut dyn FnMut() -> Option<NextSegment>>,
    ) -> Result<(), PipelineError> {
        self.run_until_wired_notify(tag, wire, refill, None)
    }

    /// [`Staged::run_until_wired`], handing each segment that becomes completely done on the
    /// way to `done` at once (in order), instead of waiting for a later `take_done`: a receiver
    /// answers a request as soon as its last copy completes, while it receives the next.
    pub fn run_until_wired_notify(
        &mut self,
        tag: u64,
        wire: &mut dyn Wire,
        refill: Option<&mut dyn FnMut() -> Option<NextSegment>>,
        done: Option<&mut dyn FnMut(u64)>,
    ) -> Result<(), PipelineError> {
        let Some(end) = self.segs.iter().find(|s| s.tag == tag).map(|s| s.end) else { return Ok(()) };
        let mut ops = Vec::new();
        let r = self.run_notify(wire, &mut ops, Until::Wired(end), refill, done);
        if r.is_err() {
            self.reset();
        }
        r
    }

    /// Runs every queued segment to completion (the receiver's last H2D included).
    pub fn finish(&mut self, wire: &mut dyn Wire) -> Result<(), PipelineError> {
        let mut ops = Vec::new();
        let r = self.run(wire, &mut ops, Until::Idle, None);
        if r.is_err() {
            self.reset();
        }
        r
    }

    /// Notes finished copies without blocking and without touching the wire.
    pub fn poll(&mut self) -> Result<(), PipelineError> {
        let mut ops = Vec::new();
        let r = self.reap(&mut ops, &mut Instant::now());
        if r.is_err() {
            self.reset();
        }
        r
    }

    /// The oldest segment, if it is completely done (its tag), in submission order.
    pub fn take_done(&mut self) -> Option<u64> {
        let s = self.segs.front()?;
        if s.end <= self.done_upto {
            return self.segs.pop_front().map(|s| s.tag);
        }
        None
    }

    /// Segments queued and not yet handed back.
    pub fn queued(&self) -> usize {
        self.segs.len()
    }

    /// Nothing queued, no copy issued and no wire operation pending: the pool may change hands
    /// without waiting for anything.
    pub fn is_idle(&self) -> bool {
        self.segs.is_empty() && self.copies.is_empty() && self.wire_ops.is_empty()
    }

    /// Waits until nothing runs on this side's stream and drops every queued segment (a stream
    /// cut short: once this returns no copy touches the segments' memory).
    pub fn abandon(&mut self) {
        if !self.segs.is_empty() || !self.copies.is_empty() {
            self.reset();
        }
    }

    /// The tag of the oldest segment not yet across the wire, if any.
    pub fn next_queued(&self) -> Option<u64> {
        self.segs.iter().find(|s| s.end > self.wired_upto).map(|s| s.tag)
    }

    /// After a failure: wait until no copy touches the pool, and start the stager afresh,
    /// dropping every queued segment. The stream is synchronised, not the events: a copy whose
    /// event record failed is tracked by no event, yet still runs.
    fn reset(&mut self) {
        self.quiesce();
        self.copies.clear();
        self.wire_ops.clear();
        self.segs.clear();
        self.wired_upto = self.next_chunk;
        self.done_upto = self.next_chunk;
        self.unstarted = 0;
        if let Ok(s) = Stager::new(self.role, self.pool_cfg) {
            self.stager = s;
        }
    }

    /// Step 1 of `run`: copies that finished, in stream order.
    fn reap(&mut self, ops: &mut Vec<Op>, stream_free: &mut Instant) -> Result<(), PipelineError> {
        while let Some(&(piece, buf, ready)) = self.copies.front() {
            if !self.dev.query(&self.events[buf.0])? {
                break;
            }
            self.copies.pop_front();
            let end = Instant::now();
            let stage = if self.role == Role::Sender { Stage::D2H } else { Stage::H2D };
            self.note(ops, Op { stage, chunk: piece.chunk, bytes: piece.len, start: ready.max(*stream_free), end });
            *stream_free = end;
            match self.role {
                Role::Sender => self.stager.handle_d2h_done(piece.chunk)?,
                Role::Receiver => {
                    self.stager.handle_h2d_done(piece.chunk)?;
                    self.done_upto = self.done_upto.max(piece.chunk.0 + 1);
                }
            }
        }
        while let Some(a) = self.stager.poll_action() {
            self.start(a)?;
        }
        Ok(())
    }

    fn run(
        &mut self,
        wire: &mut dyn Wire,
        ops: &mut Vec<Op>,
        until: Until,
        refill: Option<&mut dyn FnMut() -> Option<NextSegment>>,
    ) -> Result<(), PipelineError> {
        self.run_notify(wire, ops, until, refill, None)
    }

    fn run_notify(
        &mut self,
        wire: &mut dyn Wire,
        ops: &mut Vec<Op>,
        until: Until,
        mut refill: Option<&mut dyn FnMut() -> Option<NextSegment>>,
        mut done: Option<&mut dyn FnMut(u64)>,
    ) -> Result<(), PipelineError> {
        let mut stream_free = Instant::now();
        loop {
            if let Until::Wired(end) = until {
                if self.wired_upto >= end {
                    return Ok(());
                }
            }
            // A sender whose copy stage has nothing left to start takes the next segment now,
            // so its D2H overlaps the sends still queued (no fill at the segment boundary).
            if self.unstarted == 0 {
                if let Some(f) = refill.as_mut() {
                    match f() {
                        // SAFETY: the refill callback's contract is `submit`'s.
                        Some((src, tag, pre)) => unsafe { self.submit_src(src, tag, pre)? },
                        None => refill = None,
                    }
                }
            }
            // 1. Copies that finished, in stream order; 2. what the stager wants started.
            self.reap(ops, &mut stream_free)?;
            if let Some(f) = done.as_mut() {
                while let Some(t) = self.take_done() {
                    f(t);
                }
            }
            // 3. One wire operation (the thread's blocking work), then look at copies again.
            if let Some((piece, buf)) = self.wire_ops.pop_front() {
                let n = piece.len as usize;
                if self.role == Role::Sender {
                    // The segment's preamble (a request or response header) goes first.
                    let pre = self.segs.iter_mut().find(|s| s.first == piece.chunk.0).and_then(|s| s.preamble.take());
                    if let Some(pre) = pre {
                        wire.send(&pre).map_err(|source| PipelineError::Wire { op: "send", chunk: piece.chunk, source })?;
                    }
                }
                let start = Instant::now();
                let r = match self.role {
                    // SAFETY: the buffer's D2H copy has completed (the stager issues a send only
                    // after d2h_done) and no copy is queued on it until it is released.
                    Role::Sender => wire.send(&unsafe { self.pool[buf.0].as_slice() }[..n]).map_err(|e| ("send", e)),
                    // SAFETY: the buffer is free (no copy queued on it) until its H2D is issued,
                    // which happens only after this receive is reported done.
                    Role::Receiver if done.is_none() => {
                        wire.recv(&mut unsafe { self.pool[buf.0].as_mut_slice() }[..n]).map_err(|e| ("recv", e))
                    }
                    Role::Receiver => {
                        // Someone waits for segments as they land: receive in slices and hand
                        // over what landed in between, so a landing is seen within one slice's
                        // wire time, not one piece's.
                        let at = self.pool[buf.0].as_ptr();
                        let mut got = 0;
                        let mut r = Ok(());
                        while got < n && r.is_ok() {
                            let k = RECV_SLICE.min(n - got);
                            // SAFETY: as above; `reap` below never touches this buffer (its H2D
                            // is issued only after the whole piece is received).
                            r = wire.recv(unsafe { std::slice::from_raw_parts_mut(at.add(got), k) }).map_err(|e| ("recv", e));
                            got += k;
                            if r.is_ok() && got < n {
                                self.reap(ops, &mut stream_free)?;
                                if let Some(f) = done.as_mut() {
                                    while let Some(t) = self.take_done() {
                                        f(t);
                                    }
                                }
                            }
                        }
                        r
                    }
                };
                r.map_err(|(op, source)| PipelineError::Wire { op, chunk: piece.chunk, source })?;
                self.note(ops, Op { stage: Stage::Wire, chunk: piece.chunk, bytes: piece.len, start, end: Instant::now() });
                self.stager.handle_wire_done(piece.chunk)?;
                self.wired_upto = self.wired_upto.max(piece.chunk.0 + 1);
                if self.role == Role::Sender {
                    self.done_upto = self.wired_upto;
                }
                continue;
            }
            // 4. Nothing for the wire: wait for the oldest copy.
            if let Some(&(_, buf, _)) = self.copies.front() {
                self.dev.synchronize(&self.events[buf.0])?;
                continue;
            }
            if self.stager.is_idle() {
                if matches!(until, Until::Idle) || self.unstarted == 0 && refill.is_none() {
                    return Ok(());
                }
                continue; // a refill may still bring the next segment
            }
            return Err(PipelineError::Stalled);
        }
    }

    /// The pages of the scattered segment that holds `chunk`, if it is one.
    fn pages_of(&self, chunk: ChunkId) -> Option<Arc<Pages>> {
        self.segs.iter().find(|s| s.first <= chunk.0 && chunk.0 < s.end).and_then(|s| s.pages.clone())
    }

    /// Queues the copy of `piece` between the device and pinned buffer `host` (`kind`).
    ///
    /// # Safety
    /// The buffer is ours to fill or drain (stager), the piece's ranges lie inside a submitted
    /// segment (`submit`'s contract).
    unsafe fn copy_piece(&self, kind: CopyKind, piece: Piece, host: u64) -> Result<(), PipelineError> {
        match self.pages_of(piece.chunk) {
            None => {
                let (dst, src) = if kind == CopyKind::DeviceToHost { (host, piece.offset) } else { (piece.offset, host) };
                // SAFETY: the caller's contract.
                unsafe { self.dev.copy_async(kind, dst, src, piece.len as usize, &self.stream)? };
            }
            Some(p) => {
                let copies = p.copies(kind, piece.offset, piece.len, host);
                // SAFETY: the caller's contract; every host side lies in our pinned buffer.
                unsafe { self.dev.copy_batch_pinned_async(&copies, &self.stream)? };
            }
        }
        Ok(())
    }

    fn start(&mut self, a: Action) -> Result<(), PipelineError> {
        let now = Instant::now();
        match (self.role, a) {
            (Role::Sender, Action::StartD2H { piece, buf }) => {
                self.unstarted = self.unstarted.saturating_sub(1);
                let dst = self.pool[buf.0].addr();
                // SAFETY: the buffer is free (stager) and holds a chunk (len <= buffer size);
                // the device range is inside the transfer (send's contract).
                unsafe { self.copy_piece(CopyKind::DeviceToHost, piece, dst)? };
                self.dev.record(&self.events[buf.0], &self.stream)?;
                self.copies.push_back((piece, buf, now));
            }
            (Role::Receiver, Action::StartH2D { piece, buf }) => {
                let src = self.pool[buf.0].addr();
                // SAFETY: the buffer holds the received chunk and is not touched until its
                // event completes; the device range is inside the transfer (recv's contract).
                unsafe { self.copy_piece(CopyKind::HostToDevice, piece, src)? };
                self.dev.record(&self.events[buf.0], &self.stream)?;
                self.copies.push_back((piece, buf, now));
            }
            (Role::Sender, Action::StartSend { piece, buf }) => self.wire_ops.push_back((piece, buf)),
            (Role::Receiver, Action::StartRecv { piece, buf }) => {
                self.unstarted = self.unstarted.saturating_sub(1);
                self.wire_ops.push_back((piece, buf));
            }
            (_, Action::Release { .. }) => {}
            (role, action) => return Err(PipelineError::WrongAction { role, action }),
        }
        Ok(())
    }
}

impl<D: Device> Staged<D> {
    /// Waits until nothing queued on this side's stream runs: the stream itself, then (if the
    /// stream cannot be synchronised) every event.
    fn quiesce(&mut self) {
        if self.dev.stream_synchronize(&self.stream).is_err() {
            for e in &self.events {
                let _ = self.dev.synchronize(e);
            }
        }
    }

    /// Makes this side's stream wait (on the device) for `event`, typically recorded on the
    /// application's stream that produced the data ([`Device::record_external`]): every copy
    /// queued after this call runs after the producer's work.
    pub fn wait_for(&mut self, event: &D::Event) -> Result<(), PipelineError> {
        self.dev.stream_wait(&self.stream, event).map_err(PipelineError::from)
    }
}

impl<D: Device> Drop for Staged<D> {
    fn drop(&mut self) {
        self.quiesce();
        for b in self.pool.drain(..) {
            // SAFETY: the stream is idle, so no copy uses the buffer.
            let _ = unsafe { self.dev.free_pinned(b) };
        }
    }
}
