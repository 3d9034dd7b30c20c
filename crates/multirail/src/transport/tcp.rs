//! The TCP transport: per rail, `connections` TCP connections to the peer's rail listener,
//! each with request/response framing (`wire`, `multirail_proto::codec`).
//!
//! Threads per connection: a sender that pulls chunks from the link while it has window room
//! and writes requests (and WRITE payloads, straight from registered memory), and a receiver
//! that reads responses in order, lands READ payloads straight in registered memory and
//! reports completions. The reading half of a connection (`Rx`) belongs to whoever reads: the
//! receiver, or a caller waiting for one of its transfers (`drive`, caller-driven completion).
//! A dead connection that carried WRITEs is named by `fence_ids` so the link has the target
//! fence it (`Body::Fence`) before its chunks are reissued. Socket writes and reads never
//! happen under a lock of the link.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use multirail_gpu::{DevicePtr, Pages, Src};
use multirail_proto::codec::{RemoteOp, Role, Status, VecOp, HELLO_VECTORED, HELLO_VECTORED_GPU};
use multirail_proto::planner::{vec_pieces, Run};
use multirail_proto::{Body, Chunk, Header, Pair};

use super::{Caps, GpuPath, Host, Transport};
use crate::config::Progress;
use crate::error::{Error, Result};
use crate::net::{abort_socket, link_down, LINK_CHECK};
use crate::staging::{SockIn, SockOut, StageError, Stagers};
use crate::wire::{self, poll_in, WireError};
use crate::xfer::{Op, XferShared, XferState};

/// Socket timeout granularity: how often blocked reads/writes re-check deadlines and shutdown.
pub(crate) const TICK: Duration = Duration::from_millis(50);

struct Sent {
    req_id: u64,
    chunk: Chunk,
    xfer: Arc<XferShared>,
    /// Its payload was cut by a device error and completed with zeros to keep the stream in
    /// step (`stream_device_failed`): the chunk fails when its response comes.
    spoiled: bool,
}

/// Who is reading a connection's responses (`Conn::owner`).
const OWNER_NONE: u8 = 0;
const OWNER_RECEIVER: u8 = 1;
const OWNER_CALLER: u8 = 2;
/// How long the receiver stays away when the connection hung up while a caller drives it.
const CALLER_YIELD: Duration = Duration::from_micros(200);
/// For this long after a caller last drove a connection, the receiver leaves its responses to
/// callers ("parked"): it watches the socket for hang-up and its kick eventfd only, so a
/// response does not wake it too (on a busy host that wake-up preempts the very threads of the
/// round trip: measured, it was the whole 4 KiB p99). An asynchronous post, or a caller that
/// stops driving with requests still outstanding, kicks it back to reading.
const CALLER_GRACE: Duration = Duration::from_millis(50);
/// A parked receiver looks again this often, and reads once requests are outstanding and no
/// caller drove the connection for this long: a polling caller (`XferHandle::post_polled`)
/// leaves without kicking it, and its responses must not wait the whole grace period should
/// the polls stop.
pub(crate) const POLL_PARK: Duration = Duration::from_millis(1);

/// Wait up to `timeout` for `fd` to hang up or fail, or for `kick` to be written (data arriving
/// on `fd` does not end the wait). Returns (hung up, kicked).
fn park(fd: std::os::fd::RawFd, kick: std::os::fd::RawFd, timeout: Duration) -> (bool, bool) {
    let mut p = [libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 }, libc::pollfd { fd: kick, events: libc::POLLIN, revents: 0 }];
    // SAFETY: two valid pollfds.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, timeout.as_millis().clamp(1, i32::MAX as u128) as i32) };
    if r <= 0 {
        return (false, false);
    }
    let hup = p[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0;
    (hup, p[1].revents & libc::POLLIN != 0)
}

/// A non-blocking eventfd (a receiver's kick).
fn eventfd() -> Result<std::os::fd::OwnedFd> {
    // SAFETY: plain syscall; a valid fd it returns is owned by nobody else.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io("eventfd", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Why a reader stopped.
enum Stop {
    /// The link is shutting down.
    Shutdown,
    /// The connection failed: the reason.
    Failed(String),
    /// (Caller) nothing is outstanding on the connection.
    Idle,
    /// (Caller) its deadline passed.
    CallerTimeout,
}

/// Stall bookkeeping, shared by whoever reads the connection.
struct Clock {
    /// Last response (or idle moment).
    last: Instant,
    last_link_check: Instant,
}

/// The reading half of a connection: owned by the receiver thread or by a waiting caller.
struct Rx {
    s: TcpStream,
    inb: wire::Inbound,
    clock: Clock,
    /// Bounce pools for READs landing in GPU memory (made on the first such chunk).
    stage: Stagers,
    /// READs into GPU memory that are off the wire but whose last H2D copies may still run:
    /// completed (`chunk_done`) in order once landed, and always before the reader leaves
    /// the connection idle (`read_one`). (the request, its GPU)
    landing: std::collections::VecDeque<(Sent, u32)>,
    /// Request ids of `landing` entries whose copies completed while they could not be
    /// completed in order (an older one, on another GPU, still landing).
    landed_early: Vec<u64>,
}

/// One TCP connection on one rail.
struct Conn {
    rail: usize,
    /// The socket's fd (for poll and TCP_INFO); owned by `rx.s`.
    fd: std::os::fd::RawFd,
    rx: Mutex<Rx>,
    /// OWNER_*: who may lock `rx` and read.
    owner: AtomicU8,
    /// When a caller last drove this connection (µs since `Link::epoch`).
    caller_at: AtomicU64,
    /// When the connection last went from no request outstanding to one (µs since `Link::epoch`).
    busy_at: AtomicU64,
    /// The reader that last let go of `rx` left bytes in its read-ahead (`wire::Inbound`):
    /// whole responses may be waiting there that no socket readiness will announce.
    stashed: AtomicBool,
    /// Callers' busy-poll budget on this connection (`Progress::Adaptive`).
    spin: wire::SpinBudget,
    /// Wakes a parked receiver (see `CALLER_GRACE`); `kicks` counts requests to, `parked` says
    /// whether the receiver sleeps on it (store-then-load on both sides, SeqCst).
    kick: std::os::fd::OwnedFd,
    kicks: AtomicU64,
    parked: AtomicBool,
    /// The nonce of this connection's `Hello`: the target knows it by this id (for `Fence`).
    id: [u8; 16],
    /// Carried a WRITE: must be fenced on the target if it dies.
    wrote: AtomicBool,
    writer: Mutex<TcpStream>,
    /// Bounce pools for WRITEs from GPU memory; locked only under `writer`.
    stage_tx: Mutex<Stagers>,
    inflight: Mutex<VecDeque<Sent>>,
    inflight_n: AtomicUsize,
    next_req: AtomicU64,
    dead: AtomicBool,
    /// The receiver has stopped and no caller reads the connection: nothing lands through it
    /// any more, whatever `inflight` still names.
    stopped: AtomicBool,
    /// The receiver thread refills this connection's window itself (`refill`): it sends the
    /// next READ request right after each response it completes, so a bulk READ costs no
    /// hand-off to the sender thread per chunk (a futex wake-up, and the preemption of the
    /// receiver by the woken sender: ~70% of the initiator's context switches, issue 22 item
    /// 5). The sender sleeps on `dormant` meanwhile and takes only what is handed to it.
    self_refill: AtomicBool,
    /// A chunk the refilling receiver pulled but must not send itself (a WRITE, a vectored
    /// request): the sender sends it.
    handoff: Mutex<Option<(Chunk, Arc<XferShared>)>>,
    dormant: Mutex<()>,
    dormant_cv: Condvar,
}

impl Conn {
    /// Have the receiver read responses again (it may be parked, leaving them to callers).
    fn kick(&self) {
        self.kicks.fetch_add(1, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: an 8-byte write to our own eventfd; EAGAIN (counter full) is harmless.
            unsafe {
                libc::write(std::os::fd::AsRawFd::as_raw_fd(&self.kick), &one as *const u64 as *const libc::c_void, 8);
            }
        }
    }

    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        if let Ok(s) = self.writer.try_lock() {
            abort_socket(&s);
        }
        self.wake_sender();
    }

    /// Wake the sender if it sleeps on `dormant` (after `self_refill`, `handoff` or `dead`
    /// changed).
    fn wake_sender(&self) {
        let _g = self.dormant.lock().expect("conn lock");
        self.dormant_cv.notify_one();
    }

    /// The receiver stops refilling: the sender goes back to taking chunks from the link.
    fn stop_refill(&self) {
        if self.self_refill.swap(false, Ordering::AcqRel) {
            self.wake_sender();
        }
    }
}

/// Milliseconds since the kernel last received, on the connection whose TCP_INFO is `i`,
/// anything that shows the transfer moves: data, or an ACK of data sent (a large WRITE chunk on
/// a slow rail is progress).
///
/// Once every byte sent is acknowledged and nothing waits to be sent, the ACKs that still come
/// are the replies to keepalive probes (`keep_probing`), which prove the path, not progress:
/// the last ACK of data then came after the last data sent, so that send's time stands in.
fn progress_ms(i: &libc::tcp_info) -> u32 {
    let acked = if i.tcpi_unacked == 0 && i.tcpi_notsent_bytes == 0 { i.tcpi_last_data_sent } else { i.tcpi_last_ack_recv };
    i.tcpi_last_data_recv.min(acked)
}

