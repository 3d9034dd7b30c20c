//! CUDA VMM memory between processes of this host (issue 35, defect 8): memory that
//! `cudaIpcGetMemHandle` cannot export (PyTorch's expandable segments, VMM allocators) goes
//! as one POSIX file descriptor per physical chunk (`cuMemExportToShareableHandle`), passed
//! over a unix socket with `SCM_RIGHTS`, and is mapped by the importer into one reserved range
//! (`Device::vmm_reserve`, `vmm_map`, `vmm_commit`).
//!
//! - **Who gets an fd.** The exporter hands out a VMM region only as the legacy path hands out
//!   handles: in its `IpcHandles` answer, on the authenticated control connection, to a peer
//!   with a live watch connection. For VMM the 64 handle bytes carry no CUDA handle but a
//!   32-byte random token ([`offer`]), which the peer presents on the exporter's unix socket
//!   to receive that region's chunk fds, once: a token is used up by its first presentation,
//!   expires after the exporter's `timeout`, and is withdrawn when the region is deregistered
//!   or the agent closes ([`withdraw`]). Nothing else is served: a peer gets the fds of the
//!   regions it was answered for and nothing more.
//! - **Why `SCM_RIGHTS` and not `pidfd_getfd`** (PyTorch's way): `pidfd_getfd` needs ptrace
//!   rights over the exporter (Yama's default `ptrace_scope=1` refuses it between sibling
//!   processes, containers drop `CAP_SYS_PTRACE`, a user cannot take a root process's fds) and
//!   lets the importer take *any* fd of the exporter, not only the exported ones. With
//!   `SCM_RIGHTS` the exporter decides which fds go, to whom.
//! - **The socket** is `$MULTIRAIL_IPC_DIR` (default `/tmp`)`/multirail-vmm-<pid>-<nonce>.sock`,
//!   mode 0666 (the token is what authenticates, so a peer of another user, or root, can
//!   connect as with legacy CUDA IPC, which checks no user either), listened on only while
//!   offers are pending and removed when none is left. Each connection is served on its own
//!   short-lived thread (8 at most at once), which waits 200 ms for the token and 2 s per write.
//! - **The importer** connects without blocking (a full listen queue is retried, not waited
//!   on), checks with `SO_PEERCRED` that the listener is the exporter's process before it
//!   sends the token, and ends the whole fetch within 10 s. A definite refusal is remembered
//!   for the region (staged from then on); a timeout or a dropped connection is tried again
//!   by the next transfer.
//!
//! Wire format on the socket: the importer writes the token (32 bytes); the exporter answers
//! one status byte: 1 and a `u16`-length message (refused), or 0, then the chunk count (`u32`),
//! the total length (`u64`), and per chunk an 8-byte length with its fd attached.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use multirail_gpu::{Device, DevicePtr, Gpu};

/// First bytes of a VMM "handle" in `IpcEntry::handle` (a legacy CUDA IPC handle never starts so).
const MAGIC: &[u8; 4] = b"MRVM";
/// Read and write timeout on the fd socket, per operation.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the exporter waits for a connection's token.
const TOKEN_TIMEOUT: Duration = Duration::from_millis(200);
/// Connections the exporter serves at once.
const MAX_SERVING: usize = 8;
static SERVING: AtomicUsize = AtomicUsize::new(0);
/// Chunks per region at most (a 40 GiB expandable segment has 2,048 of 20 MiB).
pub(crate) const MAX_CHUNKS: usize = 1 << 16;
/// Where the sockets live (both processes must agree; default `/tmp`).
pub const ENV_IPC_DIR: &str = "MULTIRAIL_IPC_DIR";

/// Whether `handle` is a VMM offer rather than a legacy CUDA IPC handle.
pub(crate) fn is_vmm(handle: &[u8; 64]) -> bool {
    &handle[..4] == MAGIC
}

/// What a token gives: these chunks of `gpu`, exported when fetched.
struct Offer {
    gpu: Gpu,
    chunks: Vec<(DevicePtr, usize)>,
    /// The agent that made it (its `Exports`) and the region, for [`withdraw`].
    owner: usize,
    region: u64,
    expires: Instant,
}

struct Server {
    nonce: u64,
    offers: HashMap<[u8; 32], Offer>,
}

