//! Blocking framed I/O over a `TcpStream`, on top of the sans-IO codec.
//!
//! Sockets carry a short receive/send timeout (a "tick"). Reads and writes retry across ticks
//! and call a `tick` closure each time one passes, which decides whether to keep waiting (the
//! caller's deadline, stall detection and shutdown live there). So nothing blocks forever.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;

use multirail_proto::codec::{HEADER_LEN, MAX_CHUNK};
use multirail_proto::{Body, Header};

/// Why a framed read stopped.
#[derive(Debug)]
pub enum WireError {
    /// The socket failed or closed.
    Io(io::Error),
    /// The peer sent bytes that do not decode.
    Decode(multirail_proto::DecodeError),
    /// The tick closure gave up (deadline, stall, shutdown); carries its reason.
    GaveUp(String),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        WireError::Io(e)
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => write!(f, "connection closed by peer"),
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Decode(e) => write!(f, "{e}"),
            WireError::GaveUp(r) => write!(f, "{r}"),
        }
    }
}

/// Wait up to `timeout` for `fd` to be readable (or closed/failed). False on timeout.
pub fn poll_in(fd: std::os::fd::RawFd, timeout: std::time::Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis().min(i32::MAX as u128) as i32) };
    r != 0
}

/// How often a busy-poll runs its `check` closure.
const SPIN_CHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// How a busy-poll ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spin {
    /// The socket became readable (or closed): the next read will not sleep.
    Ready,
    /// The budget ran out first.
    Exhausted,
    /// `check` ended it (nothing to wait for any more).
    Stopped,
}

/// Whether a read of `fd` would find data (or the end) now, without waiting.
pub fn readable_now(fd: std::os::fd::RawFd) -> bool {
    poll_in(fd, std::time::Duration::ZERO)
}

/// Busy-poll (non-blocking readiness checks, no sleep) until `fd` is readable or closed, or
/// `budget` has passed, so that the read that follows finds its data without a scheduler
/// wake-up. Between checks it only pauses (no `sched_yield`): measured with two CPU hogs on
/// the host, yielding here handed each round trip a hog's time slice (4 KiB p50 ~4 ms against
/// ~20 us); on an oversubscribed host [`SpinBudget`] shrinks the spin instead. `check` runs
/// about every 10 ms: `Ok(false)` ends the spin early, an error aborts it.
pub fn spin_readable<E>(
    fd: std::os::fd::RawFd,
    budget: std::time::Duration,
    mut check: impl FnMut() -> Result<bool, E>,
) -> Result<Spin, E> {
    if budget.is_zero() {
        return Ok(Spin::Exhausted);
    }
    let t0 = std::time::Instant::now();
    let mut next_check = t0 + SPIN_CHECK;
    loop {
        if poll_in(fd, std::time::Duration::ZERO) {
            return Ok(Spin::Ready);
        }
        let now = std::time::Instant::now();
        if now.duration_since(t0) >= budget {
            return Ok(Spin::Exhausted);
        }
        if now >= next_check {
            if !check()? {
                return Ok(Spin::Stopped);
            }
            next_check = now + SPIN_CHECK;
        }
        std::hint::spin_loop();
    }
}

/// An adaptive busy-poll budget: doubled (up to `max`) when data arrived within it, halved
/// (down to `max / 16`) when it ran out. Spinning that keeps paying off (back-to-back round
/// trips) stays at `max`; on an oversubscribed host, where the peer is not running to answer,
/// failed spins shrink it so the CPU goes back to the threads that need it. A spin that ran
/// out before data that came within `max` of its start grows it back too ([`SpinBudget::woke`]):
/// without that, a budget shrunk by a few bad moments stayed at `max / 16` for good under
/// requests spaced wider than that (a 4 KiB READ every 50-150 us woke the serving thread from
/// the kernel on every request).
pub struct SpinBudget {
    cur_ns: std::sync::atomic::AtomicU64,
    max_ns: u64,
}

impl SpinBudget {
    pub fn new(max: std::time::Duration) -> SpinBudget {
        let max_ns = max.as_nanos().min(u64::MAX as u128) as u64;
        SpinBudget { cur_ns: std::sync::atomic::AtomicU64::new(max_ns), max_ns }
    }

