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
//!   offers are pending and removed when none is left. Each connection is served with a 2 s
//!   read and write timeout, one at a time.
//!
//! Wire format on the socket: the importer writes the token (32 bytes); the exporter answers
//! one status byte: 1 and a `u16`-length message (refused), or 0, then the chunk count (`u32`),
//! the total length (`u64`), and per chunk an 8-byte length with its fd attached.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use multirail_gpu::{Device, DevicePtr, Gpu};

/// First bytes of a VMM "handle" in `IpcEntry::handle` (a legacy CUDA IPC handle never starts so).
const MAGIC: &[u8; 4] = b"MRVM";
/// Read and write timeout on the fd socket, per operation.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
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
            // A failed answer ends its connection: the importer names its own reason.
            Ok((c, _)) => drop(answer(c, nonce)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One importer: its token, then the chunks of the offer it names, or a refusal.
fn answer(mut c: UnixStream, nonce: u64) -> std::io::Result<()> {
    c.set_nonblocking(false)?;
    c.set_read_timeout(Some(IO_TIMEOUT))?;
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

/// Fetches the chunks a VMM offer `handle` names and maps them on `gpu` (the local buffer's
/// device; `home` is the local ordinal of the exporter's GPU): one reserved range of exactly
/// `claimed` bytes (what the exporter's `IpcHandles` said). Undone on any error.
pub(crate) fn fetch_and_map(gpu: &Gpu, handle: &[u8; 64], claimed: u64, home: i32) -> Result<DevicePtr, String> {
    let pid = u32::from_le_bytes(handle[4..8].try_into().expect("4 bytes"));
    let nonce = u64::from_le_bytes(handle[8..16].try_into().expect("8 bytes"));
    if pid == std::process::id() {
        return Err("the VMM memory is this process's own (agents in one process stage, as CUDA IPC needs two processes)".into());
    }
    let path = socket_path(pid, nonce);
    let io = |e: std::io::Error| format!("CUDA VMM file descriptors from {}: {e}", path.display());
    let mut c = UnixStream::connect(&path).map_err(io)?;
    c.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    c.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    c.write_all(&handle[16..48]).map_err(io)?;
    let mut status = [0u8; 1];
    c.read_exact(&mut status).map_err(io)?;
    if status[0] != 0 {
        let mut n = [0u8; 2];
        c.read_exact(&mut n).map_err(io)?;
        let mut msg = vec![0u8; u16::from_le_bytes(n) as usize];
        c.read_exact(&mut msg).map_err(io)?;
        return Err(format!("the exporter refused: {}", String::from_utf8_lossy(&msg)));
    }
    let mut head = [0u8; 12];
    c.read_exact(&mut head).map_err(io)?;
    let count = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
    let total = u64::from_le_bytes(head[4..].try_into().expect("8 bytes"));
    if total != claimed || count == 0 || count > MAX_CHUNKS {
        return Err(format!("the exporter offers {count} chunks of {total} bytes in all, but claimed an allocation of {claimed} bytes"));
    }
    let len = usize::try_from(total).map_err(|_| "allocation too large".to_string())?;
    let base = gpu.vmm_reserve(len).map_err(|e| format!("cannot reserve {len} bytes: {e}"))?;
    let mapped = map_chunks(gpu, &c, base, count, total).and_then(|_| {
        // SAFETY: every byte of the reservation was mapped by map_chunks.
        unsafe { gpu.vmm_commit(base, len, home) }.map_err(|e| format!("cannot give GPU {} access: {e}", gpu.id()))
    });
    if let Err(why) = mapped {
        // SAFETY: our reservation, used by no copy yet.
        let _ = unsafe { gpu.ipc_close(base) };
        return Err(why);
    }
    Ok(base)
}

/// Receives `count` chunks and maps each in turn after the one before, filling `total` bytes.
fn map_chunks(gpu: &Gpu, c: &UnixStream, base: DevicePtr, count: usize, total: u64) -> Result<(), String> {
    let mut off = 0u64;
    for i in 0..count {
        let (len, fd) = recv_fd(c).map_err(|e| format!("chunk {i} of {count}: {e}"))?;
        let end = off.checked_add(len).filter(|e| *e <= total && len > 0);
        let (Some(end), Ok(n)) = (end, usize::try_from(len)) else {
            return Err(format!("chunk {i} ({len} bytes at {off}) does not fit the {total} bytes claimed"));
        };
        // SAFETY: inside our reservation (checked), where nothing is mapped yet (chunks are
        // placed one after another).
        unsafe { gpu.vmm_map(base, off, n, fd.as_fd()) }.map_err(|e| format!("chunk {i} of {count}: {e}"))?;
        off = end;
    }
    if off != total {
        return Err(format!("the chunks cover {off} of the {total} bytes claimed"));
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

    /// The importer's side without mapping (a test in one process: `fetch_and_map` refuses
    /// the process's own memory): the lengths and fds received.
    fn fetch_raw(handle: &[u8; 64]) -> Result<Vec<(u64, OwnedFd)>, String> {
        let nonce = u64::from_le_bytes(handle[8..16].try_into().unwrap());
        let mut c = UnixStream::connect(socket_path(std::process::id(), nonce)).map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        c.write_all(&handle[16..48]).unwrap();
        let mut status = [0u8; 1];
        c.read_exact(&mut status).map_err(|e| e.to_string())?;
        if status[0] != 0 {
            let mut n = [0u8; 2];
            c.read_exact(&mut n).unwrap();
            let mut msg = vec![0u8; u16::from_le_bytes(n) as usize];
            c.read_exact(&mut msg).unwrap();
            return Err(String::from_utf8_lossy(&msg).into_owned());
        }
        let mut head = [0u8; 12];
        c.read_exact(&mut head).unwrap();
        let count = u32::from_le_bytes(head[..4].try_into().unwrap());
        (0..count).map(|_| recv_fd(&c).map_err(|e| e.to_string())).collect()
    }
}