fn server() -> MutexGuard<'static, Option<Server>> {
    static S: Mutex<Option<Server>> = Mutex::new(None);
    S.lock().unwrap_or_else(PoisonError::into_inner)
}

fn socket_path(pid: u32, nonce: u64) -> PathBuf {
    let dir = std::env::var_os(ENV_IPC_DIR).filter(|d| !d.is_empty()).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    dir.join(format!("multirail-vmm-{pid}-{nonce:016x}.sock"))
}

/// Refuses a socket directory other users may write without the sticky bit: one of them
/// could remove the exporter's socket and bind its own at the name.
fn check_dir(path: &Path) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mode = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "{} (mode {:o}) is writable by other users without the sticky bit: set {ENV_IPC_DIR} to a directory only this user writes, or one with the sticky bit (as /tmp)",
            dir.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Offers `chunks` of `gpu` (a VMM region `region` of agent `owner`) for `ttl`; returns the
/// 64 handle bytes that name the socket and the token.
pub(crate) fn offer(owner: usize, region: u64, gpu: Gpu, chunks: Vec<(DevicePtr, usize)>, ttl: Duration) -> Result<[u8; 64], String> {
    let mut s = server();
    if s.is_none() {
        *s = Some(start()?);
    }
    let srv = s.as_mut().expect("started above");
    let token: [u8; 32] = crate::registry::random_bytes();
    srv.offers.insert(token, Offer { gpu, chunks, owner, region, expires: Instant::now() + ttl });
    let mut h = [0u8; 64];
    h[..4].copy_from_slice(MAGIC);
    h[4..8].copy_from_slice(&std::process::id().to_le_bytes());
    h[8..16].copy_from_slice(&srv.nonce.to_le_bytes());
    h[16..48].copy_from_slice(&token);
    Ok(h)
}

/// Withdraws the offers of agent `owner` for `regions` (None: all of them) that no peer has
/// fetched yet.
pub(crate) fn withdraw(owner: usize, regions: Option<&[u64]>) {
    if let Some(srv) = server().as_mut() {
        srv.offers.retain(|_, o| o.owner != owner || regions.is_some_and(|r| !r.contains(&o.region)));
    }
}