/// The keepalive idle time and interval of a data connection (`keep_probing`; the kernel's
/// smallest, whole seconds only).
const KEEPALIVE_IDLE_MS: u32 = 1000;
/// How long a keepalive probe may take to be answered before the path counts as unproven: the
/// probe waits behind other flows' packets in the rail's queues (a shaped rail shared by many
/// peers) and the peer's kernel answers it from its softirq, whatever its application does.
const KEEPALIVE_GRACE_MS: u32 = 300;
/// Unanswered keepalive probes after which the kernel gives an idle connection up
/// (`ETIMEDOUT`): a path dead for about `KEEPALIVE_IDLE_MS` x (1 + this) while the connection
/// was idle. A busy rail's death is the stall rule's, well before.
const KEEPALIVE_PROBES: u32 = 8;

/// Have the kernel probe an initiator's data connection once it has been silent for
/// `KEEPALIVE_IDLE_MS`: a probe carries no data and the peer's kernel answers it whatever its
/// application does, so a connection waiting on a busy target (every byte acknowledged, no
/// response yet) keeps proving its path (`held_by`). Without it, a target whose serving
/// threads were off the CPU past `stall_timeout` (32 initiators into one target on a loaded
/// 2-core host, issue 22) was taken for a dead rail: fenced, requeued and readmitted.
fn keep_probing(s: &TcpStream) -> Result<()> {
    let every = Duration::from_millis(KEEPALIVE_IDLE_MS.into());
    let ka = socket2::TcpKeepalive::new().with_time(every).with_interval(every).with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(s).set_tcp_keepalive(&ka).map_err(|e| Error::io("keepalive", e))
}

/// Whether the connection is held: its silence is no sign of a dead path. It is in congestion
/// window reduction, which a drop by the local qdisc puts it in (it then retries on the
/// zero-window probe timer, backing off 0.2, 0.4, 0.8 s ... while the queue stays full of other flows' packets), no
/// retransmission timed out (that would put it in Loss), and the path owes it nothing: every
/// byte it sent is acknowledged with bytes still unsent, or what is unacknowledged went out
/// less than a retransmission timeout ago (the retry that just got through). Seen on the
/// 32-initiator fan-in (issue 22): `unacked 0, notsent 2 MB, ca_state CWR, probes 1` on every
/// connection the old stall rule took for dead, and once `unacked 1, last sent 4 ms ago` after
/// a 1.2 s hold. A blackholed path is not held for long: its first retransmission timeout
/// moves the connection to Loss.
///
/// Also held: a connection in Loss whose retransmission timeout's retry this host's own queue
/// refused (retransmissions counted, no backoff: the kernel retries on its 0.5 s resource-probe
/// timer). Seen at the last false stalls of the 32 -> 1 fan-in on a loaded host: `unacked 7,
/// ca_state Loss, retrans 1, backoff 0, last ACK 500 ms ago`. Retries that leave the host and
/// go unanswered back off; two backoffs are a dead path (`dead_by`).
///
/// Also held: a retransmission timeout that is due and has not run (`rto_overdue`).
///
/// Also held: a connection waiting for its peer's application, with every byte it sent
/// acknowledged and nothing left to send, while the path answers the keepalive probes
/// (`keep_probing`): the last ACK came less than a probe interval (plus its grace) ago, and at
/// most the current probe is unanswered. Seen on the 32-initiator fan-in on a loaded host:
/// every byte acknowledged, the window open, no response yet, because the target's serving
/// threads were off the CPU past `stall_timeout`. A path that dies in that state leaves the
/// next probe unanswered: held no more `KEEPALIVE_IDLE_MS + KEEPALIVE_GRACE_MS` after its last
/// ACK. The hold is not progress: a target that stays silent still fails the rail after the
/// planner's `held_timeout`.
///
/// Also held: the peer's receive window is closed (its application reads slower than we send,
/// e.g. a busy target, or one that shares its window among many peers: `fanin`) with bytes
/// waiting and nothing unacknowledged, while the zero-window probes are answered (at most the
/// current probe outstanding; each answered probe resets the count). Seen on the 32-initiator
/// fan-in with `fan_in_window` on a loaded host: `snd_wnd 0, unacked 0, notsent 1.2 MB, ca_state
/// Open, probes 1, backoff 2` on the connections the stall rule took for dead. A path that
/// dies in that state stops answering probes: two unanswered probes (0.2 + 0.4 s of backoff)
/// end the hold.
#[cfg(test)]
fn held_locally(fd: std::os::fd::RawFd) -> bool {
    tcp_info(fd).is_some_and(|i| held_by(&i))
}

fn held_by(i: &libc::tcp_info) -> bool {
    const TCP_CA_CWR: u8 = 2;
    const TCP_CA_LOSS: u8 = 4;
    let owes_nothing = (i.tcpi_unacked == 0 && i.tcpi_notsent_bytes > 0)
        || (i.tcpi_unacked > 0 && u64::from(i.tcpi_last_data_sent) * 1000 < u64::from(i.tcpi_rto));
    let qdisc_held = i.tcpi_ca_state == TCP_CA_CWR && i.tcpi_retransmits == 0 && owes_nothing;
    let window_closed =
        i.tcpi_snd_wnd == 0 && i.tcpi_unacked == 0 && i.tcpi_notsent_bytes > 0 && i.tcpi_retransmits == 0 && i.tcpi_probes <= 1;
    let awaiting = owes_nothing_at_all(i) && i.tcpi_probes <= 1 && i.tcpi_last_ack_recv < KEEPALIVE_IDLE_MS + KEEPALIVE_GRACE_MS;
    // A retransmission timeout whose retry this host's own queue refused: the kernel then
    // retries on its resource-probe timer (0.5 s) without backing off, so the connection is in
    // Loss with retransmissions counted and no backoff. Retries that leave the host and go
    // unanswered back off instead (`dead_by`).
    let retry_held_locally = i.tcpi_ca_state == TCP_CA_LOSS && i.tcpi_retransmits >= 1 && i.tcpi_backoff == 0;
    qdisc_held || window_closed || awaiting || retry_held_locally || rto_overdue(i)
}

/// Bytes outstanding, no retransmission timeout since the last ACK that advanced (an ACK
/// resets `retransmits` and `backoff`), and that ACK is older than the timeout: the kernel's
/// timer is due and has not run. That is this host not running its timers (a starved CPU:
/// timers run in softirq context, deferred to `ksoftirqd` under load), not the path: a timer
/// that runs counts a retransmission at once, and from there the path is judged by the other
/// rules (two backoffs: `dead_by`). Seen at the last false stalls of the 32 -> 1 fan-in on a
/// host at load 8-10: `unacked 14, ca_state Loss, retrans 0, backoff 0, rto 208 ms, last data
/// sent 504 ms, ack recv 500 ms ago`.
fn rto_overdue(i: &libc::tcp_info) -> bool {
    i.tcpi_unacked > 0 && i.tcpi_retransmits == 0 && i.tcpi_backoff == 0 && u64::from(i.tcpi_last_ack_recv) * 1000 > u64::from(i.tcpi_rto)
}

/// Every byte sent acknowledged, nothing waiting to be sent, no retransmission pending.
fn owes_nothing_at_all(i: &libc::tcp_info) -> bool {
    i.tcpi_unacked == 0 && i.tcpi_notsent_bytes == 0 && i.tcpi_retransmits == 0
}

/// Evidence of a dead path: a connection that owes nothing has had a keepalive probe
/// unanswered past its grace (`held_by`'s waiting clause ends), or one with bytes outstanding
/// has backed off twice: two retransmissions that left this host went unanswered.
fn dead_by(i: &libc::tcp_info) -> bool {
    let probe_lost = owes_nothing_at_all(i) && i.tcpi_probes >= 1 && i.tcpi_last_ack_recv >= KEEPALIVE_IDLE_MS + KEEPALIVE_GRACE_MS;
    let timed_out = i.tcpi_unacked > 0 && i.tcpi_backoff >= 2;
    probe_lost || timed_out
}

fn tcp_info(fd: std::os::fd::RawFd) -> Option<libc::tcp_info> {
    // SAFETY: `tcp_info` is plain old data; getsockopt writes at most `len` bytes into it.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let r = libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info as *mut libc::tcp_info as *mut libc::c_void, &mut len);
        (r == 0 && len as usize >= std::mem::size_of::<libc::tcp_info>()).then_some(info)
    }
}

/// The TCP connections of one rail.
pub(crate) struct TcpRail {
    conns: RwLock<Vec<Arc<Conn>>>,
    /// Receivers still running (a rail is up while one is).
    live: AtomicUsize,
    /// Handles of the current connections, so a failure can shut all of them at once.
    fds: Mutex<Vec<TcpStream>>,
}

/// The rails of one link over TCP.
pub(crate) struct TcpRails {
    rails: Vec<Arc<TcpRail>>,
}

impl TcpRails {
    /// TCP_INFO of rail `ri`'s live connections with requests outstanding.
    fn busy_infos(&self, ri: usize) -> Vec<libc::tcp_info> {
        let conns = self.rails[ri].conns.read().expect("rail lock");
        conns
            .iter()
            .filter(|c| !c.dead.load(Ordering::Acquire) && c.inflight_n.load(Ordering::Acquire) > 0)
            .filter_map(|c| tcp_info(c.fd))
            .collect()
    }

    pub(crate) fn new(n: usize) -> TcpRails {
        let rails = (0..n)
            .map(|_| Arc::new(TcpRail { conns: RwLock::new(Vec::new()), live: AtomicUsize::new(0), fds: Mutex::new(Vec::new()) }))
            .collect();
        TcpRails { rails }
    }