    pub fn get(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.cur_ns.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Adjust after a spin that ended `how`.
    pub fn record(&self, how: Spin) {
        use std::sync::atomic::Ordering::Relaxed;
        let cur = self.cur_ns.load(Relaxed);
        let next = match how {
            Spin::Ready => cur.saturating_mul(2).min(self.max_ns),
            Spin::Exhausted => (cur / 2).max(self.max_ns / 16),
            Spin::Stopped => cur,
        };
        self.cur_ns.store(next, Relaxed);
    }

    /// After a spin that ran out, data came `after` the spin began: a spin of `max` would have
    /// caught it, so the budget grows to twice that wait (at least double, up to `max`); later
    /// than `max`, nothing changes. Only doubling was not enough: the spin that ran out had
    /// halved the budget (`record`), so a budget below the requests' spacing went down and back
    /// up at every request and never past the spacing (paced 4 KiB READs 250 us apart woke the
    /// serving thread from the kernel on every request once a loaded moment had shrunk it).
    pub fn woke(&self, after: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let after_ns = after.as_nanos().min(u128::from(u64::MAX)) as u64;
        if after_ns <= self.max_ns {
            let cur = self.cur_ns.load(Relaxed);
            self.cur_ns.store(cur.saturating_mul(2).max(after_ns.saturating_mul(2)).min(self.max_ns), Relaxed);
        }
    }
}

fn is_tick(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Fill `buf` completely. `started` tells the tick closure whether any byte has arrived yet
/// (a peer may idle between frames but not in the middle of one).
pub fn read_full(s: &mut TcpStream, buf: &mut [u8], tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => tick(got > 0).map_err(WireError::GaveUp)?,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// The most bytes of a bulk payload a read waits for before it wakes (`SO_RCVLOWAT`).
///
/// Without it the kernel wakes a reader for every segment that lands (on loopback, up to 64 KiB
/// each), and each wake-up costs a context switch on the reader and the wake on whoever
/// delivered the segment. A bulk read knows how many bytes it is owed, so it asks to be woken
/// once per this many, or once when the rest of its payload has come. Measured on loopback
/// (docs/benchmarks.md, "Issue 22: session 18"): a plain C socket pair moving a 64 MiB buffer
/// in 1 MiB reads took 15-20% less CPU per byte with a 256 KiB mark, and the engine 4-10% less
/// at the median (new / old build in the same runs).
pub const BULK_LOWAT_MAX: usize = 256 << 10;

/// Payloads shorter than this are read as they come: the mark's two `setsockopt`s would cost
/// about what the wake-ups they save do.
pub const BULK_LOWAT_MIN: usize = 64 << 10;

/// The low-water mark of one bulk read: set while the read runs, back to 1 (the default) when it
/// ends, so that frame reads and readiness polls between payloads wake on their first byte.
///
/// The mark never exceeds what the payload still owes, so it never waits for bytes the peer has
/// not promised (the kernel would otherwise sleep until the socket's timeout), and never
/// exceeds a quarter of the receive buffer (half the window or so), so the peer keeps sending
/// while the reader sleeps. A buffer pinned small (the target's fan-in shares) gets a small mark,
/// or none.
///
/// The reader waits in `poll`, never inside a blocking `recv`, and then reads without waiting.
/// The kernel wakes a socket's sleepers when its unread bytes reach the mark; a blocking `recv`
/// that has already copied part of what it asked for and sleeps for the rest is not woken when
/// the rest (under the mark) arrives, only by its timeout. Measured: with blocking reads, 2 + 1
/// + 0.5 Gbit/s WRITEs took a 50 ms tick at the end of most transfers (76% of the rails).
struct BulkLowat {
    fd: std::os::fd::RawFd,
    cur: usize,
    cap: usize,
    /// The socket's read timeout (its tick); None waits without one.
    timeout: Option<std::time::Duration>,
}

impl BulkLowat {
    /// The mark for a read of `total` bytes on `s`, or None when it would not pay. The wait is
    /// the socket's read timeout (its tick).
    fn new(s: &TcpStream, total: usize) -> Option<BulkLowat> {
        if total < BULK_LOWAT_MIN {
            return None;
        }
        // The receive buffer as the kernel reports it (twice what was asked for).
        let cap = BULK_LOWAT_MAX.min(socket2::SockRef::from(s).recv_buffer_size().ok()? / 4);
        if cap < BULK_LOWAT_MIN {
            return None;
        }
        let (fd, timeout) = (std::os::fd::AsRawFd::as_raw_fd(s), s.read_timeout().ok().flatten());
        let mut m = BulkLowat { fd, cur: 1, cap, timeout };
        m.owed(total);
        Some(m)
    }

    /// Wait until `left` owed bytes or the mark's worth (whichever is less) can be read, the
    /// stream ended or failed (the read that follows reports it), or the timeout passed (false).
    fn wait(&mut self, left: usize) -> bool {
        self.owed(left);
        // At least 1 ms: `poll_in` rounds down to whole milliseconds. An interrupted poll
        // counts as ready: the read finds nothing and the loop waits again.
        poll_in(self.fd, self.timeout.unwrap_or(std::time::Duration::MAX).max(std::time::Duration::from_millis(1)))
    }

    /// Before a read with `left` bytes still owed: lower the mark to `left` when it is above it
    /// (raised only by [`BulkLowat::new`]).
    fn owed(&mut self, left: usize) {
        let want = left.min(self.cap).max(1);
        if want != self.cur && (want < self.cur || self.cur == 1) {
            if set_lowat(self.fd, want).is_ok() {
                self.cur = want;
            } else if self.cur != 1 && set_lowat(self.fd, 1).is_ok() {
                // A mark that cannot be lowered must not be left above what is owed.
                self.cur = 1;
            }
        }
    }

    /// Drop the mark for the rest of this read: a wait ran out its timeout with bytes unread
    /// under the mark, so the kernel did not count them toward it in time (a window or buffer
    /// too small for the mark, or a peer slower than a mark per tick).
    fn give_up(&mut self) {
        self.cap = 1;
        if self.cur != 1 && set_lowat(self.fd, 1).is_ok() {
            self.cur = 1;
        }
    }
}

impl Drop for BulkLowat {
    fn drop(&mut self) {
        if self.cur != 1 {
            let _ = set_lowat(self.fd, 1);
        }
    }
}

fn set_lowat(fd: std::os::fd::RawFd, bytes: usize) -> io::Result<()> {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: `v` is a valid c_int for the duration of the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The socket's current `SO_RCVLOWAT` (tests).
#[cfg(test)]
fn lowat(fd: std::os::fd::RawFd) -> usize {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes for the duration of the call.
    unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, (&mut v as *mut libc::c_int).cast(), &mut len) };
    v as usize
}

/// Fill `buf` with a bulk payload under a [`BulkLowat`] mark (short payloads: [`read_full`]).
pub fn read_bulk(s: &mut TcpStream, buf: &mut [u8], tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    let Some(mut mark) = BulkLowat::new(s, buf.len()) else {
        return read_full(s, buf, tick);
    };
    let mut got = 0;
    while got < buf.len() {
        let ready = mark.wait(buf.len() - got);
        // Read even after a wait that timed out: what is there is taken, as a blocking read's
        // timeout would.
        // SAFETY: `buf[got..]` is writable for its length; recv writes at most that many bytes.
        let n = unsafe { libc::recv(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got, libc::MSG_DONTWAIT) };
        match bulk_result(n)? {
            Some(n) => {
                got += n;
                if !ready {
                    mark.give_up();
                }
            }
            None if !ready => tick(got > 0).map_err(WireError::GaveUp)?,
            None => {}
        }
    }
    Ok(())
}

/// A non-blocking bulk read's result: bytes read, None to wait again (nothing there after all,
/// or a signal), an error, or the end of the stream as an error.
fn bulk_result(n: isize) -> Result<Option<usize>, WireError> {
    if n > 0 {
        return Ok(Some(n as usize));
    }
    if n == 0 {
        return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
        _ => Err(WireError::Io(e)),
    }
}

/// Most buffers one `readv` / `writev` takes (the kernel's IOV_MAX).
pub const IOV_MAX: usize = 1024;

/// Write all of `bufs` (gathered, one syscall when it fits; at most [`IOV_MAX`] buffers a call).
pub fn write_full(s: &mut TcpStream, bufs: &[&[u8]], tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut done = 0usize;
    while done < total {
        // Build the slices that remain.
        let mut skip = done;
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len().min(IOV_MAX));
        for b in bufs {
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            slices.push(IoSlice::new(&b[skip..]));
            skip = 0;
            if slices.len() == IOV_MAX {
                break;
            }
        }
        match s.write_vectored(&slices) {
            Ok(0) => return Err(WireError::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => tick(true).map_err(WireError::GaveUp)?,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Read one frame whose kind must be `want`, checked from its header before the body is read or
/// allocated: before a peer authenticated, nothing larger than the expected frame's maximum (a
/// `Hello`: 284 bytes) is allocated for it. `Ok(Err(kind))`: the header named another kind (its
/// body left unread).
pub fn read_frame_expect(
    s: &mut TcpStream,
    want: multirail_proto::codec::Kind,
    tick: &mut dyn FnMut(bool) -> Result<(), String>,
) -> Result<Result<(Header, Body), multirail_proto::codec::Kind>, WireError> {
    let mut h = [0u8; HEADER_LEN];
    read_full(s, &mut h, tick)?;
    let header = Header::decode(&h).map_err(WireError::Decode)?;
    if header.kind != want {
        return Ok(Err(header.kind));
    }
    let mut body = vec![0u8; header.body_len as usize];
    read_full(s, &mut body, &mut |_| tick(true))?;
    let b = Body::decode(header.kind, &body).map_err(WireError::Decode)?;
    Ok(Ok((header, b)))
}

/// Read one header and its (bounded) body. Bulk data, if the message has any, is left on the
/// socket for the caller to move straight into registered memory.
pub fn read_frame(s: &mut TcpStream, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(Header, Body), WireError> {
    let mut h = [0u8; HEADER_LEN];
    read_full(s, &mut h, tick)?;
    let header = Header::decode(&h).map_err(WireError::Decode)?;
    let mut body = vec![0u8; header.body_len as usize];
    read_full(s, &mut body, &mut |_| tick(true))?;
    let b = Body::decode(header.kind, &body).map_err(WireError::Decode)?;
    Ok((header, b))
}

pub fn send(s: &mut TcpStream, body: &Body, req_id: u64, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
    // A body that does not fit the wire format is refused before anything is sent: an
    // `InvalidInput` error carrying the codec's `EncodeError` (kept out of `WireError`'s
    // variants, which name what the socket or the peer did).
    let b = body.try_encode(req_id).map_err(|e| WireError::Io(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    write_full(s, &[&b], tick)
}

/// An inbound stream with a small read-ahead: a frame's header and body usually arrive in
/// one syscall, and bytes read ahead are consumed before the socket. Bulk payloads still go
/// straight from the socket into registered memory (only the few bytes read ahead are
/// copied).
pub struct Inbound {
    stash: Vec<u8>,
    pos: usize,
}

/// Read-ahead per syscall when waiting for a frame: a small request or response arrives whole
/// in one syscall; only these first bytes of a larger payload are copied.
const READ_AHEAD: usize = 8 << 10;

impl Default for Inbound {
    fn default() -> Self {
        Self::new()
    }
}

impl Inbound {
    pub fn new() -> Self {
        Inbound { stash: Vec::with_capacity(READ_AHEAD), pos: 0 }
    }

    /// Bytes read ahead and not consumed yet.
    pub fn unread(&self) -> usize {
        self.stash.len() - self.pos
    }

    /// Make at least `n` bytes available in the stash.
    fn fill(&mut self, s: &mut TcpStream, n: usize, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
        if self.pos > 0 && self.unread() < n {
            self.stash.drain(..self.pos);
            self.pos = 0;
        }
        while self.unread() < n {
            match self.recv_ahead(std::os::fd::AsRawFd::as_raw_fd(s), 0) {
                Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => {}
                Err(e) => match e.kind() {
                    io::ErrorKind::Interrupted => {}
                    _ if is_tick(&e) => tick(self.unread() > 0).map_err(WireError::GaveUp)?,
                    _ => return Err(WireError::Io(e)),
                },
            }
        }
        Ok(())
    }

    /// One `recv` of up to READ_AHEAD bytes appended to the stash, into its spare capacity:
    /// no zeroing of the read-ahead per syscall (it was a memset of 8 KiB per frame read).
    /// Returns the bytes received (0: end of stream).
    fn recv_ahead(&mut self, fd: std::os::fd::RawFd, flags: libc::c_int) -> io::Result<usize> {
        self.stash.reserve(READ_AHEAD);
        let spare = self.stash.spare_capacity_mut();
        // SAFETY: `spare` is writable memory of at least READ_AHEAD bytes owned by the stash;
        // recv writes at most that many.
        let n = unsafe { libc::recv(fd, spare.as_mut_ptr().cast(), READ_AHEAD, flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: recv initialised the first `n` (<= READ_AHEAD <= spare) bytes of the spare
        // capacity.
        unsafe { self.stash.set_len(self.stash.len() + n as usize) };
        Ok(n as usize)
    }

    /// Fill `dst` from the read-ahead first, then straight from the socket.
    pub fn read_into(
        &mut self,
        s: &mut TcpStream,
        dst: &mut [u8],
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(), WireError> {
        let k = self.unread().min(dst.len());
        dst[..k].copy_from_slice(&self.stash[self.pos..self.pos + k]);
        self.pos += k;
        if self.pos == self.stash.len() {
            self.stash.clear();
            self.pos = 0;
        }
        read_bulk(s, &mut dst[k..], &mut |_| tick(true))
    }

    /// Fill every span `(address, length)` of `dsts` in order (a vectored request's pieces):
    /// from the read-ahead first, then straight from the socket, scattered with `readv`. Spans
    /// may overlap (the later bytes win); no Rust reference to them is formed.
    ///
    /// # Safety
    /// Every span is writable memory that nothing else reads or writes while this runs.
    pub unsafe fn read_into_spans(
        &mut self,
        s: &mut TcpStream,
        dsts: &[(*mut u8, usize)],
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(), WireError> {
        // Position: span `i`, `off` bytes into it.
        let (mut i, mut off) = (0usize, 0usize);
        fn advance(mut n: usize, dsts: &[(*mut u8, usize)], i: &mut usize, off: &mut usize) {
            while *i < dsts.len() && (n > 0 || dsts[*i].1 == 0) {
                let k = (dsts[*i].1 - *off).min(n);
                n -= k;
                *off += k;
                if *off == dsts[*i].1 {
                    *i += 1;
                    *off = 0;
                }
            }
        }
        advance(0, dsts, &mut i, &mut off);
        while i < dsts.len() && self.unread() > 0 {
            let k = self.unread().min(dsts[i].1 - off);
            // SAFETY: the caller's contract; the stash is our own buffer.
            unsafe { std::ptr::copy_nonoverlapping(self.stash.as_ptr().add(self.pos), dsts[i].0.add(off), k) };
            self.pos += k;
            advance(k, dsts, &mut i, &mut off);
        }
        if self.pos == self.stash.len() {
            self.stash.clear();
            self.pos = 0;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(s);
        let mut left: usize = dsts[i.min(dsts.len())..].iter().map(|d| d.1).sum::<usize>() - off;
        let mut mark = BulkLowat::new(s, left);
        let mut iov: Vec<libc::iovec> = Vec::with_capacity((dsts.len() - i).min(IOV_MAX));
        while i < dsts.len() {
            // As in `read_bulk`: a wait that timed out still reads what is there.
            let ready = mark.as_mut().is_none_or(|m| m.wait(left));
            iov.clear();
            // SAFETY: `off` is within span `i` (advance keeps it so).
            iov.push(libc::iovec { iov_base: unsafe { dsts[i].0.add(off) }.cast(), iov_len: dsts[i].1 - off });
            iov.extend(dsts[i + 1..].iter().take(IOV_MAX - 1).map(|d| libc::iovec { iov_base: d.0.cast(), iov_len: d.1 }));
            // SAFETY: the spans are writable (the caller's contract); `iov` outlives the call.
            let n = unsafe {
                if mark.is_some() {
                    // Under a mark: wait in poll (above), never in the read.
                    let mut msg: libc::msghdr = std::mem::zeroed();
                    msg.msg_iov = iov.as_mut_ptr();
                    msg.msg_iovlen = iov.len() as _;
                    libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT)
                } else {
                    libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int)
                }
            };
            let r = if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) };
            match r {
                Err(e) if mark.is_some() && ready && e.kind() == io::ErrorKind::WouldBlock => {}
                Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => {
                    left -= n;
                    if !ready {
                        if let Some(m) = mark.as_mut() {
                            m.give_up();
                        }
                    }
                    advance(n, dsts, &mut i, &mut off)
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_tick(&e) => tick(true).map_err(WireError::GaveUp)?,
                Err(e) => return Err(WireError::Io(e)),
            }
        }
        Ok(())
    }

    /// Read and drop `n` bulk bytes (a refused WRITE's payload), keeping the stream in sync
    /// without touching registered memory.
    pub fn discard(&mut self, s: &mut TcpStream, mut n: u64, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(), WireError> {
        debug_assert!(n <= MAX_CHUNK);
        let mut scratch = [0u8; 16 << 10];
        while n > 0 {
            let k = (n as usize).min(scratch.len());
            self.read_into(s, &mut scratch[..k], tick)?;
            n -= k as u64;
        }
        Ok(())
    }

    /// The next frame, if it is already read ahead whole (header and body), without consuming
    /// it: (header, body, its length in bytes for [`Inbound::consume`]). None when it is not
    /// complete yet or does not decode (the caller's normal path reads and reports it).
    pub fn peek_frame(&self) -> Option<(Header, Body, usize)> {
        let buf = &self.stash[self.pos..];
        let h: [u8; HEADER_LEN] = buf.get(..HEADER_LEN)?.try_into().ok()?;
        let header = Header::decode(&h).ok()?;
        let end = HEADER_LEN.checked_add(usize::try_from(header.body_len).ok()?)?;
        let body = Body::decode(header.kind, buf.get(HEADER_LEN..end)?).ok()?;
        Some((header, body, end))
    }

    /// Reads whatever the socket `fd` holds now into the read-ahead, without waiting (up to
    /// one read-ahead's worth); false on an error or the end of the stream.
    pub fn fill_now(&mut self, fd: std::os::fd::RawFd) -> bool {
        if self.pos > 0 {
            self.stash.drain(..self.pos);
            self.pos = 0;
        }
        match self.recv_ahead(fd, libc::MSG_DONTWAIT) {
            Ok(n) => n > 0,
            Err(e) => e.kind() == io::ErrorKind::WouldBlock,
        }
    }

    /// Drops `n` read-ahead bytes (a frame taken with [`Inbound::peek_frame`]).
    pub fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.stash.len());
        if self.pos == self.stash.len() {
            self.stash.clear();
            self.pos = 0;
        }
    }

    /// Read one frame (header + bounded body).
    pub fn read_frame(&mut self, s: &mut TcpStream, tick: &mut dyn FnMut(bool) -> Result<(), String>) -> Result<(Header, Body), WireError> {
        self.fill(s, HEADER_LEN, tick)?;
        let h: [u8; HEADER_LEN] = self.stash[self.pos..self.pos + HEADER_LEN].try_into().expect("16 bytes");
        let header = Header::decode(&h).map_err(WireError::Decode)?;
        self.pos += HEADER_LEN;
        let mut body = vec![0u8; header.body_len as usize];
        self.read_into(s, &mut body, tick)?;
        Ok((header, Body::decode(header.kind, &body).map_err(WireError::Decode)?))
    }

    /// Read a response, landing a successful READ payload in `dst` with one scatter read when
    /// possible (header + 12-byte body into a small buffer, payload straight into `dst`).
    /// Returns the frame and whether `dst` was filled. If the response is not a successful
    /// payload of exactly `dst.len()` bytes, `dst` may hold garbage, and the caller must treat
    /// the chunk as failed.
    pub fn read_response_into(
        &mut self,
        s: &mut TcpStream,
        dst: Option<&mut [u8]>,
        tick: &mut dyn FnMut(bool) -> Result<(), String>,
    ) -> Result<(Header, Body, bool), WireError> {
        const OK_LEN: usize = HEADER_LEN + 12;
        let Some(dst) = dst else {
            let (h, b) = self.read_frame(s, tick)?;
            return Ok((h, b, false));
        };
        if self.unread() > 0 {
            let (h, b) = self.read_frame(s, tick)?;
            return Ok(match b {
                Body::Resp { status: multirail_proto::Status::Ok, bulk_len, .. } if bulk_len == dst.len() as u64 => {
                    self.read_into(s, dst, tick)?;
                    (h, b, true)
                }
                b => (h, b, false),
            });
        }
        let mut hdr = [0u8; OK_LEN];
        let n = loop {
            match s.read_vectored(&mut [io::IoSliceMut::new(&mut hdr), io::IoSliceMut::new(dst)]) {
                Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_tick(&e) => tick(false).map_err(WireError::GaveUp)?,
                Err(e) => return Err(WireError::Io(e)),
            }
        };
        let in_dst = n.saturating_sub(OK_LEN);
        if n < OK_LEN {
            read_full(s, &mut hdr[n..], &mut |_| tick(true))?;
        }
        let header = Header::decode(hdr[..HEADER_LEN].try_into().expect("16 bytes")).map_err(WireError::Decode)?;
        let blen = header.body_len as usize;
        let fast = blen == 12 && {
            let b = Body::decode(header.kind, &hdr[HEADER_LEN..]);
            matches!(b, Ok(Body::Resp { status: multirail_proto::Status::Ok, bulk_len, .. }) if bulk_len == dst.len() as u64)
        };
        if fast {
            read_bulk(s, &mut dst[in_dst..], &mut |_| tick(true))?;
            let body = Body::decode(header.kind, &hdr[HEADER_LEN..]).map_err(WireError::Decode)?;
            return Ok((header, body, true));
        }
        // Not the payload we hoped for: what landed in `dst` belongs to the stream. `hdr` is full
        // here (a short first read was completed above): its bytes past the header are the
        // stream's, whether they came in the first read or in the completion.
        self.stash.extend_from_slice(&hdr[HEADER_LEN..OK_LEN]);
        self.stash.extend_from_slice(&dst[..in_dst]);
        let mut body = vec![0u8; blen];
        self.read_into(s, &mut body, tick)?;
        Ok((header, Body::decode(header.kind, &body).map_err(WireError::Decode)?, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_proto::codec::{RemoteOp, Status};
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// A connected loopback pair (writer, reader); the reader has a short read timeout.
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let w = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (r, _) = l.accept().expect("accept");
        r.set_read_timeout(Some(Duration::from_millis(20))).expect("timeout");
        (w, r)
    }

    fn give_up_after(n: usize) -> impl FnMut(bool) -> Result<(), String> {
        let mut left = n;
        move |_| {
            if left == 0 {
                return Err("gave up".into());
            }
            left -= 1;
            Ok(())
        }
    }

    #[test]
    fn a_response_header_split_across_segments_keeps_the_stream_in_step() {
        use std::io::Write;
        let (mut w, mut r) = pair();
        let resp = Body::Resp { status: Status::BadKey, bulk_len: 0, msg: "x".into() }.encode(9);
        let ping = Body::Ping.encode(10);
        let writer = std::thread::spawn(move || {
            w.write_all(&resp[..10]).expect("first part");
            std::thread::sleep(Duration::from_millis(100));
            w.write_all(&resp[10..]).expect("rest");
            w.write_all(&ping).expect("ping");
            w
        });
        let mut inb = Inbound::new();
        let mut dst = vec![0u8; 64];
        let (h, b, filled) = inb.read_response_into(&mut r, Some(&mut dst), &mut give_up_after(1000)).expect("response");
        assert!(!filled);
        assert!(h.req_id == 9 && matches!(b, Body::Resp { status: Status::BadKey, .. }), "{h:?} {b:?}");
        let (h2, b2) = inb.read_frame(&mut r, &mut give_up_after(1000)).expect("the next frame, in step");
        assert!(h2.req_id == 10 && matches!(b2, Body::Ping), "{h2:?} {b2:?}");
        drop(writer.join());
    }

    fn write_req(op_len: u64, id: u64) -> Vec<u8> {
        Body::WriteReq(RemoteOp { region: 3, key: multirail_proto::RegionKey([7; 16]), offset: 4096 * id, len: op_len }).encode(id)
    }

    /// Frames arrive in every split (byte by byte, several per read, a payload behind each
    /// header): the read-ahead hands them out whole and in order, each payload lands exactly,
    /// and the stash never grows beyond a frame plus one read-ahead.
    #[test]
    fn read_ahead_keeps_frames_and_payloads_in_order_across_any_split() {
        let (mut w, mut r) = pair();
        let mut stream = Vec::new();
        let mut want = Vec::new();
        for id in 1..=64u64 {
            let len = [0u64, 1, 100, 5000, 8192, 20_000][id as usize % 6];
            let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(id as u8)).collect();
            stream.extend_from_slice(&write_req(len, id));
            stream.extend_from_slice(&payload);
            want.push((id, payload));
        }
        let writer = std::thread::spawn(move || {
            // Ragged writes: a byte, a few, a lot.
            let mut at = 0;
            let mut k = 0;
            while at < stream.len() {
                let n = [1usize, 3, 17, 4096, 30_000][k % 5].min(stream.len() - at);
                w.write_all(&stream[at..at + n]).expect("write");
                at += n;
                k += 1;
                if k % 7 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            w
        });
        let mut inb = Inbound::new();
        for (id, payload) in want {
            let (h, body) = inb.read_frame(&mut r, &mut give_up_after(500)).expect("frame");
            assert_eq!(h.req_id, id);
            let Body::WriteReq(op) = body else { panic!("frame {id} decoded as {body:?}") };
            assert_eq!(op.len, payload.len() as u64);
            let mut dst = vec![0xEEu8; payload.len()];
            inb.read_into(&mut r, &mut dst, &mut give_up_after(500)).expect("payload");
            assert_eq!(dst, payload, "payload of frame {id}");
            assert!(inb.stash.capacity() <= 4 * READ_AHEAD, "read-ahead grew to {}", inb.stash.capacity());
        }
        assert_eq!(inb.unread(), 0);
        drop(writer.join().expect("writer"));
    }

    /// A reader with a buffer big enough for the largest bulk mark, and a long read timeout: a
    /// read that waited for a tick would take seconds.
    fn bulk_pair() -> (TcpStream, TcpStream) {
        let (w, r) = pair();
        r.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        set_rcvbuf(&r, 2 << 20);
        (w, r)
    }

    /// Pin `s`'s receive buffer to `bytes` (the kernel doubles it), as a fan-in share does.
    fn set_rcvbuf(s: &TcpStream, bytes: usize) {
        socket2::SockRef::from(s).set_recv_buffer_size(bytes).expect("SO_RCVBUF");
    }

    /// A bulk read's mark never waits for bytes the peer has not promised, so it returns as
    /// the payload's last bytes land, never at the 3 s read timeout:
    /// - the payload's last 40 KiB sent after a pause, below the 256 KiB mark: the read lowers
    ///   its mark to what is owed;
    /// - 100 KiB already queued when the read starts, and the other 200 KiB after a pause: a
    ///   blocking `recv` would copy the 100 KiB and sleep for the rest, and the kernel, which
    ///   wakes a socket's sleepers only when 256 KiB are unread, would leave it asleep.
    ///
    /// Every byte lands, and the mark is back to 1 afterwards, so that the next frame read wakes
    /// on its first byte.
    #[test]
    fn a_bulk_read_waits_for_no_more_than_it_is_owed_and_resets_its_mark() {
        // (spans, bytes sent before the pause, the reader starts this late)
        for (spans, first, late) in [(false, 260, 0), (true, 260, 0), (false, 100, 50), (true, 100, 50)] {
            let (mut w, mut r) = bulk_pair();
            let len = 300 << 10;
            let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(spans as u8)).collect();
            let head = payload[..first << 10].to_vec();
            let tail = payload[first << 10..].to_vec();
            let writer = std::thread::spawn(move || {
                w.write_all(&head).expect("write");
                std::thread::sleep(Duration::from_millis(100));
                w.write_all(&tail).expect("write");
                w
            });
            std::thread::sleep(Duration::from_millis(late));
            let mut inb = Inbound::new();
            let mut dst = vec![0u8; len];
            let t0 = std::time::Instant::now();
            let mut ticks = 0;
            let mut tick = |_| {
                ticks += 1;
                Ok(())
            };
            if spans {
                // Three spans, the second one straddling the pause.
                let p = dst.as_mut_ptr();
                let d = [(p, 100 << 10), (unsafe { p.add(100 << 10) }, 180 << 10), (unsafe { p.add(280 << 10) }, 20 << 10)];
                // SAFETY: the spans cover `dst`, which nothing else touches meanwhile.
                unsafe { inb.read_into_spans(&mut r, &d, &mut tick) }.expect("spans");
            } else {
                inb.read_into(&mut r, &mut dst, &mut tick).expect("bulk");
            }
            let took = t0.elapsed();
            let case = format!("spans={spans} first={first} KiB late={late} ms");
            assert_eq!(ticks, 0, "{case}: the read ticked");
            assert!(took < Duration::from_secs(2), "{case}: the read took {took:?}: it waited for a read timeout");
            assert!(dst == payload, "{case}: payload differs");
            assert_eq!(lowat(r.as_raw_fd()), 1, "{case}: the mark was left set");
            drop(writer.join().expect("writer"));
        }
    }

    /// A wait that runs out its timeout with bytes unread under the mark takes them, as a
    /// blocking read's timeout would, and drops the mark for the rest of the read: a peer that
    /// sends 100 KiB and then pauses for several ticks leaves nothing on the socket after the
    /// first tick (were the bytes left there, a mark the kernel never reaches would keep the
    /// read from ever seeing them, and a stall check that counts idle ticks would blame the
    /// peer).
    #[test]
    fn a_wait_that_times_out_takes_what_is_there_and_drops_the_mark() {
        for spans in [false, true] {
            let (mut w, mut r) = bulk_pair();
            r.set_read_timeout(Some(Duration::from_millis(40))).expect("timeout");
            let len = 300 << 10;
            let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(spans as u8)).collect();
            let head = payload[..100 << 10].to_vec();
            let tail = payload[100 << 10..].to_vec();
            let writer = std::thread::spawn(move || {
                w.write_all(&head).expect("write");
                std::thread::sleep(Duration::from_millis(400));
                w.write_all(&tail).expect("write");
                w
            });
            let fd = r.as_raw_fd();
            let mut ticks = 0;
            let mut tick = |_| {
                ticks += 1;
                if ticks > 1 {
                    let mut unread: libc::c_int = -1;
                    // SAFETY: FIONREAD writes one c_int.
                    unsafe { libc::ioctl(fd, libc::FIONREAD, &mut unread) };
                    assert_eq!(unread, 0, "spans={spans}: tick {ticks} with {unread} bytes left unread");
                    assert_eq!(lowat(fd), 1, "spans={spans}: the mark was kept after a wait timed out");
                }
                Ok(())
            };
            let mut inb = Inbound::new();
            let mut dst = vec![0u8; len];
            if spans {
                let p = dst.as_mut_ptr();
                let d = [(p, 50 << 10), (unsafe { p.add(50 << 10) }, 250 << 10)];
                // SAFETY: the spans cover `dst`, which nothing else touches meanwhile.
                unsafe { inb.read_into_spans(&mut r, &d, &mut tick) }.expect("spans");
            } else {
                inb.read_into(&mut r, &mut dst, &mut tick).expect("bulk");
            }
            assert!(ticks >= 2, "spans={spans}: {ticks} ticks over a 400 ms pause with a 40 ms timeout");
            assert!(dst == payload, "spans={spans}: payload differs");
            assert_eq!(lowat(fd), 1);
            drop(writer.join().expect("writer"));
        }
    }

    /// The mark is only taken where it pays: not for a short payload, and not on a socket whose
    /// receive buffer is pinned small (fan-in shares), where a quarter of it would be under
    /// the smallest mark.
    #[test]
    fn the_bulk_mark_is_skipped_for_short_payloads_and_small_buffers() {
        let (_w, r) = bulk_pair();
        assert!(BulkLowat::new(&r, BULK_LOWAT_MIN - 1).is_none());
        let m = BulkLowat::new(&r, 1 << 20).expect("a mark for 1 MiB");
        assert_eq!(m.cur, BULK_LOWAT_MAX);
        assert_eq!(lowat(r.as_raw_fd()), BULK_LOWAT_MAX);
        drop(m);
        assert_eq!(lowat(r.as_raw_fd()), 1);
        set_rcvbuf(&r, 32 << 10);
        assert!(BulkLowat::new(&r, 1 << 20).is_none(), "a 32 KiB share got a mark");
    }

    /// The end of the stream in the middle of a header is an error, never a frame made of
    /// stale read-ahead bytes; an idle socket only ticks.
    #[test]
    fn read_ahead_reports_eof_mid_header_and_ticks_when_idle() {
        let (mut w, mut r) = pair();
        let mut inb = Inbound::new();
        let e = inb.read_frame(&mut r, &mut give_up_after(2)).expect_err("nothing sent");
        assert!(matches!(e, WireError::GaveUp(_)), "{e}");
        let frame = Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }.encode(9);
        w.write_all(&frame).expect("write");
        w.write_all(&frame[..HEADER_LEN - 3]).expect("write");
        drop(w);
        let (h, _) = inb.read_frame(&mut r, &mut give_up_after(100)).expect("the whole frame");
        assert_eq!(h.req_id, 9);
        let e = inb.read_frame(&mut r, &mut give_up_after(100)).expect_err("truncated");
        assert!(matches!(&e, WireError::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof), "{e}");
    }

    /// `fill_now` takes what is there without waiting: true on an idle socket (would block),
    /// the bytes when some came, false once the peer has closed.
    #[test]
    fn fill_now_never_waits_and_sees_the_end() {
        let (mut w, r) = pair();
        let mut inb = Inbound::new();
        assert!(inb.fill_now(r.as_raw_fd()));
        assert_eq!(inb.unread(), 0);
        let frame = Body::Ping.encode(4);
        w.write_all(&frame).expect("write");
        let t0 = std::time::Instant::now();
        while inb.unread() < frame.len() {
            assert!(inb.fill_now(r.as_raw_fd()));
            assert!(t0.elapsed() < Duration::from_secs(10), "the frame never arrived");
        }
        let (h, body, n) = inb.peek_frame().expect("whole frame read ahead");
        assert_eq!((h.req_id, n), (4, frame.len()));
        assert!(matches!(body, Body::Ping));
        inb.consume(n);
        drop(w);
        let t0 = std::time::Instant::now();
        while inb.fill_now(r.as_raw_fd()) {
            assert!(t0.elapsed() < Duration::from_secs(10), "the end never showed");
        }
        assert_eq!(inb.unread(), 0);
    }

    #[test]
    fn spin_budget_halves_to_a_sixteenth_and_doubles_back() {
        let b = SpinBudget::new(Duration::from_micros(160));
        for _ in 0..10 {
            b.record(Spin::Exhausted);
        }
        assert_eq!(b.get(), Duration::from_micros(10));
        b.record(Spin::Ready);
        assert_eq!(b.get(), Duration::from_micros(20));
        b.record(Spin::Stopped);
        assert_eq!(b.get(), Duration::from_micros(20));
    }

    #[test]
    fn spin_budget_grows_back_when_data_came_soon_after_it_ran_out() {
        let b = SpinBudget::new(Duration::from_micros(160));
        for _ in 0..10 {
            b.record(Spin::Exhausted);
        }
        // requests 50 us apart: the 10 us spin runs out, but a full one would catch it: twice
        // the wait
        b.woke(Duration::from_micros(50));
        assert_eq!(b.get(), Duration::from_micros(100));
        b.woke(Duration::from_micros(5));
        assert_eq!(b.get(), Duration::from_micros(160), "at least doubled, at most max");
        for _ in 0..10 {
            b.record(Spin::Exhausted);
        }
        b.woke(Duration::from_micros(160));
        assert_eq!(b.get(), Duration::from_micros(160));
        // data later than the full budget: no reason to spin longer
        b.record(Spin::Exhausted);
        b.woke(Duration::from_micros(161));
        assert_eq!(b.get(), Duration::from_micros(80));
    }

    #[test]
    fn spin_budget_climbs_past_the_spacing_of_requests_it_misses() {
        // What the serving loop does per request (`server::Conn::wait_for_request`): a spin
        // that runs out is recorded (halved), then the request's arrival after the spin began
        // (`woke`). Requests 250 us apart, max 1000 us, the budget shrunk to 125 us by a loaded
        // moment: before, it went 62.5 -> 125 at every request and never caught one again.
        let b = SpinBudget::new(Duration::from_micros(1000));
        for _ in 0..3 {
            b.record(Spin::Exhausted);
        }
        assert_eq!(b.get(), Duration::from_micros(125));
        let gap = Duration::from_micros(250);
        let mut missed = 0;
        for _ in 0..6 {
            if b.get() >= gap {
                b.record(Spin::Ready);
            } else {
                missed += 1;
                b.record(Spin::Exhausted);
                b.woke(gap);
            }
        }
        assert_eq!((missed, b.get()), (1, Duration::from_micros(1000)));
    }
}