/// Binds a new socket and starts its thread (the caller holds the server lock).
fn start() -> Result<Server, String> {
    let nonce = u64::from_le_bytes(crate::registry::random_bytes());
    let path = socket_path(std::process::id(), nonce);
    check_dir(&path)?;
    let l = UnixListener::bind(&path).map_err(|e| format!("cannot listen on {} for CUDA VMM file descriptors: {e}", path.display()))?;
    let ready = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
        .and_then(|_| l.set_nonblocking(true))
        .map_err(|e| format!("{}: {e}", path.display()));
    let spawned = ready.and_then(|_| {
        let p = path.clone();
        std::thread::Builder::new().name("mr-ipc-fd".into()).spawn(move || serve(l, p, nonce)).map_err(|e| format!("spawn: {e}"))
    });
    if let Err(e) = spawned {
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    Ok(Server { nonce, offers: HashMap::new() })
}

/// Serves connections until no offer is left, then removes the socket.
fn serve(l: UnixListener, path: PathBuf, nonce: u64) {
    loop {
        {
            let mut s = server();
            let now = Instant::now();
            match s.as_mut() {
                Some(srv) if srv.nonce == nonce => {
                    srv.offers.retain(|_, o| o.expires > now);
                    if srv.offers.is_empty() {
                        *s = None;
                        let _ = std::fs::remove_file(&path);
                        return;
                    }
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                    return;
                }
            }
        }
        let mut pfd = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; waits at most 100 ms.
        unsafe { libc::poll(&mut pfd, 1, 100) };
        match l.accept() {
            // Each connection on its own short-lived thread, so one that sends nothing delays
            // no other; past MAX_SERVING at once a connection is closed unanswered (its
            // importer stages that transfer and tries again with the next).
            Ok((c, _)) => {
                if SERVING.fetch_add(1, Ordering::AcqRel) >= MAX_SERVING {
                    SERVING.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let spawned = std::thread::Builder::new().name("mr-ipc-fd-c".into()).spawn(move || {
                    // A failed answer ends its connection: the importer names its own reason.
                    let _ = answer(c, nonce);
                    SERVING.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    SERVING.fetch_sub(1, Ordering::AcqRel);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One importer: its token, then the chunks of the offer it names, or a refusal.
fn answer(mut c: UnixStream, nonce: u64) -> std::io::Result<()> {
    c.set_nonblocking(false)?;
    // The token comes at once from a real importer (it writes it right after connecting).
    c.set_read_timeout(Some(TOKEN_TIMEOUT))?;
    c.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut token = [0u8; 32];
    c.read_exact(&mut token)?;
    let offer = {
        let mut s = server();
        let now = Instant::now();
        s.as_mut().filter(|srv| srv.nonce == nonce).and_then(|srv| srv.offers.remove(&token)).filter(|o| o.expires > now)
    };
    let Some(o) = offer else {
        let msg = b"no such CUDA VMM offer: the token is unknown, used or expired";
        c.write_all(&[1])?;
        c.write_all(&(msg.len() as u16).to_le_bytes())?;
        return c.write_all(msg);
    };
    let total: u64 = o.chunks.iter().map(|c| c.1 as u64).sum();
    let mut head = vec![0u8];
    head.extend_from_slice(&(o.chunks.len() as u32).to_le_bytes());
    head.extend_from_slice(&total.to_le_bytes());
    c.write_all(&head)?;
    for &(base, len) in &o.chunks {
        // Exported one at a time and closed once sent: the process holds one more fd at most.
        let fd = o.gpu.vmm_export_fd(base).map_err(std::io::Error::other)?;
        send_fd(&c, len as u64, fd.as_fd())?;
    }
    Ok(())
}

/// Sends `len` (8 bytes) with `fd` attached.
fn send_fd(c: &UnixStream, len: u64, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let bytes = len.to_le_bytes();
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // u64s keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: msghdr and its control message are built in buffers that outlive the call; the
    // control buffer (64 bytes) holds CMSG_SPACE(4) (24 bytes on Linux).
    let sent = unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) as usize;
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        libc::sendmsg(c.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    match sent {
        8 => Ok(()),
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n => Err(std::io::Error::other(format!("sent {n} of 8 bytes"))),
    }
}

/// Receives an 8-byte length and exactly one fd (any other fds that came are closed).
fn recv_fd(c: &UnixStream) -> std::io::Result<(u64, OwnedFd)> {
    let mut bytes = [0u8; 8];
    let mut iov = libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: bytes.len() };
    let mut control = [0u64; 32];
    // SAFETY: as in send_fd; every fd the kernel installed is taken into an OwnedFd below.
    let (n, mut fds, truncated) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        let n = libc::recvmsg(c.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        let mut fds: Vec<OwnedFd> = Vec::new();
        if n >= 0 {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg);
                    let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        (n, fds, msg.msg_flags & libc::MSG_CTRUNC != 0)
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the exporter closed the connection"));
    }
    if n != 8 || truncated || fds.len() != 1 {
        return Err(std::io::Error::other(format!("malformed chunk message ({n} bytes, {} fds, truncated {truncated})", fds.len())));
    }
    let fd = fds.pop().expect("one fd");
    Ok((u64::from_le_bytes(bytes), fd))
}

/// The whole fetch of one offer (connect, token, every chunk) ends within this: it runs on the
/// thread that prepares a transfer, holding the peer's mappings.
const FETCH_LIMIT: Duration = Duration::from_secs(10);

/// Why a fetch failed: the exporter's definite answer (or a listener that is not the
/// exporter), remembered for the region; or trouble on the way (timeout, connection
/// closed, the exporter busy), tried again at the next transfer.
#[derive(Debug)]
pub(crate) enum FetchError {
    Refused(String),
    Transient(String),
}

impl From<String> for FetchError {
    fn from(m: String) -> Self {
        FetchError::Refused(m)
    }
}

#[cfg(test)]
impl FetchError {
    fn message(&self) -> &str {
        match self {
            FetchError::Refused(m) | FetchError::Transient(m) => m,
        }
    }
}

/// A connection to an exporter that has sent its header: `count` chunks of `total` bytes.
struct Fetch {
    c: UnixStream,
    deadline: Instant,
    count: usize,
    total: u64,
}

/// Sets the socket's timeouts to what is left before `deadline` (none left: `TimedOut`).
fn until(c: &UnixStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the fetch took longer than its time limit"));
    }
    c.set_read_timeout(Some(left))?;
    c.set_write_timeout(Some(left))
}

/// Connects to `path` without blocking past `deadline`: a full listen queue (`EAGAIN`, which
/// any local process can cause) is retried until then, not waited on without limit.
fn connect_within(path: &Path, deadline: Instant) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd of ours.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        // SAFETY: addr is a valid sockaddr_un of the given size.
        let r = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the exporter's socket accepted no connection in time (listen queue full)",
                    ));
                }
                std::thread::sleep(left.min(Duration::from_millis(20)));
            }
            Some(libc::EINPROGRESS) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                // SAFETY: one valid pollfd.
                let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
                if n <= 0 {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connecting to the exporter's socket timed out"));
                }
                let mut err: libc::c_int = 0;
                let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: reads one c_int into err.
                unsafe {
                    libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut libc::c_int).cast(), &mut len)
                };
                if err != 0 {
                    return Err(std::io::Error::from_raw_os_error(err));
                }
                break;
            }
            _ => return Err(e),
        }
    }
    let c = UnixStream::from(sock);
    c.set_nonblocking(false)?;
    Ok(c)
}