    /// Caller-driven completion: the thread waiting for `x` reads its responses itself, as a
    /// ping-pong client would, instead of being woken by the receiver thread (one thread
    /// wakeup per round trip instead of two). Only when `x` has a chunk in flight on a
    /// connection whose reader is free; returns whether `x` is finished. `poll_only`: read only
    /// what has already arrived (progress from `check_xfer_state`), never block for more.
    fn drive_conns(&self, link: &dyn Host, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        for rail in &self.rails {
            let conns = rail.conns.read().expect("rail lock");
            let Some(c) = conns.iter().find(|c| {
                !c.dead.load(Ordering::Acquire)
                    && c.inflight_n.load(Ordering::Acquire) > 0
                    && c.inflight.lock().expect("conn lock").iter().any(|s| std::ptr::eq(Arc::as_ptr(&s.xfer), x))
            }) else {
                continue;
            };
            let c = c.clone();
            drop(conns);
            if c.owner.compare_exchange(OWNER_NONE, OWNER_CALLER, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return false;
            }
            let Ok(mut rx) = c.rx.try_lock() else {
                c.owner.store(OWNER_NONE, Ordering::Release);
                if c.inflight_n.load(Ordering::Acquire) > 0 {
                    // The receiver may have parked on seeing this caller own the connection.
                    c.kick();
                }
                return false;
            };
            c.caller_at.store(link.now_us(), Ordering::Release);
            let mut failure = None;
            let mine = |c: &Conn| c.inflight.lock().expect("conn lock").iter().any(|s| std::ptr::eq(Arc::as_ptr(&s.xfer), x));
            while x.state() == XferState::InProgress {
                // Read-ahead may already hold the next responses: they count as arrived.
                if poll_only && rx.inb.unread() == 0 && !poll_in(c.fd, Duration::ZERO) {
                    break;
                }
                if !poll_only && !mine(&c) {
                    // The rest of `x` is on other connections: their readers finish it.
                    break;
                }
                if !poll_only && rx.inb.unread() == 0 {
                    if let Err(e) = spin_for_response(link, &c, &mut rx.clock, deadline) {
                        if let Stop::Failed(e) = e {
                            failure = Some(e);
                        }
                        break;
                    }
                }
                match read_one(link, &c, &mut rx, Some(deadline)) {
                    Ok(()) if !poll_only => refill(link, &c),
                    Ok(()) => {}
                    Err(Stop::Failed(e)) => {
                        failure = Some(e);
                        break;
                    }
                    Err(_) => break,
                }
            }
            if failure.is_some() {
                c.dead.store(true, Ordering::Release);
                abort_socket(&rx.s);
            }
            c.stop_refill();
            // Responses read ahead for other transfers are left in the stash: the receiver (kicked
            // below, as requests are outstanding) must not wait for the socket to get them.
            c.stashed.store(rx.inb.unread() > 0, Ordering::Release);
            drop(rx);
            c.caller_at.store(link.now_us(), Ordering::Release);
            c.owner.store(OWNER_NONE, Ordering::Release);
            if c.inflight_n.load(Ordering::Acquire) > 0 && !(poll_only && x.polled.load(Ordering::Acquire)) {
                // Responses are still due and this caller is leaving: the receiver reads them
                // (not for a polled transfer: its next poll does, see `POLL_PARK`).
                c.kick();
            }
            if let Some(e) = failure {
                // The receiver sees the connection dead and runs the rail-down path.
                link.rail_failed(c.rail, e);
            }
            return x.state() != XferState::InProgress;
        }
        false
    }
}

impl Transport for TcpRails {
    fn caps(&self) -> Caps {
        Caps { remote_vram: false, one_sided: false, gpu: GpuPath::Staged }
    }

    /// Open the configured number of connections on rail `ri` and start their threads.
    fn open_rail(&self, link: &Arc<dyn Host>, ri: usize, timeout: Duration) -> Result<()> {
        let rail = &self.rails[ri];
        let mut streams = Vec::new();
        // Vectored requests on this rail only when every connection's peer takes them.
        let (mut vectored, mut gpu) = (true, true);
        for _ in 0..link.cfg().connections.max(1) {
            let crate::net::Dialed { stream: s, id, version: v, .. } = link.dial_hello(ri, Role::Data, timeout)?;
            vectored &= v >= HELLO_VECTORED && link.cfg().vectored;
            gpu &= v >= HELLO_VECTORED_GPU;
            streams.push((s, id));
        }
        link.set_vectored(ri, vectored);
        link.set_vectored_gpu(ri, vectored && gpu);
        link.set_byte_progress(ri, true); // `quiet_for`: TCP_INFO's last data or ACK
        let mut conns = Vec::new();
        let mut fds = Vec::new();
        for (s, id) in streams {
            keep_probing(&s)?;
            let reader = s.try_clone().map_err(|e| Error::io("clone socket", e))?;
            fds.push(s.try_clone().map_err(|e| Error::io("clone socket", e))?);
            let c = Arc::new(Conn {
                rail: ri,
                fd: std::os::fd::AsRawFd::as_raw_fd(&reader),
                rx: Mutex::new(Rx {
                    landing: std::collections::VecDeque::new(),
                    landed_early: Vec::new(),
                    s: reader,
                    inb: wire::Inbound::new(),
                    clock: Clock { last: Instant::now(), last_link_check: Instant::now() },
                    stage: Stagers::new(link.cfg().staging, link.staging(ri), crate::numa::node_of_cpus(&link.rail_cpus(ri))),
                }),
                owner: AtomicU8::new(OWNER_NONE),
                caller_at: AtomicU64::new(0),
                busy_at: AtomicU64::new(0),
                stashed: AtomicBool::new(false),
                spin: wire::SpinBudget::new(link.cfg().spin),
                kick: eventfd()?,
                kicks: AtomicU64::new(0),
                parked: AtomicBool::new(false),
                id,
                wrote: AtomicBool::new(false),
                writer: Mutex::new(s),
                stage_tx: Mutex::new(Stagers::new(link.cfg().staging, link.staging(ri), crate::numa::node_of_cpus(&link.rail_cpus(ri)))),
                inflight: Mutex::new(VecDeque::new()),
                inflight_n: AtomicUsize::new(0),
                next_req: AtomicU64::new(1),
                dead: AtomicBool::new(false),
                stopped: AtomicBool::new(false),
                self_refill: AtomicBool::new(false),
                handoff: Mutex::new(None),
                dormant: Mutex::new(()),
                dormant_cv: Condvar::new(),
            });
            rail.live.fetch_add(1, Ordering::AcqRel);
            let (l1, r1, c1) = (link.clone(), rail.clone(), c.clone());
            // Both threads run on the rail's NIC-local CPUs (issue 34; skipped when unknown).
            let (cpus1, cpus2) = (link.rail_cpus(ri), link.rail_cpus(ri));
            std::thread::Builder::new()
                .name(format!("mr-recv-{ri}"))
                .spawn(move || {
                    crate::numa::pin_current_thread(&cpus1);
                    receiver(l1, r1, c1)
                })
                .map_err(|e| Error::io("spawn", e))?;
            let (l2, c2) = (link.clone(), c.clone());
            std::thread::Builder::new()
                .name(format!("mr-send-{ri}"))
                .spawn(move || {
                    crate::numa::pin_current_thread(&cpus2);
                    sender(l2, c2)
                })
                .map_err(|e| Error::io("spawn", e))?;
            conns.push(c);
        }
        *rail.fds.lock().expect("rail lock") = fds;
        *rail.conns.write().expect("rail lock") = conns;
        Ok(())
    }

    fn is_up(&self, ri: usize) -> bool {
        self.rails[ri].live.load(Ordering::Acquire) > 0
    }

    fn post_ready(&self, link: &dyn Host, will_drive: bool) -> bool {
        let mut need_senders = false;
        // The caller's thread sends one chunk per idle connection: a small transfer whole, for
        // its latency. The rest goes to the connections' sender threads, so a post neither
        // copies a large transfer's window into the sockets (vectored chunks pack up to
        // `chunk_size` of pages each) nor waits behind the requests already queued on a busy
        // connection.
        for rail in &self.rails {
            let conns = rail.conns.read().expect("rail lock").clone();
            for c in conns {
                if c.inflight_n.load(Ordering::Acquire) > 0 {
                    need_senders = true;
                    continue;
                }
                need_senders |= pump(link, &c, 1);
                if !will_drive && c.inflight_n.load(Ordering::Acquire) > 0 {
                    c.kick();
                }
            }
        }
        need_senders
    }

    fn drive(&self, link: &dyn Host, x: &XferShared, deadline: Option<Instant>, poll_only: bool) -> bool {
        self.drive_conns(link, x, deadline, poll_only)
    }

    fn holds(&self, x: &Arc<XferShared>) -> bool {
        (0..self.rails.len()).any(|ri| self.holds_on(ri, x))
    }

    fn holds_on(&self, ri: usize, x: &Arc<XferShared>) -> bool {
        // A chunk handed to the sender (`Conn::handoff`) is sent yet.
        let holds = |c: &Conn| {
            c.inflight.lock().expect("conn lock").iter().any(|s| Arc::ptr_eq(&s.xfer, x))
                || c.handoff.lock().expect("conn lock").as_ref().is_some_and(|h| Arc::ptr_eq(&h.1, x))
        };
        self.rails[ri].conns.read().expect("rail lock").iter().any(|c| !c.stopped.load(Ordering::Acquire) && holds(c))
    }

    fn shut_rail(&self, ri: usize) {
        let rail = &self.rails[ri];
        for c in rail.conns.read().expect("rail lock").iter() {
            c.dead.store(true, Ordering::Release);
            c.wake_sender();
        }
        for s in rail.fds.lock().expect("rail lock").iter() {
            abort_socket(s);
        }
    }

    fn fence_ids(&self, ri: usize) -> Vec<[u8; 16]> {
        self.rails[ri].conns.read().expect("rail lock").iter().filter(|c| c.wrote.load(Ordering::Acquire)).map(|c| c.id).collect()
    }

    fn paths(&self, ri: usize) -> usize {
        self.rails[ri].conns.read().expect("rail lock").len()
    }

    fn describe(&self, _ri: usize) -> String {
        "tcp".into()
    }

    fn quiet_for(&self, ri: usize) -> Option<Duration> {
        self.busy_infos(ri).iter().map(progress_ms).min().map(|ms| Duration::from_millis(ms as u64))
    }

    fn held_back(&self, ri: usize) -> bool {
        let infos = self.busy_infos(ri);
        infos.iter().any(held_by) && !infos.iter().any(dead_by)
    }

    fn path_dead(&self, ri: usize) -> bool {
        self.busy_infos(ri).iter().any(dead_by)
    }

    fn evidence(&self, ri: usize) -> Option<String> {
        let infos = self.busy_infos(ri);
        let brief = |i: &libc::tcp_info| {
            format!(
                "unacked {} notsent {} snd_wnd {} ca_state {} retrans {} probes {} backoff {} rto {} ms, last data sent {} ms, data recv {} ms, ack recv {} ms ago",
                i.tcpi_unacked,
                i.tcpi_notsent_bytes,
                i.tcpi_snd_wnd,
                i.tcpi_ca_state,
                i.tcpi_retransmits,
                i.tcpi_probes,
                i.tcpi_backoff,
                i.tcpi_rto / 1000,
                i.tcpi_last_data_sent,
                i.tcpi_last_data_recv,
                i.tcpi_last_ack_recv
            )
        };
        (!infos.is_empty()).then(|| {
            let shown: Vec<String> = infos.iter().take(4).map(brief).collect();
            let more = infos.len().saturating_sub(4);
            format!(
                "{} busy connection(s): {}{}",
                infos.len(),
                shown.join("; "),
                if more > 0 { format!("; {more} more") } else { String::new() }
            )
        })
    }

    fn wake(&self) {
        // The senders wait on the link's condition, which the link signals itself.
    }