/// The pid of the process at the other end of `c`, as this process's pid namespace sees it
/// (0: the kernel could not translate it, the process is in a pid namespace we cannot see).
fn peer_pid(c: &UnixStream) -> std::io::Result<i32> {
    // SAFETY: ucred is plain data.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: reads one ucred into cred.
    let r =
        unsafe { libc::getsockopt(c.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid)
}

/// Connects to the exporter named by `handle`, checks that the listener is the exporter's
/// process, presents the token and reads the header, all before `deadline`.
fn open_fetch(handle: &[u8; 64], deadline: Instant) -> Result<Fetch, FetchError> {
    let pid = u32::from_le_bytes(handle[4..8].try_into().expect("4 bytes"));
    let nonce = u64::from_le_bytes(handle[8..16].try_into().expect("8 bytes"));
    let path = socket_path(pid, nonce);
    let io = |e: std::io::Error| FetchError::Transient(format!("CUDA VMM file descriptors from {}: {e}", path.display()));
    check_dir(&path).map_err(FetchError::Refused)?;
    let mut c = connect_within(&path, deadline).map_err(io)?;
    // The token goes only to the exporter's process: a listener another process bound at
    // this name (the exporter removed it, or the two sides use different directories) would
    // replay it to the real socket.
    match peer_pid(&c).map_err(io)? {
        p if p == pid as i32 => {}
        0 => {
            return Err(FetchError::Refused(format!(
                "{}: the listener's process is in a pid namespace this process cannot see, so it cannot be checked to be the exporter (pid {pid}); share the pid namespace to use CUDA VMM IPC",
                path.display()
            )))
        }
        p => return Err(FetchError::Refused(format!("{}: the listener is process {p}, not the exporter (pid {pid}): token withheld", path.display()))),
    }
    until(&c, deadline).map_err(io)?;
    c.write_all(&handle[16..48]).map_err(io)?;
    let mut status = [0u8; 1];
    until(&c, deadline).map_err(io)?;
    c.read_exact(&mut status).map_err(io)?;
    if status[0] != 0 {
        let mut n = [0u8; 2];
        until(&c, deadline).map_err(io)?;
        c.read_exact(&mut n).map_err(io)?;
        let mut msg = vec![0u8; u16::from_le_bytes(n) as usize];
        until(&c, deadline).map_err(io)?;
        c.read_exact(&mut msg).map_err(io)?;
        return Err(FetchError::Refused(format!("the exporter refused: {}", String::from_utf8_lossy(&msg))));
    }
    let mut head = [0u8; 12];
    until(&c, deadline).map_err(io)?;
    c.read_exact(&mut head).map_err(io)?;
    let count = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
    let total = u64::from_le_bytes(head[4..].try_into().expect("8 bytes"));
    Ok(Fetch { c, deadline, count, total })
}

impl Fetch {
    /// The next chunk's length and fd, received before the deadline.
    fn next(&self) -> std::io::Result<(u64, OwnedFd)> {
        until(&self.c, self.deadline)?;
        recv_fd(&self.c)
    }
}

/// Fetches the chunks a VMM offer `handle` names and maps them on `gpu` (the local buffer's
/// device; `home` is the local ordinal of the exporter's GPU): one reserved range of exactly
/// `claimed` bytes (what the exporter's `IpcHandles` said). Undone on any error; the whole
/// fetch ends within [`FETCH_LIMIT`].
pub(crate) fn fetch_and_map(gpu: &Gpu, handle: &[u8; 64], claimed: u64, home: i32) -> Result<DevicePtr, FetchError> {
    fetch_and_map_within(gpu, handle, claimed, home, Instant::now() + FETCH_LIMIT)
}

fn fetch_and_map_within(gpu: &Gpu, handle: &[u8; 64], claimed: u64, home: i32, deadline: Instant) -> Result<DevicePtr, FetchError> {
    let pid = u32::from_le_bytes(handle[4..8].try_into().expect("4 bytes"));
    if pid == std::process::id() {
        return Err(FetchError::Refused(
            "the VMM memory is this process's own (agents in one process stage, as CUDA IPC needs two processes)".into(),
        ));
    }
    let f = open_fetch(handle, deadline)?;
    let (count, total) = (f.count, f.total);
    if total != claimed || count == 0 || count > MAX_CHUNKS {
        return Err(FetchError::Refused(format!(
            "the exporter offers {count} chunks of {total} bytes in all, but claimed an allocation of {claimed} bytes"
        )));
    }
    let len = usize::try_from(total).map_err(|_| FetchError::Refused("allocation too large".to_string()))?;
    let base = gpu.vmm_reserve(len).map_err(|e| FetchError::Refused(format!("cannot reserve {len} bytes: {e}")))?;
    let mapped = map_chunks(gpu, &f, base).and_then(|_| {
        // SAFETY: every byte of the reservation was mapped by map_chunks.
        unsafe { gpu.vmm_commit(base, len, home) }.map_err(|e| FetchError::Refused(format!("cannot give GPU {} access: {e}", gpu.id())))
    });
    if let Err(why) = mapped {
        // SAFETY: our reservation, used by no copy yet.
        let _ = unsafe { gpu.ipc_close(base) };
        return Err(why);
    }
    Ok(base)
}

/// Receives the chunks of `f` and maps each in turn after the one before, filling its total.
fn map_chunks(gpu: &Gpu, f: &Fetch, base: DevicePtr) -> Result<(), FetchError> {
    let (count, total) = (f.count, f.total);
    let mut off = 0u64;
    for i in 0..count {
        // The token is used up: a chunk that did not come cannot be asked for again, but a
        // new IpcReq gets a new token, so the next transfer tries again.
        let (len, fd) = f.next().map_err(|e| FetchError::Transient(format!("chunk {i} of {count}: {e}")))?;
        let end = off.checked_add(len).filter(|e| *e <= total && len > 0);
        let (Some(end), Ok(n)) = (end, usize::try_from(len)) else {
            return Err(FetchError::Refused(format!("chunk {i} ({len} bytes at {off}) does not fit the {total} bytes claimed")));
        };
        // SAFETY: inside our reservation (checked), where nothing is mapped yet (chunks are
        // placed one after another).
        unsafe { gpu.vmm_map(base, off, n, fd.as_fd()) }.map_err(|e| FetchError::Refused(format!("chunk {i} of {count}: {e}")))?;
        off = end;
    }
    if off != total {
        return Err(FetchError::Refused(format!("the chunks cover {off} of the {total} bytes claimed")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_gpu::standin::StandInAlloc;
    use multirail_gpu::{StandIn, StandInConfig};

    /// A token for another offer, a used token and a withdrawn one get no fd; the right one
    /// gets the region's chunks once, and they map the same memory.
    #[test]
    fn only_the_offered_token_gets_the_fds_and_only_once() {
        let dev = StandIn::new(43, StandInConfig::default());
        let gpu = Gpu::StandIn(dev.clone());
        let p = dev.alloc_as(3 * 65536, StandInAlloc::Vmm { chunk: 65536, posix_fd: true }).unwrap();
        let chunks = gpu.vmm_chunks(p, 3 * 65536).unwrap();
        assert_eq!(chunks.len(), 3);
        let owner = 0x5eed;
        let h = offer(owner, 1, gpu.clone(), chunks.clone(), Duration::from_secs(30)).unwrap();
        let other = offer(owner, 2, gpu.clone(), chunks[..1].to_vec(), Duration::from_secs(30)).unwrap();
        // Keeps the socket listening until the end (it closes when no offer is left).
        let _keep = offer(owner, 3, gpu.clone(), chunks[..1].to_vec(), Duration::from_secs(30)).unwrap();
        // A forged token: refused, nothing mapped.
        let mut forged = h;
        forged[20] ^= 1;
        let e = fetch_raw(&forged).unwrap_err();
        assert!(e.contains("token is unknown"), "{e}");
        // The right token: three chunks, each an fd.
        let got = fetch_raw(&h).unwrap();
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), vec![65536; 3]);
        // Used: refused.
        assert!(fetch_raw(&h).unwrap_err().contains("unknown, used or expired"));
        // Withdrawn (the region was deregistered): refused.
        withdraw(owner, Some(&[2]));
        assert!(fetch_raw(&other).unwrap_err().contains("unknown, used or expired"));
        withdraw(owner, None);
        // The fds map the exporter's memory.
        // SAFETY: stand-in memory is host memory of 3 chunks.
        unsafe { *(p.0 as *mut u8).add(65536 + 7) = 42 };
        // SAFETY: a fresh shared mapping of the second chunk's memfd.
        let m = unsafe { libc::mmap(std::ptr::null_mut(), 65536, libc::PROT_READ, libc::MAP_SHARED, got[1].1.as_raw_fd(), 0) };
        assert_ne!(m, libc::MAP_FAILED);
        // SAFETY: mapped above, 65536 bytes.
        assert_eq!(unsafe { *(m as *const u8).add(7) }, 42);
        // SAFETY: unmapped once; the allocation is not used any more.
        unsafe {
            libc::munmap(m, 65536);
            dev.free(p).unwrap();
        }
    }

    /// An offer past its time gives no fd, while a live one of the same exporter still does.
    #[test]
    fn an_expired_offer_gives_no_fd() {
        let dev = StandIn::new(45, StandInConfig::default());
        let gpu = Gpu::StandIn(dev.clone());
        let p = dev.alloc_as(65536, StandInAlloc::Vmm { chunk: 65536, posix_fd: true }).unwrap();
        let chunks = gpu.vmm_chunks(p, 65536).unwrap();
        let owner = 0xe8e8;
        let short = offer(owner, 1, gpu.clone(), chunks.clone(), Duration::from_millis(50)).unwrap();
        let live = offer(owner, 2, gpu.clone(), chunks.clone(), Duration::from_secs(30)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let expired = fetch_raw(&short);
        let got = fetch_raw(&live);
        withdraw(owner, None);
        assert!(expired.unwrap_err().contains("unknown, used or expired"));
        assert_eq!(got.unwrap().len(), 1);
        // SAFETY: not used any more.
        unsafe { dev.free(p).unwrap() };
    }

    /// A directory others can write is refused unless it has the sticky bit.
    #[test]
    fn a_socket_dir_others_can_write_needs_the_sticky_bit() {
        let dir = std::env::temp_dir().join(format!("mr-ipcdir-{:016x}", u64::from_le_bytes(crate::registry::random_bytes())));
        std::fs::create_dir(&dir).unwrap();
        let sock = dir.join("x.sock");
        let mut verdicts = Vec::new();
        for mode in [0o777, 0o1777, 0o700, 0o775] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            verdicts.push(check_dir(&sock).is_ok());
        }
        std::fs::remove_dir(&dir).unwrap();
        assert_eq!(verdicts, vec![false, true, true, false]);
    }

    /// A handle naming socket `nonce` of this process, with a token no offer has.
    fn handle_for(nonce: u64) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[..4].copy_from_slice(MAGIC);
        h[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        h[8..16].copy_from_slice(&nonce.to_le_bytes());
        h
    }

    /// A listener whose queue is full and that never accepts: the fetch gives up by its
    /// deadline (it used to block in `connect` for good, on the thread preparing a transfer).
    #[test]
    fn a_full_listen_queue_does_not_hang_the_fetch() {
        let nonce = u64::from_le_bytes(crate::registry::random_bytes());
        let path = socket_path(std::process::id(), nonce);
        let l = UnixListener::bind(&path).unwrap();
        // SAFETY: a listening socket of ours; a backlog of 0 queues one connection.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let mut queued = Vec::new();
        let mut full = false;
        for _ in 0..8 {
            match connect_within(&path, Instant::now() + Duration::from_millis(100)) {
                Ok(c) => queued.push(c),
                Err(_) => {
                    full = true;
                    break;
                }
            }
        }
        assert!(full, "the listen queue never filled");
        let h = handle_for(nonce);
        let (tx, rx) = std::sync::mpsc::channel();
        let started = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(open_fetch(&h, Instant::now() + Duration::from_secs(1)).map(|_| ()));
        });
        let got = rx.recv_timeout(Duration::from_secs(15));
        let _ = std::fs::remove_file(&path);
        let e = got.expect("the fetch hung on a full listen queue").unwrap_err();
        assert!(matches!(e, FetchError::Transient(_)), "{e:?}");
        assert!(e.message().contains("listen queue full"), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        drop((queued, l));
    }

    /// Local processes that connect and send nothing do not keep the real importer out: it
    /// gets its fds (they used to be served one at a time, 2 s each, past the fetch's limit).
    #[test]
    fn idle_connections_do_not_starve_the_importer() {
        let dev = StandIn::new(44, StandInConfig::default());
        let gpu = Gpu::StandIn(dev.clone());
        let p = dev.alloc_as(65536, StandInAlloc::Vmm { chunk: 65536, posix_fd: true }).unwrap();
        let chunks = gpu.vmm_chunks(p, 65536).unwrap();
        let owner = 0x1d1e;
        let h = offer(owner, 1, gpu.clone(), chunks.clone(), Duration::from_secs(30)).unwrap();
        let nonce = u64::from_le_bytes(h[8..16].try_into().unwrap());
        let path = socket_path(std::process::id(), nonce);
        let idle: Vec<UnixStream> = (0..6).map(|_| connect_within(&path, Instant::now() + Duration::from_secs(5)).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(300));
        let f = open_fetch(&h, Instant::now() + Duration::from_secs(8)).map_err(|e| e.message().to_string());
        let got: Result<Vec<_>, String> = f.and_then(|f| (0..f.count).map(|_| f.next().map_err(|e| e.to_string())).collect());
        drop(idle);
        withdraw(owner, None);
        assert_eq!(got.unwrap().len(), 1);
        // SAFETY: not used any more.
        unsafe { dev.free(p).unwrap() };
    }

    /// A listener another process bound at the exporter's name (here after the exporter is
    /// gone) is refused before it gets the token.
    #[test]
    fn a_listener_that_is_not_the_exporter_gets_no_token() {
        let nonce = u64::from_le_bytes(crate::registry::random_bytes());
        let path = socket_path(std::process::id(), nonce);
        let script = format!(
            "import socket,time,sys\ns=socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen(4)\nc,_=s.accept()\nd=c.recv(64)\nsys.stdout.write('GOT%d' % len(d))\nsys.stdout.flush()\ntime.sleep(5)\n",
            path.to_str().unwrap()
        );
        let Ok(mut child) = std::process::Command::new("python3").arg("-c").arg(&script).stdout(std::process::Stdio::piped()).spawn()
        else {
            eprintln!("skipped: no python3 to play the impostor");
            return;
        };
        let t0 = Instant::now();
        while !path.exists() && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let got = open_fetch(&handle_for(nonce), Instant::now() + Duration::from_secs(3));
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let _ = std::fs::remove_file(&path);
        let e = got.map(|_| ()).unwrap_err();
        assert!(matches!(e, FetchError::Refused(_)), "{e:?}");
        assert!(e.message().contains("not the exporter"), "{e:?}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("GOT32"), "the impostor received the token");
    }

    /// The importer's side without mapping (a test in one process: `fetch_and_map` refuses
    /// the process's own memory): the lengths and fds received.
    fn fetch_raw(handle: &[u8; 64]) -> Result<Vec<(u64, OwnedFd)>, String> {
        let f = open_fetch(handle, Instant::now() + FETCH_LIMIT).map_err(|e| e.message().to_string())?;
        (0..f.count).map(|_| f.next().map_err(|e| e.to_string())).collect()
    }
}