    fn close(&self) {
        for r in &self.rails {
            for c in r.conns.read().expect("rail lock").iter() {
                c.kill();
                c.kick();
            }
            for s in r.fds.lock().expect("rail lock").iter() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// Send up to `max` chunks on `c` while the planner has work for its rail and the connection
/// has room. Returns true when it stopped with work possibly left: the connection's window
/// full, or `max` sent.
fn pump(link: &dyn Host, c: &Arc<Conn>, max: usize) -> bool {
    for _ in 0..max {
        if c.dead.load(Ordering::Acquire) {
            return false;
        }
        if c.inflight_n.load(Ordering::Acquire) >= link.cfg().conn_window {
            return true;
        }
        // Nothing for this rail now (or its rail window is full): completions wake the senders
        // when that changes.
        let Some((chunk, x)) = link.next_chunk(c.rail) else { return false };
        send_chunk(link, c, chunk, x);
    }
    // Sent `max`: maybe more is left (`Link::submit` asks the planner before it wakes anyone).
    true
}

/// The local (address, length) spans of a vectored chunk's pieces, in order (adjacent ones
/// merged). They lie in local host memory registered with this agent and held by the
/// transfer (checked when the handle was made; `hold` keeps it until released).
fn local_spans(runs: &[Run]) -> Vec<(*mut u8, usize)> {
    let mut spans: Vec<(*mut u8, usize)> = Vec::with_capacity(runs.len());
    for r in runs {
        for p in r.pieces() {
            match spans.last_mut() {
                Some(s) if s.0 as u64 + s.1 as u64 == p.local => s.1 += p.len as usize,
                _ => spans.push((p.local as *mut u8, p.len as usize)),
            }
        }
    }
    spans
}

/// Where a chunk's local bytes are, for the staging pipeline (`piece` and `vec` as in `Chunk`):
/// its one range, or a vectored chunk's pieces in order (local GPU memory held by the
/// transfer, as for `local_spans`).
fn local_src(piece: &Pair, vec: Option<&[Run]>) -> Src {
    match vec {
        None => Src::At(DevicePtr(piece.local), piece.len),
        Some(runs) => Src::Pieces(Arc::new(Pages::new(runs.iter().flat_map(|r| r.pieces()).map(|p| (p.local, p.len))))),
    }
}

/// The request of a chunk: plain or vectored, READ or WRITE.
fn request(link: &dyn Host, chunk: &Chunk, write: bool) -> Body {
    let key = link.key(chunk.piece.region);
    let piece = chunk.piece;
    match &chunk.vec {
        Some(runs) => {
            let op = VecOp { region: piece.region, key, pieces: vec_pieces(runs) };
            if write {
                Body::WriteVReq(op)
            } else {
                Body::ReadVReq(op)
            }
        }
        None => {
            let op = RemoteOp { region: piece.region, key, offset: piece.offset, len: piece.len };
            if write {
                Body::WriteReq(op)
            } else {
                Body::ReadReq(op)
            }
        }
    }
}

/// Fails `chunk` (and so its transfer) with `e`, the error that kept it from being ordered
/// after the application's stream or from being encoded, without sending it: a device error
/// or a request over the wire format's fields, not the rail's.
fn fail_unordered(link: &dyn Host, rail: usize, chunk: &Chunk, x: &XferShared, e: Error) {
    let msg = e.to_string();
    x.set_cause(e);
    link.chunk_done(rail, chunk.id, x, chunk.piece.len, Err((Status::Internal, msg)));
}

/// The error of a chunk whose request does not fit the wire format (a planner bug).
fn unencodable(e: multirail_proto::EncodeError) -> Error {
    Error::InvalidArgument(format!("chunk request cannot be encoded: {e}"))
}

/// A staging device error stopped a GPU WRITE stream after `sent` bytes of its segments `segs`
/// ((request id, bytes on the wire) in order). A device error is the transfer's failure, not
/// the rail's (issue 35 defect 5): segments fully written went out with their bytes and are
/// answered as usual; the one cut short is completed with zeros (the target reads the next
/// request where it expects it) and fails when its response comes; those never started leave
/// the connection's window and fail now. Err only when the padding cannot be written (then
/// the connection is out of step and the rail's failure path runs).
fn stream_device_failed(
    link: &dyn Host,
    c: &Conn,
    w: &mut TcpStream,
    tick: &mut dyn FnMut(bool) -> std::result::Result<(), String>,
    segs: &[(u64, u64)],
    sent: u64,
    err: Error,
) -> std::result::Result<(), String> {
    let msg = err.to_string();
    let mut at = 0u64;
    let mut unsent = Vec::new();
    for &(id, len) in segs {
        let end = at + len;
        if sent > at && sent < end {
            pad_zeros(w, end - sent, tick)?;
            if let Some(s) = c.inflight.lock().expect("conn lock").iter_mut().find(|s| s.req_id == id) {
                s.spoiled = true;
                s.xfer.set_cause(err.clone());
            }
        } else if sent <= at {
            unsent.push(id);
        }
        at = end;
    }
    let gone: Vec<Sent> = {
        let mut q = c.inflight.lock().expect("conn lock");
        let (keep, gone): (VecDeque<Sent>, VecDeque<Sent>) = q.drain(..).partition(|s| !unsent.contains(&s.req_id));
        *q = keep;
        gone.into()
    };
    for s in gone {
        c.inflight_n.fetch_sub(1, Ordering::AcqRel);
        s.xfer.set_cause(err.clone());
        link.chunk_done(c.rail, s.chunk.id, &s.xfer, s.chunk.piece.len, Err((Status::Internal, msg.clone())));
    }
    Ok(())
}

/// Writes `n` zero bytes (the rest of a payload a device error cut short).
fn pad_zeros(
    w: &mut TcpStream,
    mut n: u64,
    tick: &mut dyn FnMut(bool) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let zeros = [0u8; 64 << 10];
    while n > 0 {
        let k = n.min(zeros.len() as u64) as usize;
        wire::write_full(w, &[&zeros[..k]], tick).map_err(|e| e.to_string())?;
        n -= k as u64;
    }
    Ok(())
}

fn send_chunk(link: &dyn Host, c: &Arc<Conn>, chunk: Chunk, x: Arc<XferShared>) {
    send_chunk_on(link, c, chunk, x, None)
}

/// Take request `req_id`, recorded but not written, off the connection again.
fn withdraw(c: &Conn, req_id: u64) {
    c.inflight.lock().expect("conn lock").retain(|s| s.req_id != req_id);
    c.inflight_n.fetch_sub(1, Ordering::AcqRel);
}

/// `send_chunk` with the connection's writer already locked (`held`) or not.
fn send_chunk_on(link: &dyn Host, c: &Arc<Conn>, chunk: Chunk, x: Arc<XferShared>, held: Option<MutexGuard<'_, TcpStream>>) {
    let write = x.op == Op::Write;
    let vec = chunk.vec.clone();
    let piece = chunk.piece;
    // Encoded before anything is taken: a request whose sizes do not fit the wire format
    // fails its chunk (never a truncated frame). The id is stamped once it is drawn.
    let mut hdr = match request(link, &chunk, write).try_encode(0) {
        Ok(h) => h,
        Err(e) => return fail_unordered(link, c.rail, &chunk, &x, unencodable(e)),
    };
    let src = if write && x.local_dev(piece.local).is_some() { Some(local_src(&piece, vec.as_deref())) } else { None };
    let mut w = match held {
        Some(w) => w,
        None => c.writer.lock().expect("conn lock"),
    };
    if write && !c.wrote.load(Ordering::Relaxed) {
        // Before the first byte: from now on this connection's death needs a fence.
        c.wrote.store(true, Ordering::Release);
    }
    let local_gpu = x.local_dev(piece.local);
    if local_gpu.is_some() {
        // The stream contract: no byte of local GPU memory is read (WRITE) or written (READ)
        // before the application's work queued at post has completed. A failure here is the
        // device's, not the rail's: the chunk (so the transfer) fails with it, nothing is sent.
        if let Err(e) = x.wait_gpu_order() {
            fail_unordered(link, c.rail, &chunk, &x, e);
            return;
        }
    }
    let dev = if write { local_gpu } else { None };
    // A chunk a GPU stream pulled that it could not take: sent after the stream.
    let mut other: Option<(Chunk, Arc<XferShared>)> = None;
    let req_id = c.next_req.fetch_add(1, Ordering::Relaxed);
    let (xid, x2) = (chunk.xfer.0, x.clone());
    c.inflight.lock().expect("conn lock").push_back(Sent { req_id, chunk, xfer: x, spoiled: false });
    if c.inflight_n.fetch_add(1, Ordering::AcqRel) == 0 {
        // Idle until now: the stall clock starts here, however long ago a reader last
        // looked (a parked receiver does not keep `Clock::last` fresh while idle).
        c.busy_at.store(link.now_us(), Ordering::Release);
    }
    if x2.gone(xid) {
        // Failed or cancelled meanwhile (`XferShared::give_up`): not sent.
        withdraw(c, req_id);
        return;
    }
    Header::set_req_id(&mut hdr, req_id);
    // A send that cannot progress is a stall of the rail: the link's watchdog shuts it.
    let mut tick = |_: bool| {
        if link.is_shutdown() || c.dead.load(Ordering::Acquire) {
            Err("connection closed".to_string())
        } else {
            Ok(())
        }
    };
    let r = match (write, dev) {
        (true, None) if vec.is_some() => {
            let spans = local_spans(vec.as_deref().unwrap_or_default());
            let mut bufs: Vec<&[u8]> = Vec::with_capacity(spans.len() + 1);
            bufs.push(&hdr);
            // SAFETY: host memory registered and held by the transfer (see `local_spans`),
            // only read here.
            bufs.extend(spans.iter().map(|&(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) }));
            wire::write_full(&mut w, &bufs, &mut tick).map_err(|e| e.to_string())
        }
        (true, None) => {
            // SAFETY: the pair lies inside a local region registered with this agent (checked
            // when the handle was made) and held by the transfer (`hold`) until it is released.
            let payload = unsafe { std::slice::from_raw_parts(piece.local as *const u8, piece.len as usize) };
            wire::write_full(&mut w, &[&hdr, payload], &mut tick).map_err(|e| e.to_string())
        }
        (true, Some(dev)) => {
            // One staging pipeline over this chunk and the GPU WRITE chunks that follow it on
            // this connection while its window has room: the D2H of the next chunk overlaps
            // the sends of this one (no fill at every planner chunk). A chunk that is not a
            // WRITE from this GPU is sent after the stream (`other`).
            let window = link.cfg().conn_window;
            // (request id, bytes on the wire) of every segment of the stream, in order.
            let mut segs: Vec<(u64, u64)> = vec![(req_id, hdr.len() as u64 + src.as_ref().map_or(0, Src::len))];
            let mut refill = || {
                if other.is_some() || c.dead.load(Ordering::Acquire) || c.inflight_n.load(Ordering::Acquire) >= window {
                    return None;
                }
                let (ch, xx) = link.next_chunk(c.rail)?;
                if xx.op != Op::Write || xx.local_dev(ch.piece.local) != Some(dev) {
                    other = Some((ch, xx));
                    return None;
                }
                if let Err(e) = xx.wait_gpu_order() {
                    fail_unordered(link, c.rail, &ch, &xx, e);
                    return None;
                }
                let mut body = match request(link, &ch, true).try_encode(0) {
                    Ok(b) => b,
                    Err(e) => {
                        fail_unordered(link, c.rail, &ch, &xx, unencodable(e));
                        return None;
                    }
                };
                let src = local_src(&ch.piece, ch.vec.as_deref());
                let id = c.next_req.fetch_add(1, Ordering::Relaxed);
                let (xid, x2) = (ch.xfer.0, xx.clone());
                c.inflight.lock().expect("conn lock").push_back(Sent { req_id: id, chunk: ch, xfer: xx, spoiled: false });
                if c.inflight_n.fetch_add(1, Ordering::AcqRel) == 0 {
                    c.busy_at.store(link.now_us(), Ordering::Release);
                }
                if x2.gone(xid) {
                    withdraw(c, id); // failed or cancelled meanwhile: not sent
                    return None;
                }
                segs.push((id, body.len() as u64 + src.len()));
                if c.owner.load(Ordering::Acquire) != OWNER_CALLER {
                    c.kick(); // a parked receiver reads the responses as they come
                }
                Header::set_req_id(&mut body, id);
                Some((src, id, body))
            };
            let mut stage = c.stage_tx.lock().expect("conn lock");
            let first = (src.expect("a WRITE from GPU memory"), req_id, hdr.to_vec());
            let mut out = SockOut::new(&mut w, &mut tick);
            // SAFETY: GPU memory of `dev` inside regions registered and held as above (every
            // refilled chunk's transfer holds its regions until it completes).
            let r = unsafe { stage.send_stream(dev, first, &mut out, &mut refill) };
            let sent = out.sent;
            drop(out);
            match r {
                Err(StageError::Device(m)) => {
                    // The device failed, not the network: no copy runs on the pool any more,
                    // and the stream is put back in step; the rail stays up.
                    stage.abandon();
                    drop(stage);
                    stream_device_failed(link, c, &mut w, &mut tick, &segs, sent, Error::Gpu(format!("staging on GPU {dev}: {m}")))
                }
                r => r.map_err(|e| e.to_string()),
            }
        }
        (false, _) => wire::write_full(&mut w, &[&hdr], &mut tick).map_err(|e| e.to_string()),
    };
    if let Err(e) = r {
        // Record why (the first cause names the rail's failure), shut the rail's
        // connections; the receivers notice and run the rail-down path (which requeues
        // `other` too: the planner assigned it to this rail).
        let was_dead = c.dead.swap(true, Ordering::AcqRel);
        abort_socket(&w);
        drop(w);
        if !was_dead && !link.is_shutdown() {
            link.rail_failed(c.rail, format!("send failed: {e}"));
        }
        return;
    }
    drop(w);
    if let Some((ch, xx)) = other {
        send_chunk(link, c, ch, xx);
    }
}

fn sender(link: Arc<dyn Host>, c: Arc<Conn>) {
    let Some(_active) = link.enter() else { return };
    let window = link.cfg().conn_window;
    let room = || c.inflight_n.load(Ordering::Acquire) < window;
    // Leaves `wait_chunk` (None) when the connection dies, or when its receiver starts
    // refilling the window itself (`refill`).
    let stop = || c.dead.load(Ordering::Acquire) || c.self_refill.load(Ordering::Acquire) || c.handoff.lock().expect("conn lock").is_some();
    loop {
        let handed = c.handoff.lock().expect("conn lock").take();
        let next = match handed {
            Some(h) => Some(h),
            None if c.self_refill.load(Ordering::Acquire) => {
                // Dormant while the receiver refills: woken for a hand-off, when it stops
                // refilling, or when the connection dies (TICK bounds a missed wake-up).
                let g = c.dormant.lock().expect("conn lock");
                let busy = |_: &mut ()| {
                    c.self_refill.load(Ordering::Acquire)
                        && !c.dead.load(Ordering::Acquire)
                        && !link.is_shutdown()
                        && c.handoff.lock().expect("conn lock").is_none()
                };
                drop(c.dormant_cv.wait_timeout_while(g, TICK, busy).expect("conn lock"));
                if c.dead.load(Ordering::Acquire) || link.is_shutdown() {
                    return;
                }
                continue;
            }
            None => link.wait_chunk(c.rail, &room, &stop),
        };
        let Some((chunk, x)) = next else {
            if c.dead.load(Ordering::Acquire) || link.is_shutdown() {
                return;
            }
            continue; // the receiver refills now
        };
        send_chunk(&*link, &c, chunk, x);
        if c.owner.load(Ordering::Acquire) != OWNER_CALLER {
            // No caller is reading this connection now (one that leaves with requests
            // outstanding kicks on its way out): a parked receiver must read this chunk's
            // response.
            c.kick();
        }
    }
}

/// Requests the refilling receiver sends itself: READs with a plain (not vectored) request, so
/// that a request is a few dozen bytes. It sends them only while every request in flight on the
/// connection is such a READ and at most `REFILL_MAX_INFLIGHT` are: the requests unread by the
/// target then fit its socket's receive buffer many times over, so the receiver's write never
/// waits for a target that is itself blocked writing a payload to this (then unread) socket.
/// Anything else goes to the sender thread, which may block without stopping the reading.
const REFILL_MAX_INFLIGHT: usize = 64;

fn refillable(x: &XferShared, chunk: &Chunk) -> bool {
    // Not into local GPU memory either: its request waits for the application's stream work
    // (`XferShared::wait_gpu_order`), which must not hold up the reading.
    x.op == Op::Read && chunk.vec.is_none() && x.local_dev(chunk.piece.local).is_none()
}

/// Called by the receiver thread after it completed a response: sends the connection's next
/// READ requests itself while the connection has room (see `Conn::self_refill`), so the sender
/// thread need not be woken per chunk. A chunk it may not send (`refillable`) is handed to the
/// sender, and the sender takes over again.
fn refill(link: &dyn Host, c: &Arc<Conn>) {
    let window = link.cfg().conn_window.min(REFILL_MAX_INFLIGHT);
    // Only within a stream of READs: a connection left idle is refilled by the sender, which
    // the completion has woken (so a new transfer's first chunks are not pulled here).
    let eligible = |c: &Conn| {
        let q = c.inflight.lock().expect("conn lock");
        !q.is_empty() && q.iter().all(|s| refillable(&s.xfer, &s.chunk))
    };
    // The sender is writing: it keeps the window filled; do not wait behind its write.
    let Ok(mut w) = c.writer.try_lock() else {
        c.stop_refill();
        return;
    };
    loop {
        // Checked under the writer lock, where requests are queued: no WRITE payload can then
        // be waiting in the socket ahead of the request this writes.
        // Nor while a hand-off waits for the sender (one slot: the sender sends it first).
        if c.dead.load(Ordering::Acquire) || c.handoff.lock().expect("conn lock").is_some() || !eligible(c) {
            drop(w);
            c.stop_refill();
            return;
        }
        if c.inflight_n.load(Ordering::Acquire) >= window {
            break;
        }
        let Some((chunk, x)) = link.next_chunk(c.rail) else { break };
        if !refillable(&x, &chunk) {
            *c.handoff.lock().expect("conn lock") = Some((chunk, x));
            drop(w);
            c.stop_refill();
            // The sender may be dormant, or waiting in `wait_chunk` (whose stop() sees the
            // hand-off).
            c.wake_sender();
            link.wake_senders();
            return;
        }
        c.self_refill.store(true, Ordering::Release);
        send_chunk_on(link, c, chunk, x, Some(w));
        w = match c.writer.try_lock() {
            Ok(w) => w,
            Err(_) => {
                c.stop_refill();
                return;
            }
        };
    }
}

fn receiver(link: Arc<dyn Host>, rail: Arc<TcpRail>, c: Arc<Conn>) {
    let reason = match link.enter() {
        Some(_active) => receive_loop(&*link, &c),
        None => None,
    };
    c.dead.store(true, Ordering::Release);
    {
        // Waits for a caller that is still reading this connection (it sees `dead`).
        let rx = c.rx.lock().expect("rx lock");
        if reason.is_some() {
            abort_socket(&rx.s);
        } else {
            let _ = rx.s.shutdown(Shutdown::Both);
        }
        c.stopped.store(true, Ordering::Release);
    }
    if let Some(reason) = reason {
        link.rail_failed(c.rail, reason);
    }
    link.path_stopped(c.rail, &mut || rail.live.fetch_sub(1, Ordering::AcqRel) == 1);
}

/// The receiver thread: waits for the socket to become readable without holding the
/// connection's reader, then reads responses while requests are outstanding. A caller
/// blocked in `wait` on a transfer of this connection may own the reader instead
/// (caller-driven completion, see `drive`); the receiver then stays out of its way.
/// Returns the failure reason, or None on orderly shutdown.
fn receive_loop(link: &dyn Host, c: &Arc<Conn>) -> Option<String> {
    let fd = c.fd;
    let kick_fd = std::os::fd::AsRawFd::as_raw_fd(&c.kick);
    let mut seen_kicks = 0u64;
    loop {
        if link.is_shutdown() {
            return None;
        }
        if c.dead.load(Ordering::Acquire) {
            return Some("connection shut".into());
        }
        let caller_owns = c.owner.load(Ordering::Acquire) == OWNER_CALLER;
        let since_caller = link.now_us().saturating_sub(c.caller_at.load(Ordering::Acquire));
        // Responses due and no caller polled for POLL_PARK: this receiver reads them.
        let outstanding = c.inflight_n.load(Ordering::Acquire) > 0;
        let callers_polling =
            since_caller < CALLER_GRACE.as_micros() as u64 && !(outstanding && since_caller >= POLL_PARK.as_micros() as u64);
        if caller_owns || callers_polling {
            // A caller is reading, or callers are driving this connection round trip after
            // round trip: stay out of their way until kicked (a caller that leaves with
            // requests outstanding kicks), the socket hangs up (read below, which sees the
            // failure), or the grace period ends. Parked, not napping: a bulk transfer a caller
            // drives costs this thread no wake-up per response (issue 22 item 5: the 200 µs
            // naps it took before were a thousand wake-ups a second). Without an owner, in naps
            // of POLL_PARK at most: a request sent meanwhile without a kick (a polled post) is
            // then looked after within two of them if its polls stop.
            let wait = if caller_owns { TICK } else { CALLER_GRACE.saturating_sub(Duration::from_micros(since_caller)).min(POLL_PARK) };
            c.parked.store(true, Ordering::SeqCst);
            let (hup, kicked) = if c.kicks.load(Ordering::SeqCst) != seen_kicks { (false, true) } else { park(fd, kick_fd, wait) };
            c.parked.store(false, Ordering::SeqCst);
            if kicked {
                seen_kicks = c.kicks.load(Ordering::SeqCst);
                let mut buf = 0u64;
                // SAFETY: an 8-byte read from our own non-blocking eventfd (drains it).
                unsafe {
                    libc::read(kick_fd, &mut buf as *mut u64 as *mut libc::c_void, 8);
                }
                if c.owner.load(Ordering::Acquire) == OWNER_CALLER {
                    // Still the caller's (it kicks again if it leaves work behind).
                    continue;
                }
            } else if hup && c.owner.load(Ordering::Acquire) == OWNER_CALLER {
                // The caller reads the hang-up itself (and marks the connection dead); do
                // not spin on it meanwhile.
                std::thread::sleep(CALLER_YIELD);
                continue;
            } else if !hup {
                continue;
            }
        }
        // Responses a caller read ahead but left unprocessed are as readable as the socket.
        let readable = c.stashed.load(Ordering::Acquire) || poll_in(fd, TICK);
        if c.owner.compare_exchange(OWNER_NONE, OWNER_RECEIVER, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        let mut rx = c.rx.lock().expect("rx lock");
        // A caller may have read what woke us: only read what is still there (a read with
        // nothing to come would hold the reader from the next waiting caller).
        let r = if rx.inb.unread() > 0 || (readable && poll_in(fd, Duration::ZERO)) {
            // Read while requests are outstanding; hand the reader back when idle so a
            // waiting caller can drive the next round trip itlink.
            let r = loop {
                match read_one(link, c, &mut rx, None) {
                    Ok(()) => {
                        refill(link, c);
                        if c.inflight_n.load(Ordering::Acquire) == 0 {
                            break Ok(());
                        }
                    }
                    Err(e) => break Err(e),
                }
            };
            c.stop_refill();
            r
        } else {
            quiet_checks(link, c, &mut rx.clock, false)
        };
        c.stashed.store(rx.inb.unread() > 0, Ordering::Release);
        drop(rx);
        c.owner.store(OWNER_NONE, Ordering::Release);
        match r {
            Ok(()) => {}
            Err(Stop::Shutdown) => return None,
            Err(Stop::Failed(e)) => return Some(e),
            Err(Stop::Idle) | Err(Stop::CallerTimeout) => {}
        }
    }
}

/// Deadline, stall and link checks for a reader with nothing to read right now.
fn quiet_checks(link: &dyn Host, c: &Conn, clock: &mut Clock, started: bool) -> Result<(), Stop> {
    if link.is_shutdown() {
        return Err(Stop::Shutdown);
    }
    if c.dead.load(Ordering::Acquire) {
        return Err(Stop::Failed("connection shut".into()));
    }
    let busy = started || c.inflight_n.load(Ordering::Acquire) > 0;
    if !busy {
        clock.last = Instant::now();
        return Ok(());
    }
    // Quiet since the last response, or since the connection last became busy if later.
    let busy_for = Duration::from_micros(link.now_us().saturating_sub(c.busy_at.load(Ordering::Acquire)));
    let quiet = clock.last.elapsed().min(busy_for);
    // A local link that lost carrier is dead now; no need to wait for the stall.
    if quiet > LINK_CHECK && clock.last_link_check.elapsed() > LINK_CHECK {
        clock.last_link_check = Instant::now();
        if let Some(why) = link.local_dev(c.rail).and_then(link_down) {
            return Err(Stop::Failed(why));
        }
    }
    // Stalls are the planner's decision (the link's watchdog, fed by `quiet_for`): a stalled
    // rail is shut, and this reader then sees its connection dead.
    Ok(())
}

/// Reads and completes one response (`read_response`), then completes the READs into GPU
/// memory that have landed meanwhile: all of them, waiting for their copies, when nothing more
/// is there to read now (so no chunk is left unreported on an idle connection). On a failure,
/// waits until no copy of this connection runs and drops them: the rail-down path reissues
/// their chunks.
fn read_one(link: &dyn Host, c: &Arc<Conn>, rx: &mut Rx, caller: Option<Option<Instant>>) -> Result<(), Stop> {
    let r = read_response(link, c, rx, caller);
    let idle = rx.inb.unread() == 0 && !poll_in(c.fd, Duration::ZERO);
    let landed = match &r {
        Ok(()) => land(link, c, rx, idle),
        Err(Stop::Idle | Stop::CallerTimeout) => land(link, c, rx, true),
        Err(_) => {
            rx.stage.abandon();
            rx.landing.clear();
            rx.landed_early.clear();
            Ok(())
        }
    };
    landed.and(r)
}

/// Fails the READs of `landing` into GPU `dev` (None: every GPU) whose staging copies a device
/// error dropped (their bytes were off the wire, so the connection stays in step): their
/// transfers fail with the error; the rails stay up.
fn fail_landing(link: &dyn Host, c: &Conn, landing: &mut std::collections::VecDeque<(Sent, u32)>, dev: Option<u32>, m: &str) {
    let (gone, keep): (Vec<_>, Vec<_>) = landing.drain(..).partition(|l| dev.is_none_or(|d| d == l.1));
    landing.extend(keep);
    for (sent, d) in gone {
        sent.xfer.set_cause(Error::Gpu(format!("staging on GPU {d}: {m}")));
        let msg = format!("GPU staging failed on GPU {d}: {m}");
        link.chunk_done(c.rail, sent.chunk.id, &sent.xfer, sent.chunk.piece.len, Err((Status::Internal, msg)));
    }
}

/// Completes the landed READs of `rx.landing`, in order (`wait`: all of them).
fn land(link: &dyn Host, c: &Conn, rx: &mut Rx, wait: bool) -> Result<(), Stop> {
    if rx.landing.is_empty() {
        return Ok(());
    }
    let mut devs: Vec<u32> = rx.landing.iter().map(|l| l.1).collect();
    devs.sort_unstable();
    devs.dedup();
    let mut done = std::mem::take(&mut rx.landed_early);
    let mut quiet = |_: bool| Ok(());
    for dev in devs {
        let r = if wait {
            rx.stage.recv_finish(dev, &mut SockIn::new(&mut rx.s, &mut rx.inb, &mut quiet), &mut done)
        } else {
            rx.stage.recv_done(dev, &mut done)
        };
        match r {
            Ok(()) => {}
            // Every byte of these READs is off the wire: the stream is in step, so a device
            // error is their transfers' failure, not the rail's (issue 35 defect 5).
            Err(StageError::Device(m)) => {
                rx.stage.abandon();
                rx.landed_early.clear();
                fail_landing(link, c, &mut rx.landing, None, &m);
                return Ok(());
            }
            Err(e) => {
                rx.stage.abandon();
                rx.landing.clear();
                rx.landed_early.clear();
                return Err(Stop::Failed(e.to_string()));
            }
        }
    }
    while let Some((sent, _)) = rx.landing.front() {
        if !done.contains(&sent.req_id) {
            break;
        }
        let (sent, _) = rx.landing.pop_front().expect("front exists");
        link.chunk_done(c.rail, sent.chunk.id, &sent.xfer, sent.chunk.piece.len, Ok(()));
    }
    // Landed but behind an older one still landing: kept for the next call.
    done.retain(|t| rx.landing.iter().any(|l| l.0.req_id == *t));
    rx.landed_early = done;
    Ok(())
}

/// Read and complete one response on `c`. `caller`: a waiting caller's deadline; such a
/// reader also stops (between frames only) when nothing is outstanding or time is up.
fn read_response(link: &dyn Host, c: &Arc<Conn>, rx: &mut Rx, caller: Option<Option<Instant>>) -> Result<(), Stop> {
    let Rx { s, inb, clock, stage, landing, landed_early } = rx;
    let mut stop: Option<Stop> = None;
    // Runs every TICK while the socket has nothing to read.
    let mut tick = |started: bool| -> Result<(), String> {
        let r = match caller {
            Some(_) if !started && c.inflight_n.load(Ordering::Acquire) == 0 => Err(Stop::Idle),
            Some(Some(d)) if !started && Instant::now() >= d => Err(Stop::CallerTimeout),
            _ => quiet_checks(link, c, clock, started),
        };
        r.map_err(|e| {
            stop = Some(e);
            String::new()
        })
    };
    // The response answers the oldest request (TCP keeps order). When a READ into host memory
    // is already queued (pipelined bulk), land header and payload with one scatter read; on an
    // idle connection the read-ahead takes the response whole and the payload lands after. A
    // READ into GPU memory lands through the bounce pool, after the header.
    // A vectored READ's payload is scattered into its pieces after the header.
    let head = |c: &Conn| {
        c.inflight
            .lock()
            .expect("conn lock")
            .front()
            .map(|f| (f.chunk.piece, f.chunk.vec.clone(), f.xfer.op, f.xfer.local_dev(f.chunk.piece.local)))
    };
    let front = head(c);
    let dst = match &front {
        // SAFETY: registered local memory held by the transfer (see `send_chunk`).
        Some((p, None, Op::Read, None)) => Some(unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) }),
        _ => None,
    };
    let failed = |e: WireError, stop: &mut Option<Stop>| stop.take().unwrap_or_else(|| Stop::Failed(e.to_string()));
    let (h, body, mut landed) = match inb.read_response_into(s, dst, &mut tick) {
        Ok(f) => f,
        Err(e) => return Err(failed(e, &mut stop)),
    };
    let next = match front {
        None => head(c),
        Some((_, _, Op::Read, Some(_))) | Some((_, Some(_), Op::Read, None)) => front,
        _ => None,
    };
    // A READ into GPU memory that is off the wire, its copies maybe still running: completed
    // by `land` once they are done.
    let mut deferred: Option<u32> = None;
    // Payload bytes a failed staged READ had taken off the wire, and its device error.
    let mut got = 0u64;
    let mut device_err: Option<String> = None;
    if let (Some((p, vec, Op::Read, dev)), Body::Resp { status: Status::Ok, bulk_len, .. }) = (next, &body) {
        if *bulk_len == p.len {
            let r = match dev {
                None if vec.is_some() => {
                    let dsts = local_spans(vec.as_deref().unwrap_or_default());
                    // SAFETY: registered local host memory held by the transfer (see
                    // `local_spans`) until its chunk is reported done.
                    unsafe { inb.read_into_spans(s, &dsts, &mut tick) }.map_err(StageError::Wire)
                }
                None => {
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) };
                    inb.read_into(s, dst, &mut tick).map_err(StageError::Wire)
                }
                // SAFETY: GPU memory of `dev` inside a region registered and held by the
                // transfer until its chunk is done, which `land` reports only once every copy
                // into it has completed (and a failure waits for them: `read_one`).
                Some(dev) => {
                    deferred = Some(dev);
                    // Earlier READs whose copies complete meanwhile are done at once.
                    let mut landed = |tag: u64| {
                        landed_early.push(tag);
                        while let Some(i) = landing.front().and_then(|l| landed_early.iter().position(|t| *t == l.0.req_id)) {
                            landed_early.swap_remove(i);
                            let (sent, _) = landing.pop_front().expect("front exists");
                            link.chunk_done(c.rail, sent.chunk.id, &sent.xfer, sent.chunk.piece.len, Ok(()));
                        }
                    };
                    let dst = local_src(&p, vec.as_deref());
                    let mut inp = SockIn::new(s, inb, &mut tick);
                    let r = unsafe { stage.recv_segment_notify(dev, dst, h.req_id, &mut inp, Some(&mut landed)) };
                    got = inp.received();
                    r
                }
            };
            match r {
                Ok(()) => landed = true,
                Err(StageError::Wire(e)) => return Err(failed(e, &mut stop)),
                // A device error cut the payload short: the rest is read and dropped, so the
                // stream stays in step, and the READ fails with the error (issue 35 defect 5).
                Err(StageError::Device(m)) if deferred.is_some() => {
                    if let Err(e) = inb.discard(s, p.len - got.min(p.len), &mut tick) {
                        return Err(failed(e, &mut stop));
                    }
                    device_err = Some(m);
                }
                Err(e) => return Err(Stop::Failed(e.to_string())),
            }
        }
    }
    clock.last = Instant::now();
    let proto = |m: String| Err(Stop::Failed(m));
    let (status, bulk_len, msg) = match body {
        Body::Resp { status, bulk_len, msg } => (status, bulk_len, msg),
        Body::Error { status, msg } => return proto(format!("peer closed the connection: {status:?}: {msg}")),
        other => return proto(format!("protocol error: unexpected {:?} on a data connection", other.kind())),
    };
    let Some(sent) = c.inflight.lock().expect("conn lock").pop_front() else {
        return proto("protocol error: response with no request outstanding".into());
    };
    if sent.req_id != h.req_id {
        return proto(format!("protocol error: response to request {} while {} was next", h.req_id, sent.req_id));
    }
    let ok = status == Status::Ok;
    if let (Some(m), Some(dev)) = (device_err, deferred) {
        // The pipeline dropped every segment of this GPU (the READs still landing on it too).
        c.inflight_n.fetch_sub(1, Ordering::AcqRel);
        landed_early.clear();
        landing.push_back((sent, dev));
        fail_landing(link, c, landing, Some(dev), &m);
        return Ok(());
    }
    if ok && sent.xfer.op == Op::Read && !landed {
        return proto(format!("protocol error: READ of {} bytes answered with {bulk_len}", sent.chunk.piece.len));
    } else if (!ok || sent.xfer.op == Op::Write) && bulk_len != 0 {
        return proto("protocol error: bulk data on a refused or WRITE response".into());
    }
    c.inflight_n.fetch_sub(1, Ordering::AcqRel);
    if let (true, Some(dev)) = (ok, deferred) {
        landing.push_back((sent, dev));
        return Ok(());
    }
    let r = if sent.spoiled {
        Err((Status::Internal, "its payload was cut short by a GPU staging error".to_string()))
    } else if ok {
        Ok(())
    } else {
        Err((status, msg))
    };
    link.chunk_done(c.rail, sent.chunk.id, &sent.xfer, sent.chunk.piece.len, r);
    Ok(())
}

/// In `Progress::Adaptive`, a response to a chunk larger than this is not busy-polled for: its
/// bytes take longer on any wire than the scheduler wake-up a spin saves (1 MiB is 84 µs at
/// 100 Gbit/s), so spinning would only burn CPU per byte while the connection's window keeps
/// the pipe full (issue 22 item 5). Small chunks (pages, round trips) still spin.
pub(crate) const SPIN_MAX_CHUNK: u64 = 256 << 10;

/// Whether an adaptive caller busy-polls for the response to the oldest request in flight, of
/// `head` bytes (None: nothing known in flight; the spin ends at once then anyway).
fn adaptive_spins_for(head: Option<u64>) -> bool {
    head.is_none_or(|len| len <= SPIN_MAX_CHUNK)
}

/// Busy-poll `c` for the next response before the read that would sleep in the kernel, as
/// `Config::progress` says: not at all (`Block`), up to `spin` (`Adaptive`; not for a bulk
/// chunk: `SPIN_MAX_CHUNK`), or until the caller's deadline (`Poll`). The stall, link and
/// shutdown checks keep running meanwhile; the spin ends early when nothing is outstanding on
/// `c`.
fn spin_for_response(link: &dyn Host, c: &Conn, clock: &mut Clock, deadline: Option<Instant>) -> Result<(), Stop> {
    let cfg = link.cfg();
    let budget = match cfg.progress {
        Progress::Block => return Ok(()),
        Progress::Adaptive => {
            let head = c.inflight.lock().expect("conn lock").front().map(|s| s.chunk.piece.len);
            if !adaptive_spins_for(head) {
                return Ok(());
            }
            c.spin.get()
        }
        Progress::Poll => deadline.map_or(Duration::from_secs(3600), |d| d.saturating_duration_since(Instant::now())),
    };
    let how = wire::spin_readable(c.fd, budget, || {
        if c.inflight_n.load(Ordering::Acquire) == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
        quiet_checks(link, c, clock, false).map(|_| true)
    })?;
    c.spin.record(how);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that stops reading closes its window: the sender is held (the path answers),
    /// not stalled; zero-window probes that go unanswered, or an open window, are not held.
    #[test]
    fn a_closed_receive_window_is_held_while_its_probes_are_answered() {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        // Segments of an Ethernet MTU, as on a rail (loopback's 64 KiB segments do not fit a
        // small window and are dropped rather than acknowledged).
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
        let mss: libc::c_int = 1448;
        // SAFETY: setsockopt with a c_int argument on a socket we own.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::IPPROTO_TCP,
                libc::TCP_MAXSEG,
                &mss as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "TCP_MAXSEG");
        sock.connect(&l.local_addr().expect("addr").into()).expect("connect");
        let mut w: TcpStream = sock.into();
        let (r, _) = l.accept().expect("accept");
        crate::fanin::set_window(std::os::fd::AsRawFd::as_raw_fd(&r), 64 << 10).expect("window");
        let wfd = std::os::fd::AsRawFd::as_raw_fd(&w);
        // Owing nothing, its last ACK fresh: held (the transport asks this only of connections
        // with requests outstanding, whose peer has not answered yet).
        assert!(held_locally(wfd), "a connection that owes nothing, just acknowledged, is held");
        w.set_nonblocking(true).expect("nonblocking");
        let buf = vec![7u8; 64 << 10];
        let deadline = Instant::now() + Duration::from_secs(10);
        // Fill the receiver (it never reads) and our own send buffer, then wait for the last
        // in-flight bytes to be acknowledged with a zero window.
        loop {
            let _ = w.write(&buf);
            let i = tcp_info(wfd).expect("tcp_info");
            if i.tcpi_snd_wnd == 0 && i.tcpi_unacked == 0 && i.tcpi_notsent_bytes > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the window never closed: snd_wnd {} unacked {} notsent {} probes {}",
                i.tcpi_snd_wnd,
                i.tcpi_unacked,
                i.tcpi_notsent_bytes,
                i.tcpi_probes
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(held_locally(wfd));
        let mut i = tcp_info(wfd).expect("tcp_info");
        i.tcpi_probes = 2;
        assert!(!held_by(&i), "two unanswered probes: the path may be dead");
        i.tcpi_probes = 0;
        i.tcpi_snd_wnd = 64 << 10;
        assert!(!held_by(&i), "an open window with nothing in flight is quiet, not held");
        drop(r);
    }

    /// A connection waiting on a peer whose application does not answer (every byte
    /// acknowledged, nothing to send) keeps proving its path by keepalive: held, not dead, and
    /// the probes' ACKs are not progress. A probe unanswered past its grace is a dead path.
    #[test]
    fn a_silent_peer_is_held_by_its_answered_keepalives_and_a_lost_probe_is_death() {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut w = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (_r, _) = l.accept().expect("accept"); // never reads, never answers
        keep_probing(&w).expect("keepalive");
        w.write_all(b"a request").expect("write");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&w);
        std::thread::sleep(Duration::from_millis(1600));
        let i = tcp_info(fd).expect("tcp_info");
        assert!(i.tcpi_last_ack_recv < 1000, "no keepalive was answered: last ACK {} ms ago", i.tcpi_last_ack_recv);
        assert!(progress_ms(&i) >= 1500, "a keepalive's ACK counted as progress: {} ms", progress_ms(&i));
        assert!(held_by(&i) && !dead_by(&i), "a path that answers its probes is held, not dead");
        let mut lost = i;
        lost.tcpi_probes = 1;
        lost.tcpi_last_ack_recv = KEEPALIVE_IDLE_MS + KEEPALIVE_GRACE_MS;
        assert!(!held_by(&lost) && dead_by(&lost), "a probe unanswered past its grace");
        let mut owed = i;
        owed.tcpi_unacked = 3;
        owed.tcpi_ca_state = 4; // Loss
        owed.tcpi_retransmits = 2;
        owed.tcpi_backoff = 2;
        assert!(!held_by(&owed) && dead_by(&owed), "two retransmission timeouts unanswered");
        // Seen on the 32 -> 1 fan-in on a loaded host, at a false stall: the retry of a
        // retransmission timeout refused by this host's own queue (no backoff).
        owed.tcpi_retransmits = 1;
        owed.tcpi_backoff = 0;
        assert!(held_by(&owed) && !dead_by(&owed), "a retry held in this host's queue");
        // Seen on the same fan-in at load 8-10: an ACK 500 ms ago reset the retransmission
        // count; the timeout (208 ms) has been due since and has not run on this host.
        let mut due = i;
        due.tcpi_unacked = 14;
        due.tcpi_ca_state = 4;
        due.tcpi_retransmits = 0;
        due.tcpi_backoff = 0;
        due.tcpi_probes = 0;
        due.tcpi_rto = 208_000;
        due.tcpi_last_data_sent = 504;
        due.tcpi_last_ack_recv = 500;
        assert!(rto_overdue(&due) && held_by(&due) && !dead_by(&due), "a timer this host has not run");
        // A blackholed path on a host that runs its timers: the timeout runs (a retransmission
        // counted, backed off once) and the hold is gone; the second backoff is death.
        let mut dead = due;
        dead.tcpi_retransmits = 1;
        dead.tcpi_backoff = 1;
        assert!(!held_by(&dead) && !dead_by(&dead), "after its timeout ran, a silent path is not held");
        dead.tcpi_retransmits = 2;
        dead.tcpi_backoff = 2;
        assert!(!held_by(&dead) && dead_by(&dead));
        // Not due yet: not held by this rule (the stall rule applies as before).
        let mut early = due;
        early.tcpi_rto = 1_000_000;
        assert!(!rto_overdue(&early));
    }

    /// Adaptive callers spin for responses to small chunks (round trips, pages) and not for
    /// bulk chunks, whose bytes take longer than the wake-up a spin would save.
    #[test]
    fn adaptive_spins_for_small_chunks_only() {
        assert!(adaptive_spins_for(None));
        assert!(adaptive_spins_for(Some(4096)));
        assert!(adaptive_spins_for(Some(SPIN_MAX_CHUNK)));
        assert!(!adaptive_spins_for(Some(SPIN_MAX_CHUNK + 1)));
        assert!(!adaptive_spins_for(Some(1 << 20)));
    }

    /// A parked receiver wakes for its kick and for the socket's hang-up, not for data.
    #[test]
    fn park_wakes_for_a_kick_or_a_hang_up_but_not_for_data() {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut w = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (r, _) = l.accept().expect("accept");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&r);
        let kick = eventfd().expect("eventfd");
        let kfd = std::os::fd::AsRawFd::as_raw_fd(&kick);
        w.write_all(b"data the parked receiver must not wake for").expect("write");
        assert_eq!(park(fd, kfd, Duration::from_millis(30)), (false, false));
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our own eventfd.
        assert_eq!(unsafe { libc::write(kfd, &one as *const u64 as *const libc::c_void, 8) }, 8);
        assert_eq!(park(fd, kfd, Duration::from_secs(10)), (false, true));
        let mut buf = 0u64;
        // SAFETY: an 8-byte read from our own eventfd (drains it).
        unsafe { libc::read(kfd, &mut buf as *mut u64 as *mut libc::c_void, 8) };
        w.shutdown(Shutdown::Write).expect("shutdown");
        assert_eq!(park(fd, kfd, Duration::from_secs(10)), (true, false));
    }
}
